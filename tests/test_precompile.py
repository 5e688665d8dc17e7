"""dpcompile.precompile: the launches of a graph's kernel ops made out from their fake values, and compiled in
background threads before the first launch (kernel_plans.precompile). Without a GPU: graphs whose values are
fake CUDA tensors, and a stand-in kernel; tests/test_gpu.py checks that a real launch finds the compiled kernel."""
import threading
import time

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcompile import add_randn, conv_sq_norms, gram_sq_norms, kernel_plans, precompile, randn, zero_rows

ops = torch.ops.dpcompile


def _graph(target, *operands, extra=()):
    """A graph of one call: target(placeholders..., *extra), each placeholder's meta value a fake CUDA tensor
    like the CPU tensor given; extra, where callable, makes the call's arguments from the placeholders."""
    if callable(extra):
        return precompile.op_graph(target, *operands, device="cuda", arrange=extra)
    return precompile.op_graph(target, *operands, extra=extra, device="cuda")


def _describe(launches):
    """kernel name, grid, each argument (a tensor as its dtype), consts: what decides a compile"""
    return [(k.__name__ if hasattr(k, "__name__") else k.fn.__name__, grid,
             tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args), consts)
            for k, grid, args, consts in launches]


def _direct(run):
    with kernel_plans.recording() as calls:
        run()
    return calls


# each: (CPU operands, the op's other arguments (or a function making all its arguments from the placeholders),
# the op, its launch code on the operands)
CASES = {
    # gram: an fp32 pair, and a bf16 pair wide enough to be split into pieces
    "gram_fp32": lambda: ((torch.zeros(3, 40, 24), torch.zeros(3, 40, 16)), (), ops.gram_sq_norms.default,
                          lambda a, g: gram_sq_norms.launch(a, g)),
    "gram_split_bf16": lambda: ((torch.zeros(2, 8, 24, dtype=torch.bfloat16),
                                 torch.zeros(2, 8, 3 * gram_sq_norms.SPLIT_K - 5, dtype=torch.bfloat16)), (),
                                ops.gram_sq_norms.default, lambda a, g: gram_sq_norms.launch(a, g)),
    # bk's grouped Gram norms: two signatures (one of them twice), so two launches of the table kernel
    "gram_group": lambda: ((torch.zeros(3, 40, 24), torch.zeros(3, 40, 16), torch.zeros(3, 40, 24),
                            torch.zeros(3, 40, 16), torch.zeros(3, 9, 8, dtype=torch.bfloat16),
                            torch.zeros(3, 9, 40, dtype=torch.bfloat16)), lambda n: (n[0::2], n[1::2]),
                           ops.gram_sq_norms_group.default,
                           lambda *t: gram_sq_norms.launch_group(list(t[0::2]), list(t[1::2]))),
    "conv": lambda: ((torch.zeros(2, 8, 4, 4), torch.zeros(2, 4, 8, 8)),
                     ([8, 2, 3, 3], [2, 2], [1, 1], [1, 1], 2, 1), ops.conv_weight_sq_norms.default,
                     lambda e, x: conv_sq_norms.launch(e, x, [8, 2, 3, 3], [2, 2], [1, 1], [1, 1], 2, 1)),
    "zero_rows": lambda: ((torch.zeros(4, 3, 6), torch.ones(3, dtype=torch.bool)), lambda n: ([n[0]], [n[1]], [1]),
                          ops.zero_rows_.default, lambda x, keep: zero_rows.launch(x, keep, 1)),
    "zero_rows_table": lambda: ((torch.zeros(4, 3, 6), torch.ones(3, dtype=torch.bool), torch.zeros(
        5, 2, dtype=torch.bfloat16), torch.ones(5, 1, dtype=torch.bool)), lambda n: (n[0::2], n[1::2], [1, 0]),
        ops.zero_rows_.default,
        lambda x, keep, y, keep_y: zero_rows.launch_table([x, y], [keep, keep_y], [1, 0])),
    "randn": lambda: ((torch.tensor([3, 4]),), (1, 10000), ops.randn.default,
                      lambda seeds: randn.launch(seeds, 1, 10000)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_launches_are_the_launch_codes_own(case):
    """A graph node's launches, made out from its fake CUDA values, are those its launch code makes for real
    operands of the same shapes, strides and dtypes (the same kernel, grid, integers and constexprs)."""
    operands, extra, target, direct = CASES[case]()
    gm = _graph(target, *operands, extra=extra)
    failed = []
    recorded = precompile.recorded_launches([gm], failed)
    assert not failed
    expected = _direct(lambda: direct(*operands))
    assert recorded and _describe(recorded) == _describe(expected)


def test_noise_launch_is_one_per_pair_of_dtypes():
    """add_randn's launch through its address table: one per (gradient dtype, output dtype), the table's size
    and the tensors' count as the real launch has them (no addresses needed to make it out)."""
    grads = [torch.zeros(5000, dtype=torch.bfloat16), torch.zeros(3, 7), torch.zeros(9000)]
    seeds, scale = torch.tensor([1, 2]), torch.tensor([0.5])
    g = fx.Graph()
    mode = FakeTensorMode()
    nodes = []
    for i, t in enumerate(grads + [seeds, scale]):
        n = g.placeholder(f"x{i}")
        with mode:
            n.meta["val"] = torch.empty(t.shape, dtype=t.dtype, device="cuda")
        nodes.append(n)
    g.output(g.call_function(ops.add_randn.default, (nodes[:3], nodes[3], 1, nodes[4], torch.float32)))
    recorded = precompile.recorded_launches([fx.GraphModule(torch.nn.Module(), g)])
    outs = [torch.empty(t.shape, dtype=torch.float32) for t in grads]
    expected = _direct(lambda: add_randn.launch(add_randn.sources(grads, outs), outs, seeds, 1, scale))
    assert len(recorded) == 2 and _describe(recorded) == _describe(expected)


def test_ops_on_other_devices_make_no_launches():
    gm = precompile.op_graph(ops.gram_sq_norms.default, torch.empty(2, 4, 3), torch.empty(2, 4, 5))
    assert precompile.recorded_launches([gm]) == []


def test_a_launch_code_that_raises_is_reported_not_raised():
    """zero_rows_ with a mask of the wrong length raises in its launch code: the node is reported and left to
    its first launch (which raises there)."""
    gm = _graph(ops.zero_rows_.default, torch.zeros(4, 3, 6), torch.ones(5, dtype=torch.bool),
                extra=lambda n: ([n[0]], [n[1]], [1]))
    failed = []
    assert precompile.recorded_launches([gm], failed) == [] and [n.target for n in failed] == [
        ops.zero_rows_.default]


class _SlowKernel:
    """A stand-in Triton kernel: warmup compiles (slowly, in the caller's thread), kernel[grid](...) launches,
    compiling itself only when no warmup of the same arguments has finished."""

    def __init__(self):
        self.events, self.warm = [], set()
        self.lock = threading.Lock()

    def warmup(self, *args, grid, **consts):
        time.sleep(0.2)
        with self.lock:
            self.warm.add((args, tuple(consts.items())))
            self.events.append(("warmup", threading.current_thread().name, args))

    def __getitem__(self, grid):
        def run(*args, **consts):
            key = (tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args), tuple(consts.items()))
            with self.lock:
                self.events.append(("launch", "compiled" if key in self.warm else "compiles itself"))
        return run


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_plans, "_COMPILED", {})
    monkeypatch.setattr(kernel_plans, "_PENDING", {})


def test_launch_waits_for_the_background_compile_of_its_specialisation(fresh):
    k = _SlowKernel()
    x = torch.zeros(64)
    assert kernel_plans.precompile([(k, (1,), (x, 7), {"BLOCK": 128})]) == 1
    assert kernel_plans.precompile([(k, (2,), (x, 7), {"BLOCK": 128})]) == 0  # pending already
    kernel_plans.launch(k, (5,), (x, 7), {"BLOCK": 128})
    assert [e[0] for e in k.events] == ["warmup", "launch"]
    assert k.events[0][1].startswith("dpcompile-precompile") and k.events[0][2] == (torch.float32, 7)
    assert k.events[1] == ("launch", "compiled")
    # another specialisation (n = 16: divisible by 16) was not compiled ahead: the launch compiles it
    kernel_plans.launch(k, (5,), (x, 16), {"BLOCK": 128})
    assert k.events[-1] == ("launch", "compiles itself")


def test_precompile_is_on_by_default_and_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DPCOMPILE_PRECOMPILE", raising=False)
    assert precompile.enabled()
    monkeypatch.setenv("DPCOMPILE_PRECOMPILE", "0")
    assert not precompile.enabled()
    monkeypatch.setenv("DPCOMPILE_PRECOMPILE", "1")
    assert precompile.enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not precompile.enabled()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not precompile.enabled() and precompile.precompile_kernels([]) is None


def test_a_precompiling_compile_records_what_it_started(monkeypatch):
    """With precompile on, a dp graph's summary says how many compiles it started and which ops' launches it
    could not make out (on CPU: none of either, its ops run on CPU)."""
    import dpcompile
    import models as M

    monkeypatch.setattr(precompile, "enabled", lambda: True)
    torch.manual_seed(0)
    model = M.MLP()
    backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4,
                                  compiler="eager")
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="none").mean()
        loss.backward()
        return loss.detach()

    torch.compile(step, backend=backend)(x, y)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.summary["kernel_precompile"] == {"started": 0, "failed": []}
