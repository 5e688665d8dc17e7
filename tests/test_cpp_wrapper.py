"""Inductor's C++ wrapper (option cpp_wrapper, or Inductor's global setting) for dp_fsdp graphs: the host code that
launches the kernels is C++, dpcompile's own norm ops (conv_weight_sq_norms, gram_sq_norms) are called from it, and
the gradients are still exact against the oracle (bk; ghost too in the extended tier)."""
import pytest
import torch
from torch._inductor.utils import run_and_get_code

import models as M
from helpers import all_cpp_wrapper_codes, check_against_reference, compile_step
from test_gram_sq_norms import SeqAndPatches
from tiers import extended


# ghost: the extended tier (tests/tiers.py). The C++ wrapper calls the same norm ops in both schedules, and ghost's
# graphs go through Inductor's Python wrapper in the default tier (CI time: 26 s)
@pytest.mark.parametrize("schedule", ["bk", pytest.param("ghost", marks=extended)])
def test_cpp_wrapper_steps_are_exact_and_call_the_norm_ops(schedule):
    torch.manual_seed(0)
    x, y = torch.randn(5, 3, 12, 12), torch.randn(5, 3)
    codes = []

    def run(*args, **kwargs):  # the generated code of the step's graphs, as Inductor writes it
        out, code = run_and_get_code(lambda: check_against_reference(*args, **kwargs))
        codes.extend(code)
        return out

    backend = run(SeqAndPatches(), M.mse, (x,), (y,), schedule=schedule, linear_norm="ghost", conv_norm="direct",
                  cpp_wrapper=True)
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters["gram_norm_kernels"] == 2 and rec.counters["conv_norm_kernels"] == 1, rec.counters
    assert all_cpp_wrapper_codes(codes), [c[:300] for c in codes]
    assert any("gram_sq_norms" in c for c in codes) and any("conv_weight_sq_norms" in c for c in codes)


def test_cpp_wrapper_needs_inductor():
    with pytest.raises(ValueError, match="cpp_wrapper=True needs compiler='inductor'"):
        compile_step(SeqAndPatches(), M.mse, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4,
                     cpp_wrapper=True, compiler="eager")


def test_cpp_wrapper_calls_the_op_that_keeps_conv_gradients():
    """bk's kept per-sample conv gradients (dpcompile::conv_weight_grads, an op of two outputs) called from the C++
    wrapper: exact against the oracle."""
    from test_convolution import KeptGradients

    torch.manual_seed(0)
    x, y = torch.randn(5, 4, 8, 8), torch.randn(5, 2)
    out, codes = run_and_get_code(lambda: check_against_reference(KeptGradients(), M.mse, (x,), (y,), schedule="bk",
                                                                  conv_norm="direct", cpp_wrapper=True))
    (rec,) = [r for r in out.compiled if r.dp]
    assert rec.counters["conv_grads_kept"] == 5, rec.counters
    assert any("conv_weight_grads" in c for c in codes) and all_cpp_wrapper_codes(codes)
