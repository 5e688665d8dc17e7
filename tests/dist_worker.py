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


def _init(rank, world, init_file):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def make(case):
    torch.manual_seed(0)
    if case == "gpt":
        return M.GPT(d=8, n_head=2, n_layer=2), M.seq_ce, 13
    if case == "llama":
        return M.LlamaLM(), M.seq_ce, 13
    raise ValueError(case)


def shard(model, mesh, reshard_after_forward=True):
    blocks = getattr(model, "blocks", None) or [model.block]
    for b in blocks:
        dpcompile.fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward)
    dpcompile.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def correctness(rank, world, init_file, case, schedule, sizes, reshard_after_forward):
    mesh = _init(rank, world, init_file)
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

    torch.compile(step, backend=backend)(local, local)
    for name, p in model.named_parameters():
        assert isinstance(p.grad, torch.distributed.tensor.DTensor), name
        full = p.grad.full_tensor()
        torch.testing.assert_close(full.double(), ref[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    rec = [r for r in backend.compiled if r.dp][0]
    return rec.counters, rec.ops
