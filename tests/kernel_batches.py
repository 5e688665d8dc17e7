"""The tests' Inductor C++ kernels built one translation unit per generated module instead of one per kernel.

CI time: g++ spends about 0.45 s of every kernel's build on what the prefix header instantiates at the end of a
translation unit (the precompiled header cannot keep that) and 0.15 s linking, against 0.1-0.3 s on the kernel's
own code; the default tier builds some 1500 kernels in 350 modules. Here the kernels a module asks for
(``AsyncCompile.cpp_pybinding``) are collected and built together when the module waits for them (or its first
kernel runs): each kernel's code as Inductor generated it, in a namespace of its own, and one Python entry per
kernel. What the kernels compute and how the module calls them are Inductor's; only how they are packed into
shared libraries differs. A kernel whose code has anything a shared translation unit could mix up (another
include, a macro, an entry point not in the expected form) is built as Inductor builds it, and so is every kernel
of a module whose shared build fails.

``DPCOMPILE_TEST_KERNEL_BATCHES=0`` builds every kernel as Inductor does."""
from __future__ import annotations

import os
import re

ENV = "DPCOMPILE_TEST_KERNEL_BATCHES"
PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>"
_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\(')
_C_TYPES = {"float", "double", "int64_t", "uintptr_t"}  # the scalar arguments Inductor's bindings take by value


class _Batch:
    """The kernels of one module, built together on first use."""

    def __init__(self):
        self.kernels: list[tuple[list[str], str]] = []
        self.functions = None

    def add(self, argtypes: list[str], source: str) -> "_Pending":
        self.kernels.append((list(argtypes), source))
        return _Pending(self, len(self.kernels) - 1)

    def function(self, index: int):
        if self.functions is None:
            from torch._inductor.codecache import CppPythonBindingsCodeCache

            try:
                module = CppPythonBindingsCodeCache.load(translation_unit(self.kernels), "cpu")
                self.functions = [getattr(module, f"kernel_{i}") for i in range(len(self.kernels))]
            except Exception:  # noqa: BLE001 - kernels that do not build together: each as Inductor builds it
                self.functions = [CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
                                  for argtypes, source in self.kernels]
        return self.functions[index]


class _Pending:
    """A kernel of a batch, callable before its module's wait replaces it with the built function."""

    def __init__(self, batch: _Batch, index: int):
        self.batch, self.index = batch, index

    def resolve(self):
        return self.batch.function(self.index)

    def __call__(self, *args):
        return self.resolve()(*args)


def batchable(argtypes: list[str], source: str) -> bool:
    """Whether the kernel's code can share a translation unit: the prefix included once, no other preprocessor
    line outside function bodies' pragmas, one entry point in the form Inductor writes, argument types the
    binding below knows."""
    body = source.replace(PREFIX, "", 1)
    if PREFIX not in source or any(line.lstrip().startswith("#") and not line.lstrip().startswith("#pragma")
                                   for line in body.splitlines()):
        return False
    if len(_ENTRY.findall(body)) != 1:
        return False
    return all(_bare(t).endswith("*") or _bare(t) in _C_TYPES for t in argtypes)


def _bare(argtype: str) -> str:
    """An argument type without its const (the binding passes both alike)."""
    return argtype.replace("const ", "").strip()


def _argument(argtype: str, n: int) -> str:
    t = _bare(argtype)
    if t.endswith("*"):
        return f"static_cast<{t}>(tensor_data(PyTuple_GET_ITEM(args, {n})))"
    if t in ("float", "double"):
        return f"static_cast<{t}>(checked(PyFloat_AsDouble(PyTuple_GET_ITEM(args, {n}))))"
    if t == "uintptr_t":
        return f"reinterpret_cast<uintptr_t>(checked(PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, {n}))))"
    return f"static_cast<int64_t>(checked(PyLong_AsSsize_t(PyTuple_GET_ITEM(args, {n}))))"


def translation_unit(kernels: list[tuple[list[str], str]]) -> str:
    """The kernels' code, each in namespace k<i> with its entry point's C linkage dropped, and a Python module
    "kernel" with an entry kernel_<i> per kernel (arguments as Inductor's own binding reads them: tensors by
    their data pointer, which torch hands the module through _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR)."""
    parts = [PREFIX]
    for i, (_, source) in enumerate(kernels):
        body = _ENTRY.sub("void kernel(", source.replace(PREFIX, "", 1), count=1)
        parts.append(f"namespace k{i} {{\n{body}\n}}  // namespace k{i}")
    parts.append("""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>

static void* (*tensor_data)(PyObject*);

template <typename T> static T checked(T value) {
    if (PyErr_Occurred()) throw std::runtime_error("a kernel argument of the wrong type");
    return value;
}
""")
    methods = []
    for i, (argtypes, _) in enumerate(kernels):
        call = ", ".join(_argument(t, n) for n, t in enumerate(argtypes))
        parts.append(f"""
static PyObject* kernel_{i}_py(PyObject*, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {len(argtypes)})
            throw std::runtime_error("kernel_{i} takes {len(argtypes)} arguments");
        k{i}::kernel({call});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }}
}}""")
        methods.append(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},')
    parts.append("static PyMethodDef methods[] = {\n" + "\n".join(methods) + "\n    {nullptr, nullptr, 0, nullptr}};")
    parts.append("""
static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "kernel", nullptr, -1, methods};

PyMODINIT_FUNC PyInit_kernel(void) {
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    char* end = nullptr;
    errno = 0;
    uintptr_t value = address ? std::strtoull(address, &end, 10) : 0;
    if (!address || errno != 0 || end == address || value == 0) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }
    tensor_data = reinterpret_cast<void* (*)(PyObject*)>(value);
    return PyModule_Create(&module_def);
}
""")
    return "\n".join(parts)


def install() -> None:
    """Batches the kernels of every module Inductor generates from here on (unless ``DPCOMPILE_TEST_KERNEL_BATCHES``
    is 0, or this torch's AsyncCompile lacks the two methods)."""
    from torch._inductor.async_compile import AsyncCompile

    if os.environ.get(ENV, "1") == "0" or getattr(AsyncCompile, "_dpcompile_batches", False):
        return
    if not (callable(getattr(AsyncCompile, "cpp_pybinding", None)) and callable(getattr(AsyncCompile, "wait", None))):
        return
    cpp_pybinding, wait = AsyncCompile.cpp_pybinding, AsyncCompile.wait

    def batched_cpp_pybinding(self, argtypes, source_code):
        if not batchable(argtypes, source_code):
            return cpp_pybinding(self, argtypes, source_code)
        batch = self.__dict__.get("_dpcompile_batch")
        if batch is None or batch.functions is not None:  # a module's kernels after it was built: a new batch
            batch = self.__dict__["_dpcompile_batch"] = _Batch()
        return batch.add(argtypes, source_code)

    def batched_wait(self, scope):
        for name, value in list(scope.items()):
            if isinstance(value, _Pending):
                scope[name] = value.resolve()
        return wait(self, scope)

    AsyncCompile.cpp_pybinding, AsyncCompile.wait = batched_cpp_pybinding, batched_wait
    AsyncCompile._dpcompile_batches = True
