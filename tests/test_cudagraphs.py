"""cudagraphs=True: the DP step (noise included) replayed as CUDA graphs gives what plain Inductor gives.

GPU only (CUDA graphs). Each test runs the same steps, seeds and data twice, cudagraphs off and on, and
compares every parameter after the optimizer steps (and the gradients): the graphs replay the same
kernels with the same per-step noise seeds, so the results agree to rounding. A profiler check proves the
steps did replay graphs (cudaGraphLaunch), not fall back to kernel-by-kernel launches.
"""
import copy

import pytest
import torch

import dpcompile
import models as M

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA graphs")


def _train(model, *, cudagraphs, batches, schedule, accumulate_every=1):
    """SGD steps of a dp_fsdp GPT step over ``batches``; returns (params, last grads, dropped, graph launches)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = copy.deepcopy(model).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    # cudagraphs="mode": asked for the way stock torch.compile users do, mode="reduce-overhead"
    graphs = dict(mode="reduce-overhead") if cudagraphs == "mode" else dict(cudagraphs=cudagraphs)

    @dpcompile.private_step(max_grad_norm=0.05, noise_multiplier=0.7, expected_batch_size=4, seed=3,
                            schedule=schedule, **graphs)
    def step(x, y):
        loss = M.seq_ce(model(x), y).mean()
        loss.backward()
        return loss.detach()

    launches, grads = 0, {}
    for i, n in enumerate(batches):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randint(0, 13, (n, 6), generator=g).cuda()
        y = torch.randint(0, 13, (n, 6), generator=g).cuda()
        dpcompile.mark_batch(x, y)
        last = (i + 1) % accumulate_every == 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with dpcompile.accumulate(enabled=not last):
                step(x, y)
        launches += sum(e.name == "cudaGraphLaunch" for e in prof.events())
        if last:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return ({k: p.detach().clone() for k, p in model.named_parameters()}, grads,
            step.dp_backend.dropped_samples(), launches)


def _same(a, b):
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("schedule,how", [("bk", True), ("ghost", "mode")])
def test_cudagraph_steps_equal_plain_inductor(schedule, how):
    """Five noisy steps, batch sizes 4, 4, 3, 4, 3 (one graph for every size, replayed per size)."""
    model = M.GPT(n_layer=1)
    sizes = [4, 4, 3, 4, 3]
    plain, plain_grads, _, plain_launches = _train(model, cudagraphs=False, batches=sizes, schedule=schedule)
    graphed, graphed_grads, _, launches = _train(model, cudagraphs=how, batches=sizes, schedule=schedule)
    assert plain_launches == 0 and launches >= 2, launches  # forward + backward replayed as graphs
    _same(plain, graphed)
    _same(plain_grads, graphed_grads)
    assert any((plain[k] != model.state_dict()[k].cuda()).any() for k in plain)  # the steps did train


def test_cudagraph_accumulation_keeps_earlier_micro_batches():
    """Three micro-batches per logical batch: the first two's gradients live in the graphs' memory when
    the next replay starts; they are copied out first, so the sum is the sum of all three."""
    model = M.GPT(n_layer=1)
    sizes = [2, 3, 1, 4, 2, 2]
    plain, plain_grads, _, _ = _train(model, cudagraphs=False, batches=sizes, schedule="bk", accumulate_every=3)
    graphed, graphed_grads, _, launches = _train(model, cudagraphs=True, batches=sizes, schedule="bk",
                                                 accumulate_every=3)
    assert launches >= 2
    _same(plain_grads, graphed_grads)
    _same(plain, graphed)


def test_cudagraph_dropped_samples_count_across_steps():
    """A non-finite sample in two steps: the counter's gradient survives the replays between them."""
    torch._dynamo.reset()
    model = M.GPT(n_layer=1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @dpcompile.private_step(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, cudagraphs=True)
    def step(x, scale):
        loss = (M.seq_ce(model(x), x) * scale).mean()
        loss.backward()
        return loss.detach()

    for bad in (True, False, True):
        x = torch.randint(0, 13, (4, 6), device="cuda")
        scale = torch.ones(4, device="cuda")
        if bad:
            scale[1] = float("inf")
        step(x, scale)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert step.dp_backend.dropped_samples() == 2

