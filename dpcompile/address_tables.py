"""Tables of tensor addresses for the Triton kernels that take many tensors in one launch (dpcompile.add_randn:
the noise of all gradients; dpcompile.zero_rows: bk's in-place row masks). A table is an int64 tensor on the
device, a fixed number of entries per tensor (its addresses and sizes), which the kernel reads to find its
operands: one launch where a launch per tensor costs its host time (these steps are launch-bound).

Made per call, never kept: the addresses change between steps, so a table kept per address set is new pinned
memory every call (GPT-2-small 32x256 bf16 on one H100: 1.71x the non-private wall clock with tables kept, 1.30x
with one per call, on another host of the same kind), and a kept device copy could lie in a CUDA graph's memory
pool, which later graphs overwrite. While a CUDA graph is captured the table's copy is captured too (a graph's
addresses are the same at every replay, so the host table made at capture stays right) and the host table is
kept alive for the graphs that read it (``GraphTables``)."""
from __future__ import annotations

import array

import torch

from . import kernel_plans


def host_table(entries: list[int]) -> torch.Tensor:
    """The entries (a fixed number per tensor) as one int64 CPU tensor. Through an array, not torch.tensor, which
    takes 74 us for 392 Python ints where this takes 3 (a CPU core of this project's CI machine)."""
    if not entries:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", entries), dtype=torch.int64)


def device_table(entries: list[int], device: torch.device) -> torch.Tensor:
    """The entries as an int64 tensor on the device. Staged in pinned memory (torch's caching host allocator
    recycles it once the copy is done), so the copy does not wait for the GPU: a pageable copy would, and a step's
    host would lose its lead."""
    host = host_table(entries)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


class GraphTables:
    """Pinned host memory for the address tables of CUDA graph captures. A capture's table copy becomes a node of
    the graph, which reads the host table at every replay: that table is never freed or recycled (a few bytes per
    tensor per capture). Pinned memory cannot be allocated while this thread captures (torch's copy refuses
    pageable memory then), so calls outside a capture, such as the warm-up before one, set it aside: at least
    ``RESERVE`` entries and four times the call's table."""

    RESERVE = 1 << 16

    def __init__(self) -> None:
        self.free: torch.Tensor | None = None  # pinned int64, not yet handed to a capture
        self.kept: list[torch.Tensor] = []  # handed to captures

    def set_aside(self, entries: int) -> None:
        if self.free is None or self.free.numel() < 4 * entries:
            self.free = torch.empty(max(self.RESERVE, 4 * entries), dtype=torch.int64, pin_memory=True)

    def take(self, entries: list[int], device: torch.device) -> torch.Tensor | None:
        """The table on the device, copied by the graph at every replay; None where too little was set aside
        (a capture without a warm-up call: the caller launches per tensor)."""
        n = len(entries)
        if self.free is None or self.free.numel() < n:
            return None
        host, self.free = self.free[:n], self.free[n:]
        host.copy_(host_table(entries))
        self.kept.append(host)
        return host.to(device, non_blocking=True)


GRAPH_TABLES = GraphTables()


def table(entries: list[int], device: torch.device) -> torch.Tensor | None:
    """The table a launch reads (entries: a fixed number per tensor, one tensor after another), made the way the
    moment asks: an empty one of the right size while launches are recorded (dpcompile.precompile: fake tensors
    have no addresses), the capture's own while a CUDA graph is captured (None where too little pinned memory
    was set aside: launch per tensor then), else a fresh one (and pinned memory set aside for a capture that may
    follow)."""
    n = len(entries)
    if kernel_plans.is_recording():
        return torch.empty([n], dtype=torch.int64, device=device)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return GRAPH_TABLES.take(entries, device)
        GRAPH_TABLES.set_aside(n)
    return device_table(entries, device)
