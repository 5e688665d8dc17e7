"""Per-parameter decomposition: each gradient as scaled per-sample contributions.

After the batch-dim analysis, a parameter's gradient output is reached from
one or more contribution nodes (sums over samples) through linear ops that
act on each sample's part separately: views, permutes, casts, scalar factors
and additions. Anything else between a contribution and the gradient (or a
gradient term that does not depend on the samples at all) is refused.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from dpcompile.errors import DPCompileError
from dpcompile.fx_utils import known, module_of, op_name

from .batch_state import (COLLECTIVE_REDUCTIONS, FREE, Batched, Contribution, Mixed, has_collective_reductions,
                          is_gradient_reduction,
                          is_zero_constant, where_branches)
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
# sums over the parameter's own dims and broadcasts of a gradient (a parameter standardised or normalised
# before it meets the samples: the standardisation's backward): linear, replayed per sample for the norm
SUMS_AND_BROADCASTS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.expand.default}
MATRIX_PRODUCTS = {aten.mm.default, aten.bmm.default}


def _uncloned(x: fx.Node) -> fx.Node:
    """x behind its copies: a piece of a gradient that is not contiguous (an einsum's weight gradient, a
    permute of a matmul's output) is cloned contiguous before the glue."""
    while x.target is aten.clone.default:
        x = x.args[0]
    return x


def unglue(x: fx.Node) -> fx.Node:
    """The full local gradient G behind DTensor's shard glue, else x.

    Before a reduce-scatter, DTensor re-arranges G: for Shard(0) it splits G
    along dim 0 into one piece per rank, zero-pads the short ones and
    concatenates them; for Shard(d), d > 0, it may first do the same along d
    (uneven pieces), then cuts along d and concatenates the pieces along dim 0
    (the functional reduce-scatter's scatter_dim). Each step keeps every entry
    once and adds zeros (norm-preserving, linear). Recognised only in that
    form, step by step: cat([split(G)[0], pad(split(G)[1]), ..., pad(empty),
    ...]) over all pieces of one split, in order, each padded only with zeros;
    a rank past the last piece (the dim shorter than the ranks: a ViT's
    [1, 1, D] class token on 2 ranks) gets an empty tensor padded with zeros.
    """
    while (g := _unglue_once(x)) is not x:
        x = g
    return x


def _unglue_once(x: fx.Node) -> fx.Node:
    if not isinstance(x, fx.Node) or x.target is not aten.cat.default:
        return x
    split, pieces, past_last = None, 0, False
    for piece in x.args[0]:
        piece = _uncloned(piece)
        if piece.target is aten.constant_pad_nd.default:
            pad = list(piece.args[1])
            value = piece.args[2] if len(piece.args) > 2 else 0
            # zeros added after the entries of some dims: nothing cut off (a negative pad), nothing but zeros
            if value != 0 or not all(known(p >= 0) for p in pad):
                return x
            piece = _uncloned(piece.args[0])
        if known(piece.meta["val"].numel() == 0):  # empty: zeros once padded; only after every real piece
            past_last = True
            continue
        if past_last or piece.target is not operator.getitem or piece.args[1] != pieces:
            return x
        sp = piece.args[0]
        if sp.target not in (aten.split.Tensor, aten.split_with_sizes.default):
            return x
        if split is None:
            split = sp
        elif sp is not split:
            return x
        pieces += 1
    if split is None or pieces != len(split.meta["val"]):
        return x
    return split.args[0]


@dataclasses.dataclass
class ParamGrad:
    param: ParamInfo
    grad_node: fx.Node
    terms: list[tuple[Contribution, float]]  # gradient = sum alpha * chain(contribution)
    norm_preserving: bool  # one term and the chain only moves entries
    # this rank's full gradient before any cross-rank reduction (what the
    # per-sample norm is the norm of), as sum beta * local: one local gradient
    # per cross-rank reduction on the way to the output (a parameter used
    # twice, e.g. a tied embedding and LM head, is gathered and reduced once
    # per use); empty without collectives (the gradient is grad_node itself)
    locals: list[tuple[fx.Node, float]] = dataclasses.field(default_factory=list)

    @property
    def local_terms(self) -> list[tuple[fx.Node, float]]:
        return self.locals or [(self.grad_node, 1.0)]


def _scalar(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def decompose(node: fx.Node, ctx: DPPassContext, param: ParamInfo, alpha: float = 1.0):
    """Returns ([(contribution, alpha)], norm_preserving)."""
    contribs = ctx.contributions
    if node in contribs:
        return [(contribs[node], alpha)], True
    if node.target is operator.getitem and node.args[0] in contribs:
        # a contribution computed by a tuple-valued op: convolution_backward's weight gradient
        return [(contribs[node.args[0]], alpha)], True
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
    if t is torch.ops._c10d_functional.wait_tensor.default:
        return decompose(node.args[0], ctx, param, alpha)
    if t in COLLECTIVE_REDUCTIONS:
        # a sum over ranks: each rank's samples are its own, so the per-sample
        # gradient is this rank's gradient before the reduction
        return decompose(unglue(node.args[0]), ctx, param, alpha)
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
            if ctx.states.get(b) is FREE and b not in ctx.tangent_dependent and (
                    t is aten.mul.Tensor or tuple(node.meta["val"].shape) == tuple(a.meta["val"].shape)):
                # by a sample-free factor (e.g. BatchNorm's running invstd in eval mode, a standardised
                # weight's centred values, broadcast over the gradient's dims): linear per sample, replayed
                # for the norm
                terms, _ = decompose(a, ctx, param, alpha)
                return terms, False
        if s is None or not isinstance(a, fx.Node):
            raise refuse("the gradient is multiplied by a per-sample or broadcasting tensor after the sum over samples")
        factor = s if t in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / s
        return decompose(a, ctx, param, alpha * factor)
    if t is aten.neg.default:
        return decompose(node.args[0], ctx, param, -alpha)
    if t in MATRIX_PRODUCTS:
        chain = [a for a in node.args[:2] if ctx.states.get(a) is not FREE]
        free = [a for a in node.args[:2] if ctx.states.get(a) is FREE and a not in ctx.tangent_dependent]
        if len(chain) == 1 and len(free) == 1:  # by a sample-free matrix: linear, replayed per sample
            terms, _ = decompose(chain[0], ctx, param, alpha)
            return terms, False
    if t in SUMS_AND_BROADCASTS and isinstance(node.args[0], fx.Node):
        terms, _ = decompose(node.args[0], ctx, param, alpha)
        return terms, False
    if t in (aten.add.Tensor, aten.sub.Tensor):
        a, b = node.args[0], node.args[1]
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            raise refuse("a constant is added to the gradient")
        beta = node.kwargs.get("alpha", 1)
        ta, _ = decompose(a, ctx, param, alpha)
        tb, _ = decompose(b, ctx, param, alpha * beta * (-1 if t is aten.sub.Tensor else 1))
        return ta + tb, False
    if t is aten.cat.default:
        # disjoint blocks of the parameter, each its own gradient (nn.MultiheadAttention's in_proj_weight when
        # query and key differ: three linears of its chunks): per sample, the blocks of that sample's
        terms = []
        for x in node.args[0]:
            if not isinstance(x, fx.Node):
                raise refuse("a constant block is joined to the gradient")
            terms += decompose(x, ctx, param, alpha)[0]
        ctx.counters["param_grad_blocks_joined"] += 1
        return terms, False
    if t in (aten.slice_scatter.default, aten.select_scatter.default) and is_zero_constant(node.args[0]):
        terms, _ = decompose(node.args[1], ctx, param, alpha)
        return terms, False
    if t is operator.getitem and node.args[0].target is aten._weight_norm_interface_backward.default:
        # v's or g's gradient from w's (the batch-dim analysis proved the other operands sample-free)
        terms, _ = decompose(node.args[0].args[0], ctx, param, alpha)
        return terms, False
    if t is operator.getitem:
        whole = tp_slice_source(node, param, ctx)
        if whole is not None:
            # a gradient whole on every tp rank cut to this rank's slice of a Shard parameter (2-D
            # fully_shard: a RowwiseParallel embedding's): each sample's norm is the whole one's, counted once
            param.tp = "replicate"
            terms, _ = decompose(whole, ctx, param, alpha)
            return terms, False
    if t is aten.slice.Tensor:
        # e.g. Inductor's shape padding slices a padded contraction back. After the cross-rank reduction it
        # cuts the padding off this rank's shard of the reduced gradient (a parameter whose dim does not
        # divide by the ranks): the per-sample norm is of this rank's gradient before the reduction
        # (ParamGrad.locals), which the cut does not touch
        terms, simple = decompose(node.args[0], ctx, param, alpha)
        return terms, simple and _reduced_by_collective(node.args[0])
    if t is aten.where.self and ctx.states.get(node.args[0]) is FREE:
        # each element from one of two gradients, or zero (batch_dims proved the branches sums over samples):
        # the contributions of both, the per-sample gradient replayed through the where
        terms = []
        for x in where_branches(node):
            terms += [tc for tc in decompose(x, ctx, param, alpha)[0] if all(tc[0] is not c for c, _ in terms)]
        return terms, False
    if t in SCATTER_ADD:
        # a sum over samples scattered to sample-free positions (a position
        # embedding's backward): linear, replayed per sample for the norm
        vals = node.args[3] if t is aten._unsafe_masked_index_put_accumulate.default else node.args[2]
        # (x[:, :, i, j] of a parameter, F.interpolate of a position embedding: the replay takes the sample
        # dim whole as well)
        terms, _ = decompose(vals, ctx, param, alpha)
        return terms, False
    raise refuse("this op is applied to the gradient after the sum over samples")


def local_terms(g: fx.Node, param: ParamInfo, ctx: DPPassContext) -> list[tuple[fx.Node, float]]:
    """g as a linear combination sum beta * reduce(local) of this rank's pre-reduction gradients.

    Walks from the gradient output through what follows the cross-rank
    reductions (waits, views, casts, slices, sums and scalar factors of their
    results). [] when no reduction reaches g (one process). Tensor parallel:
    a reduction over the tp group on the way (the step sums a Partial gradient
    itself, as 2-D fully_shard does) makes the local gradient this rank's part
    of a sum (``param.tp`` "partial"); a cut to this rank's slice of a gradient
    whole on every rank is walked through (``param.tp`` "replicate").
    """
    def walk(node, beta):
        t = node.target if isinstance(node, fx.Node) and node.op == "call_function" else None
        if t in COLLECTIVE_REDUCTIONS:
            return [(_innermost_local(node, param, ctx), beta)]
        if t is torch.ops._c10d_functional.wait_tensor.default or t in NORM_PRESERVING or t is aten.slice.Tensor:
            # a slice after the reduction cuts an uneven shard's padding off: this rank's gradient
            # before the reduction is the whole parameter's either way
            return walk(node.args[0], beta)
        if t is aten.neg.default:
            return walk(node.args[0], -beta)
        if t in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            a, s = node.args[0], node.args[1]
            if t in (aten.mul.Tensor, aten.mul.Scalar) and _scalar(a) is not None:
                a, s = s, a
            if _scalar(s) is not None:
                return walk(a, beta * (_scalar(s) if t in (aten.mul.Tensor, aten.mul.Scalar) else 1.0 / _scalar(s)))
        if t in (aten.add.Tensor, aten.sub.Tensor):
            sign = node.kwargs.get("alpha", 1) * (-1 if t is aten.sub.Tensor else 1)
            a, b = walk(node.args[0], beta), walk(node.args[1], beta * sign)
            if a is not None and b is not None:
                return a + b
        return None

    found = walk(g, 1.0)
    if found is None and _reaches_a_reduction(g):
        raise DPCompileError(
            f"dp_fsdp: the gradient of parameter '{param.name}' combines cross-rank reductions with other terms "
            f"after the reduction (op {op_name(g)}); dpcompile cannot tell this rank's per-sample gradient"
        )
    return found or []


def tp_slice_source(node: fx.Node, param: ParamInfo, ctx: DPPassContext) -> fx.Node | None:
    """G when ``node`` is this rank's piece of the parameter's whole gradient G cut into one piece per tp rank
    (DTensor turning a gradient whole on every rank into its Shard parameter's placement:
    ``getitem(split(G), tp_rank)``), else None."""
    if ctx.tp_size < 2 or param.tp_grad != "shard" or node.target is not operator.getitem:
        return None
    split, index = node.args
    if not isinstance(split, fx.Node) or split.target not in (aten.split.Tensor, aten.split_with_sizes.default):
        return None
    whole = split.args[0]
    # the parameter's whole shape, cut into tp pieces, this rank's taken: not a piece of a larger gradient
    # (parameters concatenated in the forward are split apart in the backward)
    if index != ctx.tp_rank or len(split.meta["val"]) != ctx.tp_size or \
            tuple(whole.meta["val"].shape) != tuple(param.shape):
        return None
    return whole


def _innermost_local(reduction: fx.Node, param: ParamInfo, ctx: DPPassContext) -> fx.Node:
    """The gradient before the first of a chain of reductions (a 2-D mesh reduce-scatters, then all-reduces
    the result across replicas; 2-D fully_shard sums a Partial gradient over tp, then reduce-scatters it over
    dp): what reaches ``reduction`` through waits, views, further reductions and tp slices."""
    local = node = reduction
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in COLLECTIVE_REDUCTIONS:
            if ctx.tp_group is not None and node.args[-1] == ctx.tp_group:
                param.tp = "partial"  # this rank's part; the sum over tp is the gradient
            local = node = unglue(node.args[0])
        elif node.target is torch.ops._c10d_functional.wait_tensor.default or node.target in NORM_PRESERVING:
            node = node.args[0]
        elif (whole := tp_slice_source(node, param, ctx)) is not None:
            param.tp = "replicate"  # decompose's reading of the same cut
            local = node = whole
        else:
            break
    return local


def _reduced_by_collective(x: fx.Node) -> bool:
    """x is the result of a cross-rank reduction, through waits and entry-moving views."""
    while isinstance(x, fx.Node) and x.op == "call_function" and (
            x.target is torch.ops._c10d_functional.wait_tensor.default or x.target in NORM_PRESERVING):
        x = x.args[0]
    return isinstance(x, fx.Node) and is_gradient_reduction(x)


def _reaches_a_reduction(g: fx.Node) -> bool:
    stack, seen = [g], set()
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        if is_gradient_reduction(n):
            return True
        stack.extend(n.all_input_nodes)
    return False


def param_grad_decomposition_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """For every trainable parameter: which contributions make up its gradient."""
    out = gm.graph.find_nodes(op="output")[0]
    outs = out.args[0]
    # one process: no gradient is reduced across ranks, and local_terms' search of every gradient's whole
    # computation for a reduction (once per parameter) would find none
    reduced = has_collective_reductions(gm.graph)

    def locals_of(g, p):
        return local_terms(g, p, ctx) if reduced else []

    for p in ctx.params:
        g = outs[p.grad_output_index]
        if g is None:
            continue
        if ctx.whole_gradient_mode or ctx.empty_batch:
            ctx.decompositions[p.name] = ParamGrad(p, g, [], True, locals_of(g, p))
            continue
        terms, simple = decompose(g, ctx, p)
        simple = simple and len(terms) == 1
        ctx.decompositions[p.name] = ParamGrad(p, g, terms, simple, locals_of(g, p))
        ctx.counters["params_decomposed"] += 1
        if len(terms) > 1:
            ctx.counters["params_shared"] += 1
    # every contribution must end in a parameter gradient: one that feeds
    # anything else (an input gradient, say) cannot be scaled per sample safely
    used = {id(c) for pg in ctx.decompositions.values() for c, _ in pg.terms}
    for n, c in ([] if ctx.whole_gradient_mode or ctx.empty_batch else ctx.contributions.items()):
        if id(c) not in used:
            raise DPCompileError(
                f"dp_fsdp: op {op_name(n)} in module {module_of(n)} sums per-sample gradients over the batch "
                f"but its result is not a parameter gradient (does an input of the step require grad?). "
                f"Only parameters may receive gradients in a DP step: detach the inputs."
            )
    return gm
