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
by both backwards is copied (what the second backward reads of it) to just
before its first reader in the second backward, which reads the copy. The
first backward's gathered value then dies at its last read there, as in
bk's single backward. A value pointwise ops make from gathered parameters
that both backwards read (a LayerNorm's affine output, which fsdp_reshard
recomputes in the first backward) is copied the same way, reading the
second backward's gathers: a ZeRO-2 step's second backward makes it again
from saved values (second_backward_copies), and holding it would keep one
activation per LayerNorm across.

Every rank must issue the same all-gathers in the same order: the choice
rests on which ops of each backward read a gathered parameter (the model's
structure, the same on every rank) and on sizes every rank shares (a batch-
sized value, a whole parameter's), never on a rank's shard or costs, and the
copies are issued in the order of their first readers, then of the original
gathers.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.buffer_reuse import PHASE_KEY, SECOND_BACKWARD
from dpcompile.fx_utils import recomputable
from dpcompile.second_backward_copies import MAX_CHAIN, MIN_NUMEL, copy_for_second_backward, numel_hint

from .context import DPPassContext
from .fsdp_reshard import in_gather_chain

_C10D = torch.ops._c10d_functional
COUNTER = "second_backward_gathers"
VALUE_COUNTER = "second_backward_gathered_value_copies"


def _chain_op(n: fx.Node) -> bool:
    """An op of a first-backward gather chain: what fsdp_reshard recomputes in the backward."""
    return n.meta.get(PHASE_KEY) != SECOND_BACKWARD and in_gather_chain(n)


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


def _made_from_gathers(root: fx.Node, in_chain: set, second: set) -> tuple[set, set] | None:
    """root's pointwise ops and views down to gathered parameters (at least one), saved values and constants:
    the ops to copy and the gather-chain nodes they read; None where root is made by anything else."""
    pointwise: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    todo = [root]
    while todo:
        n = todo.pop()
        if n in pointwise or n in leaves or n.op == "placeholder" or (n is not root and not n.all_input_nodes):
            continue  # saved values and constants are read where they are
        if n in in_chain:
            leaves.add(n)
            continue
        if n in second or not recomputable(n):
            return None
        pointwise.add(n)
        # the uneven shard's pad and slice are chain nodes, not counted here: every rank decides alike
        if len(pointwise) > MAX_CHAIN:
            return None
        todo.extend(n.all_input_nodes)
    return (pointwise, leaves) if leaves else None


def second_backward_gathers_pass(bw: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Gives the second backward its own gathers of what it reads of the gathered parameters, and its own copies
    of the pointwise values made from them that both backwards read."""
    graph = bw.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    second = {n for n in nodes if n.meta.get(PHASE_KEY) == SECOND_BACKWARD}
    if not second:
        return bw  # one backward (bk, or no clipping): nothing is kept across backwards
    chains: list[set[fx.Node]] = []
    for gather in nodes:
        if gather.target is _C10D.all_gather_into_tensor.default and gather not in second:
            if (chain := _gather_chain(gather)) is not None:
                chains.append(chain)
    in_chain = set().union(*chains)
    # a pointwise value of gathered parameters both backwards read (a LayerNorm's x_hat * w + b, recomputed in
    # the first backward): copied too, or it would be held across as the gathered parameters were
    values = []
    for root in nodes:
        if root.op != "call_function" or root in second or root in in_chain or numel_hint(root) < MIN_NUMEL:
            continue
        later = [u for u in root.users if u in second]
        if later and len(later) < len(root.users) and (made := _made_from_gathers(root, in_chain, second)):
            values.append((min(order[u] for u in later), root, *made))
    # where the second backward first needs each chain node: read directly, or through a value's copy
    demand: dict[fx.Node, int] = {}
    for chain in chains:
        for n in chain:
            for u in n.users:
                if u in second and u not in chain:
                    demand[n] = min(demand.get(n, len(nodes)), order[u])
    for first, _, _, leaves in values:
        for n in leaves:
            demand[n] = min(demand.get(n, len(nodes)), first)
    plans = []
    for chain in chains:
        if wanted := [n for n in chain if n in demand]:
            gather = next(n for n in chain if n.target is _C10D.all_gather_into_tensor.default)
            plans.append((min(demand[n] for n in wanted), order[gather], chain, wanted))
    copies: dict[fx.Node, fx.Node] = {}
    for first, _, chain, wanted in sorted(plans, key=lambda p: p[:2]):
        needed, todo = set(), list(wanted)
        while todo:  # the chain's nodes the second backward's reads come from (not a view only the first reads)
            n = todo.pop()
            if n not in needed:
                needed.add(n)
                todo.extend(a for a in n.all_input_nodes if a in chain)
        copies.update(copy_for_second_backward(graph, needed, [nodes[first]], order))
        for n in wanted:
            for u in list(n.users):
                if u in second and u not in chain:
                    u.replace_input_with(n, copies[n])
        ctx.counters[COUNTER] += 1
    for first, root, pointwise, _ in sorted(values, key=lambda v: (v[0], order[v[1]])):
        done = copy_for_second_backward(graph, pointwise, [nodes[first]], order, inputs=copies)
        for u in [u for u in root.users if u in second]:
            u.replace_input_with(root, done[root])
        ctx.counters[VALUE_COUNTER] += 1
    if plans:
        graph.lint()
        bw.recompile()
    return bw
