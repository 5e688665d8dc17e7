"""Host and GPU time of one dpcompile::zero_rows_ call (bk's in-place mask of a dropped sample's rows) against
the masked copy it replaces, on a GPT-2-small-sized output gradient (32 x 256 rows of 3072, bf16), every sample
kept (what a step pays as a rule: the kernel's programs return at once).

    python3 benchmarks/zero_rows_host.py

Steps without CUDA graphs are launch-bound on the device machines' hosts, so the op's host time per call (the
dispatcher, its cached plan, Triton's launch) is what it costs there; under CUDA graphs only its GPU time is left.
"""
import time

import torch

import dpcompile  # noqa: F401  (defines dpcompile::zero_rows_)


def per_call_us(fn, calls: int = 2000) -> tuple[float, float]:
    """(host microseconds per call, microseconds per call until the GPU is done)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    x = torch.randn(32 * 256, 3072, device="cuda", dtype=torch.bfloat16)
    keep = torch.ones(32 * 256, 1, dtype=torch.bool, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, x {tuple(x.shape)} {x.dtype}")
    for name, fn in [("zero_rows_ (op)", lambda: torch.ops.dpcompile.zero_rows_(x, keep, 0)),
                     ("where copy (eager)", lambda: torch.where(keep, x, 0)),
                     ("one-element add_ (a launch)", lambda: x[0, :1].add_(0))]:
        host, total = per_call_us(fn)
        print(f"{name:30s} host {host:7.1f} us/call, until done {total:7.1f} us/call")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            torch.ops.dpcompile.zero_rows_(x, keep, 0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"zero_rows_ GPU time in a CUDA graph: {start.elapsed_time(end) * 10:.2f} us/call")


if __name__ == "__main__":
    main()
