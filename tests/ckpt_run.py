"""A small private training run that checkpoints and resumes (tests/test_checkpoint.py).

    python tests/ckpt_run.py DIR STEPS [--die-saving-at T] [--hold-after T]

Trains a GPT on Poisson batches (micro-batches of at most 3, accumulated), Adam, noise on, the
accountant stepped once per logical step, a checkpoint every 2 steps in DIR/ckpt; resumes from the
newest checkpoint there. Prints "step t" after each logical step; at the end writes DIR/final.pt
(parameters, epsilon, noise stream position). ``--die-saving-at T`` kills the process (os._exit) in
the middle of the save of step T, after the model files are written and before the commit.
``--hold-after T`` stops after printing "step T" and waits to be killed: a SIGKILL sent on that line
lands there, however slow the reader (on a loaded 2-core machine the run went on into step T+1's save).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dpcompile  # noqa: E402
import models as M  # noqa: E402

N, RATE, SEED = 40, 0.2, 7


def train(directory, steps, mesh=None, die_saving_at=None, log=print, compiler="inductor", hold_after=None):
    torch.manual_seed(0)
    model = M.GPT(d=8, n_head=2, n_layer=1)
    rank, world = 0, 1
    if mesh is not None:
        rank, world = mesh.get_rank(), mesh.size()
        for b in model.blocks:
            dpcompile.fully_shard(b, mesh=mesh)
        dpcompile.fully_shard(model, mesh=mesh)
    data = torch.randint(0, 13, (N, 6), generator=torch.Generator().manual_seed(1))
    sampler = dpcompile.PoissonBatchSampler(N, sample_rate=RATE, steps=steps, seed=SEED, rank=rank, world_size=world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    accountant = dpcompile.PrivacyAccountant(noise_multiplier=1.0, sample_rate=RATE)

    # a backend of its own: backends from equal options are shared, and so is their noise stream
    backend = dpcompile.DPBackend(max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=RATE * N, seed=11,
                                  compiler=compiler)

    def train_step(x):
        loss = M.seq_ce(model(x), x).mean()
        loss.backward()
        return loss.detach()

    step = torch.compile(train_step, backend=backend)
    ckpt = dpcompile.Checkpointer(os.path.join(directory, "ckpt"), model=model, optimizer=opt, backend=backend,
                                  accountant=accountant, sampler=sampler)
    if die_saving_at is not None:
        import dpcompile.checkpoint as C

        write = C.atomic_write_json

        def dying_write(path, obj):
            if os.path.basename(path) == "run.json" and obj["step"] == die_saving_at:
                os._exit(9)  # the model, optimizer and noise files are written; nothing is committed
            write(path, obj)

        C.atomic_write_json = dying_write
    state = ckpt.restore()
    t = state["step"] if state else 0
    log(f"resumed at {t}" if state else "fresh run")
    for idx, last in sampler.micro_batches(3):
        x = data[idx]
        dpcompile.mark_batch(x)  # one graph for every micro-batch size: the test's time is not compile time
        with dpcompile.accumulate(enabled=not last):
            step(x)
        if last:
            opt.step()
            opt.zero_grad(set_to_none=True)
            accountant.step()
            t += 1
            log(f"step {t}")
            if t == hold_after:
                while True:
                    time.sleep(60)
            if t % 2 == 0:
                ckpt.save(t, extra={"at": t})
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    return {"params": params, "epsilon": accountant.epsilon(1e-5), "noise_step": backend.noise.step,
            "accountant_steps": accountant.steps, "t": t}


if __name__ == "__main__":
    import ci_time

    ci_time.install()  # as in the test processes (CI time: ci_time.py)
    torch.set_num_threads(1)  # the same float sums in every run
    directory, steps = sys.argv[1], int(sys.argv[2])
    opts = dict(zip(sys.argv[3::2], (int(v) for v in sys.argv[4::2])))
    out = train(directory, steps, die_saving_at=opts.get("--die-saving-at"), hold_after=opts.get("--hold-after"),
                log=lambda s: print(s, flush=True))
    torch.save(out, os.path.join(directory, "final.pt"))
