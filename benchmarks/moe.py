"""A routed-experts (MoE) training step, DP against non-private, side by side in one process on one GPU.

Hugging Face's MixtralForCausalLM in bf16, with its experts in both forms: "grouped_mm" (its default: the batch's
tokens sorted by expert, torch._grouped_mm; dpcompile follows the sort, passes.rules.row_order) and "batched_mm"
(each token's experts' weights gathered). For each form: the non-private step compiled by stock torch.compile
(Inductor), and dp_fsdp's bk and ghost steps; median step time and peak memory, and their ratios to the
non-private step of the same form.

    python benchmarks/moe.py [--batch 8 --seq 512 --hidden 1024 --ffn 2048 --experts 8 --top-k 2 --layers 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build(args, form: str):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4,
                        max_position_embeddings=args.seq, num_local_experts=args.experts,
                        num_experts_per_tok=args.top_k, experts_implementation=form)
    return MixtralForCausalLM(cfg).to("cuda", torch.bfloat16).train()


def time_step(step, model, x, y, iters: int) -> tuple[float, float]:
    """(median ms, peak GiB) of step over iters runs after two warm-up runs."""
    for _ in range(2):
        step(model, x, y)
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step(model, x, y)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2 ** 30


def profile(step, model, x, y, top: int, title: str) -> None:
    """The top GPU kernels of one step by total time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model, x, y)
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    print(f"-- {title}: top {top} GPU kernels of one step", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=90), flush=True)


def loss_of(model, x, y):
    logits = model(x, use_cache=False).logits.float()
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    return per_token.view(y.shape).mean(1).mean()


def run_modes(rows: list, key: str, value: str, modes, build, loss_of, inputs: tuple, y, args) -> None:
    """Each mode's step ("non-private": stock torch.compile; "bk", "ghost": dp_fsdp) on a fresh model from build(),
    timed (time_step), one row each in rows ({key: value, "mode", "ms", "peak_gib"} or an error); with
    args.profile, one step's costliest GPU kernels after the timing."""
    import dpcompile

    for mode in modes:
        torch._dynamo.reset()
        model = build()

        def step(m, xs, y):
            loss = loss_of(m, *xs, y)
            loss.backward()
            return loss.detach()

        if mode == "non-private":
            compiled = torch.compile(step)
        else:
            compiled = torch.compile(step, backend=dpcompile.DPBackend(
                max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=args.batch, schedule=mode))
        try:
            ms, gib = time_step(compiled, model, inputs, y, args.iters)
            rows.append({key: value, "mode": mode, "ms": round(ms, 2), "peak_gib": round(gib, 2)})
        except Exception as e:  # noqa: BLE001 (reported)
            rows.append({key: value, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
        if getattr(args, "profile", 0) and "ms" in rows[-1]:
            profile(compiled, model, inputs, y, args.profile, f"{value} {mode}")
        del model, compiled
        torch.cuda.empty_cache()


def ratio_table(rows: list, key: str, title: str) -> None:
    """The rows as a markdown table: time and peak memory, and their ratios to the non-private row of the same
    ``key`` value."""
    base = {r[key]: r for r in rows if r["mode"] == "non-private" and "ms" in r}
    print(f"| {key} | mode | ms | x non-private | peak GiB | x non-private | ({title})")
    for r in rows:
        b = base.get(r[key])
        if "ms" in r and b:
            print(f"| {r[key]} | {r['mode']} | {r['ms']} | {r['ms'] / b['ms']:.2f} | {r['peak_gib']} | "
                  f"{r['peak_gib'] / b['peak_gib']:.2f} |")
        else:
            print(f"| {r[key]} | {r['mode']} | {r.get('error', '')} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--forms", default="grouped_mm,batched_mm")
    ap.add_argument("--modes", default="non-private,bk,ghost")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile one step of each mode and print its N costliest GPU kernels")
    args = ap.parse_args(argv)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    rows = []
    for form in args.forms.split(","):
        run_modes(rows, "form", form, args.modes.split(","), lambda: build(args, form), loss_of, (x,), y, args)
    ratio_table(rows, "form", f"B={args.batch}, T={args.seq}, d={args.hidden}, ffn={args.ffn}, {args.experts} "
                              f"experts, top-{args.top_k}, {args.layers} layers, bf16, {torch.cuda.get_device_name()}, "
                              f"torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
