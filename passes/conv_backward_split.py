"""One convolution_backward per gradient it computes: input, weight and bias gradients as separate nodes.

``aten.convolution_backward`` returns (grad_input, grad_weight, grad_bias) from one node. The weight and
bias gradients are two different sums over the samples (a contraction of the output gradient with the
unfolded input, and a sum of the output gradient over positions); the batch-dim analysis records one
contribution per node, scaled per sample by rewriting that node's operands. So each requested gradient
becomes its own node: the input gradient and the weight gradient as convolution_backward calls with one
output each (cuDNN and oneDNN compute the three separately anyway), the bias gradient as the sum of the
output gradient over every dim but channels, which the reduction rules already read as a per-sample sum.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from dpcompile.fx_utils import GraphBuilder

from .context import DPPassContext

aten = torch.ops.aten


def split_convolution_backward(b: GraphBuilder, node: fx.Node) -> dict[int, fx.Node]:
    """The requested outputs of one convolution_backward node (output index -> node computing it)."""
    args = list(node.args)
    grad_out, mask = args[0], list(args[10])
    pieces: dict[int, fx.Node] = {}
    for i in (0, 1):
        if mask[i]:
            one = args[:10] + [[k == i for k in range(3)]]
            pieces[i] = b.call(operator.getitem, b.call(aten.convolution_backward.default, *one), i)
    if mask[2]:
        nd = grad_out.meta["val"].dim()
        pieces[2] = b.call(aten.sum.dim_IntList, grad_out, [0] + list(range(2, nd)))
    return pieces


def conv_backward_split_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    graph = gm.graph
    b = GraphBuilder(graph)  # the pieces read the output gradient: backward nodes
    for node in list(graph.find_nodes(op="call_function", target=aten.convolution_backward.default)):
        mask = list(node.args[10])
        if sum(map(bool, mask)) <= 1 and not mask[2]:
            continue  # one input or weight gradient: already a node of its own
        with graph.inserting_after(node):
            b.meta_source = node
            pieces = split_convolution_backward(b, node)
        for user in list(node.users):
            assert user.target is operator.getitem, user  # a tuple-valued node is only read through getitem
            user.replace_all_uses_with(pieces[user.args[1]])
            graph.erase_node(user)
        for piece in pieces.values():  # they stand for traced nodes: the rewrites treat them as such
            for n in (piece, *piece.all_input_nodes):
                if n.meta.get("dpcompile"):
                    del n.meta["dpcompile"]
        graph.erase_node(node)
        ctx.counters["conv_backward_split"] += 1
    return gm

