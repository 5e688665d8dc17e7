"""The test processes' CI-time changes to torch (ci_time.py) leave what Dynamo compiles and guards as it was."""
import inspect
import os

import pytest
import torch

import ci_time


@pytest.mark.skipif(os.environ.get(ci_time.GUARD_PROFILE_ENV) == "1", reason="guard profile kept")
def test_guards_are_built_and_checked_without_their_latency_profile(monkeypatch):
    import torch._dynamo.guards as guards

    profiled = []
    monkeypatch.setattr(guards, "profile_guard_manager", lambda *a: profiled.append(a) or 0.0)
    ci_time.install()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def f(x):
        return x.sin() * 2

    compiled = torch.compile(f, backend=backend)
    for x in (torch.randn(3), torch.randn(3), torch.randn(3, dtype=torch.float64)):
        torch.testing.assert_close(compiled(x), f(x))
    assert profiled == []  # torch's profile replaced, not called
    assert len(compiles) == 2  # the float64 input failed the guards of the float32 graph: compiled again
    assert guards.profile_guard_manager is ci_time._no_guard_profile


@pytest.mark.skipif(os.environ.get(ci_time.SYMINT_WALK_ENV) == "1", reason="FX's walk for raw SymInts kept")
def test_fx_creates_nodes_without_walking_their_arguments():
    """create_node no longer walks the arguments and builds the same nodes; torch.fx.graph keeps every other
    pytree function (the flattening of inputs of code generated with pytree specs)."""
    import torch.fx.graph as fx_graph

    ci_time.install()
    if "pytree.tree_iter((args, kwargs))" not in inspect.getsource(fx_graph):
        pytest.skip("this torch's create_node does not walk its arguments")
    assert isinstance(fx_graph.pytree, ci_time._PytreeWithoutArgWalk)
    ci_time.install()  # again: the same shim, not one around another
    assert not isinstance(fx_graph.pytree._pytree, ci_time._PytreeWithoutArgWalk)
    assert list(fx_graph.pytree.tree_iter(([1, 2], {"a": 3}))) == []

    def f(xs, y):  # nested arguments; inputs given as a pytree
        return torch.cat([xs[0], xs[1] * y], dim=0)

    gm = torch.fx.symbolic_trace(f, concrete_args={"xs": [torch.fx.PH, torch.fx.PH]})
    cat = next(n for n in gm.graph.nodes if n.target is torch.cat)
    assert [a.op for a in cat.args[0]] == ["placeholder", "call_function"] and cat.kwargs == {"dim": 0}
    xs, y = [torch.randn(2), torch.randn(2)], torch.randn(2)
    assert len(gm.graph._codegen.process_inputs(xs, y)) == 3  # pytree's arg_tree_leaves, through the shim
    torch.testing.assert_close(gm(xs, y), f(xs, y))


def test_test_processes_run_one_intra_op_thread_unless_told_otherwise(monkeypatch):
    """The conftest's install left this process, and everything it starts, with OMP_NUM_THREADS's thread count (1
    unless the run was started with one); a count already set is kept."""
    assert torch.get_num_threads() == int(os.environ[ci_time.THREADS_ENV])
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setenv(ci_time.THREADS_ENV, "3")
    ci_time.install()
    assert calls == [] and os.environ[ci_time.THREADS_ENV] == "3"
    monkeypatch.delenv(ci_time.THREADS_ENV)
    ci_time.install()
    assert calls == [1] and os.environ[ci_time.THREADS_ENV] == "1"
