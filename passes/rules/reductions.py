"""Reductions and ops along one dim: a sum over the sample dim in the backward is a per-sample gradient contribution.

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import known

from ..batch_state import SINGLE, Batched, Contribution, Mixed, Reduced, each_output, fail_layout, ndim, norm_dim
from . import row_order

if TYPE_CHECKING:
    from ..batch_dims import BatchDimAnalysis

aten = torch.ops.aten


_LINEAR_REDUCTIONS = {aten.sum, aten.mean}


def _reduction(an, node):
    """sum/mean/amax/var_mean/...: over non-sample dims keep the layout."""
    x = node.args[0]
    s = an.st(x)
    n = ndim(x)
    packet = node.target.overloadpacket
    # reduced dims and keepdim, by schema
    args = list(node.args) + [None] * 4
    kw = node.kwargs
    if node.target in (aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.all.default,
                       aten.any.default, aten.prod.default, aten.median.default, aten.nanmedian.default):
        dims, keep = list(range(n)), False
    elif packet in (aten.argmax, aten.argmin):
        d = args[1] if args[1] is not None else kw.get("dim")
        dims = list(range(n)) if d is None else [d]
        keep = bool(args[2] if args[2] is not None else kw.get("keepdim", False))
    elif packet in (aten.var_mean, aten.var, aten.std, aten.std_mean):
        d = args[1] if args[1] is not None else kw.get("dim")
        dims = list(range(n)) if d is None else ([d] if isinstance(d, int) else list(d))
        keep = bool(kw.get("keepdim", False))
    elif packet in (aten.mode, aten.kthvalue):  # (values, indices) of one dim, -1 by default
        i = 2 if packet is aten.kthvalue else 1
        d = args[i] if args[i] is not None else kw.get("dim", -1)
        dims = [d]
        keep = bool(args[i + 1] if args[i + 1] is not None else kw.get("keepdim", False))
    elif packet is aten.linalg_vector_norm:
        d = args[2] if args[2] is not None else kw.get("dim")
        dims = list(range(n)) if d is None else ([d] if isinstance(d, int) else list(d))
        keep = bool(args[3] if args[3] is not None else kw.get("keepdim", False))
    else:
        d = args[1] if args[1] is not None else kw.get("dim")
        dims = list(range(n)) if d is None or d == [] else ([d] if isinstance(d, int) else list(d))
        keep = bool(args[2] if args[2] is not None else kw.get("keepdim", False))
    dims = sorted({norm_dim(d, n) for d in dims}) if n > 0 else []

    if s.dim is None:
        return each_output(node, SINGLE)
    if s.dim in dims:
        if packet in _LINEAR_REDUCTIONS:
            return each_output(node, Reduced(node))
        if known(an.B == 1):
            return each_output(node, SINGLE)  # over the one sample there is: nothing mixed
        return each_output(node, Mixed(node, f"{packet.__name__} over the sample dim"))
    if keep:
        return each_output(node, s)
    return each_output(node, s.moved(s.dim - sum(1 for d in dims if d < s.dim)))


def _along_dim(an, node):
    """softmax/cumsum/sort/glu/...: mixes along one dim, which must not be the sample dim."""
    x = node.args[0]
    s = an.st(x)
    for a, sa in an.tensor_args(node):
        if isinstance(sa, Batched) and sa.dim is not None and s.dim is not None and sa != s:
            return fail_layout(an, node, "combines tensors with different sample dims")
        if isinstance(sa, Batched) and sa.dim is not None:
            s = sa
    packet = node.target.overloadpacket
    if packet in (aten._softmax_backward_data, aten._log_softmax_backward_data, aten.glu_backward):
        k = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    elif packet is aten.topk:
        k = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    else:
        k = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    if s.dim is not None and norm_dim(k, ndim(x)) == s.dim:
        rows = row_order.sort_rows(an, node) if packet is aten.sort else None
        if rows is not None:
            return rows  # rows sorted across the batch, tracked by their permutation
        return each_output(node, Mixed(node, f"{packet.__name__} along the sample dim"))
    return each_output(node, s)


def _sum_contribution_hook(an: "BatchDimAnalysis", node: fx.Node, state):
    """Record sums over the sample dim in the backward as contributions."""
    if isinstance(state, Reduced) and state.origin is node and node in an.tdep and node.target.overloadpacket is aten.sum:
        x = node.args[0]
        an.contributions[node] = Contribution(node, "sum", {0: an.st(x)}, scaled_operand=0)
    return state


def _reduction_with_hook(an, node):
    return _sum_contribution_hook(an, node, _reduction(an, node))


RULES: dict[Any, Any] = {}
for p in (aten.sum, aten.mean, aten.amax, aten.amin, aten.var_mean, aten.var, aten.std, aten.std_mean, aten.prod,
          aten.argmax, aten.argmin, aten.logsumexp, aten.any, aten.all, aten.max, aten.min, aten.linalg_vector_norm,
          aten.mode, aten.kthvalue, aten.median, aten.nanmedian):
    RULES[p] = _reduction_with_hook
for p in (aten._softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
          aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin, aten.sort, aten.topk, aten.glu,
          aten.glu_backward):
    RULES[p] = _along_dim
