"""Collectives on per-sample values: tensor parallelism's all-reduce of activations.

Every rank of the tensor-parallel group holds the same batch, rows in the same
order, so a sum over that group adds, row by row, pieces of one sample's
activation (a RowwiseParallel output, a ColwiseParallel input gradient): the
result stays per-sample with the input's layout. Over any other group (data
parallel ranks hold different samples) a sum would mix samples: refused.
"""
from __future__ import annotations

import torch

_C10D = torch.ops._c10d_functional


def _all_reduce(an, node):
    x, op, group = node.args[0], node.args[1], node.args[2]
    s = an.st(x)
    tp = an.ctx.tp_group
    if tp is None or group != tp:
        raise an.refuse(node, f"an all-reduce over process group {group!r} of per-sample values: its ranks hold "
                              f"different samples, so the sum mixes them",
                        "keep collectives of activations to the tensor-parallel group (parallelize_module)")
    if op != "sum":
        raise an.refuse(node, f"an all-reduce ({op}) over the tensor-parallel group: only sums of the ranks' "
                              f"pieces of a sample are proven per-sample")
    return s


def _wait(an, node):
    return an.st(node.args[0])


RULES = {
    _C10D.all_reduce: _all_reduce,
    _C10D.wait_tensor: _wait,
}
