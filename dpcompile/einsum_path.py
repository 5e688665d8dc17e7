"""torch.einsum of three or more operands with a batch size unknown at compile time.

``torch.einsum`` asks opt_einsum for a contraction order (``contract_path``) from the operands' sizes, as
Python ints. With the unbacked batch size of a sharded, Poisson-sampled or ``mark_batch`` step, that size has
no int: dynamo split the step there ("Could not extract specialized integer from data-dependent expression
u0"), stock torch.compile with ``mark_unbacked`` too, and the step was refused. The order only decides how
fast the contraction runs, never its value: where an operand has such a size, the order is chosen from the
sizes' hints (dpcompile's batch hint), unknown ones taken as UNKNOWN_SIZE, without a guard on any size.
Sizes that are all known keep torch's own call.
"""
from __future__ import annotations

from typing import Any

from dpcompile.compat import wrap_method_once

UNKNOWN_SIZE = 64  # the order's guess for a size without a hint


def einsum_path_from_hints() -> None:
    import torch.backends.opt_einsum as opt_einsum

    def wrap(original):
        def get_opt_einsum():
            module = original()
            return None if module is None else _HintedPaths(module)
        return get_opt_einsum

    # torch.backends.opt_einsum is a module wrapper (PropModule) whose functions live in the module it wraps
    wrap_method_once(getattr(opt_einsum, "m", opt_einsum), "get_opt_einsum", wrap)


class _HintedPaths:
    """opt_einsum, with contract_path taking hinted sizes where an operand has an unbacked one."""

    def __init__(self, module: Any):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def contract_path(self, equation, *operands, **kwargs):
        shapes = [getattr(op, "shape", None) for op in operands]
        if any(s is None for s in shapes) or kwargs.get("shapes") or not any(map(_has_unbacked, shapes)):
            return self._module.contract_path(equation, *operands, **kwargs)
        hinted = [tuple(_hint(d) for d in s) for s in shapes]
        return self._module.contract_path(equation, *hinted, shapes=True, **kwargs)


def _has_unbacked(shape) -> bool:
    from dpcompile.batching import is_unbacked

    return any(map(is_unbacked, shape))


def _hint(d) -> int:
    import torch

    if not isinstance(d, torch.SymInt):
        return int(d)
    node, env = d.node, d.node.shape_env
    if env is None:
        return UNKNOWN_SIZE
    if hasattr(env, "optimization_hint"):  # torch 2.13: the user's hint of an unbacked size (size_hint is deprecated)
        return int(env.optimization_hint(node.expr, fallback=UNKNOWN_SIZE))
    hint = env.size_hint(node.expr, allow_none=True)
    return int(hint) if hint is not None else UNKNOWN_SIZE
