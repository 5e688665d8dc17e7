"""One order of gradient collectives on every rank.

Ranks compile their own graphs (shard shapes differ with uneven sharding),
yet NCCL and gloo need every rank to issue the same collectives in the same
order. This pass puts the gradient reduce-scatters / all-reduces in a
canonical order fixed by the parameters alone, whatever schedule produced
them: the reverse of the gradient outputs (last parameter first), which is
the order a backward produces gradients in (the ghost second backward, and
the bk deferred contractions, which clip_schedule emits in that order). A
later collective waits for an earlier one rather than overtaking it, and its
``wait_tensor`` follows the earlier one's: Inductor's bucketing
(``bucket_reduce_scatters_fx``) fills a bucket in the order of the waits, so
waits placed by rank-dependent code (an uneven shard's padding) bucketed the
same gradients at different offsets on different ranks, and the bucket's
reduce-scatter summed one parameter's gradient with another's.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .batch_state import has_collective_reductions, is_gradient_reduction
from .cleanup import stable_topological_sort
from .context import DPPassContext

_C10D = torch.ops._c10d_functional


def _collectives_feeding(out_arg: fx.Node, seen: dict[fx.Node, bool]) -> list[fx.Node]:
    """The reductions on the way to a gradient output not found for an earlier output, outermost first.

    Everything between the output and the reductions is searched (waits,
    views, an uneven shard's slice, the sum of a parameter's reductions when
    it is used twice); below a reduction only waits and further reductions
    (a 2-D mesh reduces twice), not the gradient's own computation.
    ``seen`` (node -> whether it was reached below a reduction) is shared by
    the searches of one graph: what an earlier output's search expanded holds
    no reduction that is not already ordered, so the graph is walked once,
    not once per parameter.
    """
    found, stack = [], [(out_arg, False)]
    while stack:
        n, below = stack.pop()
        if not isinstance(n, fx.Node) or n.op != "call_function":
            continue
        if n in seen and (not seen[n] or below):  # expanded already, at least as far as it would be now
            continue
        seen[n] = below
        if is_gradient_reduction(n):  # not tensor parallelism's all-reduces of per-sample values
            found.append(n)
            below = True
        elif below and n.target is not _C10D.wait_tensor.default:
            continue
        stack.extend((a, below) for a in n.all_input_nodes)
    return found


def gradient_collectives(gm: fx.GraphModule, ctx: DPPassContext) -> list[fx.Node]:
    """The gradient reductions in canonical order: that of the parameters' gradient outputs."""
    if not has_collective_reductions(gm.graph):
        return []  # one process, or no gradient is reduced across ranks
    out = gm.graph.find_nodes(op="output")[0]
    order: list[fx.Node] = []
    seen: dict[fx.Node, bool] = {}
    # last parameter first: the order in which a backward produces gradients
    for p in sorted(ctx.params, key=lambda p: p.grad_output_index, reverse=True):
        g = out.args[0][p.grad_output_index]
        for c in reversed(_collectives_feeding(g, seen)):  # innermost (first issued) first
            if c not in order:
                order.append(c)
    return order


def waits_of(c: fx.Node) -> list[fx.Node]:
    """The ``wait_tensor`` nodes of collective ``c``: its users, or a coalesced collective's items' users."""
    waits = []
    for u in c.users:
        if u.target is _C10D.wait_tensor.default:
            waits.append(u)
        elif u.target is operator.getitem:
            waits.extend(w for w in u.users if w.target is _C10D.wait_tensor.default)
    return waits


def issue_order_edges(order: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Ordering edges (node -> nodes before it) for the stable topological sort: each collective after the one
    before it in ``order``, and each collective's waits after the waits of the last one before it that has any."""
    after: dict[fx.Node, list[fx.Node]] = {c: [prev] for prev, c in zip(order, order[1:])}
    previous: list[fx.Node] = []
    for c in order:
        waits = waits_of(c)
        for w in waits:
            after.setdefault(w, []).extend(previous)
        previous = waits or previous
    return after


def collective_order_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Reorders gradient collectives, and their waits, to the order of the parameters' outputs."""
    order = gradient_collectives(gm, ctx)
    after = issue_order_edges(order)
    stable_topological_sort(gm.graph, after=after)
    ctx.counters["collectives_ordered"] += len(order)
    return gm
