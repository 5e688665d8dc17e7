"""Tensor parallelism (parallelize_module, one 1-D mesh), 2 gloo ranks: exact gradients, one norm all-reduce, noise."""
import math

import pytest
import torch

import dist_worker
from test_fsdp import _read, spawn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


@pytest.mark.parametrize("case,schedule,compiler", [
    ("gpt", "bk", "eager"), ("gpt", "ghost", "eager"), ("llama", "bk", "inductor"), ("llama", "ghost", "eager"),
])
def test_tensor_parallel_gradients_equal_the_oracle_and_noise_is_drawn_once_per_coordinate(
        case, schedule, compiler, tmp_path):
    spawn(dist_worker.tensor_parallel, str(tmp_path), case, schedule, compiler)
    r0, r1 = _read(tmp_path)
    for rep in (r0, r1):
        # the shards' [B] squared norms summed over the group by one all-reduce; the rest counted once
        assert rep["counters"]["tp_norm_all_reduces"] == 1, rep["counters"]
        assert sorted(rep["tp_summary"]["sharded_params"]) == sorted(rep["sharded"]), rep["tp_summary"]
        if case == "gpt":  # tensor parallel MLP: the attention's backward runs while the norms are summed
            assert any(op.endswith(("aten.mm.default", "aten.bmm.default")) for op in rep["under_norm_all_reduce"]), \
                rep["under_norm_all_reduce"]
    assert r0["sharded"], "the plan shards nothing"
    std = r0["std"]
    shard_noise = []
    for name, a in r0["noise"].items():
        b = r1["noise"][name]
        if name in r0["sharded"]:
            assert a != b, f"{name}: both shards drew the same noise"
            shard_noise += a + b
        else:
            assert a == b, f"{name}: the replicas drew different noise, so they no longer agree"
            shard_noise += a  # one draw per coordinate of a replicated parameter
    n = len(shard_noise)
    mean = sum(shard_noise) / n
    var = sum((x - mean) ** 2 for x in shard_noise) / (n - 1)
    assert abs(mean) < 5 * std / math.sqrt(n), (mean, std, n)
    assert abs(var / std ** 2 - 1) < 5 * math.sqrt(2 / n), (var, std ** 2, n)
