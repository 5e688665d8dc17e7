"""Compile time of the DP step against the non-private step, cold or warm caches.

Each run is a fresh process that builds anchors.py's model and step for one
shape (the same model class, batch, loss and SGD step as the anchors table:
`anchors.build_model`, `anchors.torch_step`), times the first step (compile
included) and then the median of 10 steps (CPU: 2). Modes: nonprivate (stock
``torch.compile``), bk, ghost, auto (``dpcompile.private_step``). Runs
alternate between the modes ``--repeats`` times, so a drift of the host shows
in every mode alike. bf16 autocast on a GPU, fp32 on CPU.

Caches: ``cold`` gives each run empty Inductor and Triton cache directories
(and no FX graph cache), which is what a first compile of a new model costs;
``warm`` first fills one cache directory per mode with a run of its own and
then measures a second process start on it (the restart of a job).

    python benchmarks/compile_time.py                       # GPU: gpt:32x256; CPU: gpt:2x32
    python benchmarks/compile_time.py --shape llama:2x1024 --modes nonprivate,bk --cache warm --out ct.json
    python benchmarks/compile_time.py --inductor max_fusion_buffer_group_pairwise_attempts=16   # an Inductor setting
    python benchmarks/compile_time.py --fake-ranks 2 --dtype fp32   # sharded: rank 0 of 2, on one GPU
    python benchmarks/compile_time.py --modes ghost --dp-option pause_gc=False   # a dpcompile option, DP modes
    python benchmarks/compile_time.py --modes nonprivate,ghost,"ghost[pause_gc=False]"   # an option for one row,
                                                                                 # alternating with the others
    python benchmarks/compile_time.py --fake-ranks 2 --modes nonprivate,ghost,"ghost[reshard_after_forward=False]"

``--fake-ranks N`` compiles the step sharded with ``dpcompile.fully_shard`` (fully_shard's default bucketing) as
rank 0 of an N-rank world, in one process on one device, on torch's fake process group: its collectives return
at once and move nothing. The graphs, passes, bucketing and kernels are those of rank 0 of a real N-rank job, so
the compile time is what such a rank spends compiling, less its waits for the other ranks (a real job's
autotuning also waits inside its synchronisations for the other rank's collectives). The step time is rank 0's
computation without communication, and its values are not a real step's (the gathers leave their buffers
unwritten). It lets one GPU measure the sharded compile.

``--inductor KEY=VALUE`` (repeatable) sets ``torch._inductor.config.KEY`` in every run (VALUE read as a Python
literal), for both modes alike. Each row also gives the kernels Inductor generated (``metrics.generated_kernel_count``).
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

import anchors


def child(mode: str, shape: str, *, fake_ranks: int, dtype: str | None, disable_passes: list[str]) -> dict:
    import ast

    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics

    for setting in filter(None, os.environ.get("DPC_CT_INDUCTOR", "").split(";")):
        key, value = setting.split("=", 1)
        if not hasattr(inductor_config, key):
            raise SystemExit(f"--inductor: torch._inductor.config has no setting {key!r}")
        setattr(inductor_config, key, ast.literal_eval(value))

    model_name, B, T = anchors.parse_shape(shape)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if fake_ranks:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if device.type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("fake", rank=0, world_size=fake_ranks, store=FakeStore())
        os.environ["WORLD_SIZE"] = str(fake_ranks)  # anchors.torch_step's expected batch: B per rank
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls for fp32, as anchors.py's rows
    spec = dict(model=model_name, B=B, T=T, mode=mode, dtype=dtype or ("bf16" if device.type == "cuda" else "fp32"),
                tiny=False, shard=bool(fake_ranks), llama_tied=False,
                **json.loads(os.environ.get("DPC_CT_SHARD_OPTIONS", "{}")))
    if anchors.MODES[mode][0] == "dpcompile":
        spec["dp_options"] = {**json.loads(os.environ.get("DPC_CT_DP_OPTIONS", "{}")),
                              **({"disable_passes": tuple(disable_passes)} if disable_passes else {})}
    with device:
        model = anchors.build_model(spec)
    ids = torch.randint(0, anchors.MODEL_DIMS[model_name]["vocab"], (B, T + 1),
                        generator=torch.Generator().manual_seed(1)).to(device)
    step, _ = anchors.torch_step(spec, model, ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    t = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t
    steps, warm = [], 3 if device.type == "cuda" else 1
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the steps' peak, not the compile's
    for i in range(warm + (10 if device.type == "cuda" else 2)):
        sync()
        t = time.perf_counter()
        step()
        sync()
        if i >= warm:
            steps.append(time.perf_counter() - t)
    from torch._dynamo.utils import counters

    from dpcompile import gathered_copy_out

    records = [r for r in getattr(getattr(step.compiled, "dp_backend", None), "compiled", ()) if r.dp]
    return {"mode": mode, "first_call_s": first, "step_ms": statistics.median(steps) * 1e3,
            "kernels": metrics.generated_kernel_count, "dtype": spec["dtype"], "fake_ranks": fake_ranks,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
            "gathered_buckets_copied_out": sum(r.counters.get(gathered_copy_out.COUNTER, 0) for r in records),
            "aot_autograd_cache": {k: v for k, v in counters["aot_autograd"].items()
                                   if k.startswith("autograd_cache")},
            # where the first call went: torch's timed phases, and dpcompile's passes (anchors.py's columns)
            "compile_phases": anchors.compile_phases(),
            "dp_compile_seconds": anchors.dp_compile_seconds(step.compiled),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}


SHARD_OPTIONS = ("reshard_after_forward",)  # fully_shard's arguments a --fake-ranks row may set, any mode


def split_mode(label: str) -> tuple[str, dict]:
    """``ghost[pause_gc=False;linear_norm=ghost]`` -> ("ghost", {its options}); a plain mode has none. A DP mode
    takes dpcompile options; any mode takes fully_shard's ``reshard_after_forward`` (a --fake-ranks row)."""
    import ast

    mode, bracket, rest = label.partition("[")
    if not bracket:
        return label, {}
    dp = anchors.MODES.get(mode, ("",))[0] == "dpcompile"
    if not rest.endswith("]"):
        raise SystemExit(f"--modes: {label!r}: options go in brackets, as ghost[pause_gc=False]")
    options = {}
    for x in filter(None, rest[:-1].split(";")):
        key, _, value = x.partition("=")
        if key in SHARD_OPTIONS:
            options[key] = ast.literal_eval(value) if value else None
            if not isinstance(options[key], bool):
                raise SystemExit(f"--modes: {label!r}: {key} takes True or False")
        elif dp:
            options.update([anchors.parse_dp_option(x)])
        else:
            raise SystemExit(f"--modes: {label!r}: a non-DP mode takes only {', '.join(SHARD_OPTIONS)} in brackets; "
                             f"dpcompile options go with a DP mode, as ghost[pause_gc=False]")
    return mode, options


def run(label: str, shape: str, cache: str | None, extra: list[str]) -> dict:
    mode, options = split_mode(label)
    env = dict(os.environ)
    shard = {k: options.pop(k) for k in SHARD_OPTIONS if k in options}
    env["DPC_CT_SHARD_OPTIONS"] = json.dumps(shard)
    if options:  # the row's own options over --dp-option's
        env["DPC_CT_DP_OPTIONS"] = json.dumps({**json.loads(env.get("DPC_CT_DP_OPTIONS", "{}")), **options})
    cache = cache or tempfile.mkdtemp(prefix="dpc-ct-")
    env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--shape", shape, *extra],
                         env=env, capture_output=True, text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{label} failed:\n{out.stderr[-3000:]}")
    return {**json.loads(lines[-1]), "mode": label}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="nonprivate,bk,ghost",
                   help="rows, alternated --repeats times; a DP mode may carry its own dpcompile options, "
                        "MODE[KEY=VALUE;...] (over --dp-option's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cache", choices=("cold", "warm"), default="cold")
    p.add_argument("--shape", help="MODEL:BxT as in anchors.py (default gpt:32x256 on a GPU, gpt:2x32 on CPU)")
    p.add_argument("--out")
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                   help="a torch._inductor.config setting for every run (repeatable)")
    p.add_argument("--fake-ranks", type=int, default=0, metavar="N",
                   help="compile the step sharded, as rank 0 of N ranks on torch's fake process group (see above)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="default: bf16 autocast on a GPU, fp32 on CPU")
    p.add_argument("--disable-passes", default="", metavar="NAMES",
                   help="comma-separated dpcompile passes the DP modes skip (the option disable_passes)")
    p.add_argument("--dp-option", action="append", default=[], metavar="KEY=VALUE", dest="dp_options",
                   help="a dpcompile option for the DP modes (a DPConfig field, e.g. pause_gc=False), VALUE a Python "
                        "literal; repeatable, as anchors.py's")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.inductor:
        if any("=" not in x or ";" in x for x in a.inductor):
            raise SystemExit("--inductor takes KEY=VALUE (no ';')")
        os.environ["DPC_CT_INDUCTOR"] = ";".join(a.inductor)
    if a.dp_options:
        os.environ["DPC_CT_DP_OPTIONS"] = json.dumps(dict(anchors.parse_dp_option(x) for x in a.dp_options))
    off = list(filter(None, a.disable_passes.split(",")))
    if a.fake_ranks == 1 or a.fake_ranks < 0:
        raise SystemExit("--fake-ranks takes 2 or more (a one-rank mesh compiles no bucketed collectives)")
    if a.child:
        print(json.dumps(child(a.child, a.shape, fake_ranks=a.fake_ranks, dtype=a.dtype,
                               disable_passes=off)))
        return
    sys.path.insert(0, anchors.ROOT)  # dpcompile and its passes from this checkout, as the children import them
    from passes import check_disable_passes

    check_disable_passes(off)  # a bad name fails here, not in every child
    extra = (["--fake-ranks", str(a.fake_ranks)] if a.fake_ranks else []) + (["--dtype", a.dtype] if a.dtype else []) \
        + (["--disable-passes", a.disable_passes] if a.disable_passes else [])
    import torch

    shape = a.shape or ("gpt:32x256" if torch.cuda.is_available() else "gpt:2x32")
    anchors.parse_shape(shape)  # a bad shape fails here, not in every child
    if a.cache == "cold":
        os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    modes = a.modes.split(",")
    for label in modes:
        m, options = split_mode(label)
        if not a.fake_ranks and set(options) & set(SHARD_OPTIONS):
            raise SystemExit(f"--modes: {label!r}: {', '.join(SHARD_OPTIONS)} is fully_shard's: it needs --fake-ranks")
        if anchors.MODES.get(m, ("",))[0] not in ("torch", "dpcompile") or m == "nonprivate_eager":
            raise SystemExit(f"--modes: {m!r} is not a compiled mode of anchors.py (nonprivate, bk, ghost, auto, "
                             f"their :cg forms)")
    caches = {m: tempfile.mkdtemp(prefix=f"dpc-ct-{m}-") for m in modes} if a.cache == "warm" else {}
    for m in caches:  # the first process start fills the mode's caches (its own first call is a cold one)
        row = run(m, shape, caches[m], extra)
        print(f"{m:12s} first call {row['first_call_s']:6.1f} s   (the start that fills the cache)", flush=True)
    rows = []
    for r in range(a.repeats):
        for m in modes:
            row = run(m, shape, caches.get(m), extra)
            row["repeat"] = r
            rows.append(row)
            peak = f"   peak {row['peak_mib']:.0f} MiB" if row.get("peak_mib") else ""
            print(f"{m:12s} first call {row['first_call_s']:6.1f} s   step {row['step_ms']:7.2f} ms{peak}   "
                  f"kernels {row['kernels']}   copied-out buckets {row['gathered_buckets_copied_out']}   "
                  f"AOTAutograd cache {row['aot_autograd_cache']}", flush=True)
            print(f"{'':12s} phases s: " + ", ".join(f"{k} {v}" for k, v in list(row["compile_phases"].items())[:8]),
                  flush=True)
    print(f"\n{a.cache} caches, {shape}, {rows[0]['dtype']}, {rows[0]['device']}, torch {rows[0]['torch']}"
          + (f", rank 0 of {a.fake_ranks} (fake process group)" if a.fake_ranks else "")
          + (f", DP modes without {a.disable_passes}" if a.disable_passes else "")
          + (f", DP options {'; '.join(a.dp_options)}" if a.dp_options else "")
          + (f", inductor {'; '.join(a.inductor)}" if a.inductor else ""))
    base = statistics.mean(r["first_call_s"] for r in rows if r["mode"] == "nonprivate") if "nonprivate" in modes else None
    for m in modes:
        firsts = [r["first_call_s"] for r in rows if r["mode"] == m]
        ratio = f"{statistics.mean(firsts) / base:.2f}x non-private" if base else ""
        print(f"{m:12s} first call {', '.join(f'{x:.1f}' for x in firsts)} s  {ratio}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": sys.argv, "cache": a.cache, "shape": shape, "inductor": a.inductor,
                       "fake_ranks": a.fake_ranks, "disable_passes": a.disable_passes, "dp_options": a.dp_options,
                       "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
