"""Privacy accounting for DP-SGD with Poisson sampling: Rényi DP of the sampled Gaussian mechanism.

One DP step with sample rate q (each example in the batch independently
with probability q), clipping bound C and noise N(0, s^2 C^2) per coordinate
is the sampled Gaussian mechanism with noise multiplier s. Its Rényi DP at
integer order a (Mironov, Talwar, Zhang 2019, "Rényi Differential Privacy of
the Sampled Gaussian Mechanism", Sec. 3.3) is

    RDP(a) = 1/(a-1) * log sum_{k=0..a} C(a,k) (1-q)^(a-k) q^k exp((k^2-k) / (2 s^2)),

steps compose by adding RDP, and (epsilon, delta) follows from the
conversion of Balle et al. 2020 ("Hypothesis testing interpretations and
Rényi differential privacy", Thm. 21), minimised over the orders. Only
integer orders are used: every order gives a valid bound, fractional ones
only tighten it slightly.

The accountant's state is a list of (noise multiplier, sample rate, steps)
phases; ``save`` writes it atomically, so a crash mid-write leaves the
previous file intact.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Sequence

from dpcompile.config import _is_real

DEFAULT_ORDERS: tuple[int, ...] = tuple(range(2, 257))


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    if m == -math.inf:
        return -math.inf
    return m + math.log(sum(math.exp(x - m) for x in xs))


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def sampled_gaussian_rdp(*, noise_multiplier: float, sample_rate: float, order: int) -> float:
    """RDP at an integer ``order`` >= 2 of one step of the sampled Gaussian mechanism."""
    q, s, a = sample_rate, noise_multiplier, order
    if q == 0:
        return 0.0
    if s == 0:
        return math.inf
    if q == 1:
        return a / (2 * s * s)
    terms = [
        _log_comb(a, k) + (a - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * s * s)
        for k in range(a + 1)
    ]
    return _logsumexp(terms) / (a - 1)


def epsilon_from_rdp(rdp: Sequence[float], orders: Sequence[int], delta: float) -> tuple[float, int]:
    """The smallest epsilon over the orders, and the order that gives it."""
    best, best_order = math.inf, orders[0]
    for r, a in zip(rdp, orders):
        eps = r - (math.log(delta) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
        if eps < best:
            best, best_order = eps, a
    return max(best, 0.0), best_order


def _check_rate_and_noise(noise_multiplier: Any, sample_rate: Any) -> None:
    def real(x):
        return _is_real(x) and math.isfinite(x)

    if not real(noise_multiplier) or noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if not real(sample_rate) or not 0 <= sample_rate <= 1:
        raise ValueError(
            f"sample_rate must be in [0, 1] (the probability that an example is in a batch: expected batch size / "
            f"dataset size), got {sample_rate!r}"
        )


class RDPAccountant:
    """Counts DP steps and reports (epsilon, delta).

    >>> acc = RDPAccountant(noise_multiplier=1.1, sample_rate=256 / 60000)
    >>> for batch in loader: step(...); acc.step()
    >>> acc.epsilon(delta=1e-5)

    ``sample_rate`` is the Poisson rate of the global batch (expected global
    batch size / dataset size), the same on every rank; ``noise_multiplier``
    is the backend's. A run that changes either calls ``step`` with the new
    values; each phase is accounted with its own.
    """

    def __init__(self, *, noise_multiplier: float, sample_rate: float, orders: Sequence[int] = DEFAULT_ORDERS):
        _check_rate_and_noise(noise_multiplier, sample_rate)
        orders = tuple(orders)
        if not orders or any(isinstance(a, bool) or not isinstance(a, int) or a < 2 for a in orders):
            raise ValueError(f"orders must be integers >= 2, got {orders!r}")
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.orders = orders
        self.history: list[list[float]] = []  # [noise_multiplier, sample_rate, steps]

    @property
    def steps(self) -> int:
        return int(sum(h[2] for h in self.history))

    def step(self, steps: int = 1, *, noise_multiplier: float | None = None, sample_rate: float | None = None) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        s = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        q = self.sample_rate if sample_rate is None else sample_rate
        _check_rate_and_noise(s, q)
        self.noise_multiplier, self.sample_rate = float(s), float(q)
        if self.history and self.history[-1][:2] == [self.noise_multiplier, self.sample_rate]:
            self.history[-1][2] += steps
        elif steps:
            self.history.append([self.noise_multiplier, self.sample_rate, steps])

    def rdp(self) -> list[float]:
        """The composed RDP of all steps so far, per order."""
        return [
            sum(n * sampled_gaussian_rdp(noise_multiplier=s, sample_rate=q, order=a) for s, q, n in self.history)
            for a in self.orders
        ]

    def epsilon(self, delta: float) -> float:
        if not _is_real(delta) or not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        return epsilon_from_rdp(self.rdp(), self.orders, delta)[0]

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                "orders": list(self.orders), "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            history = [[float(s), float(q), int(n)] for s, q, n in state["history"]]
            noise, rate, orders = state["noise_multiplier"], state["sample_rate"], tuple(state["orders"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an RDPAccountant state ({type(e).__name__}: {e})") from e
        for s, q, n in history:
            _check_rate_and_noise(s, q)
            if n < 0:
                raise ValueError(f"not an RDPAccountant state: negative step count {n}")
        _check_rate_and_noise(noise, rate)
        self.noise_multiplier, self.sample_rate, self.orders, self.history = float(noise), float(rate), orders, history

    def save(self, path: str | os.PathLike) -> None:
        """Writes the state as JSON through a temporary file and a rename: the old file survives a crash."""
        path = os.fspath(path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".accountant-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RDPAccountant":
        try:
            with open(path) as f:
                state = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)} is not an accountant file written by RDPAccountant.save ({e})") from e
        acc = cls.__new__(cls)
        acc.load_state_dict(state)
        return acc
