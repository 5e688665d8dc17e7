"""Clip-scaled gradients: book-keeping (deferred contractions) and ghost (second backward).

Backprop is linear in the loss tangent and keeps samples apart, so the
gradient of sum_i r_i l_i is every per-sample contribution scaled by r_i:

- bk: each deferred contribution is rebuilt after the clip coefficients with
  its tangent-side operand row-scaled, ``mm((r*G)^T, A)``; the original
  contraction is dropped. One backward.
- ghost: the first backward keeps only what the norms need (its weight
  contractions die); a copy of the backward runs with the tangent scaled per
  sample where it first meets per-sample data, and provides the gradients.
- auto: bk for contributions whose deferred operand fits the memory budget
  (farthest from the loss first), ghost for the rest.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from dpcompile.buffer_reuse import mark_second_backward
from dpcompile.errors import DPCompileError
from dpcompile.fx_utils import GraphBuilder, module_of, op_name

from .batch_state import FREE, Batched, Contribution, Permuted, bytes_at_expected_batch
from .context import DPPassContext
from .grouped_norms import row_samples
from .inplace_row_masks import ROW_MASK

aten = torch.ops.aten


def sample_layout(b: GraphBuilder, lay: Batched, v: fx.Node, B: Any, ndim: int, d: int, N: Any) -> fx.Node:
    """v (one value per sample) laid out along dim d of an ndim-dim tensor: shape [1, .., N, .., 1]. Built once
    per layout for all the operands that share it (``b.memo``): GPT-2-small's bk asked for 321 layouts of r and
    keep, of a few kinds, each three nodes for the partitioner and Inductor to go through."""
    if isinstance(lay, Permuted):  # rows sorted across the batch: v of each row's sample
        key = ("row_layout", v, lay.sort, str(lay.inner), str(B), ndim, d)
        if key not in b.memo:
            shape = [1] * ndim
            shape[d] = N
            b.memo[key] = b.reshape(b.call(aten.index.Tensor, v, [row_samples(b, lay, B)]), shape)
        return b.memo[key]
    key = ("sample_layout", v, str(B), ndim, d, str(N), str(lay.outer), str(lay.inner))
    if key not in b.memo:
        R = b.call(aten.expand.default, b.view(v, [1, B, 1]), [lay.outer, B, lay.inner])
        shape = [1] * ndim
        shape[d] = N
        b.memo[key] = b.reshape(R, shape)
    return b.memo[key]


def sample_scale(b: GraphBuilder, lay: Batched, r: fx.Node, B: Any, ndim: int, d: int, N: Any, dtype) -> fx.Node:
    """r laid out along dim d of an ndim-dim tensor: shape [1, .., N, .., 1], value r[sample(j)]."""
    R = sample_layout(b, lay, r, B, ndim, d, N)
    if dtype != torch.float32:
        key = ("sample_scale", R, dtype)
        if key not in b.memo:
            b.memo[key] = b.call(torch.ops.prims.convert_element_type.default, R, dtype)
        R = b.memo[key]
    return R


def zero_dropped_rows(b: GraphBuilder, x: fx.Node, lay: Batched, keep: fx.Node | None, B: Any,
                      in_place: bool = False) -> fx.Node:
    """where(keep[sample(j)], x, 0): a dropped sample's rows are exact zeros, also where x holds inf or
    NaN (a product with a zero coefficient would not be). ``in_place``: every reader after this one is one of
    bk's rebuilt contractions, so the backward may zero x's rows where they lie (passes.inplace_row_masks)."""
    if keep is None or lay.dim is None:
        return x
    xv = x.meta["val"]
    K = sample_layout(b, lay, keep, B, xv.dim(), lay.dim, xv.shape[lay.dim])
    masked = b.call(aten.where.self, K, x, b.call(aten.scalar_tensor.default, 0.0, dtype=xv.dtype))
    if in_place:
        masked.meta[ROW_MASK] = lay.dim
    return masked


def row_scale(b: GraphBuilder, x: fx.Node, lay: Batched, r: fx.Node, B: Any, keep: fx.Node | None = None) -> fx.Node:
    """x * r[sample(j)] along x's sample dim, r cast to x's dtype (dropped samples' rows zeroed)."""
    xv = x.meta["val"]
    scaled = b.call(aten.mul.Tensor, x, sample_scale(b, lay, r, B, xv.dim(), lay.dim, xv.shape[lay.dim], xv.dtype))
    return zero_dropped_rows(b, scaled, lay, keep, B)


def _row_elements(v: fx.Node, lay: Batched) -> int | None:
    """Elements per index of the sample dim, where that is known while compiling."""
    n = 1
    for d, size in enumerate(v.meta["val"].shape):
        if d != lay.dim:
            n = n * size
    return n if isinstance(n, int) else None


# contributions of two per-sample operands, an input and an output gradient (scaled_operand: the latter)
_CONTRACTIONS = ("mm", "bmm", "conv", "grouped")


def _tangent_position(c: Contribution, positions: dict[int, Batched]) -> int:
    """The argument position of a contribution's operand that is linear in the loss tangent."""
    return c.scaled_operand if c.kind in _CONTRACTIONS else next(iter(positions))


def _scaled_position(c: Contribution, positions: dict[int, Batched]) -> int:
    """Which operand of a deferred contribution bk scales. For two operands either gives the same product (each
    row holds one sample's values), and the other is masked, which costs nothing where the backward zeroes its
    rows in place (passes.inplace_row_masks). So the one with fewer elements per row (the LM head: the hidden
    states, not the logits' gradient); on a tie the one not linear in the tangent, since the tangent side is
    always made by the backward itself, and so can be masked in place, where the other may be a saved
    activation."""
    if c.kind not in _CONTRACTIONS or len(positions) != 2:
        return _tangent_position(c, positions)
    args = c.node.args
    other = next(i for i in positions if i != c.scaled_operand)
    n_t, n_o = (_row_elements(args[i], positions[i]) for i in (c.scaled_operand, other))
    if n_t is None or n_o is None:
        return c.scaled_operand
    return other if n_o <= n_t else c.scaled_operand


def _operand_positions(c: Contribution) -> dict[int, Batched]:
    """Argument position -> sample layout of every per-sample operand of a contribution."""
    if c.kind in ("mm", "bmm"):
        return dict(c.layouts)
    if c.kind == "index_put":
        return {3 if c.node.target is aten._unsafe_masked_index_put_accumulate.default else 2: c.layouts["values"]}
    if c.kind == "embedding_backward":
        return {0: c.layouts["values"]}
    if c.kind == "sum":
        return {0: c.layouts[0]}
    if c.kind == "conv":  # output gradient and input
        return {0: c.layouts[0], 1: c.layouts[1]}
    if c.kind == "grouped":  # the sorted rows and their output gradient
        return dict(c.layouts)
    raise AssertionError(c.kind)


# views that keep every element of their input, in another shape or order: an operand reached through them is
# scaled or masked at its source, which the other contributions reading that source share
_WHOLE_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
                aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
                aten.squeeze.default, aten.alias.default)


def _source(x: fx.Node, states: dict) -> tuple[fx.Node, list[fx.Node]]:
    """x's source through whole views whose input has a sample dim, and those views (outermost first)."""
    views = []
    while (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _WHOLE_VIEWS
           and isinstance(states.get(x.args[0]), Batched) and states[x.args[0]].dim is not None):
        views.append(x)
        x = x.args[0]
    return x, views


def scaled_contribution(b: GraphBuilder, c: Contribution, r: fx.Node | None, B: Any, keep: fx.Node | None = None,
                        arg_of=lambda a: a, clean: frozenset = frozenset(), shared: dict | None = None,
                        states: dict | None = None, scaled_at: int | None = None,
                        in_place_masks: bool = False) -> fx.Node:
    """The contribution rebuilt with its tangent-side operand (or the one at ``scaled_at``) row-scaled by r (r
    None: not scaled) and every per-sample operand's dropped rows zeroed (but operands in ``clean``: zeroed
    already). ``in_place_masks`` (bk's rebuilt contractions, after every norm): the masks may run in place.

    With ``shared`` (and ``states``, the nodes' sample layouts), an operand is scaled or masked at its source
    (through reshapes and transposes) once for every contribution that reads it: q, k and v projections of
    one input, a block's convolution and its shortcut's, the two branches of a residual's output gradient.
    Each copy is a full read and write of the operand (WRN-16-4 bf16 on an H100: the largest such kernel
    made 10 copies, 2 of them repeats)."""
    node = c.node
    args = list(fx.node.map_arg(tuple(node.args), arg_of))
    positions = _operand_positions(c)
    scaled = _tangent_position(c, positions) if scaled_at is None else scaled_at
    for i, lay in positions.items():
        do_scale = i == scaled and r is not None
        if not do_scale and (args[i] in clean or keep is None):
            continue
        src, views = (args[i], []) if shared is None else _source(args[i], states)
        src_lay = states[src] if views else lay
        key = (src, do_scale, src_lay.dim, repr(src_lay.outer), repr(src_lay.inner))
        new = shared.get(key) if shared is not None else None
        if new is None:
            new = row_scale(b, src, src_lay, r, B, keep) if do_scale else \
                zero_dropped_rows(b, src, src_lay, keep, B, in_place=in_place_masks)
            if shared is not None:
                shared[key] = new
        for v in reversed(views):
            new = b.call(v.target, new, *v.args[1:], **v.kwargs)
        args[i] = new
    return b.call(node.target, *args, **fx.node.map_arg(dict(node.kwargs), arg_of))


# the summary's "bk_scaled" for a gradient made from kept per-sample rows
SUM_FROM_ROWS = "the per-sample sums (the norm pass's [B, n] rows)"
CONV_FROM_ROWS = "the per-sample gradients the conv norm kernel kept (conv_weight_grads)"


def _gradient_of(c: Contribution) -> fx.Node:
    """The node whose value is c's gradient: c's node, or for a tuple-valued one (a convolution_backward,
    transformers' grouped_mm_fallback_backward) its weight gradient's getitem."""
    if c.kind != "conv" and not isinstance(c.node.meta["val"], (tuple, list)):
        return c.node
    (item,) = [u for u in c.node.users if u.target is operator.getitem and u.args[1] == 1]
    return item


def _sum_from_rows(b: GraphBuilder, c: Contribution, rows: fx.Node, index: int, widths: list[int], arrange,
                   r: fx.Node, keep: fx.Node | None, clipped: dict) -> fx.Node:
    """A parameter's clipped gradient from the per-sample gradients the norm pass kept as rows ([B, N], columns
    of widths[i] for the i-th such gradient; c's are at ``index``): sum_b r_b * rows[b]. Rows are a summed
    parameter's (a bias, a norm weight: each sample's own sum over its positions, exact), instead of a second
    pass over the [B, T, C] operand (a ViT-S/16 block's eight such parameters read about 120 MB again), or a
    convolution weight's, instead of a second weight-gradient convolution. One reduction over all of rows,
    split once into every parameter's part; a dropped sample's row (inf or NaN) is zeroed, not scaled.
    ``arrange``: None, or the (shape, permutation) from a row's order to the gradient's."""
    if rows not in clipped:
        B = rows.meta["val"].shape[0]
        scaled = b.call(aten.mul.Tensor, rows, b.view(r, [B, 1]))
        if keep is not None:
            scaled = b.call(aten.where.self, b.view(keep, [B, 1]), scaled,
                            b.call(aten.scalar_tensor.default, 0.0, dtype=torch.float32))
        clipped[rows] = _split_once(b, b.call(aten.sum.dim_IntList, scaled, [0]), widths)
    total, parts = clipped[rows]
    want = _gradient_of(c).meta["val"]
    if want.dtype != total.meta["val"].dtype:
        # the parameters whose gradient is in another dtype (a linear's bias under autocast: bf16) read their
        # parts from one cast of the whole sum, split once: a cast per part was a kernel per parameter, each
        # its own Triton compile and autotuning (its slice's offset is in its code; GPT-2 bf16: 48 kernels)
        if (rows, want.dtype) not in clipped:
            clipped[rows, want.dtype] = _split_once(
                b, b.call(torch.ops.prims.convert_element_type.default, total, want.dtype), widths)
        total, parts = clipped[rows, want.dtype]
    part = total if parts is None else b.call(operator.getitem, parts, index)
    if arrange is not None:
        shape, perm = arrange
        part = b.permute(b.view(part, shape), perm)
        if tuple(part.meta["val"].stride()) != tuple(want.stride()):  # (a channels-last weight's: none needed)
            part = b.call(aten.clone.default, part, memory_format=torch.contiguous_format)
    elif want.dim() != 1:  # (a 1-D gradient, most of them, is the part itself: no node to trace)
        part = b.reshape(part, list(want.shape))
    return part


def _split_once(b: GraphBuilder, total: fx.Node, widths: list[int]) -> tuple[fx.Node, fx.Node | None]:
    """A clipped row sum and its one split into every parameter's part (None for a single part): one split, not
    a slice per parameter, since each node the partitioner adds is traced (about 1.5 ms on CPU), and a ViT or
    GPT-2 has about a hundred such parameters."""
    return total, (b.call(aten.split_with_sizes.default, total, widths) if len(widths) > 1 else None)


def _deferred_bytes(c: Contribution, ctx: DPPassContext) -> int:
    """Bytes the deferred operand holds at the expected batch size (never from this rank's sampled B: every
    rank must take the same decisions, and so issue the same collectives in the same order). A size
    symbolic beyond the batch never fits a budget. A sum whose per-sample rows the norm pass keeps holds
    nothing more (its clipped gradient is read from them)."""
    if c in ctx.sample_rows:
        return 0
    op = c.node.args[c.scaled_operand] if c.kind in _CONTRACTIONS + ("sum", "embedding_backward") else \
        c.extra["values"]
    nbytes = bytes_at_expected_batch(op, ctx.states, ctx.batch_size, ctx.options.expected_batch_size)
    return 1 << 62 if nbytes is None else nbytes


def _contributions(ctx: DPPassContext) -> list[Contribution]:
    """Every parameter's contributions, each once: one can reach a gradient by several paths (a standardised
    weight's backward reads it three times) or reach several parameters (weight_norm's g and v)."""
    return list(dict.fromkeys(c for pg in ctx.decompositions.values() for c, _ in pg.terms))


def choose_deferred(ctx: DPPassContext) -> set[Contribution]:
    """The contributions rebuilt after the clip coefficients (bk); the others come from ghost's second backward.
    Under every schedule that includes the sums whose per-sample rows the norm pass keeps: their clipped sum
    is one small reduction over those rows (_sum_from_rows), and ghost's second backward then has no bias or
    norm-weight reductions to make."""
    contribs = _contributions(ctx)
    sched = ctx.options.schedule
    if sched == "bk":
        return set(contribs)
    if sched == "ghost":
        return {c for c in contribs if c in ctx.sample_rows}
    order = {n: i for i, n in enumerate(ctx.backward_nodes)}
    # the backward runs from the loss towards the inputs: late contributions
    # hold their deferred operand for the shortest time, so defer those first
    budget = ctx.options.memory_budget
    chosen, used = set(), 0
    for c in sorted(contribs, key=lambda c: -order.get(c.node, 0)):
        nbytes = _deferred_bytes(c, ctx)
        if used + nbytes <= budget:
            chosen.add(c)
            used += nbytes
    return chosen


def _replace_output(out: fx.Node, index: int, new: fx.Node) -> None:
    outs = list(out.args[0])
    outs[index] = new
    out.args = (tuple(outs),) + tuple(out.args[1:])


def clip_schedule_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Rewrites the parameter gradients into clipped sums under the chosen schedule."""
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    r = ctx.scale_rows
    b = GraphBuilder(graph)
    if r is None:
        return gm
    B = ctx.batch_size
    sched_report = ctx.summary.setdefault("schedule", {"requested": ctx.options.schedule})
    keep = ctx.keep_rows

    if ctx.whole_gradient_mode:
        with graph.inserting_before(out):
            rs = b.call(aten.squeeze.dim, r, 0)
            ks = b.call(aten.squeeze.dim, keep, 0) if keep is not None else None
            for pg in ctx.decompositions.values():
                # scale before any cross-rank sum (r is this rank's sample's): each local gradient
                for g, _ in pg.local_terms:
                    rr = rs if g.meta["val"].dtype == torch.float32 else b.call(
                        torch.ops.prims.convert_element_type.default, rs, g.meta["val"].dtype)
                    scaled = b.call(aten.mul.Tensor, g, rr)
                    if ks is not None:  # a non-finite gradient of the one sample is dropped
                        scaled = b.call(aten.where.self, ks, scaled,
                                        b.call(aten.scalar_tensor.default, 0.0, dtype=g.meta["val"].dtype))
                    if not pg.locals:
                        _replace_output(out, pg.param.grad_output_index, scaled)
                    else:
                        g.replace_all_uses_with(
                            scaled, delete_user_cb=lambda u, s=scaled: u is not s and not u.meta.get("dpcompile"))
                ctx.counters["whole_gradient_scaled"] += 1
        sched_report["used"] = "single sample: gradient scaled by its clip coefficient"
        return gm

    deferred = choose_deferred(ctx)
    all_contribs = _contributions(ctx)
    recompute = [c for c in all_contribs if c not in deferred]

    # bk: rebuild deferred contributions after r, row-scaled; last parameter
    # first, the order a backward produces gradients and the order their
    # reductions are issued in (collective_order), so each reduce-scatter
    # can run under the next contraction
    operands: dict = {}
    scaled_side: dict = {}  # contribution -> what bk scales (the dump summary's per-parameter "bk_scaled")
    clipped_rows: dict = {}  # [B, N] per-sample sums -> their clipped sum over samples [N], split per parameter
    with graph.inserting_before(out):
        for c in reversed(all_contribs):
            if c not in deferred:
                continue
            b.meta_source = c.node
            if c in ctx.sample_rows:
                new = _sum_from_rows(b, c, *ctx.sample_rows[c], r, keep, clipped_rows)
                scaled_side[c] = CONV_FROM_ROWS if c.kind == "conv" else SUM_FROM_ROWS
                _gradient_of(c).replace_all_uses_with(new)
                ctx.counters["bk_conv_grads_from_rows" if c.kind == "conv" else "bk_sums_from_rows"] += 1
                continue
            at = _scaled_position(c, _operand_positions(c))
            scaled_side[c] = _describe_scaled(c, at)
            before = len(operands)
            new = scaled_contribution(b, c, r, B, keep, shared=operands, states=ctx.states, scaled_at=at,
                                      in_place_masks=True)
            ctx.counters["bk_operand_copies"] += len(operands) - before
            if isinstance(c.node.meta["val"], (tuple, list)) and c.kind == "grouped":
                # (x's gradient, w's): the backward goes on with the unscaled first, w's gradient is the clipped
                item = _gradient_of(c)
                item.replace_all_uses_with(b.call(operator.getitem, new, item.args[1]))
            else:
                c.node.replace_all_uses_with(new)
            ctx.counters["bk_deferred_contractions"] += 1
    # one cast of a clipped row sum per dtype its parameters' gradients are in (_sum_from_rows)
    casts = sum(isinstance(k, tuple) for k in clipped_rows)
    if casts:
        ctx.counters["clipped_row_sums_cast"] += casts
    # ghost: a second backward for the parameters with recomputed contributions
    if recompute:
        _second_backward(gm, ctx, b, out, r, B, {c.node for c in recompute}, keep)
    rebuilt = {c for c in deferred if c not in ctx.sample_rows}
    sched_report["deferred"] = sorted(c.node.name for c in rebuilt)
    sched_report["from_rows"] = sorted(c.node.name for c in deferred if c in ctx.sample_rows)
    sched_report["recomputed"] = sorted(c.node.name for c in recompute)
    sched_report["used"] = "bk" if not recompute else ("ghost" if not rebuilt else "auto (bk + ghost)")
    ctx.summary.setdefault("params", {})
    for name, pg in ctx.decompositions.items():
        ctx.summary["params"][name]["schedule"] = (
            "clipped sum of its per-sample rows" if all(c in ctx.sample_rows and c in deferred for c, _ in pg.terms)
            else "deferred (bk)" if all(c in deferred for c, _ in pg.terms) else "second backward (ghost)"
        )
        sides = sorted({scaled_side[c] for c, _ in pg.terms if c in scaled_side})
        if sides:
            ctx.summary["params"][name]["bk_scaled"] = sides[0] if len(sides) == 1 else sides
    return gm


def _describe_scaled(c: Contribution, i: int) -> str:
    """The operand at position i of a deferred contribution, which bk scales by the clip coefficients, and its
    shape."""
    role = "the input" if c.kind in _CONTRACTIONS and i != c.scaled_operand else "the output gradient"
    shape = [str(s) for s in c.node.args[i].meta["val"].shape] if isinstance(c.node.args[i], fx.Node) else []
    return f"{role} [{', '.join(shape)}]"


def _rearranges(node: fx.Node) -> bool:
    """A view or copy of its one tensor input: values move, none change."""
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and (bool(t.is_view) or t in (
        aten._unsafe_view.default, aten.clone.default)) and len(node.all_input_nodes) == 1


def _mask_at_source(b: GraphBuilder, op: fx.Node, env: dict, clean: set, states: dict, keep: fx.Node, B: Any) -> None:
    """Zero the dropped samples' rows where a second-backward operand is made, for every reader.

    The operand is often a view of a value other second-backward ops read too (the logits' gradient: its
    transpose feeds the head's weight gradient, itself the input gradient): masked at the source, Inductor
    fuses the mask into the producer and all readers share one buffer; masked at the view, the mask is a
    second logits-sized buffer. Reading zeros instead of a dropped sample's values changes nothing that is
    kept: every contribution zeroes that sample's rows anyway.
    """
    views, base = [], op
    while _rearranges(base) and base in env:
        views.append(base)
        base = base.all_input_nodes[0]
    lay = states.get(base)
    if base not in env or env[base] in clean or not isinstance(lay, Batched) or lay.dim is None:
        return
    src = env[base]
    masked = zero_dropped_rows(b, src, lay, keep, B)
    src.replace_all_uses_with(masked, delete_user_cb=lambda u: u is not masked and not _is_mask_of(u, src))
    env[base] = masked
    clean.add(masked)
    for v in reversed(views):  # the existing copies of the views now read the masked value
        clean.add(env[v])


def _is_mask_of(u: fx.Node, src: fx.Node) -> bool:
    return u.target is aten.where.self and len(u.args) > 1 and u.args[1] is src


# A scaled tangent up to this size is stored (see _small); 16 MiB: a [B, T] per-token tangent at any batch
SCALED_TANGENT_STORE_MAX_BYTES = 16 << 20


def _small(node: fx.Node, ctx: DPPassContext) -> bool:
    """Whether the row-scaled copy of node (a tangent-derived value) is small enough to store in a buffer.

    Where the scaled tangent is small (the loss tangent per sample or per token) and its readers are large
    (the softmax backward over the vocabulary), Inductor inlines r, the dropped-sample mask and the tangent
    into the large reader, whose reads then pass its limit: it is stored in fp32, a logits-sized buffer the
    non-private step never holds (GPT-2-small bf16 8x1024, H100: +1.5 GiB). Stored, the reader inlines into
    its bf16 consumer as in the first backward. A large scaled tangent stays inlined: storing it would be
    a buffer of that size.
    """
    nbytes = bytes_at_expected_batch(node, ctx.states, ctx.batch_size, ctx.options.expected_batch_size)
    return nbytes is not None and nbytes <= SCALED_TANGENT_STORE_MAX_BYTES


def _second_backward(gm, ctx, b: GraphBuilder, out, r, B, recompute_nodes: set[fx.Node], keep=None) -> None:
    """Copies the backward with the loss tangent scaled per sample.

    The scaling goes where the tangent first meets per-sample data: at a node
    whose output has a sample dim and which reads a tangent-derived value
    without one. If all its tangent-derived inputs lack a sample dim, its
    output slice i is linear in sample i's tangent and is scaled by r_i; if
    some already carry (scaled) samples, the sample-free ones are scaled by r
    broadcast along the output's sample dim (pointwise ops only).
    """
    graph = gm.graph
    states = ctx.states
    tdep = ctx.tangent_dependent
    env: dict[fx.Node, fx.Node] = {}
    # values whose dropped samples' rows are exact zeros already: the scaled tangent is masked where it is
    # made, so the contractions that read it (the LM head's weight and input gradients) share one masked
    # buffer instead of each masking a copy of a logits-sized operand
    clean: set[fx.Node] = set()
    needed = [pg for pg in ctx.decompositions.values() if any(c.node in recompute_nodes for c, _ in pg.terms)]
    before = set(graph.nodes)

    def arg_of(a):
        return env.get(a, a)

    def cannot(node, why):
        return DPCompileError(
            f"dp_fsdp (ghost schedule): cannot place the per-sample tangent scaling at op {op_name(node)} in "
            f"module {module_of(node)} ({why}); use schedule='bk'."
        )

    with graph.inserting_before(out):
        for node in ctx.backward_nodes:
            if node.op != "call_function":
                continue
            b.meta_source = node
            st = states.get(node)
            free_t = [a for a in node.all_input_nodes if a in tdep and states.get(a) is FREE]
            if node in ctx.contributions and not free_t:
                # a sum over samples of already scaled rows: zero the dropped samples' rows of every operand
                if keep is not None:
                    for op in ctx.contributions[node].node.all_input_nodes:
                        _mask_at_source(b, op, env, clean, states, keep, B)
                new = scaled_contribution(b, ctx.contributions[node], None, B, keep, arg_of, frozenset(clean))
            elif not free_t or st is FREE or node.target is operator.getitem:
                new = graph.node_copy(node, arg_of)
                if _rearranges(node) and all(a in clean for a in new.all_input_nodes):
                    clean.add(new)  # a view of zeroed rows: the same zeros
            elif node in ctx.contributions:
                # a contraction whose tangent-side operand has no sample dim of its own
                new = scaled_contribution(b, ctx.contributions[node], r, B, keep, arg_of)
                ctx.counters["ghost_tangent_scalings"] += 1
            elif isinstance(st, Batched) and st.dim is not None:
                batched_t = [a for a in node.all_input_nodes if a in tdep and isinstance(states.get(a), Batched)]
                if not batched_t:
                    new = row_scale(b, graph.node_copy(node, arg_of), st, r, B, keep)
                    if _small(node, ctx):  # the original: its sample layout is known
                        new = b.stored(new)
                        ctx.counters["ghost_scaled_tangents_stored"] += 1
                    clean.add(new)
                elif isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
                    ov = node.meta["val"]
                    repl = {}
                    for a in free_t:
                        R = sample_scale(b, st, r, B, ov.dim(), st.dim, ov.shape[st.dim], a.meta["val"].dtype)
                        repl[a] = b.call(aten.mul.Tensor, arg_of(a), R)
                    new = graph.node_copy(node, lambda x: repl.get(x, arg_of(x)))
                else:
                    raise cannot(node, "it mixes sample-free and per-sample tangent values")
                ctx.counters["ghost_tangent_scalings"] += 1
            else:
                raise cannot(node, f"its output state is {st}")
            new.meta["dpcompile"] = True
            env[node] = new
        ctx.second_backward.update(env)
        for n in graph.nodes:
            if n not in before:
                mark_second_backward(n)  # Inductor holds none of the first backward's buffers for these
        for pg in needed:
            _replace_output(out, pg.param.grad_output_index, env[pg.grad_node])
            ctx.counters["ghost_recomputed_params"] += 1
