"""Gradient accumulation: many micro-batches, one logical batch, noise once.

DP-SGD wants logical batches of thousands of samples; memory holds a few
dozen. ``with dpcompile.accumulate():`` around a DP step makes it add its
clipped per-sample sum to ``.grad`` (autograd accumulates, as in any
training loop) with no noise; the first DP step outside the context adds its
own micro-batch's clipped sum and then the noise, once, for the whole logical
batch. The noise std is ``noise_multiplier * max_grad_norm`` times 1 /
``expected_batch_size`` (mean loss), so ``expected_batch_size`` is that of
the logical batch. The DDP ``no_sync()`` habit, for ``torch.compile`` steps
and ``private_step`` alike, one process or sharded (each micro-step
reduce-scatters its clipped sum into the gradient shards as it goes).

Whether a step adds noise is a runtime input of the compiled graph (a 0/1
factor), so the number of micro-batches may change every step without a
recompile. A step inside the context does not advance the noise stream.
"""
from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def accumulating() -> bool:
    """True inside ``accumulate()``: DP steps add no noise."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def accumulate(enabled: bool = True):
    """DP steps run inside add their clipped sum without noise; the next step outside adds the noise.

        for idx, last in sampler.micro_batches(max_size=64):
            with dpcompile.accumulate(enabled=not last):
                step(x[idx], y[idx])
            if last:
                opt.step(); opt.zero_grad()

    ``enabled=False`` makes it a no-op (the last micro-batch of a logical batch).
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"accumulate(enabled=...) takes a bool, got {enabled!r}")
    if not enabled:
        yield
        return
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
