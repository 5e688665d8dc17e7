"""Anchors: dpcompile's DP step against the non-private step and against Opacus, on one GPU kind.

Every mode trains the same model (same class, same seed, same batch) with SGD;
one step = forward, loss, backward (with whatever clipping and noise the mode
does), optimizer step, zero_grad. Modes:

    nonprivate              stock torch.compile(step) (Inductor), unsharded
    nonprivate:cg           the same, mode="reduce-overhead" (CUDA graphs)
    nonprivate_eager        the same step uncompiled (what Opacus runs on)
    bk, ghost, auto         dpcompile.private_step(schedule=...) on the same step
    bk:cg, ghost:cg         ... with cudagraphs=True (the step replayed as CUDA graphs, noise included)
    opacus:ghost            Opacus 1.6 ghost clipping (PrivacyEngine.make_private, grad_sample_mode="ghost")
    opacus:ghost_fsdp       the same under Opacus' FSDP2 wrapper (2+ GPUs, torchrun)
    fork:flash_bk           the seeds' Opacus fork (github.com/JackyXiao98/opacus), grad_sample_mode="flash_bk"
    fork:ghost_bk           ... grad_sample_mode="ghost_bk"
    fork:flash_fsdp_bk      ... grad_sample_mode="flash_fsdp_bk" (2+ GPUs, torchrun)

DP modes use C = 1, noise multiplier 1, flat clipping, the mean over samples
of per-sample mean token losses. dtypes: fp32 (TF32 matmuls) and bf16
(autocast around forward and loss, fp32 parameters). Each mode runs in its own
child process (fresh model from seed 0, fresh dynamo, fresh CUDA allocator):
Opacus 1.6 and the fork are both the package `opacus` and never share an
interpreter, and a crash, OOM or hang of one mode cannot stop the others.
Median of --iters timed steps after --warmup steps (compile included in
warm-up, reported separately); peak memory over the timed steps (CUDA-graph
modes: over the whole run, since their pool is allocated while capturing in
the warm-up; an upper bound that includes compile-time autotuning). Ratios are to
the fastest non-private step of the same shape and dtype.

    python benchmarks/anchors.py --tiny --fork-path .whl/fork       # CPU smoke run, about 2 minutes
    python benchmarks/anchors.py --fork-path .whl/fork               # everything (about an hour on one H100)
    python benchmarks/anchors.py --fork-path .whl/fork --shapes gpt:8x1024 --dtypes bf16 --out a.json
    python benchmarks/anchors.py --merge a.json b.json ... --out all.json --plot anchors.png --markdown
    NCCL_NVLS_ENABLE=0 python benchmarks/anchors.py --fork-path .whl/fork --nproc 2 \
        --modes opacus:ghost_fsdp,fork:flash_fsdp_bk                 # the FSDP modes, one torchrun per mode
    python benchmarks/anchors.py --shard --nproc 2 --modes nonprivate,bk --bucket-mb off
                                       # unbucketed collectives (rows "bk unbucketed"); fully_shard's default
                                       # is 64 MiB buckets, overlapped; --bucket-mb 16 [--overlap]: rows "bk b16"
    python benchmarks/anchors.py --shapes gpt:32x256 --dtypes fp32 --modes nonprivate,bk --unbacked
                                       # bk on one GPU with the batch size unbacked, as a sharded step compiles
                                       # it (rows "bk unbacked")

Shapes are MODEL:BxT (B samples per GPU, T tokens): gpt = GPT-2-small (12
layers, d=768, 12 heads, vocab 50257), llama = Llama-3.2-1B (16 layers,
d=2048, 32/8 heads, SwiGLU 8192, vocab 128256). --merge joins the JSON files
of several calls into one table and chart (ratios recomputed over all rows;
one row per shape, dtype, mode and ranks: an ok row wins over a failed one, a
later file over an earlier one, so a rerun of a mode replaces its row).

--out is rewritten (atomically) after every mode and marked "partial" until
the last: a call killed by a wall-clock limit keeps the rows it finished, and
--merge takes such files. On SIGTERM, SIGINT or SIGHUP the script ends the
running mode's processes (torchrun's ranks included), records that mode as
"stopped", writes --out and exits; a mode over --mode-timeout is ended the
same way and recorded as "timeout".

The table's "step-1 loss" is the loss of the first step, before any update:
every mode trains the same model on the same batch (under torchrun, rank 0's
batch is the single-process one), so it must agree across the modes of a shape
and dtype (to 2e-3 relative in fp32, 2e-2 in bf16); a line LOSS MISMATCH
under the table names the modes that do not. Later losses differ by the
noise each library draws.

Time on one H100 (torch 2.11, fresh Inductor cache), measured for gpt:8x1024
(2026-11-25): every child spends 12-16 s starting (imports, mostly
torch._dynamo, CUDA, the model); compile + warm-up then takes nonprivate
21-31 s, bk / ghost 61-69 s, Opacus and the fork about 1 s. A call with
--modes nonprivate,bk,ghost,opacus:ghost for one shape and dtype took about
4 minutes. Each dpcompile and non-private row also records "compile_phases"
(seconds per Dynamo / AOTAutograd / dpcompile / Inductor phase, from
torch._dynamo's compile-time metrics) in the JSON: where compile time goes.

The models are dpcompile.train.GPT and benchmarks/llama.py's Llama with two
changes that Opacus needs, made for every mode alike: GPT's position ids are
a [B, T] tensor (Opacus' ghost clipping cannot take the shared [T] ids) and
Llama's LM head is not tied to the embedding (Opacus refuses tied parameters
under ghost clipping; --llama-tied keeps the tie and records Opacus' refusal).
GPT-2 itself ties them too: --gpt-tied ties GPT's (dp_fsdp's norm of a weight
used twice, passes/shared_norms.py).

The fork is carried as source: a directory holding its `opacus` package,
given with --fork-path and put first on the fork children's sys.path. From a
git mirror of the fork (e.g. the project's fetch of github:JackyXiao98/opacus):

    mkdir -p .whl/fork && git --git-dir=MIRROR archive HEAD opacus | tar -x -C .whl/fork
    git --git-dir=MIRROR rev-parse HEAD > .whl/fork/COMMIT          # recorded in the JSON

Its flash modes use Triton kernels on CUDA and fall back to plain torch norms
without Triton (on CPU), so --tiny does not exercise them. Its bookkeeping
modes (*_bk) fail under bf16 autocast: they multiply fp32 clip factors into
bf16 output gradients and contract them with the layer inputs outside
autocast (a dtype mismatch in populate_clipped_gradients); the rows say so.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

T_IMPORT = time.perf_counter()  # a child's setup time (imports, CUDA start, model, wrapping) counts from here
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULT_TAG = "ANCHORS_RESULT "

# mode -> (library, what the library calls it, runs on several ranks under torchrun)
MODES = {
    "nonprivate": ("torch", "compiled", False),
    "nonprivate:cg": ("torch", "compiled", False),
    "nonprivate_eager": ("torch", "eager", False),
    "bk": ("dpcompile", "bk", False),
    "ghost": ("dpcompile", "ghost", False),
    "auto": ("dpcompile", "auto", False),
    "bk:cg": ("dpcompile", "bk", False),
    "ghost:cg": ("dpcompile", "ghost", False),
    "opacus:ghost": ("opacus16", "ghost", False),
    "opacus:ghost_fsdp": ("opacus16", "ghost_fsdp", True),
    "fork:flash_bk": ("fork", "flash_bk", False),
    "fork:ghost_bk": ("fork", "ghost_bk", False),
    "fork:flash_fsdp_bk": ("fork", "flash_fsdp_bk", True),
}
NONPRIVATE = ("nonprivate", "nonprivate:cg", "nonprivate_eager")
# replayed as CUDA graphs: torch.compile(mode="reduce-overhead") / private_step(cudagraphs=True)
CUDA_GRAPHS = ("nonprivate:cg", "bk:cg", "ghost:cg")
DEFAULT_SHAPES = "gpt:8x1024,gpt:32x256,gpt:2x4096,llama:2x1024"
MODEL_DIMS = {  # keyword arguments of the model classes below
    "gpt": dict(vocab=50257, d=768, layers=12, heads=12),  # GPT-2 small
    "llama": dict(vocab=128256, d=2048, layers=16, heads=32, kv_heads=8, ffn=8192),  # Llama-3.2-1B
}
TINY_DIMS = {
    "gpt": dict(vocab=128, d=32, layers=2, heads=4),
    "llama": dict(vocab=128, d=32, layers=2, heads=4, kv_heads=2, ffn=64),
}


# ----------------------------------------------------------------------------- the child: one mode

def build_model(spec: dict):
    import torch

    sys.path.insert(0, ROOT)  # dpcompile from this checkout, also when it is not installed
    sys.path.insert(0, HERE)
    dims = (TINY_DIMS if spec["tiny"] else MODEL_DIMS)[spec["model"]]
    torch.manual_seed(0)
    if spec["model"] == "llama":
        from llama import Llama

        return Llama(dims["vocab"], dims["d"], dims["layers"], dims["heads"], dims["kv_heads"], dims["ffn"],
                     tied=spec["llama_tied"])
    from dpcompile.train import GPT

    class GPTSamplePositions(GPT):
        """dpcompile.train.GPT with [B, T] position ids: Opacus' embedding norm takes one id row per sample
        (shared [T] ids break its ghost clipping) and a contiguous index tensor (not an expand)."""

        def forward(self, ids):
            B, T = ids.shape
            pos = torch.arange(T, device=ids.device).repeat(B, 1)
            x = self.wte(ids) + self.wpe(pos)
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    model = GPTSamplePositions(dims["vocab"], dims["d"], dims["heads"], dims["layers"], spec["T"])
    if spec.get("gpt_tied"):
        model.lm_head.weight = model.wte.weight
    return model


def autocast_for(spec: dict, device):
    import contextlib

    import torch

    if spec["dtype"] == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def shard(model, spec: dict, device):
    """dpcompile.fully_shard on every block, then the root, as benchmarks/step.py does (no mixed-precision
    policy: bf16 is autocast here, like the unsharded modes). reshard_after_forward: the spec's (compile_time.py's
    rows), else True, which only dp_fsdp's steps read: a stock torch.compile keeps what its backward reads."""
    import dpcompile
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    reshard = spec.get("reshard_after_forward", True)  # compile_time.py's MODE[reshard_after_forward=False]
    for b in model.blocks:
        dpcompile.fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
    return dpcompile.fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def torch_step(spec: dict, model, x, y, device):
    """The non-private step (compiled or eager) and the dp_fsdp step: one train_step function for all."""
    import torch
    import torch.nn.functional as F

    world = int(os.environ.get("WORLD_SIZE", 1))
    if spec["shard"]:
        model = shard(model, spec, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    autocast = autocast_for(spec, device)

    def train_step(ids, targets):
        with autocast():
            logits = model(ids)
            per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
            loss = per_token.view(targets.shape).mean(1).mean()
        loss.backward()
        return loss.detach()

    lib, how, _ = MODES[spec["mode"]]
    if lib == "dpcompile":
        import dpcompile

        if spec.get("unbacked") and not spec["shard"]:
            # compiled as a sharded step is: one graph for every batch size (the size unbacked, tuned for B)
            dpcompile.mark_batch(x, y, hint=spec["B"])
        fn = dpcompile.private_step(train_step, **{
            "max_grad_norm": 1.0, "noise_multiplier": 1.0, "expected_batch_size": spec["B"] * world,
            "schedule": how, "cudagraphs": spec["mode"] in CUDA_GRAPHS, **(spec.get("dp_options") or {})})
    elif how == "compiled":
        fn = torch.compile(train_step, mode="reduce-overhead" if spec["mode"] in CUDA_GRAPHS else None)
    else:
        fn = train_step

    def step():
        loss = fn(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step.compiled = fn  # (dp_compile_seconds reads a private_step's records)
    return step, lambda loss: float(loss)


def opacus_step(spec: dict, model, x, y, device):
    """Opacus (1.6 or the fork, whichever `opacus` this child imports): make_private with ghost-style
    clipping; the criterion wrapper turns loss.backward() into the mode's backward(s)."""
    import torch
    import torch.nn as nn
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    _, how, distributed = MODES[spec["mode"]]
    B, T = spec["B"], spec["T"]
    world = int(os.environ.get("WORLD_SIZE", 1))
    data = TensorDataset(torch.zeros(B * world, T, dtype=torch.long))  # only its length matters: sample rate
    if distributed:
        from opacus.utils.fsdp_utils import FSDP2Wrapper
        from torch.utils.data import DistributedSampler

        model = FSDP2Wrapper(model)
        loader = DataLoader(data, batch_size=B, sampler=DistributedSampler(data))
    else:
        loader = DataLoader(data, batch_size=B)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt, criterion, _ = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, criterion=nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=how, clipping="flat",
        poisson_sampling=False)
    autocast = autocast_for(spec, device)

    def step():
        with autocast():
            logits = model(x)
            # per-sample loss = mean over the sample's tokens (shape=(B, T, V)), then the mean over samples
            loss = criterion(logits.flatten(0, 1).float(), y.flatten(), shape=logits.shape)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, lambda loss: loss.item()


def library_info(spec: dict) -> dict:
    lib = MODES[spec["mode"]][0]
    if lib not in ("opacus16", "fork"):
        return {}
    import opacus

    where = os.path.dirname(os.path.dirname(os.path.abspath(opacus.__file__)))
    in_fork = spec["fork_path"] is not None and os.path.samefile(where, spec["fork_path"])
    if (lib == "fork") != in_fork:  # the other opacus would be measured under this one's name
        raise RuntimeError(f"mode {spec['mode']} imported opacus {opacus.__version__} from {where}")
    info = {"opacus_version": opacus.__version__, "opacus_path": where}
    commit = os.path.join(where, "COMMIT")
    if lib == "fork" and os.path.exists(commit):
        info["fork_commit"] = open(commit).read().strip()
    return info


def measure(spec: dict, device) -> dict:
    import torch

    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with device:  # initialised where it runs: a CPU init of Llama-1B's weights takes longer than its steps
        model = build_model(spec)
    dims = (TINY_DIMS if spec["tiny"] else MODEL_DIMS)[spec["model"]]
    rank = int(os.environ.get("RANK", 0))
    g = torch.Generator().manual_seed(1 + rank)
    ids = torch.randint(0, dims["vocab"], (spec["B"], spec["T"] + 1), generator=g).to(device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    make = opacus_step if MODES[spec["mode"]][0] in ("opacus16", "fork") else torch_step
    step, loss_value = make(spec, model, x, y, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    t0 = time.perf_counter()
    setup_s = t0 - T_IMPORT
    first_loss = None  # the first step's loss: every mode's model, batch and forward are the same, so this is too
    for i in range(spec["warmup"]):
        loss = step()
        if i == 0:
            first_loss = loss_value(loss)
    sync()
    warm_s = time.perf_counter() - t0
    graphs = spec["mode"] in CUDA_GRAPHS
    if device.type == "cuda" and not graphs:
        # CUDA graphs allocate their memory pool while capturing, in the warm-up: a peak of the timed
        # replays alone would miss it, so those modes keep the peak of the whole run (compile included)
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(spec["iters"]):
        sync()
        t = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t)
        if first_loss is None:  # --warmup 0: read after the timing
            first_loss = loss_value(loss)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    snapshot = memory_snapshot(spec, step, device) if spec.get("memory_snapshots") else None
    kernels = kernel_profile(spec, step, device) if spec.get("kernel_profile") else None
    stem = f"{spec['model']}_{spec['B']}x{spec['T']}_{spec['dtype']}_{spec['mode'].replace(':', '-')}"
    host = host_profile(spec["host_profile"], stem, step, sync) if spec.get("host_profile") else None
    return {"status": "ok", "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "peak_gib": peak, "compile_and_warmup_s": warm_s, "setup_s": setup_s,
            "first_loss": first_loss, "loss": loss_value(loss), "peak_includes_warmup": graphs,
            "params": sum(p.numel() for p in model.parameters()), "compile_phases": compile_phases(),
            "dp_compile_seconds": dp_compile_seconds(getattr(step, "compiled", None)),
            "inductor_kernels": inductor_kernels(),
            "memory_snapshot": snapshot, "kernel_profile": kernels, "host_profile": host}


def memory_snapshot(spec: dict, step, device) -> str | None:
    """One more step with the CUDA caching allocator's history on, dumped as a snapshot pickle (open it at
    pytorch.org/memory_viz, or read it with torch.cuda._memory_viz): which buffers are alive at the peak and
    where they were allocated. None on CPU."""
    import torch

    if device.type != "cuda":
        return None
    os.makedirs(spec["memory_snapshots"], exist_ok=True)
    path = os.path.join(spec["memory_snapshots"], f"{spec['model']}_{spec['B']}x{spec['T']}_{spec['dtype']}_"
                        f"{spec['mode'].replace(':', '-')}.pickle")
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    try:
        step()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path


def kernel_profile(spec: dict, step, device, top: int = 60) -> str | None:
    """One more step under torch.profiler: every GPU kernel's count and GPU time, summed by name, largest
    first, as JSON in DIR (where a step's time goes, to compare across modes by kernel name; one small file
    per mode and rank: the device machine returns few files, so no Chrome trace), with the step's timeline
    (gpu_timeline: compute, idle, and the longest gaps). Under CUDA graphs the kernels of a replay are seen
    too. None on CPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None
    os.makedirs(spec["kernel_profile"], exist_ok=True)
    stem = f"{spec['model']}_{spec['B']}x{spec['T']}_{spec['dtype']}_{spec['mode'].replace(':', '-')}"
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    spans, host = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            host.append((e.time_range.start, e.time_range.end, e.name))
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time_total / 1e3  # us -> ms
            if not getattr(e, "is_user_annotation", False):  # GPU ranges of record_function, not kernels
                spans.append((e.time_range.start, e.time_range.end, e.name))
    rows = sorted(([n, c, round(ms, 4)] for n, (c, ms) in kernels.items()), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:  # one file per rank: ranks wait for each other in their collectives, differently
        stem += f"_rank{os.environ.get('RANK', 0)}"
    line = gpu_timeline(spans, cpu=host)
    path = os.path.join(spec["kernel_profile"], stem + ".json")
    with open(path, "w") as f:
        json.dump({"gpu_ms": round(total, 3), "launches": sum(r[1] for r in rows), "timeline": line,
                   "kernels": rows}, f, indent=0)
    print(f"kernel profile {stem}: {len(rows)} kernels, {sum(r[1] for r in rows)} launches, "
          f"{total:.1f} ms GPU; timeline: {line['span_ms']} ms, compute {line['compute_ms']}, idle "
          f"{line['idle_ms']} (collectives alone {line['collectives_only_ms']}); top: "
          + "; ".join(f"{r[0][:60]} x{r[1]} {r[2]:.2f}" for r in rows[:top // 4]))
    return path


def gpu_timeline(spans: list, gaps: int = 12, cpu: list | None = None) -> dict:
    """Where a profiled step's GPU time went, from its kernels' (start us, end us, name): the span from the
    first kernel's start to the last one's end; the time some compute kernel runs (collectives' kernels,
    named nccl*, run beside compute on their own stream); the idle rest of the span, and the part of it in
    which only collectives run (communication the compute waits for, not overlapped); and the longest
    gaps between compute kernels, each with the compute kernels on either side (a gap is host time or a
    wait for a collective). A kernel sum alone cannot tell a GPU-bound step from one that waits.

    cpu: the host's profiled ops and ranges, (start us, end us, name) on the kernels' clock. Then each gap
    also names what the host was running at its middle (the innermost three ranges there, shortest first:
    the host work the GPU waited for), and ``host_lead_ms`` is the host's time from its first range to the
    first kernel (a step's start, which the GPU spends idle)."""
    def merged(ivs):
        out = []
        for a, b in sorted(ivs):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    if not spans:
        return {"span_ms": 0.0, "compute_ms": 0.0, "idle_ms": 0.0, "collectives_only_ms": 0.0, "gaps": []}
    comm = [(a, b) for a, b, n in spans if n.lower().startswith("nccl")]
    compute = sorted((a, b, n) for a, b, n in spans if not n.lower().startswith("nccl"))
    start, end = min(a for a, _, _ in spans), max(b for _, b, _ in spans)
    busy = merged([(a, b) for a, b, _ in compute])
    compute_us = sum(b - a for a, b in busy)
    holes = [(a, b) for (_, a), (b, _) in zip([[start, start]] + busy, busy + [[end, end]]) if b > a]
    comm_m = merged(comm)

    def overlap(a, b):
        return sum(max(0, min(b, y) - max(a, x)) for x, y in comm_m)

    only_comm = sum(overlap(a, b) for a, b in holes)
    found, last_end, last_name = [], None, None
    for a, b, n in compute:
        if last_end is not None and a > last_end:
            found.append((a - last_end, last_name, n, (a + last_end) / 2))
        if last_end is None or b >= last_end:
            last_end, last_name = b, n
    found.sort(key=lambda g: -g[0])
    out = {"span_ms": round((end - start) / 1e3, 3), "compute_ms": round(compute_us / 1e3, 3),
           "idle_ms": round((end - start - compute_us) / 1e3, 3), "collectives_only_ms": round(only_comm / 1e3, 3),
           "gaps": [[round(us / 1e3, 3), before[:90], after[:90]] for us, before, after, *_ in found[:gaps]]}
    if cpu:
        innermost_first = sorted(cpu, key=lambda e: e[1] - e[0])
        for row, (us, _, _, mid) in zip(out["gaps"], found[:gaps]):
            row.append([n[:60] for a, b, n in innermost_first if a <= mid <= b][:3])
        out["host_lead_ms"] = round(max(0.0, start - min(a for a, _, _ in cpu)) / 1e3, 3)
    return out


def host_profile(folder: str, stem: str, step, sync, steps: int = 5, top: int = 45) -> str:
    """``steps`` more steps under cProfile, the GPU synchronised after each: where the host's time goes (a
    launch-bound step's wall time is its host time), as text in DIR: the functions by their own time and by
    their cumulative time. cProfile, not torch.profiler's CPU ops (vision.py --host-profile): the time in
    Python between ops (Triton's launcher, Inductor's wrapper code, custom ops' Python) is what it shows."""
    import cProfile
    import io
    import pstats

    os.makedirs(folder, exist_ok=True)
    sync()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
        sync()
    prof.disable()
    wall = (time.perf_counter() - t) / steps
    buf = io.StringIO()
    buf.write(f"{stem}: {steps} steps under cProfile, {1e3 * wall:.1f} ms a step (profiler overhead included)\n")
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
    path = os.path.join(folder, stem + ".txt")
    with open(path, "w") as f:
        f.write(buf.getvalue())
    prof.dump_stats(os.path.join(folder, stem + ".prof"))  # the whole profile, for pstats where it is read
    return path


def inductor_kernels() -> int | None:
    """Kernels Inductor generated in this process (all graphs of the step, forward and backward): an A/B of a
    fusion setting that changes this changed the generated code."""
    try:
        from torch._inductor import metrics
    except ImportError:
        return None
    return int(metrics.generated_kernel_count)


def compile_phases(top: int = 40) -> dict:
    """Where the compile time went: seconds per dynamo_timed phase (Dynamo tracing, AOTAutograd, the
    partitioner with dpcompile's passes, Inductor's lowering, scheduling, code generation, and waiting for
    the kernel compiles), the largest first. Phases nest, so they do not add up."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {k: round(sum(v), 2) for k, v in compilation_time_metrics.items()}
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])


def dp_compile_seconds(fn) -> dict | None:
    """Where dpcompile's part of the compile went (its record's summary "compile_seconds": each pass, the
    min-cut partition, the kept graph texts), for a private_step; None otherwise. private_step hands equal
    options one backend, whose records pile up over shapes and dtypes: this mode's is the last."""
    recs = [r for r in getattr(getattr(fn, "dp_backend", None), "compiled", ()) if r.dp]
    return recs[-1].summary.get("compile_seconds") if recs else None


def failure(exc: BaseException) -> dict:
    import traceback

    text = f"{type(exc).__name__}: {exc}"
    if "out of memory" in text.lower():  # also when Inductor wraps a CUDA OOM of its autotuning
        return {"status": "OOM", "reason": text.splitlines()[0][:300]}
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # where it broke: the innermost frame outside torch (in Opacus, the fork, dpcompile or this file)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name})" if frames else ""
    return {"status": "fail", "reason": (" | ".join(lines[:2])[:250] + where)}


def worker(spec: dict) -> int:
    """One mode in this process; rank 0 prints one RESULT_TAG line of JSON."""
    if spec["fork_path"] and MODES[spec["mode"]][0] == "fork":
        sys.path.insert(0, spec["fork_path"])  # before site-packages' (or PYTHONPATH's) opacus 1.6
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not spec["tiny"]
    if distributed(spec):  # under torchrun, or one rank started directly
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29544")
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_float32_matmul_precision("high")  # TF32 matmuls for fp32 (bf16 autocast does not care)
    for key, value in (spec.get("inductor_config") or {}).items():
        setattr(*inductor_setting(key), value)
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "ranks": int(os.environ.get("WORLD_SIZE", 1))}
    if spec.get("dp_options") and MODES[spec["mode"]][0] == "dpcompile":
        result["dp_options"] = spec["dp_options"]
    try:
        result.update(library_info(spec))  # first: a failing mode's row also says which opacus it ran
        if spec.get("bucket_mb") and compiled_mode(spec["mode"]):  # else fully_shard's default (sharded)
            sys.path.insert(0, ROOT)  # as build_model: dpcompile from this checkout
            import dpcompile

            off = spec["bucket_mb"] == "off"
            dpcompile.bucket_collectives(None if off else spec["bucket_mb"], overlap=spec.get("overlap", False))
        result.update(measure(spec, device))
    except Exception as exc:  # noqa: BLE001 - any failure of the mode is a result, not a crash
        result.update(failure(exc))
        import traceback

        traceback.print_exc()
    if int(os.environ.get("RANK", 0)) == 0:
        print(RESULT_TAG + json.dumps({**spec, **result}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- the parent: jobs, table, chart

def bucket_size(text: str) -> float | str:
    """--bucket-mb: a positive number of MiB, or 'off'."""
    if text == "off":
        return text
    try:
        mb = float(text)
    except ValueError:
        mb = 0.0
    if not 0 < mb < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of MiB or 'off', got {text!r}")
    return mb


def parse_shape(text: str) -> tuple[str, int, int]:
    model, _, bt = text.partition(":")
    b, _, t = bt.partition("x")
    if model not in MODEL_DIMS or not (b.isdigit() and t.isdigit()):
        raise ValueError(f"shape {text!r}: expected MODEL:BxT with MODEL one of {sorted(MODEL_DIMS)}")
    return model, int(b), int(t)


def inductor_setting(key: str) -> tuple[object, str]:
    """(the config object holding it, its name) for an attribute path of torch._inductor.config, e.g.
    triton.cudagraphs; (None, name) when the path does not lead to a config object."""
    import torch._inductor.config as inductor_config

    *path, name = key.split(".")
    obj = inductor_config
    for part in path:
        obj = getattr(obj, part, None)
    return obj, name


def parse_dp_option(text: str) -> tuple[str, object]:
    """KEY=VALUE of --dp-option: KEY a field of dpcompile.DPConfig that the benchmark does not set itself, VALUE a
    Python literal (a bare word is taken as a string: linear_norm=ghost)."""
    import ast
    import dataclasses

    sys.path.insert(0, ROOT)
    from dpcompile.config import DPConfig

    key, eq, value = text.partition("=")
    fields = {f.name for f in dataclasses.fields(DPConfig)}
    own = {"max_grad_norm", "noise_multiplier", "expected_batch_size", "schedule", "cudagraphs"}
    if not eq or key not in fields or key in own:
        raise ValueError(f"--dp-option {text!r}: expected KEY=VALUE with KEY one of "
                         f"{sorted(fields - own)} (the benchmark sets {sorted(own)} itself)")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def parse_setting(text: str) -> tuple[str, object]:
    """KEY=VALUE of --inductor-config: KEY an attribute path of torch._inductor.config, VALUE a Python literal."""
    import ast

    key, eq, value = text.partition("=")
    obj, name = inductor_setting(key)
    if not eq or obj is None or not hasattr(obj, name):
        raise ValueError(f"--inductor-config {text!r}: expected KEY=VALUE with KEY a torch._inductor.config setting")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"--inductor-config {text!r}: VALUE must be a Python literal ({exc})") from None


def distributed(spec: dict) -> bool:
    """Whether the mode runs in a process group: Opacus' and the fork's FSDP modes, and with --shard the
    non-private and dp_fsdp modes."""
    return MODES[spec["mode"]][2] or (spec["shard"] and compiled_mode(spec["mode"]))


def compiled_mode(mode: str) -> bool:
    """The non-private step and dpcompile's modes: Inductor compiles them, fully_shard shards them (--shard),
    and Inductor's collective bucketing (--bucket-mb) applies to them."""
    return MODES[mode][0] in ("torch", "dpcompile")


def _process_tree(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every descendant of pid, from /proc (empty where there is none). torchrun starts each
    rank in a session of its own, so the rank processes are not in torchrun's process group."""
    children: dict[int, list[tuple[int, str]]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            children.setdefault(int(fields[1]), []).append((int(name), fields[19]))  # ppid, starttime
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """Ends a child and everything it started: SIGTERM to its process group (torchrun passes it on to its ranks),
    then after `grace` seconds SIGKILL to whatever of it is left, ranks included (they would otherwise run on,
    holding the GPU and the output pipes)."""
    tree = _process_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    for pid, started in tree:
        if _start_time(pid) == started:  # still the same process, not a reused id
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _die_with_parent() -> None:
    """In the child before it runs: SIGTERM to it when this script dies, even of SIGKILL (Linux), so that no mode
    runs on, holding a GPU, after a hard wall-clock limit (torchrun passes the SIGTERM on to its ranks)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Stopped(Exception):
    """The parent got SIGTERM, SIGINT or SIGHUP (e.g. a wall-clock limit) while a mode ran: that mode is ended,
    and the rows finished so far are kept."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOP = {"signum": None, "waiting": False}  # the signal got, and whether a child is being waited for


def _stopped(signum, frame):
    """SIGTERM/SIGINT/SIGHUP handler of the parent: ends the child being waited for (launch), else only notes
    the signal, so that the run stops before its next mode and never in the middle of writing its rows."""
    _STOP["signum"] = signum
    if _STOP["waiting"]:
        raise Stopped(signum)


def launch(spec: dict, *, nproc: int, timeout: float, log_dir: str | None) -> dict:
    """Runs one mode in a child (under torchrun when it runs on several ranks); returns its result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    ranks = nproc if distributed(spec) else 1
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] + cmd[1:]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if spec["tiny"]:
        env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")  # C++ kernels without SIMD build faster (tests/conftest.py)
        # one thread: on a busy CPU every eager op's OpenMP barrier waits for a descheduled thread (a tiny eager
        # step took 270 ms with 2 threads, 1.5 ms with 1)
        env.setdefault("OMP_NUM_THREADS", "1")
    if MODES[spec["mode"]][0] == "fork":  # also for torchrun's children
        env["PYTHONPATH"] = os.pathsep.join(p for p in (spec["fork_path"], env.get("PYTHONPATH")) if p)
    base = {**spec, "ranks": ranks}
    # its own process group and session: a timeout or a stop of this script ends it (stop() above) and a Ctrl-C
    # in the terminal reaches only this script, which then ends the child
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    rc: int | None = None
    try:
        _STOP["waiting"] = True
        if _STOP["signum"] is not None:  # got between the check in run_all and here
            raise Stopped(_STOP["signum"])
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
        _STOP["waiting"] = False
    except subprocess.TimeoutExpired:
        _STOP["waiting"] = False
        stop(proc)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something outside the process tree still holds the pipes
            out, err = "", "(output lost: the pipes stayed open after the child was killed)"
    except Stopped:  # quickly: a wall-clock limit's SIGKILL may follow its SIGTERM within seconds
        _STOP["waiting"] = False
        stop(proc, grace=2)
        raise
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        name = (f"{spec['model']}_{spec['B']}x{spec['T']}_{spec['dtype']}_{spec['mode'].replace(':', '-')}"
                + (f"_{ranks}ranks" if ranks > 1 else "") + ".log")
        with open(os.path.join(log_dir, name), "w") as f:
            f.write(" ".join(cmd) + "\n" + out + "\n--- stderr ---\n" + err)
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    if rc is None:
        return {**base, "status": "timeout", "reason": f"no result within {timeout:.0f} s"}
    status = "OOM" if "out of memory" in err.lower() else "fail"
    return {**base, "status": status, "reason": f"child exited with {rc}: {last_error(err)[:250]}"}


def last_error(err: str) -> str:
    """The line of a child's stderr that says why it failed: the last exception line of a traceback (torchrun
    ends a failed rank's output with a banner of '=' and a summary, which say nothing of the cause), else the
    last line that is not the banner."""
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.match(r"^(?:[a-z_]\w*\.)*[A-Z]\w*(?:: .+|$)", line):  # [module.]ExceptionClass[: message]
            return line
    return next((ln for ln in reversed(lines) if set(ln) != {"="}), "(no output)")


def skip_reason(spec: dict, *, nproc: int) -> str | None:
    lib, _, distributed = MODES[spec["mode"]]
    if lib == "fork" and not spec["fork_path"]:
        return "no --fork-path"
    if distributed and nproc < 2:
        return f"needs 2+ ranks (--nproc {nproc})"
    if spec["mode"] in CUDA_GRAPHS and spec["tiny"]:
        return "CUDA graphs need a GPU (--tiny runs on the CPU)"
    return None


def add_ratios(results: list[dict]) -> None:
    """time_ratio / mem_ratio: to the fastest non-private row of the same shape and dtype (the same number of
    ranks if there is one)."""
    for r in results:
        group = [b for b in results if b["mode"] in NONPRIVATE and b["status"] == "ok"
                 and (b["model"], b["B"], b["T"], b["dtype"]) == (r["model"], r["B"], r["T"], r["dtype"])]
        same_ranks = [b for b in group if b.get("ranks", 1) == r.get("ranks", 1)]
        ref = min(same_ranks or group, key=lambda b: b["median_ms"], default=None)
        r["ref_mode"] = mode_name(ref) if ref else None
        ok = ref is not None and r["status"] == "ok"
        r["time_ratio"] = r["median_ms"] / ref["median_ms"] if ok else None
        r["mem_ratio"] = r["peak_gib"] / ref["peak_gib"] if ok and r.get("peak_gib") and ref.get("peak_gib") else None


def label(r: dict) -> str:
    return f"{r['model']} {r['B']}x{r['T']} {r['dtype']}"


def mode_name(r: dict) -> str:
    """The mode, and the collective bucketing it compiled with where not fully_shard's default (--bucket-mb):
    such a run is a row of its own beside the default one."""
    if r.get("unbacked") and r["mode"] in MODES and MODES[r["mode"]][0] == "dpcompile" and not r.get("shard"):
        return f"{r['mode']} unbacked"
    if not (r.get("bucket_mb") and r["mode"] in MODES and compiled_mode(r["mode"])):
        return r["mode"]
    if r["bucket_mb"] == "off":
        return f"{r['mode']} unbucketed"
    return f"{r['mode']} b{r['bucket_mb']:g}" + ("+overlap" if r.get("overlap") else "")


def series(r: dict) -> str:
    """The mode, and its ranks when it ran on several (merged single-rank and sharded runs share a chart)."""
    ranks = r.get("ranks", 1)
    return mode_name(r) + (f" ({ranks} ranks)" if ranks > 1 else "")


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table_rows(results: list[dict]) -> list[list[str]]:
    rows = []
    for r in results:
        note = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        rows.append([label(r), mode_name(r), str(r.get("ranks", 1)), fmt(r.get("median_ms"), ".1f"),
                     fmt(r.get("time_ratio"), ".2f"), fmt(r.get("peak_gib"), ".2f"), fmt(r.get("mem_ratio"), ".2f"),
                     fmt(r.get("compile_and_warmup_s"), ".1f"), fmt(r.get("first_loss"), ".4f"), note])
    return rows


HEADER = ["shape dtype", "mode", "ranks", "median ms", "x best non-private", "peak GiB", "memory x",
          "compile+warmup s", "step-1 loss", "status"]
# how far a mode's step-1 loss may be from the others' (relative): Inductor's fusions and TF32 matmuls under
# fp32, bf16 rounding under autocast
LOSS_TOLERANCE = {"fp32": 2e-3, "bf16": 2e-2}


def loss_check(results: list[dict]) -> list[str]:
    """Every mode trains the same model (seed 0) on the same batch (rank 0's is the unsharded batch), so the loss
    of the first step, before any update, must agree across the modes of one shape and dtype, whatever their
    ranks; later losses differ by their noise. Returns a line for each group where some mode's does not."""
    lines = []
    for g in dict.fromkeys(label(r) for r in results):
        rows = [r for r in results if label(r) == g and r["status"] == "ok" and r.get("first_loss") is not None]
        if len(rows) < 2:
            continue
        mid = statistics.median(r["first_loss"] for r in rows)
        tol = LOSS_TOLERANCE.get(rows[0]["dtype"], 2e-3) * max(1.0, abs(mid))
        off = [r for r in rows if abs(r["first_loss"] - mid) > tol]
        if off:
            lines.append(f"{g}: step-1 loss differs from the median {mid:.5f} (tolerance {tol:.1e}): "
                         + ", ".join(f"{series(r)} {r['first_loss']:.5f}" for r in off))
    return lines


def describe(results: list[dict]) -> str:
    """Machine and versions, from what the children reported."""
    def seen(key, lib=None):
        return ", ".join(sorted({str(r[key]) for r in results if r.get(key)
                                 and (lib is None or MODES.get(r["mode"], ("",))[0] == lib)})) or "-"
    return (f"device: {seen('device')}; torch {seen('torch')}; opacus {seen('opacus_version', 'opacus16')}; "
            f"fork: opacus {seen('opacus_version', 'fork')} at commit {seen('fork_commit')}")


def print_table(results: list[dict]) -> None:
    print(describe(results))
    rows = table_rows(results)
    widths = [max([len(h)] + [len(row[i]) for row in rows]) if i < len(HEADER) - 1 else 0
              for i, h in enumerate(HEADER)]
    for row in [HEADER] + rows:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    for line in loss_check(results):
        print("LOSS MISMATCH " + line)


def print_markdown(results: list[dict]) -> None:
    print(describe(results) + "\n")
    print("| " + " | ".join(HEADER) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in HEADER[2:-1]) + " | --- |")
    for row in table_rows(results):
        print("| " + " | ".join(c.replace("|", "/") for c in row) + " |")


def plot(results: list[dict], path: str) -> None:
    """Grouped bars: one group per shape and dtype, one bar per mode (time / fastest non-private step). A mode
    that did not run in a group gets an x and its status (fail, OOM, timeout, skip) instead of a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(label(r) for r in results))
    modes = [m for m in dict.fromkeys(series(r) for r in results)
             if any(series(r) == m and r["status"] != "skipped" for r in results)]  # drop modes run nowhere
    # one colour per mode, the same in every chart (MODES has ten); several ranks hatched, bucketed dotted
    mode_of = {series(r): r["mode"] for r in results}
    color = {m: plt.get_cmap("tab10")((list(MODES).index(mode_of[m]) if mode_of[m] in MODES else 9) % 10)
             for m in modes}
    first = {series(r): r for r in reversed(results)}
    hatch = {m: ("///" if first[m].get("ranks", 1) > 1 else "") + (".." if mode_name(first[m]) != mode_of[m] else "")
             or None for m in modes}
    by_key = {(label(r), series(r)): r for r in results}
    width = 0.8 / max(1, len(modes))
    top = max([r["time_ratio"] for r in results if r.get("time_ratio")] or [1.0])
    log = top > 20  # e.g. a CPU smoke run's eager rows: a linear axis would flatten the rest
    mark_y, word_y = (0.6, 0.75) if log else (0.03 * top, 0.07 * top)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.22 * len(modes) * len(groups) + 3), 5.5))
    for i, g in enumerate(groups):
        for j, mode in enumerate(modes):
            r, xpos = by_key.get((g, mode)), i + (j - (len(modes) - 1) / 2) * width
            if r is None:
                continue
            if r.get("time_ratio"):
                ax.bar(xpos, r["time_ratio"], width, color=color[mode], hatch=hatch[mode], edgecolor="white",
                       linewidth=0)
                ax.text(xpos, r["time_ratio"], f"{r['time_ratio']:.2f}", ha="center", va="bottom", fontsize=6,
                        rotation=90)
            elif r["status"] != "ok":
                ax.plot(xpos, mark_y, marker="x", color=color[mode], markersize=7)
                ax.text(xpos, word_y, {"skipped": "skip"}.get(r["status"], r["status"]), ha="center",
                        va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel("step time / fastest non-private step")
    if log:
        ax.set_yscale("log")
        ax.set_ylim(0.5, top * 2.0)
    else:
        ax.set_ylim(0, top * 1.18)
    devices = ", ".join(sorted({r["device"] for r in results if r.get("device")})) or "?"
    ax.set_title(f"DP-SGD step time relative to the fastest non-private step ({devices}); x = did not run",
                 fontsize=10)
    ax.legend([plt.Rectangle((0, 0), 1, 1, facecolor=color[m], hatch=hatch[m], edgecolor="white", linewidth=0)
               for m in modes], modes, fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


STATUS_RANK = {"ok": 2, "skipped": 0}  # a merge keeps the best row of a key: ok, then fail/OOM/timeout/stopped


def pool_rounds(results: list[dict]) -> list[dict]:
    """--rounds: the rows of one shape, dtype, mode and ranks as one. Each round runs a mode in a process of its
    own, and on the device machines' hosts the same step's median moves by up to 20 % from one process to the
    next (GPT-2 32x256 bf16 bk: 21.8 to 25.8 ms), so one process per mode cannot compare two within 5 %. The
    pooled row's median_ms is the median of its ok rounds' medians (``round_ms``, in run order), min_ms and
    peak_gib the extremes, compile_and_warmup_s the first round's (the cold compile), ``rounds`` "ok/run"; a
    mode with no ok round keeps its last row."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((label(r), mode_name(r), r.get("ranks", 1)), []).append(r)
    pooled = []
    for rows in groups.values():
        ok = [r for r in rows if r["status"] == "ok"]
        if len(rows) == 1 or not ok:
            pooled.append(rows[-1])
            continue
        row = {**ok[0], "round_ms": [r["median_ms"] for r in ok], "rounds": f"{len(ok)}/{len(rows)}"}
        row["median_ms"] = statistics.median(row["round_ms"])
        row["min_ms"] = min(r["min_ms"] for r in ok)
        peaks = [r["peak_gib"] for r in ok if r.get("peak_gib") is not None]
        row["peak_gib"] = max(peaks) if peaks else None
        pooled.append(row)
    return pooled


def finish(results: list[dict]) -> list[dict]:
    """Rounds pooled, ratios recomputed, rows sorted: the calls' order of shapes and dtypes, modes as in MODES,
    then ranks."""
    results = pool_rounds(results)
    add_ratios(results)
    groups = list(dict.fromkeys(label(r) for r in results))
    return sorted(results, key=lambda r: (groups.index(label(r)),
                                          list(MODES).index(r["mode"]) if r["mode"] in MODES else 99,
                                          mode_name(r) != r["mode"],
                                          r.get("ranks", 1)))


def write_json(path: str, results: list[dict], command, **extra) -> None:
    """The --out file, replaced atomically: a run killed while writing leaves the previous version whole."""
    doc = {"command": command, "machine": describe(results), **extra, "results": results}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def merge(paths: list[str]) -> tuple[list[dict], list]:
    """The rows of several --out files, complete or partial (a run stopped by a wall-clock limit leaves the rows
    it finished). One row per shape, dtype, mode and ranks: an ok row wins over a failed one and that over a
    skipped one, a later file over an earlier one; a skipped row goes where the mode ran with other ranks."""
    best: dict[tuple, dict] = {}
    commands = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        rows = doc.get("results", [])
        commands.append(doc.get("command"))
        if doc.get("partial"):
            print(f"merge: {path} is partial ({len(rows)} of {doc.get('planned', '?')} rows: its run was stopped "
                  f"or is still going)", flush=True)
        for r in rows:
            r.setdefault("ranks", 1)
            k = (r["model"], r["B"], r["T"], r["dtype"], mode_name(r), r["ranks"])
            if k not in best or STATUS_RANK.get(r["status"], 1) >= STATUS_RANK.get(best[k]["status"], 1):
                best.pop(k, None)  # re-inserted: the order of the later row
                best[k] = r
    ran = {k[:5] for k, r in best.items() if r["status"] != "skipped"}
    return [r for k, r in best.items() if r["status"] != "skipped" or k[:5] not in ran], commands


def run_all(args, on_row=None) -> tuple[list[dict], int | None]:
    """Runs every shape x dtype x mode; on_row(results) after each. Returns the rows and, when a SIGTERM,
    SIGINT or SIGHUP stopped the run, its number (the mode then running ends as a row with status 'stopped')."""
    specs = [dict(model=m, B=b, T=t, dtype=dt, mode=mode, tiny=args.tiny, warmup=args.warmup, iters=args.iters,
                  fork_path=os.path.abspath(args.fork_path) if args.fork_path else None, shard=args.shard,
                  llama_tied=args.llama_tied, gpt_tied=args.gpt_tied, inductor_config=args.inductor_config,
                  dp_options=args.dp_options,
                  bucket_mb=args.bucket_mb, overlap=args.overlap, unbacked=args.unbacked,
                  memory_snapshots=os.path.abspath(args.memory_snapshots) if args.memory_snapshots else None,
                  kernel_profile=os.path.abspath(args.kernel_profile) if args.kernel_profile else None,
                  host_profile=os.path.abspath(args.host_profile) if args.host_profile else None)
             for (m, b, t) in args.shapes for dt in args.dtypes for mode in args.modes]
    # --rounds: every mode again after all the others, in the same order (pool_rounds joins them)
    specs = specs if args.rounds == 1 else [{**s, "round": k} for k in range(args.rounds) for s in specs]
    results: list[dict] = []
    stopped = None
    for n, spec in enumerate(specs, 1):
        if _STOP["signum"] is not None:  # got between two modes
            stopped = _STOP["signum"]
            if on_row:
                on_row(results, planned=len(specs), partial=True)
            break
        head = f"[{n}/{len(specs)}] {label(spec)} {spec['mode']:<20}"
        t0 = time.perf_counter()
        try:
            reason = skip_reason(spec, nproc=args.nproc)
            if reason:
                r = {**spec, "status": "skipped", "reason": reason}
            else:
                print(f"{head} ...", flush=True)
                r = launch(spec, nproc=args.nproc, timeout=args.mode_timeout, log_dir=args.logs)
                r["wall_s"] = time.perf_counter() - t0
        except Stopped as exc:
            stopped = exc.signum
            r = {**spec, "ranks": args.nproc if distributed(spec) else 1, "status": "stopped",
                 "reason": f"this script got {exc} after {time.perf_counter() - t0:.0f} s of this mode",
                 "wall_s": time.perf_counter() - t0}
        what = (f"{r['median_ms']:.1f} ms, peak {fmt(r.get('peak_gib'), '.2f')} GiB, "
                f"compile+warmup {r['compile_and_warmup_s']:.0f} s" if r["status"] == "ok"
                else f"{r['status']}: {r.get('reason', '')}")
        print(f"{head} {what}", flush=True)
        results.append(r)
        if on_row:
            on_row(results, planned=len(specs), partial=stopped is not None or n < len(specs))
        if stopped is not None:
            break
    return results, stopped


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help=f"MODEL:BxT,... (default {DEFAULT_SHAPES}; --tiny: gpt:4x16)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    ap.add_argument("--dtypes", default=None, help="fp32,bf16 (default both; --tiny: fp32)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps, compile included (default 3; --tiny 2)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 10; --tiny 3)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: 2-layer d=32 models, fp32, few steps")
    ap.add_argument("--fork-path", default=None, help="directory holding the fork's `opacus` package source")
    ap.add_argument("--nproc", type=int, default=None,
                    help="ranks for the FSDP modes (and --shard); default: the number of GPUs")
    ap.add_argument("--shard", action="store_true",
                    help="non-private and dp_fsdp modes sharded with dpcompile.fully_shard over --nproc ranks "
                         "(reshard_after_forward=True: dp_fsdp re-gathers in the backward, ZeRO-3; the non-private "
                         "step's partitioner keeps the gathered parameters, ZeRO-2 in effect: README)")
    ap.add_argument("--bucket-mb", type=bucket_size, default=None,
                    help="compiled modes (non-private and dpcompile): dpcompile.bucket_collectives(MiB), Inductor's "
                         "bucketing of the sharded step's all-gathers and reduce-scatters, rows marked bMB; 'off': "
                         "unbucketed, rows marked so; default: fully_shard's (64 MiB, overlapped)")
    ap.add_argument("--overlap", action="store_true",
                    help="with --bucket-mb MiB: also Inductor's compute/communication reordering")
    ap.add_argument("--unbacked", action="store_true",
                    help="dpcompile modes on one process compiled with the batch size unbacked "
                         "(dpcompile.mark_batch(ids, targets, hint=B)), as every sharded step is: rows marked "
                         "'unbacked', beside the static-batch rows of another call (what the unbacked size costs "
                         "Inductor, measured on one GPU)")
    ap.add_argument("--llama-tied", action="store_true", help="tie Llama's LM head to its embedding (Opacus refuses)")
    ap.add_argument("--gpt-tied", action="store_true", help="tie GPT's LM head to its token embedding, as GPT-2 does "
                    "(Opacus refuses)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every mode this many times, each round after all modes of the one before, each run a "
                         "process of its own; a mode's median is the median of its rounds' (pool_rounds)")
    ap.add_argument("--mode-timeout", type=float, default=600, help="seconds one mode may take, compile included")
    ap.add_argument("--logs", default=None, help="directory for each mode's full output")
    ap.add_argument("--memory-snapshots", default=None, metavar="DIR",
                    help="CUDA: after the timed steps, one more step recorded as a memory snapshot pickle in DIR "
                         "(what is alive at the peak, and where it was allocated)")
    ap.add_argument("--kernel-profile", default=None, metavar="DIR",
                    help="CUDA: one more step under torch.profiler; every GPU kernel's count and time, and the "
                         "step's timeline (compute, idle, waits on collectives), as JSON in DIR, one file per rank")
    ap.add_argument("--host-profile", default=None, metavar="DIR",
                    help="5 more steps under cProfile (GPU synchronised after each): the host's time by function, "
                         "as text in DIR")
    ap.add_argument("--dp-option", action="append", default=[], metavar="KEY=VALUE", dest="dp_options",
                    help="a dpcompile option for the dp modes (a DPConfig field, e.g. linear_norm=ghost), VALUE a "
                         "Python literal; repeatable. The rows record them")
    ap.add_argument("--inductor-config", action="append", default=[], metavar="KEY=VALUE",
                    help="set torch._inductor.config.KEY (a Python literal) in every child before it compiles, for "
                         "A/B runs of an Inductor setting; recorded in each row (repeatable)")
    ap.add_argument("--out", default=None,
                    help="JSON of all rows, rewritten after every mode (marked partial until the last)")
    ap.add_argument("--plot", default=None, help="bar chart PNG of the time ratios")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="run nothing: join earlier --out files, partial ones too (ratios recomputed; one row per "
                         "shape, dtype, mode and ranks, ok rows first) for --out/--plot/--markdown")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))

    stopped = None
    if args.merge:
        try:
            results, command = merge(args.merge)
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--merge: {type(exc).__name__}: {exc}")
        extra = {"merged_from": args.merge}
    else:
        try:
            shapes = args.shapes or ("gpt:4x16" if args.tiny else DEFAULT_SHAPES)
            args.shapes = [parse_shape(s) for s in shapes.split(",")]
        except ValueError as exc:
            ap.error(str(exc))
        args.dtypes = (args.dtypes or ("fp32" if args.tiny else "fp32,bf16")).split(",")
        args.modes = args.modes.split(",")
        for bad in [m for m in args.modes if m not in MODES] + [d for d in args.dtypes if d not in ("fp32", "bf16")]:
            ap.error(f"unknown mode or dtype {bad!r}")
        try:
            args.inductor_config = dict(parse_setting(kv) for kv in args.inductor_config)
            args.dp_options = dict(parse_dp_option(kv) for kv in args.dp_options)
        except ValueError as exc:
            ap.error(str(exc))
        args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 3)
        args.iters = args.iters if args.iters is not None else (3 if args.tiny else 10)
        if args.iters < 1 or args.warmup < 0 or args.rounds < 1:
            ap.error("--iters and --rounds must be at least 1 and --warmup at least 0")
        if args.unbacked and args.shard:
            ap.error("--unbacked is for one process: a sharded step's batch size is unbacked already")
        if args.overlap and args.bucket_mb in (None, "off"):
            ap.error("--overlap needs --bucket-mb MiB (fully_shard's default overlaps already)")
        if args.nproc is None:
            import torch

            args.nproc = max(1, torch.cuda.device_count()) if not args.tiny else 1
        command = " ".join([os.path.relpath(os.path.abspath(__file__), ROOT)] + (sys.argv[1:] if argv is None
                                                                                  else list(argv)))

        def on_row(rows, **extra):  # the rows so far: a run stopped by a wall-clock limit keeps them
            if args.out:
                write_json(args.out, finish(rows), command, **extra)

        print(f"anchors: {len(args.shapes)} shapes x {len(args.dtypes)} dtypes x {len(args.modes)} modes, "
              f"warmup {args.warmup}, iters {args.iters}, nproc {args.nproc}", flush=True)
        for sig in STOP_SIGNALS:
            signal.signal(sig, _stopped)
        results, stopped = run_all(args, on_row)
        extra = {}
    results = finish(results)
    print_table(results)
    for r in results:
        if "round_ms" in r:
            print(f"rounds: {label(r)} {mode_name(r)}: {', '.join(f'{v:.1f}' for v in r['round_ms'])} ms "
                  f"({r['rounds']} ok)")
    if args.markdown:
        print()
        print_markdown(results)
    if args.out and args.merge:  # a run's own --out is written after every mode, the last time with every row
        write_json(args.out, results, command, partial=False, **extra)
    if args.out:
        print(f"json: {args.out}" + (" (partial)" if stopped else ""))
    if args.plot and results:
        plot(results, args.plot)
        print(f"chart: {args.plot}")
    if stopped:
        print(f"anchors: stopped by {signal.Signals(stopped).name}; the modes after the stopped one did not run",
              file=sys.stderr)
        return 128 + stopped
    return 0


if __name__ == "__main__":
    sys.exit(main())
