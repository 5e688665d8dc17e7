"""A restart reuses Inductor's generated code for DP graphs (the FX graph cache), never across DP options."""
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import models as M
from helpers import compile_step


def _grads_after_a_fresh_compile(model, x, y, C):
    torch._dynamo.reset()  # as a new process would: dynamo and AOTAutograd start over
    model.zero_grad(set_to_none=True)
    step, backend = compile_step(model, M.ce, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=4)
    step((x,), (y,))
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["clip_coefficients"] == 1  # the dp passes ran (no AOTAutograd cache skipped them)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recompiling_the_same_dp_step_hits_the_fx_graph_cache_and_other_options_miss_it():
    torch.manual_seed(0)
    model = M.MLP()
    x, y = torch.randn(4, 5) * 3, torch.randint(0, 3, (4,))
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True):
        first = _grads_after_a_fresh_compile(model, x, y, C=0.05)
        hits = counters["inductor"]["fxgraph_cache_hit"]
        again = _grads_after_a_fresh_compile(model, x, y, C=0.05)
        assert counters["inductor"]["fxgraph_cache_hit"] >= hits + 2  # the forward and the backward
        for n in first:
            torch.testing.assert_close(again[n], first[n], rtol=0, atol=0)
        misses = counters["inductor"]["fxgraph_cache_miss"]
        other = _grads_after_a_fresh_compile(model, x, y, C=0.025)  # every sample clipped: half the gradient
        assert counters["inductor"]["fxgraph_cache_miss"] > misses  # the backward holds C: compiled anew
        for n in first:
            torch.testing.assert_close(other[n], first[n] / 2)
