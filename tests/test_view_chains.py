"""passes.view_chains: a chain of views that is a row-major view of a contiguous tensor becomes one view of it."""
import collections
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dpcompile.passes.view_chains import view_chains_pass

B, T, F = 3, 5, 4


def _ctx():
    return types.SimpleNamespace(counters=collections.Counter())


def _rewritten(f, *args, tracing_mode="symbolic"):
    gm = make_fx(f, tracing_mode=tracing_mode)(*args)
    ctx = _ctx()
    out = view_chains_pass(gm, ctx)
    return out, ctx.counters["view_chains_collapsed"]


def sample_major_rows(h):
    """What per_sample_norms does with an activation on its way to the Gram kernel: [B, T, F] flattened to
    [B*T, F] (the layer's input), split as [1, B, T, F], samples first, [B, T, F]."""
    b = h.shape[0]
    g = torch.nn.functional.gelu(h)
    flat = g.view(b * T, F)
    x = flat.view(1, b, T, F).permute(1, 0, 2, 3).reshape(b, T, F)
    return (x * 2).sum(2) + flat.sum()


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_a_permute_of_a_size_one_dim_is_read_as_the_value_itself(tracing_mode):
    h = torch.randn(B, T, F)
    gm, n = _rewritten(sample_major_rows, h, tracing_mode=tracing_mode)
    assert n == 1
    (mul,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)
    assert mul.args[0].target is torch.ops.aten.gelu.default, gm.code  # the chain's end is gelu(h) itself
    torch.testing.assert_close(gm(h), sample_major_rows(h), rtol=0, atol=0)


def transposed_twice(a):
    """A transpose (an mm's A operand) split and transposed back: row-major again, a view of a."""
    b = a.shape[0]
    at = a.view(b * T, F).t()  # [F, B*T]
    x = at.view(F, 1, b, T).permute(2, 1, 3, 0).reshape(b, T * F)
    return x.exp().sum(1)


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_a_transpose_undone_by_a_permute_is_a_view_of_the_contiguous_source(tracing_mode):
    a = torch.randn(B, T, F)
    gm, n = _rewritten(transposed_twice, a, tracing_mode=tracing_mode)
    assert n == 1
    (exp,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.exp.default)
    view = exp.args[0]
    assert view.target is torch.ops.aten.view.default and view.args[0].op == "placeholder", gm.code
    torch.testing.assert_close(gm(a), transposed_twice(a), rtol=0, atol=0)


def transposed(a):
    return a.t().unsqueeze(0).exp()


def copied(a):
    return a.t().reshape(-1).view(F, B * T).exp()  # reshape of a transpose copies: another storage


def sliced(a):
    return a[1:].view(-1).exp()  # same storage, another offset and size


@pytest.mark.parametrize("f", [transposed, copied, sliced])
def test_chains_that_are_not_a_row_major_view_of_their_source_stay(f):
    """Nothing reads the input through one view: what reads it is a transpose, a copy or a slice."""
    a = torch.randn(B * T, F)
    gm, _ = _rewritten(f, a, tracing_mode="fake")
    (x,) = gm.graph.find_nodes(op="placeholder")
    assert all(u.target is not torch.ops.aten.view.default for u in x.users), gm.code
    torch.testing.assert_close(gm(a), f(a), rtol=0, atol=0)


def view_returned(h):
    return h.view(1, B * T, F).permute(1, 0, 2).view(B, T, F)


def test_a_graph_output_keeps_its_node():
    h = torch.randn(B * T, F)
    gm, n = _rewritten(view_returned, h, tracing_mode="fake")
    assert n == 0
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][-1] is torch.ops.aten.view.default


def _unbacked_gpt_step(**options):
    """A two-block GPT's bk step with its batch marked unbacked (a sharded step's; one process here), exact
    against the oracle; its DP record."""
    import models as M
    from helpers import check_against_reference

    import dpcompile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = M.GPT(vocab=32, d=16, n_head=2, n_layer=2, max_t=8)
    ids, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    dpcompile.mark_batch(ids, y)
    backend = check_against_reference(model, M.seq_ce, (ids,), (y,), schedule="bk", linear_norm="ghost", **options)
    (rec,) = [r for r in backend.compiled if r.dp]
    return rec


@pytest.mark.parametrize("passes_off", [(), ("view_chains",)])
def test_an_unbacked_step_reads_its_gram_operands_as_views_of_their_values(tmp_path, passes_off):
    """A step with an unbacked batch size: the Gram kernels read their operands as one view of a value the
    backward holds (Inductor made a copy of each chain, on CUDA a second GELU per layer), and the gradients
    stay exact. With the pass off the chains are there (what the test would see if the pass did nothing)."""
    import re

    rec = _unbacked_gpt_step(dump_dir=str(tmp_path), disable_passes=list(passes_off))
    (bw,) = tmp_path.rglob("*_backward.py")
    code = bw.read_text()
    defined = dict(re.findall(r"^\s*(\w+): \"[^\"]*\" = torch\.ops\.(\S+?)\(", code, re.M))
    operands = [a for args in re.findall(r"gram_sq_norms\.default\((\w+), (\w+)\)", code) for a in args]
    for lists in re.findall(r"gram_sq_norms_group\.default\((\[[^]]*\]), (\[[^]]*\])\)", code):  # bk: in one call
        operands += [a for part in lists for a in re.findall(r"\w+", part)]
    assert len(operands) >= 2 * 4, code  # the blocks' four linears at least
    chains = [a for a in operands if defined.get(a, "").startswith(("aten.permute", "aten.reshape"))]
    if passes_off:
        assert chains and not rec.counters.get("view_chains_collapsed")
    else:
        assert not chains, chains
        assert rec.counters["view_chains_collapsed"] >= len(operands) // 2


def test_an_eagerly_run_step_keeps_its_chains():
    """compiler="eager" runs the graph op by op, where an op's real strides need not be its fake value's (a CUDA
    kernel may lay its output out otherwise): the pass, which rests on the fake strides, does not run there."""
    rec = _unbacked_gpt_step(compiler="eager")
    assert "view_chains_collapsed" not in rec.counters, rec.counters


def test_only_splits_and_merges_of_dims_are_read_as_one_view():
    """A reshape that both splits a dim and merges it with the next (HF Swin's window partition under an
    unbacked batch size) stays a chain: Inductor's reshape indexer guards on such a symbolic size."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dpcompile.passes.view_chains import splits_or_merges

    u = ShapeEnv().create_unbacked_symint()
    assert splits_or_merges([u, 4, 4, 2, 2, 8], [u, 64, 8])  # merges
    assert splits_or_merges([64 * u, 3072], [u, 64, 3072])  # a split
    assert splits_or_merges([u, 16, 1, 1], [u, 1, 16])  # dims of one anywhere
    assert not splits_or_merges([16 * u, 4, 2, 4], [u, 64, 8])  # 16*u0 split, its 16 merged with the 4
    assert not splits_or_merges([2, 3, 4], [3, 8])
