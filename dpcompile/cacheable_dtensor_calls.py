"""torch 2.11: the DTensor calls of a sharded step's dynamo graph made cacheable for the AOTAutograd cache.

torch 2.11's dynamo records ``x.redistribute(mesh, placements)``, ``x.to_local(...)`` and
``DTensor.from_local(x, mesh, placements)`` as calls of a closure it makes per call (named
``prim_redistribute``, ``prim_to_local``, ``prim from_local``) that holds the call's other arguments. The
AOTAutograd cache refuses a graph with such a target ("Unsupported call_function target
...redistribute_fn_with_prim_types"), so a restarted sharded or tensor-parallel job compiled every step anew
(torch 2.13 records method calls, which its cache takes). Each such call becomes ``dtensor_call(x, key)``: a
module-level function the cache is told is safe (``unsafe_marked_cacheable_functions``, for that compile only),
and ``key`` a text of the captured arguments that is the same in every process (a mesh by its ranks, shape,
dimension names, process groups and this rank's place; placements by their repr). The text is in the graph's
code, which the cache key holds, so calls with other arguments key apart; the arguments themselves are
registered under it for the tracing that follows in this process (a cache hit traces nothing).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from dpcompile.compile_cache import mesh_text

NAME = "cacheable_dtensor_calls"  # in disable_passes: the calls stay closures, and the cache bypasses the graph
COUNTER = "dtensor_calls_made_cacheable"
# key -> (method name or function, args, kwargs) of the calls rewritten in this process
_CALLS: dict[str, tuple] = {}


def dtensor_call(x, key: str, **traced):
    """The call registered under ``key`` on x: ``x.method(*args, **kwargs)``, or ``function(x, *args,
    **kwargs, **traced)`` (``traced``: the arguments dynamo kept as graph values, a from_local's shape and
    stride)."""
    if key not in _CALLS:  # internal: only this process's rewrite makes such calls, and registers them first
        raise AssertionError(f"dpcompile: DTensor call {key!r} was not registered in this process")
    what, args, kwargs = _CALLS[key]
    if isinstance(what, str):
        return getattr(x, what)(*args, **kwargs)
    return what(x, *args, **kwargs, **traced)


QUALNAME = f"{dtensor_call.__module__}.{dtensor_call.__name__}"


def _text(v) -> str | None:
    """A text of v that is the same in every process, or None."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(v, DeviceMesh):
        return mesh_text(v)  # as the cache keys a mesh input (torch 2.13)
    if isinstance(v, (list, tuple)):
        parts = [_text(x) for x in v]
        return None if None in parts else f"{type(v).__name__}({', '.join(parts)})"
    if isinstance(v, dict):
        parts = [(repr(k), _text(x)) for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))]
        return None if any(x is None for _, x in parts) else "{" + ", ".join(f"{k}: {x}" for k, x in parts) + "}"
    text = repr(v)
    # an object printed by its address, or a tensor's values: not a text another process reproduces
    return None if " at 0x" in text or isinstance(v, torch.Tensor) else f"{type(v).__name__}:{text}"


def _captured(fn) -> tuple | None:
    """(method name or function, args, kwargs) of a closure torch 2.11's dynamo made for a DTensor call, or None:
    ``prim_redistribute`` / ``prim_to_local`` (free variables args_as_value, kwargs_as_value: the method's
    arguments), ``prim from_local`` (also ``self``, the in-graph function's variable, whose value is called)."""
    code, cells, name = getattr(fn, "__code__", None), getattr(fn, "__closure__", None), getattr(fn, "__name__", "")
    if code is None or cells is None or not name.startswith(("prim_", "prim ")):
        return None
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    if name in ("prim_redistribute", "prim_to_local") and set(free) == {"args_as_value", "kwargs_as_value"}:
        return name[len("prim_"):], tuple(free["args_as_value"]), dict(free["kwargs_as_value"])
    function = getattr(free.get("self"), "value", None)
    if name.startswith("prim ") and set(free) == {"args_as_value", "kwargs_as_value", "self"} and callable(function):
        return function, tuple(free["args_as_value"]), dict(free["kwargs_as_value"])
    return None


def cacheable_dtensor_calls_pass(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """Rewrites every such closure call whose arguments have a process-independent text; returns the graph and
    how many were rewritten. A call left as it was (arguments without such a text) keeps the cache bypassing
    the graph, as before."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        captured = _captured(node.target) if node.op == "call_function" else None
        if captured is None or len(node.args) != 1:
            continue
        what, args, kwargs = captured
        name = what if isinstance(what, str) else f"{what.__module__}.{what.__qualname__}"
        text = _text((args, kwargs))
        if text is None:
            continue
        key = f"{name}{text}"
        _CALLS.setdefault(key, captured)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(dtensor_call, (node.args[0], key), dict(node.kwargs))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return gm, rewritten


def cache_patches(source_hash: str) -> dict:
    """Inductor's config for a compile whose graph calls dtensor_call: the AOTAutograd cache takes it as safe,
    keyed by dpcompile's source."""
    return {"unsafe_marked_cacheable_functions": {
        **torch._inductor.config.unsafe_marked_cacheable_functions, QUALNAME: source_hash}}
