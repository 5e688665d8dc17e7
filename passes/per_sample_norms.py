"""Per-sample squared gradient norms, clip coefficients and row scales.

For every contribution the per-sample squared norm is built from its operands
in fp32 (contractions of bf16/fp16 operands accumulate in fp32 on CUDA, see
bmm_f32), right after the contribution in graph order (so the operands can die
early). Contractions ``A [p, N] @ G [N, m]`` with S rows per sample use the
rank-one form (S == 1), the ghost form <A A^T, G G^T> (cost ~ S^2 (p+m)) or
the direct form ||A_i G_i||^2 (cost ~ S p m plus its [p, m] gradient's memory
traffic), picked per layer from the static shapes (mm_costs). Reductions
materialise the per-sample [B, numel] gradient; embedding backwards use token
equality. A gradient made of several matmul and embedding
contributions (tied weights) takes their norms and per-sample inner products
(shared_norms); one made otherwise or reached through a reshaping chain is
materialised per sample and its chain replayed with a leading sample dim, so
its norm is exact.

Then c_i = min(1, C / (||g_i|| + eps)) and the row scale r_i = c_i * M * k
(M, k from the loss reduction) are computed once all norms exist.
"""
from __future__ import annotations

import contextlib
import math
import operator
import os

from typing import Any

import torch
import torch.fx as fx

from dpcompile import conv_sq_norms
from dpcompile import gram_sq_norms as _gram_op  # defines dpcompile::gram_sq_norms
from dpcompile.fx_utils import GraphBuilder, known

from . import conv_norms
from .sample_factors import (add_all as _add_all, bmm_f32, ids_in_range, sample_major, spans as _spans,
                             transpose12 as _transpose12)
from .batch_state import Batched, Contribution, Permuted, is_zero_constant
from .context import DPPassContext
from .grouped_norms import GroupedNorms, in_sample_order
from .shared_norms import outer_terms, shared_sq
from .param_grads import MATRIX_PRODUCTS, NORM_PRESERVING, SCATTER_ADD, SUMS_AND_BROADCASTS, ParamGrad
from .tensor_parallel import is_tp_collective

aten = torch.ops.aten
prims = torch.ops.prims


# Largest fp32 intermediate one per-sample norm form may materialise at the expected batch size ([B, p, m]
# of the direct form, [B, S, S] Gram matrices of the ghost form); larger ones are computed in blocks whose
# squared norms add. Unblocked, the direct form of GPT-2's LM head at B=8 materialised 1.2 GB per step.
NORM_BLOCK_BYTES = 128 << 20
# The ghost form in one kernel (dpcompile.gram_sq_norms) where the rows per sample are static; off (or
# DPCOMPILE_GRAM_KERNEL=0 in the environment): two Gram matmuls, their product and a sum in the graph, as
# benchmarks compare the two.
GRAM_KERNEL = os.environ.get("DPCOMPILE_GRAM_KERNEL", "1") != "0"
GRAM_KERNEL_WHY = "; in one kernel (dpcompile::gram_sq_norms)"


# Per-sample gradients of summed parameters (biases, norm weights: NormBuilder.sum_rows) are kept as [B, n] rows of
# one buffer until all exist, and their squared norms are one reduction over it; a gradient that would take the
# buffer past this size at the expected batch size gets a reduction of its own right where it is made (it is not
# kept alive through the backward).
STACKED_ROWS_MAX_BYTES = 64 << 20
STACKED_ROWS_WHY = "reduction: per-sample sum, its squares summed with the other such parameters' in one reduction"


def _row_bytes(row: fx.Node, ctx: DPPassContext) -> int:
    """fp32 bytes of a [B, n] per-sample row block at the expected batch size (n symbolic: never fits)."""
    n = row.meta["val"].shape[1]
    if not isinstance(n, int):
        return STACKED_ROWS_MAX_BYTES + 1
    B = ctx.options.expected_batch_size or (ctx.batch_size if isinstance(ctx.batch_size, int) else 1)
    return 4 * n * int(B)


# The norm kernels' [B, parts] partial sums are added in groups of this many kernels, one reduction per group: on
# CUDA, Inductor reads a concatenation of at most 8 inputs inside its reader (config.max_pointwise_cat_inputs), so a
# group is one launch (a ViT-S/16 bk step: 37 partial-sum reductions -> 5).
PARTIALS_PER_SUM = 8


def _kernel_partials(sq: fx.Node) -> fx.Node | None:
    """The [B, parts] output of a norm kernel (gram_sq_norms, conv_weight_sq_norms) when sq is just its sum."""
    if sq.op != "call_function" or sq.target is not aten.sum.dim_IntList or len(sq.args) < 2 \
            or not isinstance(sq.args[1], (list, tuple)) or list(sq.args[1]) != [1]:
        return None
    partial = sq.args[0]
    kernels = (torch.ops.dpcompile.gram_sq_norms.default, torch.ops.dpcompile.conv_weight_sq_norms.default)
    if not isinstance(partial, fx.Node) or len(partial.users) != 1:
        return None
    if partial.target in kernels:
        return partial
    # conv_weight_grads's first output (its second, the gradients, the clipped sum reads)
    if partial.target is operator.getitem and partial.args[1] == 0 and \
            partial.args[0].target is torch.ops.dpcompile.conv_weight_grads.default:
        return partial
    return None


def gram_kernel_takes(S: Any) -> bool:
    """Whether the ghost form over S rows per sample runs as dpcompile::gram_sq_norms (no [B, S, S] Grams
    written): the kernel is on and S static (its tiles are)."""
    return GRAM_KERNEL and isinstance(S, int)


# linear_norm's cost model counts memory traffic in multiply-adds: moving a byte to or from GPU memory takes about
# as long as this many multiply-adds of a matmul (an H100/H200: ~300 T bf16 multiply-adds/s reached over ~4 TB/s).
# Counting flops only, GPT-2-small's layers at 8x1024 took the direct form, which writes and reads each sample's
# [p, m] fp32 gradient: the Gram kernel was 1.3-6x faster on every one of them (H200, bf16 and fp32,
# benchmarks/gram_norm_kernel.py --direct: the LM head 0.82 ms against 5.08), and the step's GPU time fell from
# 24.3 to 22.7 ms. At 2x4096 the direct form stays (the kernel 1.4-2.7x slower on all but a 768x768 layer).
MACS_PER_BYTE = 64


def mm_costs(S: Any, p: Any, m: Any) -> tuple[Any, Any]:
    """(ghost, direct) cost per sample, in multiply-adds, of an [S, p] x [S, m] contraction's squared norm.
    Direct: the [p, m] product and its fp32 gradient written and read (8 bytes an entry). Ghost: in the
    Gram kernel, its tile pairs (gram_sq_norms.work: no Gram matrix leaves the chip); in the graph, two
    [S, S] Grams and their fp32 matrices written and read. Symbolic in, symbolic out (the graph form's)."""
    direct = S * p * m + MACS_PER_BYTE * 8 * p * m
    if gram_kernel_takes(S) and isinstance(p, int) and isinstance(m, int):
        return _gram_op.work(S, p, m), direct
    return S * S * (p + m) + MACS_PER_BYTE * 16 * S * S, direct


class NormBuilder:
    def __init__(self, b: GraphBuilder, ctx: DPPassContext):
        self.b = b
        self.ctx = ctx
        self.B = ctx.batch_size
        self._reused: dict | None = None

    @contextlib.contextmanager
    def reusing_factors(self):
        """Within: each contribution's per-sample factors (mm_factors, _emb_parts) built once, for norms that read
        them twice at one insertion point (shared_norms: a use's own norm, then its cross terms)."""
        self._reused = {}
        try:
            yield
        finally:
            self._reused = None

    def _once(self, c: Contribution, build):
        if self._reused is None:
            return build(c)
        key = (build, c.node)
        if key not in self._reused:
            self._reused[key] = build(c)
        return self._reused[key]

    # -- mm: A [p, N] @ G [N, m] with samples on N ------------------------------
    # bmm: A [H, p, N] @ G [H, N, m] (per-head weights): H such products side by side, their factors
    # [B * H, S, p] and [B * H, S, m], each sample's squared norm the sum of its H products' ones
    def mm_factors(self, c: Contribution):
        return self._once(c, self._mm_factors)

    def _mm_factors(self, c: Contribution):
        a, g = c.node.args[0], c.node.args[1]
        if c.kind == "bmm":
            return (sample_major(self.b, a, c.layouts[0], [1], self.B, lead=(0,)),
                    sample_major(self.b, g, c.layouts[1], [2], self.B, lead=(0,)))
        A = sample_major(self.b, a, c.layouts[0], [0], self.B)  # [B, S, p], in a's dtype
        G = sample_major(self.b, g, c.layouts[1], [1], self.B)  # [B, S, m]
        return A, G

    @staticmethod
    def _heads(c: Contribution) -> int:
        """Products per sample: a bmm contribution's batch size H, 1 for an mm."""
        return c.node.args[0].meta["val"].shape[0] if c.kind == "bmm" else 1

    def _per_sample(self, c: Contribution, x: fx.Node) -> fx.Node:
        """[B * H, ...] per (sample, head) -> [B, ...] summed over the heads (a bmm contribution); x for an mm."""
        if c.kind != "bmm":
            return x
        shape = list(x.meta["val"].shape)
        return self.b.call(aten.sum.dim_IntList, self.b.reshape(x, [self.B, self._heads(c)] + shape[1:]), [1])

    def mm_algorithm(self, c: Contribution) -> tuple[str, str]:
        p, N = c.node.args[0].meta["val"].shape[-2:]
        m = c.node.args[1].meta["val"].shape[-1]
        lay = c.layouts[0]
        S = lay.outer * lay.inner
        if known(S == 1):
            return "rank_one", "one row per sample: ||a||^2 ||g||^2"
        choice = self.ctx.options.linear_norm
        ghost, direct = mm_costs(S, p, m)
        try:
            ghost_i, direct_i = int(ghost), int(direct)
        except TypeError:
            ghost_i = direct_i = None
        if choice == "auto":
            if ghost_i is None:
                return "direct", "symbolic shapes: direct form"
            choice = "ghost" if ghost_i <= direct_i else "direct"  # a tie: the form that writes no [p, m] gradient
            why = (f"S={S}, p={p}, m={m}: ghost {ghost_i:.3g} vs direct {direct_i:.3g} multiply-adds per sample, "
                   f"memory traffic counted")
        else:
            why = f"forced by linear_norm={choice!r}"
        return choice, why

    def _blocks(self, per_sample_bytes: Any, n: Any) -> int:
        """How many blocks along a dim of size n keep one block's fp32 intermediate, at the expected batch
        size, within NORM_BLOCK_BYTES (1 when the sizes are symbolic: then nothing is known to split).
        Counted from expected_batch_size, never from this rank's B: every rank builds the same graph."""
        try:
            total, n = int(per_sample_bytes) * int(self.ctx.options.expected_batch_size or 1), int(n)
        except TypeError:
            return 1
        return max(1, min(n, -(-total // NORM_BLOCK_BYTES)))

    def mm_sq(self, c: Contribution) -> tuple[fx.Node, str, str]:
        sq, algo, why = self._mm_sq(c)
        if c.kind == "bmm":
            why += f"; {self._heads(c)} products per sample (a batched matmul's batch dim), their squares summed"
        return self._per_sample(c, sq), algo, why

    def _mm_sq(self, c: Contribution) -> tuple[fx.Node, str, str]:
        """[B * H] squared norms of each sample's products (H = 1 but for a bmm contribution)."""
        b = self.b
        algo, why = self.mm_algorithm(c)
        A, G = self.mm_factors(c)
        if algo == "rank_one":
            sa = b.sq_sum_per_sample(A)
            sg = b.sq_sum_per_sample(G)
            return b.call(aten.mul.Tensor, sa, sg), algo, why
        _, S, p = A.meta["val"].shape
        m = G.meta["val"].shape[2]
        H = self._heads(c)
        if algo == "ghost" and (sq := self.gram_sq(A, G)) is not None:
            return sq, algo, why + GRAM_KERNEL_WHY
        if algo == "ghost":
            # <A A^T, G G^T> over row blocks of the [S, S] Gram matrices
            k = self._blocks(2 * S * S * 4 * H, S)
            parts = []
            for lo, hi in _spans(S, k):
                Ab = A if k == 1 else b.call(aten.slice.Tensor, A, 1, lo, hi)
                Gb = G if k == 1 else b.call(aten.slice.Tensor, G, 1, lo, hi)
                Ga = bmm_f32(b, Ab, _transpose12(b, A))
                Gg = bmm_f32(b, Gb, _transpose12(b, G))
                parts.append(b.sum_per_sample(b.call(aten.mul.Tensor, Ga, Gg)))
        else:
            # ||A^T G||^2 over blocks of the larger feature dim: [B, p, m] never whole when it is large
            k = self._blocks(p * m * 4 * H, max(p, m))
            parts = []
            for lo, hi in _spans(max(p, m), k):
                Ab, Gb = A, G
                if k > 1 and known(p >= m):
                    Ab = b.call(aten.slice.Tensor, A, 2, lo, hi)
                elif k > 1:
                    Gb = b.call(aten.slice.Tensor, G, 2, lo, hi)
                parts.append(b.sq_sum_per_sample(bmm_f32(b, _transpose12(b, Ab), Gb)))  # [B, p or block, m or block]
        if k > 1:
            why += f"; in {k} blocks of at most {NORM_BLOCK_BYTES >> 20} MiB at the expected batch size"
            self.ctx.counters["norm_blocks"] += k
        return _add_all(b, parts), algo, why

    def gram_sq(self, A: fx.Node, G: fx.Node) -> fx.Node | None:
        """[n] = <A_i A_i^T, G_i G_i^T> for A [n, S, p], G [n, S, m] in one kernel (dpcompile.gram_sq_norms: no
        [n, S, S] Gram matrices written, so no blocks); None where S is symbolic (the kernel's tiles are static)
        or the kernel is off (GRAM_KERNEL)."""
        if not gram_kernel_takes(A.meta["val"].shape[1]):
            return None
        self.ctx.counters["gram_norm_kernels"] += 1
        partial = self.b.call(torch.ops.dpcompile.gram_sq_norms.default, A, G)
        return self.b.call(aten.sum.dim_IntList, partial, [1])

    def mm_materialize(self, c: Contribution) -> fx.Node:
        A, G = self.mm_factors(c)
        grads = bmm_f32(self.b, _transpose12(self.b, A), G)  # [B, p, m]; a bmm's [B * H, p, m]
        if c.kind == "bmm":
            _, p, m = grads.meta["val"].shape
            return self.b.reshape(grads, [self.B, self._heads(c), p, m])
        return grads

    # -- conv: a convolution's weight gradient (passes.conv_norms) --------------
    def conv_sq(self, c: Contribution) -> tuple[fx.Node, str, str]:
        b, B = self.b, self.B
        geo = conv_norms.geometry(c)
        by_samples = isinstance(B, int) and conv_norms.samples_outermost(geo)
        # input_gram's Grams do not shrink in blocks of channels: without blocks of samples they must fit whole
        fits = by_samples or (conv_norms.input_gram_sizes(geo) is not None
                              and self._blocks(conv_norms.input_gram_bytes(geo), 2) == 1)
        batch = B if isinstance(B, int) else self.ctx.options.expected_batch_size or 1
        algo, why = conv_norms.choose(geo, self.ctx.options.conv_norm, input_gram_fits=fits, batch=batch)
        grams = self.ctx.counters["gram_norm_kernels"]
        if algo == "direct" and conv_norms.fused(geo):  # no unfold and no [B, *weight] gradients: no blocks
            self.ctx.counters["conv_norm_kernels"] += 1
            if self._keeps_conv_grads(geo):
                sq, grads = conv_norms.fused_sq_and_grads(b, geo)
                self._keep_conv_grads(c, geo, grads, conv_sq_norms.weight_order(geo.weight_shape))
                return sq, algo, why + "; in one kernel that keeps the per-sample gradients for the clipped sum " \
                    "(dpcompile::conv_weight_grads: " + conv_norms.KEEP_WHY + ")"
            return conv_norms.fused_sq(b, geo), algo, why + "; in one kernel (dpcompile::conv_weight_sq_norms)"
        # Blocks keep the unfolded operand and the form's fp32 intermediate ([B, *weight] gradients, or two
        # [B, S, S] Gram matrices; input_gram: its two Grams, no unfold) within the block size. With a static
        # batch size: blocks of samples (contiguous rows of both operands, every intermediate shrinks).
        # Otherwise: blocks of whole groups or of D's channels (conv_norms.block_operands), the Gram rows blocked
        # apart; input_gram's Grams do not shrink so, and choose() takes it there only when they fit whole.
        S = geo.positions()
        unfolded = S * geo.weight_shape[1] * geo.groups * geo.K * geo.d.meta["val"].element_size()
        per_sample = {"direct": unfolded + math.prod(geo.weight_shape) * 4,
                      "ghost": unfolded + (0 if gram_kernel_takes(S) else 2 * S * S * 4 * geo.groups)}
        if algo == "input_gram" and conv_norms.input_gram_sizes(geo) is not None:
            per_sample["input_gram"] = conv_norms.input_gram_bytes(geo)  # it writes no unfold(D)
        unit = "samples" if by_samples else "groups" if geo.groups > 1 else "channels"
        if algo == "direct" and self._keeps_conv_grads(geo) and \
                self._blocks(per_sample["direct"], B if by_samples else conv_norms.block_units(geo)) == 1:
            # the per-sample gradients in one block: kept for the clipped sum
            grads = conv_norms.per_sample_weight_grads(b, geo, B)
            self._keep_conv_grads(c, geo, grads, None)
            return b.sq_sum_per_sample(grads), algo, why + "; keeps the per-sample gradients for the clipped " \
                "sum (" + conv_norms.KEEP_WHY + ")"
        for form in (algo, "direct"):
            if by_samples:
                sq, k = self._conv_sq_by_samples(geo, form, per_sample.get(form, 0))
            elif form == "input_gram":  # its Grams fit whole (choose): one block
                k = 1
                parts = self._conv_sq_parts(geo, B, form, [(None, None)])
                sq = None if parts is None else _add_all(b, parts)
            else:
                units = conv_norms.block_units(geo)
                k = self._blocks(per_sample["direct"] if form == "direct" else unfolded, units)
                parts = self._conv_sq_parts(geo, B, form, [(None, None)] if k == 1 else _spans(units, k))
                sq, k = (None, k) if parts is None else (_add_all(b, parts), len(parts))
            if sq is not None:
                break
            # the Gram forms only: unfold(D) does not line up with E's positions
            algo, why = "direct", "the unfolded operand does not line up with the other one's positions: direct"
        if k > 1:
            why += f"; in {k} blocks of {unit} of at most {NORM_BLOCK_BYTES >> 20} MiB at the expected batch size"
            self.ctx.counters["norm_blocks"] += k
        if self.ctx.counters["gram_norm_kernels"] > grams:
            why += GRAM_KERNEL_WHY
        return sq, algo, why

    def _keeps_conv_grads(self, geo: conv_norms.ConvGeometry) -> bool:
        """bk keeps the direct form's per-sample gradients of this convolution (conv_norms.keeps_grads)."""
        return self.ctx.options.schedule == "bk" and conv_norms.keeps_grads(geo)

    def _keep_conv_grads(self, c: Contribution, geo: conv_norms.ConvGeometry, grads: fx.Node, arrange) -> None:
        """grads [B, ...] as the rows clip_schedule makes c's clipped sum from (arrange: their order, as in
        DPPassContext.sample_rows)."""
        n = math.prod(geo.weight_shape)
        self.ctx.sample_rows[c] = (self.b.reshape(grads, [self.B, n]), 0, [n], arrange)
        self.ctx.counters["conv_grads_kept"] += 1

    def _conv_sq_by_samples(self, geo: conv_norms.ConvGeometry, algo: str, per_sample: int) -> tuple[Any, int]:
        """([B] squared norms, blocks) in blocks of samples of at most the block size (static B); (None, k) when
        the ghost form's unfold(D) does not line up with E's positions."""
        b, B = self.b, self.B
        k = self._blocks(per_sample, B) if B else 1
        blocks = [(geo, B)] if k == 1 else \
            [(conv_norms.sample_block(b, geo, lo, hi), hi - lo) for lo, hi in _spans(B, k)]
        parts = [self._conv_sq_parts(g, n, algo, [(None, None)], rows=1) for g, n in blocks]
        if any(p is None for p in parts):
            return None, k
        sums = [_add_all(b, p) for p in parts]
        return (sums[0] if k == 1 else b.call(aten.cat.default, sums, 0)), k

    def _conv_sq_parts(self, geo: conv_norms.ConvGeometry, B: Any, algo: str, spans: list,
                       rows: int | None = None) -> list[fx.Node] | None:
        """Per-sample squared norms [B] of the blocks of units in spans (block_operands), which add; the ghost
        form also in blocks of Gram rows (rows: how many; None: from the block size). None when the ghost
        form's unfold(D) does not line up with E's positions."""
        b = self.b
        if algo == "direct":
            return [b.sq_sum_per_sample(conv_norms.per_sample_weight_grads(b, geo, B, lo, hi)) for lo, hi in spans]
        if algo == "input_gram":
            parts = []
            for lo, hi in spans:
                e, d, g = conv_norms.block_operands(b, geo, lo, hi)
                sq = conv_norms.input_gram_sq(b, geo, e, d, g, B)  # [B * g]
                if sq is None:
                    return None
                parts.append(b.sum_per_sample(b.view(sq, [B, g])) if g > 1 else sq)
            return parts
        # sum over groups of <E E^T, D D^T>; D D^T adds over D's channel blocks, so a block's part is
        # <E E^T, D_blk D_blk^T> (whole groups: its groups' terms)
        parts = []
        for lo, hi in spans:
            e, d, g = conv_norms.block_operands(b, geo, lo, hi)
            factors = conv_norms.grouped_factors(b, geo, e, d, g, B)  # [B * g, S, channels per group]
            if factors is None:
                return None
            A, G = factors  # one Gram pair per group
            if (sq := self.gram_sq(A, G)) is not None:  # [B * g]
                parts.append(b.sum_per_sample(b.view(sq, [B, g])) if g > 1 else sq)
                continue
            S = A.meta["val"].shape[1]
            k = rows if rows is not None else self._blocks(2 * S * S * 4 * g, S)
            for rlo, rhi in _spans(S, k):
                Ab = A if k == 1 else b.call(aten.slice.Tensor, A, 1, rlo, rhi)
                Gb = G if k == 1 else b.call(aten.slice.Tensor, G, 1, rlo, rhi)
                prod = b.call(aten.mul.Tensor, bmm_f32(b, Ab, _transpose12(b, A)), bmm_f32(b, Gb, _transpose12(b, G)))
                parts.append(b.sum_per_sample(b.view(prod, [B, g * prod.meta["val"].shape[1] * S]) if g > 1 else prod))
        return parts

    def conv_materialize(self, c: Contribution) -> fx.Node:
        return conv_norms.per_sample_weight_grads(self.b, conv_norms.geometry(c), self.B)

    # -- sum over the sample dim ----------------------------------------------
    def _sum_split(self, c: Contribution) -> tuple[fx.Node, list[int], int]:
        """The summed operand in fp32 viewed with its sample dim split as [outer, B, inner], the dims a
        per-sample sum reduces, and the number of dims of that view."""
        node = c.node
        x = node.args[0]
        lay = c.layouts[0]
        shape = list(x.meta["val"].shape)
        n = len(shape)
        if node.target is aten.sum.default:
            dims = list(range(n))
        else:
            dims = node.args[1] if len(node.args) > 1 and node.args[1] else list(range(n))
            dims = [k % n for k in dims]
        d = lay.dim
        split = shape[:d] + [lay.outer, self.B, lay.inner] + shape[d + 1 :]
        xs = self.b.view(self.b.f32(x), split)
        newpos = lambda k: k if k < d else k + 2  # noqa: E731
        return xs, sorted({newpos(k) for k in dims if k != d} | {d, d + 2}), len(split)

    def sum_rows(self, c: Contribution) -> fx.Node | None:
        """The per-sample gradient as [B, n] straight from its reduction (no view or permute after it), or
        None where the reduction leaves other dims than the sample and one feature dim.

        Such a reduction's output can be written into a slice of a wider [B, N] buffer (Inductor realizes a
        reduction into a concatenation without a copy), so the squared norms of all of them take one
        reduction over that buffer instead of one small reduction each (a ViT-S/16 step: 102 parameters,
        biases and LayerNorm weights, and as many launches)."""
        xs, red, ndim = self._sum_split(c)
        kept = [k for k in range(ndim) if k not in red]
        d = c.layouts[0].dim
        if len(kept) != 2 or kept[0] != d + 1:
            return None
        return self.b.call(aten.sum.dim_IntList, xs, red)

    def sum_materialize(self, c: Contribution) -> fx.Node:
        b = self.b
        node = c.node
        d = c.layouts[0].dim
        xs, red, _ = self._sum_split(c)
        split = xs.meta["val"].shape
        s = b.call(aten.sum.dim_IntList, xs, red, True)
        s = b.permute(s, [d + 1] + [k for k in range(len(split)) if k != d + 1])
        out_shape = list(node.meta["val"].shape)
        return b.reshape(s, [self.B] + out_shape)

    # -- embedding backward: rows scattered by token id -------------------------
    def _emb_parts(self, c: Contribution):
        return self._once(c, self._build_emb_parts)

    def _build_emb_parts(self, c: Contribution):
        b = self.b
        idx, values = c.extra["indices"], c.extra["values"]
        lay = c.layouts["values"]
        nidx = idx.meta["val"].dim()
        nval = values.meta["val"].dim()
        v = values
        mask = c.extra.get("mask")
        if mask is not None:
            v = b.call(aten.where.self, mask, v, b.call(aten.scalar_tensor.default, 0.0, dtype=v.meta["val"].dtype))
        pad = c.extra.get("padding_idx")
        if pad is not None and pad >= 0:
            keep = b.call(aten.unsqueeze.default, b.call(aten.ne.Scalar, idx, pad), -1)
            v = b.call(aten.where.self, keep, v, b.call(aten.scalar_tensor.default, 0.0, dtype=v.meta["val"].dtype))
        if isinstance(lay, Permuted):  # rows sorted across the batch: put back in sample order first
            v, _ = in_sample_order(b, v, lay)
            idx, lay = in_sample_order(b, idx, lay)
        V = sample_major(b, v, lay, list(range(nidx, nval)), self.B)  # [B, S, D], in v's dtype
        I = sample_major(b, idx, lay, [], self.B)  # [B, S, 1]
        return V, I

    def emb_sq(self, c: Contribution) -> fx.Node:
        b = self.b
        V, I = self._emb_parts(c)
        Gv = bmm_f32(b, V, _transpose12(b, V))  # [B, S, S]
        eq = b.call(aten.eq.Tensor, I, _transpose12(b, I))  # [B, S, S]
        zero = b.call(aten.scalar_tensor.default, 0.0, dtype=torch.float32)
        return b.sum_per_sample(b.call(aten.where.self, eq, Gv, zero))

    def emb_materialize(self, c: Contribution) -> fx.Node:
        b = self.b
        V, I = self._emb_parts(c)  # [B, S, F]: F the features of a row of the table, flattened
        num, *row = c.node.meta["val"].shape  # a table of any rank: [E, d_out, d_in] experts
        I = b.call(aten.squeeze.dim, I, -1)
        I = ids_in_range(b, I, num)
        S = I.meta["val"].shape[1]
        F = V.meta["val"].shape[2]
        bidx = b.call(aten.expand.default, b.view(b.arange(self.B, I.meta["val"].device), [self.B, 1]), [self.B, S])
        zeros = b.call(aten.full.default, [self.B, num, F], 0.0, dtype=torch.float32, device=V.meta["val"].device)
        out = b.call(aten.index_put.default, zeros, [bidx, I], b.f32(V), True)
        return out if len(row) == 1 else b.reshape(out, [self.B, num, *row])

    # -- dispatch ---------------------------------------------------------------
    def sq(self, c: Contribution) -> tuple[fx.Node, str, str]:
        if c.kind in ("mm", "bmm"):
            return self.mm_sq(c)
        if c.kind == "sum":
            return self.b.sq_sum_per_sample(self.sum_materialize(c)), "materialize", "reduction: per-sample sum"
        if c.kind in ("index_put", "embedding_backward"):
            return self.emb_sq(c), "embedding_ghost", "token equality: sum_{s,t}[id_s = id_t]<g_s, g_t>"
        if c.kind == "conv":
            return self.conv_sq(c)
        if c.kind == "grouped":
            return GroupedNorms(self).sq(c)
        raise AssertionError(c.kind)

    def materialize(self, c: Contribution) -> fx.Node:
        if c.kind in ("mm", "bmm"):
            return self.mm_materialize(c)
        if c.kind == "sum":
            return self.sum_materialize(c)
        if c.kind == "conv":
            return self.conv_materialize(c)
        if c.kind == "grouped":
            return GroupedNorms(self).materialize(c)
        return self.emb_materialize(c)


def _per_sample_of(b: GraphBuilder, nb: "NormBuilder", x: fx.Node, of: fx.Node, ndim: int) -> fx.Node:
    """x [B, *of] with size-1 dims after the sample dim up to ndim + 1 dims: broadcasting a per-sample value
    against sample-free ones then keeps the samples on dim 0."""
    shape = list(of.meta["val"].shape)
    missing = ndim - len(shape)
    return b.reshape(x, [nb.B] + [1] * missing + shape) if missing > 0 else x


def weight_norm_backward(b: GraphBuilder, grad_w: fx.Node, v: fx.Node, g: fx.Node, norms: fx.Node, dim: int,
                         which: int) -> fx.Node:
    """``_weight_norm_interface_backward`` for a gradient of w per sample, grad_w [B, *w]: v's (which 0) or
    g's (which 1) per-sample gradient. With w = g v / n, n = ||v|| over every dim but ``dim`` (the first or
    the last: the fused op takes no other; g and n keep the others as size 1): grad_g = <grad_w, v> / n,
    grad_v = g / n (grad_w - v <grad_w, v> / n^2), the inner products over the same dims, per sample."""
    nd = v.meta["val"].dim()
    over = [d + 1 for d in range(nd) if d != dim % nd]
    dot = b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, grad_w, v), over, True)  # [B, *g]
    if which == 1:
        return b.call(aten.div.Tensor, dot, norms)
    along = b.call(aten.mul.Tensor, v, b.call(aten.div.Tensor, dot, b.call(aten.mul.Tensor, norms, norms)))
    return b.call(aten.mul.Tensor, b.call(aten.sub.Tensor, grad_w, along), b.call(aten.div.Tensor, g, norms))


def _replay(b: GraphBuilder, nb: NormBuilder, node: fx.Node, pg: ParamGrad, memo: dict) -> fx.Node:
    """The per-sample version [B, *shape] of a node on the chain contribution -> gradient."""
    if node in memo:
        return memo[node]
    cmap = {c.node: c for c, _ in pg.terms}
    t = node.target
    if node in cmap:
        r = nb.materialize(cmap[node])
    elif t is operator.getitem and node.args[0] in cmap:  # a tuple-valued contribution (conv's weight gradient)
        r = nb.materialize(cmap[node.args[0]])
    elif t is operator.getitem and node.args[0].target is aten._weight_norm_interface_backward.default:
        wn = node.args[0]
        r = weight_norm_backward(b, _replay(b, nb, wn.args[0], pg, memo), *wn.args[1:5], node.args[1])
    elif t in NORM_PRESERVING:
        x = _replay(b, nb, node.args[0], pg, memo)
        if t in (aten.permute.default,):
            r = b.permute(x, [0] + [k % (x.meta["val"].dim() - 1) + 1 for k in node.args[1]])
        elif t in (aten.transpose.int, aten.t.default):
            n = x.meta["val"].dim() - 1
            d0, d1 = (0, 1) if t is aten.t.default else (node.args[1] % n, node.args[2] % n)
            perm = list(range(n + 1))
            perm[d0 + 1], perm[d1 + 1] = perm[d1 + 1], perm[d0 + 1]
            r = b.permute(x, perm)
        else:  # every other norm-preserving op is a reshape of the same entries, or a cast
            r = b.reshape(x, [nb.B] + list(node.meta["val"].shape))
    elif t in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        a, s = node.args[0], node.args[1]
        on_chain = lambda n: isinstance(n, fx.Node) and n in nb.ctx.tangent_dependent  # noqa: E731
        if not on_chain(a):
            a, s = s, a
        x = _per_sample_of(b, nb, _replay(b, nb, a, pg, memo), a, node.meta["val"].dim())
        r = b.call(t if t in (aten.div.Tensor, aten.div.Scalar) else aten.mul.Tensor, x, s)
    elif t in MATRIX_PRODUCTS:  # a chain value times a sample-free matrix, for each sample: one bmm
        a, w = node.args[0], node.args[1]
        first = a in nb.ctx.tangent_dependent  # the chain value (a gradient) is the left operand
        x = _replay(b, nb, a if first else w, pg, memo)  # [B, (b,) n, k]
        m = w if first else a
        if m.meta["val"].dtype != x.meta["val"].dtype:  # the per-sample values' dtype (norms take fp32 or more)
            m = b.call(torch.ops.prims.convert_element_type.default, m, x.meta["val"].dtype)
        if t is aten.bmm.default:  # [B, b, n, k] as [B * b, n, k]
            lead = m.meta["val"].shape[0]
            x = b.reshape(x, [nb.B * lead] + list(x.meta["val"].shape[2:]))
            m = b.reshape(b.call(aten.expand.default, m, [nb.B] + list(m.meta["val"].shape)),
                          [nb.B * lead] + list(m.meta["val"].shape[1:]))
        else:
            m = b.call(aten.expand.default, m, [nb.B] + list(m.meta["val"].shape))
        r = b.call(aten.bmm.default, x, m) if first else b.call(aten.bmm.default, m, x)
        if t is aten.bmm.default:
            r = b.reshape(r, [nb.B] + list(node.meta["val"].shape))
    elif t in SUMS_AND_BROADCASTS:
        x = _replay(b, nb, node.args[0], pg, memo)
        n = node.args[0].meta["val"].dim()
        if t is aten.expand.default:
            x = _per_sample_of(b, nb, x, node.args[0], len(node.args[1]))
            r = b.call(t, x, [nb.B] + list(node.args[1]))
        else:  # the same sum over the same dims of each sample's gradient
            dims = node.args[1] if len(node.args) > 1 and t in (aten.sum.dim_IntList, aten.mean.dim) else None
            dims = [d % n + 1 for d in dims] if dims else list(range(1, n + 1))
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            r = b.call(aten.sum.dim_IntList if t in (aten.sum.dim_IntList, aten.sum.default) else aten.mean.dim,
                       x, dims, keep, **({"dtype": node.kwargs["dtype"]} if "dtype" in node.kwargs else {}))
    elif t is aten.neg.default:
        r = b.call(aten.neg.default, _replay(b, nb, node.args[0], pg, memo))
    elif t in (aten.add.Tensor, aten.sub.Tensor):
        x = _replay(b, nb, node.args[0], pg, memo)
        y = _replay(b, nb, node.args[1], pg, memo)
        r = b.call(t, x, y, **node.kwargs)
    elif t is aten.slice.Tensor:
        x = _replay(b, nb, node.args[0], pg, memo)
        n = x.meta["val"].dim() - 1
        args = list(node.args)
        args[0] = x
        args[1] = (args[1] if len(args) > 1 else 0) % n + 1
        r = b.call(t, *args)
    elif t is aten.cat.default:  # each block's per-sample gradient, joined along the same dim
        xs = [_replay(b, nb, x, pg, memo) for x in node.args[0]]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        r = b.call(aten.cat.default, xs, dim % node.meta["val"].dim() + 1)
    elif t in (aten.slice_scatter.default, aten.select_scatter.default):  # (dim, start, end) or (dim, index)
        x = _replay(b, nb, node.args[1], pg, memo)
        base = node.args[0].meta["val"]
        zeros = b.call(aten.full.default, [nb.B] + list(base.shape), 0.0, dtype=x.meta["val"].dtype,
                       device=x.meta["val"].device)
        args = list(node.args)
        args[0], args[1] = zeros, x
        args[2] = (args[2] if len(args) > 2 else 0) % base.dim() + 1
        r = b.call(t, *args)
    elif t is aten.where.self:  # each branch on the chain or zero, by a sample-free cond
        nd = node.meta["val"].dim()
        xs = [None if is_zero_constant(v) else _per_sample_of(b, nb, _replay(b, nb, v, pg, memo), v, nd)
              for v in node.args[1:3]]
        dtype = next(x for x in xs if x is not None).meta["val"].dtype
        xs = [b.call(aten.scalar_tensor.default, 0.0, dtype=dtype) if x is None else x for x in xs]
        r = b.call(aten.where.self, node.args[0], *xs)
    elif t in SCATTER_ADD:
        masked = t is aten._unsafe_masked_index_put_accumulate.default
        base, indices = node.args[0], node.args[2] if masked else node.args[1]
        vals = node.args[3] if masked else node.args[2]
        x = _replay(b, nb, vals, pg, memo)  # [B, *vals]
        if masked:
            zero = b.call(aten.scalar_tensor.default, 0.0, dtype=x.meta["val"].dtype)
            x = b.call(aten.where.self, node.args[1], x, zero)
        ni = max(i.meta["val"].dim() for i in indices if i is not None)
        idx = []
        for k, i in enumerate(indices):
            # masked-out rows are zero; keep their ids in range
            idx.append(ids_in_range(b, i, base.meta["val"].shape[k]) if masked and i is not None else i)
        zeros = b.call(aten.full.default, [nb.B] + list(base.meta["val"].shape), 0.0, dtype=x.meta["val"].dtype,
                       device=x.meta["val"].device)
        if all(i is not None for i in indices):  # the sample's own slice by an index over the samples
            bidx = b.view(b.arange(nb.B, x.meta["val"].device), [nb.B] + [1] * ni)
            r = b.call(aten.index_put.default, zeros, [bidx] + idx, x, True)
        else:  # some dims taken whole (x[:, :, i, j]: F.interpolate's backward): the sample dim taken whole too
            at = [k for k, i in enumerate(indices) if i is not None]
            nb.ctx.counters["norm_scatter_dims_whole"] += 1
            if at != list(range(at[0], at[-1] + 1)):  # indexed dims apart: torch puts the indexed dims first
                nd = x.meta["val"].dim()
                x = b.permute(x, list(range(1, ni + 1)) + [0] + list(range(ni + 1, nd)))
                nb.ctx.counters["norm_scatter_indexed_dims_apart"] += 1
            r = b.call(aten.index_put.default, zeros, [None] + idx, x, True)
    else:
        raise AssertionError(f"unexpected chain op {t}")
    memo[node] = r
    return r


def _combine(b: GraphBuilder, terms: list[tuple[fx.Node, float]]) -> fx.Node:
    """sum beta * x over the terms: this rank's gradient from its pre-reduction pieces (ParamGrad.locals)."""
    total = None
    for x, beta in terms:
        if beta != 1.0:
            x = b.call(aten.mul.Tensor, x, beta)
        total = x if total is None else b.call(aten.add.Tensor, total, x)
    return total


def _stack_sum(b: GraphBuilder, sqs: list[fx.Node]) -> fx.Node:
    if len(sqs) == 1:
        return sqs[0]
    return b.call(aten.sum.dim_IntList, b.call(aten.cat.default, [b.call(aten.unsqueeze.default, sq, 0)
                                                                  for sq in sqs]), [0])


NORM_ALL_REDUCE_META = "dpcompile_tp_norm_all_reduce"


def _next_tp_collective(node: fx.Node, group: str) -> fx.Node | None:
    """The first collective over the tp group after ``node`` in the graph, or None."""
    n = node.next
    while n.op != "output":
        if is_tp_collective(n, group):
            return n
        n = n.next
    return None


def _tp_norm_all_reduce(b: GraphBuilder, graph: fx.Graph, shard_sqs: list[fx.Node], partials: list[fx.Node],
                        ctx) -> fx.Node:
    """The one all-reduce over the tp group per step, issued where the last of its operands exists (its wait
    goes where the total is needed): column 0 the [B] squared norms of this rank's shards, then the
    [B, n] per-sample gradients of the parameters whose gradient is a sum over the group (DTensor's
    Partial: the group's sum of a sample's parts is the sample's gradient, and its norm the norm of that
    sum, not a sum of norms)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    last = max(shard_sqs + partials, key=position.__getitem__)
    c10d = torch.ops._c10d_functional
    with graph.inserting_after(last):
        b.meta_source = last
        shards = b.f32(_stack_sum(b, shard_sqs)) if shard_sqs else None
        if not partials:
            packed = shards  # [B]
        else:
            cols = ([b.call(aten.unsqueeze.default, shards, 1)] if shards is not None else []) + partials
            packed = cols[0] if len(cols) == 1 else b.call(aten.cat.default, cols, 1)
    # NCCL runs a group's collectives one after another: issued before the next activation collective of
    # tensor parallelism, which the rest of the backward waits for, it would delay that one and run while
    # nothing can; issued right after it, it runs under the compute that collective feeds
    with graph.inserting_after(_next_tp_collective(packed, ctx.tp_group) or packed):
        issued = b.call(c10d.all_reduce.default, packed, "sum", ctx.tp_group)
    issued.meta["dp_batch"] = Batched(0)  # one row per sample: not a gradient's reduction
    issued.meta[NORM_ALL_REDUCE_META] = True  # found again in the partitioned backward (CompiledStep's window)
    ctx.counters["tp_norm_all_reduces"] += 1
    width = packed.meta["val"].shape[1] if partials else 1
    ctx.summary["tensor_parallel"] = {
        "group": ctx.tp_group,
        "sharded_params": sorted(n for n, pg in ctx.decompositions.items() if pg.param.tp == "shard"),
        "partial_params": sorted(n for n, pg in ctx.decompositions.items() if pg.param.tp == "partial"),
        "norm_all_reduce": f"{issued.name}: " + (f"[B, {width}] fp32, " if partials else "[B] fp32, ")
                           + (("column 0 " if partials else "") + "the squared norms of this rank's shards, "
                              if shard_sqs else "")
                           + (f"{width - bool(shard_sqs)} columns of partial per-sample gradients "
                              f"(norms taken after the sum), " if partials else "")
                           + "summed over the group",
    }
    b.meta_source = None
    return issued


def _tp_norm_terms(b: GraphBuilder, issued: fx.Node, has_shards: bool, has_partials: bool) -> list[fx.Node]:
    """[B] squared-norm terms out of the all-reduce's result (waited here)."""
    red = b.call(torch.ops._c10d_functional.wait_tensor.default, issued)
    if not has_partials:
        return [red]
    if not has_shards:
        return [b.sq_sum_per_sample(red)]
    return [b.call(aten.select.int, red, 1, 0), b.sq_sum_per_sample(b.call(aten.slice.Tensor, red, 1, 1, None))]


def per_sample_norms_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Adds the [B] vector of per-sample squared norms, c and r = c * M * k."""
    graph = gm.graph

    def count(key: str) -> None:
        ctx.counters[key] += 1

    b = GraphBuilder(graph, counter=count)
    nb = NormBuilder(b, ctx)
    out = graph.find_nodes(op="output")[0]
    position = {n: i for i, n in enumerate(graph.nodes)}
    per_param: list[fx.Node] = []
    tp_shards: list[fx.Node] = []  # tensor parallel: squared norms of this rank's slices, to add over the group
    tp_partials: list[fx.Node] = []  # ... and [B, n] per-sample parts of gradients summed over the group
    report = ctx.summary.setdefault("params", {})
    stacked_rows: list[fx.Node] = []  # [B, n] per-sample gradients whose squares are summed in one reduction
    stacked_of: list[Contribution] = []  # ... the contribution each is the per-sample form of
    rows_bytes = 0
    kernel_partials: list[fx.Node] = []  # [B, parts] partial squared norms of the norm kernels
    for name, pg in ctx.decompositions.items():
        entry = report.setdefault(name, {"shape": list(pg.param.primal.meta["val"].shape)})
        locals_ = pg.local_terms
        anchor = max((n for n, _ in locals_), key=position.__getitem__)  # after every local gradient
        partial = pg.param.tp == "partial"
        if ctx.whole_gradient_mode:
            with graph.inserting_after(anchor):
                b.meta_source = anchor
                # reshape: a gradient may be a transposed view (einsum's weight gradient)
                whole = _combine(b, [(b.reshape(n, [1, -1]), beta) for n, beta in locals_])
                if partial:
                    tp_partials.append(b.f32(whole))
                else:
                    per_param.append(b.sq_sum_per_sample(whole))
            entry["decomposition"] = "batch of one sample: the per-sample gradient is the gradient"
            entry["norm"] = "materialize (whole gradient)" + (", summed over the tp group first" if partial else "")
            ctx.counters["norm_whole_gradient"] += 1
            continue
        if pg.norm_preserving and not partial:
            c, alpha = pg.terms[0]
            anchor = c.node
            with graph.inserting_after(anchor):
                b.meta_source = anchor
                # (a tensor-parallel shard's squared norm is summed over its group first: not stacked)
                local = pg.param.tp != "shard"
                row = nb.sum_rows(c) if c.kind == "sum" and alpha == 1.0 and local else None
                if row is not None and rows_bytes + _row_bytes(row, ctx) <= STACKED_ROWS_MAX_BYTES:
                    rows_bytes += _row_bytes(row, ctx)
                    stacked_rows.append(row)
                    stacked_of.append(c)
                    entry["decomposition"] = f"{c.kind} over sample rows ({c.node.name})"
                    entry["norm"] = "materialize"
                    entry["why"] = STACKED_ROWS_WHY
                    ctx.counters["norm_sum_materialize"] += 1
                    ctx.counters["norm_rows_stacked"] += 1
                    continue
                sq, algo, why = nb.sq(c)
                if alpha != 1.0:
                    sq = b.call(aten.mul.Tensor, sq, alpha * alpha)
                elif local and (partial := _kernel_partials(sq)) is not None:
                    # summed with other kernels' partial sums (below), not in a reduction of its own
                    graph.erase_node(sq)
                    kernel_partials.append(partial)
                    sq = None
            entry["decomposition"] = f"{c.kind} over sample rows ({c.node.name})"
            entry["norm"] = algo
            entry["why"] = why
            ctx.counters[f"norm_{c.kind}_{algo}"] += 1
        elif not partial and (outer := outer_terms(pg, ctx.tangent_dependent)) is not None:
            # matmul and embedding contributions summed (a tied embedding and LM head): their own norms
            # and their inner products, no per-sample gradient
            with graph.inserting_after(anchor):
                b.meta_source = anchor
                sq, why = shared_sq(nb, outer)
            kinds = "+".join(c.kind for c, _, _ in outer)
            entry["decomposition"] = f"{len(outer)} contributions ({kinds}) summed"
            entry["norm"] = "shared_ghost"
            entry["why"] = why
            ctx.counters["norm_shared_ghost"] += 1
        else:
            # the per-sample gradient [B, *shape], materialized; a tensor-parallel partial one is this rank's
            # part of each sample's gradient, summed over the group (in the norm all-reduce) before its norm
            with graph.inserting_after(anchor):
                b.meta_source = anchor
                memo: dict = {}
                full = _combine(b, [(_replay(b, nb, n, pg, memo), beta) for n, beta in locals_])
                if partial:
                    # this rank's whole pre-reduction gradient (under fully_shard: more than its dp shard)
                    numel = math.prod(full.meta["val"].shape[1:])
                    tp_partials.append(b.f32(b.reshape(full, [ctx.batch_size, numel])))
                else:
                    sq = b.sq_sum_per_sample(full)
            kinds = "+".join(c.kind for c, _ in pg.terms)
            if partial:
                entry["decomposition"] = (f"{len(pg.terms)} contribution(s) ({kinds}), this rank's part of a "
                                          f"sum over the tensor-parallel group (Partial)")
                entry["norm"] = "materialize, summed over the tp group"
                entry["why"] = "the norm of a sum over ranks is not the sum of their norms"
                ctx.counters["norm_tp_partial"] += 1
                continue
            entry["decomposition"] = f"{len(pg.terms)} contributions ({kinds}) through a reshaping chain"
            entry["norm"] = "materialize"
            entry["why"] = "shared or reshaped gradient: norm of the per-sample sum, computed exactly"
            ctx.counters["norm_materialized_chain"] += 1
        if sq is not None:
            (tp_shards if pg.param.tp == "shard" else per_param).append(sq)
    if stacked_rows:
        with graph.inserting_before(out):
            b.meta_source = None
            rows = stacked_rows[0] if len(stacked_rows) == 1 else b.call(aten.cat.default, stacked_rows, 1)
            per_param.append(b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, rows, rows), [1]))
        widths = [row.meta["val"].shape[1] for row in stacked_rows]
        for i, c in enumerate(stacked_of):  # the clipped sums read them (clip_schedule)
            ctx.sample_rows[c] = (rows, i, widths, None)
    with graph.inserting_before(out):
        b.meta_source = None
        for lo in range(0, len(kernel_partials), PARTIALS_PER_SUM):
            chunk = kernel_partials[lo:lo + PARTIALS_PER_SUM]
            cat = chunk[0] if len(chunk) == 1 else b.call(aten.cat.default, chunk, 1)
            per_param.append(b.call(aten.sum.dim_IntList, cat, [1]))
    tp_issued = _tp_norm_all_reduce(b, graph, tp_shards, tp_partials, ctx) if tp_shards or tp_partials else None
    if not per_param and tp_issued is None:
        return gm
    with graph.inserting_before(out):
        b.meta_source = None
        # One reduction over the stacked [P, B] squared norms, not a chain of adds: Inductor inlines a
        # chain of pointwise adds into one node that reads every norm, and on CUDA it fused that node
        # with one (early) norm reduction; the fused node then depended on every norm, so the scheduler
        # ran the whole input-gradient chain before any norm contraction and every layer's norm operands
        # stayed alive (ghost, GPT-2-small bf16 on an H100: +1.5 GiB; BENCHMARKS.md "What holds ghost's
        # extra memory"). A sum over the stacked dim is a reduction of another shape: it fuses with none.
        if tp_issued is not None:
            per_param += _tp_norm_terms(b, tp_issued, bool(tp_shards), bool(tp_partials))
        total = _stack_sum(b, per_param)
        loss = ctx.loss
        t = b.f32(loss.tangent)
        at = b.call(aten.abs.default, t)
        # ||g_i|| = M * ||graph contribution_i|| / |t|; t = 0 means no gradient at all.
        inv = b.call(aten.where.self, b.call(aten.gt.Scalar, at, 0.0),
                     b.call(aten.reciprocal.default, at), b.call(aten.scalar_tensor.default, 0.0, dtype=torch.float32))
        norms = b.call(aten.mul.Tensor, b.call(aten.mul.Tensor, b.call(aten.sqrt.default, total), inv), loss.M)
        denom = b.call(aten.add.Tensor, norms, ctx.options.norm_eps)
        coef = b.call(aten.clamp_max.default,
                      b.call(aten.mul.Tensor, b.call(aten.reciprocal.default, denom), ctx.options.max_grad_norm), 1.0)
        # a sample whose gradient is not finite (bad data, overflow) is dropped: coefficient 0, and the
        # contractions zero its rows (clip_schedule), since 0 * inf would still be NaN
        keep = b.call(aten.lt.Scalar, norms, float("inf"))  # norms >= 0: False for inf and NaN
        coef = b.call(aten.where.self, keep, coef, b.call(aten.scalar_tensor.default, 0.0, dtype=torch.float32))
        r = b.call(aten.mul.Tensor, b.call(aten.mul.Tensor, coef, loss.M), loss.k)  # M may be symbolic
        # r and keep stored once ([B] each): Inductor inlines their ~15 ops (sqrt, eps, reciprocal, clamp,
        # the finiteness test) into each of the hundreds of kernels that scale or mask by them otherwise,
        # and generating those kernels is most of the DP backward's compile time (H100, GPT-2-small bf16
        # 32x256 bk, cold caches: compile + first step 64.9-74.3 s -> 58.4-61.6 s; step time the same)
        r, keep = b.stored(r), b.stored(keep)
    ctx.per_sample_norms = norms
    ctx.clip_coef = coef
    ctx.keep_rows = keep
    ctx.summary["nonfinite_samples"] = ("dropped: a sample whose gradient norm is inf or NaN gets clip coefficient 0 "
                                        "and zero rows in every contraction; DPBackend.dropped_samples() counts them")
    if ctx.dropped_grad_index is not None:
        # how many samples were dropped: the gradient of the backend's counter input, which autograd
        # accumulates into counter.grad (DPBackend.dropped_samples reads it)
        with graph.inserting_before(out):
            dropped = b.call(aten.sum.default, b.call(torch.ops.prims.convert_element_type.default,
                                                      b.call(aten.logical_not.default, keep), torch.float32))
        outs = list(out.args[0])
        outs[ctx.dropped_grad_index] = dropped
        out.args = (tuple(outs),) + tuple(out.args[1:])
        ctx.counters["dropped_sample_counters"] += 1
    ctx.scale_rows = r
    ctx.counters["clip_coefficients"] += 1
    return gm
