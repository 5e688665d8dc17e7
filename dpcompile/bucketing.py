"""Bucketed collectives: Inductor's FX bucketing over the in-graph collectives.

fully_shard issues one all-gather and one reduce-scatter per parameter. On
GPUs each costs 110-150 us of CPU time to issue and a synchronisation of all
ranks, so a sharded step is latency-bound at small per-GPU work
(BENCHMARKS.md: 298 collectives for GPT-2-small, 10 ms of compute in a
98 ms step at 4 GPUs). The collectives are ordinary nodes of the graphs
Inductor compiles, for the non-private step (backend "inductor") and the
dp_fsdp graphs alike, so Inductor's post-grad bucketing merges neighbouring
ones into one collective per bucket. It runs after the dp rewrite: a merged
reduce-scatter reads the clipped gradients it merges, so it cannot move
before the clip coefficients exist.

The setting is global to Inductor, so a benchmark that turns it on compares
a bucketed non-private step with a bucketed private one.

``fully_shard`` turns it on (``DEFAULT_BUCKET_MB``, with overlap) unless the
user chose: a call of ``bucket_collectives`` (``None`` included) or
Inductor's bucketing or reordering set by hand stand. Measured on two H200s
(BENCHMARKS.md), GPT-2-small bf16 at 8x1024 per rank: the non-private
step 52.6 -> 31.2 ms, the bk step 90.7 -> 45.2 ms.
"""
from __future__ import annotations

import dataclasses
import logging
import math

from dpcompile.config import _is_real

DEFAULT_BUCKET_MB = 64.0  # fully_shard's default cap: GPT-2-small's blocks gather in 2-3 buckets each

# who last set Inductor's bucketing through this module: "user" (a bucket_collectives call, which fully_shard's
# default leaves alone) or "default" (fully_shard's default); None: neither
_SET_BY: list[str | None] = [None]
_KINDS = ("all_gathers", "reduce_scatters", "all_reduces")  # Inductor's bucket_<kind>_fx settings
_OFF = {**{f"bucket_{kind}_fx": "none" for kind in _KINDS}, "reorder_for_compute_comm_overlap": False}


@dataclasses.dataclass(frozen=True)
class _BucketCap:
    """Inductor's per-bucket size callback: the same cap (MiB) for every bucket; picklable for its cache key."""

    mb: float

    def __call__(self, bucket_id: int) -> float:
        return self.mb


def bucket_collectives(bucket_mb: float | None = 64.0, *, overlap: bool = False) -> None:
    """Merge the in-graph all-gathers, reduce-scatters and all-reduces of every graph compiled from now on
    into buckets of at most ``bucket_mb`` MiB each; ``None`` turns bucketing off again.

    A bucket's all-gather runs before the first parameter in it is needed and
    keeps every parameter in it gathered until its last use, so a larger cap
    means fewer collectives and more memory held. ``overlap=True`` also turns
    on Inductor's compute/communication reordering (collectives issued
    earlier, waits sunk to the first use), so a gather can run under the
    previous layer's compute. Graphs compiled before the call keep their
    collectives (``torch._dynamo.reset()`` recompiles).

    ``dpcompile.fully_shard`` turns on ``bucket_collectives(64, overlap=True)``
    when nothing was chosen; a call of this function, before or after it, is
    the choice that stands (``None``: unbucketed).
    """
    if not isinstance(overlap, bool):
        raise ValueError(f"bucket_collectives: overlap must be True or False, got {overlap!r}")
    if bucket_mb is not None and not (_is_real(bucket_mb) and 0 < bucket_mb < math.inf):
        raise ValueError(f"bucket_collectives: bucket_mb must be a positive number of MiB or None, got {bucket_mb!r}")
    _SET_BY[0] = "user"
    _set(bucket_mb, overlap)


def default_bucketing() -> bool:
    """fully_shard's default: bucketed collectives with overlap, unless bucket_collectives was called or
    Inductor's bucketing or compute/communication reordering was configured otherwise. Whether it set them."""
    from torch._inductor import config

    if _SET_BY[0] == "user" or config.reorder_for_compute_comm_overlap or _bucketed(config):
        return False
    _set(DEFAULT_BUCKET_MB, True)
    _SET_BY[0] = "default"
    logging.getLogger("dpcompile").info(
        "fully_shard: Inductor's collective bucketing (%g MiB buckets) and compute/communication reordering are on "
        "for every graph compiled from now on; dpcompile.bucket_collectives(None) turns them off", DEFAULT_BUCKET_MB)
    return True


def _set(bucket_mb: float | None, overlap: bool) -> None:
    from torch._inductor import config

    if bucket_mb is None:
        for key, value in _OFF.items():
            setattr(config, key, value)
        return
    cap = _BucketCap(float(bucket_mb))
    for kind in _KINDS:
        setattr(config, f"bucket_{kind}_fx", "all")
        setattr(config, f"bucket_{kind}_fx_bucket_size_determinator", cap)
    config.reorder_for_compute_comm_overlap = overlap


def cpp_wrapper_patches(*, collectives: bool) -> dict:
    """Inductor settings for a step compiled with the C++ wrapper (``cpp_wrapper=True``).

    torch 2.11's C++ wrapper crashes the process (SIGSEGV, in the generated
    forward) running bucketed collectives: measured on 2 gloo ranks, buckets
    with and without reordering; unbucketed the same step runs exact. (torch
    2.13 refuses sharded steps under the C++ wrapper before this matters:
    their device meshes are graph inputs it cannot take.) So a step with
    collectives compiles unbucketed when the bucketing is fully_shard's
    default, and is refused when the user chose it, rather than crash.
    """
    from torch._inductor import config

    if not collectives or not _bucketed(config):
        return {}
    if _SET_BY[0] != "default":
        from dpcompile.errors import DPCompileError

        raise DPCompileError(
            "cpp_wrapper=True with bucketed collectives: Inductor's C++ wrapper crashes the process (segmentation "
            "fault) running them on this torch. Call dpcompile.bucket_collectives(None) before compiling, or drop "
            "cpp_wrapper (cudagraphs=True also removes the per-kernel host cost).")
    logging.getLogger("dpcompile").info(
        "cpp_wrapper=True: this step's collectives are compiled unbucketed (Inductor's C++ wrapper crashes running "
        "bucketed ones); fully_shard's bucketing stays on for other steps")
    return dict(_OFF)


def _bucketed(config) -> bool:
    """Inductor buckets some kind of collective."""
    return any(getattr(config, f"bucket_{kind}_fx") != "none" for kind in _KINDS)


def repair_each_bucket_user_once() -> None:
    """Inductor's FX bucketing (torch 2.13) re-runs the fake kernels of a merged bucket's users to repair their
    metadata, starting from the users of every wait it replaced, one entry per wait. A node that reads many
    results of one bucket is then re-run once per result: dp_fsdp's noise op reads every gradient, so each
    reduce-scatter bucket re-ran it once per gradient in it, quadratic in the parameters (GPT-2-small ghost,
    sharded on CPU: 367 runs, 2.15 s of its compile; 0.17 s with each user once). Each user once gives the same
    metadata: the repair queues a user again itself when one of its inputs changes after it ran. Nothing on a
    torch without the repair (2.11)."""
    from torch._inductor.fx_passes import bucketing as inductor_bucketing

    from dpcompile.compat import wrap_method_once

    def wrap(original):
        def repair(start_users, *args, **kwargs):
            return original(list(dict.fromkeys(start_users)), *args, **kwargs)
        return repair

    wrap_method_once(inductor_bucketing, "_recompute_changed_user_metadata", wrap)
