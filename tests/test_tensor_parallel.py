"""Tensor parallelism (parallelize_module, one 1-D mesh), 2 gloo ranks: exact gradients, one norm all-reduce, noise.

Cases: a GPT MLP and a Llama block (Colwise/Rowwise), transformers' Llama under its own plan (third-party
code), torchtitan's layout of a Llama under its tensor-parallel plan, and of a Llama and a GPT-style decoder
(LayerNorm and biases) under its sequence-parallel plan: a RowwiseParallel embedding (a Shard(0) weight with a
Replicate gradient) and SequenceParallel norms (Partial gradients: each rank holds its tokens' part of every
sample's gradient).
"""
import math

import pytest
import torch

import dist_worker
from test_fsdp import _read, spawn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.mark.parametrize("case,schedule,compiler", [
    ("gpt", "bk", "eager"), ("gpt", "ghost", "eager"), ("llama", "bk", "inductor"), ("llama", "ghost", "eager"),
    # sequence parallel: each schedule once, Inductor once (CI time)
    ("llama_sp", "bk", "inductor"), ("gpt_sp", "ghost", "eager"), ("llama_tp", "bk", "eager"),
    ("hf_llama", "ghost", "eager"),
])
def test_tensor_parallel_gradients_equal_the_oracle_and_noise_is_drawn_once_per_coordinate(
        case, schedule, compiler, tmp_path):
    spawn(dist_worker.tensor_parallel, str(tmp_path), case, schedule, compiler)
    r0, r1 = _read(tmp_path)
    kinds = r0["kinds"]
    assert kinds == r1["kinds"]
    of = lambda kind: sorted(n for n, k in kinds.items() if k == kind)  # noqa: E731
    assert of("shard"), "the plan shards nothing"
    B = 4
    for rep in (r0, r1):
        # one all-reduce over the group: the shards' [B] squared norms, and with Partial gradients their
        # per-sample parts, [B, 1 + n]; everything else counted once
        assert rep["counters"]["tp_norm_all_reduces"] == 1, rep["counters"]
        assert sorted(rep["tp_summary"]["sharded_params"]) == of("shard"), rep["tp_summary"]
        assert sorted(rep["tp_summary"]["partial_params"]) == of("partial"), rep["tp_summary"]
        partial_numel = sum(len(r0["noise"][n]) for n in of("partial"))
        assert rep["norm_all_reduce"] == ([B, 1 + partial_numel] if partial_numel else [B]), rep["norm_all_reduce"]
        # issued where its last operand is made, waited where the clip coefficients are: compute runs between
        assert any("c10d" not in op for op in rep["under_norm_all_reduce"]), rep["under_norm_all_reduce"]
        if case == "gpt":  # tensor parallel MLP: the attention's backward runs while the norms are summed
            assert any(op.endswith(("aten.mm.default", "aten.bmm.default")) for op in rep["under_norm_all_reduce"]), \
                rep["under_norm_all_reduce"]
    if case.endswith(("_sp", "_tp")):
        # the vocabulary-sharded embedding's gradient is whole on every rank (counted once, though its weight
        # is a shard); the sequence-parallel norms' gradients are sums over the group, plain norms whole
        assert kinds["tok_embeddings.weight"] == "replicate", kinds
        assert kinds["layers.0.attention_norm.weight"] == ("partial" if case.endswith("_sp") else "plain"), kinds
        if case == "gpt_sp":  # LayerNorm biases too; a RowwiseParallel bias is added before the reduce-scatter
            assert "norm.bias" in of("partial") and kinds["layers.0.feed_forward.w2.bias"] == "replicate", kinds
    std = r0["std"]
    pooled = []
    for name, a in r0["noise"].items():
        b = r1["noise"][name]
        if kinds[name] == "shard":
            assert a != b, f"{name}: both shards drew the same noise"
            pooled += a + b
        elif kinds[name] == "partial":
            assert all(x == 0.0 for x in b), f"{name}: a gradient summed over the group got noise on two ranks"
            pooled += a  # its one draw, on tp rank 0
        else:
            assert a == b, f"{name}: the replicas drew different noise, so they no longer agree"
            pooled += a  # one draw per coordinate of a replicated parameter
    n = len(pooled)
    mean = sum(pooled) / n
    var = sum((x - mean) ** 2 for x in pooled) / (n - 1)
    assert abs(mean) < 5 * std / math.sqrt(n), (mean, std, n)
    assert abs(var / std ** 2 - 1) < 5 * math.sqrt(2 / n), (var, std ** 2, n)
