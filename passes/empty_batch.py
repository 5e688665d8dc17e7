"""Let a graph traced for any batch size also run with no samples.

With an unbacked batch size (one graph for every batch size: what sharded
steps compile, so every rank issues the same collectives whatever its batch)
some ops make the tracer assume the batch is not empty, e.g. ``view(B, T, H,
-1)`` (eager PyTorch cannot infer -1 on an empty tensor either), and the graph
asserts ``B != 0`` at run time. A rank that draws no samples (Poisson
sampling does that) would then raise while the other ranks wait in a
collective. Its correct step is well defined: every per-sample tensor is
empty, every contraction over the samples is zero, the gradient is zero plus
the noise. The code traced for B > 0 computes exactly that on empty tensors
(the assumption only fixed how the ambiguous sizes are resolved), so the
asserts that say nothing but "the batch is not empty" are dropped. Asserts
about anything else stay. Kernels that raise on an empty input where torch
has no empty branch (CPU Fourier transforms) are put in an op that has one.
A ratio of two multiples of the batch size (batch_norm's backward over a
``[1, B*C, ...]`` view divides numel by B*C) is replaced by its value where
that is a number (H*W): the same for any non-empty batch, where op by op the
division raised ZeroDivisionError on an empty one.
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from dpcompile.batching import drop_nonempty_asserts
from dpcompile.empty_fft import ON_ANY_BATCH

from .context import DPPassContext

aten = torch.ops.aten


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_DIVISIONS = (operator.truediv, operator.floordiv, operator.mod)
_ARITHMETIC = {*_DIVISIONS, operator.add, operator.sub, operator.mul, operator.neg, operator.pow, torch.sym_float,
               torch.sym_int, torch.sym_sqrt}


def _resolve_inferred_size(node: fx.Node) -> bool:
    """Replace a -1 in a view's sizes by the traced size when that is a plain number; True if it did."""
    sizes, val = node.args[1], node.meta.get("val")
    if not isinstance(sizes, (list, tuple)) or -1 not in sizes or val is None or val.dim() != len(sizes):
        return False
    i = list(sizes).index(-1)
    size = val.shape[i]
    if isinstance(size, torch.SymInt):
        if not size.node.is_constant():  # depends on a symbol: only a graph value can say it
            return False
        size = int(size)
    node.args = (node.args[0], [*sizes[:i], size, *sizes[i + 1:]], *node.args[2:])
    return True


def unbacked_batch(ctx: DPPassContext) -> sympy.Symbol | None:
    """The batch size's symbol where one graph serves every batch size (possibly none); None for a concrete one
    (the graph was built for it)."""
    B = ctx.batch_size
    if not isinstance(B, torch.SymInt) or not isinstance(B.node.expr, sympy.Symbol):
        return None
    return B.node.expr


def empty_batch_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    b = unbacked_batch(ctx)
    if b is None:
        return gm
    B = ctx.batch_size
    # Inductor emits the shape environment's deferred runtime asserts for an
    # unbacked symbol wherever it is bound, whatever the graph holds; drop them
    # there too (they are also axioms there: without them the simplifier proves
    # less, which only makes the generated code more general).
    in_graph, deferred = drop_nonempty_asserts(gm, B.node.shape_env, {b})
    if in_graph:
        ctx.counters["nonempty_batch_asserts_removed"] += in_graph
    if deferred:
        ctx.counters["nonempty_batch_axioms_dropped"] += deferred
    # The same assumption left a -1 in the view's sizes, which Inductor resolves from the traced shape but
    # op-by-op execution (compiler="eager") cannot on an empty tensor: write the traced size in its place.
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _VIEWS and _resolve_inferred_size(node):
            ctx.counters["nonempty_batch_views_resolved"] += 1
    cancelled = _cancel_batch_ratios(gm, b)
    if cancelled:
        ctx.counters["nonempty_batch_ratios_cancelled"] += cancelled
    # torch's CPU Fourier transforms raise on an empty input (dpcompile.empty_fft)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ON_ANY_BATCH and holds_batch(node.args[0], b):
            node.target = ON_ANY_BATCH[node.target]
            ctx.counters["nonempty_batch_transforms_guarded"] += 1
    gm.graph.eliminate_dead_code()
    return gm


def _cancel_batch_ratios(gm: fx.GraphModule, b: sympy.Symbol) -> int:
    """Each ratio of two sizes that are both multiples of the batch size b and whose quotient is a number (numel /
    (B*C) = H*W) is replaced by that number; how many."""
    n, folded = 0, set()
    for node in list(gm.graph.nodes):
        if node in folded or node.op != "call_function" or node.target not in _DIVISIONS or len(node.args) != 2:
            continue
        num, den = (_batch_multiple(a, b) for a in node.args)
        if num is None or den is None:
            continue
        q = sympy.cancel(num / den)
        if not q.is_number or (node.target is not operator.truediv and not q.is_Integer):
            continue
        value = float(q) if node.target is operator.truediv else int(q) if node.target is operator.floordiv else 0
        _fold(node, value, folded)
        n += 1
    return n


def _fold(node: fx.Node, value, folded: set) -> None:
    """node replaced by the number value, and each size arithmetic on it that is left with numbers only by its
    own result (1.0 / ratio): Inductor takes numbers where it traced sizes, not sizes made of numbers."""
    users = list(node.users)
    node.replace_all_uses_with(value)
    node.graph.erase_node(node)
    folded.add(node)
    for user in users:
        if user.op == "call_function" and user.target in _ARITHMETIC and not user.kwargs \
                and all(isinstance(a, (int, float)) for a in user.args):
            _fold(user, user.target(*user.args), folded)


def _batch_multiple(x, b: sympy.Symbol) -> sympy.Expr | None:
    """The size expression of x where it is b times positive integers and sizes (at least 1 whenever b is)."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.SymInt):
        return None
    factors = sympy.Mul.make_args(val.node.expr)
    ok = b in factors and all(f == b or (f.is_Integer and f > 0) or f.is_Symbol for f in factors)
    return val.node.expr if ok else None


def holds_batch(x, b: sympy.Symbol) -> bool:
    """x's shape depends on the batch size b."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return isinstance(val, torch.Tensor) and any(
        isinstance(size, torch.SymInt) and b in size.node.expr.free_symbols for size in val.shape)
