"""One compiled graph for every batch size under sharding.

Ranks of a sharded step hold different numbers of samples (Poisson sampling
gives each rank its own count, zero included), and every rank must issue the
same collectives in the same order. Dynamo specialises sizes 0 and 1 and
compiles a first graph for one static size; graphs for different sizes
differ in what Inductor folds away (e.g. a contraction over zero samples and
the all-gather feeding it), so ranks would deadlock. A sharded step is
therefore compiled with the batch dim *unbacked*: a size with no hint and no
specialisation, one graph that every rank compiles identically whatever its
own batch holds.

The batch dims must be marked before dynamo traces the step (a rank whose
first batch is empty may not even trace with a static size 0, e.g. through
``view(B, T, H, -1)``); ``private_step`` marks them on every call in a
distributed run, and ``mark_batch`` does it for a plain ``torch.compile``.
A sharded step traced without the mark is refused on every rank, before any
collective runs, so a forgotten mark is an error and never a hang.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dpcompile.errors import DPValueError

_SHAPE_ID = "dpcompile_batch"


def is_unbacked(size: Any) -> bool:
    return isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size.node.expr))


def batch_sizes(gm: fx.GraphModule, inputs) -> list[tuple[Any, Any, int]]:
    """(traced size, real example tensor, batch dim) of every batched data input."""
    out = []
    for node, gi in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        if gi.kind != "data" or gi.batch_dim is None:
            continue
        fake = node.meta.get("example_value")
        ga = node.meta.get("grapharg")
        real = getattr(ga, "example", None)
        if not isinstance(fake, torch.Tensor) or not isinstance(real, torch.Tensor) or fake.dim() == 0:
            continue
        bd = gi.batch_dim % fake.dim()
        out.append((fake.shape[bd], real, bd))
    return out


def mark_batch_unbacked(t: torch.Tensor, dim: int, hint: int | None = None) -> None:
    """Mark ``t``'s batch dim unbacked; all batch dims share one symbol where torch supports it.

    ``hint`` is the size Inductor tunes kernels for (it has none for an
    unbacked size and would assume a large one); it must be the same on every
    rank so that every rank compiles the same code.
    """
    kwargs = {"shape_id": _SHAPE_ID} if "shape_id" in _mark_unbacked_params() else {}
    if hint is not None and "hint_override" in _mark_unbacked_params():
        kwargs["hint_override"] = hint
    torch._dynamo.decorators.mark_unbacked(t, dim, **kwargs)


@functools.cache
def _mark_unbacked_params() -> frozenset[str]:
    # what this torch's mark_unbacked accepts (it runs on every step: look once)
    return frozenset(inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters)


def mark_batch(*tensors: torch.Tensor, batch_dim: int = 0, hint: int | None = None) -> None:
    """Compile the batch dim of these step inputs as one size for every batch (0 and 1 included).

    Needed for a plain ``torch.compile(step, backend="dp_fsdp")`` on a model
    sharded with ``dpcompile.fully_shard``; call it on the step's batched
    tensor arguments before every call (``private_step`` does this itself).
    ``hint``: the typical per-rank batch size, for Inductor's kernel tuning;
    give every rank the same value (``private_step`` uses expected_batch_size
    / world size).
    """
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"mark_batch takes the step's batched tensors, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError("mark_batch: a 0-d tensor has no batch dim; leave it unmarked and set "
                             "batch_dim={'<arg name>': None} in the dp_fsdp options")
        mark_batch_unbacked(t, batch_dim % t.dim(), hint)


def require_unbacked_batch(gm: fx.GraphModule, inputs) -> None:
    """Under sharding every batch dim must be unbacked; refuse otherwise (on every rank alike)."""
    static = [(size, real, bd) for size, real, bd in batch_sizes(gm, inputs) if not is_unbacked(size)]
    if not static:
        return
    size, real, bd = static[0]
    raise DPValueError(
        f"dp_fsdp: a sharded step must be compiled with one graph for every batch size, so that every rank "
        f"issues the same collectives whatever its number of samples (zero included); this step was traced "
        f"with a fixed batch size {size} (dim {bd} of an input of shape {tuple(real.shape)}). Decorate the "
        f"step with @dpcompile.private_step(...), which marks the batch for you, or call "
        f"dpcompile.mark_batch(<each batched tensor argument>) before every call of the compiled step."
    )


def mark_step_inputs(fn, args: tuple, kwargs: dict, config, hint: int | None = None) -> None:
    """``mark_batch`` on every tensor argument of ``fn`` that the options say is batched.

    Argument names follow the ``batch_dim`` option's convention: ``x``,
    ``batch.ids`` for a dict entry, ``xs.0`` for a list item.
    """
    from torch.utils._pytree import tree_flatten_with_path

    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return  # dynamo reports a bad call itself
    for name, value in bound.arguments.items():
        for path, leaf in tree_flatten_with_path(value)[0]:
            if not isinstance(leaf, torch.Tensor) or isinstance(leaf, torch.nn.Parameter) or leaf.dim() == 0:
                continue
            keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
            bd = config.batch_dim_for(".".join([name, *keys]))
            if bd is not None and -leaf.dim() <= bd < leaf.dim():
                mark_batch_unbacked(leaf, bd % leaf.dim(), hint)
