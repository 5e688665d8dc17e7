"""What Inductor generates for a DP step: buffers the non-private step does not allocate are a memory bug
(ghost's target is the non-private peak plus [B]-sized vectors; BENCHMARKS.md, ghost's peak)."""
import re

import models as M
import torch
from helpers import compile_step
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

V, B, T = 512, 4, 16


def _logits_sized_buffers(code: str) -> list[str]:
    """The [B*T, V] buffers a generated module allocates (C++ backend), as 'bufN dtype'."""
    pattern = rf"(buf\d+) = empty_strided_cpu\(\({B * T}, {V}\), \([^)]*\), torch\.(\w+)\)"
    return [" ".join(m) for m in re.findall(pattern, code)]


def test_ghost_second_backward_stores_no_logits_sized_loss_gradient(monkeypatch):
    """The second backward's scaled loss tangent is stored ([B*T] values), so the softmax backward over the
    vocabulary inlines into the gradient's consumers as in the non-private backward. Inlined, r, the
    dropped-sample mask and the tangent pushed that node past Inductor's read limit and it was stored: a
    logits-sized fp32 buffer (+1.5 GiB on GPT-2-small bf16 8x1024 on an H100). The limits are set to
    CUDA's (the C++ backend's differ); the logits recompute is made to apply at this size."""
    from dpcompile.passes import second_backward_recompute as SBR

    monkeypatch.setattr(SBR, "RECOMPUTE_MIN_BYTES", 1)
    monkeypatch.setattr(SBR, "RECOMPUTE_MIN_RATIO", 2)
    torch._dynamo.reset()
    torch.manual_seed(0)
    ids, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    backward_buffers = {}
    with inductor_config.patch(realize_opcount_threshold=30, realize_acc_reads_threshold=8, fx_graph_cache=False):
        model = M.GPT(vocab=V, d=16, n_head=2, n_layer=1, max_t=T)

        def nonprivate(ids, y):
            loss = M.seq_ce(model(ids), y).mean()
            loss.backward()
            return loss.detach()

        _, (_, backward) = run_and_get_code(torch.compile(nonprivate, backend="inductor"), ids, y)
        backward_buffers["nonprivate"] = _logits_sized_buffers(backward)
        model.zero_grad(set_to_none=True)
        step, backend = compile_step(model, M.seq_ce, max_grad_norm=1.0, noise_multiplier=0.0,
                                     expected_batch_size=B, schedule="ghost")
        _, (_, backward) = run_and_get_code(step, (ids,), (y,))
        backward_buffers["ghost"] = _logits_sized_buffers(backward)
    assert len(backward_buffers["ghost"]) <= len(backward_buffers["nonprivate"]), backward_buffers
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters["second_backward_recomputed_contractions"] == 1, rec.counters
    assert rec.counters["ghost_scaled_tangents_stored"] == 1, rec.counters
