"""The ghost form of a per-sample norm in one kernel: ``torch.ops.dpcompile.gram_sq_norms``.

A contraction's per-sample weight gradient is A_i^T G_i (A_i [S, p] the sample's inputs, G_i [S, m] its output
gradients, S rows per sample), and its squared norm is <A_i A_i^T, G_i G_i^T>: two [S, S] Gram matrices and the
sum of their product. Written out in the graph that is two batched matmuls writing [B, S, S] fp32 each, a product
and a reduction; on tokens of 197 (a ViT-S/16) also a zero-padded copy of both operands so that cuBLAS's
operands are aligned (passes.aligned_contractions): a ViT-S/16 step at batch 64 in bf16 spent 0.7 ms of GPU time
in those copies and 0.66 ms in the Gram matmuls on one H100. The kernel computes each tile pair of the two Gram
matrices in registers, multiplies them and keeps the sum: nothing of size [B, S, S] exists, the operands are
read where they lie (any strides), and since both Grams are symmetric only the tiles on and above the diagonal
are computed (those off it count twice).

Output: [B, parts] fp32 partial sums (one per tile pair, zero below the diagonal, and per piece of the wider
operand's features, ``SPLIT_K``), summed by the caller: no atomics, so the norms are the same bits every run.
CUDA runs the Triton kernel (the operands' dtype into fp32 accumulation; fp32 operands use TF32 when
``torch.backends.cuda.matmul.allow_tf32`` allows it, as the bmm it replaces did); other devices the same sums with
aten ops, in blocks of samples. Under ``TRITON_INTERPRET=1`` the Triton kernel runs on CPU tensors (``launch``):
that is how it is tested without a GPU.
"""
from __future__ import annotations

import torch

from . import address_tables, kernel_plans
from .kernel_plans import cached_plan, kernel_dtype

CPU_BLOCK_BYTES = 64 << 20  # the aten path: [n, S, S] Gram matrices of at most this many bytes at a time


def block(S: int) -> int:
    """Rows of a Gram tile (BLOCK_S) from the static rows per sample (the output's parts depend on it, so the
    fake kernel computes the same). Chosen on a ViT-S/16's
    (197 tokens, batch 64) and GPT-2-small's (256 tokens, batch 32) Linear layers, one H100
    (benchmarks/gram_norm_kernel.py): 128x128 tiles, 8 warps, in bf16 and fp32 (the 8 layers: bf16 0.29 ms,
    fp32 0.42, against 0.30 and 0.53 in 64x64 tiles and 1.04 and 0.85 as compiled Gram matmuls)."""
    return next(t for t in (128, 64, 32, 16) if S >= t or t == 16)


# Features of the wider operand per program: wider operands are split into pieces of at most this many, each
# piece's partial sum a part of its own (GPT-2's 50257 logits: 4 pieces, Llama-3.2's 128256: 8; no Linear of
# GPT-2-small's, Llama-1B's or a ViT's blocks is split). Static in the shapes, not the batch, so that the fake
# kernel's parts are the launch's. Timed on one H100, bf16 (benchmarks/gram_norm_kernel.py --split-k, 2026-11-28):
# GPT-2's head at 32x256 2.01 ms unsplit, 1.72 in pieces of 8192, 1.48 of 16384; Llama's at 2x1024 0.84, 0.91,
# 0.77 (each piece recomputes A's Gram over all of A's features: more pieces cost more). Those times are of the
# kernel before its loads were unmasked (2026-12-02: GPT-2's head 4x faster), on unpadded rows: to time again.
SPLIT_K = 16384


def splits(p: int, m: int) -> int:
    return max(1, -(-max(p, m) // SPLIT_K))


def parts(S: int, p: int, m: int) -> int:
    """Output parts per sample: one per tile pair (zero below the diagonal) and piece of the wider operand."""
    return _tile_count(S, block(S)) ** 2 * splits(p, m)


def _tile_count(S: int, bs: int) -> int:
    return -(-S // bs)


def work(S: int, p: int, m: int) -> int:
    """Multiply-adds per sample of the kernel (linear_norm's cost model): only the tile pairs on and above the
    diagonal are computed (t (t + 1) / 2 of t^2, t tiles of block(S) rows, the last padded), and every piece of
    the wider operand recomputes the narrower one's Gram. GPT-2's 1024 rows: 36 of 64 pairs."""
    bs = block(S)
    t = _tile_count(S, bs)
    return bs * bs * t * (t + 1) // 2 * (min(p, m) * splits(p, m) + max(p, m))


BLOCK_K = 64
SMEM_RESERVE = 8 << 10  # shared memory left for the kernel's reductions and layout conversions (bytes)
_SMEM: dict = {}


def launch_config(bs: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tiles of BLOCK_S rows by 64 features, 8 warps from 128 rows, and as many pipeline stages as the device's
    shared memory holds, up to 4 for 16-bit operands and 3 for fp32. Timed on one H200, bf16, the LM heads' Grams
    in the step's layout (benchmarks/gram_norm_kernel.py --configs, 2026-12-02): 4 stages against 3: GPT-2's at
    32x256 0.284 against 0.323 ms, at 8x1024 0.754 against 0.857, Llama-3.2's at 2x1024 0.533 against 0.602;
    128x128 tiles in 2-3 stages were slower on all but GPT-2 at 32x256, 4 warps slower everywhere."""
    itemsize = dtype.itemsize
    stages = 4 if itemsize <= 2 else 3
    smem = _shared_memory(device)
    if smem is not None:  # a stage holds a [BLOCK_S, BLOCK_K] tile of each of the dot's operands
        stages = max(1, min(stages, (smem - SMEM_RESERVE) // (2 * bs * BLOCK_K * itemsize)))
    return {"BLOCK_S": bs, "BLOCK_K": BLOCK_K, "num_warps": 8 if bs >= 128 else 4, "num_stages": stages}


def _shared_memory(device: torch.device) -> int | None:
    """The most shared memory a CUDA device lets one program have (bytes; Triton's own check of a kernel uses the
    same number); None without a CUDA device to ask (a CPU-only run planning launches for a GPU: the caps)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMEM:
        from triton.runtime import driver

        _SMEM[index] = int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    return _SMEM[index]


# Defined with torch.library's low-level API, as dpcompile::conv_weight_sq_norms is: custom_op's Python dispatch
# costs tens of microseconds of host time per call, and a ViT's step calls this 48 times.
_LIB = torch.library.Library("dpcompile", "FRAGMENT")
_LIB.define("gram_sq_norms(Tensor a, Tensor g) -> Tensor")


def gram_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """a: [B, S, p], g: [B, S, m], any strides. Returns [B, parts] fp32 partial sums of
    sum_{s,t} (a_s . a_t)(g_s . g_t) per sample (the squared norm of a_i^T g_i), which add to it."""
    if a.device.type == "cuda":
        return launch(a, g)
    return _aten(a, g)


_LIB.impl("gram_sq_norms", gram_sq_norms, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::gram_sq_norms", lib=_LIB)
def _(a, g):
    return a.new_empty([a.shape[0], parts(a.shape[1], a.shape[2], g.shape[2])], dtype=torch.float32)


def _aten(a, g):
    """The same sums with aten ops, a block of samples at a time; each sample's total in the first part."""
    B, S = a.shape[0], a.shape[1]
    out = torch.zeros(B, parts(S, a.shape[2], g.shape[2]), dtype=torch.float32, device=a.device)
    if B == 0:
        return out
    acc = torch.promote_types(torch.promote_types(a.dtype, g.dtype), torch.float32)
    step = max(1, CPU_BLOCK_BYTES // (2 * S * S * acc.itemsize))
    for lo in range(0, B, step):
        ab, gb = a[lo:lo + step].to(acc), g[lo:lo + step].to(acc)
        ga = torch.bmm(ab, ab.transpose(1, 2))
        gg = torch.bmm(gb, gb.transpose(1, 2))
        out[lo:lo + step, 0] = (ga * gg).flatten(1).sum(1).to(torch.float32)
    return out


_PLANS: dict = {}  # launch() arguments per call signature (kernel_plans.cached_plan)


def launch(a, g, config: dict | None = None):
    """Runs the Triton kernel (on CPU tensors too under TRITON_INTERPRET=1). config: BLOCK_S, BLOCK_K, num_warps,
    num_stages to try others (benchmarks/gram_norm_kernel.py); its parts then differ."""
    a, g, key, plan = _prepared(a, g, config)
    B, n_parts, grid, args, consts, plan_id = plan
    out = torch.empty(B, n_parts, dtype=torch.float32, device=a.device)
    if B:
        from dpcompile import triton_kernels

        kernel_plans.launch(triton_kernels.gram_sq_norms_kernel, grid, (a, g, out, *args), consts, plan_id)
    return out


def _prepared(a, g, config=None):
    """(a, g in the kernel's dtype and order, their call signature, its plan)."""
    dtype = kernel_dtype(a.dtype, g.dtype)
    if a.dtype != dtype:
        a = a.to(dtype)
    if g.dtype != dtype:
        g = g.to(dtype)
    if a.shape[2] > g.shape[2]:  # the sum is symmetric in the two; the kernel splits its second operand
        a, g = g, a
    tf32 = dtype == torch.float32 and a.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    key = (a.shape, a.stride(), g.shape, g.stride(), dtype, a.device, tf32, SPLIT_K,
           tuple(sorted(config.items())) if config else None)
    return a, g, key, cached_plan(_PLANS, key, lambda: _plan(a, g, dtype, tf32, config))


# -- many contractions in one call ---------------------------------------------------------------------------------
# bk keeps every layer's per-sample operands until the clip, so its Gram norms can all run where the last one is
# (passes.grouped_gram_norms): one call, one launch per signature (shapes, strides, dtype) through a table of the
# operands' addresses, as zero_rows_ and add_randn do. GPT-2-small's 49 Gram norm launches cost about 20 us of host
# time each, and its bf16 32x256 step is host-bound (22.1 ms of wall clock against 19.2 of GPU time, one H200).
_LIB.define("gram_sq_norms_group(Tensor[] a, Tensor[] g) -> Tensor")
TABLE_ENTRIES = 4  # per contraction: a's address, g's, its output block's, and a pad (rows 16-byte aligned)
MAX_TABLE_ROWS = 65535  # a launch's grid dim 1


def gram_sq_norms_group(a: list[torch.Tensor], g: list[torch.Tensor]) -> torch.Tensor:
    """a[k]: [B, S_k, p_k], g[k]: [B, S_k, m_k] (one B, one device). Returns [B, sum_k parts_k] fp32: the
    partial sums gram_sq_norms(a[k], g[k]) side by side, in the order of k."""
    if a and a[0].device.type == "cuda":
        return launch_group(a, g)  # (which checks them)
    _check_group(a, g)
    return torch.cat([_aten(x, y) for x, y in zip(a, g)], 1)


_LIB.impl("gram_sq_norms_group", gram_sq_norms_group, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::gram_sq_norms_group", lib=_LIB)
def _(a, g):
    _check_group(a, g)
    return a[0].new_empty([a[0].shape[0], group_parts(a, g)], dtype=torch.float32)


def group_parts(a, g) -> int:
    return sum(parts(x.shape[1], x.shape[2], y.shape[2]) for x, y in zip(a, g))


def _check_group(a, g) -> None:
    if len(a) != len(g) or not a:
        raise ValueError(f"gram_sq_norms_group: {len(a)} first and {len(g)} second operands; give one pair per "
                         f"contraction, at least one")
    B, device = a[0].shape[0], a[0].device
    for x, y in zip(a, g):
        if x.dim() != 3 or y.dim() != 3 or x.shape[0] != B or y.shape[0] != B or x.shape[1] != y.shape[1] \
                or x.device != device or y.device != device:
            raise ValueError(f"gram_sq_norms_group: operands must be [B, S, p] and [B, S, m] with one B and "
                             f"device; got {tuple(x.shape)} on {x.device} and {tuple(y.shape)} on {y.device} "
                             f"with B={B} on {device}")


_TABLE_PLANS: dict = {}  # the table kernel's constexprs and launch id per (signature, output stride, alignment,
# first row)


def launch_group(a: list[torch.Tensor], g: list[torch.Tensor]) -> torch.Tensor:
    """gram_sq_norms_group through the table kernel, one launch per signature (on CPU tensors too under
    TRITON_INTERPRET=1); per contraction where no table can be made (a CUDA graph capture with no pinned memory
    set aside)."""
    _check_group(a, g)
    recording = kernel_plans.is_recording()  # fake tensors (dpcompile.precompile): no addresses
    members: dict = {}  # (signature, aligned) -> [(a, g, plan, column)]
    column = 0
    for x, y in zip(a, g):
        x, y, key, plan = _prepared(x, y)
        aligned = recording or (x.data_ptr() % 16 == 0 and y.data_ptr() % 16 == 0)
        members.setdefault((key, aligned), []).append((x, y, plan, column))
        column += plan[1]
    B = a[0].shape[0]
    out = torch.empty(B, column, dtype=torch.float32, device=a[0].device)
    if not B:
        return out
    from dpcompile import triton_kernels

    base = 0 if recording else out.data_ptr()
    entries: list[int] = []
    for group in members.values():
        for x, y, plan, col in group:
            entries += (0, 0, 0, 0) if recording else (x.data_ptr(), y.data_ptr(), base + 4 * col, 0)
    table = address_tables.table(entries, out.device)
    if table is None:
        for group in members.values():
            for x, y, plan, col in group:
                out[:, col:col + plan[1]] = launch(x, y)
        return out
    row = 0
    for (key, aligned), group in members.items():
        _, n_parts, grid, args, consts, _ = group[0][2]
        for lo in range(0, len(group), MAX_TABLE_ROWS):
            n = min(MAX_TABLE_ROWS, len(group) - lo)
            # (the table whole, its first row an argument: a slice of it is a view op per launch, host time)
            table_consts, plan_id = cached_plan(_TABLE_PLANS, (key, column, aligned, row + lo),
                                                lambda: ({**consts, "ALIGNED": aligned}, kernel_plans.launch_id()))
            kernel_plans.launch(triton_kernels.gram_sq_norms_table_kernel, (grid[0], n),
                                (table, row + lo, group[0][0], column, *args), table_consts, plan_id)
        row += len(group)
    return out


def _plan(a, g, dtype, tf32, config):
    """(B, parts, grid, the kernel's other positional arguments, its keyword ones, their kernel_plans.launch_id)
    for one call signature."""
    B, S, P = a.shape
    cfg = {**launch_config(block(S), dtype, a.device), **(config or {})}
    M = g.shape[2]
    tiles = _tile_count(S, cfg["BLOCK_S"])
    n = splits(P, M)
    piece = -(-M // n)
    piece = -(-piece // cfg["BLOCK_K"]) * cfg["BLOCK_K"]  # whole K steps (a last piece may be empty: adds 0)
    precision = ("tf32" if tf32 else "ieee") if dtype == torch.float32 else None
    consts = dict(S=S, P=P, M=M, TILES=tiles, SPLITS=n, KS=piece, PRECISION=precision, **cfg)
    grid = (B * tiles * tiles * n,)
    return B, tiles * tiles * n, grid, (*a.stride(), *g.stride()), consts, kernel_plans.launch_id()
