"""Poisson sampling of batches, the sampling the privacy accounting assumes.

Every step each example joins the global batch independently with
probability ``sample_rate``, so batch sizes vary and may be zero (the
sharded step handles both). With several ranks every rank draws the same
global batch from the shared seed and keeps the examples whose index falls
to it (index % world_size == rank): the ranks' batches are disjoint and
together are exactly one Poisson sample.
"""
from __future__ import annotations

import secrets
from typing import Iterator

import torch

from dpcompile.config import _is_real

_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) over the generator's seed space


class PoissonBatchSampler:
    """A ``batch_sampler`` for ``torch.utils.data.DataLoader``: ``steps`` batches of dataset indices.

    ``seed`` must be the same on every rank (and kept secret, like the noise
    seed); with one rank, None draws one from the OS. ``start_step`` resumes
    a run: step t's batch depends only on (seed, t).
    """

    def __init__(self, num_samples: int, *, sample_rate: float, steps: int, seed: int | None = None,
                 rank: int = 0, world_size: int = 1, start_step: int = 0):
        def count(x, name, low):
            if isinstance(x, bool) or not isinstance(x, int) or x < low:
                raise ValueError(f"PoissonBatchSampler: {name} must be an int >= {low}, got {x!r}")

        count(num_samples, "num_samples", 1)
        count(steps, "steps", 0)
        count(world_size, "world_size", 1)
        count(start_step, "start_step", 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"PoissonBatchSampler: rank must be an int in [0, world_size), got {rank!r}")
        if not _is_real(sample_rate) or not 0 < sample_rate <= 1:
            raise ValueError(f"PoissonBatchSampler: sample_rate must be in (0, 1], got {sample_rate!r}")
        if seed is None:
            if world_size > 1:
                raise ValueError("PoissonBatchSampler: with several ranks pass the same seed on every rank, so they "
                                 "draw the same global batch")
            seed = secrets.randbits(63)
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"PoissonBatchSampler: seed must be an int or None, got {seed!r}")
        self.num_samples, self.sample_rate, self.steps = num_samples, float(sample_rate), steps
        self.seed, self.rank, self.world_size, self.start_step = seed, rank, world_size, start_step

    @property
    def expected_batch_size(self) -> float:
        """Of the global batch: what ``expected_batch_size`` of the dp_fsdp options should be."""
        return self.sample_rate * self.num_samples

    def _global_batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * _MIX + step) % (1 << 63))
        return (torch.rand(self.num_samples, generator=g) < self.sample_rate).nonzero().flatten()

    def batch(self, step: int) -> list[int]:
        """This rank's part of step ``step``'s global batch."""
        chosen = self._global_batch(step)
        return chosen[chosen % self.world_size == self.rank].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for t in range(self.start_step, self.steps):
            yield self.batch(t)

    def micro_batches(self, max_size: int) -> Iterator[tuple[list[int], bool]]:
        """Every step's batch in micro-batches of at most ``max_size`` indices: ``(indices, last)``, where
        ``last`` marks the final micro-batch of a step (run it outside ``dpcompile.accumulate()``).

        Every rank yields the same number of micro-batches per step (enough for the largest rank's part;
        each rank knows every part, they come from the shared seed), so sharded ranks issue the same
        collectives; a rank's micro-batches may be empty, and a step with no samples is one empty
        micro-batch (its noise is still added). Opacus' BatchMemoryManager, for this sampler.
        """
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"micro_batches: max_size must be an int >= 1 (the physical batch size), got {max_size!r}")
        for t in range(self.start_step, self.steps):
            chosen = self._global_batch(t)
            owner = chosen % self.world_size
            largest = int(torch.bincount(owner, minlength=self.world_size).max()) if len(chosen) else 0
            n = max(1, -(-largest // max_size))
            mine = chosen[owner == self.rank].tolist()
            # as even as possible: the first len(mine) % n micro-batches get one more
            size, extra = divmod(len(mine), n)
            start = 0
            for j in range(n):
                end = start + size + (j < extra)
                yield mine[start:end], j == n - 1
                start = end

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume the same sampling (the seed is as secret as the data)."""
        return {"seed": self.seed, "num_samples": self.num_samples, "sample_rate": self.sample_rate,
                "steps": self.steps}

    def load_state_dict(self, state: dict, *, start_step: int) -> None:
        """Continues the sampling of a checkpointed run at ``start_step`` (its completed steps).

        The seed comes from the checkpoint; the dataset size and sample rate must be those of the run
        (the privacy accounting assumes them); ``steps`` may grow; rank and world size may change (the
        global batch of a step depends only on the seed and the step)."""
        try:
            seed, n, rate = int(state["seed"]), int(state["num_samples"]), float(state["sample_rate"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a PoissonBatchSampler state ({type(e).__name__}: {e})") from e
        if n != self.num_samples or rate != self.sample_rate:
            raise ValueError(
                f"PoissonBatchSampler: the checkpointed run sampled {n} examples at rate {rate}, this sampler "
                f"{self.num_samples} at {self.sample_rate}; resume with the same dataset and sample rate (a new "
                f"rate is a new phase: start a new run, or account it with PrivacyAccountant.step(sample_rate=...))")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"PoissonBatchSampler: start_step must be an int >= 0, got {start_step!r}")
        self.seed, self.start_step = seed, start_step

    def __len__(self) -> int:
        return max(self.steps - self.start_step, 0)
