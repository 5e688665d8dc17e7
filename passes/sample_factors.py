"""Per-sample operands of a contraction, and their contraction in fp32: the factors every per-sample norm form
(passes.per_sample_norms, passes.conv_norms) builds on."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import GraphBuilder, known, permutation_of

from .batch_state import Batched

aten = torch.ops.aten


def sample_major(b: GraphBuilder, x: fx.Node, lay: Batched, feature_dims: list[int], B: Any,
                 lead: tuple[int, ...] = ()) -> fx.Node:
    """x with samples on ``lay`` -> [B, S, F]: S = the sample's rows, F = features. With ``lead`` dims (a batched
    matmul's batch dim H): [B * H, S, F], sample-major, each (sample, h) its own rows."""
    shape = list(x.meta["val"].shape)
    d = lay.dim
    split = shape[:d] + [lay.outer, B, lay.inner] + shape[d + 1 :]
    newpos = lambda k: k if k < d else k + 2  # noqa: E731
    feats = [newpos(f) for f in feature_dims]
    leads = [newpos(k) for k in lead]
    rows = [k for k in range(len(split)) if k != d + 1 and k not in feats and k not in leads]
    order = [d + 1] + leads + rows + feats
    S = 1
    for k in rows:
        S = S * split[k]
    F = 1
    for k in feats:
        F = F * split[k]
    n = B
    for k in leads:
        n = n * split[k]
    # where the wanted order is the elements' own (only size-one dims move), one reshape of x, or of the
    # tensor x transposes (a weight gradient's mm reads its operand transposed): fewer nodes for every pass
    # after this one, the partition and Inductor to handle
    source = _reshape_source(x, split, d, order)
    if source is not None:
        return b.reshape(source, [n, S, F])
    xs = b.view(x, split)
    xs = b.permute(xs, order)
    if not known(lay.outer == 1):
        # samples inside the rows (a sequence-first [T, B, d] activation): copied sample-major, as an eager
        # reshape would. Inductor otherwise keeps the reshape a view when it only drops size-one dims, and
        # its batched-matmul lowering, handed an operand whose sample stride is 1 and whose other strides
        # are multiples of an unbacked batch size (a sharded step's), failed on a guard of that size
        xs = b.call(aten.clone.default, xs, memory_format=torch.contiguous_format)
    return b.reshape(xs, [n, S, F])


def _in_memory_order(sizes: list, positions: list[int]) -> bool:
    """Whether taking the dims at ``positions`` in that order (every dim once) keeps the elements' row-major
    order: the dims not of size one (statically) appear in increasing position."""
    kept = [q for q in positions if not known(sizes[q] == 1)]
    return kept == sorted(kept)


def _reshape_source(x: fx.Node, split: list, d: int, order: list[int]) -> fx.Node | None:
    """A tensor whose reshape to ``order``'s dims of x's ``split`` (x with dim d split into outer, B, inner)
    is that permuted split: x itself when ``order`` keeps its elements' order, or the input y of x =
    y.permute(p) when ``order`` keeps y's. None otherwise."""
    if _in_memory_order(split, order):
        return x
    p = permutation_of(x)
    if p is None or not isinstance(x.args[0], fx.Node):
        return None
    y, yd = x.args[0], p[d]

    def y_pos(q: int) -> int:  # split position q of x -> position of the same dim in y's split at yd
        if d <= q <= d + 2:
            return yd + (q - d)
        j = p[q if q < d else q - 2]
        return j if j < yd else j + 2

    y_shape = list(y.meta["val"].shape)
    y_split = y_shape[:yd] + split[d: d + 3] + y_shape[yd + 1:]
    return y if _in_memory_order(y_split, [y_pos(q) for q in order]) else None


def transpose12(b: GraphBuilder, x: fx.Node) -> fx.Node:
    return b.permute(x, [0, 2, 1])


# Two bf16 (or two fp16) values multiply exactly in fp32, so a contraction of
# low-precision factors with an fp32 result and fp32 accumulation computes
# what the fp32 contraction of the upcast factors does (up to the order of the
# sum), on tensor cores instead of CUDA cores (Llama-1B: 149 ms of fp32 norm
# contractions per step on an H200). aten.bmm.dtype exists on CUDA only.
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def bmm_f32(b: GraphBuilder, x: fx.Node, y: fx.Node) -> fx.Node:
    """[B, n, k] @ [B, k, m] -> fp32 [B, n, m], accumulated in fp32."""
    xv, yv = x.meta["val"], y.meta["val"]
    if (xv.device.type == "cuda" and xv.dtype == yv.dtype and xv.dtype in _LOW_PRECISION
            and "dtype" in aten.bmm.overloads()):
        return b.call(aten.bmm.dtype, x, y, torch.float32)
    return b.call(aten.bmm.default, b.f32(x), b.f32(y))


def spans(n: int, k: int) -> list[tuple[int, int]]:
    """k contiguous [lo, hi) spans covering range(n), sizes differing by at most one."""
    if k == 1:
        return [(0, n)]
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def add_all(b: GraphBuilder, parts: list[fx.Node]) -> fx.Node:
    total = parts[0]
    for part in parts[1:]:
        total = b.call(aten.add.Tensor, total, part)
    return total


def ids_in_range(b: GraphBuilder, ids: fx.Node, n: Any) -> fx.Node:
    """ids clamped to [0, n): the rows a scatter or gather masks carry zero values, so any id in range serves,
    and an out-of-range one (a padding or ignore id) must not reach the indexing op."""
    return b.call(aten.clamp_max.default, b.call(aten.clamp_min.default, ids, 0), n - 1)
