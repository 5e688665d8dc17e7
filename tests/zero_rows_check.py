"""dpcompile::zero_rows_'s Triton kernel against masked_fill_ on the layouts the backward hands it. Run as a script
with TRITON_INTERPRET=1 (set before triton is imported: tests/test_zero_rows.py starts it in a process of its own)
it checks the kernel on CPU tensors; tests/test_gpu.py imports it for CUDA."""
from __future__ import annotations

import json

import torch


def _layouts(device: str, dtype: torch.dtype):
    """(name, x, dim, the storage x lives in): contiguous along each dim, channels-last, rows padded as Inductor
    pads them (the elements between rows must stay), a transposed view, samples innermost, a 1-D vector."""
    def t(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    base = t(6, 5, 7)
    yield "contiguous_dim0", base, 0, base
    base = t(6, 5, 7)
    yield "contiguous_dim1", base, 1, base
    base = t(6, 5, 7)
    yield "innermost", base, 2, base
    base = t(4, 3, 5, 6).to(memory_format=torch.channels_last)
    yield "channels_last", base, 0, base
    base = t(8, 2100)
    yield "padded_rows", base[:, :2050], 0, base  # runs longer than one block
    base = t(5, 9)
    yield "transposed", base.t(), 0, base
    base = t(6, 5, 7)
    yield "permuted", base.permute(2, 0, 1), 1, base
    base = t(9)
    yield "vector", base, 0, base


def mismatches(launch, device: str, dtypes) -> dict[str, int]:
    """Elements of each layout's whole storage that differ from masked_fill_'s (inf and NaN in kept and dropped
    rows alike), per layout and dtype."""
    from dpcompile import zero_rows

    torch.manual_seed(0)
    report = {}
    for dt in dtypes:
        for name, x, dim, base in _layouts(device, dt):
            flat = base.as_strided((base.numel(),), (1,))  # the storage, whatever the layout
            flat[1] = float("inf")
            flat[3] = float("nan")
            keep = torch.rand(x.shape[dim], device=device) > 0.5
            keep[0], keep[-1] = False, True
            if len(report) % 2:  # as the graph passes it: shaped [1, .., N, .., 1] like x, here every other entry
                wide = torch.stack([keep, ~keep], 1).reshape(-1)
                shape = [1] * x.dim()
                shape[dim] = x.shape[dim]
                stride = [1] * x.dim()
                stride[dim] = 2
                keep = wide.as_strided(shape, stride)
            want = base.clone(memory_format=torch.preserve_format)
            want_x = want.as_strided(x.shape, x.stride(), x.storage_offset() - base.storage_offset()
                                     + want.storage_offset())
            zero_rows.masked_fill(want_x, keep, dim)
            launch(x, keep, dim)
            same = (base == want) | (base.isnan() & want.isnan())
            report[f"{name}:{str(dt).split('.')[-1]}"] = int((~same).sum())
    return report


if __name__ == "__main__":
    from dpcompile import zero_rows

    print(json.dumps(mismatches(zero_rows.launch, "cpu", [torch.float32, torch.bfloat16])))
