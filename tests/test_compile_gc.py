"""dpcompile.compile_gc: Python's collector paused while dp_fsdp compiles a step (the pause_gc option)."""
import gc

import pytest
import torch
import torch._functorch.partitioners as partitioners
import torch._inductor.compile_fx as inductor_compile
from torch._inductor.utils import fresh_cache

import dpcompile
import models as M
from helpers import compile_step

from dpcompile.compile_gc import gc_paused


def test_a_pause_leaves_the_collector_as_it_found_it():
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled(), "a nested pause turned the collector back on inside the outer one"
            raise RuntimeError("inside")
    assert gc.isenabled(), "an exception inside the pause left the collector off"
    with gc_paused(False):
        assert gc.isenabled()
    gc.disable()  # the user's own choice
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the pause turned on a collector the user had turned off"
    finally:
        gc.enable()


@pytest.mark.parametrize("batch", ["static", "unbacked"])
def test_the_passes_and_both_inductor_compiles_run_with_the_collector_paused_unless_asked_not_to(monkeypatch, batch):
    """The partition (dpcompile's passes run in it) and every graph Inductor generates code for see the
    collector off: the backward too, which AOTAutograd compiles at the first backward for a static batch and
    with the forward for an unbacked one (its sizes saved for the backward). It is on again after the step;
    pause_gc=False leaves it on throughout; the gradients are the same bits either way."""
    seen: list[tuple[str, bool]] = []
    partition, codegen = partitioners.min_cut_rematerialization_partition, inductor_compile.fx_codegen_and_compile

    def spied_partition(*args, **kwargs):
        seen.append(("partition", gc.isenabled()))
        return partition(*args, **kwargs)

    def spied_codegen(*args, **kwargs):
        seen.append(("inductor", gc.isenabled()))
        return codegen(*args, **kwargs)

    monkeypatch.setattr(partitioners, "min_cut_rematerialization_partition", spied_partition)
    monkeypatch.setattr(inductor_compile, "fx_codegen_and_compile", spied_codegen)
    grads = {}
    for pause in (True, False):
        torch._dynamo.reset()
        seen.clear()
        torch.manual_seed(0)
        model = M.MLP()
        x, y = torch.randn(6, 5) * 3, torch.randint(0, 3, (6,))
        if batch == "unbacked":
            dpcompile.mark_batch(x, y)
        step, backend = compile_step(model, M.ce, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=6,
                                     pause_gc=pause)
        with fresh_cache():  # Inductor generates the code (a cache hit would skip it)
            step((x,), (y,))
        assert gc.isenabled()
        assert [r for r in backend.compiled if r.dp], "no DP compile"
        assert [w for w, _ in seen].count("partition") == 1 and [w for w, _ in seen].count("inductor") >= 2, seen
        assert all(on is not pause for _, on in seen), (pause, seen)
        grads[pause] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


def test_pause_gc_is_checked():
    with pytest.raises(ValueError, match="pause_gc must be True or False"):
        dpcompile.DPConfig(max_grad_norm=1.0, noise_multiplier=1.0, pause_gc="yes")
