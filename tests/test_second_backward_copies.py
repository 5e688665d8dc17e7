"""Ghost's second backward makes its own copies of values both backwards read (second_backward_copies)."""
import torch
import torch.fx as fx

from dpcompile.buffer_reuse import PHASE_KEY, SECOND_BACKWARD, mark_second_backward
from dpcompile.second_backward_copies import copy_shared_values_into_second_backward

aten = torch.ops.aten


def _node(g, target, args, shape, second=False):
    n = g.call_function(target, args)
    n.meta["val"] = torch.empty(shape)
    if second:
        mark_second_backward(n)
    return n


def test_shared_constant_and_pointwise_chain_are_made_again_for_the_second_backward():
    # a zeros constant both backwards read (the rotary backward's on a GPU) once raised a KeyError: an empty
    # chain had no copy of its root
    shape = [256, 256]
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(shape)
    zeros = _node(g, aten.full.default, (shape, 0.0), shape)
    act = _node(g, aten.relu.default, (x,), shape)
    first = _node(g, aten.add.Tensor, (_node(g, aten.add.Tensor, (x, zeros), shape), act), shape)
    second = _node(g, aten.mul.Tensor, (_node(g, aten.mul.Tensor, (x, zeros), shape, second=True), act), shape,
                   second=True)
    g.output((first, second))
    gm = fx.GraphModule({}, g)
    x_val = torch.randn(shape)
    want = gm(x_val)
    counters = {}
    assert copy_shared_values_into_second_backward(gm, counters) == 2
    assert counters["second_backward_pointwise_copies"] == 2
    for n in gm.graph.nodes:
        if n.meta.get(PHASE_KEY) == SECOND_BACKWARD:  # the second backward reads only its own copies
            assert zeros not in n.all_input_nodes and act not in n.all_input_nodes, n.format_node()
    got = gm(x_val)
    torch.testing.assert_close(got, want)
