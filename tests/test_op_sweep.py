"""A slice of torch's op database through DP steps against the per-sample oracle (tests/op_sweep.py runs all of
it by hand): on one process, static and unbacked, and sharded on 2 gloo ranks. Every op sample the slice takes runs
in eager; its step must be exact, refused with a DPCompileError, or fail in stock torch.compile as well, and
refused wherever its samples mix (op_sweep.samples_mix)."""
import pytest
import torch

import op_sweep
from ranks import SharedRanks

_NAMES = op_sweep.op_names()


def _checkable(names) -> dict[str, list]:
    """name -> its samples that run in eager (an op with none is left out of the slice)."""
    out: dict[str, list] = {}
    for s in op_sweep.op_samples(names=set(names)):
        model, x = op_sweep.build(s)
        if op_sweep.is_per_sample(model, x) or op_sweep.samples_mix(model, x) is not None:
            out.setdefault(s.name, []).append(s)
    return out


# spread over the alphabet (torch's op families sit together): the one-process slice and the sharded one apart
ONE_PROCESS = _checkable(_NAMES[0::20])
SHARDED = sorted(_checkable(_NAMES[10::40]))
RANKS = SharedRanks("op_sweep", {"sharded": (0, "op_sweep", dict(names=SHARDED))})


def test_the_sweep_tells_per_sample_models_from_the_rest():
    sin, cumsum_batch = (op_sweep.OpSample(n, 0, op, (4, 3), args, {})
                         for n, op, args in (("sin", torch.sin, ()), ("cumsum", torch.cumsum, (0,))))
    assert op_sweep.is_per_sample(*op_sweep.build(sin)) and not op_sweep.samples_mix(*op_sweep.build(sin))
    # cumsum(x, 0) on the batch runs along the samples: they mix, and the step must be refused
    assert not op_sweep.is_per_sample(*op_sweep.build(cumsum_batch))
    assert op_sweep.samples_mix(*op_sweep.build(cumsum_batch))
    outcome, detail = op_sweep.check(cumsum_batch, schedule="bk")
    assert outcome == "REFUSED" and detail.startswith("samples mix"), (outcome, detail)
    assert len(ONE_PROCESS) >= 8 and len(SHARDED) >= 5, (len(ONE_PROCESS), len(SHARDED))


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_hand_samples_are_exact_or_their_mixing_refused(schedule):
    """diagonal (and its backward's diagonal_scatter), kthvalue, mode, median, cummax, cummin, conj and torch.linalg
    (inv, solve, det, slogdet, eigvalsh, svdvals, qr, cholesky, matrix_exp, lu_factor and lu_solve, ormqr,
    householder_product, cdist), which the sweep found without a rule: exact along a dim that is not the batch's
    (static and unbacked); a diagonal, a matrix or distances taken across the samples refused."""
    got = {s.name: op_sweep.check(s, schedule=schedule, unbacked=schedule == "ghost") for s in op_sweep.hand_samples()}
    for name in op_sweep.ACROSS_SAMPLES:
        assert got.pop(name)[0] == "REFUSED", name
    assert all(outcome == "PASS" for outcome, _ in got.values()), got


@pytest.mark.parametrize("name", sorted(ONE_PROCESS))
def test_op_samples_are_exact_or_refused(name):
    """Each sample alternates: the first bk with a static batch, the second ghost with an unbacked one (a batch
    of 5, then 3 through the same graph)."""
    outcomes = []
    for k, sample in enumerate(ONE_PROCESS[name]):
        schedule, unbacked = (("bk", False), ("ghost", True))[k % 2]
        outcome, detail = op_sweep.check(sample, schedule=schedule, unbacked=unbacked)
        outcomes.append((sample.id, schedule, unbacked, outcome, detail))
    bad = [o for o in outcomes if o[3] not in ("PASS", "REFUSED", "TORCH", "NA")]
    assert not bad, bad
    assert any(o[3] != "NA" for o in outcomes), outcomes


@RANKS.mark("sharded")
def test_sharded_op_samples_are_exact_or_refused(shared_ranks):
    import json
    import os

    out = shared_ranks(RANKS, "sharded")
    per_rank = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    assert per_rank[0].keys() == per_rank[1].keys() and per_rank[0], per_rank
    bad = {sid: [r[sid] for r in per_rank] for sid in per_rank[0]
           if any(r[sid][0] not in ("PASS", "REFUSED", "TORCH", "NA") for r in per_rank)}
    assert not bad, bad
    assert sum(r[sid][0] == "PASS" for r in per_rank for sid in r) >= 2 * 5, per_rank
    for r in per_rank:  # the hand samples (op_sweep.hand_samples), whatever the slice
        for name in op_sweep.ACROSS_SAMPLES:
            assert r.pop(f"{name}#0")[0] == "REFUSED", (name, r)
        assert all(r[f"{s.name}#0"][0] == "PASS" for s in op_sweep.hand_samples()
                   if s.name not in op_sweep.ACROSS_SAMPLES), r
