"""Every layer kind and model of cases.py, both schedules, against the vmap(grad) oracle with clipping active."""
import pytest
import torch
import torch.nn.functional as F

import dpcompile

import cases
import models as M
from cases import BATCH_MEANS, CASES, bad_samples, check_case_invariants, ids as _ids, with_bad_samples
from helpers import check_against_reference, check_batches_against_reference, compile_step
from tiers import extended, op_by_op_here


# Every case with both schedules; one of the two through Inductor's generated code, the other op by op
# (compiler="eager": the same graphs dpcompile rewrote), alternating from case to case, as the sharded matrix
# does (tests/test_fsdp.py): Inductor's code for each case once, at half the CI time. The layer kinds the sharded
# matrix runs op by op (cases.SHARDED_LAYER_KINDS) go through Inductor with the unbacked batch size a sharded step
# compiles with (mark_batch): every kind's lowering must take a batch Inductor cannot guard on (CI time: this
# replaced a compile of each half of the kinds side by side, 4-7 minutes of CI; the static batch: the kind's
# other schedule, op by op, and test_batch_of_one and test_aligned_contractions' static Inductor runs)
MATCH_RUNS = [(case, schedule, ("inductor", "eager")[(i + k) % 2])
              for i, case in enumerate(sorted(CASES)) for k, schedule in enumerate(("bk", "ghost"))]
# The costliest compiles through Inductor (CI time, on CI's fresh kernel cache: recurrent's 111 s, reparametrised's
# 81 s, vision_blocks' 47 s, sorted_experts' 44 s): the extended tier (tests/tiers.py); the default tier runs that
# schedule op by op with the batch the Inductor run takes ("eager_standin": unbacked for the layer kinds).
# vision_blocks' convolutions go through Inductor in conv_kinds and convnet_channels_last here and in
# test_convolution's bk runs; sorted_experts' grouped matmuls in test_sorted_experts' ghost runs (a batch of one,
# an unbacked batch)
INDUCTOR_EXTENDED = ("recurrent", "reparametrised", "vision_blocks", "sorted_experts")
# Variants of a model whose Inductor run the default tier keeps (gpt, llama, hf_gpt2) or runs
# sharded (hf_llama, test_fsdp): what sets them apart (a loss over the class dim, frozen, tied or low-rank
# weights, a sum reduction) is dpcompile's rewrite, which their op-by-op run checks, and Inductor lowers the same
# blocks. Their Inductor runs are the extended tier too (CI time: 35-46 s each on a loaded 2-core machine)
MODEL_VARIANTS_EXTENDED = ("gpt_kdim_ce", "gpt_frozen", "gpt_tied", "gpt_lora", "llama_sum", "hf_llama")
# Cases whose Inductor run (the same schedule, against the oracle) the default tier has in another test: checkpointed
# (ghost) in test_graphs' test_kept_graph_texts_are_printed_when_read_as_they_were_when_kept, sample_indexed (bk, the
# unbacked batch) in test_exact_with_inductors_collective_reordering
INDUCTOR_ELSEWHERE = ("checkpointed", "sample_indexed")
# Cases whose layers the default tier lowers through Inductor in other cases, with the unbacked batch as well
# (gpt, llama, hf_gpt2 here; hf_llama sharded; test_unbacked_batch_one_graph_for_every_size's Llama): plain
# Linear layers on 2-D, 3-D and 4-D inputs, embeddings (padding_idx is dpcompile's rewrite), and weights used
# twice, whose cross terms hf_gpt2's tied head lowers (tied_blocks, shared_weights), a loss variant
# (one_hot_targets), HF's Conv1D (hf_gpt2's, bk), the padding mask (hf_llama's, sharded; this case's bk at a batch of
# one in test_batch_of_one) and a kept state (bk: test_a_weight_clamped_in_the_forward_gets_the_losss_gradient).
# What sets each apart is dpcompile's rewrite, which its op-by-op run checks (CI time: 8-22 s each on a loaded
# 2-core machine)
LOWERED_ELSEWHERE = ("mlp_2d", "linear_2d_no_bias", "linear_3d", "linear_4d", "embedding", "embedding_padding",
                     "tied_blocks", "shared_weights", "one_hot_targets", "conv1d_addmm", "attention_padding_mask",
                     "kept_state")
_MATCH_PARAMS = [p for case, schedule, compiler in MATCH_RUNS for p in (
    [pytest.param(case, schedule, compiler, marks=extended), (case, schedule, "eager_standin")]
    if compiler == "inductor" and case in (INDUCTOR_EXTENDED + MODEL_VARIANTS_EXTENDED + INDUCTOR_ELSEWHERE
                                           + LOWERED_ELSEWHERE)
    else [(case, schedule, compiler)])]


@pytest.mark.parametrize("case,schedule,compiler", _MATCH_PARAMS)
def test_matches_reference(case, schedule, compiler):
    """6 samples of which 2 are bad (a NaN input, an inf loss weight): those are dropped and counted, the other
    4 clipped and summed exactly."""
    c = with_bad_samples(CASES[case])
    inputs, targets = c.data(6)
    unbacked = compiler in ("inductor", "eager_standin") and case in cases.SHARDED_LAYER_KINDS
    compiler = "eager" if compiler == "eager_standin" else compiler
    if unbacked:  # as the sharded step marks it (nonempty: selective_scan's branch)
        dpcompile.mark_batch(*inputs, *targets, nonempty=True)
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule=schedule, reduction=c.reduction,
                                      compiler=compiler)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.summary["batch_size"].startswith("u") == unbacked, record.summary["batch_size"]
    assert backend.dropped_samples() == int(bad_samples(inputs, targets).sum()) > 0
    check_case_invariants(case, record.counters, record.summary)
    if case == "gpt_frozen":
        assert "wpe.weight" not in record.summary["params"]


@pytest.mark.parametrize("schedule,compiler", [("bk", "inductor"), ("ghost", "eager")])
def test_a_weight_clamped_in_the_forward_gets_the_losss_gradient(schedule, compiler):
    """A forward that clamps a weight's .data in place before using it (Gemma3n's AltUp coefficients): the
    clamped weight is an output of the step with a gradient of its own, which loss.backward() leaves at zero;
    compiled as zero, its chain cut, the step is exact (clipping active, the clamp active: the init exceeds
    the bound). Sharded, the write would reach one gathered copy: refused (test_fsdp's bad_inputs)."""
    torch.manual_seed(0)
    inputs, targets = (torch.randn(6, 5, 6),), (torch.randn(6, 5, 3),)
    model = M.ClampedWeight()
    assert model.coef.weight.abs().max() > model.bound
    backend = check_against_reference(model, M.mse, inputs, targets, schedule=schedule, compiler=compiler)
    assert model.coef.weight.abs().max() <= model.bound  # the step's forward clamped it
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["side_gradients_as_zeros"] == 1, record.counters
    assert record.counters["side_gradient_ops_cut"] >= 1, record.counters


# hf_llama: the extended tier (tests/tiers.py). The sharded matrix's hf_llama runs through Inductor with the
# reordering on (fully_shard turns it on) in the default tier; the sliced arange: sample_indexed (CI time: 45 s)
@pytest.mark.parametrize("case,schedule", [("sample_indexed", "bk"), pytest.param("hf_llama", "ghost", marks=extended)])
def test_exact_with_inductors_collective_reordering(case, schedule):
    """fully_shard turns on Inductor's compute/communication reordering for every graph compiled afterwards. With
    it on, Inductor keeps no-op slices in the graphs (so every rank's is the same), and the arange indexing the
    samples reached the analysis sliced: refused as "not torch.arange(batch size)" until the analysis looked
    through a slice of the whole dim."""
    from torch._inductor import config as inductor_config

    c = CASES[case]
    inputs, targets = c.data(4)
    dpcompile.mark_batch(*inputs, *targets)  # an unbacked batch size, as sharded: the slice is not dropped as 4:4
    with inductor_config.patch(reorder_for_compute_comm_overlap=True):
        backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule=schedule,
                                          reduction=c.reduction)
    (record,) = [r for r in backend.compiled if r.dp]
    check_case_invariants(case, record.counters, record.summary)


# at a batch of one the gradient is clipped whole whatever the schedule: one schedule per case, alternating, and
# one case in eight through Inductor's code (each schedule in turn), the others op by op (CI time: the batch of one
# is dpcompile's rewrite; not the costliest compiles, INDUCTOR_EXTENDED)
@pytest.mark.parametrize("case,schedule,compiler", [
    (case, ("bk", "ghost")[i % 2], ("eager", "inductor")[i % 16 in (0, 9) and case not in INDUCTOR_EXTENDED])
    for i, case in enumerate(sorted(CASES))])
def test_batch_of_one(case, schedule, compiler):
    """A static batch of one (one process: a Poisson-sampled step of one sample) is clipped whole, every case.
    Dims of size one are ambiguous there: torch.einsum moves the size-one sample dim where a contraction reads
    it (einsum_weights and per_head_weights were refused as mixing samples, and a transposed weight gradient
    failed the whole-gradient norm's view), and an RNN's backward sums over time steps of one that the
    analysis took for the sample dim (recurrent was refused)."""
    c = CASES[case]
    inputs, targets = c.data(1)
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule=schedule, reduction=c.reduction,
                                      compiler=compiler)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["norm_whole_gradient"] == len(record.summary["params"]), record.counters
    if case == "recurrent":  # the backward's ambiguous layouts taken as sample 0's, not refused
        assert record.counters["one_sample_backward_fallbacks"] > 0, record.counters


@pytest.mark.parametrize("reduction,zero_infinity,batch,schedule,compiler", [
    ("mean", True, "static", "bk", "inductor"), ("sum", False, "unbacked", "ghost", "eager"),
    ("mean", True, "one", "ghost", "eager")])
def test_ctc_loss_is_per_sample(reduction, zero_infinity, batch, schedule, compiler):
    """F.ctc_loss over time-first log-probs ([T, B, C]), padded targets, one input and target length per sample:
    dynamo split the step at torch's CTC op (its saved alpha buffer's size is read from the target lengths), so
    it was refused as a partial step; dpcompile traces it as one op per sample (dpcompile/ctc_loss.py). Exact
    against the oracle with a sample without targets and one whose targets do not fit its input length (a loss
    of 0 with zero_infinity, else dropped as non-finite), static, unbacked and a batch of one; torch's "mean"
    (each sample's loss over its target length, then the mean) is a mean of per-sample losses."""
    from reference import dp_reference

    B = 1 if batch == "one" else 5
    x, y, il, tl = cases.ctc_data(B)
    torch.manual_seed(0)
    model = M.MLP(d_out=cases.CTC_CLASSES)
    per_sample = cases.ctc_loss(reduction, zero_infinity, per_sample=True)
    # the oracle's per-sample gradients one sample at a time: torch's CTC op has no vmap rule
    _, norms = dp_reference(model, per_sample, (x,), (y, il, tl), max_grad_norm=1.0, reduction=reduction,
                            expected_batch_size=B, loop=True)
    finite = norms[norms.isfinite() & (norms > 0)]
    C = float(finite.median()) if B > 1 else float(finite[0]) / 2
    assert B == 1 or ((norms > C) & norms.isfinite()).any() and ((norms < C) & (norms > 0)).any(), norms
    ref, _ = dp_reference(model, per_sample, (x,), (y, il, tl), max_grad_norm=C, reduction=reduction,
                          expected_batch_size=B + 1, loop=True)
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B + 1,
                                  schedule=schedule, compiler=compiler)
    batch_loss = cases.ctc_loss(reduction, zero_infinity)

    def step(x, y, il, tl):
        loss = batch_loss(model(x), y, il, tl)
        loss.backward()
        return loss.detach()

    if batch == "unbacked":
        dpcompile.mark_batch(x, y, il, tl)
    torch.compile(step, backend=backend)(x, y, il, tl)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[name], rtol=1e-5, atol=1e-7, msg=lambda s: f"{name}: {s}")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.summary["loss"]["reduction"] == reduction, record.summary["loss"]
    assert backend.dropped_samples() == (0 if zero_infinity or B < 3 else 1)
    assert "dpcompile.ctc_loss.default" in record.summary["graph_ops"]["forward"], record.summary["graph_ops"]


class _Squeezed(torch.nn.Module):
    """A model that squeezes its input: at a batch of one the sample dim goes (x.squeeze() of [1, 5] is [5])."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x.squeeze())


# (model, per-sample loss of the outputs, reduction over the batch): the per-sample loss mean(-1) or sum(-1)
_ONE_SAMPLE = {"head": lambda: torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)),
               "squeezed": _Squeezed}


@pytest.mark.parametrize("model,per_sample,reduction,compiler", [
    ("head", "mean", "mean", "inductor"), ("head", "sum", "sum", "eager"), ("head", "sum", "mean", "eager"),
    ("squeezed", "mean", "mean", "eager"), ("squeezed", "sum", "sum", "eager"), ("squeezed", "sum", "mean", "eager")])
def test_a_static_batch_of_one_keeps_the_losss_reduction(model, per_sample, reduction, compiler):
    """At a static batch of one a mean over the batch is a mean (the DP gradient divided by expected_batch_size)
    and a sum a sum, as at any other batch size: exact against the oracle with expected_batch_size 2. Inductor's
    decomposition of a one-row matmul on CPU ([1, 8] @ [8, 3]: a broadcast product and a sum) spread the sample
    dim over the outputs, and the loss's mean was taken as a sum (k = 1: twice the oracle here); dpcompile now
    keeps the matmul at a batch of one. Where the model itself loses the sample dim (x.squeeze()), the loss's
    reductions decide: means alone a mean, sums alone a sum, a sum then a mean (the sample dim in either) is
    refused, saying how to compile with the sample dim known."""
    torch.manual_seed(0)
    # no targets: a per-sample target would carry the sample dim back into the loss
    loss = (lambda out: out.pow(2).mean(-1)) if per_sample == "mean" else (lambda out: out.pow(2).sum(-1))
    inputs, targets = (torch.randn(1, 5),), ()
    if model == "squeezed" and per_sample != reduction:
        with pytest.raises(dpcompile.errors.SamplesMixedError, match="dpcompile.mark_batch"):
            check_against_reference(_ONE_SAMPLE[model](), loss, inputs, targets, schedule="bk", reduction=reduction,
                                    compiler=compiler)
        return
    backend = check_against_reference(_ONE_SAMPLE[model](), loss, inputs, targets, schedule="bk",
                                      reduction=reduction, compiler=compiler)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.summary["loss"]["reduction"] == reduction, record.summary["loss"]


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_sequence_first_rows_with_an_unbacked_batch(schedule):
    """Weights applied by einsum, the second to sequence-first rows ([T, B, ...]: samples inside the rows), with
    the unbacked batch size of a sharded step, through Inductor: the per-sample operands are copied sample-major
    (Inductor's bmm lowering failed on a guard of the unbacked size when handed the strided view), and the
    symbolic strides Max(1, u0) of those copies are rebuilt as graph values."""
    c = CASES["einsum_weights"]
    inputs, targets = c.data(5)
    dpcompile.mark_batch(*inputs, *targets)
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule=schedule, compiler="inductor")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.summary["batch_size"].startswith("u"), record.summary["batch_size"]
    check_case_invariants("einsum_weights", record.counters, record.summary)


# llama: the extended tier (tests/tiers.py). auto's choice and the mixed schedules run through Inductor on gpt;
# llama's blocks go through Inductor in test_matches_reference (CI time: 22 s)
@pytest.mark.parametrize("case", ["gpt", pytest.param("llama", marks=extended)])
def test_auto_schedule_mixes_bk_and_ghost(case):
    c = CASES[case]
    inputs, targets = c.data(3)
    # a budget that fits some deferred operands but not all
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule="auto", memory_budget=2000)
    counters = backend.compiled[0].counters
    assert counters["bk_deferred_contractions"] > 0 and counters["ghost_recomputed_params"] > 0, counters


def test_auto_schedule_choice_does_not_follow_the_sampled_batch():
    """auto counts a deferred operand's bytes at expected_batch_size, so every rank (and every step of a
    Poisson-sampled run) chooses the same contractions to defer whatever its own batch size."""
    import torch

    from helpers import compile_step

    c = CASES["gpt"]
    chosen = []
    for n in (2, 6):
        torch._dynamo.reset()
        inputs, targets = c.data(n)
        step, backend = compile_step(c.model(), c.loss, max_grad_norm=1.0, noise_multiplier=0.0,
                                     expected_batch_size=4, schedule="auto", memory_budget=2000, compiler="eager")
        step(inputs, targets)
        counters = backend.compiled[0].counters
        chosen.append((counters["bk_deferred_contractions"], counters["ghost_recomputed_params"]))
    assert chosen[0] == chosen[1], chosen
    assert chosen[0][0] > 0 and chosen[0][1] > 0, chosen  # the budget fits some operands, not all


@pytest.mark.parametrize("algo", ["ghost", "direct"])
def test_linear_norm_algorithms_agree(algo):
    c = CASES["linear_3d"]
    inputs, targets = c.data(3)
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule="bk", linear_norm=algo)
    assert backend.compiled[0].counters[f"norm_mm_{algo}"] == 2


# direct op by op (per_head_weights' bk Inductor run in test_matches_reference takes the form auto picks), its
# Inductor run the extended tier (tests/tiers.py; CI time)
@pytest.mark.parametrize("algo,compiler", [("ghost", "inductor"), *op_by_op_here("direct")])
def test_per_head_weight_norm_forms(algo, compiler):
    """Per-head weights (a batched matmul's weight gradient, H products per sample): each norm form, over the
    B * H (sample, head) pairs, summed per sample; one row per sample and head takes the rank-one form."""
    c = CASES["per_head_weights"]
    inputs, targets = c.data(4)
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule="bk", linear_norm=algo,
                                      compiler=compiler)
    counters = backend.compiled[0].counters
    assert counters[f"norm_bmm_{algo}"] == 2 and counters["norm_bmm_rank_one"] == 1, counters


# one schedule through Inductor's code for the static and the symbolic graph, the other op by op (CI time: the
# recompile is dynamo's and dpcompile's; 33 s of CI's fresh kernel cache)
@pytest.mark.parametrize("schedule,compiler", [("bk", "inductor"), ("ghost", "eager")])
def test_varying_batch_sizes_use_a_dynamic_graph(schedule, compiler):
    """Poisson sampling changes B every step: dynamo recompiles once with a symbolic batch size."""
    from reference import dp_reference

    import dpcompile

    model = M.GPT(n_layer=1)  # two compiles of every layer kind; depth adds only compile time
    backend = dpcompile.DPBackend(max_grad_norm=0.3, noise_multiplier=0.0, expected_batch_size=4, schedule=schedule,
                                  compiler=compiler)

    def step(ids, y):
        loss = M.seq_ce(model(ids), y).mean()
        loss.backward()
        return loss.detach()

    compiled = torch.compile(step, backend=backend)
    for B in (4, 3, 5, 2):
        ids = _ids(B, 6, 13)
        model.zero_grad(set_to_none=True)
        compiled(ids, ids)
        ref, norms = dp_reference(model, M.seq_ce, (ids,), (ids,), max_grad_norm=0.3, expected_batch_size=4)
        assert (norms > 0.3).any()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-5, atol=1e-7)
    dp_graphs = [r for r in backend.compiled if r.dp]
    assert len(dp_graphs) == 2  # B=4 static, then one symbolic-B graph for 3, 5, 2


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_ratio_of_batch_multiples_is_its_value_on_an_empty_batch(compiler):
    """Traced as non-empty (mark_batch(nonempty=True), as a sharded step is), a graph whose sizes divide a multiple
    of the batch by another (numel / (B*C) = H*W) runs B = 3, 0, 2 exactly: the ratio is its value (pass
    empty_batch), where op by op the division raised ZeroDivisionError on the empty batch (a rank without
    samples would have left the others waiting in their collectives). A torch that cannot trace the batch as
    non-empty (2.11) asks, in batch_norm's C++, whether numel is 0: that broke the graph (refused) until
    dpcompile/cpp_size_questions answered such questions size-obliviously; now 2.11 runs it exactly too."""
    from reference import dp_reference

    from dpcompile import cpp_size_questions
    from dpcompile.batching import traces_nonempty

    torch.manual_seed(0)
    model = M.ConvNet(viewed_norm=True)
    batches = [(torch.randn(n, 3, 8, 8), torch.randn(n, 3)) for n in (3, 0, 2)]
    _, norms = dp_reference(model, M.mse, batches[0][:1], batches[0][1:], max_grad_norm=1.0, expected_batch_size=3)
    C = float(norms.median())
    step, backend = compile_step(model, M.mse, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=3,
                                 compiler=compiler)
    answered = sum(cpp_size_questions.ANSWERS.values())
    # fp32 against fp64 through seven layers; up.bias, which the norm cancels, is 0 in exact arithmetic
    check_batches_against_reference(model, M.mse, step, batches, max_grad_norm=C, expected_batch_size=3,
                                    nonempty=True, atol_of_largest=1e-6)
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters["nonempty_batch_ratios_cancelled"] >= 1, dict(rec.counters)
    if not traces_nonempty():  # batch_norm's C++ check of numel against 0, answered (it broke the graph before)
        assert sum(cpp_size_questions.ANSWERS.values()) > answered


# ghost through Inductor: the extended tier (tests/tiers.py; CI time): the unbacked batch's lowering is bk's
# here, and every layer kind's in test_matches_reference
@pytest.mark.parametrize("schedule,compiler", [("bk", "inductor"), ("bk", "eager"), *op_by_op_here("ghost")])
def test_unbacked_batch_one_graph_for_every_size(schedule, compiler):
    """Batch dims marked with dpcompile.mark_batch (one unbacked size shared by ids and targets) and a
    model with view(B, T, H, -1): one graph runs B = 3, 0, 1, 4 exactly (B = 0: a zero gradient), also
    op by op (compiler="eager": the view's -1 is resolved in the graph, as Inductor resolves it)."""
    from reference import dp_reference

    torch.manual_seed(0)
    model = M.LlamaLM()
    batches = [(_ids(B, 6, 13), _ids(B, 6, 13)) for B in (3, 0, 1, 4)]
    _, norms = dp_reference(model, M.seq_ce, batches[0][:1], batches[0][1:], max_grad_norm=1.0, reduction="sum")
    C = float(norms.median())
    step, backend = compile_step(model, M.seq_ce, reduction="sum", max_grad_norm=C, noise_multiplier=0.0,
                                 expected_batch_size=4, schedule=schedule, compiler=compiler)
    clipped, unclipped = check_batches_against_reference(model, M.seq_ce, step, batches, max_grad_norm=C,
                                                         expected_batch_size=4, reduction="sum")
    assert clipped and unclipped
    dp_graphs = [r for r in backend.compiled if r.dp]
    assert len(dp_graphs) == 1
    assert dp_graphs[0].counters["nonempty_batch_asserts_removed"] >= 1  # the -1 view's B != 0
    assert dp_graphs[0].counters["nonempty_batch_views_resolved"] >= 1


# The per-sample norms are the same pass in both schedules: each norm form runs with one of them (CI time), the
# other pairing in test_large_norm_intermediates_are_computed_in_blocks. The split is dpcompile's rewrite: one
# form through Inductor's code, the other op by op, its Inductor run the extended tier (tests/tiers.py; CI time)
@pytest.mark.parametrize("schedule,linear_norm,T,d,at_least,compiler", [
    ("bk", "direct", 8, 128, 3, "inductor"), *op_by_op_here("ghost", "ghost", 256, 16, 4)])
def test_large_per_sample_tensors_sum_in_two_stages(schedule, linear_norm, T, d, at_least, compiler, monkeypatch):
    """Per-sample tensors of 2**16 elements or more are summed in two stages (Inductor cannot split a sum to
    an unbacked [B]): direct weight gradients (the 4d x d MLP's among them), or the
    T x T Gram matrices of the ghost norms of every Linear and the position embedding (their graph form: the
    form symbolic rows per sample take; static ones run dpcompile::gram_sq_norms). Unbacked batch, exact."""
    from dpcompile.passes import per_sample_norms

    monkeypatch.setattr(per_sample_norms, "GRAM_KERNEL", False)
    torch.manual_seed(0)
    model = M.GPT(vocab=520, d=d, n_head=2, n_layer=1, max_t=T, tied=True)
    ids, y = _ids(4, T, 520), _ids(4, T, 520)
    dpcompile.mark_batch(ids, y)
    backend = check_against_reference(model, M.seq_ce, (ids,), (y,), schedule=schedule, linear_norm=linear_norm,
                                      compiler=compiler)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["per_sample_two_stage_sums"] >= at_least


# (one form through Inductor's code, the other op by op, its Inductor run the extended tier, as above)
@pytest.mark.parametrize("schedule,linear_norm,compiler", [("bk", "ghost", "inductor"),
                                                           *op_by_op_here("ghost", "direct")])
def test_large_norm_intermediates_are_computed_in_blocks(schedule, linear_norm, compiler, monkeypatch):
    """A per-sample norm whose [B, p, m] (direct) or [B, S, S] (ghost) intermediate would exceed
    NORM_BLOCK_BYTES at the expected batch size is summed over blocks: of the larger feature dim (the MLP's
    fc has m > p, its proj p > m, the tied head V > d) or of the Gram matrices' rows (their graph form; the
    kernel, dpcompile::gram_sq_norms, writes none). Exact either way."""
    from dpcompile.passes import per_sample_norms

    monkeypatch.setattr(per_sample_norms, "NORM_BLOCK_BYTES", 1024)
    monkeypatch.setattr(per_sample_norms, "GRAM_KERNEL", False)
    torch.manual_seed(0)
    model = M.GPT(vocab=40, d=8, n_head=2, n_layer=1, max_t=8)
    ids, y = _ids(5, 8, 40), _ids(5, 8, 40)
    backend = check_against_reference(model, M.seq_ce, (ids,), (y,), schedule=schedule, linear_norm=linear_norm,
                                      compiler=compiler)
    (record,) = [r for r in backend.compiled if r.dp]
    blocked = [e["why"] for e in record.summary["params"].values() if "blocks" in e.get("why", "")]
    assert record.counters["norm_blocks"] >= 2 * len(blocked) and len(blocked) >= 4, record.summary["params"]


# gpt op by op: its recomputed logits go through Inductor sharded (test_fsdp's matrix, gpt ghost +recompute);
# its Inductor run here is the extended tier (tests/tiers.py; CI time)
@pytest.mark.parametrize("case,compiler", [("hf_gpt2", "inductor"), *op_by_op_here("gpt")])
def test_ghost_second_backward_recomputes_the_logits(case, compiler, monkeypatch):
    """The ghost second backward recomputes a large forward value made by a contraction (the log-softmax of
    the LM head's logits) instead of keeping it through the first backward; with two bad samples (NaN
    input, inf weight) dropped and the rest clipped, exact. The recomputed chain runs in the backward."""
    from dpcompile.passes import second_backward_recompute as SBR

    monkeypatch.setattr(SBR, "RECOMPUTE_MIN_BYTES", 1)  # the test models are small: every size qualifies
    monkeypatch.setattr(SBR, "RECOMPUTE_MIN_RATIO", 1)  # and a vocabulary narrower than 8x the width
    c = with_bad_samples(CASES[case])
    inputs, targets = c.data(6)
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule="ghost", compiler=compiler)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters.get("second_backward_recomputed_contractions", 0) >= 1, record.counters
    assert record.summary["second_backward_recompute"], record.summary
    mm = lambda phase: {shape for t, shape in record.ops[phase] if t in ("aten.mm.default", "aten.addmm.default")}  # noqa: E731
    logits = max(mm("forward"), key=lambda s: s[-1])  # the LM head's [B*T, V]: the widest forward contraction
    assert logits in mm("backward"), (logits, mm("backward"))  # computed again in the backward


class TimeMajor(torch.nn.Module):
    """Takes [T, B, d] input: the samples are on dim 1."""

    def __init__(self):
        super().__init__()
        self.inner = M.SeqLinear()

    def forward(self, x):
        return self.inner(x.transpose(0, 1))


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_batch_dim_option(schedule):
    from reference import dp_reference

    import dpcompile

    model = TimeMajor()
    x, y = torch.randn(4, 5, 6), torch.randn(5, 4, 3)  # x: [T=4, B=5, d]
    ref_fwd = lambda m, xb: m(xb.transpose(0, 1))  # noqa: E731  (the oracle sees [B, T, d])
    _, norms = dp_reference(model, M.mse, (x.transpose(0, 1),), (y,), max_grad_norm=1.0, expected_batch_size=5,
                            forward=ref_fwd)
    C = float(norms.median())
    ref, _ = dp_reference(model, M.mse, (x.transpose(0, 1),), (y,), max_grad_norm=C, expected_batch_size=5,
                          forward=ref_fwd)
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=5, schedule=schedule,
                                  batch_dim={"x": 1})

    def step(x, y):
        loss = M.mse(model(x), y).mean()
        loss.backward()
        return loss.detach()

    torch.compile(step, backend=backend)(x, y)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-5, atol=1e-7)


class SlicedHead(torch.nn.Module):
    """A weight used through a slice of its own gradient-carrying result (the shape padding pattern)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(5, 8) * 0.3)

    def forward(self, x):
        return torch.nn.functional.pad(x, (0, 3)) @ self.w.t()[:8]


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_padded_contraction_sliced_back(schedule):
    model = SlicedHead()
    inputs, targets = (torch.randn(4, 5) * 2,), (torch.randn(4, 5),)
    check_against_reference(model, M.mse, inputs, targets, schedule=schedule)


class SplitWeight(torch.nn.Module):
    """One weight used through two slices: its gradient is two contributions placed by slice_scatter."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 4) * 0.3)

    def forward(self, x):
        return torch.tanh(x @ self.w[:3].t()) @ self.w[3:]


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_weight_used_through_two_slices(schedule):
    model = SplitWeight()
    inputs, targets = (torch.randn(4, 4) * 2,), (torch.randn(4, 4),)
    check_against_reference(model, M.mse, inputs, targets, schedule=schedule)


# ghost op by op, its Inductor run the extended tier (tests/tiers.py): the drop is dpcompile's rewrite (CI time)
@pytest.mark.parametrize("schedule,compiler", [("bk", "inductor"), *op_by_op_here("ghost")])
def test_dropped_samples_are_counted_and_a_lone_bad_sample_gives_zero(schedule, compiler):
    """backend.dropped_samples() counts the samples whose gradient was not finite since its last call; a
    batch of one bad sample (the whole-gradient path) and a batch of only bad samples give exact zeros."""
    from helpers import compile_step

    torch.manual_seed(0)
    model = M.MLP()
    compiled, backend = compile_step(model, M.ce, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4,
                                     schedule=schedule, compiler=compiler)
    x, y = torch.randn(5, 5), torch.randint(0, 3, (5,))
    x[3] = float("nan")
    compiled((x,), (y,))
    assert backend.dropped_samples() == 1 and backend.dropped_samples() == 0
    for bad in (x[3:4], torch.full((3, 5), float("inf"))):  # B = 1 (its own graph), then a symbolic B
        model.zero_grad(set_to_none=True)
        compiled((bad,), (y[: len(bad)],))
        assert backend.dropped_samples() == len(bad)
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, torch.zeros_like(p)), n
    summary = [r for r in backend.compiled if r.dp][0].summary
    assert "dropped" in summary["nonfinite_samples"]


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_weight_normalised_as_a_whole(schedule):
    """weight_norm(dim=None): one scalar gain, and plain ops (not torch's fused kernel) whose backward sums
    the gradient over the whole weight; replayed per sample. One process: a scalar parameter cannot be
    sharded (fully_shard refuses it by name, tests/test_fsdp.py)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(5, 6), dim=None),
                                torch.nn.Tanh(), torch.nn.Linear(6, 3))
    check_against_reference(model, M.ce, (torch.randn(4, 5),), (torch.randint(0, 3, (4,)),), schedule=schedule,
                            compiler="eager")


@pytest.mark.parametrize("schedule,batch,loss", [("bk", "static", "cross_entropy"), ("ghost", "unbacked", "cross_entropy"),
                                                 ("ghost", "static", "nll_loss"), ("bk", "unbacked", "nll_loss"),
                                                 ("bk", "static", "label_smoothing"),
                                                 ("ghost", "unbacked", "label_smoothing"),
                                                 ("ghost", "static", "kl_batchmean"),
                                                 ("bk", "unbacked", "kl_batchmean"),
                                                 ("bk", "static", "sum_over_numel"),
                                                 ("ghost", "unbacked", "sum_over_numel"),
                                                 ("bk", "unbacked", "prob_targets"),
                                                 ("ghost", "static", "prob_targets"),
                                                 ("ghost", "static", "sum_times_reciprocal"),
                                                 ("bk", "unbacked", "sum_times_reciprocal"),
                                                 ("ghost", "unbacked", "multilabel_margin"),
                                                 ("bk", "static", "gaussian_nll")])
def test_whole_batch_means_of_per_sample_losses(schedule, batch, loss):
    """Losses written over the whole batch that are means of per-sample losses (tests/cases.BATCH_MEANS):
    F.cross_entropy (label smoothing too) and F.nll_loss with their default mean, a sum of per-sample losses over
    the count of targets that are not ignore_index, one per sample; F.kl_div's "batchmean", a sum over the batch
    size; a sum over all elements of [B, classes] over their number (.mean() by hand); F.cross_entropy with
    probability targets (-sum / B) and a sum times 1 / B; F.multilabel_margin_loss and F.gaussian_nll_loss, whose
    compiled forms torch gets wrong or cannot trace (dpcompile.compat). The DP gradient divides
    by expected_batch_size, as for .mean(): exact against the oracle of the per-sample losses (reduction="none"),
    an ignored target's sample contributing nothing and not counted as dropped. Taken as a sum of per-sample
    losses each over the batch size instead (before), "batchmean" clipped g_i / B (fc1.weight off by 0.14), and
    sum / numel g_i / (B * classes); label smoothing's count, written twice, was refused as two counts; -sum / B
    and sum * (1 / B) were read as sums, clipping g_i / B."""
    import copy

    from reference import dp_reference

    torch.manual_seed(0)
    model = M.MLP()
    x, y = torch.randn(6, 5) * 2, torch.randint(0, 3, (6,))
    y[2] = -100  # ignore_index (kl_batchmean: a uniform target)
    batch_loss, per_sample, counter = BATCH_MEANS[loss]
    _, norms = dp_reference(model, per_sample, (x,), (y,), max_grad_norm=1.0, expected_batch_size=7)
    C = float(norms[norms > 0].median())
    assert (norms > C).any() and ((norms < C) & (norms > 0)).any(), norms
    ref, _ = dp_reference(model, per_sample, (x,), (y,), max_grad_norm=C, expected_batch_size=7)
    m = copy.deepcopy(model)
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=7, schedule=schedule)

    def step(x, y):
        l = batch_loss(m(x), y)
        l.backward()
        return l.detach()

    if batch == "unbacked":
        dpcompile.mark_batch(x, y)
    torch.compile(step, backend=backend)(x, y)
    for name, p in m.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[name], rtol=1e-5, atol=1e-7, msg=lambda s: f"{name}: {s}")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters[counter] == 1, record.counters
    assert record.summary["loss"]["reduction"] == "mean" and backend.dropped_samples() == 0


def test_hugging_faces_own_gradient_checkpointing_matches_reference():
    """transformers' gradient_checkpointing_enable (non-reentrant): each decoder layer runs in
    torch.utils.checkpoint, inside which transformers 5.25 (with kernels 0.19) set a global routing variable on
    every call of a hub-kernel-wrapped module, a side effect dynamo refuses in a checkpoint: every step was split
    (compat.hf_kernel_routing_in_checkpoints). The oracle runs the same weights without checkpointing."""
    model, plain = cases._hf_llama().double(), cases._hf_llama().double()
    plain.load_state_dict(model.state_dict())
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train(), plain.train()
    x = _ids(4, 6, 29)

    def loss(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)

    check_against_reference(model, loss, (x,), (_ids(4, 6, 29),), schedule="bk", compiler="eager", oracle=plain)


class BilinearReadout(torch.nn.Module):
    """A weight between two copies of a sample's features, written as one einsum of three operands."""

    def __init__(self, d=5, h=6, n_out=3):
        super().__init__()
        self.fc = torch.nn.Linear(d, h)
        self.w = torch.nn.Parameter(torch.randn(n_out, h, h) / h)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return torch.einsum("bi,oij,bj->bo", h, self.w, h)


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_einsum_of_three_operands_with_an_unbacked_batch(schedule):
    """torch.einsum asks opt_einsum for a contraction order from int sizes, which an unbacked batch size (sharded
    and Poisson-sampled steps, mark_batch) does not have: dynamo split the step there and it was refused. The order
    is now chosen from the sizes' hints (dpcompile/einsum_path.py); one graph, exact against the oracle."""
    inputs, targets = (torch.randn(5, 5),), (torch.randint(0, 3, (5,)),)
    dpcompile.mark_batch(*inputs, *targets)
    backend = check_against_reference(BilinearReadout(), M.ce, inputs, targets, schedule=schedule, compiler="eager")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.summary["batch_size"].startswith("u"), record.summary["batch_size"]


def test_the_oracle_of_a_solve_against_a_shared_vector_with_as_many_samples_as_rows():
    """The oracle itself: vmap takes a shared [3] right-hand side of torch.linalg.solve for a matrix when the batch
    has 3 samples (a result of one more dim; torch 2.11 and 2.13), and the per-sample gradients then come from one
    backward per sample. They must equal that loop's, for the batch sizes the GPU tests run."""
    from reference import per_sample_gradients

    c = CASES["linalg_distances"]
    model = c.model()
    for n in (3, 5):
        inputs, targets = c.data(n)
        got = per_sample_gradients(model, c.loss, inputs, targets)
        want = per_sample_gradients(model, c.loss, inputs, targets, loop=True)
        assert set(got) == set(want) and all(got[k].shape[0] == n for k in got), {k: v.shape for k, v in got.items()}
        for k in want:
            torch.testing.assert_close(got[k], want[k])
