"""fully_shard with in-graph collectives (the SimpleFSDP approach).

Parameters become DTensors sharded on dim 0 (so torch optimizers,
``state_dict`` and ``torch.distributed.checkpoint`` see them as with FSDP2).
The module reads each parameter through a property that all-gathers it with
``redistribute(Replicate).to_local(grad_placements=[Partial("sum")])``, which
dynamo traces into functional collectives: all-gathers in the forward and
reduce-scatters in the backward of the joint graph, where the dp passes can
see and move them.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from dpcompile.batching import mark_traced_batch


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """param_dtype: compute dtype of the gathered parameters (None: as stored);
    reduce_dtype: dtype of the gradient reduce-scatter (None: as stored, fp32)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32


def _gather(param: DTensor, mp: MixedPrecisionPolicy) -> torch.Tensor:
    mesh = param.device_mesh
    if mesh.ndim == 1:
        full, grads = [Replicate()], [Partial("sum")]
    else:  # hybrid: replicate across groups (dim 0), shard within (dim 1)
        full, grads = [Replicate(), Replicate()], [Partial("sum"), Partial("sum")]
    return param.redistribute(
        mesh, full, forward_dtype=mp.param_dtype, backward_dtype=mp.reduce_dtype
    ).to_local(grad_placements=grads)


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    def make(name):
        def get(self):
            p = self._parameters[name]
            if isinstance(p, DTensor):
                try:
                    # dynamo runs this for real while tracing: it makes the step's
                    # batch dim unbacked before any op of the model (dpcompile.batching)
                    mark_traced_batch()
                    return _gather(p, self._dpcompile_mp)
                except AttributeError as e:
                    # an AttributeError out of a property makes Python call nn.Module.__getattr__,
                    # which would hand the model the raw shard: fail loudly instead
                    raise RuntimeError(f"dpcompile.fully_shard: gathering {name!r} failed: {e}") from e
            return p

        return property(get)

    attrs = {n: make(n) for n in names}
    attrs["_dpcompile_sharded_names"] = names
    return type(f"DPSharded{cls.__name__}", (cls,), attrs)


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shards the parameters of ``module`` not yet sharded (apply to blocks, then the root).

    reshard_after_forward=True frees the gathered parameters after the
    forward and gathers again in the backward (ZeRO-3); False keeps them
    (ZeRO-2). A 2-D mesh shards within dim 1 and replicates across dim 0.
    """
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard needs a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard supports 1-D (FSDP) and 2-D (HSDP) meshes, got {mesh.ndim}-D")
    mp = mp_policy or MixedPrecisionPolicy()
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    converted: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for sub in module.modules():
        names = tuple(
            n for n, p in sub._parameters.items()
            if p is not None and not isinstance(p, DTensor)
        )
        if not names:
            continue
        for n in names:
            p = sub._parameters[n]
            if id(p) not in converted:
                dt = distribute_tensor(p.detach(), mesh, placements)
                new = nn.Parameter(dt, requires_grad=p.requires_grad)
                new._dpcompile_reshard_after_forward = reshard_after_forward  # read by the backend
                converted[id(p)] = new
            sub._parameters[n] = converted[id(p)]
        already = getattr(sub, "_dpcompile_sharded_names", ())
        base = sub.__class__.__bases__[0] if already else sub.__class__
        sub.__class__ = _sharded_class(base, tuple(dict.fromkeys(already + names)))
        sub._dpcompile_mp = mp
    module._dpcompile_mesh = mesh
    return module


__all__ = ["fully_shard", "MixedPrecisionPolicy"]
