"""The Triton kernels a compiled step will launch, compiled in the background before its first run.

dpcompile's kernels (dpcompile.gram_sq_norms, conv_sq_norms, add_randn, randn, zero_rows) are compiled by Triton
at their first launch, during the step's first run, one specialisation after another: the Gram norm kernel has
one per layer width (a GPT-2 step: four, two seconds each for fp32 on a CPU core), after Inductor has compiled
the graphs. Once the partitioner has made the forward and backward graphs, each dpcompile op node's operands
are known (their fake values): this runs the op's own launch code on fake tensors of the same shapes, strides
and dtypes with ``kernel_plans.recording()``, which gives the launches it will make, and hands them to
``kernel_plans.precompile``, which compiles them in threads while Inductor compiles the graphs. A launch whose
specialisation was guessed wrong (an unbacked size, a misaligned operand) compiles at its first launch as before.

On by default; ``DPCOMPILE_PRECOMPILE=0`` turns it off. Measured on one H200 (BENCHMARKS.md): it cuts a cold
GPT-2 bk compile + warm-up from 46 to 31 s (fp32) and from 48 to 32 s (bf16). A first measurement of the
host-bound bf16 step with it (36.4 instead of 25.2 ms of wall clock at the same GPU time) did not repeat: the
next one, with host profiles, had the same launches on the same paths and 22.7 against 21.6 ms.
"""
from __future__ import annotations

import os

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from . import kernel_plans

# a size Inductor cannot hint (an unbacked batch): only the grid and the batch's strides depend on it
_UNHINTED = 64


def _impls() -> dict:
    """Each kernel op's Python implementation: the code that plans and makes its launches."""
    from . import add_randn, conv_sq_norms, gram_sq_norms, randn, zero_rows

    ops = torch.ops.dpcompile
    return {
        ops.gram_sq_norms.default: gram_sq_norms.gram_sq_norms,
        ops.gram_sq_norms_group.default: gram_sq_norms.gram_sq_norms_group,
        ops.conv_weight_sq_norms.default: conv_sq_norms.conv_weight_sq_norms,
        ops.conv_weight_grads.default: conv_sq_norms.conv_weight_grads,
        ops.add_randn.default: add_randn.add_randn,
        ops.randn.default: randn.randn,
        ops.zero_rows_.default: zero_rows.zero_rows_,
    }


def enabled() -> bool:
    if os.environ.get("DPCOMPILE_PRECOMPILE", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.is_available()


def _hint(v):
    """An int for a symbolic size: its hint (the example value it was traced with), or _UNHINTED"""
    if isinstance(v, torch.SymInt):
        hint = getattr(v.node, "hint", None)
        return _UNHINTED if hint is None else int(hint)
    return v


def _concrete(value):
    """A node's argument as the op's Python code would get it: a fake tensor of the node's value's dtype and
    device with hinted sizes and strides; a symbolic int as its hint."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return torch.empty_strided([_hint(s) for s in value.shape], [_hint(s) for s in value.stride()],
                                   dtype=value.dtype, device=value.device)
    return _hint(value)


def recorded_launches(gms: list[fx.GraphModule], failed: list | None = None) -> list:
    """The launches (kernel, grid, args, consts) the graphs' kernel ops will make, with fake tensors as operands;
    ops on other devices than CUDA make none. An op whose launch code raises on its fake operands is left to
    compile at its first launch, and its node is appended to ``failed``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    impls = _impls()
    launches: list = []
    for gm in gms:
        for node in gm.graph.nodes:
            impl = impls.get(node.target) if node.op == "call_function" else None
            if impl is None:
                continue
            vals = [a.meta.get("val") for a in node.all_input_nodes]
            if not all(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in vals):
                continue
            try:
                with FakeTensorMode(), kernel_plans.recording() as calls:
                    impl(*tree_map(_concrete, node.args), **tree_map(_concrete, node.kwargs))
            except Exception:  # noqa: BLE001 - only a head start is lost; the launch itself still checks and raises
                if failed is not None:
                    failed.append(node)
                continue
            launches += calls
    return launches


def op_graph(target, *operands: torch.Tensor, extra: tuple = (), device=None, arrange=None) -> fx.GraphModule:
    """A graph of one call ``target(*operands, *extra)`` whose placeholders' values are fake tensors like the
    operands (same sizes, strides and dtype; on ``device``, or the operands' own): what ``recorded_launches``
    reads, for benchmarks and tests. ``arrange``: the call's arguments from the placeholders instead (an op
    that takes lists of tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = fx.Graph()
    nodes = []
    with FakeTensorMode():
        for i, t in enumerate(operands):
            n = graph.placeholder(f"x{i}")
            n.meta["val"] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device or t.device)
            nodes.append(n)
    args = tuple(arrange(nodes)) if arrange is not None else (*nodes, *extra)
    graph.output(graph.call_function(target, args))
    return fx.GraphModule(torch.nn.Module(), graph)


def precompile_kernels(gms: list[fx.GraphModule]) -> dict | None:
    """Starts compiling the kernels the graphs will launch (kernel_plans.precompile). Returns None where that is
    off (DPCOMPILE_PRECOMPILE=0, no CUDA, the interpreter), else {"started": compiles started (none for a
    specialisation compiled or pending already), "failed": ops whose launches could not be made out}."""
    if not enabled():
        return None
    failed: list = []
    started = kernel_plans.precompile(recorded_launches(gms, failed))
    return {"started": started, "failed": [f"{n.name} ({n.target})" for n in failed]}
