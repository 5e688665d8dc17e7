"""Every Triton kernel dpcompile launches compiles for an H100 (sm_90 cubin), on a machine without a GPU.

The kernels' numerics are checked under TRITON_INTERPRET=1, which runs their Python: it accepts code that
Triton's compiler refuses (a global that is not a constexpr read inside a jit function passed the interpreter
and failed every GPU step). Here each module's own launch path runs on CPU tensors against a recorder that stands
in for dpcompile.triton_kernels; each recorded launch is then compiled by Triton's CUDA backend (ptxas included,
which ships with the triton wheel) with the same signature, constexprs and launch options.
"""
import importlib.util
import inspect
import os

import pytest
import torch

import dpcompile
from dpcompile import add_randn, conv_sq_norms, gram_sq_norms, randn, zero_rows

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from dpcompile import triton_kernels  # noqa: E402

# Under TRITON_INTERPRET=1 @triton.jit makes interpreter functions, which Triton's compiler cannot take (the
# suite sets it only in the kernel checks' subprocesses; CI runs this file)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiles real kernels: run without TRITON_INTERPRET=1")

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
           torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages")


def _kernels() -> dict[str, JITFunction]:
    """The kernels the modules launch: triton_kernels' jit functions named *_kernel (the rest are helpers)."""
    return {n: f for n, f in vars(triton_kernels).items() if isinstance(f, JITFunction) and n.endswith("_kernel")}


class _Recorder:
    """Stands in for dpcompile.triton_kernels: kernel[grid](*args, **kwargs) records the launch, runs nothing."""

    def __init__(self):
        self.launches: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name):
        if name not in _kernels():
            raise AttributeError(name)
        recorder = self

        class _Launch:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.launches.append((name, args, kwargs))

        return _Launch()


def _launches(monkeypatch, run) -> list[tuple[str, tuple, dict]]:
    rec = _Recorder()
    monkeypatch.setattr(dpcompile, "triton_kernels", rec)
    monkeypatch.setattr(zero_rows, "_kernels", lambda: (rec.zero_rows_kernel, rec.zero_rows_table_kernel))
    run()
    assert rec.launches, "the launch path launched no kernel"
    return rec.launches


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise AssertionError(f"no Triton type for a launch argument {value!r}")


def _compile(fn: JITFunction, args: tuple, kwargs: dict, specialise: bool = False, **overrides):
    """Triton's CUDA compile of one recorded launch, for sm_90: source -> ttir -> ttgir -> llir -> ptx -> cubin.
    specialise: as Triton's launcher specialises a real launch (pointers 16-byte aligned, an integer 1 a
    constant, a multiple of 16 known to be one)."""
    name = fn.__name__
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    bound.update(overrides)
    for p in fn.params:  # parameters the launch leaves at their defaults
        if p.name not in bound and p.default is not inspect.Parameter.empty:
            bound[p.name] = p.default
    assert set(bound) == set(fn.arg_names), (name, sorted(set(fn.arg_names) ^ set(bound)))
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = bound[p.name]
        if p.is_constexpr or (specialise and isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        else:
            signature[p.name] = _arg_type(value)
            if specialise and (isinstance(value, torch.Tensor) or (isinstance(value, int) and value % 16 == 0)):
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    assert compiled.asm.get("cubin"), f"{name}: no cubin"
    return compiled


def _add_randn_launches(monkeypatch, per_tensor):
    srcs = [torch.zeros(5000, dtype=torch.bfloat16), torch.zeros(3, 7), torch.zeros(9000)]
    outs = [torch.empty(s.shape, dtype=torch.float32) for s in srcs]
    seeds, scale = torch.tensor([1, 2], dtype=torch.int64), torch.tensor([0.5])
    return _launches(monkeypatch, lambda: add_randn.launch(srcs, outs, seeds, 1, scale, per_tensor=per_tensor))


def _conv_launches(monkeypatch, dtype):
    # a strided, padded, grouped 3x3 convolution: e [B, Cout, OH, OW], x [B, Cin, H, W]
    e, x = torch.zeros(2, 8, 4, 4, dtype=dtype), torch.zeros(2, 4, 8, 8, dtype=dtype)
    return _launches(monkeypatch, lambda: conv_sq_norms.launch(e, x, (8, 2, 3, 3), (2, 2), (1, 1), (1, 1), 2, 1))


def _gram_launches(monkeypatch, dtype, wide=16):
    a, g = torch.zeros(2, 40, 24, dtype=dtype), torch.zeros(2, 40, wide, dtype=dtype)
    return _launches(monkeypatch, lambda: gram_sq_norms.launch(a, g))


def _gram_table_launches(monkeypatch, dtype):
    pairs = [(torch.zeros(2, 40, 24, dtype=dtype), torch.zeros(2, 40, 16, dtype=dtype)) for _ in range(2)]
    return _launches(monkeypatch, lambda: gram_sq_norms.launch_group([a for a, _ in pairs], [g for _, g in pairs]))


CASES = {
    "gram_table_fp32": lambda mp: _gram_table_launches(mp, torch.float32),
    "gram_table_bf16": lambda mp: _gram_table_launches(mp, torch.bfloat16),
    "randn": lambda mp: _launches(mp, lambda: randn.launch(torch.tensor([3], dtype=torch.int64), 0, 10000)),
    "add_randn_table": lambda mp: _add_randn_launches(mp, per_tensor=False),
    "add_randn_per_tensor": lambda mp: _add_randn_launches(mp, per_tensor=True),
    "conv_fp32": lambda mp: _conv_launches(mp, torch.float32),
    "conv_bf16": lambda mp: _conv_launches(mp, torch.bfloat16),
    "gram_fp32": lambda mp: _gram_launches(mp, torch.float32),
    "gram_bf16": lambda mp: _gram_launches(mp, torch.bfloat16),
    "gram_split_bf16": lambda mp: _gram_launches(mp, torch.bfloat16, wide=3 * gram_sq_norms.SPLIT_K - 5),
    "zero_rows": lambda mp: _launches(mp, lambda: zero_rows.launch(torch.zeros(4, 3, 6), torch.tensor(
        [True, False, True]), 1)),
    "zero_rows_table": lambda mp: _launches(mp, lambda: zero_rows.launch_table(
        [torch.zeros(4, 3, 6), torch.zeros(5, 3, dtype=torch.bfloat16)],
        [torch.tensor([True, False, True]), torch.ones(5, 1, dtype=torch.bool)], [1, 0])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_launched_kernels_compile_for_sm90(case, monkeypatch):
    for name, args, kwargs in CASES[case](monkeypatch):
        _compile(_kernels()[name], args, kwargs)
        if kwargs.get("PRECISION") == "ieee":  # on a GPU, fp32 takes tf32 where torch allows it
            _compile(_kernels()[name], args, kwargs, PRECISION="tf32")
        if name == "add_randn_kernel":  # the special-function-unit transform benchmarks/noise_kernel.py times
            _compile(_kernels()[name], args, kwargs, APPROX=True)


def test_table_gram_kernel_loads_operands_as_wide_as_the_one_contraction_kernel(monkeypatch):
    """The table kernel reads its operands' addresses from memory, which tells Triton nothing of their alignment:
    with ALIGNED it asserts 16 bytes (tl.multiple_of) and its loads are the one-contraction kernel's (16-byte
    asynchronous copies into shared memory); without, they are scalar. GPT-2's MLP in bf16."""
    import re

    a, g = torch.zeros(2, 256, 768, dtype=torch.bfloat16), torch.zeros(2, 256, 3072, dtype=torch.bfloat16)

    def wide_copies(ptx: str) -> int:
        return len(re.findall(r"cp\.async\.cg\.shared\.global", ptx))  # .cg: 16-byte copies only

    (single,) = _launches(monkeypatch, lambda: gram_sq_norms.launch(a, g))
    (table,) = _launches(monkeypatch, lambda: gram_sq_norms.launch_group([a, a], [g, g]))
    assert table[2]["ALIGNED"], table
    want = wide_copies(_compile(_kernels()[single[0]], single[1], single[2], specialise=True).asm["ptx"])
    assert want > 0
    kernel = _kernels()[table[0]]
    assert wide_copies(_compile(kernel, table[1], table[2], specialise=True).asm["ptx"]) == want
    assert wide_copies(_compile(kernel, table[1], table[2], specialise=True, ALIGNED=False).asm["ptx"]) == 0


def test_every_kernel_has_a_compile_case(monkeypatch):
    launched = {name for case in CASES.values() for name, _, _ in case(monkeypatch)}
    assert launched == set(_kernels()), f"kernels no case launches: {sorted(set(_kernels()) - launched)}"


def test_a_kernel_reading_a_plain_global_fails_to_compile(tmp_path):
    """What this file guards against, shown: the compiler refuses a global that is not a constexpr."""
    (tmp_path / "bad_kernels.py").write_text(
        "import triton\nimport triton.language as tl\nSCALE = 0.5\n\n\n@triton.jit\n"
        "def bad_kernel(x_ptr):\n    tl.store(x_ptr, tl.load(x_ptr) * SCALE)\n")
    spec = importlib.util.spec_from_file_location("bad_kernels", tmp_path / "bad_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(Exception, match="global variable SCALE"):
        _compile(mod.bad_kernel, (torch.zeros(1),), {})
