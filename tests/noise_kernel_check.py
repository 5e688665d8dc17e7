"""dpcompile's noise kernels (four normals per Philox call): dpcompile::randn's flat draw and dpcompile::add_randn,
which adds it to gradients. Run as a script with TRITON_INTERPRET=1 (set before triton is imported:
tests/test_noise.py starts it in a process of its own) it checks the kernels on CPU tensors, the draw alone and as
the compiled step's noise, or (argument ``add_randn``) the fused add against the flat draw, or (argument
``tails``) the normals' transform against a numpy Philox and Box-Muller, where the radius's uniform is refined;
tests/test_gpu.py imports ``draw_statistics``, ``add_randn_cases``, ``graph_replays`` and ``tail_cases`` for
CUDA."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import scipy.stats
import torch


def draw_statistics(device: str, numel: int) -> dict:
    """What the tests assert about one draw of ``numel`` (not a multiple of a program's 4096 outputs) and its
    neighbours (``assert_standard_normal``): standard normal coordinates, the same for the same seed, unrelated
    for another seed, a coordinate's value independent of the draw's length."""
    from dpcompile import randn as R

    seeds = torch.tensor([11, 12, 11], dtype=torch.int64, device=device)
    z = R.launch(seeds, 0, numel)
    again, other, same_seed = R.launch(seeds, 0, numel), R.launch(seeds, 1, numel), R.launch(seeds, 2, numel)
    # the op writes into a buffer of its own: a longer draw's first numel coordinates are the same values
    longer = R.launch(seeds, 0, numel + 4096)
    flat = z.double().cpu().numpy()
    lanes = z[: (numel // 4096) * 4096].view(-1, 4, 1024).transpose(0, 1).reshape(4, -1).double().cpu().numpy()
    return {
        "numel": numel,
        "finite": bool(torch.isfinite(z).all()),
        "mean": float(flat.mean()),
        "mean_sq": float((flat ** 2).mean()),
        "ks_p": float(scipy.stats.kstest(flat, "norm").pvalue),
        "reproduces": bool(torch.equal(z, again)) and bool(torch.equal(z, same_seed)),
        "prefix_of_longer": bool(torch.equal(z, longer[:numel])),
        "other_seed_corr": float(np.corrcoef(flat, other.double().cpu().numpy())[0, 1]),
        # the four normals of one Philox call land in four quarters of a program's outputs
        "lane_corr_max": float(np.abs(np.corrcoef(lanes) - np.eye(4)).max()),
    }


def assert_standard_normal(stats: dict) -> None:
    n = stats["numel"]
    assert stats["finite"] and stats["reproduces"] and stats["prefix_of_longer"], stats
    # |mean| of n standard normals below 4.5 / sqrt(n) but with probability ~7e-6; chi-square bounds at 1e-6
    assert abs(stats["mean"]) < 4.5 / np.sqrt(n), stats
    lo, hi = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], n) / n
    assert lo < stats["mean_sq"] < hi, stats
    assert stats["ks_p"] > 1e-4, stats
    assert abs(stats["other_seed_corr"]) < 4.5 / np.sqrt(n), stats
    # 6 pairs of quarters, each correlation over n / 4 draws
    assert stats["lane_corr_max"] < 5.0 / np.sqrt(n / 4), stats


def _gradients(device: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Gradients of every layout (contiguous, transposed, a strided slice the op copies, empty, several programs
    long) and dtype."""
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    grads = [t(35), t(3, 4096 + 5), t(7, 9).t(), t(5000)[::2], t(0), t(2, 3, 4).permute(2, 0, 1),
             t(4, 6, dtype=torch.float64), t(10, 50, dtype=torch.bfloat16), t(3 * 4096 + 1)]
    return grads + [t(700 * k + 1) for k in range(20)]  # a deeper search for a program's tensor


def _gaps(xs, ys) -> dict:
    return {str(dt): max([float((x.double() - y.double()).abs().max()) for x, y in zip(xs, ys)
                          if x.dtype == dt and x.numel()] or [0.0])
            for dt in (torch.float32, torch.float64, torch.bfloat16)}


def graph_replays(device: str = "cuda") -> dict:
    """dpcompile::add_randn captured in a CUDA graph (cudagraphs=True steps): the address table's copy is a node
    of the graph. The graph frees the table and writes -1 over its memory after the kernels; two replays, each
    with new gradient values and a new seed, must each add that seed's draw, and launch one table kernel per pair
    of dtypes (three here), no per-tensor kernel."""
    from torch.profiler import ProfilerActivity, profile

    from dpcompile import add_randn as A

    gen = torch.Generator().manual_seed(1)
    static = [g.clone() for g in _gradients(device, gen)]
    seeds = torch.tensor([3, 4], dtype=torch.int64, device=device)
    scale = torch.tensor(0.5, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels before the capture, as torch.cuda.graph's users warm up
        torch.ops.dpcompile.add_randn(static, seeds, 1, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = torch.ops.dpcompile.add_randn(static, seeds, 1, scale)
        torch.full((1 << 16,), -1, dtype=torch.int64, device=device)  # takes the freed table's memory in the pool
    gaps, names = [], []
    for seed in (77, -5):
        fresh = _gradients(device, gen)
        for g, new in zip(static, fresh):
            g.copy_(new)
        seeds[1] = seed
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        names.append([e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])
        refs = [torch.empty_like(g) for g in fresh]
        A.reference(A.sources(fresh, refs), refs, seeds, 1, scale)
        gaps.append(_gaps(outs, refs))
    return {"gaps": gaps, "table_launches": [n.count("add_randn_kernel") for n in names],
            "per_tensor_launches": [n.count("add_randn_one_kernel") for n in names]}


def assert_graph_replays(case: dict) -> None:
    assert case["table_launches"] == [3, 3] and case["per_tensor_launches"] == [0, 0], case
    for gaps in case["gaps"]:  # as assert_adds_flat_draw's
        assert gaps["torch.float32"] == 0 and gaps["torch.float64"] == 0 and gaps["torch.bfloat16"] <= 2 ** -4, case


def add_randn_cases(device: str) -> dict:
    """dpcompile::add_randn on gradients of every layout (contiguous, transposed, a strided slice it must copy,
    empty, several programs long) and dtype, through the op (one launch per dtype, an address table), the
    per-tensor launches and the reference (the flat draw sliced at each tensor's first
    program): the largest differences, per dtype, and the statistics of the noise in fp32."""
    from dpcompile import add_randn as A

    grads = _gradients(device, torch.Generator().manual_seed(0))
    seeds = torch.tensor([3, 4, 5], dtype=torch.int64, device=device)
    scale = torch.tensor(0.5, device=device)
    before = [g.clone() for g in grads]
    op = torch.ops.dpcompile.add_randn(grads, seeds, 1, scale)
    outs = [torch.empty_like(g) for g in grads]
    A.launch(A.sources(grads, outs), outs, seeds, 1, scale, per_tensor=True)
    refs = [torch.empty_like(g) for g in grads]
    A.reference(A.sources(grads, refs), refs, seeds, 1, scale)
    other = torch.ops.dpcompile.add_randn(grads, seeds, 2, scale)
    # a cast taken in: low-precision gradients read, fp32 written (out_dtype), exact against the reference
    low = [g.to(torch.bfloat16) for g in grads if g.dtype == torch.float32]
    cast = torch.ops.dpcompile.add_randn(low, seeds, 1, scale, torch.float32)
    cast_refs = [torch.empty_like(g, dtype=torch.float32) for g in low]
    A.reference(A.sources(low, cast_refs), cast_refs, seeds, 1, scale)

    fp32 = [k for k, g in enumerate(grads) if g.dtype == torch.float32]
    z = torch.cat([((op[k].double() - grads[k].double()) / 0.5).flatten() for k in fp32]).cpu().numpy()
    z2 = torch.cat([((other[k].double() - grads[k].double()) / 0.5).flatten() for k in fp32]).cpu().numpy()
    return {
        "layouts_kept": all(o.stride() == torch.empty_like(g).stride() and o.shape == g.shape for g, o in zip(grads, op)),
        "inputs_untouched": all(torch.equal(g, b) for g, b in zip(grads, before)),
        "op_vs_reference": _gaps(op, refs), "per_tensor_vs_reference": _gaps(outs, refs),
        "cast_vs_reference": _gaps(cast, cast_refs),
        "cast_layouts_kept": all(c.dtype == torch.float32 and c.stride() == torch.empty_like(g).stride()
                                 for g, c in zip(low, cast)),
        "n": int(z.size), "mean": float(z.mean()), "mean_sq": float((z ** 2).mean()),
        "ks_p": float(scipy.stats.kstest(z, "norm").pvalue), "other_seed_corr": float(np.corrcoef(z, z2)[0, 1]),
    }


def assert_adds_flat_draw(case: dict) -> None:
    assert case["layouts_kept"] and case["inputs_untouched"] and case["cast_layouts_kept"], case
    assert case["cast_vs_reference"]["torch.float32"] == 0, case
    for key in ("op_vs_reference", "per_tensor_vs_reference"):
        gaps = case[key]
        # fp32 and fp64 (computed in fp32) exact; bf16 within one rounding of values below 8 (the interpreter
        # truncates where CUDA rounds to nearest)
        assert gaps["torch.float32"] == 0 and gaps["torch.float64"] == 0 and gaps["torch.bfloat16"] <= 2 ** -4, case
    n = case["n"]
    assert abs(case["mean"]) < 4.5 / np.sqrt(n), case
    lo, hi = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], n) / n
    assert lo < case["mean_sq"] < hi and case["ks_p"] > 1e-4, case
    assert abs(case["other_seed_corr"]) < 4.5 / np.sqrt(n), case


_M32 = 0xFFFFFFFF


def philox4x32(seed: int, counters: np.ndarray) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 (Salmon et al. 2011, as Triton's tl.randint4x keys and counts it: key = the 64-bit seed's
    low and high words, counter = (offset's low word, high word, 0, 0)) in numpy: four uint32 words per counter."""
    c0, c1 = counters & _M32, (counters >> 32) & _M32
    c2 = c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & _M32), np.uint64((seed >> 32) & _M32)
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        p0, p2 = a * c0, b * c2  # 32 x 32 -> 64 bits, exact in uint64
        c0, c1, c2, c3 = (p2 >> 32) ^ c1 ^ k0, p2 & _M32, (p0 >> 32) ^ c3 ^ k1, p0 & _M32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _M32, (k1 + np.uint64(0xBB67AE85)) & _M32
    return c0, c1, c2, c3


def reference_normals(seed: int, counters: np.ndarray) -> np.ndarray:
    """[4, n] float64: what dpcompile's normals4 makes from these counters (triton_kernels.radius_uniform)."""
    w1, w2, w3, w4 = philox4x32(seed, counters)
    e1, _, e3, _ = philox4x32(seed, counters + (1 << 32))

    def u(w, e):
        w, e = w.astype(np.float64), e.astype(np.float64)
        return np.where(w < 256, (w + (e + 0.5) / 2 ** 32) / 2 ** 32, (w + 0.5) / 2 ** 32)

    out = []
    for uu, wa in ((u(w1, e1), w2), (u(w3, e3), w4)):
        r, th = np.sqrt(-2 * np.log(uu)), 2 * np.pi * wa.astype(np.float64) / 2 ** 32
        out += [r * np.cos(th), r * np.sin(th)]
    return np.stack(out)


def tail_cases(device: str) -> dict:
    """normals4 against reference_normals (numpy Philox, float64 Box-Muller) on counters that take the
    refinement and ordinary ones; tl.randint4x against numpy's Philox; the radius at the extreme words."""
    from noise_tail_kernels import normals_at, radius_at, words_at

    seed = 0x1234_5678_9ABC_DEF  # positive int64, both words nonzero
    block = 64
    # the first two counters below 2^31 whose first or third word is below 256 (about one in 8 million: where
    # normals4 takes its refinement words), found once by a numpy search of Philox over 16M counters (CI time);
    # "refined_words_below_256" checks that they still are
    refined = [12717215, 12981371]
    counters = np.array(refined + list(range(1000, 1000 + block - len(refined))), dtype=np.uint64)
    dev = torch.device(device)
    seed_t = torch.tensor([seed], dtype=torch.int64, device=dev)
    ctr_t = torch.tensor(counters.astype(np.int64), dtype=torch.int32, device=dev)
    out = torch.empty(4 * block, dtype=torch.float32, device=dev)
    normals_at[(1,)](seed_t, ctr_t, out, BLOCK=block)
    words = torch.empty(4 * block, dtype=torch.int64, device=dev)
    words_at[(1,)](seed_t, ctr_t, words, BLOCK=block)
    ref = reference_normals(seed, counters)
    got = out.view(4, block).double().cpu().numpy()
    w = np.array([0, 0, 1, 255, 255, 256, 2 ** 31, 2 ** 32 - 1], dtype=np.int64)
    e = np.array([0, 2 ** 32 - 1, 0, 2 ** 32 - 1, 0, 0, 0, 2 ** 32 - 1], dtype=np.int64)
    radius = torch.empty(8, dtype=torch.float32, device=dev)
    radius_at[(1,)](torch.tensor(w, device=dev), torch.tensor(e, device=dev), radius, BLOCK=8)
    # the draw without Triton (dpcompile.philox's torch ops: CPU steps) against the kernel's, one program and a tail
    from dpcompile import philox
    from dpcompile import randn as R
    flat = R.launch(seed_t, 0, 5000).double().cpu()
    torch_ops = philox.flat_normals(seed, 5000, R.BLOCK).double()
    wf, ef = w.astype(np.float64), e.astype(np.float64)
    u_ref = np.where(w < 256, (wf + (ef + 0.5) / 2 ** 32) / 2 ** 32, (wf + 0.5) / 2 ** 32)
    return {
        "refined_counters": refined,
        "refined_words_below_256": int(((np.stack(philox4x32(seed, counters[:len(refined)]))[[0, 2]]) < 256).sum()),
        "words_match_numpy": bool((words.view(4, block).cpu().numpy() == np.stack(philox4x32(seed, counters))
                                   .astype(np.int64)).all()),
        "normals_max_abs_err": float(np.abs(got - ref).max()),
        "torch_ops_max_abs_err": float((flat - torch_ops).abs().max()),
        "refined_normals_max_abs": float(np.abs(ref[:, :len(refined)]).max()),
        "radius": radius.double().cpu().tolist(),
        "radius_ref": np.sqrt(-2 * np.log(u_ref)).tolist(),
    }


def assert_tails(case: dict) -> None:
    assert case["refined_words_below_256"] >= len(case["refined_counters"]) and case["words_match_numpy"], case
    # fp32 and the GPU's approximate log, sqrt, sin and cos
    assert case["normals_max_abs_err"] < 1e-4 and case["torch_ops_max_abs_err"] < 1e-4, case
    # (a word within 128 of 2^32 makes u round to 1 in fp32: a radius of 0 for about 1.5e-5)
    np.testing.assert_allclose(case["radius"], case["radius_ref"], rtol=1e-5, atol=1e-4)
    # the extreme words: the largest radius 9.49 (u = 2^-65, never 0, never clamped), the grid continuous at 256
    assert 9.4 < max(case["radius"]) < 9.6 and min(case["radius"]) >= 0, case


def main() -> None:
    if sys.argv[1:] == ["tails"]:
        print(json.dumps({"cpu": tail_cases("cpu")}))
        return
    if sys.argv[1:] == ["add_randn"]:
        print(json.dumps({"cpu": add_randn_cases("cpu")}))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import dpcompile.passes.noise as noise_pass
    import test_noise

    report = {"kernel": draw_statistics("cpu", 3 * 4096 + 17)}
    # the compiled step's noise with the chunk draw on the kernel (the op runs the kernel under the interpreter)
    z, std, backend = test_noise._run_steps(seed=1234, n_steps=60)
    flat = (z / std).flatten().numpy()
    report["step"] = {"counters": dict(backend.compiled[0].counters), "n": int(flat.size),
                      "mean": float(flat.mean()), "mean_sq": float((flat ** 2).mean()),
                      "ks_p": float(scipy.stats.kstest(flat, "norm").pvalue),
                      "steps_corr": float(np.corrcoef((z / std)[:-1].flatten(), (z / std)[1:].flatten())[0, 1])}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
