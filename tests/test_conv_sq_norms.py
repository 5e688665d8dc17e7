"""The per-sample conv norm kernel (dpcompile.conv_sq_norms): the Triton kernel under TRITON_INTERPRET=1, the aten
path, and the graph rewrite that calls them (counted per layer)."""
import pytest
import torch

import conv_kernel_check
import models as M
from dpcompile import conv_sq_norms
from helpers import check_against_reference, run_interpreted


def test_triton_kernel_matches_autograd_per_sample_gradients_interpreted():
    # (bf16 is not checked here: triton 3.6's interpreter loads bf16 wrongly, the GPU test checks it; fp16 takes the
    # same dot path)
    report = run_interpreted("conv_kernel_check.py")
    assert len(report["fp"]) == 2 * len(conv_kernel_check.CASES), report
    for key, err in report["fp"].items():
        assert err < (1e-5 if key.endswith("float32") else 2e-3), (key, err)  # fp16 products, fp32 sums
    assert max(report["channels_last"].values()) < 1e-5, report
    # the kept per-sample gradients (conv_weight_grads), in the kernel's column order
    assert len(report["keep"]) == 2 * len(conv_kernel_check.CASES) and max(report["keep"].values()) < 1e-5, report


def test_aten_path_matches_autograd_per_sample_gradients():
    # the squared norms come out in fp32 (as every per-sample norm does): fp64 operands are exact to its rounding
    worst = conv_kernel_check.errors(conv_sq_norms._aten, "cpu", [torch.float64, torch.float32])
    assert all(err < (2e-7 if key.endswith("float64") else 1e-5) for key, err in worst.items()), worst


def test_aten_path_keeps_the_gradients_in_the_kernels_order(monkeypatch):
    """conv_weight_grads on CPU: the kept gradients in fp64 for fp64 operands (exact), in blocks of samples too."""
    keep = lambda *a: conv_sq_norms._aten(*a, keep=True)  # noqa: E731
    worst = conv_kernel_check.errors(keep, "cpu", [torch.float64, torch.float32], keep=True)
    assert len(worst) == 4 * len(conv_kernel_check.CASES), worst
    assert all(err < (2e-7 if "float64" in key else 1e-5) for key, err in worst.items()), worst
    monkeypatch.setattr(conv_sq_norms, "CPU_BLOCK_BYTES", 1)  # one sample at a time
    assert max(conv_kernel_check.errors(keep, "cpu", [torch.float64], keep=True).values()) < 2e-7


def test_aten_path_in_blocks_of_samples(monkeypatch):
    monkeypatch.setattr(conv_sq_norms, "CPU_BLOCK_BYTES", 1)  # one sample at a time
    worst = conv_kernel_check.errors(conv_sq_norms._aten, "cpu", [torch.float64])
    assert max(worst.values()) < 2e-7, worst


def test_what_the_kernel_takes():
    assert conv_sq_norms.supported([2, 16, 4, 4], [2, 3, 8, 8], [16, 3, 3, 3], False, 1)
    assert not conv_sq_norms.supported([2, 16, 4, 4], [2, 16, 8, 8], [16, 1, 3, 3], False, 16)  # depthwise
    assert not conv_sq_norms.supported([2, 16, 4, 4], [2, 3, 8, 8], [16, 3, 3, 3], True, 1)  # transposed
    assert not conv_sq_norms.supported([2, 16, 2, 4, 4], [2, 3, 4, 8, 8], [16, 3, 2, 3, 3], False, 1)  # 3-D
    assert not conv_sq_norms.supported([2, 16, 8], [2, 3, 10], [16, 3, 3], False, 1)  # 9 columns


@pytest.mark.parametrize("schedule,compiler", [("bk", "inductor"), ("ghost", "eager")])  # eager: CI time
def test_wide_convolutions_take_the_kernel_and_match_the_oracle(schedule, compiler):
    """Layers the kernel takes (2-D strided, grouped, 1-D dilated) beside one it does not (depthwise): one kernel
    call per layer it takes, counted and said in the summary."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.dw = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
            self.c2 = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1, groups=2)
            self.c3 = torch.nn.Conv1d(32, 16, 3, dilation=2, padding=2)
            self.fc = torch.nn.Linear(16 * 16, 3)

        def forward(self, x):
            h = torch.tanh(self.c2(torch.tanh(self.dw(torch.tanh(self.c1(x))))))
            return self.fc(torch.tanh(self.c3(h.flatten(2))).flatten(1))

    backend = check_against_reference(Net(), M.mse, (torch.randn(5, 3, 8, 8),), (torch.randn(5, 3),),
                                      schedule=schedule, conv_norm="direct", compiler=compiler)
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters["conv_norm_kernels"] == 3 and rec.counters["norm_conv_direct"] == 4, rec.counters
    params = rec.summary["params"]
    assert all("in one kernel" in params[n]["why"] for n in ("c1.weight", "c2.weight", "c3.weight"))
    assert "in one kernel" not in params["dw.weight"]["why"]
