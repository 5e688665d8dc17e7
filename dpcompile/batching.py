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

The batch dims must be unbacked when dynamo first wraps the step's inputs (a
rank whose first batch is empty may not even trace with a static size 0,
e.g. through ``view(B, T, H, -1)``). Users only call ``torch.compile`` (or
``private_step``), so dpcompile does it while dynamo traces: every module
sharded with ``dpcompile.fully_shard`` reads its parameters through
``mark_traced_batch``, which dynamo runs for real (``assume_constant_result``)
on its first parameter read. If the frame is being compiled for a dp_fsdp
backend and a batched tensor argument of the frame is not marked yet, it
marks the batch dims of the frame's arguments (names and dims follow the
``batch_dim`` option) and restarts the trace, which then sees an unbacked
batch. Later calls with plain tensors of any size match the graph's guards
(an unbacked dim is not guarded), so nothing runs per step.
``mark_batch`` stays as an explicit form for inputs dpcompile cannot see
(e.g. built inside the step). A sharded graph traced with a static batch
anyway is refused on every rank, before any collective runs.
"""
from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Mapping
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from dpcompile.compat import install_hf_shims
from dpcompile.errors import DPValueError

_SHAPE_ID = "dpcompile_batch"
_MARK = "_dpcompile_batch_dim"  # set on a tensor whose batch dim was marked unbacked


def is_unbacked(size: Any) -> bool:
    return isinstance(size, torch.SymInt) and bool(free_unbacked_symbols(size.node.expr))


def batch_sizes(gm: fx.GraphModule, inputs) -> list[tuple[Any, Any, int, str]]:
    """(traced size, real example tensor, batch dim, name) of every batched data input."""
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
        out.append((fake.shape[bd], real, bd, gi.name))
    return out


def says_only_nonempty(expr: sympy.Basic, b: sympy.Symbol) -> bool:
    """True iff ``expr`` mentions only ``b``, is false at b = 0 and true for every b >= 1."""
    if not isinstance(expr, sympy.Basic) or expr.free_symbols != {b}:
        return False
    n = sympy.Symbol("n", integer=True, positive=True)
    return bool(expr.subs(b, 0) == sympy.false) and bool(expr.subs(b, n) == sympy.true)


def forget_nonempty_axiom(gm: fx.GraphModule, inputs) -> int:
    """Let the graph dynamo traced for a batch of >= 1 sample also be entered with none; the number of asserts
    "the batch is not empty" it dropped from the graph (the bound's, and those dynamo's tracing made, e.g. for
    ``view(B, T, H, -1)``).

    ``mark_batch_unbacked(nonempty=True)`` (the sharded step's automatic marking, ``mark_batch(nonempty=True)``)
    gives the batch symbol the lower bound 1, so that dynamo resolves the model's
    Python questions about an empty batch (``if h.numel() > 0:`` in Falcon-Mamba's scan, torch's
    ``associative_scan``) as "not empty" instead of giving up on the graph. That bound would also become a
    guard on the frame (``1 <= x.size()[0]``: an empty rank would recompile, and fail, while the others wait in
    a collective) and an assert in the graph. Run where dynamo hands the graph to the backend, before it builds
    the guards: the bound goes back to a size's [0, inf] and the asserts it made are dropped, so what is traced
    after (AOTAutograd, the DP passes, Inductor) assumes nothing. The empty rank then runs the branch traced for
    a non-empty batch on empty tensors, which computes an empty per-sample result (passes.empty_batch).
    """
    from torch.utils._sympy.value_ranges import ValueRanges
    from torch.utils._sympy.numbers import int_oo

    sizes = [size for size, *_ in batch_sizes(gm, inputs) if is_unbacked(size)]
    if not sizes:
        return 0
    shape_env = sizes[0].node.shape_env
    batch = {s for size in sizes for s in free_unbacked_symbols(size.node.expr)}
    # the marked dims' own symbols, which shape_id ties to the first by an equality (a replacement)
    batch |= {u for u in getattr(shape_env, "unbacked_inputs", ()) if shape_env.replacements.get(u) in batch}
    for b in batch:
        vr = shape_env.var_to_range.get(b)
        if vr is not None and vr.lower == 1:
            shape_env.var_to_range[b] = ValueRanges(0, int_oo)
    # and the asserts the bound made, in the shape env and in dynamo's graph (``_assert_scalar(u0 >= 1)``)
    dropped, _ = drop_nonempty_asserts(gm, shape_env, batch)
    gm.recompile()
    shape_env._maybe_evaluate_static.cache_clear()
    return dropped


def drop_nonempty_asserts(gm: fx.GraphModule, shape_env, batch: set) -> tuple[int, int]:
    """Drop the asserts that say nothing but "the batch is not empty" (``says_only_nonempty`` of one of the batch
    symbols): ``_assert_scalar`` nodes of ``gm`` (dynamo's graph, or the joint graph) and the shape env's deferred
    runtime asserts, which Inductor would emit wherever the symbol is bound. (graph asserts, deferred asserts)
    dropped."""
    deferred = 0
    for b in batch:
        asserts = shape_env.deferred_runtime_asserts.get(b, [])
        kept = [ra for ra in asserts if not says_only_nonempty(ra.expr, b)]
        if len(kept) != len(asserts):
            shape_env.deferred_runtime_asserts[b] = kept
            deferred += len(asserts) - len(kept)
    in_graph = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten._assert_scalar.default)):
        cond = node.args[0]
        # (dynamo's graph holds example values, AOTAutograd's vals)
        val = cond.meta.get("val", cond.meta.get("example_value")) if isinstance(cond, fx.Node) else None
        if isinstance(val, torch.SymBool) and any(says_only_nonempty(val.node.expr, b) for b in batch):
            gm.graph.erase_node(node)
            in_graph += 1
            if not cond.users:
                gm.graph.erase_node(cond)
    return in_graph, deferred


def batch_hint(config) -> int | None:
    """The per-rank batch size Inductor tunes a sharded graph for: the same on every rank."""
    ebs = config.expected_batch_size
    if not ebs:
        return None
    return rank_share(ebs, torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)


def rank_share(expected_batch_size: int, world: int) -> int:
    """A rank's expected number of samples, at least 2 (Inductor's hint for an unbacked batch size)."""
    return max(2, -(-int(expected_batch_size) // world))


def mark_batch_unbacked(t: torch.Tensor, dim: int, hint: int | None = None, nonempty: bool = False) -> None:
    """Mark ``t``'s batch dim unbacked; all batch dims share one symbol where torch supports it.

    ``hint`` is the size Inductor tunes kernels for (it has none for an
    unbacked size and would assume a large one); it must be the same on every
    rank so that every rank compiles the same code. ``nonempty``: dynamo traces for a batch of at least one
    sample, a bound the dp_fsdp backend forgets before the frame is guarded (forget_nonempty_axiom); another
    backend would guard on it, and an empty batch would then fail.
    """
    kwargs = {"shape_id": _SHAPE_ID} if "shape_id" in _mark_unbacked_params() else {}
    if hint is not None and "hint_override" in _mark_unbacked_params():
        kwargs["hint_override"] = hint
    if nonempty and traces_nonempty():
        kwargs["min"] = 1  # dynamo traces for a batch of at least one sample (forget_nonempty_axiom)
    torch._dynamo.decorators.mark_unbacked(t, dim, **kwargs)
    setattr(t, _MARK, dim)
    install_hf_shims()  # third-party code that asks "is the batch 1?" where every answer is the same


def traces_nonempty() -> bool:
    """This torch's mark_unbacked takes a lower bound (torch 2.13): dynamo traces an unbacked batch as non-empty."""
    return "min" in _mark_unbacked_params()


@functools.cache
def _mark_unbacked_params() -> frozenset[str]:
    # what this torch's mark_unbacked accepts (look once)
    return frozenset(inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters)


def mark_batch(*tensors: torch.Tensor, batch_dim: int = 0, hint: int | None = None, nonempty: bool = False) -> None:
    """Compile the batch dim of these step inputs as one size for every batch (0 and 1 included).

    Optional: a step over a model sharded with ``dpcompile.fully_shard`` gets
    this for its tensor arguments without any call. Use it for batched
    tensors dpcompile cannot find among the arguments of the compiled
    function, before the first call. ``hint``: the typical per-rank batch
    size, for Inductor's kernel tuning; give every rank the same value.
    A flex_attention ``BlockMask`` built for the batch (``create_block_mask(mask_mod, B, ...)``) marks its
    tables and the tensors of the batch its mask_mod reads; one the batch shares (B=None) is not per-sample:
    leave it unmarked (and name it in the batch_dim option).
    ``nonempty=True`` (for a dp_fsdp step, on torch 2.13): dynamo traces the step for a batch of at least one
    sample, so that the model's questions about an empty batch (``if x.numel() > 0:``, torch's
    associative_scan) take the non-empty branch; the step still runs with no samples, that branch on empty
    tensors. What the sharded step's automatic marking does. Not for stock ``torch.compile``, which would guard
    on the bound (an empty batch would then fail).
    """
    for t in tensors:
        if _is_block_mask(t):  # a block mask built for the batch: its tables and the data its mask_mod reads
            mark_batch(*(v for _, v in _block_mask_tensors(t)), hint=hint, nonempty=nonempty)
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"mark_batch takes the step's batched tensors, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError("mark_batch: a 0-d tensor has no batch dim; leave it unmarked and set "
                             "batch_dim={'<arg name>': None} in the dp_fsdp options")
        mark_batch_unbacked(t, batch_dim % t.dim(), hint, nonempty)


def _is_block_mask(x: Any) -> bool:
    flex = sys.modules.get("torch.nn.attention.flex_attention")  # not imported: no BlockMask exists
    return flex is not None and isinstance(x, flex.BlockMask)


# a BlockMask's tables, which flex_attention reads per row of the query's batch (dim 0 of each)
_BLOCK_MASK_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                      "q_indices", "full_q_num_blocks", "full_q_indices")


def _block_mask_tensors(mask: Any) -> list[tuple[list[str], torch.Tensor]]:
    """A BlockMask's tables, and the tensors its mask_mod closes over (through nested closures: transformers'
    and_masks) with the tables' batch in dim 0 (what it was built from: the ids of the batch), each with its
    attribute path as dynamo names it (``mask_mod.__closure__.0.cell_contents``)."""
    tables = [([a], t) for a, t in ((a, getattr(mask, a, None)) for a in _BLOCK_MASK_TABLES)
              if isinstance(t, torch.Tensor)]
    if not tables:
        return []
    batch = tables[0][1].shape[0]
    found, seen = [], set()

    def closure(fn, path, depth):
        if depth > 4 or id(fn) in seen:
            return
        seen.add(id(fn))
        for i, cell in enumerate(getattr(fn, "__closure__", None) or ()):
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            here = [*path, "__closure__", str(i), "cell_contents"]
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch:
                found.append((here, v))
            elif callable(v) and not isinstance(v, torch.Tensor):
                closure(v, here, depth + 1)

    closure(getattr(mask, "mask_mod", None), ["mask_mod"], 0)
    return tables + found


def _leaves_with_names(value: Any) -> list[tuple[list[str], Any]]:
    """The pytree leaves of an argument with the path names of the batch_dim option; a BlockMask (not a pytree
    in torch) gives its tables, named by attribute (``mask.kv_indices``)."""
    from torch.utils._pytree import tree_flatten_with_path

    out = []
    for path, leaf in tree_flatten_with_path(value)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
        if _is_block_mask(leaf):
            out += [([*keys, *path], v) for path, v in _block_mask_tensors(leaf)]
        else:
            out.append((keys, leaf))
    return out


def mark_arguments(arguments: Mapping[str, Any], config, hint: int | None = None) -> bool:
    """Mark the batch dim of every batched tensor among a step's arguments; True if one was not marked yet.

    Argument names follow the ``batch_dim`` option's convention: ``x``,
    ``batch.ids`` for a dict entry, ``xs.0`` for a list item.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    marked = False
    for name, value in arguments.items():
        for path, leaf in _leaves_with_names(value):
            if not isinstance(leaf, torch.Tensor) or isinstance(leaf, torch.nn.Parameter) or leaf.dim() == 0 \
                    or is_traceable_wrapper_subclass(leaf):
                continue
            bd = config.batch_dim_for(".".join([name, *path]))
            if bd is None or not -leaf.dim() <= bd < leaf.dim() or getattr(leaf, _MARK, None) == bd % leaf.dim():
                continue
            mark_batch_unbacked(leaf, bd % leaf.dim(), hint, nonempty=True)  # a dp_fsdp step's (mark_traced_batch)
            marked = True
    return marked


@torch._dynamo.assume_constant_result
def mark_traced_batch() -> bool:
    """Run by dynamo, for real, when it traces a parameter read of a fully_shard module.

    In a frame compiled for a dp_fsdp backend whose batched tensor arguments
    are not marked yet: mark them and trace the frame again from the start.
    Elsewhere (eager, other backends, already marked): nothing.
    """
    tx = traced_frame()
    backend = traced_dp_backend(tx)
    if backend is None:
        return False
    if mark_arguments(_frame_arguments(tx), backend.config, batch_hint(backend.config)):
        raise torch._dynamo.exc.RestartAnalysis("dpcompile: batch dims of the step marked unbacked")
    return True


def traced_dp_backend(tx=None):
    """The DPBackend of the frame dynamo is compiling (``tx``: its translator, traced_frame()), or None: not
    tracing, or tracing for another backend."""
    tx = tx if tx is not None else traced_frame()
    if tx is None:
        return None
    from dpcompile.backend import backend_of

    return backend_of(tx.output.compiler_fn)


@torch._dynamo.assume_constant_result
def in_dp_trace() -> bool:
    """Whether dynamo is compiling a frame for a dp_fsdp backend. Where dynamo traces a call of it (model code, an
    F.instance_norm), it runs it for real and takes the answer as a constant; elsewhere (AOTAutograd's
    decompositions, which run inside that compile) it is an ordinary call."""
    return traced_dp_backend() is not None


def traced_frame():
    """Dynamo's translator of the frame being compiled (not of a function inlined into it), or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
    except ImportError:  # pragma: no cover
        return None
    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:
        # no dynamo trace has run in this thread yet (its thread-local is unset): not tracing. Raising
        # here would be fatal in disguise: the caller is a parameter property, and an AttributeError
        # there makes Python fall back to nn.Module.__getattr__ (the raw shard, eagerly)
        return None
    while tx is not None and getattr(tx, "parent", None) is not None:
        tx = tx.parent  # from the inlined module code out to the compiled frame
    return tx


def _frame_arguments(tx) -> dict[str, Any]:
    code = tx.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return {name: tx.f_locals[name] for name in code.co_varnames[:n] if name in tx.f_locals}


def require_unbacked_batch(gm: fx.GraphModule, inputs) -> None:
    """Under sharding every batch dim must be unbacked; refuse otherwise (on every rank alike)."""
    static = [(size, real, bd, name) for size, real, bd, name in batch_sizes(gm, inputs) if not is_unbacked(size)]
    if not static:
        return
    size, real, bd, name = static[0]
    raise DPValueError(
        f"dp_fsdp: a sharded step must be compiled with one graph for every batch size, so that every rank "
        f"issues the same collectives whatever its number of samples (zero included); this step was traced "
        f"with a fixed batch size {size} (dim {bd} of input '{name}' of shape {tuple(real.shape)}). dpcompile "
        f"marks the batch dims of the compiled function's tensor arguments (and of lists and dicts of them) "
        f"when dynamo first traces a module sharded with dpcompile.fully_shard; this input was not among "
        f"them. Pass the batch as tensor arguments of the compiled function, or call "
        f"dpcompile.mark_batch(<tensor>) on it before the call."
    )
