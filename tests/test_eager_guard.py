"""A DP step that dynamo runs eagerly (past its recompile limit, a fallback, the uncompiled function) raises
instead of writing unclipped, noiseless gradients: the plain torch.compile form has no private_step wrapper."""
import json
import os

import pytest
import torch
import torch.nn as nn
from torch._dynamo.exc import FailOnRecompileLimitHit

import dist_worker
import dpcompile
import models as M
from helpers import compile_step
from ranks import spawn


def test_one_step_function_for_many_models_raises_at_the_recompile_limit(monkeypatch):
    # the same code object compiled for models of other shapes (a sweep script without torch._dynamo.reset()):
    # past the limit dynamo used to run it eagerly, with a plain backward, and the model of the eager run had no
    # DP graph of its own for dpcompile to guard. Dynamo raises instead while it compiles a DP step's frames,
    # with the limit at least eager_guard.RECOMPILE_LIMIT (2 here); the process keeps its own settings
    from dpcompile import eager_guard

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4 + i, 6), nn.Tanh(), nn.Linear(6, 3)) for i in range(4)]

    def run(model):  # compile_step's step function: one code object for every model
        step, _ = compile_step(model, M.ce, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=3,
                               compiler="eager")
        step((torch.randn(3, model[0].in_features),), (torch.randint(0, 3, (3,)),))

    monkeypatch.setattr(eager_guard, "RECOMPILE_LIMIT", 2)
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=False):
        run(models[0])
        run(models[1])
        with pytest.raises(FailOnRecompileLimitHit):
            run(models[2])
        assert not torch._dynamo.config.fail_on_recompile_limit_hit
        assert torch._dynamo.config.recompile_limit == 2
    assert models[1][0].weight.grad is not None
    assert all(p.grad is None for p in models[2].parameters())


@pytest.mark.parametrize("world", [1, 2], ids=["one_process", "sharded"])
def test_an_eager_run_of_a_dp_trained_model_raises_and_clears_its_gradients(world, tmp_path):
    if world == 1:
        reports = [dist_worker.eager_guard_report(None)]
    else:
        spawn(dist_worker.eager_guard, str(tmp_path), world=world)
        reports = [json.load(open(os.path.join(tmp_path, f"guard{r}.json"))) for r in range(world)]
    for rep in reports:
        assert rep["limit_fails"] == [False, False], rep  # the process keeps its setting (step_frames: the DP frames')
        assert rep["dp_grads"], rep  # micro-batches under accumulate(): every backward was a DP graph's
        assert "no dp_fsdp graph produced" in rep["eager"] and "non_private()" in rep["eager"], rep
        assert all(rep["cleared"]), rep  # every parameter, also those the eager backward reached first
        assert rep["non_private"] and rep["dp_again"], rep
