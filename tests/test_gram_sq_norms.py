"""The ghost norm kernel (dpcompile.gram_sq_norms): the Triton kernel under TRITON_INTERPRET=1, the aten path, and
the rewrite that calls it for every ghost-form norm with static rows per sample (Linear over sequences, a
convolution's unfolded windows), counted, said in the summary, exact against the oracle in both schedules."""
import pytest
import torch

import dpcompile
import gram_kernel_check
import models as M
from dpcompile import gram_sq_norms
from helpers import check_against_reference, run_interpreted


def test_triton_kernel_matches_per_sample_gradient_norms_interpreted():
    report = run_interpreted("gram_kernel_check.py")  # bf16: the GPU test
    # whole and split pieces of features, and in one call of the table kernel (a pair more in fp16)
    n = len(gram_kernel_check.CASES)
    assert len(report) == 2 * 2 * n + (n + 3 + 1) + (n + 4 + 1), report
    assert report["columns:float32"] == 0 and report["columns:float16"] == 0, report
    assert max(report.values()) < 1e-5, report


def test_aten_path_matches_per_sample_gradient_norms():
    worst = gram_kernel_check.errors(gram_sq_norms._aten, "cpu", [torch.float64, torch.float32])
    assert max(worst.values()) < 1e-6, worst  # fp32 output: fp64 operands to its rounding


def test_aten_path_in_blocks_of_samples(monkeypatch):
    monkeypatch.setattr(gram_sq_norms, "CPU_BLOCK_BYTES", 1)  # one sample at a time
    worst = gram_kernel_check.errors(gram_sq_norms._aten, "cpu", [torch.float64])
    assert max(worst.values()) < 1e-6, worst


@pytest.mark.parametrize("p,m,pieces", [(5, 6, 1), (8192, 3072, 1), (16384, 16, 1), (16385, 16, 2), (50257, 768, 4),
                                          (768, 50257, 4), (2048, 128256, 8)])
def test_tiles_and_parts(p, m, pieces):
    # the fake kernel's parts are the launch's: a tile pair each, the ones below the diagonal zero, times the
    # pieces of the wider operand's features (an LM head's vocabulary, either side)
    assert gram_sq_norms.parts(197, p, m) == 4 * pieces and gram_sq_norms.parts(100, p, m) == 4 * pieces
    assert gram_sq_norms.parts(7, p, m) == pieces
    a, g = torch.randn(2, 130, p), torch.randn(2, 130, m)
    if pieces == 1:
        fake = torch.library.opcheck(torch.ops.dpcompile.gram_sq_norms.default, (a, g))
        assert all(v == "SUCCESS" for v in fake.values()), fake
    out = torch.ops.dpcompile.gram_sq_norms(a, g)
    assert out.shape == (2, gram_sq_norms.parts(130, p, m))
    with torch._subclasses.FakeTensorMode():
        fake_out = torch.ops.dpcompile.gram_sq_norms(torch.empty(2, 130, p), torch.empty(2, 130, m))
    assert fake_out.shape == out.shape


@pytest.mark.parametrize("smem,bf16_stages,fp32_stages", [(None, 4, 3), (232448, 4, 3), (166912, 4, 2),
                                                          (101376, 2, 1)])
def test_pipeline_stages_fit_the_devices_shared_memory(monkeypatch, smem, bf16_stages, fp32_stages):
    # H100/H200 (227 KiB a program), A100 (163), a consumer GPU (99): a stage holds a 128x64 tile of each
    # operand, so bf16 128-row tiles need 32 KiB a stage and fp32 64; without a device to ask, the caps
    assert gram_sq_norms._shared_memory(torch.device("cpu")) is None
    monkeypatch.setattr(gram_sq_norms, "_shared_memory", lambda device: smem)
    cuda = torch.device("cuda", 0)
    assert gram_sq_norms.launch_config(128, torch.bfloat16, cuda)["num_stages"] == bf16_stages
    assert gram_sq_norms.launch_config(128, torch.float32, cuda)["num_stages"] == fp32_stages
    assert gram_sq_norms.launch_config(64, torch.float32, cuda)["num_stages"] == min(3, 2 * fp32_stages)


class SeqAndPatches(torch.nn.Module):
    """A patch embedding (strided conv, ghost form over its unfolded patches), Linear layers over the tokens
    (ghost form: tokens^2 (p + m) < tokens p m), one of them grouped conv over tokens (ghost per group)."""

    def __init__(self):
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 24, 4, stride=4)
        self.mix = torch.nn.Conv1d(24, 24, 3, padding=1, groups=2)
        self.fc1 = torch.nn.Linear(24, 96)
        self.fc2 = torch.nn.Linear(96, 24)
        self.head = torch.nn.Linear(24, 3)

    def forward(self, x):
        t = self.patch(x).flatten(2)  # [B, 24, 9]
        t = (t + torch.tanh(self.mix(t))).transpose(1, 2)  # [B, 9 tokens, 24]
        t = t + self.fc2(torch.tanh(self.fc1(t)))
        return self.head(t.mean(1))


# both schedules, both batch kinds; Inductor's code for one, the same graphs op by op for the other (CI time)
@pytest.mark.parametrize("schedule,batch,compiler", [("bk", "static", "inductor"), ("ghost", "marked", "eager")])
def test_ghost_norms_take_the_kernel_and_match_the_oracle(schedule, batch, compiler):
    torch.manual_seed(0)
    x, y = torch.randn(5, 3, 12, 12), torch.randn(5, 3)
    if batch == "marked":  # an unbacked batch size: the fake kernel's [u0, parts]
        dpcompile.mark_batch(x, y)
    backend = check_against_reference(SeqAndPatches(), M.mse, (x,), (y,), schedule=schedule, linear_norm="ghost",
                                      conv_norm="ghost", compiler=compiler)
    (rec,) = [r for r in backend.compiled if r.dp]
    # fc1, fc2 (head: one row per sample, rank one); patch; mix: one Gram pair per group, in one call
    assert rec.counters["norm_mm_ghost"] == 2 and rec.counters["gram_norm_kernels"] == 4, rec.counters
    params = rec.summary["params"]
    for name in ("fc1.weight", "fc2.weight", "patch.weight", "mix.weight"):
        assert params[name]["norm"] == "ghost" and "dpcompile::gram_sq_norms" in params[name]["why"], params[name]
    assert "gram_sq_norms" not in params["head.weight"]["why"]


def test_kernel_off_keeps_the_graph_form(monkeypatch):
    from dpcompile.passes import per_sample_norms

    monkeypatch.setattr(per_sample_norms, "GRAM_KERNEL", False)
    torch.manual_seed(0)
    backend = check_against_reference(SeqAndPatches(), M.mse, (torch.randn(4, 3, 12, 12),), (torch.randn(4, 3),),
                                      schedule="bk", linear_norm="ghost", conv_norm="ghost", compiler="eager")
    (rec,) = [r for r in backend.compiled if r.dp]
    assert rec.counters.get("gram_norm_kernels", 0) == 0 and rec.counters["norm_mm_ghost"] == 2, rec.counters


# (S, p, m, the faster form on one H200 in bf16 and fp32: BENCHMARKS.md "forty-fifth", gram_norm_kernel.py --direct)
MEASURED_FASTER = [
    (1024, 768, 2304, "ghost"), (1024, 768, 768, "ghost"), (1024, 768, 3072, "ghost"), (1024, 3072, 768, "ghost"),
    (1024, 768, 50257, "ghost"),  # GPT-2 at 8x1024: 0.82 ms in the kernel against 5.08 direct (its head)
    (4096, 768, 2304, "direct"), (4096, 768, 3072, "direct"), (4096, 3072, 768, "direct"),
    (4096, 768, 50257, "direct"),  # GPT-2 at 2x4096
    (2048, 2048, 3072, "ghost"), (2048, 2048, 2048, "ghost"), (2048, 2048, 8192, "ghost"),
    (2048, 8192, 2048, "ghost"), (2048, 2048, 128256, "ghost"),  # Llama-3.2-1B at 2x2048
]


@pytest.mark.parametrize("S,p,m,faster", MEASURED_FASTER)
def test_cost_model_takes_the_form_measured_faster(S, p, m, faster):
    """linear_norm="auto" (per_sample_norms.mm_costs): the direct form's fp32 [p, m] gradient per sample counts,
    and the kernel's tile pairs on and above the diagonal only. Flops alone took the direct form at 8x1024."""
    from dpcompile.passes.per_sample_norms import mm_costs

    ghost, direct = mm_costs(S, p, m)
    assert ("ghost" if ghost <= direct else "direct") == faster, (ghost, direct)


def test_kernel_work_counts_the_tile_pairs_it_computes():
    # 1024 rows: 8 tiles of 128, 36 pairs on and above the diagonal; 50257 logits in 4 pieces, each of which
    # recomputes the 768-wide operand's Gram
    assert gram_sq_norms.work(1024, 768, 50257) == 128 * 128 * 36 * (768 * 4 + 50257)
    assert gram_sq_norms.work(200, 64, 64) == 128 * 128 * 3 * 128  # the last tile padded to 128 rows
    assert gram_sq_norms.work(8, 16, 16) == 16 * 16 * 32  # fewer rows than a tile of 16: one tile pair
