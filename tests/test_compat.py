"""The fixes dpcompile adds to older torch releases."""
import pytest

import dpcompile
from dpcompile.compat import guard_empty_y_grid, hint_mix_order_split, unbacked_size_hints

th = pytest.importorskip("torch._inductor.runtime.triton_heuristics")


@pytest.mark.skipif(not hasattr(th, "Grid2DWithYZOverflow"), reason="this torch has no y-grid overflow grid")
@pytest.mark.parametrize("ynumel", [0, 5, 200_000])
def test_y_overflow_grid_of_an_empty_dim_is_zero(ynumel):
    guard_empty_y_grid()
    grid = th.Grid2DWithYZOverflow(inductor_meta={"grid_type": "Grid2DWithYZOverflow"}, mode="python")
    grid.generate({"XBLOCK": 16, "YBLOCK": 2})
    g0, g1, g2 = grid.eval_slow({"xnumel": 64, "ynumel": ynumel, "XBLOCK": 16, "YBLOCK": 2})
    assert g0 == 4
    assert g1 * g2 >= (ynumel + 1) // 2 and (g1 == 0) == (ynumel == 0)
    assert g1 <= 65535


def test_unbacked_size_hints_use_the_hint_override_and_leave_static_sizes_alone():
    from torch._inductor.sizevars import SizeVarAllocator
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    u = env.create_unbacked_symint().node.expr
    env.var_to_hint_override[u] = 3
    sizevars = SizeVarAllocator(env)
    had = hasattr(sizevars, "size_hint")
    with unbacked_size_hints(sizevars):
        assert sizevars.size_hint(u * 1024) == 3 * 1024
        assert sizevars.size_hint(7 * 64) == 448
    assert hasattr(sizevars, "size_hint") == had  # the class's method again, or none as before


def test_mix_order_split_patch_only_where_torch_still_asks_size_hint():
    import inspect

    simd = pytest.importorskip("torch._inductor.codegen.simd")
    hint_mix_order_split()
    fn = simd.SIMDScheduling._codegen_mix_order_reduction
    original = getattr(fn, "_dpcompile_original", fn)
    asks_size_hint = "sizevars.size_hint(numel)" in inspect.getsource(original)
    assert getattr(fn, "_dpcompile_guarded", False) == asks_size_hint


def test_k_dimensional_cross_entropy_traces_whole_with_an_unbacked_batch():
    """F.cross_entropy on [N, C, T] branches on numel > 0 in C++: with an unbacked N dynamo would
    graph-break inside the loss. With the Python decomposition it traces in one graph, same values."""
    import torch
    import torch.nn.functional as F

    from dpcompile.compat import size_oblivious_nll_loss_nd

    size_oblivious_nll_loss_nd()

    def loss(logits, y):
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none", ignore_index=2).mean(1)

    for n in (3, 0, 1):
        logits, y = torch.randn(n, 4, 5), torch.randint(0, 5, (n, 4))
        dpcompile.mark_batch(logits, y)
        got = torch.compile(loss, backend="eager", fullgraph=True)(logits, y)  # fullgraph: a break raises
        torch.testing.assert_close(got, loss(logits, y), equal_nan=True)


def test_global_average_pool_of_a_channel_last_map_traces_whole_with_an_unbacked_batch():
    """adaptive_avg_pool2d(h, 1) asks whether h is channel-last, which guards on an unbacked batch size: a
    graph break inside the pool (timm's ConvNeXt head). With the Python decomposition: one graph, same
    values, for a batch of 4, 1 and 0."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from dpcompile.compat import size_oblivious_global_avg_pool

    size_oblivious_global_avg_pool()
    conv, mix = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 4)

    def head(x):
        h = conv(x)
        h = mix(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) + h  # channel-last strides, as timm's residual
        return F.adaptive_avg_pool2d(h, 1).flatten(1)

    for n in (4, 1, 0):
        x = torch.randn(n, 3, 5, 5)
        dpcompile.mark_batch(x)
        got = torch.compile(head, backend="aot_eager", fullgraph=True)(x)  # fullgraph: a break raises
        torch.testing.assert_close(got, head(x))


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_masked_attention_falls_back_to_math_attention_exactly(schedule, monkeypatch):
    """torch 2.11 cannot pick an SDPA kernel for a mask whose batch size is unbacked (a graph break inside
    the attention); dpcompile then traces the math attention on the additive mask. Forced here (this
    torch may not need it): exact against the oracle, one graph, for a batch of 4 and one of 1."""
    import torch

    import models as M
    from cases import ids
    from dpcompile import compat
    from helpers import check_against_reference

    monkeypatch.setitem(compat._SDPA_FALLBACK, "always", True)
    before = compat._SDPA_FALLBACK["traced"]
    for B in (4, 1):
        torch.manual_seed(B)
        x, y = ids(B, 5, 11, pad=0), torch.randn(B, 5, 3)
        dpcompile.mark_batch(x, y)
        backend = check_against_reference(M.PaddedAttention(), M.mse, (x,), (y,), schedule=schedule)
        assert len([r for r in backend.compiled if r.dp]) == 1
    assert compat._SDPA_FALLBACK["traced"] > before


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_models_without_cache_trace_whole_under_an_unbacked_batch(family):
    """transformers' mask code asks whether the batch is 1 to expand position ids (use_cache=False, no
    attention mask): under an unbacked batch that was a graph break. One graph now, the same logits."""
    import torch

    import cases

    torch.manual_seed(0)
    model = cases.CASES[f"hf_{family}"].model()

    def forward(x):
        return model(x, use_cache=False).logits

    compiled = torch.compile(forward, backend="eager", fullgraph=True)  # fullgraph: a break raises
    for B in (3, 1, 2):
        x = torch.randint(0, 29, (B, 6))
        dpcompile.mark_batch(x)
        torch.testing.assert_close(compiled(x), forward(x))
    from transformers import masking_utils

    assert masking_utils._preprocess_mask_arguments._dpcompile_guarded
