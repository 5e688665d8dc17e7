"""Tensor parallelism (torch's ``parallelize_module``): which parameters are shards, which replicas.

On a 1-D tp mesh, or on the tp dim of a (dp, tp) mesh after
``dpcompile.fully_shard`` over dp (a parameter is then a 2-D DTensor and its
tp meaning is its last placement).

Every rank of the tensor-parallel (tp) group runs the same batch. What a
parameter's gradient on a rank means is its DTensor placement, which DTensor
chooses while AOTAutograd traces the backward (it need not be the
parameter's: a RowwiseParallel embedding's weight is ``Shard(0)`` and its
gradient ``Replicate``), so it is read from AOTAutograd's record of the traced
gradients (``gradient_placements``):

- ``Shard(d)``: this rank holds a disjoint slice of every sample's gradient;
  squared norms add over the group.
- ``Replicate`` (and a plain parameter): every rank holds the whole gradient;
  counted once. passes/tensor_parallel.py checks that it reads nothing one
  rank holds alone.
- ``Partial(sum)`` (a norm under SequenceParallel, a bias added to a
  sequence shard): this rank holds its tokens' part of every sample's
  gradient and the gradient is the sum over the group, so the per-sample
  gradients themselves are summed over the group before their norm (the norm
  of a sum is not the sum of norms).
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
    size: int = 1
    dp_index: int = 0  # with fully_shard over dp as well: this rank's dp shard (its samples and noise streams)

    def stream(self, kind: str) -> int:
        """The noise stream of a gradient of this kind: one per (dp shard, tp rank) for shards; replicas,
        whole on every tp rank, share their dp shard's (partial sums draw on tp rank 0 only)."""
        return self.dp_index * self.size + (self.rank if kind == "shard" else 0)


def tp_layout(t: Any) -> Any:
    """dpcompile.fully_shard's record of a tensor-parallel parameter it made 2-D (fsdp._TPLayout), or None."""
    return getattr(t, "_dpcompile_tp_layout", None)


def dp_shard_index(mesh: Any) -> int:
    """Which dp shard this rank holds on a fully_shard mesh: its place on the last (shard) dim; replicas of
    an HSDP mesh share it, so they draw the same noise."""
    return mesh.get_local_rank(mesh_dim=mesh.ndim - 1)


def is_tp_dtensor(t: Any) -> bool:
    """A DTensor parameter that dpcompile.fully_shard did not make."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and not hasattr(t, "_dpcompile_reshard_after_forward")


def tp_placement(t: Any) -> str:
    """"shard" or "replicate" for a supported tensor-parallel parameter (1-D, or made 2-D by fully_shard);
    "" for one dpcompile cannot take (another mesh shape or placement: the caller refuses it by name)."""
    layout = tp_layout(t)
    if layout is not None:
        kind = placement_kind([layout.tp_placement])
    elif t.device_mesh.ndim != 1:
        return ""
    else:
        kind = placement_kind(t.placements)
    return kind if kind in ("shard", "replicate") else ""  # a parameter is never a pending sum


def placement_kind(placements: Any) -> str:
    """"shard", "replicate" or "partial" (a sum) for a 1-D DTensor placement; "" for anything else."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if placements is None or len(placements) != 1:
        return ""
    (p,) = placements
    if type(p) is Shard:
        return "shard"
    if type(p) is Replicate:
        return "replicate"
    if type(p) is Partial and getattr(p, "reduce_op", "sum") == "sum":
        return "partial"
    return ""


def _dtensor_placements(meta: Any) -> Any:
    """The placements recorded in a DTensor's flatten metadata: (placements, tensor meta, shard order,
    requires_grad) on torch 2.13, (DTensorSpec, requires_grad) on older versions; None if neither."""
    from torch.distributed.tensor.placement_types import Placement

    if not isinstance(meta, tuple) or not meta:
        return None
    first = meta[0]
    if hasattr(first, "placements"):
        return tuple(first.placements)
    if isinstance(first, tuple) and all(isinstance(p, Placement) for p in first):
        return first
    return None


def gradient_placements() -> dict[int, Any] | None:
    """Input index -> placements of its gradient as DTensor made it while AOTAutograd traced the joint graph
    (None for a gradient that is no DTensor); None when that record cannot be found.

    AOTAutograd keeps them in the ``SubclassMeta`` it traced the joint with (``grad_input_metas``, one entry
    per input of the compiled graph) to rebuild the gradients' DTensors at run time, and hands the
    partitioner only the plain graph; the record is read from the caller's frames (the partition step holds
    it as ``maybe_subclass_meta``), which private-API churn may move: then the caller refuses what it cannot
    classify rather than guess."""
    import sys

    from torch.distributed.tensor import DTensor

    frame = sys._getframe(1)
    while frame is not None:
        meta = frame.f_locals.get("maybe_subclass_meta")
        metas = getattr(meta, "grad_input_metas", None)
        if metas is not None:
            out: dict[int, Any] = {}
            for i, m in enumerate(metas):
                sub = getattr(m, "original_subclass", None)
                is_dtensor = isinstance(sub, DTensor) or getattr(m, "type", None) is DTensor
                out[i] = _dtensor_placements(getattr(m, "meta", None)) if is_dtensor else None
            return out
        frame = frame.f_back
    return None


def distinct_meshes(params: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """(first parameter's name, mesh) for each device mesh of the DTensor parameters (or meshes), compared by
    value: equal meshes built twice (or copied by tracing) are one mesh."""
    meshes: list[tuple[str, Any]] = []
    for name, t in params:
        mesh = getattr(t, "device_mesh", t)
        if not any(mesh == m for _, m in meshes):
            meshes.append((name, mesh))
    return meshes


def tp_mesh(params: list[tuple[str, Any]]) -> TPMesh:
    """The one 1-D tp mesh every tensor-parallel parameter lives on (with fully_shard: the tp dim of their
    2-D mesh, and this rank's dp shard)."""
    layouts = [tp_layout(t) for _, t in params]
    meshes = distinct_meshes([(n, lay.tp_mesh if lay is not None else t) for (n, t), lay in zip(params, layouts)])
    if len(meshes) > 1:
        desc = "; ".join(f"{n} on {m}" for n, m in meshes)
        raise DPCompileError(f"dp_fsdp: tensor-parallel parameters live on different device meshes ({desc}); "
                             f"parallelize the model over one tensor-parallel mesh")
    mesh = meshes[0][1]
    dp = next((lay.dp_mesh for lay in layouts if lay is not None), None)
    return TPMesh(group=mesh.get_group().group_name, rank=mesh.get_local_rank(), size=mesh.size(),
                  dp_index=dp_shard_index(dp) if dp is not None else 0)


def allow_dtensor_gradients_in_dynamo() -> None:
    """Dynamo, running the graph-broken backward (``loss.backward()`` inside the compiled step), compiles
    ``DTensor.__tensor_unflatten__`` as a frame of its own once per gradient layout; by the third layout
    automatic dynamic shapes turn a Shard's dim into a SymInt and tracing fails ("SymNodeVariable() is not
    a constant", also with stock backends and static shapes). It only rebuilds a DTensor from its local
    tensor: run it eagerly. Idempotent; ``torch._dynamo.reset()`` keeps it."""
    from torch.distributed.tensor import DTensor

    torch._dynamo.eval_frame.skip_code(DTensor.__tensor_unflatten__.__code__)
