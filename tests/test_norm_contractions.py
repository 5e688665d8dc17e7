"""The per-sample norm contractions: fp32 results, accumulated in fp32, on tensor cores where the factors allow."""
import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from dpcompile.fx_utils import GraphBuilder
from dpcompile.passes.sample_factors import bmm_f32

aten = torch.ops.aten
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


def _contract(dx, dy, device):
    with FakeTensorMode():
        vals = torch.empty(4, 8, 16, dtype=dx, device=device), torch.empty(4, 16, 3, dtype=dy, device=device)
    graph = fx.Graph()
    nodes = []
    for i, v in enumerate(vals):
        n = graph.placeholder(f"x{i}")
        n.meta["val"] = v
        nodes.append(n)
    out = bmm_f32(GraphBuilder(graph), *nodes)
    graph.output(out)
    return out, graph


@pytest.mark.parametrize("dx,dy,device,low_precision", [
    (bf16, bf16, "cuda", True), (fp16, fp16, "cuda", True),  # products exact in fp32: tensor cores
    (fp32, fp32, "cuda", False),  # fp32 factors stay fp32 (TF32 would round them)
    (bf16, fp32, "cuda", False),  # mixed: upcast
    (bf16, bf16, "cpu", False),  # aten.bmm.dtype is CUDA-only
])
def test_contraction_is_fp32_and_low_precision_only_where_exact(dx, dy, device, low_precision):
    out, graph = _contract(dx, dy, device)
    assert out.meta["val"].dtype == fp32 and tuple(out.meta["val"].shape) == (4, 8, 3)
    if low_precision:
        assert out.target is aten.bmm.dtype and out.args[2] == fp32
        assert not graph.find_nodes(op="call_function", target=torch.ops.prims.convert_element_type.default)
    else:
        assert out.target is aten.bmm.default
        assert all(a.meta["val"].dtype == fp32 for a in out.args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [bf16, fp16])
def test_cuda_low_precision_contraction_accumulates_in_fp32(dtype):
    """Through Inductor, as the DP graph runs it: over 4096 terms a bf16 accumulation would be off by ~1e-2."""
    torch.manual_seed(0)
    a = torch.randn(4, 64, 4096, device="cuda").to(dtype)
    g = torch.randn(4, 4096, 96, device="cuda").to(dtype)
    got = torch.compile(lambda x, y: (aten.bmm.dtype(x, y, fp32) ** 2).sum((1, 2)))(a, g)
    want = (torch.bmm(a.double(), g.double()) ** 2).sum((1, 2))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("case", ["gpt", "llama"])
def test_bf16_model_norms_read_bf16_factors(case):
    """A bf16 model on CPU: every per-sample norm contraction (the Gram kernel's reference here) reads the bf16
    factors as they are, as on CUDA (test_gpu's bf16-model test, which CI cannot run); the gradients against
    the fp64 oracle on the same bf16-rounded weights, with bf16 tolerances."""
    from cases import CASES
    from helpers import assert_bf16_close, assert_norms_read_bf16, clipped_on

    c = CASES[case]
    torch.manual_seed(0)
    model = c.model().to(bf16)
    inputs, targets = c.data(4)
    ref, dp, backend = clipped_on("cpu", model, c.loss, inputs, targets, schedule="bk", compiler="eager")
    (record,) = [r for r in backend.compiled if r.dp]
    assert_norms_read_bf16(record)
    assert_bf16_close(dp, ref)
