"""Host-side derivation of the per-step, per-parameter noise seeds.

The compiled backward draws each parameter's noise from Inductor's Philox
generator keyed by one int64 seed. Seeds come from a SplitMix64 hash of
(base seed, step, parameter index, rank), so they never repeat across steps,
parameters or ranks. The step counter is the state to checkpoint: restoring
it with the same base seed continues the stream instead of replaying it.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every uint64 of x (arithmetic mod 2**64, as numpy's uint64 wraps)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class NoiseSeeds:
    def __init__(self, seed: int | None, rank: int = 0):
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        self.rank = rank
        # seed index -> the stream rank it draws from, where that is not ``rank`` (tensor parallel: a
        # replicated parameter draws from one stream all ranks of its group share)
        self.index_ranks: dict[int, int] = {}
        self.step = 0
        self._lock = threading.Lock()
        # a seed from the OS differs per process: ranks take rank 0's before their first draw, so replicas
        # of a shard (hybrid sharding) draw the same noise; shards still differ through the stream's rank
        self._agreed = seed is not None
        self._index_hashes: dict[int, np.ndarray] = {}  # n -> splitmix64(1..n), the part every step shares

    def _agree(self) -> None:
        import torch.distributed as dist

        self._agreed = True
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [self.seed]
            dist.broadcast_object_list(box, src=0)
            self.seed = int(box[0])

    def seeds_for(self, step: int, n: int) -> list[int]:
        return [int(v) for v in self.seeds_array(step, n)]

    def seeds_array(self, step: int, n: int) -> np.ndarray:
        """int64 [n]: seed i is splitmix64(base(rank of i) ^ splitmix64(i + 1)), base(r) = splitmix64(seed ^
        splitmix64(step) ^ splitmix64((r + 1) << 40)), as int64 (two's complement). In numpy's uint64
        arithmetic, which wraps as the hash needs: every step computes one per graph input (hundreds), and
        this runs on the host between steps that are often host-bound."""
        bases: dict[int, int] = {}

        def base(rank: int) -> int:
            if rank not in bases:
                bases[rank] = splitmix64(self.seed ^ splitmix64(step) ^ splitmix64((rank + 1) << 40))
            return bases[rank]

        index_hash = self._index_hashes.get(n)
        if index_hash is None:
            index_hash = self._index_hashes[n] = _splitmix64_np(np.arange(1, n + 1, dtype=np.uint64))
        if self.index_ranks:
            b = np.array([base(self.index_ranks.get(i, self.rank)) for i in range(n)], dtype=np.uint64)
        else:
            b = np.uint64(base(self.rank))
        return _splitmix64_np(b ^ index_hash).view(np.int64)

    def example(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(max(n, 1), dtype=torch.int64, device=device)

    def next(self, n: int, device: torch.device) -> torch.Tensor:
        if not self._agreed:
            self._agree()
        with self._lock:
            step = self.step
            self.step += 1
        seeds = self.seeds_array(step, max(n, 1))
        if device.type != "cuda":
            t = torch.from_numpy(seeds)
            return t.to(device, non_blocking=True) if device.type != "cpu" else t
        # through pinned memory: a copy from pageable memory costs the host tens of microseconds at every step
        # (measured, ViT-S/16 under CUDA graphs), a pinned one is queued. The caching host allocator keeps the
        # block from reuse until the copy that reads it has run.
        pinned = torch.empty(len(seeds), dtype=torch.int64, pin_memory=True)
        pinned.numpy()[:] = seeds
        return pinned.to(device, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "step": self.step, "rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("seed", "step"):
            if k not in state:
                raise ValueError(f"dpcompile noise state is missing {k!r}; pass what DPBackend.state_dict() returned")
        self.seed, self.step = int(state["seed"]), int(state["step"])
        self._agreed = True  # a checkpoint's seed: every rank restores the seed the ranks agreed on
