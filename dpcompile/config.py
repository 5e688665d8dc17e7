"""The validated options of the dp_fsdp backend."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

SCHEDULES = ("bk", "ghost", "auto")
LINEAR_NORM_ALGORITHMS = ("auto", "ghost", "direct")
CONV_NORM_ALGORITHMS = LINEAR_NORM_ALGORITHMS + ("input_gram",)
COMPILERS = ("inductor", "eager")


@dataclasses.dataclass(frozen=True)
class DPConfig:
    """Options of ``torch.compile(step, backend="dp_fsdp", options={...})``.

    max_grad_norm: C, the flat per-sample clipping bound over all trainable
        parameters.
    noise_multiplier: s; each gradient coordinate gets N(0, s^2 C^2) noise
        (before the 1/expected_batch_size scaling of a mean loss).
    expected_batch_size: the batch size the 1/B of a mean loss is replaced by
        (Opacus's convention). Required when the loss is a mean over the batch.
    schedule: "bk" (one backward, weight-gradient contractions deferred until
        the clip coefficients are known), "ghost" (norm-only first backward,
        then a second with per-sample scaled tangents) or "auto" (bk for every
        contraction whose deferred operands fit ``memory_budget`` bytes,
        recompute the rest).
    seed: seeds the noise generator; None draws a fresh seed from the OS.
    dump_dir: write readable graph dumps and a summary per compile here.
    batch_dim: which dim of each data input (a tensor argument of the step
        that is not a parameter or buffer) holds the samples. An int applies
        to all; a mapping from argument name to dim (or None for "not
        batched") overrides single inputs; unnamed ones keep dim 0.
    disable_passes: names of optional passes to skip (see dpcompile.passes).
    norm_eps: c_i = min(1, C / (||g_i|| + norm_eps)).
    memory_budget: bytes of deferred output gradients "auto" may keep.
    linear_norm: per-sample norm algorithm for contractions with several
        rows per sample: "auto" picks ghost or direct per layer by cost.
    conv_norm: per-sample norm algorithm for convolution weights: "ghost"
        (Gram matrices over a sample's positions, ~S^2 (channels) per
        sample), "direct" (the per-sample gradient, ~S |weight|),
        "input_gram" (the ghost norm from the Gram of the padded input over its
        own positions, its kernel windows summed: no unfold) or "auto" (the
        cheapest per layer; the dump summary says which and why).
    compiler: "inductor" (generated kernels) or "eager": the same forward and
        backward graphs (Inductor's decompositions and joint-graph passes,
        dpcompile's passes, the partitioner) run op by op, without Inductor's
        post-grad passes and code generation. Tells a wrong result of
        Inductor's code generation from one of dpcompile's rewrite (as
        backend="aot_eager_decomp_partition" does for stock torch.compile),
        and compiles in a fraction of the time (CPU tests).
    cudagraphs: run the compiled forward and backward (noise included) as
        CUDA graphs, as ``mode="reduce-overhead"`` does for stock
        torch.compile: one launch per graph instead of one per kernel, for
        small, launch-bound steps. As there, the step's outputs live in the
        graphs' memory until the next step; gradients left in ``.grad`` across
        steps (``dpcompile.accumulate()``, ``zero_grad(set_to_none=False)``)
        are copied out before the next step runs. CUDA only; needs
        ``compiler="inductor"``.
    cpp_wrapper: Inductor's C++ wrapper for the compiled forward and backward
        (``torch._inductor.config.cpp_wrapper``): the host code that allocates
        buffers and launches kernels is compiled C++ rather than Python, for
        launch-bound steps, at the cost of a C++ compile per graph. Needs
        ``compiler="inductor"``. (Setting Inductor's global
        ``cpp_wrapper`` works too.)
    pause_gc: hold off Python's full garbage collections while dynamo
        traces the step and dp_fsdp compiles it (and while AOTAutograd
        compiles a backward at the first backward): each walks every object
        of the process, and a large compile makes millions (a GPT-2-small
        ghost step compiled sharded on CPU: 16 full collections, 4.9 s;
        held, 7, 2.2 s). Young collections run as usual. On by default;
        False leaves the collector as it is.
    """

    max_grad_norm: float
    noise_multiplier: float
    expected_batch_size: int | None = None
    schedule: str = "bk"
    seed: int | None = None
    dump_dir: str | None = None
    batch_dim: int | Mapping[str, int | None] = 0
    disable_passes: tuple[str, ...] = ()
    norm_eps: float = 1e-6
    memory_budget: int = 1 << 30
    linear_norm: str = "auto"
    conv_norm: str = "auto"
    compiler: str = "inductor"
    cudagraphs: bool = False
    cpp_wrapper: bool = False
    pause_gc: bool = True

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"dp_fsdp option {msg}")

        if not _is_real(self.max_grad_norm) or not (0 < self.max_grad_norm < math.inf):
            bad(f"max_grad_norm must be a positive finite number, got {self.max_grad_norm!r}")
        if not _is_real(self.noise_multiplier) or not (0 <= self.noise_multiplier < math.inf):
            bad(f"noise_multiplier must be a finite number >= 0, got {self.noise_multiplier!r}")
        if self.expected_batch_size is not None and (
            not _is_real(self.expected_batch_size)
            or not math.isfinite(self.expected_batch_size)
            or self.expected_batch_size <= 0
        ):
            # a real number: sample_rate * dataset size (PoissonBatchSampler.expected_batch_size) need not be whole
            bad(f"expected_batch_size must be a positive number, got {self.expected_batch_size!r}")
        if self.schedule not in SCHEDULES:
            bad(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.linear_norm not in LINEAR_NORM_ALGORITHMS:
            bad(f"linear_norm must be one of {LINEAR_NORM_ALGORITHMS}, got {self.linear_norm!r}")
        if self.conv_norm not in CONV_NORM_ALGORITHMS:
            bad(f"conv_norm must be one of {CONV_NORM_ALGORITHMS}, got {self.conv_norm!r}")
        if self.compiler not in COMPILERS:
            bad(f"compiler must be one of {COMPILERS}, got {self.compiler!r}")
        if not isinstance(self.cudagraphs, bool):
            bad(f"cudagraphs must be True or False, got {self.cudagraphs!r}")
        if self.cudagraphs and self.compiler != "inductor":
            bad(f"cudagraphs=True needs compiler='inductor' (CUDA graphs capture Inductor's kernels), "
                f"got compiler={self.compiler!r}")
        if not isinstance(self.cpp_wrapper, bool):
            bad(f"cpp_wrapper must be True or False, got {self.cpp_wrapper!r}")
        if self.cpp_wrapper and self.compiler != "inductor":
            bad(f"cpp_wrapper=True needs compiler='inductor' (it is how Inductor's code launches its kernels), "
                f"got compiler={self.compiler!r}")
        if not isinstance(self.pause_gc, bool):
            bad(f"pause_gc must be True or False, got {self.pause_gc!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an int or None, got {self.seed!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            object.__setattr__(self, "dump_dir", str(self.dump_dir))
        if isinstance(self.batch_dim, Mapping):
            for k, v in self.batch_dim.items():
                if not isinstance(k, str) or not (v is None or (isinstance(v, int) and not isinstance(v, bool))):
                    bad(f"batch_dim must map argument names to an int dim or None, got {k!r}: {v!r}")
            # frozen + hashable: keep a sorted tuple of pairs
            object.__setattr__(self, "batch_dim", tuple(sorted(self.batch_dim.items())))
        elif isinstance(self.batch_dim, tuple):
            pass  # already normalised (replace() of a normalised config)
        elif isinstance(self.batch_dim, bool) or not isinstance(self.batch_dim, int):
            bad(f"batch_dim must be an int or a mapping of argument name to dim, got {self.batch_dim!r}")
        if isinstance(self.disable_passes, str):
            object.__setattr__(self, "disable_passes", (self.disable_passes,))
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
        if not _is_real(self.norm_eps) or not (0 <= self.norm_eps < math.inf):
            bad(f"norm_eps must be a finite number >= 0, got {self.norm_eps!r}")
        if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int) or self.memory_budget < 0:
            bad(f"memory_budget must be a number of bytes >= 0, got {self.memory_budget!r}")
        # Pass names are checked against the registry lazily (import cycle).
        from dpcompile.passes import check_disable_passes

        check_disable_passes(self.disable_passes)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> "DPConfig":
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown dp_fsdp option(s) {unknown}; known options are {sorted(known)}"
            )
        missing = [n for n in ("max_grad_norm", "noise_multiplier") if n not in options]
        if missing:
            raise ValueError(f"dp_fsdp needs the option(s) {missing}")
        return cls(**options)

    def batch_dim_for(self, arg_name: str) -> int | None:
        """The batch dim of the data input named ``arg_name`` (None: not batched), or of the argument, dict
        entry or attribute it lies under (``batch.ids``, ``block_mask.kv_indices``)."""
        if isinstance(self.batch_dim, int):
            return self.batch_dim
        dims = dict(self.batch_dim)
        parts = arg_name.split(".")
        for n in range(len(parts), 0, -1):  # the longest prefix named: {"mask": None} covers mask.kv_indices
            if ".".join(parts[:n]) in dims:
                return dims[".".join(parts[:n])]
        return 0


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
