"""``F.ctc_loss`` in a traced step, as an op with static shapes.

torch's CTC op (``aten._ctc_loss``) keeps a ``[B, T, 2 * max(target_lengths) + 1]`` buffer for its backward, a
size read from the targets' values: fake tensors cannot trace it (it is tagged ``dynamic_output_shape``), and
dynamo splits the step there, with stock ``torch.compile`` too (torch 2.11 and 2.13). dpcompile traces
``aten.ctc_loss`` (its CompositeImplicitAutograd form, only while tracing: the Python dispatcher) as
``dpcompile::ctc_loss``, one loss per sample, then torch's reduction. Its backward,
``dpcompile::ctc_loss_backward``, runs torch's CTC forward and backward again from the saved inputs, so nothing
of a size read from data crosses the graph. A sample's loss and gradient come from that sample's log-probs
(``[T, B, C]``: the samples on dim 1), targets (padded, ``[B, S]``) and lengths; the batch-dim rule
(passes/rules/sequence_losses.py) says so, and refuses targets concatenated into one 1-D tensor, whose samples
are not a dim. Eager runs of ``F.ctc_loss`` do not go through here.
"""
from __future__ import annotations

import torch
from torch._C import DispatchKey

aten = torch.ops.aten

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # torch's Reduction enum as F.ctc_loss passes it


def _batched(log_probs, targets, input_lengths, target_lengths):
    """The inputs as a batch ([T, C] log-probs are one sample's: [T, 1, C]), targets as torch's CTC kernels
    take them (int64, on the log-probs' device)."""
    one = log_probs.dim() == 2
    if one:
        log_probs, targets = log_probs.unsqueeze(1), targets.unsqueeze(0)
        input_lengths, target_lengths = input_lengths.reshape(1), target_lengths.reshape(1)
    return one, log_probs, targets.to(log_probs.device, torch.long), input_lengths, target_lengths


def _forward(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    """(per-sample losses as ctc_loss returns them, torch's saved state for its backward, the batched inputs)."""
    one, lp, tg, il, tl = _batched(log_probs, targets, input_lengths, target_lengths)
    if lp.shape[1] == 0:  # a rank without samples (torch's kernels refuse an empty batch)
        nll = lp.new_zeros(0)
        return nll, (nll, None), (one, lp, tg, il, tl)
    nll, log_alpha = aten._ctc_loss.Tensor(lp, tg, il, tl, blank, zero_infinity)
    losses = torch.where(nll == float("inf"), 0.0, nll) if zero_infinity else nll
    return (losses[0] if one else losses), (nll, log_alpha), (one, lp, tg, il, tl)


@torch.library.custom_op("dpcompile::ctc_loss", mutates_args=())
def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor, blank: int, zero_infinity: bool) -> torch.Tensor:
    """F.ctc_loss(..., reduction="none"): [B] losses for [T, B, C] log-probs, a scalar for [T, C]."""
    return _forward(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)[0]


@ctc_loss.register_fake
def _ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return log_probs.new_empty(log_probs.shape[1:-1])


@torch.library.custom_op("dpcompile::ctc_loss_backward", mutates_args=())
def ctc_loss_backward(grad: torch.Tensor, log_probs: torch.Tensor, targets: torch.Tensor,
                      input_lengths: torch.Tensor, target_lengths: torch.Tensor, blank: int,
                      zero_infinity: bool) -> torch.Tensor:
    """The gradient of ``ctc_loss`` with respect to the log-probs for the incoming gradient ``grad`` (one
    value per sample): torch's CTC forward again, for the state its backward reads, then its backward."""
    _, (nll, log_alpha), (one, lp, tg, il, tl) = _forward(log_probs, targets, input_lengths, target_lengths, blank,
                                                          zero_infinity)
    if log_alpha is None:
        return log_probs.new_zeros(log_probs.shape)
    g = aten._ctc_loss_backward.Tensor(grad.reshape(nll.shape), lp, tg, il, tl, nll, log_alpha, blank, zero_infinity)
    return (g[:, 0] if one else g).contiguous()  # the layout the fake kernel gives


@ctc_loss_backward.register_fake
def _ctc_loss_backward_fake(grad, log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    return log_probs.new_empty(log_probs.shape)  # contiguous, whatever the log-probs' strides


def _setup_context(ctx, inputs, output):
    log_probs, targets, input_lengths, target_lengths, blank, zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths)
    ctx.blank, ctx.zero_infinity = blank, zero_infinity


def _backward(ctx, grad):
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    g = ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, ctx.blank, ctx.zero_infinity)
    return g, None, None, None, None, None


ctc_loss.register_autograd(_backward, setup_context=_setup_context)


def _lengths(lengths, like: torch.Tensor) -> torch.Tensor:
    return lengths if isinstance(lengths, torch.Tensor) else torch.tensor(lengths, dtype=torch.long,
                                                                          device=like.device)


def _traced_ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False):
    """aten.ctc_loss (both overloads) while tracing: dpcompile::ctc_loss, then torch's reduction (a mean divides
    each sample's loss by its target length, at least 1, then takes the mean over the batch)."""
    input_lengths, target_lengths = _lengths(input_lengths, targets), _lengths(target_lengths, targets)
    losses = ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    kind = _REDUCTIONS[int(reduction)]
    if kind == "none":
        return losses
    if kind == "sum":
        return losses.sum()
    return (losses / target_lengths.clamp_min(1).to(losses)).mean()


def trace_ctc_loss_as_one_op() -> None:
    """Installs ``_traced_ctc_loss`` as aten.ctc_loss's tracing form (idempotent)."""
    for op in (aten.ctc_loss.Tensor, aten.ctc_loss.IntList):
        if DispatchKey.CompositeImplicitAutograd not in op.py_kernels:
            op.py_impl(DispatchKey.CompositeImplicitAutograd)(_traced_ctc_loss)
