"""Host and GPU time of bk's in-place row masks (dpcompile::zero_rows_) against the masked copy they replace, on
GPT-2-small-sized operands (32 x 256 rows, bf16), every sample kept (what a step pays as a rule: the kernels'
programs return at once): one operand a call, and a backward's 49 operands one call each against all in one call
(the table kernel, what passes.inplace_row_masks emits).

    python3 benchmarks/zero_rows_host.py

Steps without CUDA graphs are launch-bound on the device machines' hosts, so the op's host time per call (the
dispatcher, its cached plan, Triton's launch, the table's copy) is what it costs there; under CUDA graphs only
its GPU time is left.
"""
import time

import torch

import dpcompile  # noqa: F401  (defines dpcompile::zero_rows_)

OPERANDS = 49  # GPT-2-small's bk backward: 12 layers x 4 linears + the LM head


def per_call_us(fn, calls: int = 1000) -> tuple[float, float]:
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


def graph_us(fn, calls: int = 100) -> float:
    """GPU microseconds per call, replayed from a CUDA graph."""
    fn()  # sets aside pinned memory for the tables a capture copies
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main() -> None:
    rows = 32 * 256
    widths = [3072, 768, 768, 2304] * 12 + [768]  # mlp fc, mlp proj, attn proj, qkv; the LM head's input
    xs = [torch.randn(rows, w, device="cuda", dtype=torch.bfloat16) for w in widths[:OPERANDS]]
    keep = torch.ones(rows, 1, dtype=torch.bool, device="cuda")
    zero_rows_ = torch.ops.dpcompile.zero_rows_
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {len(xs)} operands of {rows} rows, bf16")
    cases = [("one operand, one call", lambda: zero_rows_(xs[:1], [keep], [0])),
             (f"{len(xs)} operands, a call each", lambda: [zero_rows_([x], [keep], [0]) for x in xs]),
             (f"{len(xs)} operands, one call", lambda: zero_rows_(xs, [keep] * len(xs), [0] * len(xs))),
             ("where copy of one (eager)", lambda: torch.where(keep, xs[0], 0)),
             ("one-element add_ (a launch)", lambda: xs[0][0, :1].add_(0))]
    for name, fn in cases:
        host, total = per_call_us(fn)
        print(f"{name:32s} host {host:8.1f} us/call, until done {total:8.1f} us/call, "
              f"GPU in a CUDA graph {graph_us(fn, 20):8.2f} us/call")


if __name__ == "__main__":
    main()
