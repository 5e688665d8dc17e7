"""dpcompile.bucket_collectives: validated, and it sets (and unsets) Inductor's bucketing for every graph."""
import pickle

import pytest
from torch._inductor import config

import dpcompile


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "64"])
def test_bad_bucket_size_is_refused(bad):
    with pytest.raises(ValueError, match="bucket_mb must be a positive number"):
        dpcompile.bucket_collectives(bad)
    assert config.bucket_all_gathers_fx == "none"


def test_bucketing_on_and_off():
    try:
        dpcompile.bucket_collectives(16)
        assert (config.bucket_all_gathers_fx, config.bucket_reduce_scatters_fx, config.bucket_all_reduces_fx) == (
            "all", "all", "all")
        cap = config.bucket_reduce_scatters_fx_bucket_size_determinator
        assert cap(0) == cap(7) == 16.0
        assert pickle.loads(pickle.dumps(cap)) == cap  # part of Inductor's cache key
        assert config.reorder_for_compute_comm_overlap is False
        dpcompile.bucket_collectives(16, overlap=True)
        assert config.reorder_for_compute_comm_overlap is True
        with pytest.raises(ValueError, match="overlap must be True or False"):
            dpcompile.bucket_collectives(16, overlap="yes")
    finally:
        dpcompile.bucket_collectives(None)
    assert (config.bucket_all_gathers_fx, config.bucket_reduce_scatters_fx, config.bucket_all_reduces_fx) == (
        "none", "none", "none")
    assert config.reorder_for_compute_comm_overlap is False


_UNSET = {"bucket_all_gathers_fx": "none", "bucket_reduce_scatters_fx": "none", "bucket_all_reduces_fx": "none",
          "reorder_for_compute_comm_overlap": False}


def test_fully_shard_turns_bucketing_on_unless_the_user_chose(monkeypatch, caplog):
    """The default (64 MiB, overlapped) where nothing was chosen, logged with how to turn it off; a
    bucket_collectives call, None included, or Inductor's bucketing set by hand stands."""
    from dpcompile import bucketing

    with config.patch(_UNSET), caplog.at_level("INFO", logger="dpcompile"):
        monkeypatch.setattr(bucketing, "_SET_BY", [None])
        assert bucketing.default_bucketing() is True
        assert "bucket_collectives(None) turns them off" in caplog.text
        assert (config.bucket_all_gathers_fx, config.bucket_reduce_scatters_fx, config.bucket_all_reduces_fx) == (
            "all", "all", "all")
        assert config.bucket_all_gathers_fx_bucket_size_determinator(0) == bucketing.DEFAULT_BUCKET_MB == 64.0
        assert config.reorder_for_compute_comm_overlap is True
    with config.patch(_UNSET):
        dpcompile.bucket_collectives(None)  # the user's "unbucketed", before fully_shard
        assert bucketing.default_bucketing() is False
        assert config.bucket_all_gathers_fx == "none" and config.reorder_for_compute_comm_overlap is False
    with config.patch({**_UNSET, "bucket_all_gathers_fx": "fsdp"}):  # set by hand
        monkeypatch.setattr(bucketing, "_SET_BY", [None])
        assert bucketing.default_bucketing() is False
        assert config.bucket_reduce_scatters_fx == "none" and config.reorder_for_compute_comm_overlap is False
    with config.patch({**_UNSET, "reorder_for_compute_comm_overlap": True}):
        assert bucketing.default_bucketing() is False
        assert config.bucket_all_gathers_fx == "none"


def test_cpp_wrapper_compiles_collectives_unbucketed_or_refuses(monkeypatch, caplog):
    """torch 2.11's C++ wrapper crashes (SIGSEGV) running bucketed collectives: under fully_shard's default a
    step with collectives compiles unbucketed (logged); a bucketing the user chose is refused, saying what to
    do; steps without collectives and unbucketed settings are left alone."""
    from dpcompile import bucketing
    from dpcompile.errors import DPCompileError

    with config.patch(_UNSET), caplog.at_level("INFO", logger="dpcompile"):
        monkeypatch.setattr(bucketing, "_SET_BY", [None])
        assert bucketing.cpp_wrapper_patches(collectives=True) == {}  # nothing bucketed
        assert bucketing.default_bucketing() is True
        assert bucketing.cpp_wrapper_patches(collectives=False) == {}
        assert bucketing.cpp_wrapper_patches(collectives=True) == _UNSET
        assert "compiled unbucketed" in caplog.text
        assert config.bucket_all_gathers_fx == "all"  # other steps keep the default
        dpcompile.bucket_collectives(32)  # the user's choice
        with pytest.raises(DPCompileError, match=r"bucket_collectives\(None\)"):
            bucketing.cpp_wrapper_patches(collectives=True)
        dpcompile.bucket_collectives(None)
        assert bucketing.cpp_wrapper_patches(collectives=True) == {}
    monkeypatch.setattr(bucketing, "_SET_BY", [None])
    with config.patch({**_UNSET, "bucket_reduce_scatters_fx": "fsdp"}):  # set by hand: the user's choice
        with pytest.raises(DPCompileError, match="cpp_wrapper=True with bucketed collectives"):
            bucketing.cpp_wrapper_patches(collectives=True)


def test_split_gathered_copies_each_parameters_columns_out():
    """dpcompile::split_gathered (the copy-out of a bucketed all-gather, dpcompile.gathered_copy_out): per size
    n a new contiguous [world * n] holding its part's columns rank by rank, as the bucket's view did; its fake
    kernel and schema pass torch.library.opcheck."""
    import torch

    from dpcompile.gathered_copy_out import split_gathered

    bucket = torch.arange(2 * 10, dtype=torch.float32).view(2, 10)
    parts = split_gathered(bucket, [4, 1, 5])
    for part, (lo, hi) in zip(parts, [(0, 4), (4, 5), (5, 10)]):
        assert part.is_contiguous() and part.data_ptr() != bucket.data_ptr()
        torch.testing.assert_close(part, bucket[:, lo:hi].reshape(-1), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.dpcompile.split_gathered.default, (bucket, [4, 1, 5]))


def test_copy_out_is_patched_in_for_bucketed_collectives_unless_disabled():
    """The backend hands Inductor the copy-out as its post-grad custom pass for a graph with collectives when
    all-gathers are bucketed; not without collectives, not unbucketed, not with disable_passes naming it."""
    from dpcompile.backend import CompiledStep, DPBackend
    from dpcompile.config import DPConfig

    def patches(collectives, **options):
        backend = DPBackend(DPConfig(max_grad_norm=1.0, noise_multiplier=0.0, **options))
        return backend._codegen_patches(collectives=collectives, record=CompiledStep(compile_id="0", inputs=[]))

    try:
        dpcompile.bucket_collectives(16)
        assert patches(True)["post_grad_custom_post_pass"] is not None
        assert patches(True)["bucket_all_gathers_fx"] == "none"  # the pass buckets them itself
        assert "post_grad_custom_post_pass" not in patches(False)
        assert "post_grad_custom_post_pass" not in patches(True, disable_passes=("gathered_copy_out",))
        dpcompile.bucket_collectives(None)
        assert "post_grad_custom_post_pass" not in patches(True)
    finally:
        dpcompile.bucket_collectives(None)
    with pytest.raises(ValueError, match="gathered_copy_out"):  # named among the optional passes
        DPConfig(max_grad_norm=1.0, noise_multiplier=0.0, disable_passes=("per_sample_norms",))


def _read_all_fake_runs() -> list:
    """A custom op reading every tensor of a list, whose fake kernel counts its runs (defined once per process)."""
    import torch

    if not hasattr(_read_all_fake_runs, "runs"):
        runs = _read_all_fake_runs.runs = []

        @torch.library.custom_op("dpcompile_test::read_all", mutates_args=())
        def read_all(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            return [t.clone() for t in ts]

        @read_all.register_fake
        def _(ts):
            runs.append(len(ts))
            return [torch.empty_like(t) for t in ts]
    return _read_all_fake_runs.runs


def test_a_bucket_user_reruns_once_not_once_per_result():
    """Inductor's reduce-scatter bucketing repairs the metadata of the merged results' users (torch 2.13). A
    user reading every result of a bucket, as dp_fsdp's noise op reads every gradient, runs its fake kernel
    once, not once per result (dpcompile.bucketing.repair_each_bucket_user_once: torch queued it once per
    result, quadratic in the parameters). The bucket is merged and the user's metadata stays right."""
    import torch
    import torch.distributed as dist
    from torch._inductor.fx_passes import bucketing as inductor_bucketing
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    runs = _read_all_fake_runs()
    funcs = torch.ops._c10d_functional
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        group = dist.group.WORLD.group_name

        def step(*grads):
            return torch.ops.dpcompile_test.read_all(
                [funcs.wait_tensor(funcs.reduce_scatter_tensor(g, "sum", 2, group)) for g in grads])

        gm = make_fx(step, tracing_mode="fake")(*[torch.randn(4, n) for n in (3, 5, 2, 7)])
        scatters = list(gm.graph.find_nodes(op="call_function", target=funcs.reduce_scatter_tensor.default))
        assert len(scatters) == 4
        runs.clear()
        inductor_bucketing.merge_reduce_scatter(gm, [scatters])
    finally:
        dist.destroy_process_group()
    assert len(gm.graph.find_nodes(op="call_function", target=funcs.reduce_scatter_tensor.default)) == 1
    assert len(runs) <= 1, f"the bucket's one user ran its fake kernel {len(runs)} times"
    (user,) = gm.graph.find_nodes(op="call_function", target=torch.ops.dpcompile_test.read_all.default)
    assert [tuple(v.shape) for v in user.meta["val"]] == [(2, 3), (2, 5), (2, 2), (2, 7)]
