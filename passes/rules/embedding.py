"""Embedding and indexing: gathers by sample-free or per-sample indices, and the scatter-add of the embedding backward.

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import known

from ..batch_state import FREE, SINGLE, Batched, Contribution, Mixed, Reduced, fail_layout, ndim, norm_dim, shape_of

aten = torch.ops.aten


def _gather(an, node):
    x, k, idx = node.args[0], node.args[1], node.args[2]
    sx, si = an.st(x), an.st(idx)
    n = ndim(x)
    k = norm_dim(k, n)
    if isinstance(sx, Batched) and sx.dim is not None and sx.dim == k:
        return fail_layout(an, node, "gathers along the sample dim")
    if isinstance(sx, Batched) and isinstance(si, Batched) and sx.dim is not None and si.dim is not None and sx != si:
        return fail_layout(an, node, "gathers with an index whose sample dim differs from the source's")
    if isinstance(sx, Batched) and sx.dim is not None and not known(shape_of(idx)[sx.dim] == shape_of(x)[sx.dim]):
        return fail_layout(an, node, "gathers a different number of samples than the source has")
    if isinstance(si, Batched):
        return si
    return sx


def _embedding(an, node):
    w, idx = node.args[0], node.args[1]
    if an.st(w) is not FREE:
        raise an.refuse(node, "looks up rows of a per-sample table")
    return an.st(idx)


# ops that keep an index tensor's values and only insert, drop or broadcast dims of size one (or copy it)
_SAME_VALUES = {aten.clone.default, aten.alias.default, aten._to_copy.default, aten.lift_fresh_copy.default,
                torch.ops.prims.convert_element_type.default}
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


SAMPLE_INDEXED_COUNTER = "sample_dim_indexed_by_arange"  # gathers and index_puts proven per sample by an iota


def _size_value(a):
    """A size argument's value: an int, or the SymInt a graph input or sym_size node holds (an unbacked batch
    size reaches the graph as one)."""
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def sample_iota_dim(an, i: fx.Node) -> int | None:
    """The dim of index tensor i along which its values count the samples, 0, 1, ..., B - 1, with every other
    dim of size one or a broadcast of it (torch.arange(batch_size) and its views: transformers' masks index a
    per-sample padding mask with it, sequence classifiers take each sample's last token with it); None when i
    is not such a tensor. Indexing a tensor's sample dim with it takes sample j to position j: per sample."""
    if not isinstance(i, fx.Node) or i.op != "call_function" or an.st(i) is not FREE:
        return None
    if i.meta["val"].dtype not in (torch.int64, torch.int32):  # a bool index is a mask; narrower ints could wrap
        return None
    t = i.target
    if t in (aten.arange.default, aten.arange.start, aten.arange.start_step, torch.ops.prims.iota.default):
        if t is torch.ops.prims.iota.default:  # what arange decomposes to
            start, end, step = i.kwargs.get("start", 0), i.args[0], i.kwargs.get("step", 1)
        else:
            a = list(i.args)
            start, end, step = (0, a[0], 1) if t is aten.arange.default else (a[0], a[1], a[2] if len(a) > 2 else 1)
        start, end, step = (_size_value(v) for v in (start, end, step))
        return 0 if known(start == 0) and known(step == 1) and an.B is not None and known(end == an.B) else None
    # an offset of zero (transformers adds its mask's offsets to the aranges)
    zero_offset = t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar) and \
        len(i.args) == 2 and isinstance(i.args[1], int) and i.args[1] == 0 and i.kwargs.get("alpha", 1) == 1
    if zero_offset or t in _SAME_VALUES or _whole_slice(i):
        src = i.args[0]
        return sample_iota_dim(an, src) if isinstance(src, fx.Node) and ndim(src) == ndim(i) else None
    if not i.args or not isinstance(i.args[0], fx.Node):
        return None
    src = i.args[0]
    d = sample_iota_dim(an, src)
    if d is None:
        return None
    if t is aten.unsqueeze.default:
        at = norm_dim(i.args[1], ndim(i))
        return d + 1 if at <= d else d
    if t is aten.expand.default:
        return d + ndim(i) - ndim(src)
    if t in _RESHAPES:
        # only dims of size one inserted or dropped: the dims of other sizes keep their order
        old, new = shape_of(src), shape_of(i)
        keep_old = [k for k, n in enumerate(old) if not known(n == 1)]
        keep_new = [k for k, n in enumerate(new) if not known(n == 1)]
        if len(keep_old) != len(keep_new) or not all(known(old[a] == new[b]) for a, b in zip(keep_old, keep_new)):
            return None
        return keep_new[keep_old.index(d)] if d in keep_old else None
    return None


def _whole_slice(i: fx.Node) -> bool:
    """x[..., 0:n] with n at least the dim's size: a no-op, which Inductor keeps in the graph where it reorders
    collectives (every rank's graph alike; fully_shard's default) instead of removing it."""
    if i.target is not aten.slice.Tensor or not isinstance(i.args[0], fx.Node):
        return False
    src = i.args[0]
    dim, start, _end, step = (*i.args[1:], *(0, None, None, 1)[len(i.args) - 1:])  # slice's defaults filled in
    d = norm_dim(dim, ndim(src))
    return (known(_size_value(0 if start is None else start) == 0) and known(_size_value(step) == 1)
            and known(shape_of(i)[d] == shape_of(src)[d]))


def _indexed_block(indices) -> tuple[list[int], int, int]:
    """For x[indices] (index tensors and Nones): the positions of the index tensors, the number R of dims they
    broadcast to, and where those R dims start in the result. Numpy's rule: adjacent index tensors put them
    where they stood, separated ones first."""
    tens = [(p, i) for p, i in enumerate(indices) if i is not None]
    positions = [p for p, _ in tens]
    R = max(ndim(i) for _, i in tens)
    start = positions[0] if positions == list(range(positions[0], positions[-1] + 1)) else 0
    return positions, R, start


def _by_sample_layout(an, indices, s: int) -> tuple[int, int] | None:
    """For x[indices] (or its index_put) with a sample iota on x's sample dim s: (where the indexed block starts
    in the result, the iota's dim within that block), provided every other index tensor is sample-free or
    per-sample with its samples on that same dim; None otherwise."""
    if s >= len(indices) or indices[s] is None:
        return None
    d_i = sample_iota_dim(an, indices[s])
    if d_i is None:
        return None
    positions, R, start = _indexed_block(indices)
    d = R - ndim(indices[s]) + d_i
    for p in positions:
        si = an.st(indices[p])
        if p == s or si is FREE:
            continue
        if not (isinstance(si, Batched) and si.dim is not None and known(si.outer == 1) and known(si.inner == 1)
                and R - ndim(indices[p]) + si.dim == d):
            return None
    return start, d


def _index_by_sample(an, node, x, sx, indices):
    """x[..., iota, ...] with a sample iota (sample_iota_dim) on x's sample dim: result position j holds sample
    j's values, so the result is per sample along the iota's dim; None when the op is not of that form."""
    if not (isinstance(sx, Batched) and sx.dim is not None and known(sx.outer == 1) and known(sx.inner == 1)):
        return None
    found = _by_sample_layout(an, indices, sx.dim)
    if found is None:
        return None
    start, d = found
    if not known(shape_of(node)[start + d] == shape_of(x)[sx.dim]):
        return None
    an.ctx.counters[SAMPLE_INDEXED_COUNTER] += 1
    return Batched(start + d)


def _index(an, node):
    x, indices = node.args[0], node.args[1]
    sx = an.st(x)
    tens = [(p, i) for p, i in enumerate(indices) if i is not None]
    by_sample = _index_by_sample(an, node, x, sx, indices)
    if by_sample is not None:
        return by_sample
    if len(tens) != 1:
        if all(an.st(i) is FREE for _, i in tens) and isinstance(sx, Batched):
            # constant indices on non-sample dims keep the layout if dims before are plain
            if sx.dim is None or all(p > sx.dim for p, _ in tens):
                return sx
        return fail_layout(an, node, "advanced indexing with several index tensors, one of them on the sample dim "
                                     "and not torch.arange(batch size) there")
    p, i = tens[0]
    si = an.st(i)
    if isinstance(sx, Batched) and sx.dim is not None:
        if si is FREE and sx.dim < p:
            return sx
        if si is FREE and sx.dim > p:
            return sx.moved(sx.dim - 1 + ndim(i))
        return fail_layout(an, node, "indexes along the sample dim")
    if isinstance(si, Batched):
        return si if si.dim is None else si.moved(si.dim + p)
    return SINGLE


def _index_select(an, node):
    x, k, idx = node.args
    sx, si = an.st(x), an.st(idx)
    k = norm_dim(k, ndim(x))
    if isinstance(sx, Batched) and sx.dim is not None:
        if sx.dim == k or si is not FREE:
            return fail_layout(an, node, "selects along the sample dim")
        return sx
    if isinstance(si, Batched):
        return si if si.dim is None else si.moved(k)
    return SINGLE


def _masked_fill(an, node, base, indices, values):
    """x[mask] = v (or += v) with one boolean mask over x's leading dims and one sample-free value: an
    elementwise where(mask, v, x), which keeps x's layout (DTensor's vocabulary-sharded embedding zeroes the
    ids and rows another rank owns this way). None when the op is not of that form."""
    if len(indices) != 1 or not isinstance(indices[0], fx.Node) or an.st(values) is not FREE:
        return None
    mask = indices[0]
    mv, bv = mask.meta["val"], base.meta["val"]
    vv = values.meta["val"] if isinstance(values, fx.Node) else None
    if mv.dtype != torch.bool or vv is None or vv.numel() != 1 or \
            tuple(mv.shape) != tuple(bv.shape[: mv.dim()]):
        return None
    sb, sm = an.st(base), an.st(mask)
    if sm is FREE:
        return sb
    if sb is FREE:
        return sm  # the mask's dims are x's leading dims, of the same sizes
    if sb != sm:
        return fail_layout(an, node, "masks a per-sample tensor with a mask of another sample layout")
    return sb


def _index_put_off_sample_dim(an, node, base, indices, values, mask):
    """base.index_put(indices, values) with sample-free indices on dims other than the sample dim (the
    backward of x[:, :, i, j]: interpolation, F.unfold, Tensor.unfold): every sample's values land in its
    own slice of base, so the result keeps the layout, accumulating or not. None when the op is not of that
    form (an index on the sample dim: the embedding backward's sum over samples)."""
    tens = [(p, i) for p, i in enumerate(indices) if i is not None]
    if not tens or any(an.st(i) is not FREE for _, i in tens) or (mask is not None and an.st(mask) is not FREE):
        return None
    positions, R, start = _indexed_block(indices)  # values broadcast to base[indices]'s shape
    kept = [d for d in range(ndim(base)) if d not in positions]
    base_dim = kept[:start] + [None] * R + kept[start:]  # the base dim of each dim of base[indices]
    lay = None
    sv, sb = an.st(values), an.st(base)
    if isinstance(sv, Batched):
        if sv.dim is None:
            return SINGLE
        d = base_dim[sv.dim + len(base_dim) - ndim(values)]
        if d is None or not known(shape_of(values)[sv.dim] == shape_of(base)[d]):
            return None
        lay = sv.moved(d)
    if isinstance(sb, Batched):
        if sb.dim is None:
            return SINGLE
        if sb.dim in positions:
            return None
        if lay is not None and not (lay.dim == sb.dim and known(lay.outer == sb.outer) and
                                    known(lay.inner == sb.inner)):
            return fail_layout(an, node, "puts values into a tensor whose samples are laid out differently")
        lay = sb
    return lay


def _index_put_by_sample(an, node, base, indices, values):
    """base.index_put(indices, values) with a sample iota (sample_iota_dim) on base's sample dim (the backward of
    x[iota, j]: a sequence classifier's last-token pooling): sample j's values land in sample j's slice of base,
    so the result is per sample on that dim, accumulating or not; None when the op is not of that form. A base
    with no samples takes the dim whose iota the per-sample indices and values line up with; several iotas of
    the batch's size that all could be it (flex_attention's dense block masks: the batch's and the rows' iotas
    when there are as many rows as samples) leave it ambiguous: None."""
    sb = an.st(base)
    if isinstance(sb, Batched):
        if sb.dim is None or not (known(sb.outer == 1) and known(sb.inner == 1)):
            return None
        dims = [sb.dim]
    elif sb is FREE:
        dims = [p for p, i in enumerate(indices) if i is not None and sample_iota_dim(an, i) is not None]
    else:
        return None
    found = [s for s in dims if _scatters_by_sample(an, base, indices, values, s)]
    if len(found) != 1:
        return None
    if sb is FREE and an.st(values) is FREE and all(an.st(i) is FREE for i in indices if i is not None):
        return FREE
    an.ctx.counters[SAMPLE_INDEXED_COUNTER] += 1
    return Batched(found[0])


def _scatters_by_sample(an, base, indices, values, s: int) -> bool:
    """Whether base.index_put(indices, values) writes sample j's indices and values only into base's slice j
    along dim s (the iota there is the sample's own position)."""
    found = _by_sample_layout(an, indices, s)
    if found is None or not known(shape_of(base)[s] == an.B):
        return False
    start, d = found
    sv = an.st(values)
    if isinstance(sv, Batched):
        # values broadcast (right-aligned) to base[indices]'s shape: base's dims before the indexed block, the
        # block's R dims, base's dims after it
        positions, R, _ = _indexed_block(indices)
        n_indexed = ndim(base) - len(positions) + R  # the dims of base[indices]
        return sv.dim is not None and known(sv.outer == 1) and known(sv.inner == 1) and \
            sv.dim + n_indexed - ndim(values) == start + d
    return sv is FREE


def _index_put(an, node):
    """base.index_put(indices, values, accumulate): the embedding backward."""
    t = node.target
    if t is aten._unsafe_masked_index_put_accumulate.default:
        base, mask, indices, values = node.args[:4]
        accumulate = True
    else:
        base, indices, values = node.args[:3]
        mask = None
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    masked = _masked_fill(an, node, base, indices, values)
    if masked is not None:
        return masked
    kept = _index_put_off_sample_dim(an, node, base, indices, values, mask)
    if kept is not None:
        return kept
    if mask is None:
        by_sample = _index_put_by_sample(an, node, base, indices, values)
        if by_sample is not None:
            return by_sample
    if an.st(base) is not FREE:
        raise an.refuse(node, "scatters into a per-sample tensor")
    tens = [i for i in indices if i is not None]
    if len(indices) != 1 or len(tens) != 1:
        # (a batch of one: sample 0's, as every layout there; create_block_mask's dense mask at B=1)
        return fail_layout(an, node, "scatter with several index tensors")
    idx = tens[0]
    si, sv = an.st(idx), an.st(values)
    lay = None
    for s in (si, sv) + ((an.st(mask),) if mask is not None else ()):
        if isinstance(s, Batched):
            if s.dim is None:
                return SINGLE
            if lay is not None and s != lay:
                raise an.refuse(node, "scatter whose index and values have different sample dims")
            lay = s
    if lay is None:
        return FREE
    if not accumulate:
        return Mixed(node, "an overwriting scatter of several samples' rows")
    if node in an.tdep and values in an.tdep:
        layouts = {"indices": lay, "values": lay}
        an.contributions[node] = Contribution(
            node, "index_put", layouts, scaled_operand=-1,
            extra={"indices": idx, "values": values, "mask": mask},
        )
    return Reduced(node)


def _embedding_backward(an, node):
    grad, idx, num_weights, padding_idx, scale_by_freq = node.args[:5]
    if scale_by_freq:
        raise an.refuse(
            node, "embedding with scale_grad_by_freq=True scales by token counts taken across the batch",
            "use scale_grad_by_freq=False",
        )
    si, sg = an.st(idx), an.st(grad)
    lay = si if isinstance(si, Batched) else sg
    if lay.dim is None:
        return SINGLE
    if node in an.tdep:
        an.contributions[node] = Contribution(
            node, "embedding_backward", {"indices": lay, "values": lay}, scaled_operand=0,
            extra={"indices": idx, "values": grad, "padding_idx": padding_idx},
        )
    return Reduced(node)


def _embedding_renorm(an, node):
    raise an.refuse(
        node, "nn.Embedding with max_norm rescales, in place, the rows of the weight that the batch looks up: a "
              "change of the parameter that the samples decide, made without noise",
        "drop max_norm (or clip the weight's rows yourself after the optimizer step, outside the DP step)")


def _embedding_bag(an, node):
    # 2-D input without max_norm never gets here (dpcompile/embedding_bag.py rewrites it as an embedding)
    raise an.refuse(
        node, "nn.EmbeddingBag over 1-D input with offsets (or with max_norm) has no per-sample rule: which "
              "bag, and so which sample, an index belongs to is data",
        "pass the bags as 2-D input, one row per sample padded with padding_idx (nn.EmbeddingBag(..., "
        "padding_idx=p)), which dpcompile takes as an embedding and a reduction; drop max_norm")


RULES: dict[Any, Any] = {}
RULES[aten.embedding_renorm] = _embedding_renorm
RULES[aten._embedding_bag] = _embedding_bag
RULES[aten._embedding_bag_forward_only] = _embedding_bag
RULES[aten.gather] = _gather
RULES[aten.embedding] = _embedding
RULES[aten.index] = _index
RULES[aten._unsafe_index] = _index
RULES[aten.index_select] = _index_select
for p in (aten.index_put, aten._unsafe_index_put, aten._unsafe_masked_index_put_accumulate):
    RULES[p] = _index_put
RULES[aten.embedding_dense_backward] = _embedding_backward
