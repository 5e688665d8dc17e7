"""A batched matmul over a batch of one, rewritten as the matrix product it is.

``torch.einsum`` lowers every contraction whose operands share no batch dim to ``bmm`` over a batch of one:
``einsum("bsd,hd->bsh", x, w)`` is ``bmm(x.reshape(1, b s, d), w.t().reshape(1, d, h))``, and the weight's
gradient is ``bmm([1, d, b s], [1, b s, h])``, a contraction over the sample rows. The rules read such a
contraction as a weight-gradient contribution in ``mm`` (whose per-sample norms, clipping and noise the later
passes know), and refused it in ``bmm`` ("batched matmul contracting over the sample dim": XLNet's attention
output ``einsum("ibnd,hnd->ibh", attn, o)`` and any hand-written einsum with a weight). So every bmm whose
operands both have a static batch of one becomes ``unsqueeze(mm(squeeze(a, 0), squeeze(b, 0)), 0)``: the same
values, and no sample is lost with the squeezed dim, since a static size-one dim is never the sample dim of a
batch that is not itself of one sample (a static batch of one is handled whole: ``whole_gradient_mode``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.fx_utils import GraphBuilder

from .context import DPPassContext

aten = torch.ops.aten


def _unit_batch(node: fx.Node) -> bool:
    size = node.meta["val"].shape[0]
    return isinstance(size, int) and size == 1


def unit_batch_matmuls_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    graph = gm.graph
    b = GraphBuilder(graph)
    for node in list(graph.find_nodes(op="call_function", target=aten.bmm.default)):
        x, y = node.args
        if not (_unit_batch(x) and _unit_batch(y)):
            continue
        with graph.inserting_before(node):
            b.meta_source = node
            parts = [b.call(aten.squeeze.dim, x, 0), b.call(aten.squeeze.dim, y, 0)]
            parts.append(b.call(aten.mm.default, *parts))
            parts.append(b.call(aten.unsqueeze.default, parts[-1], 0))
        for n in parts:  # they stand for the traced bmm: the rewrites treat them as traced nodes
            del n.meta["dpcompile"]
        node.replace_all_uses_with(parts[-1])
        graph.erase_node(node)
        ctx.counters["unit_batch_bmm_as_mm"] += 1
    if ctx.counters.get("unit_batch_bmm_as_mm"):
        graph.lint()
        gm.recompile()
    return gm
