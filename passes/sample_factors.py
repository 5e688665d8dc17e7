"""Per-sample operands of a contraction, and their contraction in fp32: the factors every per-sample norm form
(passes.per_sample_norms, passes.conv_norms) builds on."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import GraphBuilder, known

from .batch_state import Batched

aten = torch.ops.aten


def sample_major(b: GraphBuilder, x: fx.Node, lay: Batched, feature_dims: list[int], B: Any,
                 lead: tuple[int, ...] = ()) -> fx.Node:
    """x with samples on ``lay`` -> [B, S, F]: S = the sample's rows, F = features. With ``lead`` dims (a batched
    matmul's batch dim H): [B * H, S, F], sample-major, each (sample, h) its own rows."""
    shape = list(x.meta["val"].shape)
    d = lay.dim
    split = shape[:d] + [lay.outer, B, lay.inner] + shape[d + 1 :]
    xs = b.view(x, split)
    newpos = lambda k: k if k < d else k + 2  # noqa: E731
    feats = [newpos(f) for f in feature_dims]
    leads = [newpos(k) for k in lead]
    rows = [k for k in range(len(split)) if k != d + 1 and k not in feats and k not in leads]
    xs = b.permute(xs, [d + 1] + leads + rows + feats)
    if not known(lay.outer == 1):
        # samples inside the rows (a sequence-first [T, B, d] activation): copied sample-major, as an eager
        # reshape would. Inductor otherwise keeps the reshape a view when it only drops size-one dims, and
        # its batched-matmul lowering, handed an operand whose sample stride is 1 and whose other strides
        # are multiples of an unbacked batch size (a sharded step's), failed on a guard of that size
        xs = b.call(aten.clone.default, xs, memory_format=torch.contiguous_format)
    S = 1
    for k in rows:
        S = S * split[k]
    F = 1
    for k in feats:
        F = F * split[k]
    n = B
    for k in leads:
        n = n * split[k]
    return b.reshape(xs, [n, S, F])


def transpose12(b: GraphBuilder, x: fx.Node) -> fx.Node:
    return b.permute(x, [0, 2, 1])


# Two bf16 (or two fp16) values multiply exactly in fp32, so a contraction of
# low-precision factors with an fp32 result and fp32 accumulation computes
# what the fp32 contraction of the upcast factors does (up to the order of the
# sum), on tensor cores instead of CUDA cores (Llama-1B: 149 ms of fp32 norm
# contractions per step on an H200). aten.bmm.dtype exists on CUDA only.
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def bmm_f32(b: GraphBuilder, x: fx.Node, y: fx.Node) -> fx.Node:
    """[B, n, k] @ [B, k, m] -> fp32 [B, n, m], accumulated in fp32."""
    xv, yv = x.meta["val"], y.meta["val"]
    if (xv.device.type == "cuda" and xv.dtype == yv.dtype and xv.dtype in _LOW_PRECISION
            and "dtype" in aten.bmm.overloads()):
        return b.call(aten.bmm.dtype, x, y, torch.float32)
    return b.call(aten.bmm.default, b.f32(x), b.f32(y))
