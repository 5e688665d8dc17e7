"""The accountant and the noise multiplier for a target epsilon against Opacus, and the Poisson sampler's statistics."""
import json
import math

import pytest
import scipy.stats
import torch

import dpcompile


CASES = [(0.01, 1.1, 10000, 1e-5), (0.004, 1.0, 5000, 1e-6), (0.1, 2.0, 100, 1e-5), (1.0, 5.0, 10, 1e-5)]


@pytest.mark.parametrize("mechanism", ["prv", "rdp"])
@pytest.mark.parametrize("q,s,steps,delta", CASES)
def test_epsilon_is_opacus_epsilon(q, s, steps, delta, mechanism):
    """Steps recorded in bulk give what Opacus' own accountant gives after as many step() calls."""
    from opacus.accountants import create_accountant

    acc = dpcompile.PrivacyAccountant(noise_multiplier=s, sample_rate=q, mechanism=mechanism)
    acc.step(steps)
    assert acc.steps == steps
    ref = create_accountant(mechanism)
    for _ in range(steps):
        ref.step(noise_multiplier=s, sample_rate=q)
    assert acc.epsilon(delta) == pytest.approx(ref.get_epsilon(delta=delta), rel=1e-9)


def test_default_is_prv_and_phases_compose():
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = dpcompile.PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.02)
    assert isinstance(acc.opacus, PRVAccountant)
    assert acc.epsilon(1e-5) == 0.0  # nothing spent yet
    acc.step(300)
    acc.step(300, noise_multiplier=2.0)
    acc.step()
    assert acc.history == [(1.0, 0.02, 300), (2.0, 0.02, 301)]
    ref = RDPAccountant()
    ref.history = [(1.0, 0.02, 300), (2.0, 0.02, 301)]
    rdp = dpcompile.PrivacyAccountant(noise_multiplier=2.0, sample_rate=0.02, mechanism="rdp")
    rdp.load_state_dict({**acc.state_dict(), "mechanism": "rdp"})
    assert rdp.epsilon(1e-5) == pytest.approx(ref.get_epsilon(delta=1e-5), rel=1e-12)
    one_phase = dpcompile.PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.02)
    one_phase.step(601)
    assert acc.epsilon(1e-5) < one_phase.epsilon(1e-5)  # more noise in the second phase spends less
    no_noise = dpcompile.PrivacyAccountant(noise_multiplier=0.0, sample_rate=0.02)
    no_noise.step()
    assert no_noise.epsilon(1e-5) == float("inf")


@pytest.mark.parametrize("mechanism", ["prv", "rdp"])
@pytest.mark.parametrize("plan", [dict(steps=500), dict(epochs=3)])
def test_noise_multiplier_for_a_target_epsilon_is_opacus(mechanism, plan):
    from opacus.accountants.utils import get_noise_multiplier

    q, eps, delta = 0.01, 4.0, 1e-5
    sigma = dpcompile.noise_multiplier_for(target_epsilon=eps, target_delta=delta, sample_rate=q,
                                           accountant=mechanism, **plan)
    assert sigma == get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q,
                                         accountant=mechanism, **plan)
    acc = dpcompile.PrivacyAccountant(noise_multiplier=sigma, sample_rate=q, mechanism=mechanism)
    acc.step(plan.get("steps") or int(plan["epochs"] / q))
    assert eps - 0.05 < acc.epsilon(delta) <= eps  # reaches the target, within Opacus' tolerance


@pytest.mark.parametrize("kwargs,match", [
    (dict(target_epsilon=0.0, target_delta=1e-5, sample_rate=0.1, steps=10), "target_epsilon"),
    (dict(target_epsilon=1.0, target_delta=0.0, sample_rate=0.1, steps=10), "delta"),
    (dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.0, steps=10), "sample_rate"),
    (dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.1), "exactly one of steps"),
    (dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.1, steps=10, epochs=1), "exactly one of steps"),
    (dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.1, steps=0), "steps must be"),
    (dict(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.1, steps=10, accountant="gdp2"), "accountant"),
])
def test_bad_target_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpcompile.noise_multiplier_for(**kwargs)


def test_checkpoint_round_trip_and_crash_safe_save(tmp_path, monkeypatch):
    acc = dpcompile.PrivacyAccountant(noise_multiplier=1.3, sample_rate=0.01)
    acc.step(1000)
    path = tmp_path / "acc.json"
    acc.save(path)
    loaded = dpcompile.PrivacyAccountant.load(path)
    assert loaded.epsilon(1e-5) == acc.epsilon(1e-5) and loaded.steps == 1000 and loaded.mechanism == "prv"
    # a crash while writing the next save leaves the previous file as it was
    acc.step(500)

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(json, "dump", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        acc.save(path)
    monkeypatch.undo()
    assert dpcompile.PrivacyAccountant.load(path).steps == 1000
    assert [p.name for p in tmp_path.iterdir()] == ["acc.json"]  # no temporary file left behind
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not an accountant file"):
        dpcompile.PrivacyAccountant.load(path)
    with pytest.raises(ValueError, match="not a PrivacyAccountant state"):
        dpcompile.PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.1).load_state_dict({"history": [[1.0]]})


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=-1.0, sample_rate=0.1), "noise_multiplier"),
    (dict(noise_multiplier=1.0, sample_rate=1.5), "sample_rate must be in"),
    (dict(noise_multiplier=1.0, sample_rate=0.1, mechanism="moments"), "accountant must be one of"),
])
def test_bad_accountant_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpcompile.PrivacyAccountant(**kwargs)
    with pytest.raises(ValueError, match="delta"):
        dpcompile.PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.1).epsilon(0.0)


def test_poisson_batches_have_the_right_law_and_split_across_ranks():
    n, q, steps = 1000, 0.05, 400
    ranks = [dpcompile.PoissonBatchSampler(n, sample_rate=q, steps=steps, seed=7, rank=r, world_size=3)
             for r in range(3)]
    assert ranks[0].expected_batch_size == pytest.approx(50.0)
    sizes, member = [], torch.zeros(n)
    for parts in zip(*ranks):
        joined = sorted(i for p in parts for i in p)
        assert len(joined) == len(set(joined))  # disjoint across ranks
        assert all(i % 3 == r for r, p in enumerate(parts) for i in p)
        sizes.append(len(joined))
        member[joined] += 1
    # global batch size ~ Binomial(n, q): mean and variance within 5 standard errors
    m = sum(sizes) / steps
    assert abs(m - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)
    var = sum((x - m) ** 2 for x in sizes) / (steps - 1)
    assert abs(var / (n * q * (1 - q)) - 1) < 5 * math.sqrt(2 / (steps - 1))
    # each example's inclusion rate is q (no example favoured): chi-square over the examples
    chi2 = float(((member - steps * q) ** 2 / (steps * q * (1 - q))).sum())
    assert scipy.stats.chi2.sf(chi2, n) > 1e-4
    # resuming at step t gives step t's batches again; another seed gives other batches
    resumed = dpcompile.PoissonBatchSampler(n, sample_rate=q, steps=steps, seed=7, rank=1, world_size=3,
                                            start_step=399)
    assert list(resumed) == [ranks[1].batch(399)] and len(resumed) == 1
    assert dpcompile.PoissonBatchSampler(n, sample_rate=q, steps=1, seed=8).batch(0) != \
        dpcompile.PoissonBatchSampler(n, sample_rate=q, steps=1, seed=7).batch(0)


def test_small_rates_give_empty_batches_and_bad_input_is_refused():
    s = dpcompile.PoissonBatchSampler(10, sample_rate=0.01, steps=50, seed=0)
    assert any(len(b) == 0 for b in s)  # P(empty) = 0.99**10 per step
    with pytest.raises(ValueError, match="same seed on every rank"):
        dpcompile.PoissonBatchSampler(10, sample_rate=0.1, steps=5, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank must be"):
        dpcompile.PoissonBatchSampler(10, sample_rate=0.1, steps=5, seed=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="sample_rate"):
        dpcompile.PoissonBatchSampler(10, sample_rate=0.0, steps=5, seed=1)
