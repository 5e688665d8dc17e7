"""Vision and audio models (benchmarks/vision_models.py, timm) against the float64 vmap(grad) oracle, clipping on.

Narrow copies of the benchmarked structures (same layers, same ops, a few channels) keep the file fast on CPU;
most runs use compiler="eager" (the same graphs op by op, no Inductor code generation), the smallest
model runs through Inductor.
"""
from __future__ import annotations

import functools
import os
import sys

import pytest
import torch
import torch.nn as nn

import dpcompile
from helpers import check_against_reference, check_batches_against_reference, compile_step
from models import ce

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import vision_models as vm  # noqa: E402

B, CLASSES = 4, 3


def dp_run(model, x, schedule, **options):
    """One DP step checked against the oracle; the record of its DP compile."""
    y = torch.randint(0, CLASSES, (x.shape[0],))
    backend = check_against_reference(model, ce, (x,), (y,), schedule=schedule, **options)
    return next(r for r in backend.compiled if r.dp)


def conv_weights(model) -> list[str]:
    return [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.modules.conv._ConvNd)]


def assert_conv_norms_forced(rec, model, form: str):
    """conv_norm=form: every conv weight took that form, and the summary says it was forced."""
    convs = conv_weights(model)
    assert rec.counters[f"norm_conv_{form}"] == len(convs), dict(rec.counters)
    other = {"ghost": "direct", "direct": "ghost"}[form]
    assert rec.counters.get(f"norm_conv_{other}", 0) == 0, dict(rec.counters)
    entry = rec.summary["params"][convs[1]]
    assert entry["norm"] == form and f"forced by conv_norm={form!r}" in entry["why"], entry


def import_timm():
    # not pytest.importorskip: a torchvision wheel built for another torch (PyPI's CUDA build under a CPU torch)
    # fails at import with a RuntimeError, which importorskip does not catch
    try:
        import timm
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"timm is not importable: {type(exc).__name__}: {str(exc)[:200]}")
    return timm


# ----------------------------------------------------------------------------- the benchmarked structures

@pytest.mark.parametrize("schedule", ["bk"])  # ghost: ResNet-18, ViT, audio (CI time)
def test_wide_resnet16(schedule):
    # WRN-16 with 4/8/16 channels per stage (the paper's 16k/32k/64k at width 4, widen 1)
    model = vm.WideResNet(depth=16, widen=1, num_classes=CLASSES, groups=16, width=4)
    options = {"conv_norm": "ghost"} if schedule == "bk" else {}
    rec = dp_run(model, torch.randn(B, 3, 16, 16), schedule, compiler="eager", **options)
    if options:
        assert_conv_norms_forced(rec, model, "ghost")


def test_resnet18_groupnorm():
    # one schedule (CI time): ghost; bk runs on the WRN and sharded on the ViT; forced direct in test_convolution
    model = vm.ResNet18GN(num_classes=CLASSES, width=8, groups=4)
    # fp32 against fp64 through 17 layers: one entry of a stage-2 kernel came out 3.7e-7 off on another CPU's
    # summation order (the default allows 2.6e-7 there); a wrong clip is off by orders of magnitude more
    rec = dp_run(model, torch.randn(B, 3, 32, 32), "ghost", compiler="eager", atol=1e-6)
    # the cost model picks per layer: direct for the stem's 256 positions, ghost for the last stage's 1
    assert rec.counters["norm_conv_direct"] and rec.counters["norm_conv_ghost"], dict(rec.counters)


@pytest.mark.parametrize("schedule,attention", [("bk", "mha"), ("ghost", "qkv")])
def test_vit(schedule, attention):
    # attention: nn.MultiheadAttention, or timm's qkv Linear and SDPA (the NCCL test's ViT)
    model = vm.ViT(image=16, patch=4, dim=16, depth=2, heads=2, mlp=32, num_classes=CLASSES, attention=attention)
    dp_run(model, torch.randn(B, 3, 16, 16), schedule, compiler="eager")


@pytest.mark.parametrize("schedule,norm", [("bk", "group"), ("ghost", "layer")])
def test_audio_front_end(schedule, norm):
    # wav2vec2's seven strided Conv1d layers (400 samples make one frame); "layer": wav2vec2-large's LayerNorm
    # over channels (transposed to channel-last) after every conv, with conv biases
    model = vm.AudioFrontEnd(channels=8, norm=norm, conv_bias=norm == "layer", num_classes=CLASSES)
    dp_run(model, torch.randn(B, 1, 400), schedule, compiler="eager")


# ----------------------------------------------------------------------------- norms that are per sample

class ConvNet(nn.Module):
    """conv - norm - ReLU - conv - mean - linear, with the norm under test."""

    def __init__(self, norm: nn.Module, c: int = 6):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1)
        self.norm = norm
        self.conv2 = nn.Conv2d(c, c, 3, stride=2)
        self.fc = nn.Linear(c, CLASSES)

    def forward(self, x):
        return self.fc(self.conv2(torch.relu(self.norm(self.conv1(x)))).mean((2, 3)))


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of [B, C, H, W] (ConvNeXt): channel-last, normalise, back."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def perturbed(norm: nn.Module) -> nn.Module:
    with torch.no_grad():  # affine parameters away from 1 and 0, so their gradients are not special
        norm.weight.add_(0.1 * torch.randn_like(norm.weight))
        norm.bias.add_(0.1 * torch.randn_like(norm.bias))
    return norm


def test_instance_norm():
    # statistics per sample and channel, no running stats: per sample in training mode
    model = ConvNet(perturbed(nn.InstanceNorm2d(6, affine=True)))
    dp_run(model, torch.randn(B, 3, 8, 8), "bk", compiler="eager")


@pytest.mark.parametrize("schedule,running", [("bk", False), ("ghost", True)])
def test_instance_norm_with_an_unbacked_batch(schedule, running):
    """One graph for every batch size (mark_batch), a batch of 0 among them: exact against the oracle. torch's
    instance_norm views the batch as channels, which an unbacked batch cannot take (refused before, and with
    compiler="eager" a division by zero on an empty batch); a DP step computes it as group_norm with a group per
    channel. running: statistics kept from before, used as they are (eval mode), written out per channel."""
    from reference import dp_reference

    torch.manual_seed(0)
    norm = perturbed(nn.InstanceNorm2d(6, affine=True, track_running_stats=running))
    if running:
        with torch.no_grad():
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
        norm.eval()
    model = ConvNet(norm)
    batches = [(torch.randn(n, 3, 6, 6), torch.randint(0, CLASSES, (n,))) for n in (3, 0, 5)]
    _, norms = dp_reference(model, ce, batches[0][:1], batches[0][1:], max_grad_norm=1.0, expected_batch_size=5)
    C = float(norms.median())
    step, backend = compile_step(model, ce, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=5,
                                 schedule=schedule, compiler="eager")
    clipped, unclipped = check_batches_against_reference(model, ce, step, batches, max_grad_norm=C,
                                                         expected_batch_size=5)
    assert clipped and unclipped
    assert len([r for r in backend.compiled if r.dp]) == 1
    if running:  # eval mode reads the statistics, never writes them
        assert not norm.num_batches_tracked


@pytest.mark.parametrize("unbacked", [False, True])
def test_instance_norm_updating_running_statistics_is_refused(unbacked):
    """track_running_stats=True in training mode averages the samples' statistics into buffers, which would
    carry them outside the privacy guarantee: refused, naming the buffer, with the batch size known at compile
    time or not (its batch_norm's C++ check of an unbacked batch against 0 is answered: cpp_size_questions)."""
    model = ConvNet(nn.InstanceNorm2d(6, affine=True, track_running_stats=True))
    step, _ = compile_step(model, ce, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=B,
                           compiler="eager")
    x, y = torch.randn(B, 3, 8, 8), torch.randint(0, CLASSES, (B,))
    if unbacked:
        dpcompile.mark_batch(x, y)
    with pytest.raises(dpcompile.DPCompileError, match=r"(?s)buffer 'norm.running_mean'.*What to do"):
        step((x,), (y,))
    assert all(p.grad is None for p in model.parameters())


def test_layer_norm_over_channels():
    # the one Inductor run of this file: the smallest graph, so the fewest kernels to build
    model = ConvNet(perturbed(LayerNorm2d(6)))
    dp_run(model, torch.randn(B, 3, 8, 8), "ghost")


def test_batchnorm_training_refused():
    model = ConvNet(nn.BatchNorm2d(6))
    step, _ = compile_step(model, ce, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=B,
                           compiler="eager")
    with pytest.raises(dpcompile.DPCompileError, match="GroupNorm") as err:
        step((torch.randn(B, 3, 8, 8),), (torch.randint(0, CLASSES, (B,)),))
    assert "BatchNorm2d" in str(err.value)


def test_batchnorm_eval_mode():
    # with running statistics (eval mode) BatchNorm is a per-channel affine map: per sample
    model = ConvNet(perturbed(nn.BatchNorm2d(6)))
    with torch.no_grad():
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 2.0)
    dp_run(model.eval(), torch.randn(B, 3, 8, 8), "bk", compiler="eager")


# ----------------------------------------------------------------------------- third-party code (timm)

def test_timm_vit():
    timm = import_timm()
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=16,
                              depth=1, num_heads=2, num_classes=CLASSES)
    dp_run(model, torch.randn(B, 3, 16, 16), "bk", compiler="eager")


def test_timm_resnet_groupnorm():
    timm = import_timm()
    # timm's ResNet takes norm_layer (a class, or a name from timm.layers.create_norm); its GroupNorm takes the
    # channels first, as BatchNorm2d does. One block per stage and narrow stages keep the test short;
    # zero_init_last=False, or every block's last norm weight is 0 and its convs get exact-zero gradients.
    model = timm.create_model("resnet18", pretrained=False, num_classes=CLASSES, layers=(1, 1, 1, 1),
                              channels=(8, 16, 32, 64), zero_init_last=False,
                              norm_layer=functools.partial(timm.layers.GroupNorm, num_groups=4))
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    dp_run(model, torch.randn(B, 3, 32, 32), "ghost", compiler="eager")
