"""DP-SGD training of a small GPT with dpcompile: per-sample clipping and noise inside torch.compile.

    python examples/train_gpt_dp.py            # CPU (Inductor C++), under a minute
    python examples/train_gpt_dp.py --device cuda --layers 12 --d 768 --steps 50

Batches are Poisson samples of a fixed dataset of random token sequences
(the point is the mechanics and the speed, not the model), so their size
varies around --batch; one compiled graph serves every size. Prints the loss,
the step time, and the privacy spent (epsilon at --delta) from the RDP
accountant.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

import dpcompile
from dpcompile.train import GPT  # GPT-2 style: pre-LayerNorm blocks, learned positions, untied head


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="expected batch size (Poisson sampling)")
    ap.add_argument("--dataset-size", type=int, default=1024)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--schedule", default="bk", choices=["bk", "ghost", "auto"])
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--noise-multiplier", type=float, default=1.0)
    ap.add_argument("--dump-dir", default=None, help="write the rewritten graphs and a summary here")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = GPT(args.vocab, args.d, args.heads, args.layers, args.seq).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    @dpcompile.private_step(max_grad_norm=args.max_grad_norm, noise_multiplier=args.noise_multiplier,
                            expected_batch_size=args.batch, schedule=args.schedule, dump_dir=args.dump_dir)
    def train_step(ids, targets):
        B = ids.shape[0]
        logits = model(ids)
        per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        loss = per_token.view(B, -1).mean(1).mean()  # mean over samples of per-sample losses
        loss.backward()
        return loss.detach()

    print(f"dpcompile example: {sum(p.numel() for p in model.parameters()):,} parameters on {dev}, "
          f"schedule={args.schedule}, C={args.max_grad_norm}, sigma={args.noise_multiplier}")
    data = torch.randint(0, args.vocab, (args.dataset_size, args.seq + 1), generator=torch.Generator().manual_seed(0))
    rate = args.batch / args.dataset_size
    sampler = dpcompile.PoissonBatchSampler(args.dataset_size, sample_rate=rate, steps=args.steps, seed=1)
    accountant = dpcompile.PrivacyAccountant(noise_multiplier=args.noise_multiplier, sample_rate=rate)
    for step, idx in enumerate(sampler):
        ids = data[idx].to(dev)
        x, y = ids[:, :-1], ids[:, 1:]
        # one graph for every batch size (0 too), tuned for args.batch
        dpcompile.mark_batch(x, y, hint=args.batch, nonempty=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        accountant.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"step {step:3d}  batch {len(idx):3d}  loss {loss.item():.4f}  step time {dt * 1e3:8.1f} ms"
              + ("  (includes compile)" if step == 0 else ""))
        if idx and not math.isfinite(loss.item()):  # an empty batch's mean loss is nan
            print("loss is not finite", file=sys.stderr)
            return 1
    print(f"privacy spent: epsilon = {accountant.epsilon(args.delta):.3f} at delta = {args.delta} after "
          f"{accountant.steps} steps (sample rate {rate:.4g}, noise multiplier {args.noise_multiplier})")
    rec = train_step.dp_backend.compiled[0]
    print("rewrite counters:", {k: v for k, v in sorted(rec.counters.items())})
    if args.dump_dir:
        print("graph dumps in", os.path.dirname(rec.dump_files[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
