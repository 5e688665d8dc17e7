"""nn.Bilinear as a matmul with its weight, before AOTAutograd traces the step.

``torch.bilinear(x1, x2, W, b)`` (nn.Bilinear, F.bilinear) lowers to ``aten._trilinear``, a contraction of
three operands that the batch-dim analysis has no rule for, and whose weight gradient is another
``_trilinear``. Written as ``x1 @ W'`` (W' the weight laid out [in1, out * in2]), then a product with ``x2``
summed over in2, it is made of ops the analysis knows: the weight's gradient is a Linear's, its per-sample
norm chosen as for any Linear (rank-one, ghost or direct). Done on dynamo's graph of a DP step, so
AOTAutograd derives the backward from the rewritten ops.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.fx_utils import retarget_calls

COUNTER = "bilinear_as_matmul"


def bilinear_by_matmul(x1: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.bilinear's value: y[..., o] = sum_ij x1[..., i] W[o, i, j] x2[..., j] (+ b[o])."""
    out, in1, in2 = weight.shape
    t = torch.matmul(x1, weight.permute(1, 0, 2).reshape(in1, out * in2))  # [..., out * in2]
    y = (t.unflatten(-1, (out, in2)) * x2.unsqueeze(-2)).sum(-1)
    return y if bias is None else y + bias


def bilinear_as_matmul(gm: fx.GraphModule) -> int:
    """Rewrites every torch.bilinear call of dynamo's graph; returns how many."""
    return retarget_calls(gm, torch.bilinear, bilinear_by_matmul)
