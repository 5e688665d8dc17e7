"""The same oracle checks with Inductor emitting Triton on a GPU (skipped without CUDA)."""
import copy
import functools

import pytest
import torch

import dpcompile
import models as M
from reference import dp_reference
from cases import CASES, bad_samples, check_case_invariants, finite_median, unbacked_left_out, with_bad_samples
from helpers import all_cpp_wrapper_codes, assert_bf16_close, assert_norms_read_bf16, clipped_on

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def exact_fp32():
    # cuDNN's flags through their context manager: a worker that collected test_op_sweep imported torch's op
    # database, whose common_utils freezes them (torch.backends.disable_global_flags), and then setting one raises
    cudnn = torch.backends.cudnn
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                         allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


_clipped_on_cuda = functools.partial(clipped_on, "cuda")


@pytest.mark.parametrize("schedule", ["bk", "ghost", "auto"])
@pytest.mark.parametrize("case", [c for c in ["mlp_2d", "norms", "embedding_padding", "gpt", "llama", "conv_kinds",
                                               "routed_experts", "sorted_experts", "spectral_norm", "recurrent",
                                               "sequence_ops", "sample_indexed", "fourier_mixer", "spatial_transformer",
                                               "selective_scan", "kept_state", "convnet_channels_last",
                                               "linalg_distances"]
                                  if c in CASES])  # (sorted_experts: where transformers' fallback is traceable)
def test_cuda_matches_reference(case, schedule):
    c = CASES[case]
    inputs, targets = c.data(4)
    ref, gpu, _ = _clipped_on_cuda(c.model(), c.loss, inputs, targets, schedule=schedule, memory_budget=4000)
    for name, p in gpu.named_parameters():
        # an entry that is a sum with cancellation is off by ~1e-5 of the tensor's scale in fp32 (sequence_ops:
        # 3.4e-6 on one of fc.weight's 48 entries, through a cumsum, against a fixed 1e-6)
        atol = 1e-6 + 1e-5 * float(ref[name].abs().max())
        torch.testing.assert_close(p.grad.double().cpu(), ref[name], rtol=1e-4, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
@pytest.mark.parametrize("case", [c for c in ["gpt", "llama", "norms", "conv_kinds", "embedding_padding",
                                               "routed_experts", "sorted_experts", "fourier_mixer",
                                               "spatial_transformer", "sequence_ops", "selective_scan",
                                               "convnet_channels_last", "linalg_distances"]
                                  if c in CASES and c not in unbacked_left_out("cuda")])
def test_cuda_unbacked_batch_matches_reference(case, schedule):
    """One graph for every batch size, as sharded and Poisson-sampled steps compile it (the batch unbacked,
    with Inductor's hint): batches of 5, 3, 1 and 0 through one compile, each exact against the fp64 oracle
    (no samples: a zero gradient). On torch 2.11 this is also where Inductor fuses by hinted sizes
    (compat.hint_fusion_scores)."""
    _unbacked_steps_match_reference(case, schedule, "cuda")


def test_cuda_mix_order_reduction_returns_gradients_in_their_shapes():
    """A LayerNorm over [C, H, W] with an unbacked batch: Inductor's mix-order reduction (its row and column
    reductions in one kernel) ended with a flat [C*H*W] sum on torch 2.11, and autograd refused the weight's
    gradient (compat.mix_order_reduction_keeps_shapes; torch 2.13 views it back itself). The gradients are
    eager's, in the parameters' shapes, for batches of 5 and 3."""
    from dpcompile.compat import hint_mix_order_split, mix_order_reduction_keeps_shapes

    hint_mix_order_split()
    mix_order_reduction_keeps_shapes()
    ln = torch.nn.LayerNorm([8, 8, 8], device="cuda")
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        step = torch.compile(lambda x: torch.nn.functional.gelu(ln(x)).pow(2).sum())
        for n in (5, 3):
            x = torch.randn(n, 8, 8, 8, device="cuda")
            torch._dynamo.decorators.mark_unbacked(x, 0, hint_override=4)
            got = torch.autograd.grad(step(x), [ln.weight, ln.bias])
            want = torch.autograd.grad(torch.nn.functional.gelu(ln(x)).pow(2).sum(), [ln.weight, ln.bias])
            for g, w in zip(got, want):
                assert g.shape == w.shape == (8, 8, 8)
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_cuda_kernels_are_tuned_for_the_batch_hint():
    """An unbacked batch with a hint: Inductor's Triton kernels carry the hinted sizes (torch 2.11 hinted every
    unbacked dim as 8192, whatever the hint: compat.hint_kernel_size_hints), and run exact at other sizes."""
    import re

    from torch._inductor.utils import run_and_get_code

    from dpcompile.compat import hint_kernel_size_hints

    hint_kernel_size_hints()

    def f(t):
        return (t.sin() * 2).sum(1), t.cos() + 1

    torch._dynamo.reset()
    compiled = torch.compile(f)
    codes = []
    for n in (3, 5, 1):  # one graph for the three
        x = torch.randn(n, 100, device="cuda")
        torch._dynamo.decorators.mark_unbacked(x, 0, hint_override=3)
        got, code = run_and_get_code(compiled, x)
        codes += code
        torch.testing.assert_close(got, f(x))
    hints = [dict(re.findall(r"'(\w+)': (\d+)", h)) for h in re.findall(r"size_hints=\{([^}]*)\}", "".join(codes))]
    assert hints and all("8192" not in h.values() for h in hints), hints
    assert any(h.get("x") in ("4", "512") for h in hints), hints  # the hint's 3 rows (or its 300 elements)


def _unbacked_steps_match_reference(case, schedule, device):
    c = CASES[case]
    model = c.model()
    gpu = copy.deepcopy(model).to(device)
    inputs, targets = c.data(5)
    _, norms = dp_reference(model, c.loss, inputs, targets, max_grad_norm=1.0, expected_batch_size=5)
    C = float(norms.median())
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=5, schedule=schedule)

    def step(xs, ts):
        l = c.loss(gpu(*xs).float(), *ts).mean()
        l.backward()
        return l.detach()

    compiled = torch.compile(step, backend=backend)
    for n in (5, 3, 1, 0):
        xs, ts = (inputs, targets) if n == 5 else c.data(n)
        ref = dp_reference(model, c.loss, xs, ts, max_grad_norm=C, expected_batch_size=5)[0] if n else \
            {name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()}
        xs, ts = tuple(x.to(device) for x in xs), tuple(t.to(device) for t in ts)
        dpcompile.mark_batch(*xs, *ts, hint=4, nonempty=True)
        for p in gpu.parameters():
            p.grad = None
        compiled(xs, ts)
        for name, p in gpu.named_parameters():
            atol = 1e-6 + 1e-5 * float(ref[name].abs().max())
            torch.testing.assert_close(p.grad.double().cpu(), ref[name], rtol=1e-4, atol=atol,
                                       msg=lambda m: f"batch {n}, {name}: {m}")
    assert len([r for r in backend.compiled if r.dp]) == 1  # one graph for the four sizes


@pytest.mark.parametrize("case", ["gpt", "conv_kinds"])
def test_cuda_precompiled_steps_match_reference(case, monkeypatch):
    """DPCOMPILE_PRECOMPILE=1: every kernel op's launches are made out from the graphs and compiled ahead, and
    the step is exact."""
    monkeypatch.setenv("DPCOMPILE_PRECOMPILE", "1")
    c = CASES[case]
    inputs, targets = c.data(4)
    ref, gpu, backend = _clipped_on_cuda(c.model(), c.loss, inputs, targets, schedule="bk", memory_budget=4000)
    for name, p in gpu.named_parameters():
        torch.testing.assert_close(p.grad.double().cpu(), ref[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.summary["kernel_precompile"]["failed"] == [], record.summary["kernel_precompile"]


@functools.lru_cache(maxsize=None)
def _stock_cpp_wrapper_failure() -> str | None:
    """Why stock torch.compile with Inductor's C++ wrapper cannot compile a plain (non-private) training step on
    CUDA with this torch (2.11: "CudaKernelParamCache not populated", BENCHMARKS.md), or None where it can."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).cuda()

    def step(x):
        model(x).square().mean().backward()

    try:
        torch.compile(step, options={"cpp_wrapper": True})(torch.randn(4, 8, device="cuda"))
    except Exception as exc:  # noqa: BLE001 (any failure of the stock compile is torch's, reported as the reason)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        torch._dynamo.reset()
    return None


@pytest.mark.parametrize("case", ["conv_kinds", "kept_gradients"])
def test_cuda_cpp_wrapper_calls_the_norm_ops_exactly(case):
    """Inductor's C++ wrapper on CUDA: the host code calls dpcompile's norm ops through Inductor's fallback, the
    two-output conv_weight_grads (bk's kept per-sample conv gradients) too, and the step is exact. Where this
    torch's C++ wrapper cannot compile a stock non-private training step on CUDA, the DP step cannot either: an
    expected failure with torch's reason (README, option cpp_wrapper)."""
    from torch._inductor.utils import run_and_get_code
    from test_convolution import KeptGradients

    failure = _stock_cpp_wrapper_failure()
    if failure is not None:
        pytest.xfail(f"torch {torch.__version__}'s C++ wrapper fails a stock CUDA training step: {failure}")
    if case == "kept_gradients":
        torch.manual_seed(0)
        model, loss, inputs, targets = KeptGradients(), M.mse, (torch.randn(4, 4, 8, 8),), (torch.randn(4, 2),)
    else:
        c = CASES[case]
        (model, loss), (inputs, targets) = (c.model(), c.loss), c.data(4)
    (ref, gpu, backend), codes = run_and_get_code(lambda: _clipped_on_cuda(
        model, loss, inputs, targets, schedule="bk", conv_norm="direct", cpp_wrapper=True))
    for name, p in gpu.named_parameters():
        torch.testing.assert_close(p.grad.double().cpu(), ref[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters.get("conv_grads_kept", 0) >= 1, rec.counters
    assert all_cpp_wrapper_codes(codes), [c[:300] for c in codes]
    assert any("conv_weight_grads" in c for c in codes)


@pytest.mark.parametrize("case", ["gpt", "llama", "conv_kinds"])
def test_cuda_bk_drops_bad_samples_exactly(case):
    """bk on CUDA, 6 samples of which one has a NaN float input (token models have none) and one an inf loss
    weight, the others' clipped sum exact: the token models' rows of the masked operands are zeroed in place by
    the Triton kernel (dpcompile::zero_rows_); conv_kinds' convolutions keep their per-sample gradients, whose
    clipped sum drops the bad rows (no deferred convolution is left to mask)."""
    c = with_bad_samples(CASES[case])
    inputs, targets = c.data(6)
    model = c.model()
    _, norms = dp_reference(model, c.loss, inputs, targets, max_grad_norm=1.0, reduction=c.reduction,
                            expected_batch_size=6)
    C = finite_median(norms)
    ref, _ = dp_reference(model, c.loss, inputs, targets, max_grad_norm=C, reduction=c.reduction,
                          expected_batch_size=7)
    gpu = copy.deepcopy(model).cuda()
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=7, schedule="bk")

    def step(xs, ts):
        per_sample = c.loss(gpu(*xs), *ts)
        l = per_sample.mean() if c.reduction == "mean" else per_sample.sum()
        l.backward()
        return l.detach()

    torch.compile(step, backend=backend)(tuple(x.cuda() for x in inputs), tuple(t.cuda() for t in targets))
    (rec,) = [r for r in backend.compiled if r.dp]
    check_case_invariants(case, rec.counters, rec.summary)  # conv_kinds keeps per-sample gradients, the rest mask
    assert backend.dropped_samples() == int(bad_samples(inputs, targets).sum())
    for name, p in gpu.named_parameters():
        torch.testing.assert_close(p.grad.double().cpu(), ref[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_cuda_noise_std():
    torch.manual_seed(0)
    model = M.MLP().cuda()
    x, y = torch.randn(4, 5, device="cuda"), torch.randint(0, 3, (4,), device="cuda")
    backend = dpcompile.DPBackend(max_grad_norm=0.5, noise_multiplier=2.0, expected_batch_size=4, seed=11)

    def step(x, y):
        l = M.ce(model(x), y).mean()
        l.backward()
        return l.detach()

    s = torch.compile(step, backend=backend)
    draws = []
    for _ in range(100):
        model.zero_grad(set_to_none=True)
        s(x, y)
        draws.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    z = torch.stack(draws)
    z = z - z.mean(0)  # the clipped sum is the same every step
    std = z.std().item()
    assert abs(std / (2.0 * 0.5 / 4) - 1) < 0.05, std
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters["noise_draws"] == 1, rec.counters


def test_cuda_noise_seeds_reach_the_device_intact():
    """The seeds go to the GPU through pinned memory, a new block each step that the host reuses once the copy
    has run: 50 steps queued behind slow GPU work, without a sync, each arrives as that step's hash."""
    from dpcompile.noise import NoiseSeeds

    ns, ref = NoiseSeeds(123, rank=1), NoiseSeeds(123, rank=1)
    big = torch.randn(4096, 4096, device="cuda")
    drawn = []
    for _ in range(50):
        big = big @ big / 64  # the copies queue behind this
        drawn.append(ns.next(300, torch.device("cuda")))
    torch.cuda.synchronize()
    for step, t in enumerate(drawn):
        assert t.device.type == "cuda" and t.tolist() == ref.seeds_for(step, 300), step


def test_cuda_randn_kernel_draws_standard_normals():
    """dpcompile::randn compiled for the GPU (the chunk draws of every CUDA step): a million draws."""
    import noise_kernel_check

    noise_kernel_check.assert_standard_normal(noise_kernel_check.draw_statistics("cuda", 1_000_003))


def test_cuda_add_randn_adds_the_flat_draw():
    """dpcompile::add_randn compiled for the GPU (the noise of every CUDA step): one launch through the address
    table and the per-tensor launches, against the flat draw, every layout and dtype."""
    import noise_kernel_check

    noise_kernel_check.assert_adds_flat_draw(noise_kernel_check.add_randn_cases("cuda"))


def test_cuda_graph_add_randn_captures_its_table():
    """dpcompile::add_randn in a CUDA graph (cudagraphs=True steps): one table kernel per pair of dtypes, whose
    table's copy replays with the graph, and every replay adds its seed's draw to that replay's gradients."""
    import noise_kernel_check

    noise_kernel_check.assert_graph_replays(noise_kernel_check.graph_replays("cuda"))


def test_cuda_normals_reach_the_gaussian_tails():
    """normals4 compiled for the GPU (its approximate log, sqrt, sin and cos) against numpy's Philox and a float64
    Box-Muller, the refined radius words included."""
    import noise_kernel_check

    noise_kernel_check.assert_tails(noise_kernel_check.tail_cases("cuda"))


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_cuda_bf16_grouped_matmuls_of_sorted_experts(schedule):
    """Routed experts in the grouped form in bf16 (tests/test_sorted_experts.py): torch._grouped_mm through
    Inductor's CUDA lowering, forward, input gradient and the grouped weight gradient over sorted rows."""
    torch.manual_seed(0)
    model = M.SortedExperts(d=16, hidden=32).to(torch.bfloat16)
    x, y = torch.randn(4, 5, 16).bfloat16(), torch.randn(4, 5, 3)
    ref, gpu, backend = _clipped_on_cuda(model, M.mse, (x,), (y,), schedule=schedule)
    (record,) = [r for r in backend.compiled if r.dp]
    assert "aten._grouped_mm" in record.graphs["joint_graph_after_dp"]
    assert sum(v for k, v in record.counters.items() if k.startswith("norm_grouped_")) == 6, record.counters
    assert_bf16_close(gpu, ref)


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_cuda_bf16_hugging_face_mixtral_default_experts(schedule):
    """transformers' Mixtral as built (experts_implementation="grouped_mm", its default) in bf16: its experts
    through torch._grouped_mm over the batch's tokens sorted by expert; the oracle runs the same bf16 weights in
    the batched_mm form."""
    from transformers import MixtralConfig, MixtralForCausalLM

    class Logits(torch.nn.Module):
        def __init__(self, form):
            super().__init__()
            torch.manual_seed(0)
            self.m = MixtralForCausalLM(MixtralConfig(
                vocab_size=29, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
                experts_implementation=form)).to(torch.bfloat16)

        def forward(self, x):
            return self.m(x, use_cache=False).logits

    model, twin = Logits("grouped_mm"), Logits("batched_mm")
    twin.load_state_dict(model.state_dict())
    x, y = torch.randint(0, 29, (4, 8)), torch.randint(0, 29, (4, 8))
    ref, gpu, backend = _clipped_on_cuda(model, M.seq_ce, (x,), (y,), oracle=twin, schedule=schedule)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters.get("norm_grouped_ghost", 0) + record.counters.get("norm_grouped_direct", 0) == 2
    assert_bf16_close(gpu, ref)


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
@pytest.mark.parametrize("case", ["gpt", "llama"])
def test_cuda_bf16_model_matches_reference(case, schedule):
    """A bf16 model: the norm contractions take the bf16 factors as they are (aten.bmm.dtype, fp32
    accumulation). Against the fp64 oracle on the same bf16-rounded weights, with bf16 tolerances."""
    c = CASES[case]
    torch.manual_seed(0)
    model = c.model().to(torch.bfloat16)
    inputs, targets = c.data(4)
    ref, gpu, backend = _clipped_on_cuda(model, c.loss, inputs, targets, schedule=schedule)
    (record,) = [r for r in backend.compiled if r.dp]
    assert_norms_read_bf16(record)
    assert record.counters["contractions_padded"] > 0  # the odd vocab (13) and sequence (6), zero-padded
    assert_bf16_close(gpu, ref)


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
@pytest.mark.parametrize("case", ["gpt", "llama"])
def test_cuda_autocast_model_matches_reference(case, schedule):
    """fp32 parameters under bf16 autocast (what users train in): the linears' bf16 gradients (gpt's bias
    gradients: parts of one cast of their clipped sum) against the fp64 oracle, with bf16 tolerances."""
    c = CASES[case]
    torch.manual_seed(0)
    inputs, targets = c.data(4)
    ref, gpu, backend = _clipped_on_cuda(M.Autocast(c.model()), c.loss, inputs, targets, schedule=schedule)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters.get("clipped_row_sums_cast", 0) == (case == "gpt"), record.counters
    assert_bf16_close(gpu, ref)


def test_cuda_conv_norm_kernel_matches_autograd_per_sample_gradients():
    """dpcompile.conv_sq_norms' Triton kernel compiled for the GPU: bf16 (which the CPU interpreter cannot check),
    fp16 and fp32 (exact_fp32: no TF32), channels-last too, against fp64 autograd on the rounded operands."""
    import conv_kernel_check
    from dpcompile import conv_sq_norms

    for channels_last in (False, True):
        worst = conv_kernel_check.errors(conv_sq_norms.launch, "cuda", [torch.bfloat16, torch.float16, torch.float32],
                                         channels_last=channels_last)
        assert len(worst) == 3 * len(conv_kernel_check.CASES) and max(worst.values()) < 1e-4, worst
        # with the per-sample gradients kept (conv_weight_grads)
        keep = lambda *a: conv_sq_norms.launch(*a, keep=True)  # noqa: E731
        worst = conv_kernel_check.errors(keep, "cuda", [torch.bfloat16, torch.float32], channels_last=channels_last,
                                         keep=True)
        assert len(worst) == 4 * len(conv_kernel_check.CASES) and max(worst.values()) < 1e-4, worst


def test_cuda_gram_norm_kernel_matches_per_sample_gradient_norms():
    """dpcompile.gram_sq_norms' Triton kernel compiled for the GPU: bf16 (which the CPU interpreter cannot check),
    fp16 and fp32 (no TF32 here), every operand layout of the cases, against fp64 on the rounded operands; and
    with TF32, as a step with allow_tf32 runs it, to TF32's rounding."""
    import gram_kernel_check
    from dpcompile import gram_sq_norms

    gram_sq_norms._PLANS.clear()
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    worst = {**gram_kernel_check.errors(gram_sq_norms.launch, "cuda", dtypes),
             **gram_kernel_check.split_errors("cuda", dtypes)}
    assert len(worst) == 2 * 3 * len(gram_kernel_check.CASES) and max(worst.values()) < 1e-4, worst
    # many contractions in one call, through the table kernel: its blocks the one-contraction kernel's bits
    grouped = gram_kernel_check.group_errors("cuda", dtypes)
    assert all(grouped[f"columns:{str(dt).split('.')[-1]}"] == 0 for dt in dtypes), grouped
    assert max(grouped.values()) < 1e-4, grouped
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        worst = gram_kernel_check.errors(gram_sq_norms.launch, "cuda", [torch.float32])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert max(worst.values()) < 1e-2, worst


def test_cuda_zero_rows_kernel_matches_masked_fill():
    """dpcompile::zero_rows_'s Triton kernels compiled for the GPU, every layout of zero_rows_check (channels-last,
    padded rows, transposed and permuted views), bf16, fp16 and fp32, one tensor a launch and all in one; and the
    op takes them on CUDA."""
    import zero_rows_check
    from dpcompile import zero_rows

    report = zero_rows_check.mismatches(zero_rows.launch, "cuda", [torch.bfloat16, torch.float16, torch.float32])
    assert len(report) == 3 * len(list(zero_rows_check._layouts("cpu", torch.float32))), report
    assert set(report.values()) == {0}, report
    report = zero_rows_check.mismatches(lambda x, keep, dim: torch.ops.dpcompile.zero_rows_([x], [keep], [dim]),
                                        "cuda", [torch.bfloat16])
    assert set(report.values()) == {0}, report
    # all layouts and dtypes in one launch of the table kernel, and through the op (which takes it for many)
    for launch_table in (zero_rows.launch_table, torch.ops.dpcompile.zero_rows_):
        report = zero_rows_check.table_mismatches(launch_table, "cuda", [torch.bfloat16, torch.float32])
        assert len(report) == 2 * len(list(zero_rows_check._layouts("cpu", torch.float32))), report
        assert set(report.values()) == {0}, report


def test_cuda_direct_launches_match_tritons_launcher():
    """kernel_plans.launch: the first launch of a specialisation goes through Triton's launcher, later ones call
    the compiled kernel directly; the same values either way, and an operand that is not 16-byte aligned (Triton
    compiles another kernel for it) gets its own entry."""
    from dpcompile import add_randn, gram_sq_norms, kernel_plans, zero_rows

    kernel_plans._COMPILED.clear()
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4, 37, 24, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = torch.randn(4, 37, 40, device="cuda", dtype=torch.bfloat16, generator=gen)
    shifted = torch.empty(a.numel() + 1, device="cuda", dtype=a.dtype)[1:].view(a.shape).copy_(a)
    assert shifted.data_ptr() % 16 != 0
    runs = [gram_sq_norms.launch(x, g) for x in (a, a, shifted, shifted)]
    assert len(kernel_plans._COMPILED) == 2
    for r in runs[1:]:
        torch.testing.assert_close(r, runs[0], rtol=0, atol=0)
    x = torch.randn(6, 33, device="cuda", generator=gen)
    keep = torch.tensor([True, False, True, True, False, True], device="cuda")
    for _ in range(2):
        y = x.clone()
        zero_rows.launch(y, keep, 0)
        torch.testing.assert_close(y, x * keep[:, None], rtol=0, atol=0)
    seeds = torch.tensor([11, 12], device="cuda")
    grads = [torch.randn(300, device="cuda", generator=gen), torch.randn(7, 9, device="cuda", generator=gen)]
    scale = torch.tensor(0.5, device="cuda")
    noisy = [torch.ops.dpcompile.add_randn(grads, seeds, 1, scale) for _ in range(2)]
    for n0, n1, gr in zip(*noisy, grads):
        torch.testing.assert_close(n0, n1, rtol=0, atol=0)
        assert (n0 - gr).abs().max() > 0
    assert len(kernel_plans._COMPILED) == 4  # gram twice, zero_rows, add_randn's table kernel


def test_cuda_eager_run_of_a_dp_trained_model_raises():
    """A CUDA backward runs its hooks on autograd's device thread: the guard's error still reaches the caller,
    and dpcompile.non_private() (entered on the calling thread) still lets a non-private backward through."""
    import dist_worker

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=False):
        rep = dist_worker.eager_guard_report(None, "cuda")
    assert "no dp_fsdp graph produced" in rep["eager"] and all(rep["cleared"]), rep
    assert rep["dp_grads"] and rep["non_private"] and rep["dp_again"], rep


def test_cuda_precompiled_kernel_is_the_one_launched():
    """A kernel compiled ahead from a graph's fake values (dpcompile.precompile) is the specialisation the real
    launch asks for: Triton's cache of the kernel grows at the compile, not again at the launch."""
    from dpcompile import gram_sq_norms, kernel_plans, precompile, triton_kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    # widths no other test uses: a specialisation not compiled yet in this process
    a = torch.randn(3, 45, 40, device="cuda", generator=gen)
    g = torch.randn(3, 45, 88, device="cuda", generator=gen)
    launches = precompile.recorded_launches([precompile.op_graph(torch.ops.dpcompile.gram_sq_norms.default, a, g)])
    cache = triton_kernels.gram_sq_norms_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    assert kernel_plans.precompile(launches) == 1
    kernel_plans.wait_for_precompiles()
    assert len(cache) == before + 1
    out = gram_sq_norms.launch(a, g)
    assert len(cache) == before + 1
    # and later launches call that compiled kernel directly (kernel_plans._direct took it)
    direct = [entry[0] for key, entry in kernel_plans._COMPILED.items()
              if key[0] is triton_kernels.gram_sq_norms_kernel]
    assert any(d is compiled for d in direct for compiled in cache.values())
    expected = torch.einsum("bsp,btp,bsm,btm->b", a.double(), a.double(), g.double(), g.double())
    torch.testing.assert_close(out.sum(1).double(), expected, rtol=1e-4, atol=1e-4)


def test_cuda_precompiled_table_kernel_is_the_one_launched():
    """The same for bk's grouped Gram norms (dpcompile::gram_sq_norms_group): the table kernel compiled ahead from
    the op's fake operands is the one its launch takes, and the grouped sums are the one-contraction kernel's."""
    from dpcompile import gram_sq_norms, kernel_plans, precompile, triton_kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    pairs = [(torch.randn(3, 45, w, device="cuda", generator=gen), torch.randn(3, 45, 93, device="cuda", generator=gen))
             for w in (41, 41)]  # widths no other test uses; one signature, one launch
    graph = precompile.op_graph(torch.ops.dpcompile.gram_sq_norms_group.default, *[t for p in pairs for t in p],
                                arrange=lambda n: ([n[0], n[2]], [n[1], n[3]]))
    launches = precompile.recorded_launches([graph])
    assert len(launches) == 1 and launches[0][0] is triton_kernels.gram_sq_norms_table_kernel, launches
    cache = triton_kernels.gram_sq_norms_table_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    assert kernel_plans.precompile(launches) == 1
    kernel_plans.wait_for_precompiles()
    assert len(cache) == before + 1
    out = gram_sq_norms.launch_group([a for a, _ in pairs], [g for _, g in pairs])
    torch.cuda.synchronize()
    assert len(cache) == before + 1
    alone = torch.cat([gram_sq_norms.launch(a, g) for a, g in pairs], 1)
    torch.testing.assert_close(out, alone, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_split_gathered_through_inductor(dtype):
    """dpcompile::split_gathered (a bucketed all-gather's copy-out, dpcompile.gathered_copy_out) on CUDA, eager and
    as an extern call in Inductor's code between Triton kernels that write the bucket and read the copies: each
    copy holds its part's columns rank by rank. (Sharded steps need 2 GPUs for NCCL; CI's gloo ranks run it on CPU.)"""
    from torch._inductor.utils import run_and_get_code

    bucket = torch.randn(2, 12, device="cuda", dtype=dtype)
    sizes = [6, 2, 4]

    def f(b):
        w, bias, rest = torch.ops.dpcompile.split_gathered(b * 2, sizes)
        return w.view(3, 4).relu(), bias + 1, rest.view(2, 4) * 3

    want = [t.float() for t in f(bucket)]
    got, codes = run_and_get_code(torch.compile(f, fullgraph=True), bucket)
    assert any("dpcompile.split_gathered" in c for c in codes)
    doubled = (bucket * 2).float()
    cols = [doubled[:, 0:6].reshape(3, 4).relu(), doubled[:, 6:8].reshape(-1) + 1, doubled[:, 8:12].reshape(2, 4) * 3]
    for g, w, c in zip(got, want, cols):
        torch.testing.assert_close(g.float(), w, rtol=0, atol=0)
        torch.testing.assert_close(g.float(), c, rtol=1e-2 if dtype == torch.bfloat16 else 0,
                                   atol=1e-2 if dtype == torch.bfloat16 else 0)
