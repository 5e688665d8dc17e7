"""User-facing errors.

Both classes also derive from dynamo's ShortenTraceback when it exists: dynamo
re-raises those from a backend unchanged, so users catch ``DPCompileError``
(or ``ValueError``) directly instead of a ``BackendCompilerFailed`` wrapper.
"""
from __future__ import annotations

try:  # pragma: no cover - depends on the torch version
    from torch._dynamo.exc import ShortenTraceback as _PassThrough

    _KW = {"first_useful_frame": None}
except Exception:  # pragma: no cover
    _PassThrough = RuntimeError  # type: ignore[misc,assignment]
    _KW = {}


class DPCompileError(_PassThrough):
    """The dp_fsdp backend cannot prove that a gradient decomposes per sample.

    Raised at compile time, before any gradient is produced: dpcompile never
    hands back a gradient it could not clip exactly. The message names the
    aten op, the parameter and the module path involved, and what to change.
    """

    def __init__(self, message: str):
        super().__init__(message, **_KW)


class SamplesMixedError(DPCompileError):
    """A DPCompileError for values of several samples combined where per-sample values are needed (a loss
    normalised across the batch, a sort or cumulative op along the sample dim feeding per-sample data).

    At a static batch of one this may be a dim of size one taken for the sample dim, which is why the
    batch-of-one path tells these refusals from the others (and adds how to name the sample dim)."""


class DPValueError(ValueError, _PassThrough):
    """Bad options or inputs found while compiling (a ValueError)."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        if _KW:
            self.first_useful_frame = None
