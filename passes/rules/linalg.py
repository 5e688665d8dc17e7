"""Batched linear algebra: factorizations, solves, inverses and determinants of a stack of matrices.

Every ``torch.linalg`` op works on its operands' last one or two dims (the core: a matrix, a vector, a pivot
row, or none for a determinant or an ``info`` code) and treats the dims before them as a batch, broadcast
across operands and aligned from the right: entry i of each output's batch is computed from entry i of each
operand's batch alone. So samples in a batch dim stay apart and come out in the same broadcast batch dim of
every output that has it; an output whose batch lacks that dim (the LU of a shared matrix solved against
per-sample right-hand sides) never reads along it and is sample-free. Samples in a core dim (a matrix whose rows
are samples) are mixed by the factorization and refused. The backwards are these ops again plus matrix products,
views and pointwise math, so per-sample matrices give per-sample gradients through them (checked against
vmap(grad) in tests/test_op_sweep.py).

A rule is ``(analysis, node) -> state`` (``passes.batch_state``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import known

from ..batch_state import FREE, SINGLE, Batched, Mixed, each_output, fail_layout, ndim

aten = torch.ops.aten


def _solve_rhs_core(node: fx.Node) -> int:
    """_linalg_solve_ex's B: a vector (core 1) where the result has one dim fewer than the LU, else matrices."""
    result, lu = node.meta["val"][0], node.meta["val"][1]
    return 1 if result.dim() == lu.dim() - 1 else 2


# op -> (core dims of each tensor argument by schema name, core dims of each output); an int, or a function of
# the node where it depends on the call (a vector or matrix right-hand side)
_CORES: dict[Any, tuple[dict[str, Any], tuple[Any, ...]]] = {
    aten.linalg_inv_ex: ({"A": 2}, (2, 0)),
    aten._linalg_solve_ex: ({"A": 2, "B": _solve_rhs_core}, (_solve_rhs_core, 2, 1, 0)),
    aten._linalg_det: ({"A": 2}, (0, 2, 1)),
    aten._linalg_slogdet: ({"A": 2}, (0, 0, 2, 1)),
    aten._linalg_svd: ({"A": 2}, (2, 1, 2)),
    aten._linalg_eigh: ({"A": 2}, (1, 2)),
    aten.linalg_eig: ({"self": 2}, (1, 2)),
    aten._linalg_eigvals: ({"self": 2}, (1,)),
    aten.linalg_qr: ({"A": 2}, (2, 2)),
    aten.geqrf: ({"self": 2}, (2, 1)),
    aten.linalg_householder_product: ({"input": 2, "tau": 1}, (2,)),
    aten.ormqr: ({"self": 2, "input2": 1, "input3": 2}, (2,)),  # (householder vectors, tau, the matrix multiplied)
    aten.linalg_cholesky_ex: ({"self": 2}, (2, 0)),
    aten.cholesky: ({"self": 2}, (2,)),
    aten.cholesky_solve: ({"self": 2, "input2": 2}, (2,)),
    aten.cholesky_inverse: ({"self": 2}, (2,)),
    aten.linalg_lu_factor_ex: ({"A": 2}, (2, 1, 0)),
    aten.linalg_lu: ({"A": 2}, (2, 2, 2)),
    aten.lu_unpack: ({"LU_data": 2, "LU_pivots": 1}, (2, 2, 2)),
    aten.linalg_lu_solve: ({"LU": 2, "pivots": 1, "B": 2}, (2,)),
    aten.linalg_ldl_factor_ex: ({"self": 2}, (2, 1, 0)),
    aten.linalg_ldl_solve: ({"LD": 2, "pivots": 1, "B": 2}, (2,)),
    aten.linalg_matrix_exp: ({"self": 2}, (2,)),
    aten.triangular_solve: ({"self": 2, "A": 2}, (2, 2)),
    aten.linalg_solve_triangular: ({"self": 2, "B": 2}, (2,)),
    aten.linalg_pinv: ({"self": 2, "atol": 0, "rtol": 0, "rcond": 0}, (2,)),
    # cdist(x1 [..., P, M], x2 [..., R, M]) -> [..., P, R]: the distance of each row of x1 to each row of x2
    aten._cdist_forward: ({"x1": 2, "x2": 2}, (2,)),
    # x1's gradient [..., P, M]; x2's is the same op with the operands' roles swapped (grad.mT, x2, x1, cdist.mT)
    aten._cdist_backward: ({"grad": 2, "x1": 2, "x2": 2, "cdist": 2}, (2,)),
}

# outputs made from one operand alone, op -> {output index: the operand}: the LU, pivots and info of a solve's
# matrix, triangular_solve's copy of it. Such an output's batch is that operand's, which may lack the dim holding
# the samples of another (a shared matrix against per-sample right-hand sides): it is then sample-free. Any other
# output without the samples' dim is refused, not taken as sample-free.
_OF_ONE_OPERAND: dict[Any, dict[int, str]] = {
    aten._linalg_solve_ex: {1: "A", 2: "A", 3: "A"},
    aten.triangular_solve: {1: "A"},
}

# core dims some ops keep apart, operand -> {its core dim: the output's}, both counted from the end: cdist's rows
# of x1 (samples as the rows of a [B, M] batch of features, prototypes or centres as x2) give the output's rows,
# the rows of x2 its columns; in the backward, rows of the output gradient, x1 and the distances give the rows
# of x1's gradient. The columns of the backward's grad and cdist, and x2's rows, are summed over: where they
# hold samples (x2's gradient, a learnable x2) the samples mix.
_KEPT_CORE_DIMS: dict[Any, dict[str, dict[int, int]]] = {
    aten._cdist_forward: {"x1": {-2: -2}, "x2": {-2: -1}},
    aten._cdist_backward: {"grad": {-2: -2}, "x1": {-2: -2}, "cdist": {-2: -2}},
}


def _core(spec, node: fx.Node) -> int:
    return spec(node) if callable(spec) else spec


def _tensor_operands(node: fx.Node):
    """(argument, its schema name) of each fx.Node argument, positional or keyword."""
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            yield value, arg.name


def _mixed(an, node: fx.Node, why: str):
    """Mixed, one per output; at a static batch of one nothing can mix (a dim of size one taken for the samples')."""
    return each_output(node, SINGLE if known(an.B == 1) else Mixed(node, why))


def _batched_linalg(an, node: fx.Node):
    packet = node.target.overloadpacket
    ins, outs = _CORES[packet]
    kept = _KEPT_CORE_DIMS.get(packet, {})
    vals = node.meta["val"]
    multi = isinstance(vals, (tuple, list))
    name = packet.__name__
    # where the samples land in the outputs: ("batch", the dim counted from the right of the broadcast batch, 0
    # next to the core), or ("core", the output's core dim counted from its end) for a core dim an op keeps apart
    where, lay, sizes, per_sample = None, None, [], set()
    for a, arg_name in _tensor_operands(node):
        s = an.st(a)
        if not isinstance(s, Batched):
            continue
        if s.dim is None:
            return each_output(node, SINGLE)
        if arg_name not in ins:
            raise an.refuse(node, f"its operand {arg_name} is per-sample, and dpcompile's rule for {name} does not "
                                  f"know which of its dims are a batch", "file an issue with this op")
        batch_rank = ndim(a) - _core(ins[arg_name], node)
        if s.dim < batch_rank:
            w = ("batch", batch_rank - 1 - s.dim)
        elif s.dim - ndim(a) in kept.get(arg_name, {}):
            w = ("core", kept[arg_name][s.dim - ndim(a)])
        else:
            return _mixed(an, node, f"{name} of a matrix whose rows or columns are samples ({arg_name} holds "
                                    f"them in its core dim {s.dim} of {ndim(a)})")
        if where is not None and not (w == where and known(s.outer == lay.outer) and known(s.inner == lay.inner)):
            return _mixed(an, node, f"{name} of per-sample operands whose samples lie in different dims")
        where, lay = w, s
        sizes.append(a.meta["val"].shape[s.dim])
        per_sample.add(arg_name)
    if where is None:
        return each_output(node, SINGLE)
    states = []
    for i, (v, spec) in enumerate(zip(vals if multi else (vals,), outs)):
        batch_rank = v.dim() - _core(spec, node)
        if where[0] == "core":
            d = v.dim() + where[1]
        elif batch_rank > where[1]:
            d = batch_rank - 1 - where[1]
        elif known(v.numel() == 0) or _OF_ONE_OPERAND.get(packet, {}).get(i) in ins.keys() - per_sample:
            states.append(FREE)  # empty (svd without U and V), or made from one operand alone, a sample-free one
            continue
        else:
            raise an.refuse(node, f"its output {i} lacks the batch dim that holds the samples of its per-sample "
                                  f"operands", "file an issue with this op")
        if not all(known(v.shape[d] == n) for n in sizes):
            return fail_layout(an, node, f"{name} broadcasts the sample dim")
        states.append(lay.moved(d))
    return tuple(states) if multi else states[0]


def _effectful(an, node: fx.Node):
    """with_effects(token, op, *args): an op ordered by an effect token. torch.linalg.inv, solve, cholesky, ... run
    their ``_linalg_check_errors`` so, on the ``info`` of each matrix: a check that returns nothing (the token), so
    no value of it reaches the loss or a gradient; one that fails raises, as eager torch does on the same singular
    matrix (the runtime checks of batch_dims._ASSERTS). Another op under an effect token is refused."""
    op = node.args[1]
    if op is not aten._linalg_check_errors.default:
        raise an.refuse(node, f"it runs {op} with per-sample inputs under an effect token, which dpcompile has no "
                              f"rule for", "file an issue with this op, or keep it out of the compiled step")
    return each_output(node, FREE)


RULES: dict[Any, Any] = {packet: _batched_linalg for packet in _CORES}
RULES[torch.ops.higher_order.with_effects] = _effectful
