"""The arithmetic floor of DP-SGD on the vision shapes: what the per-sample norms cost at the least.

    python benchmarks/vision_bound.py            # WRN-16-4 and ViT-S/16 (benchmarks/vision.py's SHAPES)

bound = (FLOPs of the non-private step + the cheapest exact per-sample norm of every weight) / FLOPs of the
non-private step: the ratio a DP step cannot beat without skipping work (bk: one norm pass more than the
non-private step, its clipped weight gradient in place of the plain one). Counted with torch's
FlopCounterMode on the meta device (no GPU, no data), forward and backward of the mean cross-entropy.

A weight's per-sample gradient is E^T U per sample (E: the output gradients, U: the inputs, unfolded for
a convolution), over S positions (output pixels, or tokens). Its squared norm costs, in multiply-adds per
sample, at the least (passes/conv_norms.py's and passes/per_sample_norms.py's two forms):

    direct  S * Cout * K            (the per-sample gradient itself: a weight gradient's work, per sample)
    ghost   S^2 * (Cout + K)        (<U U^T, E E^T> over positions)

with K = Cin/groups * prod(kernel) the unfolded input width. Biases and norm affines cost O(S * C): left out.
Prints one line per shape: the bound, the bound with every weight in the direct form, for how many weights
the direct form is the cheaper one, and the non-private GFLOPs per sample.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from vision import SHAPES  # noqa: E402


def norm_costs(model: nn.Module, x: torch.Tensor) -> list[tuple[str, int, int]]:
    """(weight name, direct, ghost) multiply-adds per sample for every conv and Linear weight."""
    found = []

    def hook(name):
        def record(module, args, out):
            if isinstance(module, nn.MultiheadAttention):  # its fused path calls no submodule: both weights here
                S, D = out[0].shape[1] if module.batch_first else out[0].shape[0], module.embed_dim
                found.append((f"{name}.in_proj_weight", S * 3 * D * D, S * S * 4 * D))
                found.append((f"{name}.out_proj.weight", S * D * D, S * S * 2 * D))
                return
            if isinstance(module, nn.modules.conv._ConvNd):
                S = math.prod(out.shape[2:])
                K = module.in_channels // module.groups * math.prod(module.kernel_size)
                cout = module.out_channels
            else:  # Linear over [B, ..., in]: positions are the middle dims
                S = math.prod(out.shape[1:-1]) if out.dim() > 2 else 1
                K, cout = module.in_features, module.out_features
            found.append((f"{name}.weight", S * cout * K, S * S * (cout + K)))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear, nn.MultiheadAttention))
               and not isinstance(m, nn.modules.linear.NonDynamicallyQuantizableLinear)]
    model(x)
    for h in handles:
        h.remove()
    return found


def step_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return counter.get_total_flops()


def bound(name: str, batch: int = 2) -> dict:
    build, side, classes, _ = SHAPES[name]
    with torch.device("meta"):
        model = build()
        x = torch.randn(batch, 3, side, side)
        y = torch.randint(0, classes, (batch,))
    flops = step_flops(model, x, y)
    costs = norm_costs(model, x)
    direct = sum(d for _, d, _ in costs) * 2 * batch  # FLOPs: 2 per multiply-add
    cheapest = sum(min(d, g) for _, d, g in costs) * 2 * batch
    return {"shape": name, "bound": 1 + cheapest / flops, "bound_direct_only": 1 + direct / flops,
            "weights": len(costs), "direct_cheaper": sum(d <= g for _, d, g in costs),
            "nonprivate_gflops_per_sample": flops / batch / 1e9}


if __name__ == "__main__":
    for shape in SHAPES:
        r = bound(shape)
        print(f"{shape}: bound {r['bound']:.3f}x (every weight direct: {r['bound_direct_only']:.3f}x); "
              f"direct is the cheaper form for {r['direct_cheaper']} of {r['weights']} weights; non-private "
              f"{r['nonprivate_gflops_per_sample']:.2f} GFLOP per sample")
