"""passes.mutated_input_reads: an input the step mutates is read, in the backward too, as it was before."""
import collections
import copy
import types

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

import models as M
from dpcompile.passes.cleanup import finalize
from dpcompile.passes.mutated_input_reads import COUNTER, mutated_input_reads_pass
from helpers import compile_step

aten = torch.ops.aten


def _joint_with_a_mutated_buffer():
    """primals_1 a weight, primals_2 a buffer the forward reads and then updates (copy_ at the end, as AOTAutograd
    writes input mutations), tangents_1; a forward op reading the buffer through a view, and a backward op that
    reads it (through another view) with the tangent."""
    g = fx.Graph()
    w, buf, tangent = (g.placeholder(n) for n in ("primals_1", "primals_2", "tangents_1"))
    for n, v in ((w, torch.randn(4)), (buf, torch.randn(4)), (tangent, torch.randn(4))):
        n.meta["val"] = v
    read = g.call_function(aten.mul.Tensor, (w, g.call_function(aten.view.default, (buf, [4]))))
    grad = g.call_function(aten.mul.Tensor, (tangent, g.call_function(aten.view.default, (buf, [2, 2]))))
    update = g.call_function(aten.copy_.default, (buf, g.call_function(aten.add.Tensor, (buf, 1.0))))
    g.output((read, grad, update))
    return fx.GraphModule(torch.nn.Module(), g), read, grad


def test_forward_reads_are_saved_and_backward_reads_see_a_copy_taken_before_the_update():
    gm, read, grad = _joint_with_a_mutated_buffer()
    ctx = types.SimpleNamespace(counters=collections.Counter())
    gm = finalize(mutated_input_reads_pass(gm, ctx))  # (finalize orders the rebuilt nodes and lints, as in backend)
    assert read.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    # the add that feeds the copy_ reads the buffer in the forward too: saved where the backward needs it
    adds = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert adds[0].meta["recompute"] is CheckpointPolicy.MUST_SAVE
    view = grad.args[1]
    assert view.target is aten.view.default and view.args[0].target is aten.clone.default, grad.args
    clone = view.args[0]
    assert clone.args[0].name == "primals_2" and clone.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    assert ctx.counters[COUNTER] == 3  # two reads pinned, one copy


def test_a_graph_without_mutated_inputs_is_left_alone():
    g = fx.Graph()
    x = g.placeholder("primals_1")
    x.meta["val"] = torch.randn(3)
    y = g.call_function(aten.mul.Tensor, (x, x))
    g.output((y,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    ctx = types.SimpleNamespace(counters=collections.Counter())
    mutated_input_reads_pass(gm, ctx)
    assert "recompute" not in y.meta and not ctx.counters


def test_spectral_norm_weight_gradient_without_clipping_equals_eager():
    """C far above every norm, no noise: the DP step's gradient is the plain one, which torch 2.13's
    torch.compile(backend="inductor") gets wrong for this model (pytorch/pytorch#197039)."""
    torch.manual_seed(0)
    model = M.SpectralNormNet()
    x, y = torch.randn(4, 5, 4), torch.randn(4, 5, 3)
    eager = copy.deepcopy(model)
    M.mse(eager(x), y).mean().backward()
    step, backend = compile_step(model, M.mse, max_grad_norm=1e9, noise_multiplier=0.0, expected_batch_size=4,
                                 schedule="bk")
    step((x,), (y,))
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters[COUNTER] >= 1, record.counters
    # and the buffers were updated once, as eager's
    for (name, b), e in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, e, msg=lambda m: f"{name}: {m}")
