"""Sequence losses traced as one op per sample: dpcompile::ctc_loss and its backward (dpcompile/ctc_loss.py).

``F.ctc_loss`` takes log-probs ``[T, B, C]`` (the samples on dim 1), targets padded to ``[B, S]`` and one input
and one target length per sample; ``dpcompile::ctc_loss`` gives one loss per sample (``[B]``) and
``dpcompile::ctc_loss_backward`` the log-probs' gradient (``[T, B, C]``) from one incoming gradient per sample.
Sample i's values come from sample i's log-probs, targets and lengths alone (torch's CTC recursion runs per
sample), so both keep the samples apart when each per-sample input holds them on those dims. Targets
concatenated into one 1-D tensor hold the samples one after another, each as long as its target length: not
a dim, refused with what to do.

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import Any

import torch

import dpcompile.ctc_loss  # noqa: F401  (registers the ops)

from ..batch_state import FREE, SINGLE, Batched, fail_layout, ndim

_CTC = torch.ops.dpcompile


def _samples_on(an, node, layout: list[tuple[Any, int]]):
    """Batched(0) when every per-sample argument holds its samples on the dim ``layout`` gives it (sample-free
    ones pass); SINGLE at a batch of one where a layout is lost; otherwise refused."""
    for arg, dim in layout:
        s = an.st(arg)
        if s is FREE:
            continue
        if not isinstance(s, Batched):
            return fail_layout(an, node, f"{arg} is not per-sample")
        if s.dim is None:
            return SINGLE
        if s.dim != dim or not (s.outer == 1 and s.inner == 1):
            return fail_layout(an, node, f"reads the samples of {arg.name} on dim {s.dim}, where CTC reads dim {dim}")
    return Batched(0)


def _check_targets(an, node, log_probs, targets):
    # whatever the analysis holds of them: declared not per-sample (batch_dim None), they are still the
    # samples' targets, one segment each
    if ndim(log_probs) == 3 and ndim(targets) == 1:
        raise an.refuse(node, "F.ctc_loss's targets are concatenated into one 1-D tensor, where the samples are not "
                              "a dim", "pass the targets padded, one row per sample ([B, S], any value past each "
                              "sample's target length), with target_lengths as they are")


def _ctc_loss(an, node):
    log_probs, targets, input_lengths, target_lengths = node.args[:4]
    _check_targets(an, node, log_probs, targets)
    if ndim(log_probs) != 3:
        return fail_layout(an, node, "CTC over one sample's [T, C] log-probs")
    return _samples_on(an, node, [(log_probs, 1), (targets, 0), (input_lengths, 0), (target_lengths, 0)])


def _ctc_loss_backward(an, node):
    grad, log_probs, targets, input_lengths, target_lengths = node.args[:5]
    _check_targets(an, node, log_probs, targets)
    if ndim(log_probs) != 3:
        return fail_layout(an, node, "CTC over one sample's [T, C] log-probs")
    s = _samples_on(an, node, [(grad, 0), (log_probs, 1), (targets, 0), (input_lengths, 0), (target_lengths, 0)])
    return s.moved(1) if isinstance(s, Batched) and s.dim is not None else s  # the log-probs' layout


RULES: dict[Any, Any] = {
    _CTC.ctc_loss.default: _ctc_loss,
    _CTC.ctc_loss_backward.default: _ctc_loss_backward,
}
