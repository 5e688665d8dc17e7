"""bk's Gram norms in one call (passes.grouped_gram_norms, dpcompile::gram_sq_norms_group): which calls may wait
for the last one (never one whose operand would live longer, be read after a mutation, or whose partial sums are
read before), the op's schema and fake, and steps exact against the oracle with the calls grouped, in both
schedules and both compilers (the sharded runs: cases.check_case_invariants)."""
import collections
import types

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import models as M
from dpcompile import gram_sq_norms
from dpcompile.passes.grouped_gram_norms import grouped_gram_norms_pass
from helpers import check_against_reference
from tiers import extended

ops = torch.ops.dpcompile


def _step(a1, g1, a2, g2, a3, g3, a4, g4, a5, g5, keep):
    t2 = a2 * 2  # a buffer only the second call reads
    p1 = ops.gram_sq_norms(a1, g1)  # its operands are read again at the end: waits for the last call
    p2 = ops.gram_sq_norms(t2, g2)  # t2 would live longer: stays
    p3 = ops.gram_sq_norms(a3, g3)
    early = p3.sum()  # its sums read before the last call: stays
    p5 = ops.gram_sq_norms(a5, g5.view(3, 5, 6))
    ops.zero_rows_([g5], [keep], [0])  # its operand's base mutated before the last call: p5 stays
    p4 = ops.gram_sq_norms(a4, g4)  # the last call
    late = [x + 1 for x in (a1, g1, g2, a3, g3, a5, g5)]
    return p1.sum(1) + p2.sum(1) + p4.sum(1) + p5.sum(1) + early, *late


def _operands():
    torch.manual_seed(0)
    shapes = [(3, 5, 4, 6), (3, 5, 4, 6), (3, 7, 2, 3), (3, 5, 8, 6), (3, 5, 4, 6)]
    out = []
    for B, S, p, m in shapes:
        out += [torch.randn(B, S, p), torch.randn(B, S, m)]
    return out + [torch.tensor([True, False, True])]


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def test_only_calls_that_change_no_value_and_no_lifetime_wait():
    args = _operands()
    gm = make_fx(_step)(*[a.clone() for a in args])
    ctx = types.SimpleNamespace(counters=collections.Counter())
    names = [n.args[0].name for n in _calls(gm, ops.gram_sq_norms.default)]
    gm = grouped_gram_norms_pass(gm, ctx)
    assert ctx.counters == {"gram_norms_grouped": 2, "gram_norm_groups": 1}, ctx.counters
    (group,) = _calls(gm, ops.gram_sq_norms_group.default)
    assert [a.name for a in group.args[0]] == [names[0], names[4]], (names, group.args)  # a1, then a4
    left = [n.args[0].name for n in _calls(gm, ops.gram_sq_norms.default)]
    assert left == [names[1], names[2], names[3]], left  # t2, a3, a5
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    (mask,) = _calls(gm, ops.zero_rows_.default)
    assert index[group] > index[mask]  # where the last call was
    expected = _step(*[a.clone() for a in args])
    got = gm(*[a.clone() for a in args])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_group_op_schema_fake_and_errors():
    a = [torch.randn(2, 5, 3), torch.randn(2, 130, 24), torch.randn(2, 5, 3, dtype=torch.float64)]
    g = [torch.randn(2, 5, 4), torch.randn(2, 130, 16), torch.randn(2, 5, 7, dtype=torch.float64)]
    result = torch.library.opcheck(ops.gram_sq_norms_group.default, (a, g))
    assert all(v == "SUCCESS" for v in result.values()), result
    out = ops.gram_sq_norms_group(a, g)
    singles = [ops.gram_sq_norms(x, y) for x, y in zip(a, g)]
    assert out.shape == (2, sum(s.shape[1] for s in singles)) == (2, gram_sq_norms.group_parts(a, g))
    torch.testing.assert_close(out, torch.cat(singles, 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one pair per contraction"):
        ops.gram_sq_norms_group(a, g[:2])
    with pytest.raises(ValueError, match="with one B and device"):
        ops.gram_sq_norms_group([a[0], torch.randn(3, 5, 3)], [g[0], torch.randn(3, 5, 4)])


def _lm_loss(out, t):
    return torch.nn.functional.cross_entropy(out.transpose(1, 2), t, reduction="none").mean(1)


# ghost through Inductor: the extended tier (tests/tiers.py); the default tier runs ghost's grouped norms op by op
# and bk's through Inductor
@pytest.mark.parametrize("schedule,compiler", [("bk", "inductor"), ("bk", "eager"), ("ghost", "eager"),
                                               pytest.param("ghost", "inductor", marks=extended)])
def test_steps_with_grouped_norms_match_the_oracle(schedule, compiler):
    torch.manual_seed(0)
    ids, tgt = torch.randint(0, 50, (5, 16)), torch.randint(0, 50, (5, 16))
    model = M.GPT(vocab=50, d=32, n_head=2, n_layer=2, max_t=16)
    backend = check_against_reference(model, _lm_loss, (ids,), (tgt,), schedule=schedule, compiler=compiler,
                                      linear_norm="ghost")
    (rec,) = [r for r in backend.compiled if r.dp]
    ops_run = [op for op, _ in rec.ops["backward"]]
    kernels = rec.counters["gram_norm_kernels"]
    assert kernels == 9, rec.counters  # 4 Linear layers a block, and the LM head
    if schedule == "bk":  # every operand alive until the clip: one call, one launch per signature
        assert rec.counters["gram_norms_grouped"] == kernels and rec.counters["gram_norm_groups"] == 1, rec.counters
        assert ops_run.count("dpcompile.gram_sq_norms_group.default") == 1, ops_run
        assert "dpcompile.gram_sq_norms.default" not in ops_run, ops_run
    else:  # ghost frees an output gradient after its norm: those norms stay where they are
        assert "dpcompile.gram_sq_norms.default" in ops_run, ops_run
        assert rec.counters.get("gram_norms_grouped", 0) < kernels, rec.counters


def test_disabled_keeps_a_call_per_norm():
    torch.manual_seed(0)
    ids, tgt = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
    backend = check_against_reference(M.GPT(vocab=50, d=32, n_head=2, n_layer=1, max_t=16), _lm_loss, (ids,),
                                      (tgt,), schedule="bk", compiler="eager", linear_norm="ghost",
                                      disable_passes=("grouped_gram_norms",))
    (rec,) = [r for r in backend.compiled if r.dp]
    assert "gram_norm_groups" not in rec.counters
    assert [op for op, _ in rec.ops["backward"]].count("dpcompile.gram_sq_norms.default") == 5
