"""The test suite's packing of Inductor's C++ kernels (kernel_batches.py): one build per generated module, the
kernels' results unchanged, and Inductor's own build for code a shared translation unit could mix up."""
import os

import pytest
import torch

import kernel_batches

SOURCE = kernel_batches.PREFIX + """
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0)
{
    for (int64_t x0 = 0; x0 < ks0; x0 += 1) out_ptr0[x0] = in_ptr0[x0] + 1.0f;
}
"""


@pytest.mark.parametrize("change,takes", [
    (lambda s: s, True),
    (lambda s: s.replace(kernel_batches.PREFIX, kernel_batches.PREFIX + "\n#include <cmath>"), False),
    (lambda s: s.replace("extern", "#define ONE 1\nextern"), False),
    (lambda s: s.replace('extern "C"  void  kernel', "void kernel"), False),  # no entry point in Inductor's form
    (lambda s: s + s.replace(kernel_batches.PREFIX, ""), False),  # two entry points
    (lambda s: s.replace(kernel_batches.PREFIX, ""), False),  # no prefix
])
def test_only_code_in_inductors_form_is_batched(change, takes):
    assert kernel_batches.batchable(["const float*", "float*", "const int64_t"], change(SOURCE)) is takes
    assert not kernel_batches.batchable(["const float*", "float*", "at::Half"], SOURCE)  # a type it cannot read


@pytest.mark.skipif(os.environ.get(kernel_batches.ENV) == "0", reason=f"{kernel_batches.ENV}=0: Inductor's builds")
def test_a_modules_kernels_are_built_once_together_and_compute_what_eager_does(monkeypatch):
    from torch._inductor import config
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    kernel_batches.install()  # (conftest did; a second call changes nothing)
    builds = []
    load = CppPythonBindingsCodeCache.load

    def counted(cls, code, *args, **kwargs):
        builds.append(code)
        return load.__func__(cls, code, *args, **kwargs)

    monkeypatch.setattr(CppPythonBindingsCodeCache, "load", classmethod(counted))

    def f(x, w, n):  # kernels before and after a contraction (an extern call between them), integer arguments
        y = torch.softmax((x.sin() * n) @ w, dim=-1)
        return y.sum(0), (x.abs() + 0.5).log().cumsum(1), y.max()

    x, w = torch.randn(7, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    with config.patch(fx_graph_cache=False):
        out = torch.compile(f, backend="inductor", dynamic=True)(x, w, 3)
    torch.testing.assert_close(out, f(x, w, 3))
    assert len(builds) == 1, builds  # one build held the module's kernels
    assert "namespace k1 " in builds[0] and builds[0].count("k0::kernel(") == 1 and "PyInit_kernel" in builds[0]


def test_kernels_that_do_not_build_together_are_built_one_by_one():
    """A shared build that fails (here: two kernels whose code defines the same C symbol) falls back to Inductor's
    build of each kernel, which runs."""
    clash = SOURCE.replace("extern \"C\"  void  kernel", 'extern "C" int clash_symbol = 1;\nextern "C"  void  kernel')
    batch = kernel_batches._Batch()
    first, second = batch.add(["const float*", "float*", "const int64_t"], clash), \
        batch.add(["const float*", "float*", "const int64_t"], clash.replace("+ 1.0f", "+ 2.0f"))
    x, out = torch.arange(4.0), torch.zeros(4)
    first(x, out, 4)
    torch.testing.assert_close(out, x + 1)
    second(x, out, 4)
    torch.testing.assert_close(out, x + 2)
    assert [f.__name__ for f in batch.functions] == ["kernel", "kernel"]  # Inductor's entries, not kernel_<i>
