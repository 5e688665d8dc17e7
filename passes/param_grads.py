"""Per-parameter decomposition: each gradient as scaled per-sample contributions.

After the batch-dim analysis, a parameter's gradient output is reached from
one or more contribution nodes (sums over samples) through linear ops that
act on each sample's part separately: views, permutes, casts, scalar factors
and additions. Anything else between a contribution and the gradient (or a
gradient term that does not depend on the samples at all) is refused.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from dpcompile.errors import DPCompileError
from dpcompile.fx_utils import module_of, op_name

from .batch_dims import FREE, Batched, Contribution, Mixed, is_zero_constant
from .context import DPPassContext, ParamInfo

aten = torch.ops.aten
prims = torch.ops.prims

# ops that move a per-sample gradient's entries around without changing them
NORM_PRESERVING = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.clone.default, aten.alias.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
    aten._to_copy.default, prims.convert_element_type.default, aten.detach.default,
}


SCATTER_ADD = {aten.index_put.default, aten._unsafe_index_put.default, aten._unsafe_masked_index_put_accumulate.default}


@dataclasses.dataclass
class ParamGrad:
    param: ParamInfo
    grad_node: fx.Node
    terms: list[tuple[Contribution, float]]  # gradient = sum alpha * chain(contribution)
    norm_preserving: bool  # one term and the chain only moves entries


def _scalar(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def decompose(node: fx.Node, ctx: DPPassContext, param: ParamInfo, alpha: float = 1.0):
    """Returns ([(contribution, alpha)], norm_preserving)."""
    contribs = ctx.contributions
    if node in contribs:
        return [(contribs[node], alpha)], True
    st = ctx.states.get(node, FREE)

    def refuse(why: str) -> DPCompileError:
        return DPCompileError(
            f"dp_fsdp cannot decompose the gradient of parameter '{param.name}' per sample: {why} "
            f"(op {op_name(node)} in module {module_of(node)})."
        )

    if st is FREE or node not in ctx.tangent_dependent:
        raise refuse(
            "it has a term that does not depend on the samples (e.g. a regulariser such as weight decay "
            "added to the loss); add weight decay in the optimizer instead"
        )
    if isinstance(st, Mixed):
        raise refuse(f"it depends on {st.why}")
    if isinstance(st, Batched):
        raise refuse("the gradient still has a sample dim (internal: no reduction over samples found)")
    t = node.target
    if t in NORM_PRESERVING:
        terms, simple = decompose(node.args[0], ctx, param, alpha)
        return terms, simple
    if t in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        a, b = node.args[0], node.args[1]
        if t in (aten.mul.Tensor, aten.mul.Scalar) and _scalar(a) is not None:
            a, b = b, a
        s = _scalar(b)
        if s is None and isinstance(a, fx.Node) and isinstance(b, fx.Node):
            if ctx.states.get(a) is FREE and t in (aten.mul.Tensor,):
                a, b = b, a
            if (ctx.states.get(b) is FREE and b not in ctx.tangent_dependent
                    and tuple(node.meta["val"].shape) == tuple(a.meta["val"].shape)):
                # elementwise by a sample-free factor (e.g. BatchNorm's running
                # invstd in eval mode): linear per sample, replayed for the norm
                terms, _ = decompose(a, ctx, param, alpha)
                return terms, False
        if s is None or not isinstance(a, fx.Node):
            raise refuse("the gradient is multiplied by a per-sample or broadcasting tensor after the sum over samples")
        factor = s if t in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / s
        return decompose(a, ctx, param, alpha * factor)
    if t is aten.neg.default:
        return decompose(node.args[0], ctx, param, -alpha)
    if t in (aten.add.Tensor, aten.sub.Tensor):
        a, b = node.args[0], node.args[1]
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            raise refuse("a constant is added to the gradient")
        beta = node.kwargs.get("alpha", 1)
        ta, _ = decompose(a, ctx, param, alpha)
        tb, _ = decompose(b, ctx, param, alpha * beta * (-1 if t is aten.sub.Tensor else 1))
        return ta + tb, False
    if t is aten.slice_scatter.default and is_zero_constant(node.args[0]):
        terms, _ = decompose(node.args[1], ctx, param, alpha)
        return terms, False
    if t is aten.slice.Tensor:
        # e.g. Inductor's shape padding slices a padded contraction back
        terms, _ = decompose(node.args[0], ctx, param, alpha)
        return terms, False
    if t is aten.where.self and ctx.states.get(node.args[0]) is FREE:
        c, a, b = node.args[:3]
        x = a if is_zero_constant(b) else b if is_zero_constant(a) else None
        if isinstance(x, fx.Node) and tuple(node.meta["val"].shape) == tuple(x.meta["val"].shape):
            terms, _ = decompose(x, ctx, param, alpha)
            return terms, False
    if t in SCATTER_ADD:
        # a sum over samples scattered to sample-free positions (a position
        # embedding's backward): linear, replayed per sample for the norm
        vals = node.args[3] if t is aten._unsafe_masked_index_put_accumulate.default else node.args[2]
        terms, _ = decompose(vals, ctx, param, alpha)
        return terms, False
    raise refuse("this op is applied to the gradient after the sum over samples")


def param_grad_decomposition_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """For every trainable parameter: which contributions make up its gradient."""
    out = gm.graph.find_nodes(op="output")[0]
    outs = out.args[0]
    for p in ctx.params:
        g = outs[p.grad_output_index]
        if g is None:
            continue
        if ctx.whole_gradient_mode:
            ctx.decompositions[p.name] = ParamGrad(p, g, [], True)
            continue
        terms, simple = decompose(g, ctx, p)
        simple = simple and len(terms) == 1
        ctx.decompositions[p.name] = ParamGrad(p, g, terms, simple)
        ctx.counters["params_decomposed"] += 1
        if len(terms) > 1:
            ctx.counters["params_shared"] += 1
    # every contribution must end in a parameter gradient: one that feeds
    # anything else (an input gradient, say) cannot be scaled per sample safely
    used = {id(c) for pg in ctx.decompositions.values() for c, _ in pg.terms}
    for n, c in ([] if ctx.whole_gradient_mode else ctx.contributions.items()):
        if id(c) not in used:
            raise DPCompileError(
                f"dp_fsdp: op {op_name(n)} in module {module_of(n)} sums per-sample gradients over the batch "
                f"but its result is not a parameter gradient (does an input of the step require grad?). "
                f"Only parameters may receive gradients in a DP step: detach the inputs."
            )
    return gm
