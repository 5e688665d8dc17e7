"""Gaussian noise on each clipped gradient, drawn inside the compiled backward.

The noise comes from a counter-based RNG (Philox4x32-10: a 64-bit seed and each coordinate's position), one seed
per draw: an entry of the step's seeds input, derived on the host from (seed, step, parameter index, rank), so
every coordinate gets exactly one fresh draw per step and draws never repeat across steps, draws or ranks. The
noise is scaled by the loss tangent t like the rest of the gradient (t = 1 for loss.backward(); a gradient
scaler's factor otherwise).

Parameters are packed into chunks of at most ``CHUNK_NUMEL`` coordinates (a larger parameter alone), and each
chunk's noise is drawn and added by one ``dpcompile::add_randn`` (dpcompile.add_randn): on CUDA one Triton kernel
that makes four normals per Philox call in registers and adds them where each gradient is read, every gradient
read and written once, one launch per chunk; elsewhere the same values from torch ops (dpcompile.philox). A
chunk's draw is keyed by the seed of its first parameter; a chunk never mixes tensor-parallel shards, which draw
per rank, with replicas, which draw the same on every rank, and a gradient summed over the tp group gets its draw
on tp rank 0 only. A bf16 weight gradient's cast to its fp32 parameter's dtype is taken into the op
(``_before_cast``): it reads bf16 and writes fp32.

Before, Inductor drew (``inductor_random``) and a foreach add added: on CUDA one normal per Philox call, integer-
bound, and the draw written and read again (a Llama-3.2-1B step on one H100: 10.6 ms of noise GPU time against
about 3.3 ms to read and write the gradients, BENCHMARKS.md); on the CPU a stream keyed by 32 bits of the seed
(two draws of a long run repeat each other with probability n^2 / 2^33) and normals bounded at 5.8 standard
deviations, as Triton's ``tl.randn`` bounds them at 5.68 (triton_kernels.radius_uniform).

Steps replayed as CUDA graphs (``cudagraphs=True``) call the same op: its address table's copy is captured with
the kernel (a graph's addresses do not change between replays), so a graph too adds all noise in one launch per
pair of dtypes.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dpcompile import add_randn  # noqa: F401  (defines dpcompile::add_randn)
from dpcompile.fx_utils import GraphBuilder

from .context import DPPassContext, ParamInfo

aten = torch.ops.aten
prims = torch.ops.prims

# 128 MiB of fp32 draws: GPT-2-small's embedding alone (it is bigger), its 148 other parameters in 3 draws
CHUNK_NUMEL = 1 << 25


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


def _before_cast(g: fx.Node, ctx: DPPassContext) -> fx.Node:
    """The gradient before its cast to the parameter's dtype (a bf16 weight gradient of an fp32 parameter under
    autocast), which dpcompile::add_randn takes in: it reads the bf16 gradient and writes fp32, where the cast
    would write an fp32 copy for it to read (Llama-3.2-1B bf16 on one H100: 2.5 ms of casts). g itself where it
    is no such cast or is read by more than the graph's output."""
    if g.op != "call_function" or len(g.users) != 1 or not isinstance(g.args[0], fx.Node):
        return g
    if g.target is prims.convert_element_type.default or (g.target is aten._to_copy.default
                                                         and set(g.kwargs) <= {"dtype"}):
        x = g.args[0].meta.get("val")
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device == g.meta["val"].device:
            ctx.counters["noise_casts_taken_in"] += 1
            return g.args[0]
    return g


def gaussian_noise_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """grad += t * k * s * C * N(0, I) for every trainable parameter."""
    chunk_numel = CHUNK_NUMEL
    sigma = ctx.options.noise_multiplier
    if sigma == 0 or ctx.loss is None or not ctx.decompositions:
        ctx.summary["noise"] = "none (noise_multiplier = 0)"
        return gm
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    seeds = [n for n in graph.find_nodes(op="placeholder")][ctx.seeds_input_index]
    b = GraphBuilder(graph)
    outs = list(out.args[0])
    std = ctx.loss.k * sigma * ctx.options.max_grad_norm
    with graph.inserting_before(out):
        scale = b.call(aten.mul.Tensor, b.f32(ctx.loss.tangent), std)
        if ctx.noise_gate_input_index is not None:  # 0 inside dpcompile.accumulate(): noise once per logical batch
            gate = graph.find_nodes(op="placeholder")[ctx.noise_gate_input_index]
            scale = b.call(aten.mul.Tensor, scale, gate)
        # a chunk's draw comes from its first parameter's stream: a chunk holds parameters of one device and,
        # under tensor parallelism, one kind (shards draw per rank, replicas the group's shared stream,
        # partial sums on tp rank 0 only). Replicas' chunks must be laid out alike on every rank (a coordinate's
        # noise is its chunk's seed and its position in the chunk), so partial sums, which only rank 0 draws
        # for, never share a chunk with them
        groups: dict[tuple[torch.device, str, torch.dtype], list[tuple[int, fx.Node, ParamInfo]]] = {}
        for pg in ctx.decompositions.values():
            i = pg.param.grad_output_index
            if pg.param.tp_grad == "partial" and ctx.tp_rank != 0:
                # a gradient summed over the tp group (DTensor's Partial): rank 0's part carries its noise,
                # so the sum gets exactly one draw per coordinate
                ctx.counters["noise_left_to_tp_rank_0"] += 1
                continue
            v = outs[i].meta["val"]
            groups.setdefault((v.device, pg.param.tp_grad, v.dtype), []).append((i, outs[i], pg.param))
            ctx.counters["noise_added"] += 1

        for group in groups.values():
            for chunk in _chunks(group, chunk_numel):
                grads = [g for _, g, _ in chunk]
                ctx.counters["noise_draws"] += 1
                # drawn and added in one kernel
                dtype = grads[0].meta["val"].dtype
                noisy = b.call(torch.ops.dpcompile.add_randn.default, [_before_cast(g, ctx) for g in grads],
                               seeds, chunk[0][2].noise_index, scale, dtype)
                for j, (i, _, _) in enumerate(chunk):
                    outs[i] = b.call(operator.getitem, noisy, j)
    out.args = (tuple(outs),) + tuple(out.args[1:])
    ctx.summary["noise"] = f"N(0, ({sigma} * {ctx.options.max_grad_norm})^2) * {ctx.loss.k:g} on each coordinate"
    return gm
