"""Contractions with unaligned static sizes are zero-padded after the dp rewrite, and stay exact."""
import collections

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import dpcompile
import models as M
from dpcompile.passes import aligned_contractions as AC
from dpcompile.passes.cleanup import finalize
from helpers import check_against_reference
from cases import LAYER_CASES
from tiers import extended, op_by_op_here

aten = torch.ops.aten


class _Ctx:
    def __init__(self):
        self.counters = collections.Counter()


def _lm_head_backward(g, w, x):
    """An LM head's input gradient, weight gradient and per-sample Gram, all contracting over the vocab."""
    g3 = g.view(2, 8, 13)
    return torch.mm(g, w), torch.mm(g.t(), x), aten.bmm.dtype(g3, g3.transpose(1, 2), torch.float32)


def _trace(device, dtype=torch.bfloat16):
    with FakeTensorMode():
        g = torch.empty(16, 13, dtype=dtype, device=device)
        w = torch.empty(13, 16, dtype=dtype, device=device)
        x = torch.empty(16, 16, dtype=dtype, device=device)
        return make_fx(_lm_head_backward)(g, w, x)


def test_one_padded_copy_serves_every_contraction_over_the_vocab():
    gm = _trace("cuda")
    ctx = _Ctx()
    gm = finalize(AC.aligned_contractions_pass(gm, ctx))
    assert ctx.counters["contractions_padded"] == 3
    # g padded once along the vocab (transposed and viewed for the other two), w once
    assert ctx.counters["contraction_operands_padded"] == 2
    pads = gm.graph.find_nodes(op="call_function", target=aten.constant_pad_nd.default)
    assert sorted(tuple(p.meta["val"].shape) for p in pads) == [(16, 16), (16, 16)]
    for n in gm.graph.nodes:
        if n.target in (aten.mm.default, aten.bmm.dtype):
            assert all(s % 8 == 0 for a in n.args[:2] for s in a.meta["val"].shape[-2:]), n.format_node()
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    assert [tuple(o.meta["val"].shape) for o in outs] == [(16, 16), (13, 16), (2, 8, 8)]
    assert outs[1].target is aten.slice.Tensor  # the [V, d] weight gradient, sliced back from [16, d]


@pytest.mark.parametrize("device,dtype", [("cpu", torch.bfloat16), ("cuda", torch.float32)])
def test_left_alone_where_alignment_does_not_matter(device, dtype):
    """CPU GEMMs, and fp32 on CUDA without TF32 (no tensor cores), do not need aligned sizes."""
    assert torch.get_float32_matmul_precision() == "highest"
    ctx = _Ctx()
    AC.aligned_contractions_pass(_trace(device, dtype), ctx)
    assert not ctx.counters


# bk through Inductor: the extended tier (tests/tiers.py). The padding is dpcompile's rewrite, which bk's op-by-op
# run checks; Inductor's code for padded contractions: ghost's run here and the sharded matrix's padded gpt (CI time)
@pytest.mark.parametrize("schedule,compiler", [("bk", "eager"), ("ghost", "inductor"),
                                               pytest.param("bk", "inductor", marks=extended)])
def test_padded_contractions_give_the_exact_gradients(schedule, compiler, monkeypatch):
    """Forced on for CPU float32 (the CUDA rule is bf16/fp16): odd vocab, width, hidden size and sequence."""
    monkeypatch.setattr(AC, "PAD_DEVICES", ("cpu",))
    monkeypatch.setattr(AC, "ALIGNMENT", {torch.float32: 8})
    torch.manual_seed(0)
    model = M.GPT(vocab=13, d=12, n_head=2, n_layer=1, max_t=6, tied=True)
    ids, y = torch.randint(0, 13, (4, 6)), torch.randint(0, 13, (4, 6))
    dpcompile.mark_batch(ids, y)  # as a sharded step: only static sizes are padded
    backend = check_against_reference(model, M.seq_ce, (ids,), (y,), schedule=schedule, compiler=compiler)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["contractions_padded"] >= 8, record.counters


def test_strided_results_reach_outputs_contiguous():
    """A column slice of a padded result is strided: a graph output (or a collective) gets a dense copy."""
    with FakeTensorMode():
        x = torch.empty(16, 13, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(13, 13, dtype=torch.bfloat16, device="cuda")
        gm = make_fx(lambda x, w: (torch.mm(x, w), torch.mm(x, w).sum(0)))(x, w)
    ctx = _Ctx()
    gm = finalize(AC.aligned_contractions_pass(gm, ctx))
    assert ctx.counters["contractions_padded"] == 2
    first, second = gm.graph.find_nodes(op="output")[0].args[0]
    assert first.target is aten.clone.default and first.meta["val"].is_contiguous()
    assert second.args[0].target is aten.slice.Tensor  # the sum reads the strided slice as it is


# One schedule per kind, alternating (the pass pads after either schedule's rewrite: each schedule's graphs are
# padded in half the kinds). The default tier pads a quarter of the kinds, op by op: what the pass pads is
# dpcompile's rewrite; Inductor's code for padded graphs runs in the GPT and computed-value tests of this file.
# The extended tier (tests/tiers.py) pads the other kinds op by op and takes the quarter through Inductor too
# (not reparametrised, the extended tier's alone: padded, its bicubic interpolate's backward took 100 s of CI to
# compile, and 19 s op by op).
@pytest.mark.parametrize("case,schedule,compiler", [pytest.param(
    case, ("bk", "ghost")[i // 2 % 2], compiler, marks=[] if quarter and compiler == "eager" else [extended])
    for i, case in enumerate(sorted(LAYER_CASES)) for quarter in [i % 4 == 0 and case != "reparametrised"]
    for compiler in ["eager"] + (["inductor"] if quarter else [])])
def test_every_layer_kind_stays_exact_when_padded(case, schedule, compiler, monkeypatch):
    """Every layer kind of the clipping tests, with their odd sizes (3, 5, 6, 11, 13) padded to 8: what the pass
    pads, checked op by op (CI time; test_padded_contractions_give_the_exact_gradients and
    test_computed_padded_values_give_the_exact_gradients take padded graphs through Inductor, and on a GPU the
    clipping tests pad for real)."""
    monkeypatch.setattr(AC, "PAD_DEVICES", ("cpu",))
    monkeypatch.setattr(AC, "ALIGNMENT", {torch.float32: 8})
    c = LAYER_CASES[case]
    torch.manual_seed(0)
    inputs, targets = c.data(4)
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule=schedule, compiler=compiler)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["contractions_padded"] > 0, record.counters


def _computed_lm_head(with_fixed_readers: bool):
    """An LM head's backward whose output gradient the step computes (a pointwise op), as the logits gradient
    is: the input gradient, a per-sample Gram, bk's row-masked weight gradient and a bias-like sum read it."""
    from dpcompile.passes.inplace_row_masks import ROW_MASK

    def f(logits, w, x, keep):
        g = logits * 3.0
        g3 = g.view(2, 8, 13)
        gram = aten.bmm.dtype(g3, g3.transpose(1, 2), torch.float32)
        masked = torch.where(keep, g, torch.scalar_tensor(0.0, dtype=g.dtype))
        outs = (torch.mm(g, w), torch.mm(masked.t(), x), gram, g.sum(0))
        # a graph output keeps eager's layout; a flattening view cannot be taken of a slice of the padded buffer
        return outs + (g, g.view(-1) * 2) if with_fixed_readers else outs

    with FakeTensorMode():
        args = (torch.empty(16, 13, dtype=torch.bfloat16, device="cuda"),
                torch.empty(13, 16, dtype=torch.bfloat16, device="cuda"),
                torch.empty(16, 16, dtype=torch.bfloat16, device="cuda"),
                torch.empty(16, 1, dtype=torch.bool, device="cuda"))
        gm = make_fx(f)(*args)
    (where,) = gm.graph.find_nodes(op="call_function", target=aten.where.self)
    where.meta[ROW_MASK] = 0  # as clip_schedule tags bk's masks
    return gm


def test_a_computed_operand_is_computed_padded_and_read_sliced():
    """The pad of a value the step computes stands in for it: every reader reads the padded buffer or a slice
    of it, so Inductor writes one padded buffer (no copy), and the row mask is taken of the padded buffer."""
    ctx = _Ctx()
    gm = finalize(AC.aligned_contractions_pass(_computed_lm_head(False), ctx))
    gm.graph.eliminate_dead_code()  # the unpadded operands' views the contractions no longer read
    assert ctx.counters["contractions_padded"] == 3
    assert ctx.counters["padded_values_shared"] == 1
    (mul,) = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
    (pad,) = mul.users  # nothing else reads the unpadded value
    assert pad.target is aten.constant_pad_nd.default and tuple(pad.meta["val"].shape) == (16, 16)
    assert ctx.counters["contraction_operands_padded"] == 2  # that value and the weight, once each
    (where,) = gm.graph.find_nodes(op="call_function", target=aten.where.self)
    assert where.args[1] is pad and tuple(where.meta["val"].shape) == (16, 16)
    (s,) = gm.graph.find_nodes(op="call_function", target=aten.sum.dim_IntList)
    assert s.args[0].target is aten.slice.Tensor and s.args[0].args[0] is pad
    assert tuple(s.meta["val"].shape) == (13,)
    dx, dw, gram, _ = gm.graph.find_nodes(op="output")[0].args[0]
    assert [tuple(o.meta["val"].shape) for o in (dx, dw, gram)] == [(16, 16), (13, 16), (2, 8, 8)]


def test_gathers_read_the_slice_of_the_padded_value(monkeypatch):
    """A tied LM head's cross term gathers the logits gradient at the token ids (shared_norms): the gather reads
    the slice of the padded buffer, so the value is computed padded, not written and then copied padded."""
    def f(logits, w, ids):
        g = logits * 3.0
        picked = aten.gather.default(g.view(2, 8, 13), 2, ids)
        return torch.mm(g, w), picked, aten.index_select.default(g, 1, ids[0, :, 0])

    monkeypatch.setattr(AC, "PAD_DEVICES", ("cpu",))  # (fake CUDA gathers need a CUDA build)
    with FakeTensorMode():
        gm = make_fx(f)(torch.empty(16, 13, dtype=torch.bfloat16), torch.empty(13, 16, dtype=torch.bfloat16),
                        torch.empty(2, 8, 8, dtype=torch.int64))
    ctx = _Ctx()
    gm = finalize(AC.aligned_contractions_pass(gm, ctx))
    gm.graph.eliminate_dead_code()
    assert ctx.counters["padded_values_shared"] == 1
    (mul,) = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)
    (pad,) = mul.users
    assert pad.target is aten.constant_pad_nd.default
    (gather,) = gm.graph.find_nodes(op="call_function", target=aten.gather.default)
    (select,) = gm.graph.find_nodes(op="call_function", target=aten.index_select.default)
    for reader in (gather.args[0].args[0], select.args[0]):
        assert reader.target is aten.slice.Tensor and reader.args[0] is pad
    assert tuple(gather.meta["val"].shape) == (2, 8, 8) and tuple(select.meta["val"].shape) == (16, 8)


def test_readers_that_need_the_values_layout_keep_it():
    ctx = _Ctx()
    gm = finalize(AC.aligned_contractions_pass(_computed_lm_head(True), ctx))
    gm.graph.eliminate_dead_code()
    assert ctx.counters["contractions_padded"] == 3
    assert "padded_values_shared" not in ctx.counters  # the value still has readers of its own
    (mul,) = gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor, sort=True)[:1]
    readers = {u.target for u in mul.users}
    assert aten.view.default in readers and "output" in {u.op for u in mul.users}
    (s,) = gm.graph.find_nodes(op="call_function", target=aten.sum.dim_IntList)
    assert s.args[0].target is aten.slice.Tensor  # the sum still reads the padded buffer


# each schedule once tied and once not, bk tied through Inductor and ghost op by op (the sharing is dpcompile's
# rewrite; CI time); the other pairings and ghost's Inductor run are the extended tier (tests/tiers.py)
@pytest.mark.parametrize("schedule,tied,compiler", [
    ("bk", True, "inductor"), *op_by_op_here("ghost", False),
    pytest.param("bk", False, "inductor", marks=extended), pytest.param("ghost", True, "inductor", marks=extended)])
def test_computed_padded_values_give_the_exact_gradients(schedule, tied, compiler, monkeypatch):
    """The sharing at work on a GPT (logits gradient, attention and MLP gradients all computed padded; tied: the
    cross term's gather of the logits gradient reads it sliced too), against the vmap(grad) oracle with
    clipping active."""
    monkeypatch.setattr(AC, "PAD_DEVICES", ("cpu",))
    monkeypatch.setattr(AC, "ALIGNMENT", {torch.float32: 8})
    torch.manual_seed(1)
    model = M.GPT(vocab=13, d=12, n_head=2, n_layer=1, max_t=6, tied=tied)
    ids, y = torch.randint(0, 13, (5, 6)), torch.randint(0, 13, (5, 6))
    backend = check_against_reference(model, M.seq_ce, (ids,), (y,), schedule=schedule, compiler=compiler)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["padded_values_shared"] >= 5, record.counters


def test_large_sizes_pad_to_the_width_inductor_pads_strides_to():
    """Past Inductor's stride-padding threshold a size is padded to 128 bytes (GPT-2's vocab 50257 -> 50304 in
    bf16), so a value computed padded has the row stride Inductor would give it unpadded; small sizes to 16
    bytes."""
    assert AC._extra(50257, 8, 2) == 47 and (50257 + 47) % 64 == 0
    assert AC._extra(50257, 4, 4) == 15 and (50257 + 15) % 32 == 0  # fp32 under TF32
    assert AC._extra(1001, 8, 2) == 7
    assert AC._extra(50264, 8, 2) == 0  # aligned for cuBLAS: Inductor pads the stride itself
    assert AC._extra(13, 0, 4) == 0
