"""F.instance_norm (nn.InstanceNorm1d/2d/3d) in a DP step: computed by group_norm with one group per channel.

torch's instance_norm (C++) views the batch as channels, ``[B, C, ...] -> [1, B*C, ...]``, and runs batch_norm on
the view. With a batch size unknown at compile time (sharded steps, Poisson sampling, ``mark_batch``) that fails
in three ways: batch_norm's check of the batch against 0 breaks dynamo's graph (the step was refused); where the
batch is traced as non-empty (a sharded step), Inductor cannot order the strides of the ``[1, B*C, ...]`` view
(refused at compile time), and with ``compiler="eager"`` batch_norm's backward divides by B*C, which raised on a
rank that drew no samples while the other ranks waited in their collectives.

Statistics per sample and channel are group_norm's with C groups: the same function (biased variance over the
spatial positions, the same eps, a per-channel affine), whose kernels keep the batch as a dim of its own. So in a
DP step's trace:

- without running statistics (``use_input_stats``, no buffers: nn.InstanceNorm's default) instance_norm is
  ``torch.group_norm(x, C, weight, bias, eps)``;
- with running statistics used as they are (eval mode, ``use_input_stats=False``) it is batch_norm's eval-mode
  function written out, ``(x - mean) / sqrt(var + eps) * weight + bias`` per channel;
- a training-mode update of running statistics (``track_running_stats=True``) averages the samples' statistics
  into buffers, which dpcompile refuses (``state_updates``): torch's op stays, and so does that refusal.

Outside DP compiles (eager, other backends) and for tensor subclasses nothing changes.
"""
from __future__ import annotations

import functools

import torch

from dpcompile.batching import in_dp_trace
from dpcompile.compat import wrap_method_once


def instance_norm_per_sample_in_dp_steps() -> None:
    import torch.nn.functional as F

    def wrap(original):
        @functools.wraps(original)
        def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                          momentum=0.1, eps=1e-5):
            if in_dp_trace() and input.dim() >= 3 and \
                    not torch.overrides.has_torch_function_variadic(input, running_mean, running_var, weight, bias):
                if use_input_stats and running_mean is None and running_var is None:
                    F._verify_spatial_size(input.size())  # instance_norm's own check: more than one position
                    # in torch's dtype: its batch_norm keeps the input's; CUDA autocast runs group_norm in fp32
                    return torch.group_norm(input, input.shape[1], weight, bias, eps).to(input.dtype)
                if not use_input_stats and running_mean is not None and running_var is not None:
                    return _normalized_by(input, running_mean, running_var, weight, bias, eps)
            return original(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
        return instance_norm

    wrap_method_once(F, "instance_norm", wrap)


def _normalized_by(x, mean, var, weight, bias, eps):
    """batch_norm in eval mode written out (torch's batch_norm checks the batch size against 0): per channel
    ``(x - mean) / sqrt(var + eps) * weight + bias``, in the input's dtype as torch's."""
    shape = (-1,) + (1,) * (x.dim() - 2)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    out = (x - mean.view(shape)) * scale.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out.to(x.dtype)
