"""Per-sample squared norms and per-sample gradients of convolution weights (``conv`` contributions).

A convolution's weight gradient is a contraction over positions. With E the operand whose channels are the
weight's dim 0 and D the other operand unfolded (its channels times the kernel positions, channel-major):

- convolution: E = the output gradient, D = unfold(input) over the output positions;
- transposed convolution (the input gradient of a convolution): E = the input, D = unfold(output gradient)
  over the input positions, with the same stride, padding and dilation;

and per group, dW[e, d] = sum_p E[e, p] D[d, p]. Two exact forms of a sample's ||dW||^2:

- direct: the per-sample gradient itself, from convolution_backward with the samples folded into the
  groups (rows of all samples side by side as channels, groups * B groups): [B, *weight], exact, computed
  by the same library kernel as the gradient. Cost ~ S * |weight| per sample (S = positions of the sample).
  With a batch size unknown at compile time (Inductor lowers a convolution only with a static number of
  groups, and an empty rank would have none) it is the contraction E^T unfold(D) per sample instead.
- ghost: sum over groups of <E E^T, D D^T> over the sample's positions: [B, S, S] Gram matrices, cost
  ~ S^2 (channels of E + channels of D). Cheaper when positions are few and channels many.

The unfold is exact (slices of the padded operand, or a reshape for non-overlapping patches): no arithmetic,
so no TF32 rounding of a convolution with an identity kernel.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from dpcompile.errors import DPCompileError
from dpcompile.fx_utils import GraphBuilder, known

from .batch_state import Batched, Contribution

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
    return ConvGeometry(e, d, c.layouts[0], list(w.meta["val"].shape), list(stride), list(padding),
                        list(dilation), bool(transposed), list(output_padding), groups)


def cost(geo: ConvGeometry) -> tuple[Any, Any]:
    """(ghost, direct) multiply-adds per sample."""
    S = geo.positions()
    e_ch = geo.weight_shape[0]
    d_ch = geo.weight_shape[1] * geo.groups * geo.K
    ghost = S * S * (e_ch + d_ch)
    direct = S * math.prod(geo.weight_shape)
    return ghost, direct


def choose(geo: ConvGeometry, forced: str) -> tuple[str, str]:
    ghost, direct = cost(geo)
    try:
        ghost_i, direct_i = int(ghost), int(direct)
    except TypeError:
        return ("direct", "symbolic shapes: direct form") if forced == "auto" else (forced, f"forced by conv_norm={forced!r}")
    nums = f"S={geo.positions()}, weight {geo.weight_shape}, groups={geo.groups}: ghost ~S^2(Ce+Cd*k)={ghost_i:.3g} " \
           f"vs direct ~S|w|={direct_i:.3g} per sample"
    if forced != "auto":
        return forced, f"forced by conv_norm={forced!r}; {nums}"
    return ("ghost" if ghost_i < direct_i else "direct"), nums


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


def per_sample_weight_grads(b: GraphBuilder, geo: ConvGeometry, B: Any, lo: int = 0, hi: int | None = None) -> fx.Node:
    """Per-sample weight gradients [B, hi - lo (or its groups' channels), *weight[1:]] in fp32, for weight rows
    lo:hi (whole groups when groups > 1: lo, hi count groups)."""
    g = geo.groups
    e_ch, d_ch = geo.weight_shape[0], geo.d.meta["val"].shape[1]
    e, d = b.f32(geo.e), b.f32(geo.d)
    if hi is not None:
        if g > 1:  # whole groups of both operands
            e = b.call(aten.slice.Tensor, e, 1, lo * (e_ch // g), hi * (e_ch // g))
            d = b.call(aten.slice.Tensor, d, 1, lo * (d_ch // g), hi * (d_ch // g))
        else:
            e = b.call(aten.slice.Tensor, e, 1, lo, hi)
    groups = (hi - lo if hi is not None else g) if g > 1 else 1
    if isinstance(B, int):
        return _grads_by_grouped_convolution(b, geo, e, d, groups, B)
    # an unbacked batch size (one graph for every batch size): Inductor lowers a convolution only with a static
    # number of groups, and a rank's batch may be empty (0 groups); the unfolded contraction takes any B
    return _grads_by_unfolded_contraction(b, geo, e, d, groups, B)


def _grads_by_grouped_convolution(b, geo, e, d, groups, B):
    """convolution_backward with each sample's channels a group of their own: the library's kernel, no unfold."""
    rows = e.meta["val"].shape[1]
    ef, df = fold_samples_into_channels(b, e, geo.lay, B), fold_samples_into_channels(b, d, geo.lay, B)
    w = b.call(aten.empty.memory_format, [B * rows] + list(geo.weight_shape[1:]), dtype=torch.float32,
               device=geo.e.meta["val"].device)
    grad_out, x = (df, ef) if geo.transposed else (ef, df)
    dw = b.call(operator.getitem, b.call(aten.convolution_backward.default, grad_out, x, w, None, geo.stride,
                                         geo.padding, geo.dilation, geo.transposed, geo.output_padding,
                                         groups * B, [False, True, False]), 1)
    return b.view(dw, [B, rows] + list(geo.weight_shape[1:]))


def grouped_factors(b: GraphBuilder, geo: ConvGeometry, e: fx.Node, d: fx.Node, groups: int, B: Any):
    """(unfold(d), e) per sample and group as [B * groups, S, channels per group] (the ghost form's Gram
    factors, the unfolded direct form's contraction operands), or None when unfold(d)'s positions are not
    e's (a transposed convolution whose output_padding reaches past the stride)."""
    from .per_sample_norms import sample_major  # noqa: PLC0415  (per_sample_norms imports this module)

    D = unfold(b, d, geo.kernel, geo.stride, geo.padding, geo.dilation)
    if list(D.meta["val"].shape[2:]) != list(e.meta["val"].shape[2:]):
        return None
    A = sample_major(b, D, geo.lay, [1], B)  # [B, S, Cd * K]
    G = sample_major(b, e, geo.lay, [1], B)  # [B, S, Ce]
    if groups > 1:  # no -1 in the shapes: B may be 0
        S = A.meta["val"].shape[1]
        A, G = (b.reshape(b.permute(b.view(t, [B, S, groups, t.meta["val"].shape[2] // groups]), [0, 2, 1, 3]),
                          [B * groups, S, t.meta["val"].shape[2] // groups]) for t in (A, G))
    return A, G


def _grads_by_unfolded_contraction(b, geo, e, d, groups, B):
    """E^T unfold(D) per sample and group: [B * groups, Ce/groups, S] @ [B * groups, S, Cd*K/groups]."""
    factors = grouped_factors(b, geo, e, d, groups, B)
    if factors is None:
        raise DPCompileError(
            f"dp_fsdp: the per-sample norm of the transposed convolution with weight {geo.weight_shape}, "
            f"output_padding {geo.output_padding}, stride {geo.stride} has no form for a batch size unknown at "
            f"compile time (its unfolded positions differ from the input's); compile the step with a static "
            f"batch size, or use an output_padding below the stride")
    A, G = factors
    dw = b.call(aten.bmm.default, b.permute(G, [0, 2, 1]), A)  # [B * groups, Ce/groups, Cd*K/groups]
    return b.reshape(dw, [B, groups * G.meta["val"].shape[2]] + list(geo.weight_shape[1:]))


def unfold(b: GraphBuilder, x: fx.Node, kernel: list, stride: list, padding: list, dilation: list) -> fx.Node:
    """[N, C, *S] -> [N, C * K, *L]: every kernel window's entries as channels (channel-major, kernel
    positions row-major: the weight's [C, *kernel] order), L the positions the convolution produces."""
    shape = list(x.meta["val"].shape)
    N, C, S = shape[0], shape[1], shape[2:]
    nd = len(S)
    L = [(S[i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(nd)]
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
    windows = []
    for offs in itertools.product(*[range(k) for k in kernel]):
        y = x
        for i in range(nd):
            start = offs[i] * dilation[i]
            y = b.call(aten.slice.Tensor, y, 2 + i, start, start + stride[i] * (L[i] - 1) + 1, stride[i])
        windows.append(b.call(aten.unsqueeze.default, y, 2))
    # cat of unsqueezed windows, not stack: the graph is past Inductor's decompositions, which lower stack
    return b.reshape(b.call(aten.cat.default, windows, 2), [N, C * len(windows)] + L)
