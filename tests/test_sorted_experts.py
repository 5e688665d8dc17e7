"""Routed experts over tokens sorted by expert across the whole batch (passes.rules.row_order, passes.grouped_norms):
Hugging Face's default MoE form (experts_implementation="grouped_mm"), its bf16 kernel (torch._grouped_mm), hand-
written sorts, against the vmap(grad) oracle with clipping active. cases.sorted_experts runs in the matrix of every
case, one process and sharded (test_per_sample_clipping, test_fsdp's layer kinds); the refusals are in
test_refusals."""
import pytest
import torch
import torch.nn as nn

import dpcompile
import models as M
from cases import CASES
from helpers import assert_bf16_close, check_against_reference, clipped_on
from tiers import op_by_op_here

# transformers' grouped_mm_fallback (fp32) in a training step needs its backward op (models.grouped_fallback_traceable)
needs_fallback_backward = pytest.mark.skipif(
    not M.grouped_fallback_traceable(), reason="this transformers release's grouped_mm_fallback backward loops on the "
    "host (test_the_untraceable_fallback_says_what_to_do checks the error)")


@needs_fallback_backward
@pytest.mark.parametrize("algo", ["ghost", "direct"])
def test_grouped_weight_norm_forms(algo):
    """Each per-sample norm form of a grouped matmul's weight gradient: the Grams of each sample's rows masked to
    pairs in one group, or each sample's [E, p, m] gradient."""
    c = CASES["sorted_experts"]
    inputs, targets = c.data(4)
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule="bk", linear_norm=algo,
                                      compiler="eager")  # (the graphs dpcompile wrote, op by op: CI time)
    assert backend.compiled[0].counters[f"norm_grouped_{algo}"] == 6, backend.compiled[0].counters


@needs_fallback_backward
# the batch of one op by op, its Inductor run the extended tier (tests/tiers.py; CI time): the grouped matmuls'
# lowering is the symbolic batch's here, and the clipping of a whole gradient dpcompile's rewrite
@pytest.mark.parametrize("batch,compiler", [(5, "inductor"), *op_by_op_here(1)])
def test_one_graph_for_every_batch_size_and_a_batch_of_one(batch, compiler):
    """Sorted rows with the batch size a symbol (dpcompile.mark_batch: the sharded step's form) and at a static
    batch of one."""
    c = CASES["sorted_experts"]
    inputs, targets = c.data(batch)
    if batch > 1:
        dpcompile.mark_batch(*inputs, *targets)
    check_against_reference(c.model(), c.loss, inputs, targets, schedule="ghost", compiler=compiler)


class GatheredSortedExperts(nn.Module):
    """A hand-written sort: argmax routing, tokens argsorted by expert, each row times its expert's weight
    gathered (a table scattered by the sorted ids in the backward), the rows put back by the argsort of the
    order."""

    def __init__(self, d: int = 4, experts: int = 3):
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.w = nn.Parameter(torch.randn(experts, d, d) / d)
        self.b = nn.Parameter(torch.randn(experts, d) / d)

    def forward(self, x):  # [B, T, d]
        tokens = x.flatten(0, 1)
        expert = self.router(tokens).argmax(-1)
        order = expert.argsort()
        e = expert[order]
        out = torch.bmm(tokens[order][:, None], self.w[e])[:, 0] + self.b[e]
        return (out[order.argsort()] * self.router(tokens).softmax(-1).amax(-1, keepdim=True)).view_as(x)


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_a_table_gathered_by_sorted_ids(schedule):
    """The experts' weights and biases gathered per sorted row: their gradients scatter sorted rows by the sorted
    ids, each row its sample's (an index_put contribution over sorted rows)."""
    x = torch.randn(5, 3, 4)
    backend = check_against_reference(GatheredSortedExperts(), lambda out: out.pow(2).sum((1, 2)), (x,), (),
                                      schedule=schedule)
    assert backend.compiled[0].counters["norm_index_put_embedding_ghost"] == 2, backend.compiled[0].counters


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_bf16_grouped_matmul_kernel(schedule):
    """In bf16 the layers call torch._grouped_mm: its input gradient is a grouped matmul of the sorted rows, its
    weight gradient one over them (x^T g per group), in bf16 against the fp64 oracle."""
    torch.manual_seed(0)
    model = M.SortedExperts(d=8, hidden=16).to(torch.bfloat16)  # (its rows' strides: multiples of 16 bytes)
    x, y = torch.randn(4, 5, 8).bfloat16(), torch.randn(4, 5, 3)
    ref, dp, backend = clipped_on("cpu", model, M.mse, (x,), (y,), schedule=schedule,
                                  compiler="inductor" if schedule == "bk" else "eager")  # (CI time)
    assert_bf16_close(dp, ref)
    (record,) = [r for r in backend.compiled if r.dp]
    assert "aten._grouped_mm" in record.graphs["joint_graph_after_dp"]
    assert sum(v for k, v in record.counters.items() if k.startswith("norm_grouped_")) == 6, record.counters


def _mixtral(experts_implementation: str):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=29, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                        num_local_experts=4, num_experts_per_tok=2, experts_implementation=experts_implementation)
    return MixtralForCausalLM(cfg)


@needs_fallback_backward
@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_hugging_face_mixtral_in_its_default_experts_form(schedule):
    """transformers' Mixtral as built, experts_implementation="grouped_mm" (its default): compiled in fp32 its
    grouped matmul is transformers' custom op; the oracle runs the same weights in the batched_mm form (vmap
    cannot run the custom op)."""
    model, twin = _mixtral("grouped_mm"), _mixtral("batched_mm")
    twin.load_state_dict(model.state_dict())
    x, y = torch.randint(0, 29, (4, 6)), torch.randint(0, 29, (4, 6))
    backend = check_against_reference(model, lambda out, y: M.seq_ce(out.logits, y), (x,), (y,), schedule=schedule,
                                      oracle=twin, compiler="inductor" if schedule == "bk" else "eager")
    counters = backend.compiled[0].counters
    assert counters["norm_grouped_ghost"] + counters.get("norm_grouped_direct", 0) == 2, counters


@pytest.mark.skipif(M.grouped_fallback_traceable(), reason="this transformers release traces its fallback's backward")
def test_the_untraceable_fallback_says_what_to_do():
    """With a transformers release whose grouped_mm_fallback backward loops on the host, the fp32 grouped form
    cannot be compiled for training (stock torch.compile fails too): the error says what to do."""
    from dpcompile import DPCompileError

    model = M.SortedExperts()
    x, y = torch.randn(4, 5, 6), torch.randn(4, 5, 3)
    with pytest.raises(DPCompileError, match="Upgrade transformers"):
        check_against_reference(model, M.mse, (x,), (y,), schedule="bk")
