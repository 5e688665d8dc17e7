"""The dp_fsdp torch.compile backend.

Dynamo hands us the forward graph of the step (``loss.backward()`` graph-
breaks); ``compile_fx`` runs AOTAutograd and calls our partitioner with the
joint forward/backward graph, where the dp passes rewrite the parameter
gradients; the min-cut partitioner and Inductor take it from there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import os
import re
import threading
import time
from collections.abc import MutableMapping
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from dpcompile.accumulation import accumulating
from dpcompile.batching import batch_sizes, forget_nonempty_axiom, is_unbacked, require_unbacked_batch
from dpcompile.buffer_reuse import count_refusals, install_phase_gated_reuse
from dpcompile import cacheable_dtensor_calls
from dpcompile.compile_gc import hold_full_collections, with_full_collections_held
from dpcompile.compile_cache import (aot_cache_allowed, load_record, partitioner_key, rank_layout, record_key,
                                     save_record, source_hash, stable_mesh_keys)
from dpcompile.compat import (cpp_wrapper_any_args, decompositions_for_one_sample, dtensor_calls_are_closures,
                              expand_unbacked_vec_indices, guard_empty_y_grid, hint_cpu_bmm_layouts,
                              hint_fusion_scores, hint_kernel_size_hints, install_hf_shims, hint_mix_order_split,
                              mix_order_reduction_keeps_shapes,
                              hint_same_ordered_strides,
                              reshape_indexer_refuses_unbacked_guesses, rng_states_before_saved_objects)
from dpcompile.bilinear import COUNTER as BILINEAR_COUNTER
from dpcompile.bilinear import bilinear_as_matmul
from dpcompile.bucketing import cpp_wrapper_patches
from dpcompile import gathered_copy_out
from dpcompile.config import DPConfig
from dpcompile.embedding_bag import COUNTER as EMBEDDING_BAG_COUNTER
from dpcompile.embedding_bag import embedding_bags_as_embeddings
from dpcompile.errors import DPCompileError, DPValueError
from dpcompile.debug import GraphDumper, GraphTexts, graph_snapshot, graph_text, resolve_dump_dir
from dpcompile.eager_guard import in_non_private, sentinel
from dpcompile.fx_utils import clean_module_path, known
from dpcompile.gathered_writes import refuse_writes_to_gathered_params
from dpcompile.noise import NoiseSeeds
from dpcompile.passes import BACKWARD_PASSES, PASSES, DPPassContext, ParamInfo, PassOptions
from dpcompile.passes.cleanup import finalize
from dpcompile.passes.per_sample_norms import NORM_ALL_REDUCE_META
from dpcompile.precompile import precompile_kernels
from dpcompile.saved_aliases import merge_identical_saved_values, no_aliased_donations
from dpcompile.second_backward_copies import copy_shared_values_into_second_backward
from dpcompile.step_split import GENERIC_ADVICE, Split, describe_split, split_by_last_break, split_error_text
from dpcompile.tensor_parallel import (TPMesh, allow_dtensor_gradients_in_dynamo, distinct_meshes, dp_shard_index,
                                       gradient_placements, is_tp_dtensor, placement_kind, tp_layout, tp_mesh,
                                       tp_placement)

SEEDS_INPUT_NAME = "dpcompile_noise_seeds"


@dataclasses.dataclass
class GraphInput:
    index: int
    kind: str  # "param", "frozen_param", "buffer", "data", "constant", "symint"
    name: str
    batch_dim: int | None = None
    reshard_after_forward: bool = False  # a fully_shard parameter to gather again in the backward
    sharded: bool = False  # a DTensor parameter (fully_shard)
    foreign_dtensor: str = ""  # a DTensor parameter dpcompile cannot take: its placements and mesh
    tp: str = ""  # tensor parallel (parallelize_module): "shard" or "replicate" (tensor_parallel.tp_placement)
    shape: tuple = ()  # a parameter's whole shape (a DTensor's global one)


@dataclasses.dataclass
class CompiledStep:
    """What one compile produced, kept for inspection (``backend.compiled``)."""

    compile_id: str
    inputs: list[GraphInput]
    # stage -> readable graph, printed when first read (debug.GraphTexts)
    graphs: MutableMapping[str, str] = dataclasses.field(default_factory=GraphTexts)
    # per stage ("forward", "backward"): (op, output shape) of every call, in
    # order, taken before Inductor lowers (and strips) the graphs
    ops: dict[str, list[tuple[str, tuple]]] = dataclasses.field(default_factory=dict)
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    dump_files: list[str] = dataclasses.field(default_factory=list)
    dp: bool = True  # False: the graph had no trainable parameter and was compiled as is
    # "hit": served by the AOTAutograd cache (no pass ran; graphs, counters and summary read back from the
    # compile that filled it); "miss": compiled and cached; "": the cache was off (dumps, TORCH_TRACE, eager)
    cache: str = ""
    compile_reason: str = ""  # why dynamo ended this graph where it did (its first line)
    # tensor parallel: seed index -> noise stream, chosen by the partitioner from the gradients' placements
    # (NoiseSeeds.index_ranks); kept so that a cache hit, which runs no partitioner, draws the same noise
    noise_index_ranks: dict[int, int] = dataclasses.field(default_factory=dict)

    def count(self, key: str, n: int) -> None:
        """Adds n to counter key (a rewrite that reports from inside Inductor's compile: the partitioner may
        have replaced ``counters`` by then)."""
        self.counters[key] = self.counters.get(key, 0) + n

    def norm_all_reduce_window(self) -> tuple[tuple[str, tuple], list[tuple[str, tuple]]] | None:
        """Tensor parallel: the per-sample norm all-reduce as (op, shape) and the backward ops between its
        issue and its wait (what it can run under); None without one."""
        ops, where = self.ops.get("backward", []), self.summary.get("tensor_parallel", {}).get("window")
        if not where:
            return None
        issue, wait = where
        return ops[issue], ops[issue + 1:wait]


def _where(e: BaseException) -> str:
    """' in dpcompile's <file>:<line> (<function>)' of the innermost dpcompile frame an internal error passed
    through: Dynamo prints a backend's error without its cause, and a report needs the place."""
    import traceback

    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f"{os.sep}dpcompile{os.sep}" in f.filename or f"{os.sep}passes{os.sep}" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" in dpcompile's {os.path.basename(os.path.dirname(f.filename))}/{os.path.basename(f.filename)}:" \
           f"{f.lineno} ({f.name})"


def grouped_fallback_has_backward_op() -> bool:
    """Whether transformers' grouped_mm_fallback (its routed experts' grouped matmul outside bf16) has a backward
    op of its own, which a training step can trace: older releases loop over the expert offsets on the host in
    its backward (transformers 5.24 has the op)."""
    return hasattr(torch.ops.transformers, "grouped_mm_fallback_backward")


def _hint(gm: fx.GraphModule, e: BaseException) -> str:
    """What to do about a failure a known third-party form causes."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    from torch._subclasses.fake_tensor import DataDependentOutputException

    fallback = any("transformers.grouped_mm_fallback" in str(n.target) for n in gm.graph.nodes)
    if fallback and isinstance(e, (DataDependentOutputException, GuardOnDataDependentSymNode)) and \
            not grouped_fallback_has_backward_op():
        return ("\n  What to do: this transformers release's grouped_mm_fallback (routed experts outside bf16) "
                "reads the expert offsets on the host in its backward, which no compiled training step can trace "
                "(stock torch.compile fails the same). Upgrade transformers (5.24 has its grouped_mm_fallback_backward "
                "op), train the experts in bf16 (torch._grouped_mm), or pass experts_implementation=\"batched_mm\".")
    return ""


def _source_name(grapharg) -> str:
    src = getattr(grapharg, "source", None)
    if src is None:
        return ""
    n = src.name
    return n() if callable(n) else str(n)


_SOURCE_PART = re.compile(r"""\[(?:'([^']*)'|"([^"]*)"|(-?\d+))\]|\.(\w+)""")


def _arg_name(source: str) -> str:
    # L['x'] -> x ; L['batch']['ids'] -> batch.ids ; L['xs'][0] -> xs.0 ; L['bm'].kv_indices -> bm.kv_indices
    if not source.startswith("L["):
        return clean_module_path(source)
    return ".".join(next(g for g in m.groups() if g is not None) for m in _SOURCE_PART.finditer(source[1:]))


def _module_state(grapharg) -> bool:
    """A tensor reached through an nn.Module passed to (or closed over by) the step: a plain tensor attribute
    of the model (a BlockMask it built once, a mask kept outside its buffers) is state the batch shares, not
    data, whatever its shape."""
    src = getattr(grapharg, "source", None)
    while src is not None:
        if "NNModuleSource" in type(src).__name__:
            return True
        src = getattr(src, "base", None)
    return False


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _foreign_dtensor(t) -> str:
    """Placements and mesh of a DTensor parameter that neither dpcompile.fully_shard made nor tensor
    parallelism on a 1-D mesh ("" otherwise)."""
    if not is_tp_dtensor(t) or tp_placement(t):
        return ""
    return f"placements {tuple(t.placements)} on {t.device_mesh}"


def classify_inputs(gm: fx.GraphModule, example_inputs, config: DPConfig) -> list[GraphInput]:
    out = []
    for i, (node, ex) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        ga = node.meta.get("grapharg")
        src = _source_name(ga) if ga is not None else ""
        example = getattr(ga, "example", None) if ga is not None else None
        example = ex if example is None else example
        if not isinstance(example, torch.Tensor):
            out.append(GraphInput(i, "symint", src or node.name))
        elif isinstance(example, nn.Parameter):
            out.append(GraphInput(i, "param" if example.requires_grad else "frozen_param", clean_module_path(src),
                                  reshard_after_forward=bool(getattr(example, "_dpcompile_reshard_after_forward", False)),
                                  sharded=_is_dtensor(example) and not is_tp_dtensor(example),
                                  foreign_dtensor=_foreign_dtensor(example),
                                  tp=tp_placement(example) if is_tp_dtensor(example) or tp_layout(example) else "",
                                  shape=tuple(example.shape)))
        elif "_buffers[" in src:
            out.append(GraphInput(i, "buffer", clean_module_path(src)))
        elif src.startswith("L[") and not _module_state(ga):
            name = _arg_name(src)
            out.append(GraphInput(i, "data", name, config.batch_dim_for(name)))
        else:
            out.append(GraphInput(i, "constant", clean_module_path(src) if src else node.name))
    return out


def check_sharding(inputs: list[GraphInput], example_inputs) -> TPMesh | None:
    """All trainable parameters sharded by fully_shard on one (dp) mesh, or none; tensor parallel on one 1-D
    tp mesh, alone or under fully_shard (returned)."""
    params = [(gi, ex) for gi, ex in zip(inputs, example_inputs) if gi.kind == "param"]
    foreign = [gi for gi, _ in params if gi.foreign_dtensor]
    if foreign:
        desc = "; ".join(f"{gi.name}: {gi.foreign_dtensor}" for gi in foreign[:4])
        raise DPCompileError(
            f"dp_fsdp: parameters that are DTensors of a layout dpcompile does not support ({desc}"
            f"{' ...' if len(foreign) > 4 else ''}). Supported: dpcompile.fully_shard over one mesh, tensor "
            f"parallelism (parallelize_module with ColwiseParallel / RowwiseParallel) over one 1-D mesh, whose "
            f"parameters are Shard(d) or Replicate DTensors, or both (parallelize_module over mesh['tp'], then "
            f"dpcompile.fully_shard over mesh['dp'] of one (dp, tp) mesh); other placements are not supported."
        )
    tp = [(gi, ex) for gi, ex in params if gi.tp]
    if tp and not any(gi.sharded for gi, _ in params):
        return tp_mesh([(gi.name, ex) for gi, ex in tp])
    sharded = [(gi, ex) for gi, ex in params if gi.sharded]
    if not sharded:
        return None
    plain = [gi.name for gi, _ in params if not gi.sharded]
    if plain:
        raise DPValueError(
            f"dp_fsdp: parameters {plain[:8]}{' ...' if len(plain) > 8 else ''} are not sharded while others are; "
            f"apply dpcompile.fully_shard to every block and then to the root module (it shards whatever "
            f"parameters are left), so each gradient is reduced across ranks exactly once"
        )
    # the dp mesh: a tensor-parallel parameter's is the dp dim of its 2-D mesh
    meshes = distinct_meshes([(gi.name, tp_layout(ex).dp_mesh if tp_layout(ex) else ex) for gi, ex in sharded])
    if len(meshes) > 1:
        desc = "; ".join(f"{name} on {mesh}" for name, mesh in meshes)
        raise DPValueError(f"dp_fsdp: parameters live on different device meshes ({desc}); shard all of them "
                           f"with fully_shard(..., mesh=<one mesh>)")
    return tp_mesh([(gi.name, ex) for gi, ex in tp]) if tp else None


def refuse_cpp_wrapper_with_opaque_inputs(cpp_wrapper: bool, inputs: list[GraphInput], example_inputs) -> None:
    """Inductor's C++ wrapper takes tensors and numbers as graph inputs; torch 2.13 also hands a sharded step's
    device meshes to the graph (compat.meshes_are_graph_inputs), which the C++ wrapper cannot take (it fails at
    the first run, "object of type 'DeviceMesh' has no len()"). Refused at compile time, with what to do."""
    if not (cpp_wrapper or torch._inductor.config.cpp_wrapper):
        return
    plain = (torch.Tensor, int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
    opaque = [f"{gi.name} ({type(ex).__name__})" for gi, ex in zip(inputs, example_inputs) if not isinstance(ex, plain)]
    if opaque:
        raise DPValueError(
            f"cpp_wrapper=True cannot compile this step: torch {torch.__version__}'s Inductor C++ wrapper does not "
            f"take the graph inputs {', '.join(opaque)} (a sharded step's device meshes). Drop cpp_wrapper (and "
            f"Inductor's global cpp_wrapper) for sharded steps; cudagraphs=True also removes the per-kernel host cost.")


def refuse_gradients_passed_out(gm: fx.GraphModule, inputs: list[GraphInput], example_inputs) -> None:
    """A graph without trainable parameters is compiled as it is (a step's tail after ``loss.backward()``,
    a metric): unless it takes inputs that require grad and makes outputs that do. Its backward then carries
    gradients on to whatever made those inputs, a model that dynamo ran eagerly (a graph break it gave up on,
    a layer it was told not to trace), and they reach the parameters unclipped and without noise: no dp graph ever
    saw them, so nothing else would notice (eager_guard watches the parameters of models a dp graph trains)."""
    if not torch.is_grad_enabled() or in_non_private():
        return
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [a.meta.get("example_value", a.meta.get("val")) for a in out.all_input_nodes]
    # an output whose value dynamo did not record counts as one that requires grad
    if not any(v is None or (isinstance(v, torch.Tensor) and v.requires_grad) for v in outs):
        return
    placeholders = gm.graph.find_nodes(op="placeholder")
    carrying = [(gi.name, node) for gi, ex, node in zip(inputs, example_inputs, placeholders)
                if isinstance(ex, torch.Tensor) and ex.requires_grad and gi.kind != "param"]
    if not carrying:
        return
    split = describe_split(gm)
    found = (f"no trainable parameter, but its input(s) {', '.join(n for n, _ in carrying)} require grad and its "
             f"output does: its backward would carry gradients on to the parameters that made them, which dynamo "
             f"ran outside any graph, unclipped and without noise")
    if split is None:
        split = Split("the parameters' computation was not traced into this graph (dynamo ran it eagerly)",
                      GENERIC_ADVICE)
    raise DPCompileError(split_error_text(split, found))


def refuse_inputs_with_gradients(inputs: list[GraphInput], example_inputs, split: Split | None) -> None:
    """A batched input that requires grad makes the graph a piece of a longer autograd computation (a step
    split by a graph break, a model whose hooks run outside the graph): the gradients it passes back out
    would reach parameters without per-sample clipping."""
    for gi, ex in zip(inputs, example_inputs):
        if gi.kind == "data" and gi.batch_dim is not None and isinstance(ex, torch.Tensor) and ex.requires_grad:
            split = split or split_by_last_break(
                "this graph's input carries gradients from code dynamo ran outside it, so the step was split")
            raise DPCompileError(split_error_text(split, (
                f"its input '{gi.name}' requires grad: gradients computed here would flow on to whatever "
                f"produced it, outside the per-sample clipping. Pass data detached (e.g. x.detach()) and "
                f"compute everything that needs gradients inside the compiled step.")))


class _Clock:
    """``with clock(name):`` adds the block's wall time to ``seconds[name]``."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t


class DPPartitioner(CustomPartitionerFn):
    """Runs the dp passes on the joint graph, then Inductor's min-cut partitioner."""

    def __init__(self, backend: "DPBackend", record: CompiledStep, dumper: GraphDumper, split: "Split | None" = None,
                 tp: TPMesh | None = None, layout: str = ""):
        self.backend = backend
        self.tp = tp
        self.layout = layout  # compile_cache.rank_layout: a sharded step's rank and meshes, "" otherwise
        self.record = record
        self.dumper = dumper
        self.split = split  # describe_split of the dynamo graph: why it may be only part of the step
        self.called = False  # False after compile_fx: the AOTAutograd cache served the step
        self.fresh = ""  # a key of its own for a compile the AOTAutograd cache must not serve (_compile_fx)

    def uuid(self):
        # Inductor hashes this into its AOTAutograd and FX graph cache keys: dpcompile's source and every
        # option and setting the passes read (compile_cache), so a hit never carries other DP options; and a
        # sharded step's rank, so that each rank reads back its own compile
        return partitioner_key(self.backend.config) + self.layout + self.fresh

    def __deepcopy__(self, memo):
        return self  # Inductor copies its config; this object holds live compile state

    def __reduce__(self):
        # Inductor pickles its config to hash it: the uuid, not the live compile state
        return (str, (self.uuid(),))

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        self.called = True
        seconds: dict[str, float] = {}  # where this compile's time went (summary "compile_seconds")
        clock = _Clock(seconds)
        with clock("context"):
            ctx = self._context(gm, kwargs["num_fwd_outputs"])
        with clock("graph_texts"):
            self._dump("joint_graph_before_dp", gm)
        before = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        for p in PASSES:
            if p.name in self.backend.config.disable_passes:
                continue
            with clock(p.name):
                gm = p.fn(gm, ctx)
            with clock("finalize"):
                gm = finalize(gm)  # passes append rebuilt nodes; restore order, lint
            self._dump(f"joint_after_{p.name}", gm, keep=False)
        with clock("graph_texts"):
            self._dump("joint_graph_after_dp", gm)
        after = {n.name for n in gm.graph.nodes if n.op == "call_function"}
        removed = sorted(f"{k} ({v})" for k, v in before.items() if k not in after)
        ctx.summary["rewrite"] = {
            "joint_nodes_before": len(before),
            "joint_nodes_after": len(after),
            "added": len(after - set(before)),
            "removed": removed,
        }
        # No CSE in the partitioner: it would merge identical collectives (a rank
        # with no samples has many identical zero gradients), and every rank
        # must issue the same collectives.
        with torch._functorch.config.patch(cse=False), clock("min_cut_partition"):
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        with clock("after_partition"):
            ctx.counters["rng_states_moved_before_saved_objects"] += rng_states_before_saved_objects(
                fw, bw, kwargs["num_fwd_outputs"])
            # what CSE would have merged among the saved values (no_aliased_donations: why it matters)
            merge_identical_saved_values(fw, bw, kwargs["num_fwd_outputs"], ctx.counters)
            # ghost: the second backward's own copies of the pointwise values both backwards read
            copy_shared_values_into_second_backward(bw, ctx.counters)
        for p in BACKWARD_PASSES:
            if p.name not in self.backend.config.disable_passes and \
                    (not p.inductor_only or self.backend.config.compiler == "inductor"):
                with clock(p.name):
                    bw = p.fn(bw, ctx)
        # dpcompile's Triton kernels compiled in threads while Inductor compiles these graphs, not at first launch
        with clock("precompile_start"):
            precompiled = precompile_kernels([fw, bw])
        if precompiled is not None:
            ctx.summary["kernel_precompile"] = precompiled
        # the rewrites before AOTAutograd's, a counter both count summed (nonempty_batch_asserts_removed)
        self.record.counters = {k: self.record.counters.get(k, 0) + ctx.counters.get(k, 0)
                                for k in {**self.record.counters, **ctx.counters}}
        # Inductor's memory planning of bw adds buffer_reuses_refused to them
        count_refusals(bw, f"{id(self.record)}:{self.record.compile_id}", self.record.counters)
        with clock("graph_texts"):
            self._dump("forward", fw)
            self._dump("backward", bw)
        with clock("record"):
            self.record.ops.update(forward=_op_list(fw), backward=_op_list(bw))
            if "tensor_parallel" in ctx.summary:
                ctx.summary["tensor_parallel"]["window"] = _norm_all_reduce_window(bw)
            ctx.summary["counters"] = dict(ctx.counters)
            ctx.summary["graph_ops"] = {
                "forward": _op_counts(fw), "backward": _op_counts(bw),
            }
            ctx.summary["collectives"] = _collectives_by_phase(fw, bw, ctx)
        ctx.summary["compile_id"] = self.record.compile_id
        ctx.summary["rank"] = _rank()
        ctx.summary["batch_size"] = str(ctx.batch_size)
        ctx.summary["compile_seconds"] = {k: round(v, 4) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
        self.record.summary = ctx.summary
        self.dumper.dump_summary(ctx.summary)
        self.record.dump_files = list(self.dumper.files)
        return fw, bw

    def _dump(self, stage: str, gm: fx.GraphModule, keep: bool = True) -> None:
        """The stage's readable graph into the dumps; kept in ``record.graphs`` too unless ``keep`` is False
        (the graph after each pass: printing a GPT-2-sized joint graph once per pass cost seconds of every
        compile, so those texts are made only when a dump directory or TORCH_TRACE wants them). A kept stage
        is a snapshot, printed when first read (the dumps, or a user reading ``record.graphs``)."""
        if keep:
            self.record.graphs[stage] = graph_snapshot(gm)
            self.dumper.dump(stage, lambda: self.record.graphs[stage])
        else:
            self.dumper.dump(stage, lambda: self.record.graphs.setdefault(stage, graph_text(gm)))

    def _context(self, gm: fx.GraphModule, num_fwd_outputs: int) -> DPPassContext:
        cfg = self.backend.config
        placeholders = gm.graph.find_nodes(op="placeholder")
        primals = [p for p in placeholders if not p.name.startswith("tangents")]
        by_index: dict[int, fx.Node] = {}
        for pos, p in enumerate(primals):
            idx = _input_index(p.meta.get("desc"))
            by_index[idx if idx is not None else pos] = p
        out = gm.graph.find_nodes(op="output")[0]
        grad_pos: dict[int, int] = {}
        descs = out.meta.get("desc") or []
        for j, d in enumerate(descs):
            while hasattr(d, "base") and getattr(d, "attr", None) == "_local_tensor":
                d = d.base  # a DTensor gradient's local shard
            of = getattr(d, "grad_of", None)
            idx = _input_index(of)
            if idx is not None:
                grad_pos[idx] = j
        if not grad_pos:  # older layout: one gradient per primal after the forward outputs
            grad_pos = {i: num_fwd_outputs + i for i in range(len(primals))}
        params, data, reshard = [], {}, set()
        inputs = self.record.inputs
        ordinal = {gi.index: k for gi, k in _param_ordinals(inputs)}
        grad_kind = self._tp_gradient_kinds(inputs, ordinal) if self.tp is not None else {}
        for gi in inputs:
            node = by_index.get(gi.index)
            if node is None:
                continue
            if gi.reshard_after_forward:
                reshard.add(node)
            if gi.kind == "param":
                j = grad_pos.get(gi.index)
                if j is None or out.args[0][j] is None:
                    continue  # unused by the loss: no gradient, no noise
                # the seed of the parameter's ordinal: the same on every rank (an input's position is not:
                # ranks' graphs may differ in their symbolic-size inputs), known before the passes run
                # (tensor-parallel replicas pick their stream by it, NoiseSeeds.index_ranks)
                kind = grad_kind.get(gi.index, "")
                params.append(ParamInfo(gi.name, node, j, ordinal[gi.index], tp=kind, tp_grad=kind, shape=gi.shape))
            elif gi.kind == "data":
                data[node] = (gi.name, gi.batch_dim)
        seeds_pos = len(inputs)
        seeds_node = by_index.get(seeds_pos)
        dropped_slot = grad_pos.get(seeds_pos + 1)  # the counter input, after the seeds
        gate_node = by_index.get(seeds_pos + 2)  # the noise gate, after the counter
        ctx = DPPassContext(
            options=PassOptions.of(cfg), params=params, data_inputs=data,
            seeds_input_index=placeholders.index(seeds_node) if seeds_node is not None else None,
            dropped_grad_index=dropped_slot,
            noise_gate_input_index=placeholders.index(gate_node) if gate_node is not None else None,
            num_fwd_outputs=num_fwd_outputs, compile_id=self.record.compile_id, reshard_primals=reshard,
            sharded=any(gi.sharded for gi in inputs), split_step=self.split,
            compile_reason=self.record.compile_reason,
            tp_group=self.tp.group if self.tp is not None else None,
            tp_rank=self.tp.rank if self.tp is not None else 0,
            tp_size=self.tp.size if self.tp is not None else 1,
            # tensor parallel: the placeholders whose values differ across the group (shards, frozen ones too)
            tp_local_primals={by_index[gi.index] for gi in inputs if gi.tp == "shard" and gi.index in by_index},
            state_inputs={by_index[gi.index]: (gi.kind, gi.name) for gi in inputs if gi.index in by_index
                          and gi.kind in ("param", "frozen_param", "buffer", "constant")},
        )
        ctx.summary["frozen"] = [gi.name for gi in inputs if gi.kind == "frozen_param"]
        return ctx

    def _tp_gradient_kinds(self, inputs: list[GraphInput], ordinal: dict[int, int]) -> dict[int, str]:
        """Tensor parallel: input index -> what each trainable parameter's gradient is on this rank ("shard",
        "replicate", "partial"; tensor_parallel's docstring), from the placement DTensor gave the gradient
        (not the parameter's: a RowwiseParallel embedding is Shard(0) with a Replicate gradient). Shards draw
        noise from this rank's stream, the rest from the group's shared one (NoiseSeeds.index_ranks)."""
        placements = gradient_placements()
        kinds: dict[int, str] = {}
        for gi in inputs:
            if gi.kind != "param":
                continue
            if not gi.tp:
                kinds[gi.index] = "replicate"  # a plain parameter: the whole gradient on every rank (checked)
                continue
            if placements is None:
                raise DPCompileError(
                    f"dp_fsdp: cannot read the placements DTensor gave the tensor-parallel gradients from this "
                    f"torch version's AOTAutograd (torch {torch.__version__}), so '{gi.name}' cannot be "
                    f"classified as a shard, a replica or a partial sum of its gradient; use torch 2.11 or 2.13")
            pl = placements.get(gi.index)
            # a fully_shard parameter is 2-D (dp, tp): its gradient is reduce-scattered over dp and its
            # meaning within the tp group is the last placement
            kind = placement_kind(pl[-1:] if gi.sharded and pl is not None and len(pl) == 2 else pl)
            if not kind:
                raise DPCompileError(
                    f"dp_fsdp: the gradient of tensor-parallel parameter '{gi.name}' has placements {pl} "
                    f"(the parameter: {gi.tp}); dpcompile takes Shard(d), Replicate and Partial(sum) gradients "
                    f"on the tp mesh")
            kinds[gi.index] = kind
        self.backend.noise.index_ranks = {ordinal[i]: self.tp.stream(kind) for i, kind in kinds.items()}
        self.record.noise_index_ranks = dict(self.backend.noise.index_ranks)
        return kinds


_COLLECTIVE_KINDS = {"all_gather_into_tensor": "all_gathers", "reduce_scatter_tensor": "reduce_scatters",
                     "all_reduce": "all_reduces"}


def _collectives_by_phase(fw: fx.GraphModule, bw: fx.GraphModule, ctx) -> dict[str, dict[str, int]]:
    """Collectives per phase: forward, backward before the clip coefficients
    exist (the ghost first backward / bk's input-gradient chain), and after."""
    clip = ctx.clip_coef.name if ctx.clip_coef is not None else None
    phases = {"forward": {}, "backward_before_clip": {}, "backward_after_clip": {}}

    def count(gm, phase):
        for n in gm.graph.nodes:
            if phase == "backward_before_clip" and n.name == clip:
                phase = "backward_after_clip"
            kind = _COLLECTIVE_KINDS.get(getattr(n.target, "__name__", "").split(".")[0]) \
                if n.op == "call_function" else None
            if kind:
                phases[phase][kind] = phases[phase].get(kind, 0) + 1

    count(fw, "forward")
    count(bw, "backward_before_clip")
    phases["removed_from_backward"] = {"reduce_scatters": ctx.counters.get("unused_collectives_removed", 0)}
    phases["backward_overlap"] = {"reduce_scatters_under_a_gemm": _reduce_scatters_under_gemm(bw)}
    return phases


_GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _reduce_scatters_under_gemm(gm: fx.GraphModule) -> int:
    """Reduce-scatters with a matrix multiply issued between them and their wait (they can overlap)."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    gemms = [pos[n] for n in gm.graph.nodes if n.op == "call_function" and n.target in _GEMMS]
    found = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default:
            waits = [pos[u] for u in n.users if u.target is torch.ops._c10d_functional.wait_tensor.default]
            found += bool(waits) and any(pos[n] < g < min(waits) for g in gemms)
    return found


def _input_index(desc) -> int | None:
    """Position among the dynamo graph's inputs of a joint-graph input descriptor.

    A DTensor input is unpacked into its local tensor (SubclassGetAttrAOTInput
    with attr "_local_tensor"); other unpacked pieces have no position.
    """
    while desc is not None and hasattr(desc, "base"):
        if getattr(desc, "attr", None) != "_local_tensor":
            return None
        desc = desc.base
    return getattr(desc, "idx", None)


def _norm_all_reduce_window(gm: fx.GraphModule) -> tuple[int, int] | None:
    """Positions in _op_list(gm) of the tensor-parallel norm all-reduce (per_sample_norms marks it) and its
    wait."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    issue = next((i for i, n in enumerate(calls) if n.meta.get(NORM_ALL_REDUCE_META)), None)
    if issue is None:
        return None
    wait = next(i for i in range(issue, len(calls))
                if calls[i].target is torch.ops._c10d_functional.wait_tensor.default and
                calls[i].args[0] is calls[issue])
    return issue, wait


def _op_list(gm: fx.GraphModule) -> list[tuple[str, tuple]]:
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            v = n.meta.get("val")
            out.append((str(n.target), tuple(v.shape) if isinstance(v, torch.Tensor) else ()))
    return out


def _op_counts(gm: fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            k = str(n.target)
            counts[k] = counts.get(k, 0) + 1
    return dict(sorted(counts.items()))


class DPBackend:
    """A dp_fsdp backend instance: ``torch.compile(step, backend=DPBackend(...))``.

    Keeps every graph it compiled (``.compiled``) and the noise stream state
    shared by all of them (``state_dict()`` / ``load_state_dict()``), so a
    recompile (a new batch size) never replays noise of an earlier step.
    """

    def __init__(self, config: DPConfig | None = None, **options: Any):
        if config is None:
            config = DPConfig.from_options(options)
        elif options:
            raise ValueError("pass either a DPConfig or keyword options, not both")
        self.config = config
        install_hf_shims()  # before dynamo traces the step (compat)
        self.compiled: list[CompiledStep] = []
        self.noise = NoiseSeeds(config.seed)
        self.calls = 0  # DP graph executions, checked by private_step
        self._dropped: dict[torch.device, torch.Tensor] = {}  # per device: a leaf whose .grad counts drops

    def dropped_samples(self) -> int:
        """How many samples this process's DP steps dropped since the last call (a sample whose gradient
        is not finite: bad data, an overflow; it contributes nothing). Reading it waits for the GPU."""
        total = 0
        for leaf in self._dropped.values():
            if leaf.grad is not None:
                total += int(leaf.grad.item())
                leaf.grad = None
        return total

    def _dropped_counter(self, device: torch.device) -> torch.Tensor:
        if device not in self._dropped:
            self._dropped[device] = torch.zeros((), device=device, requires_grad=True)
        return self._dropped[device]

    # noise stream state, for checkpoints
    def state_dict(self) -> dict[str, Any]:
        return self.noise.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.noise.load_state_dict(state)

    def __call__(self, gm: fx.GraphModule, example_inputs) -> Callable:
        # Dynamo falls back to running the frame eagerly on some backend
        # exceptions (fake-tensor ones); for us that would be a silently
        # non-private step. Every failure becomes a DPCompileError instead.
        try:
            with hold_full_collections(self.config.pause_gc):  # no full collection walks the compile (compile_gc)
                return self._compile(gm, example_inputs)
        except (DPCompileError, DPValueError):
            raise
        except ValueError as e:
            raise DPValueError(str(e)) from e
        except Exception as e:
            from torch._dynamo.exc import TensorifyScalarRestartAnalysis

            if isinstance(e, TensorifyScalarRestartAnalysis):
                raise
            raise DPCompileError(
                f"dp_fsdp failed to compile the step ({type(e).__name__}: {e}{_where(e)}). dpcompile refuses to "
                f"fall back to eager execution, which would produce non-private gradients.{_hint(gm, e)}"
            ) from e

    def _codegen_patches(self, *, collectives: bool, record: CompiledStep) -> dict:
        """Inductor settings of the code it generates that the options choose (cpp_wrapper only when asked for:
        a global ``torch._inductor.config.cpp_wrapper = True`` stays in force otherwise). ``collectives``: the
        step has in-graph collectives (sharded or tensor parallel), which the C++ wrapper runs unbucketed, and
        whose bucketed all-gathers hand their parameters on copied out (``dpcompile.gathered_copy_out``)."""
        cpp = {"cpp_wrapper": True} if self.config.cpp_wrapper else {}
        if self.config.cpp_wrapper or torch._inductor.config.cpp_wrapper:
            cpp.update(cpp_wrapper_patches(collectives=collectives))
        copy_out = {}
        # (the C++ wrapper's patches may unbucket)
        if collectives and cpp.get("bucket_all_gathers_fx") != "none" \
                and gathered_copy_out.NAME not in self.config.disable_passes:
            copy_out = gathered_copy_out.patches(count=functools.partial(record.count, gathered_copy_out.COUNTER))
        return {"triton.cudagraphs": self.config.cudagraphs, **cpp, **copy_out}

    def _compile_fx(self, gm: fx.GraphModule, inputs: list, part: "DPPartitioner", record: CompiledStep,
                    tp: TPMesh | None, aot_cache: bool, inner: dict, unbacked: bool, codegen: dict,
                    one_sample: bool) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        not_donated = functools.partial(record.count, "saved_aliases_not_donated")
        with torch._functorch.config.patch(enable_autograd_cache=aot_cache), no_aliased_donations(not_donated):
            # TORCHINDUCTOR_AUTOGRAD_CACHE=1 in the environment forces the cache on whatever the patch says:
            # then a compile it must not serve gets a key no entry has (Inductor's FX graph cache, keyed by
            # it too, then misses as well; without the variable it still serves the generated code)
            forced = not aot_cache and torch._functorch.config.enable_autograd_cache
            part.fresh = f"-uncached-{os.urandom(8).hex()}" if forced else ""
            return compile_fx(gm, inputs, config_patches={
                "custom_partitioner_fn": part,
                # Inductor's channels-last layout optimisation of convolutions assumes output strides that
                # the convolution does not give when the batch size is unbacked (one graph for every batch
                # size: sharded steps, mark_batch): its stride asserts fail at run time, with stock
                # torch.compile too (torch 2.13, CPU). Static batch sizes keep it
                "layout_optimization": torch._inductor.config.layout_optimization and not unbacked,
                # pad_mm pads and re-slices contractions in the joint graph; the
                # per-sample norms are cheaper on the unpadded ones
                "shape_padding": False,
                # Inductor tries to fuse each node with up to 64 others reading the same buffer; DP graphs
                # have buffers read by one kernel per parameter (noise seeds, loss tangent, noise gate,
                # clip coefficients), which made fusion a third of the backward's compile. 16 generated
                # the same 721 kernels for GPT-2-small bf16 on an H100 with the scheduler's 24.3 s -> 14.8 s
                # (BENCHMARKS.md, "Where the compile time goes")
                "max_fusion_buffer_group_pairwise_attempts":
                    min(16, torch._inductor.config.max_fusion_buffer_group_pairwise_attempts),
                # tensor parallel: Inductor's reordering for peak memory runs the consumers of the norm
                # all-reduce's result right after its issue (they free its [B, 1 + n] buffer), which puts the
                # wait there and leaves the all-reduce nothing to run under (BENCHMARKS.md, "the norm
                # all-reduce in the profile"); without it the graph's order, which waits where the clip
                # coefficients are needed, stands
                **({"reorder_for_peak_memory": False} if tp is not None else {}),
                **codegen,
            }, decompositions=decompositions_for_one_sample() if one_sample else None, **inner)

    def _compile(self, gm: fx.GraphModule, example_inputs) -> Callable:
        from torch._guards import CompileContext
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        cid = CompileContext.current_compile_id()
        compile_id = str(cid) if cid is not None else str(len(self.compiled))
        inputs = classify_inputs(gm, example_inputs, self.config)
        nonempty_asserts = forget_nonempty_axiom(gm, inputs)  # before dynamo guards the frame on it
        tp = check_sharding(inputs, example_inputs)
        if tp is not None:
            allow_dtensor_gradients_in_dynamo()
        if any(gi.sharded for gi in inputs) and torch.is_grad_enabled():
            require_unbacked_batch(gm, inputs)
        guard_empty_y_grid()  # a graph with an unbacked batch size may run with no samples
        hint_mix_order_split()  # ... and Inductor must tune it with the batch hint, not raise
        mix_order_reduction_keeps_shapes()  # ... and return its gradients in their shapes (torch 2.11)
        hint_fusion_scores()  # ... and fuse its kernels as for a fixed batch of the hint's size
        hint_kernel_size_hints()  # ... and tune them for it
        hint_cpu_bmm_layouts()  # ... and lower a CPU bmm of operands whose strides hold it, not raise
        hint_same_ordered_strides()  # ... and lay a buffer out in the order of strides that hold it, not raise
        expand_unbacked_vec_indices()  # ... and vectorise its CPU kernels without sympy.simplify on its indices
        reshape_indexer_refuses_unbacked_guesses()  # ... and index its reshapes for every batch size
        cpp_wrapper_any_args()  # a sharded graph's collectives under Inductor's C++ wrapper (torch 2.13)
        install_phase_gated_reuse()  # no buffer of ghost's first backward held for its second
        self.noise.rank = _noise_rank(inputs, example_inputs)
        # tensor parallel: a shard's noise comes from this rank's stream, a replica's from one stream that
        # every rank of the group shares (replicas stay equal; each coordinate gets one draw); set by the
        # partitioner from the gradients' placements (DPPartitioner._tp_gradient_kinds)
        self.noise.index_ranks = {}
        record = CompiledStep(compile_id, inputs)
        record.counters["nonempty_batch_asserts_removed"] = nonempty_asserts  # with passes.empty_batch's
        self.compiled.append(record)
        dumper = GraphDumper(resolve_dump_dir(self.config.dump_dir), compile_id, _rank())
        record.graphs["dynamo"] = graph_snapshot(gm)
        dumper.dump("dynamo_graph", lambda: record.graphs["dynamo"])
        inner = {"inner_compile": run_graph_eagerly} if self.config.compiler != "inductor" \
            else {"inner_compile": with_full_collections_held(compile_fx_inner)} if self.config.pause_gc else {}
        refuse_cpp_wrapper_with_opaque_inputs(self.config.cpp_wrapper, inputs, example_inputs)  # DP or not
        distributed = any(gi.sharded or gi.tp for gi in inputs)  # collectives in the graphs
        codegen = self._codegen_patches(collectives=distributed, record=record)
        if not any(gi.kind == "param" for gi in inputs) or not torch.is_grad_enabled():
            record.dp = False
            refuse_gradients_passed_out(gm, inputs, example_inputs)
            return compile_fx(gm, example_inputs, config_patches=codegen, **inner)

        split = describe_split(gm)
        reason = getattr(gm, "compile_subgraph_reason", None)
        record.compile_reason = ((getattr(reason, "reason", None) or "").strip().splitlines() or [""])[0]
        refuse_inputs_with_gradients(inputs, example_inputs, split)
        placeholders = gm.graph.find_nodes(op="placeholder")
        refuse_writes_to_gathered_params(gm, {placeholders[gi.index]: gi.name for gi in inputs if gi.sharded})
        device = next(ex.device for ex, gi in zip(example_inputs, inputs) if gi.kind == "param")
        # a later eager run of this model (the uncompiled step called by mistake) must fail, not train without DP
        guard = sentinel([(gi.name, ex) for ex, gi in zip(example_inputs, inputs) if gi.kind == "param"])
        seeds_example = self.noise.example(len(inputs), device)
        counter = self._dropped_counter(device)
        gate_on, gate_off = (torch.tensor(v, device=device) for v in (1.0, 0.0))
        unbacked = any(is_unbacked(size) for size, *_ in batch_sizes(gm, inputs))  # one graph, every batch size
        one_sample = not unbacked and any(known(size == 1) for size, *_ in batch_sizes(gm, inputs))
        record.counters[BILINEAR_COUNTER] = bilinear_as_matmul(gm)  # nn.Bilinear as ops with rules
        record.counters[EMBEDDING_BAG_COUNTER] = embedding_bags_as_embeddings(gm)  # ... nn.EmbeddingBag too
        gm = _with_extra_inputs(gm, [(SEEDS_INPUT_NAME, seeds_example), (_DROPPED_INPUT_NAME, counter),
                                     (_NOISE_GATE_INPUT_NAME, gate_on)])
        part = DPPartitioner(self, record, dumper, split, tp, rank_layout(example_inputs) if distributed else "")
        aot_cache = torch._functorch.config.enable_autograd_cache and aot_cache_allowed(
            self.config, dumps_wanted=dumper.folder is not None)
        if aot_cache and distributed:
            stable_mesh_keys()
            # torch 2.11 records DTensor method calls as closures, which the cache refuses
            rewritten = 0
            if dtensor_calls_are_closures() and cacheable_dtensor_calls.NAME not in self.config.disable_passes:
                gm, rewritten = cacheable_dtensor_calls.cacheable_dtensor_calls_pass(gm)
            record.counters[cacheable_dtensor_calls.COUNTER] = rewritten
            if rewritten:
                codegen = {**codegen, **cacheable_dtensor_calls.cache_patches(source_hash())}
        extra = [seeds_example, counter, gate_on]
        key = record_key(part.uuid(), gm, [*example_inputs, *extra]) if aot_cache else None
        compiled = self._compile_fx(gm, [*example_inputs, *extra], part, record, tp, key is not None, inner,
                                    unbacked, codegen, one_sample)
        if key is not None:
            record.cache = "miss" if part.called else "hit"
            found = part.called or load_record(key, record)
            if not found:
                # a hit whose record is gone (its process died before writing it, or another checkout's traced
                # source filled the cache): the step compiles again, without the cache, and writes it. A
                # tensor-parallel step's noise streams are in the record; every step's summary, counters and
                # graphs are what users and dumps read.
                compiled = self._compile_fx(gm, [*example_inputs, *extra], part, record, tp, False, inner,
                                            unbacked, codegen, one_sample)
                record.cache = "miss"
            if part.called:  # for a later process that this compile's cache entry serves
                save_record(key, record)
            else:
                self.noise.index_ranks = dict(record.noise_index_ranks)
                record.summary = {**record.summary, "compile_id": compile_id, "cache": (
                    "AOTAutograd cache hit: no pass ran; graphs, counters and summary are those of the compile "
                    "that filled the cache")}
        n_seeds = len(inputs)
        own_grads = GradsOutOfGraphMemory([gi.index for gi in inputs if gi.kind == "param"], counter) \
            if self.config.cudagraphs else None

        # a miss's record is saved once more at the next step: the backward compiles lazily, at the first
        # backward, and its memory planning adds to the counters (buffer_reuses_refused)
        resave = [key] if key is not None and record.cache == "miss" else []
        steps = [0]

        def dp_step(*args):
            self.calls += 1
            guard.arm()
            steps[0] += 1
            if resave and steps[0] == 2:
                save_record(resave.pop(), record)
            if own_grads is not None:
                own_grads(args)
            if accumulating():  # no noise, and the noise stream stays where it is
                return compiled(*args, seeds_example, counter, gate_off)
            seeds = self.noise.next(n_seeds, device)
            return compiled(*args, seeds, counter, gate_on)

        dp_step._dpcompile_record = record  # type: ignore[attr-defined]
        return dp_step


class GradsOutOfGraphMemory:
    """Under CUDA graphs, a step's outputs (the gradients autograd stores in ``.grad`` among them) live in
    the graphs' memory pool, which the next step's replay overwrites (accessing them afterwards raises).
    Before each step, a ``.grad`` still held from an earlier step (gradient accumulation, the
    dropped-sample counter, ``zero_grad(set_to_none=False)``) is copied to memory of its own, once: later
    steps accumulate into the copy."""

    def __init__(self, param_positions: list[int], counter: torch.Tensor):
        self.param_positions = param_positions
        self.counter = counter
        self.owned: dict[int, Any] = {}  # id(leaf) -> weakref to the .grad copy made here

    def __call__(self, args) -> None:
        import weakref

        leaves = [args[i] for i in self.param_positions] + [self.counter]
        for leaf in leaves:
            g = leaf.grad
            if g is None:
                continue
            ref = self.owned.get(id(leaf))
            if ref is not None and ref() is g:
                continue
            leaf.grad = g.detach().clone()
            self.owned[id(leaf)] = weakref.ref(leaf.grad)


def run_graph_eagerly(gm: fx.GraphModule, example_inputs, **kwargs) -> Callable:
    """Inductor's inner compile for ``compiler="eager"``: the partitioned graph, run op by op.

    The noise's ``inductor_random`` has an eager kernel that ignores its seed (it draws from torch's global
    generator: the same numbers on every rank that seeded it alike, and none of the noise stream's
    reproducibility); here it draws from a generator seeded with its seed instead. Not Inductor's numbers,
    the same guarantees: one draw per coordinate from the per-parameter, per-rank, per-step seed. flex_attention's
    backward gets the buffers whose gradients the graph reads as tensors that require grad (flex_backward_eagerly)."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch.fx._lazy_graph_module import _LazyGraphModule

    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.prims.inductor_random.default):
        node.target = seeded_random
    flex_backward = getattr(torch.ops.higher_order, "flex_attention_backward", None)
    for node in gm.graph.find_nodes(op="call_function", target=flex_backward) if flex_backward else ():
        used = {g.args[1] for u in node.users if u.target is operator.getitem and u.args[1] == 3
                for g in u.users}  # the buffer gradients the graph reads
        wanted = tuple(i in used for i in range(len(node.args[12])))
        node.target, node.args = flex_backward_eagerly, (wanted, *node.args)
    gm.recompile()
    _LazyGraphModule.force_recompile(gm)
    return make_boxed_func(gm.forward)


def flex_backward_eagerly(wanted: tuple[bool, ...], *args, **kwargs):
    """flex_attention_backward returning the gradients of score_mod's buffers that the graph reads (``wanted``).
    torch's eager kernel returns a buffer's gradient only where the buffer requires grad when it runs, and one
    the backward computes (a sharded parameter gathered again there) does not: it gets a detached alias that
    does."""
    bufs = tuple(b.detach().requires_grad_() if w and isinstance(b, torch.Tensor) and not b.requires_grad else b
                 for b, w in zip(args[12], wanted))
    return torch.ops.higher_order.flex_attention_backward(*args[:12], bufs, *args[13:], **kwargs)


def seeded_random(size, seed: torch.Tensor, mode: str, **kwargs) -> torch.Tensor:
    """``prims.inductor_random`` drawn from a generator seeded with ``seed`` (float32, as Inductor's)."""
    generator = torch.Generator(device=seed.device).manual_seed(int(seed))
    return getattr(torch, mode)(size, generator=generator, device=seed.device, dtype=torch.float32)


_DROPPED_INPUT_NAME = "dpcompile_dropped_samples"
_NOISE_GATE_INPUT_NAME = "dpcompile_noise_gate"  # 1.0: add the noise; 0.0: inside dpcompile.accumulate()


def _with_extra_inputs(gm: fx.GraphModule, extra: list[tuple[str, torch.Tensor]]) -> fx.GraphModule:
    """A copy of dynamo's graph with more inputs: the noise seeds, the dropped-sample counter.

    Dynamo keeps using its own graph after the backend returns, so the extra
    placeholder goes on a copy that carries what AOTAutograd reads from a
    dynamo graph (its meta, parameter sources and per-placeholder sources).
    """
    import copy

    new_graph = copy.deepcopy(gm.graph)
    new = fx.GraphModule(gm, new_graph)
    new.meta = dict(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    for old_ph, new_ph in zip(gm.graph.find_nodes(op="placeholder"), new_graph.find_nodes(op="placeholder")):
        if hasattr(old_ph, "_dynamo_source"):
            new_ph._dynamo_source = old_ph._dynamo_source
    for name, example in extra:
        last = new_graph.find_nodes(op="placeholder")[-1]
        with new_graph.inserting_after(last):
            ph = new_graph.placeholder(name)
        ph.meta["example_value"] = example
        ph._dynamo_source = None  # not a user input
    new.recompile()
    return new


def _param_ordinals(inputs: list[GraphInput]) -> list[tuple[GraphInput, int]]:
    """Each trainable parameter with its ordinal among them: its noise seed's index."""
    return [(gi, k) for k, gi in enumerate(gi for gi in inputs if gi.kind == "param")]


def _noise_rank(inputs: list[GraphInput], example_inputs) -> int:
    """Which stream this rank's noise comes from: the index of the shard it owns.

    Under pure sharding that is the rank. With a 2-D (hybrid) mesh, replicas
    of a shard must draw the same noise (each coordinate gets one draw and the
    replicas stay equal), so the stream is the rank within the shard dim.
    (Tensor-parallel parameters pick theirs per parameter: NoiseSeeds.index_ranks.)
    """
    for gi, ex in zip(inputs, example_inputs):
        if gi.sharded:
            mesh = tp_layout(ex).dp_mesh if tp_layout(ex) is not None else ex.device_mesh
            return dp_shard_index(mesh)
    return _rank()


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", 0))


_BACKENDS: dict[DPConfig, DPBackend] = {}
_BACKENDS_LOCK = threading.Lock()


def get_backend(options: dict[str, Any] | DPConfig) -> DPBackend:
    """The backend instance ``backend="dp_fsdp", options=options`` compiles with."""
    cfg = options if isinstance(options, DPConfig) else DPConfig.from_options(options)
    with _BACKENDS_LOCK:
        if cfg not in _BACKENDS:
            _BACKENDS[cfg] = DPBackend(cfg)
        return _BACKENDS[cfg]


def backend_of(compiler_fn: Any) -> DPBackend | None:
    """The DPBackend that dynamo's compiler function for a frame leads to, or None.

    Dynamo wraps the backend (repro wrapper, then torch.compile's wrapper
    holding ``options``): ``backend="dp_fsdp", options=...`` and
    ``backend=DPBackend(...)`` (``private_step``) both lead here.
    """
    fn, options = compiler_fn, None
    for _ in range(8):
        if isinstance(fn, DPBackend):
            return fn
        if fn is dp_fsdp:
            try:
                return get_backend(options) if options else None
            except ValueError:
                return None  # the compile itself reports bad options
        if hasattr(fn, "_torchdynamo_orig_backend"):
            fn = fn._torchdynamo_orig_backend
        elif hasattr(fn, "compiler_fn"):
            options = getattr(fn, "kwargs", {}).get("options", options)
            fn = fn.compiler_fn
        else:
            return None
    return None


def dp_fsdp(gm: fx.GraphModule, example_inputs, *, options: dict[str, Any] | None = None, **kwargs: Any):
    """Entry point of ``torch.compile(step, backend="dp_fsdp", options={...})``."""
    if "mode" in kwargs:
        raise ValueError(
            f"torch.compile(backend='dp_fsdp') takes its settings through options=..., and torch.compile takes "
            f"mode= or options=, never both: for mode={kwargs['mode']!r} write "
            f"options={{..., 'cudagraphs': True}} (what mode='reduce-overhead' does), or use "
            f"@dpcompile.private_step(mode={kwargs['mode']!r}, max_grad_norm=..., ...)"
        )
    if kwargs:
        raise ValueError(f"dp_fsdp takes its settings through options=..., not {sorted(kwargs)}")
    if not options:
        raise ValueError(
            "dp_fsdp needs options, e.g. torch.compile(step, backend='dp_fsdp', "
            "options={'max_grad_norm': 1.0, 'noise_multiplier': 1.0, 'expected_batch_size': 256})"
        )
    return get_backend(options)(gm, example_inputs)
