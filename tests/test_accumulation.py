"""Gradient accumulation (dpcompile.accumulate): micro-batches sum exactly, noise once per logical batch."""
import pytest
import torch

import dpcompile
import models as M
from cases import ids
from reference import dp_reference
from tiers import extended


def _step(model, loss_fn, reduction="mean"):
    def step(x, y):
        per_sample = loss_fn(model(x), y)
        loss = per_sample.mean() if reduction == "mean" else per_sample.sum()
        loss.backward()
        return loss.detach()

    return step


# ghost through Inductor: the extended tier (tests/tiers.py). What accumulates is dpcompile's (the kept clipped
# sums, the noise held back), which ghost's op-by-op run checks; Inductor's code for it: bk's run (CI time: 40 s)
@pytest.mark.parametrize("schedule,form,compiler", [("bk", "compile", "inductor"), ("ghost", "private_step", "eager"),
                                                    pytest.param("ghost", "private_step", "inductor", marks=extended)])
def test_micro_batches_sum_to_the_logical_batch_exactly(schedule, form, compiler):
    """Logical batches split into micro-batches (3 + 0 + 4, then 2 + 5, then one empty one): the
    accumulated gradient is the oracle's clipped sum over the union, scaled by the logical expected batch
    size; one graph for every micro-batch count and size."""
    torch.manual_seed(0)
    model = M.GPT(n_layer=1)
    logical = [(3, 0, 4), (2, 5), (0,)]
    data = [[(ids(b, 6, 13), ids(b, 6, 13)) for b in sizes] for sizes in logical]
    union = [tuple(torch.cat(t) for t in zip(*mbs)) for mbs in data]
    _, norms = dp_reference(model, M.seq_ce, (union[0][0],), (union[0][1],), max_grad_norm=1.0, expected_batch_size=8)
    C, E = float(norms.median()), 8
    options = dict(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=E, schedule=schedule,
                   compiler=compiler)
    step = _step(model, M.seq_ce)
    if form == "compile":
        compiled, backend = torch.compile(step, backend="dp_fsdp", options=options), dpcompile.get_backend(options)
    else:
        compiled = dpcompile.private_step(step, **options)
        backend = compiled.dp_backend
    known = len(backend.compiled)
    for mbs, (x_all, y_all) in zip(data, union):
        model.zero_grad(set_to_none=True)
        for j, (x, y) in enumerate(mbs):
            dpcompile.mark_batch(x, y)
            with dpcompile.accumulate(enabled=j < len(mbs) - 1):
                compiled(x, y)
        if len(x_all):
            ref, n = dp_reference(model, M.seq_ce, (x_all,), (y_all,), max_grad_norm=C, expected_batch_size=E)
            assert (n > C).any() or len(x_all) < 7
        for name, p in model.named_parameters():
            want = ref[name] if len(x_all) else torch.zeros_like(p, dtype=torch.float64)
            torch.testing.assert_close(p.grad.double(), want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert len([r for r in backend.compiled[known:] if r.dp]) == 1
    assert backend.noise.step == len(logical)  # micro-steps inside accumulate() draw no noise


def test_noise_is_drawn_once_per_logical_batch():
    """3 micro-batches per logical batch, sigma = 2: the gradient minus its noiseless value has std
    sigma * C / E per coordinate (chi-square over every coordinate of 12 logical batches), not sqrt(3)
    times it."""
    torch.manual_seed(0)
    model = M.MLP()
    x, y = torch.randn(9, 5), torch.randint(0, 3, (9,))
    sigma, C, E = 2.0, 0.5, 9
    grads = {}
    for s in (0.0, sigma):
        # the noiseless reference op by op (CI time; the noise tests' references are too)
        backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=s, expected_batch_size=E, seed=3,
                                      compiler="inductor" if s else "eager")
        compiled = torch.compile(_step(model, M.ce), backend=backend)
        draws = []
        for _ in range(12 if s else 1):
            model.zero_grad(set_to_none=True)
            for j in range(3):
                with dpcompile.accumulate(enabled=j < 2):
                    compiled(x[3 * j: 3 * j + 3], y[3 * j: 3 * j + 3])
            draws.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        grads[s] = torch.stack(draws)
        torch._dynamo.reset()
    z = ((grads[sigma] - grads[0.0]) / (sigma * C / E)).double().flatten()
    n = z.numel()
    assert abs(z.mean()) < 4.5 / n ** 0.5
    assert abs(z.pow(2).mean() - 1) < 4.5 * (2 / n) ** 0.5, z.pow(2).mean()


def test_micro_batches_of_a_poisson_sampler_cover_each_step_once():
    for world in (1, 3):
        samplers = [dpcompile.PoissonBatchSampler(200, sample_rate=0.2, steps=6, seed=5, rank=r, world_size=world)
                    for r in range(world)]
        per_rank = [list(s.micro_batches(max_size=7)) for s in samplers]
        assert len({len(m) for m in per_rank}) == 1  # the same number of micro-steps on every rank
        for r, (s, mbs) in enumerate(zip(samplers, per_rank)):
            steps, current = [], []
            for idx, last in mbs:
                assert len(idx) <= 7
                current += idx
                if last:
                    steps.append(current)
                    current = []
            assert steps == [s.batch(t) for t in range(6)]
    with pytest.raises(ValueError, match="max_size"):
        next(samplers[0].micro_batches(max_size=0))
    empty = dpcompile.PoissonBatchSampler(5, sample_rate=1e-9, steps=2, seed=1)
    assert list(empty.micro_batches(max_size=4)) == [([], True), ([], True)]  # noise still added each step
