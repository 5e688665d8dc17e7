"""What the launches of dpcompile's Triton kernels share (dpcompile.conv_sq_norms, dpcompile.gram_sq_norms,
dpcompile.zero_rows, dpcompile.randn, dpcompile.add_randn): the operands' dtype in a kernel, launch arguments kept
per call signature, and the launch itself (a step repeats the same few calls, and these steps are launch-bound:
host time counts)."""
from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
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
        return value.dtype, value.get_device(), value.data_ptr() % 16 == 0
    return value


_LAUNCH_IDS = itertools.count(1)


def launch_id() -> int:
    """A number that stands for one kernel's non-tensor arguments and constexprs in ``launch``: a cached plan
    makes one, and its launches are then looked up by it and their tensors' specialisations only. The full key
    (every argument's and constexpr's value) took 20 us of a Gram norm launch's host time on a CPU core of the
    CI machine, this one 4. Never reused: a new plan for the same values gets a new number (one more lookup)."""
    return next(_LAUNCH_IDS)


def launch(kernel: Any, grid: tuple, args: tuple, consts: dict, plan_id: int | None = None) -> None:
    """``kernel[grid](*args, **consts)`` (args positional, consts by name: constexprs and launch options), with
    Triton's lookup of the compiled kernel done once per specialisation of the arguments. CUDA tensors; under
    TRITON_INTERPRET=1, or for an object that is not a compiled Triton kernel (a test's recorder), the plain call.
    Inside ``recording()`` the launch is recorded, not made. ``plan_id`` (``launch_id()``): the caller's promise
    that every launch with it has the same non-tensor arguments and consts."""
    calls = _RECORDING.calls
    if calls is not None:
        calls.append((kernel, grid, args, consts))
        return
    if plan_id is None:
        key = (kernel, tuple(map(_spec, args)), tuple(consts.items()))
    else:
        key = (kernel, plan_id, *[_spec(a) for a in args if isinstance(a, torch.Tensor)])
    entry = _COMPILED.get(key)
    if entry is None:
        full = key if plan_id is None else (kernel, tuple(map(_spec, args)), tuple(consts.items()))
        pending = _PENDING.pop(full, None)
        if pending is not None:  # its compile, started by precompile(); a failed one is redone (and raises) below
            pending.exception()
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


_RUNTIME_KNOBS: list = []  # triton.knobs.runtime, once imported (an import statement per launch costs host time)


def _hooks():
    """Triton's launch hooks (set by its profiler, proton), passed on as its launcher does; None for a hook chain
    with nothing in it (Triton's knobs hold a chain object, never None, so its own launcher builds each launch's
    metadata and calls the empty chains: host time for nothing)."""
    if not _RUNTIME_KNOBS:
        from triton import knobs

        _RUNTIME_KNOBS.append(knobs.runtime)
    runtime = _RUNTIME_KNOBS[0]
    return _hook(runtime.launch_enter_hook), _hook(runtime.launch_exit_hook)


def _hook(hook):
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


# -- compiles ahead of the first launch ---------------------------------------------------------------------------
# Triton compiles a kernel at its first launch, one specialisation at a time, while the step waits: the Gram norm
# kernel specialises on its operands' widths, so a GPT-2 step's first backward compiled four of them in a row
# (about 2 s each for fp32 on a CPU core), after Inductor's compile of the same graphs. ``precompile`` starts
# those compiles in threads as soon as the graphs are known (dpcompile.precompile: from the partitioned graphs,
# on by default), beside Inductor's compile; Triton's compile spends most of its time outside the GIL (MLIR passes,
# ptxas: four Gram kernels in 4.3 s one after another, 2.7 s in threads on two CPU cores).
class _Recording(threading.local):
    calls: list | None = None  # a class default: launch() reads it every launch, and a missed getattr costs more


_RECORDING = _Recording()
_PENDING: dict = {}  # launch key -> Future of its compile
_POOL: list = []


@contextlib.contextmanager
def recording():
    """``launch`` records ``(kernel, grid, args, consts)`` into the yielded list instead of launching (this
    thread only): the launches a call of a kernel module would make, with fake tensors as its operands."""
    previous = _RECORDING.calls
    _RECORDING.calls = calls = []
    try:
        yield calls
    finally:
        _RECORDING.calls = previous


def is_recording() -> bool:
    return _RECORDING.calls is not None


def _aligned_spec(value: Any) -> Any:
    """_spec of a tensor at a 16-byte aligned address (what the caching allocator hands out), from its dtype and
    device alone: the recorded operands are fake."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.get_device(), True
    return value


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)),
                                        thread_name_prefix="dpcompile-precompile"))
    return _POOL[0]


def _warm(kernel: Any, device: int, args: tuple, consts: dict) -> None:
    # the CUDA device is per thread: Triton compiles for, and caches under, the current one
    if device is not None:
        torch.cuda.set_device(device)
    kernel.warmup(*args, grid=(1,), **consts)


def precompile(calls: list) -> int:
    """Starts compiling, in background threads, the kernels that ``calls`` (recorded launches, tensors at aligned
    addresses) will need; ``launch`` waits for a pending compile of its key. Returns how many it started: none for
    a key compiled or pending already. A compile that fails costs nothing: the launch compiles (and raises) itself."""
    started = 0
    for kernel, _grid, args, consts in calls:
        specs = tuple(map(_aligned_spec, args))
        key = (kernel, specs, tuple(consts.items()))
        if key in _COMPILED or key in _PENDING or not hasattr(kernel, "warmup"):
            continue
        device = next((s[1] for a, s in zip(args, specs) if isinstance(a, torch.Tensor)), None)
        # tensors as their dtypes: Triton's warmup stands in a tensor at address 0 (aligned) for each
        warm_args = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args)
        _PENDING[key] = _pool().submit(_warm, kernel, device, warm_args, consts)
        started += 1
    return started


def wait_for_precompiles() -> None:
    """Blocks until every compile ``precompile`` started has finished (tests, benchmarks)."""
    for future in list(_PENDING.values()):
        future.exception()
