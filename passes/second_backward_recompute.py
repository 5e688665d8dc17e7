"""Ghost's second backward recomputes the large forward contractions it reads instead of keeping them.

A non-private backward writes the logits' gradient into the logits' own
buffer: the logits die where their gradient is born. Ghost's first backward
cannot do that when its second backward reads the logits again (softmax
backward), so one more logits-sized buffer (B*T*V values) stays alive through
the first backward: on GPT-2-small at B=8, T=1024 in fp32, 1.65 GB above the
non-private peak. Recomputing such a value from its inputs at the start of the
second backward costs one contraction (the head matmul) and brings the first
backward's peak back to the non-private one.

Recomputed: a forward value the second backward reads that holds at least
RECOMPUTE_MIN_BYTES at the expected batch size and is computed, through
pointwise ops and views, from a contraction (mm, addmm, bmm) whose inputs are
at least RECOMPUTE_MIN_RATIO times smaller (the log-softmax of the logits
from the LM head's input and weight). Those small inputs stay saved (the
norms and the second backward read them anyway); the chain is copied into the
second backward. Decided from static shapes and expected_batch_size, so every
rank rewrites alike. The copies are tagged must_be_in_backward: the min-cut
partitioner would otherwise compute them in the forward and save them.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.buffer_reuse import mark_second_backward
from dpcompile.fx_utils import recomputable

from .batch_state import bytes_at_expected_batch
from .context import DPPassContext

aten = torch.ops.aten
_CONTRACTIONS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
RECOMPUTE_MIN_BYTES = 64 << 20
RECOMPUTE_MIN_RATIO = 8


def _bytes_at_expected_batch(node: fx.Node, ctx: DPPassContext) -> int | None:
    return bytes_at_expected_batch(node, ctx.states, ctx.batch_size, ctx.options.expected_batch_size)


def _chain(root: fx.Node, ctx: DPPassContext, first: set[fx.Node]) -> list[fx.Node] | None:
    """The forward nodes to recompute for root, in graph order, or None when root does not come from a
    contraction of inputs RECOMPUTE_MIN_RATIO times smaller through pointwise ops and views only."""
    size = _bytes_at_expected_batch(root, ctx)
    if size is None or size < RECOMPUTE_MIN_BYTES:
        return None
    chain, todo, contraction = set(), [root], False
    while todo:
        n = todo.pop()
        if n in chain:
            continue
        if n.op != "call_function" or n in first or n.meta.get("dpcompile"):
            return None
        if n.target in _CONTRACTIONS:
            contraction = True
        elif not recomputable(n):
            return None
        chain.add(n)
        for a in n.all_input_nodes:
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                continue
            b = _bytes_at_expected_batch(a, ctx)
            if b is None:
                return None
            if b * RECOMPUTE_MIN_RATIO >= size:  # not much smaller than the root: recomputed too
                if n.target in _CONTRACTIONS:
                    return None  # a contraction of large inputs: keeping its output costs no more
                todo.append(a)
    if not contraction:
        return None
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def second_backward_recompute_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Points the second backward's reads of large forward values made by a contraction at recomputed copies."""
    copies = set(ctx.second_backward.values())
    if not copies:
        return gm
    first = set(ctx.backward_nodes)
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers: dict[fx.Node, list[fx.Node]] = {}
    for c in copies:
        for a in c.all_input_nodes:
            if a.op == "call_function" and a not in first and a not in copies and not a.meta.get("dpcompile"):
                readers.setdefault(a, []).append(c)
    report = ctx.summary.setdefault("second_backward_recompute", {})
    done: dict[fx.Node, fx.Node] = {}
    for root in sorted(readers, key=order.__getitem__):
        chain = _chain(root, ctx, first)
        if chain is None:
            continue
        users = readers[root]
        with graph.inserting_before(min(users, key=order.__getitem__)):
            for n in chain:
                if n in done:
                    continue
                again = graph.node_copy(n, lambda a: done.get(a, a))
                again.meta = dict(n.meta)
                again.meta["partitioner_tag"] = "must_be_in_backward"
                again.meta["dpcompile"] = True
                mark_second_backward(again)
                again.meta.pop("recompute", None)
                done[n] = again
        for u in users:
            u.replace_input_with(root, done[root])
        ctx.counters["second_backward_recomputed_values"] += 1
        ctx.counters["second_backward_recomputed_contractions"] += sum(n.target in _CONTRACTIONS for n in chain)
        size = _bytes_at_expected_batch(root, ctx)
        report[root.name] = (f"{size / 2**20:.0f} MiB at the expected batch size, made by "
                             f"{' -> '.join(str(n.target).replace('aten.', '') for n in chain)}: recomputed in the "
                             f"second backward, not kept through the first")
    return gm
