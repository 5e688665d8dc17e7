"""Warm restarts: the AOTAutograd cache serves DP graphs, keyed by everything the dp passes read.

A cache hit skips AOTAutograd's tracing, dpcompile's passes and the min-cut
partitioner, and loads the generated forward and backward from Inductor's FX
graph cache. The passes bake the DP options into the graphs (C, sigma, the
schedule, block sizes), so the key (``DPPartitioner.uuid``, which Inductor
hashes into the AOTAutograd and FX graph cache keys) holds dpcompile's source,
torch's version, every ``DPConfig`` field, the fp32 matmul precision and the
value of every module-level setting of dpcompile and its passes
(``CHUNK_NUMEL``, ``NORM_BLOCK_BYTES``, ...): change any of them and the step
compiles anew. What the passes recorded for
inspection (``backend.compiled[i]``: graphs, counters, summary) is saved
beside Inductor's cache on a miss and read back on a hit.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import pickle
import re
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn

_SIMPLE = (int, float, str, bool, type(None), torch.dtype)


@functools.cache
def source_hash() -> str:
    """A digest of dpcompile's and its passes' source: compiled code is never reused across versions."""
    from dpcompile import passes as dp_passes

    digest = hashlib.sha256(torch.__version__.encode())
    for package in (pathlib.Path(__file__).parent, pathlib.Path(dp_passes.__file__).parent):
        for f in sorted(package.rglob("*.py")):
            digest.update(str(f.relative_to(package)).encode() + f.read_bytes())
    return digest.hexdigest()[:20]


def _simple(v: Any) -> bool:
    if isinstance(v, _SIMPLE):
        return True
    if isinstance(v, (tuple, list)):
        return all(_simple(x) for x in v)
    if isinstance(v, dict):
        return all(_simple(k) and _simple(x) for k, x in v.items())
    return False


def settings() -> list[tuple[str, str]]:
    """(module.NAME, repr) of every module-level setting of dpcompile and its passes, read now (a test or a
    user may have changed one since import). Settings are upper-case names holding plain values; a private
    one (leading underscore) only when scalar, so module state such as a dict of counters stays out."""
    out = []
    for mod_name, mod in sorted((n, m) for n, m in list(sys.modules.items()) if n.split(".")[0] == "dpcompile"):
        for name, value in sorted(vars(mod).items()):
            if not re.fullmatch(r"_?[A-Z][A-Z0-9_]*", name) or not _simple(value):
                continue
            if name.startswith("_") and isinstance(value, (tuple, list, dict)):
                continue
            out.append((f"{mod_name}.{name}", repr(value)))
    return out


def partitioner_key(config) -> str:
    """What the DP graphs depend on beyond the Dynamo graph and its inputs (which the caches key themselves)."""
    fields = [(f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config)]
    # the fp32 matmul precision: aligned_contractions pads for TF32
    digest = hashlib.sha256(repr((fields, settings(), torch.get_float32_matmul_precision())).encode()).hexdigest()[:20]
    return f"dpcompile.DPPartitioner-{source_hash()}-{digest}"


def aot_cache_allowed(config, dumps_wanted: bool) -> bool:
    """A hit runs no pass: no graph dumps or TORCH_TRACE artifacts; those compiles skip the cache. The eager
    compiler's graphs are not Inductor's, which the cache stores. Without Inductor's FX graph cache AOTAutograd
    stores nothing (it bypasses its cache): those compiles skip it too, and write no record (its key and graph
    texts, printed for a later process that could never hit: 0.8 s of GPT-2-small ghost's sharded compile)."""
    return config.compiler == "inductor" and not dumps_wanted and not _tracing() and _fx_graph_cache_on()


def _fx_graph_cache_on() -> bool:
    """AOTAutograd's condition for caching anything (torch 2.11 and 2.13 ``check_cacheable``)."""
    from torch._inductor.utils import should_use_remote_fx_graph_cache

    return bool(torch._inductor.config.fx_graph_cache or should_use_remote_fx_graph_cache())


def rank_layout(example_inputs) -> str:
    """A sharded or tensor-parallel step: this rank, the world, and every mesh and placement of its DTensor
    inputs, for the cache key. The ranks of a job share one cache folder, and their graphs can be the same
    text while meaning different things (a tp rank's slice of a gradient is ``getitem(split(g), rank)`` in
    AOTAutograd's graph, which the key never sees; the noise streams the record keeps are per rank); so each
    rank has entries of its own, and a job restarted on another layout compiles anew."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not (dist.is_available() and dist.is_initialized()):
        return ""
    meshes = sorted({f"{x.device_mesh.mesh.tolist()}{x.device_mesh.mesh_dim_names}{tuple(x.placements)}"
                     for x in example_inputs if isinstance(x, DTensor)})
    digest = hashlib.sha256(repr(meshes).encode()).hexdigest()[:16]
    return f"-rank{dist.get_rank()}of{dist.get_world_size()}-{digest}"


def mesh_text(mesh) -> str:
    """A device mesh as a text that is the same in every process of a job and its restarts: its ranks and shape,
    device type, dim names, process groups and this rank's place (two meshes of one text run the same
    collectives)."""
    what = (mesh.mesh.flatten().tolist(), tuple(mesh.mesh.shape), mesh.device_type, mesh.mesh_dim_names,
            tuple(getattr(mesh, "_dim_group_names", ())), mesh.get_coordinate())
    return f"DeviceMesh{what!r}"


def stable_mesh_keys() -> None:
    """Cache keys that hold a DeviceMesh (torch 2.13 passes a sharded step's meshes to the graph as opaque
    inputs) the same in every process. torch's cache pickler pickles a mesh with its ``__hash__`` cached in it,
    a hash of strings that differs per process, so a restarted job missed every such entry; a mesh is keyed by
    what it is instead: its ranks and shape, device type, dim names, process groups and this rank's place."""
    from torch._inductor.codecache import FxGraphCachePickler

    if getattr(FxGraphCachePickler.__init__, "_dpcompile_stable_meshes", False):
        return
    from torch.distributed.device_mesh import DeviceMesh

    def reduce_mesh(mesh):
        return str, (mesh_text(mesh),)

    original = FxGraphCachePickler.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.dispatch_table.setdefault(DeviceMesh, reduce_mesh)

    __init__._dpcompile_stable_meshes = True  # type: ignore[attr-defined]
    FxGraphCachePickler.__init__ = __init__


def _tracing() -> bool:
    """TORCH_TRACE on: torch's trace handler has a folder to write to (it is installed without one too)."""
    if os.environ.get("TORCH_TRACE"):
        return True
    try:
        from torch._logging._internal import LazyTraceHandler, trace_log

        return any(isinstance(h, LazyTraceHandler) and h.root_dir is not None for h in trace_log.handlers)
    except Exception:  # noqa: BLE001 (private API: assume tracing, which only costs the cache)
        return True


_COMMENT = re.compile(r"^\s*#.*\n", re.MULTILINE)


def record_key(partitioner_uuid: str, gm: torch.fx.GraphModule, example_inputs) -> str | None:
    """Names the record of one compile by what the AOTAutograd cache keys it by: the partitioner key, the
    Dynamo graph with its inputs' symbolic shapes, strides and devices (an unbacked batch and a fixed one
    give different graphs from the same tensors), the inputs, and Inductor's and functorch's configs. None
    when they cannot be hashed: that compile skips the cache."""
    metas = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            metas.append((type(x).__name__, str(x.dtype), str(x.device), str(tuple(x.shape)), str(x.stride()),
                          x.requires_grad))
        else:
            metas.append(repr(x))
    try:
        # without its comments: they hold the source paths of the traced code (another virtualenv, another
        # checkout), which the AOTAutograd cache's key leaves out; a hit must find its record
        graph = _COMMENT.sub("", gm.print_readable(print_output=False, include_stride=True, include_device=True))
        configs = _canonical((torch._inductor.config.save_config_portable(),
                              torch._functorch.config.save_config_portable()))
    except Exception:  # noqa: BLE001
        return None
    if " at 0x" in configs:  # an object printed by address: not the same in the next process
        return None
    return hashlib.sha256(repr((partitioner_uuid, graph, metas, configs)).encode()).hexdigest()


def _canonical(v: Any) -> str:
    """A repr that is the same in every process: dict items and set members sorted (string hashing, and so
    set order, differs per process)."""
    if isinstance(v, dict):
        return "{" + ", ".join(sorted(f"{_canonical(k)}: {_canonical(x)}" for k, x in v.items())) + "}"
    if isinstance(v, (set, frozenset)):
        return "{" + ", ".join(sorted(_canonical(x) for x in v)) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_canonical(x) for x in v) + "]"
    if isinstance(v, CustomPartitionerFn):
        return v.uuid() or "None"
    return repr(v)


def _records_dir() -> pathlib.Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(cache_dir()) / "dpcompile_records"


RECORDED = ("graphs", "ops", "counters", "summary", "noise_index_ranks")


def _plain(v: Any) -> Any:
    """v with every value that is not a plain Python one (a symbolic size, an op) as its text: what a later
    process can read back without this compile's shape environment."""
    if isinstance(v, Mapping):  # record.graphs (debug.GraphTexts) too: its snapshots printed now
        return {_plain(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    if type(v) in (int, float, str, bool, type(None)):  # exact types: a SymInt or a str subclass becomes text
        return v
    return str(v)


def save_record(key: str, record) -> None:
    """Best effort: a record that cannot be written only leaves a later hit without it."""
    try:
        folder = _records_dir()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{key}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({k: _plain(getattr(record, k)) for k in RECORDED}, f)
        os.replace(tmp, folder / f"{key}.pkl")
    except Exception:  # noqa: BLE001
        pass


def load_record(key: str, record) -> bool:
    try:
        with open(_records_dir() / f"{key}.pkl", "rb") as f:
            saved = pickle.load(f)
    except Exception:  # noqa: BLE001
        return False
    for k in RECORDED:
        setattr(record, k, saved[k])
    return True
