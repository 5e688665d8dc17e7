"""Let each gradient reduce-scatter run under the next gradient's contraction.

Functional collectives are issued asynchronously and joined by
``wait_tensor``; traced from the DTensor redistribute, each wait directly
follows its collective, so the GPU idles on every reduce-scatter (the
profile in BENCHMARKS.md shows no NCCL time under compute). This pass moves
the wait of gradient collective k past the issue of collective k+1, so the
deferred weight-gradient GEMM of gradient k+1 (which precedes its collective)
runs while collective k is in flight. At most two reductions are in flight,
so at most two unreduced gradients are alive beyond what the schedule already
holds. The canonical collective order is kept (every rank issues the same
sequence and waits in it: collective_order.issue_order_edges); a wait that
the next collective reads (hybrid sharding's reduce-scatter -> all-reduce
chain) stays where it is.
"""
from __future__ import annotations

import torch.fx as fx

from .cleanup import stable_topological_sort
from .collective_order import gradient_collectives, issue_order_edges, waits_of
from .context import DPPassContext


def _depends_on(node: fx.Node, target: fx.Node, pos: dict[fx.Node, int]) -> bool:
    """Whether ``node`` reads ``target``, transitively (nodes placed before ``target`` cannot)."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if n in seen or pos[n] < pos[target]:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def comm_overlap_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    order = gradient_collectives(gm, ctx)
    after = issue_order_edges(order)  # deferred, the waits keep their order
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for c, nxt in zip(order, order[1:]):
        waits = waits_of(c)
        if len(waits) != 1:
            continue
        wait = waits[0]
        if _depends_on(nxt, wait, pos):
            continue  # the next collective reduces this one's result
        after.setdefault(wait, []).append(nxt)
        ctx.counters["collective_waits_deferred"] += 1
    stable_topological_sort(gm.graph, after=after)
    return gm
