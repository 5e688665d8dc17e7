"""Tensor parallelism: prove that a replicated parameter's gradient on each rank is its whole gradient.

dpcompile counts a parameter that every rank of the tensor-parallel group
holds in full (a ``Replicate`` DTensor, a plain tensor) once, on the claim that
each rank computes all of its per-sample gradient. That fails where such a
parameter meets one rank's shard of an activation (a plain scale applied to a
ColwiseParallel output): its gradient on each rank is then a partial sum over
the rank's slice, and its norm would be too small. Values are followed from
the shards (the sharded parameters' placeholders) until a sum over the tp
group makes them whole again; a replicated parameter's contribution that
reads such a value is refused.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.errors import DPCompileError
from dpcompile.fx_utils import module_of, op_name

from .context import DPPassContext


def _rank_local(gm: fx.GraphModule, ctx: DPPassContext) -> set[fx.Node]:
    """Nodes whose value differs across the tp group: computed from a shard, not yet summed over it."""
    local = {p.primal for p in ctx.params if p.tp == "shard"}
    c10d = torch.ops._c10d_functional
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in local:
            continue
        if n.target is c10d.all_reduce.default and n.args[2] == ctx.tp_group:
            continue  # the group's sum: the same on every rank
        if any(a in local for a in n.all_input_nodes):
            local.add(n)
    return local


def tensor_parallel_check_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    if ctx.tp_group is None:
        return gm
    local = _rank_local(gm, ctx)
    for name, pg in ctx.decompositions.items():
        if pg.param.tp != "replicate":
            continue
        for c, _ in pg.terms:
            bad = [a for a in c.node.all_input_nodes if a in local]
            if bad:
                raise DPCompileError(
                    f"dp_fsdp: parameter '{name}' is the same on every rank of the tensor-parallel group, but its "
                    f"gradient is computed from one rank's shard (op {op_name(c.node)} in module "
                    f"{module_of(c.node)} reads {bad[0].name}, which comes from a sharded parameter and is not "
                    f"summed over the group): each rank would hold only part of every sample's gradient. Make "
                    f"the parameter a tensor-parallel shard too (parallelize_module), or apply it outside the "
                    f"sharded region.")
            ctx.counters["tp_replicated_contributions_checked"] += 1
    return gm
