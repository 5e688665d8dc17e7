"""User-facing errors."""


class DPCompileError(RuntimeError):
    """The dp_fsdp backend cannot prove that a gradient decomposes per sample.

    Raised at compile time, before any gradient is produced: dpcompile never
    hands back a gradient it could not clip exactly.  The message names the
    aten op, the parameter and the module path involved, and what to change.
    """
