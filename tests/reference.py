"""The test oracle: per-sample gradients by torch.func.vmap(grad(...)), clipped and summed in float64."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch.func import functional_call, grad, vmap


def dp_reference(
    model: torch.nn.Module,
    per_sample_loss: Callable,  # (model_output, *targets) -> [B] per-sample losses
    inputs: tuple,
    targets: tuple,
    *,
    max_grad_norm: float,
    reduction: str = "mean",
    expected_batch_size: int | None = None,
    eps: float = 1e-6,
    forward: Callable | None = None,  # (model, *inputs) -> output; default model(*inputs)
    loop: bool = False,  # per-sample gradients by one plain autograd backward per sample instead of vmap
):
    """Returns (clipped gradient dict in float64, per-sample norms [B]).

    A sample whose gradient is not finite (its norm is inf or NaN) is dropped: it contributes zero."""
    g = per_sample_gradients(model, per_sample_loss, inputs, targets, forward=forward, loop=loop)
    return clip_and_sum(g, max_grad_norm=max_grad_norm, reduction=reduction, expected_batch_size=expected_batch_size,
                        eps=eps)


def per_sample_gradients(model, per_sample_loss, inputs, targets, *, forward=None, loop=False) -> dict:
    """Each trainable parameter's per-sample gradients [B, *shape] in float64 (see dp_reference). A sample's
    gradient does not depend on the others in its batch: several steps' references can share one call."""
    ref = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in ref.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in ref.named_parameters() if not v.requires_grad}
    buffers = {k: v.detach() for k, v in ref.named_buffers()}
    fwd = forward or (lambda m, *xs: m(*xs))

    def to64(t):
        return t.double() if t.is_floating_point() else t

    inputs = tuple(to64(t) for t in inputs)
    targets = tuple(to64(t) for t in targets)

    class _Call(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *xs):
            return fwd(self.m, *xs)

    wrapper = _Call(ref)

    def loss_i(p, xs, ts):
        xs = tuple(x.unsqueeze(0) for x in xs)
        ts = tuple(t.unsqueeze(0) for t in ts)
        full = {**{"m." + k: v for k, v in p.items()}, **{"m." + k: v for k, v in frozen.items()},
                **{"m." + k: v for k, v in buffers.items()}}
        out = functional_call(wrapper, full, xs)
        return per_sample_loss(out, *ts).sum()

    if loop:  # models vmap cannot run (an autograd.Function without setup_context, .item() in the forward)
        def grad_i(i):
            p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
            got = torch.autograd.grad(loss_i(p, tuple(x[i] for x in inputs), tuple(t[i] for t in targets)),
                                      list(p.values()), allow_unused=True)
            return [torch.zeros_like(v) if d is None else d for v, d in zip(p.values(), got)]

        rows = [grad_i(i) for i in range(inputs[0].shape[0])]
        g = {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}
    else:
        try:
            g = vmap(grad(loss_i), in_dims=(None, 0, 0))(params, inputs, targets)
        except RuntimeError as exc:  # ops vmap has no batching rule for (nn.LSTM's fused kernels),
            # activation checkpointing (torch.func cannot take its saved-tensor hooks, torch 2.13; nor its
            # _NoopSaveInputs function, 2.11) and Python branches on tensor values (transformers asks whether
            # an attention mask masks anything), grid_sample's backward under vmap (torch 2.11: "Expected a
            # proper Tensor but got None") and group_norm of a channels-last input under vmap of one sample
            # ("Expected X.is_contiguous(memory_format)", torch 2.11 and 2.13), torch.linalg.solve of a sample's
            # [1, n, n] matrix and a shared [n] vector when the batch has n samples (vmap takes the vector for a
            # matrix: a result of one more dim, which a later op refuses, "Incompatible shapes" or "must have
            # same number of dimensions", torch 2.11 and 2.13): the loop
            if not any(m in str(exc) for m in ("batch", "shape", "saved tensor hooks", "vmap support",
                                               "data-dependent control flow", "proper Tensor but got None",
                                               "is_contiguous(memory_format)", "same number of dimensions")):
                raise
            return per_sample_gradients(model, per_sample_loss, inputs, targets, forward=forward, loop=True)
    return g


def clip_and_sum(g: dict, *, max_grad_norm: float, reduction: str = "mean", expected_batch_size: int | None = None,
                 eps: float = 1e-6):
    """dp_reference's result from per-sample gradients: (clipped gradient dict, per-sample norms [B])."""
    B = next(iter(g.values())).shape[0]
    norms = torch.sqrt(sum(v.reshape(B, -1).pow(2).sum(1) for v in g.values()))
    keep = norms.isfinite()
    c = torch.where(keep, (max_grad_norm / (norms + eps)).clamp(max=1.0), 0.0)
    k = 1.0 / expected_batch_size if reduction == "mean" else 1.0
    clipped = {n: torch.einsum("b,b...->...", c, torch.where(keep.view(-1, *[1] * (v.dim() - 1)), v, 0.0)) * k
               for n, v in g.items()}
    return clipped, norms


def replayed_per_sample_gradients(model, per_sample_loss, inputs, targets, *, seed: int) -> dict:
    """Per-sample gradients [B, *shape] (float64) of a model that draws random numbers in its forward (dropout):
    sample i's gradient is that of its own loss in a forward of the whole batch with torch's generator seeded
    ``seed``, one forward and backward per sample, so that each sample sees the masks a step seeded alike draws
    (vmap, or a forward per sample, would draw others). The model runs in its own dtype: draws depend on it."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    g: dict = {k: [] for k in params}
    B = inputs[0].shape[0]
    for i in range(B):
        torch.manual_seed(seed)
        loss = per_sample_loss(model(*inputs), *targets)[i]
        for k, t in zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)):
            g[k].append(torch.zeros_like(params[k]) if t is None else t)
    return {k: torch.stack(v).double() if v else params[k].new_zeros(0, *params[k].shape).double()
            for k, v in g.items()}
