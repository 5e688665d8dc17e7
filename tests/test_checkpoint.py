"""dpcompile.Checkpointer: a killed private run resumes as if it had never stopped."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import ckpt_run
import dist_worker
import dpcompile
import models as M
from ranks import spawn

HERE = os.path.dirname(os.path.abspath(__file__))


def _start(directory, steps, *extra):
    os.makedirs(directory, exist_ok=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore", TORCHINDUCTOR_COMPILE_THREADS="1")
    return subprocess.Popen([sys.executable, os.path.join(HERE, "ckpt_run.py"), str(directory), str(steps), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_killed_run_resumes_like_an_uninterrupted_one(tmp_path):
    """8 logical steps (Poisson batches in micro-batches, noise, Adam, the accountant), a checkpoint every 2.
    The run is SIGKILLed mid-training, resumed, killed again in the middle of a save, resumed again: its
    final parameters, epsilon and noise stream position equal those of a run that never stopped (no step
    counted twice, no noise draw replayed for another gradient, none skipped)."""
    whole = _start(tmp_path / "whole", 8)  # beside the killed run: 2 cores
    killed = _start(tmp_path / "killed", 8, "--hold-after", "3")
    seen = []
    for line in killed.stdout:  # SIGKILL once step 3 is done (the step-2 checkpoint is committed), where it waits
        seen.append(line)
        if line.startswith("step 3"):
            killed.send_signal(signal.SIGKILL)
            break
    assert _finish(killed)[0] == -signal.SIGKILL, "".join(seen)
    ckpts = sorted(os.listdir(tmp_path / "killed" / "ckpt"))
    assert ckpts == ["step_000000002"], ckpts

    rc, out = _finish(_start(tmp_path / "killed", 8, "--die-saving-at", "6"))
    assert rc == 9, out
    assert "resumed at 2" in out, out
    ckpts = sorted(os.listdir(tmp_path / "killed" / "ckpt"))  # 6 was being written: not committed
    assert ckpts == [".partial_step_000000006", "step_000000002", "step_000000004"], ckpts

    rc, out = _finish(_start(tmp_path / "killed", 8))
    assert rc == 0 and "resumed at 4" in out, out
    rc, out = _finish(whole)
    assert rc == 0 and "fresh run" in out, out

    a, b = (torch.load(tmp_path / d / "final.pt") for d in ("whole", "killed"))
    assert a["accountant_steps"] == b["accountant_steps"] == 8
    assert a["noise_step"] == b["noise_step"] == 8  # one noise draw per logical step, micro-batches not counted
    assert b["epsilon"] == pytest.approx(a["epsilon"], rel=1e-9)
    for name in a["params"]:
        torch.testing.assert_close(b["params"][name], a["params"][name], msg=lambda m: f"{name}: {m}")
    ckpts = sorted(os.listdir(tmp_path / "killed" / "ckpt"))  # the stale partial save was cleaned, keep=2
    assert ckpts == ["step_000000006", "step_000000008"], ckpts


def test_sharded_run_resumes_like_an_uninterrupted_one(tmp_path):
    """2 gloo ranks, fully_shard: 4 steps in one go equal 2 steps, a checkpoint (DCP, per-rank noise
    streams), fresh objects restored from it, 2 more steps."""
    spawn(dist_worker.checkpoint_resume, str(tmp_path))
    for rank in range(2):
        with open(tmp_path / f"ckpt{rank}.json") as f:
            rep = json.load(f)
        assert rep["error"] is None, rep["error"]


def _tiny(tmp_path, **kw):
    torch.manual_seed(0)
    model = M.GPT(d=8, n_head=2, n_layer=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    acc = dpcompile.PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.1)
    sampler = dpcompile.PoissonBatchSampler(40, sample_rate=0.1, steps=10, seed=3)
    backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4, seed=5)
    args = dict(model=model, optimizer=opt, backend=backend, accountant=acc, sampler=sampler)
    args.update(kw)
    return dpcompile.Checkpointer(tmp_path, **args), args


def test_restore_round_trip_and_refusals(tmp_path):
    ckpt, parts = _tiny(tmp_path)
    assert ckpt.restore() is None  # nothing saved: a fresh run
    parts["accountant"].step(3)
    parts["backend"].noise.step = 3
    for p in parts["model"].parameters():
        p.grad = torch.ones_like(p)
    parts["optimizer"].step()  # optimizer state to save
    ckpt.save(3, extra={"loss": [1.0, 0.5]})
    want = {n: p.detach().clone() for n, p in parts["model"].named_parameters()}

    fresh, new = _tiny(tmp_path)  # a new process would build these
    state = fresh.restore()
    assert state == {"step": 3, "extra": {"loss": [1.0, 0.5]}}
    for n, p in new["model"].named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=0)
    assert new["optimizer"].state_dict()["state"][0]["step"] == 1
    assert new["accountant"].steps == 3 and new["backend"].noise.step == 3
    assert new["sampler"].start_step == 3 and len(new["sampler"]) == 7

    with pytest.raises(ValueError, match="JSON"):
        ckpt.save(4, extra={"x": object()})
    with pytest.raises(ValueError, match="step must be an int"):
        ckpt.save(-1)
    with pytest.raises(ValueError, match="backend must be"):
        dpcompile.Checkpointer(tmp_path, model=parts["model"], backend="dp_fsdp")
    other = dpcompile.PoissonBatchSampler(40, sample_rate=0.2, steps=10, seed=3)
    with pytest.raises(ValueError, match="same dataset and sample rate"):
        _tiny(tmp_path, sampler=other)[0].restore()
    with pytest.raises(ValueError, match="not a checkpoint"):
        fresh.restore(tmp_path / "nowhere")
