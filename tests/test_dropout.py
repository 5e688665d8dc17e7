"""Dropout in a DP step, as users train (no other test model draws random numbers): every dropout and the
per-sample drop path of models.DropoutLM, one process here, sharded in test_fsdp (dist_worker.dropout).

The oracle replays the step's draws: sample i's gradient is that of its own loss in a forward of the whole batch
with the generator seeded as the step was (reference.replayed_per_sample_gradients), so the step must draw the
masks of an eager forward of its batch and use the same mask in its backward (saved, not drawn again: ghost's
second backward included, forced here to recompute what it can). Inductor draws with its own generator unless
told to fall back to torch's random ops (``fallback_random``), which the Inductor runs set; op by op the step
draws with torch's ops."""
import pytest
import torch
import torch.nn.functional as F

import dpcompile
import models as M
from helpers import compile_step
from reference import clip_and_sum, replayed_per_sample_gradients
from tiers import extended

VOCAB = 13


def token_ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


def replayed_reference(model, x, y, seed, C, ebs):
    """(clipped float64 gradient dict, per-sample norms) of the step seeded ``seed`` on (x, y)."""
    g = replayed_per_sample_gradients(model, token_ce, (x,), (y,), seed=seed)
    if len(x) == 0:
        return {k: torch.zeros(v.shape[1:], dtype=torch.float64) for k, v in g.items()}, torch.zeros(0)
    return clip_and_sum(g, max_grad_norm=C, expected_batch_size=ebs)


def check_steps(model, step, batches, C, ebs, unbacked):
    """Each (seed, x, y): the step seeded alike against the oracle; how many samples were clipped and not."""
    clipped = unclipped = 0
    for seed, x, y in batches:
        if unbacked:
            dpcompile.mark_batch(x, y)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        step((x,), (y,))
        ref, norms = replayed_reference(model, x, y, seed, C, ebs)
        clipped, unclipped = clipped + int((norms > C).sum()), unclipped + int((norms < C).sum())
        for name, p in model.named_parameters():
            tol = 1e-7 + 1e-6 * float(ref[name].abs().max())
            torch.testing.assert_close(p.grad.double(), ref[name], rtol=1e-5, atol=tol,
                                       msg=lambda m: f"B={len(x)} seed {seed} {name}: {m}")
    return clipped, unclipped


def batches_of(sizes, T=5):
    g = torch.Generator().manual_seed(0)
    return [(100 + i, torch.randint(0, VOCAB, (b, T), generator=g), torch.randint(0, VOCAB, (b, T), generator=g))
            for i, b in enumerate(sizes)]


@pytest.mark.parametrize("schedule,compiler,unbacked", [
    ("bk", "eager", False), ("ghost", "eager", False),
    # Inductor's code with an unbacked batch: the masks' shapes ([u0, 1, 1] drop path, [u0, d, 1] channels) too
    # (ghost's: the extended tier, tests/tiers.py; the default tier runs ghost op by op and the masks through
    # Inductor with bk)
    ("bk", "inductor", True), pytest.param("ghost", "inductor", True, marks=extended)])
def test_dropout_matches_the_replayed_reference(schedule, compiler, unbacked, monkeypatch):
    from dpcompile.passes import second_backward_recompute as SBR

    monkeypatch.setattr(SBR, "RECOMPUTE_MIN_BYTES", 1)  # ghost's second backward recomputes what it can
    monkeypatch.setattr(SBR, "RECOMPUTE_MIN_RATIO", 1)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = M.DropoutLM(VOCAB).double().train()
    batches = batches_of([5, 3, 0] if unbacked else [6, 4])
    seed, x, y = batches[0]
    _, norms = replayed_reference(model, x, y, seed, 1.0, 8)
    C = float(norms.median())
    step, backend = compile_step(model, token_ce, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=8,
                                 schedule=schedule, compiler=compiler)
    with torch._inductor.config.patch(fallback_random=True):
        clipped, unclipped = check_steps(model, step, batches, C, 8, unbacked)
    assert clipped and unclipped, (clipped, unclipped)
    records = [r for r in backend.compiled if r.dp]
    assert len(records) == 1 or not unbacked, records  # unbacked: one graph for every batch
    if schedule == "ghost":  # what it recomputes draws nothing: the masks are saved, not drawn again
        assert all(r.counters.get("second_backward_recomputed_contractions", 0) >= 1 for r in records)


def test_the_masks_differ_between_samples_and_steps():
    """The premise of the oracle: the step draws, and a sample's gradient depends on the draw (with the
    seed of another step the reference differs), so a step that dropped nothing or drew once per batch fails."""
    torch.manual_seed(0)
    model = M.DropoutLM(VOCAB).double().train()
    (seed, x, y), = batches_of([4])
    a = replayed_per_sample_gradients(model, token_ce, (x,), (y,), seed=seed)
    b = replayed_per_sample_gradients(model, token_ce, (x,), (y,), seed=seed + 1)
    assert not torch.allclose(a["fc.weight"], b["fc.weight"])
    model.eval()
    c = replayed_per_sample_gradients(model, token_ce, (x,), (y,), seed=seed)
    d = replayed_per_sample_gradients(model, token_ce, (x,), (y,), seed=seed + 1)
    torch.testing.assert_close(c, d)  # in eval mode nothing is drawn
