"""Sharded DP on 2 gloo processes: exact gradients, collectives per phase, noise on shards."""
import json
import os

import pytest
import torch

import dist_worker
import dpcompile
from ranks import SharedRanks, spawn
from tiers import extended, extended_tier
from ranks import read as _read
from dpcompile.compat import dtensor_takes_unbacked_batch, meshes_are_graph_inputs
from cases import BATCH_MEANS, SHARDED_CASES, SHARDED_EAGER_ONLY, SHARDED_KIND_HALVES, check_case_invariants

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


# Variants of a model that runs sharded with both schedules (a frozen part, LoRA, tied weights, the K-dim
# cross entropy, a summed loss): one schedule each, alternating, for CI time. Single-process, every case runs
# both (test_per_sample_clipping).
SHARDED_VARIANTS = ("gpt_frozen", "gpt_kdim_ce", "gpt_lora", "gpt_tied", "llama_sum", "shared_weights")


def _sharded_runs():
    """Every case on 2 ranks, both schedules and both ways to compile (plain torch.compile with
    backend="dp_fsdp", and private_step): each case runs bk with one and ghost with the other, alternating
    from case to case (a variant of another case runs one of the two), and gpt runs all four, its second
    pair with contractions padded as on CUDA (uneven shards then make the ranks' graphs differ). What is
    compiled does not depend on the way (the same backend); the way decides how dpcompile finds the options
    and marks the batch.

    Every case runs one of its runs through Inductor's generated code and the other with compiler="eager"
    (the same graphs, op by op: what dpcompile rewrites is checked sharded in both schedules, Inductor's code
    for sharded graphs once per case, at a third of the CI time). Inductor runs alternate between the
    schedules and the ways from case to case; variants take the other compiler than their neighbour. A case
    in cases.SHARDED_EAGER_ONLY runs bk op by op only (its reason there); the two halves of the layer kinds
    (cases.SHARDED_KIND_HALVES) one schedule each, op by op (why there).

    CI time (the suite is over CI's 30 minutes): Inductor's code sharded is kept where it shows something of
    its own (_SHARDED_INDUCTOR: an HF model's bk, a loss over one-hot targets' bk, gpt's padded and recomputed
    ghost steps); the other cases' Inductor runs go op by op (Inductor's code for each of them runs on one process
    with an unbacked batch, test_per_sample_clipping), and the tied head's and the recomputed HF logits' runs
    through Inductor are in the extended tier (EXTENDED_INDUCTOR)."""
    return [(case, schedule, form if "eager" in form or _keeps_inductor(case, form) else form + "+eager")
            for case, schedule, form in _alternated_runs()]


_SHARDED_INDUCTOR = ("hf_llama", "one_hot_targets")


def _keeps_inductor(case: str, form: str) -> bool:
    return case in _SHARDED_INDUCTOR or "pad" in form


def _alternated_runs():
    runs = []
    slots = sorted({"layer_kinds" if n in SHARDED_KIND_HALVES else n for n in SHARDED_CASES})
    for i, name in enumerate(slots):
        forms = ("compile", "private_step") if i % 2 == 0 else ("private_step", "compile")
        if name == "layer_kinds":  # half the layer kinds each, bk in one and ghost in the other
            runs += [(half, half.rsplit("_", 1)[1], form + "+eager") for half, form in zip(SHARDED_KIND_HALVES, forms)]
            continue
        if name in SHARDED_EAGER_ONLY:
            runs.append((name, "bk", "private_step+eager"))
            continue
        if name in SHARDED_VARIANTS:
            v = SHARDED_VARIANTS.index(name)
            form = ("private_step", "compile")[v // 2 % 2] + ("+eager" if v % 2 == 0 else "")
            runs.append((name, ("bk", "ghost")[v % 2], form))
            continue
        eager = ("", "+eager") if i // 2 % 2 == 0 else ("+eager", "")
        runs += [(name, "bk", forms[0] + eager[0]), (name, "ghost", forms[1] + eager[1])]
        if name == "gpt":
            runs += [(name, "bk", forms[1] + "+pad+eager"), (name, "ghost", forms[0] + "+pad+recompute")]
        if name == "hf_gpt2":  # its eager ghost run: the second backward's recomputed logits, sharded
            runs[-1] = (name, "ghost", runs[-1][2] + "+recompute")
    return runs


# Inductor's code for the tied head and for the second backward's recomputed logits of an HF model, sharded: the
# default tier runs them op by op (about 60 s of each rank's CI time), and Inductor's code for gpt's recomputed
# ghost step sharded
EXTENDED_INDUCTOR = (("gpt_tied", "ghost", "compile"), ("hf_gpt2", "ghost", "compile+recompute"))
_CASE_RUNS = _sharded_runs()
SHARDED_RUNS = _CASE_RUNS + list(EXTENDED_INDUCTOR)


def _extended_runs(runs):
    """The runs of the extended tier (tests/tiers.py): where a case runs both schedules sharded, the default tier
    keeps one, its run through Inductor where it has one (else ghost, whose first backward drops collectives);
    gpt keeps a bk run too. The others: the second schedule of a case the default tier runs sharded (CI time)."""
    by_case: dict = {}
    for run in runs:
        by_case.setdefault(run[0], []).append(run)
    moved = set()
    for case, own in by_case.items():
        if len(own) < 2:
            continue
        keep = [r for r in own if "eager" not in r[2]] or [r for r in own if r[1] == "ghost"]
        if case == "gpt":
            keep.append(next(r for r in own if r[1] == "bk" and "pad" not in r[2]))
        moved |= {r for r in own if r not in keep}
    # the layer kinds' ghost half (the bk half runs sharded in the default tier; every kind of both halves runs
    # both schedules on one process there, one of them through Inductor with the sharded step's unbacked batch)
    return moved | {r for r in runs if r[0] == "layer_kinds_ghost"}


EXTENDED_RUNS = _extended_runs(_CASE_RUNS) | set(EXTENDED_INDUCTOR)
# The runs share their ranks (ranks.SharedRanks): under pytest-xdist (--dist loadgroup) one process group for
# each of these groups, each on its own worker; a plain run runs them all in one process group.
# the layer kinds alone: each half's run, op by op, takes about 2 minutes of two CI cores.
MATRIX_GROUPS = {"gpt": 0, "hf_gpt2": 1, "gpt_tied": 1, "vision_blocks": 1, "hf_llama": 2, "llama": 2, "llama_sum": 2,
                 "layer_kinds_bk": 4, "layer_kinds_ghost": 4}  # the others: 3


def _matrix_job(case):
    return f"group{MATRIX_GROUPS.get(case, 3)}"


MATRIX = SharedRanks("matrix", {f"group{g}": (g, "every_case", dict(runs=[
    r for r in SHARDED_RUNS if _matrix_job(r[0]) == f"group{g}" and (r not in EXTENDED_RUNS or extended_tier())]))
    for g in range(5)})


# Smaller 2-rank tests share their ranks too (ranks.SharedRanks): {job: (group, dist_worker function, keywords)}
RANKS = SharedRanks("ranks", {
    # dpcompile's own placement of the collectives is the subject: op by op, issued as the graph runs them (CI time:
    # 25 s of each rank's compile); Inductor's code for them: the bucketed job and the matrix
    "collectives_gpt_bk": (0, "correctness", dict(case="gpt", schedule="bk", sizes=[3, 2], reshard_after_forward=True,
                                                  bucket_mb="off", compiler="eager")),
    "collectives_llama_ghost": (0, "correctness", dict(case="llama", schedule="ghost", sizes=[3, 2],
                                                       reshard_after_forward=True, bucket_mb="off", compiler="eager")),
    "padded": (0, "correctness", dict(case="gpt_odd", schedule="bk", sizes=[3, 2], reshard_after_forward=True,
                                      pad_contractions=True)),
    "bucketed_gpt_bk_16": (0, "correctness", dict(case="gpt", schedule="bk", sizes=[3, 2], reshard_after_forward=True,
                                                  bucket_mb=16)),
    "noise": (0, "noise", dict(seed=123)),
    "gathered_kernels": (0, "gathered_kernels", {}),
    # the noisy steps op by op (CI time): what sharding on the last dim changes is which coordinates each rank
    # draws, dpcompile's offsets in the graph; Inductor's code for the draw: the "noise" job
    "noise_last_dim": (1, "noise", dict(seed=123, last_dim=True, compiler="eager")),
    "bad_inputs": (0, "bad_inputs", {}),
    "bucketed_llama_ghost_default": (1, "correctness", dict(case="llama", schedule="ghost", sizes=[3, 2],
                                                            reshard_after_forward=True)),
    "reshard_false": (1, "correctness", dict(case="gpt", schedule="bk", sizes=[2, 3], reshard_after_forward=False,
                                             compiler="eager")),
    "unmarked": (1, "unmarked_batch", {}),
    "cross_entropy_mean": (1, "cross_entropy_mean", {}),
    "ctc_loss": (1, "ctc_loss_sharded", {}),
    # ghost op by op (its second backward replays the masks); bk op by op and ghost through Inductor (its
    # fallback_random draws) in the extended tier (CI time: 90 s of the group's for Inductor, 45 s for bk;
    # Inductor's dropout on one process and both schedules there: test_dropout)
    "dropout": (0, "dropout", dict(runs=(("ghost", "private_step", "eager"),))),
    "dropout_bk": (1, "dropout", dict(runs=(("bk", "compile", "eager"),))),
    "dropout_inductor": (1, "dropout", dict(runs=(("ghost", "private_step", "inductor"),))),
    # FSDP2's other ways to call fully_shard (dist_worker._sharded_case's flags)
    "placements": (1, "every_case", dict(runs=[("gpt", "bk", "compile+eager+last_dim+lists"),
                                               ("vision_blocks", "ghost", "private_step+eager+last_dim+no_mesh")])),
    # op by op (CI time: its Inductor run took half this group's 140 s): Inductor's code for input_gram with an
    # unbacked batch size runs on one process (test_convolution's test_auto_takes_input_gram_..., unbacked)
    "input_gram": (1, "every_case", dict(runs=[("vision_blocks", "bk", "private_step+eager+input_gram"),
                                               ("vision_blocks", "ghost", "compile+eager+input_gram")])),
}, extended_jobs=(
    # the extended tier (tests/tiers.py): bucketing with a size of the user's choice (fully_shard's default
    # bucketing runs in the default tier); input_gram sharded (on one process in the default tier, through
    # Inductor with an unbacked batch: test_convolution)
    "bucketed_gpt_bk_16", "input_gram",
    # gpt_odd's padded bk through Inductor (the default tier pads sharded through Inductor in the matrix's gpt ghost
    # run: its counters, the re-gathered weights and the exact gradients)
    "padded", "dropout_bk", "dropout_inductor"))
_ranks = RANKS.mark


@pytest.mark.parametrize("case,schedule,form", [
    pytest.param(*run, marks=[MATRIX.mark(_matrix_job(run[0]))] + ([extended] if run in EXTENDED_RUNS else []))
    for run in SHARDED_RUNS])
def test_sharded_matches_single_process_reference(case, schedule, form, shared_ranks):
    """Per-rank batches (0, 3), (1, 4), (5, 3), (0, 0) of different data, one graph, plain torch.compile or
    private_step with no other call: each rank's gathered gradient equals the float64 oracle on the
    concatenated batch (some samples clipped, some not)."""
    for rank, results in enumerate(_read(shared_ranks(MATRIX, _matrix_job(case)), prefix="cases")):
        r = results[f"{case}-{schedule}-{form}"]
        assert r["error"] is None, f"rank {rank}:\n{r['error']}"
        assert r["dp_graphs"] == 1, r  # one graph for every batch size, the same on every rank
        assert r["batch_size"].startswith("u"), r  # unbacked: no 0/1 specialisation
        assert r["clipped"] > 0 and r["unclipped"] > 0, r
        check_case_invariants(case, r["counters"], {"frozen": r["frozen"], "schedule": {"requested": schedule}})
        assert (r["padded"] > 0) == ("+pad" in form), r
        assert r["compiler"] == ("eager" if "+eager" in form else "inductor"), r
        assert (r["recomputed"] > 0) == ("+recompute" in form), r
        assert r["waits_out_of_order"] == [], r  # the same buckets on every rank under Inductor's bucketing
        if "llama" in case:  # view(B, T, H, -1): the tracer assumed B != 0; a rank with no samples runs anyway
            assert r["counters"]["nonempty_batch_asserts_removed"] >= 1, r["counters"]


def test_cpp_wrapper_sharded(tmp_path):
    """cpp_wrapper=True on 2 ranks: where torch hands the device meshes to the graph (2.13) Inductor's C++ wrapper
    cannot take them, and the step is refused at compile time with what to do, on every rank; elsewhere the step
    runs exact against the oracle, the kernels launched from C++."""
    spawn(dist_worker.every_case, str(tmp_path), [("gpt", "bk", "compile+cpp")], timeout=900)
    for rank, results in enumerate(_read(tmp_path, prefix="cases")):
        r = results["gpt-bk-compile+cpp"]
        if meshes_are_graph_inputs():
            assert r["error"] is not None and "cpp_wrapper=True cannot compile this step" in r["error"], r
            assert "DeviceMesh" in r["error"] and "Drop cpp_wrapper" in r["error"], r["error"]
        else:
            assert r["error"] is None, f"rank {rank}:\n{r['error']}"
            assert r["clipped"] > 0 and r["unclipped"] > 0 and r["compiler"] == "inductor", r


@_ranks("input_gram")
@extended
def test_input_gram_conv_norms_sharded(shared_ranks):
    """conv_norm="input_gram" on 2 ranks (an unbacked batch size, ranks with no samples): every convolution of the
    vision blocks (strided, depthwise 7x7, transposed, 1x1, a Conv1d) exact against the oracle, both schedules,
    op by op."""
    runs = RANKS.jobs["input_gram"][2]["runs"]
    for rank, results in enumerate(_read(shared_ranks(RANKS, "input_gram"), prefix="cases")):
        for case, schedule, form in runs:
            r = results[f"{case}-{schedule}-{form}"]
            assert r["error"] is None, f"rank {rank}:\n{r['error']}"
            assert r["clipped"] > 0 and r["unclipped"] > 0, r
            assert r["counters"].get("norm_conv_input_gram", 0) >= 4, r["counters"]
            assert r["batch_size"].startswith("u") and r["waits_out_of_order"] == [], r


@pytest.mark.parametrize("case,schedule", [pytest.param(c, s, marks=_ranks(f"collectives_{c}_{s}"))
                                           for c, s in [("gpt", "bk"), ("llama", "ghost")]])
def test_collectives_per_phase(case, schedule, shared_ranks):
    """Unbucketed (bucket_collectives(None)): dpcompile's own placement of one collective per parameter."""
    for rep in _read(shared_ranks(RANKS, f"collectives_{case}_{schedule}")):
        counts, n = rep["counts"], rep["n_params"]
        assert rep["bucketing"] == ["none", False, None], rep
        assert counts["backward"]["reduce_scatter"] == n  # one per gradient: none in a ghost first pass
        assert counts["forward"]["reduce_scatter"] == 0
        assert counts["forward"]["all_gather"] == n
        # reshard_after_forward: gathered again, and ghost's second backward gathers again what it reads
        again = rep["counters"].get("second_backward_gathers", 0)
        assert 0 < counts["backward"]["all_gather"] - again <= n and (again > 0) == (schedule == "ghost"), rep
        phases = rep["summary_collectives"]  # what the dump summary reports
        assert phases["backward_before_clip"].get("reduce_scatters", 0) == 0  # none before the clip
        assert phases["backward_after_clip"]["reduce_scatters"] == n
        assert rep["counters"]["collective_waits_deferred"] == n - 1  # comm_overlap
        assert rep["issued"]["reduce_scatter_tensor"] == n  # as run: one per gradient
        # the reduce-scatter issued before each weight gradient's GEMM stays in flight under it
        assert phases["backward_overlap"]["reduce_scatters_under_a_gemm"] >= rep["n_linear"] - 1, phases
        if schedule == "ghost":
            assert rep["counters"]["unused_collectives_removed"] == n
            assert phases["removed_from_backward"]["reduce_scatters"] == n


@_ranks("padded")
@extended
def test_padded_contractions_on_a_sharded_model(shared_ranks):
    """Odd widths, vocab and sequence padded inside the sharded graph (column-sliced weight gradients feed
    reduce-scatters): still exact, weights still re-gathered."""
    for rep in _read(shared_ranks(RANKS, "padded")):
        assert rep["counters"]["contractions_padded"] >= 8, rep["counters"]
        # the forward ops reading a gathered weight are saved, not recomputed: without that, the ranks' (unequal)
        # graphs partitioned differently here and one rank re-gathered a weight the other did not (a hang)
        assert rep["counters"]["reshard_readers_saved"] > 0, rep["counters"]
        assert 0 < rep["counts"]["backward"]["all_gather"] <= rep["n_params"]


@pytest.mark.parametrize("case,schedule,bucket_mb", [
    pytest.param(c, s, mb, marks=RANKS.marks(f"bucketed_{c}_{s}_{mb or 'default'}"))
    for c, s, mb in [("gpt", "bk", 16), ("llama", "ghost", None)]])
def test_bucketed_collectives_stay_exact(case, schedule, bucket_mb, shared_ranks):
    """Inductor merges the gathers and the clipped gradients' reduce-scatters after the dp rewrite, and
    reorders them against compute: fully_shard's default (None), or dpcompile.bucket_collectives(16) without
    reordering. The gradients stay exact and far fewer collectives are issued. Every collective's wait follows
    the order of issue on every rank (Inductor fills a bucket in the order of the waits)."""
    for rep in _read(shared_ranks(RANKS, f"bucketed_{case}_{schedule}_{bucket_mb or 'default'}")):
        assert rep["bucketing"] == (["all", True, 64.0] if bucket_mb is None else ["all", False, 16.0]), rep
        assert rep["waits_out_of_order"] == [], rep
        n, issued = rep["n_params"], rep["issued"]
        assert 0 < issued["reduce_scatter_tensor"] < n / 4, issued
        gathers = issued["all_gather_into_tensor"] + issued["all_gather_into_tensor_out"]
        assert 0 < gathers < n / 4, issued
        assert rep["summary_collectives"]["backward_before_clip"].get("reduce_scatters", 0) == 0


@_ranks("gathered_kernels")
def test_blocks_share_kernels_reading_gathered_parameters(shared_ranks):
    """A bucketed all-gather's parameters are copied out of the bucket by one op per bucket
    (dpcompile.gathered_copy_out), so a kernel reading a gathered parameter does not carry the parameter's
    offset in the bucket, and the blocks share it: the forward of two Linear-GELU-Linear blocks launches one
    GELU kernel (which reads the first bias) twice, where without the copy-out each block had one of its own
    (6 distinct forward kernels instead of 4). Every bucket is copied out, also one holding a parameter the
    bucketing handed on as a strided view of the bucket (a [2, d] parameter at 2 ranks)."""
    for rep in _read(shared_ranks(RANKS, "gathered_kernels")):
        assert rep["copied_out"] == rep["buckets"] == 2, rep  # the forward's bucket, the backward's
        (forward,) = [g for g in rep["graphs"] if not g["backward"]]
        assert list(forward["gelu"].values()) == [2], rep


@_ranks("reshard_false")
def test_reshard_after_forward_false_keeps_gathered_params(shared_ranks):
    # what the partitioner keeps is the subject: op by op (CI time)
    for rep in _read(shared_ranks(RANKS, "reshard_false")):
        assert rep["counts"]["backward"]["all_gather"] == 0


@_ranks("unmarked")
def test_batch_dpcompile_cannot_see_is_refused_on_every_rank(shared_ranks):
    """A batch inside an object dynamo reads attributes of (not a tensor argument, list or dict): dpcompile
    cannot mark it, and a fixed batch size would give ranks different graphs. Refused on every rank,
    rank 1 with no samples, before any collective; the message says what to do."""
    for rep in _read(shared_ranks(RANKS, "unmarked"), prefix="unmarked"):
        assert "one graph for every batch size" in rep["error"] and "mark_batch" in rep["error"], rep


def test_mixed_precision_policy_casts_inputs_and_outputs_like_fsdp2(tmp_path):
    # one rank: the casts are per module, not per collective; bf16 numerics on GPUs: the NCCL test
    spawn(dist_worker.mixed_precision_casts, str(tmp_path), world=1)
    (rep,) = _read(tmp_path, world=1, prefix="mp")
    assert rep["conv_input"] == "torch.bfloat16" and rep["output"] == "torch.float32", rep
    assert "same" in rep["uncast"] and "BFloat16" in rep["uncast"], rep  # fp32 images into a bf16 conv
    assert all(dtype == "torch.float32" and nonzero for dtype, nonzero in rep["grads"].values()), rep


@_ranks("cross_entropy_mean")
def test_whole_batch_means_sharded(shared_ranks):
    """Whole-batch means of per-sample losses on 2 ranks (per-rank batches of 0, 1, 3, 4, 5; ignored targets):
    F.cross_entropy's default mean in both schedules, with label smoothing and with probability targets, F.kl_div's
    "batchmean" (a sum over each rank's batch size), a sum over each rank's B * classes elements by their number,
    a sum times 1 / B, F.multilabel_margin_loss and F.gaussian_nll_loss, exact against
    the oracle, each seen by the loss pass as the mean it is."""
    for rank, results in enumerate(_read(shared_ranks(RANKS, "cross_entropy_mean"), prefix="ce")):
        assert sorted(results) == ["cross_entropy-bk", "cross_entropy-ghost", "gaussian_nll-bk", "kl_batchmean-bk",
                                   "label_smoothing-ghost", "multilabel_margin-ghost", "prob_targets-bk",
                                   "sum_over_numel-ghost", "sum_times_reciprocal-ghost"], results
        for run, r in results.items():
            assert r["error"] is None, f"rank {rank} {run}:\n{r['error']}"
            counter = BATCH_MEANS[run.split("-")[0]][2]
            assert r["counters"][counter] == 1, r["counters"]


@pytest.mark.parametrize("job", [pytest.param(j, marks=RANKS.marks(j)) for j in ("dropout", "dropout_bk",
                                                                                 "dropout_inductor")])
def test_dropout_sharded(job, shared_ranks):
    """models.DropoutLM's dropouts and per-sample drop path sharded on 2 ranks, per-rank batches (0, 3), (1, 4),
    (5, 3), (0, 0) through one graph, each rank seeded per step: every rank's gathered gradient equals the
    replayed oracle of the whole batch (dist_worker.dropout), ghost op by op, and bk op by op and ghost through
    Inductor (the extended tier)."""
    ranks = _read(shared_ranks(RANKS, job), prefix="dropout")
    want = {"-".join(run) for run in RANKS.jobs[job][2]["runs"]}
    for rank, results in enumerate(ranks):
        assert set(results) == want, results
        for key, r in results.items():
            assert r["error"] is None, f"rank {rank} {key}:\n{r['error']}"
            assert r["dp_graphs"] == 1, r
    for key in ranks[0]:  # clipping active: some samples above C, some below, over both ranks
        assert sum(r[key]["clipped"] for r in ranks) and sum(r[key]["unclipped"] for r in ranks), ranks


@_ranks("ctc_loss")
def test_ctc_loss_sharded(shared_ranks):
    """F.ctc_loss on 2 ranks (per-rank batches of 0, 1, 3, 4, 5; a sample without targets and one whose targets
    do not fit), traced as one op per sample: exact against the oracle on every rank, a mean over the batch."""
    for rank, r in enumerate(_read(shared_ranks(RANKS, "ctc_loss"), prefix="ctc")):
        assert r["error"] is None, f"rank {rank}:\n{r['error']}"
        assert r["reduction"] == "mean" and "dpcompile.ctc_loss.default" in r["ops"], r


@pytest.mark.parametrize("job", [pytest.param(j, marks=_ranks(j)) for j in ("noise", "noise_last_dim")])
def test_noise_on_shards_two_ranks(job, shared_ranks):
    """One draw per coordinate across the ranks, each rank its own stream: parameters sharded on dim 0, and on
    their last dim (shard_placement_fn: each rank holds some columns of a matrix)."""
    out = shared_ranks(RANKS, job)
    z0 = torch.load(os.path.join(out, "noise0.pt"))
    z1 = torch.load(os.path.join(out, "noise1.pt"))
    assert z0["placements"] == (["(Shard(dim=0),)"] if job == "noise" else ["(Shard(dim=0),)", "(Shard(dim=1),)"])
    std = 2.0 * 0.5 / 4
    # both ranks see the same full gradient (gathered), noise included
    torch.testing.assert_close(z0["z"], z1["z"])
    z = z0["z"].double() / std
    n = z.numel()
    assert abs(z.mean()) < 4.5 / n ** 0.5
    assert 0.93 < z.pow(2).mean() < 1.07, z.pow(2).mean()
    # each rank drew its own shard: with the same seed the two ranks' draws differ and are uncorrelated
    same = [n for n in z0["local"] if z0["local"][n].shape == z1["local"][n].shape]
    assert len(same) > 10
    a = torch.cat([z0["local"][n].flatten() for n in same]).double()
    b = torch.cat([z1["local"][n].flatten() for n in same]).double()
    for n in same:
        assert not torch.equal(z0["local"][n], z1["local"][n]), n
    r = torch.corrcoef(torch.stack([a, b]))[0, 1]
    assert abs(r) < 4.5 / a.numel() ** 0.5, r


@_ranks("bad_inputs")
def test_partially_sharded_two_mesh_stock_fsdp2_or_partial_tensor_parallel_model_is_refused(shared_ranks):
    for rep in _read(shared_ranks(RANKS, "bad_inputs"), prefix="bad"):
        assert "not sharded" in rep["partial"] and "fully_shard" in rep["partial"], rep
        assert "different device meshes" in rep["two_meshes"], rep
        assert rep["equal_meshes_grads"] == rep["n_params"], rep  # meshes compared by value
        # a model wrapped with torch.distributed.fsdp.fully_shard: refused, saying why and what to use
        assert "only part of the training step" in rep["stock_fsdp2"], rep
        assert "FSDP2" in rep["stock_fsdp2"] and "dpcompile.fully_shard" in rep["stock_fsdp2"], rep
        # tensor parallel: a plain gate on a ColwiseParallel output has part of each sample's gradient per rank
        assert "parameter 'mlp.gate' has a gradient that is the same on every rank" in rep["tensor_parallel_partial"], rep
        assert "one rank's shard" in rep["tensor_parallel_partial"], rep
        # no record of the gradients' placements: refused by name rather than classified by a guess
        assert "cannot read the placements" in rep["tp_placements_unknown"], rep
        assert "blocks.0.fc.weight" in rep["tp_placements_unknown"], rep
        # dp and tp meshes of different device meshes: refused by fully_shard, naming the parameter
        assert "'blocks.0.fc.weight' is tensor parallel" in rep["tp_dp_meshes_apart"], rep
        assert ("mesh['dp'] and mesh['tp']" if dtensor_takes_unbacked_batch() else "needs torch 2.13") \
            in rep["tp_dp_meshes_apart"], rep
        assert "'parametrizations.weight.original0' is a scalar" in rep["scalar_parameter"], rep
        # FSDP2's arguments taken in a form dpcompile cannot shard: refused, saying what, nothing sharded
        for key, says in {
            "placement_not_shard": ["must return torch.distributed.tensor.Shard(dim) or None", "'weight'", "Replicate"],
            "placement_no_dim": ["Shard(dim=2) for parameter 'weight' of shape (3, 4): no such dim"],
            "reshard_int": ["reshard_after_forward must be True, False or None, got 2"],
            "list_not_modules": ["only nn.Module"],
            "cpu_offload": ["offload_policy=CPUOffloadPolicy"],
            "ignored_params": ["ignored_params is not supported"],
            "tied_apart": ["parameter 'weight' is shared with a module an earlier fully_shard call sharded",
                           "(Shard(dim=0),)", "(Shard(dim=1),)"],
        }.items():
            assert all(s in rep[key] for s in says), (key, rep[key])
            assert rep[f"{key}_untouched"], key
        # a buffer written from the samples is refused, naming it, before the step writes anything
        assert "writes sample data into buffer 'running_mean'" in rep["running_statistic"], rep
        assert "aten.mean.dim" in rep["running_statistic"] and rep["running_statistic_untouched"], rep
        # a forward that writes into a sharded weight (.data.clamp_): refused, naming the weight, op and line
        said = rep["gathered_write"]
        assert "changes the sharded parameter 'coef.weight' in place (clamp_" in said, said
        assert "self.coef.weight.data.clamp_(-self.bound, self.bound)" in said, said
        # a step dynamo would run as plain Python (a graph break in its loop): refused, nothing written
        said = rep["gave_up"]
        assert "dynamo gave up on looping_step" in said and "block done" in said, said
        assert rep["gave_up_no_grads"], rep


@_ranks("placements")
def test_shard_placement_fn_default_mesh_and_lists_of_modules(shared_ranks):
    """FSDP2's other ways to call fully_shard: every parameter sharded on its last dim (shard_placement_fn: a
    Linear's input features, a convolution's kernel width, uneven pieces where the dim is odd, DTensor's glue
    around the reduce-scatters), fully_shard's default mesh, a ModuleList's blocks sharded by one call. Per-rank
    batches (0, 3), (1, 4), (5, 3), (0, 0), one graph, clipping active, bad samples dropped: each rank's
    gathered gradient equals the float64 oracle on the whole batch, in both schedules."""
    runs = {"gpt-bk-compile+eager+last_dim+lists": "(Shard(dim=1),)",
            "vision_blocks-ghost-private_step+eager+last_dim+no_mesh": "(Shard(dim=3),)"}
    for rank, results in enumerate(_read(shared_ranks(RANKS, "placements"), prefix="cases")):
        assert set(results) == set(runs), results.keys()
        for run, widest in runs.items():
            r = results[run]
            assert r["error"] is None, f"rank {rank} {run}:\n{r['error']}"
            assert r["dp_graphs"] == 1 and r["batch_size"].startswith("u"), r
            assert r["clipped"] > 0 and r["unclipped"] > 0, r
            # 1-D parameters on dim 0, the others on their last dim, never dim 0
            assert "(Shard(dim=0),)" in r["placements"] and widest in r["placements"], r["placements"]
            assert len(r["meshes"]) == 1 and "cpu" in r["meshes"][0], r["meshes"]  # one mesh: the default


def test_fully_shard_without_a_mesh_needs_a_process_group():
    with pytest.raises(ValueError, match="no mesh given and no default process group"):
        dpcompile.fully_shard(torch.nn.Linear(3, 2))


@pytest.mark.parametrize("case", sorted(dist_worker.NCCL_CASES))
@pytest.mark.parametrize("world", [2, 4])
def test_gpus_nccl_bf16_against_fp64_reference(world, case, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    spawn(dist_worker.correctness_nccl_bf16, str(tmp_path), case, world=world, timeout=900,
          start_method="spawn")
    worst = json.load(open(os.path.join(tmp_path, f"nccl_bf16_{world}_{case}.json")))
    assert set(worst) == {f"{case}-{s}" for s in ("bk", "ghost")}
    assert max(worst.values()) < 1, worst  # each: the worst error over its bound (correctness_nccl_bf16)


@extended  # tests/tiers.py: the default tier's 2-D mesh is dp x tp (test_tensor_parallel)
def test_hybrid_sharding_2x2_mesh(tmp_path):
    """4 ranks, replicate across mesh dim 0 and shard within dim 1: both schedules exact against the
    reference; replicas of a shard (ranks 0/2, 1/3) add the same noise draw, shards different ones."""
    spawn(dist_worker.hybrid, str(tmp_path), world=4, timeout=900)
    for rep in _read(tmp_path, world=4):
        for schedule in ("bk", "ghost"):
            assert rep[schedule]["counts"]["backward"]["reduce_scatter"] == rep[schedule]["n_params"]
    z = [torch.load(os.path.join(tmp_path, f"hnoise{r}.pt")) for r in range(4)]
    std = z[0]["std"]
    z = [d["noise"] for d in z]
    for name in z[0]:
        torch.testing.assert_close(z[0][name], z[2][name], rtol=0, atol=0)
        torch.testing.assert_close(z[1][name], z[3][name], rtol=0, atol=0)
        if z[0][name].shape == z[1][name].shape:
            assert not torch.equal(z[0][name], z[1][name]), name
    flat = torch.cat([z[r][n].flatten() for r in (0, 1) for n in z[r]]).double() / std  # one draw per coordinate
    assert abs(flat.mean()) < 4.5 / flat.numel() ** 0.5
    assert abs(flat.pow(2).mean() - 1) < 4.5 * (2 / flat.numel()) ** 0.5, flat.pow(2).mean()  # 4.5 sigma of chi2
