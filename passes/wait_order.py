"""Every collective's wait after the waits of the collectives of its kind issued before it.

Inductor's bucketing (``bucket_all_gathers_fx``, ``bucket_reduce_scatters_fx``)
fills a bucket in the order of the collectives' waits, not of their issues.
Where rank-dependent code (an uneven shard's padding and slicing) places a
wait later on one rank than on another, the ranks bucket the same tensors at
different offsets and the bucket's collective mixes one parameter's values
with another's (a wrong gradient, 34th session). collective_order fixes the
order of the gradient collectives; this pass, run last on each graph, puts
the waits of every kind (the forward's and the re-gathering backward's
all-gathers, tensor parallelism's all-reduces of per-sample values) in the
order the collectives are issued in. On a communication stream, which runs
collectives in issue order, waiting for a later one first gains nothing, so
the order costs no overlap.
"""
from __future__ import annotations

import collections

import torch
import torch.fx as fx

from .cleanup import stable_topological_sort
from .collective_order import issue_order_edges
from .context import DPPassContext

_C10D = torch.ops._c10d_functional


def _is_collective(n: fx.Node) -> bool:
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "_c10d_functional" and n.target is not _C10D.wait_tensor.default)


def wait_order_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Reorders waits (only) so that, per collective kind, they follow the order of issue."""
    by_kind: dict = collections.defaultdict(list)
    for n in gm.graph.nodes:
        if _is_collective(n):
            by_kind[n.target].append(n)  # in graph order: the order this rank issues them in
    if not by_kind:
        return gm  # one process: nothing to order
    waits_before = [n for n in gm.graph.nodes if n.target is _C10D.wait_tensor.default]
    after: dict[fx.Node, list[fx.Node]] = {}
    for order in by_kind.values():
        for n, befores in issue_order_edges(order).items():
            after.setdefault(n, []).extend(befores)
    stable_topological_sort(gm.graph, after=after)
    waits_now = [n for n in gm.graph.nodes if n.target is _C10D.wait_tensor.default]
    ctx.counters["collective_waits_reordered"] += sum(a is not b for a, b in zip(waits_before, waits_now))
    gm.graph.lint()
    gm.recompile()
    return gm
