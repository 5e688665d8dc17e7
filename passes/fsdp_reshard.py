"""reshard_after_forward: gather sharded parameters again in the backward.

fully_shard(..., reshard_after_forward=True) asks for ZeRO-3 memory: the
all-gathered parameter must not be kept from the forward for the backward.
The gather chain of each such parameter (all-gather, wait, the uneven-shard
slice, views and the mixed-precision cast) is marked MUST_RECOMPUTE, so the
min-cut partitioner saves the shard and re-gathers in the backward.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .context import DPPassContext

aten = torch.ops.aten
_C10D = torch.ops._c10d_functional
_GATHER_CHAIN = {
    _C10D.all_gather_into_tensor.default, _C10D.wait_tensor.default, aten.slice.Tensor, aten.view.default,
    aten.constant_pad_nd.default,  # uneven shards are padded before the gather
    aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.alias.default,
}


def fsdp_reshard_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Marks the parameter gather chains of reshard_after_forward parameters for recompute."""
    for primal in ctx.reshard_primals:
        frontier = list(primal.users)
        seen: set[fx.Node] = set()
        while frontier:
            n = frontier.pop()
            if n in seen or n.op != "call_function" or n.target not in _GATHER_CHAIN:
                continue
            seen.add(n)
            if n.target in (_C10D.all_gather_into_tensor.default, aten.constant_pad_nd.default) or any(
                a.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE or a is primal for a in n.all_input_nodes
            ):
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                n.meta["ac_graph_id"] = 0
                frontier.extend(n.users)
        ctx.counters["reshard_after_forward_nodes"] += len(seen)
    return gm
