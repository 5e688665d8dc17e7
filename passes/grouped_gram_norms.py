"""Gram norms that can wait, in one call (on the backward graph, after the partition).

Each ghost-form norm with static rows per sample is a ``dpcompile::gram_sq_norms(A, G)`` call (passes.
per_sample_norms), a kernel launch of its own: GPT-2-small's backward makes 49, about 20 us of host time each, and
its bf16 32x256 step is host-bound (22.1 ms of wall clock against 19.2 ms of GPU time, one H200). Under bk every
layer's operands stay alive until the clip anyway (the weight gradients are rebuilt from them after it), so those
calls can all run where the last one is: ``dpcompile::gram_sq_norms_group(As, Gs)``, one launch per signature
through a table of addresses, whose [B, sum of parts] output the old calls' readers read in slices.

A call joins the group at the last Gram call only where that changes neither a value nor a peak: each of its
operands' buffers is read (or mutated) after that point anyway, so the move keeps no buffer alive longer (ghost
frees an output gradient right after its norm: nothing of it joins); nothing mutates them in between; and every
reader of its partial sums comes after that point. The calls left out form groups of their own the same way, at
their own last call.
Counters: ``gram_norms_grouped`` (calls moved into a group), ``gram_norm_groups`` (group calls made).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dpcompile import gram_sq_norms as _gram_op  # noqa: F401  (defines the two ops)

from .context import DPPassContext
from .inplace_row_masks import _MAY_SHARE_STORAGE, _VIEWS, _buffer_readers, storage_root

aten = torch.ops.aten


def _buffer(x: fx.Node) -> fx.Node:
    """The node whose buffer x reads: its storage root, or through views a graph input's (or another buffer
    storage_root does not name, such as a collective's output)."""
    root = storage_root(x)
    if root is not None:
        return root
    while x.op == "call_function" and isinstance(x.target, torch._ops.OpOverload) and \
            (x.target.is_view or x.target.overloadpacket.__name__ in _VIEWS) and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    return x


def _alias_source(n: fx.Node) -> fx.Node | None:
    """The input n's output may share storage with: a view's, or what Inductor may turn into an alias of its
    input (a clone it drops as a no-op); None for any other node."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return None
    name = n.target.overloadpacket.__name__
    if name in _MAY_SHARE_STORAGE:
        i = _MAY_SHARE_STORAGE[name]
        src = n.args[0][0] if i is None else n.args[i]
    elif n.target.is_view:
        src = n.args[0]
    else:
        return None
    return src if isinstance(src, fx.Node) else None


def _alias_root(x: fx.Node) -> fx.Node:
    """The first node up x's chain of possible aliases: every buffer x's storage may be, for the mutation check."""
    while (src := _alias_source(x)) is not None:
        x = src
    return x


def _mutates(n: fx.Node) -> bool:
    return n.op == "call_function" and (not isinstance(n.target, torch._ops.OpOverload)
                                        or n.target._schema.is_mutable)


def _mutators(x: fx.Node) -> list[fx.Node]:
    """The nodes that may mutate x's storage: mutable ops (and ops of unknown effect) that read x or a node
    that may alias it, up and down chains of views and possible no-ops."""
    root = _alias_root(x)
    found, stack, seen = [], [root], {root}
    while stack:
        for u in stack.pop().users:
            if u in seen:
                continue
            seen.add(u)
            if _mutates(u):
                found.append(u)
            elif _alias_source(u) is not None:
                stack.append(u)
    return found


def _may_wait(call: fx.Node, at: int, last: fx.Node, index: dict[fx.Node, int]) -> bool:
    """call may run at position ``at`` (the last call's) instead of its own: see the module docstring."""
    here = index[call]
    if any(index[u] <= at for u in call.users):
        return False
    a, g = call.args[0], call.args[1]
    mine, theirs = a.meta.get("val"), last.args[0].meta.get("val")  # one batch and device in a group
    if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and mine.device == theirs.device
            and statically_known_true(mine.shape[0] == theirs.shape[0])):
        return False
    for operand in (a, g):
        if not any(index[r] > at for r in _buffer_readers(_buffer(operand))):
            return False
        if any(here < index[m] <= at for m in _mutators(operand)):
            return False
    return True


def grouped_gram_norms_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    graph = gm.graph
    single = torch.ops.dpcompile.gram_sq_norms.default
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is single]
    made = 0
    while len(calls) >= 2:
        index = {n: i for i, n in enumerate(graph.nodes)}
        last = calls[-1]
        group = [c for c in calls[:-1] if _may_wait(c, index[last], last, index)] + [last]
        calls = [c for c in calls[:-1] if c not in group]
        if len(group) < 2:
            continue
        after = last.next
        with graph.inserting_before(after):
            node = graph.call_function(torch.ops.dpcompile.gram_sq_norms_group.default,
                                       ([c.args[0] for c in group], [c.args[1] for c in group]))
            node.meta.update({k: v for k, v in last.meta.items() if k not in ("val", "tensor_meta")})
            widths = [c.meta["val"].shape[1] for c in group]
            node.meta["val"] = last.meta["val"].new_empty([last.meta["val"].shape[0], sum(widths)])
            col = 0
            for c, w in zip(group, widths):
                piece = graph.call_function(aten.slice.Tensor, (node, 1, col, col + w))
                piece.meta.update({k: v for k, v in c.meta.items() if k not in ("val", "tensor_meta")})
                piece.meta["val"] = node.meta["val"][:, col:col + w]
                col += w
                c.replace_all_uses_with(piece)
                graph.erase_node(c)
        ctx.counters["gram_norms_grouped"] += len(group)
        made += 1
    if made:
        ctx.counters["gram_norm_groups"] += made
        graph.lint()
        gm.recompile()
    return gm
