"""How dynamo compiles the frames of a DP step, in both forms (``torch.compile(step, backend="dp_fsdp")`` and
``private_step``).

Dynamo calls a backend only for the graphs it makes. Where it cannot resume after a graph break (the break
sits where dynamo cannot split the frame: a module call inside an expression, a loop, an unsupported
bytecode), it gives up on the whole frame and runs it as plain Python, calling no backend, and it keeps doing
so at every later call. For a DP step that means ``loss.backward()`` writes unclipped, noiseless gradients
and nothing in dpcompile runs: no graph was compiled, so eager_guard has no parameter to watch. Before this
module, an ``nn.LSTM`` at the top level of a ``torch.compile(step, backend="dp_fsdp")`` step trained without
DP, silently.

So, for every frame dynamo compiles with a dp_fsdp backend:

- dynamo's settings for DP steps (``dp_frame_settings``) hold while it traces the frame: RNN layers traced
  (``allow_rnn``), logging calls skipped instead of breaking the graph, and a hard failure at the recompile
  limit instead of an eager run (``private_step`` used to set these around its calls; the plain form had
  none of them before its first DP graph);
- a frame of the step itself (the function given to torch.compile, or the rest of it that dynamo resumes
  after a graph break) that dynamo gives up on raises ``DPCompileError`` saying where and why, instead of
  running as plain Python. Frames the step merely calls are left to dynamo: when one of them runs as plain
  Python, the step's own frame was split at the call, and the backend refuses the pieces (step_split).
  ``fullgraph=True`` already raises dynamo's own error.
- Python's full garbage collections are held off while dynamo traces and compiles the frame, as the pause_gc
  option says (compile_gc);
- ``torch._dynamo.config.suppress_errors`` (a compile that fails runs the frame as plain Python) is off while
  dynamo compiles a DP step's frames: dpcompile's refusals reach the user instead of an eager, non-private run.
"""
from __future__ import annotations

import contextlib
import linecache
import logging
import os
from typing import Any, Iterator

import torch

from dpcompile import eager_guard
from dpcompile.compat import wrap_method_once
from dpcompile.compile_gc import hold_full_collections
from dpcompile.errors import DPCompileError
from dpcompile.step_split import (_RESUME, GENERIC_ADVICE, PACKED_ADVICE, called_by_torch_compile, describe_break,
                                  frame_callers, packed_sequence_named, resumed_at)

# logging.Logger's methods that only log (warning_once, info_once, warning_advice: added by transformers)
_LOGGING_METHODS = ("debug", "info", "warning", "warn", "warning_once", "info_once", "warning_advice")
_LOOPED_BACKWARD_ADVICE = (
    "a DP step computes one loss and calls its backward once, at its end: for micro-batches, call the step once "
    "per micro-batch, all but the last inside `with dpcompile.accumulate():` (the noise is added once, by the last)"
)
_ENGINE = os.path.join("torch", "autograd", "graph.py")  # autograd's backward, which runs hooks that dynamo sees


def _logging_methods() -> set:
    return {getattr(logging.Logger, n) for n in _LOGGING_METHODS if hasattr(logging.Logger, n)}


@contextlib.contextmanager
def dp_frame_settings() -> Iterator[None]:
    """Dynamo's settings while it traces a frame of a DP step. Set and restored by hand, not by config.patch,
    which builds a class at every call."""
    cfg = torch._dynamo.config
    settings: dict[str, Any] = {"fail_on_recompile_limit_hit": True, "allow_rnn": True,
                                "recompile_limit": max(cfg.recompile_limit, eager_guard.RECOMPILE_LIMIT)}
    # a logging call in model code (transformers' logger.warning_once) is a graph break, which splits the step:
    # inside the step it is skipped instead (torch 2.13's name of the setting; older releases: ignore_logger_methods)
    ignored = "ignore_logging_functions" if hasattr(cfg, "ignore_logging_functions") else "ignore_logger_methods"
    settings[ignored] = getattr(cfg, ignored) | _logging_methods()
    prior = {k: getattr(cfg, k) for k in settings}
    for k, v in settings.items():
        setattr(cfg, k, v)
    try:
        yield
    finally:
        for k, v in prior.items():
            setattr(cfg, k, v)


def compile_dp_frames_strictly() -> None:
    """Wraps dynamo's per-frame compile (ConvertFrameAssert.__call__, which ConvertFrame calls and whose soft
    failures it turns into an eager run of the frame), once per process."""
    from torch._dynamo import convert_frame
    from torch._dynamo.exc import TorchRuntimeError, Unsupported, UserError

    def wrap(original):
        def __call__(self, frame, *args, **kwargs):
            backend = _dp_backend(self)
            if backend is None:
                return original(self, frame, *args, **kwargs)
            _skip_this_wrapper(kwargs)
            # dynamo's trace of the frame, as well as the backend's compile, makes millions of objects
            with dp_frame_settings(), hold_full_collections(backend.config.pause_gc):
                try:
                    return original(self, frame, *args, **kwargs)
                except (Unsupported, UserError) as e:
                    # (a frame called without grad mode, an evaluation, writes no gradient to protect)
                    if getattr(self, "_one_graph", False) or not torch.is_grad_enabled() or \
                            not _is_the_steps_frame(frame.f_code):
                        raise
                    raise DPCompileError(_gave_up_text(frame.f_code, e)) from e
                except TorchRuntimeError as e:
                    packed = packed_sequence_named(str(e))
                    if packed is None:
                        raise
                    # torch 2.11 traces into the packing where 2.13 skips it, then fails on a fake tensor
                    raise DPCompileError(f"dp_fsdp: dynamo failed to trace torch.nn.utils.rnn's {packed} (a "
                                         f"PackedSequence): {str(e).strip().splitlines()[0]}.\n  What to do: "
                                         f"{PACKED_ADVICE}.") from e
        return __call__

    wrap_method_once(convert_frame.ConvertFrameAssert, "__call__", wrap)

    def wrap_outer(original):
        def __call__(self, frame, *args, **kwargs):
            cfg = torch._dynamo.config
            if not cfg.suppress_errors or _dp_backend(self) is None:
                return original(self, frame, *args, **kwargs)
            _skip_this_wrapper(kwargs)
            # torch._dynamo.config.suppress_errors runs a frame whose compile failed as plain Python: for a DP
            # step, a refusal (BatchNorm, a split step) would then train without DP. Off for DP frames
            cfg.suppress_errors = False
            try:
                return original(self, frame, *args, **kwargs)
            finally:
                cfg.suppress_errors = True
        return __call__

    wrap_method_once(convert_frame.ConvertFrame, "__call__", wrap_outer)


def _dp_backend(convert: Any) -> Any:
    """The dp_fsdp backend dynamo's frame converter (ConvertFrame, ConvertFrameAssert) compiles for, or None."""
    from dpcompile.backend import backend_of

    return backend_of(getattr(convert, "_torchdynamo_orig_backend", None))


def _skip_this_wrapper(kwargs: dict) -> None:
    """Dynamo's ``skip``: the frames it leaves out of the stacks it records, one more for the wrapper."""
    if "skip" in kwargs:
        kwargs["skip"] += 1


def _is_the_steps_frame(code: Any) -> bool:
    """Whether the frame about to run ``code`` is the compiled step itself or the rest of it after a graph
    break, before its backward. Dynamo calls this before the frame runs, so the Python stack above here ends at
    its caller: torch.compile's wrapper for the step, or, for a rest (``torch_dynamo_resume_in_<fn>_at_<line>``),
    the step's frame through the rests resumed before it. A rest resumed after a ``.backward(`` (its line, or an
    earlier rest's) runs once the DP backward has made the gradients: what it does as plain Python (an optimizer
    step, logging) was never part of the DP graph. Frames run by autograd's backward are never the step's."""
    callers = frame_callers()
    if any(c.co_filename.endswith(_ENGINE) for c in callers):
        return False
    rests = [code] if code.co_name.startswith(_RESUME) else []
    i = 0
    if rests:
        while i < len(callers) and callers[i].co_name.startswith(_RESUME):
            rests.append(callers[i])
            i += 1
        i += 1  # the step's own frame, which called the first rest
    if any(_resumed_after_backward(c) for c in rests):
        return False
    return called_by_torch_compile(callers[i:])


def _resumed_after_backward(code: Any) -> bool:
    """A rest whose graph break was at a line that calls ``.backward(`` (its source line, as dynamo names it)."""
    line = resumed_at(code)[1]
    return line.isdigit() and ".backward(" in linecache.getline(code.co_filename, int(line))


def _gave_up_text(code: Any, exc: BaseException) -> str:
    brk = describe_break(str(exc), exc)
    name = code.co_name
    if name.startswith(_RESUME):
        fn, line = resumed_at(code)
        name = f"the rest of {fn} after its graph break at line {line}"
    advice = brk.advice or GENERIC_ADVICE
    if ".backward(" in brk.where:  # a backward per micro-batch in a loop
        advice = _LOOPED_BACKWARD_ADVICE
    return (f"dp_fsdp: dynamo gave up on {name} ({code.co_filename}:{code.co_firstlineno}), a frame of the DP step, "
            f"and would run it as plain Python: its gradients would be neither clipped nor noised. Dynamo could "
            f"not resume after the graph break at {brk.where}: {brk.why}.\n  What to do: "
            f"{advice} (dynamo cannot split a frame at a break inside a loop, among "
            f"others, and gives up on all of it).")
