"""torch's associative_scan as the higher-order op in the graph (what combine_mode="pointwise" leaves there on CUDA;
called directly here, which runs on the CPU too): one tensor's scan is exact per sample, and a scan of several
tensors together, whose gradient torch gets wrong, is refused (passes/rules/scans.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import dpcompile
import models as M
from helpers import check_against_reference

associative_scan_op = pytest.importorskip("torch._higher_order_ops.associative_scan").associative_scan_op

COMBINES = {"product": (lambda left, right: [left * right], lambda h: h.cumprod(1)),
            "logaddexp": (lambda left, right: [torch.logaddexp(left, right)], lambda h: h.logcumsumexp(1))}


class OneTensorScan(nn.Module):
    """A Linear, a cumulative product (or logsumexp) over the tokens, a Linear; ``hop``: by the higher-order op
    over dim 0 (as the wrapper moves the scan dim there), else by torch's cumulative op (the oracle, which vmap
    runs)."""

    def __init__(self, combine: str, hop: bool):
        super().__init__()
        self.inp, self.out = nn.Linear(3, 4), nn.Linear(4, 3)
        self.combine, self.hop = COMBINES[combine], hop

    def forward(self, x):  # [B, T, 3]
        h = torch.sigmoid(self.inp(x)) + 0.5
        if self.hop:
            (h,) = associative_scan_op(self.combine[0], [h.movedim(1, 0).contiguous()], ())
            h = h.movedim(0, 1)
        else:
            h = self.combine[1](h)
        return self.out(h).mean(1)


@pytest.mark.parametrize("combine", sorted(COMBINES))
@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_one_tensor_scan_is_exact_per_sample(combine, schedule):
    torch.manual_seed(0)
    model, oracle = OneTensorScan(combine, hop=True), OneTensorScan(combine, hop=False)
    oracle.load_state_dict(model.state_dict())
    inputs, targets = (torch.randn(6, 5, 3),), (torch.randn(6, 3),)
    backend = check_against_reference(model, M.mse, inputs, targets, schedule=schedule, oracle=oracle,
                                      compiler="eager")  # (Inductor lowers the op on GPUs only)
    (record,) = [r for r in backend.compiled if r.dp]
    assert "associative_scan" in record.graphs["joint_graph_before_dp"]


def test_a_scan_of_two_tensors_together_is_refused_saying_what_to_do():
    """h_t = a_t * h_(t-1) + b_t (Mamba's selective scan) as the higher-order op: torch's backward gives a's
    gradient wrong (checked here first, so the refusal's reason is checked too)."""
    torch.manual_seed(0)
    a = torch.rand(5, 6, 4, requires_grad=True)
    b = torch.randn(5, 6, 4, requires_grad=True)
    pair = lambda al, bl, ar, br: [al * ar, ar * bl + br]  # noqa: E731
    (_, h) = associative_scan_op(pair, [a, b], ())
    hs, state = [], torch.zeros(6, 4)
    for t in range(5):
        state = a[t] * state + b[t]
        hs.append(state)
    w = torch.randn(5, 6, 4)
    got = torch.autograd.grad((h * w).sum(), a)[0]
    want = torch.autograd.grad((torch.stack(hs) * w).sum(), a)[0]
    if torch.allclose(got, want, atol=1e-5):
        pytest.fail("torch's gradient of a two-tensor associative_scan is right now: the refusal can go")

    lin = nn.Linear(3, 8)

    def step(x):
        gate, u = lin(x).chunk(2, dim=-1)
        (_, hh) = associative_scan_op(pair, [torch.sigmoid(gate).movedim(1, 0).contiguous(),
                                             u.movedim(1, 0).contiguous()], ())
        hh.pow(2).sum((0, 2)).mean().backward()

    backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, compiler="eager")
    with pytest.raises(dpcompile.DPCompileError, match="scans 2 tensors together") as e:
        torch.compile(step, backend=backend)(torch.randn(4, 5, 3))
    assert "use_associative_scan=False" in str(e.value) and "associative_scan" in str(e.value)
