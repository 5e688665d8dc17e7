"""Convolutions (1-D, 2-D, 3-D, transposed, grouped): samples pass through dim 0; the weight gradient of the
backward is a per-sample contribution.

A convolution mixes channels and positions of one row of dim 0 and nothing across rows, so a sample dim on
dim 0 (any ``outer``/``inner``: [B*T, C, L] frames of an audio clip are fine) passes through. The backward
arrives split (``passes.conv_backward_split``): its weight gradient, sum over rows of
conv_weight_grad(grad_out[n], input[n]), is a ``conv`` contribution (per-sample norms in
``passes.per_sample_norms``, row-scaled grad_out for the clipped sum), its input gradient keeps the layout.

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import Any

import torch

from dpcompile.fx_utils import known

from ..batch_state import FREE, SINGLE, Batched, Contribution, Reduced, fail_layout

aten = torch.ops.aten


def _rows_layout(an, node, operands) -> Batched | None:
    """The one sample layout of the per-sample operands, which must hold their samples on dim 0."""
    lay = None
    for name, x in operands:
        s = an.st(x)
        if not isinstance(s, Batched):
            continue
        if s.dim is None:
            return SINGLE
        if s.dim != 0:
            return fail_layout(an, node, f"convolves with the samples of its {name} on dim {s.dim}, where the "
                                         f"convolution mixes channels or positions (only dim 0 keeps them apart)")
        if lay is not None and not (known(lay.outer == s.outer) and known(lay.inner == s.inner)):
            return fail_layout(an, node, "combines an output gradient and an input whose rows belong to "
                                         "different samples")
        lay = s
    return lay


def _sample_free_weight(an, node, weight, bias=None) -> None:
    for what, x in (("weight", weight), ("bias", bias)):
        if x is not None and an.st(x) is not FREE:
            raise an.refuse(node, f"convolves with a per-sample {what} (a weight computed from the samples)",
                            "make the convolution weight a parameter or a sample-free value")


def _convolution(an, node):
    x, weight, bias = node.args[0], node.args[1], node.args[2]
    _sample_free_weight(an, node, weight, bias)
    lay = _rows_layout(an, node, [("input", x)])
    return FREE if lay is None else lay


def _convolution_backward(an, node):
    grad_out, x, weight = node.args[0], node.args[1], node.args[2]
    mask = list(node.args[10])
    # internal: passes.conv_backward_split leaves one gradient per node (one contribution per node)
    assert sum(map(bool, mask)) == 1 and not mask[2], mask
    _sample_free_weight(an, node, weight)
    lay = _rows_layout(an, node, [("output gradient", grad_out), ("input", x)])
    if lay is None:
        return FREE
    if lay.dim is None:
        return (SINGLE, SINGLE, None)
    if mask[0]:
        return (lay, None, None)  # the input gradient: row n from row n's output gradient
    # the weight gradient: a sum over rows of per-row contractions. Both operands' rows are sample rows
    # (one of them may be sample-free data laid out by sample, as in the mm rule)
    if node in an.tdep:
        an.contributions[node] = Contribution(node, "conv", {0: lay, 1: lay}, scaled_operand=0)
    return (None, Reduced(node), None)


RULES: dict[Any, Any] = {aten.convolution: _convolution, aten.convolution_backward: _convolution_backward}
