"""A chain of views that lands on a row-major view of a contiguous tensor, read as one view of it.

The norm rewrite reaches its operands through view chains: ``sample_major``
splits the rows as [outer, B, inner, F] and permutes the samples first,
so GPT-2's ``gelu(h)`` [B, T, 3072] reaches the Gram kernel as
``view -> view [1, B, T, 3072] -> permute -> reshape [B, T, 3072]``.
With a static batch Inductor sees through such a chain. With the unbacked
batch size of a sharded step, on CUDA, it does not: it writes the chain's
end to a buffer of its own, so the value is computed twice, and the copy
the Gram kernel reads is not the buffer the deferred weight gradient reads
(GPT-2-small bk on one H200, fp32 32x256, batch marked unbacked: GELU and
its backward computed twice per layer; 48.2 ms a step, 46.8 ms with this
pass, 43.3-44.2 ms with a static batch: BENCHMARKS.md).

The pass replaces each chain's end (a view op read by something other than a
view op) whose value is row-major by one ``view`` of the farthest tensor up
its chain that is row-major too and has the same storage, storage offset and
element count. Both then read the same memory in the same order, for every
value of the size symbols: the pass checks it on the fake values' sizes,
strides and storages (``statically_known_true``) and leaves a chain alone
where a check is not known. A reshape that copied (its fake value has a
storage of its own) ends the walk; so does ghost's second backward (a walk
does not leave it for the first backward's value). Only a view that splits
dims or merges consecutive ones is made (``splits_or_merges``): Inductor
guards on other reshapes of a symbolic size.

It runs on the partitioned backward graph: on the joint graph, a backward
contraction reading a forward value directly (instead of through backward
views) makes the min-cut partitioner keep that value rather than recompute
it (ghost's backward peak on tests/test_generated_code.py's GPT: 10.1 MB
instead of 8.6). The graph's outputs keep their nodes (AOTAutograd recorded
what each one aliases). Only for Inductor (``compiler="inductor"``): its code keeps the
fake values' strides, where an eager run of the graph need not (on a CUDA
GPU, the padded routed-experts step run eagerly: a view the pass made failed
on its source's real strides). Counter: ``view_chains_collapsed``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dpcompile.buffer_reuse import PHASE_KEY
from dpcompile.fx_utils import GraphBuilder, known, row_major
from dpcompile.saved_aliases import storage_of
from .context import DPPassContext

aten = torch.ops.aten
# ops whose result is a view of their first argument (reshape: where it does not copy, which the storage check sees)
VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    *([aten.squeeze.dims] if hasattr(aten.squeeze, "dims") else []),
})
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) and not v.is_sparse else None


def is_view_op(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in VIEW_OPS and isinstance(node.args[0], fx.Node)


def _row_major(v: torch.Tensor) -> bool:
    return row_major(v.shape, v.stride())


def contiguous_source(node: fx.Node) -> fx.Node | None:
    """The farthest node up ``node``'s chain of view ops whose value is the same memory as ``node``'s in
    the same row-major order; None where there is none or ``node`` is not row-major itself. The chain
    stays among nodes placed as ``node`` is, but for its last node (the chain's source)."""
    v = _val(node)
    if v is None or not _row_major(v):
        return None
    storage = storage_of(v)
    if storage is None:
        return None
    # which backward the chain is in (ghost's two, buffer_reuse): the walk never crosses into the other one,
    # which would make ghost's second backward read a first-backward value instead of its own copy of it
    best, src, phase = None, node, node.meta.get(PHASE_KEY)
    while is_view_op(src) and (src is node or src.meta.get(PHASE_KEY) == phase):
        src = src.args[0]
        s = _val(src)
        if s is None or s.dtype != v.dtype or storage_of(s) != storage:
            break
        if known(s.storage_offset() == v.storage_offset()) and known(s.numel() == v.numel()) and _row_major(s):
            best = src
    return best


def splits_or_merges(old: list, new: list) -> bool:
    """Whether ``new`` is ``old`` with each dim split into consecutive dims, or consecutive dims merged into
    one, the sizes known equal (dims of size one anywhere). Inductor's reshape indexer compares other
    reshapes' sizes by their hints: on a symbolic size it then adds a guard the step's next call fails
    (HF Swin's window partition, [16*u0, 4, 2, 4] -> [u0, 64, 8], which the chain reached through a permute)."""
    a = [s for s in old if not known(s == 1)]
    b = [s for s in new if not known(s == 1)]
    i = j = 0
    while i < len(a) and j < len(b):
        for x, y, step in ((a, b, 1), (b, a, -1)):  # a dim of one side as consecutive dims of the other
            k, h = (i, j) if step == 1 else (j, i)
            prod, m = y[h], h + 1
            while m < len(y) and not known(prod == x[k]):
                prod, m = prod * y[m], m + 1
            if known(prod == x[k]):
                i, j = (k + 1, m) if step == 1 else (m, k + 1)
                break
        else:
            return False
    return i == len(a) and j == len(b)


def _erase_unread_views(graph: fx.Graph, node: fx.Node) -> None:
    while is_view_op(node) and not node.users:
        src = node.args[0]
        graph.erase_node(node)
        node = src


def view_chains_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    graph = gm.graph
    b = GraphBuilder(graph, tag=None)
    for node in list(graph.nodes):
        # chain ends only (a view that only views read is collapsed with them), and not a lone reshape of the
        # model's: one reshape of a tensor is what Inductor sees through or copies anyway (cheap checks first:
        # the symbolic ones cost a GPT-2-small compile half a second). The norm rewrite's own lone reshapes
        # (sample_major's, where one reshape gives the sample-major rows) become views like a chain's end
        model_reshape = node.target in _RESHAPES and not node.meta.get("dpcompile")
        if not is_view_op(node) or all(is_view_op(u) for u in node.users) or \
                (model_reshape and not is_view_op(node.args[0])):
            continue
        src = contiguous_source(node)
        if src is None or (src is node.args[0] and (model_reshape or node.target is not aten.reshape.default)):
            continue
        shape = list(node.meta["val"].shape)
        if not splits_or_merges(list(src.meta["val"].shape), shape):
            continue
        same = len(shape) == src.meta["val"].dim() and all(known(a == c) for a, c in zip(shape, src.meta["val"].shape))
        if same:
            new = src
        else:
            b.meta_source = node
            with graph.inserting_before(node):
                new = b.view(src, shape)
            for k in ("partitioner_tag", PHASE_KEY):
                if k in node.meta:
                    new.meta[k] = node.meta[k]
        # the graph's outputs keep their nodes (AOTAutograd recorded what each output aliases)
        if node.replace_all_uses_with(new, delete_user_cb=lambda user: user.op != "output"):
            ctx.counters["view_chains_collapsed"] += 1
        elif new is not src:
            graph.erase_node(new)
        _erase_unread_views(graph, node)
    graph.lint()
    gm.recompile()
    return gm
