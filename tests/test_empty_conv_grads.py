"""A rank with no samples through a convolution whose input is channels-last (passes.empty_conv_grads,
dpcompile::convolution_backward_any_batch): torch's kernel returns the weight gradient of an empty batch in the
weight's layout, the traced graph has it channels-last, and Inductor's stride assert stopped the step. The op
against aten's kernel, and steps with an unbacked batch that run with samples and then with none, exact, in both
schedules (sharded: tests/model_zoo.py's hf_convnext and hf_segformer run [4, 0])."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models as M
from dpcompile.empty_conv_backward import weight_format
from helpers import check_one_graph_against_reference

ops = torch.ops.dpcompile
aten = torch.ops.aten
ARGS = ([16], [2, 2], [0, 0], [1, 1], False, [0, 0], 1, [True, True, True])


def test_op_is_atens_kernel_with_an_empty_batchs_weight_gradient_as_traced():
    w = torch.randn(16, 8, 2, 2)
    for B in (3, 0):
        x = torch.randn(B, 8, 4, 4).contiguous(memory_format=torch.channels_last)
        go = torch.randn(B, 16, 2, 2)
        want = aten.convolution_backward.default(go, x, w, *ARGS)
        got = ops.convolution_backward_any_batch(go, x, w, *ARGS, 1)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        assert got[1].is_contiguous(memory_format=torch.channels_last)
        # aten's kernel lays an empty batch's weight gradient out as the weight: what the op is for
        assert want[1].is_contiguous() == (B == 0)
        kept = ops.convolution_backward_any_batch(go, x, w, *ARGS, 0)
        assert kept[1].stride() == want[1].stride()
        result = torch.library.opcheck(ops.convolution_backward_any_batch.default, (go, x, w, *ARGS, 1))
        assert all(v == "SUCCESS" for v in result.values()), result
    assert weight_format(torch.empty(16, 8, 2, 2).contiguous(memory_format=torch.channels_last)) == 1
    assert weight_format(torch.empty(16, 8, 1, 1).contiguous(memory_format=torch.channels_last)) == 0  # both
    assert weight_format(torch.empty(4, 2, 3, 3, 3).contiguous(memory_format=torch.channels_last_3d)) == 2


class ChannelsLastDown(nn.Module):
    """ConvNeXt's downsampling: a LayerNorm over the channels of a permuted map, permuted back (channels-last
    strides, no copy), then a strided convolution reading it."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.ln = nn.LayerNorm(8)
        self.down = nn.Conv2d(8, 16, 2, stride=2)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.ln(torch.tanh(self.stem(x)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(F.gelu(self.down(h)).mean((2, 3)))


# bk keeps a small convolution's per-sample gradients (its clipped gradient is their weighted sum) unless told
# to take the ghost form, whose clipped gradient is a convolution_backward
@pytest.mark.parametrize("schedule,conv_norm", [("bk", "ghost"), ("ghost", "auto")])
def test_a_step_runs_with_no_samples_after_one_with_samples(schedule, conv_norm):
    torch.manual_seed(0)
    x, y = torch.randn(5, 3, 8, 8), torch.randn(5, 3)
    model = ChannelsLastDown()
    # one graph for both batch sizes (the helper marks each batch): exact with samples, zero gradients with none
    # (no noise here)
    backend = check_one_graph_against_reference(model, M.mse, [(x, y), (x[:0], y[:0])], schedule=schedule,
                                                compiler="inductor", conv_norm=conv_norm)
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters["nonempty_batch_conv_grads_guarded"] >= 1, rec.counters
    assert "dpcompile.convolution_backward_any_batch.default" in [op for op, _ in rec.ops["backward"]]
    for name, p in model.named_parameters():  # the empty batch ran last: no sample, every gradient exactly zero
        assert p.grad is not None and not p.grad.any(), name
