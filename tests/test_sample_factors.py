"""passes.sample_factors.sample_major: samples first as [B, S, F], in one reshape where the elements' order allows."""
import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from dpcompile.fx_utils import GraphBuilder
from dpcompile.passes.batch_state import Batched
from dpcompile.passes.sample_factors import sample_major

aten = torch.ops.aten
B, T, F = 3, 5, 4


def _graph(f, *args):
    gm = make_fx(f, tracing_mode="fake")(*args)
    (out,) = gm.graph.find_nodes(op="output")
    return gm, out.args[0][0]


def _run(gm, node, lay, feats, *args):
    """sample_major of ``node`` appended to gm's graph and returned as its output; gm's result on args."""
    b = GraphBuilder(gm.graph)
    (out,) = gm.graph.find_nodes(op="output")
    with gm.graph.inserting_before(out):
        r = sample_major(b, node, lay, feats, B)
    out.args = ((r,),)
    gm.graph.lint()
    gm.recompile()
    return r, gm(*args)[0]


def _chain(r):
    ops = []
    while isinstance(r, fx.Node) and r.op == "call_function":
        ops.append(r.target)
        r = r.args[0]
    return ops


@pytest.mark.parametrize("transposed", ["no", "t", "transpose", "permute"])
def test_rows_in_memory_order_are_one_reshape_of_the_value_or_of_what_it_transposes(transposed):
    # a Linear's input [B*T, F] (samples outside the rows), as the weight gradient's mm reads it: transposed
    h = torch.randn(B * T, F)
    how = {"no": lambda v: v, "t": lambda v: v.t(), "transpose": lambda v: v.transpose(-1, 0),
           "permute": lambda v: v.permute(1, 0)}[transposed]
    gm, node = _graph(lambda h: [how(h * 2)], h)
    if transposed == "permute":
        assert node.target is aten.permute.default
    r, got = _run(gm, node, Batched(0 if transposed == "no" else 1, 1, T), [1 if transposed == "no" else 0], h)
    assert _chain(r)[0] is aten.reshape.default and r.args[0].target is aten.mul.Tensor, gm.graph
    torch.testing.assert_close(got, (h * 2).view(B, T, F))


def test_samples_inside_the_rows_are_permuted_first():
    # sequence-first [T, B, F]: samples inside the rows, no reshape keeps the order; the old chain, copied
    h = torch.randn(T, B, F)
    gm, node = _graph(lambda h: [h * 2], h)
    r, got = _run(gm, node, Batched(1, 1, 1), [2], h)
    assert aten.permute.default in _chain(r), gm.graph
    torch.testing.assert_close(got, (h * 2).permute(1, 0, 2).reshape(B, T, F))


def test_a_transpose_that_breaks_the_order_is_not_looked_through():
    # x = y.t() with y [F, B*T]: x's rows are y's columns, so no reshape of y gives them in order; x's own
    # reshape does (it copies, as eagerly)
    y = torch.randn(F, B * T)
    gm, node = _graph(lambda y: [(y * 2).t()], y)
    r, got = _run(gm, node, Batched(0, 1, T), [1], y)
    assert r.target is aten.reshape.default and r.args[0] is node, gm.graph
    torch.testing.assert_close(got, (y * 2).t().reshape(B, T, F))
