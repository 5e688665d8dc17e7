"""The unfold of a conv norm as one gather, compiled alone: time and write bandwidth on a GPU (BENCHMARKS.md,
"Vision after profiling"). v1: [N, C*k*k, L] from NCHW indices (what passes.conv_norms builds); v2: the same
entries as [N, L, k*k*C] from an NHWC view; v3: F.unfold. Each for contiguous and channels-last input, bf16 and fp32.

    python benchmarks/unfold_gather.py
"""
import torch, torch.nn.functional as F
from torch.utils.benchmark import Timer
def idx(kernel, L, stride, dil, dev):
    return [(torch.arange(k, device=dev)[:, None] * d + torch.arange(l, device=dev)[None, :] * s) for k, l, s, d in zip(kernel, L, stride, dil)]
def v1(x):  # NCHW-order gather
    xp = F.pad(x, (1, 1, 1, 1)); N, C = x.shape[:2]
    ih, iw = idx([3, 3], [32, 32], [1, 1], [1, 1], x.device)
    out = xp[:, :, ih.view(3, 1, 32, 1), iw.view(1, 3, 1, 32)]
    return out.reshape(N, C * 9, 1024)
def v2(x):  # NHWC-order gather: [N, Lh, Lw, kh, kw, C]
    xp = F.pad(x.permute(0, 2, 3, 1), (0, 0, 1, 1, 1, 1)); N, C = x.shape[:2]
    ih, iw = idx([3, 3], [32, 32], [1, 1], [1, 1], x.device)
    out = xp[:, ih.t().reshape(32, 1, 3, 1), iw.t().reshape(1, 32, 1, 3)]
    return out.reshape(N, 1024, 9 * C)
def v3(x):
    return F.unfold(x, 3, padding=1)
for name, f in (("v1", v1), ("v2", v2), ("v3", v3)):
    cf = torch.compile(f)
    for fmt in (torch.contiguous_format, torch.channels_last):
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(256, 64, 32, 32, device="cuda", dtype=dt).to(memory_format=fmt)
            cf(x); torch.cuda.synchronize()
            t = Timer("cf(x); torch.cuda.synchronize()", globals=dict(cf=cf, x=x, torch=torch)).blocked_autorange(min_run_time=0.3)
            gb = 256 * 1024 * 576 * x.element_size() / 1e9
            print(f"{name} {str(fmt)[14:]:18s} {str(dt)[6:]:9s} {t.median*1e3:.3f} ms  ({gb/t.median:.0f} GB/s written)")
