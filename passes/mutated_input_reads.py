"""Reads of an input the step mutates are saved for the backward, never recomputed there.

A functionalized joint graph reads every input before its mutation: an in-place update of a module buffer
(spectral_norm's power iteration, a running statistic, a step counter) becomes a ``copy_`` into the input at
the end of the forward. The min-cut partitioner may still recompute, in the backward, a value the forward
computed from that input; the backward then reads the input after the copy, and the gradient is silently
wrong. Stock ``torch.compile`` has this bug in torch 2.11-2.13 (pytorch/pytorch#197039, open): a Linear
under ``torch.nn.utils.parametrizations.spectral_norm`` in training mode (tests/cases.py ``spectral_norm``)
got a weight gradient off by 0.22 where its largest entry is 1.6, DP step or not.

So every op that reads such an input's data (through its views) is marked MUST_SAVE: the partitioner saves
it where the backward needs it, and leaves it alone otherwise. A backward op (one that reads a tangent) that
reads the input itself gets a copy of it taken in the forward instead.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from dpcompile.fx_utils import backward_nodes

from .context import DPPassContext

aten = torch.ops.aten
COUNTER = "mutated_input_reads_saved"  # reads pinned, and copies taken for the backward


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and bool(getattr(node.target, "is_view", False))


def mutated_input_reads_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    graph = gm.graph
    mutated = {n.args[0] for n in graph.nodes if n.op == "call_function" and n.target is aten.copy_.default
               and n.args[0].op == "placeholder"}
    if not mutated:
        return gm
    backward = backward_nodes(graph)
    for primal in mutated:
        copies: dict[fx.Node, fx.Node] = {}  # the input, and its views, on the copy taken in the forward

        def on_copy(node: fx.Node) -> fx.Node:
            if node not in copies:
                if node is primal:
                    new = graph.call_function(aten.clone.default, (primal,))
                    new.meta.update(primal.meta)
                    new.meta["val"] = primal.meta["val"].clone()
                    new.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                    ctx.counters[COUNTER] += 1
                else:  # finalize() puts the rebuilt views after their operands
                    new = graph.call_function(node.target, (on_copy(node.args[0]), *node.args[1:]), node.kwargs)
                    new.meta.update(node.meta)
                copies[node] = new
            return copies[node]

        stack = [(primal, u) for u in primal.users]
        while stack:
            source, user = stack.pop()
            if user.op != "call_function" or (user.target is aten.copy_.default and user.args[0] is source):
                continue  # the mutation itself; the output node returns the mutated input
            if user in backward:
                user.replace_input_with(source, on_copy(source))
            elif _is_view(user):
                stack.extend((user, u) for u in list(user.users))
            else:  # (fsdp_reshard may have pinned it already: the first op past a parameter's gather)
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                ctx.counters[COUNTER] += 1
    return gm
