"""Matrix products: a contraction over sample rows in the backward is a weight-gradient contribution.

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import Any

import torch

from dpcompile.fx_utils import known

from ..batch_state import SINGLE, Batched, Contribution, Mixed, Reduced, fail_layout, ndim

aten = torch.ops.aten


def _mm(an, node):
    """[n,k] @ [k,m]: samples on rows/cols pass through, on k it is a contraction."""
    if node.target is aten.addmm.default:
        bias, a, b = node.args[0], node.args[1], node.args[2]
    else:
        bias, a, b = None, node.args[0], node.args[1]
    sa, sb = an.st(a), an.st(b)
    if sa.__class__ is Batched and sa.dim is None or sb.__class__ is Batched and sb.dim is None:
        return SINGLE
    rows = sa if isinstance(sa, Batched) and sa.dim == 0 else None
    cols = sb if isinstance(sb, Batched) and sb.dim == 1 else None
    ka = sa if isinstance(sa, Batched) and sa.dim == 1 else None
    kb = sb if isinstance(sb, Batched) and sb.dim == 0 else None
    if rows and cols:
        return Mixed(node, "a product of two per-sample matrices across samples")
    if (ka or kb) and (rows or cols):
        return Mixed(node, "a contraction over samples mixed with per-sample rows")
    if (ka or kb) and _one_sample_forward(an, node):
        return SINGLE
    if ka or kb:
        if ka and kb and not (known(ka.outer == kb.outer) and known(ka.inner == kb.inner)):
            return Mixed(node, "a contraction over rows that belong to different samples")
        lay = ka or kb
        if bias is not None:
            return Mixed(node, "a contraction over samples plus a bias")
        return _sum_over_samples(an, node, "mm", a, b, {0: Batched(1, lay.outer, lay.inner),
                                                          1: Batched(0, lay.outer, lay.inner)})
    out = rows.moved(0) if rows else cols.moved(1)
    if bias is not None:
        sbias = an.st(bias)
        if isinstance(sbias, Batched) and sbias.dim is not None:
            d_out = sbias.dim + (2 - ndim(bias))
            if sbias.moved(d_out) != out:
                return fail_layout(an, node, "adds a per-sample bias with a different sample dim")
    return out


def _one_sample_forward(an, node) -> bool:
    """A forward contraction in a graph of one sample (a static batch of one, clipped whole: whole_gradient_mode).
    With B == 1 the layouts cannot tell the size-one sample dim from another size-one dim, and torch.einsum moves
    it where a contraction reads it: what looks like a contraction over samples is that one sample's product
    (SINGLE: no dim of it known). It was refused as a sum over the samples."""
    return known(an.B == 1) and node not in an.tdep


def _bmm(an, node):
    return _bmm_of(an, node, node.args[0], node.args[1], contribution=True)


def _baddbmm(an, node):
    """beta * input + alpha * bmm(b1, b2) (Bloom's ALiBi attention scores): the product's samples, and the
    added input's where it has them, on the same dim (a pointwise add of the two)."""
    found = _bmm_of(an, node, node.args[1], node.args[2])
    if not isinstance(found, Batched) and found is not None:
        return found  # refused or mixed
    s = an.st(node.args[0])
    if not isinstance(s, Batched):  # sample-free: added to every sample alike
        return found
    if s.dim is None or found is not None and found.dim is None:
        return fail_layout(an, node, "adds per-sample values to a batched matmul without a sample dim")
    cand = s.moved(s.dim + 3 - ndim(node.args[0]))
    if found is not None and cand != found:
        return fail_layout(an, node, "adds per-sample values with another sample dim to a batched matmul")
    return cand


def _bmm_of(an, node, a, b, contribution=False):
    """[H, n, k] @ [H, k, m]: samples on the batch dim or on a free dim pass through; on k (a sample-free batch
    dim H) the product sums over samples: per-head weights applied with einsum("bhsd,hde->bhse") have their
    weight gradient so, a contribution of kind "bmm" (H weight gradients of the mm kind, side by side)."""
    sa, sb = an.st(a), an.st(b)
    ka = sa if isinstance(sa, Batched) and sa.dim == 2 else None
    kb = sb if isinstance(sb, Batched) and sb.dim == 1 else None
    if (ka or kb) and _one_sample_forward(an, node):
        return SINGLE
    if ka or kb:
        return _bmm_over_samples(an, node, (a, sa, ka), (b, sb, kb), contribution)
    found = None  # samples on the batch dim or a free dim (a contraction dim holding them is handled above)
    for s in (sa, sb):
        if isinstance(s, Batched):
            if s.dim is None:
                return SINGLE
            if found is not None and (found.dim == 0) != (s.dim == 0):
                return fail_layout(an, node, "batched matmul with samples on both operands' free dims")
            if found is not None and found.dim == 0 and found != s:
                return fail_layout(an, node, "batched matmul with different sample layouts")
            found = s
    if found is not None and found.dim != 0 and isinstance(sa, Batched) and isinstance(sb, Batched):
        return Mixed(node, "a product of per-sample rows and per-sample columns")
    return found


def _bmm_over_samples(an, node, first, second, contribution):
    """A batched matmul whose contraction dim k holds samples (ka on the first operand's dim 2, kb on the
    second's dim 1)."""
    (a, sa, ka), (b, sb, kb) = first, second
    for s, k in ((sa, ka), (sb, kb)):
        if isinstance(s, Batched) and s.dim is None:
            return SINGLE
        if isinstance(s, Batched) and k is None:
            return Mixed(node, "a batched matmul contracting over samples, with per-sample rows or batch entries "
                               "in its other operand")
    if ka and kb and not (known(ka.outer == kb.outer) and known(ka.inner == kb.inner)):
        return Mixed(node, "a batched matmul contracting over rows that belong to different samples")
    if not contribution:
        return Mixed(node, "a batched matmul contracting over samples, plus an added input")
    lay = ka or kb
    return _sum_over_samples(an, node, "bmm", a, b, {0: Batched(2, lay.outer, lay.inner),
                                                      1: Batched(1, lay.outer, lay.inner)})


def _sum_over_samples(an, node, kind, a, b, layouts):
    """A contraction over sample rows: a sum over the samples, and a weight-gradient contribution of ``kind``
    (layouts: the samples' layout in each operand) where it is in the backward with exactly one operand linear in
    the loss tangent."""
    tdep_ops = [i for i, x in ((0, a), (1, b)) if x in an.tdep]
    if len(tdep_ops) == 1 and node in an.tdep:
        an.contributions[node] = Contribution(node, kind, layouts, tdep_ops[0])
    return Reduced(node)


RULES: dict[Any, Any] = {aten.mm: _mm, aten.addmm: _mm, aten.bmm: _bmm, aten.baddbmm: _baddbmm}
