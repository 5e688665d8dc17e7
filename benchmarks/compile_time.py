"""Compile time of the DP step against the non-private step, cold or warm caches.

Each run is a fresh process that builds the GPT-2-small-shaped model
(dpcompile.train.GPT: 12 layers, d = 768, vocab 50257), compiles one training
step (forward, loss, backward, SGD step) and times the first call (compile and
first step), then the median of 10 steps (CPU: 2). Modes: nonprivate (stock
``torch.compile``), bk, ghost (``dpcompile.private_step``). Runs alternate
between the modes ``--repeats`` times, so a drift of the host shows in every
mode alike.

Caches: ``cold`` gives each run empty Inductor and Triton cache directories
(and no FX graph cache), which is what a first compile of a new model costs;
``warm`` first fills one cache directory per mode with a run of its own and
then measures a second process start on it (the restart of a job).

    python benchmarks/compile_time.py                       # GPU: B=32, T=256, bf16 autocast; CPU: B=2, T=32
    python benchmarks/compile_time.py --modes nonprivate,bk --repeats 2 --cache warm --out ct.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(mode: str, B: int, T: int) -> dict:
    import torch
    import torch.nn.functional as F

    import dpcompile
    from dpcompile.train import GPT

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = GPT(50257, 768, 12, 12, T).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 50257, (B, T), device=dev)

    def step(ids):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            logits = model(ids)
            per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
            loss = per_token.view(B, -1).mean(1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if mode == "nonprivate":
        f = torch.compile(step)
    else:
        f = dpcompile.private_step(step, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                                   schedule=mode)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    t = time.perf_counter()
    f(ids)
    sync()
    first = time.perf_counter() - t
    steps, warm = [], 3 if dev == "cuda" else 1
    for i in range(warm + (10 if dev == "cuda" else 2)):
        sync()
        t = time.perf_counter()
        f(ids)
        sync()
        if i >= warm:
            steps.append(time.perf_counter() - t)
    return {"mode": mode, "first_call_s": first, "step_ms": statistics.median(steps) * 1e3,
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__}


def run(mode: str, B: int, T: int, cache: str | None) -> dict:
    env = dict(os.environ)
    cache = cache or tempfile.mkdtemp(prefix="dpc-ct-")
    env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--batch", str(B), "--tokens", str(T)],
                         env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="nonprivate,bk,ghost")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cache", choices=("cold", "warm"), default="cold")
    p.add_argument("--batch", type=int)
    p.add_argument("--tokens", type=int)
    p.add_argument("--out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.batch, a.tokens)))
        return
    import torch

    gpu = torch.cuda.is_available()
    B, T = a.batch or (32 if gpu else 2), a.tokens or (256 if gpu else 32)
    if a.cache == "cold":
        os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    modes = a.modes.split(",")
    caches = {m: tempfile.mkdtemp(prefix=f"dpc-ct-{m}-") for m in modes} if a.cache == "warm" else {}
    for m in caches:  # the first process start fills the mode's caches
        run(m, B, T, caches[m])
    rows = []
    for r in range(a.repeats):
        for m in modes:
            row = run(m, B, T, caches.get(m))
            row["repeat"] = r
            rows.append(row)
            print(f"{m:12s} first call {row['first_call_s']:6.1f} s   step {row['step_ms']:7.2f} ms", flush=True)
    print(f"\n{a.cache} caches, B={B}, T={T}, {rows[0]['device']}, torch {rows[0]['torch']}")
    base = statistics.mean(r["first_call_s"] for r in rows if r["mode"] == "nonprivate") if "nonprivate" in modes else None
    for m in modes:
        firsts = [r["first_call_s"] for r in rows if r["mode"] == m]
        ratio = f"{statistics.mean(firsts) / base:.2f}x non-private" if base else ""
        print(f"{m:12s} first call {', '.join(f'{x:.1f}' for x in firsts)} s  {ratio}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": sys.argv, "cache": a.cache, "B": B, "T": T, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
