"""Run one DP step through the backend and compare with the vmap oracle."""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import torch

import dpcompile
from reference import clip_and_sum, dp_reference, per_sample_gradients

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # (major, minor)


def compile_step(model, per_sample_loss, *, reduction="mean", whole_step=True, **options):
    """A DP step of ``model`` and its backend. ``whole_step``: the step as users write it, ``loss.backward()``
    inside the compiled function; else only the forward and loss are compiled and the step calls
    ``loss.backward()`` on the compiled loss. The DP graph is the same either way (dynamo ends the whole step's
    graph at ``loss.backward()`` with the loss as its output; test_graphs checks that), but dynamo traces the
    whole step's forward twice (it restarts the frame at the break) and compiles the non-DP rest after it: about
    40% of an op-by-op compile of gpt, llama or hf_gpt2 here (CI time; BENCHMARKS.md, eighty-first section)."""
    backend = dpcompile.DPBackend(**options)
    # the two functions spelled alike: dynamo names the graph's inputs and nodes after what the code reads

    def step(inputs, targets):
        per_sample = per_sample_loss(model(*inputs), *targets)
        loss = per_sample.mean() if reduction == "mean" else per_sample.sum()
        loss.backward()
        return loss.detach()

    def loss_of(inputs, targets):
        per_sample = per_sample_loss(model(*inputs), *targets)
        loss = per_sample.mean() if reduction == "mean" else per_sample.sum()
        return loss

    if whole_step:
        return torch.compile(step, backend=backend), backend
    compiled_loss = torch.compile(loss_of, backend=backend)

    def loss_step(inputs, targets):
        loss = compiled_loss(inputs, targets)
        loss.backward()
        return loss.detach()

    return loss_step, backend


def check_against_reference(model, per_sample_loss, inputs, targets, *, schedule, reduction="mean",
                            rtol=1e-5, atol=1e-7, oracle=None, **extra):
    """Picks C so that clipping is active (some samples above C, some below when B > 1). ``oracle``: the model
    the reference runs instead of ``model``, the same function with the same parameter names (a form of the
    layer that vmap can run)."""
    B = inputs[0].shape[0]
    ref_model = model if oracle is None else oracle
    grads = per_sample_gradients(ref_model, per_sample_loss, inputs, targets)  # one oracle call for both sums
    _, norms = clip_and_sum(grads, max_grad_norm=1.0, reduction=reduction, expected_batch_size=B)
    finite = norms[norms.isfinite()]
    # both sides drop a sample whose gradient is not finite: with every one dropped the check compares nothing
    assert len(finite) or B == 0, f"the reference gradient of every sample is not finite: {norms}"
    C = float(finite.median()) if len(finite) > 1 else float(finite[0]) * 0.5 if len(finite) else 1.0
    if len(finite) > 1:
        assert (norms > C).any() and (norms < C).any(), norms
    ref, _ = clip_and_sum(grads, max_grad_norm=C, reduction=reduction, expected_batch_size=B + 1)
    model.zero_grad(set_to_none=True)
    extra.setdefault("whole_step", False)  # the same DP graph, compiled faster (compile_step)
    step, backend = compile_step(model, per_sample_loss, reduction=reduction, max_grad_norm=C, noise_multiplier=0.0,
                                 expected_batch_size=B + 1, schedule=schedule, **extra)
    step(inputs, targets)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"frozen parameter {name} got a gradient"
            continue
        assert p.grad is not None, f"no gradient for {name}"
        # fp32 against fp64: an entry that is a sum with cancellation is off by ~1e-6 of the tensor's scale
        tol = atol + 1e-6 * float(ref[name].abs().max())
        torch.testing.assert_close(p.grad.double(), ref[name], rtol=rtol, atol=tol, msg=lambda m: f"{name}: {m}")
    return backend


def check_batches_against_reference(model, per_sample_loss, step, batches, *, max_grad_norm, expected_batch_size,
                                    reduction="mean", nonempty=False, atol=1e-7, atol_of_largest=0.0):
    """``step`` (compile_step's) run on each ``(x, y)`` of ``batches`` with its batch dims marked
    (dpcompile.mark_batch): every gradient against the oracle, zero where the batch is empty. ``atol_of_largest``:
    added to atol in proportion to the largest reference gradient (fp32 against fp64 through deep nets).
    Returns how many samples were clipped and how many were not."""
    clipped = unclipped = 0
    for x, y in batches:
        dpcompile.mark_batch(x, y, nonempty=nonempty)
        model.zero_grad(set_to_none=True)
        step((x,), (y,))
        B, ref = len(x), {}
        if B:
            ref, norms = dp_reference(model, per_sample_loss, (x,), (y,), max_grad_norm=max_grad_norm,
                                      reduction=reduction, expected_batch_size=expected_batch_size)
            clipped += int((norms > max_grad_norm).sum())
            unclipped += int((norms < max_grad_norm).sum())
        tol = atol + atol_of_largest * max((float(r.abs().max()) for r in ref.values()), default=0.0)
        for n, p in model.named_parameters():
            want = ref[n] if B else torch.zeros_like(p, dtype=torch.float64)
            torch.testing.assert_close(p.grad.double(), want, rtol=1e-5, atol=tol, msg=lambda m: f"B={B} {n}: {m}")
    return clipped, unclipped


def check_one_graph_against_reference(model, per_sample_loss, batches, *, schedule, **options):
    """One compile of a DP step with the batch unbacked (dpcompile.mark_batch) that runs every ``(x, y)`` of
    ``batches``, each exact against the oracle, C the median per-sample norm of the first (clipping active).
    Compiling once for every batch is what a sharded step does, and what CI's time allows. Returns the backend."""
    x, y = batches[0]
    _, norms = dp_reference(model, per_sample_loss, (x,), (y,), max_grad_norm=1.0, expected_batch_size=4)
    C = float(norms.median())
    options.setdefault("whole_step", False)  # the same DP graph, compiled faster (compile_step)
    step, backend = compile_step(model, per_sample_loss, max_grad_norm=C, noise_multiplier=0.0,
                                 expected_batch_size=4, schedule=schedule, **options)
    clipped, unclipped = check_batches_against_reference(model, per_sample_loss, step, batches, max_grad_norm=C,
                                                         expected_batch_size=4, atol_of_largest=1e-6)
    assert clipped and unclipped, (clipped, unclipped)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.summary["batch_size"].startswith("u"), record.summary["batch_size"]
    return backend


def run_interpreted(script: str, *args: str) -> dict:
    """Runs tests/<script> (with args) with TRITON_INTERPRET=1 in a process of its own (the variable must be set before triton
    is imported) with this checkout's dpcompile first on the path; its JSON report."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(here)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    out = subprocess.run([sys.executable, os.path.join(here, script), *args], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def all_cpp_wrapper_codes(codes) -> bool:
    """Whether Inductor wrote every one of these generated files with its C++ wrapper (and at least one)."""
    return bool(codes) and all("cpp_wrapper" in c or 'extern "C"' in c for c in codes)


def clipped_on(device, model, loss, inputs, targets, oracle=None, **options):
    """The fp64 oracle (C = median norm, clipping active) and dp_fsdp's step on a copy of ``model`` on
    ``device``: (oracle gradients, the copy, its backend). ``oracle``: as check_against_reference's."""
    ref_model = model if oracle is None else oracle
    grads = per_sample_gradients(ref_model, loss, inputs, targets)
    _, norms = clip_and_sum(grads, max_grad_norm=1.0, expected_batch_size=4)
    C = float(norms.median())
    ref, _ = clip_and_sum(grads, max_grad_norm=C, expected_batch_size=5)
    dp = copy.deepcopy(model).to(device)
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=5, **options)

    def step(xs, ts):
        l = loss(dp(*xs).float(), *ts).mean()  # the loss in fp32 whatever the model computes in
        l.backward()
        return l.detach()

    torch.compile(step, backend=backend)(tuple(x.to(device) for x in inputs), tuple(t.to(device) for t in targets))
    return ref, dp, backend


def assert_bf16_close(model, ref):
    """Every gradient of ``model`` against the fp64 oracle with bf16 tolerances."""
    for name, p in model.named_parameters():
        want = ref[name]
        torch.testing.assert_close(p.grad.double().cpu(), want, rtol=5e-2, atol=2e-2 * float(want.abs().max()),
                                   msg=lambda m: f"{name}: {m}")


def norm_contraction_operands(graph_text: str) -> dict[str, list[str]]:
    """The operands' dtypes of each dpcompile::gram_sq_norms and aten.bmm.dtype call in a readable graph (a
    node's dtype from its definition, `name: "bf16[4, 6, 32]" = ...`)."""
    dtypes = dict(re.findall(r'^\s*(\w+): "(\w+)\[', graph_text, re.M))
    calls = re.findall(r'^\s*(\w+): "\w+\[[^"]*\]" = torch\.ops\.(?:dpcompile\.gram_sq_norms\.default|'
                       r'aten\.bmm\.dtype)\((\w+), (\w+)', graph_text, re.M)
    return {out: [dtypes.get(a), dtypes.get(b)] for out, a, b in calls}


def assert_norms_read_bf16(record) -> None:
    """The bf16 factors were not upcast: every norm contraction of a compile (the Gram kernel, a bmm
    accumulating in fp32) reads bf16 operands."""
    operands = norm_contraction_operands(record.graphs["joint_graph_after_dp"])
    assert operands and all(dtypes == ["bf16", "bf16"] for dtypes in operands.values()), operands
