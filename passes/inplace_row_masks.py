"""bk's masks of unscaled operands, done in place in the backward graph (after the partition).

A deferred weight contraction reads one operand scaled by the clip coefficients and the other with a dropped
sample's rows zeroed (``clip_schedule.zero_dropped_rows``: ``where(keep, x, 0)``, tagged ``ROW_MASK``): a
dropped sample may hold inf or NaN, and 0 * inf is NaN. That where is a full copy of the operand, and the
copies were most of bk's extra GPU time (a ViT-S/16 step's 2.4 ms of 13.5, GPT-2-small's 3.5 of 23.7).

Where ``x`` is a buffer the backward made itself (not a saved tensor, a tangent, a view, a collective's
output or a gradient it returns), the where becomes ``dpcompile::zero_rows_(x, keep, dim)``, which zeroes the
dropped rows of x where they lie (one launch, no copy), and its readers read x. Any reader of x that comes
after it is one of bk's rebuilt contractions or copies, which drop those rows anyway; readers before it are
ordered before it by Inductor, which sees the mutation. Only the partition knows which values are saved and
which the backward makes (the min-cut recomputes cheap pointwise values), so this runs on the backward graph.
Counters: ``row_masks_in_place``, ``row_masks_copied``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile import zero_rows as _zero_rows  # noqa: F401  (defines dpcompile::zero_rows_)

from .context import DPPassContext

aten = torch.ops.aten
ROW_MASK = "dpcompile_row_mask"  # meta of a where(keep, x, 0) that may run in place: the masked dim of x
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")


def _owned(x: fx.Node, returned: set[fx.Node]) -> bool:
    """x is a buffer of the backward's own that nothing outside the step reads."""
    if x.op != "call_function" or x in returned:
        return False
    target = x.target
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace in _COLLECTIVE_NAMESPACES or target._schema.is_mutable:
            return False
        if any(r.alias_info is not None for r in target._schema.returns):  # a view of another value
            return False
    return isinstance(x.meta.get("val"), torch.Tensor)


def inplace_row_masks_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    returned: set[fx.Node] = set()
    fx.node.map_arg(out.args, lambda a: returned.add(a))
    changed = False
    for node in list(graph.nodes):
        dim = node.meta.get(ROW_MASK)
        if dim is None or node.op != "call_function" or node.target is not aten.where.self:
            continue
        keep, x = node.args[0], node.args[1]
        if not _owned(x, returned):
            ctx.counters["row_masks_copied"] += 1
            continue
        with graph.inserting_before(node):
            m = graph.call_function(torch.ops.dpcompile.zero_rows_.default, (x, keep, dim))
        m.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta", ROW_MASK)})
        m.meta["val"] = None
        node.replace_all_uses_with(x)
        graph.erase_node(node)
        ctx.counters["row_masks_in_place"] += 1
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
