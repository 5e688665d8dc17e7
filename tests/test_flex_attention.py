"""flex_attention in DP steps (dpcompile.passes.rules.flex_attention): its score_mod and mask_mod read per-sample
tensors only at [b], block masks shared by the batch or built for it (in the step or passed in), grouped-query heads.

On CPU the steps run dp_fsdp's graphs op by op (compiler="eager": torch's Inductor has no CPU backward for flex,
models.allow_flex_backward_on_cpu); on a GPU Inductor generates the flex kernels. Sharded (2 gloo ranks):
tests/test_fsdp.py's matrix runs cases.FLEX_ATTENTION."""
import copy

import pytest
import torch
import torch.nn as nn

import dpcompile
import models as M
from cases import FLEX_ATTENTION, bad_samples, with_bad_samples
from helpers import assert_bf16_close, check_against_reference, clipped_on, compile_step
from reference import dp_reference
from tiers import extended

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _twin(model, **kw):
    """The model's function with scaled_dot_product_attention and explicit masks, the same parameters."""
    twin = M.FlexAttentionNet(dense=True, **kw)
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("documents,schedule,batch", [(False, "bk", 6), (False, "ghost", "unbacked"),
                                                      (True, "ghost", 6), (True, "bk", 1)])
def test_flex_attention_matches_the_oracle(documents, schedule, batch):
    """Both flex layers (a per-sample padding mask read at [b, kv_idx] in score_mod; ALiBi with a shared causal
    block mask and grouped-query heads), or the first with a block mask built in the step from per-sample
    document ids: exact against the fp64 oracle, two bad samples dropped, clipping active; an unbacked batch
    (sharded steps, mark_batch); a batch of one."""
    c = with_bad_samples(FLEX_ATTENTION)
    inputs, targets = c.data(6 if batch == "unbacked" else batch)
    model = M.FlexAttentionNet(documents=documents)
    if batch == "unbacked":
        dpcompile.mark_batch(*inputs, *targets)
    backend = check_against_reference(model, c.loss, inputs, targets, schedule=schedule, compiler="eager",
                                      oracle=_twin(model, documents=documents))
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["flex_attention_checked"] == 4  # two layers, forward and backward
    assert backend.dropped_samples() == int(bad_samples(inputs, targets).sum())
    if batch == "unbacked":
        assert record.summary["batch_size"].startswith("u"), record.summary["batch_size"]


def test_as_many_samples_as_block_rows():
    """create_block_mask in the step builds its dense mask by scattering into a tensor of no samples with an iota
    of the batch and one of the block rows: with as many samples as rows (3 samples, 384 tokens in blocks of 128)
    both could be the batch's; the per-sample block indices say which (it was refused as ambiguous)."""
    c = FLEX_ATTENTION
    inputs, targets = c.data(3, T=384)
    model = M.FlexAttentionNet(documents=True, T=384)
    check_against_reference(model, c.loss, inputs, targets, schedule="bk", compiler="eager",
                            oracle=_twin(model, documents=True, T=384))


def _step_with_mask_argument(model, twin, ids, y, schedule, **options):
    _, norms = dp_reference(twin, M.mse, (ids,), (y,), max_grad_norm=1.0, expected_batch_size=len(ids))
    C = float(norms.median())
    ref, _ = dp_reference(twin, M.mse, (ids,), (y,), max_grad_norm=C, expected_batch_size=len(ids))
    step, backend = compile_step(model, M.mse, max_grad_norm=C, noise_multiplier=0.0, schedule=schedule,
                                 expected_batch_size=len(ids), compiler="eager", **options)
    return step, backend, ref


@pytest.mark.parametrize("schedule,unbacked", [("bk", False), ("ghost", True)])
def test_a_block_mask_built_for_the_batch_is_a_step_argument(schedule, unbacked):
    """A BlockMask built outside the step for this batch (its tables per sample, its mask_mod reading the ids at
    [b]) passed to the step: per-sample data at dim 0 like any argument, marked with the batch by mark_batch.
    torch cannot build such a mask in the step with an unbacked batch (create_block_mask's vmap guards on it),
    so this is the sharded form of test_flex_attention_matches_the_oracle's documents."""
    torch.manual_seed(0)
    (ids,), (y,) = FLEX_ATTENTION.data(5)
    model = M.FlexAttentionNet(documents=True)
    mask = M.flex_document_mask(ids)
    if unbacked:
        dpcompile.mark_batch(ids, mask, y)
    step, backend, ref = _step_with_mask_argument(model, _twin(model, documents=True), ids, y, schedule)
    step((ids, mask), (y,))
    for name, p in model.named_parameters():
        atol = 1e-7 + 1e-6 * float(ref[name].abs().max())
        torch.testing.assert_close(p.grad.double(), ref[name], rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["flex_attention_checked"] == 4


def test_a_block_mask_the_batch_shares_as_an_argument_is_named_in_batch_dim():
    """A BlockMask built with B=None passed to the step: its tables have one row, not the batch's. The error
    says which option to set; batch_dim={"inputs.1": None} (every table under the argument) then runs exact."""
    torch.manual_seed(0)
    (ids,), (y,) = FLEX_ATTENTION.data(4)
    ids[:] = ids.clamp(min=2) // 2 * 2  # one document per sample: the shared causal mask is the documents' mask
    model = M.FlexAttentionNet(documents=True)
    from torch.nn.attention.flex_attention import create_block_mask

    shared = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 8, 8, device="cpu")
    step, _, _ = _step_with_mask_argument(model, _twin(model, documents=True), ids, y, "bk")
    with pytest.raises(ValueError, match=r"batch_dim=\{'inputs\.1\.kv_num_blocks': None\}.*\{'inputs': None\}|"
                                         r"\{'inputs\.1': None\}|\{'inputs': None\} for every tensor"):
        step((ids, shared), (y,))
    model.zero_grad(set_to_none=True)
    step, _, ref = _step_with_mask_argument(model, _twin(model, documents=True), ids, y, "bk",
                                            batch_dim={"inputs.1": None})
    step((ids, shared), (y,))
    for name, p in model.named_parameters():
        atol = 1e-7 + 1e-6 * float(ref[name].abs().max())
        torch.testing.assert_close(p.grad.double(), ref[name], rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


class _ScoreMods(nn.Module):
    """One flex layer whose score_mod does what dp_fsdp must refuse (or, "shared", may allow)."""

    def __init__(self, kind):
        super().__init__()
        M.allow_flex_backward_on_cpu()
        self.kind = kind
        self.qkv = nn.Linear(6, 12)
        self.table = nn.Parameter(torch.randn(2, 15)) if kind in ("learned", "learned_row_0") else None
        self.lengths = torch.tensor([5, 3, 4, 2]) if kind == "captured" else None  # module state, not data

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 2, 2).permute(2, 0, 3, 1, 4)
        keep = x[..., 0] > -1
        rows = self.table.expand(B, -1, -1) if self.table is not None else None
        mods = {
            "batch_index": lambda s, b, h, qi, kv: s + b,
            "other_sample": lambda s, b, h, qi, kv: torch.where(keep[0, kv], s, -1e4),
            "captured": lambda s, b, h, qi, kv: torch.where(kv < self.lengths[b], s, -1e4),
            "learned": lambda s, b, h, qi, kv: s + self.table[h, qi - kv + 7],
            "learned_row_0": lambda s, b, h, qi, kv: s + rows[0, h, qi - kv + 7],
        }
        return flex_attention(q, k, v, score_mod=mods[self.kind]).transpose(1, 2).reshape(B, T, 4)


@pytest.mark.parametrize("kind,message", [
    ("batch_index", r"score_mod uses the batch index b in aten\.add\.Tensor .*its place in the batch"),
    ("other_sample", r"score_mod reads a tensor computed from input inputs\.0, per-sample, in aten\.index\.Tensor "
                     r"other than at \[b\]"),
    ("captured", r"score_mod indexes tensor .* with the batch index b, but that tensor is not per-sample data"),
    ("learned", r"gradient of parameter table, which flex_attention's score_mod reads for every sample, is summed "
                r"over the samples inside the kernel; expand it to the batch and read its row b"),
    ("learned_row_0", r"score_mod reads a tensor computed from parameter table, per-sample, in .* other than at \[b\]"),
])
def test_mods_that_mix_samples_are_refused(kind, message):
    """b in arithmetic (a sample's place in the batch), another sample's row of a per-sample tensor, a tensor
    that is not data of the step indexed by b, a learned table in score_mod (its gradient summed over the samples
    inside flex's kernel), or expanded to the batch but read at a row other than b (every sample's gradient in that
    row): each refused, naming the mod and the tensor. (Expanded and read at [b]: FlexAttentionNet, exact.)"""
    model = _ScoreMods(kind)
    x, y = torch.randn(4, 5, 6), torch.randn(4, 5, 4)
    step, _ = compile_step(model, M.mse, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4,
                           compiler="eager")
    with pytest.raises(dpcompile.DPCompileError, match=message):
        step((x,), (y,))


class _LearnedMemory(nn.Module):
    """Queries of the samples attend over learned keys and values the batch shares, expanded to the batch or of
    one row that flex broadcasts (then with a block mask of the batch, as flex needs)."""

    def __init__(self, expand):
        super().__init__()
        M.allow_flex_backward_on_cpu()
        self.expand = expand
        self.q = nn.Linear(6, 32)
        self.memory = nn.Parameter(torch.randn(1, 2, 8, 16))
        self.out = nn.Linear(32, 3)

    def forward(self, x):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        B, T, _ = x.shape
        q = self.q(x).view(B, T, 2, 16).transpose(1, 2)
        if self.expand:
            kv, mask = self.memory.expand(B, -1, -1, -1), None
        else:
            kv, mask = self.memory, create_block_mask(lambda b, h, qi, kv: kv >= 0, B, None, T, 8, device=x.device)
        return self.out(flex_attention(q, kv, kv, block_mask=mask).transpose(1, 2).reshape(B, T, 32))


def test_learned_keys_shared_by_the_batch():
    """Keys and values from a parameter: expanded to the batch, each sample's gradient of it is its own row of
    flex's key gradient (exact against the oracle); of one row, which flex broadcasts over the batch, its
    gradient is summed over the samples inside the kernel: refused, saying to expand it."""
    x, y = torch.randn(4, 5, 6), torch.randn(4, 5, 3)
    check_against_reference(_LearnedMemory(expand=True), M.mse, (x,), (y,), schedule="ghost", compiler="eager")
    step, _ = compile_step(_LearnedMemory(expand=False), M.mse, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=4, compiler="eager")
    with pytest.raises(dpcompile.DPCompileError, match=r"gradient of parameter memory, a key or value of one row that "
                                                       r"flex_attention broadcasts over the batch, is summed.*expand"):
        step((x,), (y,))


def _hf_llama_flex():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=29, hidden_size=32, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=8, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0, use_cache=False, attn_implementation="flex_attention")
    model = LlamaForCausalLM(cfg)
    twin = copy.deepcopy(model)
    twin.config._attn_implementation = "eager"  # transformers' own attention with the same masks: the oracle
    return model, twin


class _Logits(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask):
        return self.model(input_ids=ids, attention_mask=attention_mask).logits


def _token_ce(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


# ghost: the extended tier (tests/tiers.py). transformers' mask handling is the forward's, the same in both
# schedules; flex attention under ghost: test_flex_attention_matches_the_oracle (CI time: 13 s)
@pytest.mark.parametrize("schedule", ["bk", pytest.param("ghost", marks=extended)])
def test_hugging_face_llama_with_flex_attention(schedule):
    """transformers' Llama with attn_implementation="flex_attention" and a padded batch: transformers builds the
    block mask in the step from the attention mask (compat.hf_flex_padding_mask takes its branch on the mask's
    values out of the graph), exact against the same model with transformers' eager attention."""
    pytest.importorskip("transformers")
    M.allow_flex_backward_on_cpu()
    torch.manual_seed(0)
    model, twin = _hf_llama_flex()
    (ids,), _ = FLEX_ATTENTION.data(4, T=6)
    ids = ids % 29
    y = torch.randint(0, 29, (4, 6))
    backend = check_against_reference(_Logits(model), _token_ce, (ids, (ids != 0).long()), (y,), schedule=schedule,
                                      compiler="eager", oracle=_Logits(twin))
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["flex_attention_checked"] == 2


@cuda
@pytest.mark.parametrize("schedule", ["bk", "ghost"])
@pytest.mark.parametrize("documents", [False, True])
def test_cuda_flex_attention_through_inductor(schedule, documents):
    """Inductor's flex kernels (Triton) for both layers, fp32, exact against the fp64 oracle."""
    torch.manual_seed(0)
    (ids,), (y,) = FLEX_ATTENTION.data(4)
    model = M.FlexAttentionNet(documents=documents)
    ref, gpu, backend = clipped_on("cuda", model, M.mse, (ids,), (y,), oracle=_twin(model, documents=documents),
                                   schedule=schedule)
    for name, p in gpu.named_parameters():
        atol = 1e-6 + 1e-5 * float(ref[name].abs().max())
        torch.testing.assert_close(p.grad.double().cpu(), ref[name], rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["flex_attention_checked"] == 4


@cuda
@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_cuda_flex_attention_unbacked_batch_and_bf16(schedule):
    """One graph for batches of 5, 3 and 1 (mark_batch, the block mask an argument built for each batch), and
    the same model under bf16 autocast within bf16 tolerances."""
    torch.manual_seed(0)
    model = M.FlexAttentionNet(documents=True)
    twin = _twin(model, documents=True)
    gpu = copy.deepcopy(model).cuda()
    (ids,), (y,) = FLEX_ATTENTION.data(5)
    _, norms = dp_reference(twin, M.mse, (ids,), (y,), max_grad_norm=1.0, expected_batch_size=5)
    C = float(norms.median())
    step, backend = compile_step(gpu, M.mse, max_grad_norm=C, noise_multiplier=0.0, schedule=schedule,
                                 expected_batch_size=5)
    for n in (5, 3, 1):
        (ids,), (y,) = FLEX_ATTENTION.data(n)
        ref, _ = dp_reference(twin, M.mse, (ids,), (y,), max_grad_norm=C, expected_batch_size=5)
        ids, y = ids.cuda(), y.cuda()
        mask = M.flex_document_mask(ids)
        dpcompile.mark_batch(ids, mask, y, hint=4)
        gpu.zero_grad(set_to_none=True)
        step((ids, mask), (y,))
        for name, p in gpu.named_parameters():
            atol = 1e-6 + 1e-5 * float(ref[name].abs().max())
            torch.testing.assert_close(p.grad.double().cpu(), ref[name], rtol=1e-4, atol=atol,
                                       msg=lambda m: f"batch {n}, {name}: {m}")
    assert len([r for r in backend.compiled if r.dp]) == 1
    (ids,), (y,) = FLEX_ATTENTION.data(4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref, bf16, _ = clipped_on("cuda", model, M.mse, (ids,), (y,), oracle=twin, schedule=schedule)
    assert_bf16_close(bf16, ref)


@cuda
def test_cuda_hugging_face_llama_with_flex_attention():
    """transformers' Llama with flex attention through Inductor's flex kernels, padded batch, exact."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, twin = _hf_llama_flex()
    (ids,), _ = FLEX_ATTENTION.data(4, T=6)
    ids = ids % 29
    y = torch.randint(0, 29, (4, 6))
    ref, gpu, _ = clipped_on("cuda", _Logits(model), _token_ce, (ids, (ids != 0).long()), (y,), oracle=_Logits(twin),
                             schedule="bk")
    for name, p in gpu.named_parameters():
        atol = 1e-6 + 1e-5 * float(ref[name].abs().max())
        torch.testing.assert_close(p.grad.double().cpu(), ref[name], rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


@cuda
def test_cuda_flex_attention_on_a_rank_without_samples():
    """The padding-mask and ALiBi layers with an unbacked batch through Inductor's flex kernels: 4 samples, then
    none (a sharded step's rank without samples: the kernels' grid is empty), whose gradient is zero."""
    torch.manual_seed(0)
    model = M.FlexAttentionNet()
    gpu = copy.deepcopy(model).cuda()
    step, backend = compile_step(gpu, M.mse, max_grad_norm=1.0, noise_multiplier=0.0, schedule="bk",
                                 expected_batch_size=4)
    for n in (4, 0):
        (ids,), (y,) = FLEX_ATTENTION.data(n)
        ref = dp_reference(model, M.mse, (ids,), (y,), max_grad_norm=1.0, expected_batch_size=4)[0] if n else None
        ids, y = ids.cuda(), y.cuda()
        dpcompile.mark_batch(ids, y, hint=4)
        gpu.zero_grad(set_to_none=True)
        step((ids,), (y,))
        for name, p in gpu.named_parameters():
            want = ref[name] if n else torch.zeros(p.shape, dtype=torch.float64)
            atol = 1e-6 + 1e-5 * float(want.abs().max())
            torch.testing.assert_close(p.grad.double().cpu(), want, rtol=1e-4, atol=atol,
                                       msg=lambda m: f"batch {n}, {name}: {m}")
    assert len([r for r in backend.compiled if r.dp]) == 1
