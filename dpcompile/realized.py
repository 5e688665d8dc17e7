"""``dpcompile::realized``: a copy Inductor cannot fuse into its readers (passes/scatter_reads.py).

An op Inductor does not know is an extern kernel call: its output is a buffer of its own, written before any
reader runs. Defined with torch.library's low-level API, as conv_sq_norms' ops are."""
from __future__ import annotations

import torch

_LIB = torch.library.Library("dpcompile", "FRAGMENT")
_LIB.define("realized(Tensor x) -> Tensor")


def realized(x: torch.Tensor) -> torch.Tensor:
    """x's values in a new tensor of x's sizes and strides."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return out.copy_(x)


_LIB.impl("realized", realized, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::realized", lib=_LIB)
def _(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
