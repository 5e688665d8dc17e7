"""Elementwise ops: pointwise math (the fallback for every op tagged pointwise), masks, fresh tensors, dropout.

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import known

from ..batch_state import FREE, SINGLE, Batched, fail_layout, ndim, shape_of

if TYPE_CHECKING:
    from ..batch_dims import BatchDimAnalysis

aten = torch.ops.aten


def _pointwise(an: "BatchDimAnalysis", node: fx.Node):
    out = node.meta["val"]
    if isinstance(out, (tuple, list)):
        raise an.refuse(node, "pointwise op with several outputs")
    n_out = out.dim()
    found: Batched | None = None
    for a, s in an.tensor_args(node):
        if not isinstance(s, Batched) or s.dim is None:
            continue
        d_out = s.dim + (n_out - ndim(a))
        if not known(shape_of(a)[s.dim] == out.shape[d_out]):
            return fail_layout(an, node, "broadcasts the sample dim")
        cand = s.moved(d_out)
        if found is None:
            found = cand
        elif found != cand and not (
            found.dim == cand.dim and known(found.outer == cand.outer) and known(found.inner == cand.inner)
        ):
            return fail_layout(
                an, node, f"combines per-sample tensors whose sample dims differ ({found} vs {cand})"
            )
    return found if found is not None else SINGLE


def _fresh(an, node):
    return FREE  # *_like creation ops: the values do not depend on the input's data


def _tril(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is not None and s.dim >= ndim(x) - 2:
        return fail_layout(an, node, "masks a matrix whose rows or columns are samples")
    return s


def _dropout(an, node):
    s = an.st(node.args[0])
    return (s, s)


pointwise = _pointwise  # the rule of every op tagged pointwise that has no rule of its own

RULES: dict[Any, Any] = {}
RULES[aten.tril] = _tril
RULES[aten.triu] = _tril
for p in (aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like,
          aten.randint_like):
    RULES[p] = _fresh
RULES[aten.native_dropout] = _dropout
# an input's in-place update (a functionalized mutation: copy_ into the input) holds the value written; what
# may be written into state the step keeps is passes/state_updates.py's to check
RULES[aten.copy_] = _pointwise
