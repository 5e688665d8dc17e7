"""torch's op database through DP steps, one model per op sample, against the float64 per-sample oracle.

Each sample torch tests an op on (``op_db``'s sample inputs) becomes a model with one trainable parameter
``w`` shaped as the sample's input, applied to a batch: ``op(x * w, *args, **kwargs)`` with x ``[B, *shape]``,
the loss ``sin(out).sum() / B`` (a mean of per-sample losses). The rule table meets every op torch has, with the
argument forms torch itself tests (dims, keywords, broadcast operands), without a model written for it.

Outcomes, one line per op sample and run:
  PASS     the DP step's gradient is the oracle's (vmap(grad) per sample, clipped with C at the median norm)
  REFUSED  DPCompileError: dp_fsdp cannot prove the step per sample (an op that mixes samples, say)
  TORCH    stock torch.compile of the same step (aot_eager, the same batch marking) fails as well
  NA       nothing to check: the model fails in eager, or the oracle cannot run it
  FAIL     anything else: a wrong gradient, a crash, a step that ran although its samples mix
A model whose output row i is the model on sample i alone is checked against vmap(grad) of the model on one
sample. Any other (the op reduces, sorts or broadcasts along the batch dim) is checked by what its samples do to
each other: with w copied once per sample (``x * W``, W [B, *shape]), the loss's gradient through each sample's
copy is that sample's gradient wherever it moves with that sample's input alone, and the step is checked
against those; where another sample's input moves it, the samples mix and the step must be REFUSED.
Under --shard the model is sharded with dpcompile.fully_shard (a scalar ``w`` is stored with shape [1] and read
as a scalar: fully_shard refuses 0-dim parameters) and run on N gloo ranks, the batch split unevenly, then with
the last rank given nothing, through one graph.

Run by hand (CI runs a slice: tests/test_op_sweep.py):

    python tests/op_sweep.py                               # every op, bk and ghost, one process
    python tests/op_sweep.py --ops cumsum,nn.functional.linear --compiler inductor --unbacked
    python tests/op_sweep.py --shard 2
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_map

import dpcompile
from reference import clip_and_sum, per_sample_gradients

B = 5
# ops whose values are random draws (a sample's gradient would depend on the draw order) or whose inputs are
# not dense tensors
_LEFT_OUT = ("rand", "dropout", "bernoulli", "multinomial", "normal", "uniform", "poisson", "exponential", "cauchy",
             "geometric", "log_normal", "rrelu", "empty", "sparse", "signal.windows")


@dataclass
class OpSample:
    name: str  # op_db name, with its variant
    index: int  # which of the op's samples
    op: object
    input_shape: tuple
    args: tuple
    kwargs: dict

    @property
    def id(self) -> str:
        return f"{self.name}#{self.index}"


def _eligible(device: str) -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    return [(info.name + (f".{info.variant_test_name}" if info.variant_test_name else ""), info) for info in op_db
            if info.supports_autograd and torch.float64 in info.supported_dtypes(device)
            and not any(w in info.name for w in _LEFT_OUT)]


def op_names(device: str = "cpu") -> list[str]:
    """The differentiable ops with float64 support, sorted (without building their samples)."""
    return sorted({name for name, _ in _eligible(device)})


def op_samples(device: str = "cpu", names=None, per_op: int = 2) -> list[OpSample]:
    """The first ``per_op`` float64 samples with a non-empty tensor input of each op (of ``names``)."""
    out = []
    for name, info in _eligible(device):
        if names is not None and name not in names:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                found = [s for s in info.sample_inputs(device, torch.float64, requires_grad=False)
                         if isinstance(s.input, torch.Tensor) and s.input.numel() > 0 and s.input.is_floating_point()]
        except Exception:  # noqa: BLE001 - an op whose samples cannot be made here has nothing to sweep
            continue
        out += [OpSample(name, i, info.op, tuple(s.input.shape), tuple(s.args), dict(s.kwargs))
                for i, s in enumerate(found[:per_op])]
    return out


def hand_samples() -> list[OpSample]:
    """Forms op_db's samples do not reach, each checked in CI on one process and sharded (tests/test_op_sweep.py):
    ops whose rule the sweep asked for, along a dim that is not the batch's, and the diagonal across it."""
    def make(name, op, shape, *args, **kwargs):
        return OpSample(name, 0, op, shape, args, kwargs)

    return [make("diagonal_dims_1_2", torch.diagonal, (3, 4, 4), 1, 1, 2),  # [B, 3, 4, 4]: dims 2 and 3
            make("diagonal_across_samples", torch.diagonal, (4,), 0, 0, 1),  # [B, 4]: the samples' diagonal
            make("kthvalue_last", torch.kthvalue, (3, 5), 2),
            make("mode_middle", torch.mode, (4, 3), 1),
            make("cummax_last", torch.cummax, (3, 4), -1),
            make("cummin_middle", torch.cummin, (4, 3), 1),
            make("median_nanmedian", lambda t: torch.median(t, -1).values + torch.nanmedian(t, 1).values, (3, 3)),
            make("conj_of_hfft", lambda t: torch.fft.hfft(torch.fft.rfft(t)), (3, 6))] + _linalg_samples(make)


def _shifted(t, by: float = 3.0):
    """t plus by * identity on its last two dims: a per-sample matrix well away from singular."""
    return t + by * torch.eye(t.shape[-1], dtype=t.dtype, device=t.device)


def _linalg_samples(make) -> list[OpSample]:
    """torch.linalg on per-sample matrices kept well-conditioned (op_db's random ones are near singular at times,
    where a gradient of sin(out) is noise), and the forms that must be refused: a matrix or a distance taken
    across the samples (``ACROSS_SAMPLES``)."""
    g = torch.Generator().manual_seed(0)
    rhs, centres = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    reflectors, tau = torch.geqrf(torch.randn(4, 3, generator=g, dtype=torch.float64))

    def householder(t):  # Q of fixed reflectors applied to a per-sample matrix, and Q of per-sample tau
        refl = reflectors.to(t.device).expand(t.shape[0], 4, 3)
        return torch.ormqr(refl, tau.to(t.device).expand(t.shape[0], 3), t) + \
            torch.linalg.householder_product(refl, t[:, 0])

    return [make("inv", lambda t: torch.linalg.inv(_shifted(t)), (3, 3)),
            make("solve_shared_rhs", lambda t: torch.linalg.solve(_shifted(t), rhs.to(t.device)), (3, 3)),
            make("solve_per_sample_rhs", lambda t: torch.linalg.solve(_shifted(t[..., :3]), t[..., 3:]), (3, 5)),
            make("det_slogdet", lambda t: torch.linalg.det(_shifted(t)) + torch.linalg.slogdet(_shifted(t))[1], (3, 3)),
            make("eigvalsh_svdvals", lambda t: torch.linalg.eigvalsh(t + t.mT) + torch.linalg.svdvals(t), (2, 3, 3)),
            make("qr_cholesky", lambda t: torch.linalg.qr(t).Q + torch.linalg.cholesky(_shifted(t @ t.mT, 1.0)),
                 (3, 3)),
            make("matrix_exp_lu_solve", lambda t: torch.linalg.lu_solve(*torch.linalg.lu_factor(_shifted(t)),
                                                                        torch.linalg.matrix_exp(0.3 * t)), (3, 3)),
            make("ormqr_householder_product", householder, (4, 3)),
            make("cdist_to_centres", lambda t: torch.cdist(t, centres.to(t.device), p=1.0), (3,)),
            make("cdist_within_samples", lambda t: torch.cdist(t, t.flip(-2)), (4, 3)),
            make("cdist_across_samples", lambda t: torch.cdist(t, t), (3,)),
            make("svdvals_across_samples", lambda t: torch.linalg.svdvals(t), (4,))]


ACROSS_SAMPLES = ("diagonal_across_samples", "cdist_across_samples", "svdvals_across_samples")


class OpModel(torch.nn.Module):
    def __init__(self, sample: OpSample, scalar_as_vector: bool = False):
        super().__init__()
        shape = sample.input_shape
        self.as_scalar = scalar_as_vector and shape == ()
        self.w = torch.nn.Parameter(torch.randn((1,) if self.as_scalar else shape, dtype=torch.float64) * 0.5 + 1.0)
        self.op, self.args, self.kwargs = sample.op, sample.args, sample.kwargs

    def forward(self, x):
        w = self.w.view(()) if self.as_scalar else self.w
        return self.op(x * w, *self.args, **self.kwargs)


def first_float(out):
    """The op's first floating-point output (ops such as max(dim) return indices too), or None."""
    if isinstance(out, (tuple, list)):
        out = next((t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return out if isinstance(out, torch.Tensor) and out.is_floating_point() else None


def batch_loss(out, n):
    return first_float(out).sin().sum() / n


def per_sample_loss(out):
    return first_float(out).sin().sum().reshape(1)


def build(sample: OpSample, scalar_as_vector: bool = False, device: str = "cpu"):
    torch.manual_seed(sample.index)
    model = OpModel(sample, scalar_as_vector).to(device)
    return model, torch.randn(B, *sample.input_shape, dtype=torch.float64).to(device)


def is_per_sample(model, x) -> bool:
    """Row i of the model's output on the batch is the model on sample i alone, for every i: the oracle's
    per-sample losses are then the batch loss's terms. False where the op reduces, sorts, or broadcasts along the
    batch dim, or fails."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = first_float(model(x))
            if out is None or out.dim() == 0 or out.shape[0] != x.shape[0]:
                return False
            return all(torch.allclose(out[i:i + 1], first_float(model(x[i:i + 1])), rtol=1e-9, atol=1e-12,
                                      equal_nan=True) for i in range(x.shape[0]))
    except Exception:  # noqa: BLE001 - an op that fails in eager has nothing to check
        return False


def _grads_through_each_sample(model, x) -> torch.Tensor:
    """[n, *w.shape]: the batch loss's gradient through each sample's own use of w (w copied once per sample:
    ``x * W``, W [n, *shape]), times n (the loss is a mean): sample i's gradient wherever the loss is a sum of
    terms of one sample each, whatever the op does with the batch dim."""
    n = x.shape[0]
    w = model.w.detach().view(()) if model.as_scalar else model.w.detach()
    W = w.expand(n, *w.shape).clone().requires_grad_(True)
    (g,) = torch.autograd.grad(batch_loss(model.op(x * W, *model.args, **model.kwargs), n), [W], allow_unused=True)
    g = torch.zeros_like(W) if g is None else g
    return (g * n).reshape(n, *model.w.shape)


def samples_mix(model, x) -> bool | None:
    """Whether a sample's gradient (``_grads_through_each_sample``) moves when another sample's input does: the
    op mixes samples, and a DP step must refuse it. None where the model fails in eager."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = _grads_through_each_sample(model, x)
            for j in range(x.shape[0]):
                moved = x.clone()
                moved[j] = moved[j] + 0.5 * torch.randn_like(moved[j])
                h = _grads_through_each_sample(model, moved)
                others = [i for i in range(x.shape[0]) if i != j]
                if not torch.allclose(g[others], h[others], rtol=1e-7, atol=1e-10, equal_nan=True):
                    return True
            return False
    except Exception:  # noqa: BLE001 - an op that fails in eager has nothing to check
        return None


# dpcompile sums per-sample squared norms in float32, for float64 models too: a sample whose squared norm is beyond
# float32's range counts as overflowed and is dropped (README, "A bad sample costs that sample, not the run")
_F32_NORM_LIMIT = torch.finfo(torch.float32).max ** 0.5


class Reference(NamedTuple):
    """A clipped gradient the step must give, and the size of its terms: dpcompile computes the clip coefficients
    in float32, so where the clipped terms cancel (a sum near zero of terms far from it) the step is off by float32's
    rounding of the terms, not of the sum."""
    grad: torch.Tensor  # sum_i c_i g_i / B
    terms: torch.Tensor  # sum_i c_i |g_i| / B


def _clipped(g: torch.Tensor, C: float | None = None):
    """(Reference of the clipped sum / B in float64, C) of per-sample gradients g [n, ...], those past float32's
    norm range dropped. C: by default the median of their finite norms, so that some samples are clipped and some
    are not; 1.0 where there is none or it is 0."""
    norms = g.reshape(g.shape[0], -1).norm(dim=1)
    g = torch.where((norms < _F32_NORM_LIMIT).view(-1, *[1] * (g.dim() - 1)), g, float("nan"))
    if C is None:
        finite = norms[norms < _F32_NORM_LIMIT]
        C = float(finite.median()) if finite.numel() else 1.0
        C = C if C > 0 else 1.0
    grad, terms = (clip_and_sum({"w": t}, max_grad_norm=C, expected_batch_size=B)[0]["w"] for t in (g, g.abs()))
    return Reference(grad, terms), C


def oracle(model, x, C: float | None = None):
    """(Reference of w's clipped gradient, C) from vmap(grad) of the model on one sample (``_clipped``), cross-checked
    against each sample's gradient through its own copy of w: where they differ, torch's vmap is wrong (its
    batching of linalg.solve_ex with a shared vector right-hand side reads the vmap batch as the vector's, torch
    2.13) and the own copies' gradients are the oracle."""
    g = per_sample_gradients(model, per_sample_loss, (x,), ())["w"]
    own = _grads_through_each_sample(model, x).double()
    scale = own.reshape(own.shape[0], -1).norm(dim=1).clamp(min=1e-12).view(-1, *[1] * (own.dim() - 1))
    if not torch.allclose(g / scale, own / scale, rtol=0, atol=1e-8, equal_nan=True):
        g = own
    return _clipped(g, C)


def expected(model, x):
    """What a DP step of the model on batch x must give: (kind, Reference or None, C), kind "per sample"
    (row i of the output is the model on sample i alone: the vmap oracle), "own terms" (not so written, as an
    operand broadcast along the batch dim, but each sample's gradient through its own copy of w moves with its
    input alone: those) or "mixes" (the step must be refused); or the reason there is nothing to check."""
    try:
        if is_per_sample(model, x):
            return ("per sample", *oracle(model, x))
        mixes = samples_mix(model, x)
        if mixes is None:
            return "fails in eager"
        return ("mixes", None, 1.0) if mixes else ("own terms", *_clipped(_grads_through_each_sample(model, x)))
    except Exception as exc:  # noqa: BLE001 - vmap and the per-sample loop both fail: nothing to compare with
        return f"the oracle cannot run it: {type(exc).__name__}"


def _tolerance(model, x) -> float:
    """1e-6 relative for a float64 output, 1e-2 for an op that computes in half precision inside (the oracle runs
    the same casts, in another order)."""
    with torch.no_grad():
        out = first_float(model(x))
    return 1e-6 if out.dtype == torch.float64 else 1e-2


def _error(got, ref: Reference) -> float:
    """The step's largest error relative to the largest clipped term (Reference)."""
    return float((got.double() - ref.grad).abs().max() / (ref.terms.abs().max() + 1e-12))


def _unwrap(exc: Exception) -> Exception:
    return exc.__cause__ if type(exc).__name__ == "BackendCompilerFailed" and exc.__cause__ is not None else exc


def _stock_fails(model, xs, unbacked: bool) -> bool:
    """Whether stock torch.compile (aot_eager) fails on the same step: torch's limit, not dpcompile's."""
    torch._dynamo.reset()

    def step(xx):
        batch_loss(model(xx), xx.shape[0]).backward()

    try:
        for xx in xs:
            xx = xx.clone()
            if unbacked:
                dpcompile.mark_batch(xx)
            torch.compile(step, backend="aot_eager", fullgraph=True)(xx)
        return False
    except Exception:  # noqa: BLE001
        return True
    finally:
        model.zero_grad(set_to_none=True)


def _outcome(exc: Exception, stock_fails) -> tuple[str, str]:
    exc = _unwrap(exc)
    line = (str(exc).splitlines() or [""])[0][:200]
    if isinstance(exc, dpcompile.DPCompileError):
        return "REFUSED", line
    return ("TORCH" if stock_fails() else "FAIL"), f"{type(exc).__name__}: {line}"


class DeviceLost(Exception):
    """A device-side assert (an index out of range in a CUDA kernel): the process's CUDA context is lost for every
    later sample. args: (the sample's outcome, detail); main() resumes the sweep in a new process."""


def _synchronized(device: str, outcome: str, why: str) -> None:
    """Wait for the device; where a kernel asserted, raise DeviceLost(outcome, why) (asserts are reported late,
    at the next synchronization: this one keeps them with the sample that made them)."""
    if device == "cpu":
        return
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - torch.AcceleratorError (torch 2.11+) or RuntimeError
        raise DeviceLost(outcome, f"{why}: {(str(exc).splitlines() or [''])[0][:150]}") from exc


def _fails_on_cpu(sample: OpSample) -> bool:
    """Whether the sample's model fails in eager on the CPU. A sample for another device runs there first: on CUDA
    the failing op may be a device-side assert (masked_scatter's size check), after which the process's CUDA
    context is lost for every later sample."""
    def to_cpu(t):
        return t.cpu() if isinstance(t, torch.Tensor) else t

    model, x = build(replace(sample, args=tree_map(to_cpu, sample.args),
                           kwargs=tree_map(to_cpu, sample.kwargs)))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(x)
        return False
    except Exception:  # noqa: BLE001 - whatever fails here is not run on the device
        return True


def check(sample: OpSample, *, schedule: str, compiler: str = "eager", unbacked: bool = False,
          device: str = "cpu") -> tuple[str, str]:
    """One op sample through one DP step on this process: (outcome, detail). unbacked: the batch marked with
    dpcompile.mark_batch, and a second batch of 3 samples through the same graph. device: where the sample, the
    model and the step are (op_samples(device) made the sample there); the oracle runs there too, in float64."""
    if device != "cpu" and _fails_on_cpu(sample):
        return "NA", f"fails in eager (on the CPU; not run on {device})"
    model, x = build(sample, device=device)
    want = expected(model, x)
    _synchronized(device, "NA", "a device-side assert in eager")
    if isinstance(want, str):
        return "NA", want
    kind, ref, C = want
    mixes = kind == "mixes"
    batches = [(x, ref)] + ([(x[:3], None)] if unbacked and kind == "per sample" else [])
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B, schedule=schedule,
                                  compiler=compiler)

    # the forward and loss compiled, loss.backward() called on the compiled loss: the DP graph a whole step's
    # break at loss.backward() gives, without dynamo's second trace of the forward (helpers.compile_step; CI time);
    # the sharded sweep below runs the user's whole step
    loss_of = torch.compile(lambda xx: batch_loss(model(xx), xx.shape[0]), backend=backend)

    def compiled(xx):
        loss_of(xx).backward()

    torch._dynamo.reset()
    worst = 0.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for xx, want in batches:
                if want is None:  # the same C and expected batch size: a smaller batch of the same step
                    want = oracle(model, xx, C)[0]
                model.zero_grad(set_to_none=True)
                xx = xx.clone()
                if unbacked:
                    dpcompile.mark_batch(xx)
                compiled(xx)
                _synchronized(device, "FAIL", "a device-side assert in the DP step (none in eager)")
                if mixes:
                    return "FAIL", "a step whose samples mix ran: it must be refused"
                if model.w.grad is None:
                    return "FAIL", f"no gradient for w (batch of {xx.shape[0]})"
                worst = max(worst, _error(model.w.grad, want))
    except DeviceLost:
        raise
    except Exception as exc:  # noqa: BLE001 - classified: refused, torch's own failure, or ours
        _synchronized(device, "FAIL", f"a device-side assert in the DP step (none in eager): {exc}"[:300])
        outcome, detail = _outcome(exc, lambda: _stock_fails(model, [b for b, _ in batches], unbacked))
        return outcome, ("samples mix; " if mixes else "") + detail
    ok = worst <= _tolerance(model, x)
    return ("PASS" if ok else "FAIL"), f"relative error {worst:.2e}"


def sharded_checks(samples: list[OpSample], mesh, rank: int, world: int, compiler: str = "eager",
                   verbose: bool = False) -> dict:
    """Each sample through a private_step over ``fully_shard(model, mesh=mesh)`` on this rank (every rank calls
    this with the same samples): {sample id: (outcome, detail)}. The batch is split unevenly (rank 0 one sample
    more than an even share), then given whole to the ranks but the last, through one graph; each rank's
    gathered gradient against the oracle of the whole batch. Schedules alternate over the samples. verbose: rank 0
    prints each sample's outcome on this rank as it comes."""
    import torch.distributed as dist

    cuts = [min(B, B // world + 1) if r == 0 else B // world for r in range(world - 1)]
    cuts.append(B - sum(cuts))
    empty_last = [B // (world - 1)] * (world - 1) + [0]
    empty_last[-2] += B - sum(empty_last)
    results = {}
    for k, sample in enumerate(samples):
        schedule = ("bk", "ghost")[k % 2]
        model, x = build(sample, scalar_as_vector=True)
        want = expected(model, x)  # the same on every rank
        if isinstance(want, str):
            results[sample.id] = ("NA", want)
            continue
        kind, ref, C = want
        mixes = kind == "mixes"
        tol = _tolerance(model, x)
        plain = copy.deepcopy(model)  # for stock torch.compile, should the step fail
        dpcompile.fully_shard(model, mesh=mesh)

        def step(xx):
            batch_loss(model(xx), xx.shape[0]).backward()

        torch._dynamo.reset()
        private = dpcompile.private_step(step, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B,
                                         schedule=schedule, compiler=compiler)
        worst = 0.0
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for split in (cuts, empty_last):
                    lo = sum(split[:rank])
                    model.zero_grad(set_to_none=True)
                    private(x[lo:lo + split[rank]].clone())
                    if mixes:
                        raise AssertionError("a step whose samples mix ran: it must be refused")
                    (grad,) = [p.grad for p in model.parameters()]  # fully_shard's w, read through named params
                    if grad is None:
                        raise AssertionError(f"no gradient for w (per-rank batches {split})")
                    worst = max(worst, _error(grad.full_tensor().view(ref.grad.shape), ref))
            ok = worst <= tol
            results[sample.id] = ("PASS" if ok else "FAIL", f"{schedule}: relative error {worst:.2e}")
        except Exception as exc:  # noqa: BLE001 - classified as in check; torch's own failure by stock
            # torch.compile of the unsharded model with an unbacked batch (stock FSDP2 cannot be traced)
            outcome, why = _outcome(exc, lambda: _stock_fails(plain, [x], unbacked=True))
            results[sample.id] = (outcome, f"{schedule}: {'samples mix; ' if mixes else ''}{why}")
        if rank == 0 and verbose:
            print(f"rank 0: {results[sample.id][0]:8s} {sample.id:45s} {results[sample.id][1]}", flush=True)
        dist.barrier()  # the ranks agree on every sample's collectives before the next
    return results


def _sharded_rank(rank, world, tmp, names, compiler):
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results = sharded_checks(op_samples(names=names), init_device_mesh("cpu", (world,)), rank, world, compiler,
                             verbose=True)
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def main() -> int:
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", help="comma-separated op_db names (with .variant), default every op")
    parser.add_argument("--compiler", default="eager", choices=("eager", "inductor"))
    parser.add_argument("--schedules", default="bk,ghost", help='comma-separated, or "alternate"')
    parser.add_argument("--unbacked", action="store_true", help="mark the batch unbacked; a second batch of 3")
    parser.add_argument("--shard", type=int, default=0, help="N gloo ranks, dpcompile.fully_shard")
    parser.add_argument("--device", default="cpu", help="one process: where the step runs (cuda: Triton)")
    parser.add_argument("--part", help="k/n: the k-th of n slices of the ops (parallel processes)")
    parser.add_argument("--resume-after", help=argparse.SUPPRESS)  # sample id:schedule, after a lost device
    args = parser.parse_args()
    names = set(args.ops.split(",")) if args.ops else None
    counts: dict[str, int] = {}
    if args.shard:
        with tempfile.TemporaryDirectory() as tmp:
            torch.multiprocessing.spawn(_sharded_rank, args=(args.shard, tmp, names, args.compiler), nprocs=args.shard)
            per_rank = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.shard)]
        for sid in per_rank[0]:
            order = ["FAIL", "TORCH", "REFUSED", "NA", "PASS"]
            worst = min((r[sid] for r in per_rank), key=lambda o: order.index(o[0]))
            counts[worst[0]] = counts.get(worst[0], 0) + 1
            print(f"{worst[0]:8s} {sid:45s} {worst[1]}", flush=True)
    else:
        samples = op_samples(args.device, names=names)
        if args.part:
            k, n = (int(v) for v in args.part.split("/"))
            mine = set(sorted({s.name for s in samples})[k - 1::n])
            samples = [s for s in samples if s.name in mine]
        skipping = args.resume_after is not None
        for sample in samples:
            # "alternate": bk for a sample's first form, ghost for its second (half the compiles)
            alternate = args.schedules == "alternate"
            schedules = [("bk", "ghost")[sample.index % 2]] if alternate else args.schedules.split(",")
            for schedule in schedules:
                if skipping:
                    skipping = f"{sample.id}:{schedule}" != args.resume_after
                    continue
                try:
                    outcome, detail = check(sample, schedule=schedule, compiler=args.compiler,
                                            unbacked=args.unbacked, device=args.device)
                except DeviceLost as lost:
                    (outcome, detail), resume = lost.args, f"{sample.id}:{schedule}"
                    print(f"{outcome:8s} {sample.id:45s} {schedule:5s} {detail}; the sweep goes on in a new process "
                          f"(its counts are the lines', the summary below is the new process's)", flush=True)
                    argv = [a for a in sys.argv[1:] if not a.startswith("--resume-after")]
                    os.execv(sys.executable, [sys.executable, sys.argv[0], *argv, f"--resume-after={resume}"])
                counts[outcome] = counts.get(outcome, 0) + 1
                print(f"{outcome:8s} {sample.id:45s} {schedule:5s} {detail}", flush=True)
    print(" ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return 1 if counts.get("FAIL") else 0


if __name__ == "__main__":
    sys.exit(main())
