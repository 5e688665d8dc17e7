"""benchmarks/anchors.py: the timeline it reads from a profiled step's kernels, and its --unbacked rows."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import anchors  # noqa: E402


def test_gpu_timeline_splits_compute_idle_and_exposed_collectives():
    # us: compute 0-10 and 12-20 (overlapping kernels merge), a 2 us gap at 10-12 under no collective,
    # a 30 us gap at 20-50 of which an all-gather covers 20-45 (25 us exposed), compute again 50-60
    spans = [(0, 10, "mm_a"), (5, 8, "pointwise_b"), (12, 20, "mm_c"), (50, 60, "norm_d"),
             (15, 45, "ncclDevKernel_AllGather"), (61, 63, "nccl:reduce_scatter")]
    t = anchors.gpu_timeline(spans)
    assert t["span_ms"] == 0.063 and t["compute_ms"] == 0.028
    assert t["idle_ms"] == 0.035  # 2 + 30 + 3 (the trailing reduce-scatter) us
    assert t["collectives_only_ms"] == 0.027  # 20-45 within the 30 us gap, 61-63 at the end
    assert t["gaps"][0] == [0.03, "mm_c", "norm_d"]  # longest first, named by the kernels either side
    assert t["gaps"][1] == [0.002, "mm_a", "mm_c"]  # after mm_a's end, not pointwise_b's
    assert len(t["gaps"]) == 2
    assert anchors.gpu_timeline([])["span_ms"] == 0.0
    # the host's ranges: what it ran in the middle of each gap (innermost first), and its lead before the GPU
    host = [(-40, 70, "step"), (-40, -5, "guards"), (25, 45, "CompiledFunction"), (30, 40, "cudaGraphLaunch")]
    t = anchors.gpu_timeline(spans, cpu=host)
    assert t["gaps"][0] == [0.03, "mm_c", "norm_d", ["cudaGraphLaunch", "CompiledFunction", "step"]]
    assert t["gaps"][1] == [0.002, "mm_a", "mm_c", ["step"]]
    assert t["host_lead_ms"] == 0.04


def test_unbacked_rows_compile_the_dp_step_with_an_unbacked_batch():
    """--unbacked: a dpcompile mode on one process marks the batch (as a sharded step has it) and its rows are
    named apart; the non-private reference stays static."""
    import torch

    from dpcompile import batching

    spec = dict(model="gpt", B=2, T=8, dtype="fp32", mode="bk", tiny=True, shard=False, llama_tied=False,
                unbacked=True, dp_options={"compiler": "eager"})
    torch._dynamo.reset()
    model = anchors.build_model(spec)
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    step, value = anchors.torch_step(spec, model, x, y, torch.device("cpu"))
    assert getattr(x, batching._MARK, None) == 0 and getattr(y, batching._MARK, None) == 0
    assert torch.isfinite(torch.tensor(value(step())))
    assert anchors.mode_name(spec) == "bk unbacked"
    assert anchors.mode_name({**spec, "mode": "nonprivate"}) == "nonprivate"
    assert anchors.mode_name({**spec, "unbacked": False}) == "bk"


def test_rounds_pool_into_one_row_per_mode():
    """--rounds: a mode's rows become one whose median is the median of its rounds' medians; the ratio is taken
    between pooled rows; a failed round is left out and counted; a mode with no ok round keeps its last row."""
    def row(mode, ms, status="ok", peak=1.0):
        r = dict(model="gpt", B=32, T=256, dtype="bf16", mode=mode, status=status, ranks=1)
        if status == "ok":
            r.update(median_ms=ms, min_ms=ms - 0.5, peak_gib=peak, compile_and_warmup_s=ms)
        return r

    rows = [row("nonprivate", 18.0), row("bk", 25.0), row("ghost", 0, "timeout"),
            row("nonprivate", 19.0), row("bk", 21.0, peak=2.0), row("ghost", 0, "oom"),
            row("nonprivate", 18.5), row("bk", 0, "timeout")]
    pooled = anchors.finish(rows)
    by_mode = {r["mode"]: r for r in pooled}
    assert len(pooled) == 3
    assert by_mode["nonprivate"]["round_ms"] == [18.0, 19.0, 18.5] and by_mode["nonprivate"]["median_ms"] == 18.5
    bk = by_mode["bk"]
    assert bk["round_ms"] == [25.0, 21.0] and bk["median_ms"] == 23.0 and bk["rounds"] == "2/3"
    assert bk["min_ms"] == 20.5 and bk["peak_gib"] == 2.0 and bk["compile_and_warmup_s"] == 25.0
    assert abs(bk["time_ratio"] - 23.0 / 18.5) < 1e-12
    assert by_mode["ghost"]["status"] == "oom" and "round_ms" not in by_mode["ghost"]
    single = anchors.finish([row("nonprivate", 18.0), row("bk", 21.0)])
    assert all("round_ms" not in r for r in single)


def test_dp_options_reach_the_dp_step_and_are_checked():
    """--dp-option KEY=VALUE: a DPConfig field for the dp modes (a bare word is a string), refused where the
    benchmark sets the field itself or no such field exists; the step is built with it."""
    import pytest

    assert anchors.parse_dp_option("linear_norm=ghost") == ("linear_norm", "ghost")
    assert anchors.parse_dp_option("memory_budget=1024") == ("memory_budget", 1024)
    for bad in ("schedule=ghost", "no_such_option=1", "linear_norm"):
        with pytest.raises(ValueError, match="--dp-option"):
            anchors.parse_dp_option(bad)
    import torch

    spec = dict(model="gpt", B=2, T=8, dtype="fp32", mode="bk", tiny=True, shard=False, llama_tied=False,
                dp_options={"linear_norm": "direct", "memory_budget": 1024})
    model = anchors.build_model(spec)
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    step, _ = anchors.torch_step(spec, model, x, y, torch.device("cpu"))
    config = step.compiled.dp_backend.config
    assert config.linear_norm == "direct" and config.memory_budget == 1024 and config.schedule == "bk"


def test_compile_time_rows_carry_their_own_dp_options(monkeypatch, tmp_path):
    """compile_time.py --modes nonprivate,ghost,"ghost[pause_gc=False]": a DP row's bracketed options reach its
    child process over --dp-option's, so one option's rows alternate with the others on one machine; a row
    without brackets keeps --dp-option's, and brackets on a non-DP mode, unclosed or naming no DPConfig field
    are refused."""
    import json
    import subprocess

    import pytest

    import compile_time

    assert compile_time.split_mode("ghost") == ("ghost", {})
    assert compile_time.split_mode("ghost[pause_gc=False;linear_norm=ghost]") == (
        "ghost", {"pause_gc": False, "linear_norm": "ghost"})
    for bad in ("nonprivate[pause_gc=False]", "ghost[pause_gc=False", "ghost[no_such_option=1]"):
        with pytest.raises((SystemExit, ValueError)):
            compile_time.split_mode(bad)
    children = []

    def child_process(cmd, env, **_):
        children.append((cmd[cmd.index("--child") + 1], json.loads(env.get("DPC_CT_DP_OPTIONS", "{}"))))
        return subprocess.CompletedProcess(cmd, 0, stdout='{"first_call_s": 1.0}\n', stderr="")

    monkeypatch.setattr(compile_time.subprocess, "run", child_process)
    monkeypatch.setenv("DPC_CT_DP_OPTIONS", json.dumps({"pause_gc": True, "linear_norm": "direct"}))
    assert compile_time.run("ghost[pause_gc=False]", "gpt:2x32", str(tmp_path), [])["mode"] == "ghost[pause_gc=False]"
    assert compile_time.run("ghost", "gpt:2x32", str(tmp_path), [])["mode"] == "ghost"
    assert children == [("ghost", {"pause_gc": False, "linear_norm": "direct"}),
                        ("ghost", {"pause_gc": True, "linear_norm": "direct"})]


def test_compile_time_rows_may_keep_the_gathered_parameters(monkeypatch, tmp_path):
    """compile_time.py --fake-ranks 2 --modes nonprivate,ghost,"ghost[reshard_after_forward=False]": a row of any
    mode may set fully_shard's reshard_after_forward, which reaches anchors.shard's fully_shard calls in the child
    (not the DP options); a value other than True or False is refused."""
    import json
    import subprocess
    import types

    import pytest

    import anchors
    import compile_time

    assert compile_time.split_mode("ghost[reshard_after_forward=False;pause_gc=False]") == (
        "ghost", {"reshard_after_forward": False, "pause_gc": False})
    assert compile_time.split_mode("nonprivate[reshard_after_forward=False]") == (
        "nonprivate", {"reshard_after_forward": False})
    for bad in ("ghost[reshard_after_forward=1]", "nonprivate[reshard_after_forward]"):
        with pytest.raises(SystemExit):
            compile_time.split_mode(bad)
    children = []

    def child_process(cmd, env, **_):
        children.append((json.loads(env["DPC_CT_SHARD_OPTIONS"]), json.loads(env.get("DPC_CT_DP_OPTIONS", "{}"))))
        return subprocess.CompletedProcess(cmd, 0, stdout='{"first_call_s": 1.0}\n', stderr="")

    monkeypatch.setattr(compile_time.subprocess, "run", child_process)
    monkeypatch.delenv("DPC_CT_DP_OPTIONS", raising=False)
    compile_time.run("ghost[reshard_after_forward=False;pause_gc=False]", "gpt:2x32", str(tmp_path), [])
    compile_time.run("ghost", "gpt:2x32", str(tmp_path), [])
    assert children == [({"reshard_after_forward": False}, {"pause_gc": False}), ({}, {})]

    import torch.distributed as dist
    import torch.distributed.device_mesh

    import dpcompile

    calls = []
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed.device_mesh, "init_device_mesh", lambda *a, **k: "mesh")
    monkeypatch.setattr(dpcompile, "fully_shard", lambda m, **kw: calls.append((m, kw)) or m)
    model = types.SimpleNamespace(blocks=["b0", "b1"])
    for spec, reshard in (({}, True), ({"reshard_after_forward": False}, False)):
        calls.clear()
        anchors.shard(model, spec, types.SimpleNamespace(type="cpu"))
        assert calls == [(m, {"mesh": "mesh", "reshard_after_forward": reshard}) for m in ("b0", "b1", model)]
