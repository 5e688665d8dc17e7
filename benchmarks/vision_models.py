"""The vision (and audio) models of the DP-SGD literature, without BatchNorm, at any size.

BatchNorm mixes the samples of a batch (its statistics are over the batch), so a per-sample gradient is not
defined under it and dpcompile refuses it in training mode. DP papers (De et al. 2022, Opacus' examples) use
GroupNorm instead; these models do the same. Every width is a constructor argument, so the tests build a
narrow copy of the very structure the benchmarks time.

    WideResNet      WRN-d-k for CIFAR (Zagoruyko & Komodakis 2016), pre-activation blocks, GroupNorm
    ResNet18GN      torchvision's ResNet-18 layout (ImageNet stem) with GroupNorm
    ViT             ViT with nn.MultiheadAttention, or timm's qkv attention (ViT-small by default)
    AudioFrontEnd   wav2vec2's convolutional feature encoder over a raw waveform, then a classifier
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def group_norm(channels: int, groups: int) -> nn.GroupNorm:
    # a narrow copy may have fewer channels than the full model's group count: the largest count dividing both
    return nn.GroupNorm(math.gcd(groups, channels), channels)


# ----------------------------------------------------------------------------- Wide ResNet

class WideBlock(nn.Module):
    """Pre-activation block: norm-ReLU-conv3x3(stride)-norm-ReLU-conv3x3, plus the input (a 1x1 strided conv of the
    pre-activated input where the shape changes, as in the reference code)."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.norm1 = group_norm(c_in, groups)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)  # no bias: a norm follows
        self.norm2 = group_norm(c_out, groups)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride, bias=False) if (c_in, stride) != (c_out, 1) else None

    def forward(self, x):
        a = F.relu(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(a)
        return skip + self.conv2(F.relu(self.norm2(self.conv1(a))))


class WideResNet(nn.Module):
    """WRN-depth-widen: a 3x3 stem conv to `width` channels, three stages of (depth - 4) / 6 blocks with
    width*widen, 2*width*widen, 4*width*widen channels at strides 1, 2, 2, norm-ReLU, global average pool,
    linear. width=16 is the paper's; a test's width=4 keeps the structure at a sixteenth of the FLOPs."""

    def __init__(self, depth: int = 16, widen: int = 4, num_classes: int = 10, groups: int = 16, in_ch: int = 3,
                 width: int = 16):
        super().__init__()
        assert (depth - 4) % 6 == 0, "WRN depth is 6n + 4"
        n = (depth - 4) // 6
        chans = [width * widen * m for m in (1, 2, 4)]
        self.stem = nn.Conv2d(in_ch, width, 3, 1, 1, bias=False)
        blocks, c = [], width
        for c_out, stride in zip(chans, (1, 2, 2)):
            for i in range(n):
                blocks.append(WideBlock(c, c_out, stride if i == 0 else 1, groups))
                c = c_out
        self.blocks = nn.Sequential(*blocks)
        self.norm = group_norm(c, groups)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        x = F.relu(self.norm(self.blocks(self.stem(x))))
        return self.fc(x.mean((2, 3)))  # global average pool, any input size


# ----------------------------------------------------------------------------- ResNet-18

class BasicBlock(nn.Module):
    """torchvision's BasicBlock (post-activation) with GroupNorm."""

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = group_norm(c_out, groups)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = group_norm(c_out, groups)
        self.down = None
        if (c_in, stride) != (c_out, 1):
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), group_norm(c_out, groups))

    def forward(self, x):
        y = self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18GN(nn.Module):
    """7x7/2 stem conv, 3x3/2 max-pool, 4 stages of 2 BasicBlocks (width, 2w, 4w, 8w; strides 1, 2, 2, 2),
    adaptive average pool, fc. width=64 is ResNet-18."""

    def __init__(self, num_classes: int = 1000, width: int = 64, groups: int = 32, in_ch: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_ch, width, 7, 2, 3, bias=False), group_norm(width, groups),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        stages, c = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            c_out = width * 2**i
            stages += [BasicBlock(c, c_out, stride, groups), BasicBlock(c_out, c_out, 1, groups)]
            c = c_out
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))


# ----------------------------------------------------------------------------- ViT

class QKVAttention(nn.Module):
    """timm's ViT attention: one qkv Linear, scaled_dot_product_attention over the heads, an output Linear."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))


class ViTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), x + MLP(LN(x)). attention="mha": nn.MultiheadAttention;
    "qkv": timm's (QKVAttention)."""

    def __init__(self, dim: int, heads: int, mlp: int, attention: str = "mha"):
        super().__init__()
        if attention not in ("mha", "qkv"):
            raise ValueError(f"attention={attention!r}: 'mha' (nn.MultiheadAttention) or 'qkv' (timm's)")
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True) if attention == "mha" else \
            QKVAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x):
        h = self.norm1(x)
        if isinstance(self.attn, QKVAttention):
            h = self.attn(h)
        else:  # nn.MultiheadAttention, or Opacus' DPMultiheadAttention in its place (ModuleValidator.fix)
            h = self.attn(h, h, h, need_weights=False)[0]  # need_weights=False: the fused (SDPA) attention
        x = x + h
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patches by a strided conv, a class token, learned position embeddings, pre-norm blocks, a final LayerNorm
    and a linear head on the class token. The defaults are ViT-small/16 at 224x224; attention: ViTBlock's."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 384, depth: int = 12, heads: int = 6,
                 mlp: int = 1536, num_classes: int = 1000, in_ch: int = 3, attention: str = "mha"):
        super().__init__()
        self.patch_embed = nn.Conv2d(in_ch, dim, patch, patch)
        tokens = (image // patch) ** 2 + 1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, tokens, dim))
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads, mlp, attention) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, patches, dim]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


# ----------------------------------------------------------------------------- audio

class ChannelLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of a [B, C, T] signal (wav2vec2's 'layer' mode): channel-last, normalise,
    back."""

    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class AudioFrontEnd(nn.Module):
    """wav2vec2's feature encoder over a raw waveform [B, in_ch, L], then mean over time and a linear classifier.

    Strided Conv1d layers, each followed by GELU. norm="group": GroupNorm with one group per channel after the
    first conv only (wav2vec2-base); norm="layer": a LayerNorm over channels after every conv (wav2vec2-large).
    The default kernels and strides are wav2vec2's: 400 samples (25 ms at 16 kHz) per frame, a frame every 320."""

    def __init__(self, in_ch: int = 1, channels: int = 512, kernels=(10, 3, 3, 3, 3, 2, 2),
                 strides=(5, 2, 2, 2, 2, 2, 2), norm: str = "group", conv_bias: bool = False, num_classes: int = 35):
        super().__init__()
        assert norm in ("group", "layer")
        layers, c = [], in_ch
        for i, (k, s) in enumerate(zip(kernels, strides)):
            layers.append(nn.Conv1d(c, channels, k, s, bias=conv_bias))
            if norm == "layer":
                layers.append(ChannelLayerNorm(channels))
            elif i == 0:
                layers.append(nn.GroupNorm(channels, channels))
            layers.append(nn.GELU())
            c = channels
        self.encoder = nn.Sequential(*layers)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, wave):
        return self.fc(self.encoder(wave).mean(2))
