"""The noise kernels' normals computed with torch ops, for devices without Triton (the CPU): Philox4x32-10 keyed
by the full 64-bit seed, and the Box-Muller of ``triton_kernels.normals4`` (radius uniform (w + 1/2) 2^-32,
refined to 2^-64 below 2^-24 from the words at counter + 2^32, never clamped), in float64.

Why not torch's CPU generator or Inductor's CPU RNG: both key their streams by 32 bits of the seed (mt19937's
seeding; Inductor's ``randn_cpu(uint32_t seed, ...)``), so two of a run's draws repeat each other's numbers with
probability about n^2 / 2^33 for n draws (0.1 for 30 000: a long run's steps times chunks), and two released
gradients with the same noise give away their difference; and both make float32 uniforms of 24 or 31 bits, which
bound the noise at about 5.8 standard deviations. Here every draw is a function of all 64 bits of its seed and of
each coordinate's position, as on CUDA (the same values up to the last bits of log, sqrt, sin and cos).

uint32 arithmetic in int64 tensors: products split in 16-bit halves so that none overflows.
"""
from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mul_hi_lo(c: torch.Tensor, a: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of c * a, c in [0, 2^32) (int64), a a 32-bit constant."""
    low16 = c * (a & 0xFFFF)  # < 2^48
    mid = c * (a >> 16) + (low16 >> 16)  # < 2^48 + 2^32
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low16 & 0xFFFF)


def philox4x32(seed: int, counters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 as Triton's ``tl.randint4x(seed, counters)``: key the seed's two 32-bit words, counter (the
    offset's low word, its high word, 0, 0); four words in [0, 2^32) as int64 tensors."""
    c0, c1 = counters & _M32, (counters >> 32) & _M32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi0, lo0 = _mul_hi_lo(c0, _ROUND_A)
        hi2, lo2 = _mul_hi_lo(c2, _ROUND_B)
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def normals4(seed: int, counters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four float64 normals ``triton_kernels.normals4`` makes at each counter."""
    w1, w2, w3, w4 = philox4x32(seed, counters)
    e1, e3 = torch.zeros_like(w1), torch.zeros_like(w3)
    rare = (w1 < 256) | (w3 < 256)  # the refinement words only where a radius word needs them (1 in 8 million)
    if rare.any():
        f1, _, f3, _ = philox4x32(seed, counters[rare] + (1 << 32))
        e1[rare], e3[rare] = f1, f3
    out = []
    for w, e, angle in ((w1, e1, w2), (w3, e3, w4)):
        w, e = w.double(), e.double()
        u = torch.where(w < 256, (w + (e + 0.5) * 2.0 ** -32) * 2.0 ** -32, (w + 0.5) * 2.0 ** -32)
        r, th = torch.sqrt(-2.0 * torch.log(u)), angle.double() * (2 * math.pi * 2.0 ** -32)
        out += [r * torch.cos(th), r * torch.sin(th)]
    return tuple(out)


def flat_normals(seed: int, numel: int, block: int, *, piece: int = 1 << 16) -> torch.Tensor:
    """float32 [numel]: dpcompile::randn's layout (program p's counters [p block, (p + 1) block), word j of counter
    p block + l at output 4 p block + j block + l), made a piece of programs at a time."""
    programs = -(-numel // (4 * block))
    out = torch.empty(programs * 4 * block, dtype=torch.float32)
    per_piece = max(1, piece // block)
    for p0 in range(0, programs, per_piece):
        p1 = min(programs, p0 + per_piece)
        counters = torch.arange(p0 * block, p1 * block, dtype=torch.int64)
        words = torch.stack(normals4(seed, counters))  # [4, (p1 - p0) block]
        out[p0 * 4 * block: p1 * 4 * block] = words.view(4, p1 - p0, block).transpose(0, 1).reshape(-1).float()
    return out[:numel]
