"""Collectives on per-sample values: tensor parallelism's sums and gathers of activations.

Every rank of the tensor-parallel group holds the same batch, rows in the same
order, so a collective over that group moves or adds, row by row, pieces of
one sample's activation: the result stays per-sample.

- ``all_reduce`` (sum): a RowwiseParallel output, a ColwiseParallel input
  gradient; the input's layout.
- ``all_gather_into_tensor``: the group's pieces stacked along dim 0, rank
  outermost (a sequence-parallel activation gathered before a
  ColwiseParallel layer is ``[tp * B, T / tp, D]``, then split and joined
  along the sequence): dim 0's sample layout gains ``tp`` outer blocks.
- ``reduce_scatter_tensor`` (sum): dim 0 cut into ``tp`` blocks, rank r
  keeps the sum of everyone's block r (a RowwiseParallel output scattered
  along the sequence): the blocks must hold whole copies of the batch.

Over any other group (data-parallel ranks hold different samples) these would
mix samples: refused.
"""
from __future__ import annotations

import torch

from dpcompile.fx_utils import known

from ..batch_state import Batched

_C10D = torch.ops._c10d_functional


def _tp_only(an, node, group, what, op="sum"):
    """Refuses a collective over any group but the tp group, and a reduction other than a sum."""
    tp = an.ctx.tp_group
    if tp is None or group != tp:
        raise an.refuse(node, f"{what} over process group {group!r} of per-sample values: its ranks hold "
                              f"different samples, so the result mixes them",
                        "keep collectives of activations to the tensor-parallel group (parallelize_module)")
    if op != "sum":
        raise an.refuse(node, f"{what} ({op}) over the tensor-parallel group: only sums of the ranks' pieces of "
                              f"a sample are proven per-sample")


def _all_reduce(an, node):
    x, op, group = node.args[0], node.args[1], node.args[2]
    _tp_only(an, node, group, "an all-reduce", op)
    return an.st(x)


def _all_gather(an, node):
    x, size, group = node.args[0], node.args[1], node.args[2]
    _tp_only(an, node, group, "an all-gather")
    s = an.st(x)
    if s.dim != 0:
        return s  # pieces stacked along a dim that is not the samples' (or B == 1: all of it is sample 0)
    return Batched(0, s.outer * size, s.inner)


def _reduce_scatter(an, node):
    x, op, size, group = node.args[0], node.args[1], node.args[2], node.args[3]
    _tp_only(an, node, group, "a reduce-scatter", op)
    s = an.st(x)
    if s.dim != 0:
        return s
    if not known(s.outer % size == 0):
        raise an.refuse(node, f"a reduce-scatter over the tensor-parallel group cuts dim 0 (samples laid out as "
                              f"{s.outer} blocks of the batch) into {size} pieces that are not whole blocks, so "
                              f"a rank's piece would hold part of the batch")
    return Batched(0, s.outer // size, s.inner)


def _wait(an, node):
    return an.st(node.args[0])


RULES = {
    _C10D.all_reduce: _all_reduce,
    _C10D.all_gather_into_tensor: _all_gather,
    _C10D.reduce_scatter_tensor: _reduce_scatter,
    _C10D.wait_tensor: _wait,
}
