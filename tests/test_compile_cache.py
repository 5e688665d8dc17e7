"""A restart reuses the compiled DP step (AOTAutograd and FX graph caches), never across DP options or settings."""
import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import models as M
from helpers import compile_step
from tiers import extended

from dpcompile import compile_cache
from dpcompile.cacheable_dtensor_calls import COUNTER as DTENSOR_CALLS, cache_patches, cacheable_dtensor_calls_pass
from dpcompile.compat import dtensor_calls_are_closures
from dpcompile.config import DPConfig
from dpcompile.passes import noise as noise_pass


def _fresh_compile(model, x, y, C, **options):
    """Grads and record of a step compiled as a new process would: dynamo and AOTAutograd start over."""
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    step, backend = compile_step(model, M.ce, max_grad_norm=C, expected_batch_size=4,
                                 **{"noise_multiplier": 0.0, **options})
    step((x,), (y,))
    (record,) = [r for r in backend.compiled if r.dp]
    return {n: p.grad.clone() for n, p in model.named_parameters()}, record


def test_a_restart_hits_the_aot_autograd_cache_and_other_options_or_settings_miss_it(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = M.MLP()
    x, y = torch.randn(4, 5) * 3, torch.randint(0, 3, (4,))
    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        first, rec1 = _fresh_compile(model, x, y, C=0.05)
        assert rec1.cache == "miss" and rec1.counters["clip_coefficients"] == 1  # the dp passes ran

        hits = counters["aot_autograd"]["autograd_cache_hit"]
        again, rec2 = _fresh_compile(model, x, y, C=0.05)
        assert counters["aot_autograd"]["autograd_cache_hit"] == hits + 1
        assert rec2.cache == "hit"  # no pass ran; what they recorded is read back
        assert rec2.counters == rec1.counters and rec2.graphs["backward"] == rec1.graphs["backward"]
        assert "cache hit" in rec2.summary["cache"] and rec2.summary["params"] == rec1.summary["params"]
        for n in first:
            torch.testing.assert_close(again[n], first[n], rtol=0, atol=0)

        # an entry without its record (its process died before writing it) compiles again and writes it: a
        # hit never leaves a step without its summary, counters and graphs
        import shutil

        shutil.rmtree(compile_cache._records_dir())
        lost, rec_lost = _fresh_compile(model, x, y, C=0.05)
        assert rec_lost.cache == "miss" and rec_lost.counters == rec1.counters, rec_lost.summary.get("cache")
        assert rec_lost.summary["batch_size"] == rec1.summary["batch_size"]
        assert _fresh_compile(model, x, y, C=0.05)[1].cache == "hit"
        for n in first:
            torch.testing.assert_close(lost[n], first[n], rtol=0, atol=0)

        # C is baked into the backward: another C compiles anew and clips with it
        other, rec3 = _fresh_compile(model, x, y, C=0.025)  # every sample clipped: half the gradient
        assert rec3.cache == "miss"
        for n in first:
            torch.testing.assert_close(other[n], first[n] / 2)

        # a module setting the passes read (here the noise's chunk size) is part of the key too
        _, rec4 = _fresh_compile(model, x, y, C=0.05, noise_multiplier=1.0, seed=0)
        assert rec4.cache == "miss"
        monkeypatch.setattr(noise_pass, "CHUNK_NUMEL", 8)
        _, rec5 = _fresh_compile(model, x, y, C=0.05, noise_multiplier=1.0, seed=0)
        assert rec5.cache == "miss" and rec5.counters["noise_draws"] > rec4.counters["noise_draws"]

        # graph dumps need the passes to run: that compile skips the cache
        _, rec6 = _fresh_compile(model, x, y, C=0.05, dump_dir=str(tmp_path))
        assert rec6.cache == "" and rec6.counters["clip_coefficients"] == 1 and rec6.dump_files


def test_no_record_without_the_fx_graph_cache():
    """AOTAutograd stores nothing where Inductor's FX graph cache is off (it bypasses its cache), so such a
    compile skips the cache: no key, no record written (its graph texts printed for nothing), the passes run and
    the gradients are those of a cached compile."""
    torch.manual_seed(0)
    model = M.MLP()
    x, y = torch.randn(4, 5) * 3, torch.randint(0, 3, (4,))
    with fresh_cache(), torch._functorch.config.patch(enable_autograd_cache=True):
        with torch._inductor.config.patch(fx_graph_cache=False):
            off, rec_off = _fresh_compile(model, x, y, C=0.05)
            assert rec_off.cache == "" and rec_off.counters["clip_coefficients"] == 1
            records = compile_cache._records_dir()
            assert not records.exists() or not any(records.iterdir())
        with torch._inductor.config.patch(fx_graph_cache=True):
            on, rec_on = _fresh_compile(model, x, y, C=0.05)
            assert rec_on.cache == "miss" and any(records.iterdir())
    for n in on:
        torch.testing.assert_close(off[n], on[n], rtol=0, atol=0)


def test_the_record_key_leaves_out_the_traced_source_paths():
    # the AOTAutograd cache's key does: a checkout or virtualenv elsewhere hits the entry and must find its record
    gm = torch.fx.symbolic_trace(M.MLP())
    x = [torch.randn(4, 5)]
    key = compile_cache.record_key("uuid", gm, x)
    for node in gm.graph.nodes:
        node.stack_trace = ('  File "/elsewhere/site-packages/torch/nn/modules/linear.py", line 134, in forward\n'
                            '    return F.linear(input, self.weight, self.bias)\n')
    gm.recompile()
    assert "/elsewhere/" in gm.print_readable(print_output=False)
    assert compile_cache.record_key("uuid", gm, x) == key
    assert compile_cache.record_key("other", gm, x) != key


def test_the_key_holds_every_dp_option_and_module_setting(monkeypatch):
    base = compile_cache.partitioner_key(DPConfig(max_grad_norm=1.0, noise_multiplier=1.0))
    assert base == compile_cache.partitioner_key(DPConfig(max_grad_norm=1.0, noise_multiplier=1.0))
    for change in (dict(max_grad_norm=2.0), dict(noise_multiplier=0.5), dict(schedule="ghost"),
                   dict(expected_batch_size=8), dict(norm_eps=1e-5), dict(memory_budget=1), dict(linear_norm="direct"),
                   dict(cudagraphs=True)):
        key = compile_cache.partitioner_key(DPConfig(**{"max_grad_norm": 1.0, "noise_multiplier": 1.0, **change}))
        assert key != base, change
    names = dict(compile_cache.settings())
    for setting in ("dpcompile.passes.noise.CHUNK_NUMEL", "dpcompile.passes.per_sample_norms.NORM_BLOCK_BYTES",
                    "dpcompile.passes.aligned_contractions.ALIGNMENT",
                    "dpcompile.passes.second_backward_recompute.RECOMPUTE_MIN_BYTES"):
        assert setting in names, setting
    monkeypatch.setattr(noise_pass, "CHUNK_NUMEL", 3)
    assert compile_cache.partitioner_key(DPConfig(max_grad_norm=1.0, noise_multiplier=1.0)) != base


_RESTART = r"""
import json, sys
import torch, dpcompile
sys.path.insert(0, sys.argv[1])
import models as M
from helpers import compile_step
torch.manual_seed(0)
model = M.MLP()
x, y = torch.randn(4, 5) * 3, torch.randint(0, 3, (4,))
dpcompile.mark_batch(x, y)  # an unbacked batch: symbolic sizes in the record
step, backend = compile_step(model, M.ce, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=4)
step((x,), (y,))
(rec,) = [r for r in backend.compiled if r.dp]
print(json.dumps({"cache": rec.cache, "counters": rec.counters, "graphs": sorted(rec.graphs),
                  "grads": [p.grad.flatten().tolist() for p in model.parameters()]}))
"""


def test_a_new_process_reads_back_the_record_of_the_compile_that_filled_the_cache(tmp_path):
    """Across processes (string hashing differs per process) and with symbolic sizes in the record."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    tests = os.path.dirname(__file__)
    runs = []
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", _RESTART, tests], env={**env, "PYTHONHASHSEED": seed},
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, again = runs
    assert first["cache"] == "miss" and again["cache"] == "hit", (first["cache"], again["cache"])
    assert again["counters"] == first["counters"] and first["counters"]["clip_coefficients"] == 1
    assert "joint_graph_before_dp" in again["graphs"] and again["graphs"] == first["graphs"]
    assert again["grads"] == first["grads"]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
# the tensor-parallel restart is the extended tier (tests/tiers.py): the sharded one reads back every rank's own
# compile the same way
@pytest.mark.parametrize("layout,schedule", [("fsdp", "bk"), pytest.param("tp", "ghost", marks=extended)])
def test_a_restart_of_a_sharded_or_tensor_parallel_step_hits_the_cache_on_every_rank(
        layout, schedule, tmp_path, monkeypatch):
    """Two ranks share one cache folder, as on one machine: each reads back its own compile (ranks' graphs and
    noise streams differ), and the restarted job's noisy gradients are bitwise those of the first."""
    import dist_worker
    from ranks import read as _read, spawn

    for k, v in dict(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
                     TORCHINDUCTOR_AUTOGRAD_CACHE="1").items():
        monkeypatch.setenv(k, v)
    for run in ("first", "again"):
        spawn(dist_worker.restart, str(tmp_path), layout, schedule, run, start_method="spawn")
    first, again = _read(tmp_path, prefix="first"), _read(tmp_path, prefix="again")
    for rank in (0, 1):
        assert first[rank]["cache"] == ["miss"] and again[rank]["cache"] == ["hit"], (rank, first, again)
        # torch 2.11: the DTensor calls dynamo recorded as closures were made cacheable (else: no entry)
        assert (first[rank]["counters"][0][DTENSOR_CALLS] > 0) == dtensor_calls_are_closures(), first[rank]
        assert again[rank]["counters"] == first[rank]["counters"]
        assert again[rank]["streams"] == first[rank]["streams"]
        assert again[rank]["grads"] == first[rank]["grads"], rank
    # the ranks did not serve each other: their noise differs (shards, and a tp rank's own stream)
    assert first[0]["grads"] != first[1]["grads"]
    if layout == "tp":  # shards draw per rank, replicas from one stream (by the record on the hit, too)
        assert sorted(set(first[0]["streams"][0].values())) == [0] and \
            sorted(set(first[1]["streams"][0].values())) == [0, 1], first[1]["streams"]
        # the cache entry without its record (a process that died in between): the streams are not known
        # without the partitioner, so the step compiles again rather than use the entry
        import shutil

        shutil.rmtree(tmp_path / "cache" / "dpcompile_records")
        spawn(dist_worker.restart, str(tmp_path), layout, schedule, "lost", start_method="spawn")
        for rank, rep in enumerate(_read(tmp_path, prefix="lost")):
            assert rep["cache"] == ["miss"] and rep["grads"] == first[rank]["grads"], rank


def _closure(name, *args, **kwargs):
    """A call as torch 2.11's dynamo records a DTensor method: a closure made for it, its arguments captured."""
    args_as_value, kwargs_as_value = list(args), dict(kwargs)

    def redistribute_fn_with_prim_types(x):
        return x.redistribute(*args_as_value, **kwargs_as_value)

    def to_local_fn_with_prim_types(x):
        return x.to_local(*args_as_value, **kwargs_as_value)

    fn = redistribute_fn_with_prim_types if name == "redistribute" else to_local_fn_with_prim_types
    fn.__name__ = f"prim_{name}"
    return fn


class _Recorder:
    """Stands in for a DTensor: records the method calls made on it."""

    def __init__(self):
        self.calls = []

    def redistribute(self, *args, **kwargs):
        self.calls.append(("redistribute", args, kwargs))
        return self

    def to_local(self, *args, **kwargs):
        self.calls.append(("to_local", args, kwargs))
        return self


def test_dtensor_calls_recorded_as_closures_become_cacheable_calls_keyed_by_their_arguments():
    """torch 2.11 records x.redistribute(...) and x.to_local(...) as per-call closures, which the AOTAutograd
    cache refuses: each becomes a call of one module-level function that the cache is told is safe, with a
    text of the captured arguments in the graph's code (so the key tells calls with other arguments apart),
    and the same calls made on the input. A closure whose arguments have no such text is left as it was."""
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(_closure("redistribute", "mesh-stand-in", (1, 2), async_op=False), (x,))
    b = graph.call_function(_closure("to_local", grad_placements=None), (a,))
    c = graph.call_function(_closure("redistribute", "mesh-stand-in", (2, 1)), (b,))
    d = graph.call_function(_closure("redistribute", object()), (c,))  # printed by address: not keyable
    graph.output(d)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(BypassAOTAutogradCache):
        check_node_safe(a)
    gm, n = cacheable_dtensor_calls_pass(gm)
    assert n == 3, gm.code
    calls = [node for node in gm.graph.nodes if node.op == "call_function"]
    keys = [node.args[1] for node in calls[:3]]
    assert len(set(keys)) == 3 and "int:1, int:2" in keys[0] and "int:2, int:1" in keys[2], keys
    assert all(key in gm.code for key in keys), gm.code  # in the code, which the cache key hashes
    assert calls[3].target.__name__ == "prim_redistribute"  # left for the cache to bypass
    with torch._inductor.config.patch(cache_patches("test")):
        for node in calls[:3]:
            check_node_safe(node)
    with pytest.raises(BypassAOTAutogradCache):
        check_node_safe(calls[0])  # only while the compile's config marks it
    rec = _Recorder()
    assert gm(rec) is rec
    assert [(m, args, kw) for m, args, kw in rec.calls[:3]] == [
        ("redistribute", ("mesh-stand-in", (1, 2)), {"async_op": False}), ("to_local", (), {"grad_placements": None}),
        ("redistribute", ("mesh-stand-in", (2, 1)), {})], rec.calls
