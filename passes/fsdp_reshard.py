"""reshard_after_forward: gather sharded parameters again in the backward, the same ones on every rank.

fully_shard(..., reshard_after_forward=True) asks for ZeRO-3 memory: the
all-gathered parameter must not be kept from the forward for the backward.
The gather chain of each such parameter (all-gather, wait, the uneven-shard
slice and pad, views and the mixed-precision cast) is marked MUST_RECOMPUTE,
so the min-cut partitioner saves the shard and re-gathers in the backward.

Every rank must re-gather the same parameters in the same order, yet every
rank partitions its own graph, and the graphs differ (uneven shards are
sliced and padded on some ranks only). Left to itself, the min-cut may
recompute a cheap forward op that reads a gathered parameter (a LayerNorm
output, an embedding lookup) on one rank and save it on another: the first
rank issues an extra all-gather and both ranks hang. So the first forward op
past each gather chain is never recomputed (MUST_SAVE; it is stored only if
the backward reads it): a parameter is then gathered in the backward exactly
when a backward op reads it, which the graph's structure fixes, not the
partitioner's costs. Ops the user tagged for recompute (activation
checkpointing) keep their tag: they recompute on every rank alike.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from dpcompile.fx_utils import backward_nodes

from .context import DPPassContext

aten = torch.ops.aten
_C10D = torch.ops._c10d_functional
_GATHER_CHAIN = {
    _C10D.all_gather_into_tensor.default, _C10D.wait_tensor.default, aten.slice.Tensor, aten.view.default,
    aten.constant_pad_nd.default,  # uneven shards are padded before the gather
    aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.alias.default,
}


def _in_chain(n: fx.Node) -> bool:
    """Ops of a gather chain: free to recompute, and they do not keep the gathered parameter alive."""
    if n.op != "call_function":
        return False
    return n.target in _GATHER_CHAIN or bool(getattr(n.target, "is_view", False))


def fsdp_reshard_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Marks the parameter gather chains of reshard_after_forward parameters for recompute, and the forward
    ops that read them as saved."""
    # backward: what reads the tangent, and what dpcompile placed in the backward without reading it (a
    # forward value the ghost second backward recomputes): those read a gathered parameter in the backward
    backward = backward_nodes(gm.graph) if ctx.reshard_primals else set()
    for primal in ctx.reshard_primals:
        frontier = list(primal.users)
        chain: set[fx.Node] = set()
        while frontier:
            n = frontier.pop()
            if n in chain or not _in_chain(n):
                continue
            chain.add(n)
            if n.target in (_C10D.all_gather_into_tensor.default, aten.constant_pad_nd.default) or any(
                a.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE or a is primal for a in n.all_input_nodes
            ):
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                n.meta["ac_graph_id"] = 0
                frontier.extend(n.users)
        recomputed = {n for n in chain if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
        ctx.counters["reshard_after_forward_nodes"] += len(recomputed)
        for n in recomputed:
            for user in n.users:
                if (user in recomputed or user in backward or user.op != "call_function"
                        or "recompute" in user.meta):
                    continue
                user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                ctx.counters["reshard_readers_saved"] += 1
    return gm
