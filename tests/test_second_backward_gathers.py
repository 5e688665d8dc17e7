"""Ghost's second backward gathers its parameters again (passes/second_backward_gathers): with
reshard_after_forward, no parameter the first backward gathers is held for the second."""
import pytest
import torch

import dpcompile
from dpcompile import backend as dp_backend
from dpcompile.buffer_reuse import PHASE_KEY, SECOND_BACKWARD
from dpcompile.passes import Pass
from dpcompile.passes.second_backward_gathers import COUNTER, VALUE_COUNTER, _gather_chain

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


@pytest.fixture(scope="module")
def fake_world():
    """Rank 0 of 2 on torch's fake process group (its collectives move nothing), one for the module's tests:
    a mesh outlives its group in DTensor's caches."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _compile_sharded_gpt(mesh, *, d: int, schedule: str, reshard: bool = True, disable: tuple[str, ...] = ()):
    """Compiles one step of a 2-block GPT of width d sharded as rank 0 of 2 (fake process group); its record."""
    import dist_worker
    import models as M

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = dist_worker.shard(M.GPT(d=d, n_head=2, n_layer=2), mesh, reshard)
        backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4,
                                      schedule=schedule, compiler="eager", disable_passes=disable)

        def step(x, y):
            loss = M.seq_ce(model(x), y).mean()
            loss.backward()
            return loss.detach()

        ids = torch.randint(0, 13, (3, 6))
        torch.compile(step, backend=backend)(ids, ids)
    finally:
        torch._dynamo.reset()
    (record,) = [r for r in backend.compiled if r.dp]
    return record


def _sharded_backward(monkeypatch, mesh, schedule: str, disable: tuple[str, ...] = (), reshard: bool = True,
                      d: int = 8):
    """The partitioned backward graph (after the backward passes) of the sharded GPT, and the compile's counters."""
    captured = []
    monkeypatch.setattr(dp_backend, "BACKWARD_PASSES", dp_backend.BACKWARD_PASSES + (
        Pass("capture", lambda gm, ctx: captured.append(gm) or gm),))
    record = _compile_sharded_gpt(mesh, d=d, schedule=schedule, disable=disable, reshard=reshard)
    (bw,) = captured
    return bw, record.counters


def _held(bw) -> list[str]:
    """The backward's gathers whose gathered value both backwards read (held from the first to the second)."""
    held = []
    for gather in bw.graph.find_nodes(op="call_function", target=_GATHER):
        chain = _gather_chain(gather)
        phases = {u.meta.get(PHASE_KEY) == SECOND_BACKWARD for n in chain for u in n.users if u not in chain}
        if phases == {True, False}:
            held.append(gather.name)
    return held


@pytest.mark.parametrize("schedule,disable", [("ghost", ()), ("ghost", ("second_backward_gathers",)), ("bk", ())])
def test_the_second_backward_gathers_its_own_parameters(monkeypatch, fake_world, schedule, disable):
    """Ghost: each parameter both backwards read is gathered in each (the counter counts the second's gathers),
    so none is held from the first backward to the second; with the pass disabled every one is held (the test
    can fail). bk's one backward gathers once."""
    bw, counters = _sharded_backward(monkeypatch, fake_world, schedule, disable)
    gathers = bw.graph.find_nodes(op="call_function", target=_GATHER)
    second = [g for g in gathers if g.meta.get(PHASE_KEY) == SECOND_BACKWARD]
    assert gathers, "reshard_after_forward: the backward gathers the parameters again"
    if schedule == "ghost" and not disable:
        # every Linear weight and LayerNorm weight both backwards read is gathered once in each
        assert counters[COUNTER] == len(second) >= 2 * 4, counters
        assert _held(bw) == []
    elif schedule == "ghost":  # the pass disabled: one gather, held across (what the pass exists to stop)
        assert COUNTER not in counters and second == []
        assert len(_held(bw)) >= 2 * 4
    else:  # bk: one backward, nothing to hold
        assert counters.get(COUNTER, 0) == 0 and second == [] and _held(bw) == []


def _saved_batch_values(monkeypatch, mesh, schedule: str, reshard: bool) -> tuple[list[str], dict]:
    """The shapes of the batch-sized values the forward of the sharded GPT saves for the backward, and the
    compile's counters."""
    import torch._functorch.partitioners as partitioners
    from torch.fx.experimental.symbolic_shapes import free_symbols

    saved = []
    partition = partitioners.min_cut_rematerialization_partition

    def keep(gm, joint_inputs, **kwargs):
        fw, bw = partition(gm, joint_inputs, **kwargs)
        out = fw.graph.find_nodes(op="output")[0].args[0][kwargs["num_fwd_outputs"]:]
        saved.extend(str(tuple(v.shape)) for v in (n.meta.get("val") for n in out)
                     if isinstance(v, torch.Tensor) and v.dim() and free_symbols(v.shape[0]))
        return fw, bw

    monkeypatch.setattr(partitioners, "min_cut_rematerialization_partition", keep)
    record = _compile_sharded_gpt(mesh, d=16, schedule=schedule, reshard=reshard)
    return sorted(saved), record.counters


@pytest.mark.parametrize("schedule", ["ghost", "bk"])
def test_resharding_saves_no_more_activations(monkeypatch, fake_world, schedule):
    """With reshard_after_forward=True the forward saves the same batch-sized values as with False: a
    LayerNorm's affine output, which reads a gathered weight and bias, is recomputed in the backward on every
    rank (fsdp_reshard's recomputed readers), not saved beside the LayerNorm's input (twice the activations
    per LayerNorm before)."""
    zero3, counters = _saved_batch_values(monkeypatch, fake_world, schedule, True)
    zero2, _ = _saved_batch_values(monkeypatch, fake_world, schedule, False)
    assert zero3 == zero2
    # 2 blocks x 2 LayerNorms + the final one, each a weight and a bias reader
    assert counters["reshard_readers_recomputed"] >= 2 * 5, counters


def _first_backward_values_the_second_reads(bw) -> list[str]:
    """The shapes of the values the first backward makes that the second backward reads (held across)."""
    second = {n for n in bw.graph.nodes if n.meta.get(PHASE_KEY) == SECOND_BACKWARD}
    return sorted(str(tuple(n.meta["val"].shape)) for n in bw.graph.nodes
                  if n.op == "call_function" and n not in second and any(u in second for u in n.users)
                  and isinstance(n.meta.get("val"), torch.Tensor))


def test_resharding_holds_nothing_more_across_ghost_backwards(monkeypatch, fake_world):
    """ZeRO-3 ghost's first backward hands its second backward the same values as ZeRO-2's: a value made from
    gathered parameters by pointwise ops (a LayerNorm's affine output, recomputed in the first backward), which
    ZeRO-2's second backward makes again from saved values, is made again from its own gathers (before: held
    across, 5 LayerNorm outputs more here)."""
    # width 64: values large enough for the second backward's copies (second_backward_copies.MIN_NUMEL)
    zero3, counters = _sharded_backward(monkeypatch, fake_world, "ghost", reshard=True, d=64)
    monkeypatch.undo()
    zero2, _ = _sharded_backward(monkeypatch, fake_world, "ghost", reshard=False, d=64)
    assert _first_backward_values_the_second_reads(zero3) == _first_backward_values_the_second_reads(zero2)
    assert counters[VALUE_COUNTER] >= 5, counters  # 2 blocks x 2 LayerNorms + the final one
