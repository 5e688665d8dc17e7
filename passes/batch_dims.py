"""Batch-dimension analysis: which dim of every joint-graph value holds the samples.

A dataflow propagation over the aten joint graph. Every value gets a state:

- ``FREE``: does not depend on the samples (parameters, constants, the loss
  tangent, random numbers, anything computed from those alone).
- ``Batched(dim, outer, inner)``: slice ``i`` depends only on sample ``i``.
  Dim ``dim`` has size ``outer * B * inner`` and index ``j`` belongs to sample
  ``(j // inner) % B``; so ``[B*T, D]`` rows are ``Batched(0, 1, T)``.
  ``dim=None`` (only when B == 1) means "the whole tensor is sample 0".
- ``Reduced``: a linear sum over samples (a weight-gradient contraction, the
  loss).
- ``Mixed``: a non-linear function of several samples (BatchNorm statistics,
  a loss normalised by a count taken over the batch).

Every op with a sample-dependent input needs a rule here; an op without one is
refused (never guessed). Reductions over the batch dim in the backward are the
per-sample gradient *contributions*; they are recorded for the later passes.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from dpcompile.errors import DPCompileError, DPValueError
from dpcompile.fx_utils import known, module_of, op_name, source_line
from dpcompile.step_split import split_error_text

from .context import DPPassContext

aten = torch.ops.aten
prims = torch.ops.prims


class _Free:
    def __repr__(self) -> str:
        return "FREE"


FREE = _Free()


@dataclasses.dataclass(frozen=True)
class Batched:
    dim: int | None
    outer: Any = 1
    inner: Any = 1

    def moved(self, dim: int | None) -> "Batched":
        return Batched(dim, self.outer, self.inner)


SINGLE = Batched(None)


@dataclasses.dataclass(frozen=True, eq=False)
class Reduced:
    origin: fx.Node


@dataclasses.dataclass(frozen=True, eq=False)
class Mixed:
    origin: fx.Node
    why: str


@dataclasses.dataclass(eq=False)
class Contribution:
    """A backward node that sums a per-sample quantity over the samples.

    kind: "mm" (contraction over sample rows), "sum" (reduction over the
    sample dim), "index_put" (embedding backward: scatter-add of sample rows).
    operands: the argument positions (into node.args) of the per-sample inputs,
    with the layout of the sample dim in each.
    scaled_operand: the argument position that is linear in the loss tangent;
    per-sample row scaling is applied to it.
    """

    node: fx.Node
    kind: str
    layouts: dict[int, Batched]
    scaled_operand: int
    extra: dict = dataclasses.field(default_factory=dict)


def _mixing_advice(origin: fx.Node) -> str:
    where = module_of(origin)
    if "BatchNorm" in where:
        return ("BatchNorm in training mode normalises with statistics of the whole batch; use GroupNorm or "
                "LayerNorm, or put the module in eval mode.")
    if "Embedding" in where:
        return ("an Embedding with scale_grad_by_freq=True scales by token counts taken across the batch; "
                "set scale_grad_by_freq=False.")
    return ("per-sample gradients need every sample's computation to be independent of the others: remove "
            "statistics taken over the batch (BatchNorm in training mode, x - x.mean(0), ...).")


class BatchDimAnalysis:
    """Runs the propagation; ``states`` maps node -> state."""

    def __init__(self, ctx: DPPassContext, gm: fx.GraphModule):
        self.ctx = ctx
        self.gm = gm
        self.states: dict[fx.Node, Any] = {}
        self.contributions: dict[fx.Node, Contribution] = {}
        self.tdep: set[fx.Node] = set()
        self.B = None

    # -- errors ---------------------------------------------------------------
    def refuse(self, node: fx.Node, why: str, what_to_do: str = "") -> DPCompileError:
        line = source_line(node)
        msg = (
            f"dp_fsdp cannot prove per-sample gradients: op {op_name(node)} in module "
            f"{module_of(node)}: {why}."
        )
        if line:
            msg += f"\n  at: {line}"
        if what_to_do:
            msg += f"\n  What to do: {what_to_do}"
        return DPCompileError(msg)

    # -- driver ---------------------------------------------------------------
    def run(self) -> None:
        ctx = self.ctx
        sizes = []
        for ph, (name, bd) in ctx.data_inputs.items():
            if bd is None:
                continue
            v = ph.meta["val"]
            if bd < -v.dim() or bd >= v.dim():
                raise DPValueError(
                    f"batch_dim {bd} is out of range for data input '{name}' of shape {tuple(v.shape)}; "
                    f"set the batch_dim option (e.g. batch_dim={{'{name}': None}} for an input that is not per-sample)"
                )
            sizes.append((name, v.shape[bd % v.dim()]))
        if not sizes:
            found = ("no batched data input: the samples must arrive as tensor arguments of the step function "
                     "(dim 0 is the batch unless the batch_dim option says otherwise)")
            raise DPValueError(split_error_text(ctx.split_step, found) if ctx.split_step is not None
                               else f"dp_fsdp found {found}")
        self.B = sizes[0][1]
        for name, s in sizes[1:]:
            if not known(s == self.B):
                raise DPValueError(
                    f"data inputs disagree on the batch size: '{sizes[0][0]}' has {sizes[0][1]} samples and "
                    f"'{name}' has {s} along their batch dims; if '{name}' is not per-sample, pass "
                    f"batch_dim={{'{name}': None}} (or the right dim) in the dp_fsdp options"
                )
        for _, s in sizes[1:]:
            _unify_symbols(s, self.B)
        ctx.batch_size = self.B
        # a sharded step is compiled with an unbacked batch size
        # (dpcompile.batching): one graph, the same collectives on every rank
        assert not ctx.sharded or not (known(self.B == 0) or known(self.B == 1)), self.B
        ctx.whole_gradient_mode = known(self.B == 1)
        ctx.empty_batch = known(self.B == 0)
        if ctx.empty_batch:
            # no samples this step (a static size: unsharded only): every
            # per-sample tensor is empty and the gradient is exactly zero;
            # like B == 1 it is handled whole, scaled by r = 0
            ctx.whole_gradient_mode = True
            self.tdep = {n for n in self.gm.graph.nodes if n.name.startswith("tangents")}
            return

        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.states[node] = self._placeholder_state(node)
                if str(node.name).startswith("tangents"):
                    self.tdep.add(node)
            elif node.op == "call_function":
                ins = node.all_input_nodes
                if any(i in self.tdep for i in ins):
                    self.tdep.add(node)
                self.states[node] = self._state(node)
            elif node.op == "output":
                pass
            else:
                raise self.refuse(node, f"unsupported FX node kind {node.op}")
        ctx.states = self.states
        ctx.tangent_dependent = self.tdep

    def _placeholder_state(self, node: fx.Node):
        if node in self.ctx.data_inputs:
            _, bd = self.ctx.data_inputs[node]
            if bd is None:
                return FREE
            v = node.meta["val"]
            return Batched(bd % v.dim())
        return FREE

    # -- dispatch ---------------------------------------------------------------
    def _state(self, node: fx.Node):
        if node.target is operator.getitem:
            src, idx = node.args
            s = self.states[src]
            if isinstance(s, tuple):
                return s[idx]
            return s
        ins = [i for i in node.all_input_nodes]
        in_states = [self.states[i] for i in ins]
        if all(s is FREE or (isinstance(s, tuple) and all(x is FREE for x in s)) for s in in_states):
            return FREE
        v = node.meta.get("val")
        if node.target in _SIZE_QUERIES:
            # sizes are not sample data: how many samples and how long they
            # are, public like the batch size itself (x.view(x.size()[:-1] + ...))
            return FREE
        if not isinstance(v, (torch.Tensor, tuple, list)):
            # a Python scalar computed from per-sample values (.item()) would
            # carry sample data outside the graph's per-sample tracking
            if any(isinstance(s, (Batched, Reduced, Mixed)) for s in in_states):
                raise self.refuse(node, "produces a Python scalar from per-sample data")
            return FREE
        # Mixed inputs poison everything downstream; combining them with
        # per-sample data is the privacy bug we are here to prevent.
        mixed = [s for s in in_states if isinstance(s, Mixed)]
        if mixed:
            if any(isinstance(s, Batched) for s in in_states):
                raise self._mixing_error(node, mixed[0])
            return Mixed(mixed[0].origin, mixed[0].why)
        target = node.target
        packet = getattr(target, "overloadpacket", None)
        reduced = [s for s in in_states if isinstance(s, Reduced)]
        if reduced:
            if any(isinstance(s, Batched) for s in in_states):
                raise self._mixing_error(node, Mixed(reduced[0].origin, "a sum over the samples"))
            return self._reduced_rule(node, reduced[0])
        rule = _RULES.get(packet) or _RULES.get(target)
        if rule is None and isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
            rule = _pointwise
        if rule is None:
            raise self.refuse(
                node,
                "this op has per-sample inputs and dpcompile has no rule proving it keeps samples apart",
                "file an issue with this op, or keep it out of the compiled step",
            )
        return rule(self, node)

    def _mixing_error(self, node: fx.Node, m: Mixed) -> DPCompileError:
        o = m.origin
        ov = o.meta.get("val")
        if isinstance(ov, torch.Tensor) and ov.numel() == 1:
            # a scalar computed across samples feeding per-sample values: the
            # typical case is a loss normalised by a count over the batch
            from .loss_reduction import loss_not_per_sample  # cycle: it imports this module

            return loss_not_per_sample(o, m.why)
        return DPCompileError(
            f"dp_fsdp cannot prove per-sample gradients: op {op_name(o)} in module {module_of(o)} "
            f"mixes samples ({m.why}), and its result is combined with per-sample data by "
            f"{op_name(node)} in module {module_of(node)}."
            + (f"\n  at: {source_line(o)}" if source_line(o) else "")
            + "\n  What to do: " + _mixing_advice(o)
        )

    def _reduced_rule(self, node: fx.Node, r: Reduced):
        """Linear maps of a sum over samples stay a sum over samples."""
        t = node.target
        if getattr(t, "overloadpacket", None) in _SCATTER_PACKETS:
            # scatter-add of a sum over samples at sample-free positions: linear
            vals = node.args[3] if t is aten._unsafe_masked_index_put_accumulate.default else node.args[2]
            others = [a for a in node.all_input_nodes if a is not vals]
            acc = True if t is aten._unsafe_masked_index_put_accumulate.default else (
                node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))
            if acc and isinstance(self.states.get(vals), Reduced) and all(self.states.get(a) is FREE for a in others):
                return Reduced(r.origin)
            return Mixed(node, "a scatter involving a sum over the samples")
        if t is aten.slice_scatter.default and is_zero_constant(node.args[0]) and \
                isinstance(self.states.get(node.args[1]), Reduced):
            return Reduced(r.origin)  # a sum over samples placed into zeros: linear
        if t is aten.where.self and _is_masking(self, node):
            return Reduced(r.origin)
        if t in _LINEAR_ON_REDUCED or getattr(t, "overloadpacket", None) in _VIEWLIKE_PACKETS:
            if t in (aten.mul.Tensor, aten.div.Tensor):
                # linear only if the other factor does not depend on the samples
                if t is aten.div.Tensor and isinstance(self.states.get(node.args[1]), Reduced):
                    return Mixed(node, "a ratio of two sums over the samples")
                other = [self.states[a] for a in node.all_input_nodes]
                if sum(isinstance(s, Reduced) for s in other) > 1:
                    return Mixed(node, "a product of two sums over the samples")
            return Reduced(r.origin)
        return Mixed(node, f"{op_name(node)} of a sum over the samples")

    # -- helpers used by rules -----------------------------------------------
    def st(self, a: Any):
        return self.states[a] if isinstance(a, fx.Node) else FREE

    def tensor_args(self, node: fx.Node) -> list[tuple[fx.Node, Any]]:
        return [(a, self.states[a]) for a in node.all_input_nodes]


def _unify_symbols(s: Any, B: Any) -> None:
    """Make two batch sizes proven equal one symbol.

    Unbacked batch dims (one graph for every batch size) get one symbol per
    input, and what proves them equal is often a shape check on a product
    (cross_entropy checks 8*u1 == 8*u0), which gives the shape environment an
    axiom but no substitution; without one, divisibility facts like
    u1 % u0 == 0 that the layout rules rely on are not provable.
    """
    if not (isinstance(s, torch.SymInt) and isinstance(B, torch.SymInt)):
        return
    a, b = s.node.expr, B.node.expr
    if a != b and isinstance(a, sympy.Symbol) and isinstance(b, sympy.Symbol):
        s.node.shape_env._set_replacement(a, b, "dpcompile: data inputs share the batch dim")


def is_zero_constant(a: Any) -> bool:
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return a == 0
    if isinstance(a, fx.Node) and a.op == "call_function":
        if a.target in (aten.full.default, aten.scalar_tensor.default):
            fill = a.args[1] if a.target is aten.full.default else a.args[0]
            return isinstance(fill, (int, float)) and fill == 0
        if a.target in (aten.zeros.default, aten.zeros_like.default):
            return True
    return False


def masked_operand(node: fx.Node) -> fx.Node | None:
    """x of where(cond, x, 0) / where(cond, 0, x) when it keeps x's shape, else None."""
    _, a, b = node.args[:3]
    x = a if is_zero_constant(b) else b if is_zero_constant(a) else None
    if isinstance(x, fx.Node) and tuple(node.meta["val"].shape) == tuple(x.meta["val"].shape):
        return x
    return None


def _is_masking(an: "BatchDimAnalysis", node: fx.Node) -> bool:
    """where with a sample-free cond and a zero branch: linear in the other branch."""
    return an.st(node.args[0]) is FREE and masked_operand(node) is not None


# ---------------------------------------------------------------------------
# shape helpers
def _ndim(x: fx.Node) -> int:
    return x.meta["val"].dim()


def _shape(x: fx.Node):
    return list(x.meta["val"].shape)


def _norm_dim(d: int, n: int) -> int:
    return d % n if n > 0 else 0


def _prod(xs) -> Any:
    p = 1
    for x in xs:
        p = p * x
    return p


def view_layout(in_shape, out_shape, lay: Batched, B) -> Batched | None:
    """Where the sample index lands after a view (row-major reinterpretation).

    Sample of flat index f is (f // G) % B with G = inner * prod(in[dim+1:]).
    An output dim e with P = prod(out[e+1:]) carries it iff P | G and
    (G/P) * B | out[e]; then it is Batched(e, out[e] / ((G/P) B), G/P).
    """
    if lay.dim is None:
        return SINGLE
    G = lay.inner * _prod(in_shape[lay.dim + 1 :])
    # outermost first: with B == 1 several dims qualify and the outermost is
    # the natural sample dim; with B > 1 at most one does
    for e in range(len(out_shape)):
        P = _prod(out_shape[e + 1 :])
        if known(G % P == 0):
            i2 = G // P
            size = out_shape[e]
            if known(size % (i2 * B) == 0) and not known(size == 0):
                return Batched(e, size // (i2 * B), i2)
    return None


# ---------------------------------------------------------------------------
# rules: (analysis, node) -> state
def _fail_layout(an: BatchDimAnalysis, node: fx.Node, why: str):
    if known(an.B == 1):
        return SINGLE
    raise an.refuse(node, why)


def _pointwise(an: BatchDimAnalysis, node: fx.Node):
    out = node.meta["val"]
    if isinstance(out, (tuple, list)):
        raise an.refuse(node, "pointwise op with several outputs")
    n_out = out.dim()
    found: Batched | None = None
    for a, s in an.tensor_args(node):
        if not isinstance(s, Batched) or s.dim is None:
            continue
        d_out = s.dim + (n_out - _ndim(a))
        if not known(_shape(a)[s.dim] == out.shape[d_out]):
            return _fail_layout(an, node, "broadcasts the sample dim")
        cand = s.moved(d_out)
        if found is None:
            found = cand
        elif found != cand and not (
            found.dim == cand.dim and known(found.outer == cand.outer) and known(found.inner == cand.inner)
        ):
            return _fail_layout(
                an, node, f"combines per-sample tensors whose sample dims differ ({found} vs {cand})"
            )
    return found if found is not None else SINGLE


def _identity(an, node):
    return an.st(node.args[0])


def _view(an, node):
    x = node.args[0]
    s = an.st(x)
    lay = view_layout(_shape(x), list(node.meta["val"].shape), s, an.B)
    if lay is None:
        return _fail_layout(an, node, "reshapes the sample dim in a way dpcompile cannot track")
    return lay


def _permute(an, node):
    x, dims = node.args[0], node.args[1]
    s = an.st(x)
    if s.dim is None:
        return s
    n = _ndim(x)
    dims = [_norm_dim(d, n) for d in dims]
    return s.moved(dims.index(s.dim))


def _transpose(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is None:
        return s
    n = _ndim(x)
    if node.target is aten.t.default:
        d0, d1 = 0, min(1, n - 1)
    else:
        d0, d1 = _norm_dim(node.args[1], n), _norm_dim(node.args[2], n)
    d = s.dim
    return s.moved(d1 if d == d0 else d0 if d == d1 else d)


def _unsqueeze(an, node):
    x, k = node.args[0], node.args[1]
    s = an.st(x)
    if s.dim is None:
        return s
    k = _norm_dim(k, _ndim(x) + 1)
    return s.moved(s.dim + (1 if k <= s.dim else 0))


def _squeeze(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is None:
        return s
    n = _ndim(x)
    shape = _shape(x)
    if len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = [_norm_dim(d, n) for d in dims]
    else:
        dims = list(range(n))
    dims = [d for d in dims if known(shape[d] == 1)]
    if s.dim in dims:
        return SINGLE  # only possible when B == 1
    return s.moved(s.dim - sum(1 for d in dims if d < s.dim))


def _expand(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is None:
        return s
    out = node.meta["val"]
    d = s.dim + (out.dim() - _ndim(x))
    if not known(out.shape[d] == _shape(x)[s.dim]):
        return _fail_layout(an, node, "expands the sample dim")
    return s.moved(d)


def _slice(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is None:
        return s
    n = _ndim(x)
    k = _norm_dim(node.args[1] if len(node.args) > 1 else 0, n)
    if k == s.dim:
        if known(node.meta["val"].shape[k] == _shape(x)[k]):
            return s
        return _fail_layout(an, node, "slices along the sample dim")
    return s


def _select(an, node):
    x, k = node.args[0], node.args[1]
    s = an.st(x)
    if s.dim is None:
        return s
    k = _norm_dim(k, _ndim(x))
    if k == s.dim:
        return _fail_layout(an, node, "selects along the sample dim")
    return s.moved(s.dim - (1 if k < s.dim else 0))


def _split(an, node):
    x = node.args[0]
    s = an.st(x)
    outs = node.meta["val"]
    n = _ndim(x)
    if node.target in (aten.unbind.int,):
        k = _norm_dim(node.args[1] if len(node.args) > 1 else 0, n)
        if s.dim is not None and k == s.dim:
            return tuple(_fail_layout(an, node, "unbinds the sample dim") for _ in outs)
        return tuple(s if s.dim is None else s.moved(s.dim - (1 if k < s.dim else 0)) for _ in outs)
    k = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), n)
    if s.dim is not None and k == s.dim and len(outs) > 1:
        return tuple(_fail_layout(an, node, "splits the sample dim") for _ in outs)
    return tuple(s for _ in outs)


def _cat(an, node):
    tensors = node.args[0]
    out = node.meta["val"]
    k = _norm_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), out.dim())
    found = None
    for t in tensors:
        s = an.st(t)
        if isinstance(s, Batched) and s.dim is not None:
            if s.dim == k:
                return _fail_layout(an, node, "concatenates along the sample dim")
            if found is not None and found != s:
                return _fail_layout(an, node, "concatenates tensors with different sample dims")
            found = s
    return found or SINGLE


def _stack(an, node):
    tensors = node.args[0]
    out = node.meta["val"]
    k = _norm_dim(node.args[1] if len(node.args) > 1 else 0, out.dim())
    found = None
    for t in tensors:
        s = an.st(t)
        if isinstance(s, Batched) and s.dim is not None:
            cand = s.moved(s.dim + (1 if k <= s.dim else 0))
            if found is not None and found != cand:
                return _fail_layout(an, node, "stacks tensors with different sample dims")
            found = cand
    return found or SINGLE


def _pad(an, node):
    x, pad = node.args[0], node.args[1]
    s = an.st(x)
    if s.dim is None:
        return s
    n = _ndim(x)
    for j in range(len(pad) // 2):
        d = n - 1 - j
        if d == s.dim and (pad[2 * j] != 0 or pad[2 * j + 1] != 0):
            return _fail_layout(an, node, "pads the sample dim")
    return s


def _tril(an, node):
    x = node.args[0]
    s = an.st(x)
    if s.dim is not None and s.dim >= _ndim(x) - 2:
        return _fail_layout(an, node, "masks a matrix whose rows or columns are samples")
    return s


def _slice_scatter(an, node):
    """slice_scatter/select_scatter(base, src, dim, ...): the backward of slicing."""
    base, src = node.args[0], node.args[1]
    sb, ss = an.st(base), an.st(src)
    n = _ndim(base)
    k = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), n)
    found = None
    for s in (sb, ss):
        if isinstance(s, Batched) and s.dim is not None:
            d = s.dim
            if node.target is aten.select_scatter.default and s is ss and d >= k:
                d += 1  # src lacks the selected dim
            cand = s.moved(d)
            if found is not None and found != cand:
                return _fail_layout(an, node, "scatters between tensors with different sample dims")
            found = cand
    if found is None:
        return SINGLE
    if found.dim == k:
        return _fail_layout(an, node, "scatters along the sample dim")
    return found


def _fresh(an, node):
    return FREE  # *_like creation ops: the values do not depend on the input's data


_LINEAR_REDUCTIONS = {aten.sum, aten.mean}


def _reduction(an, node):
    """sum/mean/amax/var_mean/...: over non-sample dims keep the layout."""
    x = node.args[0]
    s = an.st(x)
    n = _ndim(x)
    packet = node.target.overloadpacket
    # reduced dims and keepdim, by schema
    args = list(node.args) + [None] * 4
    kw = node.kwargs
    if node.target in (aten.sum.default, aten.mean.default, aten.max.default, aten.min.default, aten.all.default, aten.any.default, aten.prod.default):
        dims, keep = list(range(n)), False
    elif packet in (aten.argmax, aten.argmin):
        d = args[1] if args[1] is not None else kw.get("dim")
        dims = list(range(n)) if d is None else [d]
        keep = bool(args[2] if args[2] is not None else kw.get("keepdim", False))
    elif packet in (aten.var_mean, aten.var, aten.std, aten.std_mean):
        d = args[1] if args[1] is not None else kw.get("dim")
        dims = list(range(n)) if d is None else ([d] if isinstance(d, int) else list(d))
        keep = bool(kw.get("keepdim", False))
    elif packet is aten.linalg_vector_norm:
        d = args[2] if args[2] is not None else kw.get("dim")
        dims = list(range(n)) if d is None else ([d] if isinstance(d, int) else list(d))
        keep = bool(args[3] if args[3] is not None else kw.get("keepdim", False))
    else:
        d = args[1] if args[1] is not None else kw.get("dim")
        dims = list(range(n)) if d is None or d == [] else ([d] if isinstance(d, int) else list(d))
        keep = bool(args[2] if args[2] is not None else kw.get("keepdim", False))
    dims = sorted({_norm_dim(d, n) for d in dims}) if n > 0 else []
    multi = isinstance(node.meta["val"], (tuple, list))

    def wrap(state):
        return tuple(state for _ in node.meta["val"]) if multi else state

    if s.dim is None:
        return wrap(SINGLE)
    if s.dim in dims:
        if packet in _LINEAR_REDUCTIONS:
            return wrap(Reduced(node))
        if known(an.B == 1):
            return wrap(SINGLE)  # over the one sample there is: nothing mixed
        return wrap(Mixed(node, f"{packet.__name__} over the sample dim"))
    if keep:
        return wrap(s)
    return wrap(s.moved(s.dim - sum(1 for d in dims if d < s.dim)))


def _along_dim(an, node):
    """softmax/cumsum/sort/...: mixes along one dim, which must not be the sample dim."""
    x = node.args[0]
    s = an.st(x)
    for a, sa in an.tensor_args(node):
        if isinstance(sa, Batched) and sa.dim is not None and s.dim is not None and sa != s:
            return _fail_layout(an, node, "combines tensors with different sample dims")
        if isinstance(sa, Batched) and sa.dim is not None:
            s = sa
    packet = node.target.overloadpacket
    if packet in (aten._softmax_backward_data, aten._log_softmax_backward_data):
        k = node.args[2]
    elif packet is aten.topk:
        k = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    else:
        k = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    multi = isinstance(node.meta["val"], (tuple, list))
    if s.dim is not None and _norm_dim(k, _ndim(x)) == s.dim:
        m = Mixed(node, f"{packet.__name__} along the sample dim")
        return tuple(m for _ in node.meta["val"]) if multi else m
    return tuple(s for _ in node.meta["val"]) if multi else s


def _gather(an, node):
    x, k, idx = node.args[0], node.args[1], node.args[2]
    sx, si = an.st(x), an.st(idx)
    n = _ndim(x)
    k = _norm_dim(k, n)
    if isinstance(sx, Batched) and sx.dim is not None and sx.dim == k:
        return _fail_layout(an, node, "gathers along the sample dim")
    if isinstance(sx, Batched) and isinstance(si, Batched) and sx.dim is not None and si.dim is not None and sx != si:
        return _fail_layout(an, node, "gathers with an index whose sample dim differs from the source's")
    if isinstance(sx, Batched) and sx.dim is not None and not known(_shape(idx)[sx.dim] == _shape(x)[sx.dim]):
        return _fail_layout(an, node, "gathers a different number of samples than the source has")
    if isinstance(si, Batched):
        return si
    return sx


def _embedding(an, node):
    w, idx = node.args[0], node.args[1]
    if an.st(w) is not FREE:
        raise an.refuse(node, "looks up rows of a per-sample table")
    return an.st(idx)


def _index(an, node):
    x, indices = node.args[0], node.args[1]
    sx = an.st(x)
    tens = [(p, i) for p, i in enumerate(indices) if i is not None]
    if len(tens) != 1:
        if all(an.st(i) is FREE for _, i in tens) and isinstance(sx, Batched):
            # constant indices on non-sample dims keep the layout if dims before are plain
            if sx.dim is None or all(p > sx.dim for p, _ in tens):
                return sx
        return _fail_layout(an, node, "advanced indexing with several index tensors")
    p, i = tens[0]
    si = an.st(i)
    if isinstance(sx, Batched) and sx.dim is not None:
        if si is FREE and sx.dim < p:
            return sx
        if si is FREE and sx.dim > p:
            return sx.moved(sx.dim - 1 + _ndim(i))
        return _fail_layout(an, node, "indexes along the sample dim")
    if isinstance(si, Batched):
        return si if si.dim is None else si.moved(si.dim + p)
    return SINGLE


def _index_select(an, node):
    x, k, idx = node.args
    sx, si = an.st(x), an.st(idx)
    k = _norm_dim(k, _ndim(x))
    if isinstance(sx, Batched) and sx.dim is not None:
        if sx.dim == k or si is not FREE:
            return _fail_layout(an, node, "selects along the sample dim")
        return sx
    if isinstance(si, Batched):
        return si if si.dim is None else si.moved(k)
    return SINGLE


def _dropout(an, node):
    s = an.st(node.args[0])
    return (s, s)


def _mm(an, node):
    """[n,k] @ [k,m]: samples on rows/cols pass through, on k it is a contraction."""
    if node.target is aten.addmm.default:
        bias, a, b = node.args[0], node.args[1], node.args[2]
    else:
        bias, a, b = None, node.args[0], node.args[1]
    sa, sb = an.st(a), an.st(b)
    if sa.__class__ is Batched and sa.dim is None or sb.__class__ is Batched and sb.dim is None:
        return SINGLE
    rows = sa if isinstance(sa, Batched) and sa.dim == 0 else None
    cols = sb if isinstance(sb, Batched) and sb.dim == 1 else None
    ka = sa if isinstance(sa, Batched) and sa.dim == 1 else None
    kb = sb if isinstance(sb, Batched) and sb.dim == 0 else None
    if rows and cols:
        return Mixed(node, "a product of two per-sample matrices across samples")
    if (ka or kb) and (rows or cols):
        return Mixed(node, "a contraction over samples mixed with per-sample rows")
    if ka or kb:
        if ka and kb and not (known(ka.outer == kb.outer) and known(ka.inner == kb.inner)):
            return Mixed(node, "a contraction over rows that belong to different samples")
        lay = ka or kb
        if bias is not None:
            return Mixed(node, "a contraction over samples plus a bias")
        layouts = {0: Batched(1, lay.outer, lay.inner), 1: Batched(0, lay.outer, lay.inner)}
        tdep_ops = [i for i, x in ((0, a), (1, b)) if x in an.tdep]
        if len(tdep_ops) == 1 and node in an.tdep:
            an.contributions[node] = Contribution(node, "mm", layouts, tdep_ops[0])
        return Reduced(node)
    out = rows.moved(0) if rows else cols.moved(1)
    if bias is not None:
        sbias = an.st(bias)
        if isinstance(sbias, Batched) and sbias.dim is not None:
            d_out = sbias.dim + (2 - _ndim(bias))
            if sbias.moved(d_out) != out:
                return _fail_layout(an, node, "adds a per-sample bias with a different sample dim")
    return out


def _bmm(an, node):
    a, b = node.args[0], node.args[1]
    sa, sb = an.st(a), an.st(b)
    found = None
    for s, allowed in ((sa, {0: 0, 1: 1}), (sb, {0: 0, 2: 2})):
        if isinstance(s, Batched):
            if s.dim is None:
                return SINGLE
            if s.dim not in allowed:
                return _fail_layout(an, node, "batched matmul contracting over the sample dim")
            cand = s.moved(allowed[s.dim])
            if found is not None and (found.dim == 0) != (cand.dim == 0):
                return _fail_layout(an, node, "batched matmul with samples on both operands' free dims")
            if found is not None and found.dim == 0 and found != cand:
                return _fail_layout(an, node, "batched matmul with different sample layouts")
            found = cand
    if found is not None and found.dim != 0 and isinstance(sa, Batched) and isinstance(sb, Batched):
        return Mixed(node, "a product of per-sample rows and per-sample columns")
    return found


def _attention(an, node):
    """Fused SDPA forward/backward: leading dims are batch dims of every tensor."""
    found = None
    for a, s in an.tensor_args(node):
        if not isinstance(s, Batched) or not a.meta["val"].dtype.is_floating_point:
            continue  # integer inputs are RNG state / sequence offsets
        if s.dim is None:
            found = found or SINGLE
            continue
        nd = _ndim(a)
        if s.dim >= nd - 2:
            return _fail_layout(an, node, "attends across samples (the sample dim is a sequence or feature dim)")
        if found is not None and found.dim is not None and found != s:
            return _fail_layout(an, node, "attention inputs with different sample dims")
        found = s
    outs = node.meta["val"]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    res = []
    for o in outs:
        if not isinstance(o, torch.Tensor) or found is None or not o.dtype.is_floating_point:
            res.append(FREE)  # RNG seed / offset / cumulative-length outputs
        elif found.dim is None or (o.dim() > found.dim and known(o.shape[found.dim] == found.outer * an.B * found.inner)):
            res.append(found)
        else:
            # e.g. the gradient of a bias broadcast over the batch, summed
            # inside the fused kernel: not something we can decompose
            res.append(Mixed(node, "an attention output reduced over the samples inside the fused kernel"))
    return tuple(res) if isinstance(node.meta["val"], (tuple, list)) else res[0]


def _index_put(an, node):
    """base.index_put(indices, values, accumulate): the embedding backward."""
    t = node.target
    if t is aten._unsafe_masked_index_put_accumulate.default:
        base, mask, indices, values = node.args[:4]
        accumulate = True
    else:
        base, indices, values = node.args[:3]
        mask = None
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if an.st(base) is not FREE:
        raise an.refuse(node, "scatters into a per-sample tensor")
    tens = [i for i in indices if i is not None]
    if len(indices) != 1 or len(tens) != 1:
        raise an.refuse(node, "scatter with several index tensors")
    idx = tens[0]
    si, sv = an.st(idx), an.st(values)
    lay = None
    for s in (si, sv) + ((an.st(mask),) if mask is not None else ()):
        if isinstance(s, Batched):
            if s.dim is None:
                return SINGLE
            if lay is not None and s != lay:
                raise an.refuse(node, "scatter whose index and values have different sample dims")
            lay = s
    if lay is None:
        return FREE
    if not accumulate:
        return Mixed(node, "an overwriting scatter of several samples' rows")
    if node in an.tdep and values in an.tdep:
        layouts = {"indices": lay, "values": lay}
        an.contributions[node] = Contribution(
            node, "index_put", layouts, scaled_operand=-1,
            extra={"indices": idx, "values": values, "mask": mask},
        )
    return Reduced(node)


def _embedding_backward(an, node):
    grad, idx, num_weights, padding_idx, scale_by_freq = node.args[:5]
    if scale_by_freq:
        raise an.refuse(
            node, "embedding with scale_grad_by_freq=True scales by token counts taken across the batch",
            "use scale_grad_by_freq=False",
        )
    si, sg = an.st(idx), an.st(grad)
    lay = si if isinstance(si, Batched) else sg
    if lay.dim is None:
        return SINGLE
    if node in an.tdep:
        an.contributions[node] = Contribution(
            node, "embedding_backward", {"indices": lay, "values": lay}, scaled_operand=0,
            extra={"indices": idx, "values": grad, "padding_idx": padding_idx},
        )
    return Reduced(node)


def _sum_contribution_hook(an: BatchDimAnalysis, node: fx.Node, state):
    """Record sums over the sample dim in the backward as contributions."""
    if isinstance(state, Reduced) and state.origin is node and node in an.tdep and node.target.overloadpacket is aten.sum:
        x = node.args[0]
        an.contributions[node] = Contribution(node, "sum", {0: an.st(x)}, scaled_operand=0)
    return state


def _reduction_with_hook(an, node):
    return _sum_contribution_hook(an, node, _reduction(an, node))


_SCATTER_PACKETS = {aten.index_put, aten._unsafe_index_put, aten._unsafe_masked_index_put_accumulate}
_VIEWLIKE_PACKETS = {
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t,
    aten.unsqueeze, aten.squeeze, aten.clone, aten.alias, aten._to_copy, aten.detach,
}
_LINEAR_ON_REDUCED = {
    aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, prims.convert_element_type.default, aten.clone.default,
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.expand.default,
    aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.constant_pad_nd.default,
    aten.cat.default,
}
# cross-rank sums (FSDP gradient reduction): linear
_C10D = torch.ops._c10d_functional
COLLECTIVE_REDUCTIONS = {_C10D.reduce_scatter_tensor.default, _C10D.all_reduce.default}
_LINEAR_ON_REDUCED |= COLLECTIVE_REDUCTIONS | {_C10D.wait_tensor.default}

# ops that read a tensor's size, never its values
_SIZE_QUERIES = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}

_RULES: dict[Any, Any] = {}
for p in (aten.view, aten._unsafe_view, aten.reshape):
    _RULES[p] = _view
for p in (aten.clone, aten.alias, aten._to_copy, aten.detach, aten.lift_fresh_copy, aten.contiguous):
    _RULES[p] = _identity
_RULES[aten.permute] = _permute
_RULES[aten.transpose] = _transpose
_RULES[aten.t] = _transpose
_RULES[aten.unsqueeze] = _unsqueeze
_RULES[aten.squeeze] = _squeeze
_RULES[aten.expand] = _expand
_RULES[aten.slice] = _slice
_RULES[aten.select] = _select
for p in (aten.split, aten.split_with_sizes, aten.unbind, aten.chunk):
    _RULES[p] = _split
_RULES[aten.cat] = _cat
_RULES[aten.stack] = _stack
_RULES[aten.constant_pad_nd] = _pad
_RULES[aten.slice_scatter] = _slice_scatter
_RULES[aten.select_scatter] = _slice_scatter
_RULES[aten.tril] = _tril
_RULES[aten.triu] = _tril
for p in (aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.rand_like, aten.randn_like, aten.randint_like):
    _RULES[p] = _fresh
for p in (aten.sum, aten.mean, aten.amax, aten.amin, aten.var_mean, aten.var, aten.std, aten.std_mean, aten.prod,
          aten.argmax, aten.argmin, aten.logsumexp, aten.any, aten.all, aten.max, aten.min, aten.linalg_vector_norm):
    _RULES[p] = _reduction_with_hook
for p in (aten._softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
          aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.sort, aten.topk):
    _RULES[p] = _along_dim
_RULES[aten.gather] = _gather
_RULES[aten.embedding] = _embedding
_RULES[aten.index] = _index
_RULES[aten._unsafe_index] = _index
_RULES[aten.index_select] = _index_select
_RULES[aten.native_dropout] = _dropout
_RULES[aten.mm] = _mm
_RULES[aten.addmm] = _mm
_RULES[aten.bmm] = _bmm
for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward",
):
    if hasattr(aten, name):
        _RULES[getattr(aten, name)] = _attention
for p in (aten.index_put, aten._unsafe_index_put, aten._unsafe_masked_index_put_accumulate):
    _RULES[p] = _index_put
_RULES[aten.embedding_dense_backward] = _embedding_backward


def batch_dim_analysis_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Annotates every joint-graph node with its sample-dim state (meta["dp_batch"])."""
    an = BatchDimAnalysis(ctx, gm)
    an.run()
    for node, s in an.states.items():
        node.meta["dp_batch"] = s
    ctx.contributions = an.contributions
    ctx.counters["batch_dim_nodes_batched"] += sum(
        1 for s in an.states.values() if isinstance(s, Batched)
    )
    ctx.counters["contributions_found"] += len(an.contributions)
    ctx.analysis = an
    ctx.backward_nodes = [n for n in gm.graph.nodes if n in an.tdep and n.op == "call_function"]
    return gm
