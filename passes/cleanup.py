"""Dead-code elimination; and the order/lint/recompile every run ends with."""
from __future__ import annotations

import torch.fx as fx
import heapq

import torch

from .batch_state import COLLECTIVE_REDUCTIONS
from .context import DPPassContext


_C10D = torch.ops._c10d_functional
_COLLECTIVES = COLLECTIVE_REDUCTIONS | {_C10D.wait_tensor.default, _C10D.all_gather_into_tensor.default}


def cleanup_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Drops the contractions the rewrite made dead (e.g. the ghost first pass's)."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    # FX keeps functional collectives whose results nobody reads (wait_tensor
    # counts as side-effecting); the ghost schedule's first backward leaves its
    # reduce-scatters unread. Every rank rewrites the same graph, so every rank
    # drops the same collectives.
    removed = 0
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in _COLLECTIVES and not node.users:
            gm.graph.erase_node(node)
            removed += node.target is not _C10D.wait_tensor.default
    gm.graph.eliminate_dead_code()
    ctx.counters["dead_nodes_removed"] += before - len(gm.graph.nodes)
    if removed:
        ctx.counters["unused_collectives_removed"] += removed
    return gm


def finalize(gm: fx.GraphModule) -> fx.GraphModule:
    """A valid topological order (rebuilt nodes were appended late), lint, recompile."""
    stable_topological_sort(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def stable_topological_sort(graph: fx.Graph, after: dict | None = None) -> None:
    """Reorders nodes so every node follows its inputs, moving as little as possible.

    Kahn's algorithm with the current position as priority: nodes already in
    a valid order stay put; a node placed before one of its inputs (the
    passes append rebuilt nodes at the end) moves down just past it.
    ``after`` adds ordering edges that are not data dependencies.
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    after = after or {}  # extra ordering edges: node -> nodes that must come before it
    users = {n: list(n.users) for n in nodes}
    for n, befores in after.items():
        for b in befores:
            users[b].append(n)
    indeg = {n: len(set(n.all_input_nodes)) + len(after.get(n, ())) for n in nodes}
    ready = [pos[n] for n in nodes if indeg[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        n = nodes[heapq.heappop(ready)]
        order.append(n)
        for u in users[n]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, pos[u])
    assert len(order) == len(nodes), "cycle in the rewritten joint graph"
    prev = None
    for n in order:
        if prev is not None and prev.next is not n:
            prev.append(n)
        prev = n
