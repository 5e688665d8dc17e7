"""Convolutions: every form (1-D/2-D/3-D, stride, padding, dilation, groups, transposed, bias) against the vmap(grad)
oracle with clipping active, both schedules and both per-sample norm forms; the cost model's choice; blocks."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpcompile
import models as M
from helpers import check_against_reference

from dpcompile.passes import conv_norms, per_sample_norms

_CONV = {(1, False): nn.Conv1d, (2, False): nn.Conv2d, (3, False): nn.Conv3d,
         (1, True): nn.ConvTranspose1d, (2, True): nn.ConvTranspose2d, (3, True): nn.ConvTranspose3d}


class TwoConvs(nn.Module):
    """conv -> tanh -> conv -> linear: the second convolution also computes an input gradient."""

    def __init__(self, dim, transposed, size, **kw):
        super().__init__()
        conv = _CONV[dim, transposed]
        self.c1 = conv(4, 6, 3, **kw)
        self.c2 = conv(6, 2, 2, **{k: v for k, v in kw.items() if k in ("groups", "bias")})
        self.fc = nn.Linear(_out_numel(self, dim, size), 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.c2(torch.tanh(self.c1(x)))).flatten(1))


def _out_numel(m, dim, size):
    with torch.no_grad():
        return m.c2(m.c1(torch.zeros(1, 4, *[size] * dim))).numel()


FORMS = {
    "2d": (2, False, {}),
    "2d_stride_pad_groups": (2, False, dict(stride=2, padding=1, groups=2)),
    "2d_stride_past_the_end": (2, False, dict(stride=3)),  # the windows never reach the last column (a crop)
    "2d_depthwise_no_bias": (2, False, dict(groups=2, bias=False)),
    "1d_dilated_same": (1, False, dict(dilation=2, padding="same")),
    "3d_anisotropic_stride": (3, False, dict(stride=(1, 2, 1), padding=(0, 1, 1))),
    "2d_transposed": (2, True, dict(stride=2, padding=1, output_padding=1, groups=2)),
    "1d_transposed_dilated": (1, True, dict(dilation=2, output_padding=1)),  # padding past the stride: no unfold
    # padding="valid" traces as padding [0], one value for every spatial dim (SigLIP's patch embedding)
    "3d_valid": (3, False, dict(padding="valid")),
}


# every form with both schedules and every norm form, paired differently from form to form (CI time)
RUNS = [(form, schedule, norm) for i, form in enumerate(sorted(FORMS))
        for schedule, norm in ((("bk", "direct"), ("ghost", "ghost"), ("bk", "input_gram")),
                               (("bk", "ghost"), ("ghost", "direct"), ("ghost", "input_gram")))[i % 2]]


@pytest.mark.parametrize("form,schedule,conv_norm", RUNS)
def test_convolution_forms_match_the_oracle(form, schedule, conv_norm):
    dim, transposed, kw = FORMS[form]
    size = 4 if dim == 3 else 7
    model = TwoConvs(dim, transposed, size, **kw)
    x, y = torch.randn(5, 4, *[size] * dim), torch.randn(5, 3)
    backend = check_against_reference(model, M.mse, (x,), (y,), schedule=schedule, compiler="eager",
                                      conv_norm=conv_norm)
    (rec,) = [r for r in backend.compiled if r.dp]
    forms = {k: v for k, v in rec.counters.items() if k.startswith("norm_conv_")}
    assert sum(forms.values()) == 2 and set(forms) <= {f"norm_conv_{conv_norm}", "norm_conv_direct"}
    for name in ("c1.weight", "c2.weight"):
        p = rec.summary["params"][name]
        # an output_padding past the stride: unfold(D) misses E's last positions, and the ghost form gives way
        assert (p["norm"], f"conv_norm={conv_norm!r}" in p["why"]) == (conv_norm, True) or \
            (p["norm"], "does not line up" in p["why"], kw.get("output_padding", 0)) == ("direct", True, 1), p
    assert forms.get(f"norm_conv_{conv_norm}", 0) == 2 or "output_padding" in kw


def test_auto_picks_the_cheaper_norm_per_layer_and_says_why():
    """Non-overlapping patches with many channels and few positions (a ViT's patch embedding): the Gram
    matrices over 4 positions are cheaper than the [B, 96, 3, 4, 4] gradient, also in one kernel; a 3x3
    convolution over 64 positions with few channels: the direct gradient is."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(3, 96, 4, stride=4)
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.fc = nn.Linear(96 * 4 + 4 * 64, 2)

        def forward(self, x):
            return self.fc(torch.cat([self.patch(x).flatten(1), self.conv(x).flatten(1)], 1))

    backend = check_against_reference(Net(), M.mse, (torch.randn(4, 3, 8, 8),), (torch.randn(4, 2),),
                                      schedule="bk", compiler="eager")
    (rec,) = [r for r in backend.compiled if r.dp]
    params = rec.summary["params"]
    assert params["patch.weight"]["norm"] == "ghost" and params["conv.weight"]["norm"] == "direct", params
    for name in ("patch.weight", "conv.weight"):
        assert "ghost ~" in params[name]["why"] and "direct ~" in params[name]["why"]


class FewPositionsManyChannels(nn.Module):
    """3x3 convolutions over 4x4 positions with 128 channels (a CIFAR WRN's last stage, narrowed), one dilated,
    one strided, and a Conv1d over rows that are not the samples (a [B, 4, C, L] stack folded to [B * 4, C, L]:
    each sample's 4 rows are sequences of their own, which no window crosses)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(128, 128, 3, padding=1)
        self.c = nn.Conv2d(128, 128, 3, padding=2, dilation=2)
        self.b = nn.Conv2d(128, 128, 3, stride=2, padding=1)
        self.seq = nn.Conv1d(128, 128, 3, padding=1)
        self.fc = nn.Linear(4 * 128 * 4, 2)

    def forward(self, x):
        h = self.b(torch.tanh(self.c(torch.tanh(self.a(x))))).flatten(2)  # [B, 128, 4]
        rows = torch.stack([h, torch.tanh(h), h * h, -h], 1).reshape(-1, 128, 4)  # [B * 4, 128, 4]
        return self.fc(self.seq(rows).reshape(x.shape[0], -1))


@pytest.mark.parametrize("schedule,batch", [("bk", "static"), ("ghost", "unbacked")])
def test_auto_takes_input_gram_where_positions_are_few_and_it_matches_the_oracle(schedule, batch, monkeypatch):
    """Few positions and many channels: the padded input's Gram over its positions (input_gram) is cheaper than
    unfold(D)'s and than the per-sample gradients once its fixed cost per layer is shared by enough samples
    (here: none, as at a large batch); exact against the oracle with clipping active, for a strided, a dilated
    and a sequence-folded convolution, with a static batch size op by op and an unbacked one through Inductor's
    code (as a sharded step runs it: test_fsdp's input_gram runs go op by op)."""
    monkeypatch.setattr(conv_norms, "INPUT_GRAM_COST", {torch.float32: (conv_norms.MACS_PER_BYTE, 0.0)})
    model = FewPositionsManyChannels()
    x, y = torch.randn(5, 128, 4, 4), torch.randn(5, 2)
    if batch == "unbacked":
        dpcompile.mark_batch(x, y)
    backend = check_against_reference(model, M.mse, (x,), (y,), schedule=schedule,
                                      compiler="inductor" if batch == "unbacked" else "eager")
    (rec,) = [r for r in backend.compiled if r.dp]
    params = rec.summary["params"]
    for name in ("a.weight", "b.weight", "c.weight", "seq.weight"):
        assert params[name]["norm"] == "input_gram" and "input_gram ~" in params[name]["why"], params[name]
    assert rec.counters["norm_conv_input_gram"] == 4


def test_input_gram_fixed_cost_per_layer_keeps_auto_off_it_at_a_small_batch():
    """The same layers at 5 samples with the measured costs: input_gram's five kernels per layer cost more than
    the other forms save, so auto does not take it."""
    model = FewPositionsManyChannels()
    backend = check_against_reference(model, M.mse, (torch.randn(5, 128, 4, 4),), (torch.randn(5, 2),),
                                      schedule="bk", compiler="eager")
    (rec,) = [r for r in backend.compiled if r.dp]
    assert not rec.counters.get("norm_conv_input_gram"), dict(rec.counters)
    assert "input_gram ~" in rec.summary["params"]["a.weight"]["why"]


@pytest.mark.parametrize("conv_norm,batch", [("direct", "static"), ("ghost", "static"), ("direct", "unbacked"),
                                              ("ghost", "unbacked"), ("input_gram", "static")])
def test_large_convolution_norms_are_computed_in_blocks(conv_norm, batch, monkeypatch):
    """Blocks of samples with a static batch size; with an unbacked one (dpcompile.mark_batch: sharded steps,
    Poisson sampling), blocks of the unfolded operand's channels (and of Gram rows)."""
    import dpcompile

    monkeypatch.setattr(per_sample_norms, "NORM_BLOCK_BYTES", 256)
    model = TwoConvs(2, False, 7, groups=2 if batch == "static" else 1)
    x, y = torch.randn(5, 4, 7, 7), torch.randn(5, 3)
    if batch == "unbacked":
        dpcompile.mark_batch(x, y)
    backend = check_against_reference(model, M.mse, (x,), (y,), schedule="bk", compiler="eager", conv_norm=conv_norm)
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters["norm_blocks"] >= 4
    unit = "samples" if batch == "static" else "channels"
    assert f"blocks of {unit}" in rec.summary["params"]["c1.weight"]["why"], rec.summary["params"]["c1.weight"]


class KeptGradients(nn.Module):
    """Layers whose per-sample fp32 weight gradient is no bigger than their output gradient and input over a
    sample's positions: in the norm kernel (a: 3x3 over 8x8, g: grouped, seq: a Conv1d over 2 rows per sample)
    and in the batched contraction (dw: depthwise, up: transposed); and one whose gradient is bigger (b:
    strided, 4x4 positions against 288 columns)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.g = nn.Conv2d(16, 32, 3, padding=1, groups=2)
        self.b = nn.Conv2d(32, 16, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.seq = nn.Conv1d(16, 16, 3, padding=1)
        self.fc = nn.Linear(2 * 16 * 16, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.g(torch.tanh(self.dw(h)) + h))  # [B, 32, 8, 8]
        d = self.b(h)  # [B, 16, 4, 4]
        h = d.flatten(2) + F.avg_pool2d(self.up(torch.tanh(d)), 2).flatten(2)  # [B, 16, 16]
        rows = torch.stack([torch.tanh(h), h * h], 1).reshape(-1, 16, 16)  # [B * 2, 16, 16]
        return self.fc(self.seq(rows).reshape(x.shape[0], -1))


@pytest.mark.parametrize("layout,batch", [("contiguous", "static"), ("channels_last", "unbacked")])
def test_bk_makes_clipped_conv_gradients_from_kept_per_sample_gradients(layout, batch):
    """bk: where the direct form's per-sample gradients are no bigger than the operands bk would hold, it keeps
    them (the norm kernel's through conv_weight_grads, or the batched contraction's) and the clipped weight
    gradient is sum_b r_b g_b over them, with no second weight-gradient convolution; exact against the oracle
    with clipping active, contiguous and channels-last weights, a static and an unbacked batch. Ghost keeps
    nothing (its memory is the non-private step's)."""
    model = KeptGradients()
    x, y = torch.randn(5, 4, 8, 8), torch.randn(5, 2)
    if layout == "channels_last":
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    if batch == "unbacked":
        dpcompile.mark_batch(x, y)
    backend = check_against_reference(model, M.mse, (x,), (y,), schedule="bk", compiler="eager",
                                      conv_norm="direct")
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters["conv_grads_kept"] == 5 and rec.counters["bk_conv_grads_from_rows"] == 5, rec.counters
    params = rec.summary["params"]
    for name in ("a.weight", "dw.weight", "g.weight", "up.weight", "seq.weight"):
        assert "keeps the per-sample gradients" in params[name]["why"], params[name]
        assert params[name]["schedule"] == "clipped sum of its per-sample rows", params[name]
    assert "keeps" not in params["b.weight"]["why"] and params["b.weight"]["schedule"] == "deferred (bk)"
    ops = [op for op, _ in rec.ops["backward"]]
    assert ops.count("dpcompile.conv_weight_grads.default") == 3, ops
    # the input gradients of all but a (x needs none), and one weight gradient: b's, deferred; channels-last
    # with an unbacked batch, laid out as traced on an empty batch too (passes.empty_conv_grads)
    guarded = int(layout == "channels_last" and batch == "unbacked")
    assert ops.count("aten.convolution_backward.default") == 5 + 1 - guarded, ops
    assert ops.count("dpcompile.convolution_backward_any_batch.default") == guarded, ops
    ghost = check_against_reference(KeptGradients(), M.mse, (x,), (y,), schedule="ghost", compiler="eager",
                                    conv_norm="direct")
    (rec,) = [r for r in ghost.compiled if r.dp]
    assert not rec.counters.get("conv_grads_kept"), rec.counters


def test_a_convolution_over_the_sample_dim_is_refused():
    """The samples as the input's channels (x transposed to [C, B, L]): the convolution mixes them."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv1d(4, 2, 3)
            self.fc = nn.Linear(3 * 2 * 3, 4)

        def forward(self, x):  # x [B=4, 3, 5]
            return self.fc(self.c(x.transpose(0, 1)).flatten()).expand(x.shape[0], 4)

    net = Net()
    step = dpcompile.private_step(lambda x, y: ((net(x) - y) ** 2).sum(1).mean().backward(), max_grad_norm=1.0,
                                  noise_multiplier=0.0, expected_batch_size=4, compiler="eager")
    with pytest.raises(dpcompile.DPCompileError, match=r"convolution.*samples of its input on dim 1"):
        step(torch.randn(4, 3, 5), torch.randn(4, 4))
