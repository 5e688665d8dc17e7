"""Telling the user that dynamo split the training step, where and why.

A DP step must reach the scalar loss in one graph, from the batch inputs
through every trainable parameter: only then does the joint graph hold each
sample's whole gradient. ``loss.backward()`` always ends the graph (dynamo
graph-breaks there, as it should). Any other graph break before the loss
hands the backend a piece of the step: activations instead of a loss, or a
graph whose inputs already carry gradients. Dynamo records why it compiled a
graph (``gm.compile_subgraph_reason``) and which frame it traced; this turns
that into a message that says where the step was split, why, and what to do.
"""
from __future__ import annotations

import collections
import dataclasses
import linecache
import os
import re
import sys
from typing import Any

import torch
import torch.fx as fx

from dpcompile.batching import traced_frame
from dpcompile.compat import wrap_method_once
from dpcompile.passes.batch_state import HF_LOSS_ADVICE, HF_LOSS_MARKERS

_FSDP2_ADVICE = (
    "the model is wrapped with torch.distributed.fsdp.fully_shard (FSDP2), whose hooks run outside the graph "
    "(dynamo graph-breaks on them); shard it with dpcompile.fully_shard instead, same arguments: "
    "dpcompile.fully_shard(module, mesh=..., reshard_after_forward=..., "
    "mp_policy=dpcompile.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)) on each block, then the root"
)
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_EVAL_FRAME = os.path.join("torch", "_dynamo", "eval_frame.py")  # torch.compile's wrapper calls the function here
_MODULE_CALL = os.path.join("torch", "nn", "modules", "module.py")
_RESUME = "torch_dynamo_resume_in_"  # the code name dynamo gives the rest of a frame after a graph break
GENERIC_ADVICE = (
    "remove the graph break (TORCH_LOGS=graph_breaks lists every break; torch.compile(..., fullgraph=True) "
    "raises at the first), or move the code that breaks out of the step"
)

# Ops whose checks of the batch size against 0 in Python meta code an unbacked batch size (dpcompile.mark_batch,
# Poisson sampling, sharded steps) cannot answer: dynamo breaks the graph there. Matched on the break's stack.
# (Such checks in C++ are answered: dpcompile.cpp_size_questions; an InstanceNorm with running statistics is then
# refused naming the buffer it would write.)
_UNBACKED_BATCH_ADVICE = {
    "reflection_pad": "torch < 2.13's reflection padding checks the batch size against 0, which a batch size "
                      "unknown at compile time (dpcompile.mark_batch, Poisson sampling, sharded steps) cannot "
                      "answer: use torch >= 2.13, or another padding mode",
}
# torch.nn.utils.rnn's packing: dynamo skips these functions on torch 2.13 (stock torch.compile breaks there too);
# torch 2.11 traces them and fails on fake tensors (step_frames)
_PACKED_SEQUENCES = ("pack_padded_sequence", "pad_packed_sequence", "pack_sequence")
PACKED_ADVICE = (
    "dynamo does not trace torch.nn.utils.rnn's packed sequences (PackedSequence); run the recurrent layer on the "
    "padded batch instead (batch_first=True) and take each sample's output at its last valid step, e.g. "
    "out[torch.arange(len(lengths)), lengths - 1], or mask the padded steps"
)


def packed_sequence_named(text: str) -> str | None:
    """The packing function of torch.nn.utils.rnn that ``text`` names (with torch's underscore or without),
    or None."""
    return next((f for f in _PACKED_SEQUENCES if f in text), None)


# A logging call in model code (transformers' logger.warning_once): dynamo breaks the graph there, saying so
# (_LOGGING_MARKER), or the rest of the frame is resumed after the call (its source line: _LOGGING_CALL)
_LOGGING_MARKER = "logging.Logger method"
_LOGGING_CALL = re.compile(r"(?i)log\w*(\([^)]*\))?\.(debug|info|warning|warn|warning_once|info_once)\(")
_LOGGING_ADVICE = (
    "a logging call in the model breaks dynamo's graph (in DP steps dpcompile has dynamo skip logging.Logger's "
    "debug, info and warning calls, transformers' warning_once among them, but not others such as error): "
    "move the call out of the step, or add the method to torch._dynamo.config.ignore_logger_methods before the "
    "first step (e.g. {logging.Logger.error})"
)

# The graph breaks dynamo met last: a frame dynamo gave up on (a break in a loop skips the whole frame) leaves no
# graph to say why, only the graphs of what it called (remember_graph_breaks)
_RECENT_BREAKS: collections.deque[_Break] = collections.deque(maxlen=4)
_BREAK_PREAMBLES = ("Encountered graph break when attempting", "Consider annotating your code using torch._check*(). ")
_RAISED_ADVICE = (
    "dynamo saw the model code raise the exception above while tracing it and ran that code eagerly instead; "
    "code that takes another path under torch.compile (transformers' is_torchdynamo_compiling() branches skip "
    "making a default argument, such as an attention mask of ones) needs it from the caller: pass it to the model"
)
_BRANCH_ON_BATCH_ADVICE = (
    "the model code branches on a size that holds the batch size, which a batch size unknown at compile time "
    "(sharded steps, dpcompile.mark_batch, Poisson sampling) cannot answer: ask about the size you mean instead "
    "(e.g. the sequence length rather than numel()), or move the branch out of the step"
)


@dataclasses.dataclass(frozen=True)
class _Break:
    where: str  # file:line (source) of the user code
    why: str  # the reason's first line
    user_branch: bool  # a bool of a symbolic size asked by the user code itself (if x.numel() > 0:)
    root: tuple[str, str] = ("", "")  # (file, function) of the outermost frame dynamo was tracing
    raised: bool = False  # the code raised an exception while dynamo traced it (and ran eagerly after)

    @property
    def told(self) -> str:
        return f"the last graph break dynamo met was at {self.where}: {self.why}"

    @property
    def advice(self) -> str | None:
        """What to do about this break where it says more than "remove the graph break"."""
        return _BRANCH_ON_BATCH_ADVICE if self.user_branch else _RAISED_ADVICE if self.raised else None


def remember_graph_breaks() -> None:
    """Keep where and why dynamo broke its graphs (its own log of them is off unless TORCH_LOGS asks), for the
    message about a graph that is only part of the step: a break in a loop makes dynamo skip the whole frame,
    and the graphs left (a sharded parameter's get) do not say why."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    def wrap(original):
        def log_graph_break(self, code_options, reason, exc):
            if not getattr(exc, "logged", True) and getattr(exc, "gb_type", "") != "graph break in loop":
                try:
                    _RECENT_BREAKS.append(describe_break(reason, exc))
                except Exception:  # noqa: BLE001 - a message's detail: never in the way of dynamo's own handling
                    pass
            return original(self, code_options, reason, exc)
        return log_graph_break

    wrap_method_once(InstructionTranslatorBase, "log_graph_break", wrap)


def describe_break(reason: str, exc: Any) -> _Break:
    stack = getattr(exc, "real_stack", None) or torch._guards.TracingContext.extract_stack()
    where = "an unknown line"
    if stack:
        f = stack[-1]
        where = f"{f.filename}:{f.lineno}" + (f" ({f.line.strip()})" if f.line else "")
    lines = [ln.strip().removeprefix(_BREAK_PREAMBLES[1]) for ln in (reason or "").splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(_BREAK_PREAMBLES[0])]
    # a line that introduces the break ("... Graph break encountered:") is read with the one after it, and the
    # exception dynamo saw ("Developer debug context: raised exception TypeError(...)") is part of the why
    why = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else
                                                                                  "no reason given")
    # "Attempted to call function marked as skipped" names the function only in its explanation
    explained = next((ln for ln in lines[1:] if ln.startswith("Explanation:")), "")
    if "marked as skipped" in why and explained:
        why += f" ({explained.removeprefix('Explanation: ')})"
    debug = next((ln for ln in lines if ln.startswith("Developer debug context: raised exception")), "")
    if debug:
        why += f" ({debug.removeprefix('Developer debug context: ')})"
    # dynamo's "Caused by:" line names where the guard was asked: its own evaluate_expr for a bool in user code
    caused = next((ln for ln in lines if ln.startswith("Caused by:")), "")
    user_branch = "data-dependent" in why and "_dynamo/variables/" in caused.replace("\\", "/") and \
        not (stack and os.path.abspath(stack[-1].filename).startswith(_TORCH))  # torch's own Python asks too
    root = (os.path.abspath(stack[0].filename), stack[0].name) if stack else ("", "")
    return _Break(where, why, user_branch, root, bool(debug))


def _last_break() -> _Break | None:
    """The last break dynamo met, if the frame it was tracing then is still running (dynamo gave up on it and
    runs it: the graph asked about is one of what it calls), else None (an earlier step's break)."""
    if not _RECENT_BREAKS:
        return None
    last = _RECENT_BREAKS[-1]
    frame = sys._getframe()
    while frame is not None:
        if (os.path.abspath(frame.f_code.co_filename), frame.f_code.co_name) == last.root:
            return last
        frame = frame.f_back
    return None


def _last_break_at(reason: Any) -> _Break | None:
    """dynamo's account of the break at the line where the graph's own reason says it broke (``_break_at``)."""
    stack = getattr(reason, "user_stack", None) or []
    return _break_at(stack[-1].filename, stack[-1].lineno) if stack else None


def _break_at(filename: str, line: Any) -> _Break | None:
    """dynamo's account of the break at filename:line (where a graph broke, or where a resumed rest of a frame
    begins): the one that says which size question broke it where there is one (a frame traced again on its own
    only says "Data-dependent branching"), else the last; None if dynamo logged none there."""
    at = f"{filename}:{line}"
    here = [b for b in reversed(_RECENT_BREAKS) if b.where == at or b.where.startswith(f"{at} ")]
    return next((b for b in here if b.user_branch), here[0] if here else None)


@dataclasses.dataclass(frozen=True)
class Split:
    """Why a graph is only part of the step (what dynamo did) and what the user should do."""

    why: str
    advice: str


def describe_split(gm: fx.GraphModule) -> Split | None:
    """Where and why dynamo split the step before its loss, or None if it did not (as far as dynamo says)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    tx = traced_frame()
    owner = tx.f_locals.get("self") if tx is not None else None
    fsdp2 = _is_stock_fsdp(owner) or any("distributed/fsdp" in f.filename.replace("\\", "/")
                                         for f in getattr(reason, "user_stack", None) or ())
    # logged: the break is a logging call; last: dynamo's last break, told after what; seen: the break dynamo
    # logged for this graph (last, or the one at the line where the graph's reason says it broke)
    what, logged, last, seen = None, False, None, None
    if reason is not None and reason.graph_break and not _is_backward_call(reason):
        why = reason.reason.strip().splitlines()[0] if reason.reason else "no reason given"
        seen = _last_break_at(reason)  # dynamo's own account of this break, where its reason is terse
        what = f"dynamo split the step at a graph break{_where(reason)}: {seen.why if seen else why}"
        logged = _LOGGING_MARKER in why
    elif tx is not None and tx.f_code.co_name.startswith(_RESUME):
        fn, line = resumed_at(tx.f_code)
        code = linecache.getline(tx.f_code.co_filename, int(line)).strip() if line.isdigit() else ""
        seen = _break_at(tx.f_code.co_filename, line)
        what = (f"this graph is the rest of {fn} ({tx.f_code.co_filename}), which dynamo resumed after a graph "
                f"break at line {line}{f' ({code})' if code else ''}{f': {seen.why}' if seen else ''}; the frames "
                f"that called it were split before it as well")
        logged = _LOGGING_CALL.search(code) is not None
    elif tx is not None and _is_dpcompile_code(tx.f_code):
        # e.g. the property that gathers a sharded parameter (dpcompile.fully_shard), compiled as a frame of its
        # own because dynamo ran the model code that read the parameter without a graph (a frame it gave up on)
        of = f" of {type(owner).__name__}" if owner is not None else ""
        what = (f"this graph is dpcompile's {tx.f_code.co_name}{of} ({tx.f_code.co_filename}:"
                f"{tx.f_code.co_firstlineno}) compiled on its own, without the batch or the loss: dynamo split "
                f"or gave up on the model code that called it")
        last = _last_break()
    elif isinstance(owner, torch.nn.Module) and tx.f_code.co_name == "forward" and \
            called_by_torch_compile(frame_callers(), past_module_calls=True):
        return Split(f"torch.compile was given the model ({type(owner).__name__}), not the training step: a DP "
                     f"step is the function that computes the loss from the batch and calls loss.backward()",
                     "compile the step: def step(x, y): loss = per_sample_loss(model(x), y).mean(); "
                     "loss.backward(); return loss.detach(), then step = torch.compile(step, backend='dp_fsdp', "
                     "options=...) (or decorate it with @dpcompile.private_step(...))")
    elif isinstance(owner, torch.nn.Module) and tx.f_code.co_name == "forward":
        what = (f"this graph is {type(owner).__name__}.forward ({tx.f_code.co_filename}:"
                f"{tx.f_code.co_firstlineno}) compiled on its own, without the loss: the frame that called it "
                f"was split at a graph break before the call")
        last = _last_break()
    if what is None:
        return None
    if last is not None:
        what += f"; {last.told}"
        logged = logged or _LOGGING_MARKER in last.why
        seen = last
    if fsdp2:
        return Split(what, _FSDP2_ADVICE)
    text = " ".join([what] + [f"{f.name} {f.filename} {f.line or ''}" for f in getattr(reason, "user_stack", None) or ()])
    advice = next((a for op, a in _UNBACKED_BATCH_ADVICE.items() if op in text and "data-dependent" in text), None)
    if advice is None and packed_sequence_named(text):
        advice = PACKED_ADVICE
    if advice is None and any(m in text.replace("\\", "/") for m in HF_LOSS_MARKERS):
        advice = HF_LOSS_ADVICE
    if advice is None and logged:
        advice = _LOGGING_ADVICE
    if advice is None and seen is not None:
        advice = seen.advice
    return Split(what, advice or GENERIC_ADVICE)


def split_by_last_break(what: str) -> Split | None:
    """For a graph that is a piece of the step by what it is (an input carries gradients) where dynamo's own
    reason for it says nothing: ``what``, then the last graph break dynamo met, or None if it met none."""
    last = _last_break()
    if last is None:
        return None
    return Split(f"{what}; {last.told}", last.advice or GENERIC_ADVICE)


def split_error_text(split: Split | None, found: str) -> str:
    """The message for a graph that is not a whole DP step: the split first (``describe_split``), then what
    the backend found."""
    head = ("dp_fsdp: the compiled graph is only part of the training step; a DP step must reach the scalar "
            "loss in one graph, from the batch inputs through every trainable parameter.")
    if split is None:
        return f"dp_fsdp: {found}"
    return (f"{head}\n  Why: {split.why}.\n  What dp_fsdp found in this part: {found}\n"
            f"  What to do: {split.advice}.")


def resumed_at(code: Any) -> tuple[str, str]:
    """(function, line) of a rest dynamo resumed after a graph break, from its code name
    (``torch_dynamo_resume_in_<function>_at_<line>``); the line as written there, a number where it is one."""
    fn, _, line = code.co_name[len(_RESUME):].rpartition("_at_")
    return fn, line


def frame_callers() -> list:
    """The code objects of the Python stack beyond dynamo's per-frame compile (convert_frame.py), innermost
    first: while dynamo compiles a frame (tracing it, or in the backend), they begin with the frame's caller,
    the frame itself not having started."""
    codes = []
    f = sys._getframe(1)
    while f is not None:
        codes.append(f.f_code)
        f = f.f_back
    last = max((i for i, c in enumerate(codes) if c.co_filename.endswith("convert_frame.py")), default=None)
    return [] if last is None else codes[last + 1:]


def called_by_torch_compile(callers: list, past_module_calls: bool = False) -> bool:
    """Whether ``frame_callers()`` start at torch.compile's wrapper (eval_frame.py): the frame being compiled is
    the function given to torch.compile. ``past_module_calls``: through nn.Module's call machinery first (a
    module given to torch.compile: dynamo compiles its forward)."""
    i = 0
    if past_module_calls:
        while i < len(callers) and callers[i].co_filename.endswith(_MODULE_CALL):
            i += 1
    return i < len(callers) and callers[i].co_filename.endswith(_EVAL_FRAME)


def _is_dpcompile_code(code: Any) -> bool:
    """Code in dpcompile's own package: never a user's whole training step."""
    return os.path.dirname(os.path.abspath(code.co_filename)) == _PACKAGE


def _is_backward_call(reason: Any) -> bool:
    first = (reason.reason or "").strip().splitlines()[:1]
    stack = getattr(reason, "user_stack", None) or []
    line = (stack[-1].line or "") if stack else ""
    return any("backward()" in s for s in first) or ".backward(" in line


def _where(reason: Any) -> str:
    stack = getattr(reason, "user_stack", None) or []
    if not stack:
        return ""
    f = stack[-1]
    code = f" ({f.line.strip()})" if f.line else ""
    return f" in {f.name} at {f.filename}:{f.lineno}{code}"


def _is_stock_fsdp(module: Any) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, FSDPModule)
