"""dpcompile.compile_gc: Python's full garbage collections held off while dp_fsdp compiles a step (pause_gc)."""
import gc

import pytest
import torch
import torch._functorch.partitioners as partitioners
import torch._dynamo.symbolic_convert as symbolic_convert
import torch._inductor.compile_fx as inductor_compile
from torch._inductor.utils import fresh_cache

import dpcompile
import models as M
from helpers import compile_step

from dpcompile.compile_gc import full_collections_held, hold_full_collections


def test_a_hold_leaves_the_collector_as_it_found_it():
    before = gc.get_threshold()
    assert gc.isenabled() and not full_collections_held()
    with pytest.raises(RuntimeError, match="inside"):
        with hold_full_collections():
            assert full_collections_held() and gc.get_threshold()[:2] == before[:2]  # young collections run
            with hold_full_collections():
                assert full_collections_held()
            assert full_collections_held(), "a nested hold ended the outer one"
            raise RuntimeError("inside")
    assert gc.get_threshold() == before, "an exception inside the hold left full collections off"
    with hold_full_collections(False):
        assert not full_collections_held()
    with hold_full_collections():  # thresholds set inside stand
        gc.set_threshold(500, 5, 5)
    assert gc.get_threshold() == (500, 5, 5)
    gc.set_threshold(*before)
    gc.disable()  # the user's own choice
    try:
        with hold_full_collections():
            assert not gc.isenabled() and gc.get_threshold() == before
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("batch", ["static", "unbacked"])
def test_the_trace_passes_and_inductor_run_with_full_collections_held_unless_told_not_to(monkeypatch, batch):
    """Dynamo's trace of the step, the partition (dpcompile's passes run in it) and every graph Inductor
    generates code for run with full collections held off: the backward too, which AOTAutograd compiles at the
    first backward for a static batch and with the forward for an unbacked one (its sizes saved for the
    backward). They are back after the step; pause_gc=False leaves them on throughout; the gradients are the
    same bits either way."""
    seen: list[tuple[str, bool]] = []
    partition, codegen = partitioners.min_cut_rematerialization_partition, inductor_compile.fx_codegen_and_compile

    def spied_partition(*args, **kwargs):
        seen.append(("partition", full_collections_held()))
        return partition(*args, **kwargs)

    def spied_codegen(*args, **kwargs):
        seen.append(("inductor", full_collections_held()))
        return codegen(*args, **kwargs)

    trace = symbolic_convert.InstructionTranslator.run

    def spied_trace(self, *args, **kwargs):
        seen.append(("dynamo", full_collections_held()))
        return trace(self, *args, **kwargs)

    monkeypatch.setattr(symbolic_convert.InstructionTranslator, "run", spied_trace)
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
        assert gc.isenabled() and not full_collections_held()
        assert [r for r in backend.compiled if r.dp], "no DP compile"
        where = [w for w, _ in seen]
        assert where.count("partition") == 1 and where.count("inductor") >= 2 and "dynamo" in where, seen
        assert all(held is pause for _, held in seen), (pause, seen)
        grads[pause] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


def test_pause_gc_is_checked():
    with pytest.raises(ValueError, match="pause_gc must be True or False"):
        dpcompile.DPConfig(max_grad_norm=1.0, noise_multiplier=1.0, pause_gc="yes")
