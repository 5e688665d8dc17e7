"""The noise kernels' normals computed with torch ops, for devices without Triton (the CPU): Philox4x32-10 keyed
by the full 64-bit seed, and the Box-Muller of ``triton_kernels.normals4`` (radius uniform (w + 1/2) 2^-32,
refined to 2^-64 below 2^-24 from the words at counter + 2^32, never clamped), in float64.

Why not torch's CPU generator or Inductor's CPU RNG: both key their streams by 32 bits of the seed (mt19937's
seeding; Inductor's ``randn_cpu(uint32_t seed, ...)``), so two of a run's draws repeat each other's numbers with
probability about n^2 / 2^33 for n draws (0.1 for 30 000: a long run's steps times chunks), and two released
gradients with the same noise give away their difference; and both make float32 uniforms of 24 or 31 bits, which
bound the noise at about 5.8 standard deviations. Here every draw is a function of all 64 bits of its seed and of
each coordinate's position, as on CUDA (the same values up to the last bits of log, sqrt, sin and cos).

uint32 arithmetic in int64 tensors. Philox's 32 x 32-bit products are below 2^64: torch's int64 multiply keeps
their low 64 bits (it wraps; checked once per process against the product split in 16-bit halves, which cannot
overflow and is used instead where the check fails), so one multiply gives both words. Most operations work in
place, and a piece of 2^18 counters (a million normals) at a time, large enough for torch to spread each
operation over threads: on a 2-core machine 16 M normals take about 0.18 s, 11 ns each (the split products, a
fresh tensor per operation and pieces of 2^16 counters took about 26 ns).
"""
from __future__ import annotations

import functools
import math

import torch

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mul_hi_lo_split(c: torch.Tensor, a: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of c * a, c in [0, 2^32) (int64), a a 32-bit constant: a split in 16-bit halves,
    every partial product below 2^49."""
    low16 = c * (a & 0xFFFF)  # < 2^48
    mid = c * (a >> 16) + (low16 >> 16)  # < 2^48 + 2^32
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low16 & 0xFFFF)


def _mul_hi_lo_wrapping(c: torch.Tensor, a: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same words from one int64 multiply, whose wrapped result holds the unsigned product's 64 bits (the
    high word masked: >> is arithmetic on a product at or above 2^63). Returns fresh tensors (the low word's
    and-in-place reuses the product)."""
    p = c * a
    return (p >> 32).bitwise_and_(_M32), p.bitwise_and_(_M32)


@functools.cache
def _mul_hi_lo():
    """The wrapping multiply where this build's int64 kernels wrap (vectorised loop and tail checked), else the
    split one."""
    c = torch.tensor([_M32, _M32 - 1, 1 << 31, (1 << 31) + 12345, 0, 1, 0xDEADBEEF] * 19, dtype=torch.int64)
    for a in (_ROUND_A, _ROUND_B):
        if not all(torch.equal(x, y) for x, y in zip(_mul_hi_lo_wrapping(c, a), _mul_hi_lo_split(c, a))):
            return _mul_hi_lo_split
    return _mul_hi_lo_wrapping


def philox4x32(seed: int, counters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 as Triton's ``tl.randint4x(seed, counters)``: key the seed's two 32-bit words, counter (the
    offset's low word, its high word, 0, 0); four words in [0, 2^32) as int64 tensors."""
    mul = _mul_hi_lo()
    c0, c1 = counters & _M32, (counters >> 32) & _M32
    c2, c3 = torch.zeros_like(c0), torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi0, lo0 = mul(c0, _ROUND_A)
        hi2, lo2 = mul(c2, _ROUND_B)
        c0, c1, c2, c3 = hi2.bitwise_xor_(c1).bitwise_xor_(k0), lo2, hi0.bitwise_xor_(c3).bitwise_xor_(k1), lo0
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def normals4(seed: int, counters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four float64 normals ``triton_kernels.normals4`` makes at each counter."""
    words = philox4x32(seed, counters)
    out = []
    for k, (w, angle) in enumerate(((words[0], words[1]), (words[2], words[3]))):
        u = w.double().add_(0.5).mul_(2.0 ** -32)
        rare = w < 256  # the refinement word only where a radius word needs it (1 in 16 million)
        if rare.any():
            e = philox4x32(seed, counters[rare] + (1 << 32))[2 * k]
            u[rare] = (w[rare].double() + (e.double() + 0.5) * 2.0 ** -32) * 2.0 ** -32
        r = u.log_().mul_(-2.0).sqrt_()
        th = angle.double().mul_(2 * math.pi * 2.0 ** -32)
        out += [torch.cos(th).mul_(r), th.sin_().mul_(r)]
    return tuple(out)


def flat_normals(seed: int, numel: int, block: int, *, piece: int = 1 << 18) -> torch.Tensor:
    """float32 [numel]: dpcompile::randn's layout (program p's counters [p block, (p + 1) block), word j of counter
    p block + l at output 4 p block + j block + l), made a piece of programs at a time."""
    programs = -(-numel // (4 * block))
    out = torch.empty(programs, 4, block, dtype=torch.float32)
    per_piece = max(1, piece // block)
    for p0 in range(0, programs, per_piece):
        p1 = min(programs, p0 + per_piece)
        counters = torch.arange(p0 * block, p1 * block, dtype=torch.int64)
        for j, z in enumerate(normals4(seed, counters)):
            out[p0:p1, j].copy_(z.view(p1 - p0, block))
    return out.view(-1)[:numel]
