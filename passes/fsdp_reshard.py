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
rank issues an extra all-gather and both ranks hang. So each forward op past
a gather chain (a reader) is saved or recomputed on every rank alike, by the
graph's structure, not the partitioner's costs. A pointwise reader whose value
reaches a backward op through views and other pointwise readers (a
LayerNorm's ``x_hat * w + b``, which the next Linear's weight gradient reads)
is recomputed, path and all (MUST_RECOMPUTE): every rank needs the value, so
every rank gathers its parameters. Saving it kept one more activation per
LayerNorm than the non-sharded step keeps (the normalised input and the
affine output both, where that step keeps the input and recomputes the
rest). Every other reader is never recomputed (MUST_SAVE; it is stored only
if the backward reads it): its parameter is then gathered in the backward
exactly when a backward op reads it. Ops the user tagged for recompute
(activation checkpointing) keep their tag: they recompute on every rank alike.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from dpcompile.fx_utils import backward_nodes, recomputable

from .context import DPPassContext

aten = torch.ops.aten
_C10D = torch.ops._c10d_functional
_GATHER_CHAIN = {
    _C10D.all_gather_into_tensor.default, _C10D.wait_tensor.default, aten.slice.Tensor, aten.view.default,
    aten.constant_pad_nd.default,  # uneven shards are padded before the gather
    aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.alias.default,
}


def in_gather_chain(n: fx.Node) -> bool:
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
    gathered: set[fx.Node] = set()
    for primal in ctx.reshard_primals:
        frontier = list(primal.users)
        chain: set[fx.Node] = set()
        while frontier:
            n = frontier.pop()
            if n in chain or not in_gather_chain(n):
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
        gathered |= recomputed
    readers = dict.fromkeys(u for n in gm.graph.nodes if n in gathered for u in n.users if u not in gathered and
                            u not in backward and u.op == "call_function" and "recompute" not in u.meta)
    again = _recomputed_readers(readers, backward)
    for n in again:
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        n.meta["ac_graph_id"] = 0
    for user in readers:
        if user in again:
            ctx.counters["reshard_readers_recomputed"] += 1
        else:
            user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            ctx.counters["reshard_readers_saved"] += 1
    return gm


def _recomputed_readers(readers: dict[fx.Node, None], backward: set[fx.Node]) -> set[fx.Node]:
    """The pointwise readers of gathered parameters to recompute in the backward, with the views and pointwise
    readers from them to a value a backward op reads (a LayerNorm's ``x_hat * w + b``, read by the next
    Linear's weight gradient): the backward needs that value on every rank, and recomputing the whole path on
    every rank gathers the same parameters on every rank. Saving it instead keeps one more activation per
    reader (the normalised input and the affine output both), where a non-sharded step keeps the input only."""
    cheap = {u for u in readers if recomputable(u)}
    paths: dict[fx.Node, set[fx.Node]] = {}

    def path(n: fx.Node) -> set[fx.Node]:
        if n not in paths:
            found: set[fx.Node] = {n} if any(w in backward for w in n.users) else set()
            for w in n.users:
                if w in backward or w.op != "call_function" or "recompute" in w.meta:  # a reader has none yet
                    continue
                if w in cheap or (recomputable(w) and w.target.is_view):
                    if sub := path(w):
                        found |= sub | {n}
            paths[n] = found
        return paths[n]

    again: set[fx.Node] = set()
    for u in readers:
        if u in cheap:
            again |= path(u)
    return again

