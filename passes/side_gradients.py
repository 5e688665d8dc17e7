"""Incoming gradients of outputs other than the loss, compiled as zeros and checked at run time.

The joint graph has a tangent for every forward output that requires a gradient: the loss, and a tensor the
model keeps on a module attribute (a recurrent state) or writes into a parameter's ``.data`` (both are outputs
of the graph, dynamo writes them back). ``loss.backward()`` gives those zeros, but the backward reads them, and
the norm analysis would take their chains for the loss's. Where exactly one of the outputs with a gradient is a
scalar (the loss), each other tangent's readers read zeros instead, and the loss tangent passes through
``dpcompile::side_gradients_are_zero`` (dpcompile.side_gradients), which raises if one of them is not zero: a
step that backpropagates through such a tensor fails rather than getting the loss's gradient alone. Two
scalars, or none: left as they are, and loss_reduction refuses, naming every output.

The zeros' chains are then cut where an op's result is zero whatever its other operands (a product, a view, a
sum, a contraction with a zero operand) and where a zero is added to a value of the sum's layout: the backward
is the loss's, as eager autograd, which never visits those outputs, computes it (a chain left in place would
reach a parameter's gradient as a term without samples, which the analysis refuses, and would cost time).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dpcompile import side_gradients  # noqa: F401  (defines dpcompile::side_gradients_are_zero)
from dpcompile.fx_utils import GraphBuilder, known

from .context import DPPassContext
from .loss_reduction import describe_output, output_seeded_by

aten = torch.ops.aten


def side_gradients_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    fwd_outs = list(out.args[0][: ctx.num_fwd_outputs])
    placeholders = graph.find_nodes(op="placeholder")
    used = [n for n in placeholders if n.name.startswith("tangents") and n.users]
    if len(used) < 2:
        return gm
    seeded = {t: output_seeded_by(t, fwd_outs, graph) for t in used}
    scalars = [t for t in used if isinstance(seeded[t], fx.Node)
               and isinstance(v := seeded[t].meta.get("val"), torch.Tensor) and known(v.numel() == 1)]
    if len(scalars) != 1:
        return gm
    loss_tangent = scalars[0]
    sides = [t for t in used if t is not loss_tangent]
    b = GraphBuilder(graph)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    zeros = set()
    with graph.inserting_before(first):
        for t in sides:
            z = b.call(aten.zeros_like.default, t)
            t.replace_all_uses_with(z, delete_user_cb=lambda user, z=z: user is not z)
            zeros.add(z)
        checked = b.call(torch.ops.dpcompile.side_gradients_are_zero.default, loss_tangent, sides,
                         [describe_output(seeded[t]) for t in sides])
    loss_tangent.replace_all_uses_with(checked, delete_user_cb=lambda user: user is not checked)
    ctx.side_tangents = sides
    ctx.counters["side_gradients_as_zeros"] += len(sides)
    ctx.counters["side_gradient_ops_cut"] += _cut_zero_chains(graph, zeros)
    graph.lint()
    gm.recompile()
    return gm


# ops whose result is zero when their first operand is (linear in it, or a layout or a reduction of it)
_ZERO_IN_FIRST = {getattr(aten, name) for name in (
    "neg", "view", "_unsafe_view", "reshape", "expand", "permute", "t", "transpose", "squeeze", "unsqueeze",
    "slice", "select", "clone", "contiguous", "_to_copy", "alias", "narrow", "split", "split_with_sizes",
    "unbind", "flatten", "sum", "mean", "cumsum", "flip", "roll", "repeat", "index_select", "gather", "index",
    "embedding_dense_backward", "slice_backward", "select_backward", "threshold_backward", "div", "masked_fill",
    "as_strided", "diagonal", "squeeze_copy", "unsqueeze_copy", "view_copy", "permute_copy", "expand_copy",
    "_reshape_alias", "unfold", "tril", "triu", "constant_pad_nd", "movedim", "real", "imag", "view_as_real",
    "view_as_complex", "conj", "_conj", "resolve_conj", "resolve_neg", "new_zeros", "zeros_like",
    # backwards, linear in the incoming gradient (their first operand); a tuple's parts through getitem
    "tanh_backward", "sigmoid_backward", "gelu_backward", "silu_backward", "hardtanh_backward",
    "leaky_relu_backward", "elu_backward", "softplus_backward", "hardswish_backward", "hardsigmoid_backward",
    "mish_backward", "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm_backward",
    "native_group_norm_backward", "convolution_backward", "max_pool2d_with_indices_backward",
    "avg_pool2d_backward", "_adaptive_avg_pool2d_backward", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward", "upsample_nearest2d_backward", "upsample_bilinear2d_backward")
    if hasattr(aten, name)}
_ZERO_IN_FIRST.add(torch.ops.prims.convert_element_type)
# ... when any tensor operand is
_ZERO_IN_ANY = {aten.mul, aten.mm, aten.bmm, aten.matmul, aten.dot, aten.mv, aten.outer, aten.einsum}


def _fill_is_zero(n: fx.Node) -> bool:
    """Whether what the op writes besides its first operand is zero: masked_fill's value, constant_pad_nd's
    padding (every other op of _ZERO_IN_FIRST writes nothing else)."""
    target = getattr(n.target, "overloadpacket", None)
    if target is aten.masked_fill:
        return not isinstance(n.args[2], fx.Node) and n.args[2] == 0
    if target is aten.constant_pad_nd:
        return (n.args[2] if len(n.args) > 2 else n.kwargs.get("value", 0)) == 0
    return True


def _is_zero(n: fx.Node, zero: set) -> bool:
    packet = getattr(n.target, "overloadpacket", n.target)
    args = n.args
    if packet in _ZERO_IN_FIRST or n.target in _ZERO_IN_FIRST:
        return bool(args) and args[0] in zero and _fill_is_zero(n)
    if packet in _ZERO_IN_ANY:
        return any(a in zero for a in n.all_input_nodes)
    if packet is aten.where:  # where(c, zero, zero | 0)
        return len(args) == 3 and args[1] in zero and (args[2] in zero or (not isinstance(args[2], fx.Node)
                                                                           and args[2] == 0))
    if packet in (aten.add, aten.sub):
        return all(a in zero for a in args[:2])
    if packet is aten.cat:
        return all(a in zero for a in args[0])
    if n.target is operator.getitem:
        return args[0] in zero
    return False


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and \
        va.device == vb.device and len(va.shape) == len(vb.shape) and \
        all(known(x == y) for x, y in zip(va.shape, vb.shape)) and \
        all(known(x == y) for x, y, n in zip(va.stride(), vb.stride(), va.shape) if not known(n == 1))


def _cut_zero_chains(graph: fx.Graph, zeros: set) -> int:
    """Nodes whose value is zero (from ``zeros``) dropped, and a sum with one replaced by its other operand where
    that has the sum's layout; returns how many nodes went."""
    zero = set(zeros)
    cut = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n in zero or not any(a in zero for a in n.all_input_nodes):
            continue
        if _is_zero(n, zero):
            zero.add(n)
            continue
        packet = getattr(n.target, "overloadpacket", None)
        if packet in (aten.add, aten.sub) and len(n.args) == 2 and "alpha" not in n.kwargs:
            x, y = n.args
            other = x if y in zero else (y if packet is aten.add and x in zero else None)
            if isinstance(other, fx.Node) and _same_layout(other, n):
                n.replace_all_uses_with(other)
                graph.erase_node(n)
                cut += 1
    for n in reversed(list(graph.nodes)):
        if n in zero and not n.users:
            graph.erase_node(n)
            cut += 1
    return cut
