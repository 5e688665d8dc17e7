"""Standard normal draws, four per Philox call: ``torch.ops.dpcompile.randn(seeds, index, numel)``.

The noise pass draws each chunk of parameters' noise as one flat fp32 vector. Inductor's ``inductor_random``
runs ``tl.randn`` per element: a whole Philox call (ten rounds, four 32-bit words) and a Box-Muller transform per
output, three of the four words unused, so the draws are bound by integer arithmetic, not by writing them: on
one H100 a Llama-3.2-1B step (1.24 billion coordinates) spent 7.35 ms of GPU time in its noise draws against
about 1.7 ms to write them (BENCHMARKS.md). This op turns every word into a normal
(``triton_kernels.normals4``).

seeds: the step's int64 seeds on the draws' device, index: this draw's entry (read by the kernel: no host sync,
and no kernel of its own to look the seed up). Every output comes from its own Philox counter and word, so a draw
has independent N(0, 1) coordinates, and a coordinate's value depends on the seed and its position only, not on
``numel`` (a longer draw starts with the same values). CUDA runs the Triton
kernel (CPU tensors too under ``TRITON_INTERPRET=1``, through ``launch``); other devices compute the same normals
with torch ops (dpcompile.philox: Philox keyed by all 64 bits of the seed).
"""
from __future__ import annotations

import os

import torch

from . import kernel_plans
from .kernel_plans import cached_plan

BLOCK = 1024  # counters per program: 4096 outputs

_LIB = torch.library.Library("dpcompile", "FRAGMENT")
# nondeterministic_seeded: a draw is never recomputed or merged with another by the partitioner or CSE
_LIB.define("randn(Tensor seeds, int index, SymInt numel) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))


def randn(seeds: torch.Tensor, index: int, numel: int) -> torch.Tensor:
    if seeds.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return launch(seeds, index, numel)
    from .philox import flat_normals  # torch ops: the same values, keyed by all 64 bits of the seed

    return flat_normals(int(seeds[index]), numel, BLOCK).to(seeds.device)


_LIB.impl("randn", randn, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::randn", lib=_LIB)
def _(seeds, index, numel):
    return seeds.new_empty([numel], dtype=torch.float32)


_PLANS: dict = {}


def launch(seeds: torch.Tensor, index: int, numel: int) -> torch.Tensor:
    """The Triton kernel (on CPU tensors too under TRITON_INTERPRET=1)."""
    if seeds.dtype != torch.int64 or seeds.dim() != 1 or not 0 <= index < seeds.numel():
        raise ValueError(f"dpcompile::randn: seeds must be a 1-D int64 tensor holding entry {index}, got "
                         f"{seeds.dtype} {tuple(seeds.shape)}")
    out = torch.empty(numel, dtype=torch.float32, device=seeds.device)
    grid = cached_plan(_PLANS, numel, lambda: (-(-numel // (4 * BLOCK)),))
    if numel:
        from dpcompile import triton_kernels

        kernel_plans.launch(triton_kernels.randn_kernel, grid, (out, seeds, index, numel), {"BLOCK": BLOCK})
    return out
