"""Noise added to gradients in one pass over them: ``torch.ops.dpcompile.add_randn(grads, seeds, index, scale,
out_dtype)`` returns ``[(g + scale * z_g).to(out_dtype) for g in grads]`` (computed in fp32; out_dtype None: each
gradient's own), z standard normal, four normals per Philox call.

The noise pass drew a chunk of parameters' noise as one flat vector (``dpcompile::randn``) and added its slices
with a foreach add: the draw written once and read once, on top of reading the gradients and writing the noisy
ones, 16 bytes per fp32 coordinate where 8 suffice (a Llama-3.2-1B step on one H100: 2.85 ms of draws and 3.28
ms of adds for 0.72 G coordinates, against about 1.9 ms to read and write them once). This op makes each normal
in registers and adds it where the gradient is read: one launch per chunk, every gradient read and written
once. out_dtype takes in the cast of a low-precision gradient to its parameter's dtype (bf16 autocast, fp32
parameters): the bf16 gradient is read, not an fp32 copy of it written first.

The draws are ``dpcompile::randn``'s: tensor k of the call gets the coordinates of one flat draw (seed
``seeds[index]``) that start at a multiple of a program's 4096 outputs (``tile_starts``), so every coordinate of
every tensor has a Philox counter and word of its own; within a tensor, coordinates follow its memory order (its
strides: a transposed gradient gets the same noise values in a different arrangement, each coordinate still one
draw). The outputs have the gradients' layout (``empty_like``); a gradient that is not dense is copied into it
first. Values are the same on every device and every way of running, up to the last bits of the transform's
log, sqrt, sin and cos: the Triton kernel (CUDA; CPU tensors under ``TRITON_INTERPRET=1``) and the reference
below, which slices ``dpcompile::randn``'s flat draw (computed with torch ops where there is no Triton:
dpcompile.philox).

CUDA launches: one for all tensors of one pair of dtypes, through a table of their addresses (dpcompile.address_tables:
five entries per tensor, also under CUDA graph capture). ``per_tensor`` launches (one per tensor, addresses as
arguments) remain for comparison, and for a capture without pinned memory set aside for its table.
"""
from __future__ import annotations

import os

import torch

from . import address_tables, kernel_plans
from . import randn as _randn

BLOCK = _randn.BLOCK  # counters per program, as dpcompile::randn: the same draw
TILE = 4 * BLOCK  # outputs per program
# 8 warps: 1.3x the throughput of 4 (0.34 against 0.44 ms for 122 M bf16 -> fp32 coordinates on one H100,
# benchmarks/noise_kernel.py, BENCHMARKS.md); a program's values do not depend on it
NUM_WARPS = 8
_CONSTS = {"BLOCK": BLOCK, "num_warps": NUM_WARPS}

_LIB = torch.library.Library("dpcompile", "FRAGMENT")
# nondeterministic_seeded: never recomputed or merged with another call by the partitioner or CSE
_LIB.define("add_randn(Tensor[] grads, Tensor seeds, int index, Tensor scale, ScalarType? out_dtype=None) "
            "-> Tensor[]", tags=(torch.Tag.nondeterministic_seeded,))


def tile_starts(numels: list[int]) -> tuple[list[int], int]:
    """Each tensor's first program (of TILE outputs) in the flat draw, and the draw's programs in all."""
    starts, total = [], 0
    for n in numels:
        starts.append(total)
        total += -(-n // TILE)
    return starts, total


def add_randn(grads: list[torch.Tensor], seeds: torch.Tensor, index: int, scale: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    _check(grads, seeds, index, scale, out_dtype)
    outs = [torch.empty_like(g, dtype=out_dtype) for g in grads]
    srcs = sources(grads, outs)
    scale = scale.to(torch.float32)
    if seeds.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        launch(srcs, outs, seeds, index, scale)
    else:
        reference(srcs, outs, seeds, index, scale)
    return outs


_LIB.impl("add_randn", add_randn, "CompositeExplicitAutograd")


@torch.library.register_fake("dpcompile::add_randn", lib=_LIB)
def _(grads, seeds, index, scale, out_dtype=None):
    return [torch.empty_like(g, dtype=out_dtype) for g in grads]


def sources(grads: list[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient in its output's layout, what the kernels and the reference read: the gradient itself
    (empty_like keeps the strides of a dense tensor only), or a copy into the output, which then takes the noise
    in place."""
    return [g if g.stride() == o.stride() else o.copy_(g) for g, o in zip(grads, outs)]


def _check(grads, seeds, index, scale, out_dtype) -> None:
    if seeds.dtype != torch.int64 or seeds.dim() != 1 or not 0 <= index < seeds.numel():
        raise ValueError(f"dpcompile::add_randn: seeds must be a 1-D int64 tensor holding entry {index}, got "
                         f"{seeds.dtype} {tuple(seeds.shape)}")
    if scale.numel() != 1:
        raise ValueError(f"dpcompile::add_randn: scale must have one element, got shape {tuple(scale.shape)}")
    for g in grads:
        if not g.is_floating_point() or g.device != seeds.device:
            raise ValueError(f"dpcompile::add_randn: every gradient must be floating point on the seeds' device "
                             f"{seeds.device}, got {g.dtype} on {g.device}")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise ValueError(f"dpcompile::add_randn: out_dtype must be a floating point dtype, got {out_dtype}")


def _memory_flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as a 1-D view in memory order."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def reference(srcs, outs, seeds, index, scale) -> None:
    """The kernel's values from dpcompile::randn's flat draw, sliced at each tensor's first program."""
    starts, total = tile_starts([s.numel() for s in srcs])
    z = _randn.randn(seeds, index, total * TILE)
    for s, o, start in zip(srcs, outs, starts):
        n = s.numel()
        noisy = _memory_flat(s).float() + scale * z[start * TILE: start * TILE + n]
        _memory_flat(o).copy_(noisy.to(o.dtype))


def launch(srcs, outs, seeds, index, scale, *, per_tensor: bool = False) -> None:
    """The Triton kernels (on CPU tensors too under TRITON_INTERPRET=1): one launch per pair of dtypes through an
    address table (captured with its copy while a CUDA graph is), or (per_tensor) one launch per tensor."""
    from dpcompile import triton_kernels

    starts, _ = tile_starts([s.numel() for s in srcs])
    recording = kernel_plans.is_recording()  # fake tensors (dpcompile.precompile): no addresses
    by_dtype: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for k, (s, o) in enumerate(zip(srcs, outs)):
        if s.numel():
            by_dtype.setdefault((s.dtype, o.dtype), []).append(k)
    for ks in by_dtype.values():
        entries, first = [], 0  # five per tensor: addresses, numel, first program here and in the flat draw
        for k in ks:
            n = srcs[k].numel()
            entries += (0, 0, n, first, starts[k]) if recording else \
                (srcs[k].data_ptr(), outs[k].data_ptr(), n, first, starts[k])
            first += -(-n // TILE)
        table = None if per_tensor else address_tables.table(entries, seeds.device)
        if table is None:
            for k in ks:
                n = srcs[k].numel()
                kernel_plans.launch(triton_kernels.add_randn_one_kernel, (-(-n // TILE),),
                                    (srcs[k], outs[k], n, starts[k], seeds, index, scale), _CONSTS)
            continue
        kernel_plans.launch(triton_kernels.add_randn_kernel, (first,),
                            (table, len(ks), srcs[ks[0]], outs[ks[0]], seeds, index, scale), _CONSTS)
