"""A slice of torch's op database through DP steps against the per-sample oracle (tests/op_sweep.py runs all of
it by hand): on one process, static and unbacked, and sharded on 2 gloo ranks. Every op sample the slice takes is
per sample as written (op_sweep.is_per_sample); its step must be exact, refused with a DPCompileError, or fail in
stock torch.compile as well."""
import pytest
import torch

import op_sweep
from ranks import SharedRanks

_NAMES = op_sweep.op_names()


def _per_sample(names) -> dict[str, list]:
    """name -> its samples that are per sample as written (an op with none is left out of the slice)."""
    out: dict[str, list] = {}
    for s in op_sweep.op_samples(names=set(names)):
        if op_sweep.is_per_sample(*op_sweep.build(s)):
            out.setdefault(s.name, []).append(s)
    return out


# spread over the alphabet (torch's op families sit together): the one-process slice and the sharded one apart
ONE_PROCESS = _per_sample(_NAMES[0::16])
SHARDED = sorted(_per_sample(_NAMES[8::32]))
RANKS = SharedRanks("op_sweep", {"sharded": (0, "op_sweep", dict(names=SHARDED))})


def test_the_sweep_tells_per_sample_models_from_the_rest():
    sin, cumsum_batch = (op_sweep.OpSample(n, 0, op, (4, 3), args, {})
                         for n, op, args in (("sin", torch.sin, ()), ("cumsum", torch.cumsum, (0,))))
    assert op_sweep.is_per_sample(*op_sweep.build(sin))
    # cumsum along the sample's dim 0 is along the batch's dim 1; along 0 of the sample it is per sample, but
    # written as cumsum(x, 0) on the batch it mixes samples
    assert not op_sweep.is_per_sample(*op_sweep.build(cumsum_batch))
    assert op_sweep.check(cumsum_batch, schedule="bk")[0] == "NA"
    assert len(ONE_PROCESS) >= 8 and len(SHARDED) >= 5, (len(ONE_PROCESS), len(SHARDED))


@pytest.mark.parametrize("name", sorted(ONE_PROCESS))
def test_op_samples_are_exact_or_refused(name):
    """Each sample alternates: the first bk with a static batch, the second ghost with an unbacked one (a batch
    of 5, then 3 through the same graph)."""
    outcomes = []
    for k, sample in enumerate(ONE_PROCESS[name]):
        schedule, unbacked = (("bk", False), ("ghost", True))[k % 2]
        outcome, detail = op_sweep.check(sample, schedule=schedule, unbacked=unbacked)
        outcomes.append((sample.id, schedule, unbacked, outcome, detail))
    bad = [o for o in outcomes if o[3] not in ("PASS", "REFUSED", "TORCH")]
    assert not bad, bad


@RANKS.mark("sharded")
def test_sharded_op_samples_are_exact_or_refused(shared_ranks):
    import json
    import os

    out = shared_ranks(RANKS, "sharded")
    per_rank = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    assert per_rank[0].keys() == per_rank[1].keys() and per_rank[0], per_rank
    bad = {sid: [r[sid] for r in per_rank] for sid in per_rank[0]
           if any(r[sid][0] not in ("PASS", "REFUSED") for r in per_rank)}
    assert not bad, bad
    assert sum(r[sid][0] == "PASS" for r in per_rank for sid in r) >= 2 * 5, per_rank
