"""State the step keeps past itself is updated from parameters and constants only, never from sample data.

DP covers what training releases: the parameters, through their noised gradients. A buffer, frozen
parameter or captured tensor the step writes in place is released too (it is saved with the model), but
without noise: BatchNorm's running statistics, a running mean of the inputs, a counter of the tokens seen.
A functionalized joint graph writes such an update as a ``copy_`` into the input; the batch-dim analysis
says whether the value written depends on the samples. One that does is refused, naming the input and the
op that computed it. Updates from parameters alone (spectral_norm's power iteration, a step counter) pass.
Inputs of the step function itself (the batch) hold sample data already and may be written.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.errors import DPCompileError
from dpcompile.fx_utils import module_of, op_name, source_line

from .batch_state import FREE
from .context import DPPassContext

aten = torch.ops.aten
COUNTER = "state_updates_checked"


def _advice(module: str, kind: str) -> str:
    if "BatchNorm" in module:
        return ("BatchNorm in training mode keeps running statistics of the samples: use GroupNorm (or LayerNorm), "
                "or put the module in eval mode.")
    return (f"update the {kind} outside the DP step, from public data, or keep the module from updating it "
            f"while it trains with DP; dp_fsdp privatises gradients only.")


def _origin(node: fx.Node, states) -> fx.Node:
    """The op to name for an update: from the value written, back along its one sample-dependent operand
    while that stays in the same module (``0.9 * r + 0.1 * x.mean(0)`` names the mean); where the value has
    several such operands, or the operand comes from another module, the value's own op."""
    while node.op == "call_function":
        dependent = [a for a in node.all_input_nodes if states.get(a, FREE) is not FREE]
        if len(dependent) != 1 or module_of(dependent[0]) != module_of(node):
            return node
        node = dependent[0]
    return node


def state_updates_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    if ctx.empty_batch or not ctx.state_inputs:  # no samples, or nothing kept: nothing to leak
        return gm
    for node in gm.graph.find_nodes(op="call_function", target=aten.copy_.default):
        dst, src = node.args[0], node.args[1]
        if dst not in ctx.state_inputs:
            continue
        ctx.counters[COUNTER] += 1
        if ctx.states.get(src, FREE) is FREE:
            continue
        kind, name = ctx.state_inputs[dst]
        o = _origin(src, ctx.states)
        where = module_of(o)
        line = source_line(o)
        raise DPCompileError(
            f"dp_fsdp: the step writes sample data into {kind} '{name}' (op {op_name(o)} in module {where} "
            f"computes it from the batch): the {kind} is kept after the step, and it would carry the samples "
            f"without noise, outside the privacy guarantee."
            + (f"\n  at: {line}" if line else "")
            + "\n  What to do: " + _advice(where, kind)
        )
    return gm
