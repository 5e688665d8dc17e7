"""A scatter's result read in a separate step from the scatter, where torch 2.11's C++ backend misorders them.

torch 2.11's Inductor, on CPU, fused the readers of a scatter's result (``scatter_add`` into zeros: the
backward of ``torch.gather``, ``F.multilabel_margin_loss``'s among them) into the kernel that zeroes the
scatter's buffer, ahead of the scatter itself (an ``aten.scatter_reduce_`` fallback, or atomic adds placed
after the loads in one loop): they read the zeros, and the gradient lost the scatter's part. It needed a
reader the non-private step does not have (the per-sample norm rows of a bias in float64); torch 2.13
orders them. Each such scatter's result is read through ``dpcompile::realized`` (a copy Inductor cannot
fuse), on torch < 2.13, on CPU, under Inductor. Counter: ``scatter_reads_realized``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

import dpcompile.realized  # noqa: F401 (defines the op at import: a warm restart's cached code calls it, no pass runs)
from dpcompile.compat import scatter_reads_in_order

from .context import DPPassContext

aten = torch.ops.aten

_SCATTERS = {aten.scatter_add.default, aten.scatter_reduce.two, aten.scatter.src, aten.scatter.value,
             aten.index_add.default}


def scatter_reads_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    if scatter_reads_in_order():
        return gm
    graph = gm.graph
    changed = 0
    for node in list(graph.nodes):
        val = node.meta.get("val")
        if node.op != "call_function" or node.target not in _SCATTERS or not isinstance(val, torch.Tensor) or \
                val.device.type != "cpu" or not node.users:
            continue
        with graph.inserting_after(node):
            new = graph.call_function(torch.ops.dpcompile.realized.default, (node,))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new, delete_user_cb=lambda u, new=new: u is not new)
        changed += 1
    if changed:
        ctx.counters["scatter_reads_realized"] += changed
        graph.lint()
        gm.recompile()
    return gm
