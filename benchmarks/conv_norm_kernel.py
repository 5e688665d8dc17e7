"""The per-sample conv norm kernel (dpcompile.conv_sq_norms) on a WRN-16-4's layer shapes at batch 256, against
what it replaced (unfold as one gather + bmm in the operands' dtype with fp32 accumulation + sum of squares,
compiled by Inductor), against the two Gram forms of the same norm (ghost: unfold and the Gram kernel
dpcompile.gram_sq_norms; input_gram: the padded input's Gram over its positions, its 9 windows summed, compiled
by Inductor, as passes.conv_norms builds it) and against cuDNN's weight gradient of the same layer (the
non-private step's cost of it): median GPU ms per layer kind, for tile configurations given on the command line.

    python benchmarks/conv_norm_kernel.py [--dtypes bf16,fp32] [--layouts channels_last,contiguous]
        [--configs "64,64,32,4,3;64,128,32,8,3"]   (BLOCK_M,BLOCK_N,BLOCK_P,num_warps,num_stages; default: the
        kernel's own choice) [--layers "128->128,256->256"]   (substrings of the layer names)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dpcompile
from dpcompile import conv_sq_norms, gram_sq_norms  # noqa: E402

# (name, Cin, Cout, input side, kernel, stride, padding): a WRN-16-4's distinct convolutions at CIFAR's 32x32
WRN_LAYERS = [
    ("stem 3->16 32x32", 3, 16, 32, 3, 1, 1),
    ("g1 16->64 32x32", 16, 64, 32, 3, 1, 1),
    ("g1 64->64 32x32", 64, 64, 32, 3, 1, 1),
    ("g2 64->128 s2", 64, 128, 32, 3, 2, 1),
    ("g2 128->128 16x16", 128, 128, 16, 3, 1, 1),
    ("g3 128->256 s2", 128, 256, 16, 3, 2, 1),
    ("g3 256->256 8x8", 256, 256, 8, 3, 1, 1),
    ("shortcut 64->128 1x1 s2", 64, 128, 32, 1, 2, 0),
]


def gpu_ms(fn, iters=20, reps=10):
    """Median GPU ms of one call, from events around ``reps`` calls in a row: around one call, the host's
    launch time (tens of microseconds for a Triton kernel from Python) would count where the GPU idles."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def unfolded(e, x, k, s, p):
    """The replaced form: unfold, the per-sample gradients [B, Cout, Cin * k * k] in fp32, their squares' sum."""
    B = x.shape[0]
    u = F.unfold(x, k, padding=p, stride=s)  # [B, Cin * k * k, P]
    dw = torch.bmm(e.flatten(2), u.transpose(1, 2)).float()
    return dw.square().view(B, -1).sum(1)


def _f32_bmm(a, b):
    """a @ b in fp32 with fp32 accumulation, in the operands' dtype (passes.sample_factors.bmm_f32)."""
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.aten.bmm.dtype(a, b, torch.float32)
    return torch.bmm(a, b)


def ghost_gram_kernel(e, x, k, s, p):
    """The ghost form: unfold(x) [B, L, Cin * k * k] and the output gradient [B, L, Cout] into the Gram kernel."""
    u = F.unfold(x, k, padding=p, stride=s).transpose(1, 2).contiguous()
    return gram_sq_norms.launch(u, e.flatten(2).transpose(1, 2).contiguous()).sum(1)


def input_gram(e, x, k, s, p):
    """The input_gram form: the Gram of x padded (and cropped to what the windows reach) over its positions, the
    k * k strided windows of it summed, times the output gradient's Gram."""
    B, L = x.shape[0], e.shape[2]
    ext = s * (L - 1) + k
    xp = F.pad(x, [p, ext - x.shape[3] - p, p, ext - x.shape[2] - p])
    X = xp.flatten(2).transpose(1, 2)
    XX = _f32_bmm(X, X.transpose(1, 2)).view(B, ext, ext, ext, ext)
    end = s * (L - 1) + 1
    UU = sum(XX[:, i:i + end:s, j:j + end:s, i:i + end:s, j:j + end:s] for i in range(k) for j in range(k))
    G = e.flatten(2).transpose(1, 2)
    return (UU.reshape(B, L * L, L * L) * _f32_bmm(G, G.transpose(1, 2))).sum((1, 2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--layouts", default="channels_last,contiguous")
    ap.add_argument("--configs", default="", help="';'-separated BLOCK_M,BLOCK_N,BLOCK_P,num_warps,num_stages")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--layers", default="", help="comma-separated substrings of the layer names to run (default: all)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    configs = [None] + [dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_P", "num_warps", "num_stages"),
                                 map(int, c.split(",")))) for c in args.configs.split(";") if c]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}")
    for dt_name in args.dtypes.split(","):
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dt_name]
        for layout in args.layouts.split(","):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            totals = [0.0] * (len(configs) + 4)
            print(f"\n{dt_name} {layout}: ms per layer: wgrad (cuDNN) | unfold+bmm (Inductor) | ghost (unfold + "
                  f"Gram kernel) | input_gram (Inductor) | kernel " + " | ".join(str(c) for c in configs[1:]))
            for name, cin, cout, side, k, s, p in WRN_LAYERS:
                if args.layers and not any(sub in name for sub in args.layers.split(",")):
                    continue
                torch._dynamo.reset()  # a compile per layer: past dynamo's recompile limit it would run eagerly
                old, gram = torch.compile(unfolded), torch.compile(input_gram)
                x = torch.randn(args.batch, cin, side, side, device="cuda", dtype=dt).contiguous(memory_format=fmt)
                w = torch.randn(cout, cin, k, k, device="cuda", dtype=dt)
                e = torch.randn_like(F.conv2d(x, w, None, s, p)).contiguous(memory_format=fmt)
                row = [gpu_ms(lambda: torch.ops.aten.convolution_backward(
                    e, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, [False, True, False])),
                    gpu_ms(lambda: old(e, x, k, s, p))]
                ref = old(e, x, k, s, p).double()
                for form in (ghost_gram_kernel, gram):
                    err = float(((form(e, x, k, s, p).double() - ref).abs() / ref).max())
                    assert err < 1e-2, (name, form, err)
                    row.append(gpu_ms(lambda: form(e, x, k, s, p)))
                for cfg in configs:
                    got = conv_sq_norms.launch(e, x, [cout, cin, k, k], [s, s], [p, p], [1, 1], 1, 1, cfg).sum(1)
                    err = float(((got.double() - ref).abs() / ref).max())
                    assert err < 1e-2, (name, cfg, err)
                    row.append(gpu_ms(lambda: conv_sq_norms.launch(e, x, [cout, cin, k, k], [s, s], [p, p], [1, 1],
                                                                   1, 1, cfg)))
                totals = [t + r for t, r in zip(totals, row)]
                print(f"  {name:26s} " + " | ".join(f"{r:7.3f}" for r in row))
            print(f"  {'sum':26s} " + " | ".join(f"{r:7.3f}" for r in totals))


if __name__ == "__main__":
    main()
