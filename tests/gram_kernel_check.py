"""The ghost norm kernel (dpcompile.gram_sq_norms) against each sample's ||A_i^T G_i||^2 in fp64. Run as a
script with TRITON_INTERPRET=1 (set before triton is imported: tests/test_gram_sq_norms.py starts it in a process
of its own) it checks the Triton kernel on CPU tensors; tests/test_gpu.py imports it for CUDA."""
from __future__ import annotations

import json

import torch

# (samples, rows per sample, p, m, layout): rows and features not a multiple of any tile (one tile, cut; several
# tiles with pairs off the diagonal), fewer rows than the smallest tile, features above one K step; operands as
# the graph hands them over: contiguous, features-major (a transposed [B, p, S] storage), samples not outermost
# in memory ([S, B, p] storage, as a sequence-first model lays them out)
CASES = [
    (3, 7, 5, 9, "contiguous"),
    (2, 40, 70, 33, "contiguous"),
    (2, 130, 24, 150, "contiguous"),
    (3, 67, 48, 17, "features_major"),
    (2, 97, 33, 80, "sequence_first"),
    (1, 1, 16, 16, "contiguous"),
]


def operand(B: int, S: int, F: int, layout: str, device: str) -> torch.Tensor:
    if layout == "features_major":
        return torch.randn(B, F, S, device=device).transpose(1, 2)
    if layout == "sequence_first":
        return torch.randn(S, B, F, device=device).transpose(0, 1)
    return torch.randn(B, S, F, device=device)


def errors(fn, device: str, dtypes) -> dict[str, float]:
    """Largest relative error of fn's squared norms (summed over its parts) per case and dtype."""
    torch.manual_seed(0)
    worst = {}
    for i, (B, S, p, m, layout) in enumerate(CASES):
        a, g = operand(B, S, p, layout, device), operand(B, S, m, layout, device)
        for dt in dtypes:
            ad, gd = a.to(dt), g.to(dt)
            # the reference of the rounded operands: what is left is the kernel's own error
            ref = torch.bmm(ad.double().transpose(1, 2), gd.double()).square().flatten(1).sum(1)
            got = fn(ad, gd).sum(1).double()
            worst[f"{i}:{str(dt).split('.')[-1]}"] = float(((got - ref).abs() / ref).max())
    return worst


def split_errors(device: str, dtypes, split_k: int = 32) -> dict[str, float]:
    """errors() of the kernel with the wider operand split in pieces of split_k features (an LM head's 50257
    logits are split at the default; here the cases' 33-150 features give 2-5 pieces, a last piece empty where
    the rounding to whole K steps leaves none, and operands swapped where the first is the wider)."""
    from dpcompile import gram_sq_norms

    old = gram_sq_norms.SPLIT_K
    gram_sq_norms.SPLIT_K = split_k
    try:
        assert any(gram_sq_norms.splits(p, m) > 1 for _, _, p, m, _ in CASES)
        return {f"split:{k}": v for k, v in errors(gram_sq_norms.launch, device, dtypes).items()}
    finally:
        gram_sq_norms.SPLIT_K = old


if __name__ == "__main__":
    from dpcompile import gram_sq_norms

    dtypes = [torch.float32, torch.float16]
    print(json.dumps({**errors(gram_sq_norms.launch, "cpu", dtypes), **split_errors("cpu", dtypes)}))
