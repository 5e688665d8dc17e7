"""Smoke test of examples/dp_image_classification.py: its --quick mode, in process, through dpcompile."""
import importlib.util
import json
import math
import os

import pytest

import dpcompile

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "dp_image_classification.py")
EPSILONS = [1.0, 3.0]  # two targets, one compile each (Opacus finds their noise multipliers faster than 8's)


def load_example():
    spec = importlib.util.spec_from_file_location("dp_image_classification", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_trains_each_epsilon_through_dpcompile(tmp_path):
    pytest.importorskip("sklearn")
    example = load_example()
    out = tmp_path / "digits"
    returned = example.main(["--quick", "--no-progress", "--out", str(out),
                             "--epsilons", *[str(e) for e in EPSILONS]])
    record = json.loads((out / "results.json").read_text())
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 1000
    assert record["dp"] == returned["dp"]
    assert [r["target_epsilon"] for r in record["dp"]] == EPSILONS
    steps = example.QUICK_STEPS
    for run in record["dp"]:
        assert 0 <= run["test_accuracy"] <= 1 and run["steps"] == steps
        # the privacy spent, accounted again here from the run's noise multiplier and sample rate
        accountant = dpcompile.PrivacyAccountant(noise_multiplier=run["noise_multiplier"],
                                                 sample_rate=record["config"]["batch"] / record["data"]["train_images"])
        accountant.step(steps)
        spent = accountant.epsilon(record["delta"])
        assert run["epsilon_spent"] == pytest.approx(spent)
        assert 0.9 * run["target_epsilon"] < spent <= run["target_epsilon"]
        # every step ran the DP graph (private_step also refuses a step that did not), which clips per sample
        # and adds noise to all 10 parameters (weight and bias of two convolutions, two GroupNorms, the head)
        assert run["dp_graph_calls"] == steps and run["dp_graphs_compiled"] == 1
        counters = run["dp_rewrite_counters"]
        assert counters["clip_coefficients"] == 1 and counters["noise_added"] == 10
        assert counters.get("norm_conv_ghost", 0) + counters.get("norm_conv_direct", 0) == 2  # the conv weights
    assert 0 <= record["nonprivate"]["test_accuracy"] <= 1 and math.isfinite(record["wall_seconds"])
