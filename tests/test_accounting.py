"""The RDP accountant against an independent integral and Opacus, and the Poisson sampler's statistics."""
import json
import math

import pytest
import scipy.integrate
import scipy.stats
import torch

import dpcompile
from dpcompile.accounting import RDPAccountant, epsilon_from_rdp, sampled_gaussian_rdp


def _rdp_by_integral(q, s, a):
    """RDP(a) of the sampled Gaussian from its definition, E_{z~N(0,s^2)}[((1-q) + q e^{(2z-1)/(2s^2)})^a],
    by quadrature: independent of the binomial sum the accountant uses."""
    def f(z):
        ratio = (1 - q) + q * math.exp((2 * z - 1) / (2 * s * s))
        return scipy.stats.norm.pdf(z, scale=s) * ratio ** a

    val, _ = scipy.integrate.quad(f, -40 * s, 40 * s, limit=500, epsabs=0, epsrel=1e-11)
    return math.log(val) / (a - 1)


@pytest.mark.parametrize("q,s,a", [(0.01, 1.1, 2), (0.01, 1.1, 8), (0.1, 2.0, 5), (0.3, 0.9, 3), (0.004, 1.0, 12)])
def test_rdp_matches_the_definition(q, s, a):
    got = sampled_gaussian_rdp(noise_multiplier=s, sample_rate=q, order=a)
    assert got == pytest.approx(_rdp_by_integral(q, s, a), rel=1e-7)


def test_full_batch_is_the_gaussian_mechanism():
    for a in (2, 7, 64):
        assert sampled_gaussian_rdp(noise_multiplier=1.5, sample_rate=1.0, order=a) == pytest.approx(a / (2 * 2.25))
    assert sampled_gaussian_rdp(noise_multiplier=0.0, sample_rate=0.5, order=4) == math.inf
    assert sampled_gaussian_rdp(noise_multiplier=1.0, sample_rate=0.0, order=4) == 0.0


# (q, noise multiplier, steps, delta) -> epsilon from Opacus 1.5.2 (opacus.accountants.analysis.rdp:
# compute_rdp + get_privacy_spent with orders 2..256), an independent implementation.
OPACUS = [
    (0.01, 1.1, 10000, 1e-5, 5.654308000149469),
    (0.004, 1.0, 5000, 1e-6, 1.9648369915329447),
    (0.1, 2.0, 100, 1e-5, 2.58665217816753),
    (1.0, 5.0, 10, 1e-5, 2.814109167845533),
]


@pytest.mark.parametrize("q,s,steps,delta,want", OPACUS)
def test_epsilon_matches_opacus(q, s, steps, delta, want):
    acc = RDPAccountant(noise_multiplier=s, sample_rate=q)
    acc.step(steps)
    assert acc.steps == steps
    assert acc.epsilon(delta) == pytest.approx(want, rel=1e-9)


def test_steps_compose_and_phases_add():
    one = RDPAccountant(noise_multiplier=1.0, sample_rate=0.02)
    one.step(300)
    split = RDPAccountant(noise_multiplier=1.0, sample_rate=0.02)
    for _ in range(300):
        split.step()
    assert split.history == [[1.0, 0.02, 300]]
    assert split.epsilon(1e-5) == pytest.approx(one.epsilon(1e-5), rel=1e-12)
    # a second phase with more noise adds less than the first phase again
    two = RDPAccountant(noise_multiplier=1.0, sample_rate=0.02)
    two.step(300)
    two.step(300, noise_multiplier=2.0)
    double = RDPAccountant(noise_multiplier=1.0, sample_rate=0.02)
    double.step(600)
    assert one.epsilon(1e-5) < two.epsilon(1e-5) < double.epsilon(1e-5)
    second = [300 * sampled_gaussian_rdp(noise_multiplier=2.0, sample_rate=0.02, order=a) for a in one.orders]
    rdp_sum = [x + y for x, y in zip(one.rdp(), second)]
    assert epsilon_from_rdp(rdp_sum, one.orders, 1e-5)[0] == pytest.approx(two.epsilon(1e-5), rel=1e-12)


def test_checkpoint_round_trip_and_crash_safe_save(tmp_path, monkeypatch):
    acc = RDPAccountant(noise_multiplier=1.3, sample_rate=0.01)
    acc.step(1000)
    path = tmp_path / "acc.json"
    acc.save(path)
    loaded = RDPAccountant.load(path)
    assert loaded.epsilon(1e-5) == acc.epsilon(1e-5) and loaded.steps == 1000
    # a crash while writing the next save leaves the previous file as it was
    acc.step(500)

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(json, "dump", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        acc.save(path)
    monkeypatch.undo()
    assert RDPAccountant.load(path).steps == 1000
    assert [p.name for p in tmp_path.iterdir()] == ["acc.json"]  # no temporary file left behind
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not an accountant file"):
        RDPAccountant.load(path)
    with pytest.raises(ValueError, match="not an RDPAccountant state"):
        RDPAccountant(noise_multiplier=1.0, sample_rate=0.1).load_state_dict({"history": [[1.0]]})


@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=-1.0, sample_rate=0.1), "noise_multiplier"),
    (dict(noise_multiplier=1.0, sample_rate=1.5), "sample_rate must be in"),
    (dict(noise_multiplier=1.0, sample_rate=0.1, orders=[1]), "orders"),
])
def test_bad_accountant_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RDPAccountant(**kwargs)
    with pytest.raises(ValueError, match="delta"):
        RDPAccountant(noise_multiplier=1.0, sample_rate=0.1).epsilon(0.0)


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
