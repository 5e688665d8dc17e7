"""The batch-dim rule table: one module per op family, registered here in one table.

``RULES`` maps an aten op (overload packet or overload) to its rule; an op with
per-sample inputs and no rule is refused by the analysis, except pointwise ops
(``pointwise``). A new family is a module with a ``RULES`` dict, added below.
"""
from __future__ import annotations

from typing import Any

import torch

from . import (attention, collectives, contractions, convolution, elementwise, embedding, flex_attention, linalg,
               reductions, row_order, scans, sequence_losses, spatial, spectral, views)
from .elementwise import pointwise

RULES: dict[Any, Any] = {}
for _family in (views, elementwise, reductions, contractions, convolution, attention, flex_attention, embedding,
                collectives, spatial, spectral, sequence_losses, row_order, scans, linalg):
    _twice = RULES.keys() & _family.RULES.keys()
    assert not _twice, f"ops with a rule in two families: {_twice}"
    RULES.update(_family.RULES)



def rule_for(target: Any):
    """The rule of an op: its family's, else the pointwise rule for an op tagged pointwise, else None (refused)."""
    rule = RULES.get(getattr(target, "overloadpacket", None)) or RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        rule = pointwise
    return rule


__all__ = ["RULES", "pointwise", "rule_for"]
