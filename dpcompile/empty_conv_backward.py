"""``aten.convolution_backward`` whose weight gradient keeps its traced layout on an empty batch.

A graph compiled for every batch size (an unbacked one: sharded and Poisson-sampled steps) runs with no samples
on a rank that draws none. The fake kernel of ``convolution_backward`` lays the weight gradient out as the
convolution's input and weight (channels-last where the input is: ConvNeXt's and SegFormer's convolutions read
a LayerNorm's permuted output); the real kernel does too, except on an empty input, where torch's backend for
it returns ``zeros_like(weight)`` in the weight's layout. The weight gradient is not empty (it has the weight's
shape), so Inductor's stride assert on it stopped that rank while the others waited in a collective (the
sharded HF ConvNeXt through Inductor, CPU). This op is the aten kernel, except that on an empty input its weight
gradient (zeros) is laid out as traced: ``weight_format`` 1 channels-last, 2 channels-last-3d, 0 as returned.
``passes.empty_conv_grads`` puts it in place of the aten kernel where the batch is unbacked and the traced
weight gradient is not contiguous; its fake kernel is aten's.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
FORMATS = (None, torch.channels_last, torch.channels_last_3d)

# torch.library's low-level API (custom_op's Python dispatch costs tens of microseconds a call; a ConvNeXt backward
# calls this once per convolution)
_LIB = torch.library.Library("dpcompile", "FRAGMENT")
_LIB.define("convolution_backward_any_batch(Tensor grad_output, Tensor input, Tensor weight, SymInt[]? bias_sizes, "
            "SymInt[] stride, SymInt[] padding, SymInt[] dilation, bool transposed, SymInt[] output_padding, "
            "SymInt groups, bool[3] output_mask, int weight_format) -> (Tensor?, Tensor?, Tensor?)")


def _grads(args, weight_format: int, empty: bool) -> tuple:
    """aten's three gradients, the weight's laid out as FORMATS[weight_format] where the batch is empty."""
    grads = aten.convolution_backward.default(*args)
    fmt = FORMATS[weight_format]
    if empty and fmt is not None and grads[1] is not None:
        return grads[0], grads[1].contiguous(memory_format=fmt), grads[2]
    return tuple(grads)


def convolution_backward_any_batch(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                                   output_padding, groups, output_mask, weight_format):
    return _grads((grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                   groups, output_mask), weight_format, input.numel() == 0)


_LIB.impl("convolution_backward_any_batch", convolution_backward_any_batch, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::convolution_backward_any_batch", lib=_LIB)
def _(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
      output_mask, weight_format):
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    # a batch known to be empty: the kernel's layout, as above; an unbacked one may be empty or not: as traced
    return _grads((grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                   groups, output_mask), weight_format, statically_known_true(input.numel() == 0))


def weight_format(grad_weight: torch.Tensor) -> int:
    """FORMATS' index of the traced weight gradient's layout: 0 where it is contiguous (or unknown)."""
    if grad_weight.dim() == 4 and not grad_weight.is_contiguous() and \
            grad_weight.is_contiguous(memory_format=torch.channels_last):
        return 1
    if grad_weight.dim() == 5 and not grad_weight.is_contiguous() and \
            grad_weight.is_contiguous(memory_format=torch.channels_last_3d):
        return 2
    return 0
