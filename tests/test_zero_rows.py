"""bk's masks of unscaled operands in place (passes.inplace_row_masks, dpcompile::zero_rows_): the Triton kernel
under TRITON_INTERPRET=1 against masked_fill_ on every layout the backward hands it, the op's schema, and steps
whose dropped samples hold NaN and inf in the operands masked in place, exact against the oracle."""
import pytest
import torch

import models as M
import zero_rows_check
from dpcompile import zero_rows
from dpcompile.passes.clip_schedule import SUM_FROM_ROWS
from helpers import check_against_reference, run_interpreted


def test_triton_kernel_matches_masked_fill_interpreted():
    report = run_interpreted("zero_rows_check.py")
    # each layout and dtype by the one-tensor kernel, and all of them in one launch of the table kernel
    assert len(report) == 2 * 2 * len(list(zero_rows_check._layouts("cpu", torch.float32))), report
    assert set(report.values()) == {0}, report


def test_layouts_without_runs_fall_back_to_masked_fill():
    base = torch.randn(4, 6, 8, 10)
    cut = base[:, :3, :5, :7]  # three strided dims per row: no runs
    assert zero_rows.row_runs(cut.shape, cut.stride(), 0) is None
    expanded = torch.randn(4, 1, 5).expand(4, 3, 5)
    assert zero_rows.row_runs(expanded.shape, expanded.stride(), 0) is None
    with pytest.raises(ValueError, match="no contiguous runs"):
        zero_rows.launch(cut, torch.ones(4, dtype=torch.bool), 0)
    keep = torch.tensor([True, False, True, False])
    cut[1, 0, 0, 0] = float("nan")
    before = base.clone()
    torch.ops.dpcompile.zero_rows_([cut], [keep], [0])  # masked_fill_ on CPU and on such layouts
    assert torch.equal(cut[1], torch.zeros_like(cut[1])) and torch.equal(cut[3], torch.zeros_like(cut[3]))
    assert torch.equal(cut[0], before[0, :3, :5, :7]) and torch.equal(cut[2], before[2, :3, :5, :7])
    assert torch.equal(base[:, 3:], before[:, 3:])  # outside the view: untouched


def test_op_schema_mutates_its_first_argument():
    x, keep = torch.randn(5, 3), torch.tensor([True, False, True, True, False])
    y = torch.randn(2, 5)
    result = torch.library.opcheck(torch.ops.dpcompile.zero_rows_.default, ([x, y], [keep, keep[None]], [0, 1]))
    assert all(v == "SUCCESS" for v in result.values()), result
    assert torch.ops.dpcompile.zero_rows_.default._schema.is_mutable


def test_bad_arguments_say_what_to_give():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="one mask and one dim per tensor"):
        torch.ops.dpcompile.zero_rows_([x, x], [torch.ones(4, dtype=torch.bool)], [0, 0])
    with pytest.raises(ValueError, match="keep must be a bool tensor"):
        zero_rows.launch(x, torch.ones(4), 0)
    with pytest.raises(ValueError, match="keep has 3 entries for 4 rows"):
        zero_rows.launch_table([x], [torch.ones(3, dtype=torch.bool)], [0])


class Widening(torch.nn.Module):
    """Every Linear widens, so bk scales its input and masks its output gradient: a buffer the backward makes
    itself, zeroed in place. A NaN input makes every one of its sample's output gradients NaN."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = torch.nn.Linear(4, 16), torch.nn.Linear(16, 24), torch.nn.Linear(24, 32)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
@pytest.mark.parametrize("in_place", [True, False])
def test_masked_output_gradients_in_place_drop_nan_samples_exactly(compiler, in_place):
    torch.manual_seed(0)
    x, y = torch.randn(7, 4), torch.randint(0, 32, (7,))
    x[2] = float("nan")
    x[5, 1] = float("inf")
    backend = check_against_reference(Widening(), M.ce, (x,), (y,), schedule="bk", compiler=compiler,
                                      disable_passes=() if in_place else ("inplace_row_masks",))
    (rec,) = [r for r in backend.compiled if r.dp]
    ops = [op for op, _ in rec.ops["backward"]]
    if in_place:
        # the three output gradients (the inputs are the scaled side), in one call
        assert rec.counters["row_masks_in_place"] == 3 and rec.counters["row_mask_calls"] == 1, rec.counters
        assert ops.count("dpcompile.zero_rows_.default") == 1, ops
    else:
        assert "row_masks_in_place" not in rec.counters and "dpcompile.zero_rows_.default" not in ops
    assert backend.dropped_samples() == 2


def test_bk_scales_the_narrower_operand():
    # an LM head's shape: the logits' gradient [B*T, 40] is masked in place, the hidden states [B*T, 6] scaled
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 40))
    x, y = torch.randn(4, 5, 3), torch.randint(0, 40, (4, 5))
    x[1] = float("nan")
    backend = check_against_reference(model, M.seq_ce, (x,), (y,), schedule="bk")
    (rec,) = [r for r in backend.compiled if r.dp]
    params = rec.summary["params"]
    assert params["2.weight"]["bk_scaled"] == "the input [20, 6]", params["2.weight"]
    assert params["0.weight"]["bk_scaled"] == "the input [20, 3]", params["0.weight"]
    # the bias: its clipped sum from the norm pass's per-sample sums, not from the [20, 40] output gradient
    assert params["2.bias"]["bk_scaled"] == SUM_FROM_ROWS, params["2.bias"]
    assert rec.counters["row_masks_in_place"] == 2, rec.counters


def test_a_buffer_shared_with_a_graph_input_is_masked_by_a_copy():
    """The pass on a backward-shaped graph: a clone of an input (which Inductor's no-op removal may turn back into
    the input), a view of an input and a cast to the same dtype keep their masked copy; a product, a clone into
    another layout and a cast to another dtype are the graph's own buffers, masked in place; every result as
    before, the input untouched."""
    import collections
    import types

    from torch.fx.experimental.proxy_tensor import make_fx

    from dpcompile.passes.inplace_row_masks import ROW_MASK, inplace_row_masks_pass

    def f(a, keep):
        outs = []
        for v in (a.clone(), a.view(6, 2), a.to(a.dtype), a * 2.0, a[:, None].expand(3, 2, 4).contiguous(),
                  a.to(torch.float64)):
            k = keep.reshape([-1] + [1] * (v.dim() - 1)) if v.shape[0] == 3 else keep.repeat_interleave(2)[:, None]
            outs.append(torch.where(k, v, 0.0).sum(-1))
        return outs

    a, keep = torch.randn(3, 4), torch.tensor([True, False, True])
    a[1, 2] = float("nan")
    gm = make_fx(f, tracing_mode="fake")(a, keep)
    for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.where.self):
        n.meta[ROW_MASK] = 0
    want = gm(a.clone(), keep)
    ctx = types.SimpleNamespace(counters=collections.Counter())
    gm = inplace_row_masks_pass(gm, ctx)
    assert ctx.counters == {"row_masks_in_place": 3, "row_masks_copied": 3, "row_mask_calls": 1}, ctx.counters
    zeros = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.scalar_tensor.default)
    assert zeros and all(z.users for z in zeros), zeros  # the masks' zeros of the copied wheres only
    given = a.clone()
    got = gm(given, keep)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(given, a, equal_nan=True)


def test_masks_share_a_call_where_no_read_changes():
    """The pass groups masks into one zero_rows_ call at the first of them, moving a keep layout made later ahead
    of it; a mask whose operand is read in between, or made after that point, goes to a later call. Every value
    the graph returns is the one the copying masks gave (a reader before a mask still sees the NaN rows)."""
    import collections
    import types

    from torch.fx.experimental.proxy_tensor import make_fx

    from dpcompile.passes.inplace_row_masks import ROW_MASK, inplace_row_masks_pass

    def f(a, keep):
        x1, x2, x4 = a * 2.0, a + 1.0, a * 5.0
        m1 = torch.where(keep.view(3, 1), x1, 0.0)  # the first mask: the first call goes here
        read = x2.sum(-1)  # reads x2 unmasked after the first mask: x2's mask stays out of the first call
        x3 = a - 3.0  # made after the first mask: its mask too
        m4 = torch.where(keep.reshape(3, 1).clone(), x4, 0.0)  # keep laid out later: moved ahead, joins
        m2 = torch.where(keep[:, None], x2, 0.0)
        m3 = torch.where(keep[:, None], x3, 0.0)
        return m1.sum(-1), read, m4.sum(-1), m2.sum(-1), m3.sum(-1)

    a, keep = torch.randn(3, 4), torch.tensor([True, False, True])
    a[1, 2] = float("nan")
    gm = make_fx(f, tracing_mode="fake")(a, keep)
    wheres = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.where.self)
    for n in wheres:
        n.meta[ROW_MASK] = 0
    x1, x4, x2, x3 = (w.args[1] for w in wheres)
    want = gm(a, keep)
    ctx = types.SimpleNamespace(counters=collections.Counter())
    gm = inplace_row_masks_pass(gm, ctx)
    assert ctx.counters == {"row_masks_in_place": 4, "row_mask_calls": 2}, ctx.counters
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.dpcompile.zero_rows_.default)
    assert [c.args[0] for c in calls] == [[x1, x4], [x2, x3]], [c.args[0] for c in calls]
    got = gm(a, keep)
    assert torch.isnan(got[1][1])  # x2 read before its mask
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True)
