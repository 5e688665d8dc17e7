"""Vision step time and peak memory on one GPU: non-private vs dpcompile (bk, ghost) vs Opacus ghost clipping.

    python benchmarks/vision.py                                # WRN-16-4 and ViT-S/16, fp32 and bf16, every mode
    python benchmarks/vision.py --models vit --dtypes bf16 --modes nonprivate,ghost --out vit.json
    python benchmarks/vision.py --models wrn16-4 --cudagraphs  # CUDA graphs on both sides (launch-bound steps)
    python benchmarks/vision.py --models wrn16-4 --conv-norm direct --kernel-profile kp   # a forced norm form; kernels
    python benchmarks/vision.py --models vit-s16 --gram-kernel off   # ghost-form norms as Gram matmuls (A/B)
    python benchmarks/vision.py --models wrn16-4 --input-gram off    # auto without the input_gram form (A/B)
    python benchmarks/vision.py --tiny                         # CPU smoke run: narrow models, few steps, eager
    python benchmarks/vision.py --tiny --compiler inductor     # ... with Inductor's code generation (slow on CPU)

Shapes (benchmarks/vision_models.py, GroupNorm instead of BatchNorm as in DP training):

    wrn16-4   WideResNet(16, 4) on CIFAR-10-shaped input: 3x32x32, 10 classes, batch 256
    vit-s16   ViT-small/16 (dim 384, depth 12, 6 heads) on 3x224x224, 1000 classes, batch 64

Modes, one after another in this process, each on a fresh model from seed 0 (fresh dynamo, allocator
emptied and its peak reset between modes):

    nonprivate   stock torch.compile of the step (Inductor)
    bk, ghost    dpcompile.private_step(schedule=...) of the same step
    opacus       Opacus 1.6 PrivacyEngine, grad_sample_mode="ghost" (ghost clipping), eager; skipped with a
                 note when opacus is not importable. Opacus refuses nn.MultiheadAttention, so its ViT runs
                 Opacus' own drop-in replacement (ModuleValidator.fix: DPMultiheadAttention, the same
                 parameters as separate q/k/v projections, attention by plain matmuls), as its docs say.
                 Its batch_first=True path reshapes the heads' output without transposing it (fixed upstream
                 after 1.6, meta-pytorch/opacus PR 825): the same work, but not the same function, so the
                 ViT's opacus step-1 loss differs from the other modes'.

One step = forward and per-sample cross-entropy (mean over the batch), backward (with the mode's clipping,
C = 1, and noise, multiplier 1), SGD step, zero_grad. fp32 runs with TF32 matmuls and convolutions; bf16 is
autocast around forward and loss with fp32 parameters. Reported: median step time over --iters steps after
--warmup (compile included in the warm-up, reported apart), torch.cuda.max_memory_allocated over the timed
steps, both as ratios to the non-private step of the same shape and dtype, and the first step's loss (the
same model and batch in every mode, so it must agree across modes). A mode that fails (OOM, a refusal)
is a row with its reason, and the others still run. --out is rewritten after every mode.

--compiler eager (the default of --tiny) runs the same graphs op by op without Inductor's code generation:
dpcompile's compiler="eager" and stock backend="aot_eager_decomp_partition" (the same decompositions and
partitioner). It checks the script and the rewrite in a few minutes on CPU; its times mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # dpcompile from this checkout, also when it is not installed
sys.path.insert(0, HERE)
import dpcompile  # noqa: E402
from anchors import compile_phases, dp_compile_seconds, failure, host_profile, kernel_profile  # noqa: E402
from vision_models import ViT, WideResNet  # noqa: E402

MODES = ("nonprivate", "bk", "ghost", "opacus")
SHAPES = {  # name -> (model builder, image side, classes, batch)
    "wrn16-4": (lambda: WideResNet(depth=16, widen=4, num_classes=10), 32, 10, 256),
    "vit-s16": (lambda: ViT(num_classes=1000), 224, 1000, 64),
}
TINY_SHAPES = {  # the same structures, a few channels: a CPU smoke run of every code path
    "wrn16-4": (lambda: WideResNet(depth=16, widen=1, num_classes=10, width=4), 16, 10, 8),
    "vit-s16": (lambda: ViT(image=16, patch=4, dim=16, depth=2, heads=2, mlp=32, num_classes=10), 16, 10, 8),
}


def autocast_for(dtype: str, device: torch.device):
    return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext


def torch_step(mode: str, model: nn.Module, batch: int, autocast, compiler: str, options: dict):
    """The non-private step and the dpcompile steps: one train_step, compiled by stock Inductor or dp_fsdp."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_step(x, y):
        with autocast():
            loss = F.cross_entropy(model(x).float(), y, reduction="none").mean()
        loss.backward()
        return loss.detach()

    if mode == "nonprivate":
        stock = {"options": {"triton.cudagraphs": True, "cpp_wrapper": True}} if options.get("cudagraphs") and \
            options.get("cpp_wrapper") else {"options": {"cpp_wrapper": True}} if options.get("cpp_wrapper") else \
            {"mode": "reduce-overhead"} if options.get("cudagraphs") else {}
        fn = torch.compile(train_step, backend="inductor" if compiler == "inductor" else "aot_eager_decomp_partition",
                           **stock)
    else:
        fn = dpcompile.private_step(train_step, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=batch,
                                    schedule=mode, compiler=compiler, **options)

    def step(x, y):
        loss = fn(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step, fn


def opacus_step(model: nn.Module, batch: int, autocast):
    """Opacus ghost clipping: make_private wraps model, optimizer and criterion; the criterion's backward runs
    the norm pass and the clipped second backward."""
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator
    from torch.utils.data import DataLoader, TensorDataset

    model = ModuleValidator.fix(model)  # nn.MultiheadAttention -> DPMultiheadAttention; a no-op for the WRN
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.zeros(batch, 1)), batch_size=batch)  # only its sample rate matters
    model, opt, criterion, _ = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, criterion=nn.CrossEntropyLoss(), noise_multiplier=1.0,
        max_grad_norm=1.0, grad_sample_mode="ghost", clipping="flat", poisson_sampling=False)

    def step(x, y):
        with autocast():
            loss = criterion(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def norm_forms(fn) -> dict | None:
    """How dpcompile computed the per-sample norms (counters norm_*: conv ghost or direct, linear ...). private_step
    hands equal options one backend, whose records pile up over shapes and dtypes: this mode's is the last."""
    recs = [r for r in fn.dp_backend.compiled if r.dp]
    return {k: v for k, v in recs[-1].counters.items() if k.startswith("norm_")} if recs else None


def dp_options(args) -> dict:
    """dpcompile options from the command line (the defaults where not given)."""
    opts = {k: v for k, v in (("conv_norm", args.conv_norm), ("linear_norm", args.linear_norm)) if v is not None}
    opts = {**opts, "cudagraphs": True} if args.cudagraphs else opts
    opts = {**opts, "disable_passes": tuple(args.disable_passes.split(","))} if args.disable_passes else opts
    return {**opts, "cpp_wrapper": True} if args.cpp_wrapper else opts


def base_row(shape: str, dtype: str, mode: str, args) -> dict:
    _, side, _, batch = (TINY_SHAPES if args.tiny else SHAPES)[shape]
    return {"shape": shape, "dtype": dtype, "mode": mode, "batch": batch, "image": side,
            "compiler": None if mode == "opacus" else args.compiler,
            "options": None if mode == "opacus" else dp_options(args)}


def measure(shape: str, dtype: str, mode: str, args, device: torch.device) -> dict:
    build, side, classes, batch = (TINY_SHAPES if args.tiny else SHAPES)[shape]
    row = base_row(shape, dtype, mode, args)
    if mode == "opacus":
        try:
            import opacus
        except ImportError as exc:
            return {**row, "status": "skipped", "reason": f"opacus is not importable: {exc}"}
        row["opacus"] = opacus.__version__
    torch._dynamo.reset()
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with device:
        model = build()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, side, side, generator=g).to(device)
    y = torch.randint(0, classes, (batch,), generator=g).to(device)
    autocast = autocast_for(dtype, device)
    fn = None
    if mode == "opacus":
        step = opacus_step(model, batch, autocast)
    else:
        step, fn = torch_step(mode, model, batch, autocast, args.compiler, dp_options(args))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    first_loss = step(x, y)
    for _ in range(args.warmup - 1):
        step(x, y)
    sync()
    warm_s = time.perf_counter() - t0
    if cuda and not args.cudagraphs:  # the timed steps' peak, not compile-time autotuning's
        # (CUDA graphs allocate their pool while capturing, in the warm-up: the timed replays allocate nothing,
        # so with --cudagraphs the peak is the whole run's, compile included, as in anchors.py)
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        sync()
        t = time.perf_counter()
        step(x, y)
        sync()
        times.append(time.perf_counter() - t)
    kernels = kernel_profile({"kernel_profile": args.kernel_profile, "model": shape, "B": batch, "T": side,
                              "dtype": dtype, "mode": "-".join([mode] + [f"{k}-{v}" for k, v in dp_options(args).items()])},
                             lambda: step(x, y), device) if args.kernel_profile else None
    if args.host_profile:
        path = host_profile(args.host_profile, f"{shape}_{dtype}_{mode}", lambda: step(x, y), torch.cuda.synchronize)
        with open(path) as f:
            print("".join(f.readlines()[:40]), flush=True)
    return {**row, "status": "ok", "kernel_profile": kernels, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "compile_and_warmup_s": warm_s, "first_loss": first_loss,
            "params": sum(p.numel() for p in model.parameters()),
            "norm_forms": norm_forms(fn) if mode in ("bk", "ghost") else None,
            "dp_compile_seconds": dp_compile_seconds(fn) if mode in ("bk", "ghost") else None,
            "compile_phases": compile_phases() if fn is not None else None}


def add_ratios(results: list[dict]) -> None:
    for r in results:
        base = next((b for b in results if b["mode"] == "nonprivate" and b["status"] == "ok"
                     and (b["shape"], b["dtype"]) == (r["shape"], r["dtype"])), None)
        if base and r["status"] == "ok":
            r["time_ratio"] = r["median_ms"] / base["median_ms"]
            r["mem_ratio"] = r["peak_gib"] / base["peak_gib"] if base["peak_gib"] else None


def print_table(results: list[dict]) -> None:
    def f(v, spec):
        return "-".rjust(int(spec.split(".")[0])) if v is None else format(v, spec)

    print(f"{'shape':>8} {'dtype':>5} {'batch':>5} {'mode':>10} {'median ms':>10} {'x np':>5} {'peak GiB':>9} "
          f"{'x np':>5} {'compile+warmup s':>16} {'step-1 loss':>11}")
    for r in results:
        head = f"{r['shape']:>8} {r['dtype']:>5} {r['batch']:>5} {r['mode']:>10}"
        if r["status"] != "ok":
            print(f"{head} {r['status'].upper()}: {r['reason']}")
            continue
        print(f"{head} {r['median_ms']:10.1f} {f(r.get('time_ratio'), '5.2f')} {f(r['peak_gib'], '9.2f')} "
              f"{f(r.get('mem_ratio'), '5.2f')} {r['compile_and_warmup_s']:16.1f} {r['first_loss']:11.5f}")
    for line in loss_mismatches(results):
        print(line)


def loss_mismatches(results: list[dict]) -> list[str]:
    """Modes whose step-1 loss is not the non-private one (same model, same batch): beyond 2e-3 relative in fp32,
    2e-2 in bf16."""
    lines = []
    for r in results:
        base = next((b for b in results if b["mode"] == "nonprivate" and b["status"] == "ok"
                     and (b["shape"], b["dtype"]) == (r["shape"], r["dtype"])), None)
        if base and r["status"] == "ok" and r is not base:
            rel = abs(r["first_loss"] - base["first_loss"]) / abs(base["first_loss"])
            if rel > (2e-2 if r["dtype"] == "bf16" else 2e-3):
                lines.append(f"LOSS MISMATCH {r['shape']} {r['dtype']} {r['mode']}: {r['first_loss']:.5f} vs "
                             f"non-private {base['first_loss']:.5f}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps, compile included (default 3; --tiny 2)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 20; --tiny 3)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: narrow models, batch 8, few steps")
    ap.add_argument("--compiler", choices=["inductor", "eager"], default=None,
                    help="code generation of the compiled modes (default inductor; --tiny: eager)")
    ap.add_argument("--conv-norm", default=None, choices=["auto", "ghost", "direct", "input_gram"],
                    help="dpcompile's conv_norm option for bk and ghost (default: its default, auto)")
    ap.add_argument("--linear-norm", default=None, choices=["auto", "ghost", "direct"],
                    help="dpcompile's linear_norm option for bk and ghost (default: its default, auto)")
    ap.add_argument("--cudagraphs", action="store_true",
                    help="CUDA graphs on both sides: the non-private step with mode='reduce-overhead', dpcompile's "
                         "with cudagraphs=True (its analogue)")
    ap.add_argument("--cpp-wrapper", action="store_true",
                    help="Inductor's C++ wrapper on both sides: the non-private step with options={'cpp_wrapper': True}, "
                         "dpcompile's with cpp_wrapper=True")
    ap.add_argument("--kernel-profile", default=None, metavar="DIR",
                    help="CUDA: one more step of each mode under torch.profiler; every GPU kernel's count and time "
                         "as JSON in DIR")
    ap.add_argument("--host-profile", default=None, metavar="DIR",
                    help="CUDA: five more steps of each mode under cProfile (anchors.py's): the host's time by "
                         "function, as text in DIR")
    ap.add_argument("--gram-kernel", default=None, choices=["on", "off"],
                    help="off: ghost-form norms as Gram matmuls in the graph, not dpcompile::gram_sq_norms (A/B; "
                         "default: dpcompile's, on unless DPCOMPILE_GRAM_KERNEL=0)")
    ap.add_argument("--input-gram", default=None, choices=["on", "off"],
                    help="off: conv_norm='auto' picks between ghost and direct alone, not input_gram (A/B; default: "
                         "dpcompile's, on unless DPCOMPILE_INPUT_GRAM=0)")
    ap.add_argument("--disable-passes", default=None, metavar="NAMES",
                    help="comma-separated optional dpcompile passes to skip in bk and ghost (an A/B of one pass)")
    ap.add_argument("--out", default=None, help="JSON of every row, rewritten after each mode")
    args = ap.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else 2 if args.tiny else 3
    args.iters = args.iters if args.iters is not None else 3 if args.tiny else 20
    args.compiler = args.compiler or ("eager" if args.tiny else "inductor")
    assert args.warmup >= 1, "the first warm-up step gives the step-1 loss"
    for given, known in ((args.models, SHAPES), (args.dtypes, ("fp32", "bf16")), (args.modes, MODES)):
        if set(given.split(",")) - set(known):
            ap.error(f"unknown {sorted(set(given.split(',')) - set(known))}; known: {', '.join(known)}")
    from dpcompile.passes import per_sample_norms
    if args.gram_kernel is not None:
        per_sample_norms.GRAM_KERNEL = args.gram_kernel == "on"
    if args.input_gram is not None:
        from dpcompile.passes import conv_norms

        conv_norms.INPUT_GRAM = args.input_gram == "on"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 = TF32 tensor-core matmuls and convolutions
    torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, compiler {args.compiler}, warmup {args.warmup}, iters {args.iters}",
          flush=True)
    results = []
    for shape in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                try:
                    r = measure(shape, dtype, mode, args, device)
                except Exception as exc:  # noqa: BLE001 - a failing mode is a row, not the end of the run
                    r = {**base_row(shape, dtype, mode, args), **failure(exc)}
                results.append(r)
                print(f"done {shape} {dtype} {mode}: " + (f"median {r['median_ms']:.1f} ms, compile+warmup "
                      f"{r['compile_and_warmup_s']:.1f} s" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"),
                      flush=True)
                if args.out:
                    add_ratios(results)
                    with open(args.out, "w") as fh:
                        json.dump({"device": name, "torch": torch.__version__, "args": vars(args),
                                   "results": results}, fh, indent=2)
    add_ratios(results)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
