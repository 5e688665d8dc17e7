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

Every op with a sample-dependent input needs a rule (``passes.rules``, one
module per op family); an op without one is refused (never guessed). Reductions over the batch dim in the backward are the
per-sample gradient *contributions*; they are recorded for the later passes.
"""
from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from dpcompile.errors import DPCompileError, DPValueError, SamplesMixedError
from dpcompile.fx_utils import known, module_of, op_name, source_line
from dpcompile.step_split import split_error_text

from .batch_state import (AMBIGUOUS_AT_ONE, BATCH_SIZE_FACTOR, BATCH_SIZE_FACTOR_WHY, COLLECTIVE_REDUCTIONS, FREE,
                          RATIO_OF_SUMS, ROW_ORDER_STATES, SINGLE,
                          SUM_OVER_NUMEL_AT_ONE, Batched, Contribution, Mixed, Reduced, is_zero_constant,
                          loss_not_per_sample, sample_count_sum, where_branches)
from .context import DPPassContext
from .rules import row_order, rule_for

aten = torch.ops.aten
prims = torch.ops.prims


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
                under = name.split(".")[0]
                raise DPValueError(
                    f"data inputs disagree on the batch size: '{sizes[0][0]}' has {sizes[0][1]} samples and "
                    f"'{name}' has {s} along their batch dims; if '{name}' is not per-sample, pass "
                    f"batch_dim={{'{name}': None}} (or the right dim) in the dp_fsdp options"
                    + (f" ({{'{under}': None}} for every tensor under '{under}', e.g. a flex_attention BlockMask "
                       f"the batch shares, built with B=None)" if under != name else "")
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
                if ctx.whole_gradient_mode and node in self.tdep:
                    self.states[node] = self._backward_state_of_one_sample(node)
                elif ctx.whole_gradient_mode:
                    self.states[node] = self._forward_state_of_one_sample(node)
                else:
                    self.states[node] = self._state(node)
            elif node.op == "output":
                pass
            elif node.op == "get_attr":
                # a constant the graph module holds (DTensor's masked embedding keeps one): no sample data
                self.states[node] = FREE
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
        if node.target in _ASSERTS:
            return FREE
        if node.target in _SIZE_QUERIES:
            # sizes are not sample data: how many samples and how long they
            # are, public like the batch size itself (x.view(x.size()[:-1] + ...))
            return FREE
        if not isinstance(v, (torch.Tensor, tuple, list)):
            # a Python scalar computed from per-sample values (.item()) would
            # carry sample data outside the graph's per-sample tracking
            if any(isinstance(s, (Batched, Reduced, Mixed, *ROW_ORDER_STATES)) for s in in_states):
                raise self.refuse(node, "produces a Python scalar from per-sample data")
            return FREE
        if any(isinstance(s, ROW_ORDER_STATES) for s in in_states):
            return row_order.state(self, node)  # rows sorted across the batch (routed experts)
        # Mixed inputs poison everything downstream; combining them with
        # per-sample data is the privacy bug we are here to prevent.
        mixed = [s for s in in_states if isinstance(s, Mixed)]
        if mixed:
            if any(isinstance(s, Batched) for s in in_states):
                raise self._mixing_error(node, mixed[0])
            return Mixed(mixed[0].origin, mixed[0].why)
        target = node.target
        reduced = [s for s in in_states if isinstance(s, Reduced)]
        if reduced:
            if any(isinstance(s, Batched) for s in in_states):
                raise self._mixing_error(node, Mixed(reduced[0].origin, "a sum over the samples"))
            return self._reduced_rule(node, reduced[0])
        rule = rule_for(target)
        if rule is None:
            raise self.refuse(
                node,
                "this op has per-sample inputs and dpcompile has no rule proving it keeps samples apart",
                "file an issue with this op, or keep it out of the compiled step",
            )
        return rule(self, node)

    def _backward_state_of_one_sample(self, node: fx.Node):
        """A backward node of a static batch of one (``whole_gradient_mode``). Its gradient is clipped whole, so
        no backward state is used: the schedule neither decomposes the gradients into contributions nor
        scales rows. Where dims of size one make a rule's layout ambiguous (an RNN's time steps of one, a
        sum over a size-one dim taken for the sample dim), the node is sample 0's (SINGLE) rather than
        refused: nothing can mix samples when there is one. The forward stays strict: it decides what the
        loss reduces over."""
        v = node.meta.get("val")
        if not isinstance(v, (torch.Tensor, tuple, list)):
            return self._state(node)  # a Python scalar from sample data leaves the graph: refused as ever
        try:
            s = self._state(node)
        except DPCompileError:
            self.ctx.counters["one_sample_backward_fallbacks"] += 1
            return tuple(SINGLE for _ in v) if isinstance(v, (tuple, list)) else SINGLE
        return s

    def _forward_state_of_one_sample(self, node: fx.Node):
        """A forward node of a static batch of one: refused as at any batch size (the forward's states decide
        whether the loss is a mean or a sum over samples). Samples found mixed there may be a dim of size one
        taken for the sample dim: that refusal says how to compile with the sample dim known."""
        try:
            return self._state(node)
        except SamplesMixedError as e:
            raise SamplesMixedError(
                f"{e}\n  At a static batch of one every dim of size one may hold the sample. If the step runs "
                f"at larger batches, dpcompile.mark_batch(<the step's batched inputs>) before the call compiles "
                f"one graph for every batch size, with the sample dim known.") from e

    def _mixing_error(self, node: fx.Node, m: Mixed) -> SamplesMixedError:
        o = m.origin
        ov = o.meta.get("val")
        if isinstance(ov, torch.Tensor) and ov.numel() == 1:
            # a scalar computed across samples feeding per-sample values: the
            # typical case is a loss normalised by a count over the batch
            err = loss_not_per_sample(o, m.why)
        else:
            err = SamplesMixedError(
                f"dp_fsdp cannot prove per-sample gradients: op {op_name(o)} in module {module_of(o)} "
                f"mixes samples ({m.why}), and its result is combined with per-sample data by "
                f"{op_name(node)} in module {module_of(node)}."
                + (f"\n  at: {source_line(o)}" if source_line(o) else "")
                + "\n  What to do: " + _mixing_advice(o)
            )
        return err

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
        if t in (aten.slice_scatter.default, aten.select_scatter.default) and is_zero_constant(node.args[0]) and \
                isinstance(self.states.get(node.args[1]), Reduced):
            return Reduced(r.origin)  # a sum over samples placed into zeros (x[i:j] or x[i] of a parameter): linear
        if t is aten.where.self and self.states.get(node.args[0]) is FREE and \
                all(isinstance(self.states.get(x), Reduced) for x in where_branches(node)):
            # each element from one of two sums over samples, or zero, by a sample-free cond: linear in the
            # samples' contributions (a mask; softplus's backward on a learned scalar: xIELU's alpha); replayed
            # per sample for the norm
            self.ctx.counters["where_of_sums"] += 1
            return Reduced(r.origin)
        if t in (aten.mm.default, aten.bmm.default):
            factors = [self.states.get(a) for a in node.args[:2]]
            if sum(isinstance(f, Reduced) for f in factors) == 1 and sum(f is FREE for f in factors) == 1:
                # a sum over samples times a sample-free matrix (a parameter multiplied by another parameter
                # before it meets the samples: DeBERTa's relative position embeddings through the key
                # projection): linear, replayed per sample for the norm
                return Reduced(r.origin)
        if t is aten._weight_norm_interface_backward.default and \
                isinstance(self.states.get(node.args[0]), Reduced) and \
                all(self.states.get(a) is FREE for a in node.args[1:4]):
            # weight_norm's backward (w = g v / ||v||: nn.utils.parametrizations.weight_norm): the gradients
            # of v and g are linear in w's, by factors of the parameters alone; replayed per sample for the
            # norm (per_sample_norms.weight_norm_backward)
            return (Reduced(r.origin), Reduced(r.origin))
        if t in _LINEAR_ON_REDUCED or getattr(t, "overloadpacket", None) in _VIEWLIKE_PACKETS:
            if t in (aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar):
                mean = self._batch_size_mean(node)
                if mean is AMBIGUOUS_AT_ONE:
                    return Mixed(node, SUM_OVER_NUMEL_AT_ONE)
                if mean is BATCH_SIZE_FACTOR:
                    return Mixed(node, BATCH_SIZE_FACTOR_WHY)
                if mean:
                    self.ctx.batch_size_means.add(node)
                    return Reduced(r.origin)
            if t in (aten.mul.Tensor, aten.div.Tensor):
                # linear only if the other factor does not depend on the samples
                if t is aten.div.Tensor and isinstance(self.states.get(node.args[1]), Reduced):
                    if node in self.tdep and self.states.get(node.args[0]) is FREE and \
                            node.args[1] in self.ctx.sample_count_means.values():
                        # the loss's incoming gradient over the count it divides by: the same for every
                        # sample, and the loss pass's M (that count) scales each sample's share back
                        return FREE
                    if self._sample_count_mean(node):
                        self.ctx.sample_count_means[node] = node.args[1]
                        return Reduced(r.origin)
                    return Mixed(node, RATIO_OF_SUMS)
                other = [self.states[a] for a in node.all_input_nodes]
                if sum(isinstance(s, Reduced) for s in other) > 1:
                    return Mixed(node, "a product of two sums over the samples")
            return Reduced(r.origin)
        return Mixed(node, f"{op_name(node)} of a sum over the samples")

    def _batch_size_mean(self, node: fx.Node):
        """``node`` divides a sum over the samples by the batch size (F.kl_div's reduction="batchmean", a
        hand-written ``loss.sum() / x.shape[0]`` or ``loss.sum() * (1 / x.shape[0])``) or by the number of
        elements summed, B times a per-sample count (``loss.sum() / loss.numel()`` of a ``[B, T]`` loss): the
        mean of per-sample losses that ``.mean()`` is, which the loss pass takes as one. The sum may reach the
        division through a sign or a sample-free factor (``F.cross_entropy``'s default mean with probability
        targets is ``-sum / B``). Taken as a constant factor of each sample's loss instead, the DP gradient
        would be the sum of clip(g_i / B) over the samples: under Poisson sampling B is the number of samples
        drawn, so one sample more or less would change every other sample's clipped share, and the
        sensitivity would exceed max_grad_norm. A static batch size is a number in the graph, a dynamic one a
        size symbol: both are compared exactly (a reciprocal to the float's rounding). At a static batch of
        one the number of elements summed is the per-sample count, so ``sum / numel`` and a sum of
        per-sample means (``sum / T``) are one graph: AMBIGUOUS_AT_ONE, refused (the graphs for other batch
        sizes would take the two apart, and mixing the readings across steps is the sensitivity problem
        above)."""
        reciprocal = node.target in (aten.mul.Tensor, aten.mul.Scalar)
        x, d = node.args[0], node.args[1]
        if reciprocal and isinstance(d, fx.Node) and isinstance(self.states.get(d), Reduced):
            x, d = d, x  # (1 / B) * sum
        summed_node = self._sum_behind(x)
        if summed_node is None:
            return False
        value = _scalar_value(d)
        if value is not None:
            summed = summed_node.args[0].meta.get("val") if isinstance(summed_node.args[0], fx.Node) else None
            counts = [self.B] + ([summed.numel()] if isinstance(summed, torch.Tensor) else [])
            for i, n in enumerate(counts):
                if _reciprocal_of(value, n) if reciprocal else _equal(value, n):
                    return AMBIGUOUS_AT_ONE if i and known(self.B == 1) else True
        # any other factor made from the batch size (or one the analysis cannot evaluate): read as a constant,
        # the clipped shares would depend on B (above); refused
        return BATCH_SIZE_FACTOR if self._reads_batch_size(d) else False

    def _reads_batch_size(self, factor: Any) -> bool:
        """Whether a sample-free factor is computed from the batch size (its symbol, made a tensor)."""
        syms = self.B.node.expr.free_symbols if isinstance(self.B, torch.SymInt) else set()
        stack, seen = [factor], set()
        while stack and syms:
            n = stack.pop()
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            v = n.meta.get("val")
            if isinstance(v, (torch.SymInt, torch.SymFloat)) and v.node.expr.free_symbols & syms:
                return True
            stack.extend(n.all_input_nodes)
        return False

    def _sum_behind(self, x: Any) -> fx.Node | None:
        """The sum over the samples that x is, or a sample-free multiple of (through a sign, a product or
        quotient by a sample-free value, a cast or a copy); None for anything else, or for a sum already
        divided by the batch size on the way."""
        while isinstance(x, fx.Node):
            st = self.states.get(x)
            if not isinstance(st, Reduced) or x in self.ctx.batch_size_means:
                return None
            if st.origin is x:
                return x if getattr(x.target, "overloadpacket", None) is aten.sum else None
            if x.target in (aten.neg.default, prims.convert_element_type.default, aten.clone.default):
                x = x.args[0]
                continue
            if x.target not in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
                return None
            a, b = x.args[:2]
            if x.target in (aten.mul.Tensor, aten.mul.Scalar) and isinstance(b, fx.Node) and \
                    isinstance(self.states.get(b), Reduced):
                a, b = b, a
            if isinstance(b, fx.Node) and self.states.get(b) is not FREE:
                return None
            x = a
        return None

    def _sample_count_mean(self, node: fx.Node) -> bool:
        """``node`` divides a sum of one value per sample by a count of samples (F.cross_entropy's and
        F.nll_loss's default mean over the targets that are not ignore_index, one target per sample): a mean
        of per-sample losses whose count leaves some samples out, which the loss pass takes as a mean with
        that count for the batch size (the DP gradient divides by expected_batch_size all the same). A count
        of several values per sample (a token mean over the batch) or of anything else stays refused: it
        would change each sample's scale."""
        num, den = (self.states.get(a) for a in node.args[:2])
        count = sample_count_sum(node.args[1])
        if not (isinstance(num, Reduced) and isinstance(den, Reduced) and count is not None
                and den.origin is count and getattr(num.origin.target, "overloadpacket", None) is aten.sum):
            return False

        def one_per_sample(s: fx.Node) -> bool:
            v = s.args[0].meta.get("val") if isinstance(s.args[0], fx.Node) else None
            return isinstance(v, torch.Tensor) and known(v.numel() == self.B)

        return one_per_sample(count) and one_per_sample(num.origin)

    # -- helpers used by rules -----------------------------------------------
    def st(self, a: Any):
        return self.states[a] if isinstance(a, fx.Node) else FREE

    def tensor_args(self, node: fx.Node) -> list[tuple[fx.Node, Any]]:
        return [(a, self.states[a]) for a in node.all_input_nodes]


# ops that make or pass on a 0-d value, and the arithmetic _scalar_value follows through them
_SCALAR_PASS = {prims.convert_element_type.default, aten._to_copy.default, aten.clone.default, aten.alias.default}
_SCALAR_ARITH = {aten.mul.Tensor: operator.mul, aten.mul.Scalar: operator.mul, aten.div.Tensor: operator.truediv,
                 aten.div.Scalar: operator.truediv, aten.true_divide.Tensor: operator.truediv}


def _scalar_value(x: Any, depth: int = 0) -> Any:
    """A sample-free factor's value as a number or size value: a number, a size (SymInt, SymFloat), or a 0-d
    tensor made of them (``torch.tensor(1.0) / x.shape[0]`` traced with an unbacked batch: full, scalar_tensor of
    the size, casts, products and quotients); None for anything else. Sizes stay torch's, so that _equal asks
    the shape environment (which knows sizes proven equal) before comparing expressions."""
    if isinstance(x, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool):
        return x
    if not isinstance(x, fx.Node) or depth > 16:
        return None
    v = x.meta.get("val")
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        return v
    if not (isinstance(v, torch.Tensor) and v.dim() == 0) or x.op != "call_function":
        return None
    t = x.target
    try:
        if t is aten.full.default and list(x.args[0]) == []:
            return _scalar_value(x.args[1], depth + 1)
        if t is aten.scalar_tensor.default or t in _SCALAR_PASS:
            return _scalar_value(x.args[0], depth + 1)
        if t is aten.reciprocal.default:
            a = _scalar_value(x.args[0], depth + 1)
            return None if a is None else 1.0 / a
        if t in _SCALAR_ARITH:
            a, b = (_scalar_value(y, depth + 1) for y in x.args[:2])
            return None if a is None or b is None else _SCALAR_ARITH[t](a, b)
    except (ZeroDivisionError, TypeError):
        return None
    return None


def _expr(v: Any) -> sympy.Expr:
    """A number or size value as a plain sympy expression: torch's float conversions and true divisions of
    sizes written as sympy's own, which simplify (1.0 / u0 times u0 is 1)."""
    from torch.utils._sympy.functions import FloatTrueDiv, IntTrueDiv, ToFloat

    e = v.node.expr if isinstance(v, (torch.SymInt, torch.SymFloat)) else sympy.sympify(v)
    e = e.replace(ToFloat, lambda x: x)
    for div in (FloatTrueDiv, IntTrueDiv):
        e = e.replace(div, lambda a, b: a / b)
    return e


def _equal(d: Any, n: Any) -> bool:
    """Whether the value d is n (a count): exactly, for numbers and size expressions."""
    if isinstance(d, (int, float)) and isinstance(n, int):
        return d == n
    if isinstance(d, (torch.SymInt, torch.SymFloat)) and known(d == n):
        return True
    try:
        return sympy.simplify(_expr(d) - _expr(n)) == 0
    except (TypeError, ValueError, AttributeError):
        return False


def _reciprocal_of(d: Any, n: Any) -> bool:
    """Whether the factor d is 1 / n: exactly for size expressions, to the rounding of 1.0 / n for numbers."""
    if isinstance(d, (int, float)) and isinstance(n, int):
        return n > 0 and d == 1.0 / n
    try:
        return sympy.simplify(_expr(d) * _expr(n) - 1) == 0
    except (TypeError, ValueError, AttributeError):
        return False


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
_LINEAR_ON_REDUCED |= COLLECTIVE_REDUCTIONS | {torch.ops._c10d_functional.wait_tensor.default}

# ops that read a tensor's size, never its values
_SIZE_QUERIES = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}
# runtime checks (F.one_hot's "class values must be non-negative", torch._check): they return nothing (or an
# ordering token), so no value of theirs reaches the loss or a gradient; one that fails raises, as eager torch
# does on the same bad target
_ASSERTS = {aten._assert_async.default, aten._assert_async.msg, aten._functional_assert_async.msg,
            aten._assert_scalar.default, aten._functional_assert_scalar.default}


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
