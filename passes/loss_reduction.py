"""Find the loss and how it reduces per-sample losses: mean or sum over the batch."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from dpcompile.errors import DPCompileError, DPValueError, SamplesMixedError
from dpcompile.fx_utils import known, module_of, op_name, source_line
from dpcompile.step_split import split_error_text

from .batch_state import (FREE, PER_SAMPLE_LOSS_HELP, Batched, Mixed, Reduced, count_key,
                          loss_not_per_sample, sample_count_sum)
from .context import DPPassContext

aten = torch.ops.aten

def _empty_batch_loss(ctx: DPPassContext, loss: fx.Node, tangent: fx.Node) -> None:
    """B == 0: only the reduction kind matters (for the noise scale k); found by
    walking back from the loss through single-input ops to the first sum/mean,
    the node the per-sample analysis finds on ranks that have samples."""
    kind, node = "sum", loss
    while isinstance(node, fx.Node) and node.op == "call_function":
        packet = getattr(node.target, "overloadpacket", None)
        if packet in (aten.mean, aten.sum):
            kind = "mean" if packet is aten.mean else "sum"
            break
        if node.target is aten.div.Tensor and sample_count_sum(node.args[1]) is not None:
            kind = "mean"  # a sum over a count of samples, as batch_dims takes it where there are samples
            break
        if node.target in (aten.div.Tensor, aten.div.Scalar) and not isinstance(node.args[1], fx.Node) and \
                node.args[1] == 0:
            kind = "mean"  # a sum over the batch size, 0 here (F.kl_div's "batchmean"; _batch_size_mean)
            break
        ins = node.all_input_nodes
        node = ins[0] if len(ins) == 1 else None
    if kind == "mean" and ctx.options.expected_batch_size is None:
        raise DPValueError("dp_fsdp: the loss is a mean over the batch, so the option expected_batch_size is needed")
    k = 1.0 / ctx.options.expected_batch_size if kind == "mean" else 1.0
    ctx.loss = LossInfo(loss, tangent, kind, 0 if kind == "mean" else 1, k)
    ctx.summary["loss"] = {"reduction": kind, "k": k, "batch_size": "0 (no samples on this rank)"}


@dataclasses.dataclass
class LossInfo:
    node: fx.Node  # forward value of the loss
    tangent: fx.Node  # its incoming gradient in the backward (1.0 for loss.backward())
    reduction: str  # "mean" (k = 1/expected_batch_size, M = B) or "sum" (k = 1, M = 1)
    M: Any  # graph contribution of sample i = tangent * g_i / M (a graph value where a count of samples divides)
    k: float


def _shape_of(node: Any) -> tuple | None:
    # sizes as text: comparing an unbacked size with a number would ask dynamo's shape env a question
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(str(d) for d in val.shape) if isinstance(val, torch.Tensor) else None


def output_seeded_by(tangent: fx.Node, fwd_outs: list, graph: fx.Graph) -> fx.Node:
    """The forward output whose incoming gradient ``tangent`` is: the one AOTAutograd's descriptor names
    (``TangentAOTInput(output=PlainAOTOutput(idx))``), checked by shape, a tangent has its output's shape.
    Without a descriptor (or one that does not fit), by what it is: the only output of the tangent's shape,
    else the k-th output of that shape for the k-th tangent of that shape (tangents follow the outputs
    that need gradients, in order)."""
    want = _shape_of(tangent)
    idx = getattr(getattr(tangent.meta.get("desc"), "output", None), "idx", None)
    if isinstance(idx, int) and 0 <= idx < len(fwd_outs) and _shape_of(fwd_outs[idx]) == want:
        return fwd_outs[idx]
    same = [o for o in fwd_outs if isinstance(o, fx.Node) and _shape_of(o) == want]
    if len(same) == 1:
        return same[0]
    tangents = [n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents")
                and _shape_of(n) == want]
    k = tangents.index(tangent)
    grads = [o for o in same if o.meta["val"].requires_grad] or same
    assert k < len(grads), f"no forward output of shape {want} for {tangent.name}"  # AOTAutograd's layout
    return grads[k]


def describe_output(node: Any) -> str:
    """A forward output for a message: its shape, the line that made it and its module."""
    if not isinstance(node, fx.Node):
        return "an output that is not a tensor"
    shape = _shape_of(node)
    line = source_line(node)
    return (f"the output of shape ({', '.join(shape or ())}) made by {op_name(node)} in module {module_of(node)}"
            + (f" ({line})" if line else ""))


def _one_sample_reduction(loss: fx.Node, states: dict) -> str:
    """Whether a loss found per-sample at a static batch of one (Batched: no reduction over a known sample dim on
    its way) is a mean or a sum over the batch. Where the analysis lost the sample dim (SINGLE: a layout that
    broadcasts or moves a size-one dim), the sample dim went in one of the sums or means of SINGLE values on
    the loss's way: all means, a mean; all sums (or none: per_sample.squeeze()), a sum. Both, or a sum over its
    number of elements (``sum / numel`` and ``sum / T`` are one graph here), could be either: refused, as the
    reading would differ from the graphs compiled for other batch sizes (mixing the two across a Poisson-
    sampled run's steps scales some steps' clipped sums by the batch size)."""
    linear = {aten.sum: "sum", aten.mean: "mean"}

    def single(a: Any) -> bool:
        s = states.get(a)
        return isinstance(s, Batched) and s.dim is None

    found, seen, stack = {}, set(), [loss]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node) or not isinstance(states.get(n), Batched):
            continue
        seen.add(n)
        ins = n.all_input_nodes
        kind = linear.get(getattr(n.target, "overloadpacket", None))
        if kind is not None and ins and single(ins[0]):
            found.setdefault(kind, n)
        if n.target in (aten.div.Tensor, aten.div.Scalar) and isinstance(n.args[0], fx.Node) and \
                getattr(n.args[0].target, "overloadpacket", None) is aten.sum and \
                single(n.args[0].args[0]) and not isinstance(n.args[1], fx.Node) and \
                n.args[1] != 1 and n.args[1] == n.args[0].args[0].meta["val"].numel():
            found["sum / numel"] = n
        stack.extend(ins)
    if len(found) > 1:
        ops = ", ".join(f"{k} ({op_name(n)} in module {module_of(n)})" for k, n in sorted(found.items()))
        raise SamplesMixedError(
            f"dp_fsdp: at a static batch of one the analysis lost the sample dim on the loss's way, and the loss "
            f"reduces it with {ops}: it cannot tell whether the loss is a mean or a sum over the samples."
            "\n  What to do: call dpcompile.mark_batch(<the step's batched inputs>) before the call, which compiles "
            "one graph for every batch size with the sample dim known; or reduce per-sample losses of shape [B] "
            "with one .mean() or .sum().")
    return "mean" if "mean" in found else "sum"


def loss_reduction_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    """Identifies the loss output and whether it is a mean or a sum over samples."""
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    fwd_outs = list(out.args[0][: ctx.num_fwd_outputs])
    used_tangents = [
        n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents") and len(n.users) > 0
        and n not in ctx.side_tangents  # read as zeros (passes.side_gradients)
    ]
    if len(used_tangents) != 1:
        names = ", ".join(n.name for n in used_tangents)
        outs = "; ".join(f"{t.name} is that of {describe_output(output_seeded_by(t, fwd_outs, graph))}"
                         for t in used_tangents)
        raise DPCompileError(split_error_text(
            ctx.split_step,
            f"the compiled step must backpropagate from exactly one scalar loss, but the backward "
            f"graph uses {len(used_tangents)} incoming gradients ({names}): {outs}. Return other tensors from "
            f"the step with .detach() (e.g. `return loss.detach()`), so only the loss carries gradients; a tensor "
            f"the model keeps between calls (a recurrent state or cache stored on a module attribute) must be "
            f"stored detached too."
        ))
    tangent = used_tangents[0]
    loss = output_seeded_by(tangent, fwd_outs, graph)
    if ctx.empty_batch:
        _empty_batch_loss(ctx, loss, tangent)
        return gm
    st = ctx.states.get(loss, FREE)
    if isinstance(st, Mixed):
        raise loss_not_per_sample(st.origin, st.why)
    if st is FREE:
        raise DPCompileError(split_error_text(
            ctx.split_step, "the loss does not depend on the batch inputs; nothing to privatise."))
    if not known(loss.meta["val"].numel() == 1):  # (a graph cut short by a break may end in a [B, ...] value)
        raise DPCompileError(split_error_text(
            ctx.split_step,
            f"the loss must be a scalar, got shape {tuple(loss.meta['val'].shape)}. " + PER_SAMPLE_LOSS_HELP
            + (f"\n  (dynamo ended this graph: {ctx.compile_reason})" if ctx.split_step is None
               and ctx.compile_reason else ""),
        ))
    kinds = set()
    if isinstance(st, Batched):  # B == 1: the sample dim was reduced without being known
        kinds.add(_one_sample_reduction(loss, ctx.states))
    seen = set()
    counts = set()  # counts of samples the loss divides its sum by (F.cross_entropy's default mean)
    stack = [loss]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, fx.Node):
            continue
        seen.add(n)
        s = ctx.states.get(n)
        if n in ctx.batch_size_means:  # sum / B: a mean, as .mean() is
            kinds.add("mean")
            continue
        if isinstance(s, Reduced) and s.origin is n:
            packet = getattr(n.target, "overloadpacket", None)
            kinds.add("mean" if packet is aten.mean else "sum")
            continue
        if n in ctx.sample_count_means:  # sum / count: the sum is the loss's, the count its batch size
            counts.add(ctx.sample_count_means[n])
            stack.append(n.args[0])
            continue
        for a in n.all_input_nodes:
            if isinstance(ctx.states.get(a), (Reduced, Batched)) and a not in seen:
                if isinstance(ctx.states.get(a), Reduced) or isinstance(s, Batched):
                    stack.append(a)
    if len(kinds) != 1:
        raise DPCompileError(
            f"dp_fsdp: the loss combines a mean and a sum over the batch ({sorted(kinds)}); use one of them. "
            + PER_SAMPLE_LOSS_HELP
        )
    kind = kinds.pop()
    count = None
    if counts:
        # one count written twice (label smoothing's two terms) is one count
        if len({count_key(c) for c in counts}) > 1 or kind != "sum":
            raise DPCompileError(
                "dp_fsdp: the loss divides sums over the batch by different counts of samples, or a mean by "
                "one; use one reduction of per-sample losses. " + PER_SAMPLE_LOSS_HELP)
        kind, count = "mean", min(counts, key=lambda c: c.name)
    if kind == "mean":
        if ctx.options.expected_batch_size is None:
            raise DPValueError(
                "dp_fsdp: the loss is a mean over the batch, so the option expected_batch_size is needed "
                "(the DP gradient divides the noisy clipped sum by it, not by the sampled batch size)"
            )
        # a mean over a count of samples: a sample's graph contribution is its gradient over the count
        M, k = (ctx.batch_size if count is None else count), 1.0 / ctx.options.expected_batch_size
    else:
        M, k = 1, 1.0
    ctx.loss = LossInfo(loss, tangent, kind, M, k)
    ctx.summary["loss"] = {"reduction": kind, "k": k, "batch_size": str(ctx.batch_size)}
    if count is not None:
        ctx.summary["loss"]["count"] = ("a sum of per-sample losses over a count of samples (F.cross_entropy's "
                                        "default mean: the targets that are not ignore_index), taken as a mean")
        ctx.counters["loss_mean_over_sample_count"] += 1
    if ctx.batch_size_means & seen:  # a sum over the batch size (F.kl_div's "batchmean") on the loss's way
        ctx.summary["loss"]["count"] = ("a sum of per-sample losses over the batch size (F.kl_div's "
                                        "reduction='batchmean'), taken as a mean")
        ctx.counters["loss_mean_over_batch_size"] += 1
    ctx.counters[f"loss_{kind}"] += 1
    return gm
