"""Per-sample squared norms of a convolution's weight gradient in one kernel (implicit GEMM), for 1-D and 2-D
convolutions: ``torch.ops.dpcompile.conv_weight_sq_norms``.

The direct form of the norm (passes.conv_norms) is each sample's weight gradient, E^T unfold(X) per group, and
its sum of squares. Written out in the graph it is an unfold of X (K = kernel-size times its input, written and
read back), a batched matmul writing [B, *weight] in fp32, and a reduction: three launches per layer, and on
a WRN-16-4 at batch 256 (bf16, one H100) 2.3 ms of GPU time against the non-private step's 3.9 ms. The kernel
contracts E with X's windows as it loads them (the unfold is address arithmetic), keeps each tile of the
gradient in registers, and writes one partial sum of squares per tile: nothing of size [B, *weight] or
[B, K * X] exists. Tiles of the gradient's columns run over (kernel position, input channel) with the channel
fastest, contiguous in a channels-last input; a squared norm does not depend on the columns' order.

Output: [B, parts] fp32 partial sums (one per group and tile), summed by the caller: no atomics, so the
norms are the same bits every run. CUDA runs the Triton kernel (the operands' dtype into fp32 accumulation; fp32
operands use TF32 when ``torch.backends.cuda.matmul.allow_tf32`` allows it, as the bmm it replaces did); other
devices the same contraction with aten ops, in blocks of samples. Under ``TRITON_INTERPRET=1`` the Triton
kernel runs on CPU tensors (``launch``): that is how it is tested without a GPU.
"""
from __future__ import annotations

import math

import torch

from . import kernel_plans
from .kernel_plans import cached_plan, kernel_dtype

CPU_BLOCK_BYTES = 64 << 20  # the aten path: per-sample gradients of at most this many bytes at a time


def supported(e_shape, x_shape, weight_shape, transposed: bool, groups: int) -> bool:
    """The kernel covers 1-D and 2-D convolutions (not transposed) whose gradient tiles fill a tensor-core dot
    (at least 16 output channels per group and 16 columns): depthwise and tiny layers keep the graph's form."""
    nd = len(weight_shape) - 2
    if transposed or nd not in (1, 2) or len(e_shape) != nd + 2 or len(x_shape) != nd + 2:
        return False
    cout_g = weight_shape[0] // groups
    return cout_g >= 16 and weight_shape[1] * math.prod(weight_shape[2:]) >= 16


def tiles(cout_g: int, n: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): the gradient tile of one program, from the static weight shape (n columns) and the
    kernel's dtype (the output's parts depend on it, so the fake kernel computes the same). Chosen on a
    WRN-16-4's layers, channels-last, batch 256, one H100 (benchmarks/conv_norm_kernel.py): 128 columns where
    there are that many (64 -> 64 channels at 32x32, bf16: 0.13 -> 0.07 ms against 64x64 tiles); up to 128
    rows in half precision, at most 32 in fp32 (64-row fp32 tiles: 1.5-2x slower)."""
    top = 128 if dtype != torch.float32 else 32
    bm = next(t for t in (128, 64, 32, 16) if t <= top and (cout_g >= t or t == 16))
    bn = next(t for t in (128, 64, 32, 16) if n >= t or t == 16)
    return bm, bn


def parts(weight_shape, groups: int, dtype: torch.dtype) -> int:
    cout_g, n = weight_shape[0] // groups, weight_shape[1] * math.prod(weight_shape[2:])
    return _tile_count(groups, cout_g, n, *tiles(cout_g, n, dtype))


def _tile_count(groups: int, cout_g: int, n: int, bm: int, bn: int) -> int:
    """Tiles of the gradient per sample, one partial sum each: the fake kernel's parts and the launch's alike."""
    return groups * -(-cout_g // bm) * -(-n // bn)


def launch_config(bm: int, bn: int, n_pos: int, dtype: torch.dtype) -> dict:
    """Warps and the positions per step (the dot's K) for a tile: 8 warps from 64x128; a whole 8x8 map per
    step in a 128x128 tile (WRN-16-4's 256-channel layers, bf16: 0.11 -> 0.08 ms). fp32's narrow tiles take 64
    positions a step in two stages (WRN-16-4's 8 layer kinds, TF32, one H200: 1.33 -> 1.16 ms; the 8x8 ones
    0.39 -> 0.27 ms; 64-row tiles stay 1.5-2x slower in every tried configuration)."""
    if dtype == torch.float32:
        return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_P": 64, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_P": 64 if bm * bn >= 128 * 128 and n_pos <= 64 else 32,
            "num_warps": 8 if bm * bn >= 64 * 128 else 4, "num_stages": 3}


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(2) if t.dim() == 3 else t


def _geometry(weight_shape, stride, padding, dilation):
    """2-D kernel, stride, padding, dilation (a 1-D convolution is a 2-D one of height 1)."""
    if len(weight_shape) == 3:
        return [1, weight_shape[2]], [1, stride[0]], [0, padding[0]], [1, dilation[0]]
    return list(weight_shape[2:]), list(stride), list(padding), list(dilation)


# Defined with torch.library's low-level API, not ``custom_op``: the op runs 12 times in a WRN-16-4's step, and
# custom_op's Python dispatch took 36 us of host time per call on top of the launch's 35 (one H100's host);
# these steps are launch-bound.
_LIB = torch.library.Library("dpcompile", "FRAGMENT")
_LIB.define("conv_weight_sq_norms(Tensor e, Tensor x, int[] weight_shape, int[] stride, int[] padding, "
            "int[] dilation, int groups, int rows) -> Tensor")


def conv_weight_sq_norms(e: torch.Tensor, x: torch.Tensor, weight_shape: list[int], stride: list[int],
                         padding: list[int], dilation: list[int], groups: int, rows: int) -> torch.Tensor:
    """e: the output gradient [B * rows, Cout, *S']; x: the input [B * rows, Cin, *S]; a sample's rows are
    contiguous (rows per sample). Returns [B, parts] fp32: partial sums of the squared entries of each
    sample's weight gradient, which add to its squared norm."""
    if e.device.type == "cuda":
        return launch(e, x, weight_shape, stride, padding, dilation, groups, rows)
    return _aten(e, x, weight_shape, stride, padding, dilation, groups, rows)


_LIB.impl("conv_weight_sq_norms", conv_weight_sq_norms, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::conv_weight_sq_norms", lib=_LIB)
def _(e, x, weight_shape, stride, padding, dilation, groups, rows):
    return e.new_empty([e.shape[0] // rows, parts(weight_shape, groups, kernel_dtype(e.dtype, x.dtype))],
                       dtype=torch.float32)


_LIB.define("conv_weight_grads(Tensor e, Tensor x, int[] weight_shape, int[] stride, int[] padding, "
            "int[] dilation, int groups, int rows) -> (Tensor, Tensor)")


def conv_weight_grads(e: torch.Tensor, x: torch.Tensor, weight_shape: list[int], stride: list[int],
                      padding: list[int], dilation: list[int], groups: int, rows: int):
    """conv_weight_sq_norms's partial sums, and the per-sample weight gradients they are the squares of:
    [B, Cout, K * Cin/groups] (grads_dtype), each row's columns in the kernel's order, kernel position outer and
    input channel inner (``weight_order`` maps them to the weight's [Cout, Cin/groups, *kernel]). Where bk
    defers a convolution's weight gradient until the clip coefficients exist, the kept gradients make it:
    sum_b r_b grads[b], one small reduction, not a second weight-gradient convolution over every position."""
    if e.device.type == "cuda" and grads_dtype(e.dtype, x.dtype) == torch.float32:
        return launch(e, x, weight_shape, stride, padding, dilation, groups, rows, keep=True)
    return _aten(e, x, weight_shape, stride, padding, dilation, groups, rows, keep=True)


_LIB.impl("conv_weight_grads", conv_weight_grads, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::conv_weight_grads", lib=_LIB)
def _(e, x, weight_shape, stride, padding, dilation, groups, rows):
    B = e.shape[0] // rows
    return (e.new_empty([B, parts(weight_shape, groups, kernel_dtype(e.dtype, x.dtype))], dtype=torch.float32),
            e.new_empty(grads_shape(B, weight_shape), dtype=grads_dtype(e.dtype, x.dtype)))


def grads_shape(B, weight_shape: list[int]) -> list:
    """The kept gradients' shape: a [Cout, K * Cin/groups] row block per sample (the fake, aten and kernel agree)."""
    return [B, weight_shape[0], math.prod(weight_shape[1:])]


def grads_dtype(e_dtype: torch.dtype, x_dtype: torch.dtype) -> torch.dtype:
    """The kept gradients' dtype: fp32, the kernel's accumulator (fp64 operands take the aten path: fp64)."""
    return torch.promote_types(torch.promote_types(e_dtype, x_dtype), torch.float32)


def weight_order(weight_shape: list[int]) -> tuple[list[int], list[int]]:
    """(shape, permutation): a kept gradient's row [Cout * K * Cin/groups] viewed as ``shape`` and permuted by
    ``permutation`` is the weight's [Cout, Cin/groups, *kernel]."""
    kernel = list(weight_shape[2:])
    nk = len(kernel)
    return [weight_shape[0], *kernel, weight_shape[1]], [0, nk + 1, *range(1, nk + 1)]


def _aten(e, x, weight_shape, stride, padding, dilation, groups, rows, keep: bool = False):
    """The same contraction with aten ops: unfold, one bmm per block of samples; each sample's squared norm in
    the first part (the others zero); keep: and the gradients, as conv_weight_grads returns them."""
    B = e.shape[0] // rows
    out = torch.zeros(B, parts(weight_shape, groups, kernel_dtype(e.dtype, x.dtype)), dtype=torch.float32,
                      device=e.device)
    grads = torch.empty(grads_shape(B, weight_shape), dtype=grads_dtype(e.dtype, x.dtype),
                        device=e.device) if keep else None
    if B == 0:
        return (out, grads) if keep else out
    kernel, st, pad, dil = _geometry(weight_shape, stride, padding, dilation)
    acc = torch.promote_types(torch.promote_types(e.dtype, x.dtype), torch.float32)
    e4, x4 = _as_2d(e).to(acc), _as_2d(x).to(acc)
    cout, cin = e4.shape[1], x4.shape[1]
    cout_g, cin_g, K = cout // groups, cin // groups, kernel[0] * kernel[1]
    step = max(1, CPU_BLOCK_BYTES // (math.prod(weight_shape) * acc.itemsize))  # acc: fp32 or fp64
    for lo in range(0, B, step):
        hi = min(B, lo + step)
        eb, xb = e4[lo * rows:hi * rows], x4[lo * rows:hi * rows]
        u = torch.nn.functional.unfold(xb, kernel, dilation=dil, padding=pad, stride=st)  # [n * rows, Cin * K, P]
        n, P = hi - lo, u.shape[2]
        # [samples * groups, channels per group, rows * P]: a sample's rows are more positions
        u = u.view(n, rows, groups, cin_g * K, P).permute(0, 2, 3, 1, 4).reshape(n * groups, cin_g * K, rows * P)
        g = eb.reshape(n, rows, groups, cout_g, P).permute(0, 2, 3, 1, 4).reshape(n * groups, cout_g, rows * P)
        dw = torch.bmm(g, u.transpose(1, 2))  # [samples * groups, Cout/g, Cin/g * K]
        out[lo:hi, 0] = dw.square().view(n, -1).sum(1).to(torch.float32)
        if keep:  # unfold's columns are (input channel, kernel position): the kernel position outer
            grads[lo:hi] = dw.view(n, cout, cin_g, K).transpose(2, 3).reshape(n, cout, K * cin_g)
    return (out, grads) if keep else out


_PLANS: dict = {}  # launch() arguments per call signature (kernel_plans.cached_plan)


def launch(e, x, weight_shape, stride, padding, dilation, groups, rows, config: dict | None = None,
           keep: bool = False):
    """Runs the Triton kernel (on CPU tensors too under TRITON_INTERPRET=1). config: BLOCK_M, BLOCK_N, BLOCK_P,
    num_warps, num_stages to try others (benchmarks/conv_norm_kernel.py); its parts then differ. keep: the
    gradients too (conv_weight_grads)."""
    dtype = kernel_dtype(e.dtype, x.dtype)
    if e.dtype != dtype:
        e = e.to(dtype)
    if x.dtype != dtype:
        x = x.to(dtype)
    e4, x4 = _as_2d(e), _as_2d(x)
    tf32 = dtype == torch.float32 and e.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    key = (e4.shape, e4.stride(), x4.shape, x4.stride(), dtype, tf32, tuple(weight_shape), tuple(stride),
           tuple(padding), tuple(dilation), groups, rows, tuple(sorted(config.items())) if config else None, keep)
    B, n_parts, grid, args, consts, plan_id = cached_plan(
        _PLANS, key, lambda: _plan(e4, x4, dtype, tf32, weight_shape, stride, padding, dilation, groups, rows, config,
                                   keep))
    out = torch.empty(B, n_parts, dtype=torch.float32, device=e.device)
    grads = torch.empty(grads_shape(B, weight_shape), dtype=torch.float32, device=e.device) if keep else None
    if B:
        from dpcompile import triton_kernels

        kernel_plans.launch(triton_kernels.conv_weight_sq_norms_kernel, grid,
                            (e4, x4, out, out if grads is None else grads, *args), consts, plan_id)
    return (out, grads) if keep else out


def _plan(e4, x4, dtype, tf32, weight_shape, stride, padding, dilation, groups, rows, config, keep=False):
    """(B, parts, grid, the kernel's other positional arguments, its keyword ones, their kernel_plans.launch_id)
    for one call signature."""
    B = e4.shape[0] // rows
    kernel, st, pad, dil = _geometry(weight_shape, stride, padding, dilation)
    cout_g, cin_g = weight_shape[0] // groups, weight_shape[1]
    n_cols = cin_g * kernel[0] * kernel[1]
    n_pos = rows * e4.shape[2] * e4.shape[3]
    cfg = {**launch_config(*tiles(cout_g, n_cols, dtype), n_pos, dtype), **(config or {})}
    n_parts = _tile_count(groups, cout_g, n_cols, cfg["BLOCK_M"], cfg["BLOCK_N"])
    precision = ("tf32" if tf32 else "ieee") if dtype == torch.float32 else None
    args = (*e4.stride(), *x4.stride(), rows, cout_g, cin_g, e4.shape[2], e4.shape[3], x4.shape[2], x4.shape[3],
            groups, n_parts, n_pos)
    consts = dict(KH=kernel[0], KW=kernel[1], SH=st[0], SW=st[1], PH=pad[0], PW=pad[1], DH=dil[0], DW=dil[1],
                  PRECISION=precision, KEEP=keep, **cfg)
    return B, n_parts, (B * n_parts,), args, consts, kernel_plans.launch_id()
