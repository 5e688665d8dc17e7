"""nn.EmbeddingBag over 2-D input as an embedding and a reduction, before AOTAutograd traces the step.

``F.embedding_bag`` lowers to ``aten._embedding_bag``, which the batch-dim analysis has no rule for. With
2-D input (one bag per row: a sample's bag, as DP recommendation and text-classification models feed it)
and no ``max_norm``, it is the embedding of the bag's indices reduced over the bag: a sum (weighted by
``per_sample_weights`` where given), a mean over the bag's entries that are not ``padding_idx``, or their
max; entries equal to ``padding_idx`` count for nothing and an empty bag gives zeros, as in
``F.embedding_bag``. Written so on dynamo's graph of a DP step, the bag's gradient is an embedding's, whose
per-sample norm dpcompile knows. Bags given by ``offsets`` over 1-D input stay as they are: refused at
``_embedding_bag`` (passes/rules/embedding.py says how to pass them as 2-D input). With ``mode="max"``, two
different rows with the same largest value in a bag share its gradient (amax's backward) where
``F.embedding_bag`` gives it to one of them.
"""
from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F

from dpcompile.fx_utils import retarget_calls

COUNTER = "embedding_bag_as_embedding"
_SIGNATURE = inspect.signature(F.embedding_bag)


def embedding_bag_by_embedding(input, weight, offsets=None, max_norm=None, norm_type=2.0,
                               scale_grad_by_freq=False, mode="mean", sparse=False, per_sample_weights=None,
                               include_last_offset=False, padding_idx=None):
    """F.embedding_bag's value for 2-D input and no max_norm (embedding_bags_as_embeddings checks both)."""
    e = F.embedding(input, weight, padding_idx, None, norm_type, scale_grad_by_freq, sparse)  # [B, L, D]
    keep = torch.ones_like(input, dtype=torch.bool) if padding_idx is None else input != padding_idx % weight.shape[0]
    if mode == "max":
        m = e.masked_fill(~keep.unsqueeze(-1), float("-inf")).amax(1)
        return torch.where(keep.any(1, keepdim=True), m, torch.zeros((), dtype=m.dtype, device=m.device))
    if per_sample_weights is not None:
        e = e * per_sample_weights.unsqueeze(-1).to(e.dtype)
    e = e * keep.unsqueeze(-1).to(e.dtype)
    s = e.sum(1)
    if mode == "sum":
        return s
    return s / keep.sum(1, keepdim=True).clamp(min=1).to(s.dtype)


def _example(a):
    return a.meta.get("example_value") if isinstance(a, fx.Node) else a


def _rewritable(node: fx.Node) -> bool:
    """2-D input, no offsets, no max_norm, and per_sample_weights only where summed; any other call is left to
    F.embedding_bag: refused by the analysis, or its own error (weights not summed)."""
    try:
        args = _SIGNATURE.bind(*node.args, **node.kwargs).arguments
    except TypeError:
        return False
    x = _example(args["input"])
    mode = args.get("mode", "mean")
    return isinstance(x, torch.Tensor) and x.dim() == 2 and args.get("offsets") is None and \
        args.get("max_norm") is None and mode in ("sum", "mean", "max") and \
        (mode == "sum" or args.get("per_sample_weights") is None)


def embedding_bags_as_embeddings(gm: fx.GraphModule) -> int:
    """Rewrites every F.embedding_bag call of dynamo's graph that has 2-D input and no max_norm; returns how
    many."""
    return retarget_calls(gm, F.embedding_bag, embedding_bag_by_embedding, where=_rewritable)
