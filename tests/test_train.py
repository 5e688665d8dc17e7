"""Smoke test of the main job, ``python -m dpcompile.train``: a few DP steps of a very small model, in process."""
import json
import math

import pytest

import dpcompile
from dpcompile import train

SMALL = ["--steps", "6", "--seq-len", "32", "--batch-size", "16", "--physical-batch-size", "8", "--layers", "1",
         "--width", "32", "--heads", "2", "--eval-every", "3", "--device", "cpu", "--quiet"]


def test_records_are_paragraphs_and_the_split_is_fixed():
    records = train.load_records()
    assert len(records) > 1000 and all(len(r.strip()) >= train.MIN_RECORD_BYTES for r in records)
    tr, held = train.split_records(records)
    assert len(held) == round(0.1 * len(records)) and len(tr) + len(held) == len(records)
    assert train.split_records(records) == (tr, held)
    x, y = train.encode(held[:3], 16)
    assert (x[:, 0] == train.PAD).all() and (x[:, 1:] == y[:, :-1]).all()
    assert bytes(y[0].tolist()) == held[0][:16]


def test_a_short_dp_run_writes_its_plot_and_curves(tmp_path):
    out = tmp_path / "run"
    final = train.main([*SMALL, "--out-dir", str(out)])
    png, js = out / "curves.png", out / "curves.json"
    assert png.stat().st_size > 1000 and js.stat().st_size > 100
    assert final["plot"] == str(png) and final["json"] == str(js)
    record = json.loads(js.read_text())
    dp = record["dp"]
    assert dp["steps"] == [0, 3, 6]
    assert len(dp["epsilon"]) == len(dp["heldout_loss"]) == len(dp["train_loss"]) == 3
    assert len(dp["train_loss_per_step"]) == 6
    assert all(math.isfinite(v) for v in dp["heldout_loss"])
    assert dp["epsilon"][0] == 0 and dp["epsilon"] == sorted(dp["epsilon"])
    eps = record["final"]["epsilon"]
    assert 0 < eps <= 8.0 + 1e-6 and eps == pytest.approx(dp["epsilon"][-1])
    assert final["epsilon"] == eps and final["steps"] == 6
    assert math.isfinite(record["unigram_baseline"]) and record["unigram_baseline"] == final["unigram_baseline"]
    assert record["config"]["noise_multiplier"] > 0 and record["nonprivate"] is None
    assert record["final"]["dropped_samples"] == 0


def test_a_stopped_run_resumes_from_its_checkpoint(tmp_path):
    """4 of 8 planned steps, then the same command resumes at step 4: the privacy spent and the curves go on
    from the checkpoint (no step counted twice)."""
    out = tmp_path / "run"
    argv = [*SMALL, "--steps", "8", "--eval-every", "4", "--out-dir", str(out)]
    first = train.main([*argv, "--stop-after", "4"])
    assert first["steps"] == 4 and 0 < first["epsilon"] < 8.0
    assert (out / "checkpoints").is_dir()
    final = train.main(argv)
    record = json.loads((out / "curves.json").read_text())
    assert record["dp"]["steps"] == [0, 4, 8] and len(record["dp"]["train_loss_per_step"]) == 8
    assert record["dp"]["epsilon"][1] == pytest.approx(first["epsilon"])
    assert final["steps"] == 8 and 0 < final["epsilon"] <= 8.0 + 1e-6
    config = record["config"]
    accountant = dpcompile.PrivacyAccountant(noise_multiplier=config["noise_multiplier"],
                                             sample_rate=config["sample_rate"])
    accountant.step(8)
    assert final["epsilon"] == pytest.approx(accountant.epsilon(config["delta"]))  # 8 steps counted, not 12
