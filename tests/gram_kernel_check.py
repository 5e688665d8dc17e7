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


def misaligned(B: int, S: int, F: int, device: str) -> torch.Tensor:
    """[B, S, F] contiguous one element past an aligned address (a view into a larger buffer)."""
    return torch.randn(B * S * F + 1, device=device)[1:].view(B, S, F)


def group_errors(device: str, dtypes, B: int = 3) -> dict[str, float]:
    """The table kernel (gram_sq_norms.launch_group) on every case at one batch size in one call, two cases
    twice (two contractions of one signature in one launch), one with misaligned operands (launched apart from
    its aligned twin) and, in a 16-bit call, an fp32 pair: each contraction's relative error against fp64,
    and under "columns" the largest difference between its block of the output and gram_sq_norms.launch's
    partial sums of the same contraction (0: the same programs wrote them)."""
    from dpcompile import gram_sq_norms

    torch.manual_seed(1)
    worst = {}
    for dt in dtypes:
        pairs = [(operand(B, S, p, layout, device), operand(B, S, m, layout, device))
                 for _, S, p, m, layout in CASES]
        pairs += [pairs[1], (operand(B, 40, 70, "contiguous", device), operand(B, 40, 33, "contiguous", device)),
                  (misaligned(B, 40, 70, device), misaligned(B, 40, 33, device))]
        pairs = [(a.to(dt), g.to(dt)) for a, g in pairs]
        if dt != torch.float32:  # another dtype in the same call: a launch of its own
            pairs.append((operand(B, 7, 5, "contiguous", device), operand(B, 7, 9, "contiguous", device)))
        out = gram_sq_norms.launch_group([a for a, _ in pairs], [g for _, g in pairs])
        col, columns = 0, 0.0
        for i, (a, g) in enumerate(pairs):
            alone = gram_sq_norms.launch(a, g)
            block = out[:, col:col + alone.shape[1]]
            col += alone.shape[1]
            columns = max(columns, float((block - alone).abs().max()))
            ref = torch.bmm(a.double().transpose(1, 2), g.double()).square().flatten(1).sum(1)
            worst[f"group{i}:{str(dt).split('.')[-1]}"] = float(((block.sum(1).double() - ref).abs() / ref).max())
        assert col == out.shape[1], (col, out.shape)
        worst[f"columns:{str(dt).split('.')[-1]}"] = columns
    return worst


if __name__ == "__main__":
    from dpcompile import gram_sq_norms

    dtypes = [torch.float32, torch.float16]
    print(json.dumps({**errors(gram_sq_norms.launch, "cpu", dtypes), **split_errors("cpu", dtypes),
                      **group_errors("cpu", dtypes)}))
