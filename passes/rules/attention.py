"""Fused attention kernels (SDPA's flash, efficient, cuDNN and CPU forms): per-sample in every batch-like dim.

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import Any

import torch

from dpcompile.fx_utils import known

from ..batch_state import FREE, SINGLE, Batched, Mixed, fail_layout, ndim

aten = torch.ops.aten


def _attention(an, node):
    """Fused SDPA forward/backward: leading dims are batch dims of every tensor."""
    found = None
    for a, s in an.tensor_args(node):
        if not isinstance(s, Batched) or not a.meta["val"].dtype.is_floating_point:
            continue  # integer inputs are RNG state / sequence offsets
        if s.dim is None:
            found = found or SINGLE
            continue
        nd = ndim(a)
        if s.dim >= nd - 2:
            return fail_layout(an, node, "attends across samples (the sample dim is a sequence or feature dim)")
        if found is not None and found.dim is not None and found != s:
            return fail_layout(an, node, "attention inputs with different sample dims")
        found = s
    outs = node.meta["val"]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    res = []
    for o in outs:
        if not isinstance(o, torch.Tensor) or found is None or not o.dtype.is_floating_point:
            res.append(FREE)  # RNG seed / offset / cumulative-length outputs
        elif found.dim is None or (o.dim() > found.dim and known(o.shape[found.dim] == found.outer * an.B * found.inner)):
            res.append(found)
        else:
            # e.g. the gradient of a bias broadcast over the batch, summed
            # inside the fused kernel: not something we can decompose
            res.append(Mixed(node, "an attention output reduced over the samples inside the fused kernel"))
    return tuple(res) if isinstance(node.meta["val"], (tuple, list)) else res[0]


RULES: dict[Any, Any] = {}
for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward",
):
    if hasattr(aten, name):
        RULES[getattr(aten, name)] = _attention
