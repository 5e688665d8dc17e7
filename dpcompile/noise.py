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

import torch

_MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= (1 << 63) else x


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

    def _agree(self) -> None:
        import torch.distributed as dist

        self._agreed = True
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [self.seed]
            dist.broadcast_object_list(box, src=0)
            self.seed = int(box[0])

    def seeds_for(self, step: int, n: int) -> list[int]:
        bases: dict[int, int] = {}

        def base(rank: int) -> int:
            if rank not in bases:
                bases[rank] = splitmix64(self.seed ^ splitmix64(step) ^ splitmix64((rank + 1) << 40))
            return bases[rank]

        return [_signed(splitmix64(base(self.index_ranks.get(i, self.rank)) ^ splitmix64(i + 1))) for i in range(n)]

    def example(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(max(n, 1), dtype=torch.int64, device=device)

    def next(self, n: int, device: torch.device) -> torch.Tensor:
        if not self._agreed:
            self._agree()
        with self._lock:
            step = self.step
            self.step += 1
        t = torch.tensor(self.seeds_for(step, max(n, 1)), dtype=torch.int64)
        return t.to(device, non_blocking=True) if device.type != "cpu" else t

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "step": self.step, "rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("seed", "step"):
            if k not in state:
                raise ValueError(f"dpcompile noise state is missing {k!r}; pass what DPBackend.state_dict() returned")
        self.seed, self.step = int(state["seed"]), int(state["step"])
        self._agreed = True  # a checkpoint's seed: every rank restores the seed the ranks agreed on
