"""What the backend cannot prove per-sample is refused, naming op, module and parameter."""
import dataclasses
import logging
import operator
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpcompile
import models as M
from dpcompile import DPCompileError
from dpcompile.errors import SamplesMixedError
from helpers import check_against_reference


def run(model, loss_of, inputs, **options):
    opts = dict(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)
    opts.update(options)
    backend = dpcompile.DPBackend(**opts)

    def step(*xs):
        loss = loss_of(model, *xs)
        loss.backward()
        return loss.detach()

    return torch.compile(step, backend=backend)(*inputs)


def expect_refusal(fn, *fragments, exc=DPCompileError):
    with pytest.raises(Exception) as info:
        fn()
    err = info.value
    while not isinstance(err, exc) and err.__cause__ is not None:
        err = err.__cause__
    assert isinstance(err, exc), f"expected {exc.__name__}, got {type(info.value).__name__}: {info.value}"
    for f in fragments:
        assert f in str(err), f"{f!r} not in: {err}"
    return err


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.bn(self.fc(x)))


@pytest.mark.parametrize("suppress_errors", [False, True])
def test_batchnorm_in_training_mode_is_refused(suppress_errors):
    """Also with dynamo's suppress_errors, which runs a frame whose compile failed as plain Python: a refused DP
    step then trained without DP. Off while dynamo compiles DP frames (step_frames); the process keeps its own."""
    model = BNNet()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with torch._dynamo.config.patch(suppress_errors=suppress_errors):
        expect_refusal(lambda: run(model, lambda m, x, y: M.ce(m(x), y).mean(), (x, y)),
                       "var_mean", "bn (BatchNorm1d)", "mixes samples", "GroupNorm")
        assert torch._dynamo.config.suppress_errors == suppress_errors
    assert all(p.grad is None for p in model.parameters())


def test_batchnorm_in_eval_mode_is_fine():
    model = BNNet().eval()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    run(model, lambda m, x, y: M.ce(m(x), y).mean(), (x, y))
    assert model.fc.weight.grad is not None


@pytest.mark.parametrize("batch", [4, 1])
def test_a_buffer_written_from_the_samples_is_refused(batch):
    """A running mean of the inputs kept in a buffer leaves the step without noise: refused, naming the buffer
    and the op, before the step has written it; the sample-free counter beside it passes. At a static batch
    of one too (clipped whole: nothing else there looks at the samples). Sharded: test_fsdp's
    test_partially_sharded_..."""
    model = M.RunningInputMean()
    x = torch.randn(batch, 5)
    expect_refusal(lambda: run(model, lambda m, x: m(x).pow(2).sum(1).mean(), (x,)),
                   "writes sample data into buffer 'running_mean'", "aten.mean.dim", "privatises gradients only")
    assert (model.running_mean == 0).all() and model.steps == 0


def test_batchnorm_running_statistics_are_refused_at_a_batch_of_one():
    """At a batch of one BatchNorm's statistics are the one sample's (not mixed), but its running statistics
    would still carry the sample out of the step."""
    model = nn.Sequential(nn.BatchNorm1d(6), nn.Flatten(), nn.Linear(18, 3))
    x, y = torch.randn(1, 6, 3), torch.randint(0, 3, (1,))
    expect_refusal(lambda: run(model, lambda m, x, y: M.ce(m(x), y).mean(), (x, y)),
                   "into buffer '0.running_", "0 (BatchNorm1d)", "GroupNorm")


def test_a_buffer_written_from_parameters_only_is_fine():
    """spectral_norm's power iteration writes buffers computed from the weight alone (tests/cases.py runs it
    against the oracle): the check lets it through."""
    model = M.SpectralNormNet()
    x, y = torch.randn(4, 5, 4), torch.randn(4, 5, 3)
    backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)

    def step(x, y):
        loss = M.mse(model(x), y).mean()
        loss.backward()
        return loss.detach()

    torch.compile(step, backend=backend)(x, y)
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["state_updates_checked"] >= 2, record.counters


@pytest.mark.parametrize("batch", [4, 1])
def test_an_embedding_with_max_norm_is_refused(batch):
    """max_norm renormalises, in place, the rows the batch looks up: the samples change the weight, without
    noise. Refused by name with what to do, at a batch of one too (no size-one advice there: not a layout)."""
    model = M.EmbNet()
    model.emb.max_norm = 1.0
    x, y = torch.randint(0, 11, (batch, 5)), torch.randn(batch, 5, 3)
    err = expect_refusal(lambda: run(model, lambda m, x, y: M.mse(m(x), y).mean(), (x, y)),
                         "aten.embedding_renorm", "emb (Embedding)", "drop max_norm")
    assert "mark_batch" not in str(err)


def test_an_embedding_bag_with_offsets_is_refused_saying_how_to_pass_it():
    """Bags given by offsets over 1-D input: which sample an index belongs to is data. Refused, naming the op
    and the module, with the 2-D form dpcompile takes (tests/cases.py: embedding_bag)."""
    class Bags(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(11, 4, mode="sum")
            self.head = nn.Linear(4, 3)

        def forward(self, flat, offsets):
            return self.head(self.bag(flat, offsets))

    flat, offsets = torch.randint(0, 11, (8,)), torch.tensor([0, 3, 5, 6])
    expect_refusal(lambda: run(Bags(), lambda m, f, o: m(f, o).pow(2).sum(1).mean(), (flat, offsets),
                               batch_dim={"xs.0": None}),
                   "aten._embedding_bag", "bag (EmbeddingBag)", "as 2-D input")


def test_an_embedding_bag_that_torch_refuses_keeps_its_error():
    """per_sample_weights are only for mode="sum": F.embedding_bag raises for a mean, and the rewrite as an
    embedding (dpcompile/embedding_bag.py) must not turn that into a mean that ignores them."""
    model = nn.EmbeddingBag(11, 4, mode="mean")
    ids, w = torch.randint(0, 11, (4, 5)), torch.rand(4, 5)
    with pytest.raises(Exception, match="per_sample_weights"):
        run(model, lambda m, x, w: m(x, per_sample_weights=w).pow(2).sum(1).mean(), (ids, w))


def test_samples_mixed_at_a_batch_of_one_says_how_to_know_the_sample_dim():
    """At a static batch of one a dim of size one may be taken for the sample dim: a refusal for mixing
    samples in the forward there says how to compile with the sample dim known (mark_batch)."""
    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            return self.fc(x - x.mean(0))

    err = expect_refusal(lambda: run(Centred(), lambda m, x: m(x).pow(2).sum(1).mean(), (torch.randn(1, 5),)),
                         "mixes samples", "static batch of one", "dpcompile.mark_batch")
    assert isinstance(err, SamplesMixedError), type(err)
    # at larger batches the same refusal, without the batch-of-one advice; a refusal of another kind is not one
    err = expect_refusal(lambda: run(Centred(), lambda m, x: m(x).pow(2).sum(1).mean(), (torch.randn(4, 5),)),
                         "mixes samples")
    assert isinstance(err, SamplesMixedError) and "static batch of one" not in str(err), err
    err = expect_refusal(lambda: run(M.RunningInputMean(), lambda m, x: m(x).pow(2).sum(1).mean(),
                                     (torch.randn(1, 5),)), "writes sample data into buffer")
    assert not isinstance(err, SamplesMixedError) and "static batch of one" not in str(err), err


@pytest.mark.parametrize("divisor", ["numel", "classes"])
def test_a_sum_over_its_number_of_elements_is_refused_at_a_static_batch_of_one(divisor):
    """At a batch of one, loss.sum() / loss.numel() (a mean over the batch: cases.BATCH_MEANS "sum_over_numel")
    and loss.sum() / classes (a sum of per-sample means) are one graph; taking either reading would mix the
    two across the graphs a Poisson-sampled run compiles for each size. Refused there, saying what to do;
    at larger batches both run, as a mean and as a sum, and .mean() or a sum over the batch size runs at one."""
    def loss_of(m, x):
        per_class = m(x).pow(2)
        return per_class.sum() / (per_class.numel() if divisor == "numel" else per_class.shape[1])

    err = expect_refusal(lambda: run(nn.Linear(5, 4), loss_of, (torch.randn(1, 5),)),
                         "a batch of one divided by their number", "loss.mean()", "dpcompile.mark_batch")
    assert isinstance(err, SamplesMixedError), type(err)
    for batch, loss, reduction in ((3, loss_of, "mean" if divisor == "numel" else "sum"),
                                   (1, lambda m, x: m(x).pow(2).mean(), "mean"),
                                   (1, lambda m, x: m(x).pow(2).sum() / x.shape[0], "mean")):
        torch._dynamo.reset()
        backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)
        model = nn.Linear(5, 4)  # 4 classes: not the batch size
        torch.compile(lambda x: loss(model, x).backward(), backend=backend)(torch.randn(batch, 5))
        (record,) = [r for r in backend.compiled if r.dp]
        assert record.summary["loss"]["reduction"] == reduction, (batch, record.summary)


def test_a_sum_scaled_by_another_function_of_the_batch_size_is_refused():
    """One graph for every batch size: loss.sum() / (2 * B) is neither the mean (sum / B, or sum * (1 / B), or
    -sum / B: F.cross_entropy's with probability targets) nor a constant factor. Read as a constant, each
    sample's clipped share would depend on how many samples were drawn: refused, saying how to write the
    mean; the three forms of the mean run as one."""
    def loss_of(scale):
        return lambda m, x: scale(m(x).pow(2).sum(1).sum(), x.shape[0])

    x = torch.randn(3, 5)
    dpcompile.mark_batch(x)
    err = expect_refusal(lambda: run(nn.Linear(5, 4), loss_of(lambda s, b: s / (2 * b)), (x,)),
                         "computed from the batch size", ".mean()")
    assert isinstance(err, SamplesMixedError), type(err)
    for scale in (lambda s, b: s / b, lambda s, b: s * (1.0 / b), lambda s, b: -(-s) / b):
        torch._dynamo.reset()
        backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)
        model = nn.Linear(5, 4)
        x = torch.randn(3, 5)
        dpcompile.mark_batch(x)
        torch.compile(lambda x: loss_of(scale)(model, x).backward(), backend=backend)(x)
        (record,) = [r for r in backend.compiled if r.dp]
        assert record.summary["loss"]["reduction"] == "mean", record.summary


def test_ctc_loss_with_concatenated_targets_is_refused():
    """F.ctc_loss also takes the targets concatenated into one 1-D tensor: the samples are not a dim of it, so the
    analysis cannot follow them (padded [B, S] targets run: test_per_sample_clipping's test_ctc_loss_is_per_sample).
    As a batched input it disagrees with the batch size; declared not per-sample (batch_dim None), the CTC op
    is refused by name, saying to pad the targets."""
    import cases

    x, y, il, tl = cases.ctc_data(4)
    flat = torch.cat([y[i, :tl[i]] for i in range(4)])
    model = M.MLP(d_out=cases.CTC_CLASSES)

    def step(x, flat, il, tl):
        loss = F.ctc_loss(model(x).log_softmax(-1).transpose(0, 1), flat, il, tl)
        loss.backward()
        return loss.detach()

    for options, fragments, exc in (({}, ("disagree on the batch size", "batch_dim"), ValueError),
                                    ({"batch_dim": {"flat": None}}, ("dpcompile.ctc_loss", "concatenated",
                                                                     "padded, one row per sample"), DPCompileError)):
        torch._dynamo.reset()
        backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, **options)
        expect_refusal(lambda: torch.compile(step, backend=backend)(x, flat, il, tl), *fragments, exc=exc)


@pytest.mark.parametrize("order", ["flipped", "shifted"])
def test_indexing_the_sample_dim_out_of_order_is_refused(order):
    """x[arange(B), j] is per sample (tests/cases.py sample_indexed); the batch positions in any other order
    take one sample's values to another's place, which mixes samples."""
    class Picks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            B = x.shape[0]
            rows = torch.arange(B).flip(0) if order == "flipped" else (torch.arange(B) + 1) % B
            return self.fc(x)[rows, torch.zeros_like(rows)]

    expect_refusal(lambda: run(Picks(), lambda m, x: m(x).pow(2).mean(), (torch.randn(4, 5),)),
                   "aten.index.Tensor", "not torch.arange(batch size)")


@pytest.mark.parametrize("how", ["fft", "repeat"])
def test_fourier_transform_or_tiling_along_the_sample_dim_is_refused(how):
    """torch.fft over the samples' dim puts several samples' values in one place; Tensor.repeat tiling it keeps
    each row one sample's (cases.routed_experts: Llama 4's tokens repeated per expert, exact), but rows read
    from it shifted by one are each the next sample's (tests/cases.py fourier_mixer: fft off the sample dim,
    exact)."""
    class AcrossSamples(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            h = self.fc(x)
            if how == "fft":
                return torch.fft.fft(h, dim=0).real
            return h.repeat(2, 1)[1: x.shape[0] + 1] + h

    expect_refusal(lambda: run(AcrossSamples(), lambda m, x: m(x).pow(2).sum(1).mean(), (torch.randn(4, 5),)),
                   "along the sample dim" if how == "fft" else "slices along the sample dim")


def test_a_hugging_face_model_given_labels_is_refused_saying_to_compute_the_loss_from_logits():
    """model(ids, labels=ids).loss is transformers' token mean over the whole batch, where dynamo breaks the
    graph: the refusal says to call the model without labels and make one loss per sample from its logits."""
    import transformers  # the test extra's

    cfg = transformers.GPT2Config(vocab_size=29, n_positions=8, n_embd=12, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(1, 29, (4, 6))
    expect_refusal(lambda: run(model, lambda m, ids: m(input_ids=ids, labels=ids).loss, (ids,)),
                   "given labels=", "without labels", "reduction='none'")


def test_token_mean_over_whole_batch_is_refused():
    model = M.GPT()
    ids = torch.randint(0, 13, (4, 6))
    err = expect_refusal(
        lambda: run(model, lambda m, ids: F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()), (ids,)),
        "not a sum or mean of per-sample losses", "reduction='none'",
    )
    assert "aten.div" in str(err)


@pytest.mark.parametrize("how", ["token_mean", "class_weights"])
def test_cross_entropys_mean_over_other_counts_is_refused_saying_to_pass_reduction_none(how):
    """F.cross_entropy's default mean divides by the targets that are not ignore_index: over a batch of tokens
    (several per sample) or weighted by class, that count changes each sample's scale, so it is refused (one
    target per sample is accepted: test_per_sample_clipping); the refusal names the default mean."""
    if how == "token_mean":
        model, ids = M.GPT(), torch.randint(0, 13, (4, 6))
        call = lambda: run(model, lambda m, ids: F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()), (ids,))
    else:
        x, y, model = torch.randn(4, 5), torch.randint(0, 3, (4,)), M.MLP()
        model.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5]))
        call = lambda: run(model, lambda m, x, y: F.cross_entropy(m(x), y, weight=m.class_weight), (x, y))
    err = expect_refusal(call, "not a sum or mean of per-sample losses", "default reduction='mean'",
                         "pass reduction='none'")
    assert "aten.div" in str(err)


def test_regulariser_in_loss_is_refused_naming_the_parameter():
    model = M.MLP()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    expect_refusal(
        lambda: run(model, lambda m, x, y: M.ce(m(x), y).mean() + 1e-3 * m.fc1.weight.pow(2).sum(), (x, y)),
        "fc1.weight", "does not depend on the samples", "weight decay in the optimizer",
    )


class SegmentSums(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):  # per sample, but dpcompile has no rule for segment_reduce (tests/op_sweep.py lists such ops)
        lengths = torch.tensor([1, 2]).expand(x.shape[0], 2)
        return torch.segment_reduce(self.fc(x), "sum", lengths=lengths, axis=1)


def test_unknown_op_is_refused_not_guessed():
    model = nn.Sequential(SegmentSums())
    x, y = torch.randn(4, 5), torch.randint(0, 2, (4,))
    expect_refusal(lambda: run(model, lambda m, x, y: M.ce(m(x), y).mean(), (x, y)),
                   "aten.segment_reduce", "0 (SegmentSums)", "no rule", "torch.segment_reduce(")


class BatchCentering(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0, keepdim=True)


def test_mixing_samples_through_a_batch_statistic_is_refused():
    model = nn.Sequential(BatchCentering())
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    expect_refusal(lambda: run(model, lambda m, x, y: M.ce(m(x), y).mean(), (x, y)),
                   "mixes samples", "0 (BatchCentering)")


def test_scale_grad_by_freq_embedding_is_refused():
    model = M.EmbNet()
    model.emb.scale_grad_by_freq = True
    ids, y = torch.randint(0, 11, (4, 5)), torch.randn(4, 5, 3)
    expect_refusal(lambda: run(model, lambda m, i, y: M.mse(m(i), y).mean(), (ids, y)),
                   "scale_grad_by_freq", "emb (Embedding)")


def test_a_second_differentiable_output_gets_no_gradient_and_cannot_carry_one():
    """A step that returns its per-sample losses undetached has a second output with a gradient: compiled with
    that gradient as zero (passes.side_gradients), the step's gradients are the loss's. A backward through the
    returned tensor afterwards never reaches the parameters: autograd refuses it, the step's backward having
    freed what it saved (a backward that does give such an output a gradient within the step fails on the
    backward's check: test_a_gradient_into_a_kept_state_fails_the_step_naming_the_state)."""
    torch.manual_seed(0)
    model = M.MLP()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)

    def step(x, y):
        per_sample = M.ce(model(x), y)
        loss = per_sample.mean()
        loss.backward()
        return per_sample  # still requires grad: a second output with a gradient

    per_sample = torch.compile(step, backend=backend)(x, y)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["side_gradients_as_zeros"] == 1, record.counters
    model.zero_grad()
    torch._dynamo.reset()
    detached = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)

    def step_detached(x, y):
        loss = M.ce(model(x), y).mean()
        loss.backward()
        return loss.detach()

    torch.compile(step_detached, backend=detached)(x, y)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        per_sample.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)  # nothing added


def test_mean_loss_needs_expected_batch_size():
    model = M.MLP()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    expect_refusal(lambda: run(model, lambda m, x, y: M.ce(m(x), y).mean(), (x, y), expected_batch_size=None),
                   "expected_batch_size", exc=ValueError)


def test_inputs_disagreeing_on_batch_size_get_a_hint():
    model = M.MLP()
    x, y, w = torch.randn(4, 5), torch.randint(0, 3, (4,)), torch.ones(7)

    def make(**extra):
        backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, **extra)

        def step(x, y, weights):
            loss = (M.ce(model(x), y) * weights[:4]).mean()
            loss.backward()
            return loss.detach()

        return torch.compile(step, backend=backend)

    expect_refusal(lambda: make()(x, y, w), "batch_dim={'weights': None}", exc=ValueError)
    torch._dynamo.reset()
    make(batch_dim={"weights": None})(x, y, w)  # with the hint applied it compiles and runs
    assert model.fc1.weight.grad is not None


@pytest.mark.parametrize("bad, fragment", [
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(max_grad_norm=float("inf")), "max_grad_norm"),
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(expected_batch_size=0), "expected_batch_size"),
    (dict(schedule="fast"), "schedule"),
    (dict(linear_norm="magic"), "linear_norm"),
    (dict(compiler="aot_eager"), "compiler must be one of"),
    (dict(cudagraphs="yes"), "cudagraphs must be True or False"),
    (dict(cudagraphs=True, compiler="eager"), "cudagraphs=True needs compiler='inductor'"),
    (dict(batch_dim="0"), "batch_dim"),
    (dict(disable_passes=("no_such_pass",)), "unknown pass"),
    (dict(disable_passes=("per_sample_norms",)), "cannot be disabled"),
    (dict(max_grad_nrom=1.0), "unknown dp_fsdp option"),
])
def test_bad_options_are_value_errors(bad, fragment):
    opts = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    opts.update(bad)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        dpcompile.DPConfig.from_options(opts)


def test_missing_required_options():
    with pytest.raises(ValueError, match="needs the option"):
        dpcompile.DPConfig.from_options({"max_grad_norm": 1.0})


class BrokenGPT(M.GPT):
    """A GPT whose forward dynamo splits in two."""

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        torch._dynamo.graph_break()
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def test_graph_break_before_the_loss_is_refused_saying_where_and_why():
    """Refusing is right (the first piece has no loss); the message says the step was split, where, why."""
    model = BrokenGPT()
    ids = torch.randint(0, 13, (4, 6))
    err = expect_refusal(lambda: run(model, lambda m, ids: M.seq_ce(m(ids), ids).mean(), (ids,)),
                         "only part of the training step", "graph break", "test_refusals.py",
                         "torch._dynamo.graph_break()", "What to do", "fullgraph=True")
    assert "loss must be a scalar, got shape (4, 6, 8)" in str(err)  # what the piece it got looks like


def test_input_carrying_gradients_is_refused():
    """Activations computed outside the compiled step (here by a module run eagerly) bring gradients that
    would reach that module's parameters without per-sample clipping."""
    emb, model = nn.Embedding(13, 5), M.MLP()
    ids, y = torch.randint(0, 13, (4,)), torch.randint(0, 3, (4,))
    expect_refusal(lambda: run(model, lambda m, x, y: M.ce(m(x), y).mean(), (emb(ids), y)),
                   "input 'xs.0' requires grad", "outside the per-sample clipping", "detach")


def test_sizes_of_per_sample_data_are_not_sample_data():
    """Hugging Face's Conv1D (x.view(-1, x.size(-1)), then x.view(x.size()[:-1] + (nf,))) under an unbacked
    batch: the joint graph reads sizes of per-sample tensors (sym_size), public like the batch size; the
    step compiles and is exact."""
    from transformers.pytorch_utils import Conv1D

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = Conv1D(8, 5), Conv1D(3, 8)

        def forward(self, x):
            return self.c2(torch.tanh(self.c1(x)))

    x, y = torch.randn(4, 2, 5), torch.randn(4, 2, 3)
    dpcompile.mark_batch(x, y)
    backend = check_against_reference(Net(), M.mse, (x,), (y,), schedule="bk")
    assert "aten.sym_size.int(" in backend.compiled[0].graphs["joint_graph_before_dp"]


class BreakFirstGPT(M.GPT):
    """A GPT whose forward breaks before any op: the first piece dynamo hands over is the rest of forward."""

    def forward(self, ids):
        torch._dynamo.graph_break()
        return super().forward(ids)


def test_graph_resumed_after_a_break_is_refused_as_a_split_step():
    model = BreakFirstGPT()
    ids = torch.randint(0, 13, (4, 6))
    expect_refusal(lambda: run(model, lambda m, ids: M.seq_ce(m(ids), ids).mean(), (ids,)),
                   "only part of the training step", "the rest of forward", "resumed after a graph break",
                   "What to do")



class PackedLSTM(nn.Module):
    """A text classifier over variable-length samples: packed (torch.nn.utils.rnn), or padded and read at each
    sample's last valid step, the form the refusal of the packed one advises."""

    def __init__(self, packed: bool):
        super().__init__()
        self.packed = packed
        self.rnn, self.head = nn.LSTM(5, 4, batch_first=True), nn.Linear(4, 3)

    def forward(self, x, lengths):
        if not self.packed:
            return self.head(self.rnn(x)[0][torch.arange(x.shape[0]), lengths - 1])
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True)
        return self.head(out[torch.arange(x.shape[0]), lengths - 1])


def test_a_packed_sequence_is_refused_naming_the_function_and_the_padded_form():
    """dynamo does not trace torch.nn.utils.rnn's packing: torch 2.13 skips it (stock torch.compile breaks there too:
    the step is split at that line), 2.11 traces it and fails on a fake tensor. Either way the message names the
    function and says how to write the step without it, and that form is exact."""
    x, lengths, y = torch.randn(4, 6, 5), torch.tensor([6, 2, 4, 1]), torch.randint(0, 3, (4,))
    err = expect_refusal(lambda: run(PackedLSTM(packed=True), lambda m, x, n: F.cross_entropy(m(x, n), y),
                                     (x, lengths)), "run the recurrent layer on the padded batch")
    assert "pad_packed_sequence" in str(err) or "pack_padded_sequence" in str(err), str(err)
    assert "resumed after a graph break" in str(err) or "failed to trace" in str(err), str(err)
    check_against_reference(PackedLSTM(packed=False), lambda out, y: F.cross_entropy(out, y, reduction="none"),
                            (x, lengths), (y,), schedule="bk")

def test_loss_is_the_output_its_tangent_seeds_not_the_first_output():
    """With AOTAutograd's tangent descriptors missing (or not fitting), the loss is still found by what it
    is: the output of the tangent's shape, and among several of that shape the one in the tangent's place."""
    import torch.fx as fx

    from passes.loss_reduction import output_seeded_by

    g = fx.Graph()
    t1, t2 = g.placeholder("tangents_1"), g.placeholder("tangents_2")
    logits, loss, aux = g.placeholder("logits"), g.placeholder("loss"), g.placeholder("aux")
    for n, val in ((t1, torch.zeros(())), (t2, torch.zeros(())), (logits, torch.zeros(4, 6, 13)),
                   (loss, torch.zeros((), requires_grad=True)), (aux, torch.zeros((), requires_grad=True))):
        n.meta["val"] = val
    assert output_seeded_by(t1, [logits, loss], g) is loss  # the first output is the logits
    assert output_seeded_by(t2, [logits, loss, aux], g) is aux  # the second scalar tangent: the second scalar
    t1.meta["desc"] = type("D", (), {"output": type("O", (), {"idx": 0})()})()  # names the logits: not its shape
    assert output_seeded_by(t1, [logits, loss], g) is loss


def test_mode_reduce_overhead_is_the_cudagraphs_option():
    opts = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    assert dpcompile.private_step(lambda x: x, mode="reduce-overhead", **opts).dp_backend.config.cudagraphs
    assert not dpcompile.private_step(lambda x: x, mode="default", **opts).dp_backend.config.cudagraphs
    with pytest.raises(ValueError, match="mode must be one of"):
        dpcompile.private_step(lambda x: x, mode="max-autotune", **opts)
    with pytest.raises(ValueError, match="drop one of them"):
        dpcompile.private_step(lambda x: x, mode="reduce-overhead", cudagraphs=False, **opts)


def test_torch_compile_mode_with_dp_fsdp_says_how_to_write_it():
    # torch.compile refuses mode= and options= together, so dp_fsdp gets a mode without its settings
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x * 2).sum(), backend="dp_fsdp", mode="reduce-overhead")
    with pytest.raises(Exception, match=r"options=\{\.\.\., 'cudagraphs': True\}") as e:
        f(torch.randn(3, requires_grad=True))
    # dynamo wraps what a backend raises (BackendCompilerFailed); the user's error is the ValueError inside
    assert isinstance(getattr(e.value, "inner_exception", e.value), ValueError), type(e.value)



def test_a_parameter_transformed_by_an_op_without_a_per_sample_replay_is_refused_naming_it():
    """A parameter used through a function of itself (cumsum: a monotone parametrization) has as gradient
    that function's backward of a sum over samples; sums, broadcasts and sample-free factors are replayed
    per sample (the standardised and weight_norm cases), a reversed cumulative sum is not: refused."""
    class Monotone(nn.Module):
        def __init__(self):
            super().__init__()
            self.steps = nn.Parameter(torch.rand(5))
            self.head = nn.Linear(5, 3)

        def forward(self, x):
            return self.head(x * self.steps.cumsum(0))

    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    expect_refusal(lambda: run(Monotone(), lambda m, x, y: M.ce(m(x), y).mean(), (x, y), compiler="eager"),
                   "parameter 'steps'", "of a sum over the samples", "rev")


def test_a_graph_of_dpcompiles_own_code_is_described_as_a_split_step(monkeypatch):
    """Where dynamo gives up on the model code that reads a sharded parameter (Mixtral's expert routing, 2
    ranks), it compiles fully_shard's gathering property as a frame of its own: no batch, no loss. The error
    says it is a piece of the step (not "no batched data input" alone) and what to do."""
    from types import SimpleNamespace

    from dpcompile import fsdp, step_split

    getter = fsdp._sharded_class(torch.nn.Linear, ("weight",)).weight.fget
    frame = SimpleNamespace(f_code=getter.__code__, f_locals={"self": torch.nn.Linear(2, 2)})
    monkeypatch.setattr(step_split, "traced_frame", lambda: frame)
    split = step_split.describe_split(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
    assert split is not None and "dpcompile's get of Linear" in split.why and "compiled on its own" in split.why
    text = step_split.split_error_text(split, "no batched data input")
    assert "only part of the training step" in text and "What to do" in text
    # dynamo gave up on the caller at a break it logged: the message names that break, and a size question
    # asked by the model code itself (dynamo's evaluate_expr) gets the advice for branches on the batch size
    # (dynamo gave up on a frame that is still running: here this test's)
    here = (os.path.abspath(__file__), "test_a_graph_of_dpcompiles_own_code_is_described_as_a_split_step")
    broke = step_split._Break("mamba.py:408 (if h.numel() > 0:)",
                              "Could not guard on data-dependent expression 192*u0 > 0", True, here)
    monkeypatch.setattr(step_split, "_RECENT_BREAKS", [broke])
    frame.f_code = getter.__code__
    split = step_split.describe_split(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
    assert "the last graph break dynamo met was at mamba.py:408 (if h.numel() > 0:)" in split.why, split.why
    assert split.advice == step_split._BRANCH_ON_BATCH_ADVICE
    # a break in a frame no longer running is an earlier step's: not this graph's reason
    monkeypatch.setattr(step_split, "_RECENT_BREAKS", [dataclasses.replace(broke, root=(here[0], "elsewhere"))])
    assert "graph break" not in step_split.describe_split(torch.fx.GraphModule(torch.nn.Module(),
                                                                                torch.fx.Graph())).why
    frame.f_code = test_loss_is_the_output_its_tangent_seeds_not_the_first_output.__code__  # user code: no split
    assert step_split.describe_split(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())) is None


class KeepsItsState(nn.Module):
    """A cell that keeps its last state on itself between calls (RecurrentGemma's recurrent_states)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.state = None

    def forward(self, x):
        h = torch.tanh(self.fc(x))  # the state: made here
        self.state = h
        return h


def test_a_gradient_into_a_kept_state_fails_the_step_naming_the_state():
    """A tensor the model keeps on a module attribute is an output of the graph too, compiled with the gradient
    loss.backward() gives it, none (passes.side_gradients; the step is exact: tests/cases.py's kept_outputs).
    A step that does backpropagate into it fails at run time, naming the tensor, the module and the line that
    made it, rather than getting the loss's clipped gradient alone."""
    model = nn.Sequential(KeepsItsState(), nn.Linear(5, 3))
    backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)

    def step(x, y):
        loss = M.ce(model(x), y).mean()
        state = model[0].state
        torch.autograd.backward([loss, state], [torch.ones_like(loss), torch.ones_like(state)])
        return loss.detach()

    compiled = torch.compile(step, backend=backend)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    expect_refusal(lambda: compiled(x, y), "got a gradient for the output of shape (4, 5)", "(KeepsItsState)",
                   "h = torch.tanh(self.fc(x))  # the state: made here", "Call .backward() on the loss only")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["side_gradients_as_zeros"] == 1, record.counters


class KeepsAScalar(nn.Module):
    """A block that keeps a scalar of its own on itself (an auxiliary loss no step reads)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.aux = None

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        self.aux = h.pow(2).mean()  # the kept scalar
        return h


def test_a_kept_scalar_beside_the_loss_is_refused_naming_both():
    """Two scalar outputs with gradients: which one is the loss cannot be told from the graph. The refusal names
    both, the module and the line that made the second, and says to store it detached."""
    model = nn.Sequential(KeepsAScalar(), nn.Linear(5, 3))
    expect_refusal(lambda: run(model, lambda m, x, y: M.ce(m(x), y).mean(), (torch.randn(4, 5),
                                                                             torch.randint(0, 3, (4,)))),
                   "2 incoming gradients", "(KeepsAScalar)", "self.aux = h.pow(2).mean()  # the kept scalar",
                   "shape ()", "stored detached too")


class BatchBranchBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        h = self.fc(x)
        if h.numel() > 0:  # a question about the batch size (Falcon-Mamba's scan asks it)
            h = torch.tanh(h)
        return h + x


class BatchBranchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks, self.head = nn.ModuleList([BatchBranchBlock(), BatchBranchBlock()]), nn.Linear(5, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_branch_of_the_model_on_the_batch_size_is_refused_saying_which_line_asks():
    """Model code that branches on a size holding the batch size (if h.numel() > 0) with a batch size unknown at
    compile time (mark_batch; sharded steps and Poisson sampling too): dynamo breaks the graph there, and for a
    block called in a loop it traces the block again as a frame of its own, whose reason only says
    "Data-dependent branching". The message quotes the line and the size question dynamo could not answer, and
    says to ask about the size the code means."""
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    dpcompile.mark_batch(x, y)
    expect_refusal(lambda: run(BatchBranchNet(), lambda m, x, y: M.ce(m(x), y).mean(), (x, y)),
                   "only part of the training step", "test_refusals.py", "if h.numel() > 0:",
                   "Could not guard on data-dependent expression", "branches on a size that holds the batch size",
                   "rather than numel()")


class HeadStatistics(nn.Module):
    """Per-head weights plus the heads' [d, d] statistics over the whole batch: a batched matmul that sums over
    the samples in the forward, not a weight gradient."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x):  # [B, 2, S, 4]
        stats = torch.einsum("bhsd,bhse->hde", x, x)
        return torch.einsum("bhsd,hde->bhse", x, self.w + stats)


def test_a_batched_matmul_summing_samples_in_the_forward_is_refused():
    expect_refusal(lambda: run(HeadStatistics(), lambda m, x: m(x).pow(2).sum(), (torch.randn(4, 2, 3, 4),)),
                   "aten.bmm.default", "HeadStatistics", "mixes samples")


class SampleScatter(nn.Module):
    """Rows scattered to other rows along the sample dim (samples reversed): each output row is another
    sample's."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x)
        rows = torch.arange(h.shape[0] - 1, -1, -1, device=h.device)[:, None].expand_as(h)
        return torch.zeros_like(h).scatter(0, rows, h)


def test_a_scatter_along_the_sample_dim_is_refused():
    """scatter (topk's backward, MoE routing) keeps samples apart along any other dim (cases.routed_experts);
    along the sample dim it moves rows between samples."""
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    expect_refusal(lambda: run(SampleScatter(), lambda m, x, y: M.ce(m(x), y).mean(), (x, y)),
                   "aten.scatter", "scatters along the sample dim", "SampleScatter")


class SortedTokens(nn.Module):
    """Tokens sorted across the batch by a router's choice (as routed experts in the grouped form do), then
    something the row-order analysis cannot follow (passes.rules.row_order): ``how`` says what."""

    def __init__(self, how: str, d: int = 8, experts: int = 3):
        super().__init__()
        self.how = how
        self.router = nn.Linear(d, experts)
        self.w = nn.Parameter(torch.randn(experts, d, d) / d)

    def forward(self, x):  # [B, T, d]
        tokens = (x @ self.w[0]).flatten(0, 1)
        key = self.router(tokens).argmax(-1)
        if self.how == "keys_unbounded":  # keys that are not a router's choice: no range to count them in
            key = (tokens.sum(-1) * 3).long()
        # a descending sort: the offsets count groups from the lowest id, so a row's group is not its own id
        ids, order = torch.sort(key, descending=self.how == "descending")
        rows = tokens[order]
        if self.how == "sample_order":  # sorted rows added to rows in sample order: each row another sample's
            return (rows + tokens).view_as(x)
        if self.how == "cumsum":  # a running sum down the sorted rows: every row reads the rows before it
            return rows.cumsum(0)[order.argsort()].view_as(x)
        offs = torch.cumsum(torch.histc(ids.float(), bins=3, min=0, max=2), 0, dtype=torch.int32)
        if self.how == "offsets_not_counted":  # offsets of fixed sizes: a row's group is not its own key
            offs = torch.tensor([2, 5, rows.shape[0]], dtype=torch.int32) + 0 * offs
        if self.how == "other_keys_counted":  # the counts of another router's choices
            other = self.router(tokens).argmin(-1)
            offs = torch.cumsum(torch.histc(other.float(), bins=3, min=0, max=2), 0, dtype=torch.int32)
        out = torch._grouped_mm(rows, self.w, offs=offs)  # (bf16: rows of 16 bytes)
        return out[order.argsort()].view_as(x)


@pytest.mark.parametrize("how,fragments", [
    ("keys_unbounded", ("aten.histc", "not proven to lie in a known range")),
    ("sample_order", ("aten.add", "combines rows sorted across the batch with rows in sample order")),
    ("cumsum", ("aten.cumsum", "mixes rows sorted across the batch")),
    ("offsets_not_counted", ("aten._grouped_mm", "offsets not counted from their sort's keys")),
    ("descending", ("aten.histc", "descending sort")),
    ("other_keys_counted", ("aten._grouped_mm", "offsets not counted from their sort's keys")),
])
def test_tokens_sorted_across_the_batch_where_rows_meet_other_rows_are_refused(how, fragments):
    """Sorted rows are followed row by row (tests/test_sorted_experts.py); where a row's value would depend on
    another sample's (its place in a running sum, its group from offsets not counted from the keys, an add to
    the row of another sample, groups counted in the other order), the step is refused naming the op."""
    x = torch.randn(4, 3, 8).bfloat16()
    expect_refusal(lambda: run(SortedTokens(how).bfloat16(), lambda m, x: m(x).float().pow(2).sum((1, 2)).mean(),
                               (x,)), *fragments, "SortedTokens")


class SampleFlip(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x).flip(0)  # sample b gets sample B - 1 - b's output


def test_a_flip_of_the_sample_dim_is_refused():
    """flip along any other dim is per sample (cases.sequence_ops)."""
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    expect_refusal(lambda: run(SampleFlip(), lambda m, x, y: M.ce(m(x), y).mean(), (x, y)),
                   "reverses the sample dim", "SampleFlip")


def test_a_step_traced_without_its_model_is_refused():
    """The same for any model dynamo does not trace (here one it was told to skip)."""
    model = M.MLP()
    model.forward = torch._dynamo.disable(model.forward)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    expect_refusal(lambda: run(model, lambda m, x, y: M.ce(m(x), y).mean(), (x, y)),
                   "no trainable parameter", "require grad", "remove the graph break")
    assert all(p.grad is None for p in model.parameters())


def _both_forms(form, fn, **options):
    """fn as a DP step: torch.compile(fn, backend="dp_fsdp", options=...) or @dpcompile.private_step(...)."""
    if form == "private_step":
        return dpcompile.private_step(fn, **options)
    return torch.compile(fn, backend="dp_fsdp", options=options)


@pytest.mark.parametrize("form", ["compile", "private_step"])
def test_both_forms_trace_recurrent_layers(form):
    """Dynamo runs nn.LSTM, nn.GRU and nn.RNN eagerly unless torch._dynamo.config.allow_rnn is set; the plain
    form used to leave them out of its graph and be refused as split. Both forms now have dynamo trace them
    (dpcompile/step_frames.py), with the setting off for the process, and the gradients are exact. (The case's
    second LSTM reads the batch itself: cells, not mkldnn's opaque op, dpcompile/recurrent.py.)"""
    import cases
    from reference import dp_reference

    c = cases.CASES["recurrent"]
    torch.manual_seed(0)
    inputs, targets = c.data(4)
    model = c.model()
    _, norms = dp_reference(model, c.loss, inputs, targets, max_grad_norm=1.0, expected_batch_size=4)
    C = float(norms.sort().values[1:3].mean())  # two samples above, two below
    ref, _ = dp_reference(model, c.loss, inputs, targets, max_grad_norm=C, expected_batch_size=4)

    def step(x, y):
        c.loss(model(x), y).mean().backward()

    step = _both_forms(form, step, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=4, compiler="eager")
    with torch._dynamo.config.patch(allow_rnn=False):
        torch._dynamo.reset()
        step(*inputs, *targets)
        assert not torch._dynamo.config.allow_rnn  # set only while dynamo compiles the step's frames
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


class Printing(nn.Module):
    """Blocks in a loop that prints: dynamo cannot split a frame at a graph break inside a loop."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 6), nn.Linear(6, 3)])


@pytest.mark.parametrize("form", ["compile", "private_step"])
def test_a_step_that_dynamo_gives_up_on_is_refused_not_run_as_plain_python(form, capsys):
    """A graph break dynamo cannot resume after (here a print inside the step's loop over layers) makes it give
    up on the whole frame and run it as plain Python at this and every later call, calling no backend: the plain
    form trained without DP then, silently (private_step noticed after the call, with the gradients written). The
    frame is refused where dynamo compiles it, naming the break, and no gradient is written, at every call."""
    model = Printing()

    def step(x, y):
        h = x
        for block in model.blocks:
            h = block(h)
            print("block done")
        M.ce(h, y).mean().backward()

    step = _both_forms(form, step, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=4, compiler="eager")
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    for _ in range(2):
        expect_refusal(lambda: step(x, y), "dynamo gave up on step", "plain Python", "neither clipped nor noised",
                       'print("block done")', "inside a loop")
        assert all(p.grad is None for p in model.parameters())
    assert "block done" not in capsys.readouterr().out  # refused before the frame ran
    with torch.no_grad():  # an evaluation through the same backend writes no gradient: dynamo's to run
        with pytest.raises(RuntimeError, match="does not require grad"):
            step(x, y)
    assert "block done" in capsys.readouterr().out


def test_a_model_given_to_torch_compile_is_refused_saying_to_compile_the_step():
    """torch.compile(model, backend="dp_fsdp") compiles the forward alone, with the loss and backward outside:
    refused before any gradient, saying that a DP step is the function that ends in loss.backward()."""
    model = M.MLP()
    compiled = torch.compile(model, backend="dp_fsdp", options=dict(max_grad_norm=1.0, noise_multiplier=0.0,
                                                                    expected_batch_size=4, compiler="eager"))
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    expect_refusal(lambda: M.ce(compiled(x), y).mean().backward(), "torch.compile was given the model (MLP)",
                   "compile the step: def step(x, y)")
    assert all(p.grad is None for p in model.parameters())


def test_a_backward_per_micro_batch_in_a_loop_is_refused_pointing_to_accumulate():
    """Gradient accumulation written inside the step (a backward per micro-batch in a loop): dynamo gives up on
    the frame at the first backward, and every micro-batch would train without DP. Refused, saying to call the
    step once per micro-batch under dpcompile.accumulate()."""
    model = M.MLP()

    def step(x, y):
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            M.ce(model(xs), ys).mean().backward()

    step = torch.compile(step, backend="dp_fsdp", options=dict(max_grad_norm=0.1, noise_multiplier=0.0,
                                                               expected_batch_size=4, compiler="eager"))
    expect_refusal(lambda: step(torch.randn(4, 5), torch.randint(0, 3, (4,))), "dynamo gave up on step",
                   ".backward()", "once per micro-batch", "dpcompile.accumulate()")
    assert all(p.grad is None for p in model.parameters())


def test_a_loop_that_breaks_the_graph_after_the_backward_runs_as_plain_python():
    """The same loop after loss.backward() (logging, an optimizer step) runs once the DP backward has written the
    gradients: dynamo runs that rest of the step as plain Python, as for any other step, and the gradients are
    the DP step's."""
    torch.manual_seed(0)
    model = M.MLP()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    options = dict(max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=4, compiler="eager")
    plain = torch.compile(lambda x, y: M.ce(model(x), y).mean().backward(), backend="dp_fsdp", options=options)
    plain(x, y)
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    seen = []

    def step(x, y):
        loss = M.ce(model(x), y).mean()
        loss.backward()
        for p in model.parameters():
            seen.append(p.grad.norm().item())
        return loss.detach()

    torch.compile(step, backend="dp_fsdp", options=options)(x, y)
    assert len(seen) == len(expected)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)


_LOG = logging.getLogger("dpcompile.tests.model")  # a module's logger, as transformers' modeling files have


class WarnsInForward(nn.Module):
    """Model code that logs in its forward (transformers' logger.warning_once on an input it pads, or on a
    deprecated argument): a graph break for dynamo."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        if x.shape[-1] % 2:
            _LOG.warning("padding the input to an even width")
        return self.fc(x)


@pytest.mark.parametrize("form", ["compile", "private_step"])
def test_a_logging_call_in_the_model_is_skipped_by_both_forms(form):
    """Dynamo breaks the graph at a logging call, which would split the step; in DP steps of both forms it
    skips the call instead (torch._dynamo.config.ignore_logger_methods while it compiles them, restored after),
    and the gradients are exact. A logging method outside that set (error) still splits the step: refused,
    saying what to do."""
    from reference import dp_reference

    model = WarnsInForward()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    ref, _ = dp_reference(model, M.ce, (x,), (y,), max_grad_norm=0.05, expected_batch_size=4)
    before = set(torch._dynamo.config.ignore_logger_methods)

    def step(x, y):
        M.ce(model(x), y).mean().backward()

    step = _both_forms(form, step, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=4,
                       compiler="eager")
    torch._dynamo.reset()
    step(x, y)
    assert set(torch._dynamo.config.ignore_logger_methods) == before
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(ignore_logger_methods=set()), pytest.MonkeyPatch.context() as mp:
        mp.setattr(_LOG, "warning", _LOG.error)  # the model's warning is an error call now
        expect_refusal(lambda: step(x, y), "logging call", "ignore_logger_methods", "logging.Logger.error")
    assert all(p.grad is None for p in model.parameters())
    torch._dynamo.reset()


@pytest.mark.parametrize("form", ["call_method", "prim_function"])
def test_a_write_into_a_gathered_parameter_is_found_in_either_form_of_dynamos_graph(form):
    """A sharded parameter's read is ``redistribute`` then ``to_local`` in dynamo's graph: methods on torch 2.13,
    calls of functions dynamo names ``prim_redistribute`` and ``prim_to_local`` on torch 2.11. An in-place op
    on the read (through ``.data`` or a view) is found in both and refused, naming the parameter; one on a value
    computed from it is not (the parameter is not written)."""
    from dpcompile.gathered_writes import refuse_writes_to_gathered_params

    def prim(name):
        def fn(x):
            return x
        fn.__name__ = name
        return fn

    def read(g, p):
        if form == "call_method":
            return g.call_method("to_local", (g.call_method("redistribute", (p,)),))
        return g.call_function(prim("prim_to_local"), (g.call_function(prim("prim_redistribute"), (p,)),))

    for written, refused in [("alias", True), ("product", False)]:
        g = torch.fx.Graph()
        p = g.placeholder("L_model_w_")
        w = read(g, p)
        if written == "alias":
            target = g.call_method("t", (g.call_function(torch._C._autograd._get_data_attr, (w,)),))
        else:
            target = g.call_function(operator.mul, (w, 2.0))
        g.call_method("clamp_", (target, -0.3, 0.3))
        g.output(None)
        gm = torch.fx.GraphModule({}, g)
        if refused:
            expect_refusal(lambda: refuse_writes_to_gathered_params(gm, {p: "w"}),
                           "changes the sharded parameter 'w' in place (clamp_")
        else:
            refuse_writes_to_gathered_params(gm, {p: "w"})
