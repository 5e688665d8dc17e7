"""Questions torch's C++ asks of an unbacked size, answered as torch's Python answers its own.

torch's C++ asks of a tensor with symbolic sizes whether it is empty and which sizes exceed 1 before telling its
layout: every ``is_contiguous()`` (``numel() == 0``) and ``suggest_memory_format`` (each size ``== 0``, ``> 1``),
which ``x.to(dtype, memory_format=...)``, ``group_norm``, ``channel_shuffle`` and kernels' empty-input shortcuts
call (torch 2.11 and 2.13). With an unbacked batch size the question raises: a channels-last activation (a model
converted with ``model.to(memory_format=torch.channels_last)``, or a LayerNorm over channels between permutes)
stopped the step at ``group_norm`` (timm's PoolFormer), at a ``LayerNorm`` over ``[C, H, W]`` (its backward's
decomposition calls ``to(..., memory_format=torch.contiguous_format)``) or at a model's own
``if not x.is_contiguous()``, with stock ``torch.compile`` and ``mark_unbacked`` too. torch's Python checks of the
same questions read an unbacked size obliviously (``guard_or_false``, ``guard_size_oblivious``: as if it were at
least 2, the general path, which is right for any size).

``install()`` wraps ``SymNode.guard_bool``, the entry those C++ questions take. Where torch would raise on a
question asked from C++ (a ``.h``/``.cpp`` file; Python's own questions pass an empty file name), it asks the shape
environment the same question size-obliviously and returns its answer if it has one: ``numel() == 0`` is false,
``size > 1`` true. No guard and no runtime assert: a rank with no samples, or one, runs the same graph. Any other
question, and any question torch answers, is torch's. The wrapper is torch's machinery, not the user's code: torch
skips this file when it names the line that asked a question it cannot answer ("Caused by: ...").
"""
from __future__ import annotations

import os

from dpcompile.compat import _wrap_once

# how many times torch's C++ asked a question of an unbacked size that only a size-oblivious reading answers,
# by C++ file:line (tests read it)
ANSWERS: dict[str, int] = {}
_CPP_SOURCES = (".h", ".cpp", ".cc")
_THIS_FILE = os.path.abspath(__file__)


def install() -> None:
    try:
        from torch.fx.experimental import symbolic_shapes
        from torch.fx.experimental.sym_node import SymNode
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    except ImportError:  # pragma: no cover
        return

    def wrap(original):
        def guard_bool(self, file, line):
            try:
                return original(self, file, line)
            except GuardOnDataDependentSymNode:
                if not str(file).endswith(_CPP_SOURCES):
                    raise
                answer = self.shape_env._maybe_evaluate_static(self.expr, size_oblivious=True)
                if answer is None or not answer.is_Boolean:
                    raise
                key = f"{str(file).rsplit('/', 1)[-1]}:{line}"
                ANSWERS[key] = ANSWERS.get(key, 0) + 1
                return bool(answer)
        return guard_bool

    _wrap_once(SymNode, "guard_bool", wrap)
    _not_user_code(symbolic_shapes)


def _not_user_code(symbolic_shapes) -> None:
    """torch names the user's line in a data-dependent error by walking the stack to the first frame outside its
    own files (``uninteresting_files()``, a cached set) or outside its directory (``_find_user_code_frame``): the
    wrappers' frames sit between, and would be named instead of the model's line."""
    import torch

    files = getattr(symbolic_shapes, "uninteresting_files", None)
    if files is not None:
        files().add(_THIS_FILE)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

    def wrap(original):
        def _find_user_code_frame():
            frame = original()  # the first frame outside torch: this wrapper's own, or guard_bool's, or the user's
            while frame is not None and (os.path.abspath(frame.f_code.co_filename) == _THIS_FILE
                                         or frame.f_code.co_filename.startswith(torch_dir)):
                frame = frame.f_back
            return frame
        return _find_user_code_frame

    _wrap_once(symbolic_shapes, "_find_user_code_frame", wrap)
