"""A Llama-shaped decoder for the benchmarks (Llama-3.2-1B: 16 layers, d=2048,
32 query / 8 key-value heads, SwiGLU 8192, vocab 128256, tied embeddings).

Written the way torchtitan writes it (RMSNorm, rotary embedding, grouped
query attention by expanding the key/value heads), random init.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpcompile.train import rotary  # the main job's Llama preset uses the same one


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    B, T, kvh, hd = x.shape
    return x[:, :, :, None, :].expand(B, T, kvh, n_rep, hd).reshape(B, T, kvh * n_rep, hd)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.hd = n_heads, n_kv_heads, d // n_heads
        self.wq = nn.Linear(d, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(d, n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = rotary(self.wq(x).view(B, T, -1, self.hd))
        k = rotary(self.wk(x).view(B, T, -1, self.hd))
        v = self.wv(x).view(B, T, -1, self.hd)
        rep = self.n_heads // self.n_kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, repeat_kv(k, rep), repeat_kv(v, rep)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv_heads: int, ffn: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.attn = Attention(d, n_heads, n_kv_heads)
        self.w1 = nn.Linear(d, ffn, bias=False)
        self.w3 = nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab: int = 128256, d: int = 2048, n_layers: int = 16, n_heads: int = 32,
                 n_kv_heads: int = 8, ffn: int = 8192, tied: bool = True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, n_heads, n_kv_heads, ffn) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids):
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))
