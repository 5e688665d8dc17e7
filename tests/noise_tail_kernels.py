"""Triton kernels that run dpcompile's normal transform and Triton's Philox on given counters and words, for
tests/noise_kernel_check.py's tail cases (a module of their own: a jitted function resolves names in its module's
globals, and the check imports triton only where it runs them)."""
import triton
import triton.language as tl

from dpcompile import triton_kernels as K


@triton.jit
def normals_at(seed_ptr, counters_ptr, out_ptr, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    n1, n2, n3, n4 = K.normals4(tl.load(seed_ptr), tl.load(counters_ptr + lane), False)
    tl.store(out_ptr + lane, n1)
    tl.store(out_ptr + BLOCK + lane, n2)
    tl.store(out_ptr + 2 * BLOCK + lane, n3)
    tl.store(out_ptr + 3 * BLOCK + lane, n4)

@triton.jit
def words_at(seed_ptr, counters_ptr, out_ptr, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    w1, w2, w3, w4 = tl.randint4x(tl.load(seed_ptr), tl.load(counters_ptr + lane))
    tl.store(out_ptr + lane, w1.to(tl.int64))
    tl.store(out_ptr + BLOCK + lane, w2.to(tl.int64))
    tl.store(out_ptr + 2 * BLOCK + lane, w3.to(tl.int64))
    tl.store(out_ptr + 3 * BLOCK + lane, w4.to(tl.int64))

@triton.jit
def radius_at(w_ptr, e_ptr, out_ptr, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    u = K.radius_uniform(tl.load(w_ptr + lane).to(tl.uint32), tl.load(e_ptr + lane).to(tl.uint32))
    tl.store(out_ptr + lane, tl.sqrt(-2.0 * tl.log(u)))
