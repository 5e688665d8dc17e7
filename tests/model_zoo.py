"""Third-party models (transformers, timm) through one DP step each, against the float64 oracle.

Not collected by pytest (CI time: each model is a compile of its own); run by hand when dpcompile's rules or
passes change, on CPU:

    python tests/model_zoo.py                          # every model, both schedules, compiler="eager"
    python tests/model_zoo.py --models bert,mistral --compiler inductor
    python tests/model_zoo.py --shard 2                # sharded: dpcompile.fully_shard on 2 gloo ranks

Each model is built small with random init and dropout off, in training mode, in float64 (``--dtype``);
clipping is active (the oracle's median per-sample norm is C). The oracle is vmap(grad), or one plain
backward per sample where vmap cannot run the model. A line per model and schedule: PASS, REFUSED (a
DPCompileError: the step is not provably per sample, with the op, parameter and module), SKIP (the library
does not import), BROKEN (the model's plain float64 forward and backward fail, or give a sample a gradient
that is not finite: nothing to compare with, since both sides drop such a sample, and the run goes on to the
next model) or FAIL (anything else: a wrong gradient is one). Exit status 1 if any FAIL.

``--shard N``: the same step on N gloo processes, the model sharded as a user would (``dpcompile.fully_shard``
on every block, bottom up, then the root), the batch split unevenly over the ranks (rank 0 takes one sample
more than its share, the last rank the rest, possibly none), each rank's gathered gradient against the oracle
on the whole batch; then the same batch again through the same graph with the last rank given no sample.
``ZOO_TRACEBACK=1`` prints each failing rank's traceback.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import functools
import importlib
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpcompile  # noqa: E402
import helpers  # noqa: E402
import reference  # noqa: E402
from dpcompile import gathered_copy_out  # noqa: E402
from dpcompile.errors import DPValueError  # noqa: E402
from helpers import check_against_reference  # noqa: E402

B, T, VOCAB = 4, 6, 31


class Logits(torch.nn.Module):
    """A model whose output object has .logits (transformers) as a function returning the logits."""

    def __init__(self, model, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, *xs):
        out = self.model(*xs, **self.kwargs)
        return out.logits if hasattr(out, "logits") else out


class Seq2Seq(torch.nn.Module):
    """An encoder-decoder taking (source, labels): the decoder reads the labels shifted right. ``source``: the
    keyword the encoder takes its input as."""

    def __init__(self, wrapped: Logits, source: str = "input_ids"):
        super().__init__()
        self.model, self.source = wrapped.model, source

    def forward(self, source, labels):
        return self.model(**{self.source: source}, labels=labels, use_cache=False).logits


def token_ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


def class_ce(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


def tokens():
    return torch.randint(1, VOCAB, (B, T))


def labels():
    return torch.randint(0, 3, (B,))


def hf(config: str, model: str, task: str, checkpointing: dict | None = None, **kw):
    """A transformers model: task "lm" (next-token logits, token targets) or "cls" (3 classes).
    checkpointing: the model's own activation checkpointing turned on, with these arguments for
    torch.utils.checkpoint."""
    def make():
        import transformers

        ids = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        extra = {"num_labels": 3} if task != "lm" else {}
        cfg = getattr(transformers, config)(**(ids if task != "image" else {}), **extra, **kw)
        call = {"use_cache": False} if "CausalLM" in model else {}
        m = getattr(transformers, model)(cfg)
        if checkpointing is not None:
            enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
            enable(checkpointing)
        return Logits(m, **call)

    if task == "lm":
        return make, lambda: ((tokens(),), (tokens(),)), token_ce
    if task == "cls":
        return make, lambda: ((tokens(),), (labels(),)), class_ce
    if task == "seq2seq":  # teacher forcing: the targets as labels, the model shifts them into its decoder
        return lambda: Seq2Seq(make()), lambda: ((tokens(), tokens()), (tokens(),)), token_ce
    return make, lambda: ((torch.randn(B, 3, 16, 16),), (labels(),)), class_ce


def _frozen(model: torch.nn.Module, *names: str) -> torch.nn.Module:
    """model with the named parameters frozen: ones its forward does not use here (XLNet's mask_emb serves
    permutation-LM targets, its segment biases token types), which would get no gradient (dpcompile leaves an
    unused parameter so: no gradient, no noise) where the check wants one."""
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(False)
    return model


def timm_model(name: str, size: int = 32, **kw):
    def make():
        import timm

        return timm.create_model(name, pretrained=False, num_classes=3, **kw)

    return make, lambda: ((torch.randn(B, 3, size, size),), (labels(),)), class_ce


def timm_class(path: str, size: int = 32, **kw):
    """timm's model class ``path`` (module.Class under timm.models) built directly: for a family whose registered
    configurations fix the arguments the zoo shrinks."""
    def make():
        module, name = path.rsplit(".", 1)
        return getattr(importlib.import_module(f"timm.models.{module}"), name)(num_classes=3, **kw)

    return make, timm_model(path, size)[1], class_ce


def group_norm():
    return functools.partial(timm().layers.GroupNorm, num_groups=4)


def timm():
    import timm as module  # an ImportError here is a SKIP

    return module


class Padded(torch.nn.Module):
    """A transformers model called with an attention mask (input_ids, attention_mask): its mask is built from the
    per-sample padding mask indexed with torch.arange(batch size) (transformers' masking_utils)."""

    def __init__(self, wrapped: Logits):
        super().__init__()
        self.model = wrapped.model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits


def padded(config: str, model: str, **kw):
    """A sequence classifier fed padded batches: samples 1, 3, ... end in two padding tokens (masked out). Its
    pooling, where it takes the last non-padding token (Llama's), indexes the samples with arange(B) too."""
    def data():
        ids = torch.randint(3, VOCAB, (B, T))
        ids[1::2, -2:] = 0
        return (ids, (ids != 0).long()), (labels(),)

    make = hf(config, model, "cls", **kw)[0]
    return lambda: Padded(make()), data, class_ce


def whisper():
    """Whisper's encoder for audio classification: two Conv1d over log-mel features, then transformer blocks."""
    import transformers

    cfg = transformers.WhisperConfig(num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                     decoder_ffn_dim=24, max_source_positions=8, num_labels=3, dropout=0.0,
                                     attention_dropout=0.0, activation_dropout=0.0, vocab_size=VOCAB)
    return Logits(transformers.WhisperForAudioClassification(cfg))


class TorchEncoder(torch.nn.Module):
    """torch.nn's own TransformerEncoder (its layers a ModuleList, as users shard them), mean-pooled."""

    def __init__(self, norm_first: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


class TorchTransformer(torch.nn.Module):
    """torch.nn.Transformer, encoder-decoder with a causal target mask, next-token logits."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.model = torch.nn.Transformer(16, 2, 1, 1, 24, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, source, target):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(target.shape[1], dtype=self.head.weight.dtype)
        return self.head(self.model(self.embed(source), self.embed(target), tgt_mask=mask, tgt_is_causal=True))


BLOCK = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
NO_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
def wav2vec2():
    """Fine-tuning as its model card says: the convolutional feature encoder frozen (trained, its forward
    sets requires_grad on a tensor, which dynamo cannot trace). Its positional convolution is weight-normed
    (a parametrization): refused today, the per-sample norm of the parametrization's original tensors
    needs the parametrization's backward applied per sample."""
    import transformers

    cfg = transformers.Wav2Vec2Config(num_labels=3, **BLOCK, conv_dim=(8, 8), conv_stride=(5, 2),
                                      conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                                      num_conv_pos_embedding_groups=2, hidden_dropout=0.0, activation_dropout=0.0,
                                      attention_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
                                      mask_time_prob=0.0, classifier_proj_size=8)
    model = transformers.Wav2Vec2ForSequenceClassification(cfg)
    model.freeze_feature_encoder()
    with torch.no_grad():  # installs transformers' output-capturing hooks, under a lock dynamo cannot enter
        model(torch.randn(1, 200))
    return Logits(model)


KV1 = dict(num_key_value_heads=1, max_position_embeddings=16)
S2S = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
           encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
           activation_dropout=0.0)


def seq2seq_kw(config: str, model: str, **kw):
    return hf(config, model, "seq2seq", decoder_start_token_id=2, **kw)


def audio(config: str, model: str, **kw):
    """A wav2vec2-style audio classifier (a tiny convolutional feature encoder, frozen as its model card
    fine-tunes it; one plain forward first, as wav2vec2's entry)."""
    def make():
        import transformers

        base = dict(num_labels=3, **BLOCK, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                    num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
                    activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
                    mask_time_prob=0.0, classifier_proj_size=8)
        m = getattr(transformers, model)(getattr(transformers, config)(**{**base, **kw}))
        m.freeze_feature_encoder()
        with torch.no_grad():
            m(torch.randn(1, 200))
        return Logits(m)

    return make, lambda: ((torch.randn(B, 200),), (labels(),)), class_ce


def speech2text():
    """Speech2Text: log-mel features [B, frames, features] into the encoder, the decoder teacher-forced."""
    import transformers

    cfg = transformers.Speech2TextConfig(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         decoder_start_token_id=2, **S2S, max_source_positions=16,
                                         max_target_positions=16, num_conv_layers=1, conv_kernel_sizes=(3,),
                                         conv_channels=8, input_feat_per_channel=8, input_channels=1)
    return Seq2Seq(Logits(transformers.Speech2TextForConditionalGeneration(cfg)), source="input_features")


def no_dropout(entry):
    """entry with every nn.Dropout's p set to 0: dropout the model's config cannot turn off (timm's relative
    position MLP has p=0.125 written in), whose random masks no oracle shares."""
    make, data, loss = entry

    def made():
        m = make()
        for mod in m.modules():
            if isinstance(mod, torch.nn.modules.dropout._DropoutNd):
                mod.p = 0.0
        return m

    return made, data, loss


def unused_frozen(entry):
    """entry with the parameters its forward leaves unused here frozen (found by one plain backward, the RNG
    state kept): CANINE's projection and final character encoder (token-level tasks), MarkupLM's
    xpath_unitseq2_embeddings, LUKE's entity embeddings (no entity ids given)."""
    make, data, loss = entry

    def made():
        m = make()
        with torch.random.fork_rng():
            inputs, targets = data()
            loss(m(*inputs), *targets).mean().backward()
        for p in m.parameters():
            if p.grad is None:
                p.requires_grad_(False)
            p.grad = None
        return m

    return made, data, loss


MODELS = {
    "bert": hf("BertConfig", "BertForSequenceClassification", "cls", max_position_embeddings=16, **BLOCK, **NO_DROP),
    "roberta_mlm": hf("RobertaConfig", "RobertaForMaskedLM", "lm", max_position_embeddings=16, **BLOCK, **NO_DROP),
    "distilbert": hf("DistilBertConfig", "DistilBertForSequenceClassification", "cls", dim=16, n_layers=1,
                     n_heads=2, hidden_dim=24, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                     seq_classif_dropout=0.0),
    "albert": hf("AlbertConfig", "AlbertForSequenceClassification", "cls", embedding_size=8,
                 max_position_embeddings=16, **{**BLOCK, "num_hidden_layers": 2}, **NO_DROP,
                 classifier_dropout_prob=0.0),
    "electra": hf("ElectraConfig", "ElectraForSequenceClassification", "cls", embedding_size=8,
                  max_position_embeddings=16, **BLOCK, **NO_DROP),
    "gpt_neo": hf("GPTNeoConfig", "GPTNeoForCausalLM", "lm", hidden_size=16, num_layers=2, num_heads=2,
                  attention_types=[[["global", "local"], 1]], window_size=4, max_position_embeddings=16,
                  embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0),
    "gpt_bigcode": hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", "lm", n_embd=16, n_layer=1, n_head=2,
                      n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": hf("OPTConfig", "OPTForCausalLM", "lm", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
              ffn_dim=24, word_embed_proj_dim=16, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0),
    "falcon": hf("FalconConfig", "FalconForCausalLM", "lm", hidden_size=16, num_hidden_layers=1,
                 num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0),
    "mistral": hf("MistralConfig", "MistralForCausalLM", "lm", **BLOCK, num_key_value_heads=1,
                  max_position_embeddings=16, sliding_window=4),
    # the model's own activation checkpointing: each decoder layer's forward recomputed in the backward
    "llama_checkpointed": hf("LlamaConfig", "LlamaForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2},
                             num_key_value_heads=1, max_position_embeddings=16,
                             checkpointing={"use_reentrant": False}),
    "llama_checkpointed_reentrant": hf("LlamaConfig", "LlamaForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2},
                                       num_key_value_heads=1, max_position_embeddings=16,
                                       checkpointing={"use_reentrant": True}),
    "qwen2": hf("Qwen2Config", "Qwen2ForCausalLM", "lm", **BLOCK, num_key_value_heads=1, max_position_embeddings=16),
    "phi": hf("PhiConfig", "PhiForCausalLM", "lm", **BLOCK, max_position_embeddings=16, partial_rotary_factor=0.5,
              resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "gemma": hf("GemmaConfig", "GemmaForCausalLM", "lm", **BLOCK, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=16),
    "bloom": hf("BloomConfig", "BloomForCausalLM", "lm", hidden_size=16, n_layer=1, n_head=2, hidden_dropout=0.0,
                attention_dropout=0.0),  # ALiBi position bias
    "gptj": hf("GPTJConfig", "GPTJForCausalLM", "lm", n_embd=16, n_layer=1, n_head=2, rotary_dim=4, n_positions=16,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "mixtral": hf("MixtralConfig", "MixtralForCausalLM", "lm", **BLOCK, num_key_value_heads=1,
                  max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
                  experts_implementation="eager"),  # top-2 routed MoE; eager experts: grouped_mm takes no float64
    # the same with its experts as batched matmuls of weights gathered per token: one graph, no data-dependent shape
    "mixtral_bmm": hf("MixtralConfig", "MixtralForCausalLM", "lm", **BLOCK, num_key_value_heads=1,
                      max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
                      experts_implementation="batched_mm"),
    # and as grouped matmuls over the batch's tokens sorted by expert (transformers' default; compiled outside bf16
    # its grouped matmul is a custom op whose loop on the host vmap cannot run, and eagerly torch._grouped_mm, which
    # takes no float64: its oracle runs on mixtral_bmm with the same weights, ORACLE_TWIN)
    "mixtral_grouped": hf("MixtralConfig", "MixtralForCausalLM", "lm", **BLOCK, num_key_value_heads=1,
                          max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
                          experts_implementation="grouped_mm"),
    # more routed-experts families in their default grouped form, each with a batched_mm twin for its oracle:
    # Qwen2-MoE (a gated shared expert), Qwen3-MoE, OLMoE, GPT-OSS (expert biases, a clamped gate, attention
    # sinks), DeepSeek-V3 (group-limited routing, a shared expert, latent attention), PhiMoE (sparsemixer routing)
    **{f"{name}_{form}": hf(cfg, model, "lm", **kw, experts_implementation=impl)
       for name, (cfg, model, kw) in {
           "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                         dict(**BLOCK, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=8, shared_expert_intermediate_size=12,
                              max_position_embeddings=16)),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                         dict(**BLOCK, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=8, max_position_embeddings=16)),
           "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
                     dict(**BLOCK, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=16)),
           "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                       dict(**BLOCK, num_key_value_heads=1, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=16, layer_types=["full_attention"])),
           "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                           dict(**BLOCK, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=8, n_shared_experts=1, n_group=2, topk_group=1,
                                first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                                qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=16)),
           # PhiMoE's training-mode routing samples experts within router_jitter_noise of the best (Gumbel
           # noise): a token near a tie is routed by the random stream, which no oracle shares; at 0 the best
           # expert is always taken, the way dropout is off here
           "phimoe": ("PhimoeConfig", "PhimoeForCausalLM",
                      dict(**BLOCK, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=16, router_jitter_noise=0.0, input_jitter_noise=0.0)),
       }.items() for form, impl in (("grouped", "grouped_mm"), ("bmm", "batched_mm"))},
    "deberta_v2": hf("DebertaV2Config", "DebertaV2ForSequenceClassification", "cls", max_position_embeddings=16,
                     relative_attention=True, position_buckets=4, pos_att_type=["p2c", "c2p"], **BLOCK, **NO_DROP),
    "mobilebert": hf("MobileBertConfig", "MobileBertForSequenceClassification", "cls", hidden_size=16,
                     num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, embedding_size=8,
                     intra_bottleneck_size=8, true_hidden_size=8, num_feedforward_networks=2,
                     max_position_embeddings=16, **NO_DROP),  # NoNorm: an elementwise affine
    "t5": hf("T5Config", "T5ForConditionalGeneration", "seq2seq", d_model=16, d_kv=8, d_ff=24, num_layers=1,
             num_heads=2, relative_attention_num_buckets=4, dropout_rate=0.0, decoder_start_token_id=0),
    "bart": hf("BartConfig", "BartForConditionalGeneration", "seq2seq", d_model=16, encoder_layers=1,
               decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
               decoder_ffn_dim=24, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, decoder_start_token_id=2),
    "gpt_neox": hf("GPTNeoXConfig", "GPTNeoXForCausalLM", "lm", **BLOCK, max_position_embeddings=16, rotary_pct=0.5,
                   hidden_dropout=0.0, attention_dropout=0.0),
    "qwen3": hf("Qwen3Config", "Qwen3ForCausalLM", "lm", **BLOCK, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=16),  # RMSNorm on q and k per head
    "gemma2": hf("Gemma2Config", "Gemma2ForCausalLM", "lm", **BLOCK, num_key_value_heads=1, head_dim=8,
                 max_position_embeddings=16, sliding_window=4),  # logit soft-capping, sliding-window layers
    "starcoder2": hf("Starcoder2Config", "Starcoder2ForCausalLM", "lm", **BLOCK, num_key_value_heads=1,
                     max_position_embeddings=16, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0),
    # sequence-first inside, its projections as einsums with weights (bmm over a batch of one)
    "xlnet": (lambda: _frozen(hf("XLNetConfig", "XLNetForSequenceClassification", "cls", d_model=16, n_layer=1,
                                 n_head=2, d_inner=24, dropout=0.0, summary_last_dropout=0.0)[0](),
                          "model.transformer.mask_emb", "model.transformer.layer.0.rel_attn.r_s_bias",
                          "model.transformer.layer.0.rel_attn.seg_embed"),
              lambda: ((tokens(),), (labels(),)), class_ce),
    "hf_vit": hf("ViTConfig", "ViTForImageClassification", "image", image_size=16, patch_size=4, **BLOCK,
                 **NO_DROP),
    "hf_convnext": hf("ConvNextConfig", "ConvNextForImageClassification", "image", image_size=16,
                      hidden_sizes=[8, 16], depths=[1, 1], num_stages=2),
    "hf_wav2vec2": (wav2vec2, lambda: ((torch.randn(B, 200),), (labels(),)), class_ce),
    "hf_whisper": (whisper, lambda: ((torch.randn(B, 8, 16),), (labels(),)), class_ce),
    "hf_dinov2": (lambda: _frozen(hf("Dinov2Config", "Dinov2ForImageClassification", "image", image_size=16,
                                     patch_size=4, **BLOCK, **NO_DROP)[0](), "model.dinov2.embeddings.mask_token"),
                  hf("Dinov2Config", "", "image")[1], class_ce),
    "hf_swin": hf("SwinConfig", "SwinForImageClassification", "image", image_size=16, patch_size=2, embed_dim=8,
                  depths=[1, 1], num_heads=[2, 2], window_size=2, drop_path_rate=0.0, **NO_DROP),
    "hf_segformer": hf("SegformerConfig", "SegformerForImageClassification", "image", num_encoder_blocks=2,
                       depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[3, 3], strides=[2, 2],
                       num_attention_heads=[1, 2], mlp_ratios=[2, 2], drop_path_rate=0.0,
                       classifier_dropout_prob=0.0, **NO_DROP),
    # CLIP's vision tower as a classifier (its pooled output's layer norm unused there: frozen)
    "hf_clip_vision": (lambda: _frozen(hf("CLIPConfig", "CLIPForImageClassification", "image", vision_config=dict(
        image_size=16, patch_size=4, **BLOCK), text_config=BLOCK)[0](),
        "model.vision_model.post_layernorm.weight", "model.vision_model.post_layernorm.bias"),
        hf("CLIPConfig", "", "image")[1], class_ce),
    "mamba": hf("MambaConfig", "MambaForCausalLM", "lm", hidden_size=16, state_size=4, num_hidden_layers=1, expand=2,
                conv_kernel=3),  # selective scan, torch's sequential path
    "mpt": hf("MptConfig", "MptForCausalLM", "lm", d_model=16, n_heads=2, n_layers=1, expansion_ratio=2,
              max_seq_len=16, attn_config=dict(attn_pdrop=0), resid_pdrop=0.0, emb_pdrop=0.0),  # ALiBi
    # rotary positions in BERT; funnel's pooling between blocks; grouped 1x1 convolutions in place of Linear;
    # span-based dynamic convolution; Fourier mixing (torch.fft) in place of attention
    "roformer": hf("RoFormerConfig", "RoFormerForSequenceClassification", "cls", max_position_embeddings=16,
                   embedding_size=16, **BLOCK, **NO_DROP),
    "funnel": hf("FunnelConfig", "FunnelForSequenceClassification", "cls", block_sizes=[1, 1], num_decoder_layers=1,
                 d_model=16, n_head=2, d_head=8, d_inner=24, hidden_dropout=0.0, attention_dropout=0.0,
                 activation_dropout=0.0),
    "squeezebert": hf("SqueezeBertConfig", "SqueezeBertForSequenceClassification", "cls", max_position_embeddings=16,
                      embedding_size=16, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2,
                      intermediate_groups=2, output_groups=2, **BLOCK, **NO_DROP),
    "convbert": hf("ConvBertConfig", "ConvBertForSequenceClassification", "cls", max_position_embeddings=16,
                   embedding_size=16, conv_kernel_size=3, head_ratio=2, **BLOCK, **NO_DROP),
    "fnet": hf("FNetConfig", "FNetForSequenceClassification", "cls", max_position_embeddings=16, hidden_size=16,
               num_hidden_layers=1, intermediate_size=24, hidden_dropout_prob=0.0, use_tpu_fourier_optimizations=False),
    "megatron_bert": hf("MegatronBertConfig", "MegatronBertForSequenceClassification", "cls",
                        max_position_embeddings=16, **BLOCK, **NO_DROP),
    "mpnet": hf("MPNetConfig", "MPNetForSequenceClassification", "cls", max_position_embeddings=24, **BLOCK, **NO_DROP),
    # ESM with rotary positions (its contact head serves another task: frozen); RemBERT's decoupled embedding sizes
    "esm": (lambda: _frozen(hf("EsmConfig", "EsmForSequenceClassification", "cls", max_position_embeddings=24,
                               position_embedding_type="rotary", mask_token_id=3, **BLOCK, **NO_DROP)[0](),
                            "model.esm.contact_head.regression.weight", "model.esm.contact_head.regression.bias"),
            hf("EsmConfig", "", "cls")[1], class_ce),
    "rembert": hf("RemBertConfig", "RemBertForSequenceClassification", "cls", max_position_embeddings=16,
                  input_embedding_size=8, output_embedding_size=8, classifier_dropout_prob=0.0, **BLOCK, **NO_DROP),
    "biogpt": hf("BioGptConfig", "BioGptForCausalLM", "lm", max_position_embeddings=16, **BLOCK, **NO_DROP),
    "codegen": hf("CodeGenConfig", "CodeGenForCausalLM", "lm", n_embd=16, n_layer=1, n_head=2, rotary_dim=4,
                  n_positions=16, n_ctx=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "ctrl": hf("CTRLConfig", "CTRLLMHeadModel", "lm", n_embd=16, n_layer=1, n_head=2, dff=24, n_positions=16,
               resid_pdrop=0.0, embd_pdrop=0.0),
    "olmo2": hf("Olmo2Config", "Olmo2ForCausalLM", "lm", **BLOCK, num_key_value_heads=1, max_position_embeddings=16),
    "cohere": hf("CohereConfig", "CohereForCausalLM", "lm", **BLOCK, num_key_value_heads=1, max_position_embeddings=16),
    "stablelm": hf("StableLmConfig", "StableLmForCausalLM", "lm", **BLOCK, num_key_value_heads=1,
                   max_position_embeddings=16),
    "persimmon": hf("PersimmonConfig", "PersimmonForCausalLM", "lm", **BLOCK, max_position_embeddings=16),
    "granite": hf("GraniteConfig", "GraniteForCausalLM", "lm", **BLOCK, num_key_value_heads=1,
                  max_position_embeddings=16),
    # RWKV's time mixing (a recurrence over the tokens; its init needs two layers)
    "rwkv": hf("RwkvConfig", "RwkvForCausalLM", "lm", hidden_size=16, num_hidden_layers=2, attention_hidden_size=16,
               intermediate_size=24, context_length=16),
    # the forty-seventh session's additions (all passed there, one process, both schedules)
    "phi3": hf("Phi3Config", "Phi3ForCausalLM", "lm", **BLOCK, num_key_value_heads=1, max_position_embeddings=16,
               resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),  # fused qkv and gate-up projections
    "gemma3": hf("Gemma3TextConfig", "Gemma3ForCausalLM", "lm", **BLOCK, num_key_value_heads=1, head_dim=8,
                 max_position_embeddings=16, sliding_window=4),
    "olmo": hf("OlmoConfig", "OlmoForCausalLM", "lm", **BLOCK, num_key_value_heads=1, max_position_embeddings=16),
    "nemotron": hf("NemotronConfig", "NemotronForCausalLM", "lm", **BLOCK, num_key_value_heads=1,
                   max_position_embeddings=16, partial_rotary_factor=0.5),  # layer norm with a 1 + weight
    "glm": hf("GlmConfig", "GlmForCausalLM", "lm", **BLOCK, num_key_value_heads=1, head_dim=8,
              max_position_embeddings=16),
    "modernbert": hf("ModernBertConfig", "ModernBertForSequenceClassification", "cls", **BLOCK,
                     max_position_embeddings=16, global_attn_every_n_layers=1, local_attention=4),
    "xlm_roberta": hf("XLMRobertaConfig", "XLMRobertaForSequenceClassification", "cls", max_position_embeddings=16,
                      **BLOCK, **NO_DROP),
    # BigBird's full attention; its classifier reads the first token, not the pooler (frozen)
    "big_bird": (lambda: _frozen(hf("BigBirdConfig", "BigBirdForSequenceClassification", "cls",
                                    max_position_embeddings=16, attention_type="original_full", **BLOCK,
                                    **NO_DROP)[0](), "model.bert.pooler.weight", "model.bert.pooler.bias"),
                 lambda: ((tokens(),), (labels(),)), class_ce),
    "mbart": hf("MBartConfig", "MBartForConditionalGeneration", "seq2seq", d_model=16, encoder_layers=1,
                decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                decoder_ffn_dim=24, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0),
    "pegasus": hf("PegasusConfig", "PegasusForConditionalGeneration", "seq2seq", d_model=16, encoder_layers=1,
                  decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                  decoder_ffn_dim=24, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0),
    "mt5": hf("MT5Config", "MT5ForConditionalGeneration", "seq2seq", d_model=16, d_kv=8, d_ff=24, num_layers=1,
              num_heads=2, dropout_rate=0.0, feed_forward_proj="gated-gelu", decoder_start_token_id=0),
    "hf_beit": hf("BeitConfig", "BeitForImageClassification", "image", image_size=16, patch_size=4, **BLOCK,
                  **NO_DROP),  # relative position bias tables indexed per head
    "hf_deit": hf("DeiTConfig", "DeiTForImageClassification", "image", image_size=16, patch_size=4, **BLOCK,
                  **NO_DROP),
    "hf_vit_msn": hf("ViTMSNConfig", "ViTMSNForImageClassification", "image", image_size=16, patch_size=4, **BLOCK,
                     **NO_DROP),
    "hf_focalnet": hf("FocalNetConfig", "FocalNetForImageClassification", "image", image_size=16, patch_size=4,
                      embed_dim=8, depths=[1, 1], focal_levels=[2, 2], focal_windows=[3, 3],
                      hidden_dropout_prob=0.0, drop_path_rate=0.0),
    "hf_convnextv2": hf("ConvNextV2Config", "ConvNextV2ForImageClassification", "image", image_size=16,
                        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, drop_path_rate=0.0),  # global response norm
    # SigLIP's vision tower: its patch embedding a convolution with padding="valid" (traced as padding [0]); its
    # attention-pooling head serves the image-text task, not the classifier (frozen)
    "hf_siglip_vision": (lambda: _frozen(hf("SiglipConfig", "SiglipForImageClassification", "image", vision_config=dict(
        image_size=16, patch_size=4, **BLOCK), text_config=BLOCK)[0](),
        *[f"model.vision_model.head.{n}" for n in ("probe", "attention.in_proj_weight", "attention.in_proj_bias",
                                                    "attention.out_proj.weight", "attention.out_proj.bias",
                                                    "layernorm.weight", "layernorm.bias", "mlp.fc1.weight",
                                                    "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")]),
        hf("SiglipConfig", "", "image")[1], class_ce),
    "torch_encoder": (lambda: TorchEncoder(False), lambda: ((tokens(),), (labels(),)), class_ce),
    "torch_encoder_pre_norm": (lambda: TorchEncoder(True), lambda: ((tokens(),), (labels(),)), class_ce),
    "torch_transformer": (TorchTransformer, lambda: ((tokens(), tokens()), (tokens(),)), token_ce),
    "bert_padded": padded("BertConfig", "BertForSequenceClassification", max_position_embeddings=16, **BLOCK,
                          **NO_DROP),
    "llama_padded": padded("LlamaConfig", "LlamaForSequenceClassification", **BLOCK, num_key_value_heads=1,
                           max_position_embeddings=16),
    "timm_convnext": timm_model("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 16, 16), drop_path_rate=0.0),
    "timm_deit": timm_model("deit_tiny_patch16_224", 16, img_size=16, patch_size=4, embed_dim=16, depth=1,
                            num_heads=2),
    "timm_swin": timm_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4, embed_dim=8,
                            depths=(1, 1), num_heads=(1, 2), drop_path_rate=0.0),
    "timm_mixer": (lambda: timm().models.mlp_mixer.MlpMixer(num_classes=3, img_size=16, patch_size=4,
                                                                        embed_dim=16, num_blocks=1),
                   timm_model("mixer", 16)[1], class_ce),
    "timm_poolformer": (lambda: timm().models.metaformer.MetaFormer(
        num_classes=3, depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), token_mixers=timm().models.metaformer.Pooling,
        norm_layers=timm().models.metaformer.GroupNorm1, use_mlp_head=False),
        timm_model("poolformer")[1], class_ce),
    "timm_resnetv2_stdconv": (lambda: timm_model("resnetv2_50", layers=(1, 1, 1, 1), drop_path_rate=0.0,
                                                 conv_layer=timm().layers.StdConv2d,
                                                 norm_layer=timm().layers.GroupNormAct)[0](),
                              timm_model("resnetv2_50")[1], class_ce),
    "timm_resnet_gn": (lambda: timm_model("resnet18", 16, layers=(1, 1, 1, 1), norm_layer=group_norm())[0](),
                       timm_model("resnet18", 16)[1], class_ce),
    "timm_regnet_gn": (lambda: timm_model("regnetx_002", norm_layer=group_norm())[0](),
                       timm_model("regnetx_002")[1], class_ce),
    "timm_efficientnet_gn": (lambda: timm_model("efficientnet_b0", norm_layer=group_norm())[0](),
                             timm_model("efficientnet_b0")[1], class_ce),
    # the 63rd session's timm sweep (timm 1.0.31): normaliser-free ResNet (scaled weight standardisation, no
    # BatchNorm), ViTs with rotary, relative-position and class-attention forms, convolutional and pyramid
    # transformers, a hierarchical one with its token unrolling
    "timm_nf_resnet": timm_model("nf_resnet26", depths=(1, 1, 1, 1), channels=(16, 32, 32, 32)),
    "timm_eva02": timm_model("eva02_tiny_patch14_224", 16, img_size=16, patch_size=4, embed_dim=16, depth=1,
                             num_heads=2),
    "timm_beit": timm_model("beit_base_patch16_224", 16, img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2),
    "timm_cait": timm_model("cait_xxs24_224", 16, img_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                            depth_token_only=1),
    "timm_convit": timm_model("convit_tiny", 16, img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                              local_up_to_layer=1),
    "timm_vit_relpos": no_dropout(timm_model("vit_relpos_small_patch16_224", 16, img_size=16, patch_size=4,
                                             embed_dim=16, depth=1, num_heads=2)),
    "timm_vit_registers_avg": timm_model("vit_small_patch16_224", 16, img_size=16, patch_size=4, embed_dim=16,
                                         depth=1, num_heads=2, class_token=False, reg_tokens=2, global_pool="avg"),
    "timm_davit": timm_model("davit_tiny", depths=(1, 1, 1, 1), embed_dims=(8, 16, 16, 16), num_heads=(1, 1, 1, 1)),
    "timm_edgenext": timm_model("edgenext_xx_small", depths=(1, 1, 1, 1), dims=(8, 16, 16, 16)),
    "timm_xcit": timm_model("xcit_nano_12_p16_224", img_size=32, embed_dim=16, depth=1, num_heads=2),
    "timm_pvt_v2": timm_model("pvt_v2_b0", depths=(1, 1, 1, 1), embed_dims=(8, 16, 16, 16), num_heads=(1, 1, 1, 1)),
    "timm_twins": timm_model("twins_pcpvt_small", depths=(1, 1, 1, 1), embed_dims=(8, 16, 16, 16),
                             num_heads=(1, 1, 1, 1)),
    "timm_hiera": timm_model("hiera_tiny_224", img_size=32, embed_dim=8, num_heads=1, stages=(1, 1, 1, 1)),
    # the 65th session's timm families: an LSTM mixer, pooling attention, outlook-free MLPs, two-branch and
    # nested transformers, conv-attention, cosine window attention with a position-bias MLP, gated conv blocks
    "timm_sequencer": timm_model("sequencer2d_s", layers=(1, 1, 1, 1), patch_sizes=(4, 2, 1, 1),
                                 embed_dims=(8, 8, 16, 16), hidden_sizes=(4, 4, 8, 8), mlp_ratios=(2, 2, 2, 2)),
    "timm_mvitv2": timm_model("mvitv2_tiny", img_size=32),
    "timm_resmlp": timm_class("mlp_mixer.MlpMixer", 16, img_size=16, patch_size=4, embed_dim=16, num_blocks=1,
                              block_layer=lambda *a, **k: timm().models.mlp_mixer.ResBlock(*a, init_values=1e-4, **k),
                              stem_norm=False, mlp_ratio=4),
    "timm_gmlp": timm_class("mlp_mixer.MlpMixer", 16, img_size=16, patch_size=4, embed_dim=16, num_blocks=1,
                            block_layer=lambda *a, **k: timm().models.mlp_mixer.SpatialGatingBlock(*a, **k),
                            mlp_layer=lambda *a, **k: timm().layers.GatedMlp(*a, **k), mlp_ratio=6),
    "timm_crossvit": timm_model("crossvit_tiny_240", img_size=(32, 32), patch_size=(8, 16), embed_dim=(16, 32),
                                depth=((1, 1, 0),), num_heads=(2, 2), crop_scale=False),
    "timm_tnt": timm_model("tnt_s_patch16_224", 16, img_size=16, patch_size=8, embed_dim=16, inner_dim=8, depth=1,
                           num_heads_inner=1, num_heads_outer=2, first_stride=4),
    "timm_pit": timm_model("pit_ti_224", img_size=32, patch_size=8, stride=4, base_dims=(8, 8, 8), depth=(1, 1, 1),
                           heads=(1, 2, 2)),
    "timm_nest": timm_class("nest.Nest", img_size=32, patch_size=4, embed_dims=(8, 16, 16), num_heads=(1, 2, 2),
                            depths=(1, 1, 1), drop_path_rate=0.0),
    "timm_coat": timm_model("coat_lite_tiny", img_size=32, embed_dims=(16, 16, 16, 16), serial_depths=(1, 1, 1, 1),
                            num_heads=8, mlp_ratios=(2, 2, 2, 2)),
    "timm_swinv2": timm_model("swinv2_tiny_window8_256", img_size=32, patch_size=4, window_size=4, embed_dim=8,
                              depths=(1, 1), num_heads=(1, 2), drop_path_rate=0.0),
    "timm_mambaout": timm_model("mambaout_femto", depths=(1, 1, 1, 1), dims=(8, 8, 16, 16)),
    # two blocks a stage: the second reads the stage's global query tokens (with one, their layers are unused)
    "timm_gcvit": timm_class("gcvit.GlobalContextVit", 64, img_size=64, depths=(2, 2), num_heads=(1, 2),
                             window_ratio=(8, 16), embed_dim=8),
    # the 53rd session's sweep of transformers 5.24: state-space and hybrid LMs, routed experts in the batched
    # form, more decoders, encoder-decoders, encoders, vision and audio models
    "mamba2": hf("Mamba2Config", "Mamba2ForCausalLM", "lm", hidden_size=16, num_heads=4, head_dim=8, expand=2,
                 state_size=4, n_groups=1, conv_kernel=3, num_hidden_layers=1, chunk_size=4),
    "falcon_mamba": hf("FalconMambaConfig", "FalconMambaForCausalLM", "lm", hidden_size=16, state_size=4,
                       num_hidden_layers=1, expand=2, conv_kernel=3),
    "jamba": hf("JambaConfig", "JambaForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2}, **KV1,
                num_experts=4, num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0,
                attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3, mamba_expand=2,
                mamba_dt_rank=4, use_mamba_kernels=False, experts_implementation="batched_mm"),
    "zamba": hf("ZambaConfig", "ZambaForCausalLM", "lm", hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                attention_head_dim=16, num_key_value_heads=2, intermediate_size=24, n_mamba_heads=2,
                mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
                layers_block_type=["mamba", "hybrid", "hybrid"], max_position_embeddings=16),
    "bamba": hf("BambaConfig", "BambaForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2}, **KV1,
                attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=4,
                mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4),
    "zamba2": hf("Zamba2Config", "Zamba2ForCausalLM", "lm", hidden_size=16, num_hidden_layers=2,
                 layers_block_type=["mamba", "hybrid"], mamba_d_state=4, mamba_d_conv=3, mamba_expand=2,
                 mamba_ngroups=1, n_mamba_heads=4, chunk_size=4, use_mamba_kernels=False, intermediate_size=24,
                 num_attention_heads=2, num_key_value_heads=2, num_mem_blocks=1, adapter_rank=4,
                 max_position_embeddings=16),
    "falcon_h1": hf("FalconH1Config", "FalconH1ForCausalLM", "lm", **BLOCK, **KV1, mamba_d_ssm=32,
                    mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=4, mamba_d_conv=3,
                    mamba_expand=2, mamba_chunk_size=4),
    "lfm2": hf("Lfm2Config", "Lfm2ForCausalLM", "lm", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, intermediate_size=24, max_position_embeddings=16, conv_L_cache=3,
               block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention"]),
    "minimax": hf("MiniMaxConfig", "MiniMaxForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2}, **KV1,
                  head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=4,
                  layer_types=["linear_attention", "full_attention"], experts_implementation="batched_mm"),
    "qwen3_next": hf("Qwen3NextConfig", "Qwen3NextForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2}, **KV1,
                     head_dim=8, linear_conv_kernel_dim=3, linear_key_head_dim=4, linear_value_head_dim=4,
                     linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=8,
                     shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                     layer_types=["linear_attention", "full_attention"], experts_implementation="batched_mm"),
    "llama4_text": hf("Llama4TextConfig", "Llama4ForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2}, **KV1,
                      head_dim=8, intermediate_size_mlp=24, num_local_experts=2, num_experts_per_tok=1,
                      interleave_moe_layer_step=2, attention_chunk_size=4),
    "granitemoe": hf("GraniteMoeConfig", "GraniteMoeForCausalLM", "lm", **BLOCK, **KV1, num_local_experts=4,
                     num_experts_per_tok=2, experts_implementation="batched_mm"),
    "granitemoe_shared": hf("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", "lm", **BLOCK, **KV1,
                            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=12,
                            experts_implementation="batched_mm"),
    "dots1": hf("Dots1Config", "Dots1ForCausalLM", "lm", **BLOCK, **KV1, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8, n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                experts_implementation="batched_mm"),
    "glm4_moe": hf("Glm4MoeConfig", "Glm4MoeForCausalLM", "lm", **BLOCK, **KV1, head_dim=8, n_routed_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1, first_k_dense_replace=0,
                   n_group=1, topk_group=1, experts_implementation="batched_mm"),
    "helium": hf("HeliumConfig", "HeliumForCausalLM", "lm", **BLOCK, **KV1, head_dim=8),
    "exaone4": hf("Exaone4Config", "Exaone4ForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2}, **KV1,
                  sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "smollm3": hf("SmolLM3Config", "SmolLM3ForCausalLM", "lm", **BLOCK, **KV1),
    "ernie4_5": hf("Ernie4_5Config", "Ernie4_5ForCausalLM", "lm", **BLOCK, **KV1, head_dim=8),
    "hunyuan_dense": hf("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", "lm", **BLOCK, **KV1, head_dim=8),
    "arcee": hf("ArceeConfig", "ArceeForCausalLM", "lm", **BLOCK, **KV1),
    "glm4": hf("Glm4Config", "Glm4ForCausalLM", "lm", **BLOCK, **KV1, head_dim=8),
    "apertus": hf("ApertusConfig", "ApertusForCausalLM", "lm", **BLOCK, **KV1),
    "doge": hf("DogeConfig", "DogeForCausalLM", "lm", **BLOCK, **KV1),
    "olmo3": hf("Olmo3Config", "Olmo3ForCausalLM", "lm", **BLOCK, **KV1, sliding_window=4),
    "marian": seq2seq_kw("MarianConfig", "MarianMTModel", **S2S),
    "blenderbot": seq2seq_kw("BlenderbotConfig", "BlenderbotForConditionalGeneration", **S2S),
    "blenderbot_small": seq2seq_kw("BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration", **S2S),
    "umt5": hf("UMT5Config", "UMT5ForConditionalGeneration", "seq2seq", d_model=16, d_kv=8, d_ff=24, num_layers=1,
               num_heads=2, relative_attention_num_buckets=4, dropout_rate=0.0, decoder_start_token_id=0),
    "mvp": seq2seq_kw("MvpConfig", "MvpForConditionalGeneration", **S2S),
    "t5gemma": hf("T5GemmaConfig", "T5GemmaForConditionalGeneration", "seq2seq",
                  encoder=dict(**BLOCK, **KV1, head_dim=8, vocab_size=VOCAB, sliding_window=4),
                  decoder=dict(**BLOCK, **KV1, head_dim=8, vocab_size=VOCAB, sliding_window=4),
                  decoder_start_token_id=2),
    "canine": unused_frozen(hf("CanineConfig", "CanineForSequenceClassification", "cls", **BLOCK, **NO_DROP,
                 max_position_embeddings=64, num_hash_functions=2, num_hash_buckets=32, downsampling_rate=2,
                 upsampling_kernel_size=3, local_transformer_stride=4)),
    "luke": unused_frozen(hf("LukeConfig", "LukeForSequenceClassification", "cls", **BLOCK, **NO_DROP,
                             max_position_embeddings=16, entity_vocab_size=8, entity_emb_size=8)),
    "layoutlm": hf("LayoutLMConfig", "LayoutLMForSequenceClassification", "cls", **BLOCK, **NO_DROP,
                   max_position_embeddings=16, max_2d_position_embeddings=32),
    "markuplm": unused_frozen(hf("MarkupLMConfig", "MarkupLMForSequenceClassification", "cls", **BLOCK, **NO_DROP,
                   max_position_embeddings=16, max_depth=4, max_xpath_tag_unit_embeddings=8,
                   max_xpath_subs_unit_embeddings=8, xpath_unit_hidden_size=8, tag_pad_id=7, subs_pad_id=7)),
    "ernie": hf("ErnieConfig", "ErnieForSequenceClassification", "cls", **BLOCK, **NO_DROP,
                max_position_embeddings=16, use_task_id=True, task_type_vocab_size=3),
    "data2vec_text": hf("Data2VecTextConfig", "Data2VecTextForSequenceClassification", "cls", **BLOCK, **NO_DROP,
                        max_position_embeddings=16),
    "gpt_neox_japanese": hf("GPTNeoXJapaneseConfig", "GPTNeoXJapaneseForCausalLM", "lm", hidden_size=16,
                            num_hidden_layers=1, num_attention_heads=2, intermediate_multiple_size=2,
                            max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0),
    "hf_data2vec_vision": hf("Data2VecVisionConfig", "Data2VecVisionForImageClassification", "image",
                             image_size=16, patch_size=4, **BLOCK, **NO_DROP, use_relative_position_bias=True),
    "hf_swinv2": hf("Swinv2Config", "Swinv2ForImageClassification", "image", image_size=16, patch_size=2,
                    embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2, drop_path_rate=0.0, **NO_DROP),
    "hf_poolformer": hf("PoolFormerConfig", "PoolFormerForImageClassification", "image", hidden_sizes=[8, 16],
                        depths=[1, 1], num_encoder_blocks=2, patch_sizes=[3, 3], strides=[2, 2], padding=[1, 1],
                        pool_size=3, drop_path_rate=0.0, hidden_dropout_prob=0.0),
    "hf_bit": hf("BitConfig", "BitForImageClassification", "image", embedding_size=8, hidden_sizes=[8, 16],
                 depths=[1, 1], layer_type="preactivation", global_padding="SAME", num_groups=4,
                 drop_path_rate=0.0),
    "hf_pvt": hf("PvtConfig", "PvtForImageClassification", "image", image_size=16, num_encoder_blocks=2,
                 depths=[1, 1], sequence_reduction_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[4, 2],
                 strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], drop_path_rate=0.0, **NO_DROP),
    "hf_hiera": hf("HieraConfig", "HieraForImageClassification", "image", image_size=[16, 16], patch_size=[3, 3],
                   patch_stride=[2, 2], patch_padding=[1, 1], embed_dim=8, num_heads=[1, 2], depths=[1, 1],
                   embed_dim_multiplier=2.0, num_query_pool=1, query_stride=[2, 2], masked_unit_size=[2, 2],
                   masked_unit_attention=[True, False], drop_path_rate=0.0),
    "hf_hubert": audio("HubertConfig", "HubertForSequenceClassification"),
    "hf_wavlm": audio("WavLMConfig", "WavLMForSequenceClassification", num_buckets=8, max_bucket_distance=16),
    "hf_data2vec_audio": audio("Data2VecAudioConfig", "Data2VecAudioForSequenceClassification",
                               conv_pos_kernel_size=3, num_conv_pos_embeddings=4),
    "hf_sew": audio("SEWConfig", "SEWForSequenceClassification", squeeze_factor=2),
    "hf_unispeech": audio("UniSpeechConfig", "UniSpeechForSequenceClassification"),
    "hf_speech2text": (speech2text, lambda: ((torch.randn(B, 12, 8), tokens()), (tokens(),)), token_ce),
    # transformers 5.25, a second sweep: GPT-2 and GPT-1 (Conv1D), TAPAS (its cell and column embeddings), BitNet
    # (ternary weights through a straight-through round), DeepSeek-V2 and MiniCPM3 (latent attention, low-rank
    # queries), RecurrentGemma (its RG-LRU keeps its state on a module: an output with a gradient besides the
    # loss) and Gemma3n (AltUp clamps its coefficients' .data in the forward; refused sharded: a gathered copy)
    "tapas": hf("TapasConfig", "TapasForSequenceClassification", "cls", **BLOCK, **NO_DROP, max_position_embeddings=16),
    "roberta_prelayernorm": hf("RobertaPreLayerNormConfig", "RobertaPreLayerNormForSequenceClassification", "cls",
                               **BLOCK, **NO_DROP, max_position_embeddings=16),
    "gpt2": hf("GPT2Config", "GPT2LMHeadModel", "lm", n_embd=16, n_layer=1, n_head=2, n_positions=16,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "openai_gpt": hf("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", "lm", n_embd=16, n_layer=1, n_head=2, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "diffllama": hf("DiffLlamaConfig", "DiffLlamaForCausalLM", "lm", **BLOCK, num_key_value_heads=2,
                    max_position_embeddings=16),
    "cohere2": hf("Cohere2Config", "Cohere2ForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2}, **KV1,
                  sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "bitnet": hf("BitNetConfig", "BitNetForCausalLM", "lm", **BLOCK, **KV1),
    "deepseek_v2": hf("DeepseekV2Config", "DeepseekV2ForCausalLM", "lm", **BLOCK, num_key_value_heads=2,
                      max_position_embeddings=16, moe_intermediate_size=8, n_routed_experts=4, n_shared_experts=1,
                      num_experts_per_tok=2, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8,
                      qk_nope_head_dim=4, first_k_dense_replace=0, n_group=1, topk_group=1,
                      experts_implementation="batched_mm"),
    "minicpm3": hf("MiniCPM3Config", "MiniCPM3ForCausalLM", "lm", **BLOCK, num_key_value_heads=2,
                   max_position_embeddings=16, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8,
                   qk_nope_head_dim=4),
    "recurrent_gemma": hf("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", "lm", hidden_size=16,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=24,
                          lru_width=16, attention_window_size=4, conv1d_width=3,
                          block_types=["recurrent", "attention"], head_dim=8),
    "gemma3n_text": hf("Gemma3nTextConfig", "Gemma3nForCausalLM", "lm", **{**BLOCK, "num_hidden_layers": 2}, **KV1,
                       head_dim=8, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=4,
                       sliding_window=4, layer_types=["sliding_attention", "full_attention"], altup_num_inputs=2,
                       laurel_rank=4, num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0]),
    "plbart": seq2seq_kw("PLBartConfig", "PLBartForConditionalGeneration", **S2S),
    "hf_pvt_v2": hf("PvtV2Config", "PvtV2ForImageClassification", "image", image_size=16, num_encoder_blocks=2,
                    depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[3, 3], strides=[2, 2],
                    num_attention_heads=[1, 2], mlp_ratios=[2, 2], drop_path_rate=0.0, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0),
    "hf_dinov2_registers": unused_frozen(hf("Dinov2WithRegistersConfig", "Dinov2WithRegistersForImageClassification",
                                            "image", image_size=16, patch_size=4, **BLOCK, **NO_DROP,
                                            num_register_tokens=2, drop_path_rate=0.0)),
    "hf_ijepa": hf("IJepaConfig", "IJepaForImageClassification", "image", image_size=16, patch_size=4, **BLOCK,
                   **NO_DROP),
    "hf_sew_d": audio("SEWDConfig", "SEWDForSequenceClassification", squeeze_factor=2, max_position_embeddings=16,
                      position_buckets=8, share_att_key=True, relative_attention=True, pos_att_type=("p2c", "c2p"),
                      norm_rel_ebd="layer_norm", hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0),
    "hf_unispeech_sat": unused_frozen(audio("UniSpeechSatConfig", "UniSpeechSatForSequenceClassification")),
}


# models whose oracle runs on another model of the zoo with the same parameters and the same function, written
# with ops float64 has (the oracle's precision)
# (reentrant checkpointing cannot run under torch.autograd.grad, which the oracle's per-sample backward uses)
ORACLE_TWIN = {"mixtral_grouped": "mixtral_bmm", "llama_checkpointed_reentrant": "llama_checkpointed",
               **{f"{n}_grouped": f"{n}_bmm" for n in ("qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3",
                                                       "phimoe")}}


def _twin_oracle(name: str, oracle):
    """``oracle`` run on ORACLE_TWIN[name] holding the given model's parameters."""
    def run(model, *args, **kwargs):
        with torch.random.fork_rng():  # the twin's random init draws nothing from the stream the step then reads
            twin = MODELS[ORACLE_TWIN[name]][0]().train()  # (PhiMoE's router draws random numbers in training)
        twin.load_state_dict(model.state_dict())
        return oracle(twin, *args, **kwargs)

    return run


def _oracle_for(model, loss, inputs, targets, name: str | None = None):
    """(oracle, unclipped per-sample norms): reference.dp_reference (vmap(grad)) where vmap can run the model,
    else the same with one plain backward per sample (loop=True); on the model's ORACLE_TWIN where it has one."""
    def on(oracle):
        return _twin_oracle(name, oracle) if name in ORACLE_TWIN else oracle

    try:
        oracle = on(reference.dp_reference)
        return oracle, oracle(model, loss, inputs, targets, max_grad_norm=1.0, expected_batch_size=B)[1]
    except Exception:  # noqa: BLE001 - vmap cannot run this model
        oracle = on(functools.partial(reference.dp_reference, loop=True))
        return oracle, oracle(model, loss, inputs, targets, max_grad_norm=1.0, expected_batch_size=B)[1]


def _oracle(model, loss, inputs, targets, name: str | None = None):
    """(clipped float64 gradients, C): C the median per-sample norm, so that clipping is active."""
    oracle, norms = _oracle_for(model, loss, inputs, targets, name)
    if not torch.isfinite(norms).all():  # every sample dropped on both sides: a match that checks nothing
        raise _Broken(f"the model's own per-sample gradients are not finite (norms {norms.tolist()})")
    C = float(norms.median())
    ref, _ = oracle(model, loss, inputs, targets, max_grad_norm=C, expected_batch_size=B + 1)
    return ref, C


class _Broken(Exception):
    """The model itself fails the check's premise (BROKEN): nothing about dpcompile."""


def _classify(exc: Exception) -> tuple[str, str]:
    """REFUSED for dpcompile's own errors (DPCompileError, DPValueError: it says what and why), else FAIL."""
    ours = (dpcompile.DPCompileError, DPValueError)
    while exc.__cause__ is not None and not isinstance(exc, ours):
        exc = exc.__cause__
    if isinstance(exc, ours):
        return "REFUSED", " ".join(line.strip() for line in str(exc).splitlines()[:2])
    return "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


DROPOUT_SEED = 7
_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "attn_drop", "dropout_prob")


def dropouts_on(model: torch.nn.Module, p: float) -> int:
    """--dropout: every dropout the model has set to p, as users train (the zoo's configurations turn them off
    for the vmap oracle): nn.Dropout and its kin, a drop path's probability, and the float dropout rates
    attention modules pass to F.dropout or SDPA. How many were set."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p, n = p, n + 1
            continue
        names = ("drop_prob",) if "DropPath" in type(m).__name__ else _DROPOUT_ATTRIBUTES
        for a in names:
            if isinstance(getattr(m, a, None), float):
                setattr(m, a, p)
                n += 1
    return n


def _dropout() -> float:
    return float(os.environ.get("ZOO_DROPOUT", "0"))


def _replayed(model, loss, inputs, targets, name: str, seed: int) -> dict:
    """--dropout's oracle: per-sample gradients with the draws of a step seeded ``seed`` replayed
    (reference.replayed_per_sample_gradients), on the model's ORACLE_TWIN where it has one (its dropouts on too)."""
    if name in ORACLE_TWIN:
        with torch.random.fork_rng():
            twin = MODELS[ORACLE_TWIN[name]][0]().train().to(next(model.parameters()).dtype)
        twin.load_state_dict(model.state_dict())
        dropouts_on(twin, _dropout())
        model = twin
    return reference.replayed_per_sample_gradients(model, loss, inputs, targets, seed=seed)


def _replayed_clip(model, loss, inputs, targets, name: str, seed: int, C: float | None):
    """(clipped float64 gradients at expected batch size B + 1, C): C the median per-sample norm when None."""
    try:
        g = _replayed(model, loss, inputs, targets, name, seed)
    except Exception as exc:  # noqa: BLE001 - the model's own forward/backward with its dropouts on fails
        raise _Broken(f"the model fails without dpcompile ({type(exc).__name__}: {str(exc).splitlines()[0]})") \
            from exc
    if C is None:
        norms = reference.clip_and_sum(g, max_grad_norm=1.0, expected_batch_size=B)[1]
        if not torch.isfinite(norms).all():
            raise _Broken(f"the model's own per-sample gradients are not finite (norms {norms.tolist()})")
        C = float(norms.median())
    return reference.clip_and_sum(g, max_grad_norm=C, expected_batch_size=B + 1)[0], C


def _compare(model, ref: dict, where: str, full=lambda t: t) -> None:
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            raise AssertionError(f"no gradient for {pname} ({where})")
        tol = 1e-7 + 1e-6 * float(ref[pname].abs().max())
        torch.testing.assert_close(full(p.grad).double(), ref[pname], rtol=1e-5, atol=tol,
                                   msg=lambda m: f"{pname}, {where}: {m}")


def _run_with_dropout(name, model, loss, inputs, targets, schedule, compiler, off) -> None:
    """One process, dropouts on: the step seeded as the replayed oracle, Inductor drawing with torch's ops."""
    ref, C = _replayed_clip(model, loss, inputs, targets, name, DROPOUT_SEED, None)
    model.zero_grad(set_to_none=True)
    step, _ = helpers.compile_step(model, loss, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B + 1,
                                   schedule=schedule, compiler=compiler, disable_passes=list(off))
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(DROPOUT_SEED)
        step(inputs, targets)
    _compare(model, ref, f"dropout {_dropout()}")


def _build(name: str, dtype: torch.dtype):
    make, data, loss = MODELS[name]
    torch.manual_seed(0)
    model = make().train().to(dtype)
    inputs, targets = data()
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    if _dropout():
        dropouts_on(model, _dropout())
    if os.environ.get("ZOO_CHANNELS_LAST"):  # --channels-last: how vision users run a conv net on GPUs
        model = model.to(memory_format=torch.channels_last)
        inputs = tuple(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in inputs)
    return model, loss, inputs, targets


def run(name: str, schedule: str, compiler: str, dtype: torch.dtype, off: tuple[str, ...] = ()) -> tuple[str, str]:
    try:
        model, loss, inputs, targets = _build(name, dtype)
    except ImportError as exc:
        return "SKIP", f"{type(exc).__name__}: {exc}"
    torch._dynamo.reset()
    if _dropout():
        try:
            _run_with_dropout(name, model, loss, inputs, targets, schedule, compiler, off)
        except _Broken as exc:
            return "BROKEN", str(exc)
        except Exception as exc:  # noqa: BLE001 (reported, and the exit status says so)
            return _classify(exc)
        return "PASS", ""
    try:
        helpers.dp_reference, norms = _oracle_for(model, loss, inputs, targets, name)  # check_against_reference's
    except Exception as exc:  # noqa: BLE001 - the model's own plain forward/backward fails: nothing to check
        return "BROKEN", f"the model fails without dpcompile ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    if not torch.isfinite(norms).all():  # every sample dropped on both sides: a match that checks nothing
        return "BROKEN", f"the model's own per-sample gradients are not finite in {dtype} (norms {norms.tolist()})"
    try:
        check_against_reference(model, loss, inputs, targets, schedule=schedule, compiler=compiler,
                                disable_passes=list(off))
    except Exception as exc:  # noqa: BLE001 (reported, and the exit status says so)
        return _classify(exc)
    finally:
        helpers.dp_reference = reference.dp_reference
    return "PASS", ""


def shard_blocks(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """dpcompile.fully_shard on every block (an item of an nn.ModuleList or nn.Sequential that holds
    parameters in modules of its own: a transformer layer, a vision stage's block), innermost first, then the
    root: how users shard a model they did not write."""
    for module in reversed(list(model.modules())):
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        for block in module:
            if any(True for _ in block.children()) and any(p.requires_grad for p in block.parameters()):
                dpcompile.fully_shard(block, mesh=mesh)
    return dpcompile.fully_shard(model, mesh=mesh)


def _sharded_rank(rank: int, world: int, tmp: str, name: str, schedule: str, compiler: str, dtype: str,
                  off: tuple[str, ...] = ()) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        model, loss, inputs, targets = _build(name, getattr(torch, dtype))
        if _dropout():  # C from one draw of the whole batch; each split's oracle replays each rank's draws
            unsharded = copy.deepcopy(model)
            ref, C = _replayed_clip(model, loss, inputs, targets, name, DROPOUT_SEED, None)
        else:
            ref, C = _oracle(model, loss, inputs, targets, name)
        shard_blocks(model, init_device_mesh("cpu", (world,)))
        # uneven: rank 0 one sample more than an even share, the last rank what is left (maybe nothing)
        cuts = [min(B, B // world + 1) if r == 0 else B // world for r in range(world - 1)]
        cuts.append(B - sum(cuts))
        # then the same batch again through the same graph, with the last rank given nothing (Poisson
        # sampling gives a rank an empty batch now and then, and its step must still run every collective)
        empty_last = [B // (world - 1)] * (world - 1) + [0]
        empty_last[-2] += B - sum(empty_last)

        def step(inputs, targets):
            per_sample = loss(model(*inputs), *targets)
            per_sample.mean().backward()

        torch._dynamo.reset()
        private = dpcompile.private_step(step, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B + 1,
                                         schedule=schedule, compiler=compiler, disable_passes=list(off))
        for i, split in enumerate((cuts, empty_last)):
            lo = sum(split[:rank])
            local = tuple(x[lo:lo + split[rank]] for x in inputs), tuple(y[lo:lo + split[rank]] for y in targets)
            model.zero_grad(set_to_none=True)
            seed = DROPOUT_SEED + 1 + rank + world * i  # each rank its own draws, each split others
            with torch._inductor.config.patch(fallback_random=True):
                torch.manual_seed(seed)
                private(*local)
            if _dropout():  # the whole batch's oracle: each rank's clipped sum under its draws, added
                ref = _replayed_clip(unsharded, loss, *local, name, seed, C)[0] if split[rank] else \
                    {k: torch.zeros_like(v, dtype=torch.float64) for k, v in unsharded.named_parameters()}
                for k in sorted(ref):
                    dist.all_reduce(ref[k])
            _compare(model, ref, f"per-rank batches {split}", full=lambda g: g.full_tensor())
        # (fully_shard's default bucketing: its all-gathers' parameters copied out, dpcompile.gathered_copy_out)
        copied = sum(r.counters.get(gathered_copy_out.COUNTER, 0) for r in private.dp_backend.compiled if r.dp)
        result = ("PASS", f"per-rank batches {cuts}, then {empty_last}"
                  + (f"; {copied} gathered buckets copied out" if copied else ""))
    except ImportError as exc:
        result = ("SKIP", f"{type(exc).__name__}: {exc}")
    except _Broken as exc:
        result = ("BROKEN", str(exc))
    except Exception as exc:  # noqa: BLE001 (reported, and the exit status says so)
        result = _classify(exc)
        if os.environ.get("ZOO_TRACEBACK"):
            traceback.print_exc()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def run_sharded(name: str, schedule: str, compiler: str, dtype: torch.dtype, world: int,
                off: tuple[str, ...] = ()) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        died = ""
        try:
            torch.multiprocessing.spawn(_sharded_rank, args=(world, tmp, name, schedule, compiler,
                                                             str(dtype).split(".")[-1], off), nprocs=world)
        except Exception as exc:  # noqa: BLE001 - a rank died: before its result (FAIL) or after it (said)
            died = f"a rank died: {str(exc).splitlines()[-1][:200] if str(exc) else type(exc).__name__}"
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                return "FAIL", died
            with open(path) as f:
                results.append(tuple(json.load(f)))
    status, why = min(results, key=lambda sw: ["FAIL", "REFUSED", "BROKEN", "SKIP", "PASS"].index(sw[0]))
    return status, f"{why}; then {died} (after every rank's result)" if died else why


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all", help=f"comma-separated, or all: {','.join(MODELS)}")
    ap.add_argument("--schedules", default="bk,ghost")
    ap.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    # float64 by default: the oracle's precision, so a deep net's fp32 rounding (EfficientNet's 16 blocks
    # with 4-group GroupNorm: 1e-4 of a gradient's scale) is not mistaken for an error
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    ap.add_argument("--shard", type=int, default=0, metavar="N", help="run sharded on N gloo processes")
    ap.add_argument("--channels-last", action="store_true",
                    help="the model converted with model.to(memory_format=torch.channels_last), 4-d inputs channels-last")
    ap.add_argument("--dropout", type=float, default=0.0, metavar="P",
                    help="every dropout and drop path of the model set to P, as users train; the oracle replays the "
                         "step's draws (Inductor draws with torch's random ops: fallback_random)")
    ap.add_argument("--disable-passes", default="", metavar="A,B",
                    help="optional passes to skip (the option disable_passes): is a failure theirs?")
    args = ap.parse_args()
    if args.channels_last:
        os.environ["ZOO_CHANNELS_LAST"] = "1"  # (read by _build, in the sharded ranks too)
    if args.dropout:
        os.environ["ZOO_DROPOUT"] = str(args.dropout)  # (read by _build and the oracles, in the sharded ranks too)
    names = list(MODELS) if args.models == "all" else args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    failed = False
    for name in names:
        for schedule in args.schedules.split(","):
            t = time.perf_counter()
            dtype = getattr(torch, args.dtype)
            off = tuple(p for p in args.disable_passes.split(",") if p)
            status, why = run_sharded(name, schedule, args.compiler, dtype, args.shard, off) if args.shard > 1 \
                else run(name, schedule, args.compiler, dtype, off)
            failed |= status == "FAIL"
            print(f"{status:8s} {name:22s} {schedule:6s} {time.perf_counter() - t:5.1f}s  {why[:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
