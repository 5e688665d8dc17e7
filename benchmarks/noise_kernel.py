"""GPU time of the noise of one chunk of Llama-3.2-1B-sized gradients (the shapes of two decoder layers, 2^25
coordinates at most as the noise pass packs them) and of its two large parameters' own draws:
dpcompile::add_randn's kernel over a range of tiles (counters per program) and warps, against the floor (one read
and one write of every gradient: a foreach multiply by 1) and the path it replaced (a flat dpcompile::randn draw
added by a foreach add).

    python3 benchmarks/noise_kernel.py [--configs 1024x4,1024x8,512x4,1024x8a,...] [--reps 20]

A config ending in "a" runs the Box-Muller transform through the special-function unit
(triton_kernels.box_muller_approx: lg2.approx, sin.approx, cos.approx) instead of libdevice's logf, sinf and
cosf, which dpcompile uses; the line then also gives its largest difference from the exact kernel's values.

Sources are bf16 (autocast gradients, cast to fp32 in the kernel) or fp32. A tile other than dpcompile's
BLOCK lays the counters out differently (other values, the same distribution): this only times them.
"""
from __future__ import annotations

import argparse

import torch

import dpcompile  # noqa: F401
from dpcompile import add_randn as A
from dpcompile import triton_kernels


def shapes_llama(layers: int = 2, d: int = 2048, ffn: int = 8192, kv: int = 512) -> list[tuple[int, ...]]:
    per_layer = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn), (d,), (d,)]
    return per_layer * layers


def gpu_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def table(srcs, outs, block: int):
    """dpcompile.add_randn's address table for a program of 4 * block outputs, and the launch's programs."""
    rows, first = [], 0
    for s, o in zip(srcs, outs):
        rows.append((s.data_ptr(), o.data_ptr(), s.numel(), first, first))
        first += -(-s.numel() // (4 * block))
    return A._table(rows, torch.device("cuda")), len(rows), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="256x4,512x4,512x8,1024x4,1024x8,2048x8,2048x16")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    seeds = torch.tensor([5, 6], dtype=torch.int64, device="cuda")
    scale = torch.tensor(0.01, device="cuda")
    cases = {"chunk": shapes_llama(), "large": [(128256, 2048)]}
    for name, shapes in cases.items():
        for src_dtype in (torch.bfloat16, torch.float32):
            srcs = [torch.randn(s, device="cuda").to(src_dtype) for s in shapes]
            outs = [torch.empty_like(s, dtype=torch.float32) for s in srcs]
            numel = sum(s.numel() for s in srcs)
            floor_bytes = numel * (srcs[0].element_size() + 4)
            floor = gpu_ms(lambda: torch._foreach_mul(srcs, 1.0), args.reps)  # (same dtype out: a lower floor)
            line = [f"{name} {tuple(shapes[0])}.. {numel / 1e6:.0f}M coords, {src_dtype} -> fp32: "
                    f"{floor_bytes / 1e9:.2f} GB at least; foreach read+write {floor:.3f} ms"]
            if src_dtype == torch.float32:
                def old():
                    z = torch.ops.dpcompile.randn(seeds, 0, numel)
                    torch._foreach_add(srcs, [v.view_as(s) for v, s in zip(z.split([s.numel() for s in srcs]), srcs)])
                line.append(f"randn + foreach {gpu_ms(old, args.reps):.3f} ms")
            op = gpu_ms(lambda: torch.ops.dpcompile.add_randn(srcs, seeds, 0, scale, torch.float32), args.reps)
            each = gpu_ms(lambda: A.launch(srcs, outs, seeds, 0, scale, per_tensor=True), args.reps)
            line.append(f"op {op:.3f} ms, per tensor {each:.3f} ms")
            for cfg in args.configs.split(","):
                approx = cfg.endswith("a")
                block, warps = (int(v) for v in cfg.rstrip("a").split("x"))
                tab, tensors, programs = table(srcs, outs, block)

                def run(approx=approx):
                    triton_kernels.add_randn_kernel[(programs,)](tab, tensors, srcs[0], outs[0], seeds, 0, scale,
                                                                 BLOCK=block, APPROX=approx, num_warps=warps)
                ms = gpu_ms(run, args.reps)
                diff = ""
                if approx:  # both transforms once from the same sources, in fp32 units of the noise's std
                    run(False)
                    exact = [o.clone() for o in outs]
                    run(True)
                    worst = max(float((o - e).abs().max()) for o, e in zip(outs, exact)) / float(scale)
                    diff = f", max |diff| {worst:.2e} std"
                line.append(f"{cfg} {ms:.3f} ms ({floor_bytes / ms / 1e6:.0f} GB/s{diff})")
            print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
