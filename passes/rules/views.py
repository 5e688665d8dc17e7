"""Views and layout ops: where the sample dim goes when a tensor is reshaped, permuted, sliced, joined.

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import Any

import torch

from dpcompile.fx_utils import known, row_major

from ..batch_state import FREE, SINGLE, Batched, fail_layout, ndim, norm_dim, shape_of, view_layout

aten = torch.ops.aten


def _identity(an, node):
    return an.st(node.args[0])


def _view(an, node, x=None):
    """node's value is x's entries (default: its first argument) in node's shape."""
    x = node.args[0] if x is None else x
    lay = view_layout(shape_of(x), list(node.meta["val"].shape), an.st(x), an.B)
    if lay is None:
        return fail_layout(an, node, "reshapes the sample dim in a way dpcompile cannot track")
    return lay


def _permute(an, node):
    x, dims = node.args[0], node.args[1]
    s = an.st(x)
    if s.dim is None:
        return s
    n = ndim(x)
    dims = [norm_dim(d, n) for d in dims]
    return s.moved(dims.index(s.dim))


def _transpose(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is None:
        return s
    n = ndim(x)
    if node.target is aten.t.default:
        d0, d1 = 0, min(1, n - 1)
    else:
        d0, d1 = norm_dim(node.args[1], n), norm_dim(node.args[2], n)
    d = s.dim
    return s.moved(d1 if d == d0 else d0 if d == d1 else d)


def _unsqueeze(an, node):
    x, k = node.args[0], node.args[1]
    s = an.st(x)
    if s.dim is None:
        return s
    k = norm_dim(k, ndim(x) + 1)
    return s.moved(s.dim + (1 if k <= s.dim else 0))


def _squeeze(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is None:
        return s
    n = ndim(x)
    shape = shape_of(x)
    if len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = [norm_dim(d, n) for d in dims]
    else:
        dims = list(range(n))
    dims = [d for d in dims if known(shape[d] == 1)]
    if s.dim in dims:
        return SINGLE  # only possible when B == 1
    return s.moved(s.dim - sum(1 for d in dims if d < s.dim))


def _expand(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is None:
        return s
    out = node.meta["val"]
    d = s.dim + (out.dim() - ndim(x))
    if not known(out.shape[d] == shape_of(x)[s.dim]):
        return fail_layout(an, node, "expands the sample dim")
    return s.moved(d)


def _repeat(an, node):
    """x.repeat(reps): tiles x (new leading dims for extra reps). Tiling along a dim other than the sample dim
    keeps every sample's values in its own rows. Tiling the sample dim k times lays k copies of the batch one
    after another: row r of copy q is row r of x, sample (r // inner) % B as before, so the layout's ``outer``
    copies become k times as many (Llama 4's routed experts: the tokens repeated once per expert)."""
    x, reps = node.args[0], node.args[1]
    s = an.st(x)
    if not isinstance(s, Batched) or s.dim is None:
        return s
    d = s.dim + len(reps) - ndim(x)
    k = reps[d].meta["val"] if isinstance(reps[d], torch.fx.Node) else reps[d]
    if known(k == 1):
        return s.moved(d)
    return Batched(d, s.outer * k, s.inner)


def _slice(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is None:
        return s
    n = ndim(x)
    k = norm_dim(node.args[1] if len(node.args) > 1 else 0, n)
    if k == s.dim:
        if known(node.meta["val"].shape[k] == shape_of(x)[k]):
            return s
        blocks = _sliced_blocks(s, node, an.B)
        if blocks is not None:
            return Batched(k, blocks, s.inner)
        return fail_layout(an, node, "slices along the sample dim")
    return s


def _sliced_blocks(s: Batched, node, B):
    """How many whole copies of the batch a slice of a dim laid out as ``s.outer`` copies keeps (a
    tensor-parallel all-gather's pieces taken apart with symbolic sizes: slice [k*B, (k+1)*B)), or None if
    it cuts a copy or steps."""
    args = _arg_values(node, 5)
    start, step = _or(args[2], 0), _or(args[4], 1)
    if s.outer == 1 or not known(step == 1) or not known(start % (B * s.inner) == 0):
        return None
    blocks = _whole_blocks(s, [node.meta["val"].shape[s.dim]], B)
    return blocks[0] if blocks is not None else None


def _arg_values(node, n: int) -> list:
    """node's n positional arguments as values (a symbolic size is a SymInt node: its value), None where left
    out."""
    args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    return args + [None] * (n - len(args))


def _or(value, default):
    """value, or default where it is None (not ``value or default``: that asks whether a symbolic size is 0)."""
    return default if value is None else value


def _select(an, node):
    x, k = node.args[0], node.args[1]
    s = an.st(x)
    if s.dim is None:
        return s
    k = norm_dim(k, ndim(x))
    if k == s.dim:
        return fail_layout(an, node, "selects along the sample dim")
    return s.moved(s.dim - (1 if k < s.dim else 0))


def _diagonal_dims(node, at: int, n: int) -> tuple[int, int]:
    """dim1 and dim2 of diagonal (at=2) or diagonal_scatter (at=3: after base and src), of a tensor of n dims."""
    args = list(node.args) + [None] * 4
    return (norm_dim(args[at] if args[at] is not None else node.kwargs.get("dim1", 0), n),
            norm_dim(args[at + 1] if args[at + 1] is not None else node.kwargs.get("dim2", 1), n))


def _diagonal(an, node):
    """diagonal(x, offset, dim1, dim2): dim1 and dim2 go, the diagonal is a new last dim; per sample unless one
    of the two is the sample dim (a diagonal across samples)."""
    x = node.args[0]
    s = an.st(x)
    if s.dim is None:
        return s
    d1, d2 = _diagonal_dims(node, 2, ndim(x))
    if s.dim in (d1, d2):
        return fail_layout(an, node, "takes a diagonal across the sample dim")
    return s.moved(s.dim - sum(1 for d in (d1, d2) if d < s.dim))


def _split(an, node):
    x = node.args[0]
    s = an.st(x)
    outs = node.meta["val"]
    n = ndim(x)
    if node.target in (aten.unbind.int,):
        k = norm_dim(node.args[1] if len(node.args) > 1 else 0, n)
        if s.dim is not None and k == s.dim:
            return tuple(fail_layout(an, node, "unbinds the sample dim") for _ in outs)
        return tuple(s if s.dim is None else s.moved(s.dim - (1 if k < s.dim else 0)) for _ in outs)
    k = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), n)
    if s.dim is not None and k == s.dim and len(outs) > 1:
        blocks = _whole_blocks(s, [o.shape[k] for o in outs], an.B)
        if blocks is None:
            return tuple(fail_layout(an, node, "splits the sample dim") for _ in outs)
        return tuple(Batched(k, m, s.inner) for m in blocks)
    return tuple(s for _ in outs)


def _whole_blocks(s: Batched, sizes, B) -> list | None:
    """Pieces of a dim laid out as ``s.outer`` copies of the batch (each ``B * s.inner`` long, a tensor-parallel
    all-gather's ranks): how many whole copies each piece holds, or None if one cuts a copy. A piece of whole
    copies keeps every sample's rows in the same places."""
    block = B * s.inner
    out = []
    for size in sizes:
        if not known(size % block == 0) or known(size == 0):
            return None
        out.append(size // block)
    return out


def _cat(an, node):
    tensors = node.args[0]
    out = node.meta["val"]
    k = norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), out.dim())
    found = None
    states = [an.st(t) for t in tensors]
    if any(isinstance(s, Batched) and s.dim == k for s in states):
        # along the sample dim: whole copies of the batch, one after another (the pieces of a tensor-parallel
        # reduce-scatter, one per rank): the result is that many copies
        inner = states[0].inner if isinstance(states[0], Batched) else None
        if all(isinstance(s, Batched) and s.dim == k and known(s.inner == inner) for s in states):
            return Batched(k, sum(s.outer for s in states), inner)
        return fail_layout(an, node, "concatenates along the sample dim")
    for s in states:
        if isinstance(s, Batched) and s.dim is not None:
            if found is not None and found != s:
                return fail_layout(an, node, "concatenates tensors with different sample dims")
            found = s
    return found or SINGLE


def _stack(an, node):
    tensors = node.args[0]
    out = node.meta["val"]
    k = norm_dim(node.args[1] if len(node.args) > 1 else 0, out.dim())
    found = None
    for t in tensors:
        s = an.st(t)
        if isinstance(s, Batched) and s.dim is not None:
            cand = s.moved(s.dim + (1 if k <= s.dim else 0))
            if found is not None and found != cand:
                return fail_layout(an, node, "stacks tensors with different sample dims")
            found = cand
    return found or SINGLE


def _pad(an, node):
    x, pad = node.args[0], node.args[1]
    s = an.st(x)
    if s.dim is None:
        return s
    n = ndim(x)
    for j in range(len(pad) // 2):
        d = n - 1 - j
        if d == s.dim and (pad[2 * j] != 0 or pad[2 * j + 1] != 0):
            return fail_layout(an, node, "pads the sample dim")
    return s


def _flip(an, node):
    """flip (prims.rev: its decomposition) reverses the entries along dims: per sample unless one is the
    sample dim, whose rows it would hand to other samples."""
    x, dims = node.args[0], node.args[1]
    s = an.st(x)
    if s.dim is None:
        return s
    n = ndim(x)
    if s.dim in {norm_dim(d, n) for d in dims}:
        return fail_layout(an, node, "reverses the sample dim")
    return s


def _slice_scatter(an, node):
    """slice_scatter/select_scatter(base, src, dim, ...): the backward of slicing."""
    base, src = node.args[0], node.args[1]
    sb, ss = an.st(base), an.st(src)
    n = ndim(base)
    k = norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), n)
    found = None
    for s in (sb, ss):
        if isinstance(s, Batched) and s.dim is not None:
            d = s.dim
            if node.target is aten.select_scatter.default and s is ss and d >= k:
                d += 1  # src lacks the selected dim
            cand = s.moved(d)
            if found is not None and found != cand:
                return fail_layout(an, node, "scatters between tensors with different sample dims")
            found = cand
    if found is None:
        return SINGLE
    if found.dim == k:
        placed = _scattered_blocks(an, node, sb, ss, k) if node.target is aten.slice_scatter.default else None
        return placed if placed is not None else fail_layout(an, node, "scatters along the sample dim")
    return found


def _diagonal_scatter(an, node):
    """diagonal_scatter(base, src, offset, dim1, dim2): the backward of diagonal; src is laid out as the
    base's diagonal (dim1 and dim2 gone, the diagonal last)."""
    base, src = node.args[0], node.args[1]
    n = ndim(base)
    d1, d2 = _diagonal_dims(node, 3, n)
    rest = [d for d in range(n) if d not in (d1, d2)]  # base's dim of each of src's dims but the last
    found = None
    for s, from_src in ((an.st(base), False), (an.st(src), True)):
        if not (isinstance(s, Batched) and s.dim is not None):
            continue
        if from_src and s.dim >= len(rest):
            return fail_layout(an, node, "scatters a diagonal across the sample dim")
        cand = s.moved(rest[s.dim] if from_src else s.dim)
        if found is not None and found != cand:
            return fail_layout(an, node, "scatters between tensors with different sample dims")
        found = cand
    if found is None:
        return SINGLE
    if found.dim in (d1, d2):
        return fail_layout(an, node, "scatters a diagonal across the sample dim")
    return found


def _scattered_blocks(an, node, sb, ss, k):
    """slice_scatter along the sample dim that writes whole copies of the batch at a whole copy's place (the
    backward of ``_sliced_blocks``' slice: ``t[B:2B]`` of a tensor tiled twice) leaves every row its sample:
    row r of the source lands on row start + r, the same sample when start is a multiple of a copy's length.
    The base is that many copies (or holds no sample's data: zeros); the result is laid out as the base."""
    args = _arg_values(node, 6)
    start, step = _or(args[3], 0), _or(args[5], 1)
    if not isinstance(ss, Batched) or ss.dim != k or not known(step == 1):
        return None
    inner, block = ss.inner, an.B * ss.inner
    if not known(start % block == 0) or _whole_blocks(ss, [shape_of(node.args[1])[k]], an.B) is None:
        return None
    base_blocks = _whole_blocks(ss, [shape_of(node.args[0])[k]], an.B)
    if base_blocks is None:
        return None
    if sb is FREE or (isinstance(sb, Batched) and sb.dim is None):  # no sample's data (zeros, a parameter's)
        return Batched(k, base_blocks[0], inner)
    if isinstance(sb, Batched) and sb.dim == k and known(sb.inner == inner) and known(sb.outer == base_blocks[0]):
        return sb
    return None


def _whole_and_row_major(size, stride, offset, base) -> bool:
    """size/stride/offset address every entry of the contiguous tensor ``base``, in row-major order (the
    strides of size-1 dims do not matter)."""
    return known(prod_of(size) == base.numel()) and (offset is None or known(offset == 0)) and \
        base.is_contiguous() and known(base.storage_offset() == 0) and \
        row_major(size, stride)


def _as_strided(an, node):
    """as_strided that reads a contiguous tensor as another contiguous shape of the same size (Inductor's
    GroupNorm decomposition re-reads its [N, G, C/G, 1] statistics as [N, C] this way) is a view; any other
    as_strided (overlapping or skipping entries, an offset) could move entries across samples: refused."""
    x, out = node.args[0], node.meta["val"]  # sizes and strides as values (a batch size is a graph node)
    xv = x.meta["val"]
    if not _whole_and_row_major(list(out.shape), list(out.stride()), out.storage_offset(), xv):
        return fail_layout(an, node, "reads the tensor's memory with strides of its own (as_strided)")
    return _view(an, node)


def _value(a):
    """A size, stride or offset argument as a value (a symbolic size is a graph node)."""
    return a.meta["val"] if hasattr(a, "meta") else a


def _as_strided_scatter(an, node):
    """as_strided_scatter(base, src, size, stride, offset) that writes every entry of a contiguous base, in
    the row-major order of a contiguous ``size``, is ``src`` reshaped as ``base``: none of base's entries
    survive. AOTAutograd emits it as the backward of an as_strided view that restrides a tensor (a mean over
    a channels-last map's 1x1 positions: timm's pooling in ConvNeXt). Any other (a part of base kept, strides
    of its own, an offset) could move entries across samples: refused."""
    base, src = node.args[0], node.args[1]
    size = [_value(a) for a in node.args[2]]
    stride = [_value(a) for a in node.args[3]]
    offset = _value(node.args[4] if len(node.args) > 4 else node.kwargs.get("storage_offset"))
    bv = base.meta["val"]
    if not (_whole_and_row_major(size, stride, offset, bv) and known(src.meta["val"].numel() == bv.numel())):
        return fail_layout(an, node, "writes into the tensor's memory with strides of its own (as_strided_scatter)")
    return _view(an, node, src)


def prod_of(xs):
    p = 1
    for x in xs:
        p = p * x
    return p


RULES: dict[Any, Any] = {}
RULES[aten.as_strided] = _as_strided
RULES[aten.as_strided_scatter] = _as_strided_scatter
for p in (aten.view, aten._unsafe_view, aten.reshape):
    RULES[p] = _view
# _conj: a complex tensor's conjugate as a view (torch.conj, the backward of complex ops), entry by entry
for p in (aten.clone, aten.alias, aten._to_copy, aten.detach, aten.lift_fresh_copy, aten.contiguous, aten._conj):
    RULES[p] = _identity
RULES[aten.permute] = _permute
RULES[aten.transpose] = _transpose
RULES[aten.t] = _transpose
RULES[aten.unsqueeze] = _unsqueeze
RULES[aten.squeeze] = _squeeze
RULES[aten.expand] = _expand
RULES[aten.repeat] = _repeat
RULES[aten.slice] = _slice
RULES[aten.select] = _select
RULES[aten.diagonal] = _diagonal
for p in (aten.split, aten.split_with_sizes, aten.unbind, aten.chunk):
    RULES[p] = _split
RULES[aten.cat] = _cat
RULES[aten.stack] = _stack
RULES[aten.constant_pad_nd] = _pad
RULES[aten.flip] = _flip
RULES[torch.ops.prims.rev] = _flip
RULES[aten.slice_scatter] = _slice_scatter
RULES[aten.select_scatter] = _slice_scatter
RULES[aten.diagonal_scatter] = _diagonal_scatter
