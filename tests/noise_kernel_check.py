"""dpcompile::randn's Triton kernel (four normals per Philox call). Run as a script with TRITON_INTERPRET=1 (set
before triton is imported: tests/test_noise.py starts it in a process of its own) it checks the kernel on CPU
tensors, alone and as the compiled step's noise; tests/test_gpu.py imports ``draw_statistics`` for CUDA."""
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


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import dpcompile.passes.noise as noise_pass
    import test_noise

    report = {"kernel": draw_statistics("cpu", 3 * 4096 + 17)}
    # the compiled step's noise with the chunk draw on the kernel (the op runs the kernel under the interpreter)
    noise_pass.TRITON_DRAW_DEVICES = ("cpu",)
    z, std, backend = test_noise._run_steps(seed=1234, n_steps=60)
    flat = (z / std).flatten().numpy()
    report["step"] = {"counters": dict(backend.compiled[0].counters), "n": int(flat.size),
                      "mean": float(flat.mean()), "mean_sq": float((flat ** 2).mean()),
                      "ks_p": float(scipy.stats.kstest(flat, "norm").pvalue),
                      "steps_corr": float(np.corrcoef((z / std)[:-1].flatten(), (z / std)[1:].flatten())[0, 1])}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
