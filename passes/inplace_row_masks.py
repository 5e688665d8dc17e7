"""bk's masks of unscaled operands, done in place in the backward graph (after the partition).

A deferred weight contraction reads one operand scaled by the clip coefficients and the other with a dropped
sample's rows zeroed (``clip_schedule.zero_dropped_rows``: ``where(keep, x, 0)``, tagged ``ROW_MASK``): a
dropped sample may hold inf or NaN, and 0 * inf is NaN. That where is a full copy of the operand, and the
copies were most of bk's extra GPU time (a ViT-S/16 step's 2.4 ms of 13.5, GPT-2-small's 3.5 of 23.7).

Where ``x`` is a buffer the backward made itself (``storage_root``: not a saved tensor, a tangent, a collective's
output or a gradient it returns, nor a view or a possible no-op of one), the where becomes
``dpcompile::zero_rows_(x, keep, dim)``, which zeroes the dropped rows of x where they lie (one launch, no copy),
and its readers read x. Why that is exact: keep depends on every per-sample norm, so every value a norm needs is
read before the mutation; what reads x's buffer after it is bk's rebuilt contractions and copies (and, under
``auto``, the ghost second backward), per-sample computations whose dropped rows are discarded; and Inductor
orders the mutation after the earlier readers of the buffer. Only the partition knows which values are saved
and which the backward makes (the min-cut recomputes cheap pointwise values), so this runs on the backward graph.
Counters: ``row_masks_in_place``, ``row_masks_copied``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dpcompile import zero_rows as _zero_rows  # noqa: F401  (defines dpcompile::zero_rows_)
from dpcompile.fx_utils import COLLECTIVE_NAMESPACES

from .context import DPPassContext

aten = torch.ops.aten
ROW_MASK = "dpcompile_row_mask"  # meta of a where(keep, x, 0) that may run in place: the masked dim of x
# ops whose output may share its input's storage once Inductor has the graph: views it lowers without an alias
# annotation, and what its post-grad remove_noop_ops replaces by an input where it changes nothing (a clone, a
# cast to the same dtype, a one-tensor cat, ...), which does not look for later mutations. Argument position of
# the input (cat: its first tensor).
_MAY_SHARE_STORAGE = {"_unsafe_view": 0, "view": 0, "alias": 0, "clone": 0, "_to_copy": 0, "convert_element_type": 0,
                      "device_put": 0, "slice": 0, "repeat": 0, "constant_pad_nd": 0, "ceil": 0, "floor": 0,
                      "round": 0, "trunc": 0, "pow": 0, "expand": 0, "copy": 1, "slice_scatter": 1, "cat": None}
_VIEWS = {"_unsafe_view", "view", "alias", "slice", "expand"}


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    """What remove_noop_ops asks before it replaces a possible no-op by its input (post_grad.same_meta): the same
    sizes, strides, dtype and device. An op whose output differs in any of them (a clone into another layout, a
    cast) writes a buffer of its own."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return True  # unknown: assume it may be removed
    if va.dtype != vb.dtype or va.device != vb.device or va.layout != vb.layout or va.dim() != vb.dim():
        return False
    # symbolic sizes or strides count as equal (Inductor may prove them equal where this cannot tell)
    return not (_known_differ(va.size(), vb.size())
                or (va.layout == torch.strided and _known_differ(va.stride(), vb.stride())))


def _known_differ(xs, ys) -> bool:
    """Some position holds two integers that differ."""
    return any(isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(xs, ys))


def storage_root(x: fx.Node) -> fx.Node | None:
    """The node whose buffer x's storage is once Inductor has lowered the graph, following views and possible
    no-ops; None where that is not a buffer the backward computes with an op of its own: a graph input (a saved
    tensor, a tangent), a collective's output, a mutable op's or a higher-order op's."""
    while True:
        if x.op != "call_function":
            return None
        target = x.target
        if target is operator.getitem:  # one output of a multi-output op: a buffer of its own
            src = x.args[0]
            return x if isinstance(src, fx.Node) and storage_root(src) is src else None
        if not isinstance(target, torch._ops.OpOverload) or target.namespace in COLLECTIVE_NAMESPACES \
                or target._schema.is_mutable:
            return None
        name = target.overloadpacket.__name__
        if name in _MAY_SHARE_STORAGE:
            i = _MAY_SHARE_STORAGE[name]
            src = x.args[0][0] if i is None else x.args[i]
        elif target.is_view:
            src = x.args[0]
        else:
            return x
        if not isinstance(src, fx.Node):
            return x
        if not (target.is_view or name in _VIEWS) and not _same_meta(x, src):
            return x  # a no-op candidate that changes layout or dtype: a copy Inductor keeps
        x = src


def _owned(x: fx.Node, returned: set[fx.Node]) -> bool:
    """x is a buffer of the backward's own (not a view of one: Inductor then mutates a layout it chose) that
    nothing outside the step reads."""
    return storage_root(x) is x and isinstance(x.meta.get("val"), torch.Tensor) and x not in returned


def inplace_row_masks_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    returned: set[fx.Node] = set()  # the storage roots of what the backward returns
    fx.node.map_arg(out.args, lambda a: returned.add(storage_root(a) or a))
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
        zero = node.args[2]
        graph.erase_node(node)
        if isinstance(zero, fx.Node) and zero.target is aten.scalar_tensor.default and not zero.users:
            graph.erase_node(zero)  # the masked value's 0, now read by nothing (no DCE runs after this pass)
        ctx.counters["row_masks_in_place"] += 1
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
