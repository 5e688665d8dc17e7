"""torch.fft's three kernels as ops that also run on an empty batch.

A graph compiled for every batch size (an unbacked one: sharded and Poisson-sampled steps) runs with no
samples on a rank that draws none. torch's CPU transforms (oneMKL) raise on an empty input ("DFTI ERROR:
Inconsistent configuration parameters"), in eager PyTorch too, so that rank would fail while the others wait
in a collective. Each op here is the aten kernel it names, except that an input with no entries gives an
output with none, of the kernel's shape and dtype (nothing to read, so its layout says nothing: Inductor's
stride asserts skip empty tensors). ``passes.empty_batch`` puts them in place of the aten kernels on an input
holding the batch; their fake kernels are aten's.
"""
from __future__ import annotations

import torch
from torch._prims_common import corresponding_complex_dtype, corresponding_real_dtype

aten = torch.ops.aten


def _empty(x: torch.Tensor, sizes, dtype) -> torch.Tensor:
    return torch.empty(sizes, dtype=dtype, device=x.device)


@torch.library.custom_op("dpcompile::fft_r2c", mutates_args=())
def fft_r2c(x: torch.Tensor, dim: list[int], normalization: int, onesided: bool) -> torch.Tensor:
    if x.numel() == 0:
        sizes = list(x.shape)
        if onesided:
            sizes[dim[-1]] = sizes[dim[-1]] // 2 + 1
        return _empty(x, sizes, corresponding_complex_dtype(x.dtype))
    return aten._fft_r2c.default(x, dim, normalization, onesided)


@torch.library.custom_op("dpcompile::fft_c2c", mutates_args=())
def fft_c2c(x: torch.Tensor, dim: list[int], normalization: int, forward: bool) -> torch.Tensor:
    if x.numel() == 0:
        return _empty(x, x.shape, x.dtype)
    return aten._fft_c2c.default(x, dim, normalization, forward)


@torch.library.custom_op("dpcompile::fft_c2r", mutates_args=())
def fft_c2r(x: torch.Tensor, dim: list[int], normalization: int, last_dim_size: int) -> torch.Tensor:
    if x.numel() == 0:
        sizes = list(x.shape)
        sizes[dim[-1]] = last_dim_size
        return _empty(x, sizes, corresponding_real_dtype(x.dtype))
    return aten._fft_c2r.default(x, dim, normalization, last_dim_size)


@fft_r2c.register_fake
def _(x, dim, normalization, onesided):
    return aten._fft_r2c.default(x, dim, normalization, onesided)


@fft_c2c.register_fake
def _(x, dim, normalization, forward):
    return aten._fft_c2c.default(x, dim, normalization, forward)


@fft_c2r.register_fake
def _(x, dim, normalization, last_dim_size):
    return aten._fft_c2r.default(x, dim, normalization, last_dim_size)


# aten kernel -> the same on any batch, arguments alike
ON_ANY_BATCH = {
    aten._fft_r2c.default: torch.ops.dpcompile.fft_r2c.default,
    aten._fft_c2c.default: torch.ops.dpcompile.fft_c2c.default,
    aten._fft_c2r.default: torch.ops.dpcompile.fft_c2r.default,
}
