"""Per-sample squared norms of a grouped matmul's weight gradient (routed experts over rows sorted by expert).

The gradient is grad_w[e] = sum over sorted rows r in group e of x[r]^T g[r], each row of one sample
(passes.rules.row_order). Both forms first put the rows back in sample order (a scatter by the sort's
permutation) with each row's group, read from the offsets as the grouped matmul does (rows past the last offset
belong to none), then:

- ghost: sum over pairs of one sample's rows in the same group of <x_r, x_s> <g_r, g_s> (two [B, R, R] Grams,
  masked by group equality), R the sample's rows;
- direct: each sample's [E, p, m] gradient, sum_r x_r^T (onehot(group_r) g_r), one batched matmul.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import GraphBuilder

from .batch_state import Batched, Contribution, Permuted
from .rules.row_order import perm_of
from .sample_factors import bmm_f32, sample_major

aten = torch.ops.aten


def _positions(c: Contribution) -> tuple[int, int]:
    """(the operand whose features are the gradient's rows p, the one whose features are its columns m)."""
    first, second = sorted(c.layouts)
    return first, second


def row_samples(b: GraphBuilder, lay: Permuted, B: Any) -> fx.Node:
    """[S] int64: the sample of each sorted row, (perm[r] // inner) % B."""
    key = ("row_samples", lay.sort, str(lay.inner), str(B))
    if key not in b.memo:
        perm = perm_of(lay.sort, b)
        b.memo[key] = b.call(aten.remainder.Scalar,
                             b.call(aten.div.Tensor_mode, perm, lay.inner, rounding_mode="floor"), B)
    return b.memo[key]


def in_sample_order(b: GraphBuilder, v: fx.Node, lay: Permuted) -> tuple[fx.Node, Batched]:
    """v with sorted rows on lay.dim (any dim of a 2-D value, else dim 0) scattered back to sample order on dim 0:
    row perm[r] <- row r."""
    if lay.dim != 0:
        assert v.meta["val"].dim() == 2, lay
        v = b.permute(v, [1, 0])
    val = v.meta["val"]
    zeros = b.call(aten.full.default, list(val.shape), 0, dtype=val.dtype, device=val.device)
    out = b.call(aten.index_put.default, zeros, [perm_of(lay.sort, b)], v, False)
    return out, Batched(0, lay.outer, lay.inner)


class GroupedNorms:
    def __init__(self, nb):
        self.nb = nb

    def factors(self, c: Contribution):
        return self.nb._once(c, self._factors)

    def _factors(self, c: Contribution):
        """X [B, R, p], G [B, R, m] in their dtypes, K [B, R] each row's group (E: none)."""
        b, B = self.nb.b, self.nb.B
        i, j = _positions(c)
        out = []
        for pos in (i, j):
            v, lay = in_sample_order(b, c.node.args[pos], c.layouts[pos])
            out.append(sample_major(b, v, lay, [1], B))
        lay = c.layouts[i]
        S = c.node.args[i].meta["val"].shape[lay.dim]
        offs = b.call(torch.ops.prims.convert_element_type.default, c.extra["offs"], torch.int64)
        rows = b.arange(S, offs.meta["val"].device)
        groups = b.call(aten.searchsorted.Tensor, offs, rows, right=True)  # row r in group e: offs[e-1] <= r < offs[e]
        g, glay = in_sample_order(b, b.view(groups, [S, 1]), lay.moved(0))
        K = sample_major(b, g, glay, [1], B)
        return out[0], out[1], b.view(K, list(K.meta["val"].shape[:2]))

    def algorithm(self, c: Contribution) -> tuple[str, str]:
        i, j = _positions(c)
        lay = c.layouts[i]
        R = lay.outer * lay.inner
        p = c.node.args[i].meta["val"].shape[1 - lay.dim]
        m = c.node.args[j].meta["val"].shape[1 - c.layouts[j].dim]
        E = c.extra["groups"]
        choice = self.nb.ctx.options.linear_norm
        if choice != "auto":
            return choice, f"forced by linear_norm={choice!r}"
        try:
            ghost, direct = int(R * R * (p + m)), int(R * p * E * m)
        except TypeError:
            return "ghost", "symbolic shapes: ghost form"
        return ("ghost" if ghost <= direct else "direct"), \
            f"R={R} rows per sample, p={p}, m={m}, {E} groups: ghost {ghost:.3g} vs direct {direct:.3g} " \
            "multiply-adds per sample"

    def sq(self, c: Contribution) -> tuple[fx.Node, str, str]:
        b = self.nb.b
        algo, why = self.algorithm(c)
        why = "grouped matmul, rows in sample order by the sort's permutation; " + why
        if algo == "direct":
            return b.sq_sum_per_sample(self.materialize(c)), "direct", why
        X, G, K = self.factors(c)
        Bn, R = K.meta["val"].shape
        same = b.call(aten.eq.Tensor, b.view(K, [Bn, R, 1]), b.view(K, [Bn, 1, R]))
        real = b.call(aten.lt.Scalar, b.view(K, [Bn, R, 1]), c.extra["groups"])
        mask = b.call(aten.logical_and.default, same, real)
        gx = bmm_f32(b, X, b.permute(X, [0, 2, 1]))
        gg = bmm_f32(b, G, b.permute(G, [0, 2, 1]))
        zero = b.call(aten.scalar_tensor.default, 0.0, dtype=torch.float32)
        prod = b.call(aten.where.self, mask, b.call(aten.mul.Tensor, gx, gg), zero)
        return b.sum_per_sample(prod), "ghost", why

    def materialize(self, c: Contribution) -> fx.Node:
        """[B, E, p, m] fp32: each sample's gradient."""
        b = self.nb.b
        X, G, K = self.factors(c)
        Bn, R, m = G.meta["val"].shape
        p = X.meta["val"].shape[2]
        E = c.extra["groups"]
        onehot = b.call(aten.eq.Tensor, b.view(K, [Bn, R, 1]), b.view(b.arange(E, K.meta["val"].device), [1, 1, E]))
        onehot = b.call(torch.ops.prims.convert_element_type.default, onehot, torch.float32)
        spread = b.call(aten.mul.Tensor, b.view(b.f32(G), [Bn, R, 1, m]), b.view(onehot, [Bn, R, E, 1]))
        grads = bmm_f32(b, b.permute(X, [0, 2, 1]), b.reshape(spread, [Bn, R, E * m]))  # [B, p, E*m]
        return b.permute(b.view(grads, [Bn, p, E, m]), [0, 2, 1, 3])
