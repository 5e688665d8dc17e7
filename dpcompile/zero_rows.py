"""A dropped sample's rows zeroed in place: ``torch.ops.dpcompile.zero_rows_(x, keep, dim)``.

bk rebuilds each weight gradient after the clip coefficients from two per-sample operands: one scaled by the
coefficients (a copy), the other with a dropped sample's rows zeroed, since a dropped sample may hold inf or
NaN and 0 * inf is NaN. Written as ``where(keep, x, 0)`` that mask is a second full copy of the operand, though
a step drops no sample as a rule. This op zeroes the rows whose ``keep`` is False where they lie: one program
per row, kept rows return at once, so the step pays a launch, not a read and a write of the operand
(dpcompile.passes.inplace_row_masks chooses where it may mutate).

keep: bool, one entry per index of ``x``'s dim ``dim`` (any shape with that many elements). CUDA tensors whose
rows are runs of contiguous elements (contiguous, channels-last, padded rows, a transposed view) take the
Triton kernel (CPU tensors too under ``TRITON_INTERPRET=1``, through ``launch``); any other layout and device
``masked_fill_``, which writes every element.
"""
from __future__ import annotations

import torch

from . import kernel_plans
from .kernel_plans import cached_plan

BLOCK = 1024

_LIB = torch.library.Library("dpcompile", "FRAGMENT")
_LIB.define("zero_rows_(Tensor(a!) x, Tensor keep, int dim) -> ()")


def zero_rows_(x: torch.Tensor, keep: torch.Tensor, dim: int) -> None:
    if x.device.type != "cuda" or not _run(x, keep, dim):
        masked_fill(x, keep, dim)


_LIB.impl("zero_rows_", zero_rows_, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::zero_rows_", lib=_LIB)
def _(x, keep, dim):
    return None


def _kernel():
    from dpcompile import triton_kernels

    return triton_kernels.zero_rows_kernel


def masked_fill(x: torch.Tensor, keep: torch.Tensor, dim: int) -> None:
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    x.masked_fill_(keep.reshape(shape).logical_not(), 0)


def row_runs(shape, strides, dim: int) -> tuple[int, int, int, int] | None:
    """(row_stride, P, s_p, Q) when every index j of ``dim`` holds P runs of Q contiguous elements starting at
    j * row_stride + p * s_p; None otherwise. The other dims, largest stride first, merge where one continues
    the next; at most two may remain, the inner one contiguous (or, alone, runs of one element)."""
    rest = sorted(((st, sz) for i, (sz, st) in enumerate(zip(shape, strides)) if i != dim and sz != 1),
                  reverse=True)
    merged: list[list[int]] = []
    for st, sz in rest:
        if merged and merged[-1][0] == st * sz:
            merged[-1] = [st, merged[-1][1] * sz]
        else:
            merged.append([st, sz])
    if any(st == 0 for st, _ in merged):
        return None
    if not merged:
        return strides[dim], 1, 0, 1
    if len(merged) == 1:  # one run, or (the masked dim innermost) runs of one element
        st, sz = merged[0]
        return (strides[dim], 1, 0, sz) if st == 1 else (strides[dim], sz, st, 1)
    if len(merged) > 2 or merged[-1][0] != 1:
        return None
    return strides[dim], merged[0][1], merged[0][0], merged[1][1]


_PLANS: dict = {}  # launch arguments per call signature (kernel_plans.cached_plan)


def _plan(x: torch.Tensor, keep: torch.Tensor, dim: int):
    """(grid, the kernel's other positional arguments, BLOCK); () where there is nothing to zero; None where x's
    layout has no runs (masked_fill_ then)."""
    runs = row_runs(x.shape, x.stride(), dim)
    if runs is None:
        return None
    n = x.shape[dim]
    if n == 0 or x.numel() == 0:
        return ()
    if keep.numel() != n:
        raise ValueError(f"zero_rows_: keep has {keep.numel()} entries for {n} rows along dim {dim}")
    keep_stride = keep.stride(dim) if keep.dim() == x.dim() else keep.stride(-1) if keep.dim() else 0
    row_stride, P, s_p, Q = runs
    return (n,), (keep_stride, row_stride, P, s_p, Q), min(BLOCK, max(16, _pow2(Q)))


def _run(x: torch.Tensor, keep: torch.Tensor, dim: int) -> bool:
    """The Triton kernel where x's layout has row runs (False where it has not). A step calls this once per
    masked operand (49 times for GPT-2-small) and such steps are launch-bound: one cached plan per call
    signature, the keep flags passed as they lie."""
    plan = cached_plan(_PLANS, (x.shape, x.stride(), keep.shape, keep.stride(), dim), lambda: _plan(x, keep, dim))
    if plan is None:
        return False
    if plan:
        kernel_plans.launch(_kernel(), plan[0], (x, keep, *plan[1]), {"BLOCK": plan[2]})
    return True


def launch(x: torch.Tensor, keep: torch.Tensor, dim: int) -> None:
    """The Triton kernel (on CPU tensors too under TRITON_INTERPRET=1); x's layout must have row runs. keep: bool,
    x.shape[dim] entries, as a 1-D vector or shaped [1, .., N, .., 1] like x (any strides)."""
    if not _run(x, keep, dim):
        raise ValueError(f"zero_rows_: a tensor of shape {tuple(x.shape)} and strides {x.stride()} has no "
                         f"contiguous runs along dim {dim}")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
