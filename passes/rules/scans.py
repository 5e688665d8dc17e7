"""torch's associative_scan (``torch._higher_order_ops.associative_scan``): Mamba's selective scan as Hugging Face
compiles it (``use_associative_scan``, on by default for Mamba and Zamba).

In ``combine_mode="pointwise"`` (on CUDA) the higher-order op stays in the graph: ``associative_scan(combine, xs,
additional_inputs)`` scans every x along dim 0 (the wrapper moves the scan dim there), combining element t with the
running result of elements 0..t-1 by ``combine``. A combine made only of pointwise ops reads, at each position, the
values at that position: along every dim other than the scan dim the scan keeps elements apart, so samples in such a
dim stay apart and each output has the samples where its inputs have them. Refused: the scan along the sample dim
(it runs one sample into the next), a combine with an op that is not pointwise, per-sample additional inputs, and a
scan of several tensors together (Mamba's (a, b) pairs): torch's backward of that is wrong (each tensor's gradient
taken apart from the others'; measured in the refusal). One tensor's scan (a cumulative product, maximum,
logsumexp) has the right gradient. The generic mode (the CPU's) is traced into plain ops, and so is the op's
backward.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..batch_state import FREE, SINGLE, Batched, fail_layout

hop = torch.ops.higher_order


def _non_pointwise(combine: fx.GraphModule) -> list[str]:
    """The ops of the combine function that are not pointwise."""
    bad = []
    for n in combine.graph.nodes:
        if n.op in ("placeholder", "output") or n.target is operator.getitem:
            continue
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or torch.Tag.pointwise not in n.target.tags:
            bad.append(str(n.target))
    return bad


def _associative_scan(an, node: fx.Node):
    combine, xs, extra = node.args[:3]
    assert isinstance(combine, fx.Node) and combine.op == "get_attr", combine
    if len(xs) > 1:
        raise an.refuse(node, f"it scans {len(xs)} tensors together, and torch's gradient of such a scan is wrong: "
                              f"its backward takes each scanned tensor's gradient apart from the others' (torch "
                              f"2.13, measured on h_t = a_t * h_(t-1) + b_t: the gradient of a off by 5.4, that of b "
                              f"right), so no per-sample gradient through it can be exact",
                        "scan with combine_mode='generic' (traced into plain ops, exact), or use the model's "
                        "sequential form (Hugging Face Mamba and Zamba: use_associative_scan=False in the config)")
    bad = _non_pointwise(operator.attrgetter(combine.target)(an.gm))
    if bad:
        raise an.refuse(node, f"its combine function has ops that are not pointwise ({', '.join(sorted(set(bad)))}), "
                              f"which may mix the elements of one position, samples among them",
                        "write the combine function with elementwise ops only")
    for a in extra:
        s = an.st(a) if isinstance(a, fx.Node) else FREE
        if isinstance(s, Batched) and s.dim is not None:
            raise an.refuse(node, f"an additional input of the scan ({a.name}) is per-sample",
                            "pass per-sample tensors as scanned inputs (xs)")
    (x,) = xs
    s = an.st(x)
    if s is FREE or s == SINGLE:
        return (SINGLE,)
    if not isinstance(s, Batched):
        return fail_layout(an, node, f"the scanned input ({x.name}) is laid out as {s}")
    if s.dim == 0:
        return fail_layout(an, node, "scans along the sample dim: each sample's result would take the samples "
                                     "before it")
    return (s,)


RULES: dict[Any, Any] = {}
if hasattr(hop, "associative_scan"):
    RULES[hop.associative_scan] = _associative_scan
