"""One order of gradient collectives on every rank.

Ranks compile their own graphs (batch sizes differ, and so may the schedule's
placement of deferred and recomputed contractions), yet NCCL and gloo need every rank to
issue the same collectives in the same order. This pass puts the gradient
reduce-scatters / all-reduces in a canonical order, that of the parameters'
gradient outputs, whatever schedule produced them; a later collective waits
for an earlier one rather than overtaking it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .batch_dims import COLLECTIVE_REDUCTIONS as _REDUCTIONS
from .cleanup import stable_topological_sort
from .context import DPPassContext

_C10D = torch.ops._c10d_functional


def _collectives_feeding(out_arg: fx.Node) -> list[fx.Node]:
    found, stack, seen = [], [out_arg], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target in _REDUCTIONS:
            found.append(n)
        if n.target in _REDUCTIONS or n.target is _C10D.wait_tensor.default or not found:
            stack.extend(n.all_input_nodes)
    return found


def collective_order_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Reorders gradient collectives to the order of the parameters' outputs."""
    out = gm.graph.find_nodes(op="output")[0]
    order: list[fx.Node] = []
    for p in sorted(ctx.params, key=lambda p: p.grad_output_index):
        g = out.args[0][p.grad_output_index]
        for c in reversed(_collectives_feeding(g)):  # innermost (first issued) first
            if c not in order:
                order.append(c)
    stable_topological_sort(gm.graph, after={c: [prev] for prev, c in zip(order, order[1:])})
    ctx.counters["collectives_ordered"] += len(order)
    return gm
