"""Convolution weight gradients laid out as traced on an empty batch (on the backward graph, after the partition).

Where the batch size is unbacked (one graph for every batch size, a rank's possibly none) and a
``convolution_backward``'s traced weight gradient is channels-last, the node becomes
``dpcompile::convolution_backward_any_batch`` (dpcompile.empty_conv_backward): on an empty batch torch's kernel
returns that gradient (zeros) in the weight's own layout, and Inductor's stride assert stopped the rank. After
the partition, since the DP passes make convolution_backward calls of their own (the clipped weight gradients).
Counter: ``nonempty_batch_conv_grads_guarded``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile import empty_conv_backward

from .context import DPPassContext
from .empty_batch import holds_batch, unbacked_batch

aten = torch.ops.aten


def empty_conv_grads_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    b = unbacked_batch(ctx)
    if b is None:
        return gm  # a concrete batch size: never empty unless traced so
    changed = 0
    for node in gm.graph.find_nodes(op="call_function", target=aten.convolution_backward.default):
        val = node.meta.get("val")
        if not isinstance(val, (tuple, list)) or not isinstance(val[1], torch.Tensor) or \
                not holds_batch(node.args[1], b):
            continue
        fmt = empty_conv_backward.weight_format(val[1])
        if not fmt:
            continue
        args = list(node.args) + [None] * (11 - len(node.args))  # (the schema's defaults: none)
        node.target = torch.ops.dpcompile.convolution_backward_any_batch.default
        node.args = (*args[:11], fmt)
        changed += 1
    if changed:
        ctx.counters["nonempty_batch_conv_grads_guarded"] += changed
        gm.graph.lint()
        gm.recompile()
    return gm
