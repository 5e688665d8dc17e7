"""dpcompile::zero_rows_'s Triton kernel against masked_fill_ on the layouts the backward hands it. Run as a script
with TRITON_INTERPRET=1 (set before triton is imported: tests/test_zero_rows.py starts it in a process of its own)
it checks the kernel on CPU tensors; tests/test_gpu.py imports it for CUDA."""
from __future__ import annotations

import json

import torch


def _layouts(device: str, dtype: torch.dtype):
    """(name, x, dim, the storage x lives in): contiguous along each dim, channels-last, rows padded as Inductor
    pads them (the elements between rows must stay), a transposed view, samples innermost, a 1-D vector, more
    rows than zero_rows.ROWS."""
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
    base = t(600, 3)
    yield "many_rows", base, 0, base  # more rows than one program of the table kernel takes


def _cases(device: str, dtypes):
    """(name, x, keep, dim, base, what base must become) for each layout and dtype: inf and NaN in kept and
    dropped rows alike; keep as a vector, or (every other case) shaped [1, .., N, .., 1] like x as the graph
    passes it, here every other entry of a wider tensor."""
    from dpcompile import zero_rows

    torch.manual_seed(0)
    k = 0
    for dt in dtypes:
        for name, x, dim, base in _layouts(device, dt):
            flat = base.as_strided((base.numel(),), (1,))  # the storage, whatever the layout
            flat[1] = float("inf")
            flat[3] = float("nan")
            keep = torch.rand(x.shape[dim], device=device) > 0.5
            keep[0], keep[-1] = False, True
            if k % 2:
                wide = torch.stack([keep, ~keep], 1).reshape(-1)
                shape = [1] * x.dim()
                shape[dim] = x.shape[dim]
                stride = [1] * x.dim()
                stride[dim] = 2
                keep = wide.as_strided(shape, stride)
            k += 1
            want = base.clone(memory_format=torch.preserve_format)
            want_x = want.as_strided(x.shape, x.stride(), x.storage_offset() - base.storage_offset()
                                     + want.storage_offset())
            zero_rows.masked_fill(want_x, keep, dim)
            yield f"{name}:{str(dt).split('.')[-1]}", x, keep, dim, base, want


def _differ(base: torch.Tensor, want: torch.Tensor) -> int:
    same = (base == want) | (base.isnan() & want.isnan())
    return int((~same).sum())


def mismatches(launch, device: str, dtypes) -> dict[str, int]:
    """Elements of each layout's whole storage that differ from masked_fill_'s, per layout and dtype, each
    zeroed by its own call launch(x, keep, dim)."""
    report = {}
    for name, x, keep, dim, base, want in _cases(device, dtypes):
        launch(x, keep, dim)
        report[name] = _differ(base, want)
    return report


def table_mismatches(launch_table, device: str, dtypes) -> dict[str, int]:
    """The same, every layout and dtype zeroed by one call launch_table(xs, keeps, dims)."""
    cases = list(_cases(device, dtypes))
    launch_table([c[1] for c in cases], [c[2] for c in cases], [c[3] for c in cases])
    return {name: _differ(base, want) for name, _x, _keep, _dim, base, want in cases}


if __name__ == "__main__":
    from dpcompile import zero_rows

    dtypes = [torch.float32, torch.bfloat16]
    report = {f"one:{k}": v for k, v in mismatches(zero_rows.launch, "cpu", dtypes).items()}
    report.update({f"table:{k}": v for k, v in table_mismatches(zero_rows.launch_table, "cpu", dtypes).items()})
    print(json.dumps(report))
