"""Differentially private training of a byte-level GPT on Python's own help text (dpcompile's main job).

    python -m dpcompile.train                          # CPU (2 cores): about 2.5 minutes, epsilon = 8
    python -m dpcompile.train --compare-nonprivate     # also the same model trained without DP, on the same plot
    python -m dpcompile.train --device cuda --model gpt2-small --dtype bfloat16 --seq-len 128
    torchrun --nproc-per-node 2 -m dpcompile.train --device cuda --model llama-1b-shape --dtype bfloat16

Data: the English text of ``pydoc_data.topics.topics`` (the help topics that
every Python install ships, offline). ONE RECORD = ONE PARAGRAPH of a topic
(topics split on blank lines, paragraphs of at least 40 bytes), and ONE RECORD
IS ONE PRIVACY UNIT: the (epsilon, delta) guarantee is about adding or
removing one paragraph. A fixed 10% of the records (a fixed seed, the same
for every run) is held out for evaluation and never trained on. The help
text differs between Python versions, and so do the records (1993 on
Python 3.11, 2113 on 3.12).

Tokens are bytes (256 values) plus a pad token (id 256, also the
begin-of-record input). A record is cut to its first --seq-len bytes; the
model reads [pad] + the record's first T-1 bytes and predicts each of its
first T bytes. Shorter records are padded and the padding is masked out of
the loss: a sample's loss is the mean token cross-entropy over its own valid
positions, and the step's loss is the mean of those over the batch (with
``expected_batch_size`` = the logical batch's expected size).

DP-SGD: Poisson sampling (each record joins each logical batch independently
with probability q = --batch-size / training records), per-sample clipping
to --max-grad-norm and Gaussian noise inside ``torch.compile`` (dpcompile's
dp_fsdp backend); the noise multiplier is chosen so that the planned --steps
spend exactly --target-epsilon at --delta (Opacus' PRV accountant). Logical
batches are split into micro-batches of at most --physical-batch-size
(``dpcompile.accumulate``; noise once per logical batch).

Models (--model): tiny (GPT, d=128, 2 blocks, 4 heads: the CPU default),
gpt2-small (GPT, d=768, 12 blocks, 12 heads), llama-1b-shape (Llama-3.2-1B's
shape: RMSNorm, rotary, grouped-query attention, SwiGLU, tied embeddings,
973M parameters), all on the byte vocabulary; --layers/--width/--heads
override the preset. hf:<local path> loads a transformers causal LM and feeds
it bytes (its vocabulary must have at least 257 tokens). Under torchrun
(WORLD_SIZE > 1) every block and then the root is sharded with
``dpcompile.fully_shard`` and each rank takes its share of every Poisson batch.

Output: a progress bar (loss, epsilon spent, tokens/s), the held-out loss and
perplexity every --eval-every steps next to the unigram baseline (the
cross-entropy of the held-out bytes under the byte frequencies of the
training split, Laplace-smoothed; a non-private reference number, not part
of the trained model), and at
the end a plot (held-out loss against steps and against epsilon) and a JSON
file with the curves in --out-dir. The run is checkpointed every
--checkpoint-every steps in --checkpoint-dir and resumes from there when
started again with the same directory.

Seeds: --seed seeds the model's initialisation, the Poisson sampling and
the noise, so a run is reproducible. Whoever knows the sampling and noise
seeds can subtract the noise: for a model you release, use --private-seeds
(both drawn from the OS and kept only in the checkpoints; keep those as
private as the data).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import dpcompile
from dpcompile.batching import rank_share

PAD = 256  # pad token; also the begin-of-record input
VOCAB = 257  # 256 byte values + PAD
MIN_RECORD_BYTES = 40
HELD_OUT_FRACTION = 0.1
SPLIT_SEED = 1234  # the held-out split is the same for every run

# d, layers, heads (and for Llama: kv heads, SwiGLU hidden size)
MODELS = {
    "tiny": dict(kind="gpt", width=128, layers=2, heads=4),
    "gpt2-small": dict(kind="gpt", width=768, layers=12, heads=12),
    "llama-1b-shape": dict(kind="llama", width=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
}
# default Adam learning rates: tiny's tuned on the CPU default run; the larger ones' only a guess (4e-3 made
# llama-1b-shape's loss rise within 4 steps)
DEFAULT_LR = {"tiny": 4e-3, "gpt2-small": 1e-3, "llama-1b-shape": 3e-4, "hf": 3e-4}


# ----------------------------------------------------------------------------- data
def load_records() -> list[bytes]:
    """The paragraphs of Python's help topics, as UTF-8 bytes: one record (one privacy unit) each."""
    from pydoc_data.topics import topics

    records = []
    for name in sorted(topics):
        for para in re.split(r"\n[ \t]*\n", topics[name]):
            para = para.strip("\n").rstrip()
            data = para.encode("utf-8")
            if len(data.strip()) >= MIN_RECORD_BYTES:
                records.append(data)
    return records


def split_records(records: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(train, held-out): a fixed random 10% held out."""
    perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_held = max(1, round(HELD_OUT_FRACTION * len(records)))
    return [records[i] for i in perm[n_held:]], [records[i] for i in perm[:n_held]]


def encode(records: list[bytes], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both [N, seq_len] int64: targets = the record's first seq_len bytes (PAD after its
    end), inputs = PAD followed by the targets shifted right."""
    targets = torch.full((len(records), seq_len), PAD, dtype=torch.long)
    for i, r in enumerate(records):
        b = torch.frombuffer(bytearray(r[:seq_len]), dtype=torch.uint8)
        targets[i, : len(b)] = b.long()
    inputs = torch.cat([torch.full((len(records), 1), PAD, dtype=torch.long), targets[:, :-1]], dim=1)
    return inputs, targets


def unigram_baseline(train_targets: torch.Tensor, held_targets: torch.Tensor) -> float:
    """Cross-entropy (nats per byte) of the held-out bytes under the training split's byte frequencies,
    Laplace-smoothed (add one to each of the 256 counts)."""
    counts = torch.bincount(train_targets[train_targets != PAD], minlength=256).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[held_targets[held_targets != PAD]].mean())


# ----------------------------------------------------------------------------- models
class GPTBlock(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 style: learned positions, pre-LayerNorm blocks, GELU MLP, untied LM head."""

    def __init__(self, vocab: int, d: int, n_head: int, n_layer: int, max_t: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_t, d)
        self.blocks = nn.ModuleList(GPTBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def rotary(x: torch.Tensor, base: float = 500000.0) -> torch.Tensor:
    """Rotary position embedding on [B, T, H, hd] (pairs of halves)."""
    T, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, rotary embedding, grouped-query attention (key/value heads expanded), SwiGLU."""

    def __init__(self, d: int, n_heads: int, n_kv_heads: int, ffn: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.hd = n_heads, n_kv_heads, d // n_heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.wq = nn.Linear(d, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(d, n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = rotary(self.wq(h).view(B, T, self.n_heads, self.hd))
        k = rotary(self.wk(h).view(B, T, self.n_kv_heads, self.hd))
        v = self.wv(h).view(B, T, self.n_kv_heads, self.hd)
        rep = self.n_heads // self.n_kv_heads
        k, v = (t[:, :, :, None, :].expand(B, T, self.n_kv_heads, rep, self.hd).reshape(B, T, self.n_heads, self.hd)
                for t in (k, v))
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, -1))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Llama-3.2-1B's shape (16 layers, d=2048, 32/8 heads, SwiGLU 8192, tied embeddings) on the byte vocab."""

    def __init__(self, vocab: int, d: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, n_heads, n_kv_heads, ffn) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids):
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def build_model(args) -> tuple[nn.Module, dict[str, Any]]:
    """The model and a description of it (for the JSON)."""
    if args.model.startswith("hf:"):
        from transformers import AutoModelForCausalLM

        path = args.model[3:]
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).float()
        vocab = getattr(model.config, "vocab_size", None) or model.get_input_embeddings().num_embeddings
        if vocab < VOCAB:
            raise ValueError(f"--model {args.model}: its vocabulary has {vocab} tokens; this job feeds bytes (256 "
                             f"values) and a pad token, so the model needs a vocabulary of at least {VOCAB}")
        return model, {"model": args.model, "hf": True, "vocab_size": vocab}
    if args.model not in MODELS:
        raise ValueError(f"--model must be one of {sorted(MODELS)} or hf:<local path>, got {args.model!r}")
    cfg = dict(MODELS[args.model])
    for key in ("width", "layers", "heads"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if cfg["width"] % cfg["heads"]:
        raise ValueError(f"--width {cfg['width']} is not a multiple of --heads {cfg['heads']}")
    if cfg["kind"] == "gpt":
        model = GPT(VOCAB, cfg["width"], cfg["heads"], cfg["layers"], args.seq_len)
    else:
        kv = math.gcd(cfg["kv_heads"], cfg["heads"])
        cfg["kv_heads"] = kv
        model = Llama(VOCAB, cfg["width"], cfg["layers"], cfg["heads"], kv, cfg["ffn"])
    return model, {"model": args.model, **cfg}


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # A transformers model is called with its default use_cache: with use_cache=False (no cache object)
    # transformers (5.x masking_utils) compares the batch size with position_ids.shape[0], which dynamo cannot
    # decide for the step's unbacked batch size: a graph break that dp_fsdp refuses.
    out = model(ids) if not hasattr(model, "config") else model(input_ids=ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B]: each sample's mean token cross-entropy over its own valid (non-pad) positions."""
    B, T = targets.shape
    tok = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(B, T)
    mask = (targets != PAD).to(tok.dtype)
    return (tok * mask).sum(1) / mask.sum(1).clamp(min=1)


# ----------------------------------------------------------------------------- distributed
class Dist:
    """One process, or one rank of a torchrun job (WORLD_SIZE > 1)."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.mesh = None
        self.owns_group = False
        if self.world > 1:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            if device.startswith("cuda"):
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
                self.owns_group = True
            self.mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (self.world,))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, name: str) -> torch.device:
        if name.startswith("cuda") and self.world > 1:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(name)

    def shard(self, model: nn.Module) -> nn.Module:
        """dpcompile.fully_shard every transformer block (each item of an nn.ModuleList), then the root."""
        if self.mesh is None:
            return model
        for module in list(model.modules()):
            if isinstance(module, nn.ModuleList):
                for block in module:
                    dpcompile.fully_shard(block, mesh=self.mesh)
        dpcompile.fully_shard(model, mesh=self.mesh)
        return model

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        return t.cpu().tolist()

    def broadcast(self, obj):
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch: int, autocast) -> float:
    """Held-out loss: mean token cross-entropy (nats per byte) over every valid held-out position. no_grad,
    not the DP step; every rank evaluates the whole held-out split."""
    total = torch.zeros((), dtype=torch.float64, device=inputs.device)
    count = 0
    was_training = model.training
    model.eval()  # dropout off (a transformers model may have some)
    try:
        for i in range(0, len(inputs), batch):
            x, y = inputs[i: i + batch], targets[i: i + batch]
            with autocast():
                logits = logits_of(model, x)
            tok = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
            valid = y.flatten() != PAD
            total += tok[valid].double().sum()
            count += int(valid.sum())
    finally:
        model.train(was_training)
    return float(total) / max(count, 1)


# ----------------------------------------------------------------------------- options
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: ...)" only where the help does not say it already
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m dpcompile.train", description=__doc__.split("\n\n")[0],
        epilog="One record = one paragraph of a help topic = one privacy unit: the (epsilon, delta) guarantee "
               "is about adding or removing one paragraph. See the module docstring for the details.",
        formatter_class=_HelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                    help="(default: cuda when there is a GPU, else cpu)")
    ap.add_argument("--model", default="tiny",
                    help="tiny | gpt2-small | llama-1b-shape | hf:<local path> (a transformers causal LM whose "
                         "vocabulary has >= 257 tokens; it is fed bytes, its tokenizer is not used)")
    ap.add_argument("--layers", type=int, default=None, help="override the model's number of blocks")
    ap.add_argument("--width", type=int, default=None, help="override the model's width d")
    ap.add_argument("--heads", type=int, default=None, help="override the model's number of attention heads")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: autocast around the forward and the loss (cuda only)")
    ap.add_argument("--seq-len", type=int, default=64, help="T: each record's first T bytes")
    ap.add_argument("--steps", type=int, default=100, help="planned logical (noisy) steps")
    ap.add_argument("--batch-size", type=int, default=256,
                    help="expected logical batch size; sample rate q = batch-size / training records")
    ap.add_argument("--physical-batch-size", type=int, default=64,
                    help="micro-batch size: at most this many samples per compiled step call")
    ap.add_argument("--target-epsilon", type=float, default=8.0, help="epsilon spent by the planned --steps")
    ap.add_argument("--delta", type=float, default=None, help="(default: 1 / training records)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    ap.add_argument("--lr", type=float, default=None,
                    help="Adam learning rate (default: " + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")")
    ap.add_argument("--seed", type=int, default=0, help="model init, Poisson sampling and noise seed")
    ap.add_argument("--private-seeds", action="store_true",
                    help="draw the sampling and noise seeds from the OS (for a model you release)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations "
                    "(default: 10%% of --steps)")
    ap.add_argument("--eval-batch-size", type=int, default=None, help="(default: --physical-batch-size)")
    ap.add_argument("--compare-nonprivate", action="store_true",
                    help="also train the same model the same number of steps, same batches, without DP "
                    "(no per-sample clipping, no noise; the batch gradient's norm clipped at 1, as usual)")
    ap.add_argument("--out-dir", default=None, help="plot, JSON and checkpoints (default: runs/<timestamp>)")
    ap.add_argument("--checkpoint-dir", default=None, help="a run resumes from the newest checkpoint found here "
                    "(default: <out-dir>/checkpoints)")
    ap.add_argument("--checkpoint-every", type=int, default=None,
                    help="steps between checkpoints (default: 10%% of --steps; 0: none)")
    ap.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                    help="stop once STEP of the planned steps are done (checkpointed, as if the job were killed "
                         "there); the same command without it resumes")
    ap.add_argument("--quiet", action="store_true", help="no progress bar, no evaluation lines")
    args = ap.parse_args(argv)
    for name in ("seq_len", "steps", "batch_size", "physical_batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.dtype == "bfloat16" and args.device != "cuda":
        ap.error("--dtype bfloat16 is for --device cuda (autocast on the GPU)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU is available")
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 10)
    if args.checkpoint_every is None:
        args.checkpoint_every = args.eval_every
    if args.eval_every < 1 or args.checkpoint_every < 0:
        ap.error("--eval-every must be >= 1 and --checkpoint-every >= 0")
    args.eval_batch_size = args.eval_batch_size or args.physical_batch_size
    if args.lr is None:
        args.lr = DEFAULT_LR["hf" if args.model.startswith("hf:") else args.model] if (
            args.model.startswith("hf:") or args.model in DEFAULT_LR) else 1e-3
    return args


# settings a resumed run must share with the checkpointed one (its privacy accounting and model depend on them)
RESUME_KEYS = ("model", "layers", "width", "heads", "seq_len", "steps", "batch_size", "target_epsilon", "delta",
               "max_grad_norm", "train_records", "noise_multiplier", "sample_rate")


# ----------------------------------------------------------------------------- training
class Curves:
    """Held-out evaluations of one run: step, epsilon, held-out loss, mean train loss since the last one."""

    def __init__(self, state: dict | None = None):
        state = state or {}
        self.steps: list[int] = list(state.get("steps", []))
        self.epsilon: list[float] = list(state.get("epsilon", []))
        self.heldout_loss: list[float] = list(state.get("heldout_loss", []))
        self.train_loss: list[float | None] = list(state.get("train_loss", []))
        self.train_loss_per_step: list[float | None] = list(state.get("train_loss_per_step", []))
        self.tokens: int = int(state.get("tokens", 0))
        self.train_seconds: float = float(state.get("train_seconds", 0.0))
        self.dropped_samples: int = int(state.get("dropped_samples", 0))

    def add(self, step: int, epsilon: float | None, heldout: float) -> None:
        since = [v for v in self.train_loss_per_step[self.steps[-1] if self.steps else 0: step] if v is not None]
        self.steps.append(step)
        if epsilon is not None:
            self.epsilon.append(epsilon)
        self.heldout_loss.append(heldout)
        self.train_loss.append(sum(since) / len(since) if since else None)

    def state(self) -> dict:
        return {"steps": self.steps, "epsilon": self.epsilon, "heldout_loss": self.heldout_loss,
                "heldout_perplexity": [math.exp(v) for v in self.heldout_loss], "train_loss": self.train_loss,
                "train_loss_per_step": self.train_loss_per_step, "tokens": self.tokens,
                "train_seconds": self.train_seconds, "dropped_samples": self.dropped_samples}


NONPRIVATE_GRAD_CLIP = 1.0


def run_training(*, private: bool, args, ctx: Dist, dev: torch.device, data: dict, sampler_seed: int,
                 noise_seed: int | None, sigma: float, q: float, delta: float, baseline: float,
                 config: dict, say) -> tuple[Curves, dict]:
    """Trains one model (DP-SGD, or the non-private comparison) for args.steps logical steps."""
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    if args.model.startswith("hf:"):
        model = build_model(args)[0].to(dev)
    else:
        with torch.device(dev):  # initialised where it runs (a 1B model's init on the CPU takes a while)
            model = build_model(args)[0]
    model = ctx.shard(model)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    eval_model = model  # evaluated eagerly (a sharded model gathers its parameters as it goes)
    sampler = dpcompile.PoissonBatchSampler(data["n_train"], sample_rate=q, steps=args.steps, seed=sampler_seed,
                                            rank=ctx.rank, world_size=ctx.world)
    bf16 = args.dtype == "bfloat16"

    def autocast():
        return torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    if private:
        def dp_train_step(ids, targets):
            with autocast():
                per_sample = per_sample_loss(logits_of(model, ids), targets)
            loss = per_sample.mean()  # scaled by 1 / expected_batch_size (the logical batch's) in the DP graph
            loss.backward()
            return loss.detach()

        step_fn = dpcompile.private_step(dp_train_step, max_grad_norm=args.max_grad_norm, noise_multiplier=sigma,
                                         expected_batch_size=args.batch_size, seed=noise_seed)
        backend = step_fn.dp_backend
        accountant = dpcompile.PrivacyAccountant(noise_multiplier=sigma, sample_rate=q)
    else:
        expected = float(args.batch_size)

        def plain_train_step(ids, targets, weights):
            with autocast():
                per_sample = per_sample_loss(logits_of(model, ids), targets)
            # the same gradient as the DP step's, without clipping and noise (weights: 1, or 0 for a stand-in)
            loss = (per_sample * weights).sum() / expected
            loss.backward()
            return loss.detach()

        step_fn = torch.compile(plain_train_step)
        backend = accountant = None

    # --- checkpoint / resume: every Checkpointer call is here and in save() below
    ckpt = None
    curves = Curves()
    if private and (args.checkpoint_every or args.stop_after is not None):
        ckpt = dpcompile.Checkpointer(args.checkpoint_dir, model=model, optimizer=opt, backend=step_fn,
                                      accountant=accountant, sampler=sampler)
        restored = ckpt.restore()
        if restored is not None:
            extra = restored["extra"] or {}
            old = extra.get("config", {})
            diff = {k: (old.get(k), config.get(k)) for k in RESUME_KEYS if old.get(k) != config.get(k)}
            if diff:
                raise ValueError(f"{args.checkpoint_dir} holds a checkpoint of a run with other settings "
                                 f"(checkpointed, now): {diff}; use another --out-dir / --checkpoint-dir")
            curves = Curves(extra.get("curves"))
            say(f"resumed from the checkpoint in {args.checkpoint_dir} after step {restored['step']} "
                f"(epsilon spent so far {accountant.epsilon(delta):.3f})")

    def save(t: int) -> None:
        if ckpt is not None:
            ckpt.save(t, extra={"config": config, "curves": curves.state()})

    def evaluate_now(t: int) -> float:
        heldout = evaluate(eval_model, data["held_in"], data["held_tg"], args.eval_batch_size, autocast)
        eps = accountant.epsilon(delta) if private else None
        if private:
            curves.dropped_samples += int(ctx.sum([float(backend.dropped_samples())])[0])
        curves.add(t, eps, heldout)
        tr = curves.train_loss[-1]
        say(f"{'DP' if private else 'non-private'} step {t:4d}/{args.steps}"
            + (f"  epsilon {eps:6.3f}" if private else "")
            + (f"  train loss {tr:.4f}" if tr is not None else "")
            + f"  held-out loss {heldout:.4f}  perplexity {math.exp(heldout):7.3f}  (unigram baseline "
              f"{baseline:.4f})" + (f"  dropped samples {curves.dropped_samples}" if private else ""))
        return eps

    start = sampler.start_step
    if not curves.steps:
        evaluate_now(start)
    eps = curves.epsilon[-1] if curves.epsilon else 0.0
    bar = tqdm(total=args.steps, initial=start, disable=args.quiet or not ctx.main, dynamic_ncols=True,
               desc="DP-SGD" if private else "non-private", file=sys.stderr, smoothing=0.1)
    train_in, train_tg, lengths = data["train_in"], data["train_tg"], data["train_len"]
    t = start
    loss_sum, n_samples, tokens = 0.0, 0, 0
    recent: list[tuple[int, float]] = []  # (tokens, seconds) of each step this process ran
    seconds_at = time.perf_counter()
    # the micro-batch size Inductor tunes the one graph for (its size is unbacked: no hint of its own; without
    # one Inductor assumes 8192 samples): a rank's expected share of the logical batch, at most a micro-batch
    hint = max(2, min(args.physical_batch_size, rank_share(args.batch_size, ctx.world)))
    for idx, last in sampler.micro_batches(max_size=args.physical_batch_size):
        # An empty DP micro-batch still runs (the last one of a step adds the noise), and sharded ranks all run
        # every micro-step (the parameter all-gathers are collectives). The plain (non-private) step is never
        # given an empty batch (dpcompile makes its own graphs safe for one, not Inductor's plain ones): a
        # sharded rank with no samples runs it on one stand-in record of weight 0.
        if idx or private or ctx.world > 1:
            index = torch.tensor(idx, dtype=torch.long)
            ids, targets = train_in[index.to(dev)], train_tg[index.to(dev)]
            if private:
                dpcompile.mark_batch(ids, targets, hint=hint, nonempty=True)  # one graph for every size (0, 1 too)
                with dpcompile.accumulate(enabled=not last):
                    loss = step_fn(ids, targets)
            else:
                weights = torch.ones(len(idx), device=dev)
                if not idx:
                    ids, targets, weights = train_in[:1], train_tg[:1], torch.zeros(1, device=dev)
                dpcompile.mark_batch(ids, targets, weights, hint=hint)
                loss = step_fn(ids, targets, weights)
            if idx:
                # the DP step returns the micro-batch's mean, the plain one its sum / expected batch size
                loss_sum += float(loss) * (len(idx) if private else args.batch_size)
                n_samples += len(idx)
                tokens += int(lengths[index].sum())
        if not last:
            continue
        if not private:
            # the usual recipe for a non-private transformer: the batch gradient's norm clipped at 1 (without
            # it Adam stalls at the unigram loss for ~100 steps on gpt2-small; DP's clipping bounds it anyway)
            torch.nn.utils.clip_grad_norm_(model.parameters(), NONPRIVATE_GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if private:
            accountant.step()
        t += 1
        s, n, tok = ctx.sum([loss_sum, float(n_samples), float(tokens)])
        train_loss = s / n if n else None  # mean per-sample loss of the logical batch
        curves.train_loss_per_step.append(train_loss)
        curves.tokens += int(tok)
        now = time.perf_counter()
        curves.train_seconds += now - seconds_at
        recent.append((int(tok), now - seconds_at))  # this process's steps; the first one compiles
        seconds_at = now
        loss_sum, n_samples, tokens = 0.0, 0, 0
        stop = private and args.stop_after is not None and t >= args.stop_after
        if t % args.eval_every == 0 or t == args.steps or stop:
            bar.clear()
            eps = evaluate_now(t)
            bar.refresh()
            seconds_at = time.perf_counter()  # evaluation time is not training time
        if (args.checkpoint_every and t % args.checkpoint_every == 0) or t == args.steps or stop:
            save(t)
            seconds_at = time.perf_counter()
        post = {"loss": f"{train_loss:.3f}" if train_loss is not None else "-"}
        if private:
            post["eps"] = f"{eps:.2f}"
        window = recent[1:][-10:] or recent  # the last 10 steps, not the compile
        post["tok/s"] = f"{sum(k for k, _ in window) / max(sum(d for _, d in window), 1e-9):,.0f}"
        bar.set_postfix(post, refresh=False)
        bar.update(1)
        if stop:
            say(f"stopped after step {t} of {args.steps} (--stop-after); run again without it to resume")
            break
    bar.close()
    after_first = recent[1:]
    return curves, {"epsilon": accountant.epsilon(delta) if private else None, "completed_steps": t,
                    "first_step_seconds": recent[0][1] if recent else None,
                    "tokens_per_second": sum(k for k, _ in after_first) / sum(d for _, d in after_first)
                    if after_first else None}


def plot(path: str, dp: Curves, nonprivate: Curves | None, baseline: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.plot(dp.steps, dp.heldout_loss, "o-", label="DP-SGD (dpcompile)")
    if nonprivate is not None:
        a.plot(nonprivate.steps, nonprivate.heldout_loss, "s-", color="tab:green", label="non-private")
    a.axhline(baseline, color="tab:red", ls=":", label=f"unigram baseline {baseline:.3f}")
    a.set_xlabel("step")
    a.set_ylabel("held-out loss (nats per byte)")
    a.set_title("held-out loss against steps")
    a.legend()
    a.grid(alpha=0.3)
    b.plot(dp.epsilon, dp.heldout_loss, "o-", label="DP-SGD (dpcompile)")
    if nonprivate is not None:
        b.axhline(nonprivate.heldout_loss[-1], color="tab:green", ls="--",
                  label=f"non-private, final {nonprivate.heldout_loss[-1]:.3f}")
    b.axhline(baseline, color="tab:red", ls=":", label=f"unigram baseline {baseline:.3f}")
    b.set_xlabel("epsilon spent")
    b.set_ylabel("held-out loss (nats per byte)")
    b.set_title("held-out loss against privacy spent")
    b.legend()
    b.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    """Runs the job; returns the final numbers (steps, epsilon, held-out losses, unigram baseline, paths)."""
    args = parse_args(argv)
    wall = time.perf_counter()
    ctx = Dist(args.device)
    try:
        with warnings.catch_warnings():
            # Opacus' RDP order search (used by the PRV accountant to bound its domain), and DCP saving
            # from a single process: both expected here
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            return _main(args, ctx, wall)
    finally:
        ctx.close()


def _main(args, ctx: Dist, wall: float) -> dict:
    say = (lambda msg: __import__("tqdm").tqdm.write(msg, file=sys.stdout)) if ctx.main and not args.quiet \
        else (lambda msg: None)
    dev = ctx.device(args.device)
    if args.out_dir is None:
        args.out_dir = ctx.broadcast(os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S")))
    args.checkpoint_dir = args.checkpoint_dir or os.path.join(args.out_dir, "checkpoints")
    if ctx.main:
        os.makedirs(args.out_dir, exist_ok=True)

    train, held = split_records(load_records())
    train_in, train_tg = encode(train, args.seq_len)
    held_in, held_tg = encode(held, args.seq_len)
    baseline = unigram_baseline(train_tg, held_tg)
    data = {"n_train": len(train), "train_in": train_in.to(dev), "train_tg": train_tg.to(dev),
            "train_len": (train_tg != PAD).sum(1), "held_in": held_in.to(dev), "held_tg": held_tg.to(dev)}
    n = len(train)
    if args.batch_size > n:
        raise ValueError(f"--batch-size {args.batch_size} is larger than the {n} training records")
    q = args.batch_size / n
    delta = args.delta if args.delta is not None else 1.0 / n
    sigma = dpcompile.noise_multiplier_for(target_epsilon=args.target_epsilon, target_delta=delta, sample_rate=q,
                                           steps=args.steps)
    if args.private_seeds:
        import secrets

        sampler_seed, noise_seed = ctx.broadcast(secrets.randbits(63)), None  # noise: dpcompile draws it
    else:
        sampler_seed, noise_seed = args.seed * 2 + 1, args.seed * 2 + 2

    torch.manual_seed(args.seed)
    with contextlib.nullcontext() if args.model.startswith("hf:") else torch.device("meta"):
        probe, model_desc = build_model(args)  # for its description: no memory, no init
    n_params = sum(p.numel() for p in probe.parameters())
    del probe
    config = {**{k: v for k, v in vars(args).items() if k not in ("quiet",)}, **model_desc,
              "parameters": n_params, "train_records": n, "heldout_records": len(held), "delta": delta,
              "noise_multiplier": sigma, "sample_rate": q, "world_size": ctx.world, "vocab": VOCAB,
              "privacy_unit": "one paragraph of a pydoc_data.topics help topic (one record)"}
    say(f"data: {len(train) + len(held)} records (one paragraph = one privacy unit): {n} training, {len(held)} "
        f"held out; first {args.seq_len} bytes of each")
    say(f"model: {args.model} {model_desc}, {n_params:,} parameters on {dev}"
        + (f" x {ctx.world} ranks (dpcompile.fully_shard)" if ctx.world > 1 else "") + f", {args.dtype}")
    say(f"DP-SGD: {args.steps} steps, Poisson sample rate q = {q:.4f} (expected batch {args.batch_size}, micro-"
        f"batches <= {args.physical_batch_size}), C = {args.max_grad_norm}, noise multiplier {sigma:.4f} -> "
        f"epsilon {args.target_epsilon} at delta {delta:.3g}; Adam lr {args.lr}")
    say(f"unigram baseline (held-out bytes under the training split's byte frequencies): {baseline:.4f} nats/byte, "
        f"perplexity {math.exp(baseline):.2f}")

    common = dict(args=args, ctx=ctx, dev=dev, data=data, sampler_seed=sampler_seed, sigma=sigma, q=q,
                  delta=delta, baseline=baseline, config=config, say=say)
    t0 = time.perf_counter()
    dp, info = run_training(private=True, noise_seed=noise_seed, **common)
    dp_seconds = time.perf_counter() - t0
    nonprivate, np_seconds = None, None
    stopped = info["completed_steps"] < args.steps
    if args.compare_nonprivate and not stopped:
        say("training the same model without DP (no clipping, no noise), same batches, for comparison")
        t0 = time.perf_counter()
        nonprivate, _ = run_training(private=False, noise_seed=None, **common)
        np_seconds = time.perf_counter() - t0

    plot_path = os.path.join(args.out_dir, "curves.png")
    json_path = os.path.join(args.out_dir, "curves.json")
    final = {
        "steps": info["completed_steps"], "planned_steps": args.steps, "epsilon": info["epsilon"], "delta": delta,
        "target_epsilon": args.target_epsilon, "heldout_loss": dp.heldout_loss[-1],
        "heldout_perplexity": math.exp(dp.heldout_loss[-1]), "unigram_baseline": baseline,
        "nonprivate_heldout_loss": nonprivate.heldout_loss[-1] if nonprivate else None,
        "dropped_samples": dp.dropped_samples, "noise_multiplier": sigma, "sample_rate": q,
        "tokens_per_second": info["tokens_per_second"], "first_step_seconds": info["first_step_seconds"],
        "dp_seconds": dp_seconds, "nonprivate_seconds": np_seconds,
        "wall_seconds": time.perf_counter() - wall, "plot": plot_path, "json": json_path,
        "checkpoint_dir": args.checkpoint_dir if args.checkpoint_every or args.stop_after is not None else None,
    }
    if ctx.main:
        title = (f"byte-level {args.model} on pydoc topics, {n} paragraphs; DP-SGD q={q:.3f}, sigma={sigma:.3f}, "
                 f"C={args.max_grad_norm}, {args.steps} steps -> eps={info['epsilon']:.2f} at delta={delta:.2g}")
        plot(plot_path, dp, nonprivate, baseline, title)
        record = {"config": config, "unigram_baseline": baseline, "final": final, "dp": dp.state(),
                  "nonprivate": nonprivate.state() if nonprivate else None}
        with open(json_path, "w") as f:
            json.dump(record, f, indent=1)
        msg = (f"done: {final['steps']} DP steps, epsilon {final['epsilon']:.3f} at delta {delta:.3g}; held-out loss "
               f"{final['heldout_loss']:.4f} (perplexity {final['heldout_perplexity']:.2f})"
               + (f", non-private {final['nonprivate_heldout_loss']:.4f}" if nonprivate else "")
               + f", unigram baseline {baseline:.4f}; dropped samples {dp.dropped_samples}; "
                 f"wall time {final['wall_seconds']:.1f} s (DP training {dp_seconds:.1f} s"
               + (f", first step with the compile {info['first_step_seconds']:.1f} s" if info["first_step_seconds"]
                  else "")
               + (f", then {info['tokens_per_second']:,.0f} tokens/s" if info["tokens_per_second"] else "")
               + (f"; non-private {np_seconds:.1f} s" if nonprivate else "") + ")")
        print(msg)
        print(f"plot: {plot_path}\ncurves: {json_path}")
    return final


if __name__ == "__main__":
    main()
