"""kernel_plans.launch: Triton's lookup of the compiled kernel done once per specialisation, then its launcher
called directly (a launch-bound step's host time). Here against a stand-in for a Triton kernel and its compiled
kernel, so that it runs without a GPU; tests/test_gpu.py runs dpcompile's kernels through it on CUDA."""
import inspect

import pytest
import torch

from dpcompile import kernel_plans


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Compiled:
    """Records direct launches as Triton's launcher is called: grid, stream, function, metadata, hooks, args."""

    def __init__(self, tag):
        self.tag, self.function, self.packed_metadata, self.runs = tag, f"fn-{tag}", f"meta-{tag}", []

    def launch_metadata(self, grid, stream, *args):
        return ("launch-metadata", grid)

    def run(self, *call):
        self.runs.append(call)


class _Kernel:
    """kernel[grid](*args, **kwargs) as a JITFunction: compiles one _Compiled per specialisation it is handed."""

    arg_names = ["x", "n", "BLOCK", "FLAG"]
    params = [_Param("x"), _Param("n"), _Param("BLOCK"), _Param("FLAG", False)]

    def __init__(self):
        self.slow = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow.append((grid, args, kwargs))
            return _Compiled(len(self.slow))
        return run


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_plans, "_COMPILED", {})
    monkeypatch.setattr(kernel_plans, "_stream", lambda device: f"stream-{device}")
    monkeypatch.setattr(kernel_plans, "_device", lambda: None)  # CPU tensors' device index
    monkeypatch.setattr(kernel_plans, "_hooks", lambda: (None, None))


def test_second_launch_calls_the_compiled_kernel_directly(fresh):
    k = _Kernel()
    x = torch.zeros(64)
    kernel_plans.launch(k, (5,), (x, 7), {"BLOCK": 128, "num_warps": 8})
    assert len(k.slow) == 1 and k.slow[0] == ((5,), (x, 7), {"BLOCK": 128, "num_warps": 8})
    kernel_plans.launch(k, (6, 2), (x, 7), {"BLOCK": 128, "num_warps": 8})
    assert len(k.slow) == 1  # no second lookup
    (compiled, tail, device), = kernel_plans._COMPILED.values()
    # the constexprs after the positional arguments, in signature order, defaults included; launch options not
    assert tail == (128, False) and device is None
    assert compiled.runs == [(6, 2, 1, "stream-None", "fn-1", "meta-1", None, None, None, x, 7, 128, False)]


def test_each_specialisation_is_looked_up_once(fresh):
    """A new dtype, a pointer that is not 16-byte aligned, another integer or constexpr: Triton may compile another
    kernel for it, so it goes through Triton's launcher (once) again."""
    k = _Kernel()
    base = torch.zeros(64)
    calls = [((base, 7), {"BLOCK": 128}), ((base.double(), 7), {"BLOCK": 128}), ((base[1:], 7), {"BLOCK": 128}),
             ((base, 8), {"BLOCK": 128}), ((base, 7), {"BLOCK": 64}), ((base, 7), {"BLOCK": 128, "FLAG": True})]
    for args, consts in calls + calls:
        kernel_plans.launch(k, (1,), args, consts)
    assert len(k.slow) == len(calls) == len(kernel_plans._COMPILED)
    assert [len(c.runs) for c, _, _ in kernel_plans._COMPILED.values()] == [1] * len(calls)
    assert base[1:].data_ptr() % 16 != 0


def test_a_plan_id_stands_for_the_other_arguments(fresh):
    """With a plan id (kernel_plans.launch_id: a cached plan's promise that its integers and constexprs are the
    same), a launch is looked up by the id and its tensors' dtype, device and alignment: a tensor at a pointer
    that is not 16-byte aligned, or another plan, still goes through Triton's launcher once."""
    k = _Kernel()
    base = torch.zeros(64)
    plan, other = kernel_plans.launch_id(), kernel_plans.launch_id()
    calls = [((base, 7), {"BLOCK": 128}, plan), ((base[1:], 7), {"BLOCK": 128}, plan),
             ((base.double(), 7), {"BLOCK": 128}, plan), ((base, 8), {"BLOCK": 64}, other)]
    for args, consts, plan_id in calls + calls:
        kernel_plans.launch(k, (1,), args, consts, plan_id)
    assert len(k.slow) == len(calls) == len(kernel_plans._COMPILED)
    runs = [c.runs for c, _, _ in kernel_plans._COMPILED.values()]
    assert [len(r) for r in runs] == [1] * len(calls)
    assert runs[3][0][-4:] == (base, 8, 64, False)  # the other plan's arguments, its constexprs after them
    assert plan != other and kernel_plans.launch_id() > other


def test_hooks_get_the_launch_metadata(fresh, monkeypatch):
    monkeypatch.setattr(kernel_plans, "_hooks", lambda: ("enter", None))
    k = _Kernel()
    x = torch.zeros(4)
    for _ in range(2):
        kernel_plans.launch(k, (2,), (x, 1), {"BLOCK": 16})
    (compiled, _, _), = kernel_plans._COMPILED.values()
    assert compiled.runs[0][6:9] == (("launch-metadata", (2,)), "enter", None)


def test_empty_hook_chains_are_passed_as_none(monkeypatch):
    """Triton's knobs hold hook chains, never None: an empty one is passed as None (no launch metadata built, no
    empty chain called per launch); one its profiler added to is passed on."""
    knobs = pytest.importorskip("triton.knobs")
    enter, leave = knobs.HookChain(), knobs.HookChain(reversed=True)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", enter)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", leave)
    assert kernel_plans._hooks() == (None, None)
    enter.add(print)
    assert kernel_plans._hooks() == (enter, None)


def test_tensors_off_the_current_device_take_the_plain_call(fresh, monkeypatch):
    """Triton loads a compiled kernel for the current device: tensors on another one are never launched directly."""
    monkeypatch.setattr(kernel_plans, "_device", lambda: 0)
    k = _Kernel()
    for _ in range(2):
        kernel_plans.launch(k, (1,), (torch.zeros(4), 1), {"BLOCK": 16})
    assert len(k.slow) == 2 and not kernel_plans._COMPILED


def test_objects_that_are_not_compiled_kernels_always_take_the_plain_call(fresh):
    """The interpreter and the sm_90 compile test's recorder return no compiled kernel: every call is the plain
    kernel[grid](...) call."""
    class Plain(_Kernel):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.slow.append(args)

    k = Plain()
    for _ in range(3):
        kernel_plans.launch(k, (1,), (torch.zeros(4), 1), {"BLOCK": 16})
    assert len(k.slow) == 3 and not kernel_plans._COMPILED


def test_address_tables_hold_the_entries_as_given():
    """dpcompile.address_tables (the noise's and the row masks' tables): the int64 entries in order, 64-bit
    values intact; an empty table; while launches are recorded, a table of the right size without addresses."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpcompile import address_tables

    entries = [0, -3, 2 ** 40 + 7, 2 ** 63 - 1, 5]
    assert address_tables.table(entries, torch.device("cpu")).tolist() == entries
    assert address_tables.host_table([]).shape == (0,)
    with FakeTensorMode(), kernel_plans.recording():
        recorded = address_tables.table(entries, torch.device("cpu"))
    assert recorded.shape == (5,) and recorded.dtype == torch.int64
