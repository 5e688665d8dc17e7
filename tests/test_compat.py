"""The fixes dpcompile adds to older torch releases."""
import inspect
import types

import pytest
import torch

import dpcompile
from dpcompile.compat import (guard_empty_y_grid, hint_fusion_scores, hint_kernel_size_hints, hint_mix_order_split,
                              unbacked_size_hints)
from tiers import extended

th = pytest.importorskip("torch._inductor.runtime.triton_heuristics")


@pytest.fixture
def inductor_caches_off():
    """Inductor compiles anew (the patched lowering or fake rules are what the test checks). config.patch, not
    monkeypatch: torch 2.11's config module takes a monkeypatched attribute back wrongly."""
    import torch

    with torch._inductor.config.patch(force_disable_caches=True):
        yield


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


def test_unbacked_symbolic_hints_use_the_hint_override_and_leave_other_sizes_alone():
    import sympy
    from torch._inductor.sizevars import SizeVarAllocator
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    class OlderSizeVars(SizeVarAllocator):
        def symbolic_hint(self, expr):  # torch 2.11's: a size with an unbacked symbol is left symbolic
            return sympy.sympify(expr)

    env = ShapeEnv()
    u, v = env.create_unbacked_symint().node.expr, env.create_unbacked_symint().node.expr
    env.var_to_hint_override[u] = 3
    sizevars = OlderSizeVars(env)
    with unbacked_size_hints(sizevars, "symbolic_hint"):
        assert sizevars.symbolic_hint(u * 1024) == 3 * 1024  # the kernel is tuned for the hinted batch
        assert sizevars.symbolic_hint(sympy.Integer(7 * 64)) == 448
        assert int(sizevars.symbolic_hint(v * 2)) > 2  # no hint: Inductor's fallback, a number all the same
    assert "symbolic_hint" not in vars(sizevars)  # the class's method again
    assert sizevars.symbolic_hint(u * 1024) == u * 1024


@pytest.mark.parametrize("module,owner,name,install,marker", [
    ("torch._inductor.codegen.triton", "TritonKernel", "codegen_kernel", hint_kernel_size_hints, "size_hint = 8192"),
    ("torch._inductor.codegen.simd", "SIMDScheduling", "_codegen_mix_order_reduction", hint_mix_order_split,
     "sizevars.size_hint(numel)"),
])
def test_hint_patches_only_where_torch_still_asks_the_flat_question(module, owner, name, install, marker):
    """Each patch is installed on a torch whose code still has the older question, and only there."""
    cls = getattr(pytest.importorskip(module), owner)
    install()
    chain = _wrappers(getattr(cls, name))  # (mix_order_reduction_keeps_shapes may wrap the hinted method too)
    hinted = any(f.__name__ == "hinted" for f in chain)
    assert hinted == (marker in inspect.getsource(chain[-1]))


def _wrappers(fn) -> list:
    """fn, and each function it wraps (dpcompile's wrappers keep theirs in _dpcompile_original), torch's last."""
    chain = [fn]
    while hasattr(chain[-1], "_dpcompile_original"):
        chain.append(chain[-1]._dpcompile_original)
    return chain


def test_mix_order_reduction_gets_its_view_only_where_torch_lacks_it():
    """compat.mix_order_reduction_keeps_shapes wraps the mix-order codegen where torch's final reduction line has no
    view back to the buffer's shape (torch 2.11; 2.13 has it), over hint_mix_order_split's wrapper; its pattern
    matches the line that codegen writes."""
    from dpcompile.compat import _FINAL_REDUCE, hint_mix_order_split, mix_order_reduction_keeps_shapes

    simd = pytest.importorskip("torch._inductor.codegen.simd")
    hint_mix_order_split()
    mix_order_reduction_keeps_shapes()
    chain = _wrappers(simd.SIMDScheduling._codegen_mix_order_reduction)
    source = inspect.getsource(chain[-1])
    kept = any(getattr(f, "_dpcompile_shapes_kept", False) for f in chain)
    assert kept == ("final_shape" not in source and ".view({nsplit}, {rnumel})" in source)
    line = "buf71 = workspace_0[0 * math.floor(15/16 + (1/16)*u0) * 512 : (0 + 1) * 4 * 512].view(4, 512).sum(dim=0)"
    assert _FINAL_REDUCE.match(line).group(1) == "buf71"


def _scheduled_nodes(step, x, hint, monkeypatch) -> int:
    """How many nodes (kernels and extern calls) Inductor's scheduler leaves after fusing step's graph."""
    import torch
    from torch._inductor.scheduler import Scheduler

    counts = []
    original = Scheduler.fuse_nodes

    def fuse_nodes(self, nodes):
        fused = original(self, nodes)
        counts.append(len(fused))
        return fused

    monkeypatch.setattr(Scheduler, "fuse_nodes", fuse_nodes)
    if hint is not None:
        torch._dynamo.decorators.mark_unbacked(x, 0, hint_override=hint)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        torch.compile(step)(x)
    return sum(counts)


def _unhinted_dep_scores(self, dep, count_bytes=True):
    """torch 2.11's GraphLowering.get_dep_size_hint: 0 bytes for a buffer with an unbacked size, hint or not."""
    if (dep, count_bytes) not in self.dep_size_hint_cache:
        size = 0
        try:
            if not dep.has_unbacked_symbols():
                size = dep.numbytes_hint() if count_bytes else dep.numel_hint()
        except KeyError:
            pass
        self.dep_size_hint_cache[(dep, count_bytes)] = size
    return self.dep_size_hint_cache[(dep, count_bytes)]


def test_hinted_unbacked_batch_fuses_as_newer_torch_does(monkeypatch):
    """A LayerNorm, a Linear with bias, GELU and a residual, forward and backward, the batch unbacked and
    hinted. The older scheduler's scoring (installed here) leaves more nodes unfused (its fusions score 0);
    with hint_fusion_scores it leaves as many as the newer scheduler (which scores hinted buffers itself),
    within one of a fixed batch's."""
    import torch
    import torch.nn.functional as F
    from torch._inductor.graph import GraphLowering
    from torch._inductor.sizevars import SizeVarAllocator

    w, b, g = (torch.randn(32, 32, requires_grad=True), torch.randn(32, requires_grad=True),
               torch.randn(32, requires_grad=True))

    def step(x):
        h = F.layer_norm(x, (32,), g) @ w + b
        (F.gelu(h) + x).sum().backward()

    fixed = _scheduled_nodes(step, torch.randn(6, 8, 32), None, monkeypatch)
    native = _scheduled_nodes(step, torch.randn(6, 8, 32), 6, monkeypatch)
    monkeypatch.setattr(GraphLowering, "get_dep_size_hint", _unhinted_dep_scores)
    unhinted = _scheduled_nodes(step, torch.randn(6, 8, 32), 6, monkeypatch)
    hint_fusion_scores(force=True)
    hinted = _scheduled_nodes(step, torch.randn(6, 8, 32), 6, monkeypatch)
    assert unhinted > hinted and hinted <= fixed + 1, (fixed, unhinted, hinted)
    if hasattr(SizeVarAllocator, "all_unbacked_explicitly_hinted"):
        assert hinted == native, (native, hinted)


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


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("form", ["2d", "k_dim", "weight_smoothing"])
def test_probability_target_cross_entropy_traces_whole_with_an_unbacked_batch(reduction, form):
    """F.cross_entropy with probability targets asks torch 2.11 for a plain size of the input: with an
    unbacked batch dynamo would graph-break inside the loss (the sharded one_hot_targets case on the GPU
    machine). With the Python kernel: one graph for batches of 3, 0 and 1, the values and input gradients
    of torch's own (nan for the mean of an empty batch, as torch)."""
    import torch
    import torch.nn.functional as F

    from dpcompile.compat import size_oblivious_prob_cross_entropy

    size_oblivious_prob_cross_entropy()
    weight = torch.rand(5) + 0.5 if form == "weight_smoothing" else None
    smoothing = 0.2 if form == "weight_smoothing" else 0.0

    def loss(logits, t):
        return F.cross_entropy(logits, t, weight=weight, reduction=reduction, label_smoothing=smoothing)

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="eager", fullgraph=True)  # fullgraph: a break raises
    for n in (3, 0, 1):
        shape = (n, 5, 4) if form == "k_dim" else (n, 5)
        logits, t = torch.randn(shape, requires_grad=True), torch.randn(shape).softmax(1)
        eager_logits = logits.detach().clone().requires_grad_()
        dpcompile.mark_batch(logits, t)
        got, want = compiled(logits, t), loss(eager_logits, t)
        torch.testing.assert_close(got, want, equal_nan=True)
        if n and reduction != "none":
            got.backward()
            want.backward()
            torch.testing.assert_close(logits.grad, eager_logits.grad)


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
    from helpers import check_one_graph_against_reference

    monkeypatch.setitem(compat._SDPA_FALLBACK, "always", True)
    before = compat._SDPA_FALLBACK["traced"]
    torch.manual_seed(0)
    check_one_graph_against_reference(M.PaddedAttention(), M.mse,
                                      [(ids(B, 5, 11, pad=0), torch.randn(B, 5, 3)) for B in (4, 1)],
                                      schedule=schedule, compiler="inductor" if schedule == "bk" else "eager")
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


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif("not __import__('torch').cuda.is_available()",
                                                                reason="needs CUDA"))]


def _whole_graph_grads(fn, params, sizes, make):
    """fn compiled with fullgraph (a graph break raises) on a batch dpcompile.mark_batch made unbacked: its value
    and its parameters' gradients equal eager's for every batch size that eager can run; batch 0 compiles and
    runs (eager may refuse it: a -1 of 0 elements is ambiguous there)."""
    import torch

    for n in sizes:
        torch._dynamo.reset()
        x = make(n)
        dpcompile.mark_batch(x)
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
        grads = torch.autograd.grad(got, params)
        if n == 0:
            continue
        want = fn(x)
        torch.testing.assert_close(got, want)
        for g, w in zip(grads, torch.autograd.grad(want, params)):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_a_minus_one_in_the_reshape_of_a_transposed_batch_traces_whole(device):
    """Bloom's q.transpose(1, 2).reshape(B * H, -1, D): C++ infers the -1 by asking whether B * H * D is 0,
    which guards on an unbacked batch size (a graph break in the attention of a sharded step)."""
    import torch

    w = torch.nn.Parameter(torch.randn(8, 8, device=device))

    def heads(x):
        B = x.shape[0]
        q = (x @ w).view(B, 5, 2, 4).transpose(1, 2)  # [B, H, T, D], not viewable as [B * H, T, D]
        return (q.reshape(B * 2, -1, 4) ** 2).sum()

    _whole_graph_grads(heads, [w], (3, 1, 0), lambda n: torch.randn(n, 5, 8, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_a_parameter_repeated_over_the_batch_traces_whole(device):
    """DeBERTa's position projection .repeat(query.size(0) // heads, 1, 1): the autograd formula of repeat
    asks whether the count is 1. The gradient is the sum over the repeats, as eager's."""
    import torch

    w = torch.nn.Parameter(torch.randn(2, 5, 4, device=device))

    def scores(x):
        B = x.shape[0]
        return (x.view(B * 2, 5, 4) * w.repeat(B, 1, 1)).sum()

    _whole_graph_grads(scores, [w], (3, 1, 0), lambda n: torch.randn(n, 2, 5, 4, device=device))
    # a count known when tracing goes to torch's own autograd kernel through the Python kernel: its gradient too
    torch._dynamo.reset()
    x = torch.randn(3, 2, 5, 4, device=device)
    (g,) = torch.autograd.grad(torch.compile(scores, backend="aot_eager", fullgraph=True)(x), [w])
    torch.testing.assert_close(g, torch.autograd.grad(scores(x), [w])[0])

    def heads(x):
        # WavLM's position bias: repeated over a new batch dim, then viewed with the heads folded into it, which
        # the fake tensor could do only if the repeat was a copy (as it is) and not a stride-0 view of w
        B = x.shape[0]
        bias = w.unsqueeze(0).repeat(B, 1, 1, 1).view(B * 2, 5, 4)
        return (x.view(B * 2, 5, 4) * bias).sum()

    _whole_graph_grads(heads, [w], (3, 1, 0), lambda n: torch.randn(n, 2, 5, 4, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_group_norm_of_an_unbacked_batch_traces_whole_and_still_checks_a_known_one(device):
    """F.group_norm first asks whether there is one value per channel (B * L == 1 for wav2vec2's GroupNorm with
    a group per channel), which an unbacked batch cannot answer. A known size still gets torch's ValueError."""
    import torch

    conv, norm = torch.nn.Conv1d(4, 4, 3, device=device), torch.nn.GroupNorm(4, 4, device=device)

    def encoder(x):
        return norm(conv(x)).pow(2).sum()

    _whole_graph_grads(encoder, [conv.weight, norm.weight], (3, 1, 0),
                       lambda n: torch.randn(n, 4, 9, device=device))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        torch.nn.functional.group_norm(torch.randn(1, 4, 1, device=device), 4)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_with_a_mask_of_batch_one_traces_whole(device):
    """T5's decoder mask ([1, H, T, T], no gradient) in SDPA with transposed heads: torch 2.13's kernel choice
    asks whether the query's unbacked batch is 1 too (torch 2.11 does not), and dpcompile traces the math
    attention there. One graph (fullgraph), eager's values and gradients."""
    import torch

    mask = torch.randn(1, 2, 5, 5, device=device)
    w = torch.nn.Parameter(torch.randn(4, 4, device=device))

    def attend(x):
        q, kv = (x @ w).transpose(1, 2), x.transpose(1, 2)  # [B, H, T, D] views of [B, T, H, D]
        return torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask).pow(2).sum()

    _whole_graph_grads(attend, [w], (3, 1, 0), lambda n: torch.randn(n, 5, 2, 4, device=device))


def test_constant_folding_of_a_uniform_tensor_with_an_unbacked_batch_compiles(monkeypatch):
    """Inductor's constant_fold_uniform_value asks whether a uniform tensor (BART's expanded all-ones mask) is
    contiguous, which guards on an unbacked batch size and failed the whole compile; the folding now stops
    there. Inductor (C++ on CPU), the caches off so that the joint-graph passes run."""
    import torch

    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    w = torch.nn.Parameter(torch.randn(5, 5))

    def masked(x):
        return (x @ w + torch.ones(x.shape[0], 1, 5, 5).expand(-1, 3, -1, -1).sum(1)).pow(2).sum()

    for n in (3, 1):
        torch._dynamo.reset()
        x = torch.randn(n, 5, 5)
        dpcompile.mark_batch(x)
        got = torch.compile(masked, fullgraph=True)(x)
        (g,) = torch.autograd.grad(got, [w])
        want = masked(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(g, torch.autograd.grad(want, [w])[0])


def test_attention_kernel_without_a_mask_is_torchs_own():
    """dpcompile's Python kernel for SDPA (used while tracing) with no mask, called directly: torch 2.11 routes
    every traced SDPA through it, torch 2.13 not always, so a bug there (reading a missing mask) showed only on
    the GPU machines' torch. It must give torch's values with and without is_causal."""
    import torch
    from torch._C import DispatchKey

    from dpcompile.compat import size_oblivious_sdpa

    size_oblivious_sdpa()
    kernel = torch.ops.aten.scaled_dot_product_attention.default.py_kernels[DispatchKey.CompositeImplicitAutograd]
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    for causal in (False, True):
        torch.testing.assert_close(kernel(q, k, v, None, 0.0, causal),
                                   torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))


def test_channels_last_check_agrees_with_torchs_on_static_shapes():
    """dpcompile's stride check (used where a size is unbacked) answers as torch's own on static shapes: random
    4-d and 5-d shapes with sizes 0 and 1, strides of random dim orders, some padded, some degenerate."""
    import random

    import torch._prims_common as prims_common

    from dpcompile.compat import channels_last_strides, size_oblivious_channels_last

    size_oblivious_channels_last()
    check = prims_common.are_strides_like_channels_last_or_false
    torchs = getattr(check, "_dpcompile_original", check)
    rng = random.Random(0)
    answers = set()
    for _ in range(3000):
        nd = rng.choice([4, 5])
        shape = [rng.choice([0, 1, 1, 2, 3, 4]) for _ in range(nd)]
        order = list(range(nd))
        rng.shuffle(order)
        strides, extent = [0] * nd, 1
        for d in reversed(order):
            strides[d] = extent
            extent *= max(shape[d], 1) + rng.choice([0, 0, 0, 1])
        if rng.random() < 0.1:
            strides[rng.randrange(nd)] = rng.choice([0, 1, 2])
        expected = torchs(shape, strides)
        assert channels_last_strides(shape, strides) == expected, (shape, strides)
        answers.add(expected)
    assert answers == {True, False}


def _channels_last_convs_step(schedule, batches=(3, 1), **options):
    """ConvNeXt's pattern: a LayerNorm over channels between permutes, then a (depthwise) convolution of the
    channels-last result; a DP step with the batch unbacked, exact against the oracle for each batch size."""
    import torch
    import torch.nn as nn

    import models as M
    from helpers import check_one_graph_against_reference

    class ChannelsLastConvs(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch, self.norm = nn.Conv2d(3, 8, 2, stride=2), nn.LayerNorm(8)
            self.dw, self.head = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Linear(8, 3)

        def forward(self, x):
            h = self.norm(self.patch(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # channels-last strides
            return self.head(self.dw(h).mean((2, 3)))

    torch.manual_seed(0)
    check_one_graph_against_reference(ChannelsLastConvs(), M.mse,
                                      [(torch.randn(B, 3, 8, 8), torch.randn(B, 3)) for B in batches],
                                      schedule=schedule, **options)


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_convolution_of_a_channels_last_input_with_an_unbacked_batch(schedule):
    """With the batch unbacked, torch's stride check took the channels-last input for contiguous (the batch
    might be empty), the convolution's fake output disagreed with its real one and Inductor's stride assert
    stopped the step (stock torch.compile too)."""
    _channels_last_convs_step(schedule, compiler="inductor" if schedule == "bk" else "eager")


def _token_conv_model():
    """A transformer's convolution over its tokens (Twins' and PVT's position convolution, SegFormer's Mix-FFN):
    ``[B, N, C]`` transposed and viewed as a ``[B, C, H, W]`` image, channels-last strides, then flattened."""
    import torch.nn as nn

    class TokenConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pos = nn.Linear(5, 8), nn.Conv2d(8, 8, 3, padding=1, groups=8)
            self.conv, self.head = nn.Conv2d(8, 4, 2), nn.Linear(4 * 3 * 3 + 8 * 4 * 4, 3)

        def forward(self, x):
            B = x.shape[0]
            image = self.embed(x).transpose(1, 2).reshape(B, 8, 4, 4)
            h = self.pos(image) + image
            return self.head(torch.cat([self.conv(h).flatten(1), h.flatten(1)], 1))

    return TokenConv()


@pytest.mark.parametrize("schedule,compiler", [("bk", "eager"), ("ghost", "inductor")])
def test_convolution_over_tokens_with_an_unbacked_batch(schedule, compiler):
    """torch's fake convolution took the meta kernel's contiguous layout for an input with an unbacked batch,
    where the kernels return channels-last output for this channels-last input: the flatten traced as a view
    of it failed at run time (stock torch.compile with mark_unbacked too). One graph for batches of 3, 0 and 2,
    each exact against the oracle."""
    import models as M
    from helpers import check_one_graph_against_reference

    torch.manual_seed(0)
    # fp32 against the fp64 oracle: 1e-6 of the largest gradient, as test_per_sample_clipping's fp32 nets (one
    # element was 1.9e-7 off on a 2-core CI machine, 1e-7 absolute allowed)
    check_one_graph_against_reference(_token_conv_model(), M.mse,
                                      [(torch.randn(n, 16, 5), torch.randn(n, 3)) for n in (3, 0, 2)],
                                      schedule=schedule, compiler=compiler)


def test_fake_convolution_with_an_unbacked_batch_is_laid_out_as_its_kernel():
    """conv_layout_of_an_unbacked_batch: the fake output of a channels-last input with an unbacked batch is
    channels-last as the real one is (torch's own fake kernel: contiguous); a contiguous input stays
    contiguous."""
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    conv = torch.ops.aten.convolution.default
    args = ([1, 1], [1, 1], [1, 1], False, [0, 0], 8)
    real = conv(torch.randn(3, 16, 8).transpose(1, 2).reshape(3, 8, 4, 4), torch.randn(8, 1, 3, 3), None, *args)
    assert real.is_contiguous(memory_format=torch.channels_last) and not real.is_contiguous()

    def fake_strides(channels_last: bool) -> list[int]:
        """The fake output's strides but the batch's (a number here): of [B, 16, 8] tokens transposed and
        viewed as [B, 8, 4, 4], or of a contiguous input."""
        env = ShapeEnv()
        with FakeTensorMode(shape_env=env):
            u = env.create_unbacked_symint()
            x = torch.empty_strided((u, 8, 4, 4), (128, 1, 32, 8)) if channels_last else torch.empty(u, 8, 4, 4)
            return [int(s) for s in conv(x, torch.empty(8, 1, 3, 3), None, *args).stride()[1:]]

    assert fake_strides(channels_last=True) == list(real.stride()[1:])
    assert fake_strides(channels_last=False) == [16, 4, 1]
    fixed = fake_impls.op_implementations_dict[conv]
    if getattr(fixed, "_dpcompile_guarded", False):  # torch's own kernel: the meta layout, contiguous
        fake_impls.op_implementations_dict[conv] = fixed._dpcompile_original
        FakeTensorMode.cache_clear()  # (fake results are cached by their inputs' metadata)
        try:
            assert fake_strides(channels_last=True) == [16, 4, 1]
        finally:
            fake_impls.op_implementations_dict[conv] = fixed
            FakeTensorMode.cache_clear()


def test_cpp_size_questions_of_an_unbacked_batch_are_answered_size_obliviously():
    """dpcompile.cpp_size_questions: torch's C++ asks whether a channels-last tensor with an unbacked batch is
    empty (is_contiguous) and how its sizes compare with 0 and 1 (suggest_memory_format, under
    to(memory_format=...)); each is answered as torch's Python answers it, counted by C++ file:line. Python's
    own question of the same size still raises, naming the asking line, not the wrapper; torch's own guard_bool
    raises on the C++ ones."""
    from torch.fx.experimental.sym_node import SymNode
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpcompile import cpp_size_questions

    def ask(fn):
        env = ShapeEnv()
        with FakeTensorMode(shape_env=env):
            u = env.create_unbacked_symint()
            torch._check_is_size(u)  # as dynamo's mark_unbacked makes the batch size
            return fn(torch.empty_strided((u, 8, 4, 4), (128, 1, 32, 8)), u)

    before = sum(cpp_size_questions.ANSWERS.values())
    assert ask(lambda x, u: x.is_contiguous()) is False  # the empty case aside: channels-last, not contiguous
    assert ask(lambda x, u: x.is_contiguous(memory_format=torch.channels_last)) is True
    assert ask(lambda x, u: list(x.to(torch.float32, memory_format=torch.contiguous_format).stride()[1:])) == [16, 4, 1]
    assert sum(cpp_size_questions.ANSWERS.values()) >= before + 2
    assert all(".h:" in k or ".cpp:" in k for k in cpp_size_questions.ANSWERS), cpp_size_questions.ANSWERS
    with pytest.raises(GuardOnDataDependentSymNode) as raised:
        ask(lambda x, u: bool(u == 0))  # a question from Python: torch's
    assert "test_compat.py" in str(raised.value) and "cpp_size_questions" not in str(raised.value)
    wrapped = SymNode.guard_bool
    SymNode.guard_bool = wrapped._dpcompile_original
    try:
        with pytest.raises(GuardOnDataDependentSymNode):
            ask(lambda x, u: x.is_contiguous())
    finally:
        SymNode.guard_bool = wrapped


def _attention_step(schedule, batches=(3, 1)):
    """torch.nn.MultiheadAttention (batch_first: it works on [T, B, E] inside, heads split by a view to
    [T, B * heads, E / heads]) in a DP step with the batch unbacked: one graph for every batch (one compile: CI
    time), each exact against the oracle, clipping active."""
    import torch
    import torch.nn as nn

    import models as M
    from helpers import check_one_graph_against_reference

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    model = Attention()
    check_one_graph_against_reference(model, M.mse, [(torch.randn(B, 5, 8), torch.randn(B, 3)) for B in batches],
                                      schedule=schedule)


@pytest.mark.parametrize("schedule", ["ghost"])
def test_multihead_attention_with_an_unbacked_batch(schedule, monkeypatch, inductor_caches_off):
    """Inductor's reshape indexing of MultiheadAttention's head split asserted that the unbacked batch is 1
    (torch 2.13, stock torch.compile too): the step failed at its first call. With
    reshape_indexer_refuses_unbacked_guesses the view is indexed for every batch size and the step is exact.
    Where the fix applies (torch 2.13), the step without it fails. One schedule (CI time): the view is the
    forward's, the same in both."""
    import torch
    from torch._inductor.ir import View

    from dpcompile import backend

    _attention_step(schedule)
    fixed = inspect.getattr_static(View, "_dynamic_reshape_indexer").__func__
    if getattr(fixed, "_dpcompile_guarded", False):
        monkeypatch.setattr(View, "_dynamic_reshape_indexer", staticmethod(fixed._dpcompile_original))
        monkeypatch.setattr(backend, "reshape_indexer_refuses_unbacked_guesses", lambda: None)  # not reinstalled
        with pytest.raises(AssertionError, match="Guard failed"):
            _attention_step(schedule, batches=(3,))


def test_convolution_backward_fake_layout_follows_the_input(monkeypatch, inductor_caches_off):
    """torch 2.11's fake convolution_backward lays the input gradient out as the output gradient (its kernels:
    as the input). That rule installed here (on a torch that has it, a no-op): the channels-last step stops at
    Inductor's stride assert; with conv_backward_layout_as_input it is exact."""
    import torch
    import torch._prims_common as prims_common
    from torch._C import DispatchKey

    from dpcompile import compat

    op = torch.ops.aten.convolution_backward.default
    current = op.py_kernels[DispatchKey.Meta]

    def layout(a, b):
        formats = {prims_common.suggest_memory_format(a), prims_common.suggest_memory_format(b)}
        return torch.channels_last if torch.channels_last in formats else torch.contiguous_format

    def as_grad_output(grad_output, input, weight, *args, **kwargs):  # torch 2.11's rule
        gi, gw, gb = current(grad_output, input, weight, *args, **kwargs)
        return (gi if gi is None else gi.to(memory_format=layout(grad_output, weight)),
                gw if gw is None else gw.to(memory_format=layout(input, grad_output)), gb)

    libs = [torch.library.Library("aten", "IMPL")]
    try:
        monkeypatch.setitem(op.py_kernels, DispatchKey.Meta, as_grad_output)
        op._dispatch_cache.clear()
        compat.impl_overriding(libs[0], "convolution_backward", as_grad_output, "Meta")
        with pytest.raises(AssertionError, match="stride"):
            _channels_last_convs_step("bk", batches=(3,))
        monkeypatch.setattr(compat, "_conv_backward_meta_lib", None)
        compat.conv_backward_layout_as_input(force=True)
        libs.append(compat._conv_backward_meta_lib)
        assert op.py_kernels[DispatchKey.Meta]._dpcompile_original is as_grad_output
        _channels_last_convs_step("bk", batches=(3,))
    finally:
        for lib in reversed(libs):
            if lib is not None:
                lib._destroy()
        op._dispatch_cache.clear()


@pytest.mark.parametrize("device", DEVICES)
def test_one_hot_of_unbacked_targets_traces_whole_and_still_checks_their_range(device):
    """F.one_hot(y, k) in a step with an unbacked batch (label smoothing made in a sharded step): torch 2.11's
    kernel asks whether y is empty. The value and the gradient are eager's for every batch size; a target out of
    range still fails the step (CPU: when it runs; CUDA: a device assert, not tested here)."""
    import torch
    import torch.nn.functional as F

    w = torch.nn.Parameter(torch.randn(4, 3, device=device))

    def loss(x, y):
        return -(F.log_softmax(x @ w, -1) * (0.9 * F.one_hot(y, 3) + 0.1 / 3)).sum()

    for n in (3, 1, 0):
        torch._dynamo.reset()
        x, y = torch.randn(n, 4, device=device), torch.randint(0, 3, (n,), device=device)
        dpcompile.mark_batch(x, y)
        fn = torch.compile(loss, backend="aot_eager", fullgraph=True)
        got = fn(x, y)
        (g,) = torch.autograd.grad(got, [w])
        want = loss(x, y)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(g, torch.autograd.grad(want, [w])[0])
        if n and device == "cpu":
            with pytest.raises(RuntimeError, match="num_classes|smaller"):
                fn(x, torch.full_like(y, 3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_log_sigmoid_of_an_unbacked_batch_compiles_with_eagers_gradient(device, backend):
    """F.logsigmoid (a DPO-style loss) with an unbacked batch: torch's decomposition of its backward asks whether
    the buffer the CPU forward saved, of the batch's size, is empty (aot_eager, as dp_fsdp's compiler="eager":
    GuardOnDataDependentSymNode without size_oblivious_log_sigmoid_backward; Inductor's forward decomposition
    saves an empty buffer, so it never asked). The value and the gradient are eager's for batches of 3, 1 and 0."""
    import torch
    import torch.nn.functional as F

    from dpcompile.compat import size_oblivious_log_sigmoid_backward

    size_oblivious_log_sigmoid_backward()
    w = torch.nn.Parameter(torch.randn(4, 2, device=device))

    def loss(x):
        logits = x @ w
        return -F.logsigmoid(logits[:, 0] - logits[:, 1]).sum()

    _compiled_matches_eager_for_unbacked_batches(loss, w, backend, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_logsumexp_of_an_unbacked_batch_traces_whole_with_eagers_gradient(device, backend):
    """torch.logsumexp over the classes (a z-loss) with an unbacked batch: torch's decomposition, which fake
    tensors and Inductor run, asks whether the input is empty (Eq(3*u0, 0)) and dynamo broke the graph there
    (fullgraph raises without size_oblivious_logsumexp). The value and the gradient are eager's for batches of
    3, 1 and 0, over one dim and two, keepdim or not."""
    import torch

    from dpcompile.compat import size_oblivious_logsumexp

    size_oblivious_logsumexp()
    w = torch.nn.Parameter(torch.randn(4, 6, device=device))

    def loss(x):
        o = x @ w
        return torch.logsumexp(o, -1).pow(2).sum() + torch.logsumexp(o.view(-1, 2, 3), (1, 2), keepdim=True).sum()

    _compiled_matches_eager_for_unbacked_batches(loss, w, backend, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_cummax_and_cummin_of_an_unbacked_batch_trace_whole_with_eagers_gradient(device, backend):
    """torch.cummax and torch.cummin along the sequence with an unbacked batch: their fake kernel asks whether
    the input is empty (Eq(20*u0, 0)) and dynamo broke the graph there (fullgraph raises without
    size_oblivious_cummaxmin). The values' gradient and the indices are eager's for batches of 3, 1 and 0."""
    import torch

    from dpcompile.compat import size_oblivious_cummaxmin

    size_oblivious_cummaxmin()
    w = torch.nn.Parameter(torch.randn(4, 20, device=device))

    def loss(x):
        o = (x @ w).view(-1, 4, 5)
        hi, at = torch.cummax(o, -1)
        lo, _ = torch.cummin(o, 1)
        return hi.sin().sum() + lo.pow(2).sum() + (hi * (at == 4)).sum()

    _compiled_matches_eager_for_unbacked_batches(loss, w, backend, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_solve_det_and_cdist_of_an_unbacked_batch_trace_whole_with_eagers_gradient(device, backend):
    """torch.linalg.solve and det (whose backwards run linalg_lu_solve) and torch.cdist with an unbacked batch:
    lu_solve's fake kernel asks whether its result is empty (Ne(5*u0, 0)), cdist's backward whether any size is
    zero (Eq(u0, 0)), cdist with p = 2 whether the batch has more than 25 rows, and dynamo broke the graph at each
    (fullgraph raises without size_oblivious_lu_solve, size_oblivious_cdist_backward and size_oblivious_cdist_mode).
    The gradient is eager's for batches of 3, 1 and 0."""
    import torch

    from dpcompile.compat import size_oblivious_cdist_backward, size_oblivious_cdist_mode, size_oblivious_lu_solve

    size_oblivious_lu_solve()
    size_oblivious_cdist_backward()
    size_oblivious_cdist_mode()
    w = torch.nn.Parameter(torch.randn(4, 20, device=device))
    rhs, centres = torch.randn(4, device=device), torch.randn(3, 5, device=device)
    many = torch.randn(30, 20, device=device)  # more than 25 rows: torch.cdist's matrix-product kernel

    def loss(x):
        h = (x @ w).view(-1, 4, 5)
        a = h[..., :4] + 4 * torch.eye(4, device=device)
        return (torch.linalg.solve(a, rhs).sin().sum() + torch.linalg.det(a).sum()
                + torch.cdist(h, centres, p=1.0).sum() + torch.cdist(x @ w, many).sin().sum())

    _compiled_matches_eager_for_unbacked_batches(loss, w, backend, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_cumsum_and_roll_of_an_unbacked_batch_trace_whole_with_eagers_gradient(device, backend):
    """torch.cumsum and torch.roll along the sequence with an unbacked batch (a sharded step's): roll's
    decomposition asks whether its input is empty (Eq(20*u0, 0): dynamo broke the graph, size_oblivious_roll)
    and cumsum's autograd formula whether the gradient has at most one element (20*u0 <= 1: the joint trace
    failed, size_oblivious_cumsum). The value and the gradient are eager's for batches of 3, 1 and 0, a roll
    over one dim and over two, a cumsum in another dtype."""
    import torch

    from dpcompile.compat import size_oblivious_cumsum, size_oblivious_roll

    size_oblivious_cumsum()
    size_oblivious_roll()
    w = torch.nn.Parameter(torch.randn(4, 20, device=device))

    def loss(x):
        h = (x @ w).view(-1, 4, 5)
        mixed = torch.roll(h, 1, 1) * torch.roll(h, (-2, 1), (2, 1)) + torch.cumsum(h, 2, dtype=torch.float64)
        return mixed.pow(2).sum()

    _compiled_matches_eager_for_unbacked_batches(loss, w, backend, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_fourier_transforms_of_an_unbacked_batch_trace_whole_with_eagers_gradient(device, backend):
    """torch.fft along the features or the sequence only, with an unbacked batch: the fake kernels' layout of
    the output asked whether the collapsed batch is empty (Eq(20*u0, 0): dynamo broke the graph,
    size_oblivious_fft). r2c, c2c and c2r transforms over one dim and two, of a transposed input too: value and
    gradient are eager's for batches of 3 and 1 (eager's CPU transforms raise on an empty batch:
    dpcompile.empty_fft, which the sharded fourier_mixer case runs on an empty rank)."""
    import torch

    from dpcompile.compat import size_oblivious_fft
    from helpers import TORCH_VERSION

    if backend == "inductor" and TORCH_VERSION < (2, 13):
        pytest.skip("torch < 2.13: Inductor asserts the strides of _fft_r2c's meta kernel, which differ from the "
                    "kernel's for a transform over a dim other than the last (conftest._UPSTREAM_BUGS)")
    size_oblivious_fft()
    w = torch.nn.Parameter(torch.randn(4, 20, device=device))

    def loss(x):
        h = (x @ w).view(-1, 4, 5)
        mixed = torch.fft.rfft(h, dim=1).abs().sum(1, keepdim=True) + torch.fft.fft(h, dim=-1).real + \
            torch.fft.irfft(torch.fft.fft2(h.transpose(1, 2)), n=4, dim=-1).transpose(1, 2)
        return mixed.pow(2).sum()

    _compiled_matches_eager_for_unbacked_batches(loss, w, backend, device, batches=(3, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_affine_grid_of_an_unbacked_batch_traces_whole_with_eagers_gradient(device, backend):
    """F.affine_grid with an unbacked batch (a sharded spatial transformer): its check min(size) <= 0 compared
    the batch size with the others (u0 > 3: dynamo broke the graph), and the generator's autograd formula
    takes no symbolic size (size_oblivious_affine_grid). 2-D and 3-D grids: value and gradient are eager's for
    batches of 3 and 1; eager's refusals stay (a size of 0, integer matrices, matrices of the wrong shape)."""
    import torch
    import torch.nn.functional as F

    from dpcompile.compat import size_oblivious_affine_grid

    size_oblivious_affine_grid()
    w = torch.nn.Parameter(torch.randn(4, 18, device=device))

    def loss(x):
        theta = (x @ w).view(-1, 18)
        n = x.shape[0]
        flat = F.affine_grid(theta[:, :6].view(-1, 2, 3), [n, 3, 5, 4], align_corners=False)
        deep = F.affine_grid(theta[:, 6:].view(-1, 3, 4), [n, 1, 2, 3, 4], align_corners=True)
        return flat.pow(2).sum() + deep.sin().sum()

    _compiled_matches_eager_for_unbacked_batches(loss, w, backend, device, batches=(3, 1))
    for theta, size, why in [(torch.randn(2, 2, 3), [2, 3, 0, 4], "positive output size"),
                             (torch.randn(0, 2, 3), [0, 3, 5, 4], "positive output size"),
                             (torch.ones(2, 2, 3, dtype=torch.int64), [2, 3, 5, 4], "floating point"),
                             (torch.randn(2, 3, 3), [2, 3, 5, 4], "Nx2x3")]:
        with pytest.raises(ValueError, match=why):
            F.affine_grid(theta, size, align_corners=False)


def _compiled_matches_eager_for_unbacked_batches(loss, w, backend: str, device: str, batches=(3, 1, 0)) -> None:
    """loss(x) compiled whole (fullgraph) with x's batch unbacked: its value and its gradient for w are eager's,
    for batches of 3, 1 and 0 samples of 4 features. Stock Inductor's CUDA launcher of a 2-D grid divides by a
    y grid of 0 on an empty batch: dpcompile's guard (which its compiles install) installed here too, or the test
    would depend on a DP compile having run before it in its worker (a ZeroDivisionError on the H100 otherwise)."""
    import torch

    from dpcompile.compat import guard_empty_y_grid

    guard_empty_y_grid()
    for n in batches:
        torch._dynamo.reset()
        x = torch.randn(n, 4, device=device)
        dpcompile.mark_batch(x)
        got = torch.compile(loss, backend=backend, fullgraph=True)(x)
        (g,) = torch.autograd.grad(got, [w])
        want = loss(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(g, torch.autograd.grad(want, [w])[0])


def test_cpu_bmm_lowering_gets_unbacked_operands_contiguous(monkeypatch):
    """torch's CPU bmm lowering compares an operand's fake sizes and strides to decide a copy, which raised on an
    unbacked batch among them (XLNet sharded through Inductor: ``16*Max(1, u0) >= 8``; the sharded zoo run is
    the end-to-end check). hint_cpu_bmm_layouts' wrapper hands it such an operand made contiguous (a fixed
    layout, which it asks nothing of), and a static one as it is; a CUDA pair as they are."""
    import torch.fx as fx
    from torch._inductor import ir
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dpcompile import compat

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        u0 = env.create_unbacked_symint()
        batched = torch.empty_strided((2 * u0, 6, 8), (8, 16 * u0, 1))
        static = torch.empty(4, 8, 6)
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    a.meta["val"], b.meta["val"] = batched, static
    node = graph.call_function(torch.ops.aten.bmm.default, (a, b))

    class Operand:
        def __init__(self, name, device="cpu"):
            self.name, self.device = name, torch.device(device)

        def get_device(self):
            return self.device

    def lowering(mat1, mat2):
        return mat1, mat2

    lowering_table = {torch.ops.aten.bmm.default: lowering}
    monkeypatch.setattr(compat.inspect, "getsource", lambda fn: "is_preferred_layout_as_bmm_input current_node.args")
    monkeypatch.setattr("torch._inductor.lowering.lowerings", lowering_table)
    monkeypatch.setattr(compat, "_hinted", set())
    monkeypatch.setattr(ir.ExternKernel, "require_contiguous", staticmethod(lambda x: Operand(x.name + "+contiguous",
                                                                                             x.device.type)))
    compat.hint_cpu_bmm_layouts()
    with V.set_graph_handler(types.SimpleNamespace(current_node=node)):
        m1, m2 = lowering_table[torch.ops.aten.bmm.default](Operand("m1"), Operand("m2"))
        assert (m1.name, m2.name) == ("m1+contiguous", "m2")
        m1, m2 = lowering_table[torch.ops.aten.bmm.default](Operand("m1", "cuda"), Operand("m2", "cuda"))
        assert (m1.name, m2.name) == ("m1", "m2")


def test_cpu_vector_strides_of_an_unbacked_index_are_expanded_not_simplified(monkeypatch):
    """Inductor's C++ vector codegen finds an index's stride along a loop variable with sympy.simplify, which ran
    for more than ten minutes on one of Funnel's indices with an unbacked batch size (the sharded zoo run is
    the end-to-end check). expand_unbacked_vec_indices: such an index's stride is found without sympy.simplify
    and has the value sympy.simplify's has at every point; an index without unbacked symbols still goes through
    sympy.simplify."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing
    from torch.utils._sympy.symbol import SymT, make_symbol

    from dpcompile import compat

    sizevars = compat.vec_index_module()  # torch._inductor.sizevars (2.13) or torch._inductor.codegen.cpp (2.11)
    assert sizevars is not None

    x = sympy.Symbol("d3", integer=True, nonnegative=True)
    u0 = make_symbol(SymT.UNBACKED_INT, 0, integer=True, nonnegative=True)
    s0 = make_symbol(SymT.SIZE, 0, integer=True, positive=True)

    def index(n):
        return ModularIndexing(FloorDiv(x, 32) + n * x, 1, 5) + 16 * x * n + n * FloorDiv(x + 3 * n, 7) + 3

    for name in ("simplify_index_in_vec_range", "stride_at"):  # torch's own (a compile may have wrapped them)
        fn = getattr(sizevars, name)
        monkeypatch.setattr(sizevars, name, getattr(fn, "_dpcompile_original", fn))  # restored after the test
    original = sizevars.simplify_index_in_vec_range

    def forget():  # torch's caches of the answers (stride_at_vec_range's own on torch 2.13)
        for fn in (original, sizevars.stride_at_vec_range):
            getattr(fn, "cache_clear", lambda: None)()

    forget()
    expected = {n: sizevars.stride_at_vec_range(index(n), x, 16) for n in (u0, s0)}  # torch's own answer
    forget()
    monkeypatch.setattr(compat, "_hinted", set())
    compat.expand_unbacked_vec_indices()
    assert sizevars.stride_at._dpcompile_guarded and sizevars.simplify_index_in_vec_range._dpcompile_guarded

    simplified = []
    simplify = sympy.simplify
    monkeypatch.setattr(sympy, "simplify", lambda e, *a, **k: simplified.append(e) or simplify(e, *a, **k))
    stride = sizevars.stride_at_vec_range(index(u0), x, 16)
    assert simplified == []
    points = [dict(zip(sorted(expected[u0].free_symbols | stride.free_symbols, key=str), p))
              for p in [(0, 0, 0), (1, 2, 3), (5, 17, 40), (9, 33, 2)]]
    assert len(stride.free_symbols | expected[u0].free_symbols) <= 3
    for p in points:
        assert stride.subs(p) == expected[u0].subs(p), (stride, expected[u0], p)
    assert sizevars.stride_at_vec_range(index(s0), x, 16) == expected[s0] and simplified  # the stock path
    forget()


def test_dynamo_logs_its_settings_while_a_dp_step_ignores_logging_calls():
    """compat.dynamo_config_logging_takes_functions: inside a DP step's frame dynamo ignores logging functions
    (a set of functions in its settings), and torch 2.11's metrics logging sorted that set and raised at every
    compile (an error and a traceback in the log)."""
    from torch._dynamo import utils as dynamo_utils

    from dpcompile.step_frames import dp_frame_settings

    cfg = torch._dynamo.config
    name = "ignore_logging_functions" if hasattr(cfg, "ignore_logging_functions") else "ignore_logger_methods"
    with dp_frame_settings():
        assert len(getattr(cfg, name)) >= 2  # functions that cannot be sorted among themselves
        logged = dynamo_utils._get_dynamo_config_for_logging()
    assert logged is None or isinstance(logged, str)


# Inductor: the extended tier (tests/tiers.py). aot_eager traces the same decomposition (the wrong loss shows there
# too); Inductor's code for the replaced op in a DP step: test_losses' multilabel_margin (CI time: 25 s)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=extended)])
def test_multilabel_margin_loss_compiles_to_eagers_value_and_gradient(device, backend, inductor_caches_off):
    """F.multilabel_margin_loss with targets padded by -1 (fewer labels than classes, as users write them): torch's
    decomposition, which every compiled step traces, read class 0 for each slot after the -1, a wrong loss and
    gradient (pytorch#141017; compat.multilabel_margin_loss_stops_at_the_first_negative). Each reduction, a batch
    and one unbatched sample, a row with no labels and one with all: the value and the gradient are eager's."""
    import torch.nn.functional as F

    w = torch.nn.Parameter(torch.randn(5, 4, device=device))
    x = torch.randn(4, 5, device=device)
    t = torch.tensor([[3, 0, -1, -1], [1, -1, 2, 2], [-1, 0, 0, 0], [0, 1, 2, 3]], device=device)
    for reduction in ("mean", "sum", "none"):
        for xs, ts in ((x, t), (x[0], t[0])):
            def loss(xs, ts):
                out = F.multilabel_margin_loss(xs @ w, ts, reduction=reduction)
                return out if reduction != "none" else (out * torch.arange(1.0, out.numel() + 1, device=device).
                                                        view(out.shape)).sum()

            torch._dynamo.reset()
            got = torch.compile(loss, backend=backend, fullgraph=True)(xs, ts)
            want = loss(xs, ts)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(torch.autograd.grad(got, [w])[0], torch.autograd.grad(want, [w])[0])


@pytest.mark.parametrize("device", DEVICES)
def test_gaussian_nll_loss_traces_whole_and_still_refuses_a_negative_variance(device):
    """F.gaussian_nll_loss and nn.GaussianNLLLoss check their variance with a branch on its values, which split
    the step (compat.gaussian_nll_loss_checks_in_graph): compiled whole now, with an unbacked batch, for a
    variance of the input's shape and one a dim short, each reduction: eager's value and gradients (the
    variance predicted too). A negative variance still fails the step (CPU: when it runs)."""
    import torch.nn as nn
    import torch.nn.functional as F

    w = torch.nn.Parameter(torch.randn(4, 6, device=device))

    def loss_of(reduction, homoscedastic, module):
        def loss(x, y):
            out = x @ w
            mean, var = out[:, :3], F.softplus(out[:, 3:])
            var = var[:, 0] if homoscedastic else var
            fn = nn.GaussianNLLLoss(full=True, reduction=reduction) if module else \
                lambda *a: F.gaussian_nll_loss(*a, reduction=reduction)
            return fn(mean, y, var).sum()
        return loss

    for reduction, homoscedastic, module in (("mean", False, False), ("sum", True, True), ("none", False, True)):
        loss = loss_of(reduction, homoscedastic, module)
        for n in (3, 1):
            torch._dynamo.reset()
            x, y = torch.randn(n, 4, device=device), torch.randn(n, 3, device=device)
            dpcompile.mark_batch(x, y)
            fn = torch.compile(loss, backend="aot_eager", fullgraph=True)
            got = fn(x, y)
            want = loss(x, y)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(torch.autograd.grad(got, [w])[0], torch.autograd.grad(want, [w])[0])
    if device == "cpu":
        torch._dynamo.reset()
        bad = torch.compile(lambda x, v: F.gaussian_nll_loss(x, torch.zeros_like(x), v), backend="aot_eager",
                            fullgraph=True)
        with pytest.raises(RuntimeError, match="negative"):
            bad(torch.randn(3, 2), -torch.ones(3, 2))
