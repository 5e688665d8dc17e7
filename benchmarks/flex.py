"""A flex_attention training step, DP against non-private, side by side in one process on one GPU.

Hugging Face's LlamaForCausalLM in bf16 on a right-padded batch (half the samples end in padding), with
attn_implementation "flex_attention" (transformers builds a BlockMask from the padding mask in the step; Inductor
generates the flex kernels; dpcompile proves its mask_mod reads the padding mask at [b]) and "sdpa" (the same model
with scaled_dot_product_attention, for reference). For each: the non-private step compiled by stock torch.compile
(Inductor), and dp_fsdp's bk and ghost steps; median step time and peak memory, and their ratios to the
non-private step of the same attention.

    python benchmarks/flex.py [--batch 8 --seq 1024 --hidden 1024 --layers 4]
"""
from __future__ import annotations

import argparse

import torch

from moe import ratio_table, run_modes


def build(args, attention: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4,
                      max_position_embeddings=args.seq, pad_token_id=0, attn_implementation=attention)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()


def loss_of(model, x, mask, y):
    logits = model(input_ids=x, attention_mask=mask, use_cache=False).logits.float()
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    return (per_token.view(y.shape) * mask).sum(1).div(mask.sum(1)).mean()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--attention", default="flex_attention,sdpa")
    ap.add_argument("--modes", default="non-private,bk,ghost")
    args = ap.parse_args(argv)
    x = torch.randint(1, args.vocab, (args.batch, args.seq), device="cuda")
    mask = torch.ones_like(x)
    mask[1::2, args.seq * 3 // 4:] = 0  # every other sample padded for its last quarter
    x = x * mask
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    rows = []
    for attention in args.attention.split(","):
        run_modes(rows, "attention", attention, args.modes.split(","), lambda: build(args, attention), loss_of,
                  (x, mask), y, args)
    ratio_table(rows, "attention", f"B={args.batch}, T={args.seq}, d={args.hidden}, {args.layers} layers, bf16, "
                                   f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
