"""Step time and peak memory: non-private vs dp_fsdp bk vs dp_fsdp ghost, side by side in one run.

    torchrun --nproc_per_node=2 benchmarks/step.py                # 2 GPUs (NCCL), GPT-2-small shape
    torchrun --nproc_per_node=1 benchmarks/step.py                # 1 GPU, same sharding code
    torchrun --nproc_per_node=4 benchmarks/step.py --model llama  # Llama-3.2-1B shape
    python benchmarks/step.py --tiny                              # CPU smoke run (gloo, 1 rank)
    python benchmarks/step.py --tiny --model llama
    torchrun --nproc_per_node=4 benchmarks/step.py --bucket-mb off   # unbucketed (fully_shard's default:
                                                                      # 64 MiB buckets, overlapped)
    torchrun --nproc_per_node=4 benchmarks/step.py --bucket-mb 16 [--overlap]  # other buckets
    python benchmarks/step.py --batch 4 --cudagraphs                  # CUDA graphs in every mode
    torchrun --nproc_per_node=2 benchmarks/step.py --model llama --parallel tp     # tensor parallel (bf16 params)
    torchrun --nproc_per_node=2 benchmarks/step.py --model llama --parallel tp-sp  # ... with sequence parallel
    torchrun --nproc_per_node=2 benchmarks/step.py --tiny --model llama --parallel tp-sp  # CPU (gloo)

Every mode uses the same model, the same fully_shard sharding and mixed
precision (fp32 parameters, bf16 compute, fp32 gradient reduction); only the
backend differs ("inductor" for the non-private step). --parallel tp / tp-sp
instead parallelizes the Llama with torch's tensor-parallel plan over all
ranks (torchtitan's: Colwise in, Rowwise out; tp-sp adds SequenceParallel
norms), bf16 parameters, every rank the same batch; the profile then reports
where dpcompile's per-sample norm all-reduce runs. Reports the median
step time over --iters timed steps after --warmup, peak memory, and the
ratios to non-private. Rank 0 prints a table and writes JSON to --out.
--profile DIR also records one more step of each mode with torch.profiler
(a Chrome trace per rank) and prints where the collectives sit: NCCL kernel
time, and how much of it runs while a compute kernel runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import dpcompile  # noqa: E402
from train_gpt_dp import GPT  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from anchors import bucket_size  # noqa: E402
from llama import Llama  # noqa: E402


def tensor_parallel_plan(model, mesh, sequence_parallel: bool) -> None:
    """torch's tensor-parallel API on benchmarks/llama.py's Llama, as torchtitan plans it."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    seq = Shard(1) if sequence_parallel else Replicate()
    root = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    parallelize_module(model, mesh, root)
    for b in model.blocks:
        plan = {"attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=seq),
                # the MLP is inline in the block: w1 and w3 each gather the sequence-parallel input
                "w1": ColwiseParallel(input_layouts=seq), "w3": ColwiseParallel(input_layouts=seq),
                "w2": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            plan.update(attn_norm=SequenceParallel(), mlp_norm=SequenceParallel())
        parallelize_module(b, mesh, plan)


def build(args, mesh, device):
    torch.manual_seed(0)
    if args.parallel != "fsdp":
        if args.model != "llama":
            raise SystemExit("--parallel tp/tp-sp: --model llama (its projections are separate modules)")
        model = Llama(args.vocab, args.d, args.layers, args.heads, args.kv_heads, args.ffn, tied=False)
        model = model.to(device, torch.bfloat16 if args.bf16 else torch.float32)
        tensor_parallel_plan(model, mesh, sequence_parallel=args.parallel == "tp-sp")
        return model
    if args.model == "llama":
        model = Llama(args.vocab, args.d, args.layers, args.heads, args.kv_heads, args.ffn).to(device)
    else:
        model = GPT(args.vocab, args.d, args.heads, args.layers, args.seq).to(device)
    mp = dpcompile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    for b in model.blocks:
        dpcompile.fully_shard(b, mesh=mesh, mp_policy=mp)
    dpcompile.fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def run_mode(mode, args, mesh, device, world):
    torch._dynamo.reset()
    model = build(args, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(ids, targets):
        logits = model(ids)
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        loss = per_token.view(targets.shape).mean(1).mean()
        loss.backward()
        return loss.detach()

    if mode == "nonprivate":
        if args.parallel != "fsdp":
            # stock torch.compile fails on a tensor-parallel step whose backward runs inside it (Dynamo compiles
            # DTensor.__tensor_unflatten__ as a frame, DESIGN.md): the same workaround dp_fsdp applies
            from dpcompile.tensor_parallel import allow_dtensor_gradients_in_dynamo

            allow_dtensor_gradients_in_dynamo()
        step = torch.compile(train_step, backend="inductor", mode="reduce-overhead" if args.cudagraphs else None)
    else:
        # what users run: one graph for every per-rank batch size (private_step marks the batch); tensor
        # parallel: every rank of the group holds the same samples
        samples = args.batch * (world if args.parallel == "fsdp" else 1)
        step = dpcompile.private_step(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=samples,
                                      schedule=mode, cudagraphs=args.cudagraphs)(train_step)
    g = torch.Generator(device="cpu").manual_seed(1 + (dist.get_rank() if args.parallel == "fsdp" else 0))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    warm_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        sync()
        t = time.perf_counter()
        loss = step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t)
        loss = float(loss)  # under CUDA graphs the next replay reuses its memory
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    overlap = profile_step(mode, args, lambda: (step(x, y), opt.step(), opt.zero_grad(set_to_none=True)), sync) \
        if args.profile else None
    return {"mode": mode, "comm": overlap, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "peak_gib": peak / 2**30, "compile_and_warmup_s": warm_s, "loss": float(loss),
            "norm_all_reduce": norm_all_reduce_placement(step, args) if mode != "nonprivate" else None}


def norm_all_reduce_placement(step, args) -> dict | None:
    """Where dpcompile put the per-sample norm all-reduce of a tensor-parallel step (its compile record):
    the backward ops between its issue and its wait."""
    recs = [r for r in getattr(step, "dp_backend").compiled if r.dp]
    window = recs[0].norm_all_reduce_window() if recs else None
    if window is None:
        return None
    (_, shape), between = window
    between = [op for op, _ in between]
    return {"shape": [str(s) for s in shape], "ops_between": len(between),
            "gemms_between": sum(op.endswith(("aten.mm.default", "aten.bmm.default", "aten.addmm.default"))
                                 for op in between),
            "summary": recs[0].summary["tensor_parallel"]}


def profile_step(mode, args, run, sync) -> dict:
    """One profiled step: a Chrome trace, and NCCL kernel time overlapped with compute."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        run()
        sync()
    os.makedirs(args.profile, exist_ok=True)
    if dist.get_rank() == 0:  # one trace per mode keeps the output small; ranks run the same graph
        prof.export_chrome_trace(os.path.join(args.profile, f"{args.model}_{mode}_rank0.json"))
    # device kernels only: the GPU-side ranges of annotations ("nccl:all_gather...", "Optimizer.step")
    # would count each collective twice and the optimizer's span as compute
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False) and not e.name.startswith(("nccl:", "Optimizer."))]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    comm = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    comp = sorted((e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower())
    merged: list[list[float]] = []  # compute busy intervals
    for a, b in comp:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])

    def under_compute(intervals) -> float:
        return sum(max(0.0, min(b, mb) - max(a, ma)) for a, b in intervals for ma, mb in merged) / 1e3

    def of_kind(kind: str):
        return [(e.time_range.start, e.time_range.end) for e in kernels if kind in e.name]

    span = (max(b for _, b in merged) - min(a for a, _ in merged)) if merged else 0.0
    per_kind = {}
    for kind in ("AllGather", "ReduceScatter", "AllReduce"):
        iv = of_kind(kind)
        per_kind[kind] = {"kernels": len(iv), "ms": sum(b - a for a, b in iv) / 1e3, "under_compute_ms": under_compute(iv)}
    return {"nccl_kernels": len(comm), "nccl_ms": sum(b - a for a, b in comm) / 1e3,
            "nccl_overlapped_ms": under_compute(comm), "per_collective": per_kind,
            "compute_busy_ms": sum(b - a for a, b in merged) / 1e3, "gpu_span_ms": span / 1e3,
            "top_kernels": [(name[:90], len(ts), sum(ts) / 1e3) for name, ts in top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--d", "--width", dest="d", type=int, default=None)  # --width under torchrun (--d is ambiguous there)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=8, help="llama: key/value heads")
    ap.add_argument("--ffn", type=int, default=8192, help="llama: SwiGLU hidden size")
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="samples per GPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--modes", default="nonprivate,bk,ghost")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false")
    ap.add_argument("--bf16", dest="bf16", action="store_true", help="bf16 (the default; also with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="small CPU smoke configuration")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="directory for one profiled step per mode")
    ap.add_argument("--bucket-mb", type=bucket_size, default=None,
                    help="dpcompile.bucket_collectives(MiB) for every mode (non-private too), or 'off'; default: "
                         "fully_shard's (64 MiB, overlapped; --parallel tp/tp-sp: unbucketed)")
    ap.add_argument("--overlap", action="store_true",
                    help="with --bucket-mb MiB: also Inductor's compute/communication reordering (every mode)")
    ap.add_argument("--cudagraphs", action="store_true",
                    help="CUDA graphs: mode='reduce-overhead' for the non-private step, cudagraphs=True for dp_fsdp")
    ap.add_argument("--parallel", choices=["fsdp", "tp", "tp-sp"], default="fsdp",
                    help="fsdp: dpcompile.fully_shard over all ranks; tp / tp-sp: torch's tensor parallelism "
                         "(--model llama), tp-sp with sequence-parallel norms")
    ap.add_argument("--combo-kernels", action="store_true",
                    help="Inductor combo kernels (independent small kernels launched as one), every mode")
    args = ap.parse_args(argv)
    if args.overlap and args.bucket_mb in (None, "off"):
        ap.error("--overlap needs --bucket-mb MiB (fully_shard's default overlaps already)")
    shape = {"gpt": dict(layers=12, d=768, heads=12, vocab=50257),  # GPT-2 small
             "llama": dict(layers=16, d=2048, heads=32, vocab=128256)}[args.model]  # Llama-3.2-1B
    for k, v in shape.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.tiny:
        args.layers, args.d, args.heads, args.vocab, args.seq, args.batch = 2, 32, 4, 128, 16, 4
        args.kv_heads, args.ffn = 2, 64
        args.warmup, args.iters = 2, 3
        args.bf16 = "--bf16" in (argv if argv is not None else sys.argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    if args.bucket_mb:
        dpcompile.bucket_collectives(None if args.bucket_mb == "off" else args.bucket_mb, overlap=args.overlap)
    if args.combo_kernels:  # the DP step launches ~2x the kernels; a launch-bound step may gain from fewer
        torch._inductor.config.combo_kernels = True
    results = []
    for m in args.modes.split(","):
        results.append(run_mode(m, args, mesh, device, world))
        if rank == 0:  # as each mode ends: a run cut off by a time limit still reports the modes it finished
            r = results[-1]
            print(f"done {m}: median {r['median_ms']:.1f} ms, peak {r['peak_gib']:.2f} GiB, compile+warmup "
                  f"{r['compile_and_warmup_s']:.1f} s", flush=True)
    base = next((r for r in results if r["mode"] == "nonprivate"), None)
    for r in results:
        if base:
            r["time_ratio"] = r["median_ms"] / base["median_ms"]
            r["mem_ratio"] = r["peak_gib"] / base["peak_gib"] if base["peak_gib"] else None
    if rank == 0:
        gpu_name = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"{args.model} L={args.layers} d={args.d} V={args.vocab} T={args.seq}, {args.batch}/GPU x {world} {gpu_name}, "
              f"bf16={args.bf16}, {args.parallel}, torch {torch.__version__}")
        print(f"{'mode':>10} {'median ms':>10} {'ratio':>6} {'peak GiB':>9} {'mem ratio':>9} {'compile+warmup s':>16}")
        for r in results:
            print(f"{r['mode']:>10} {r['median_ms']:10.1f} {r.get('time_ratio', 1):6.2f} {r['peak_gib']:9.2f} "
                  f"{(r.get('mem_ratio') or 0):9.2f} {r['compile_and_warmup_s']:16.1f}")
        for r in results:
            if r.get("norm_all_reduce"):
                n = r["norm_all_reduce"]
                print(f"{r['mode']:>10} norm all-reduce {n['shape']}: {n['ops_between']} backward ops between issue "
                      f"and wait, {n['gemms_between']} of them GEMMs")
        for r in results:
            if r["comm"]:
                c = r["comm"]
                print(f"{r['mode']:>10} profile: {c['nccl_kernels']} NCCL kernels, {c['nccl_ms']:.1f} ms, "
                      f"{c['nccl_overlapped_ms']:.1f} ms of it under compute; compute busy "
                      f"{c['compute_busy_ms']:.1f} ms of a {c['gpu_span_ms']:.1f} ms GPU span")
                for kind, k in c["per_collective"].items():
                    if k["kernels"]:
                        print(f"{'':>10}   {kind}: {k['kernels']} kernels, {k['ms']:.1f} ms, "
                              f"{k['under_compute_ms']:.1f} ms of it under compute")
                for name, count, ms in c["top_kernels"]:
                    print(f"{'':>10}   {ms:7.2f} ms {count:4d}x  {name}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "world": world, "device": gpu_name, "results": results}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
