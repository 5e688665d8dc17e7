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

Masks go into one call where they can (``_group``): a launch per operand was 49 launches in GPT-2-small's
backward, about 1.5 ms of host time in a launch-bound step. The call sits at the first mask of its group, and a
later mask joins only where that changes no value any node reads: its operand and keep are there by then (keep's
layout nodes move ahead), and nothing reads its operand's buffer in between.
Counters: ``row_masks_in_place``, ``row_masks_copied``, ``row_mask_calls`` (zero_rows_ calls made).
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


# ops that only lay a value out (or copy it): a keep mask's layout chain may move ahead of the first mask of a
# group, which reads keep where its layout is made
_LAYOUT_OPS = {"reshape", "clone", "_to_copy", "convert_element_type", "_unsafe_view", "expand", "view"}


def _buffer_readers(x: fx.Node) -> list[fx.Node]:
    """The nodes that read x's buffer: its users, and through views (and ops Inductor may turn into aliases of
    x) theirs. A view itself reads nothing."""
    readers, stack, seen = [], [x], {x}
    while stack:
        for u in stack.pop().users:
            if u in seen:
                continue
            seen.add(u)
            target = u.target
            is_view = isinstance(target, torch._ops.OpOverload) and \
                (target.is_view or target.overloadpacket.__name__ in _VIEWS)
            if not is_view:
                readers.append(u)
            if is_view or storage_root(u) is x:
                stack.append(u)
    return readers


def _hoistable_chain(keep: fx.Node, pos: int, index: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The nodes at or after position pos that keep is made from (in graph order): what moves ahead of the node
    at pos for keep to be there; None where one of them is not a layout op."""
    chain, stack, seen = [], [keep], {keep}
    while stack:
        n = stack.pop()
        if index[n] < pos:
            continue
        target = n.target
        if n.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable \
                or target.namespace in COLLECTIVE_NAMESPACES \
                or not (target.is_view or target.overloadpacket.__name__ in _LAYOUT_OPS):
            return None
        chain.append(n)
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return sorted(chain, key=index.__getitem__)


def _group(masks: list[fx.Node], index: dict[fx.Node, int]) -> tuple[list[fx.Node], set[fx.Node]]:
    """The masks one zero_rows_ call at the first of them takes, and the keep layout nodes that must move ahead
    of it. A mask joins where its operand is made before that point, its keep is or can be (a layout chain),
    and nothing reads the operand's buffer between that point and the mask: every reader then reads the same
    values as with the mask where it was (an earlier one the unmasked rows, a later one the zeroed rows)."""
    pos = index[masks[0]]
    group, hoist, dims = [], set(), {}
    for w in masks:
        keep, x, dim = w.args[0], w.args[1], w.meta[ROW_MASK]
        if index[x] >= pos or dims.get(x, dim) != dim:
            continue
        chain = _hoistable_chain(keep, pos, index)
        if chain is None or any(pos < index[r] < index[w] for r in _buffer_readers(x) if r is not w):
            continue
        dims[x] = dim
        group.append(w)
        hoist.update(chain)
    return group, hoist


def inplace_row_masks_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    returned: set[fx.Node] = set()  # the storage roots of what the backward returns
    fx.node.map_arg(out.args, lambda a: returned.add(storage_root(a) or a))
    masks = []
    for node in graph.nodes:
        dim = node.meta.get(ROW_MASK)
        if dim is None or node.op != "call_function" or node.target is not aten.where.self:
            continue
        if _owned(node.args[1], returned):
            masks.append(node)
        else:
            ctx.counters["row_masks_copied"] += 1
    calls = 0
    while masks:
        index = {n: i for i, n in enumerate(graph.nodes)}
        group, hoist = _group(masks, index)
        first = masks[0]
        for n in sorted(hoist, key=index.__getitem__):
            first.prepend(n)
        xs, keeps, dims = [], [], []
        for w in group:
            if w.args[1] not in xs:
                xs.append(w.args[1])
                keeps.append(w.args[0])
                dims.append(w.meta[ROW_MASK])
        with graph.inserting_before(first):
            m = graph.call_function(torch.ops.dpcompile.zero_rows_.default, (xs, keeps, dims))
        m.meta.update({k: v for k, v in first.meta.items() if k not in ("val", "tensor_meta", ROW_MASK)})
        m.meta["val"] = None
        for w in group:
            w.replace_all_uses_with(w.args[1])
            zero = w.args[2]
            graph.erase_node(w)
            if isinstance(zero, fx.Node) and zero.target is aten.scalar_tensor.default and not zero.users:
                graph.erase_node(zero)  # the masked value's 0, now read by nothing (no DCE runs after this pass)
        ctx.counters["row_masks_in_place"] += len(group)
        calls += 1
        masks = [w for w in masks if w not in group]
    if calls:
        ctx.counters["row_mask_calls"] += calls
        graph.lint()
        gm.recompile()
    return gm
