"""dpcompile's Triton kernels, imported on first launch (so triton is needed only where they run): the per-sample
norm of a convolution's weight gradient (dpcompile.conv_sq_norms), the ghost form's Gram product
(dpcompile.gram_sq_norms), the noise draws (dpcompile.randn, dpcompile.add_randn). Their launch arguments,
tiles and fallbacks live in those modules."""
import triton
import triton.language as tl


@triton.jit
def conv_weight_sq_norms_kernel(
        e_ptr, x_ptr, out_ptr, grads_ptr,
        se_b, se_c, se_h, se_w, sx_b, sx_c, sx_h, sx_w,
        ROWS: tl.constexpr, COUT_G: tl.constexpr, CIN_G: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
        H: tl.constexpr, W: tl.constexpr, GROUPS: tl.constexpr, PARTS: tl.constexpr, N_POS: tl.constexpr,
        KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr,
        PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr,
        KEEP: tl.constexpr = False):
    # The geometry is constexpr (a kernel per layer shape): the index arithmetic of every step divides by
    # constants. One program per (sample and group, tile), a sample's tiles adjacent: they run at about
    # the same time and read the same rows of e and x, so those come from L2 once per sample, not once
    # per tile (WRN-16-4 bf16, H100: the step's 12 launches 0.87 -> 0.78 ms).
    n_cols: tl.constexpr = CIN_G * KH * KW
    tiles_m: tl.constexpr = (COUT_G + BLOCK_M - 1) // BLOCK_M
    tiles_n: tl.constexpr = (n_cols + BLOCK_N - 1) // BLOCK_N
    # a tile within one kernel tap (BLOCK_N divides the channels): its columns are channels at one
    # (kh, kw), so a position's window offset and padding test are one value per position, not per entry
    one_tap: tl.constexpr = CIN_G % BLOCK_N == 0
    pid = tl.program_id(0)
    pid_bg = pid // (tiles_m * tiles_n)
    pid_m = pid % (tiles_m * tiles_n) // tiles_n
    pid_n = pid % tiles_n
    b = pid_bg // GROUPS
    g = pid_bg % GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output channel within the group
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # column: (kernel position, input channel)
    if one_tap:
        ci = (pid_n * BLOCK_N) % CIN_G + tl.arange(0, BLOCK_N)
        kpos = (pid_n * BLOCK_N) // CIN_G
    else:
        ci = offs_n % CIN_G
        kpos = offs_n // CIN_G
    kh = kpos // KW
    kw = kpos % KW
    mask_m = offs_m < COUT_G
    mask_n = offs_n < n_cols
    e_base = e_ptr + (g * COUT_G + offs_m)[:, None] * se_c
    x_base = x_ptr + (g * CIN_G + ci)[None, :] * sx_c
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, N_POS, BLOCK_P):  # N_POS = ROWS * OH * OW: a sample's positions
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask_p = offs_p < N_POS
        row = b * ROWS + offs_p // (OH * OW)
        pos = offs_p % (OH * OW)
        oh = pos // OW
        ow = pos % OW
        e_tile = tl.load(e_base + (row * se_b + oh * se_h + ow * se_w)[None, :],
                         mask=mask_m[:, None] & mask_p[None, :], other=0.0)  # [BLOCK_M, BLOCK_P]
        if one_tap:
            ih = oh * SH - PH + kh * DH
            iw = ow * SW - PW + kw * DW
            inside = mask_p & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            x_tile = tl.load(x_base + (row * sx_b + ih * sx_h + iw * sx_w)[:, None],
                             mask=inside[:, None], other=0.0)  # [BLOCK_P, BLOCK_N]
        else:
            ih = (oh * SH - PH)[:, None] + (kh * DH)[None, :]
            iw = (ow * SW - PW)[:, None] + (kw * DW)[None, :]
            inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            x_tile = tl.load(x_base + (row * sx_b)[:, None] + ih * sx_h + iw * sx_w,
                             mask=mask_p[:, None] & mask_n[None, :] & inside, other=0.0)  # [BLOCK_P, BLOCK_N]
        acc = tl.dot(e_tile, x_tile, acc, input_precision=PRECISION)
    part = (g * tiles_m + pid_m) * tiles_n + pid_n
    tl.store(out_ptr + b * PARTS + part, tl.sum(tl.sum(acc * acc, axis=1), axis=0))
    if KEEP:  # the tile itself too: grads [B, GROUPS * COUT_G, n_cols] fp32, columns in this kernel's order
        rows_out = (b * GROUPS + g) * COUT_G + offs_m
        tl.store(grads_ptr + rows_out.to(tl.int64)[:, None] * n_cols + offs_n[None, :], acc,
                 mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gram_tile(base, s_s, s_f, offs_i, offs_j, mask_i, mask_j, k_lo, LEN: tl.constexpr,
               BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DIAG: tl.constexpr):
    """[BLOCK_S, BLOCK_S] fp32: rows offs_i against rows offs_j of one sample's [S, F] operand at base, over its
    features [k_lo, k_lo + LEN). The length is a constexpr (Triton 3.6's interpreter cannot take a value computed
    from the program id as a range bound; a static count also lets the compiler pipeline the loop), and the whole
    K steps load without a mask on the features: a mask against a bound that is no multiple of 16 (GPT-2's 50257
    logits) makes every load scalar, which held an LM head's Gram to about a fifth of what the same kernel ran at
    on Llama's 128256. The rest of the features, if any, is one masked step after the loop. DIAG: offs_j is
    offs_i, and the rows are loaded once (the two Grams of a diagonal tile read half the bytes: an LM head's Gram
    is bound by those reads)."""
    acc = tl.zeros([BLOCK_S, BLOCK_S], dtype=tl.float32)
    for kk in range(0, LEN // BLOCK_K * BLOCK_K, BLOCK_K):
        acc = _gram_step(base, s_s, s_f, offs_i, offs_j, mask_i, mask_j, k_lo + kk, BLOCK_K, acc, BLOCK_K,
                         PRECISION, DIAG)
    if LEN % BLOCK_K:
        acc = _gram_step(base, s_s, s_f, offs_i, offs_j, mask_i, mask_j, k_lo + LEN // BLOCK_K * BLOCK_K,
                         LEN % BLOCK_K, acc, BLOCK_K, PRECISION, DIAG)
    return acc


@triton.jit
def _gram_step(base, s_s, s_f, offs_i, offs_j, mask_i, mask_j, k0, VALID: tl.constexpr, acc,
               BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DIAG: tl.constexpr):
    """acc plus one K step over features [k0, k0 + VALID): a whole step (VALID == BLOCK_K) masks rows only, so its
    loads vectorise; a last partial step masks the features past VALID too."""
    lane = tl.arange(0, BLOCK_K)
    offs_k = k0 + lane
    if VALID == BLOCK_K:
        mask_x = mask_i[:, None]
        mask_y = mask_j[None, :]
    else:
        mask_x = mask_i[:, None] & (lane < VALID)[None, :]
        mask_y = (lane < VALID)[:, None] & mask_j[None, :]
    x = tl.load(base + offs_i[:, None] * s_s + offs_k[None, :] * s_f, mask=mask_x, other=0.0)  # [BLOCK_S, BLOCK_K]
    if DIAG:
        y = tl.trans(x)
    else:
        y = tl.load(base + offs_j[None, :] * s_s + offs_k[:, None] * s_f, mask=mask_y, other=0.0)  # [BLOCK_K, BLOCK_S]
    return tl.dot(x, y, acc, input_precision=PRECISION)


@triton.jit
def _gram_pair_sum(a_base, sa_s, sa_f, g_base, sg_s, sg_f, offs_i, offs_j, mask_i, mask_j, s,
                   P: tl.constexpr, M: tl.constexpr, SPLITS: tl.constexpr, KS: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DIAG: tl.constexpr):
    """The sum of the product of A's Gram tile (all P features) and G's (piece s of M's, KS each: the first
    M // KS pieces whole, the next one the rest of M, any after it empty)."""
    ga = _gram_tile(a_base, sa_s, sa_f, offs_i, offs_j, mask_i, mask_j, 0, P, BLOCK_S, BLOCK_K, PRECISION, DIAG)
    if SPLITS == 1:
        gg = _gram_tile(g_base, sg_s, sg_f, offs_i, offs_j, mask_i, mask_j, 0, M, BLOCK_S, BLOCK_K, PRECISION, DIAG)
    else:
        gg = tl.zeros([BLOCK_S, BLOCK_S], dtype=tl.float32)  # a piece past M stays empty
        if s < M // KS:
            gg = _gram_tile(g_base, sg_s, sg_f, offs_i, offs_j, mask_i, mask_j, s * KS, KS, BLOCK_S, BLOCK_K,
                            PRECISION, DIAG)
        if M % KS:  # (a constexpr: the rest of M, where there is one, is piece M // KS)
            if s == M // KS:
                gg = _gram_tile(g_base, sg_s, sg_f, offs_i, offs_j, mask_i, mask_j, M // KS * KS, M % KS,
                                BLOCK_S, BLOCK_K, PRECISION, DIAG)
    return tl.sum(tl.sum(ga * gg, axis=1), axis=0)


@triton.jit
def gram_sq_norms_kernel(a_ptr, g_ptr, out_ptr, sa_b, sa_s, sa_f, sg_b, sg_s, sg_f,
                         S: tl.constexpr, P: tl.constexpr, M: tl.constexpr, TILES: tl.constexpr,
                         SPLITS: tl.constexpr, KS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # out: [B, parts] contiguous, one part per program
    pid = tl.program_id(0)
    _gram_program(a_ptr, g_ptr, out_ptr + pid, pid, sa_b, sa_s, sa_f, sg_b, sg_s, sg_f, S, P, M, TILES, SPLITS, KS,
                  BLOCK_S, BLOCK_K, PRECISION)


@triton.jit
def gram_sq_norms_table_kernel(table_ptr, first, ref_ptr, out_stride, sa_b, sa_s, sa_f, sg_b, sg_s, sg_f,
                               S: tl.constexpr, P: tl.constexpr, M: tl.constexpr, TILES: tl.constexpr,
                               SPLITS: tl.constexpr, KS: tl.constexpr, BLOCK_S: tl.constexpr,
                               BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, ALIGNED: tl.constexpr):
    # Many contractions of one signature (shapes, strides, dtype) in one launch: program (pid, t) is program pid
    # of gram_sq_norms_kernel on contraction t, whose table row (first + t) holds the addresses of its two
    # operands and of its [B, parts] block of the output (rows out_stride apart; gram_sq_norms.TABLE_ENTRIES). ref_ptr
    # only gives the operands' element type. ALIGNED: every operand address is a multiple of 16 bytes, as Triton
    # assumes of an aligned pointer argument (an address read from memory carries no such fact, and loads
    # without it are not vectorised).
    pid = tl.program_id(0)
    row = table_ptr + 4 * (first + tl.program_id(1))
    a_ptr = tl.load(row).to(tl.pointer_type(ref_ptr.dtype.element_ty))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(ref_ptr.dtype.element_ty))
    out_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        a_ptr = tl.multiple_of(a_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
    per_sample = TILES * TILES * SPLITS
    out = out_ptr + (pid // per_sample).to(tl.int64) * out_stride + pid % per_sample
    _gram_program(a_ptr, g_ptr, out, pid, sa_b, sa_s, sa_f, sg_b, sg_s, sg_f, S, P, M, TILES, SPLITS, KS,
                  BLOCK_S, BLOCK_K, PRECISION)


@triton.jit
def _gram_program(a_ptr, g_ptr, out, pid, sa_b, sa_s, sa_f, sg_b, sg_s, sg_f,
                  S: tl.constexpr, P: tl.constexpr, M: tl.constexpr, TILES: tl.constexpr,
                  SPLITS: tl.constexpr, KS: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # One program per (sample, piece of G's features, tile pair), the tile pairs of one piece adjacent: they read
    # the same rows of the piece, from L2 (G [8192, 50257] of an LM head is 0.8 GB: read once, not once per
    # tile pair, where it can). <A A^T, G G^T> is linear in G G^T, the sum of its pieces' Grams over features
    # [s KS, (s + 1) KS): a program computes A's Gram tile whole and G's over its piece, and its partial sum is
    # exact to add. Where G is wide that gives the GPU programs enough to fill it (a sample's three tile pairs at
    # 256 tokens, 96 programs at batch 32, left SMs idle over a 50257-long loop). Its sum is stored at out.
    pair = pid % (TILES * TILES)
    s = pid // (TILES * TILES) % SPLITS
    b = pid // (TILES * TILES * SPLITS)
    i = pair // TILES
    j = pair % TILES
    if j < i:  # the Gram matrices are symmetric: tile (j, i) counts for this one
        tl.store(out, 0.0)
    else:
        offs_i = i * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_j = j * BLOCK_S + tl.arange(0, BLOCK_S)
        mask_i = offs_i < S
        mask_j = offs_j < S
        a_base = a_ptr + b.to(tl.int64) * sa_b
        g_base = g_ptr + b.to(tl.int64) * sg_b
        if i == j:
            total = _gram_pair_sum(a_base, sa_s, sa_f, g_base, sg_s, sg_f, offs_i, offs_j, mask_i, mask_j, s,
                                   P, M, SPLITS, KS, BLOCK_S, BLOCK_K, PRECISION, True)
        else:
            total = 2.0 * _gram_pair_sum(a_base, sa_s, sa_f, g_base, sg_s, sg_f, offs_i, offs_j, mask_i, mask_j,
                                         s, P, M, SPLITS, KS, BLOCK_S, BLOCK_K, PRECISION, False)
        tl.store(out, total)


@triton.jit
def zero_rows_kernel(x_ptr, keep_ptr, keep_stride, row_stride, P, s_p, Q, BLOCK: tl.constexpr):
    # One program per index j of the masked dim: kept rows return at once (a step drops no sample at all as
    # a rule, so the launch costs about its own latency); a dropped row's P runs of Q contiguous elements,
    # s_p apart, are overwritten with zeros.
    j = tl.program_id(0)
    if tl.load(keep_ptr + j * keep_stride) == 0:
        _zero_row(x_ptr + j.to(tl.int64) * row_stride, P, s_p, Q, tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty),
                  BLOCK)


@triton.jit
def _zero_row(base, P, s_p, Q, zeros, BLOCK: tl.constexpr):
    # P runs of Q elements of base's type, s_p apart, overwritten with zeros; while, not range(): Triton 3.6's
    # interpreter cannot take a scalar argument as a range bound
    p = 0
    while p < P:
        run = base + tl.cast(p, tl.int64) * s_p
        q0 = 0
        while q0 < Q:
            offs = q0 + tl.arange(0, BLOCK)
            tl.store(run + offs, zeros, mask=offs < Q)
            q0 += BLOCK
        p += 1


@triton.jit
def zero_rows_table_kernel(table_ptr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # Many tensors in one launch: program (i, t) takes rows i * ROWS .. of tensor t, whose table row holds its
    # address, its keep flags' address, rows n, the flags' stride, and its row runs in bytes (row stride, P runs
    # s_p apart, Q bytes each: zeros are zero bytes in every float dtype, so tensors of all dtypes share it). A
    # program loads its rows' flags at once and returns where all are kept (a step drops no sample as a rule).
    i = tl.program_id(0)
    row = table_ptr + 8 * tl.program_id(1)  # dpcompile.zero_rows.ENTRIES
    n = tl.load(row + 2)
    keep = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
    keep_stride = tl.load(row + 3)
    first = i.to(tl.int64) * ROWS
    js = first + tl.arange(0, ROWS)
    flags = tl.load(keep + js * keep_stride, mask=js < n, other=1)
    if tl.min(flags, axis=0) == 0:
        x = tl.load(row).to(tl.pointer_type(tl.uint8))
        row_stride = tl.load(row + 4)
        P = tl.load(row + 5)
        s_p = tl.load(row + 6)
        Q = tl.load(row + 7)
        zeros = tl.zeros([BLOCK], dtype=tl.uint8)
        r = 0
        while r < ROWS:
            j = first + r
            if j < n:
                if tl.load(keep + j * keep_stride) == 0:
                    _zero_row(x + j * row_stride, P, s_p, Q, zeros, BLOCK)
            r += 1


# 2^-32: a 32-bit word's weight
_W = tl.constexpr(2.3283064365386963e-10)


@triton.jit
def radius_uniform(w, e):
    # The uniform of a Box-Muller radius, sqrt(-2 ln u), from its word w and a refinement word e: (w + 1/2) 2^-32,
    # and for w < 256 (where that grid is coarse against u) (w + (e + 1/2) 2^-32) 2^-32, a grid of 2^-64 there.
    # u is never 0, so nothing is clamped: the smallest u, 2^-65, gives a radius of 9.49. Triton's tl.randn and
    # randn4x clamp u at 1e-7, so every normal they make has |z| <= 5.68 and a radius of exactly 5.68 with
    # probability 1e-7: a noise bounded at 5.68 sigma, where neighbouring data sets' outputs can be told apart
    # with probability about Phi(5.68) - Phi(5.68 - 1/noise_multiplier) per step (1.4e-6 at noise multiplier 1,
    # 1.2e-4 at 0.5), which the Gaussian mechanism's accounting does not count.
    coarse = (w.to(tl.float32) + 0.5) * _W
    fine = (w.to(tl.float32) + (e.to(tl.float32) + 0.5) * _W) * _W
    return tl.where(w < 256, fine, coarse)


@triton.jit
def box_muller(u, w_angle):
    # two independent normals from the radius's uniform u in (0, 1) and the angle's word
    r = tl.sqrt(-2.0 * tl.log(u))
    th = w_angle.to(tl.float32) * (6.283185307179586 * _W)
    return r * tl.cos(th), r * tl.sin(th)


@triton.jit
def _mufu(x, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def box_muller_approx(u, w_angle):
    # box_muller through the GPU's special-function unit (lg2.approx, sin.approx, cos.approx: a few instructions
    # each where libdevice's logf, sinf and cosf take tens), for benchmarks/noise_kernel.py to time against it.
    # Not used by dpcompile's draws: its values differ from the exact transform's by about 1e-6 (the .approx
    # instructions' errors), and its tails are not checked.
    # cos and sin of th - pi in [-pi, pi) (where sin.approx and cos.approx are accurate), negated: th's values.
    r = tl.sqrt(-1.3862943611198906 * _mufu(u, "lg2.approx.f32 $0, $1;"))  # -2 ln u = -2 ln 2 lg2 u
    th = w_angle.to(tl.float32) * (6.283185307179586 * _W) - 3.141592653589793
    return -r * _mufu(th, "cos.approx.f32 $0, $1;"), -r * _mufu(th, "sin.approx.f32 $0, $1;")


@triton.jit
def normals4(seed, counter, APPROX: tl.constexpr):
    # Four standard normals from one Philox call (two Box-Muller pairs), like tl.randn4x but with the radii's
    # uniforms resolved to 2^-64 near 0 (radius_uniform). The refinement words come from a second Philox call at
    # counter + 2^32 (Philox's second counter word 1: never a counter of a draw, whose counters stay below 2^32),
    # made only by a program where some radius word is below 256: about one program in 8000.
    w1, w2, w3, w4 = tl.randint4x(seed, counter)
    e1 = w1 * 0
    e3 = w3 * 0
    if tl.min(tl.minimum(w1, w3), axis=0) < 256:
        e1, _, e3, _ = tl.randint4x(seed, counter.to(tl.int64) + 4294967296)
    if APPROX:  # benchmarks only (box_muller_approx)
        n1, n2 = box_muller_approx(radius_uniform(w1, e1), w2)
        n3, n4 = box_muller_approx(radius_uniform(w3, e3), w4)
    else:
        n1, n2 = box_muller(radius_uniform(w1, e1), w2)
        n3, n4 = box_muller(radius_uniform(w3, e3), w4)
    return n1, n2, n3, n4


@triton.jit
def randn_kernel(out_ptr, seeds_ptr, index, n, BLOCK: tl.constexpr):
    # One Philox call per counter gives four 32-bit words, and normals4 turns them into four normals (both
    # outputs of two Box-Muller pairs); tl.randn, which Inductor's inductor_random runs per element, keeps one
    # of the four. Program p uses counters [p * BLOCK, (p + 1) * BLOCK) and writes outputs
    # [4 p BLOCK, 4 (p + 1) BLOCK): every output comes from its own (counter, word), never shared.
    p = tl.program_id(0)
    seed = tl.load(seeds_ptr + index)
    lane = tl.arange(0, BLOCK)
    r0, r1, r2, r3 = normals4(seed, p * BLOCK + lane, False)
    base = p.to(tl.int64) * (4 * BLOCK) + lane
    tl.store(out_ptr + base, r0, mask=base < n)
    tl.store(out_ptr + base + BLOCK, r1, mask=base + BLOCK < n)
    tl.store(out_ptr + base + 2 * BLOCK, r2, mask=base + 2 * BLOCK < n)
    tl.store(out_ptr + base + 3 * BLOCK, r3, mask=base + 3 * BLOCK < n)


@triton.jit
def _add_scaled(src, out, base, n, scale, z):
    # out[base] = src[base] + scale * z (in fp32, stored in out's dtype) where base < n
    m = base < n
    tl.store(out + base, (tl.load(src + base, mask=m).to(tl.float32) + scale * z).to(out.dtype.element_ty), mask=m)


@triton.jit
def _add_randn_program(src, out, n, local, program, seed, scale, BLOCK: tl.constexpr, APPROX: tl.constexpr):
    # outputs [4 local BLOCK, 4 (local + 1) BLOCK) of one tensor, from the counters randn_kernel's program
    # `program` uses: the same values as its flat draw at that program's outputs
    lane = tl.arange(0, BLOCK)
    r0, r1, r2, r3 = normals4(seed, program * BLOCK + lane, APPROX)
    base = local.to(tl.int64) * (4 * BLOCK) + lane
    _add_scaled(src, out, base, n, scale, r0)
    _add_scaled(src, out, base + BLOCK, n, scale, r1)
    _add_scaled(src, out, base + 2 * BLOCK, n, scale, r2)
    _add_scaled(src, out, base + 3 * BLOCK, n, scale, r3)


@triton.jit
def add_randn_kernel(table_ptr, tensors, src_ref, out_ref, seeds_ptr, index, scale_ptr, BLOCK: tl.constexpr,
                     APPROX: tl.constexpr = False):
    # One program per 4 BLOCK outputs of one tensor, all tensors of one source and one output dtype (src_ref's
    # and out_ref's) in one launch. The table (dpcompile.add_randn.launch) holds per tensor its source and output
    # addresses, numel, first program in this launch and first program in the flat draw; a program finds its
    # tensor by a binary search over the first programs (a few loads, from L2: no per-program table to build
    # and copy on the host).
    p = tl.program_id(0)
    lo = 0
    hi = tensors
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(table_ptr + 5 * mid + 3) <= p:
            lo = mid
        else:
            hi = mid
    row = table_ptr + 5 * lo
    src = tl.load(row).to(tl.pointer_type(src_ref.dtype.element_ty))
    out = tl.load(row + 1).to(tl.pointer_type(out_ref.dtype.element_ty))
    local = p - tl.load(row + 3)
    _add_randn_program(src, out, tl.load(row + 2), local, tl.load(row + 4) + local, tl.load(seeds_ptr + index),
                       tl.load(scale_ptr), BLOCK, APPROX)


@triton.jit(do_not_specialize=["n", "start"])
def add_randn_one_kernel(src, out, n, start, seeds_ptr, index, scale_ptr, BLOCK: tl.constexpr):
    # One tensor, its addresses as arguments (add_randn.launch's per_tensor): program p is the draw's program start + p.
    # n and start unspecialised: one compiled kernel per pair of dtypes, not one per tensor size.
    p = tl.program_id(0)
    _add_randn_program(src, out, n, p, start + p, tl.load(seeds_ptr + index), tl.load(scale_ptr), BLOCK, False)
