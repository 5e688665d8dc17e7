"""fully_shard with in-graph collectives (the SimpleFSDP approach).

Parameters become DTensors sharded on dim 0, or on the dim shard_placement_fn
gives (so torch optimizers, ``state_dict`` and ``torch.distributed.checkpoint``
see them as with FSDP2).
The module reads each parameter through a property that all-gathers it with
``redistribute(Replicate).to_local(grad_placements=[Partial("sum")])``, which
dynamo traces into functional collectives: all-gathers in the forward and
reduce-scatters in the backward of the joint graph, where the dp passes can
see and move them.

On a tensor-parallel model (torch's ``parallelize_module`` over a tp mesh,
then ``fully_shard`` over the dp mesh of the same device mesh), a
tensor-parallel parameter becomes a 2-D DTensor on (dp, tp): its tp-local
tensor sharded on dim 0 over dp (``_StridedShard`` where tp already shards
dim 0, as FSDP2 lays it out), so ``state_dict`` and ``full_tensor`` see the
whole parameter. Reading it gathers over dp and hands the module the 1-D tp
DTensor the plan made; its gradient is reduce-scattered over dp (and, where
DTensor made it a Partial sum over tp, all-reduced over tp first: the
backend takes that all-reduce as the sum of the tp ranks' parts).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from dpcompile.batching import mark_traced_batch
from dpcompile.bucketing import default_bucketing
from dpcompile.compat import dtensor_takes_unbacked_batch


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """As FSDP2's: param_dtype: compute dtype of the gathered parameters (None: as stored);
    reduce_dtype: dtype of the gradient reduce-scatter (None: as stored, fp32); output_dtype: the
    floating-point outputs of each sharded module's forward are cast to it (None: no cast);
    cast_forward_inputs: the floating-point tensors a sharded module's forward receives are cast to
    param_dtype first (images in fp32 into a bf16 convolution)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, torch.dtype) and v.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy({name}={v!r}): a floating-point torch.dtype or None")


def _cast_floats(tree, dtype: torch.dtype):
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _cast_inputs_hook(dtype: torch.dtype):
    def hook(module, args, kwargs):
        return _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
    return hook


def _cast_output_hook(dtype: torch.dtype):
    def hook(module, args, output):
        return _cast_floats(output, dtype)
    return hook


@dataclasses.dataclass(frozen=True)
class _TPLayout:
    """How a tensor-parallel parameter sits in its 2-D (dp, tp) DTensor: what the module reads back."""

    dp_mesh: DeviceMesh
    tp_mesh: DeviceMesh
    tp_placement: object  # the plan's placement of the parameter on the tp mesh
    tp_local_shape: torch.Size  # this tp rank's tensor, which dp shards on dim 0
    shape: torch.Size  # the whole parameter
    stride: tuple[int, ...]


def _gather_tp(param: DTensor, layout: _TPLayout, mp: MixedPrecisionPolicy) -> DTensor:
    # this rank's dp piece of its tp tensor, gathered over dp (the gradient: reduce-scattered back), then
    # the 1-D tp DTensor the module computes with; from_local's backward turns a Partial gradient into
    # the plan's placement (an all-reduce over tp in the graph)
    piece = DTensor.from_local(param.to_local(), layout.dp_mesh, [Shard(0)], run_check=False,
                               shape=layout.tp_local_shape, stride=make_contiguous_strides_for(layout.tp_local_shape))
    local = piece.redistribute(layout.dp_mesh, [Replicate()], forward_dtype=mp.param_dtype,
                               backward_dtype=mp.reduce_dtype).to_local(grad_placements=[Partial("sum")])
    return DTensor.from_local(local, layout.tp_mesh, [layout.tp_placement], run_check=False,
                              shape=layout.shape, stride=layout.stride)


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
                    layout = self._dpcompile_tp.get(name)
                    if layout is not None:
                        return _gather_tp(p, layout, self._dpcompile_mp)
                    return _gather(p, self._dpcompile_mp)
                except AttributeError as e:
                    # an AttributeError out of a property makes Python call nn.Module.__getattr__,
                    # which would hand the model the raw shard: fail loudly instead
                    raise RuntimeError(f"dpcompile.fully_shard: gathering {name!r} failed: {e}") from e
            return p

        return property(get)

    attrs = {n: make(n) for n in names}
    attrs["_dpcompile_sharded_names"] = names
    if issubclass(cls, nn.RNNBase):
        attrs.update(_RNN_ATTRS)
    return type(f"DPSharded{cls.__name__}", (cls,), attrs)


def _gathered_flat_weights(self) -> list:
    return [getattr(self, wn) if hasattr(self, wn) else None for wn in self._flat_weights_names]


# nn.LSTM, nn.GRU and nn.RNN run on a list of their weights (_flat_weights), kept by RNNBase when the weights
# are set and refreshed by a check of weak references at each forward. A sharded module's weights are
# gathered where they are read, a new tensor each time: the list read, here, gathers them (through the
# properties above), and nothing keeps it (setting it, refreshing it or flattening it for cuDNN does nothing;
# a list kept from before sharding would train the unsharded weights, outside the graph's collectives)
_RNN_ATTRS = {
    "_flat_weights": property(_gathered_flat_weights, lambda self, value: None),
    "_update_flat_weights": lambda self: None,
    "flatten_parameters": lambda self: None,
}


def _made_here(p: nn.Parameter) -> bool:
    return hasattr(p, "_dpcompile_reshard_after_forward")


def _shard_tensor_parallel(p: DTensor, mesh: DeviceMesh, name: str) -> tuple[DTensor, _TPLayout]:
    """A tensor-parallel parameter as a 2-D DTensor on (dp, tp): this rank's tp tensor sharded on dim 0
    over dp, as FSDP2 lays it out."""
    tp_mesh = p.device_mesh
    if mesh.ndim != 1 or tp_mesh.ndim != 1 or len(p.placements) != 1 or \
            type(p.placements[0]) not in (Shard, Replicate):
        raise ValueError(
            f"fully_shard: parameter '{name}' is a DTensor with placements {tuple(p.placements)} on {tp_mesh}; "
            f"dpcompile.fully_shard takes tensor-parallel parameters (parallelize_module: Shard(d) or Replicate "
            f"on a 1-D tp mesh) with a 1-D dp mesh of the same device mesh (mesh['dp'] of "
            f"init_device_mesh(..., (dp, tp), mesh_dim_names=('dp', 'tp'))); HSDP with tensor parallelism is "
            f"not supported")
    if not dtensor_takes_unbacked_batch():
        raise ValueError(
            f"fully_shard: parameter '{name}' is tensor parallel; data x tensor parallel needs torch 2.13 or later "
            f"(this is {torch.__version__}): a sharded step is compiled with an unbacked batch size (one graph "
            f"for every per-rank batch, so that every rank issues the same collectives), and this torch's "
            f"DTensor sharding propagation asks questions of that size it cannot answer (\"is the batch 1?\"). "
            f"Upgrade torch, or use tensor parallelism alone (every rank the same batch) or fully_shard alone.")
    try:
        root = DeviceMesh._concatenate([mesh, tp_mesh])
    except Exception as e:  # noqa: BLE001 - torch's message says which check failed
        raise ValueError(
            f"fully_shard: parameter '{name}' is tensor parallel on {tp_mesh}, which is not the other dim of one "
            f"device mesh with the dp mesh {mesh} ({type(e).__name__}: {e}); build both as mesh['dp'] and "
            f"mesh['tp'] of one init_device_mesh(..., (dp, tp), mesh_dim_names=('dp', 'tp'))") from e
    (tp_pl,) = p.placements
    local = p.to_local().detach()
    if local.dim() == 0:
        raise ValueError(f"fully_shard: tensor-parallel parameter '{name}' is a scalar; it cannot be sharded")
    n, k = mesh.size(), mesh.get_local_rank()
    pieces = list(torch.chunk(local, n, 0))  # DTensor's Shard(0) split: torch.chunk, empty pieces at the end
    piece = pieces[k] if k < len(pieces) else local.new_empty((0, *local.shape[1:]))
    # where tp already shards dim 0, dp shards each tp rank's rows: a strided shard of the whole
    split = tp_mesh.size() if type(tp_pl) is Shard and tp_pl.dim == 0 else 1
    dp_pl = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
    dt = DTensor.from_local(piece.clone(), root, [dp_pl, tp_pl], run_check=False, shape=p.shape, stride=p.stride())
    return dt, _TPLayout(mesh, tp_mesh, tp_pl, local.shape, p.shape, tuple(p.stride()))


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = True,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: object = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module | list[nn.Module]:
    """Shards the parameters of ``module`` not yet sharded (apply to blocks, then the root).

    The arguments mean what FSDP2's do. mesh: None, a 1-D mesh over every rank
    of the default process group (on CUDA where its backend is NCCL, else
    CPU). reshard_after_forward=True (or None) frees the gathered parameters
    after the forward and gathers again in the backward (ZeRO-3); False keeps
    them (ZeRO-2). dp_fsdp's steps honour it; a non-private step (eager, or a
    stock torch.compile) keeps what its backward reads, as with False.
    A 2-D mesh shards within dim 1 and replicates across dim 0.
    shard_placement_fn: parameter -> ``Shard(dim)`` (the dim each rank holds a
    piece of; uneven sizes are fine) or None for ``Shard(0)``. A list of
    modules is sharded as one group, as FSDP2 does.
    mp_policy: as FSDP2's, the casts of inputs and outputs included (MixedPrecisionPolicy).
    offload_policy and ignored_params: accepted for FSDP2's signature, refused unless they ask for nothing
    (no CPU offload; no parameter left out of the gradients' cross-rank sum, which the noise relies on).
    On a model parallelized over ``mesh["tp"]`` (torch's parallelize_module),
    pass ``mesh=mesh["dp"]`` of the same device mesh: the tensor-parallel
    parameters become 2-D DTensors on (dp, tp) (the module docstring).
    The first call turns on Inductor's bucketing of the graphs' collectives
    (64 MiB, overlapped with compute) unless ``dpcompile.bucket_collectives``
    was called or Inductor's bucketing was set otherwise: a sharded step is
    latency-bound without it (BENCHMARKS.md).
    """
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise ValueError(f"fully_shard: offload_policy={offload_policy!r} is not supported (the in-graph "
                         f"all-gathers read the parameters where they live); leave it out")
    if ignored_params:
        raise ValueError("fully_shard: ignored_params is not supported: an ignored parameter's gradient would not "
                         "be summed over the ranks, and each rank's noise covers only the coordinates it holds. "
                         "Freeze it (requires_grad=False) or shard it")
    if isinstance(module, (list, tuple)):
        return _shard_group(list(module), mesh=_default_mesh() if mesh is None else mesh,
                            reshard_after_forward=reshard_after_forward, shard_placement_fn=shard_placement_fn,
                            mp_policy=mp_policy)
    if mesh is None:
        mesh = _default_mesh()
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard needs a DeviceMesh (or None for one over every rank), got {type(mesh).__name__}")
    if reshard_after_forward is None:
        reshard_after_forward = True
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"fully_shard: reshard_after_forward must be True, False or None, got "
                         f"{reshard_after_forward!r} (FSDP2's int, resharding to a smaller group, is not supported)")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard supports 1-D (FSDP) and 2-D (HSDP) meshes, got {mesh.ndim}-D")
    mp = mp_policy or MixedPrecisionPolicy()
    scalars = [n for n, p in module.named_parameters() if p.dim() == 0 and not _made_here(p)]
    if scalars:
        # Shard(0) needs a dim; a replicated parameter would need noise drawn once for all ranks
        raise ValueError(
            f"fully_shard: parameter {scalars[0]!r} is a scalar (0-dim), which dpcompile cannot shard. Give it "
            f"a dim (shape [1]); for nn.utils.parametrizations.weight_norm(..., dim=None) pass dim=0, which "
            f"normalises per output row (a scalar gain per row instead of one)")
    params = [(name, p) for name, p in module.named_parameters() if not _made_here(p)]
    # tensor-parallel parameters first: a layout that cannot be taken is refused before anything changes (one an
    # earlier call sharded, in a module that shares it with this one, is reused below, not sharded again)
    tp_sharded = {id(p): _shard_tensor_parallel(p, mesh, name) for name, p in params
                  if isinstance(p, DTensor) and getattr(p, "_dpcompile_sharded_as", None) is None}
    # every other parameter's placements, shard_placement_fn asked once each, before anything changes
    placements = {}
    for name, p in params:
        if not isinstance(p, DTensor):
            placements[id(p)] = _placements(p, name, mesh, shard_placement_fn)
        elif shard_placement_fn is not None and (asked := shard_placement_fn(p)) not in (None, Shard(0)):
            raise ValueError(f"fully_shard: parameter {name!r} is tensor parallel; its data-parallel pieces are "
                             f"Shard(0) of each tensor-parallel piece, so shard_placement_fn must return None "
                             f"or Shard(0) for it, got {asked!r}")
    # parameters an earlier call sharded in a module that shares them with this one, checked before anything changes
    earlier = {id(p): e for name, p in params
               if (e := _sharded_earlier(p, name, mesh, placements.get(id(p)), reshard_after_forward)) is not None}
    converted: dict[int, tuple[nn.Parameter, _TPLayout | None]] = {}  # tied parameters stay tied
    for sub in module.modules():
        names = tuple(
            n for n, p in sub._parameters.items()
            if p is not None and not _made_here(p)
        )
        if not names:
            continue
        layouts = dict(getattr(sub, "_dpcompile_tp", {}))
        for n in names:
            p = sub._parameters[n]
            if id(p) not in converted and id(p) in earlier:
                converted[id(p)] = earlier[id(p)]  # tied to a module an earlier call sharded: the same parameter
            if id(p) not in converted:
                if id(p) in tp_sharded:
                    dt, layout = tp_sharded[id(p)]
                else:
                    dt, layout = distribute_tensor(p.detach(), mesh, placements[id(p)]), None
                new = nn.Parameter(dt, requires_grad=p.requires_grad)
                new._dpcompile_reshard_after_forward = reshard_after_forward  # read by the backend
                if layout is not None:
                    new._dpcompile_tp_layout = layout  # read by the backend: the gradient's tp meaning
                converted[id(p)] = (new, layout)
                p._dpcompile_sharded_as = converted[id(p)]  # for the modules that share it, sharded later
            sub._parameters[n], layout = converted[id(p)]
            if layout is not None:
                layouts[n] = layout
        already = getattr(sub, "_dpcompile_sharded_names", ())
        base = sub.__class__.__bases__[0] if already else sub.__class__
        sub.__class__ = _sharded_class(base, tuple(dict.fromkeys(already + names)))
        sub.__dict__.pop("_flat_weights", None)  # an RNN's list of its unsharded weights (_RNN_ATTRS)
        sub._dpcompile_mp = mp
        sub._dpcompile_tp = layouts
    if not getattr(module, "_dpcompile_mp_hooks", False):  # FSDP2's module-level casts, once per module
        if mp.cast_forward_inputs and mp.param_dtype is not None:
            module.register_forward_pre_hook(_cast_inputs_hook(mp.param_dtype), with_kwargs=True)
        if mp.output_dtype is not None:
            module.register_forward_hook(_cast_output_hook(mp.output_dtype))
        module._dpcompile_mp_hooks = True
    module._dpcompile_mesh = mesh
    _run_gradient_wrapping_eagerly()
    default_bucketing()  # bucketed, overlapped collectives unless the user chose (dpcompile.bucketing)
    return module


def _run_gradient_wrapping_eagerly() -> None:
    """AOTAutograd wraps a compiled backward's gradients into DTensors with ``DTensor.__tensor_unflatten__``,
    called from its runtime wrapper while dynamo's frame hook is still on (the step's ``loss.backward()``
    runs inside the compiled function). Dynamo then traces that function as a frame of its own (its module
    is on dynamo's inline list): a graph of nothing for a Shard(0) gradient, and on torch 2.13 an internal
    error for Shard(d), d > 0 (DTensorSpec checks its shard order with ``Shard(dim)``, a C++ class dynamo
    cannot call with a traced int). Run it as plain Python there; tracing the model still inlines it."""
    skip = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip is not None:
        skip(DTensor.__tensor_unflatten__.__code__)


def _sharded_earlier(p: nn.Parameter, name: str, mesh: DeviceMesh, want: list | None,
                     reshard_after_forward: bool) -> tuple[nn.Parameter, _TPLayout | None] | None:
    """The sharded parameter an earlier fully_shard call made of ``p``, which this module shares with a module of
    that call (Hugging Face ties a parameter across blocks by making it one object: Zamba's shared attention
    block), or None. The tie must survive: two parameters would train apart. Refused where the two calls
    disagree on how to shard it. want: this call's placements for ``p``; None for a tensor-parallel parameter,
    whose layout follows from its tensor-parallel placement and the dp mesh alone."""
    earlier = getattr(p, "_dpcompile_sharded_as", None)
    if earlier is None:
        return None
    new, layout = earlier
    dp_mesh = layout.dp_mesh if layout is not None else new.device_mesh
    got = tuple(new.placements)
    if dp_mesh != mesh or (want is not None and got != tuple(want)) or \
            new._dpcompile_reshard_after_forward != reshard_after_forward:
        asked = "its tensor-parallel layout" if want is None else f"placements {tuple(want)}"
        raise ValueError(
            f"fully_shard: parameter {name!r} is shared with a module an earlier "
            f"fully_shard call sharded on {dp_mesh} with placements {got} and reshard_after_forward="
            f"{new._dpcompile_reshard_after_forward}; this call asks for {mesh}, {asked} and "
            f"reshard_after_forward={reshard_after_forward}. A shared parameter has one layout: give both calls "
            f"the same mesh, shard_placement_fn and reshard_after_forward, or shard the modules' common parent in "
            f"one call")
    return earlier


def _default_mesh() -> DeviceMesh:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError("fully_shard: no mesh given and no default process group; call "
                         "torch.distributed.init_process_group first (torchrun sets what it needs), or pass mesh=")
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


def _placements(p: nn.Parameter, name: str, mesh: DeviceMesh, fn) -> list:
    """The parameter's placements on mesh: Shard(dim) from shard_placement_fn (None: Shard(0)); a 2-D mesh
    replicates over its dim 0."""
    shard = Shard(0) if fn is None else fn(p)
    if shard is None:
        shard = Shard(0)
    if type(shard) is not Shard:
        raise ValueError(f"fully_shard: shard_placement_fn returned {shard!r} for parameter {name!r}; it must "
                         f"return torch.distributed.tensor.Shard(dim) or None (Shard(0))")
    if not -p.dim() <= shard.dim < p.dim():
        raise ValueError(f"fully_shard: shard_placement_fn returned {shard!r} for parameter {name!r} of shape "
                         f"{tuple(p.shape)}: no such dim")
    shard = Shard(shard.dim % p.dim())
    return [shard] if mesh.ndim == 1 else [Replicate(), shard]


def _shard_group(modules: list[nn.Module], **kwargs) -> list[nn.Module]:
    """FSDP2's list form: modules that share one group of parameters. Each module's parameters not yet sharded
    are sharded (a parameter two of them share, once); the gathers are per module, as for separate calls."""
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise ValueError("fully_shard: a list of modules must be non-empty and hold only nn.Module")
    for m in modules:
        fully_shard(m, **kwargs)
    return modules


__all__ = ["fully_shard", "MixedPrecisionPolicy"]
