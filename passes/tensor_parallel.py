"""Tensor parallelism: prove that a replicated gradient on each rank is the whole gradient.

dpcompile counts a gradient that DTensor calls ``Replicate`` (or a plain
parameter's) once, on the claim that each rank computes all of its per-sample
gradient. That fails where such a parameter meets a value one rank holds alone
(a plain scale applied to a ColwiseParallel output, a plain norm applied to a
sequence shard): its gradient on each rank is then a part of the sum over the
group, and its norm would be too small. Values are followed from the shards
(the sharded parameters' placeholders, and every reduce-scatter's pieces) until
an all-reduce or an all-gather over the group makes them whole again; a
replicated gradient's contribution that reads such a value is refused.
Gradients that DTensor calls ``Partial`` are such sums by declaration: their
per-sample parts are summed over the group before their norm
(per_sample_norms).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.errors import DPCompileError
from dpcompile.fx_utils import module_of, op_name

from .context import DPPassContext


_C10D = torch.ops._c10d_functional
# what a tensor-parallel graph's activation collectives over the tp group are
_TP_COLLECTIVES = (_C10D.all_gather_into_tensor.default, _C10D.reduce_scatter_tensor.default,
                  _C10D.all_reduce.default)


def is_tp_collective(n: fx.Node, group: str) -> bool:
    """``n`` is a collective over the tensor-parallel process group named ``group``."""
    return n.op == "call_function" and n.target in _TP_COLLECTIVES and n.args[-1] == group


def _rank_local(gm: fx.GraphModule, ctx: DPPassContext) -> set[fx.Node]:
    """Nodes whose value differs across the tp group: computed from a shard, not yet made whole."""
    local = set(ctx.tp_local_primals)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in local:
            continue
        if is_tp_collective(n, ctx.tp_group):
            # a reduce-scatter leaves each rank its own piece; an all-reduce (the group's sum) or an
            # all-gather (everyone's pieces) is the same on every rank
            if n.target is _C10D.reduce_scatter_tensor.default:
                local.add(n)
            continue
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
                    f"dp_fsdp: parameter '{name}' has a gradient that is the same on every rank of the "
                    f"tensor-parallel group (a plain parameter, or a Replicate one), but it is computed from one "
                    f"rank's shard (op {op_name(c.node)} in module {module_of(c.node)} reads {bad[0].name}, which "
                    f"comes from a sharded parameter or a reduce-scatter's piece and is not made whole over the "
                    f"group): each rank would hold only part of every sample's gradient, and nothing sums them. "
                    f"Make the parameter a DTensor of the plan (parallelize_module: ColwiseParallel, or "
                    f"SequenceParallel for a norm, whose gradient is then a Partial sum dpcompile completes), or "
                    f"apply it outside the sharded region.")
            ctx.counters["tp_replicated_contributions_checked"] += 1
    return gm
