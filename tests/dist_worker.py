"""Multi-rank test bodies, run in spawned gloo processes (see test_fsdp.py)."""
from __future__ import annotations

import contextlib
import copy
import faulthandler
import functools
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import cases
import ci_time
import dpcompile
import models as M
from reference import clip_and_sum, dp_reference, per_sample_gradients

ci_time.install()  # the ranks compile as the pytest process does (ci_time.py)


_SHARED_GROUP = [False]  # dist_worker.jobs is running: one process group for all of its test bodies


def _init(rank, world, init_file, mesh_shape=None, mesh_dim_names=None):
    """A test body's process group (the one dist_worker.jobs made, when it runs the body) and its device mesh."""
    import datetime

    if not _SHARED_GROUP[0]:
        # a rank that crashes (SIGSEGV in a C++ library) prints every thread's Python stack to its stderr, which
        # the test's captured output shows: pytest's faulthandler covers its own process only
        faulthandler.enable()
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        # a collective one rank never reaches fails the test after 5 minutes instead of hanging the run (a rank
        # compiling while the other waits for it takes less)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    return init_device_mesh("cpu", tuple(mesh_shape or (world,)), mesh_dim_names=mesh_dim_names)


def _finish():
    """The end of a test body: its process group goes, unless dist_worker.jobs runs more bodies on it."""
    if not _SHARED_GROUP[0]:
        dist.destroy_process_group()


@contextlib.contextmanager
def _restoring(attributes):
    """(module, name) pairs: their values as they are now (copies: a list may be written in place) come back
    on exit."""
    saved = [(m, k, copy.copy(getattr(m, k))) for m, k in attributes]
    try:
        yield
    finally:
        for m, k, v in saved:
            setattr(m, k, copy.copy(v))


def _children_cpu():
    """CPU seconds of this process's ended children (g++ of Inductor's C++ kernels)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def jobs(rank, world, init_file, out_dir, specs):
    """Several tests' bodies on one spawned process group, one after another (spawning the ranks is the slow
    part of a small test; torch cannot make a second default process group in a process: its device meshes
    keep resolving the first). specs: {job: (function name in this module, keyword arguments)}; each job gets
    its own output folder out_dir/job, starts from a fresh dynamo and from the Inductor settings and module
    globals the ranks started with, and leaves its traceback in error<rank>.txt if it raises. The jobs after
    one that raised do not run (the ranks may no longer agree on their collectives): each says so."""
    import traceback

    from torch._inductor import config as inductor_config

    from dpcompile import bucketing
    from dpcompile.passes import aligned_contractions

    _init(rank, world, init_file)
    _SHARED_GROUP[0] = True
    globals_ = [(bucketing, "_SET_BY"), (aligned_contractions, "PAD_DEVICES"), (aligned_contractions, "ALIGNMENT")]
    settings = inductor_config.get_config_copy()
    failed = None
    for job, (fn, kwargs) in specs.items():
        job_dir = os.path.join(out_dir, job)
        os.makedirs(job_dir, exist_ok=True)
        if failed:
            with open(os.path.join(job_dir, f"error{rank}.txt"), "w") as f:
                f.write(f"not run: job {failed!r} before it on these ranks raised")
            continue
        torch._dynamo.reset()
        start, cpu_start, children_start = time.time(), time.process_time(), _children_cpu()
        try:
            with _restoring(globals_):
                globals()[fn](rank, world, init_file, out_dir=job_dir, **kwargs)
        except Exception:  # noqa: BLE001 - reported to the job's test
            failed = job
            with open(os.path.join(job_dir, f"error{rank}.txt"), "w") as f:
                f.write(traceback.format_exc()[-4000:])
        finally:
            inductor_config.load_config(settings)
            # what each job costs: CI time is the suite's budget (children: the C++ compiles it waited for)
            with open(os.path.join(job_dir, f"cost{rank}.json"), "w") as f:
                json.dump({"seconds": time.time() - start, "cpu_seconds": time.process_time() - cpu_start,
                           "children_cpu_seconds": _children_cpu() - children_start}, f)
    _SHARED_GROUP[0] = False
    _finish()


def make(case):
    torch.manual_seed(0)
    if case == "gpt":  # one block: the collectives of every layer kind, and CI time
        return M.GPT(d=8, n_head=2, n_layer=1), M.seq_ce, 13
    if case == "llama":
        return M.LlamaLM(), M.seq_ce, 13
    if case == "gpt_odd":  # widths 12, 36, 48 and vocab 13: unaligned for the padding tests
        return M.GPT(d=12, n_head=2, n_layer=1), M.seq_ce, 13
    if case == "hf_llama":  # third-party code: transformers' Llama, which counts its heads from the widths
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=29, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8, bos_token_id=0,
                          eos_token_id=0, pad_token_id=0, use_cache=False)
        return LlamaForCausalLM(cfg), lambda out, y: M.seq_ce(out.logits, y), cfg.vocab_size
    if case in ("llama_sp", "gpt_sp", "llama_tp"):  # torchtitan's layout, for its (sequence-)parallel plan
        return M.TitanLM(kind=case.split("_")[0]), M.seq_ce, 13
    raise ValueError(case)


_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def waits_out_of_order(record) -> list[str]:
    """The collective kinds whose waits, in a compiled graph of ``record``, are not in the order the collectives
    are issued in. Inductor's bucketing fills a bucket in the order of the waits: waits placed by rank-dependent
    code bucket a gradient at different offsets on different ranks (a wrong gradient, 34th session)."""
    import re

    bad = []
    for stage in ("forward", "backward"):
        text = record.graphs.get(stage, "")
        for kind in _COLLECTIVES:
            issued = re.findall(rf"^\s*(\w+)(?::[^=\n]*)? = torch\.ops\._c10d_functional\.{kind}\.default\(", text,
                                re.M)
            names = set(issued)
            waited = [w for w in re.findall(r"wait_tensor\.default\((\w+)\)", text) if w in names]
            if waited != issued:
                bad.append(f"{stage} {kind}")
    return bad


def shard(model, mesh, reshard_after_forward=True):
    blocks = getattr(model, "blocks", None) or [model.block]
    for b in blocks:
        dpcompile.fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward)
    dpcompile.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def correctness(rank, world, init_file, case, schedule, sizes, reshard_after_forward, out_dir=None,
                mesh_shape=None, pad_contractions=False, bucket_mb=None, overlap=False, compiler="inductor"):
    mesh = _init(rank, world, init_file, mesh_shape)
    if bucket_mb == "off":  # unbucketed: dpcompile's own collective passes, one collective per parameter
        dpcompile.bucket_collectives(None)
    elif bucket_mb:  # a cap the user chose; None: fully_shard's default (64 MiB, overlapped)
        dpcompile.bucket_collectives(bucket_mb, overlap=overlap)
    if pad_contractions:  # the CUDA padding rule, forced on for CPU float32
        from dpcompile.passes import aligned_contractions

        aligned_contractions.PAD_DEVICES = ("cpu",)
        aligned_contractions.ALIGNMENT = {torch.float32: 8}
    report = _correct(mesh, rank, world, case, schedule, sizes, reshard_after_forward, compiler=compiler)
    if out_dir:
        import json

        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({k: v for k, v in report.items() if k not in ("model", "step")}, f)
    _finish()


def _correct(mesh, rank, world, case, schedule, sizes, reshard_after_forward=True, **options):
    """One sharded step on this rank's slice of a batch, exact against the oracle; what it issued."""
    model, loss_fn, vocab = make(case)
    ref_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    total = sum(sizes)
    ids = torch.randint(0, vocab, (total, 6), generator=g)
    offsets = [sum(sizes[:r]) for r in range(world)]
    local = ids[offsets[rank]: offsets[rank] + sizes[rank]]
    _, norms = dp_reference(ref_model, loss_fn, (ids,), (ids,), max_grad_norm=1.0, expected_batch_size=total)
    C = float(norms.median())
    ebs = total + 1
    ref, _ = dp_reference(ref_model, loss_fn, (ids,), (ids,), max_grad_norm=C, expected_batch_size=ebs)

    shard(model, mesh, reshard_after_forward)
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=ebs, schedule=schedule,
                                  **options)

    def step(x, y):
        loss = loss_fn(model(x), y).mean()
        loss.backward()
        return loss.detach()

    compiled = torch.compile(step, backend=backend)
    compiled(local, local)
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(local, local)  # the compiled step only: which collectives it issues
    issued = {kind: sum(e.count for e in prof.key_averages() if e.key == f"_c10d_functional::{kind}")
              for kind in ("all_gather_into_tensor", "all_gather_into_tensor_out", "reduce_scatter_tensor")}
    for name, p in model.named_parameters():
        assert isinstance(p.grad, torch.distributed.tensor.DTensor), name
        full = p.grad.full_tensor()
        torch.testing.assert_close(full.double(), ref[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    rec = [r for r in backend.compiled if r.dp][0]
    from torch._inductor import config as inductor_config

    counts = {
        phase: {kind: sum(kind in op for op, _ in rec.ops[phase]) for kind in ("reduce_scatter", "all_gather")}
        for phase in ("forward", "backward")
    }
    return {"counts": counts, "n_params": sum(1 for p in model.parameters() if p.requires_grad),
            "n_linear": sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear)), "counters": rec.counters,
            "summary_collectives": rec.summary["collectives"], "issued": issued,
            "waits_out_of_order": waits_out_of_order(rec),
            "bucketing": [inductor_config.bucket_reduce_scatters_fx, inductor_config.reorder_for_compute_comm_overlap,
                          inductor_config.bucket_reduce_scatters_fx_bucket_size_determinator(0)
                          if inductor_config.bucket_reduce_scatters_fx != "none" else None],
            "model": model, "step": (step, local, C, ebs)}


class _GeluBlocks(torch.nn.Module):
    """Two residual blocks, Linear -> GELU -> Linear: the first bias is read by the GELU's kernel. Then a scale
    and shift from one [2, d] parameter: at 2 ranks its gathered [2, d] part is already its shape, so Inductor's
    bucketing hands it on as a strided view of the bucket, without the clone the other parameters get."""

    def __init__(self, d=8, n_block=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
            for _ in range(n_block))
        self.affine = torch.nn.Parameter(torch.randn(2, d) / d)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x * (1 + self.affine[0]) + self.affine[1]


def gathered_kernels(rank, world, init_file, out_dir, copy_out=True):
    """Which kernels Inductor generates for the forward and the backward of a bucketed sharded bk step of two
    Linear-GELU-Linear blocks (compiled afresh: no FX graph cache): per graph, the number of distinct kernels and
    the launches of each kernel fusing a GELU (one per block); and how many buckets were copied out.
    ``copy_out=False`` disables the copy-out by name (to see what the test's counts are without it)."""
    import re

    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from dpcompile import gathered_copy_out

    mesh = _init(rank, world, init_file)
    inductor_config.fx_graph_cache = False
    torch.manual_seed(0)
    model = shard(_GeluBlocks(), mesh)
    backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, schedule="bk",
                                  disable_passes=() if copy_out else (gathered_copy_out.NAME,))

    def step(x, y):
        loss = M.mse(model(x), y).mean()
        loss.backward()
        return loss.detach()

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    _, codes = run_and_get_code(torch.compile(step, backend=backend), x, y)  # the forward's, the backward's
    rec = [r for r in backend.compiled if r.dp][0]
    report = {"copied_out": rec.counters.get(gathered_copy_out.COUNTER, 0), "graphs": [],
              # the all-gathers the generated code calls: one per bucket
              "buckets": sum(len(re.findall(r"^\s+.*all_gather_into_tensor\w*\.default\(", c, re.M)) for c in codes)}
    for code in codes:
        defined = set(re.findall(r"^(\w+) = async_compile\.\w+\(", code, re.M))  # a kernel's definition
        launches = re.findall(r"^\s+(\w+)\(", code, re.M)  # (C++ kernels are called; Triton's .run)
        launches += re.findall(r"^\s+(\w+)\.run\(", code, re.M)
        gelu = {k: launches.count(k) for k in defined if "gelu" in k}
        report["graphs"].append({"kernels": len(defined), "gelu": gelu, "backward": "gelu_backward" in code})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    _finish()


def hybrid(rank, world, init_file, out_dir):
    """2x2 mesh (replicate across dim 0, shard within dim 1): both schedules exact against the oracle; then
    the ghost step again with noise: replicas of a shard must draw the same noise, shards different noise."""
    import json

    mesh = _init(rank, world, init_file, (2, 2))
    # 4 ranks on CI's 2 cores: the exact steps op by op (the sharded matrix runs Inductor's code), the noisy
    # step through Inductor (its random numbers are Inductor's)
    reports = {s: _correct(mesh, rank, world, "gpt", s, [2, 3, 2, 2], compiler="eager") for s in ("bk", "ghost")}
    model = reports["ghost"]["model"]
    step, local, C, ebs = reports["ghost"]["step"]
    clean = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    # no seed: each process draws one from the OS, and the ranks take rank 0's (replicas must agree)
    noisy_step = torch.compile(step, backend=dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=3.0,
                                                                 expected_batch_size=ebs, schedule="ghost"))
    model.zero_grad(set_to_none=True)
    noisy_step(local, local)
    torch.save({"noise": {n: p.grad.to_local() - clean[n] for n, p in model.named_parameters()}, "std": 3.0 * C / ebs},
               os.path.join(out_dir, f"hnoise{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({s: {k: v for k, v in r.items() if k not in ("model", "step")} for s, r in reports.items()}, f)
    _finish()


# per-rank batch sizes of the steps every sharded case runs: an empty rank, a one-sample rank, uneven, no samples
SHARDED_STEPS = ((0, 3), (1, 4), (5, 3), (0, 0))


def shard_like_a_user(model, mesh, blocks=(), lists=False, **kwargs):
    """fully_shard every item of every nn.ModuleList (the blocks of a transformer; lists: all of a list's
    items by one call) and every module whose class is named in blocks (a vision model's blocks, in an
    nn.Sequential), then the root."""
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList) and lists:
            assert dpcompile.fully_shard(list(module), mesh=mesh, **kwargs) == list(module)
        elif isinstance(module, torch.nn.ModuleList):
            for block in module:
                dpcompile.fully_shard(block, mesh=mesh, **kwargs)
        elif type(module).__name__ in blocks:
            dpcompile.fully_shard(module, mesh=mesh, **kwargs)
    dpcompile.fully_shard(model, mesh=mesh, **kwargs)
    return model


def every_case(rank, world, init_file, out_dir, runs):
    """Runs (case name in cases.SHARDED_CASES, schedule, form) sharded on 2 ranks. The form is "compile" or
    "private_step", with flags "+pad" (contractions padded as on CUDA), "+eager" (compiler="eager"), "+cpp"
    (cpp_wrapper=True) and "+recompute" (the ghost second backward recomputes every forward contraction it can).

    Steps with per-rank batch sizes SHARDED_STEPS (different data on each rank; the (5, 3) step accumulated
    from 2 micro-batches per rank); after each, every rank's gathered gradient must equal the float64 oracle
    on the concatenated batch, clipping active, bad samples dropped and counted. One graph must serve all
    the steps. Results (or the error) per run go to a JSON file per rank.
    """
    import json
    import traceback

    mesh = _init(rank, world, init_file)
    results = {}
    for n, (name, schedule, form) in enumerate(runs):
        torch._dynamo.reset()
        try:
            case = cases.with_bad_samples(cases.SHARDED_CASES[name])  # two samples of a step are dropped
            results[f"{name}-{schedule}-{form}"] = _sharded_case(case, mesh, rank, schedule, form, seed=n)
        except Exception:  # noqa: BLE001 - reported per run to the test
            results[f"{name}-{schedule}-{form}"] = {"error": traceback.format_exc()[-4000:]}
    with open(os.path.join(out_dir, f"cases{rank}.json"), "w") as f:
        json.dump(results, f)
    _finish()


def _sharded_case(case, mesh, rank, schedule, form, seed):
    torch.manual_seed(seed)
    batches = [case.data(sum(sizes)) for sizes in SHARDED_STEPS]
    every = [torch.cat(ts) for ts in zip(*[inputs + targets for inputs, targets in batches])]
    n_in = len(batches[0][0])
    model = case.model()  # after the data: a model built from its first batch (cases.side_by_side)
    ref_model = copy.deepcopy(model)
    # every step's samples' gradients in one oracle call (the steps' references slice them; CI time)
    every_grads = per_sample_gradients(ref_model, case.loss, tuple(every[:n_in]), tuple(every[n_in:]))
    _, norms = clip_and_sum(every_grads, max_grad_norm=1.0, reduction=case.reduction, expected_batch_size=9)
    C = cases.finite_median(norms)  # over the samples of all steps: some clipped, some not
    form, *flags = form.split("+")
    # "+last_dim": every parameter sharded on its last dim (shard_placement_fn), its pieces uneven where that
    # dim is odd; "+no_mesh": fully_shard's default mesh (every rank of the process group); "+lists": each
    # nn.ModuleList's blocks sharded by one call, as a list (FSDP2's form)
    shard_like_a_user(model, None if "no_mesh" in flags else mesh, lists="lists" in flags,
                      **({"shard_placement_fn": lambda p: Shard(p.dim() - 1)} if "last_dim" in flags else {}))
    options = dict(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=9, schedule=schedule, seed=seed)

    if "eager" in flags:
        options["compiler"] = "eager"
    if "cpp" in flags:  # Inductor's C++ wrapper launches the kernels (collectives and dpcompile's ops included)
        options["cpp_wrapper"] = True
    if "input_gram" in flags:  # every convolution's norm from its padded input's Gram (auto: large batches only)
        options["conv_norm"] = "input_gram"
    from dpcompile.passes import aligned_contractions, second_backward_recompute

    patches = []
    if "pad" in flags:  # the CUDA padding rule, forced on for CPU float32
        patches += [(aligned_contractions, "PAD_DEVICES", ("cpu",)),
                    (aligned_contractions, "ALIGNMENT", {torch.float32: 8})]
    if "recompute" in flags:  # every forward value the ghost second backward reads qualifies (small models)
        patches += [(second_backward_recompute, "RECOMPUTE_MIN_BYTES", 1),
                    (second_backward_recompute, "RECOMPUTE_MIN_RATIO", 1)]
    with _restoring([(m, k) for m, k, _ in patches]):
        for m, k, v in patches:
            setattr(m, k, v)
        return _run_sharded_steps(case, model, ref_model, rank, form, options, C, batches, every_grads)


def _buffers(model) -> dict:
    """Every buffer's values, whole (a DTensor's gathered)."""
    return {n: (b.full_tensor() if hasattr(b, "full_tensor") else b).detach().clone()
            for n, b in model.named_buffers()}


def _run_sharded_steps(case, model, ref_model, rank, form, options, C, batches, every_grads):
    start, cpu_start = time.time(), time.process_time()
    first = 0  # the step's first sample among every_grads' rows

    def step(inputs, targets):
        per_sample = case.loss(model(*inputs), *targets)
        loss = per_sample.mean() if case.reduction == "mean" else per_sample.sum()
        loss.backward()
        return loss.detach()

    if form == "compile":
        compiled = torch.compile(step, backend="dp_fsdp", options=options)
        backend = dpcompile.get_backend(options)
    else:
        compiled = dpcompile.private_step(step, **options)
        backend = compiled.dp_backend
    known = len(backend.compiled)  # the same options share one backend
    clipped = unclipped = 0
    worst = 0.0
    stateful = False  # a step updated buffers in place (cases.spectral_norm): the oracle starts from them
    for sizes, (inputs, targets) in zip(SHARDED_STEPS, batches):
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        local = tuple(t[lo:hi].clone() for t in inputs), tuple(t[lo:hi].clone() for t in targets)
        model.zero_grad(set_to_none=True)
        before = _buffers(model)
        with torch.no_grad():
            for name, b in ref_model.named_buffers():
                b.copy_(before[name])
        # the (5, 3) step as a logical batch of 2 micro-batches per rank (dpcompile.accumulate); not for a
        # model whose forward updates its buffers, whose second micro-batch would see them updated once more
        n_micro = 2 if sizes == (5, 3) and not stateful else 1
        cuts = [hi - lo] if n_micro == 1 else [(hi - lo + 1) // 2, (hi - lo) // 2]
        at = 0
        for j, cut in enumerate(cuts):
            part = tuple(tuple(t[at: at + cut] for t in ts) for ts in local)
            with dpcompile.accumulate(enabled=j < n_micro - 1):
                compiled(*part)
            at += cut
        stateful = stateful or any(not torch.equal(before[n], b) for n, b in _buffers(model).items())
        # cases.with_bad_samples: a sample with a non-finite float input or weight is dropped, counted where
        # it lives
        bad = cases.bad_samples(inputs, targets)
        bad_here = int(bad[lo:hi].sum())
        got = backend.dropped_samples()
        assert got == bad_here, (sizes, rank, got)
        if sum(sizes):
            # a model that updated its buffers: the oracle from the buffers this step started from
            grads = per_sample_gradients(ref_model, case.loss, inputs, targets) if stateful else \
                {name: g[first: first + sum(sizes)] for name, g in every_grads.items()}
            ref, n = clip_and_sum(grads, max_grad_norm=C, reduction=case.reduction, expected_batch_size=9)
            clipped, unclipped = clipped + int((n > C).sum()), unclipped + int((n < C).sum())
        first += sum(sizes)
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, f"frozen {name} got a gradient"
                continue
            full = p.grad.full_tensor().double()
            want = ref[name] if sum(sizes) else torch.zeros_like(full)  # no samples anywhere: zero (+ noise)
            # fp32 against fp64: an entry that is a sum with cancellation is off by ~1e-5 of the tensor's scale
            atol = 1e-7 + 1e-5 * float(want.abs().max())
            torch.testing.assert_close(full, want, rtol=1e-5, atol=atol, msg=lambda m: f"{sizes} {name}: {m}")
            worst = max(worst, float((full - want).abs().max()))
    graphs = [r for r in backend.compiled[known:] if r.dp]
    return {"error": None, "dp_graphs": len(graphs), "batch_size": graphs[0].summary["batch_size"],
            "padded": graphs[0].counters.get("contractions_padded", 0), "compiler": backend.config.compiler,
            "recomputed": graphs[0].counters.get("second_backward_recomputed_contractions", 0),
            "counters": graphs[0].counters, "frozen": graphs[0].summary["frozen"], "clipped": clipped,
            "unclipped": unclipped, "worst": worst, "seconds": time.time() - start,
            "cpu_seconds": time.process_time() - cpu_start,
            "waits_out_of_order": waits_out_of_order(graphs[0]),
            "placements": sorted({f"{p.placements}" for p in model.parameters()}),
            "meshes": sorted({f"{p.device_mesh}" for p in model.parameters()})}


def noise(rank, world, init_file, out_dir, seed, last_dim=False, compiler="inductor"):
    """Noiseless and noisy steps on identical data; saves this rank's noise draws (full gradients). last_dim:
    every parameter sharded on its last dim; compiler: the noisy steps'."""
    mesh = _init(rank, world, init_file)
    model, loss_fn, vocab = make("gpt")
    if last_dim:
        shard_like_a_user(model, mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    else:
        shard(model, mesh)
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(rank))

    def run(sigma, steps):
        # the noiseless reference op by op (CI time)
        backend = dpcompile.DPBackend(max_grad_norm=0.5, noise_multiplier=sigma, expected_batch_size=4, seed=seed,
                                      compiler=compiler if sigma else "eager")

        def step(x, y):
            loss = loss_fn(model(x), y).mean()
            loss.backward()
            return loss.detach()

        compiled = torch.compile(step, backend=backend)
        outs = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            compiled(ids, ids)
            outs.append(torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]))
            # this rank's own shard, to compare draws across ranks
        local = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        return torch.stack(outs), local

    clean, clean_local = run(0.0, 1)
    torch._dynamo.reset()
    noisy, noisy_local = run(2.0, 30)
    local = {n: noisy_local[n] - clean_local[n] for n in noisy_local}
    placements = sorted({f"{p.placements}" for p in model.parameters()})
    torch.save({"z": noisy - clean, "local": local, "placements": placements}, os.path.join(out_dir, f"noise{rank}.pt"))
    _finish()


def op_sweep(rank, world, init_file, out_dir, names):
    """op_sweep.sharded_checks of the named ops' samples and the hand-made ones: {sample id: (outcome, detail)}
    per rank."""
    import json

    import op_sweep as sweep

    mesh = _init(rank, world, init_file)
    samples = sweep.op_samples(names=set(names)) + sweep.hand_samples()
    results = sweep.sharded_checks(samples, mesh, rank, world)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    _finish()


def cross_entropy_mean(rank, world, init_file, out_dir):
    """Whole-batch means of per-sample losses (cases.BATCH_MEANS: F.cross_entropy's default mean over the
    targets that are not ignore_index, with label smoothing too, F.kl_div's "batchmean", a hand-written
    sum / numel, probability targets' -sum / B, sum * (1 / B), F.multilabel_margin_loss, F.gaussian_nll_loss),
    sharded: per-rank
    batches SHARDED_STEPS with an ignored target in each batch of three or more, both schedules; every rank's
    gathered gradient against the oracle of the per-sample losses (reduction="none")."""
    import json
    import traceback

    mesh = _init(rank, world, init_file)
    results = {}
    # every loss with compiler="eager" (CI time: the loss pass is what they test; Inductor runs them on one process,
    # test_per_sample_clipping and test_losses)
    for loss, schedule, form, compiler in (("cross_entropy", "bk", "compile", "eager"),
                                           ("cross_entropy", "ghost", "private_step", "eager"),
                                           ("label_smoothing", "ghost", "compile", "eager"),
                                           ("kl_batchmean", "bk", "private_step", "eager"),
                                           ("sum_over_numel", "ghost", "compile", "eager"),
                                           ("prob_targets", "bk", "compile", "eager"),
                                           ("sum_times_reciprocal", "ghost", "private_step", "eager"),
                                           ("multilabel_margin", "ghost", "compile", "eager"),
                                           ("gaussian_nll", "bk", "private_step", "eager")):
        batch_loss, per_sample, _ = cases.BATCH_MEANS[loss]
        torch._dynamo.reset()
        torch.manual_seed(0)
        batches = []
        for sizes in SHARDED_STEPS:
            x, y = torch.randn(sum(sizes), 5) * 2, torch.randint(0, 3, (sum(sizes),))
            if sum(sizes) > 2:
                y[2] = -100
            batches.append((x, y))
        model = M.MLP()
        ref_model = copy.deepcopy(model)
        xs, ys = (torch.cat(t) for t in zip(*batches))
        _, norms = dp_reference(ref_model, per_sample, (xs,), (ys,), max_grad_norm=1.0, expected_batch_size=9)
        C = float(norms[norms > 0].median())
        shard_like_a_user(model, mesh)
        options = dict(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=9, schedule=schedule,
                       compiler=compiler)

        def step(x, y):
            out = batch_loss(model(x), y)
            out.backward()
            return out.detach()

        fn = torch.compile(step, backend="dp_fsdp", options=options) if form == "compile" else \
            dpcompile.private_step(step, **options)
        # two losses with the same per-sample gradients get the same C, so the same backend (get_backend, which
        # private_step uses too) holds both runs' graphs: this run's are those compiled after
        seen = len(dpcompile.get_backend(options).compiled)
        try:
            for sizes, (x, y) in zip(SHARDED_STEPS, batches):
                lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
                model.zero_grad(set_to_none=True)
                fn(x[lo:hi].clone(), y[lo:hi].clone())
                ref = dp_reference(ref_model, per_sample, (x,), (y,), max_grad_norm=C, expected_batch_size=9)[0] \
                    if sum(sizes) else None
                for name, p in model.named_parameters():
                    full = p.grad.full_tensor().double()
                    want = ref[name] if ref is not None else torch.zeros_like(full)
                    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-7 + 1e-5 * float(want.abs().max()),
                                               msg=lambda m: f"{sizes} {name}: {m}")
            (record,) = [r for r in dpcompile.get_backend(options).compiled[seen:] if r.dp]
            results[f"{loss}-{schedule}"] = {"error": None, "counters": dict(record.counters)}
        except Exception:  # noqa: BLE001 - reported to the test
            results[f"{loss}-{schedule}"] = {"error": traceback.format_exc()[-3000:]}
    with open(os.path.join(out_dir, f"ce{rank}.json"), "w") as f:
        json.dump(results, f)
    _finish()


def dropout(rank, world, init_file, out_dir, runs):
    """models.DropoutLM sharded (test_dropout's model): per-rank batches SHARDED_STEPS, each step seeded per rank
    and step; every rank's gathered gradient against the replayed oracle (reference.replayed_per_sample_gradients
    on each rank's own batch and seed, the clipped sums added over the ranks). runs: (schedule, "compile" or
    "private_step", compiler); Inductor with fallback_random (torch's random ops)."""
    import json
    import traceback

    from test_dropout import VOCAB, batches_of, replayed_reference, token_ce

    mesh = _init(rank, world, init_file)
    # Inductor, scheduling the bucketed collectives, moves the drop path's rand and Dropout1d's bernoulli_ before
    # the nn.Dropouts' native_dropout (independent ops; each still draws once, forward and backward read the same
    # masks): other masks than an eager forward's, which the oracle cannot replay. Unbucketed it keeps the
    # program's order. Both torch 2.11 and 2.13 reorder them (2.13's output code draws rand and bernoulli_ first).
    dpcompile.bucket_collectives(None)
    results = {}
    for schedule, form, compiler in runs:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = M.DropoutLM(VOCAB).double().train()
        ref_model = copy.deepcopy(model)
        steps = [(sizes, batches_of([sum(sizes)])[0][1:]) for sizes in SHARDED_STEPS]
        seed_of = [1000 * i + 17 * rank for i in range(len(steps))]

        def local(i):
            sizes, (x, y) = steps[i]
            lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
            return x[lo:hi].clone(), y[lo:hi].clone()

        norms = []  # C: the median of every rank's per-sample norms of every step
        for i in range(len(steps)):
            norms += replayed_reference(ref_model, *local(i), seed_of[i], 1.0, 9)[1].tolist()
        every = [None] * world
        dist.all_gather_object(every, norms)
        C = float(torch.tensor(sum(every, [])).median())
        shard_like_a_user(model, mesh)
        options = dict(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=9, schedule=schedule,
                       compiler=compiler)

        def step(x, y):
            loss = token_ce(model(x), y).mean()
            loss.backward()
            return loss.detach()

        fn = torch.compile(step, backend="dp_fsdp", options=options) if form == "compile" else \
            dpcompile.private_step(step, **options)
        key = f"{schedule}-{form}-{compiler}"
        try:
            clipped = unclipped = 0
            with torch._inductor.config.patch(fallback_random=True):
                for i in range(len(steps)):
                    x, y = local(i)
                    model.zero_grad(set_to_none=True)
                    torch.manual_seed(seed_of[i])
                    fn(x, y)
                    ref, n = replayed_reference(ref_model, x, y, seed_of[i], C, 9)  # (zeros for no samples)
                    clipped, unclipped = clipped + int((n > C).sum()), unclipped + int((n < C).sum())
                    for name in sorted(ref):  # the oracle of the whole batch: the ranks' clipped sums added
                        dist.all_reduce(ref[name])
                    for name, p in model.named_parameters():
                        full = p.grad.full_tensor().double()
                        torch.testing.assert_close(full, ref[name], rtol=1e-5,
                                                   atol=1e-7 + 1e-6 * float(ref[name].abs().max()),
                                                   msg=lambda m: f"step {i} {steps[i][0]} {name}: {m}")
            backend = dpcompile.get_backend(options) if form == "compile" else fn.dp_backend
            results[key] = {"error": None, "dp_graphs": sum(1 for r in backend.compiled if r.dp),
                            "clipped": clipped, "unclipped": unclipped}
        except Exception:  # noqa: BLE001 - reported to the test
            results[key] = {"error": traceback.format_exc()[-3000:]}
    with open(os.path.join(out_dir, f"dropout{rank}.json"), "w") as f:
        json.dump(results, f)
    _finish()


def ctc_loss_sharded(rank, world, init_file, out_dir):
    """F.ctc_loss (torch's mean, zero_infinity) sharded: per-rank batches SHARDED_STEPS of cases.ctc_data (a sample
    without targets and one whose targets do not fit in each batch of three or more), ghost op by op; every
    rank's gathered gradient against the oracle of the per-sample losses."""
    import json
    import traceback

    mesh = _init(rank, world, init_file)
    torch.manual_seed(0)
    batches = [cases.ctc_data(sum(sizes), seed=i) for i, sizes in enumerate(SHARDED_STEPS)]
    model = M.MLP(d_out=cases.CTC_CLASSES)
    ref_model = copy.deepcopy(model)
    per_sample = cases.ctc_loss("mean", True, per_sample=True)
    every = [torch.cat(t) for t in zip(*batches)]
    _, norms = dp_reference(ref_model, per_sample, every[:1], every[1:], max_grad_norm=1.0, expected_batch_size=9,
                            loop=True)
    C = float(norms[norms > 0].median())
    shard_like_a_user(model, mesh)
    batch_loss = cases.ctc_loss("mean", True)

    @dpcompile.private_step(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=9, schedule="ghost",
                            compiler="eager")
    def step(*batch):
        out = batch_loss(model(batch[0]), *batch[1:])
        out.backward()
        return out.detach()

    result = {"error": None}
    try:
        for sizes, batch in zip(SHARDED_STEPS, batches):
            lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
            model.zero_grad(set_to_none=True)
            step(*(t[lo:hi].clone() for t in batch))
            ref = dp_reference(ref_model, per_sample, batch[:1], batch[1:], max_grad_norm=C, expected_batch_size=9,
                               loop=True)[0] if sum(sizes) else None
            for name, p in model.named_parameters():
                full = p.grad.full_tensor().double()
                want = ref[name] if ref is not None else torch.zeros_like(full)
                torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-7 + 1e-5 * float(want.abs().max()),
                                           msg=lambda m: f"{sizes} {name}: {m}")
        (record,) = [r for r in step.dp_backend.compiled if r.dp]
        result["reduction"] = record.summary["loss"]["reduction"]
        result["ops"] = sorted(record.summary["graph_ops"]["forward"])
    except Exception:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()[-3000:]
    with open(os.path.join(out_dir, f"ctc{rank}.json"), "w") as f:
        json.dump(result, f)
    _finish()

def bad_inputs(rank, world, init_file, out_dir):
    """Partly sharded models and mixed meshes are refused with a clear error."""
    import json

    mesh = _init(rank, world, init_file)
    results = {}
    model, loss_fn, vocab = make("gpt")
    dpcompile.fully_shard(model.blocks[0], mesh=mesh)  # root and blocks[1] left unsharded
    ids = torch.randint(0, vocab, (2, 6))
    # refused while compiling, before any code is generated: op by op for the one that runs (CI time)
    backend = dpcompile.DPBackend(max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=4, compiler="eager")

    def step(x, y):
        loss = loss_fn(model(x), y).mean()
        loss.backward()
        return loss.detach()

    try:
        torch.compile(step, backend=backend)(ids, ids)
        results["partial"] = "no error"
    except ValueError as e:
        results["partial"] = str(e)
    # blocks on one mesh, the root on a different one (2-D: replicate x shard)
    torch._dynamo.reset()
    model, loss_fn, vocab = make("gpt")
    other = init_device_mesh("cpu", (1, world))
    for b in model.blocks:
        dpcompile.fully_shard(b, mesh=mesh)
    dpcompile.fully_shard(model, mesh=other)
    try:
        torch.compile(step, backend=backend)(ids, ids)
        results["two_meshes"] = "no error"
    except ValueError as e:
        results["two_meshes"] = str(e)
    # the same mesh built twice (equal by value): one mesh, the step runs
    torch._dynamo.reset()
    model, loss_fn, vocab = make("gpt")
    for b in model.blocks:
        dpcompile.fully_shard(b, mesh=init_device_mesh("cpu", (world,)))
    dpcompile.fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    torch.compile(step, backend=backend)(ids, ids)
    results["equal_meshes_grads"] = sum(p.grad is not None for p in model.parameters())
    results["n_params"] = sum(1 for _ in model.parameters())
    # stock FSDP2: its hooks graph-break, so the step reaches the backend in pieces
    torch._dynamo.reset()
    from torch.distributed.fsdp import fully_shard as stock_fully_shard

    model, loss_fn, vocab = make("gpt")
    for b in model.blocks:
        stock_fully_shard(b, mesh=mesh)
    stock_fully_shard(model, mesh=mesh)
    try:
        torch.compile(step, backend=backend)(ids, ids)
        results["stock_fsdp2"] = "no error"
    except dpcompile.DPCompileError as e:
        results["stock_fsdp2"] = str(e)
    # tensor parallel: a plain parameter applied to one rank's shard of an activation has only part of each
    # sample's gradient on every rank: refused, naming it
    torch._dynamo.reset()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = _GatedMLPLM()
    parallelize_module(model.mlp, mesh, {"fc": ColwiseParallel(), "out": RowwiseParallel()})

    def gated_step(ids, y):
        loss = M.seq_ce(model(ids), y).mean()
        loss.backward()
        return loss.detach()

    tp_ids = ids.clone()  # not the tensor the sharded steps above marked with an unbacked batch size
    try:
        torch.compile(gated_step, backend=backend)(tp_ids, tp_ids)
        results["tensor_parallel_partial"] = "no error"
    except (ValueError, dpcompile.DPCompileError) as e:
        results["tensor_parallel_partial"] = str(e)
    # tensor parallel where AOTAutograd's record of the gradients' placements cannot be found (a torch version
    # that moved it): refused, never guessed from the parameters' placements
    torch._dynamo.reset()
    import dpcompile.backend as dp_backend

    torch.manual_seed(0)
    model = M.GPT(d=8, n_head=2, n_layer=1)
    parallelize_module(model.blocks[0], mesh, {"fc": ColwiseParallel(), "out": RowwiseParallel()})
    found = dp_backend.gradient_placements
    dp_backend.gradient_placements = lambda: None
    try:
        torch.compile(step, backend=backend)(tp_ids, tp_ids)
        results["tp_placements_unknown"] = "no error"
    except (ValueError, dpcompile.DPCompileError) as e:
        results["tp_placements_unknown"] = str(e)
    finally:
        dp_backend.gradient_placements = found
    # fully_shard of a tensor-parallel model over a dp mesh that is not the other dim of the tp mesh's device
    # mesh (here: a second mesh over the same ranks): refused before anything is sharded
    try:
        dpcompile.fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        results["tp_dp_meshes_apart"] = "no error"
    except ValueError as e:
        results["tp_dp_meshes_apart"] = str(e)
    # a 0-dim parameter (weight_norm with dim=None): refused by name before anything is sharded
    try:
        dpcompile.fully_shard(torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 4), dim=None),
                              mesh=init_device_mesh("cpu", (world,)))
        results["scalar_parameter"] = "no error"
    except ValueError as e:
        results["scalar_parameter"] = str(e)
    # shard_placement_fn returning what is not a Shard, or a dim the parameter lacks; FSDP2's int
    # reshard_after_forward; a list with something else than modules: refused before anything is sharded
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import Replicate

    for key, call in {
        "placement_not_shard": lambda m: dpcompile.fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Replicate()),
        "placement_no_dim": lambda m: dpcompile.fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(2)),
        "reshard_int": lambda m: dpcompile.fully_shard(m, mesh=mesh, reshard_after_forward=2),
        "list_not_modules": lambda m: dpcompile.fully_shard([m, "fc"], mesh=mesh),
        "cpu_offload": lambda m: dpcompile.fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy()),
        "ignored_params": lambda m: dpcompile.fully_shard(m, mesh=mesh, ignored_params={m.bias}),
        # a weight tied to one an earlier call sharded otherwise: refused, naming it (one parameter, one layout)
        "tied_apart": lambda m: dpcompile.fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1)),
    }.items():
        lin = torch.nn.Linear(4, 3)
        if key == "tied_apart":
            first = torch.nn.Linear(4, 3)
            lin.weight = first.weight
            dpcompile.fully_shard(first, mesh=mesh)
        try:
            call(lin)
            results[key] = "no error"
        except ValueError as e:
            results[key] = str(e)
        results[f"{key}_untouched"] = not any(isinstance(p, torch.distributed.tensor.DTensor) for p in lin.parameters())
    # a buffer updated from the samples (a running mean of the inputs): refused on every rank, rank 1 with no
    # samples included (the graph is the same), before any collective
    torch._dynamo.reset()
    running = M.RunningInputMean()
    dpcompile.fully_shard(running, mesh=mesh)
    xs = torch.randn(3 * (1 - rank), 5)

    def running_step(x):
        loss = running(x).pow(2).sum(1).mean()
        loss.backward()
        return loss.detach()

    try:
        torch.compile(running_step, backend=backend)(xs)
        results["running_statistic"] = "no error"
    except dpcompile.DPCompileError as e:
        results["running_statistic"] = str(e)
    results["running_statistic_untouched"] = bool((running.running_mean == 0).all())
    # a forward that clamps a sharded weight's .data (Gemma3n's AltUp): the clamp would reach one gathered copy
    # only; refused, naming the weight and the line (one process: exact, test_per_sample_clipping)
    torch._dynamo.reset()
    clamped = M.ClampedWeight()
    dpcompile.fully_shard(clamped, mesh=mesh)
    xs = torch.randn(3 * (1 - rank), 5, 6)

    def clamped_step(x):
        loss = clamped(x).pow(2).sum((1, 2)).mean()
        loss.backward()
        return loss.detach()

    try:
        torch.compile(clamped_step, backend=backend)(xs)
        results["gathered_write"] = "no error"
    except dpcompile.DPCompileError as e:
        results["gathered_write"] = str(e)
    # a step dynamo gives up on (a graph break inside its loop over the blocks) would run as plain Python, the
    # sharded model's own collectives under eager autograd: refused on every rank, rank 1 with no samples, before
    # anything runs (one process: test_refusals)
    torch._dynamo.reset()
    model, loss_fn, vocab = make("gpt")
    shard_like_a_user(model, mesh)

    def looping_step(x, y):
        h = model.wte(x) + model.wpe(torch.arange(x.shape[1]))
        for block in model.blocks:
            h = block(h)
            print(f"rank {rank}: block done")
        loss = loss_fn(model.lm_head(model.ln_f(h)), y).mean()
        loss.backward()
        return loss.detach()

    try:
        ids = torch.randint(0, vocab, (3 * (1 - rank), 6))
        torch.compile(looping_step, backend=backend)(ids, ids)
        results["gave_up"] = "no error"
    except dpcompile.DPCompileError as e:
        results["gave_up"] = str(e)
    results["gave_up_no_grads"] = all(p.grad is None for p in model.parameters())
    with open(os.path.join(out_dir, f"bad{rank}.json"), "w") as f:
        json.dump(results, f)
    _finish()


class _GatedMLP(torch.nn.Module):
    """An MLP whose hidden activation is scaled by a plain learned gate."""

    def __init__(self, d=8):
        super().__init__()
        self.fc = torch.nn.Linear(d, 2 * d)
        self.out = torch.nn.Linear(2 * d, d)
        self.gate = torch.nn.Parameter(torch.ones(1) * 1.5)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.fc(x)) * self.gate)


class _GatedMLPLM(torch.nn.Module):
    def __init__(self, vocab=13, d=8):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.mlp = _GatedMLP(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        return self.head(self.mlp(self.tok(ids)))


class _Batch:
    """A batch as an object with attributes: dynamo reads its tensors, dpcompile does not look inside."""

    def __init__(self, ids):
        self.ids = ids


def unmarked_batch(rank, world, init_file, out_dir):
    """A sharded step whose batch dpcompile cannot mark is refused on every rank (rank 1 has no samples)."""
    import json

    mesh = _init(rank, world, init_file)
    model, loss_fn, vocab = make("gpt")
    shard(model, mesh)
    backend = dpcompile.DPBackend(max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=4)

    def step(batch):
        loss = loss_fn(model(batch.ids), batch.ids).mean()
        loss.backward()
        return loss.detach()

    ids = torch.randint(0, vocab, (2 if rank == 0 else 0, 6))
    try:
        torch.compile(step, backend=backend)(_Batch(ids))
        err = "no error"
    except ValueError as e:
        err = str(e)
    with open(os.path.join(out_dir, f"unmarked{rank}.json"), "w") as f:
        json.dump({"error": err}, f)
    _finish()


def _anchor_gpt():
    """GPT-2-small's widths (d=768, vocab 50257, untied head), 2 layers: the model of the benchmarks, whose
    root holds wte, wpe, ln_f and the head while the blocks are sharded on their own (12 layers would only
    add compile time: each took minutes to compile on 2 ranks)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from train_gpt_dp import GPT

    return GPT(50257, 768, 12, 2, 64), M.seq_ce, 50257


def _hf_gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT-2 small's widths and tied head, 2 layers
    cfg = GPT2Config(n_layer=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg), lambda out, y: M.seq_ce(out.logits, y), cfg.vocab_size


def _tokens(vocab, T):
    return lambda n, gen: (torch.randint(0, vocab, (n, T), generator=gen),) * 2  # next-token targets: the input


def _text(build, T):
    def case():
        model, loss_fn, vocab = build()
        return model, loss_fn, _tokens(vocab, T)
    return case


def _vision(name, image, classes=10):
    """The benchmarks' vision models: WRN-16-4 at CIFAR's shape, a narrow ViT with timm's qkv attention
    (nn.MultiheadAttention fails in Inductor with an unbacked batch: cases.SHARDED_EAGER_ONLY)."""
    def case():
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
        import vision_models as V

        model = V.WideResNet(16, 4, num_classes=classes) if name == "wrn" else \
            V.ViT(image=image, patch=8, dim=64, depth=2, heads=4, mlp=128, num_classes=classes, attention="qkv")
        return model, M.ce, lambda n, gen: (torch.randn(n, 3, image, image, generator=gen),
                                            torch.randint(0, classes, (n,), generator=gen))
    return case


# every case: () -> (model, per-sample loss, data(n, generator) -> (inputs, targets))
NCCL_CASES = {"gpt": _text(lambda: make("gpt"), 6), "llama": _text(lambda: make("llama"), 6),
              "anchor_gpt": _text(_anchor_gpt, 32), "hf_gpt2": _text(_hf_gpt2_small, 32),
              "wrn": _vision("wrn", 32), "vit_qkv": _vision("vit", 32)}


def _relative_error(got, ref) -> float:
    """The largest entry's error, relative to the reference's largest entry."""
    return ((got.double() - ref.double()).abs().max() / (ref.abs().max() + 1e-12)).item()


def _bf16_gradient_error(model, loss_fn, x, y, ebs):
    """The worst relative error of the model's non-private gradient computed in bf16 (a bf16 copy, the mean
    loss over ebs) against fp64, on one GPU: how far bf16 alone takes this model's gradients."""
    exact, _ = dp_reference(model, loss_fn, (x,), (y,), max_grad_norm=float("inf"), expected_batch_size=ebs)
    low = copy.deepcopy(model).to(torch.bfloat16)
    (loss_fn(low(x.bfloat16() if x.is_floating_point() else x), y).sum() / ebs).backward()
    return max(_relative_error(p.grad, exact[n]) for n, p in low.named_parameters())


def correctness_nccl_bf16(rank, world, init_file, out_dir, case):
    """2 or 4 GPUs, NCCL, bf16 compute with fp32 parameters and reduction, against the fp64 reference.

    Plain torch.compile with backend="dp_fsdp", nothing else; the oracle runs in fp64 on the GPU. The bound on
    a gradient's error (its largest entry's, relative to the reference's largest): 0.05, or 1.5x the worst
    error of the same model's non-private gradient computed in bf16 (clipping off, against fp64 clipping
    off) where bf16 alone is further off than that. A 16-layer conv net's bf16 gradient is 0.16-0.21 off
    fp64 before any DP (WRN-16-4, H100); the DP path must not add to that.
    """
    import json

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world,))
    results = {}
    build = NCCL_CASES[case]
    for schedule in ("bk", "ghost"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, loss_fn, data = build()
        model = model.cuda()
        sizes = {2: [3, 1], 4: [3, 2, 0, 1]}[world]  # an empty rank and a one-sample rank
        ebs = sum(sizes) + 1
        x, y = (t.cuda() for t in data(sum(sizes), torch.Generator().manual_seed(1)))
        _, norms = dp_reference(model, loss_fn, (x,), (y,), max_grad_norm=1.0, expected_batch_size=ebs)
        C = float(norms.median())
        ref, _ = dp_reference(model, loss_fn, (x,), (y,), max_grad_norm=C, expected_batch_size=ebs)
        ref = {k: v.cpu() for k, v in ref.items()}
        if schedule == "bk":  # the same for both schedules
            bound = max(0.05, 1.5 * _bf16_gradient_error(model, loss_fn, x, y, ebs))
        mp = dpcompile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_like_a_user(model, mesh, blocks=("WideBlock", "ViTBlock"), mp_policy=mp)
        options = dict(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=ebs, schedule=schedule)

        def step(x, y):
            loss = loss_fn(model(x), y).mean()
            loss.backward()
            return loss.detach()

        rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        torch.compile(step, backend="dp_fsdp", options=options)(x[rows], y[rows])
        worst = 0.0
        for name, p in model.named_parameters():
            assert p.grad.dtype == torch.float32, (name, p.grad.dtype)
            err = _relative_error(p.grad.full_tensor().cpu(), ref[name])
            worst = max(worst, err)
            assert err < bound, (case, schedule, name, err, bound)
        results[f"{case}-{schedule}"] = worst / bound
        del model, ref
        torch.cuda.empty_cache()
    if rank == 0:
        with open(os.path.join(out_dir, f"nccl_bf16_{world}_{case}.json"), "w") as f:
            json.dump(results, f)
    _finish()


def checkpoint_resume(rank, world, init_file, out_dir):
    """tests/test_checkpoint.py: a sharded run resumed from a checkpoint equals the uninterrupted run."""
    import json
    import traceback

    import ckpt_run

    mesh = _init(rank, world, init_file)
    error = None
    try:
        # before anything is compiled in this process: an eager forward of a sharded model (evaluation)
        torch.manual_seed(0)
        model = M.GPT(d=8, n_head=2, n_layer=1)
        plain = copy.deepcopy(model)
        shard(model, mesh)
        x = torch.randint(0, 13, (3, 6))
        with torch.no_grad():
            torch.testing.assert_close(model(x), plain(x))
        # op by op: what is checkpointed is the subject (CI time); the single-process test runs Inductor's code
        run = functools.partial(ckpt_run.train, mesh=mesh, compiler="eager")
        whole = run(os.path.join(out_dir, "whole"), 4, log=lambda s: None)
        torch._dynamo.reset()
        first = run(os.path.join(out_dir, "resumed"), 2, log=lambda s: None)
        assert first["t"] == 2
        torch._dynamo.reset()
        logs = []
        second = run(os.path.join(out_dir, "resumed"), 4, log=logs.append)
        assert logs[0] == "resumed at 2", logs
        assert second["noise_step"] == whole["noise_step"] == 4
        assert second["accountant_steps"] == 4 and second["epsilon"] == whole["epsilon"]
        for name, p in whole["params"].items():
            torch.testing.assert_close(second["params"][name], p, msg=lambda m: f"{name}: {m}")
    except Exception:  # noqa: BLE001 - reported to the test
        error = traceback.format_exc()[-4000:]
    with open(os.path.join(out_dir, f"ckpt{rank}.json"), "w") as f:
        json.dump({"error": error}, f)
    _finish()


def _tp_plan(case):
    """(the modules to parallelize, torch's plan for each): Colwise in, Rowwise out, as torchtitan does."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if case.endswith(("_sp", "_tp")):  # torchtitan's plan of the whole model (_sp: sequence parallel too)
        return None, None
    if case == "hf_llama":  # transformers' own tensor-parallel plan for Llama (base_model_tp_plan), by hand
        return lambda m: list(m.model.layers), {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    if case == "gpt":  # the MLP (the fused qkv splits by width: not a tensor-parallel attention)
        return lambda m: list(m.blocks), {"fc": ColwiseParallel(), "out": RowwiseParallel()}
    if case == "llama":  # attention and MLP
        return lambda m: [m.block], {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
                                     "wo": RowwiseParallel(), "w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                     "w2": RowwiseParallel()}
    raise ValueError(case)


def tensor_parallel(rank, world, init_file, out_dir, case, schedule, compiler, dp=1):
    """TP over a 1-D mesh of all ranks (the same batch on every rank), or with dp > 1 on a (dp, tp) mesh with
    dpcompile.fully_shard over dp (each dp rank its own batch, of unequal sizes): gathered gradients equal the
    float64 oracle's; then with noise: replicas (plain and Replicate parameters) draw the same noise on every
    tp rank, shards their own."""
    import json

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _init(rank, world, init_file, (dp, world // dp), ("dp", "tp"))
    tp_mesh, dp_rank = mesh["tp"], mesh["dp"].get_local_rank()
    model, loss_fn, vocab = make(case)
    ref_model = copy.deepcopy(model)
    sizes = [4] if dp == 1 else [3, 5, 2, 4][:dp]  # per dp rank
    B = sum(sizes)
    ids = torch.randint(0, vocab, (B, 6), generator=torch.Generator().manual_seed(1))
    mine = ids[sum(sizes[:dp_rank]):sum(sizes[:dp_rank + 1])]
    _, norms = dp_reference(ref_model, loss_fn, (ids,), (ids,), max_grad_norm=1.0, expected_batch_size=B)
    C = float(norms.median())
    ebs = B + 1
    ref, _ = dp_reference(ref_model, loss_fn, (ids,), (ids,), max_grad_norm=C, expected_batch_size=ebs)
    modules, plan = _tp_plan(case)
    pairs = M.titan_tp_plan(model, sequence_parallel=case.endswith("_sp")) if modules is None else \
        [(m, plan) for m in modules(model)]
    for m, p in pairs:
        parallelize_module(m, tp_mesh, p)
    if dp > 1:
        from dpcompile.compat import dtensor_takes_unbacked_batch

        if not dtensor_takes_unbacked_batch():  # torch 2.11: refused before anything is sharded
            try:
                shard_like_a_user(model, mesh["dp"])
                refused = "no error"
            except ValueError as e:
                refused = str(e)
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump({"refused": refused}, f)
            _finish()
            return
        shard_like_a_user(model, mesh["dp"])

    def step(x, y):
        loss = loss_fn(model(x), y).mean()
        loss.backward()
        return loss.detach()

    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=ebs, schedule=schedule,
                                  compiler=compiler)
    torch.compile(step, backend=backend)(mine, mine)
    kinds = {}  # what each gradient is on a tp rank, by its DTensor placement on the tp mesh (not the parameter's)
    for name, p in model.named_parameters():
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(full.double(), ref[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
        pl = p.grad.placements[-1] if isinstance(p.grad, DTensor) and p.grad.device_mesh.ndim == 2 or \
            isinstance(p.grad, DTensor) and dp == 1 else None
        kinds[name] = "plain" if pl is None else "shard" if pl.is_shard() else "partial" if pl.is_partial() \
            else "replicate"
    rec = [r for r in backend.compiled if r.dp][0]
    # the norm all-reduce (a [B] vector, or [B, 1 + n] with partial gradients' per-sample parts) and the
    # backward's ops between its issue and its wait: what it runs under
    (_, norm_shape), under = rec.norm_all_reduce_window()
    clean = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters()}

    sigma = 2.0
    torch._dynamo.reset()
    noisy = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=ebs, schedule=schedule,
                                compiler=compiler)  # no seed: the ranks take rank 0's
    model.zero_grad(set_to_none=True)
    torch.compile(step, backend=noisy)(mine, mine)
    noise = {n: ((p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) - clean[n]).flatten().tolist()
             for n, p in model.named_parameters()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"counters": dict(rec.counters), "tp_summary": rec.summary.get("tensor_parallel"),
                   "under_norm_all_reduce": [op for op, _ in under], "norm_all_reduce": [str(s) for s in norm_shape],
                   "kinds": kinds, "noise": noise, "std": sigma * C / ebs, "batch": len(mine), "dp_rank": dp_rank,
                   "tp_rank": tp_mesh.get_local_rank()}, f)
    _finish()


def restart(rank, world, init_file, out_dir, layout, schedule, run):
    """Two noisy steps (a fixed noise seed) of a GPT sharded with dpcompile.fully_shard (batches of 3 and 5) or
    parallelized over a 1-D tp mesh (the same batch on both ranks), through Inductor with the caches on, in a
    fresh process: how each compile was served and the gradients (run = the file name's tag)."""
    import json

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _init(rank, world, init_file)
    model, loss_fn, vocab = make("gpt")
    ids = torch.randint(0, vocab, (8, 6), generator=torch.Generator().manual_seed(1))
    if layout == "fsdp":
        mine = ids[:3] if rank == 0 else ids[3:]
        shard(model, mesh)
    else:
        mine = ids[:4]
        modules, plan = _tp_plan("gpt")
        for m in modules(model):
            parallelize_module(m, mesh, plan)

    def step(x, y):
        loss = loss_fn(model(x), y).mean()
        loss.backward()
        return loss.detach()

    backend = dpcompile.DPBackend(max_grad_norm=0.05, noise_multiplier=1.0, expected_batch_size=8, seed=7,
                                  schedule=schedule)
    compiled = torch.compile(step, backend=backend)
    for _ in range(2):  # the second step saves the record again: the lazily compiled backward counts into it
        compiled(mine, mine)
    local = lambda g: g.to_local() if isinstance(g, DTensor) else g  # noqa: E731
    rec = [r for r in backend.compiled if r.dp]
    with open(os.path.join(out_dir, f"{run}{rank}.json"), "w") as f:
        json.dump({"cache": [r.cache for r in rec], "counters": [r.counters for r in rec],
                   "streams": [r.noise_index_ranks for r in rec],
                   "grads": {n: local(p.grad).flatten().tolist() for n, p in model.named_parameters()}}, f)
    _finish()


def mixed_precision_casts(rank, world, init_file, out_dir):
    """tests/test_fsdp.py: MixedPrecisionPolicy casts a sharded module's floating inputs to param_dtype and its
    outputs to output_dtype, as FSDP2's does; the DP step of such a model runs with fp32 images."""
    import json

    mesh = _init(rank, world, init_file)
    seen = {}

    def conv_model(mp):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.GroupNorm(2, 4), torch.nn.Flatten(),
                                    torch.nn.Linear(4 * 6 * 6, 3))
        model[0].register_forward_pre_hook(lambda m, a: seen.__setitem__("conv_input", str(a[0].dtype)))
        dpcompile.fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
    report = {}
    model = conv_model(dpcompile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    report["output"] = str(model(x).dtype)
    report["conv_input"] = seen["conv_input"]
    try:
        conv_model(dpcompile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False))(x)
        report["uncast"] = "no error"
    except RuntimeError as e:
        report["uncast"] = str(e)

    @dpcompile.private_step(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, compiler="eager")
    def step(x, y):
        loss = M.ce(model(x), y).mean()
        loss.backward()
        return loss.detach()

    step(x, y)
    report["grads"] = {n: [str(p.grad.dtype), bool(p.grad.to_local().abs().sum() > 0)]
                       for n, p in model.named_parameters()}
    with open(os.path.join(out_dir, f"mp{rank}.json"), "w") as f:
        json.dump(report, f)
    _finish()


def eager_guard(rank, world, init_file, out_dir):
    """tests/test_eager_guard.py: a model a DP graph trains refuses gradients from an eager run of its step, on
    every rank (world 1: one process, unsharded)."""
    import json

    mesh = _init(rank, world, init_file) if world > 1 else None
    report = eager_guard_report(mesh)
    with open(os.path.join(out_dir, f"guard{rank}.json"), "w") as f:
        json.dump(report, f)
    if world > 1:
        _finish()


def eager_guard_report(mesh, device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)
    if mesh is not None:
        dpcompile.fully_shard(model, mesh=mesh)

    def step(x, y):
        loss = M.ce(model(x), y).mean()
        loss.backward()
        return loss.detach()

    compiled = torch.compile(step, backend="dp_fsdp", options=dict(
        max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=4, compiler="eager"))
    x, y = torch.randn(4, 5, device=device), torch.randint(0, 3, (4,), device=device)
    report = {"limit_fails": torch._dynamo.config.fail_on_recompile_limit_hit}
    with dpcompile.accumulate():  # micro-batches: each backward delivers its DP graph's gradient
        compiled(x[:2], y[:2])
    compiled(x[2:], y[2:])
    report["dp_grads"] = all(p.grad is not None for p in model.parameters())
    report["limit_fails"] = [report["limit_fails"], torch._dynamo.config.fail_on_recompile_limit_hit]
    try:
        step(x, y)  # the uncompiled step: plain autograd
        report["eager"] = "no error"
    except dpcompile.DPCompileError as e:
        report["eager"] = str(e)
    report["cleared"] = [p.grad is None for p in model.parameters()]
    with dpcompile.non_private():
        step(x, y)
    report["non_private"] = all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    compiled(x, y)  # DP steps go on after both
    report["dp_again"] = all(p.grad is not None for p in model.parameters())
    return report
