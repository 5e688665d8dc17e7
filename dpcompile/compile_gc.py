"""Python's full garbage collections held off while dp_fsdp compiles (the ``pause_gc`` option).

A compile makes millions of long-lived Python objects (FX nodes, fake tensors, sympy expressions, Inductor's IR
and scheduler nodes). The collector's full collections walk every object of the process, and it starts one
each time the objects that survived its young collections have grown by a quarter: in a GPT-2-small ghost step
compiled sharded on CPU (torch 2.13), 16 full collections took 4.9 s of the compile and about 1,300 young ones
1.3 s (BENCHMARKS.md, eighty-second section); with the hold, 7 full collections (2.2 s) were left, mostly
before the compile. The young collections stay on: they free the compile's short-lived cycles while their
memory is still warm. The full collections come back when the compile returns. On by default: the test
suite's many small compiles ran as fast or faster with it (BENCHMARKS.md).

Held off while dynamo traces a DP step's frame and the backend compiles it (``step_frames``: AOTAutograd's
trace, dpcompile's passes, the partition, the forward's Inductor compile), and for every graph Inductor
compiles later (a backward compiled at the first backward). Explicit ``gc.collect()`` calls inside still
run. Nested holds, a collector the user turned off and thresholds changed inside are left alone: a hold
restores only what it changed itself.
"""
from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

# the full-collection threshold while held: the number of young (generation 1) collections it waits for
HELD = 1 << 30


@contextlib.contextmanager
def hold_full_collections(enabled: bool = True) -> Iterator[None]:
    """No automatic full collection inside, when ``enabled`` and the collector is on; as before after,
    exceptions included."""
    young0, young1, full = gc.get_threshold()
    if not enabled or not gc.isenabled() or young0 == 0 or full == HELD:
        yield
        return
    gc.set_threshold(young0, young1, HELD)
    try:
        yield
    finally:
        if gc.get_threshold() == (young0, young1, HELD):  # unless changed inside
            gc.set_threshold(young0, young1, full)


def full_collections_held() -> bool:
    """Whether a ``hold_full_collections`` hold is in force."""
    return gc.isenabled() and gc.get_threshold()[2] == HELD


def with_full_collections_held(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called with full collections held off (Inductor's inner compile of one graph)."""

    @functools.wraps(fn)
    def held(*args: Any, **kwargs: Any) -> Any:
        with hold_full_collections():
            return fn(*args, **kwargs)

    return held
