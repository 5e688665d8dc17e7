"""What the launches of dpcompile's Triton kernels share (dpcompile.conv_sq_norms, dpcompile.gram_sq_norms,
dpcompile.zero_rows, dpcompile.randn, dpcompile.add_randn): the operands' dtype in a kernel, launch arguments kept
per call signature, and the launch itself (a step repeats the same few calls, and these steps are launch-bound:
host time counts)."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

PLAN_LIMIT = 4096  # signatures kept per kernel: every batch size of a sampled batch is one


def kernel_dtype(x_dtype: torch.dtype, y_dtype: torch.dtype) -> torch.dtype:
    """The operands' dtype in a kernel: theirs when both are one of fp16, bf16, fp32; else fp32."""
    return x_dtype if x_dtype == y_dtype and x_dtype in (torch.float16, torch.bfloat16, torch.float32) else \
        torch.float32


def cached_plan(plans: dict, key: Any, make: Callable[[], Any]) -> Any:
    """plans[key], made by make() on a miss (plans emptied first when it holds PLAN_LIMIT)."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= PLAN_LIMIT:
            plans.clear()
        plan = plans[key] = make()
    return plan


# -- launches -----------------------------------------------------------------------------------------------------
# ``kernel[grid](*args, **consts)`` costs tens of microseconds of host time in Triton's launcher: it binds the
# arguments, specialises each (dtype, 16-byte alignment of a pointer, an integer's value class), hashes that into
# its cache key and looks the compiled kernel up, every launch. A GPT-2-small step calls dpcompile's kernels about
# 100 times (a Gram norm and a row mask per Linear) and such steps are launch-bound (one H100, cProfile of the bk
# step: 530 launches in 5 steps through Triton's launcher, 39 ms of host time under the profiler). ``launch``
# resolves that once per specialisation and then calls the compiled kernel's launcher directly, as Triton's own
# launcher does after its lookup.
_COMPILED_LIMIT = 4096
_COMPILED: dict = {}


def _spec(value: Any) -> Any:
    """What Triton specialises a launch argument on, exactly enough to tell its compiled kernels apart: a
    tensor's dtype, device and whether its address is 16-byte aligned; any other argument's value."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.device.index, value.data_ptr() % 16 == 0
    return value


def launch(kernel: Any, grid: tuple, args: tuple, consts: dict) -> None:
    """``kernel[grid](*args, **consts)`` (args positional, consts by name: constexprs and launch options), with
    Triton's lookup of the compiled kernel done once per specialisation of the arguments. CUDA tensors; under
    TRITON_INTERPRET=1, or for an object that is not a compiled Triton kernel (a test's recorder), the plain call."""
    key = (kernel, tuple(map(_spec, args)), tuple(consts.items()))
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **consts)
        entry = _direct(kernel, compiled, args, consts)
        if entry is not None:
            if len(_COMPILED) >= _COMPILED_LIMIT:
                _COMPILED.clear()
            _COMPILED[key] = entry
        return
    compiled, tail, device = entry
    full = (*args, *tail)
    stream = _stream(device)
    enter, leave = _hooks()
    meta = compiled.launch_metadata(grid, stream, *full) if enter is not None or leave is not None else None
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, meta, enter, leave, *full)


def _direct(kernel: Any, compiled: Any, args: tuple, consts: dict):
    """(compiled kernel, the constexpr arguments after the positional ones in signature order, device) for direct
    launches; None where that launcher is not there (the interpreter, a recorder, another Triton), or where the
    tensors are not on the current device (Triton loaded the kernel for the current one)."""
    names = getattr(kernel, "arg_names", None)
    if names is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata",
                                                                  "launch_metadata")):
        return None
    device = _device()
    if any(a.device.index != device for a in args if isinstance(a, torch.Tensor)):
        return None
    defaults = {p.name: p.default for p in kernel.params}
    tail = []
    for n in names[len(args):]:
        value = consts.get(n, defaults.get(n, inspect.Parameter.empty))
        if value is inspect.Parameter.empty:
            return None
        tail.append(value)
    return compiled, tuple(tail), device


def _device() -> int:
    return torch.cuda.current_device()


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _hooks():
    """Triton's launch hooks (set by its profiler, proton): passed on as its launcher does."""
    from triton import knobs

    return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
