"""Step time and peak memory: non-private vs dp_fsdp bk vs dp_fsdp ghost, side by side in one run.

    torchrun --nproc_per_node=2 benchmarks/step.py            # 2 GPUs (NCCL), GPT-2-small shape
    torchrun --nproc_per_node=1 benchmarks/step.py            # 1 GPU, same sharding code
    python benchmarks/step.py --tiny                          # CPU smoke run (gloo, 1 rank)

Every mode uses the same model, the same fully_shard sharding and mixed
precision (fp32 parameters, bf16 compute, fp32 gradient reduction); only the
backend differs ("inductor" for the non-private step). Reports the median
step time over --iters timed steps after --warmup, peak memory, and the
ratios to non-private. Rank 0 prints a table and writes JSON to --out.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import dpcompile  # noqa: E402
from train_gpt_dp import GPT  # noqa: E402


def build(args, mesh, device):
    torch.manual_seed(0)
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
        step = torch.compile(train_step, backend="inductor")
    else:
        step = torch.compile(train_step, backend=dpcompile.DPBackend(
            max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=args.batch * world, schedule=mode))
    g = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
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
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return {"mode": mode, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "peak_gib": peak / 2**30, "compile_and_warmup_s": warm_s, "loss": float(loss)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="samples per GPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--modes", default="nonprivate,bk,ghost")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false")
    ap.add_argument("--tiny", action="store_true", help="small CPU smoke configuration")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.d, args.heads, args.vocab, args.seq, args.batch = 2, 32, 2, 128, 16, 4
        args.warmup, args.iters, args.bf16 = 2, 3, False
    cuda = torch.cuda.is_available() and not args.tiny
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    results = [run_mode(m, args, mesh, device, world) for m in args.modes.split(",")]
    base = next((r for r in results if r["mode"] == "nonprivate"), None)
    for r in results:
        if base:
            r["time_ratio"] = r["median_ms"] / base["median_ms"]
            r["mem_ratio"] = r["peak_gib"] / base["peak_gib"] if base["peak_gib"] else None
    if rank == 0:
        name = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"GPT L={args.layers} d={args.d} V={args.vocab} T={args.seq}, {args.batch}/GPU x {world} {name}, "
              f"bf16={args.bf16}, torch {torch.__version__}")
        print(f"{'mode':>10} {'median ms':>10} {'ratio':>6} {'peak GiB':>9} {'mem ratio':>9} {'compile+warmup s':>16}")
        for r in results:
            print(f"{r['mode']:>10} {r['median_ms']:10.1f} {r.get('time_ratio', 1):6.2f} {r['peak_gib']:9.2f} "
                  f"{(r.get('mem_ratio') or 0):9.2f} {r['compile_and_warmup_s']:16.1f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "world": world, "device": name, "results": results}, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
