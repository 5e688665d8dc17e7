"""Dead-code elimination; and the order/lint/recompile every run ends with."""
from __future__ import annotations

import torch.fx as fx
from torch.fx.passes.tools_common import legalize_graph

from .context import DPPassContext


def cleanup_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Drops the contractions the rewrite made dead (e.g. the ghost first pass's)."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    ctx.counters["dead_nodes_removed"] += before - len(gm.graph.nodes)
    return gm


def finalize(gm: fx.GraphModule) -> fx.GraphModule:
    """A valid topological order (rebuilt nodes were appended late), lint, recompile."""
    legalize_graph(gm)
    gm.graph.lint()
    gm.recompile()
    return gm
