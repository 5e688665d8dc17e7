"""The test processes' CI-time changes to torch (ci_time.py) leave what Dynamo compiles and guards as it was."""
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
