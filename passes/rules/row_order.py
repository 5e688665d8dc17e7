"""Rows sorted across the batch: routed experts in the grouped form.

Hugging Face's default ``experts_implementation="grouped_mm"`` (and torchtitan's MoE) sorts the batch's
(token, expert) pairs by expert, runs each expert's weight on its contiguous block of rows with one grouped
matmul, and puts the rows back in order. Rows of different samples sit side by side in that order, so the
Batched layouts (sample = index // inner) cannot describe them; ``Permuted`` keeps the sort's permutation
instead: row r is element perm[r] of a sample-major dim and belongs to sample (perm[r] // inner) % B.

- sort of a sample-major 1-D tensor along its samples: values ``Permuted(keys=True)``, indices ``PermIndex``
  (passes.rules.reductions sends it here);
- ``x[perm // k]`` of rows in sample order: ``Permuted``; an iota scattered to perm: ``InversePerm``, and sorted
  rows indexed by it are in sample order again; the scatter-adds of the backward go the other way;
- the keys' histogram in bins, proven to hold every key (the keys are top-k or argmax indices), and its
  cumulative sum: ``GroupOffsets``; a grouped matmul of sorted rows by sample-free weights with those offsets
  keeps rows apart (row r lies in group key[r], its own routing), and its weight gradient is a "grouped"
  contribution (the norm pass's GroupedNorms);
- every other op reading sorted rows goes through the ordinary rule with each row taken for a sample of its own
  (``lifted``): what the rule proves then is that every output row depends on the same input row alone.

Anything else meeting these states is refused, naming the op.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import known, op_name

from ..batch_state import (COLLECTIVE_REDUCTIONS, FREE, Batched, Contribution, GroupOffsets, InversePerm, Mixed,
                           Permuted, PermIndex, Reduced, is_zero_constant, ndim, shape_of)

aten = torch.ops.aten
prims = torch.ops.prims

_VALUE_CASTS = {prims.convert_element_type.default, aten._to_copy.default, aten.clone.default,
                aten.alias.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_EXACT_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)
_INDEX_PUTS = {aten.index_put.default, aten._unsafe_index_put.default}
# transformers' grouped matmul outside bf16 and its backward, by name (fx_utils.op_name): transformers registers them
FALLBACK_FORWARD = "transformers.grouped_mm_fallback.default"
FALLBACK_BACKWARD = "transformers.grouped_mm_fallback_backward.default"


def sort_rows(an, node) -> Any:
    """sort along the sample dim of a 1-D sample-major tensor (the routed experts' ids): values and indices
    whose rows are a permutation of the samples' elements. None where the sort is of another shape (mixed)."""
    x = node.args[0]
    s = an.st(x)
    if not (isinstance(s, Batched) and s.dim == 0 and ndim(x) == 1):
        return None
    return (Permuted(node, s.outer, s.inner, 0, keys=True), PermIndex(node, 1))


def perm_of(sort: fx.Node, b=None) -> fx.Node:
    """The node holding a sort's permutation (its getitem 1), made with builder b where there is none."""
    for u in sort.users:
        if u.target is operator.getitem and u.args[1] == 1:
            return u
    assert b is not None, sort
    return b.call(operator.getitem, sort, 1)


def _refuse(an, node, why: str):
    return an.refuse(node, why, "run the experts in sample order (Hugging Face: experts_implementation="
                     "\"batched_mm\"), or file an issue with this op")


def state(an, node: fx.Node) -> Any:
    """The state of a node one of whose inputs is in a row-order state (batch_dims dispatches here)."""
    states = {a: an.states[a] for a in node.all_input_nodes}
    for s in states.values():
        if isinstance(s, Mixed):
            raise an._mixing_error(node, s)
        if isinstance(s, Reduced):
            raise an._mixing_error(node, Mixed(s.origin, "a sum over the samples"))
    t = node.target
    name = op_name(node)
    if t is aten.index.Tensor:
        return _index(an, node)
    if t in _INDEX_PUTS:
        return _index_put(an, node)
    if t in (aten.div.Tensor_mode, aten.floor_divide.default) and isinstance(an.st(node.args[0]), PermIndex):
        return _perm_floordiv(an, node)
    if t in (aten.sort.default, aten.sort.stable) and isinstance(an.st(node.args[0]), PermIndex):
        return _argsort_of_perm(an, node)
    if t is aten.histc.default:
        return _histc(an, node)
    if t is aten.cumsum.default and isinstance(an.st(node.args[0]), GroupOffsets):
        return _cumsum(an, node)
    if t is aten._grouped_mm.default or name == FALLBACK_FORWARD:
        return _grouped_mm(an, node)
    if name == FALLBACK_BACKWARD:
        return _fallback_backward(an, node)
    others = [s for s in states.values() if not (s is FREE or isinstance(s, Permuted))]
    if others:
        raise _refuse(an, node, f"combines rows sorted across the batch with {_describe(others[0])}")
    return lifted(an, node)


def _describe(s) -> str:
    if isinstance(s, Batched):
        return "rows in sample order"
    if isinstance(s, PermIndex):
        return "a sort's permutation used as a value"
    if isinstance(s, InversePerm):
        return "an inverse permutation used as a value"
    if isinstance(s, GroupOffsets):
        return "group offsets used as a value"
    return str(s)


def _rows(states) -> Permuted | None:
    """The one row order of these states (the first Permuted), or None where two differ."""
    perms = [s for s in states if isinstance(s, Permuted)]
    first = perms[0]
    for p in perms[1:]:
        if p.sort is not first.sort or not (known(p.inner == first.inner) and known(p.outer == first.outer)):
            return None
    return first


def lifted(an, node: fx.Node) -> Any:
    """The ordinary rule of node's op, run with each sorted row taken for a sample of its own: the rule's
    proof that an output slice depends only on the same input slices is then the proof that each output row
    depends only on the same input row, whose sample the permutation tells."""
    from . import rule_for

    states = {a: an.states[a] for a in node.all_input_nodes}
    rows = _rows(list(states.values()))
    if rows is None:
        raise _refuse(an, node, "combines rows of two different sorts (or of one sort laid out differently)")
    t = node.target
    rule = rule_for(t)
    if rule is None or t in COLLECTIVE_REDUCTIONS or str(getattr(t, "namespace", "")).endswith("c10d_functional"):
        raise _refuse(an, node, "this op reads rows sorted across the batch and dpcompile has no rule proving it "
                                "keeps rows apart")
    x = next(a for a, s in states.items() if isinstance(s, Permuted))
    S = shape_of(x)[states[x].dim]
    saved_B, before = an.B, set(an.contributions)
    try:
        an.B = S
        for a, s in states.items():
            if isinstance(s, Permuted):
                an.states[a] = Batched(s.dim)
        out = rule(an, node)
    finally:
        an.B = saved_B
        for a, s in states.items():
            an.states[a] = s
    added = set(an.contributions) - before
    for k in added:
        _sorted_rows_contribution(an, node, an.contributions[k], rows)
    keys = t in _VALUE_CASTS and states.get(node.args[0]) is rows and rows.keys and ndim(node) == 1 and \
        node.meta["val"].dtype in _EXACT_DTYPES

    def back(o, val):
        if o is FREE or o is None or isinstance(o, Reduced) and o.origin in added:
            return o
        if isinstance(o, Batched) and o.dim is not None and known(o.outer == 1) and known(o.inner == 1) \
                and known(val.shape[o.dim] == S):
            return Permuted(rows.sort, rows.outer, rows.inner, o.dim, keys=keys)
        if isinstance(o, Mixed):
            raise _refuse(an, node, f"mixes rows sorted across the batch, each of its own sample ({o.why}, the "
                                    "sorted rows taken for the samples)")
        raise _refuse(an, node, "moves values between rows sorted across the batch")

    v = node.meta["val"]
    if isinstance(out, tuple):
        return tuple(back(o, vv) for o, vv in zip(out, v))
    return back(out, v)


def _sorted_rows_contribution(an, node: fx.Node, c: Contribution, rows: Permuted) -> None:
    """A contribution the ordinary rule found over sorted rows taken for samples: a table's rows scattered by
    per-row ids (the gradient of expert biases or weights gathered per sorted row) is one over the rows of the
    samples the permutation tells, each row's own (the norm pass puts them back in sample order); any other
    kind is refused."""
    lays = list(c.layouts.values())
    ok = c.kind == "index_put" and c.extra.get("mask") is None and all(
        isinstance(lay, Batched) and lay.dim == 0 and known(lay.outer == 1) and known(lay.inner == 1)
        for lay in lays) and isinstance(an.st(c.extra["indices"]), Permuted) and ndim(c.extra["indices"]) == 1
    if not ok:
        del an.contributions[c.node]
        raise _refuse(an, node, "sums rows sorted across the batch into a gradient in a form dpcompile has no "
                                "per-sample norm for")
    c.layouts = {k: Permuted(rows.sort, rows.outer, rows.inner, 0) for k in c.layouts}


def _index(an, node: fx.Node) -> Any:
    x, indices = node.args[0], list(node.args[1])
    sx = an.st(x)
    tens = [i for i in indices if i is not None]
    si = [an.st(i) for i in tens]
    if not any(isinstance(s, (PermIndex, InversePerm)) for s in si):
        if all(s is FREE or isinstance(s, Permuted) for s in [sx, *si]):
            return lifted(an, node)  # sorted rows gathered along other dims, or a table read by sorted ids
        raise _refuse(an, node, "indexes sorted rows with indices in sample order")
    if len(indices) != 1:
        raise _refuse(an, node, "indexes with a permutation and further indices")
    (s_idx,) = si
    if isinstance(s_idx, PermIndex) and isinstance(sx, Batched) and sx.dim == 0:
        # row r is x's row perm[r] // k, of sample (perm[r] // (k * inner)) % B
        inner = s_idx.k * sx.inner
        S = shape_of(node)[0]
        if not known(S % (an.B * inner) == 0):
            raise _refuse(an, node, "gathers rows by a permutation of another length")
        return Permuted(s_idx.sort, S // (an.B * inner), inner, 0)
    if isinstance(s_idx, InversePerm) and isinstance(sx, Permuted) and sx.dim == 0 and sx.sort is s_idx.sort:
        # row j is sorted row inv[j]: element j of the sample-major dim again
        return Batched(0, sx.outer, sx.inner)
    raise _refuse(an, node, "indexes with a permutation rows it does not order")


def _is_iota_of(v: Any, n: Any) -> bool:
    if not (isinstance(v, fx.Node) and v.op == "call_function"):
        return False
    def size(a):  # an int, or the SymInt a size node holds (a sharded step's batch size is unbacked)
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    if v.target is prims.iota.default:
        return v.kwargs.get("start", 0) == 0 and v.kwargs.get("step", 1) == 1 and known(size(v.args[0]) == n)
    if v.target is aten.arange.default:
        return known(size(v.args[0]) == n)
    return False


def _index_put(an, node: fx.Node) -> Any:
    dest, indices, values = node.args[0], list(node.args[1]), node.args[2]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    sd, sv = an.st(dest), an.st(values)
    si = [an.st(i) for i in indices if i is not None]
    if len(indices) != 1 or not any(isinstance(s, (PermIndex, InversePerm)) for s in si):
        if sd is FREE and all(isinstance(s, Permuted) or s is FREE for s in [sv, *si]):
            return lifted(an, node)  # (a scatter-add of sorted rows by sorted ids: refused there as a sum)
        raise _refuse(an, node, "scatters sorted rows with per-sample indices")
    (s_idx,) = si
    if sd is not FREE:
        raise _refuse(an, node, "scatters by a permutation into per-sample values")
    n = shape_of(dest)[0]
    if isinstance(s_idx, PermIndex) and s_idx.k == 1 and sv is FREE and _is_iota_of(values, n) and not accumulate \
            and ndim(dest) == 1 and known(n == shape_of(indices[0])[0]):
        return InversePerm(s_idx.sort)  # inv[perm[r]] = r
    if not is_zero_constant(dest) and not _zeros_of(dest):
        raise _refuse(an, node, "scatters by a permutation into a tensor that is not zeros")
    if isinstance(s_idx, InversePerm) and isinstance(sv, Batched) and sv.dim == 0:
        return Permuted(s_idx.sort, sv.outer, sv.inner, 0)  # out[inv[j]] = v[j]: out[r] = v[perm[r]]
    if isinstance(s_idx, PermIndex) and isinstance(sv, Permuted) and sv.dim == 0 and sv.sort is s_idx.sort:
        # out[perm[r] // k] += v[r]: the k rows of one element of the gather's source, all of its sample
        k = s_idx.k
        if (k != 1 and not accumulate) or not known(sv.inner % k == 0):
            raise _refuse(an, node, "scatters sorted rows to positions of another layout")
        inner = sv.inner // k
        M = shape_of(node)[0]
        if not known(M % (an.B * inner) == 0):
            raise _refuse(an, node, "scatters sorted rows to positions of another layout")
        return Batched(0, M // (an.B * inner), inner)
    raise _refuse(an, node, "scatters by a permutation rows it does not order")


def _descending(sort: fx.Node) -> bool:
    if sort.target is aten.sort.default and len(sort.args) > 2:
        return bool(sort.args[2])
    return bool(sort.kwargs.get("descending", False))


def _argsort_of_perm(an, node: fx.Node) -> Any:
    """perm.argsort(): the sorted values are 0, 1, ..., S - 1 (sample-free) and the indices perm's inverse."""
    s = an.st(node.args[0])
    if s.k != 1 or ndim(node.args[0]) != 1 or _descending(node):
        raise _refuse(an, node, "sorts a permutation other than to invert it")
    return (FREE, InversePerm(s.sort))


def _zeros_of(n: Any) -> bool:
    """A zeros tensor made by the decompositions (full(shape, 0) under another name)."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in (aten.full.default,
                                                                              aten.new_zeros.default) and \
        (n.target is aten.new_zeros.default or n.args[1] == 0)


def _perm_floordiv(an, node: fx.Node) -> Any:
    s, k = an.st(node.args[0]), node.args[1]
    mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
    if node.target is aten.div.Tensor_mode and mode != "floor" or not isinstance(k, int) or k <= 0:
        raise _refuse(an, node, "computes with a sort's permutation other than dividing it by a whole number")
    return PermIndex(s.sort, s.k * k)


_INDEX_SOURCES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
                  aten.alias.default, prims.convert_element_type.default, aten._to_copy.default,
                  aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default, aten.flatten.using_ints}


def key_bound(x: fx.Node) -> Any:
    """n where every value of x is provably in [0, n): x is (a view or cast of) top-k, max or argmax indices over
    a dim of size n (a router's choice of experts), or a concatenation of such. None otherwise."""
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _INDEX_SOURCES:
        if x.target in (prims.convert_element_type.default, aten._to_copy.default) and \
                x.meta["val"].dtype not in (torch.int32, torch.int64):
            return None
        x = x.args[0]
    if not (isinstance(x, fx.Node) and x.op == "call_function"):
        return None
    if x.target is aten.cat.default:  # the choices of several routing steps side by side (PhiMoE's sparsemixer)
        bounds = [key_bound(p) for p in x.args[0]]
        return None if any(n is None or not isinstance(n, int) for n in bounds) else max(bounds)
    if x.target is operator.getitem and x.args[1] == 1 and x.args[0].target in (aten.topk.default,
                                                                                aten.max.dim, aten.min.dim):
        src = x.args[0]
        dim = src.args[2] if src.target is aten.topk.default and len(src.args) > 2 else \
            src.kwargs.get("dim", -1) if src.target is aten.topk.default else src.args[1]
        return shape_of(src.args[0])[dim % ndim(src.args[0])]
    if x.target in (aten.argmax.default, aten.argmin.default) and len(x.args) > 1 and x.args[1] is not None:
        return shape_of(x.args[0])[x.args[1] % ndim(x.args[0])]
    return None


def key_source(x: fx.Node) -> fx.Node:
    """x through views, reshapes, copies and exact casts: tensors with one source hold one multiset of values,
    so their counts per value agree."""
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _INDEX_SOURCES and \
            x.meta["val"].dtype in _EXACT_DTYPES:
        x = x.args[0]
    return x


def _histc(an, node: fx.Node) -> Any:
    """Counts of a router's choices in bins that hold every choice: of a sort's keys (Permuted keys) or of the
    keys before they are sorted (rows in sample order: the counts torchtitan takes), which the grouped
    matmul's rule matches to the sort of the same keys."""
    x = node.args[0]
    s = an.st(x)
    bins, lo, hi = (list(node.args[1:]) + [100, 0, 0][len(node.args) - 1:])[:3]
    bins, lo, hi = node.kwargs.get("bins", bins), node.kwargs.get("min", lo), node.kwargs.get("max", hi)
    if isinstance(s, Permuted) and s.keys:
        if _descending(s.sort):  # offsets count groups in ascending order: row r's group would be another's count
            raise _refuse(an, node, "counts the keys of a descending sort")
        keys, sort = s.sort.args[0], s.sort
    elif isinstance(s, Batched) and s.dim == 0 and ndim(x) == 1:
        keys, sort = key_source(x), None
    else:
        raise _refuse(an, node, "counts values of rows sorted across the batch other than the sort's keys")
    n = key_bound(keys)
    if n is None or not isinstance(n, int):
        raise _refuse(an, node, "counts keys not proven to lie in a known range (a router's top-k indices)")
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo <= 0 and hi >= n - 1 and hi > lo):
        raise _refuse(an, node, f"counts keys in [0, {n}) into a histogram over [{lo}, {hi}] that does not "
                                "hold them all")
    return GroupOffsets(sort, int(bins), cumulative=False, keys=keys if sort is None else None)


def _cumsum(an, node: fx.Node) -> Any:
    s = an.st(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if s.cumulative or dim not in (0, -1):
        raise _refuse(an, node, "accumulates group counts other than once along their groups")
    return GroupOffsets(s.sort, s.groups, cumulative=True, keys=s.keys)


def _grouped_args(node: fx.Node):
    a, b = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    return a, b, offs, bias


def _counts_keys_of(so: GroupOffsets, sort: fx.Node) -> bool:
    """Whether offsets count the keys that sort sorted, in its (ascending) order."""
    if so.sort is not None:
        return so.sort is sort
    return not _descending(sort) and key_source(sort.args[0]) is so.keys


def _offsets(an, node, offs, *rows: Permuted) -> GroupOffsets:
    so = an.st(offs)
    if not (isinstance(so, GroupOffsets) and so.cumulative and all(_counts_keys_of(so, r.sort) for r in rows)):
        raise _refuse(an, node, "runs a grouped matmul over sorted rows with offsets not counted from their "
                                "sort's keys")
    return so


def _grouped_mm(an, node: fx.Node) -> Any:
    a, b, offs, bias = _grouped_args(node)
    sa, sb = an.st(a), an.st(b)
    if bias is not None and an.st(bias) is not FREE:
        raise _refuse(an, node, "adds a per-sample bias in a grouped matmul")
    if isinstance(sa, Permuted) and sa.dim == 0 and sb is FREE and ndim(a) == 2 and ndim(b) == 3:
        so = _offsets(an, node, offs, sa)
        if not known(shape_of(b)[0] == so.groups):
            raise _refuse(an, node, "runs a grouped matmul with another number of groups than offsets")
        return Permuted(sa.sort, sa.outer, sa.inner, 0)  # row r: a[r] @ b[key[r]]
    if isinstance(sa, Permuted) and isinstance(sb, Permuted) and sa.dim == 1 and sb.dim == 0 and \
            ndim(a) == 2 and ndim(b) == 2 and node.target is aten._grouped_mm.default:
        so = _offsets(an, node, offs, sa, sb)
        if _rows([sa, sb]) is None:
            raise _refuse(an, node, "contracts rows of two different orders")
        return _contribution(an, node, {0: sa, 1: sb}, so)
    raise _refuse(an, node, "runs a grouped matmul whose rows are not sorted rows times sample-free weights")


def _contribution(an, node, layouts: dict, so: GroupOffsets) -> Reduced:
    """The sum over sorted rows of each group's products: a weight gradient's contribution when exactly one
    operand is linear in the loss tangent."""
    tdep = [i for i in layouts if node.args[i] in an.tdep]
    if node in an.tdep and len(tdep) == 1:
        an.contributions[node] = Contribution(node, "grouped", layouts, tdep[0],
                                              extra={"offs": node.args[2] if len(node.args) > 2
                                                     else node.kwargs["offs"], "groups": so.groups})
    return Reduced(node)


def _fallback_backward(an, node: fx.Node) -> Any:
    """transformers' grouped_mm_fallback_backward(x, w, offs, grad): (grad_x per sorted row, grad_w)."""
    x, w, offs, g = node.args[:4]
    sx, sw, sg = an.st(x), an.st(w), an.st(g)
    if not (isinstance(sx, Permuted) and isinstance(sg, Permuted) and sx.dim == 0 and sg.dim == 0
            and sw is FREE and _rows([sx, sg]) is not None):
        raise _refuse(an, node, "takes the backward of a grouped matmul whose rows are not sorted rows")
    so = _offsets(an, node, offs, sx, sg)
    tdep = [i for i in (0, 3) if node.args[i] in an.tdep]
    # (the op makes w's gradient also where w is frozen, and then nothing reads it: no contribution)
    read = any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users)
    if node in an.tdep and len(tdep) == 1 and read:
        an.contributions[node] = Contribution(node, "grouped", {0: sx, 3: sg}, tdep[0],
                                              extra={"offs": offs, "groups": so.groups})
    return (Permuted(sg.sort, sg.outer, sg.inner, 0), Reduced(node))


# counts of the keys in sample order (before their sort): the one op of this family with a Batched input
RULES: dict[Any, Any] = {aten.histc: _histc}
