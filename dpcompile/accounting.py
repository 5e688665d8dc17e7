"""Privacy accounting for DP-SGD with Poisson sampling, by Opacus.

One DP step with sample rate q (each example in the batch independently
with probability q), clipping bound C and noise N(0, s^2 C^2) per coordinate
is the sampled Gaussian mechanism with noise multiplier s. Opacus' accountants
compose it over steps: PRV (numerical composition of privacy loss random
variables, Gopi et al. 2021; the tightest, the default) or RDP (Rényi DP,
Mironov et al. 2019). dpcompile does not account by itself; it adds what a
training run needs on top of an Opacus accountant:

- ``PrivacyAccountant``: steps in bulk and phases (a new noise multiplier or
  sample rate), epsilon at a delta, and an atomic ``save``/``load`` so a crash
  mid-write leaves the previous file intact (a run's checkpoint holds it);
- ``noise_multiplier_for``: the noise multiplier that reaches a target
  (epsilon, delta) over a planned number of steps or epochs at a sample rate
  (``opacus.accountants.utils.get_noise_multiplier``), checked up front.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

from dpcompile.config import _is_real

MECHANISMS = ("prv", "rdp")


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


def _check_delta(delta: Any) -> None:
    if not _is_real(delta) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1) (e.g. 1 / dataset size), got {delta!r}")


def _check_mechanism(mechanism: Any) -> None:
    if mechanism not in MECHANISMS:
        raise ValueError(f"accountant must be one of {MECHANISMS} (Opacus' PRV or RDP accountant), got {mechanism!r}")


def _opacus_accountant(mechanism: str):
    from opacus.accountants import create_accountant

    return create_accountant(mechanism)


class PrivacyAccountant:
    """The privacy spent so far by a DP-SGD run, accounted by Opacus (``mechanism`` "prv" or "rdp").

    ``noise_multiplier`` and ``sample_rate`` are those of the next steps; ``step`` records steps with
    them (or with new ones: a new phase). ``opacus`` is the Opacus accountant itself.

        accountant = dpcompile.PrivacyAccountant(noise_multiplier=s, sample_rate=B / N)
        ... one training step ...
        accountant.step()
        accountant.epsilon(delta=1 / N)
    """

    def __init__(self, *, noise_multiplier: float, sample_rate: float, mechanism: str = "prv"):
        _check_rate_and_noise(noise_multiplier, sample_rate)
        _check_mechanism(mechanism)
        self.noise_multiplier = float(noise_multiplier)
        self.sample_rate = float(sample_rate)
        self.mechanism = mechanism
        self.opacus = _opacus_accountant(mechanism)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """Opacus' record of the run: (noise multiplier, sample rate, steps) per phase."""
        return self.opacus.history

    @property
    def steps(self) -> int:
        return int(sum(n for _, _, n in self.opacus.history))

    def step(self, steps: int = 1, *, noise_multiplier: float | None = None, sample_rate: float | None = None) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        s = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        q = self.sample_rate if sample_rate is None else sample_rate
        _check_rate_and_noise(s, q)
        self.noise_multiplier, self.sample_rate = float(s), float(q)
        if not steps:
            return
        history = self.opacus.history
        if history and tuple(history[-1][:2]) == (self.noise_multiplier, self.sample_rate):
            history[-1] = (self.noise_multiplier, self.sample_rate, history[-1][2] + steps)
        else:  # what Opacus' own step() records, for many steps at once
            history.append((self.noise_multiplier, self.sample_rate, steps))

    def epsilon(self, delta: float) -> float:
        _check_delta(delta)
        if not self.steps:
            return 0.0
        if all(s == 0 for s, q, n in self.opacus.history if q > 0 and n > 0):
            return math.inf  # a step without noise on sampled data: no privacy
        return float(self.opacus.get_epsilon(delta=delta))

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate, "history": [list(h) for h in self.opacus.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]
            noise, rate, mechanism = state["noise_multiplier"], state["sample_rate"], state["mechanism"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a PrivacyAccountant state ({type(e).__name__}: {e})") from e
        for s, q, n in history:
            _check_rate_and_noise(s, q)
            if n < 0:
                raise ValueError(f"not a PrivacyAccountant state: negative step count {n}")
        _check_rate_and_noise(noise, rate)
        _check_mechanism(mechanism)
        opacus = _opacus_accountant(mechanism)
        opacus.load_state_dict({"history": history, "mechanism": mechanism})
        self.noise_multiplier, self.sample_rate, self.mechanism, self.opacus = float(noise), float(rate), \
            mechanism, opacus

    def save(self, path: str | os.PathLike) -> None:
        """Writes the state as JSON through a temporary file and a rename: the old file survives a crash."""
        atomic_write_json(path, self.state_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PrivacyAccountant":
        try:
            with open(path) as f:
                state = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)} is not an accountant file written by PrivacyAccountant.save "
                             f"({e})") from e
        acc = cls.__new__(cls)
        acc.load_state_dict(state)
        return acc


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".dpcompile-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def noise_multiplier_for(*, target_epsilon: float, target_delta: float, sample_rate: float,
                         steps: int | None = None, epochs: float | None = None, accountant: str = "prv",
                         epsilon_tolerance: float = 0.01) -> float:
    """The smallest noise multiplier (within Opacus' search tolerance) whose run of ``steps`` steps (or
    ``epochs`` epochs: epochs / sample_rate steps) at ``sample_rate`` spends at most ``target_epsilon``
    at ``target_delta``. Pass it as the ``noise_multiplier`` option."""
    from opacus.accountants.utils import get_noise_multiplier

    if not _is_real(target_epsilon) or not target_epsilon > 0 or not math.isfinite(target_epsilon):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    _check_delta(target_delta)
    _check_mechanism(accountant)
    if not _is_real(sample_rate) or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1] (expected batch size / dataset size), got {sample_rate!r}")
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps= (DP steps planned) and epochs= (passes over the data)")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if epochs is not None and (not _is_real(epochs) or not epochs > 0):
        raise ValueError(f"epochs must be a number > 0, got {epochs!r}")
    if steps is None:
        steps = max(1, int(epochs / sample_rate))
    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                      sample_rate=sample_rate, steps=steps, accountant=accountant,
                                      epsilon_tolerance=epsilon_tolerance))
