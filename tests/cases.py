"""The models and losses every gradient check runs: one process and sharded alike.

A case builds a fresh model (``model()``), a batch of B samples
(``data(B) -> (inputs, targets)``), and names its per-sample loss and how the
step reduces it over the batch. Third-party models (Hugging Face
``transformers``) are cases too: their code is not ours, which is the point.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F

from dpcompile.batching import traces_nonempty

import models as M
from helpers import TORCH_VERSION

TORCH_2_13 = TORCH_VERSION >= (2, 13)

# nn.LSTM, nn.GRU and nn.RNN (the recurrent case) traced by dynamo, as the README tells users of plain
# torch.compile to set (private_step sets it itself); without it the step is refused (test_refusals)
torch._dynamo.config.allow_rnn = True


@dataclasses.dataclass(frozen=True)
class Case:
    model: Callable[[], torch.nn.Module]
    data: Callable[[int], tuple[tuple, tuple]]
    loss: Callable  # (model output, *targets) -> [B] per-sample losses
    reduction: str = "mean"  # how the step reduces the per-sample losses: "mean" or "sum"


def ids(B, T, vocab, pad=None):
    x = torch.randint(1 if pad == 0 else 0, vocab, (B, T))
    if pad is not None and B:
        x[0, -1] = pad
        x[-1, 0] = pad
    return x


def _tokens(vocab, T=6):
    return lambda B: ((ids(B, T, vocab),), (ids(B, T, vocab),))


def _frozen_gpt():
    model = M.GPT(n_layer=1)
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    model.wpe.weight.requires_grad_(False)
    return model


def kdim_ce(logits, y):
    """Cross-entropy in its K-dimensional form (classes on dim 1), averaged within each sample."""
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


def one_hot_ce(logits, y):
    """Cross-entropy against label-smoothed one-hot targets made in the step: F.one_hot checks the targets' range
    with asserts in the graph (aten._assert_async over the batch), which were refused as a Python scalar made
    from per-sample data."""
    k = logits.shape[-1]
    return F.cross_entropy(logits, 0.9 * F.one_hot(y, k).to(logits.dtype) + 0.1 / k, reduction="none")


def _logits_ce(out, y):
    return M.seq_ce(out.logits, y)


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=29, n_positions=8, n_embd=12, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)  # Conv1D (addmm, [in, out] weights), tied LM head


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=29, hidden_size=12, intermediate_size=20, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False)
    # grouped-query attention, rotary, RMSNorm, SwiGLU, untied head; use_cache=False as in training scripts
    # (GPT-2 keeps the default): transformers' mask code then takes another path (compat.hf_expand_position_ids)
    return LlamaForCausalLM(cfg)


def _padded_tokens(vocab, T=6):
    """(ids, attention_mask) with samples 1, 3, ... ending in two padding tokens (id 0), and token targets:
    transformers builds its attention mask from the per-sample padding mask indexed with arange(B)."""
    def data(B):
        x = ids(B, T, vocab, pad=0)
        x[:, 0] = x[:, 0].clamp(min=1)  # right padding only: a row of a left-padded sample could be all masked
        x[1::2, -2:] = 0
        return (x, (x != 0).long()), (ids(B, T, vocab),)

    return data


# every layer kind, each in a small model of its own
SMALL_LAYER_CASES = {
    "mlp_2d": Case(lambda: M.MLP(), lambda B: ((torch.randn(B, 5) * 2,), (torch.randint(0, 3, (B,)),)), M.ce),
    "linear_2d_no_bias": Case(lambda: M.SeqLinear(), lambda B: ((torch.randn(B, 6),), (torch.randn(B, 3),)), M.mse),
    "linear_3d": Case(lambda: M.SeqLinear(), lambda B: ((torch.randn(B, 4, 6),), (torch.randn(B, 4, 3),)), M.mse),
    "linear_4d": Case(lambda: M.SeqLinear(), lambda B: ((torch.randn(B, 2, 3, 6),), (torch.randn(B, 2, 3, 3),)),
                      M.mse),
    "conv1d_addmm": Case(lambda: M.Conv1DNet(), lambda B: ((torch.randn(B, 4, 6),), (torch.randn(B, 4, 3),)), M.mse),
    "einsum_weights": Case(lambda: M.EinsumNet(), lambda B: ((torch.randn(B, 4, 6),), (torch.randn(B, 4, 3),)),
                           M.mse),
    "norms": Case(lambda: M.NormNet(), lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)), M.mse),
    # weight_norm, weight standardisation, a table through another parameter's matrix, baddbmm scores
    "reparametrised": Case(lambda: M.ReparametrisedNet(),
                           lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)), M.mse),
    # shape code of Bloom, DeBERTa, T5, wav2vec2, BART that asks questions of an unbacked batch size (sharded)
    "batch_shaped_attention": Case(lambda: M.BatchShapedAttention(),
                                   lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)), M.mse),
    "embedding": Case(lambda: M.EmbNet(), lambda B: ((ids(B, 5, 11),), (torch.randn(B, 5, 3),)), M.mse),
    "embedding_padding": Case(lambda: M.EmbNet(padding_idx=0),
                              lambda B: ((ids(B, 5, 11, pad=0),), (torch.randn(B, 5, 3),)), M.mse),
    "attention_padding_mask": Case(lambda: M.PaddedAttention(),
                                   lambda B: ((ids(B, 5, 11, pad=0),), (torch.randn(B, 5, 3),)), M.mse),
    # the sample dim indexed with torch.arange(B): transformers' masks and last-token pooling
    "sample_indexed": Case(lambda: M.SampleIndexed(), lambda B: ((ids(B, 5, 11, pad=0),), (torch.randn(B, 3),)), M.mse),
    "fourier_mixer": Case(lambda: M.FourierMixer(), lambda B: ((torch.randn(B, 5, 3),), (torch.randn(B, 3),)), M.mse),
    "linalg_distances": Case(lambda: M.LinalgNet(), lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 3),)), M.mse),
    "spatial_transformer": Case(lambda: M.SpatialTransformer(), lambda B: ((torch.randn(B, 3, 8, 8),),
                                                                          (torch.randn(B, 3),)), M.mse),
    # an associative scan behind "is the batch empty?" (Mamba, Falcon-Mamba, Jamba)
    "selective_scan": Case(lambda: M.SelectiveScan(), lambda B: ((torch.randn(B, 5, 3),), (torch.randn(B, 3),)),
                           M.mse),
    # one Parameter in two blocks of a ModuleList (transformers' tied blocks), sharded block by block
    "tied_blocks": Case(lambda: M.TiedBlocks(), lambda B: ((torch.randn(B, 4, 3),), (torch.randn(B, 4, 3),)), M.mse),
    # a top-2 routed mixture of experts: topk routing, expert weights gathered per token (an index_put gradient)
    "routed_experts": Case(lambda: M.RoutedExperts(), lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)),
                           M.mse),
    # the same in the grouped form (Hugging Face's default): tokens sorted by expert across the batch, grouped matmuls
    # (in fp32 transformers' grouped_mm_fallback, whose backward older transformers releases cannot trace)
    **({"sorted_experts": Case(lambda: M.SortedExperts(), lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)),
                               M.mse)} if M.grouped_fallback_traceable() else {}),
    # nn.MultiheadAttention with key and value apart from the query: its in_proj_weight's gradient in three blocks
    "cross_attention": Case(lambda: M.CrossAttention(), lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)),
                            M.mse),
    # LSTM, GRU and RNN layers (dynamo traces them with allow_rnn, set at the top of this module)
    "recurrent": Case(lambda: M.RecurrentNet(), lambda B: ((ids(B, 3, 11),), (torch.randn(B, 3, 3),)), M.mse),
    # nn.EmbeddingBag over 2-D input in its three modes, padding entries and per-entry weights
    "embedding_bag": Case(lambda: M.EmbeddingBagNet(), lambda B: ((ids(B, 5, 11, pad=0), torch.rand(B, 5)),
                                                                  (torch.randn(B, 3),)), M.mse),
    # nn.Bilinear (a weight between two per-sample operands) on sequences ([B, T, d])
    "bilinear": Case(lambda: M.BilinearNet(), lambda B: ((torch.randn(B, 4, 6),), (torch.randn(B, 4, 3),)), M.mse),
    # activation checkpointing (torch.utils.checkpoint, non-reentrant): the block's forward recomputed in the
    # backward; the oracle runs one backward per sample (torch.func cannot take checkpoint's hooks)
    "checkpointed": Case(lambda: M.CheckpointedBlocks(),
                         lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)), M.mse),
    # flip, roll and cumsum along the sequence, RMSNorm, LayerNorm without bias, a max over time
    "sequence_ops": Case(lambda: M.SequenceOps(), lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)),
                         M.mse),
    # an output with a gradient besides the loss: a state kept on a module (a weight's .data clamped in the
    # forward: test_per_sample_clipping's test_a_weight_clamped_in_the_forward...)
    "kept_state": Case(lambda: M.KeptState(), lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)), M.mse),
    # buffers the forward updates in place, read by the weight's gradient (spectral_norm's power iteration)
    "spectral_norm": Case(lambda: M.SpectralNormNet(), lambda B: ((torch.randn(B, 5, 4),), (torch.randn(B, 5, 3),)),
                          M.mse),
    # every convolution form, GroupNorm, InstanceNorm, LayerNorm over channels (tests/test_convolution.py
    # has each form alone, with both per-sample norm forms)
    "conv_kinds": Case(lambda: M.ConvNet(), lambda B: ((torch.randn(B, 3, 8, 8),), (torch.randn(B, 3),)), M.mse),
    # a conv net converted to channels-last with channels-last images (what vision users run on GPUs)
    "convnet_channels_last": Case(lambda: M.ChannelsLastNet().to(memory_format=torch.channels_last),
                                  lambda B: ((torch.randn(B, 3, 8, 8).contiguous(memory_format=torch.channels_last),),
                                             (torch.randn(B, 3),)), M.mse),
}
LAYER_CASES = {
    **SMALL_LAYER_CASES,
    # not among the small kinds, which the sharded matrix runs side by side (SHARDED_KIND_HALVES)
    "per_head_weights": Case(lambda: M.PerHeadNet(), lambda B: ((torch.randn(B, 5, 6),), (torch.randn(B, 5, 3),)),
                             M.mse),
    "gpt": Case(lambda: M.GPT(), _tokens(13), M.seq_ce),
    "llama": Case(lambda: M.LlamaLM(), _tokens(13), M.seq_ce),
}

# whole models, loss forms and reductions (one block each where one shows the point: compile time)
MODEL_CASES = {
    "gpt_tied": Case(lambda: M.GPT(n_layer=1, tied=True), _tokens(13), M.seq_ce),
    "shared_weights": Case(lambda: M.SharedWeights(), _tokens(13), M.seq_ce),
    "gpt_frozen": Case(_frozen_gpt, _tokens(13), M.seq_ce),
    "gpt_lora": Case(lambda: M.LoRAGPT(n_layer=1), _tokens(13), M.seq_ce),
    "gpt_kdim_ce": Case(lambda: M.GPT(n_layer=1), _tokens(13), kdim_ce),
    "llama_sum": Case(lambda: M.LlamaLM(), _tokens(13), M.seq_ce, reduction="sum"),
    "one_hot_targets": Case(lambda: M.MLP(), lambda B: ((torch.randn(B, 5) * 2,), (torch.randint(0, 3, (B,)),)),
                            one_hot_ce),
    "hf_gpt2": Case(_hf_gpt2, _tokens(29), _logits_ce),
    "hf_llama": Case(_hf_llama, _padded_tokens(29), _logits_ce, reduction="sum"),  # with an attention mask
    # squeeze-excitation, ConvNeXt, U-Net, MLP-Mixer and gated-conv blocks
    "vision_blocks": Case(lambda: M.VisionBlocks(), lambda B: ((torch.randn(B, 3, 8, 8),), (torch.randn(B, 3),)),
                          M.mse),
}

CASES = {**LAYER_CASES, **MODEL_CASES}


def _vision_models():
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if here not in sys.path:
        sys.path.insert(0, here)
    import vision_models

    return vision_models


# The benchmarks' vision models, narrow (tests/test_vision_models.py checks each on one process). Sharded: the ViT
# (patch convolution, a [1, 1, D] class token: shorter than the ranks, nn.MultiheadAttention), op by op only
# (SHARDED_EAGER_ONLY). The WRN passes sharded both ways too (2 gloo ranks, by hand); in CI the layer kinds'
# conv_kinds stands for it (every convolution form, GroupNorm), for CI time.
VIT = Case(lambda: _vision_models().ViT(image=8, patch=4, dim=8, depth=1, heads=2, mlp=16, num_classes=3),
           lambda B: ((torch.randn(B, 3, 8, 8),), (torch.randint(0, 3, (B,)),)), M.ce)


class SideBySide(torch.nn.Module):
    """Several cases' models in one: each reads its own inputs (all batched on dim 0)."""

    def __init__(self, cases: dict[str, Case], arity: dict[str, int]):
        super().__init__()
        self.parts = torch.nn.ModuleDict({n: c.model() for n, c in cases.items()})
        self.arity = arity

    def forward(self, *inputs):
        outs, i = [], 0
        for name, part in self.parts.items():
            outs.append(part(*inputs[i: i + self.arity[name]]))
            i += self.arity[name]
        return tuple(outs)


def side_by_side(cases: dict[str, Case]) -> Case:
    """One case made of several (mean-reduced) ones: a sample's loss is the sum of its losses in each, so
    one flat clipping norm spans every layer kind at once. One compile instead of one per case."""
    assert all(c.reduction == "mean" for c in cases.values())
    counts = {}  # name -> (number of inputs, number of targets), from the first batch made

    def data(B):
        parts = {n: c.data(B) for n, c in cases.items()}
        counts.update({n: (len(i), len(t)) for n, (i, t) in parts.items()})
        return tuple(x for i, _ in parts.values() for x in i), tuple(t for _, ts in parts.values() for t in ts)

    def model():
        if not counts:
            data(1)
        return SideBySide(cases, {n: k[0] for n, k in counts.items()})

    def loss(outs, *targets):
        total, j = 0, 0
        for (n, c), out in zip(cases.items(), outs):
            total = total + c.loss(out, *targets[j: j + counts[n][1]])
            j += counts[n][1]
        return total

    return Case(model, data, loss)


def _soft_targets(logits, y):
    """A target distribution made in the step from class targets (an ignored target's row: uniform)."""
    classes = torch.arange(logits.shape[-1], device=y.device)
    return torch.where(y[:, None] == classes, 0.8, 0.2 / (logits.shape[-1] - 1)).to(logits.dtype)


def _soft_ce(logits, y):
    """Each class's term of the cross-entropy with _soft_targets, [B, classes]."""
    return -F.log_softmax(logits, -1) * _soft_targets(logits, y)


# Whole-batch losses as users write them that are means of per-sample losses: name -> (the step's loss, the
# oracle's per-sample loss, the counter the loss pass shows). Cross-entropy's default mean divides by the count
# of targets that are not ignore_index (label smoothing divides its two terms by that count, computed twice);
# kl_div's "batchmean" divides a sum by the batch size.
BATCH_MEANS = {
    "cross_entropy": (lambda out, y: F.cross_entropy(out, y),
                      lambda out, y: F.cross_entropy(out, y, reduction="none"), "loss_mean_over_sample_count"),
    "nll_loss": (lambda out, y: F.nll_loss(F.log_softmax(out, -1), y),
                 lambda out, y: F.nll_loss(F.log_softmax(out, -1), y, reduction="none"),
                 "loss_mean_over_sample_count"),
    "label_smoothing": (lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1),
                        lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1, reduction="none"),
                        "loss_mean_over_sample_count"),
    "kl_batchmean": (lambda out, y: F.kl_div(F.log_softmax(out, -1), _soft_targets(out, y), reduction="batchmean"),
                     lambda out, y: F.kl_div(F.log_softmax(out, -1), _soft_targets(out, y),
                                             reduction="none").sum(-1), "loss_mean_over_batch_size"),
    # a sum over all B * classes elements divided by their number: .mean() written by hand
    "sum_over_numel": (lambda out, y: _soft_ce(out, y).sum() / out.numel(), lambda out, y: _soft_ce(out, y).mean(-1),
                       "loss_mean_over_batch_size"),
    # probability targets: torch's mean is -sum / B, the sign between the sum and its division
    "prob_targets": (lambda out, y: F.cross_entropy(out, _soft_targets(out, y)),
                     lambda out, y: F.cross_entropy(out, _soft_targets(out, y), reduction="none"),
                     "loss_mean_over_batch_size"),
    # the mean as a product with 1 / B (a 0-d tensor made from the size, under an unbacked batch)
    "sum_times_reciprocal": (lambda out, y: _soft_ce(out, y).sum(-1).sum() * (1.0 / out.shape[0]),
                             lambda out, y: _soft_ce(out, y).sum(-1), "loss_mean_over_batch_size"),
    # torch's decomposition read class 0 for each slot after a target's -1 (compat, pytorch#141017)
    "multilabel_margin": (lambda out, y: F.multilabel_margin_loss(out, _label_sets(out, y)),
                          lambda out, y: F.multilabel_margin_loss(out, _label_sets(out, y), reduction="none"),
                          "loss_mean"),
    # F.gaussian_nll_loss checks its variance with a branch dynamo cannot trace (compat)
    "gaussian_nll": (lambda out, y: F.gaussian_nll_loss(out, _soft_targets(out, y), _variances(out, y)),
                     lambda out, y: F.gaussian_nll_loss(out, _soft_targets(out, y), _variances(out, y),
                                                        reduction="none").mean(-1), "loss_mean"),
}


def _label_sets(logits, y):
    """F.multilabel_margin_loss's targets from class targets: class y, and y + 1 for even y, then -1 padding (an
    ignored target: no labels)."""
    k = logits.shape[-1]
    first = torch.where(y < 0, -1, y)
    second = torch.where((y >= 0) & (y % 2 == 0), (y + 1) % k, -1)
    pad = torch.full_like(y, -1)[:, None].expand(-1, k - 2)
    return torch.cat([first[:, None], torch.where(first[:, None] < 0, -1, second[:, None]), pad], 1)


def _variances(logits, y):
    """A per-sample variance made in the step from the targets, of the logits' shape (heteroscedastic)."""
    return (0.5 + 0.25 * y.abs().clamp(max=4)[:, None]).to(logits.dtype).expand_as(logits)



# F.ctc_loss (dpcompile/ctc_loss.py): M.MLP(d_out=CTC_CLASSES) on [B, T, 5] inputs gives each step's scores, blank 0
CTC_STEPS, CTC_TARGET, CTC_CLASSES = 6, 3, 4


def ctc_data(B: int, seed: int = 0) -> tuple:
    """(inputs [B, T, 5], targets padded to [B, S], input lengths, target lengths): sample 1 has no targets and
    sample 2's three targets cannot be aligned in its two steps (an infinite loss: 0 with zero_infinity, else
    its gradient is NaN and the sample dropped)."""
    g = torch.Generator().manual_seed(seed * 100 + B)
    x = torch.randn(B, CTC_STEPS, 5, generator=g) * 2
    y = torch.randint(1, CTC_CLASSES, (B, CTC_TARGET), generator=g)
    target_lengths = torch.randint(1, CTC_TARGET + 1, (B,), generator=g)
    input_lengths = torch.randint(CTC_TARGET + 1, CTC_STEPS + 1, (B,), generator=g)
    if B > 1:
        target_lengths[1] = 0
    if B > 2:
        input_lengths[2], target_lengths[2] = 2, CTC_TARGET
    return x, y, input_lengths, target_lengths


def ctc_loss(reduction: str, zero_infinity: bool, per_sample: bool = False) -> Callable:
    """(scores [B, T, C], targets, input lengths, target lengths) -> F.ctc_loss over the scores' log-softmax (time
    first); per_sample: the oracle's per-sample losses of that reduction (a mean divides each by its target
    length, at least 1, as F.ctc_loss's does)."""
    def loss(out, y, input_lengths, target_lengths):
        log_probs = out.log_softmax(-1).transpose(0, 1)
        if not per_sample:
            return F.ctc_loss(log_probs, y, input_lengths, target_lengths, reduction=reduction,
                              zero_infinity=zero_infinity)
        each = F.ctc_loss(log_probs, y, input_lengths, target_lengths, reduction="none", zero_infinity=zero_infinity)
        return each / target_lengths.clamp_min(1) if reduction == "mean" else each
    return loss

def with_bad_samples(case: Case, bad_input=1, bad_weight=2) -> Case:
    """The case with one more input, a per-sample loss weight, and two bad samples in every batch large
    enough: sample ``bad_input``'s float inputs hold NaN (so do its activations) and sample ``bad_weight``'s
    weight is inf (its gradient is inf or NaN). dpcompile must drop both and leave the others' clipped
    sum as it is (the oracle drops a sample whose gradient is not finite)."""

    def data(B):
        inputs, targets = case.data(B)
        if B > bad_input:
            inputs = tuple(x.clone().index_fill_(0, torch.tensor([bad_input]), float("nan"))
                           if x.is_floating_point() else x for x in inputs)
        w = torch.ones(B)
        if B > bad_weight:
            w[bad_weight] = float("inf")
        return inputs, (*targets, w)

    def loss(out, *targets):
        return case.loss(out, *targets[:-1]) * targets[-1]

    return Case(case.model, data, loss, case.reduction)


def bad_samples(inputs, targets) -> torch.Tensor:
    """Which samples with_bad_samples made bad: a non-finite float input or weight (a token model's NaN input is
    not one, its inputs are integers)."""
    bad = torch.zeros(len(targets[-1]), dtype=torch.bool)
    for t in (*inputs, *targets):
        if t.is_floating_point() and len(t):
            bad |= ~t.reshape(len(t), -1).isfinite().all(1)
    return bad


def finite_median(norms: torch.Tensor) -> float:
    """A clipping bound with samples above and below it, among the samples that are not dropped."""
    return float(norms[norms.isfinite()].median())


def _flex_tokens(B, T=8):
    """Token ids with padding (id 0) at the end of samples 1, 3, ..., and a target per position."""
    x = ids(B, T, 11, pad=0)
    if B:
        x[:, 0] = x[:, 0].clamp(min=1)  # no sample fully masked
        x[1::2, -3:] = 0
    return (x,), (torch.randn(B, T, 3),)


# flex_attention's mods (padding mask per sample, ALiBi, a shared causal block mask, grouped-query heads): not in
# CASES (torch refuses its backward in Inductor on CPU: the matrices' Inductor runs), tests/test_flex_attention.py
FLEX_ATTENTION = Case(lambda: M.FlexAttentionNet(), _flex_tokens, M.mse)


# what the sharded tests run: the small layer kinds side by side (one compile), then every model
# (a model whose forward updates buffers runs alone: the matrix's logical batch of two micro-batches, which
# would see them updated twice, is then one batch)
STATEFUL_CASES = ("spectral_norm",)
# (and nn.MultiheadAttention, which runs sharded op by op only: SHARDED_EAGER_ONLY)
ALONE_CASES = (*STATEFUL_CASES, "cross_attention")
# cases the sharded runs leave out, and why
# layer kinds that cannot run sharded, each with why (torch.fft and F.affine_grid joined with
# compat.size_oblivious_fft and compat.size_oblivious_affine_grid)
SHARDED_LEFT_OUT: dict[str, str] = {} if TORCH_2_13 else {
    "spatial_transformer": "torch 2.11's F.grid_sample asks whether an input with an unbacked batch size is empty "
                           "(Eq(192*u0, 0)): dynamo splits the sharded step there (torch 2.13 does not ask)",
    "fourier_mixer": "torch 2.11's fake kernel of a CPU transform over a dim other than the last lays out its "
                     "output otherwise than the kernel, and Inductor asserts the fake's strides "
                     "(conftest._UPSTREAM_BUGS; torch 2.13 fixed it)",
}
if not traces_nonempty():
    SHARDED_LEFT_OUT["selective_scan"] = ("this torch's mark_unbacked takes no lower bound (torch 2.13's min=1): "
                                          "dynamo cannot answer `if x.numel() > 0` of an unbacked batch and splits "
                                          "the step")
# fourier_mixer's reason is a CPU kernel's: with an unbacked batch it runs on CUDA (test_gpu)
_CPU_ONLY_LEFT_OUT = {"fourier_mixer"}


def unbacked_left_out(device: str) -> dict[str, str]:
    """The layer kinds this torch cannot compile with an unbacked batch on ``device``, and why."""
    return {k: v for k, v in SHARDED_LEFT_OUT.items() if device == "cpu" or k not in _CPU_ONLY_LEFT_OUT}


SHARDED_LAYER_KINDS = {n: c for n, c in SMALL_LAYER_CASES.items() if n not in ALONE_CASES and n not in SHARDED_LEFT_OUT}
# The layer kinds in two halves, each one side-by-side model. Sharded, bk runs one half and ghost the other, op by
# op: each kind sharded once (CI time: both schedules of every kind at once took 4 minutes of CI's two cores;
# Inductor's compile of every kind at once 4-5 minutes of a CI core on each rank, 270 kernels). bk has the
# convolutions (it keeps their per-sample gradients); sharded ghost convolutions: vision_blocks in test_fsdp's
# input_gram and placements jobs. On one process every kind runs both schedules (test_per_sample_clipping), one of
# them through Inductor with a sharded step's unbacked batch (its test_matches_reference).
_KINDS = sorted(SHARDED_LAYER_KINDS)
SHARDED_KIND_HALVES = {"layer_kinds_bk": _KINDS[1::2], "layer_kinds_ghost": _KINDS[0::2]}
assert "conv_kinds" in SHARDED_KIND_HALVES["layer_kinds_bk"]
SHARDED_CASES = {**{n: side_by_side({k: SHARDED_LAYER_KINDS[k] for k in kinds})
                    for n, kinds in SHARDED_KIND_HALVES.items()},
                 **{n: c for n, c in CASES.items() if n not in SMALL_LAYER_CASES or n in ALONE_CASES},
                 "vit": VIT, "flex_attention": FLEX_ATTENTION}
# cases the sharded matrix runs once, op by op (compiler="eager"), and why not through Inductor
SHARDED_EAGER_ONLY = {
    "vision_blocks": "CI time (its Inductor compile on 2 ranks cost about 100 s of CI); its ops through Inductor "
                     "with an unbacked batch: the layer kinds' convolutions sharded, and this case on one process "
                     "(test_per_sample_clipping); sharded through Inductor it passed by hand (13th session)",
    "per_head_weights": "stock torch.compile (torch 2.13) fails on an einsum with per-head weights ('bhsd,hde->bhse') "
                        "with an unbacked batch size: 'Could not guard on data-dependent expression Eq(5*u0, 1)' in "
                        "Inductor's lowering; one process with a backed batch size runs through Inductor",
    "cross_attention": "CI time; nn.MultiheadAttention through Inductor with an unbacked batch size (which torch "
                       "2.13 got wrong without compat.reshape_indexer_refuses_unbacked_guesses) runs in "
                       "test_compat::test_multihead_attention_with_an_unbacked_batch",
    "vit": "as cross_attention",
    "flex_attention": "torch 2.13's Inductor has no CPU backward for flex_attention (its CPU lowering refuses it); "
                      "tests/test_flex_attention.py runs it through Inductor on a GPU, on one process",
}
def check_case_invariants(name, counters, summary):
    """What a case's compile must show beyond exact gradients (shared with the sharded runs)."""
    kinds = set(SHARDED_KIND_HALVES.get(name, [name]))  # the layer kinds of the case
    # every Linear-like norm in the ghost form (static rows per sample here) runs as one kernel
    assert counters.get("gram_norm_kernels", 0) >= counters.get("norm_mm_ghost", 0), counters
    if counters.get("bk_deferred_contractions") and name.startswith(("gpt", "llama", "hf_")):
        # bk masks the wider operand of a block's projections, an output gradient the backward makes: in place
        assert counters.get("row_masks_in_place", 0) >= 1, counters
        if counters.get("gram_norm_kernels", 0) >= 2:  # its operands alive until the clip: norms in one call
            assert counters.get("gram_norms_grouped", 0) >= 2, counters
    # every per-sample conv gradient a norm kernel keeps makes its clipped weight gradient (bk only)
    assert counters.get("bk_conv_grads_from_rows", 0) == counters.get("conv_grads_kept", 0), counters
    if kinds & {"conv_kinds", "vision_blocks"} and \
            summary.get("schedule", {}).get("requested") == "bk":  # (e.g. the depthwise, transposed and 1-D ones)
        assert counters.get("conv_grads_kept", 0) >= 1, counters
    if "einsum_weights" in kinds:  # both einsums and the weight gradients' bmms, as mms
        assert counters.get("unit_batch_bmm_as_mm", 0) >= 4, counters
    if "reparametrised" in kinds:  # LearnedActivation's two softplus backwards, a where over summed gradients
        assert counters.get("where_of_sums", 0) >= 2, counters
        # the interpolated position embedding's and t[i, :, j]'s gradients, replayed per sample
        assert counters.get("norm_scatter_dims_whole", 0) >= 2, counters
        assert counters.get("norm_scatter_indexed_dims_apart", 0) >= 1, counters
    if name == "per_head_weights":  # the three per-head weights' gradients, batched matmuls
        assert sum(v for k, v in counters.items() if k.startswith("norm_bmm_")) >= 3, counters
    if "fourier_mixer" in kinds and str(summary.get("batch_size", "")).startswith("u"):
        # every transform of the forward and the backward in an op that runs on an empty batch (dpcompile.empty_fft)
        assert counters.get("nonempty_batch_transforms_guarded", 0) >= 6, counters
    if "embedding_bag" in kinds:  # the three nn.EmbeddingBag as embeddings
        assert counters.get("embedding_bag_as_embedding", 0) == 3, counters
    if "bilinear" in kinds:  # both nn.Bilinear as matmuls with their weights
        assert counters.get("bilinear_as_matmul", 0) == 2, counters
    if "sample_indexed" in kinds:  # the mask, the three picks and the picks' index_puts
        assert counters.get("sample_dim_indexed_by_arange", 0) >= 7, counters
    if name == "hf_llama":  # transformers' mask from the attention mask: the padding mask gathered per sample
        assert counters.get("sample_dim_indexed_by_arange", 0) >= 1, counters
    if name == "cross_attention":  # in_proj_weight's three blocks, each per sample
        assert counters.get("param_grad_blocks_joined", 0) >= 1, counters
    if "kept_state" in kinds:  # the kept state's incoming gradient read as zeros, and its chain cut
        assert counters.get("side_gradients_as_zeros", 0) >= 1, counters
        assert counters.get("side_gradient_ops_cut", 0) >= 2, counters
    if name == "spectral_norm":  # the reads of the updated buffers saved, not recomputed
        assert counters.get("mutated_input_reads_saved", 0) >= 1, counters
    if name == "routed_experts":  # the experts' weights and biases gathered per token: index_put gradients
        assert counters.get("norm_index_put_embedding_ghost", 0) >= 2, counters
        assert counters.get("norm_materialized_chain", 0) >= 1, counters  # the up-projections, through the gain
    if "sorted_experts" in kinds:
        # each layer's two expert weights, over rows sorted by expert
        assert sum(v for k, v in counters.items() if k.startswith("norm_grouped_")) == 6, counters
    if name in ("gpt_tied", "hf_gpt2"):
        assert counters["params_shared"] == 1  # the norm of the per-sample sum of both uses, not two norms
    if name in ("gpt_tied", "hf_gpt2", "shared_weights"):
        # ... from each use's own norm and their per-sample inner products: no [B, V, d] gradient materialised
        assert counters.get("norm_shared_ghost", 0) == (2 if name == "shared_weights" else 1), counters
    if name == "shared_weights":
        assert "norm_materialized_chain" not in counters, counters
    if name in ("gpt_frozen", "gpt_lora"):
        assert "wpe.weight" in summary["frozen"], summary["frozen"]  # no gradient, no noise
    if name == "gpt_lora":
        assert "blocks.0.qkv.base.weight" in summary["frozen"], summary["frozen"]
