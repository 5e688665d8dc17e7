"""dpcompile: differentially private training inside torch.compile.

    step = torch.compile(train_step, backend="dp_fsdp",
                         options={"max_grad_norm": 1.0, "noise_multiplier": 1.1,
                                  "expected_batch_size": 256})

or ``@dpcompile.private_step(max_grad_norm=1.0, ...)``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

def _locate_passes() -> None:
    # The passes live in the top-level folder passes/ and install as
    # dpcompile.passes (pyproject package-dir). Running from a source checkout
    # without installing, import them from that folder under the same name.
    import importlib.util
    import os
    import sys

    if "dpcompile.passes" in sys.modules or importlib.util.find_spec("dpcompile.passes") is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes")
    spec = importlib.util.spec_from_file_location(
        "dpcompile.passes", os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["dpcompile.passes"] = module
    spec.loader.exec_module(module)
    setattr(sys.modules[__name__], "passes", module)


_locate_passes()

from dpcompile.accounting import PrivacyAccountant, noise_multiplier_for  # noqa: E402
from dpcompile.accumulation import accumulate  # noqa: E402
from dpcompile.batching import mark_batch  # noqa: E402
from dpcompile.checkpoint import Checkpointer  # noqa: E402
from dpcompile.bucketing import bucket_collectives, repair_each_bucket_user_once  # noqa: E402
from dpcompile.backend import CompiledStep, DPBackend, dp_fsdp, get_backend  # noqa: E402
from dpcompile import cpp_size_questions  # noqa: E402
from dpcompile.compat import (conv_backward_layout_as_input, flex_backward_takes_unbacked_batch,  # noqa: E402
                              dynamo_config_logging_takes_functions,
                              flex_dense_takes_an_empty_batch,
                              integer_equalities_decided,
                              conv_layout_of_an_unbacked_batch, size_oblivious_channels_last,
                              size_oblivious_global_avg_pool,
                              size_oblivious_log_sigmoid_backward, size_oblivious_logsumexp,
                              size_oblivious_solve_triangular, size_oblivious_cummaxmin,
                              size_oblivious_lu_solve, size_oblivious_cdist_backward, size_oblivious_cdist_mode,
                              size_oblivious_nll_loss_nd,
                              size_oblivious_norm_batch_check, size_oblivious_one_hot,
                              size_oblivious_prob_cross_entropy, multilabel_margin_loss_stops_at_the_first_negative,
                              gaussian_nll_loss_checks_in_graph,
                              size_oblivious_repeat, size_oblivious_reshape,
                              size_oblivious_cumsum, size_oblivious_fft, size_oblivious_roll,
                              size_oblivious_sdpa, size_oblivious_affine_grid,
                              uniform_fold_skips_unbacked_guards)
from dpcompile.config import DPConfig  # noqa: E402
from dpcompile.step_split import remember_graph_breaks  # noqa: E402
from dpcompile.step_frames import compile_dp_frames_strictly  # noqa: E402
from dpcompile.recurrent import lstm_cells_in_dp_steps  # noqa: E402
from dpcompile.instance_norm import instance_norm_per_sample_in_dp_steps  # noqa: E402
from dpcompile.einsum_path import einsum_path_from_hints  # noqa: E402
from dpcompile.ctc_loss import trace_ctc_loss_as_one_op  # noqa: E402
from dpcompile.debug import dump_graphs  # noqa: E402
from dpcompile.eager_guard import RECOMPILE_LIMIT, non_private  # noqa: E402
from dpcompile.errors import DPCompileError  # noqa: E402
from dpcompile.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from dpcompile.sampling import PoissonBatchSampler  # noqa: E402

trace_ctc_loss_as_one_op()  # F.ctc_loss in a traced step: before dynamo traces one (dpcompile/ctc_loss.py)

__all__ = [
    "DPBackend", "DPCompileError", "MixedPrecisionPolicy", "fully_shard", "DPConfig", "CompiledStep", "dump_graphs",
    "get_backend", "mark_batch", "private_step", "dp_fsdp", "bucket_collectives", "PrivacyAccountant",
    "noise_multiplier_for", "accumulate", "non_private", "Checkpointer",
    "PoissonBatchSampler",
]


_MODES = {"default": {}, "reduce-overhead": {"cudagraphs": True}}
def private_step(fn: Callable | None = None, *, mode: str | None = None, **options: Any):
    """Decorator: ``@private_step(max_grad_norm=..., noise_multiplier=..., ...)``.

    The same as ``torch.compile(fn, backend="dp_fsdp", options=options)``; the
    returned function has ``.dp_backend`` (the DPBackend, with the compiled
    graphs and the noise state for checkpoints). ``mode`` as for
    ``torch.compile``: "default", or "reduce-overhead" (CUDA graphs: the
    option ``cudagraphs=True``). torch.compile itself takes ``mode`` or
    ``options``, never both, so with ``backend="dp_fsdp"`` the options say it.
    """
    if mode is not None:
        if mode not in _MODES:
            raise ValueError(f"private_step: mode must be one of {sorted(_MODES)}, got {mode!r} "
                             f"(Inductor's max-autotune modes are not offered for DP steps)")
        for key, value in _MODES[mode].items():
            if options.setdefault(key, value) != value:
                raise ValueError(f"private_step: mode={mode!r} means {key}={value!r}, but {key}={options[key]!r} "
                                 f"was given; drop one of them")
    backend = get_backend(options)

    def wrap(f: Callable) -> Callable:
        compiled = torch.compile(f, backend=backend)

        @functools.wraps(f)
        def step(*args, **kwargs):
            before = backend.calls
            out = compiled(*args, **kwargs)  # dynamo's settings for DP steps: step_frames, for both forms
            if torch.is_grad_enabled() and backend.calls == before:
                raise DPCompileError(
                    f"the step {getattr(f, '__name__', f)!r} ran without a dp_fsdp graph (did dynamo skip or "
                    f"fall back on the frame?); its gradients would not be private. Run with "
                    f"TORCH_LOGS=graph_breaks to see why."
                )
            return out

        step.dp_backend = backend  # type: ignore[attr-defined]
        return step

    return wrap(fn) if fn is not None else wrap


def _register_if_missing() -> None:
    # With `pip install` the entry point (group torch_dynamo_backends) makes
    # dynamo import us on first use of "dp_fsdp" and register the name itself;
    # registering here too would be a duplicate. From a plain source checkout
    # there is no entry point, so register directly.
    from importlib.metadata import entry_points

    from torch._dynamo.backends import registry

    if any(ep.name == "dp_fsdp" for ep in entry_points(group="torch_dynamo_backends")):
        return
    if "dp_fsdp" not in registry.list_backends(exclude_tags=()):
        try:
            registry.register_backend(dp_fsdp, "dp_fsdp")
        except AssertionError:  # registered meanwhile (duplicate name)
            pass


_register_if_missing()
size_oblivious_nll_loss_nd()  # see dpcompile.compat
size_oblivious_sdpa()
size_oblivious_global_avg_pool()
size_oblivious_reshape()
size_oblivious_norm_batch_check()
size_oblivious_repeat()
size_oblivious_cumsum()
size_oblivious_roll()
size_oblivious_fft()
size_oblivious_affine_grid()
remember_graph_breaks()
compile_dp_frames_strictly()  # a DP step's frame never runs as plain Python (dpcompile/step_frames.py)
lstm_cells_in_dp_steps()  # a first-layer nn.LSTM as cells, not mkldnn's opaque op (dpcompile/recurrent.py)
instance_norm_per_sample_in_dp_steps()  # instance_norm as group_norm: any batch size (dpcompile/instance_norm.py)
einsum_path_from_hints()  # einsum of 3+ operands with an unbacked batch (dpcompile/einsum_path.py)
size_oblivious_one_hot()
size_oblivious_log_sigmoid_backward()
size_oblivious_logsumexp()
size_oblivious_solve_triangular()
size_oblivious_cummaxmin()
size_oblivious_lu_solve()
size_oblivious_cdist_backward()
size_oblivious_cdist_mode()
size_oblivious_prob_cross_entropy()
multilabel_margin_loss_stops_at_the_first_negative()
gaussian_nll_loss_checks_in_graph()
size_oblivious_channels_last()
conv_layout_of_an_unbacked_batch()  # a convolution's fake output laid out as its kernel's
conv_backward_layout_as_input()
uniform_fold_skips_unbacked_guards()
cpp_size_questions.install()  # C++'s questions of an unbacked size (dpcompile/cpp_size_questions.py)
dynamo_config_logging_takes_functions()
integer_equalities_decided()
flex_backward_takes_unbacked_batch()
flex_dense_takes_an_empty_batch()
repair_each_bucket_user_once()  # a bucket's users re-run once each, not once per wait
