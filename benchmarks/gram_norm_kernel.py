"""The ghost norm kernel (dpcompile.gram_sq_norms) on a ViT-S/16's and GPT-2-small's Linear shapes, against what
it replaced (two Gram bmms in the operands' dtype with fp32 accumulation, their product and sum, compiled by
Inductor; also with the rows zero-padded to a multiple of 8 first, as passes.aligned_contractions did for cuBLAS)
and against the layer's weight gradient (one mm over all rows: the non-private step's cost of it): median GPU
ms per layer, for tile configurations given on the command line.

    python benchmarks/gram_norm_kernel.py [--dtypes bf16,fp32]
        [--configs "64,64,4,3;32,64,4,3"]   (BLOCK_S,BLOCK_K,num_warps,num_stages; default: the kernel's choice)
        [--split-k 1000000,4096,16384]     (the default tiles with other pieces of the wider operand's features,
                                             gram_sq_norms.SPLIT_K; 1000000: no split)
        [--layout step|contiguous]         (step: rows as wide as the step stores them, passes.aligned_contractions'
                                             padding: GPT-2's 50257 logits in rows of 50304; contiguous: unpadded)
        [--kernel-only]                    (no weight-gradient mm and no compiled Grams: the kernel's columns only)
        [--direct]                         (also the direct form ||A_i^T G_i||^2 as the graph builds it where
                                             linear_norm's cost model picks it: per-sample gradients in fp32, in
                                             blocks of NORM_BLOCK_BYTES at the batch, squared and summed; compiled)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's dpcompile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conv_norm_kernel import gpu_ms  # noqa: E402
from dpcompile import gram_sq_norms  # noqa: E402

# (name, samples, rows per sample, p, m): the Linear layers of one block
LAYERS = [
    ("vit-s16 qkv 384->1152", 64, 197, 384, 1152),
    ("vit-s16 proj 384->384", 64, 197, 384, 384),
    ("vit-s16 fc1 384->1536", 64, 197, 384, 1536),
    ("vit-s16 fc2 1536->384", 64, 197, 1536, 384),
    ("gpt2 qkv 768->2304 (32x256)", 32, 256, 768, 2304),
    ("gpt2 proj 768->768", 32, 256, 768, 768),
    ("gpt2 fc 768->3072", 32, 256, 768, 3072),
    ("gpt2 proj 3072->768", 32, 256, 3072, 768),
    ("gpt2 lm_head 768->50257", 32, 256, 768, 50257),
    ("gpt2 qkv 768->2304 (8x1024)", 8, 1024, 768, 2304),
    ("gpt2 proj 768->768 (8x1024)", 8, 1024, 768, 768),
    ("gpt2 fc 768->3072 (8x1024)", 8, 1024, 768, 3072),
    ("gpt2 proj 3072->768 (8x1024)", 8, 1024, 3072, 768),
    ("gpt2 lm_head 768->50257 (8x1024)", 8, 1024, 768, 50257),
    ("gpt2 qkv 768->2304 (2x4096)", 2, 4096, 768, 2304),
    ("gpt2 proj 768->768 (2x4096)", 2, 4096, 768, 768),
    ("gpt2 fc 768->3072 (2x4096)", 2, 4096, 768, 3072),
    ("gpt2 proj 3072->768 (2x4096)", 2, 4096, 3072, 768),
    ("gpt2 lm_head 768->50257 (2x4096)", 2, 4096, 768, 50257),
    # two samples of 1024 tokens: 72 programs a layer without pieces of features (36 tile pairs a sample)
    ("llama qkv 2048->3072 (2x1024)", 2, 1024, 2048, 3072),
    ("llama o 2048->2048", 2, 1024, 2048, 2048),
    ("llama gate 2048->8192", 2, 1024, 2048, 8192),
    ("llama down 8192->2048", 2, 1024, 8192, 2048),
    ("llama lm_head 2048->128256", 2, 1024, 2048, 128256),
    ("llama qkv 2048->3072 (2x2048)", 2, 2048, 2048, 3072),
    ("llama o 2048->2048 (2x2048)", 2, 2048, 2048, 2048),
    ("llama gate 2048->8192 (2x2048)", 2, 2048, 2048, 8192),
    ("llama down 8192->2048 (2x2048)", 2, 2048, 8192, 2048),
    ("llama lm_head 2048->128256 (2x2048)", 2, 2048, 2048, 128256),
]


def host_us(a, g, n=2000) -> float:
    """Host microseconds per launch() call (the GPU kept busy by the calls themselves; a tiny case)."""
    import time

    for _ in range(10):
        gram_sq_norms.launch(a, g)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        gram_sq_norms.launch(a, g)
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / n


def grams(a, g):
    """The replaced form: [B, S, S] fp32 Grams (fp32 accumulation of the operands' dtype), product, sum."""
    ga, gg = bmm_f32(a, a.transpose(1, 2)), bmm_f32(g, g.transpose(1, 2))
    return (ga * gg).flatten(1).sum(1)


def bmm_f32(x, y):
    """x @ y with fp32 accumulation and output: 16-bit operands through aten.bmm.dtype, as the graph has them."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.aten.bmm.dtype(x, y, torch.float32)
    return torch.bmm(x, y)


def direct(a, g):
    """The direct form as passes/per_sample_norms builds it: [B, p, m] per-sample gradients (fp32 out) in blocks of
    the wider feature dim of at most NORM_BLOCK_BYTES at this batch, each squared and summed per sample."""
    from dpcompile.passes.per_sample_norms import NORM_BLOCK_BYTES, _spans

    B, _, p = a.shape
    m = g.shape[2]
    k = max(1, min(max(p, m), -(-(p * m * 4 * B) // NORM_BLOCK_BYTES)))
    total = None
    for lo, hi in _spans(max(p, m), k):
        ab, gb = (a[..., lo:hi], g) if p >= m else (a, g[..., lo:hi])
        part = bmm_f32(ab.transpose(1, 2), gb).square().sum((1, 2))
        total = part if total is None else total + part
    return total


def padded_grams(a, g):
    pad = -a.shape[1] % 8
    return grams(F.pad(a, (0, 0, 0, pad)), F.pad(g, (0, 0, 0, pad)))


def operand(B: int, S: int, F: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """[B, S, F] random, its rows as wide as the step's (layout "step") or F wide."""
    width = F
    if layout == "step":
        from dpcompile.passes import aligned_contractions as ac

        width = F + ac._extra(F, ac._alignment(dtype), dtype.itemsize)  # main() turned TF32 on, as the step has it
    return torch.randn(B, S, width, device="cuda", dtype=dtype)[..., :F]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--configs", default="")
    ap.add_argument("--layers", default="", help="substring filters on the layer names, separated by '|'")
    ap.add_argument("--split-k", default="", help="comma-separated SPLIT_K values to time beside the default")
    ap.add_argument("--layout", default="step", choices=("step", "contiguous"))
    ap.add_argument("--kernel-only", action="store_true")
    ap.add_argument("--direct", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    tiny = torch.randn(2, 8, 16, device="cuda", dtype=torch.bfloat16)
    print(f"host time per launch() of a tiny case: {host_us(tiny, tiny):.1f} us; through the op: ", end="")
    import time
    op = torch.ops.dpcompile.gram_sq_norms.default
    for _ in range(10):
        op(tiny, tiny)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        op(tiny, tiny)
    print(f"{1e6 * (time.perf_counter() - t) / 2000:.1f} us")
    configs = [None] + [dict(zip(("BLOCK_S", "BLOCK_K", "num_warps", "num_stages"), map(int, c.split(","))))
                        for c in args.configs.split(";") if c]
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    split_ks = [int(v) for v in args.split_k.split(",") if v]
    baselines = [] if args.kernel_only else ["weight grad mm", "grams (compiled)", "padded grams (compiled)"]
    baselines += ["direct norm (compiled)"] if args.direct else []
    head = ["layer", "dtype"] + baselines + \
        ["kernel " + ("default" if c is None else ",".join(map(str, c.values()))) for c in configs] + \
        [f"kernel split_k={v}" for v in split_ks]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    sums = {}
    for dname in args.dtypes.split(","):
        for name, B, S, p, m in LAYERS:
            if args.layers and not any(f in name for f in args.layers.split("|")):
                continue
            torch.manual_seed(0)
            a = operand(B, S, p, dt[dname], args.layout)
            g = operand(B, S, m, dt[dname], args.layout)
            ref = torch.bmm(a.double().transpose(1, 2), g.double()).square().flatten(1).sum(1)
            row = [] if args.kernel_only else [gpu_ms(lambda: torch.mm(a.flatten(0, 1).t(), g.flatten(0, 1)))]
            for fn in (() if args.kernel_only else (grams, padded_grams)) + ((direct,) if args.direct else ()):
                torch._dynamo.reset()
                f = torch.compile(fn)
                got = f(a, g).double()
                assert float(((got - ref).abs() / ref).max()) < 1e-2, name
                row.append(gpu_ms(lambda: f(a, g)))
            for cfg in configs:
                got = gram_sq_norms.launch(a, g, cfg).sum(1).double()
                err = float(((got - ref).abs() / ref).max())
                assert err < 1e-2, (name, cfg, err)
                row.append(gpu_ms(lambda: gram_sq_norms.launch(a, g, cfg)))
            default_split = gram_sq_norms.SPLIT_K
            for v in split_ks:
                gram_sq_norms.SPLIT_K = v
                got = gram_sq_norms.launch(a, g).sum(1).double()
                assert float(((got - ref).abs() / ref).max()) < 1e-2, (name, v)
                row.append(gpu_ms(lambda: gram_sq_norms.launch(a, g)))
            gram_sq_norms.SPLIT_K = default_split
            for i, v in enumerate(row):
                sums[(dname, i)] = sums.get((dname, i), 0.0) + v
            print(f"| {name} | {dname} | " + " | ".join(f"{v:.3f}" for v in row) + " |", flush=True)
        print(f"| sum | {dname} | " + " | ".join(f"{sums[(dname, i)]:.3f}" for i in range(len(head) - 2)) + " |")


if __name__ == "__main__":
    main()
