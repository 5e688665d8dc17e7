"""No buffer of ghost's first backward is held for reuse by its second backward.

Inductor's wrapper does not free a dead buffer when a later allocation of the
same size and dtype can take it over: the buffer stays referenced, so
allocated, from its last read to the reuse. It gates this on its own peak
estimate (``AllocateLine.should_reuse_buffer``), which ghost's two backwards
defeat: each layer's GELU output, read once by the layer's norm contraction
in the first backward, was held until the second backward made a buffer of
its size, so every layer's copy was alive where the second backward starts
(GPT-2-small bf16 8x1024 on an H100: 12 x 48 MiB among the 0.6 GiB above the
non-private peak). A buffer freed by the first backward is dead for the whole
second backward: taking it over there saves one allocator call and can only
raise the peak, so dpcompile refuses exactly those reuses.

Nodes of the second backward carry ``node.meta[PHASE_KEY] = 1``; Inductor's
scheduler nodes know the FX nodes they come from, so an allocation in a node
of a later phase than the node that freed the buffer allocates afresh.
Graphs without the tag are planned as torch plans them.
"""
from __future__ import annotations

import weakref

PHASE_KEY = "dpcompile_phase"
SECOND_BACKWARD = 1

COUNTER = "buffer_reuses_refused"
COUNTERS_KEY = "dpcompile_counters"

_installed = False
# where a graph's refusals are counted: node.meta[COUNTERS_KEY] -> the counters (a string in the meta, which
# AOTAutograd may deep-copy with the graph); the latest graphs only
_counters: dict[str, dict] = {}
_KEEP = 64


def mark_second_backward(node) -> None:
    node.meta[PHASE_KEY] = SECOND_BACKWARD


def _origins(snode):
    for sub in snode.get_nodes():
        ir_node = getattr(sub, "node", None)
        for origin in getattr(ir_node, "origins", None) or ():
            meta = getattr(origin, "meta", None)
            if meta:
                yield meta


_phases: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler -> (phase of each node, key)


def _phases_of(scheduler) -> tuple[list[int], str | None]:
    got = _phases.get(scheduler)
    if got is None or len(got[0]) != len(scheduler.nodes):
        phases, key = [], None
        for snode in scheduler.nodes:
            phase = 0
            for meta in _origins(snode):
                phase = max(phase, meta.get(PHASE_KEY, 0))
                key = key or meta.get(COUNTERS_KEY)
            phases.append(phase)
        got = _phases[scheduler] = (phases, key)
    return got


def count_refusals(gm, key: str, counters: dict) -> None:
    """Reuses refused while Inductor plans ``gm`` (or a copy of it) are counted in ``counters[COUNTER]``."""
    for n in gm.graph.nodes:
        n.meta[COUNTERS_KEY] = key
    _counters[key] = counters
    while len(_counters) > _KEEP:
        del _counters[next(iter(_counters))]


def install_phase_gated_reuse() -> bool:
    """Gates Inductor's buffer reuse on the phase tags, for every graph compiled from now on (idempotent).
    False where this torch plans reuse otherwise (nothing changed)."""
    global _installed
    if _installed:
        return True
    try:
        from torch._inductor.codegen import wrapper
        from torch._inductor.virtualized import V
    except ImportError:
        return False
    alloc = getattr(wrapper, "AllocateLine", None)
    should_reuse = getattr(alloc, "should_reuse_buffer", None)
    if should_reuse is None:
        return False

    def phase_gated(self, free_line, size):
        if not should_reuse(self, free_line, size):
            return False
        freed_at = getattr(free_line, "scheduler_node_index", None)
        at = getattr(self, "scheduler_node_index", None)
        if freed_at is None or at is None or freed_at >= at:
            return True
        phases, key = _phases_of(V.graph.scheduler)
        if phases[freed_at] < phases[at]:
            counters = _counters.get(key)
            if counters is not None:
                counters[COUNTER] = counters.get(COUNTER, 0) + 1
            return False
        return True

    phase_gated.__wrapped__ = should_reuse  # type: ignore[attr-defined]
    alloc.should_reuse_buffer = phase_gated
    _installed = True
    return True
