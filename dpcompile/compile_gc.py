"""Python's cyclic garbage collector paused while dp_fsdp compiles (the ``pause_gc`` option).

A compile makes millions of long-lived Python objects (FX nodes, fake tensors, sympy expressions, Inductor's IR
and scheduler nodes). The collector's full collections walk all of them, again each time the heap grows by a
quarter: in a GPT-2-small ghost step compiled sharded on CPU (torch 2.13), 16 full collections and about 1,300
younger ones took 6.1 s of the compile (BENCHMARKS.md, eighty-second section). Little of it is garbage that
matters while the compile runs; what cycles it leaves are freed by the first collections after it (the
collector is back on when the compile returns, and Dynamo collects right after each frame's compile).

Paused for the backend's compile of the step (AOTAutograd's trace, dpcompile's passes, the partition and the
forward's Inductor compile) and for every graph Inductor compiles later (a backward compiled at the first
backward). Explicit ``gc.collect()`` calls inside still run. Nested pauses and a collector the user turned off
are left alone: only a pause that turned it off turns it back on.
"""
from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def gc_paused(enabled: bool = True) -> Iterator[None]:
    """The collector off inside, when ``enabled`` and it was on; back on after, exceptions included."""
    if not enabled or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def with_gc_paused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called with the collector paused (Inductor's inner compile of one graph)."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return paused
