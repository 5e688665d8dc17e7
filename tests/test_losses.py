"""torch's losses as users write them, with their default reductions, against the per-sample oracle.

Each whole-batch loss is a mean (or a sum) of per-sample losses: the oracle runs the same loss with
reduction="none", each sample's elements averaged (a mean over all of [B, C] is the mean over samples of
per-sample means). The whole-batch means of cross-entropy and its kin, which divide by counts, are
tests/cases.BATCH_MEANS (one process and sharded)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpcompile
import models as M
from dpcompile.compat import scatter_reads_in_order
from reference import dp_reference

B, D, C = 6, 5, 4


def _targets(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    classes = torch.randint(0, C, (B,), generator=g)
    labels = torch.full((B, C), -1)  # multilabel_margin_loss: labels, then -1
    labels[:, 0] = classes
    labels[::2, 1] = (classes[::2] + 1) % C
    return {
        "real": torch.randn(B, C, generator=g),
        "binary": torch.randint(0, 2, (B, C), generator=g).double(),
        "signs": (torch.randint(0, 2, (B, C), generator=g) * 2 - 1).double(),
        "sign": (torch.randint(0, 2, (B,), generator=g) * 2 - 1).double(),
        "classes": classes,
        "labels": labels,
        "counts": torch.poisson(torch.rand(B, C, generator=g) * 3).double(),
        "variances": torch.rand(B, C, generator=g).double() + 0.5,
    }


def _each(loss):
    """The per-sample form of a loss whose reduction="none" output has more dims than the batch: their mean."""
    def per_sample(*args):
        out = loss(*args)
        return out.flatten(1).mean(1) if out.dim() > 1 else out
    return per_sample


_POS_WEIGHT = torch.tensor([1.0, 2.0, 3.0, 0.5])

# name -> (targets, the loss as users write it, the same loss with reduction="none")
LOSSES = {
    "l1": ("real", F.l1_loss, _each(lambda o, y: F.l1_loss(o, y, reduction="none"))),
    "huber": ("real", lambda o, y: F.huber_loss(o, y, delta=0.5),
              _each(lambda o, y: F.huber_loss(o, y, delta=0.5, reduction="none"))),
    "smooth_l1": ("real", lambda o, y: F.smooth_l1_loss(o, y, beta=0.3),
                  _each(lambda o, y: F.smooth_l1_loss(o, y, beta=0.3, reduction="none"))),
    "bce_with_logits": ("binary", lambda o, y: F.binary_cross_entropy_with_logits(o, y, pos_weight=_POS_WEIGHT),
                        _each(lambda o, y: F.binary_cross_entropy_with_logits(
                            o, y, pos_weight=_POS_WEIGHT.to(o.dtype), reduction="none"))),
    "bce_module": ("binary", lambda o, y: nn.BCELoss()(o.sigmoid(), y),
                   _each(lambda o, y: nn.BCELoss(reduction="none")(o.sigmoid(), y))),
    "soft_margin": ("signs", F.soft_margin_loss, _each(lambda o, y: F.soft_margin_loss(o, y, reduction="none"))),
    "multilabel_soft_margin": ("binary", F.multilabel_soft_margin_loss,
                               lambda o, y: F.multilabel_soft_margin_loss(o, y, reduction="none")),
    "multi_margin": ("classes", lambda o, y: F.multi_margin_loss(o, y, p=2, margin=0.5),
                     lambda o, y: F.multi_margin_loss(o, y, p=2, margin=0.5, reduction="none")),
    "multilabel_margin": ("labels", F.multilabel_margin_loss,
                          lambda o, y: F.multilabel_margin_loss(o, y, reduction="none")),
    "hinge_embedding": ("signs", lambda o, y: F.hinge_embedding_loss(o, y, margin=0.7),
                        _each(lambda o, y: F.hinge_embedding_loss(o, y, margin=0.7, reduction="none"))),
    "poisson_nll": ("counts", F.poisson_nll_loss, _each(lambda o, y: F.poisson_nll_loss(o, y, reduction="none"))),
    "cosine_embedding": ("sign", lambda o, y: F.cosine_embedding_loss(o[:, :2], o[:, 2:], y, margin=-0.5),
                         lambda o, y: F.cosine_embedding_loss(o[:, :2], o[:, 2:], y, margin=-0.5, reduction="none")),
    "triplet_margin": ("real", lambda o, y: F.triplet_margin_loss(o, y, y.flip(1), margin=2.0),
                       lambda o, y: F.triplet_margin_loss(o, y, y.flip(1), margin=2.0, reduction="none")),
    "margin_ranking": ("sign", lambda o, y: F.margin_ranking_loss(o[:, 0], o[:, 1], y, margin=0.5),
                       lambda o, y: F.margin_ranking_loss(o[:, 0], o[:, 1], y, margin=0.5, reduction="none")),
    "kl_div_log_target": ("real", lambda o, y: F.kl_div(F.log_softmax(o, -1), F.log_softmax(y, -1),
                                                        reduction="batchmean", log_target=True),
                          lambda o, y: F.kl_div(F.log_softmax(o, -1), F.log_softmax(y, -1), reduction="none",
                                                log_target=True).sum(-1)),
    "gaussian_nll_homoscedastic": ("variances", lambda o, v: nn.GaussianNLLLoss(full=True)(o, o.detach() * 0.5,
                                                                                         v[:, 0]),
                                   _each(lambda o, v: nn.GaussianNLLLoss(full=True, reduction="none")(
                                       o, o.detach() * 0.5, v[:, 0]))),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_torch_losses_with_default_reductions_match_reference(name):
    """The step runs the loss as written; the oracle the per-sample losses, clipped (some samples above C, some
    below) and averaged. bk and ghost alternate over the losses, op by op, and two run through Inductor."""
    kind, loss, per_sample = LOSSES[name]
    torch.manual_seed(0)
    model = M.MLP(d_out=C).double()
    x = torch.randn(B, D, dtype=torch.float64) * 2
    y = _targets()[kind]
    with torch.no_grad():  # the oracle's per-sample losses average to the loss the step runs
        torch.testing.assert_close(per_sample(model(x), y).mean(), loss(model(x), y))
    _, norms = dp_reference(model, per_sample, (x,), (y,), max_grad_norm=1.0, expected_batch_size=B)
    C_ = float(norms[norms > 0].median())
    assert (norms > C_).any() and ((norms < C_) & (norms > 0)).any(), norms
    ref, _ = dp_reference(model, per_sample, (x,), (y,), max_grad_norm=C_, expected_batch_size=B)
    i = sorted(LOSSES).index(name)
    backend = dpcompile.DPBackend(max_grad_norm=C_, noise_multiplier=0.0, expected_batch_size=B,
                                  schedule="bk" if i % 2 else "ghost",
                                  compiler="inductor" if name in ("huber", "multilabel_margin") else "eager")

    def step(x, y):
        out = loss(model(x), y)
        out.backward()
        return out.detach()

    torch.compile(step, backend=backend)(x, y)
    for n, p in model.named_parameters():
        # the norms and clip coefficients are fp32 (per_sample_norms), whatever the parameters' dtype
        tol = 1e-7 + 1e-6 * float(ref[n].abs().max())
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=tol, msg=lambda m: f"{n}: {m}")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.summary["loss"]["reduction"] == "mean", record.summary
    if name == "multilabel_margin" and not scatter_reads_in_order():
        # torch 2.11's C++ backend read the gather backward's scatter_add before it ran (fp64: its fallback)
        assert record.counters["scatter_reads_realized"] >= 1, record.counters
