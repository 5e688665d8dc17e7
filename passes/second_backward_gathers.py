"""Ghost's second backward gathers its own parameters again instead of keeping the first backward's.

With ``reshard_after_forward=True`` (ZeRO-3) fsdp_reshard has the backward
gather each parameter again where a backward op first reads it. Ghost's
backward is two backwards: the first (per-sample norms) and the second (the
clipped gradients) both read each weight (a Linear's input gradient is
``grad_out @ W`` in both). One gather in the first backward, kept for the
second, holds every layer's gathered parameter at once where the second
backward starts, on top of the activations both backwards read: the peak of
ZeRO-2, for the communication of ZeRO-3.

Run on the partitioned backward: each gather chain of the backward (the
all-gather of a saved shard, its wait, and the uneven shard's pad and slice,
views and the mixed-precision cast around it) whose gathered value is read
by both backwards is copied, whole, to just before its first reader in the
second backward, which reads the copy. The first backward's gathered value
then dies at its last read there, as in bk's single backward.

Every rank must issue the same all-gathers in the same order: the choice
rests on which ops of each backward read a gathered parameter (the model's
structure, the same on every rank), never on sizes or costs, and the copies
are issued in the order of their first readers, then of the original gathers.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.buffer_reuse import PHASE_KEY, SECOND_BACKWARD
from dpcompile.second_backward_copies import copy_for_second_backward

from .context import DPPassContext

aten = torch.ops.aten
_C10D = torch.ops._c10d_functional
COUNTER = "second_backward_gathers"
# a gather chain: what fsdp_reshard recomputes in the backward (passes/fsdp_reshard._GATHER_CHAIN) and views
_CHAIN_OPS = {
    _C10D.all_gather_into_tensor.default, _C10D.wait_tensor.default, aten.slice.Tensor, aten.constant_pad_nd.default,
    aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.alias.default,
}


def _chain_op(n: fx.Node) -> bool:
    if n.op != "call_function" or n.meta.get(PHASE_KEY) == SECOND_BACKWARD:
        return False
    return n.target in _CHAIN_OPS or bool(getattr(n.target, "is_view", False))


def _gather_chain(gather: fx.Node) -> set[fx.Node] | None:
    """The gather's chain: its input side down to the backward's inputs (the saved shard), and every chain op
    its result reaches; None where its input comes from anything else (a value the backward computes)."""
    chain, todo = {gather}, list(gather.all_input_nodes)
    while todo:
        n = todo.pop()
        if n.op == "placeholder" or n in chain:
            continue
        if not _chain_op(n) or n.target is _C10D.wait_tensor.default:
            return None
        chain.add(n)
        todo.extend(n.all_input_nodes)
    todo = list(gather.users)
    while todo:
        n = todo.pop()
        if n in chain or not _chain_op(n) or n.target is _C10D.all_gather_into_tensor.default:
            continue
        if any(a not in chain and a.op != "placeholder" for a in n.all_input_nodes):
            continue  # reads something else too (a view of two inputs): not part of the gather
        chain.add(n)
        todo.extend(n.users)
    return chain


def second_backward_gathers_pass(bw: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Copies each gather chain whose value both backwards read into the second backward."""
    graph = bw.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    second = {n for n in nodes if n.meta.get(PHASE_KEY) == SECOND_BACKWARD}
    if not second:
        return bw  # one backward (bk, or no clipping): nothing is kept across backwards
    plans = []
    for gather in nodes:
        if gather.target is not _C10D.all_gather_into_tensor.default or gather in second:
            continue
        chain = _gather_chain(gather)
        if chain is None:
            continue
        readers = [u for n in chain for u in n.users if u not in chain]
        later = [u for u in readers if u in second]
        if not later or len(later) == len(readers):
            continue  # read by one backward only: nothing is held across them
        plans.append((min(order[u] for u in later), order[gather], chain))
    for _, _, chain in sorted(plans, key=lambda p: p[:2]):
        later = {u for n in chain for u in n.users if u not in chain and u in second}
        needed, todo = set(), [n for n in chain if any(u in later for u in n.users)]
        while todo:  # the chain's nodes the second backward's reads come from (not a view only the first reads)
            n = todo.pop()
            if n not in needed:
                needed.add(n)
                todo.extend(a for a in n.all_input_nodes if a in chain)
        done = copy_for_second_backward(graph, needed, later, order)
        for u in later:
            for n in needed:
                u.replace_input_with(n, done[n])
        ctx.counters[COUNTER] += 1
    if plans:
        graph.lint()
        bw.recompile()
    return bw
