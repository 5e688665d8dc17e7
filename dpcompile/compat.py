"""Fixes for older torch releases that the DP graphs run into.

A sharded step runs one graph for every batch size, so a rank with no
samples launches Inductor's Triton kernels with zero-size dims. torch 2.11's
grid for 2-D kernels whose y dim may exceed the CUDA limit divides by the
number of y-grid splits, which is 0 for an empty y dim (ZeroDivisionError
at launch). Newer torch guards it (``0 if y_grid_div_ == 0 else ...``); this
adds the same guard where it is missing. It changes nothing where torch
already has it.
"""
from __future__ import annotations

_done = False


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
