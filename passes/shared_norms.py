"""The per-sample norm of a gradient made of several matmul and embedding contributions, without its per-sample
copies: a tied embedding and LM head, or a weight applied twice.

Each such contribution is, per sample, a sum of outer products over the sample's rows: a matmul's weight
gradient A^T G is sum_s a_s (x) g_s, an embedding's is sum_s onehot(id_s) (x) v_s. So the squared norm of
sum_k c_k g_k is sum_k c_k^2 ||g_k||^2 (each term's own form: the Gram kernel, token equality, ...) plus
2 sum_{k<l} c_k c_l <g_k, g_l>, and the inner product of two outer-product sums is
sum_{s,t} <x_s, x'_t> <y_s, y'_t>: two [S, S'] matrices per sample whose entries are Gram entries for dense
factors, gathers for a dense and a one-hot factor (a_s[id_t]) and token equalities for two one-hot ones.
GPT-2's tied [50257, 768] weight at 8 x 1024 tokens: [8, 1024, 1024] matrices instead of two [8, 50257, 768]
fp32 per-sample gradients written, added and read.

Taken only where each local gradient is a sum of the contributions, each moved by transposes, size-1 dims and
casts only and scaled by constants (outer_terms); any other chain is materialised per sample (per_sample_norms).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import GraphBuilder

from .param_grads import NORM_PRESERVING, ParamGrad
from .sample_factors import add_all, bmm_f32, ids_in_range, spans, transpose12

aten = torch.ops.aten

OUTER_KINDS = ("mm", "embedding_backward", "index_put")
_SAME_ENTRIES = (aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
                 torch.ops.prims.convert_element_type.default)


def _moved(ops: list[fx.Node], shape) -> bool | None:
    """Whether a chain of norm-preserving ops (views, size-1 dims added or dropped, permutes, casts) takes an
    [r, c] matrix to itself (False) or to its transpose (True); None for any other chain, and where r or c is
    1 (their dims could not be told from added ones)."""
    r, c = shape
    if r == 1 or c == 1:
        return None
    dims = [("r", r), ("c", c)]  # (which of the source's dims, size); "1" for an added size-1 dim
    for op in ops:
        t, args = op.target, op.args
        n = len(dims)
        if t in _SAME_ENTRIES:
            continue
        if t is aten.unsqueeze.default:
            dims.insert(args[1] % (n + 1), ("1", 1))
        elif t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            drop = ({d % n for d in (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])}
                    if len(args) > 1 else {d for d in range(n) if dims[d][1] == 1})
            if any(dims[d][0] != "1" for d in drop if dims[d][1] == 1):
                return None
            dims = [x for d, x in enumerate(dims) if d not in drop or x[1] != 1]
        elif t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            new = list(op.meta["val"].shape)
            kept = [x for x in dims if x[0] != "1"]
            if [s for s in new if s != 1] != [s for _, s in kept]:
                return None  # entries regrouped, not only size-1 dims moved
            it = iter(kept)
            dims = [next(it) if s != 1 else ("1", 1) for s in new]
        elif t is aten.permute.default:
            dims = [dims[d % n] for d in args[1]]
        elif t is aten.transpose.int:
            i, j = args[1] % n, args[2] % n
            dims[i], dims[j] = dims[j], dims[i]
        elif t is aten.t.default:
            dims = dims[::-1]
        else:
            return None
    order = [x[0] for x in dims]
    return {("r", "c"): False, ("c", "r"): True}.get(tuple(order))


def outer_terms(pg: ParamGrad, chain: set) -> list[tuple[Any, float, bool]] | None:
    """[(contribution, coefficient, transposed)] with this rank's gradient = sum coefficient * (contribution,
    transposed when flagged), or None when a local gradient's chain does anything else (then it is
    materialised per sample). chain: the nodes that depend on the samples (the others are constants)."""
    cmap = {c.node: c for c, _ in pg.terms}
    out: list[tuple[Any, float, bool]] = []

    def walk(node: Any, coef: float, flipped: bool) -> bool:
        moves = []
        while isinstance(node, fx.Node) and node not in cmap and node.target in NORM_PRESERVING:
            moves.append(node)
            node = node.args[0]
        if not isinstance(node, fx.Node) or node.meta.get("val") is None or node.meta["val"].dim() != 2:
            return False
        if moves:
            moved = _moved(moves[::-1], tuple(node.meta["val"].shape))
            if moved is None:
                return False
            flipped ^= moved
        if node in cmap:
            c = cmap[node]
            out.append((c, coef, flipped))
            return c.kind in OUTER_KINDS
        t, args = node.target, node.args
        if t is aten.neg.default:
            return walk(args[0], -coef, flipped)
        if t in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            x, s = args[0], args[1]
            if t in (aten.mul.Tensor, aten.mul.Scalar) and isinstance(x, (int, float)):
                x, s = s, x
            if isinstance(s, bool) or not isinstance(s, (int, float)):
                return False  # a tensor factor: not a constant the analysis can see
            return walk(x, coef * s if t in (aten.mul.Tensor, aten.mul.Scalar) else coef / s, flipped)
        if t in (aten.add.Tensor, aten.sub.Tensor) and not node.kwargs and len(args) == 2:
            x, y = args
            if not all(isinstance(v, fx.Node) and v in chain for v in (x, y)):
                return False
            return walk(x, coef, flipped) and walk(y, -coef if t is aten.sub.Tensor else coef, flipped)
        return False

    for local, beta in pg.local_terms:
        if not walk(local, beta, False):
            return None
    return out if len(out) > 1 else None


def _factors(nb, c, flipped: bool) -> tuple[tuple[str, fx.Node], tuple[str, fx.Node]]:
    """(row factor, column factor) of a contribution's per-sample outer products, in the parameter's
    orientation: ("dense", [B, S, n]) or ("index", [B, S, 1] ids of one-hot rows)."""
    if c.kind == "mm":
        A, G = nb.mm_factors(c)
        x, y = ("dense", A), ("dense", G)
    else:
        V, ids = nb._emb_parts(c)
        x, y = ("index", _int64(nb.b, ids)), ("dense", V)
    return (y, x) if flipped else (x, y)


def _int64(b: GraphBuilder, ids: fx.Node) -> fx.Node:
    if ids.meta["val"].dtype == torch.int64:
        return ids
    return b.call(torch.ops.prims.convert_element_type.default, ids, torch.int64)


def _rows(b: GraphBuilder, f: tuple[str, fx.Node], lo: int, hi: int) -> tuple[str, fx.Node]:
    kind, x = f
    if (lo, hi) == (0, x.meta["val"].shape[1]):
        return f
    return kind, b.call(aten.slice.Tensor, x, 1, lo, hi)


def _inner(b: GraphBuilder, u: tuple[str, fx.Node], v: tuple[str, fx.Node]) -> tuple[str, fx.Node]:
    """[B, S, S'] inner products of u's rows with v's: ("value", fp32) or ("equal", bool) for two one-hot
    factors."""
    (ku, x), (kv, y) = u, v
    if ku == "dense" and kv == "dense":
        return "value", bmm_f32(b, x, transpose12(b, y))
    if ku == "index" and kv == "index":
        return "equal", b.call(aten.eq.Tensor, x, transpose12(b, y))
    if ku == "index":  # <onehot(id_s), y_t> = y_t[id_s]
        return "value", transpose12(b, _gather(b, y, x))
    return "value", _gather(b, x, y)


def _gather(b: GraphBuilder, x: fx.Node, ids: fx.Node) -> fx.Node:
    """[B, S, S'] with [b, s, t] = x[b, s, ids[b, t]] (x [B, S, n], ids [B, S', 1]), in fp32. Ids of rows an
    embedding masks (their values are zeros) are clamped into range: their products are zero either way."""
    B, S, n = x.meta["val"].shape
    ids = ids_in_range(b, ids, n)
    idx = b.call(aten.expand.default, transpose12(b, ids), [B, S, ids.meta["val"].shape[1]])
    return b.f32(b.call(aten.gather.default, x, 2, idx))


def _cross(b: GraphBuilder, nb, f, g) -> fx.Node:
    """[B] <sum_s f_x(s) (x) f_y(s), sum_t g_x(t) (x) g_y(t)> per sample, in blocks of f's rows whose two
    [rows, S'] fp32 matrices stay within the norm block size."""
    S, T = f[0][1].meta["val"].shape[1], g[0][1].meta["val"].shape[1]
    parts = []
    zero = b.call(aten.scalar_tensor.default, 0.0, dtype=torch.float32)
    for lo, hi in spans(S, nb._blocks(2 * S * T * 4, S)):
        fx_, fy = _rows(b, f[0], lo, hi), _rows(b, f[1], lo, hi)
        (k1, p), (k2, q) = _inner(b, fx_, g[0]), _inner(b, fy, g[1])
        if k1 == "equal" and k2 == "equal":
            prod = b.f32(b.call(aten.logical_and.default, p, q))
        elif k1 == "equal" or k2 == "equal":
            mask, val = (p, q) if k1 == "equal" else (q, p)
            prod = b.call(aten.where.self, mask, val, zero)
        else:
            prod = b.call(aten.mul.Tensor, p, q)
        parts.append(b.sum_per_sample(prod))
    return add_all(b, parts)


def shared_sq(nb, terms: list[tuple[Any, float, bool]]) -> tuple[fx.Node, str]:
    """([B] squared norm of sum_k c_k g_k per sample, why) for outer_terms' terms."""
    b = nb.b
    parts, forms = [], []
    with nb.reusing_factors():
        for c, coef, _ in terms:
            sq, algo, _ = nb.sq(c)
            parts.append(sq if coef * coef == 1.0 else b.call(aten.mul.Tensor, sq, coef * coef))
            forms.append(algo)
        factors = [_factors(nb, c, flipped) for c, _, flipped in terms]
    for k in range(len(terms)):
        for l in range(k + 1, len(terms)):
            w = 2.0 * terms[k][1] * terms[l][1]
            parts.append(b.call(aten.mul.Tensor, _cross(b, nb, factors[k], factors[l]), w))
    why = (f"{len(terms)} contributions' own norms ({', '.join(forms)}) and their {len(terms) * (len(terms) - 1) // 2}"
           f" per-sample inner product(s) over row pairs: no per-sample gradient materialised")
    return add_all(b, parts), why

