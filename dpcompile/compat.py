"""Fixes for older torch releases that the DP graphs run into.

A sharded step runs one graph for every batch size, so a rank with no
samples launches Inductor's Triton kernels with zero-size dims. torch 2.11's
grid for 2-D kernels whose y dim may exceed the CUDA limit divides by the
number of y-grid splits, which is 0 for an empty y dim (ZeroDivisionError
at launch). Newer torch guards it (``0 if y_grid_div_ == 0 else ...``); this
adds the same guard where it is missing. It changes nothing where torch
already has it.

torch 2.11's Triton codegen for a "mix-order" reduction (a row reduction
fused with a column reduction over the same input, e.g. a LayerNorm
backward) picks its split size from ``sizevars.size_hint(numel)``, which
raises on an unbacked batch size even when the user gave a hint
(``hint_override``); newer torch asks ``optimization_hint``, which uses the
hint. ``hint_mix_order_split`` makes the older codegen do the same.
"""
from __future__ import annotations

import contextlib
import inspect

_done = False
_mix_order_done = False


def guard_empty_y_grid() -> None:
    global _done
    if _done:
        return
    _done = True
    try:
        from torch._inductor.runtime import triton_heuristics as th
    except ImportError:  # no Triton runtime: nothing launches Triton kernels
        return
    cls = getattr(th, "Grid2DWithYZOverflow", None)
    if cls is None or getattr(cls.generate, "_dpcompile_guarded", False):
        return
    original = cls.generate

    def generate(self, meta, *args, **kwargs):  # (meta) in torch 2.11, (meta, is_lazy) later
        original(self, meta, *args, **kwargs)
        y = str(self.y_grid)
        if "y_grid_div_" in y and "y_grid_div_ == 0" not in y:
            self.y_grid = (f"(0 if y_grid_div_ == 0 else {y})" if getattr(self, "mode", "python") == "python"
                           else f"(y_grid_div_ == 0 ? 0 : {y})")

    generate._dpcompile_guarded = True  # type: ignore[attr-defined]
    cls.generate = generate


@contextlib.contextmanager
def unbacked_size_hints(sizevars):
    """Within the block, ``sizevars.size_hint`` answers unbacked expressions
    with ``optimization_hint`` (the user's hint_override, else Inductor's
    fallback) instead of raising; other expressions are answered as before."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    original = getattr(sizevars, "size_hint", None)

    def size_hint(expr, *args, **kwargs):
        if original is None or (not args and not kwargs and free_unbacked_symbols(expr)):
            return sizevars.optimization_hint(expr)
        return original(expr, *args, **kwargs)

    sizevars.size_hint = size_hint
    try:
        yield
    finally:
        del sizevars.size_hint  # the class's method again


def hint_mix_order_split() -> None:
    global _mix_order_done
    if _mix_order_done:
        return
    _mix_order_done = True
    try:
        from torch._inductor.codegen.simd import SIMDScheduling
    except ImportError:
        return
    original = getattr(SIMDScheduling, "_codegen_mix_order_reduction", None)
    if original is None or getattr(original, "_dpcompile_guarded", False):
        return
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return
    if "sizevars.size_hint(numel)" not in source:
        return  # this torch asks for an optimization hint already

    def codegen(self, *args, **kwargs):
        from torch._inductor.virtualized import V

        with unbacked_size_hints(V.graph.sizevars):
            return original(self, *args, **kwargs)

    codegen._dpcompile_guarded = True  # type: ignore[attr-defined]
    codegen._dpcompile_original = original  # type: ignore[attr-defined]
    SIMDScheduling._codegen_mix_order_reduction = codegen
