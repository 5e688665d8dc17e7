"""The dp passes over the AOTAutograd joint graph, in order.

Each pass is ``name_pass(gm, ctx) -> gm`` in its own module. ``PASSES`` is
the ordered list; a pass marked optional can be disabled by name through the
``disable_passes`` option. The others carry the privacy guarantee and cannot
be disabled.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch.fx as fx

from dpcompile import cacheable_dtensor_calls, gathered_copy_out

from .aligned_contractions import aligned_contractions_pass
from .batch_dims import batch_dim_analysis_pass
from .cleanup import cleanup_pass
from .clip_schedule import clip_schedule_pass
from .collective_order import collective_order_pass
from .comm_overlap import comm_overlap_pass
from .conv_backward_split import conv_backward_split_pass
from .context import DPPassContext, ParamInfo, PassOptions
from .empty_batch import empty_batch_pass
from .empty_conv_grads import empty_conv_grads_pass
from .fsdp_reshard import fsdp_reshard_pass
from .grouped_gram_norms import grouped_gram_norms_pass
from .inplace_row_masks import inplace_row_masks_pass
from .loss_reduction import loss_reduction_pass
from .mutated_input_reads import mutated_input_reads_pass
from .noise import gaussian_noise_pass
from .param_grads import param_grad_decomposition_pass
from .per_sample_norms import per_sample_norms_pass
from .scatter_reads import scatter_reads_pass
from .second_backward_gathers import second_backward_gathers_pass
from .second_backward_recompute import second_backward_recompute_pass
from .side_gradients import side_gradients_pass
from .state_updates import state_updates_pass
from .tensor_parallel import tensor_parallel_check_pass
from .unit_batch_matmuls import unit_batch_matmuls_pass
from .view_chains import view_chains_pass
from .wait_order import wait_order_pass


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[fx.GraphModule, DPPassContext], fx.GraphModule]
    optional: bool = False
    # only where Inductor compiles the graph: it rests on the fake values' strides, which Inductor's code keeps
    # and an eager run of the graph need not (a CUDA kernel may return other strides than its meta predicts)
    inductor_only: bool = False


PASSES: tuple[Pass, ...] = (
    Pass("conv_backward_split", conv_backward_split_pass),
    # before the analysis: einsum's bmm over a batch of one as an mm, whose weight gradient the rules know
    Pass("unit_batch_matmuls", unit_batch_matmuls_pass, optional=True),
    # before the analysis: a tangent of an output other than the loss (a state kept on a module) read as zeros
    Pass("side_gradients", side_gradients_pass),
    Pass("batch_dim_analysis", batch_dim_analysis_pass),
    Pass("empty_batch", empty_batch_pass),
    # privacy: what the step keeps besides gradients (buffers) holds no sample data
    Pass("state_updates", state_updates_pass),
    Pass("loss_reduction", loss_reduction_pass),
    Pass("param_grad_decomposition", param_grad_decomposition_pass),
    Pass("tensor_parallel_check", tensor_parallel_check_pass),
    Pass("per_sample_norms", per_sample_norms_pass),
    Pass("clip_schedule", clip_schedule_pass),
    Pass("gaussian_noise", gaussian_noise_pass),
    Pass("second_backward_recompute", second_backward_recompute_pass, optional=True),
    Pass("cleanup", cleanup_pass, optional=True),
    # before fsdp_reshard: a pad of a gathered weight joins its recomputed chain
    Pass("aligned_contractions", aligned_contractions_pass, optional=True),
    Pass("fsdp_reshard", fsdp_reshard_pass, optional=True),
    Pass("collective_order", collective_order_pass),
    Pass("comm_overlap", comm_overlap_pass, optional=True),
    # every collective kind's waits in the order of issue: Inductor buckets by wait order (a wrong gradient)
    Pass("wait_order", wait_order_pass),
    # last: reads of a mutated input saved, whatever the passes above placed where (pytorch/pytorch#197039)
    Pass("mutated_input_reads", mutated_input_reads_pass),
)

# on the backward graph, after the partition (which decides what the backward makes itself)
BACKWARD_PASSES: tuple[Pass, ...] = (
    # ghost with reshard_after_forward: the second backward gathers its parameters again (ZeRO-3's peak)
    Pass("second_backward_gathers", second_backward_gathers_pass, optional=True),
    # the norm rewrite's view chains as one view each: Inductor copies a chain it cannot see through (an
    # unbacked batch size), computing the value twice. After the partition: on the joint graph, a chain's
    # end read straight from a forward value makes the min-cut keep that value instead of recomputing it
    Pass("view_chains", view_chains_pass, optional=True, inductor_only=True),
    Pass("inplace_row_masks", inplace_row_masks_pass, optional=True),
    # bk's Gram norms where the last one is, one launch per signature: these steps are launch-bound
    Pass("grouped_gram_norms", grouped_gram_norms_pass, optional=True),
    # a rank with no samples: convolution weight gradients (zeros) laid out as traced
    Pass("empty_conv_grads", empty_conv_grads_pass),
    # torch 2.11, CPU: a scatter's readers after the scatter (its C++ backend fused them ahead of it)
    Pass("scatter_reads", scatter_reads_pass, inductor_only=True),
    # again after the partition and the passes above, which place nodes of their own
    Pass("backward_wait_order", wait_order_pass),
)


# rewrites outside the joint graph, not FX passes of the lists above, but optional and disabled by name the same
# way: one inside Inductor's compile, as its post-grad custom pass (dpcompile.backend's codegen patches), and one
# of dynamo's graph before AOTAutograd's cache sees it (torch 2.11's DTensor calls)
INDUCTOR_PASS_NAMES: tuple[str, ...] = (gathered_copy_out.NAME, cacheable_dtensor_calls.NAME)


def check_disable_passes(names) -> None:
    by_name = {p.name: p for p in PASSES + BACKWARD_PASSES}
    optional = [p.name for p in PASSES + BACKWARD_PASSES if p.optional] + list(INDUCTOR_PASS_NAMES)
    for n in names:
        if n in INDUCTOR_PASS_NAMES:
            continue
        if n not in by_name:
            raise ValueError(
                f"disable_passes: unknown pass {n!r}; passes are {list(by_name) + list(INDUCTOR_PASS_NAMES)}")
        if not by_name[n].optional:
            raise ValueError(
                f"disable_passes: pass {n!r} computes part of the DP gradient and cannot be disabled; "
                f"optional passes: {optional}"
            )


__all__ = ["PASSES", "BACKWARD_PASSES", "INDUCTOR_PASS_NAMES", "Pass", "DPPassContext", "ParamInfo", "PassOptions",
           "check_disable_passes"]
