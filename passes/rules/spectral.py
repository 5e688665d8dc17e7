"""Fourier transforms and the complex views around them (FNet's token mixing, spectral layers).

``torch.fft`` lowers to ``_fft_r2c``, ``_fft_c2c`` and ``_fft_c2r``, each over a list of dims, and their backwards
are the same three ops. A transform mixes values only along its dims: over dims other than the sample dim it
keeps every sample's values apart and the layout as it was; one over the sample dim mixes samples and is refused.
``view_as_real`` (``Tensor.real``, ``.imag``) adds a trailing dim of two and ``view_as_complex`` takes it away.

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import Any

import torch

from dpcompile.empty_fft import ON_ANY_BATCH

from ..batch_state import Batched, fail_layout, ndim, norm_dim

aten = torch.ops.aten


def _fft(an, node):
    x, dims = node.args[0], node.args[1]
    s = an.st(x)
    if not isinstance(s, Batched) or s.dim is None:
        return s
    if s.dim in {norm_dim(d, ndim(x)) for d in dims}:
        return fail_layout(an, node, "a Fourier transform along the sample dim mixes samples")
    return s  # the output has the input's dims (sizes change along the transformed ones only)


def _view_as_real(an, node):
    return an.st(node.args[0])  # [..., 2] added after the last dim


def _view_as_complex(an, node):
    x = node.args[0]
    s = an.st(x)
    if isinstance(s, Batched) and s.dim is not None and s.dim == ndim(x) - 1:
        return fail_layout(an, node, "view_as_complex pairs values along the sample dim")
    return s


RULES: dict[Any, Any] = {}
for _p in (aten._fft_r2c, aten._fft_c2r, aten._fft_c2c, *(op.overloadpacket for op in ON_ANY_BATCH.values())):
    RULES[_p] = _fft
RULES[aten.view_as_real] = _view_as_real
RULES[aten.view_as_complex] = _view_as_complex
