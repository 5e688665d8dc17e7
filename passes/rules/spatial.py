"""Spatial ops of vision models: pooling, interpolation, padding, sliding windows, and their backwards.

These ops treat every index of their leading dims (N and C) on its own and mix values only along their
last k dims (k = 1, 2 or 3, the op's spatial dims; an unbatched input lacks N, and then C or anything else
before the spatial dims is a leading dim). A sample dim among the leading dims keeps its layout, whatever
its outer/inner blocks; a sample dim among the spatial dims would mix samples and is refused. A backward
op takes the output's gradient and the input or indices: all its per-sample operands must share one layout,
which the input's gradient keeps.

Inductor's decompositions turn several of these ops into others that no other family covers, which live
here too: the low-memory max-pool prims (max pooling's forward), ``scatter_add`` (max pooling's backward
over flattened planes; ``scatter`` and ``scatter_reduce`` alike: topk's backward), ``_unsafe_masked_index``
(reflection padding's backward), ``copy`` and ``new_empty_strided`` (circular padding) and ``unfold``
(``Tensor.unfold``).

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers prims._low_memory_max_pool_*)
import torch.fx as fx

from dpcompile.fx_utils import known

from ..batch_state import FREE, SINGLE, Batched, fail_layout, ndim, norm_dim, one_layout, same_layout, shape_of

aten = torch.ops.aten
prims = torch.ops.prims


def _for_each_output(node: fx.Node, state):
    """The state of every output: max pooling returns (values, indices), both laid out like the input."""
    v = node.meta["val"]
    return tuple(state for _ in v) if isinstance(v, (tuple, list)) else state


def _leading_layout(an, node: fx.Node, k: int):
    """The one layout of node's per-sample tensor operands, each checked to hold its samples before its
    last k (spatial) dims. Every operand of these ops has the output's number of dims, so the output's
    sample dim is the operands'."""
    found = one_layout(an, node, lambda a, s: s.dim < ndim(a) - k, "mixes along the sample dim")
    return found if found is not None else SINGLE


def _spatial(k: int):
    """The rule of an op (forward or backward) over the last k dims of its operands."""
    def rule(an, node):
        return _for_each_output(node, _leading_layout(an, node, k))
    return rule


def _low_memory_max_pool(an, node):
    """prims._low_memory_max_pool_with_offsets / _offsets_to_indices (Inductor's max pooling): the
    kernel size (args[1]) says how many trailing dims are pooled."""
    return _for_each_output(node, _leading_layout(an, node, len(node.args[1])))


def _scatter(an, node):
    """self.scatter_add(dim, index, src), self.scatter(dim, index, src or a value), self.scatter_reduce(...):
    src's entries put into self at index along dim, every other dim in place (max pooling's backward scatters
    each plane's gradient into that plane, over [N*C, H*W]; topk's backward puts a token's gradient back at its
    chosen positions, as in an MoE router). Per-sample rows stay apart unless dim is the sample dim, provided
    every operand covers all samples."""
    base, k, index = node.args[:3]
    src = node.args[3] if len(node.args) > 3 else node.kwargs.get("src")
    k = norm_dim(k, ndim(base))
    name = node.target.__name__.split(".")[0]
    found = None
    for a in (base, index, src):
        if not isinstance(a, fx.Node):  # scatter's scalar value
            continue
        s = an.st(a)
        if not isinstance(s, Batched):
            continue
        if s.dim is None:
            return SINGLE
        if s.dim == k:
            return fail_layout(an, node, f"{name} scatters along the sample dim")
        if found is not None and not same_layout(found, s):
            return fail_layout(an, node, f"{name} combines operands with different sample layouts")
        found = s
    if found is None:
        return SINGLE
    size = shape_of(base)[found.dim]
    if not all(known(shape_of(a)[found.dim] == size) for a in (index, src) if isinstance(a, fx.Node)):
        # a shorter index or src along the sample dim would shift which rows belong to which sample
        return fail_layout(an, node, f"{name} with operands of different lengths along the sample dim")
    return found


# ---------------------------------------------------------------------------
# _unsafe_masked_index: reflection padding's backward gathers each input position's gradient from the
# padded output with an index on every dim, the one on the sample dim an arange (every sample reads its
# own slice)
_IDENTITY_STEPS = {aten.view.default, aten.unsqueeze.default, aten.expand.default, aten.reshape.default,
                   aten._unsafe_view.default, prims.convert_element_type.default, aten.clone.default}


def _is_arange(idx: fx.Node, length) -> bool:
    """Whether idx holds 0, 1, ..., length - 1 along its one dim longer than 1 (an iota or arange, viewed or
    broadcast to a shape with 1s elsewhere)."""
    shape = shape_of(idx)
    if sum(1 for d in shape if not known(d == 1)) != 1:
        return False
    n = idx
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _IDENTITY_STEPS:
        n = n.args[0]
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return False
    # a symbolic length (Poisson-sampled batches) is a SymInt node: its value
    args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in n.args] + [None] * 3
    if n.target is prims.iota.default:
        start, step = n.kwargs.get("start", 0), n.kwargs.get("step", 1)
        return known(args[0] == length) and start == 0 and step == 1
    if n.target is aten.arange.default:
        return known(args[0] == length)
    if n.target in (aten.arange.start, aten.arange.start_step):
        step = args[2] if n.target is aten.arange.start_step else 1
        return args[0] == 0 and step == 1 and known(args[1] == length)
    return False


def _index_dims(indices):
    """(positions of the index tensors, where their broadcast dims start in x[indices], how many there are).
    Numpy's rule: adjacent index tensors put their broadcast dims where they stood, separated ones first."""
    positions = [p for p, i in enumerate(indices) if i is not None]
    R = max(ndim(indices[p]) for p in positions)
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    return positions, (positions[0] if adjacent else 0), R


def _masked_index(an, node):
    """_unsafe_masked_index(x, mask, indices, fill): x[indices] where mask holds, fill elsewhere."""
    x, mask, indices = node.args[:3]
    sx = an.st(x)
    if an.st(mask) is not FREE or any(an.st(i) is not FREE for i in indices if i is not None):
        return fail_layout(an, node, "indexes with per-sample indices or mask")
    if sx.dim is None:
        return SINGLE
    d = sx.dim
    if all(i is None for i in indices):
        return sx
    positions, start, R = _index_dims(indices)
    if d not in positions:
        kept_before = sum(1 for p in range(d) if p not in positions)
        return sx.moved(d if d < start else R + kept_before)
    idx = indices[d]
    if not _is_arange(idx, shape_of(x)[d]):
        return fail_layout(an, node, "indexes along the sample dim")
    # the samples land on the arange's dim of the broadcast index shape, in their own order
    r = next(j for j, n in enumerate(shape_of(idx)) if not known(n == 1)) + (R - ndim(idx))
    return sx.moved(start + r)


# ---------------------------------------------------------------------------
# circular padding (its decomposition copies into fresh tensors) and sliding windows
def _copy(an, node):
    """copy(self, src): src's values broadcast to self's shape; self gives only the shape."""
    dst, src = node.args[:2]
    s = an.st(src)
    if s is FREE and src not in an.tdep:
        # a constant written over per-sample positions (circular padding's backward zeroes the wrapped
        # slices of the gradient this way): laid out as self, so that the ghost schedule sees a per-sample
        # value, not a sample-free tangent it would have to scale per sample; the constant is per-sample
        # trivially
        return an.st(dst)
    if s is FREE or s.dim is None:
        return s
    d = s.dim + ndim(dst) - ndim(src)
    if not known(shape_of(dst)[d] == shape_of(src)[s.dim]):
        return fail_layout(an, node, "copy broadcasts the sample dim")
    return s.moved(d)


def _new_like(an, node):
    """x.new_empty_strided(size, stride) & co: no sample data, but laid out like x where it has x's shape.
    Circular padding's backward copies a permuted gradient into new_empty_strided(grad, ...): a FREE
    destination would count as a sample-free tangent the ghost schedule has to scale per sample, where the
    copy overwrites it with the per-sample gradient anyway."""
    x = node.args[0]
    s = an.st(x)
    shape = list(node.meta["val"].shape)
    if isinstance(s, Batched) and len(shape) == ndim(x) and all(known(a == b) for a, b in zip(shape, shape_of(x))):
        return s
    return FREE


def _unfold(an, node):
    """x.unfold(dim, size, step): windows along dim go to a new last dim; the other dims stay in place."""
    x, k = node.args[:2]
    s = an.st(x)
    if s.dim is None:
        return s
    if norm_dim(k, ndim(x)) == s.dim:
        return fail_layout(an, node, "unfold takes windows along the sample dim")
    return s


def _unfold_backward(an, node):
    """unfold_backward(grad, input_sizes, dim, size, step): grad has unfold's output dims (windows last)."""
    grad, _, k = node.args[:3]
    s = an.st(grad)
    if s.dim is None:
        return s
    if s.dim == ndim(grad) - 1 or s.dim == norm_dim(k, ndim(grad) - 1):
        return fail_layout(an, node, "unfold_backward sums windows along the sample dim")
    return s


def _grid_sampler(an, node):
    """grid_sample (and its backward): the input [N, C, *spatial], the grid [N, *out, k] and the output's gradient
    [N, C, *out] meet only at equal N, which each image reads on its own: every per-sample operand must hold its
    samples on dim 0, laid out alike, and every output (the backward's input and grid gradients) keeps that."""
    found = one_layout(an, node, lambda a, s: s.dim == 0, "with the samples off the images' dim 0")
    return _for_each_output(node, FREE if found is None else found)


# ---------------------------------------------------------------------------
_BY_SPATIAL_DIMS = {
    1: (aten.avg_pool1d, aten.max_pool1d, aten.max_pool1d_with_indices, aten.adaptive_avg_pool1d,
        aten.adaptive_max_pool1d, aten.upsample_nearest1d, aten.upsample_nearest1d_backward,
        aten._upsample_nearest_exact1d, aten._upsample_nearest_exact1d_backward, aten.upsample_linear1d,
        aten.upsample_linear1d_backward, aten.reflection_pad1d, aten.reflection_pad1d_backward,
        aten.replication_pad1d, aten.replication_pad1d_backward),
    2: (aten.avg_pool2d, aten.avg_pool2d_backward, aten.max_pool2d, aten.max_pool2d_with_indices,
        aten.max_pool2d_with_indices_backward, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward,
        aten.adaptive_max_pool2d, aten.adaptive_max_pool2d_backward, aten.fractional_max_pool2d,
        aten.fractional_max_pool2d_backward, aten.upsample_nearest2d, aten.upsample_nearest2d_backward,
        aten._upsample_nearest_exact2d, aten._upsample_nearest_exact2d_backward, aten.upsample_bilinear2d,
        aten.upsample_bilinear2d_backward, aten.upsample_bicubic2d, aten.upsample_bicubic2d_backward,
        aten._upsample_bilinear2d_aa, aten._upsample_bilinear2d_aa_backward, aten._upsample_bicubic2d_aa,
        aten._upsample_bicubic2d_aa_backward, aten.reflection_pad2d, aten.reflection_pad2d_backward,
        aten.replication_pad2d, aten.replication_pad2d_backward),
    3: (aten.avg_pool3d, aten.avg_pool3d_backward, aten.max_pool3d, aten.max_pool3d_with_indices,
        aten.max_pool3d_with_indices_backward, aten._adaptive_avg_pool3d, aten._adaptive_avg_pool3d_backward,
        aten.adaptive_max_pool3d, aten.adaptive_max_pool3d_backward, aten.fractional_max_pool3d,
        aten.fractional_max_pool3d_backward, aten.upsample_nearest3d, aten.upsample_nearest3d_backward,
        aten._upsample_nearest_exact3d, aten._upsample_nearest_exact3d_backward, aten.upsample_trilinear3d,
        aten.upsample_trilinear3d_backward, aten.reflection_pad3d, aten.reflection_pad3d_backward,
        aten.replication_pad3d, aten.replication_pad3d_backward),
}

RULES: dict[Any, Any] = {}
for _k, _packets in _BY_SPATIAL_DIMS.items():
    for _p in _packets:
        RULES[_p] = _spatial(_k)
RULES[prims._low_memory_max_pool_with_offsets] = _low_memory_max_pool
for _p in (aten.grid_sampler_2d, aten.grid_sampler_2d_backward, aten.grid_sampler_3d, aten.grid_sampler_3d_backward,
           aten.cudnn_grid_sampler, aten.cudnn_grid_sampler_backward, aten._grid_sampler_2d_cpu_fallback,
           aten._grid_sampler_2d_cpu_fallback_backward):
    RULES[_p] = _grid_sampler
RULES[prims._low_memory_max_pool_offsets_to_indices] = _low_memory_max_pool
for _p in (aten.scatter_add, aten.scatter, aten.scatter_reduce):
    RULES[_p] = _scatter
RULES[aten._unsafe_masked_index] = _masked_index
RULES[aten.copy] = _copy
for _p in (aten.new_empty_strided, aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full):
    RULES[_p] = _new_like
RULES[aten.unfold] = _unfold
RULES[aten.unfold_backward] = _unfold_backward
