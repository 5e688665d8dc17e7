"""State the dp passes share while rewriting one joint graph."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch.fx as fx


@dataclasses.dataclass
class ParamInfo:
    """A trainable parameter as it appears in the joint graph."""

    name: str  # module path, e.g. "blocks.0.attn.qkv.weight"
    primal: fx.Node  # its placeholder
    grad_output_index: int  # position of its gradient among the joint graph's outputs
    noise_index: int  # which seed of the seeds input its noise uses
    # tensor parallel, what its gradient on this rank is (the placement DTensor gave it): "shard" (a slice:
    # squared norms add over the tp group), "replicate" (all of it: counted once) or "partial" (this rank's
    # part of a sum over the group: per-sample gradients summed before the norm); "" without tensor parallelism.
    # Starts as tp_grad; param_grads finds where the step converts the gradient in the graph (2-D fully_shard:
    # a Partial sum all-reduced over tp, a whole gradient cut to this rank's slice) and sets what it was before
    tp: str = ""
    tp_grad: str = ""  # the same for the gradient the step outputs (DTensor's placement): what its noise is
    shape: tuple = ()  # the whole parameter's (under sharding: not its placeholder's)


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """The user's options that the passes read, as plain values (the backend takes them from its DPConfig,
    which validated them): the passes do not depend on the config class."""

    max_grad_norm: float
    noise_multiplier: float
    expected_batch_size: int | None  # None: a summed loss (no batch size to divide by)
    schedule: str  # "bk", "ghost" or "auto"
    memory_budget: int  # bytes of deferred operands "auto" may keep
    linear_norm: str  # how contractions' per-sample norms are computed ("auto" picks per layer)
    conv_norm: str  # the same for convolutions
    norm_eps: float  # added to the per-sample norm before dividing by it

    @classmethod
    def of(cls, config) -> "PassOptions":
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class DPPassContext:
    options: PassOptions
    params: list[ParamInfo]
    data_inputs: dict[fx.Node, tuple[str, int | None]]  # placeholder -> (arg name, batch dim)
    seeds_input_index: int | None  # primal index of the noise seeds input
    num_fwd_outputs: int
    compile_id: str = "0"
    sharded: bool = False  # parameters are fully_shard DTensors: collectives in the graph
    reshard_primals: set = dataclasses.field(default_factory=set)  # params gathered again in the backward
    rank: int = 0
    split_step: Any = None  # dpcompile.step_split.Split: where dynamo split the step before its loss
    compile_reason: str = ""  # dynamo's reason for ending the graph there (for error messages)
    dropped_grad_index: int | None = None  # joint output slot: the dropped-sample count (its input's gradient)
    noise_gate_input_index: int | None = None  # placeholder index of the 0/1 noise factor (dpcompile.accumulate)
    tp_group: str | None = None  # tensor parallel: the group's name (its collectives in the graph name it)
    tp_rank: int = 0  # this rank's coordinate in the tp group
    tp_size: int = 1
    tp_local_primals: set = dataclasses.field(default_factory=set)  # placeholders that differ across the group
    # placeholders of state the step keeps past itself (parameters, buffers, captured tensors): (kind, name)
    state_inputs: dict[fx.Node, tuple[str, str]] = dataclasses.field(default_factory=dict)
    # filled by the passes -------------------------------------------------
    batch_size: Any = None
    states: dict[fx.Node, Any] = dataclasses.field(default_factory=dict)
    tangent_dependent: set[fx.Node] = dataclasses.field(default_factory=set)
    loss: Any = None  # passes.loss_reduction.LossInfo
    # incoming gradients of outputs other than the loss, compiled as zeros (passes.side_gradients)
    side_tangents: list[fx.Node] = dataclasses.field(default_factory=list)
    # a sum of per-sample losses divided by a count of samples (F.cross_entropy's default mean: the targets
    # that are not ignore_index): the division -> the count (BatchDimAnalysis._sample_count_mean)
    sample_count_means: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)
    # a sum over the samples divided by the batch size (F.kl_div's reduction="batchmean"): a mean
    # (BatchDimAnalysis._batch_size_mean)
    batch_size_means: set[fx.Node] = dataclasses.field(default_factory=set)
    decompositions: dict[str, Any] = dataclasses.field(default_factory=dict)  # param name -> ParamGrad
    scale_rows: fx.Node | None = None  # r = c * M * k, shape [B]
    clip_coef: fx.Node | None = None
    keep_rows: fx.Node | None = None  # bool, shape of r: the sample's gradient is finite (else it is dropped)
    per_sample_norms: fx.Node | None = None
    # per-sample gradients the norm pass keeps as [B, N] rows (per_sample_norms): summed parameters' stacked in
    # one fp32 buffer, a convolution weight's from its norm kernel (conv_weight_grads). contribution -> (that
    # buffer, the index of its columns among the buffer's gradients', their widths, and None or (shape,
    # permutation) that turns a row into the gradient's shape: conv_sq_norms.weight_order)
    sample_rows: dict[Any, tuple[fx.Node, int, list[int], Any]] = dataclasses.field(default_factory=dict)
    contributions: dict[fx.Node, Any] = dataclasses.field(default_factory=dict)
    analysis: Any = None
    backward_nodes: list[fx.Node] = dataclasses.field(default_factory=list)  # original backward, in order
    second_backward: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)  # ghost: original -> copy
    whole_gradient_mode: bool = False  # B <= 1: the per-sample gradient is the gradient
    empty_batch: bool = False  # B == 0: zero gradient + noise
    counters: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def param_by_primal(self) -> dict[fx.Node, ParamInfo]:
        return {p.primal: p for p in self.params}
