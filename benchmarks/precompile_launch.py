"""Host time per launch of a kernel compiled ahead (dpcompile.precompile) against one compiled at its first launch.

One H200 measurement once had the GPT-2 bf16 bk step 11 ms slower with the precompile at the same GPU time; it
did not repeat (BENCHMARKS.md, twenty-seventh: that step's wall clock spreads over 22-32 ms between processes on
that machine). This isolates the launch path. Two Gram norm kernels of different widths: the first compiled ahead
from a graph's fake values (kernel_plans.precompile, in a background thread), the second at its first launch.
Then, alternating, --launches launches of each, timed on the host (no synchronisation inside the loop), and the
same loop of the second kernel before anything was precompiled, to see whether the precompile's threads alone
slow the host. Prints host microseconds per launch, whether each launch takes kernel_plans' direct path, and
the threads alive.

    python benchmarks/precompile_launch.py --launches 2000
"""
from __future__ import annotations

import argparse
import threading
import time

import torch


def _per_launch_us(run, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        run()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=2000)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("precompile_launch.py needs a CUDA GPU")
    from dpcompile import gram_sq_norms, kernel_plans, precompile, triton_kernels

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    # small operands: the launch, not the kernel, is what is timed
    a1, g1 = (torch.randn(4, 64, w, device="cuda", dtype=dtype) for w in (48, 80))
    a2, g2 = (torch.randn(4, 64, w, device="cuda", dtype=dtype) for w in (48, 112))
    late = lambda: gram_sq_norms.launch(a2, g2)  # noqa: E731
    late()  # compiled at its first launch
    before = _per_launch_us(late, args.launches)
    started = kernel_plans.precompile(precompile.recorded_launches(
        [precompile.op_graph(torch.ops.dpcompile.gram_sq_norms.default, a1, g1)]))
    kernel_plans.wait_for_precompiles()
    ahead = lambda: gram_sq_norms.launch(a1, g1)  # noqa: E731
    ahead()
    rows = {"compiled at first launch, before any precompile": before}
    for _ in range(2):
        rows["compiled ahead"] = _per_launch_us(ahead, args.launches)
        rows["compiled at first launch"] = _per_launch_us(late, args.launches)
    direct = sum(1 for k in kernel_plans._COMPILED if k[0] is triton_kernels.gram_sq_norms_kernel)
    print(f"precompiles started: {started}; threads alive: {threading.active_count()} "
          f"({', '.join(t.name for t in threading.enumerate())})")
    print(f"Gram kernel specialisations launched directly: {direct} (2 when both take the direct path)")
    for name, us in rows.items():
        print(f"{name:50s} {us:7.2f} us per launch (host)")


if __name__ == "__main__":
    main()
