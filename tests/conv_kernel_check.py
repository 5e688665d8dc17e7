"""The conv norm kernel (dpcompile.conv_sq_norms) against each sample's weight gradient from autograd in fp64.
Run as a script with TRITON_INTERPRET=1 (set before triton is imported: tests/test_conv_sq_norms.py starts it
in a process of its own) it checks the Triton kernel on CPU tensors; tests/test_gpu.py imports it for CUDA."""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

# (samples, rows per sample, Cin, Cout, input size, kernel, stride, padding, dilation, groups): tiles cut by
# the masks on every side (17 and 20 output channels, 27 and 45 columns, positions not a multiple of the
# dot's), stride, padding, dilation, groups, several rows per sample, 1-D; both column layouts of a tile
CASES = [
    (3, 1, 3, 16, (7, 9), (3, 3), (1, 1), (1, 1), (1, 1), 1),
    (2, 1, 6, 20, (8, 8), (3, 3), (2, 2), (1, 1), (1, 1), 1),
    (2, 2, 4, 32, (9, 7), (3, 2), (1, 2), (2, 0), (2, 1), 1),
    (2, 1, 8, 32, (6, 6), (1, 1), (2, 2), (0, 0), (1, 1), 2),
    (3, 1, 9, 17, (10,), (5,), (2,), (2,), (1,), 1),
    (1, 1, 64, 64, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1), 1),
    (2, 2, 64, 80, (6, 5), (3, 3), (2, 1), (1, 2), (1, 2), 2),  # 128 columns across taps, 40 rows
    # tiles within one kernel tap (channels per group a multiple of the tile's 128 columns): 128x128 tiles in
    # half precision (144 rows: cut); strided, padded, dilated, grouped (24 rows: cut); 1-D
    (1, 1, 128, 144, (5, 5), (3, 3), (1, 1), (1, 1), (1, 1), 1),
    (2, 1, 256, 48, (6, 5), (3, 3), (2, 1), (1, 2), (1, 2), 2),
    (2, 1, 128, 32, (12,), (3,), (1,), (1,), (2,), 1),
]


def reference_grads(e, x, weight_shape, stride, padding, dilation, groups, rows):
    """Each sample's weight gradient from autograd in fp64: [B, *weight_shape]."""
    conv = F.conv2d if len(weight_shape) == 4 else F.conv1d
    out = []
    for b in range(e.shape[0] // rows):
        w = torch.zeros(weight_shape, dtype=torch.float64, device=e.device, requires_grad=True)
        y = conv(x[b * rows:(b + 1) * rows].double(), w, None, stride, padding, dilation, groups)
        out.append(torch.autograd.grad(y, w, e[b * rows:(b + 1) * rows].double())[0])
    return torch.stack(out)


def reference(e, x, weight_shape, stride, padding, dilation, groups, rows):
    """Each sample's ||dW||^2 from autograd in fp64."""
    return reference_grads(e, x, weight_shape, stride, padding, dilation, groups, rows).flatten(1).square().sum(1)


def errors(fn, device: str, dtypes, channels_last: bool = False, keep: bool = False) -> dict[str, float]:
    """Largest relative error of fn's squared norms (summed over its parts) per case and dtype; keep: fn returns
    (partial sums, kept gradients) as conv_weight_grads does, and the gradients' largest error relative to
    their largest entry counts too (key suffix ``:grads``)."""
    from dpcompile import conv_sq_norms

    torch.manual_seed(0)
    worst = {}
    for i, (B, rows, cin, cout, size, k, st, pad, dil, g) in enumerate(CASES):
        x = torch.randn(B * rows, cin, *size, device=device)
        w_shape = [cout, cin // g, *k]
        conv = F.conv2d if len(k) == 2 else F.conv1d
        e = torch.randn(conv(x, torch.zeros(w_shape, device=device), None, st, pad, dil, g).shape, device=device)
        for dt in dtypes:
            ed, xd = e.to(dt), x.to(dt)
            if channels_last and len(k) == 2:
                ed, xd = ed.contiguous(memory_format=torch.channels_last), xd.contiguous(memory_format=torch.channels_last)
            # the reference of the rounded operands: what is left is the kernel's own error
            ref_grads = reference_grads(ed, xd, w_shape, st, pad, dil, g, rows)
            ref = ref_grads.flatten(1).square().sum(1)
            out = fn(ed, xd, w_shape, list(st), list(pad), list(dil), g, rows)
            got = (out[0] if keep else out).sum(1).double()
            key = f"{i}:{str(dt).split('.')[-1]}"
            worst[key] = float(((got - ref).abs() / ref).max())
            if keep:  # each row in the kernel's column order, arranged as the weight
                shape, perm = conv_sq_norms.weight_order(w_shape)
                kept = out[1].view(out[1].shape[0], *shape).permute(0, *[p + 1 for p in perm]).double()
                worst[key + ":grads"] = float((kept - ref_grads).abs().max() / ref_grads.abs().max())
    return worst


if __name__ == "__main__":
    from dpcompile import conv_sq_norms

    report = {"fp": errors(conv_sq_norms.launch, "cpu", [torch.float32, torch.float16]),
              "channels_last": errors(conv_sq_norms.launch, "cpu", [torch.float32], channels_last=True),
              "keep": errors(lambda *a: conv_sq_norms.launch(*a, keep=True), "cpu", [torch.float32],
                             channels_last=True, keep=True)}
    json.dump(report, sys.stdout)
