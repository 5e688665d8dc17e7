"""Noise: one N(0, s^2 C^2) k draw per coordinate and step, seeded, never repeated."""
import numpy as np
import pytest
import scipy.stats
import torch

import dpcompile
import dpcompile.passes.noise as noise_pass
import models as M
from helpers import compile_step


def _grads(model):
    return torch.cat([p.grad.detach().flatten().clone() for p in model.parameters()])


def _run_steps(seed, n_steps, *, sigma=1.3, C=0.7, ebs=5, reduction="mean", compiler="inductor"):
    torch.manual_seed(0)
    model = M.MLP()
    x, y = torch.randn(4, 5) * 2, torch.randint(0, 3, (4,))
    # the noiseless reference op by op (CI time): the noisy steps below take the compiler under test
    noiseless, _ = compile_step(model, M.ce, reduction=reduction, max_grad_norm=C, noise_multiplier=0.0,
                                expected_batch_size=ebs, compiler="eager")
    model.zero_grad(set_to_none=True)
    noiseless((x,), (y,))
    clean = _grads(model)
    torch._dynamo.reset()
    step, backend = compile_step(model, M.ce, reduction=reduction, max_grad_norm=C, noise_multiplier=sigma,
                                 expected_batch_size=ebs, seed=seed, compiler=compiler)
    draws = []
    for _ in range(n_steps):
        model.zero_grad(set_to_none=True)
        step((x,), (y,))
        draws.append(_grads(model) - clean)
    k = 1.0 / ebs if reduction == "mean" else 1.0
    return torch.stack(draws).double(), sigma * C * k, backend


# compiler="eager" runs the same op eagerly. chunk: how many coordinates one draw covers (passes/noise.py); the
# MLP's parameters have 35, 7, 21 and 3: None = the default, all in one draw; 40 = [35] and [7, 21, 3]; 8 = 35
# and 21 alone, 7 and 3 each a chunk of one
@pytest.mark.parametrize("reduction,compiler,chunk", [("mean", "inductor", None), ("sum", "inductor", None),
                                                      ("mean", "eager", None), ("mean", "inductor", 40),
                                                      ("mean", "inductor", 8)])
def test_noise_is_gaussian_with_std_sCk_and_mean_zero(reduction, compiler, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(noise_pass, "CHUNK_NUMEL", chunk)
    z, std, backend = _run_steps(seed=1234, n_steps=150, reduction=reduction, compiler=compiler)
    draws = {None: 1, 40: 2, 8: 4}[chunk]
    assert backend.compiled[0].counters["noise_draws"] == draws
    n = z.numel()  # 150 steps x 64 coordinates
    flat = (z / std).flatten().numpy()
    # mean 0: |mean| of n standard normals is below 4.5/sqrt(n) except with prob ~7e-6
    assert abs(flat.mean()) < 4.5 / np.sqrt(n), flat.mean()
    # variance 1: chi-square bounds at the 1e-6 level
    lo, hi = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], n) / n
    assert lo < (flat ** 2).mean() < hi, (flat ** 2).mean()
    # Gaussian shape
    assert scipy.stats.kstest(flat, "norm").pvalue > 1e-4
    # every coordinate gets noise of the same scale (no coordinate skipped or doubled)
    per_coord = (z / std).pow(2).mean(0).numpy()
    lo_c, hi_c = scipy.stats.chi2.ppf([1e-7, 1 - 1e-7], z.shape[0]) / z.shape[0]
    assert ((per_coord > lo_c) & (per_coord < hi_c)).all(), per_coord


@pytest.mark.parametrize("compiler,chunk", [("inductor", None), ("eager", None), ("inductor", 8)])
def test_draws_are_independent_across_steps_and_coordinates(compiler, chunk, monkeypatch):
    if chunk is not None:  # parameters with draws of their own: different seeds' streams uncorrelated too
        monkeypatch.setattr(noise_pass, "CHUNK_NUMEL", chunk)
    z, std, _ = _run_steps(seed=99, n_steps=150, compiler=compiler)
    z = (z / std).numpy()
    # successive steps uncorrelated
    r_steps = np.corrcoef(z[:-1].flatten(), z[1:].flatten())[0, 1]
    assert abs(r_steps) < 4.5 / np.sqrt(z[:-1].size), r_steps
    # coordinates uncorrelated with each other (different parameters' streams included)
    c = np.corrcoef(z.T)
    off = c[~np.eye(c.shape[0], dtype=bool)]
    assert np.abs(off).max() < 0.5, np.abs(off).max()
    assert abs(off.mean()) < 0.02, off.mean()


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_same_seed_reproduces_and_different_seeds_differ(compiler):
    a, _, _ = _run_steps(seed=7, n_steps=3, compiler=compiler)
    torch._dynamo.reset()
    b, _, _ = _run_steps(seed=7, n_steps=3, compiler=compiler)
    torch._dynamo.reset()
    c, _, _ = _run_steps(seed=8, n_steps=3, compiler=compiler)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)  # (_run_steps seeds torch's global generator alike: the seed decides)
    assert not torch.allclose(a[0], a[1])  # a fresh draw every step


def test_noise_state_round_trips_for_checkpoints():
    z, _, backend = _run_steps(seed=5, n_steps=4)
    state = backend.state_dict()
    assert state["step"] == 4 and state["seed"] == 5
    fresh = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    fresh.load_state_dict(state)
    assert fresh.noise.seeds_for(4, 3) == backend.noise.seeds_for(4, 3)
    assert fresh.noise.seeds_for(3, 3) != fresh.noise.seeds_for(4, 3)
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state_dict({"seed": 1})


def test_unseeded_backends_draw_different_seeds():
    a = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    b = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    assert a.noise.seed != b.noise.seed


def test_seeds_are_the_splitmix64_stream_in_int64():
    # the vectorised derivation is the documented hash (checkpoints of earlier runs resume the same stream):
    # seed i = splitmix64(base(rank of i) ^ splitmix64(i + 1)) as int64, base(r) from (seed, step, r)
    from dpcompile.noise import NoiseSeeds, splitmix64

    def reference(ns, step, n):
        def base(r):
            return splitmix64(ns.seed ^ splitmix64(step) ^ splitmix64((r + 1) << 40))
        out = [splitmix64(base(ns.index_ranks.get(i, ns.rank)) ^ splitmix64(i + 1)) for i in range(n)]
        return [v - (1 << 64) if v >= 1 << 63 else v for v in out]

    for seed, rank, step in [(0, 0, 0), (7, 1, 3), ((1 << 64) - 1, 3, 12345), (2**40 + 17, 0, 2**33)]:
        ns = NoiseSeeds(seed, rank=rank)
        assert ns.seeds_for(step, 9) == reference(ns, step, 9)
        ns.index_ranks = {2: 0, 5: 7}  # tensor parallel: a replicated parameter's stream is another rank's
        assert ns.seeds_for(step, 9) == reference(ns, step, 9)
        step = ns.step
        drawn = ns.next(9, torch.device("cpu"))
        assert drawn.dtype == torch.int64 and drawn.tolist() == reference(ns, step, 9) and ns.step == step + 1


def test_the_triton_draw_is_standard_normal_and_so_is_the_steps_noise():
    """dpcompile::randn's kernel (CUDA's chunk draws) under the Triton interpreter: alone, and as the compiled
    step's noise (mean 0, std s C k, every coordinate, fresh each step)."""
    import noise_kernel_check
    from helpers import run_interpreted

    report = run_interpreted("noise_kernel_check.py")
    noise_kernel_check.assert_standard_normal(report["kernel"])
    step = report["step"]
    assert step["counters"]["noise_draws"] == 1, step["counters"]
    n = step["n"]
    assert abs(step["mean"]) < 4.5 / np.sqrt(n), step
    lo, hi = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], n) / n
    assert lo < step["mean_sq"] < hi, step
    assert step["ks_p"] > 1e-4 and abs(step["steps_corr"]) < 4.5 / np.sqrt(n), step


@pytest.mark.parametrize("chunk", [None, 8])
def test_draws_through_the_op_are_gaussian(chunk, monkeypatch):
    """The op's plumbing on CPU (torch's generator behind it there): every chunk, and every parameter with a draw
    of its own, drawn and added by dpcompile::add_randn, no foreach add, Gaussian noise of the right scale."""
    if chunk is not None:
        monkeypatch.setattr(noise_pass, "CHUNK_NUMEL", chunk)  # 35 and 21 alone, [7] and [3] as chunks
    z, std, backend = _run_steps(seed=5, n_steps=60)
    c = backend.compiled[0].counters
    draws = {None: 1, 8: 4}[chunk]
    assert c["noise_draws"] == draws, c
    flat = (z / std).flatten().numpy()
    lo, hi = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], flat.size) / flat.size
    assert lo < (flat ** 2).mean() < hi and abs(flat.mean()) < 4.5 / np.sqrt(flat.size)
    assert abs(np.corrcoef((z / std)[:-1].flatten(), (z / std)[1:].flatten())[0, 1]) < 4.5 / np.sqrt(flat.size)


def test_normals_reach_the_gaussian_tails():
    """The kernels' normals (normals4) against numpy's Philox4x32-10 and a float64 Box-Muller, on counters whose
    radius word is below 256 (where the uniform takes 32 more bits) and ordinary ones; the radius never clamped:
    up to 9.49 (Triton's tl.randn stops at 5.68, which a DP guarantee does not allow for)."""
    import noise_kernel_check
    from helpers import run_interpreted

    noise_kernel_check.assert_tails(run_interpreted("noise_kernel_check.py", "tails")["cpu"])


def test_add_randn_kernel_adds_the_flat_draw():
    """dpcompile::add_randn's kernels under the Triton interpreter against the reference (dpcompile::randn's flat
    draw sliced at each tensor's first program): every layout and dtype, one launch or one per tensor."""
    import noise_kernel_check
    from helpers import run_interpreted

    report = run_interpreted("noise_kernel_check.py", "add_randn")
    for name, case in report.items():
        noise_kernel_check.assert_adds_flat_draw(case)


def _autocast_llama_grads(n_steps, seed, **options):
    """fp32 parameters, bf16 autocast: the flattened gradients of n_steps steps and the backend."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = M.LlamaLM(vocab=32, d=16)
    x, y = torch.randint(0, 32, (4, 6)), torch.randint(0, 32, (4, 6))

    @dpcompile.private_step(max_grad_norm=0.5, expected_batch_size=4, seed=seed, **options)
    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = M.seq_ce(model(x), y).mean()
        loss.backward()
        return loss.detach()

    out = []
    for _ in range(n_steps):
        model.zero_grad(set_to_none=True)
        step(x, y)
        out.append(_grads(model))
    return torch.stack(out).double(), step.dp_backend


def test_autocast_gradients_take_the_cast_into_the_op(monkeypatch):
    """bf16 autocast, fp32 parameters: the op reads each bf16 weight gradient before its cast to fp32 and writes
    fp32 (counter noise_casts_taken_in); the noise is N(0, (s C k)^2) on every coordinate around the clipped
    gradient computed without noise."""
    sigma = 0.9
    clean, _ = _autocast_llama_grads(1, 0, noise_multiplier=0.0, compiler="eager")  # the centre, op by op
    noisy, backend = _autocast_llama_grads(12, 7, noise_multiplier=sigma)  # 12 x 2672 coordinates (CI time: 40 steps)
    (rec,) = [r for r in backend.compiled if r.dp]
    n_linear = 7 + 1  # the block's q, k, v, o, gate, up, down and the head: bf16 gradients under autocast
    assert rec.counters["noise_casts_taken_in"] == n_linear and rec.counters["noise_draws"] == 1, rec.counters
    z = ((noisy - clean) / (sigma * 0.5 / 4)).flatten().numpy()
    lo, hi = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], z.size) / z.size
    assert lo < (z ** 2).mean() < hi and abs(z.mean()) < 4.5 / np.sqrt(z.size), ((z ** 2).mean(), z.mean())
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-4


def test_cuda_graph_steps_add_the_ops_values(monkeypatch):
    """Steps replayed as CUDA graphs draw through the same op (its address table's copy captured in the graph),
    so a step gives the same gradients with and without graphs (on CPU, where there are no graphs, the option
    still goes through the pass)."""
    op, op_backend = _autocast_llama_grads(3, 11, noise_multiplier=1.1)
    graphed, graphed_backend = _autocast_llama_grads(3, 11, noise_multiplier=1.1, cudagraphs=True)
    for backend in (op_backend, graphed_backend):
        (rec,) = [r for r in backend.compiled if r.dp]
        assert rec.counters["noise_draws"] == 1, rec.counters
        assert "dpcompile.add_randn.default" in [op for op, _ in rec.ops["backward"]], rec.ops["backward"]
    torch.testing.assert_close(graphed, op, rtol=0, atol=0)
    assert (op[1] != op[0]).all()  # fresh noise each step


@pytest.mark.parametrize("multiply", ["wrapping", "split"])
@pytest.mark.parametrize("seed", [-0x1234_5678_9ABC_DEF1, 0x123456789ABCDEF])
def test_cpu_draws_use_all_64_bits_of_the_seed(seed, multiply, monkeypatch):
    """Without Triton the normals come from dpcompile.philox's torch ops: Philox4x32-10 as numpy computes it, keyed
    by the whole seed (torch's CPU generator and Inductor's CPU RNG keep 32 bits of it, so two draws of a long run
    would repeat each other with probability n^2 / 2^33), and the kernels' Box-Muller (refined radius words: for
    the second seed, counters 12717215 and 12981371 take the refinement). Both ways of taking Philox's products
    (one wrapping int64 multiply, used where this build's multiply wraps, and the split one) give numpy's words."""
    import noise_kernel_check
    from dpcompile import philox
    from dpcompile import randn as R

    if multiply == "wrapping":
        assert philox._mul_hi_lo() is philox._mul_hi_lo_wrapping  # torch's int64 multiply wraps on this build
    else:
        monkeypatch.setattr(philox, "_mul_hi_lo", lambda: philox._mul_hi_lo_split)
    counters = torch.cat([torch.arange(5000), torch.tensor([12717215, 12981371, (1 << 32) + 5])])
    if seed == 0x123456789ABCDEF:
        w1, _, w3, _ = philox.philox4x32(seed, counters[5000:5002])
        assert (torch.minimum(w1, w3) < 256).all(), (w1, w3)
    ours = np.stack([w.numpy() for w in philox.philox4x32(seed, counters)])
    ref = np.stack(noise_kernel_check.philox4x32(seed & (2 ** 64 - 1), counters.numpy().astype(np.uint64)))
    assert (ours == ref.astype(np.int64)).all()
    normals = np.stack([z.numpy() for z in philox.normals4(seed, counters)])
    np.testing.assert_allclose(normals, noise_kernel_check.reference_normals(seed & (2 ** 64 - 1),
                                                                             counters.numpy().astype(np.uint64)),
                               rtol=0, atol=1e-12)
    seeds = torch.tensor([7, 7 + (1 << 32), 7], dtype=torch.int64)
    a, b, c = (R.randn(seeds, i, 1000) for i in range(3))
    assert torch.equal(a, c) and abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 0.2
    # a coordinate's value does not depend on the draw's length
    assert torch.equal(R.randn(seeds, 0, 5000)[:1000], a)
