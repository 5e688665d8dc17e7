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
    noiseless, _ = compile_step(model, M.ce, reduction=reduction, max_grad_norm=C, noise_multiplier=0.0,
                                expected_batch_size=ebs, compiler=compiler)
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


# compiler="eager" draws the noise with torch's generator from the same seeds (not Inductor's kernels).
# chunk: how many coordinates one flat draw covers (passes/noise.py); the MLP's parameters have 35, 7, 21
# and 3: None = the default, all in one draw; 40 = [35] and [7, 21, 3]; 8 = 35 and 21 alone, added
# without a foreach, 7 and 3 each a chunk of one
@pytest.mark.parametrize("reduction,compiler,chunk", [("mean", "inductor", None), ("sum", "inductor", None),
                                                      ("mean", "eager", None), ("mean", "inductor", 40),
                                                      ("mean", "inductor", 8)])
def test_noise_is_gaussian_with_std_sCk_and_mean_zero(reduction, compiler, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(noise_pass, "CHUNK_NUMEL", chunk)
    z, std, backend = _run_steps(seed=1234, n_steps=150, reduction=reduction, compiler=compiler)
    draws, foreach_adds = {None: (1, 1), 40: (2, 2), 8: (4, 2)}[chunk]
    assert backend.compiled[0].counters["noise_draws"] == draws
    assert backend.compiled[0].counters["noise_foreach_adds"] == foreach_adds
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
        assert ns.next(9, torch.device("cpu")).dtype == torch.int64


def test_the_triton_draw_is_standard_normal_and_so_is_the_steps_noise():
    """dpcompile::randn's kernel (CUDA's chunk draws) under the Triton interpreter: alone, and as the compiled
    step's noise (mean 0, std s C k, every coordinate, fresh each step)."""
    import noise_kernel_check
    from helpers import run_interpreted

    report = run_interpreted("noise_kernel_check.py")
    noise_kernel_check.assert_standard_normal(report["kernel"])
    step = report["step"]
    assert step["counters"]["noise_draws_triton"] == step["counters"]["noise_draws"] == 1, step["counters"]
    n = step["n"]
    assert abs(step["mean"]) < 4.5 / np.sqrt(n), step
    lo, hi = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], n) / n
    assert lo < step["mean_sq"] < hi, step
    assert step["ks_p"] > 1e-4 and abs(step["steps_corr"]) < 4.5 / np.sqrt(n), step


def test_chunk_draws_through_the_op_keep_the_graph(monkeypatch):
    """The op's plumbing on CPU (torch's generator behind it there): flat chunk draws on the op, a parameter
    with a draw of its own on Inductor's fused RNG, the same foreach adds, Gaussian noise of the right scale."""
    monkeypatch.setattr(noise_pass, "TRITON_DRAW_DEVICES", ("cpu",))
    monkeypatch.setattr(noise_pass, "CHUNK_NUMEL", 8)  # 35 and 21 alone, [7] and [3] as chunks
    z, std, backend = _run_steps(seed=5, n_steps=60)
    c = backend.compiled[0].counters
    assert (c["noise_draws"], c["noise_draws_triton"], c["noise_foreach_adds"]) == (4, 2, 2), c
    flat = (z / std).flatten().numpy()
    lo, hi = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], flat.size) / flat.size
    assert lo < (flat ** 2).mean() < hi and abs(flat.mean()) < 4.5 / np.sqrt(flat.size)
