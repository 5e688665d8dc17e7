"""Tensor parallelism (torch's ``parallelize_module``) on a 1-D mesh: which parameters are shards, which replicas.

Every rank of the tensor-parallel (tp) group runs the same batch. A
parameter sharded by ColwiseParallel / RowwiseParallel (a DTensor with
placement ``Shard(d)``) gets on each rank the per-sample gradient of its own
slice: squared norms add over the group. Every other trainable parameter (a
``Replicate`` DTensor such as a RowwiseParallel bias, or a plain tensor: norms,
embeddings, heads) is the same on every rank and gets the whole per-sample
gradient there: counted once. The dp passes check both claims on the graph
(passes/tensor_parallel.py) and refuse what they cannot prove.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dpcompile.errors import DPCompileError


@dataclasses.dataclass(frozen=True)
class TPMesh:
    group: str  # the process group's name: the graph's collectives name it
    rank: int  # this rank's coordinate on the tp mesh


def is_tp_dtensor(t: Any) -> bool:
    """A DTensor parameter that dpcompile.fully_shard did not make."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and not hasattr(t, "_dpcompile_reshard_after_forward")


def tp_placement(t: Any) -> str:
    """"shard" or "replicate" for a supported tensor-parallel parameter; "" for one dpcompile cannot take
    (another mesh shape or placement: the caller refuses it by name)."""
    from torch.distributed.tensor import Replicate, Shard

    if t.device_mesh.ndim != 1 or len(t.placements) != 1:
        return ""
    (p,) = t.placements
    if type(p) is Shard:
        return "shard"
    if type(p) is Replicate:
        return "replicate"
    return ""


def distinct_meshes(params: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """(first parameter's name, mesh) for each device mesh of the DTensor parameters, compared by value:
    equal meshes built twice (or copied by tracing) are one mesh."""
    meshes: list[tuple[str, Any]] = []
    for name, t in params:
        if not any(t.device_mesh == m for _, m in meshes):
            meshes.append((name, t.device_mesh))
    return meshes


def tp_mesh(params: list[tuple[str, Any]]) -> TPMesh:
    """The one 1-D mesh every tensor-parallel parameter lives on."""
    meshes = distinct_meshes(params)
    if len(meshes) > 1:
        desc = "; ".join(f"{n} on {m}" for n, m in meshes)
        raise DPCompileError(f"dp_fsdp: tensor-parallel parameters live on different device meshes ({desc}); "
                             f"parallelize the model over one tensor-parallel mesh")
    mesh = meshes[0][1]
    return TPMesh(group=mesh.get_group().group_name, rank=mesh.get_local_rank())


def allow_dtensor_gradients_in_dynamo() -> None:
    """Dynamo, running the graph-broken backward (``loss.backward()`` inside the compiled step), compiles
    ``DTensor.__tensor_unflatten__`` as a frame of its own once per gradient layout; by the third layout
    automatic dynamic shapes turn a Shard's dim into a SymInt and tracing fails ("SymNodeVariable() is not
    a constant", also with stock backends and static shapes). It only rebuilds a DTensor from its local
    tensor: run it eagerly. Idempotent; ``torch._dynamo.reset()`` keeps it."""
    from torch.distributed.tensor import DTensor

    torch._dynamo.eval_frame.skip_code(DTensor.__tensor_unflatten__.__code__)
