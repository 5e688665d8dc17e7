"""Gaussian noise on each clipped gradient, drawn inside the compiled backward.

Each parameter's noise comes from Inductor's counter-based RNG keyed by its
own seed (one entry of the step's seeds input, derived on the host from
(seed, step, parameter index)), so every coordinate gets exactly one fresh
draw per step and draws never repeat across steps or parameters. The noise is
scaled by the loss tangent t like the rest of the gradient (t = 1 for
loss.backward(); a gradient scaler's factor otherwise).

The noise is added to all the gradients by one ``_foreach_add`` (per
device): Inductor lowers it to one horizontal kernel for all parameters (a
few, where its argument limit splits them) with each parameter's draw
inlined, instead of one kernel per parameter after its weight-gradient
GEMM: 149 launches per step on GPT-2-small.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dpcompile.fx_utils import GraphBuilder

from .context import DPPassContext

aten = torch.ops.aten
prims = torch.ops.prims


def gaussian_noise_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """grad += t * k * s * C * N(0, I) for every trainable parameter."""
    sigma = ctx.config.noise_multiplier
    if sigma == 0 or ctx.loss is None or not ctx.decompositions:
        ctx.summary["noise"] = "none (noise_multiplier = 0)"
        return gm
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    seeds = [n for n in graph.find_nodes(op="placeholder")][ctx.seeds_input_index]
    b = GraphBuilder(graph)
    outs = list(out.args[0])
    std = ctx.loss.k * sigma * ctx.config.max_grad_norm
    with graph.inserting_before(out):
        scale = b.call(aten.mul.Tensor, b.f32(ctx.loss.tangent), std)
        if ctx.noise_gate_input_index is not None:  # 0 inside dpcompile.accumulate(): noise once per logical batch
            gate = graph.find_nodes(op="placeholder")[ctx.noise_gate_input_index]
            scale = b.call(aten.mul.Tensor, scale, gate)
        by_device: dict[torch.device, list[tuple[int, fx.Node, fx.Node]]] = {}
        for pg in ctx.decompositions.values():
            i = pg.param.grad_output_index
            g = outs[i]
            gv = g.meta["val"]
            seed = b.call(torch.ops.prims.inductor_lookup_seed.default, seeds, pg.param.noise_index)
            # it reads only a graph input, so the min-cut would put it in the forward and save its scalar for
            # the backward: one forward node and one saved tensor per parameter, and Inductor's fusion tried
            # every pair of them (they all read the seeds): 23k of a 12-layer GPT forward's 23.5k fusion checks
            seed.meta["partitioner_tag"] = "must_be_in_backward"
            z = b.call(torch.ops.prims.inductor_random.default, list(gv.shape), seed, "randn")
            z = b.call(aten.mul.Tensor, z, scale)
            if gv.dtype != torch.float32:
                z = b.call(prims.convert_element_type.default, z, gv.dtype)
            by_device.setdefault(gv.device, []).append((i, g, z))
            ctx.counters["noise_added"] += 1
        for group in by_device.values():
            noisy = b.call(aten._foreach_add.List, [g for _, g, _ in group], [z for _, _, z in group])
            for j, (i, _, _) in enumerate(group):
                outs[i] = b.call(operator.getitem, noisy, j)
            ctx.counters["noise_foreach_adds"] += 1
    out.args = (tuple(outs),) + tuple(out.args[1:])
    ctx.summary["noise"] = f"N(0, ({sigma} * {ctx.config.max_grad_norm})^2) * {ctx.loss.k:g} on each coordinate"
    return gm
