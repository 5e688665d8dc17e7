"""Could bk's clip scaling ride inside the weight-gradient GEMM? Triton variants against cuBLAS (bf16, H100).

bk's deferred contraction is mm((r*G)^T, X) over N = B*T rows, both operands'
dropped samples zeroed; dpcompile emits where/mul copies that feed cuBLAS.
The variants here fold the per-row work into the GEMM's loads instead:

  m0  plain Triton GEMM, no DP work (the ceiling of this approach)
  m1  tiles loaded with per-row keep masks, the G tile scaled in registers
  m2  per-sample segments (T % BLOCK_K == 0): a partial product per sample,
      added to the accumulator times r; dropped samples skipped
  m3  as m1, the X tile scaled instead
  m4  flash-attention style: the accumulator rescaled by r_prev / r per tile
  m5  m0 with the per-row keep masks on the loads (no scaling)

GPT-2-small weight shapes (qkv, attention projection, MLP in/out, the
50257-row lm_head), cuBLAS ``mm(G.t(), X)`` and the copies + cuBLAS that
Inductor makes of today's graph printed first (microseconds). Results and the
decision are in BENCHMARKS.md ("Clip scaling inside the GEMM").

    python3 benchmarks/row_scaled_mm.py [--shapes 32x256,2x4096] [--modes 0,1,2,3,4,5] [--splits 1,2,4]
"""
import argparse
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    return pid_m, pid_n


@triton.jit
def k_variant(a_ptr, b_ptr, c_ptr, r_ptr, keep_ptr, M, N, K, nsamples, inner,
              sam, sak, sbk, sbn, scm, scn,
              MODE: tl.constexpr, SPLIT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    kchunk = K // SPLIT
    k_lo = pid_s * kchunk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + offs_m[:, None] * sam
    b_base = b_ptr + offs_n[None, :] * sbn
    mmask = offs_m[:, None] < M
    nmask = offs_n[None, :] < N
    if MODE == 0:  # plain
        for k0 in range(k_lo, k_lo + kchunk, BLOCK_K):
            ks = k0 + offs_k
            a = tl.load(a_base + ks[None, :] * sak, mask=mmask, other=0.0)
            b = tl.load(b_base + ks[:, None] * sbk, mask=nmask, other=0.0)
            acc = tl.dot(a, b, acc)
    elif MODE == 1:  # masked loads, A scaled in registers
        for k0 in range(k_lo, k_lo + kchunk, BLOCK_K):
            ks = k0 + offs_k
            s = (ks // inner) % nsamples
            keep = tl.load(keep_ptr + s) != 0
            r = tl.load(r_ptr + s)
            a = tl.load(a_base + ks[None, :] * sak, mask=mmask & keep[None, :], other=0.0)
            b = tl.load(b_base + ks[:, None] * sbk, mask=nmask & keep[:, None], other=0.0)
            a = (a.to(tl.float32) * r[None, :]).to(a.dtype)
            acc = tl.dot(a, b, acc)
    elif MODE == 2:  # masked loads, per-sample segments (inner % BLOCK_K == 0), nested loop
        for seg in range(k_lo // inner, (k_lo + kchunk) // inner):
            s = seg % nsamples
            keep = tl.load(keep_ptr + s)
            r = tl.load(r_ptr + s)
            if keep != 0:
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(seg * inner, seg * inner + inner, BLOCK_K):
                    ks = k0 + offs_k
                    a = tl.load(a_base + ks[None, :] * sak, mask=mmask, other=0.0)
                    b = tl.load(b_base + ks[:, None] * sbk, mask=nmask, other=0.0)
                    part = tl.dot(a, b, part)
                acc += r * part
    elif MODE == 4:  # masked loads, online rescale of the accumulator (tiles within one sample)
        r_prev = 1.0
        for k0 in range(k_lo, k_lo + kchunk, BLOCK_K):
            s = (k0 // inner) % nsamples
            keep = tl.load(keep_ptr + s)
            r = tl.load(r_ptr + s)
            r = tl.where(keep != 0, r, r_prev)
            acc = acc * (r_prev / r)
            r_prev = r
            ks = k0 + offs_k
            kk = offs_k < BLOCK_K * keep.to(tl.int32)  # all-true when kept, all-false when dropped
            a = tl.load(a_base + ks[None, :] * sak, mask=mmask & kk[None, :], other=0.0)
            b = tl.load(b_base + ks[:, None] * sbk, mask=nmask & kk[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
        acc = acc * r_prev
    elif MODE == 5:  # plain + masked loads per row
        for k0 in range(k_lo, k_lo + kchunk, BLOCK_K):
            ks = k0 + offs_k
            s = (ks // inner) % nsamples
            keep = tl.load(keep_ptr + s) != 0
            a = tl.load(a_base + ks[None, :] * sak, mask=mmask & keep[None, :], other=0.0)
            b = tl.load(b_base + ks[:, None] * sbk, mask=nmask & keep[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
    else:  # MODE 3: B scaled in registers (masked loads)
        for k0 in range(k_lo, k_lo + kchunk, BLOCK_K):
            ks = k0 + offs_k
            s = (ks // inner) % nsamples
            keep = tl.load(keep_ptr + s) != 0
            r = tl.load(r_ptr + s)
            a = tl.load(a_base + ks[None, :] * sak, mask=mmask & keep[None, :], other=0.0)
            b = tl.load(b_base + ks[:, None] * sbk, mask=nmask & keep[:, None], other=0.0)
            b = (b.to(tl.float32) * r[:, None]).to(b.dtype)
            acc = tl.dot(a, b, acc)
    c_ptrs = c_ptr + offs_m[:, None] * scm + offs_n[None, :] * scn
    if SPLIT == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask & nmask)
    else:
        tl.atomic_add(c_ptrs, acc, mask=mmask & nmask)


CFGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)]


def launch(a, b, r, keep, B, T, mode, split, cfg):
    bm, bn, bk, w, st = cfg
    M, K = a.shape
    N = b.shape[1]
    if split == 1:
        c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    else:
        c = torch.zeros(M, N, device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), split)
    k_variant[grid](a, b, c, r, keep, M, N, K, B, T, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                    c.stride(0), c.stride(1), MODE=mode, SPLIT=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                    GROUP_M=8, num_warps=w, num_stages=st)
    return c if split == 1 else c.to(a.dtype)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="32x256,2x4096")
    p.add_argument("--modes", default="0,1,2,3,4,5")
    p.add_argument("--splits", default="1", help="split-K factors (fp32 atomics when > 1)")
    args = p.parse_args()
    modes = [int(m) for m in args.modes.split(",")]
    for (B, T) in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]:
        Nr = B * T
        for name, O, I in [("qkv", 2304, 768), ("attn_proj", 768, 768), ("fc", 3072, 768), ("mlp_proj", 768, 3072),
                           ("lm_head", 50257, 768)]:
            G = torch.randn(Nr, O, device="cuda", dtype=torch.bfloat16)
            X = torch.randn(Nr, I, device="cuda", dtype=torch.bfloat16)
            r = torch.rand(B, device="cuda")
            keep = (torch.rand(B, device="cuda") > 0.1)
            ku = keep.to(torch.uint8)
            rs = r.view(B, 1).expand(B, T).reshape(Nr, 1)
            ks = keep.view(B, 1).expand(B, T).reshape(Nr, 1)
            ref = torch.mm(torch.where(ks, G.float() * rs, 0).t(), torch.where(ks, X.float(), 0))
            t_cub = do_bench(lambda: torch.mm(G.t(), X))
            copies = torch.compile(lambda G, X, rs, ks: torch.mm(torch.where(ks, G * rs.to(G.dtype), 0.0).t(),
                                                                torch.where(ks, X, 0.0)))
            copies(G, X, rs, ks)
            t_cop = do_bench(lambda: copies(G, X, rs, ks))  # what bk emits today, compiled by Inductor
            line = f"B{B}xT{T} {name:9s} cublas {t_cub*1e3:6.1f} | copies+cublas {t_cop*1e3:6.1f}"
            for mode in modes:
                for split in [int(v) for v in args.splits.split(",")]:
                    best = None
                    for cfg in CFGS:
                        try:
                            out = launch(G.t(), X, r, ku, B, T, mode, split, cfg)
                            if mode in (1, 2, 3, 4):  # the DP variants must give the clipped sum
                                err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
                                if err > 2e-2:
                                    raise RuntimeError(f"wrong: rel err {err}")
                            t = do_bench(lambda: launch(G.t(), X, r, ku, B, T, mode, split, cfg))
                        except Exception as e:  # noqa: BLE001
                            if "wrong" in str(e):
                                print("WRONG", mode, split, cfg, e)
                            continue
                        if best is None or t < best[0]:
                            best = (t, cfg)
                    if best:
                        line += f" | m{mode}s{split} {best[0]*1e3:6.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
