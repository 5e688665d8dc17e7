"""Saved tensors that alias are never donated to the backward (dpcompile/saved_aliases.py).

Two saved tensors that shared storage both counted as donated buffers, and Inductor reused one while the
other was still to be read (wrong gradients on an H100, Llama test model, bf16, ghost: two identical views
of the MLP input, one per linear). Which partition saves such views depends on the device (CUDA's fused
RMSNorm output is saved, CPU's decomposed one recomputed), so the pieces are tested here on hand-made
graphs and on attention (q, k and v: views of one projection, saved on every device), and end to end on
a GPU by tests/test_gpu.py.
"""
import pytest
import torch
from cases import LAYER_CASES
from helpers import check_against_reference
from torch.fx.experimental.proxy_tensor import make_fx

from dpcompile.saved_aliases import merge_identical_saved_values, without_aliases


def _forward(x, w):
    h = torch.sin(x)  # [4, 6, 8]
    return (h.view(24, 8) @ w).sum(), h.view(24, 8), h.view(24, 8), h.transpose(1, 2), torch.cos(x)


def _backward(a, b, c, d, t):
    return (a * 2 + b).sum(0) * t + c.sum(2).sum(0).sum() + d.sum()


def _partition(forward=_forward, backward=_backward):
    x, w = torch.randn(4, 6, 8), torch.randn(8, 3)
    fw = make_fx(forward, tracing_mode="fake")(x, w)
    outs = fw.graph.find_nodes(op="output")[0].args[0]
    bw = make_fx(backward, tracing_mode="fake")(*[n.meta["val"] for n in outs[1:]], torch.tensor(1.5))
    for n, p in zip(outs[1:], bw.graph.find_nodes(op="placeholder")):
        p._rename(n.name)  # a partitioner names the backward's inputs after the saved values
    bw.recompile()
    return fw, bw, (x, w)


def test_identical_saved_values_are_merged_and_the_backward_is_unchanged():
    fw, bw, args = _partition()
    t = torch.tensor(1.5)
    first = fw(*args)
    want = bw(*first[1:], t)
    counters = {}
    assert merge_identical_saved_values(fw, bw, 1, counters) == 1  # the second h.view(24, 8); not h.t()
    assert counters == {"saved_values_merged": 1}
    outs = fw(*args)
    assert len(outs) == len(first) - 1
    assert len(outs) == len(bw.graph.find_nodes(op="placeholder"))  # the saved values and the tangent
    torch.testing.assert_close(bw(*outs[1:], t), want)


def test_no_identical_saved_values_no_change():
    def forward(x, w):
        h = torch.sin(x)
        return (h.view(24, 8) @ w).sum(), h.view(24, 8), h.transpose(1, 2), torch.cos(x)

    fw, bw, _ = _partition(forward, lambda a, b, c, t: a.sum() * t + b.sum() + c.sum())
    before = fw.code, bw.code
    assert merge_identical_saved_values(fw, bw, 1, {}) == 0
    assert (fw.code, bw.code) == before


def test_random_draws_with_the_same_arguments_are_not_merged():
    """Two torch.rand((B, 1, 1)) (Hugging Face's drop path, once per block) are two masks: the backward must
    read each block's own (merged, every block read the first one's: wrong gradients with dropout on)."""
    def forward(x, w):
        a = torch.floor(torch.rand(4, 1, 1) + 0.5)
        b = torch.floor(torch.rand(4, 1, 1) + 0.5)
        h = torch.sin(x) * a
        return (h.view(24, 8) @ w).sum(), torch.rand(4, 1, 1), torch.rand(4, 1, 1), a, b

    fw, bw, _ = _partition(forward, lambda r1, r2, a, b, t: (r1 + 2 * r2).sum() * t + (a * b).sum())
    counters = {}
    assert merge_identical_saved_values(fw, bw, 1, counters) == 0, fw.code
    assert counters == {}
    assert len(fw.graph.find_nodes(op="call_function", target=torch.ops.aten.rand.default)) == 4


def test_aliasing_saved_tensors_are_not_donated():
    h, other = torch.randn(4, 6, 8), torch.randn(3)
    saved = [h.view(24, 8), other, h.transpose(1, 2), torch.randn(2)]
    # donated indexes count the saved symbolic sizes first (offset 2 here)
    assert without_aliases([2, 3, 4, 5], saved, 2) == [3, 5]
    assert without_aliases([3, 5], saved, 2) == [3, 5]
    assert without_aliases([0, 1, 2, 3], [h, other, None, torch.randn(1)], 0) == [0, 1, 2, 3]


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_attention_views_saved_side_by_side_stay_exact(schedule):
    """q, k and v are views of one projection's output, saved for attention's backward: none is donated
    (counter), and the gradients match the per-sample reference through Inductor's code."""
    c = LAYER_CASES["attention_padding_mask"]
    torch.manual_seed(0)
    inputs, targets = c.data(4)
    backend = check_against_reference(c.model(), c.loss, inputs, targets, schedule=schedule)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters.get("saved_aliases_not_donated", 0) >= 2, record.counters
