"""A dropped sample's rows zeroed in place: ``torch.ops.dpcompile.zero_rows_(xs, keeps, dims)`` zeroes, in each
tensor xs[k], the indices of its dim dims[k] whose keeps[k] entry is False.

bk rebuilds each weight gradient after the clip coefficients from two per-sample operands: one scaled by the
coefficients (a copy), the other with a dropped sample's rows zeroed, since a dropped sample may hold inf or
NaN and 0 * inf is NaN. Written as ``where(keep, x, 0)`` that mask is a second full copy of the operand, though
a step drops no sample as a rule. This op zeroes the rows whose ``keep`` is False where they lie: its programs
for kept rows return at once, so the step pays a launch, not a read and a write of the operand
(dpcompile.passes.inplace_row_masks chooses where it may mutate, and masks many operands in one call).

keeps[k]: bool, one entry per index of xs[k]'s dim dims[k] (any shape with that many elements). CUDA tensors
whose rows are runs of contiguous elements (contiguous, channels-last, padded rows, a transposed view) take a
Triton kernel: one launch for one tensor (``launch``), one for all of a call's tensors on one device through a
table of their addresses (``launch_table``; a GPT-2-small step masks 49 operands, and such steps are
launch-bound: 49 launches cost about 1.5 ms of host time). CPU tensors take them too under
``TRITON_INTERPRET=1``, through those two functions. Any other layout and device: ``masked_fill_``, which writes
every element.
"""
from __future__ import annotations

import torch

from . import address_tables, kernel_plans
from .kernel_plans import cached_plan

BLOCK = 1024
ENTRIES = 8  # table entries per tensor (triton_kernels.zero_rows_table_kernel reads them)
ROWS = 256  # keep flags one program of the table kernel reads
TABLE_BLOCK = 1024  # bytes the table kernel zeroes at a time
MAX_TENSORS = 65535  # a launch's grid dim 1
_TABLE_CONSTS = {"ROWS": ROWS, "BLOCK": TABLE_BLOCK}
_table_plan_id = kernel_plans.launch_id()  # the table kernel's only other argument is the table (lower case:
# not a setting, compile_cache.settings, whose value depends on import order)

_LIB = torch.library.Library("dpcompile", "FRAGMENT")
_LIB.define("zero_rows_(Tensor(a!)[] xs, Tensor[] keeps, int[] dims) -> ()")


def zero_rows_(xs: list[torch.Tensor], keeps: list[torch.Tensor], dims: list[int]) -> None:
    if not len(xs) == len(keeps) == len(dims):
        raise ValueError(f"zero_rows_: {len(xs)} tensors, {len(keeps)} keep masks and {len(dims)} dims; give one "
                         f"mask and one dim per tensor")
    by_device: dict[int, list[tuple[torch.Tensor, torch.Tensor, tuple]]] = {}
    keep_keys: dict[int, tuple] = {}  # the masks' part of the plans' keys: a backward's masks share a few keeps
    for x, keep, dim in zip(xs, keeps, dims):
        plan = None
        if x.is_cuda:
            keep_key = keep_keys.get(id(keep)) or keep_keys.setdefault(id(keep), _keep_key(keep))
            plan = _plan(x, keep, dim, keep_key)
        if plan is None:
            masked_fill(x, keep, dim)
        elif plan:
            by_device.setdefault(x.get_device(), []).append((x, keep, plan))
    for runs in by_device.values():
        _launch_runs(runs)


_LIB.impl("zero_rows_", zero_rows_, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::zero_rows_", lib=_LIB)
def _(xs, keeps, dims):
    return None


def _kernels():
    from dpcompile import triton_kernels

    return triton_kernels.zero_rows_kernel, triton_kernels.zero_rows_table_kernel


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


def _keep_key(keep: torch.Tensor) -> tuple:
    return keep.shape, keep.stride(), keep.dtype


def _plan(x: torch.Tensor, keep: torch.Tensor, dim: int, keep_key: tuple | None = None) -> tuple | None:
    """(rows n, the one-tensor kernel's arguments after x and keep, its constexprs, the table kernel's entries
    after the two addresses, the one-tensor launch's kernel_plans.launch_id), cached per call signature (a step
    repeats the same calls, and is launch-bound: the key is what a call costs on the host); () where there is
    nothing to zero; None where x's layout has no runs (masked_fill_ then)."""
    key = (x.shape, x.stride(), x.dtype, keep_key or _keep_key(keep), dim)
    return cached_plan(_PLANS, key, lambda: _make_plan(x, keep, dim))


def _make_plan(x: torch.Tensor, keep: torch.Tensor, dim: int) -> tuple | None:
    if keep.dtype != torch.bool:
        raise ValueError(f"zero_rows_: keep must be a bool tensor, got {keep.dtype}")
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
    e = x.element_size()  # the table kernel counts in bytes
    return (n, (keep_stride, row_stride, P, s_p, Q), {"BLOCK": min(BLOCK, max(16, _pow2(Q)))},
            (n, keep_stride, row_stride * e, P, s_p * e, Q * e), kernel_plans.launch_id())


def _launch_runs(runs: list[tuple[torch.Tensor, torch.Tensor, tuple]], *, table_from: int = 2) -> None:
    """Tensors with row runs on one device: the table kernel for ``table_from`` or more of them, else the
    one-tensor kernel per tensor (also where a CUDA graph capture has no pinned memory set aside for a table)."""
    single, table_kernel = _kernels()
    left = [] if len(runs) >= table_from else runs
    for start in range(0, len(runs) if not left else 0, MAX_TENSORS):
        chunk = runs[start:start + MAX_TENSORS]
        if not _launch_table(table_kernel, chunk):
            left = left + chunk
    for x, keep, plan in left:
        kernel_plans.launch(single, (plan[0],), (x, keep, *plan[1]), plan[2], plan[4])


def _launch_table(kernel, runs: list[tuple[torch.Tensor, torch.Tensor, tuple]]) -> bool:
    """One launch over the tensors through a table of (address, flags' address, rows, flags' stride, row stride,
    P, s_p, Q) per tensor, the last four in bytes; False where there is no table (launch per tensor then)."""
    recording = kernel_plans.is_recording()  # fake tensors (dpcompile.precompile): no addresses
    entries: list[int] = []
    for x, keep, plan in runs:
        entries += (0, 0) if recording else (x.data_ptr(), keep.data_ptr())
        entries += plan[3]
    assert len(entries) == ENTRIES * len(runs), (len(entries), len(runs))
    table = address_tables.table(entries, runs[0][0].device)
    if table is None:
        return False
    grid = (-(-max(plan[0] for _x, _keep, plan in runs) // ROWS), len(runs))
    kernel_plans.launch(kernel, grid, (table,), _TABLE_CONSTS, _table_plan_id)
    return True


def _planned(xs, keeps, dims) -> list[tuple[torch.Tensor, torch.Tensor, tuple]]:
    runs = []
    for x, keep, dim in zip(xs, keeps, dims):
        plan = _plan(x, keep, dim)
        if plan is None:
            raise ValueError(f"zero_rows_: a tensor of shape {tuple(x.shape)} and strides {x.stride()} has no "
                             f"contiguous runs along dim {dim}")
        if plan:
            runs.append((x, keep, plan))
    return runs


def launch(x: torch.Tensor, keep: torch.Tensor, dim: int) -> None:
    """The one-tensor Triton kernel (on CPU tensors too under TRITON_INTERPRET=1); x's layout must have row runs.
    keep: bool, x.shape[dim] entries, as a 1-D vector or shaped [1, .., N, .., 1] like x (any strides)."""
    _launch_runs(_planned([x], [keep], [dim]))


def launch_table(xs: list[torch.Tensor], keeps: list[torch.Tensor], dims: list[int]) -> None:
    """The table kernel over all the tensors, on one device (CPU tensors under TRITON_INTERPRET=1), whatever
    their dtypes; every layout must have row runs."""
    runs = _planned(xs, keeps, dims)
    if len({x.device for x, _keep, _plan in runs}) > 1:
        raise ValueError("zero_rows_: launch_table takes tensors on one device")
    _launch_runs(runs, table_from=1)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
