"""Per-sample squared norms and per-sample gradients of convolution weights (``conv`` contributions).

A convolution's weight gradient is a contraction over positions. With E the operand whose channels are the
weight's dim 0 and D the other operand unfolded (its channels times the kernel positions, channel-major):

- convolution: E = the output gradient, D = unfold(input) over the output positions;
- transposed convolution (the input gradient of a convolution): E = the input, D = unfold(output gradient)
  over the input positions, with the same stride, padding and dilation;

and per group, dW[e, d] = sum_p E[e, p] D[d, p]. Three exact forms of a sample's ||dW||^2:

- direct: the per-sample gradient itself, E^T unfold(D) per sample and group, one batched contraction in the
  operands' dtype with fp32 accumulation: [B, *weight], exact. For 1-D and 2-D convolutions the kernel of
  dpcompile.conv_sq_norms does it without writing unfold(D) or the gradients (fused, fused_sq). Cost
  ~ S * |weight| per sample (S = positions of the sample). It takes any batch size, also one unknown at
  compile time or 0. (A transposed convolution whose output_padding reaches past its stride has no unfold
  lined up with E: with a static batch size its gradients come from convolution_backward with the samples
  folded into the groups.)
- ghost: sum over groups of <E E^T, D D^T> over the sample's positions: [B, S, S] Gram matrices, cost
  ~ S^2 (channels of E + channels of D). Cheaper when positions are few and channels many.
- input_gram: the same inner product without unfold(D). unfold(D) unfold(D)^T at positions (p, q) is the
  sum over kernel offsets o of X X^T at (p*stride + o*dilation, q*stride + o*dilation), X = the padded D over
  its own positions: one [B, Sp, Sp] Gram of D's channels (not of its channels times the kernel), whose K
  strided windows add up to the [B, S, S] one. Cost ~ Sp^2 * channels of D + S^2 * channels of E, and no
  unfold written: the cheapest form where positions are few and a 3x3 kernel would multiply D's channels by 9
  (a CIFAR WRN's 8x8 layers, a ResNet's last stage).

The unfold is exact (one gather from the padded operand, or a reshape for non-overlapping patches): no
arithmetic, so no TF32 rounding of a convolution with an identity kernel. The first two unfold D; when unfold(D)
with the form's fp32 intermediate would exceed the norm block size at the expected batch size, both run in
blocks whose squared norms add: of samples with a static batch size (sample_block), else of whole groups or
of D's channels (block_operands).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import os
from typing import Any

import torch
import torch.fx as fx

from dpcompile import conv_sq_norms
from dpcompile.errors import DPCompileError
from dpcompile.fx_utils import GraphBuilder, known

from .batch_state import Batched, Contribution
from .sample_factors import bmm_f32, sample_major, transpose12

aten = torch.ops.aten


@dataclasses.dataclass
class ConvGeometry:
    e: fx.Node  # operand whose channels are the weight's dim 0 (output gradient; input if transposed)
    d: fx.Node  # the other operand, unfolded in the ghost form
    lay: Batched
    weight_shape: list  # [E channels, D channels per group, *kernel]
    stride: list
    padding: list
    dilation: list
    transposed: bool
    output_padding: list
    groups: int

    @property
    def kernel(self) -> list:
        return list(self.weight_shape[2:])

    @property
    def K(self) -> int:
        return math.prod(self.kernel)

    def positions(self) -> Any:
        """Rows of one sample: positions of E (over which the contraction runs) times the rows per sample."""
        return self.lay.outer * self.lay.inner * math.prod(self.e.meta["val"].shape[2:])


def geometry(c: Contribution) -> ConvGeometry:
    n = c.node
    grad_out, x, w = n.args[0], n.args[1], n.args[2]
    stride, padding, dilation, transposed, output_padding, groups = n.args[4:10]
    e, d = (x, grad_out) if transposed else (grad_out, x)
    shape = list(w.meta["val"].shape)
    nd = len(shape) - 2
    return ConvGeometry(e, d, c.layouts[0], shape, per_dim(stride, nd), per_dim(padding, nd), per_dim(dilation, nd),
                        bool(transposed), per_dim(output_padding, nd), groups)


def per_dim(values, nd: int) -> list:
    """A convolution's stride, padding, dilation or output_padding, one value per spatial dim: aten takes one
    value for all of them too (padding="valid" traces as padding [0])."""
    values = list(values)
    return values * nd if len(values) == 1 else values


# Multiply-adds worth one byte of an fp32 intermediate written and read back: a tensor-core rate over the memory
# bandwidth (an H100: ~200 T multiply-adds/s in TF32, ~3.3 TB/s), as an order of magnitude. Both forms read the
# same unfolded operand, so only what differs counts: the direct form's [B, *weight] gradients, the ghost
# form's two [B, S, S] Gram matrices.
MACS_PER_BYTE = 64


# input_gram among auto's choices; off (DPCOMPILE_INPUT_GRAM=0 in the environment): auto picks between ghost and
# direct alone, as before the form existed (benchmarks compare the two; conv_norm="input_gram" still forces it)
INPUT_GRAM = os.environ.get("DPCOMPILE_INPUT_GRAM", "1") != "0"


# The kernel's time over cuDNN's weight gradient of the same layer (the same multiply-adds), summed over a
# WRN-16-4's layers at batch 256 (each distinct shape as often as the network has it), channels-last, one H100
# (benchmarks/conv_norm_kernel.py, 2026-11-26): bf16 0.99 vs 0.77 ms (1.3x), fp32 (TF32) 3.08 vs 1.83 ms. Per
# layer it ranges from 0.9x to 3x (fp32, more at 8x8). Half precision is charged 1.5x, not 1.3x: on an input
# that is not channels-last the kernel's loads are scattered: a ViT-S/16's patch embedding (the NCHW image,
# 16x16 patches, bf16, batch 64, H100) took 0.11 ms in it, about 5x what 1.3x predicts, and 1.3x would have
# taken it from the ghost form (a reshape and two Gram matrices). The other contractions run at library speed.
FUSED_SLOWDOWN = {torch.float32: 1.7}
FUSED_SLOWDOWN_HALF = 1.5


def input_gram_extent(geo: ConvGeometry, d: fx.Node | None = None) -> list | None:
    """Per spatial dim, the extent of the padded D that E's windows reach (stride * (L - 1) + dilation *
    (kernel - 1) + 1, L = E's positions), or None when unfold(D) would not line up with E's positions (a
    transposed convolution whose output_padding reaches past its stride)."""
    S_d = list((geo.d if d is None else d).meta["val"].shape[2:])
    L = list(geo.e.meta["val"].shape[2:])
    if window_positions(S_d, geo.kernel, geo.stride, geo.padding, geo.dilation) != L:
        return None
    return [geo.stride[i] * (L[i] - 1) + geo.dilation[i] * (geo.kernel[i] - 1) + 1 for i in range(len(L))]


def window_positions(S: list, kernel: list, stride: list, padding: list, dilation: list) -> list:
    """The positions a convolution's windows take along each spatial dim of an input of sizes S."""
    return [(S[i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(len(S))]


def input_gram_sizes(geo: ConvGeometry) -> tuple[Any, Any] | None:
    """(Sp, S): rows of one sample's padded-D Gram and of its E Gram (rows per sample times positions)."""
    ext = input_gram_extent(geo)
    if ext is None:
        return None
    rows = geo.lay.outer * geo.lay.inner
    return rows * math.prod(ext), geo.positions()


# input_gram's time, fitted to one H200 (benchmarks/conv_norm_kernel.py, a WRN-16-4's layers at batch 256,
# channels-last, 36th session), in the units of cost(): the direct kernel's multiply-adds as charged there. Its
# time is a fixed part per layer (its five kernels: pad, two Gram matmuls, the windows' sum and the product's
# reduction) plus one part per byte of the padded input's fp32 [Sp, Sp] Gram; the matmuls' multiply-adds, on
# tensor cores, are lost in those. Per dtype of the operands: (units per Gram byte, units per layer). fp32 (TF32):
# 16x16 128->128 0.200 ms against the kernel's 0.293, 8x8 256->256 0.109 against 0.257, 8x8 128->256 stride 2
# 0.184 against 0.138; bf16: 0.18-0.21 ms against the kernel's 0.04-0.09, so never at those sizes.
INPUT_GRAM_COST = {torch.float32: (MACS_PER_BYTE, 5.1e9)}
INPUT_GRAM_COST_HALF = (180, 3.1e10)


def input_gram_cost(geo: ConvGeometry, batch: Any = 1) -> Any:
    """input_gram's time per sample (INPUT_GRAM_COST) at ``batch`` samples a step, None where unfold(D) does not
    line up with E's positions."""
    sizes = input_gram_sizes(geo)
    if sizes is None:
        return None
    Sp, _ = sizes
    dtype = conv_sq_norms.kernel_dtype(geo.e.meta["val"].dtype, geo.d.meta["val"].dtype)
    per_byte, per_layer = INPUT_GRAM_COST.get(dtype, INPUT_GRAM_COST_HALF)
    return per_byte * 4 * geo.groups * Sp * Sp + per_layer / max(1, batch)


def input_gram_bytes(geo: ConvGeometry) -> Any:
    """input_gram's fp32 intermediates per sample: the two Grams (and D padded, in its dtype)."""
    Sp, S = input_gram_sizes(geo)
    return 4 * geo.groups * (Sp * Sp + S * S) + Sp * geo.weight_shape[1] * geo.groups * geo.d.meta["val"].element_size()


def unfold_cost(geo: ConvGeometry) -> Any:
    """unfold(D) written and read back, in multiply-adds: what the ghost form and the unfused direct form pay
    that input_gram and the direct kernel do not."""
    S = geo.positions()
    return MACS_PER_BYTE * 2 * S * geo.weight_shape[1] * geo.groups * geo.K * geo.d.meta["val"].element_size()


def cost(geo: ConvGeometry) -> tuple[Any, Any]:
    """(ghost, direct) time per sample in multiply-adds: the contractions, plus the fp32 intermediate each
    writes and reads back at MACS_PER_BYTE (the direct form in one kernel, fused(), writes none and runs at
    FUSED_SLOWDOWN)."""
    S = geo.positions()
    e_ch = geo.weight_shape[0]
    d_ch = geo.weight_shape[1] * geo.groups * geo.K
    w = math.prod(geo.weight_shape)
    ghost = S * S * (e_ch + d_ch) + MACS_PER_BYTE * 2 * (2 * S * S * 4)
    if fused(geo):
        dtype = conv_sq_norms.kernel_dtype(geo.e.meta["val"].dtype, geo.d.meta["val"].dtype)
        direct = S * w * FUSED_SLOWDOWN.get(dtype, FUSED_SLOWDOWN_HALF)
    else:
        direct = S * w + MACS_PER_BYTE * 2 * (w * 4)
    return ghost, direct


def fused(geo: ConvGeometry) -> bool:
    """The direct form runs as one kernel (dpcompile.conv_sq_norms): a 1-D or 2-D convolution, each sample's
    rows contiguous and their number static, tiles a tensor-core dot fills."""
    return (samples_outermost(geo) and type(geo.lay.inner) is int and
            conv_sq_norms.supported(geo.e.meta["val"].shape, geo.d.meta["val"].shape, geo.weight_shape,
                                    geo.transposed, geo.groups))


KEEP_WHY = "they hold no more than the deferred operands they replace, and no weight-gradient convolution runs again"


def keeps_grads(geo: ConvGeometry) -> bool:
    """Whether bk keeps the direct form's per-sample gradients (the fused kernel's, conv_weight_grads; or the
    batched contraction's) and makes the clipped weight gradient from them: where a sample's fp32 gradient takes
    no more bytes than its output gradient and input, which bk would hold until the clip coefficients exist to
    run the weight-gradient convolution again (a WRN's 32x32 3x3 layers: 576 input columns against 1024
    positions; a depthwise convolution's few weights against its whole map). That convolution reads both over
    every position; the kept gradients are written once and summed once, so they are also the faster form. Not
    for fp64 operands: the direct form accumulates in fp32, the convolution it replaces in fp64."""
    e, d = geo.e.meta["val"], geo.d.meta["val"]
    outer = 1 if known(geo.lay.outer == 1) else geo.lay.outer  # (an unbacked batch's rows: 1 as a symbol)
    rows = outer * geo.lay.inner  # rows per sample
    if torch.float64 in (e.dtype, d.dtype) or not isinstance(rows, int):
        return False
    held = math.prod(e.shape[1:]) * e.element_size() + math.prod(d.shape[1:]) * d.element_size()  # a row's
    # (a size symbolic beyond the batch: not kept, rather than a guard on it)
    return isinstance(held, int) and math.prod(geo.weight_shape) * 4 <= held * rows


def fused_sq_and_grads(b: GraphBuilder, geo: ConvGeometry) -> tuple[fx.Node, fx.Node]:
    """([B] squared norms, [B, Cout, K * Cin/groups] per-sample gradients in the kernel's column order) from one
    conv_weight_grads launch (keeps_grads(geo))."""
    both = b.call(torch.ops.dpcompile.conv_weight_grads.default, geo.e, geo.d, list(geo.weight_shape),
                  list(geo.stride), list(geo.padding), list(geo.dilation), geo.groups, geo.lay.inner)
    partial, grads = b.call(operator.getitem, both, 0), b.call(operator.getitem, both, 1)
    return b.call(aten.sum.dim_IntList, partial, [1]), grads


def fused_sq(b: GraphBuilder, geo: ConvGeometry) -> fx.Node:
    """[B] squared norms of the per-sample weight gradients from the kernel's partial sums (fused(geo))."""
    partial = b.call(torch.ops.dpcompile.conv_weight_sq_norms.default, geo.e, geo.d, list(geo.weight_shape),
                     list(geo.stride), list(geo.padding), list(geo.dilation), geo.groups, geo.lay.inner)
    return b.call(aten.sum.dim_IntList, partial, [1])


def choose(geo: ConvGeometry, forced: str, input_gram_fits: bool = True, batch: Any = 1) -> tuple[str, str]:
    """(form, why). ghost against direct as before; input_gram where it is cheaper than both with unfold(D)
    charged to the forms that write it. ``input_gram_fits``: its Grams fit the block size at the expected
    batch size, or can be computed in blocks of samples; ``batch``: samples a step (its fixed cost per layer
    is shared by them)."""
    ghost, direct, ig = *cost(geo), input_gram_cost(geo, batch)
    try:
        ghost_i, direct_i = int(ghost), int(direct)
        ig_i = None if ig is None else int(ig)
        unfold_i = int(unfold_cost(geo))
    except TypeError:
        return ("direct", "symbolic shapes: direct form") if forced == "auto" else (forced, f"forced by conv_norm={forced!r}")
    nums = f"S={geo.positions()}, weight {geo.weight_shape}, groups={geo.groups}: ghost ~S^2(Ce+Cd*k)+2 Grams=" \
           f"{ghost_i:.3g} vs direct ~S|w|+|w|={direct_i:.3g} multiply-adds per sample"
    if ig_i is not None:
        nums += f"; input_gram ~Sp^2 Gram bytes+1 layer/B={ig_i:.3g} vs unfold(D) {unfold_i:.3g}"
    if forced != "auto":
        return forced, f"forced by conv_norm={forced!r}; {nums}"
    best = "ghost" if ghost_i < direct_i else "direct"
    with_unfold = min(ghost_i + unfold_i, direct_i + (0 if fused(geo) else unfold_i))
    if INPUT_GRAM and ig_i is not None and input_gram_fits and ig_i < with_unfold:
        return "input_gram", nums
    return best, nums


def samples_outermost(geo: ConvGeometry) -> bool:
    """Each sample's rows are contiguous along dim 0 (the samples the outermost factor of the rows)."""
    return geo.lay.dim == 0 and known(geo.lay.outer == 1)


def sample_block(b: GraphBuilder, geo: ConvGeometry, lo: int, hi: int) -> ConvGeometry:
    """The geometry of samples lo:hi alone (samples_outermost: their rows are contiguous slices of both
    operands)."""
    lay = geo.lay
    rows = [b.call(aten.slice.Tensor, x, 0, lo * lay.inner, hi * lay.inner) for x in (geo.e, geo.d)]
    return dataclasses.replace(geo, e=rows[0], d=rows[1])


def block_units(geo: ConvGeometry) -> int:
    """What the unfolded operand is split along when it is large: whole groups, or the other operand's
    channels (the weight's dim 1) of an ungrouped convolution."""
    return geo.groups if geo.groups > 1 else geo.weight_shape[1]


def block_operands(b: GraphBuilder, geo: ConvGeometry, lo: int | None, hi: int | None) -> tuple[fx.Node, fx.Node, int]:
    """(e, d, groups) of the block of units lo:hi (block_units; None: all). The squared norms of the blocks add:
    a block is whole groups, or a slice of the weight's dim 1 (the gradient's columns, and the unfolded
    operand's channels)."""
    g, e, d = geo.groups, geo.e, geo.d
    if hi is None:
        return e, d, g
    if g > 1:
        e_per, d_per = geo.weight_shape[0] // g, d.meta["val"].shape[1] // g
        e = b.call(aten.slice.Tensor, e, 1, lo * e_per, hi * e_per)
        return e, b.call(aten.slice.Tensor, d, 1, lo * d_per, hi * d_per), hi - lo
    return e, b.call(aten.slice.Tensor, d, 1, lo, hi), 1


# -- operands as [rows of all samples, channels of sample-major] -----------------------------------------
def fold_samples_into_channels(b: GraphBuilder, x: fx.Node, lay: Batched, B: Any) -> fx.Node:
    """[outer*B*inner, C, *S] -> [outer*inner, B*C, *S]: each sample's rows become channels of its own."""
    shape = list(x.meta["val"].shape)
    C, S = shape[1], shape[2:]
    if known(lay.outer == 1) and known(lay.inner == 1):
        return b.reshape(x, [1, B * C] + S)  # a view when x is contiguous
    xs = b.reshape(x, [lay.outer, B, lay.inner, C] + S)
    xs = b.permute(xs, [0, 2, 1, 3] + list(range(4, 4 + len(S))))
    return b.reshape(xs, [lay.outer * lay.inner, B * C] + S)


def per_sample_weight_grads(b: GraphBuilder, geo: ConvGeometry, B: Any, lo: int | None = None,
                            hi: int | None = None) -> fx.Node:
    """Per-sample weight gradients in fp32 of the block of units lo:hi (block_operands; None: all):
    [B, E channels of the block, D channels per group of the block, *kernel]. The contraction E^T unfold(D) per
    sample and group, in the operands' dtype with fp32 accumulation (bmm_f32): for any batch size, also an
    unbacked one or 0. (cuDNN's convolution_backward with the samples folded into the groups took 5.6 ms for
    one 64-channel 3x3 layer of a WRN-16-4 at batch 256 on an H200, in 256 launches of a legacy fp32 kernel.)"""
    e, d, groups = block_operands(b, geo, lo, hi)
    factors = grouped_factors(b, geo, e, d, groups, B)
    if factors is None:  # a transposed convolution whose output_padding reaches past the stride
        if isinstance(B, int):
            return _grads_by_grouped_convolution(b, geo, b.f32(e), b.f32(d), groups, B)
        raise DPCompileError(
            f"dp_fsdp: the per-sample norm of the transposed convolution with weight {geo.weight_shape}, "
            f"output_padding {geo.output_padding}, stride {geo.stride} has no form for a batch size unknown at "
            f"compile time (its unfolded positions differ from the input's); compile the step with a static "
            f"batch size, or use an output_padding below the stride")
    A, G = factors
    dw = bmm_f32(b, transpose12(b, G), A)  # [B * groups, Ce/groups, Cd*K/groups]
    return b.reshape(dw, [B, e.meta["val"].shape[1], d.meta["val"].shape[1] // groups] + geo.kernel)


def _grads_by_grouped_convolution(b, geo, e, d, groups, B):
    """convolution_backward with each sample's channels a group of their own (static B only: Inductor lowers a
    convolution only with a static number of groups)."""
    rows = e.meta["val"].shape[1]
    ef, df = fold_samples_into_channels(b, e, geo.lay, B), fold_samples_into_channels(b, d, geo.lay, B)
    w_shape = [d.meta["val"].shape[1] // groups] + geo.kernel  # this block's weight, less its rows
    w = b.call(aten.empty.memory_format, [B * rows] + w_shape, dtype=torch.float32, device=geo.e.meta["val"].device)
    grad_out, x = (df, ef) if geo.transposed else (ef, df)
    dw = b.call(operator.getitem, b.call(aten.convolution_backward.default, grad_out, x, w, None, geo.stride,
                                         geo.padding, geo.dilation, geo.transposed, geo.output_padding,
                                         groups * B, [False, True, False]), 1)
    return b.view(dw, [B, rows] + w_shape)


def grouped_factors(b: GraphBuilder, geo: ConvGeometry, e: fx.Node, d: fx.Node, groups: int, B: Any):
    """(unfold(d), e) per sample and group as [B * groups, S, channels per group] (the ghost form's Gram
    factors, the unfolded direct form's contraction operands), or None when unfold(d)'s positions are not
    e's (a transposed convolution whose output_padding reaches past the stride)."""
    D = unfold(b, d, geo.kernel, geo.stride, geo.padding, geo.dilation)
    if list(D.meta["val"].shape[2:]) != list(e.meta["val"].shape[2:]):
        return None
    A = sample_major(b, D, geo.lay, [1], B)  # [B, S, Cd * K]
    G = sample_major(b, e, geo.lay, [1], B)  # [B, S, Ce]
    return per_group(b, A, B, groups), per_group(b, G, B, groups)


def per_group(b: GraphBuilder, t: fx.Node, B: Any, groups: int) -> fx.Node:
    """[B, S, C] -> [B * groups, S, C / groups]: each (sample, group) its own rows."""
    if groups == 1:
        return t
    S, C = t.meta["val"].shape[1:]  # no -1 in the shapes: B may be 0
    return b.reshape(b.permute(b.view(t, [B, S, groups, C // groups]), [0, 2, 1, 3]), [B * groups, S, C // groups])


def input_gram_sq(b: GraphBuilder, geo: ConvGeometry, e: fx.Node, d: fx.Node, groups: int, B: Any) -> fx.Node | None:
    """[B * groups] = <E E^T, unfold(D) unfold(D)^T> per sample and group, from the Gram of the padded D over its
    positions (the input_gram form), or None when unfold(D) would not line up with E's positions."""
    ext = input_gram_extent(geo, d)
    if ext is None:
        return None
    S_d = list(d.meta["val"].shape[2:])
    nd = len(S_d)
    pads = []
    for i in reversed(range(nd)):  # before: the padding; after: up to what the windows reach (negative: a crop)
        pads += [geo.padding[i], ext[i] - S_d[i] - geo.padding[i]]
    if any(pads):
        d = b.call(aten.constant_pad_nd.default, d, pads, 0.0)
    X = per_group(b, sample_major(b, d, geo.lay, [1], B), B, groups)  # [B * g, R * prod(ext), Cd / g]
    G = per_group(b, sample_major(b, e, geo.lay, [1], B), B, groups)  # [B * g, R * prod(L), Ce / g]
    R = geo.lay.outer * geo.lay.inner  # rows per sample: each its own image, windows never cross them
    L = list(e.meta["val"].shape[2:])
    XX = b.view(bmm_f32(b, X, transpose12(b, X)), [B * groups, R, *ext, R, *ext])
    total = None
    for offset in itertools.product(*(range(k) for k in geo.kernel)):
        window = XX
        for i in range(nd):  # both sides' dim i: positions o * dilation + l * stride, l < L
            start = offset[i] * geo.dilation[i]
            end = start + geo.stride[i] * (L[i] - 1) + 1
            for dim in (2 + i, 3 + nd + i):
                if (start, end, geo.stride[i]) != (0, ext[i], 1):
                    window = b.call(aten.slice.Tensor, window, dim, start, end, geo.stride[i])
        total = window if total is None else b.call(aten.add.Tensor, total, window)
    S = R * math.prod(L)
    UU = b.reshape(total, [B * groups, S, S])
    GG = bmm_f32(b, G, transpose12(b, G))
    return b.call(aten.sum.dim_IntList, b.call(aten.mul.Tensor, UU, GG), [1, 2])


def unfold(b: GraphBuilder, x: fx.Node, kernel: list, stride: list, padding: list, dilation: list) -> fx.Node:
    """[N, C, *S] -> [N, C * K, *L]: every kernel window's entries as channels (channel-major, kernel
    positions row-major: the weight's [C, *kernel] order), L the positions the convolution produces."""
    shape = list(x.meta["val"].shape)
    N, C, S = shape[0], shape[1], shape[2:]
    nd = len(S)
    L = window_positions(S, kernel, stride, padding, dilation)
    if all(stride[i] == kernel[i] and dilation[i] == 1 and padding[i] == 0 for i in range(nd)):
        # non-overlapping patches (a ViT's patch embedding): a reshape
        for i in range(nd):
            if not known(S[i] == L[i] * kernel[i]):
                x = b.call(aten.slice.Tensor, x, 2 + i, 0, L[i] * kernel[i])
        split = [N, C] + [v for i in range(nd) for v in (L[i], kernel[i])]
        xs = b.reshape(x, split)
        perm = [0, 1] + [3 + 2 * i for i in range(nd)] + [2 + 2 * i for i in range(nd)]
        return b.reshape(b.permute(xs, perm), [N, C * math.prod(kernel)] + L)
    if any(padding):
        pads = []
        for i in reversed(range(nd)):
            pads += [padding[i], padding[i]]
        x = b.call(aten.constant_pad_nd.default, x, pads, 0.0)
    # one gather: x[:, :, idx_1, .., idx_nd] with idx_i[k_i, L_i] = k_i * dilation + L_i * stride, laid out to
    # broadcast to [k_1, .., k_nd, L_1, .., L_nd]; Inductor lowers it (with the padding) as one kernel
    # (slices of every window and their cat took 257 kernels and 2 ms for a WRN-16-4 step on an H200)
    device = x.meta["val"].device
    indices = [None, None]
    for i in range(nd):
        k_i = b.call(aten.mul.Tensor, b.arange(kernel[i], device), dilation[i])
        l_i = b.call(aten.mul.Tensor, b.arange(L[i], device), stride[i])
        idx = b.call(aten.add.Tensor, b.view(k_i, [kernel[i], 1]), b.view(l_i, [1, L[i]]))
        shape_i = [1] * (2 * nd)
        shape_i[i], shape_i[nd + i] = kernel[i], L[i]
        indices.append(b.view(idx, shape_i))
    windows = b.call(aten.index.Tensor, x, indices)  # [N, C, *kernel, *L]
    return b.reshape(windows, [N, C * math.prod(kernel)] + L)

