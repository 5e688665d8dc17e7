"""Gaussian noise on each clipped gradient, drawn inside the compiled backward.

Noise comes from Inductor's counter-based RNG (Philox: a seed and each
coordinate's offset), one seed per draw: an entry of the step's seeds input,
derived on the host from (seed, step, parameter index, rank), so every
coordinate gets exactly one fresh draw per step and draws never repeat across
steps, draws or ranks. The noise is
scaled by the loss tangent t like the rest of the gradient (t = 1 for
loss.backward(); a gradient scaler's factor otherwise).

Launches: Inductor realizes every ``inductor_random`` as its own kernel, and
on GPUs it does not fuse a draw into a foreach op that reads it, so one draw
per parameter is one launch per parameter (149 per step on GPT-2-small,
measured). Parameters are therefore packed into chunks of at most
``CHUNK_NUMEL`` coordinates: one flat draw per chunk (keyed by the seed of its
first parameter; a chunk never mixes tensor-parallel shards, which draw per
rank, with replicas, which draw the same on every rank; a gradient summed over the tp group gets its draw on
tp rank 0 only), sliced into the chunk's parameters and added by one
``_foreach_add`` (Inductor's horizontal kernel). A parameter of at least
``CHUNK_NUMEL`` coordinates keeps its own draw, fused into its add, so no
flat draw is larger than a chunk (128 MiB of fp32 by default). A chunk's draw
lives until its foreach add; how many are alive at once is Inductor's
scheduling (GPT-2-small bf16 on an H200: peak memory unchanged).

On CUDA a chunk's flat draw is ``dpcompile::randn`` (dpcompile.randn: four
normals per Philox call; Inductor's ``inductor_random`` makes one per call and
was integer-bound: 4.6 of a Llama-3.2-1B step's 10.6 ms of noise GPU time on an
H100). A parameter with a draw of its own keeps ``inductor_random``, which
Inductor fuses into its add (one read and one write of the gradient).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dpcompile import randn as _randn  # noqa: F401  (defines dpcompile::randn)
from dpcompile.fx_utils import GraphBuilder

from .context import DPPassContext, ParamInfo

aten = torch.ops.aten
prims = torch.ops.prims

# 128 MiB of fp32 draws: GPT-2-small's embedding alone (it is bigger), its 148 other parameters in 3 draws
CHUNK_NUMEL = 1 << 25
# the devices whose chunk draws run dpcompile::randn (the CPU tests add "cpu": its Triton kernel under
# TRITON_INTERPRET=1, torch's generator otherwise)
TRITON_DRAW_DEVICES = ("cuda",)


def _chunks(group: list[tuple[int, fx.Node, ParamInfo]], chunk_numel: int) -> list[list[tuple[int, fx.Node, ParamInfo]]]:
    """Consecutive parameters packed while their coordinates fit ``chunk_numel``; a larger one alone."""
    chunks: list[list[tuple[int, fx.Node, ParamInfo]]] = []
    filled = chunk_numel
    for item in group:
        n = item[1].meta["val"].numel()
        if n >= chunk_numel or filled + n > chunk_numel:
            chunks.append([])
            filled = 0
        chunks[-1].append(item)
        filled += n
    return chunks


def gaussian_noise_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """grad += t * k * s * C * N(0, I) for every trainable parameter."""
    chunk_numel = CHUNK_NUMEL
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
        # a chunk's draw comes from its first parameter's stream: a chunk holds parameters of one device and,
        # under tensor parallelism, one kind (shards draw per rank, replicas the group's shared stream,
        # partial sums on tp rank 0 only). Replicas' chunks must be laid out alike on every rank: a draw's
        # values at an offset depend on its length (Inductor's vectorised tail), so partial sums, which only
        # rank 0 draws for, never share a chunk with them
        groups: dict[tuple[torch.device, str], list[tuple[int, fx.Node, ParamInfo]]] = {}
        for pg in ctx.decompositions.values():
            i = pg.param.grad_output_index
            if pg.param.tp_grad == "partial" and ctx.tp_rank != 0:
                # a gradient summed over the tp group (DTensor's Partial): rank 0's part carries its noise,
                # so the sum gets exactly one draw per coordinate
                ctx.counters["noise_left_to_tp_rank_0"] += 1
                continue
            groups.setdefault((outs[i].meta["val"].device, pg.param.tp_grad), []).append((i, outs[i], pg.param))
            ctx.counters["noise_added"] += 1

        def draw(numel: int, param: ParamInfo, device: torch.device, flat: bool) -> fx.Node:
            ctx.counters["noise_draws"] += 1
            if flat and device.type in TRITON_DRAW_DEVICES:
                ctx.counters["noise_draws_triton"] += 1
                return b.call(torch.ops.dpcompile.randn.default, seeds, param.noise_index, numel)
            seed = b.call(prims.inductor_lookup_seed.default, seeds, param.noise_index)
            # it reads only a graph input, so the min-cut would put it in the forward and save its scalar for
            # the backward: one forward node and one saved tensor per parameter, and Inductor's fusion tried
            # every pair of them (they all read the seeds): 23k of a 12-layer GPT forward's 23.5k fusion checks
            seed.meta["partitioner_tag"] = "must_be_in_backward"
            return b.call(prims.inductor_random.default, [numel], seed, "randn")

        def scaled(z: fx.Node, g: fx.Node) -> fx.Node:
            gv = g.meta["val"]
            z = b.call(aten.mul.Tensor, b.view(z, gv.shape), scale)
            return z if gv.dtype == torch.float32 else b.call(prims.convert_element_type.default, z, gv.dtype)

        for (device, _), group in groups.items():
            for chunk in _chunks(group, chunk_numel):
                if len(chunk) == 1 and chunk[0][1].meta["val"].numel() >= chunk_numel:
                    i, g, param = chunk[0]
                    outs[i] = b.call(aten.add.Tensor, g, scaled(draw(g.meta["val"].numel(), param, device, False), g))
                    continue
                z = draw(sum(g.meta["val"].numel() for _, g, _ in chunk), chunk[0][2], device, True)
                zs, offset = [], 0
                for _, g, _ in chunk:
                    n = g.meta["val"].numel()
                    zs.append(scaled(b.call(aten.slice.Tensor, z, 0, offset, offset + n), g))
                    offset += n
                noisy = b.call(aten._foreach_add.List, [g for _, g, _ in chunk], zs)
                for j, (i, _, _) in enumerate(chunk):
                    outs[i] = b.call(operator.getitem, noisy, j)
                ctx.counters["noise_foreach_adds"] += 1
    out.args = (tuple(outs),) + tuple(out.args[1:])
    ctx.summary["noise"] = f"N(0, ({sigma} * {ctx.config.max_grad_norm})^2) * {ctx.loss.k:g} on each coordinate"
    return gm
