"""``torch.ops.dpcompile.side_gradients_are_zero(tangent, sides, what)``: ``tangent`` (a copy), once every
tensor of ``sides`` is checked to be all zeros; a non-zero one raises ``DPCompileError`` naming it.

A compiled step's graph has an output for every tensor it leaves behind with a gradient: the loss, and a
tensor the model keeps on a module attribute (a recurrent state, RecurrentGemma's RG-LRU) or writes into a
parameter's ``.data`` in its forward (Gemma3n's AltUp clamps its coefficients). Their incoming gradients are
inputs of the backward. ``loss.backward()`` leaves every output but the loss without a gradient, and autograd
hands the backward zeros for them, so the step's gradient is the loss's; passes.side_gradients compiles the
backward for exactly that (their gradients as zeros) and reads them only here, so that a step which does
backpropagate through such a tensor (``torch.autograd.backward([loss, state], ...)``) fails instead of
getting the loss's gradient alone.

On a CUDA stream being captured into a graph (``cudagraphs=True``), where reading a value back to the host is
not allowed, the check is ``torch._assert_async``: a device-side assert, which stops the process with the
assert's text rather than this error's.
"""
from __future__ import annotations

import torch

from .errors import DPCompileError

_LIB = torch.library.Library("dpcompile", "FRAGMENT")
_LIB.define("side_gradients_are_zero(Tensor tangent, Tensor[] sides, str[] what) -> Tensor")


def side_gradients_are_zero(tangent: torch.Tensor, sides: list[torch.Tensor], what: list[str]) -> torch.Tensor:
    for side, name in zip(sides, what):
        if side.numel() == 0:
            continue
        nonzero = side.ne(0).any()
        if side.is_cuda and torch.cuda.is_current_stream_capturing():
            torch._assert_async(nonzero.logical_not(), f"dpcompile: a gradient reached {name}")
        elif nonzero:
            raise DPCompileError(
                f"dp_fsdp: the backward of this step got a gradient for {name}, an output of the compiled step "
                f"other than its loss (a tensor the step returns, or one the model keeps on a module "
                f"attribute). A DP step backpropagates from its scalar loss alone: its gradient is clipped "
                f"per sample as the loss's. Call .backward() on the loss only, or make that tensor part of the "
                f"loss inside the step.")
    return tangent.clone()


_LIB.impl("side_gradients_are_zero", side_gradients_are_zero, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::side_gradients_are_zero", lib=_LIB)
def _(tangent, sides, what):
    return torch.empty_like(tangent)
