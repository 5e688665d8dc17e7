"""A forward that changes a ``dpcompile.fully_shard`` parameter in place: refused, naming it.

A sharded module reads each parameter through a property that all-gathers it (dpcompile.fsdp): every read is a
copy of its own. A forward that writes into a parameter (Gemma3n clamps its AltUp coefficients with
``self.prediction_coefs.weight.data.clamp_(...)`` before using them) writes into the copy of that read, which
nothing reads again: the later reads, the gradient and the optimizer see the parameter unchanged, and the step
computes another function than the unsharded model's. The write is in dynamo's graph as an in-place method on
(an alias of) a gathered copy (``to_local`` of the parameter's ``redistribute``): found there, before AOTAutograd.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .errors import DPCompileError
from .fx_utils import module_of, source_line

# methods and functions whose result shares the memory of their first operand
_ALIAS_METHODS = {"view", "view_as", "t", "transpose", "permute", "reshape", "flatten", "unflatten", "unsqueeze",
                  "squeeze", "expand", "expand_as", "narrow", "select", "detach", "as_strided", "unfold", "movedim",
                  "__getitem__", "split", "chunk", "unbind", "diagonal", "swapaxes", "contiguous"}
_ALIAS_FUNCTIONS = {torch._C._autograd._get_data_attr, operator.getitem, torch.detach, torch.t, torch.transpose,
                    torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze, torch.narrow, torch.select,
                    torch.permute, torch.split, torch.chunk, torch.unbind, torch.diagonal, torch.movedim}


def _is(node, method: str) -> bool:
    """A DTensor method's call in dynamo's graph: ``call_method`` (torch 2.13), or a ``call_function`` of the
    function dynamo made for it, named ``prim_<method>`` (torch 2.11)."""
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target == method)
        or (node.op == "call_function" and getattr(node.target, "__name__", "") == f"prim_{method}"))


def _gathered(node, names: dict) -> str | None:
    """The name of the sharded parameter whose gathered copy ``node`` is, or aliases; else None."""
    while isinstance(node, fx.Node):
        if _is(node, "to_local"):
            src = node.args[0]
            while _is(src, "redistribute"):
                src = src.args[0]
            return names.get(src)
        if (node.op == "call_method" and node.target in _ALIAS_METHODS) or \
                (node.op == "call_function" and node.target in _ALIAS_FUNCTIONS):
            node = node.args[0] if node.args else None
            continue
        return None
    return None


def _writes_in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function":
        if node.target is operator.setitem:
            return True
        name = getattr(node.target, "__name__", "")
    else:
        return False
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__") and not name.startswith("_")


def refuse_writes_to_gathered_params(gm: fx.GraphModule, names: dict[fx.Node, str]) -> None:
    """names: dynamo's placeholders of sharded parameters -> their names."""
    for node in gm.graph.nodes:
        if not _writes_in_place(node) or not node.args:
            continue
        param = _gathered(node.args[0], names)
        if param is None:
            continue
        what = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
        line = source_line(node)
        raise DPCompileError(
            f"dp_fsdp: the forward changes the sharded parameter {param!r} in place ({what} in module "
            f"{module_of(node)}{'; ' + line if line else ''}). dpcompile.fully_shard all-gathers a parameter at "
            f"each read, so the change reaches only that read's copy: the later reads, the gradient and the "
            f"optimizer would see the parameter unchanged, unlike the unsharded model.\n  What to do: change the "
            f"parameter outside the step (e.g. under torch.no_grad() after optimizer.step()), or leave the module "
            f"that owns it out of fully_shard.")
