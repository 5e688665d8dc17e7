"""Multi-rank test bodies, run in spawned gloo processes (see test_fsdp.py)."""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dpcompile
import models as M
from reference import dp_reference


def _init(rank, world, init_file, mesh_shape=None):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return init_device_mesh("cpu", tuple(mesh_shape or (world,)))


def make(case):
    torch.manual_seed(0)
    if case == "gpt":
        return M.GPT(d=8, n_head=2, n_layer=2), M.seq_ce, 13
    if case == "llama":
        return M.LlamaLM(), M.seq_ce, 13
    if case == "gpt_odd":  # widths 12, 36, 48 and vocab 13: unaligned for the padding tests
        return M.GPT(d=12, n_head=2, n_layer=1), M.seq_ce, 13
    raise ValueError(case)


def shard(model, mesh, reshard_after_forward=True):
    blocks = getattr(model, "blocks", None) or [model.block]
    for b in blocks:
        dpcompile.fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward)
    dpcompile.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def correctness(rank, world, init_file, case, schedule, sizes, reshard_after_forward, out_dir=None,
                mesh_shape=None, pad_contractions=False, bucket_mb=None, overlap=False):
    mesh = _init(rank, world, init_file, mesh_shape)
    if bucket_mb:  # Inductor's collective bucketing, as a user would turn it on
        dpcompile.bucket_collectives(bucket_mb, overlap=overlap)
    if pad_contractions:  # the CUDA padding rule, forced on for CPU float32
        from dpcompile.passes import aligned_contractions

        aligned_contractions.PAD_DEVICES = ("cpu",)
        aligned_contractions.ALIGNMENT = {torch.float32: 8}
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
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=ebs, schedule=schedule)

    def step(x, y):
        loss = loss_fn(model(x), y).mean()
        loss.backward()
        return loss.detach()

    dpcompile.mark_batch(local)
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
    counts = {
        phase: {kind: sum(kind in op for op, _ in rec.ops[phase]) for kind in ("reduce_scatter", "all_gather")}
        for phase in ("forward", "backward")
    }
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    n_linear = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    if out_dir:
        import json

        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"counts": counts, "n_params": n_params, "n_linear": n_linear, "counters": rec.counters,
                       "summary_collectives": rec.summary["collectives"], "issued": issued}, f)
    dist.destroy_process_group()


def uneven_steps(rank, world, init_file, case, schedule, steps, out_dir, private_step=False):
    """Several steps with per-rank batch sizes that change, zero and one included.

    Every rank must run one compiled graph (the same collectives whatever its
    batch); each step's gradient equals the reference on the concatenation.
    """
    import json

    mesh = _init(rank, world, init_file)
    model, loss_fn, vocab = make(case)
    ref_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (sum(sizes), 6), generator=g) for sizes in steps]
    _, norms = dp_reference(ref_model, loss_fn, (batches[0],), (batches[0],), max_grad_norm=1.0,
                            expected_batch_size=8)
    C = float(norms.median())
    shard(model, mesh)
    options = dict(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=8, schedule=schedule)

    def step(x, y):
        loss = loss_fn(model(x), y).mean()
        loss.backward()
        return loss.detach()

    if private_step:
        compiled = dpcompile.private_step(**options)(step)
        backend = compiled.dp_backend
    else:
        backend = dpcompile.DPBackend(**options)
        compiled = torch.compile(step, backend=backend)
    clipped = unclipped = 0
    for sizes, ids in zip(steps, batches):
        lo = sum(sizes[:rank])
        local = ids[lo: lo + sizes[rank]].clone()  # a fresh batch, as a data loader gives
        model.zero_grad(set_to_none=True)
        if not private_step:
            dpcompile.mark_batch(local)
        compiled(local, local)
        if len(ids):
            ref, n = dp_reference(ref_model, loss_fn, (ids,), (ids,), max_grad_norm=C, expected_batch_size=8)
            clipped += int((n > C).sum())
            unclipped += int((n < C).sum())
        for name, p in model.named_parameters():
            full = p.grad.full_tensor().double()
            want = ref[name] if len(ids) else torch.zeros_like(full)
            torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{sizes} {name}: {m}")
    dp_graphs = [r for r in backend.compiled if r.dp]
    with open(os.path.join(out_dir, f"uneven{rank}.json"), "w") as f:
        json.dump({"dp_graphs": len(dp_graphs), "batch_size": dp_graphs[0].summary["batch_size"],
                   "counters": dp_graphs[0].counters, "clipped": clipped, "unclipped": unclipped}, f)
    dist.destroy_process_group()


def noise(rank, world, init_file, out_dir, seed):
    """Noiseless and noisy steps on identical data; saves this rank's noise draws (full gradients)."""
    mesh = _init(rank, world, init_file)
    model, loss_fn, vocab = make("gpt")
    shard(model, mesh)
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(rank))

    def run(sigma, steps):
        backend = dpcompile.DPBackend(max_grad_norm=0.5, noise_multiplier=sigma, expected_batch_size=4, seed=seed)

        def step(x, y):
            loss = loss_fn(model(x), y).mean()
            loss.backward()
            return loss.detach()

        compiled = torch.compile(step, backend=backend)
        outs = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            dpcompile.mark_batch(ids)
            compiled(ids, ids)
            outs.append(torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]))
            # this rank's own shard, to compare draws across ranks
        local = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        return torch.stack(outs), local

    clean, clean_local = run(0.0, 1)
    torch._dynamo.reset()
    noisy, noisy_local = run(2.0, 30)
    local = {n: noisy_local[n] - clean_local[n] for n in noisy_local}
    torch.save({"z": noisy - clean, "local": local}, os.path.join(out_dir, f"noise{rank}.pt"))
    dist.destroy_process_group()


def hybrid_noise(rank, world, init_file, out_dir):
    """2x2 mesh: replicas of a shard draw the same noise, shards draw different noise."""
    mesh = _init(rank, world, init_file, (2, 2))
    model, loss_fn, vocab = make("gpt")
    shard(model, mesh)
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(rank))

    def draw(sigma):
        torch._dynamo.reset()
        step = dpcompile.private_step(max_grad_norm=0.5, noise_multiplier=sigma, expected_batch_size=8, seed=5,
                                      schedule="ghost")(lambda x, y: loss_fn(model(x), y).mean().backward())
        model.zero_grad(set_to_none=True)
        step(ids, ids)
        return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}

    clean, noisy = draw(0.0), draw(3.0)
    torch.save({n: noisy[n] - clean[n] for n in clean}, os.path.join(out_dir, f"hnoise{rank}.pt"))
    dist.destroy_process_group()


def bad_inputs(rank, world, init_file, out_dir):
    """Partly sharded models and mixed meshes are refused with a clear error."""
    import json

    mesh = _init(rank, world, init_file)
    results = {}
    model, loss_fn, vocab = make("gpt")
    dpcompile.fully_shard(model.blocks[0], mesh=mesh)  # root and blocks[1] left unsharded
    ids = torch.randint(0, vocab, (2, 6))
    backend = dpcompile.DPBackend(max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=4)

    def step(x, y):
        loss = loss_fn(model(x), y).mean()
        loss.backward()
        return loss.detach()

    try:
        torch.compile(step, backend=backend)(ids, ids)
        results["partial"] = "no error"
    except ValueError as e:
        results["partial"] = str(e)
    # blocks on one mesh, the root on another
    torch._dynamo.reset()
    model, loss_fn, vocab = make("gpt")
    other = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        dpcompile.fully_shard(b, mesh=mesh)
    dpcompile.fully_shard(model, mesh=other)
    try:
        torch.compile(step, backend=backend)(ids, ids)
        results["two_meshes"] = "no error"
    except ValueError as e:
        results["two_meshes"] = str(e)
    with open(os.path.join(out_dir, f"bad{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def unmarked_batch(rank, world, init_file, out_dir):
    """A sharded step compiled without mark_batch is refused on every rank (rank 1 has no samples)."""
    import json

    mesh = _init(rank, world, init_file)
    model, loss_fn, vocab = make("gpt")
    shard(model, mesh)
    backend = dpcompile.DPBackend(max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=4)

    def step(x, y):
        loss = loss_fn(model(x), y).mean()
        loss.backward()
        return loss.detach()

    ids = torch.randint(0, vocab, (2 if rank == 0 else 0, 6))
    try:
        torch.compile(step, backend=backend)(ids, ids)
        err = "no error"
    except ValueError as e:
        err = str(e)
    with open(os.path.join(out_dir, f"unmarked{rank}.json"), "w") as f:
        json.dump({"error": err}, f)
    dist.destroy_process_group()


def correctness_nccl_bf16(rank, world, init_file, out_dir):
    """2 or 4 GPUs, NCCL, bf16 compute with fp32 parameters and reduction, against the fp64 reference."""
    import json

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world,))
    results = {}
    for case in ("gpt", "llama"):
        for schedule in ("bk", "ghost"):
            torch._dynamo.reset()
            model, loss_fn, vocab = make(case)
            ref_model = copy.deepcopy(model)
            sizes = {2: [3, 1], 4: [3, 2, 0, 1]}[world]  # an empty rank and a one-sample rank
            ebs = sum(sizes) + 1
            ids = torch.randint(0, vocab, (sum(sizes), 6), generator=torch.Generator().manual_seed(1))
            _, norms = dp_reference(ref_model, loss_fn, (ids,), (ids,), max_grad_norm=1.0, expected_batch_size=ebs)
            C = float(norms.median())
            ref, _ = dp_reference(ref_model, loss_fn, (ids,), (ids,), max_grad_norm=C, expected_batch_size=ebs)
            model = model.cuda()
            mp = dpcompile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for b in (getattr(model, "blocks", None) or [model.block]):
                dpcompile.fully_shard(b, mesh=mesh, mp_policy=mp)
            dpcompile.fully_shard(model, mesh=mesh, mp_policy=mp)
            backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=ebs,
                                          schedule=schedule)

            def step(x, y):
                loss = loss_fn(model(x).float(), y).mean()
                loss.backward()
                return loss.detach()

            local = ids[sum(sizes[:rank]): sum(sizes[: rank + 1])].cuda()
            dpcompile.mark_batch(local)
            torch.compile(step, backend=backend)(local, local)
            worst = 0.0
            for name, p in model.named_parameters():
                full = p.grad.full_tensor().double().cpu()
                assert p.grad.dtype == torch.float32, (name, p.grad.dtype)
                scale = ref[name].abs().max().item() + 1e-12
                err = (full - ref[name]).abs().max().item() / scale
                worst = max(worst, err)
                assert err < 0.05, (case, schedule, name, err)
            results[f"{case}-{schedule}"] = worst
    if rank == 0:
        with open(os.path.join(out_dir, f"nccl_bf16_{world}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def checkpoint(rank, world, init_file, out_dir):
    """Save with torch.distributed.checkpoint after a step, load into a fresh sharded model, continue."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _init(rank, world, init_file)
    ids = torch.randint(0, 13, (6, 6), generator=torch.Generator().manual_seed(7))
    local = ids[3 * rank: 3 * rank + 3]

    def fresh():
        torch._dynamo.reset()
        model, loss_fn, _ = make("gpt")
        shard(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        backend = dpcompile.DPBackend(max_grad_norm=0.5, noise_multiplier=0.7, expected_batch_size=6, seed=11)

        def step(x, y):
            loss = loss_fn(model(x), y).mean()
            loss.backward()
            return loss.detach()

        return model, opt, backend, torch.compile(step, backend=backend)

    def train(model, opt, step, n):
        losses = []
        for _ in range(n):
            dpcompile.mark_batch(local)
            losses.append(float(step(local, local)))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses

    # uninterrupted: 3 steps
    model, opt, backend, step = fresh()
    straight = train(model, opt, step, 3)
    final = {k: v.full_tensor() for k, v in model.state_dict().items()}
    # interrupted: 1 step, save, new objects, load, 2 steps
    model, opt, backend, step = fresh()
    first = train(model, opt, step, 1)
    msd, osd = get_state_dict(model, opt)
    ckpt = os.path.join(out_dir, "ckpt")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    torch.save(backend.state_dict(), os.path.join(out_dir, f"noise_state{rank}.pt"))
    model, opt, backend, step = fresh()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    backend.load_state_dict(torch.load(os.path.join(out_dir, f"noise_state{rank}.pt")))
    resumed = first + train(model, opt, step, 2)
    worst = max((final[k] - v.full_tensor()).abs().max().item() for k, v in model.state_dict().items())
    if rank == 0:
        with open(os.path.join(out_dir, "ckpt.json"), "w") as f:
            json.dump({"straight": straight, "resumed": resumed, "worst_param_diff": worst}, f)
    dist.destroy_process_group()
