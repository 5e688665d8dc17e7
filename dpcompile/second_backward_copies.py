"""Ghost's second backward recomputes its own pointwise values instead of sharing the first backward's.

The min-cut partitioner saves a few forward values and recomputes cheap
pointwise ones (a GELU output, a normalized LayerNorm input) in the backward,
once, where the backward first reads them. Ghost's two backwards both read
them, so each was made in the first backward and kept alive until the second
backward read it again: every layer's copy at once where the second backward
starts, where the non-private backward holds one layer's at a time.

Run on the partitioned backward, so the saved values are settled: a value
the second backward reads that the first backward also reads, made through
pointwise ops and views only from the backward's inputs (saved values, or
none), is copied, chain and all, to just before its first reader in the
second backward. The copies read the same saved inputs; nothing more is
saved. Random ops are never copied (a copy would draw other numbers).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.buffer_reuse import PHASE_KEY, SECOND_BACKWARD, mark_second_backward
from dpcompile.fx_utils import recomputable

_CONSTANTS = (torch.ops.aten.full.default, torch.ops.aten.zeros.default, torch.ops.aten.scalar_tensor.default)
MAX_CHAIN = 12  # ops per copied chain: longer ones cost more arithmetic than the memory is worth
MIN_NUMEL = 1 << 16  # smaller values are not worth a recompute


def numel_hint(n: fx.Node) -> int:
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return 0
    numel = v.numel()
    if isinstance(numel, torch.SymInt):
        hint = numel.node.hint
        return int(hint) if hint is not None else MIN_NUMEL  # an unbacked batch: counted as large enough
    return int(numel)


def _chain(root: fx.Node) -> list[fx.Node] | None:
    """The nodes to copy for root (pointwise ops and views down to the backward's inputs and constants), or
    None when root is made by anything else (a contraction, a reduction, a random op) on the way."""
    if not root.all_input_nodes:
        # a constant both backwards read (a rotary backward's zeros, Llama on an H100): made again; it has
        # nothing to chain down to (the KeyError this raised once: an empty chain has no copy of root)
        return [root] if root.target in _CONSTANTS else None
    chain, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n in chain or n.op == "placeholder" or not n.all_input_nodes:
            continue  # leaves: saved values, and constants (a full, a scalar_tensor), read where they are
        if not recomputable(n) or n.meta.get(PHASE_KEY) == SECOND_BACKWARD:
            return None
        chain.add(n)
        if len(chain) > MAX_CHAIN:
            return None
        todo.extend(n.all_input_nodes)
    return list(chain)


def copy_for_second_backward(graph: fx.Graph, nodes, readers, order: dict[fx.Node, int],
                             inputs: dict[fx.Node, fx.Node] | None = None) -> dict[fx.Node, fx.Node]:
    """Copies ``nodes`` (in graph order, each copy reading the copies of the others, and ``inputs``' nodes
    replaced by theirs) to just before the first of ``readers``, marked as the second backward's; returns node ->
    copy (inputs' included). The readers are not changed."""
    done: dict[fx.Node, fx.Node] = dict(inputs or {})
    with graph.inserting_before(min(readers, key=order.__getitem__)):
        for n in sorted(nodes, key=order.__getitem__):
            again = graph.node_copy(n, lambda a: done.get(a, a))
            again.meta = dict(n.meta)
            mark_second_backward(again)
            done[n] = again
    return done


def copy_shared_values_into_second_backward(bw: fx.GraphModule, counters: dict | None = None) -> int:
    """Gives the second backward its own copy of each pointwise value it shares with the first backward.
    Returns how many values were copied (counter ``second_backward_pointwise_copies``)."""
    graph = bw.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    second = {n for n in nodes if n.meta.get(PHASE_KEY) == SECOND_BACKWARD}
    if not second:
        return 0
    copied = 0
    for root in nodes:
        if root.op != "call_function" or root in second or numel_hint(root) < MIN_NUMEL:
            continue
        readers = [u for u in root.users if u in second]
        if not readers or len(readers) == len(root.users):
            continue  # not shared: made for the second backward alone, Inductor places it there
        chain = _chain(root)
        if chain is None:
            continue
        done = copy_for_second_backward(graph, chain, readers, order)
        for u in readers:
            u.replace_input_with(root, done[root])
        copied += 1
    if copied:
        graph.lint()
        bw.recompile()
        if counters is not None:
            counters["second_backward_pointwise_copies"] = (
                counters.get("second_backward_pointwise_copies", 0) + copied)
    return copied
