"""Golden graphs: where the weight-gradient contractions and the norms sit, per schedule."""
import os
import re
import subprocess
import sys
import textwrap
import unittest.mock

import pytest
import torch
from expecttest import TestCase

import dpcompile
import models as M
from helpers import check_against_reference, compile_step

KEEP = {"mm", "bmm", "sqrt", "clamp_max", "add_randn"}


def op_short(target: str) -> str:
    """aten.mm.default -> mm."""
    return target.split(".")[1] if target.count(".") >= 2 else target


def op_trace(ops) -> str:
    """The backward's contractions and norm milestones, in order, with shapes."""
    lines = []
    for target, shape in ops:
        name = op_short(target)
        if name in KEEP:
            lines.append(f"{name} {list(shape)}")
    return "\n".join(lines)


class TwoHeads(torch.nn.Module):
    """Two heads read one hidden layer, and their sum gives both one output gradient."""

    def __init__(self):
        super().__init__()
        self.fc, self.a, self.b = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Linear(7, 3)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return self.a(h) + self.b(h)


def mlp_backward(schedule, **extra):
    torch._dynamo.reset()
    model = M.MLP()
    step, backend = compile_step(model, M.ce, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4,
                                 schedule=schedule, **extra)
    step((torch.randn(4, 5),), (torch.randint(0, 3, (4,)),))
    return backend.compiled[0]


class TestGoldenGraphs(TestCase):
    def test_bk_one_weight_mm_per_linear_after_the_norms(self):
        rec = mlp_backward("bk")
        self.assertExpectedInline(op_trace(rec.ops["backward"]), """\
mm [4, 7]
sqrt [4]
clamp_max [4]
mm [3, 7]
mm [7, 5]""")
        # the two weights' contractions rebuilt; the biases' clipped sums from their per-sample rows
        self.assertEqual(rec.counters["bk_deferred_contractions"], 2)
        self.assertEqual(rec.counters["bk_sums_from_rows"], 2)

    def test_ghost_first_backward_has_no_weight_mm(self):
        rec = mlp_backward("ghost")
        self.assertExpectedInline(op_trace(rec.ops["backward"]), """\
mm [4, 7]
sqrt [4]
clamp_max [4]
mm [4, 7]
mm [3, 7]
mm [7, 5]""")
        # the two weights from the second backward; the biases' clipped sums from their per-sample rows
        self.assertEqual(rec.counters["ghost_recomputed_params"], 2)
        self.assertEqual(rec.counters["bk_sums_from_rows"], 2)

    def test_squared_norms_are_summed_in_one_reduction(self):
        # not a chain of [B] adds: Inductor inlines such a chain into one node that reads every norm, and
        # on CUDA fused it with an early norm reduction, which ran every norm contraction after the whole
        # input-gradient chain (ghost's peak memory, BENCHMARKS.md)
        for schedule in ("bk", "ghost"):
            rec = mlp_backward(schedule, compiler="eager")  # rec.ops: dpcompile's graph, the same op by op
            ops = [(op_short(op), list(shape)) for op, shape in rec.ops["backward"]]
            before_sqrt = ops[:[name for name, _ in ops].index("sqrt")]
            # the two biases' per-sample gradients ([4, 7] and [4, 3]) are rows of one buffer whose squares
            # are one reduction; that and the two weights' norms are stacked and summed in one more
            self.assertEqual([o for o in before_sqrt if o[0] == "cat"], [("cat", [4, 10]), ("cat", [3, 4])],
                             schedule)
            tail = [o for o in before_sqrt if o[0] in ("cat", "mul", "sum")][-5:]
            self.assertEqual(tail, [("cat", [4, 10]), ("mul", [4, 10]), ("sum", [4]), ("cat", [3, 4]), ("sum", [4])],
                             schedule)
            self.assertNotIn(("add", [4]), before_sqrt, schedule)

    def test_clip_coefficients_and_keep_mask_are_stored_once(self):
        # not inlined into every kernel that scales or masks by them (the DP backward's compile time)
        for schedule in ("bk", "ghost"):
            rec = mlp_backward(schedule, compiler="eager")  # rec.ops: dpcompile's graph, the same op by op
            stored = [(op_short(op), list(shape)) for op, shape in rec.ops["backward"]
                      if op == "prims.inductor_force_stride_order.default"]
            self.assertGreaterEqual(stored.count(("inductor_force_stride_order", [4])), 2, schedule)

    def test_bk_scales_or_masks_each_operand_once_for_all_its_readers(self):
        # 3 weight contractions read 4 scaled or masked operands, each made once for all its readers: the
        # input (5 wide, scaled for fc's weight: narrower than fc's output gradient), fc's output gradient (7
        # wide: masked for fc's weight, in place), the hidden layer (masked: a saved activation, so a copy),
        # the heads' shared output gradient (3 wide, scaled for both heads' weights). One per reader would be
        # 6. The 3 biases' clipped sums read none: they come from the norm pass's per-sample rows
        torch._dynamo.reset()
        x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
        x[2] = float("nan")  # dropped: its rows must be zero in every copy
        # op by op: the counters are dpcompile's (Inductor's code for masked rows in place: test_zero_rows)
        backend = check_against_reference(TwoHeads(), M.ce, (x,), (y,), schedule="bk", compiler="eager")
        self.assertEqual(backend.compiled[0].counters["bk_deferred_contractions"], 3)
        self.assertEqual(backend.compiled[0].counters["bk_sums_from_rows"], 3)
        self.assertEqual(backend.compiled[0].counters["bk_operand_copies"], 4)
        self.assertEqual(backend.compiled[0].counters["row_masks_in_place"], 1)
        self.assertEqual(backend.compiled[0].counters["row_masks_copied"], 1)

    def test_noise_is_drawn_and_added_in_the_backward_in_one_op(self):
        torch._dynamo.reset()
        model = M.MLP()
        step, backend = compile_step(model, M.ce, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
        # pytest's log capture hangs handlers on torch's trace log, which then asks for every artifact
        with unittest.mock.patch.object(torch._logging._internal.trace_log, "handlers", []):
            step((torch.randn(4, 5),), (torch.randint(0, 3, (4,)),))
        rec = backend.compiled[0]
        self.assertExpectedInline(op_trace(rec.ops["backward"]).split("clamp_max [4]\n")[1], """\
mm [3, 7]
mm [7, 5]
add_randn []""")
        self.assertNotIn("add_randn", rec.graphs["forward"])
        self.assertEqual(rec.counters["noise_added"], 4)
        # one draw for the four parameters' 66 coordinates, drawn and added by one op: one kernel on GPUs
        self.assertEqual(rec.counters["noise_draws"], 1)
        self.assertNotIn("aten._foreach_add.List", [op for op, _ in rec.ops["backward"]])
        self.assertNotIn("aten.add.Tensor", [op for op, _ in rec.ops["backward"]][-8:])
        # no dump asked for: the graph after each pass is not printed (seconds per compile at GPT-2 size)
        self.assertEqual(sorted(rec.graphs), ["backward", "dynamo", "forward", "joint_graph_after_dp",
                                              "joint_graph_before_dp"])


def test_dumps_and_summary(tmp_path):
    torch._dynamo.reset()
    model = M.GPT()
    # the dumps are of dpcompile's graphs, which compiler="eager" runs without Inductor's code (CI time)
    step, backend = compile_step(model, M.seq_ce, max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=4,
                                 dump_dir=str(tmp_path), schedule="ghost", compiler="eager")
    ids = torch.randint(0, 13, (4, 6))
    step((ids,), (ids,))
    rec = backend.compiled[0]
    folder = os.path.dirname(rec.dump_files[0])
    names = sorted(os.listdir(folder))
    for stage in ("dynamo_graph", "joint_graph_before_dp", "joint_after_batch_dim_analysis",
                  "joint_after_per_sample_norms", "joint_after_clip_schedule", "joint_after_gaussian_noise", "joint_after_second_backward_recompute",
                  "joint_graph_after_dp", "forward", "backward"):
        assert any(stage in n for n in names), (stage, names)
    assert "summary.txt" in names and "summary.json" in names
    summary = open(os.path.join(folder, "summary.txt")).read()
    for name, p in model.named_parameters():
        assert name in summary, name
    assert "embedding_ghost" in summary and "token equality" in summary
    assert "ghost" in summary and "reduction" in summary
    # what the rewrite removed: the first backward's weight-gradient contractions
    assert "rewrite" in summary and "(aten.mm.default)" in summary
    # the partitioned backward graph (not a joint stage whose pass name has "backward" in it)
    assert "class GraphModule" in open(os.path.join(folder, [n for n in names if n.endswith("_backward.py")][0])).read()


def test_kept_graph_texts_are_printed_when_read_as_they_were_when_kept(monkeypatch):
    """record.graphs keeps snapshots, printed when first read (printing is most of a graph's cost at GPT-2 size,
    and most compiles never read them): each text must be the graph as it was at its stage, not as later passes
    or Inductor's own (post-grad, in place on the forward and backward) left it; checkpoint bodies included."""
    import dpcompile.backend as backend_module
    from cases import CASES
    from dpcompile.debug import graph_text

    # the compile cache's record prints the texts when it is saved (a later process reads them back): off here
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    at_stage = []
    keep = backend_module.graph_snapshot
    monkeypatch.setattr(backend_module, "graph_snapshot", lambda gm: at_stage.append(graph_text(gm)) or keep(gm))
    case = CASES["checkpointed"]
    inputs, targets = case.data(5)
    # exact against the oracle too: the checkpointed case's Inductor run of the default tier (test_matches_reference
    # runs it op by op there, CI time)
    model = case.model()
    model.blocks = model.blocks[:1]  # one checkpointed block (CI time)
    backend = check_against_reference(model, case.loss, inputs, targets, schedule="ghost", reduction=case.reduction)
    records = [r for r in backend.compiled if r.dp]
    assert records and all(r.cache == "" and callable(t) for r in records for t in r.graphs._texts.values())
    got = [text for r in backend.compiled for text in r.graphs.values()]
    assert len(got) == len(at_stage) >= 5 and "checkpoint" in at_stage[0]
    for text, want in zip(got, at_stage):
        assert text == want


def test_dump_dir_context_manager_and_env(tmp_path):
    torch._dynamo.reset()
    model = M.MLP()
    step, _ = compile_step(model, M.ce, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)
    with dpcompile.dump_graphs(tmp_path / "ctx"):
        step((torch.randn(4, 5),), (torch.randint(0, 3, (4,)),))
    summaries = lambda: sorted(os.path.relpath(r, tmp_path / "ctx") for r, _, fs in os.walk(tmp_path / "ctx")  # noqa: E731
                               if "summary.txt" in fs)
    assert summaries() == [os.path.join("0_0", "rank0")]
    # compile ids start over after a reset (and in a new process): the next compile goes beside, not over
    torch._dynamo.reset()
    step, _ = compile_step(model, M.ce, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4)
    with dpcompile.dump_graphs(tmp_path / "ctx"):
        step((torch.randn(4, 5),), (torch.randint(0, 3, (4,)),))
    assert summaries() == sorted([os.path.join("0_0", "rank0"), os.path.join("0_0.1", "rank0")])


def _run_script(code: str, env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=600)


STRING_BACKEND = """
    import torch, torch.nn as nn, torch.nn.functional as F
    model = nn.Linear(4, 2)
    def step(x, y):
        loss = F.cross_entropy(model(x), y, reduction="none").mean()
        loss.backward()
        return loss.detach()
    step = torch.compile(step, backend="dp_fsdp",
                         options={"max_grad_norm": 0.1, "noise_multiplier": 0.0, "expected_batch_size": 3,
                                  "compiler": "eager"})
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 1])
    step(x, y)
    import sys
    assert "dpcompile" in sys.modules  # loaded through the entry point
    assert model.weight.grad.norm() <= 0.1 * 3 / 3 + 1e-6, model.weight.grad.norm()
    print("OK")
"""


def test_string_backend_works_without_importing_dpcompile(tmp_path):
    r = _run_script(STRING_BACKEND, {"TORCH_TRACE": str(tmp_path / "trace")})
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
    logs = "".join(open(os.path.join(tmp_path / "trace", f)).read() for f in os.listdir(tmp_path / "trace"))
    assert "dpcompile_" in logs and "summary" in logs  # graph dumps as TORCH_TRACE artifacts
    # the joint graph after each pass too (made only when a dump or the trace wants it)
    assert "joint_after_per_sample_norms" in logs and "joint_after_gaussian_noise" in logs


def test_private_step_decorator():
    torch._dynamo.reset()
    model = M.MLP()
    x, y = torch.randn(4, 5) * 3, torch.randint(0, 3, (4,))

    @dpcompile.private_step(max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=4)
    def step(x, y):
        loss = M.ce(model(x), y).mean()
        loss.backward()
        return loss.detach()

    step(x, y)
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    assert total <= 0.05 + 1e-6  # flat clipping: each sample <= C, mean over 4 samples
    assert step.dp_backend.calls == 1
    assert step.dp_backend.compiled[0].counters["clip_coefficients"] == 1


class TokenStack(torch.nn.Module):
    """Ten Linear layers over 6 tokens (ghost norms: each a gram_sq_norms kernel) with biases and LayerNorms."""

    def __init__(self, n=10, d=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(self.norm(x).mean(1))


def token_stack_record(schedule):
    """TokenStack's DP compile record, its gradients checked against the oracle (5 samples, clipping active)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    backend = check_against_reference(TokenStack(), M.mse, (torch.randn(5, 6, 8),), (torch.randn(5, 3),),
                                      schedule=schedule, linear_norm="ghost", compiler="eager")
    (rec,) = [r for r in backend.compiled if r.dp]
    return rec


def test_norm_partial_sums_and_bias_rows_are_summed_in_few_reductions():
    # ten kernels' [B, parts] partial sums in two reductions (8 + 2: a reduction over a concatenation of at most
    # 8 inputs reads them inside one CUDA kernel), the 13 summed parameters' [B, n] per-sample gradients (biases,
    # LayerNorm) as rows of one buffer with one reduction of their squares; exact against the oracle
    rec = token_stack_record("bk")
    assert rec.counters["gram_norm_kernels"] == 10 and rec.counters["norm_rows_stacked"] == 13, rec.counters
    ops = [(op_short(op), list(shape)) for op, shape in rec.ops["backward"]]
    before_sqrt = ops[:[name for name, _ in ops].index("sqrt")]
    cats = [shape for name, shape in before_sqrt if name == "cat"]
    parts = gram_parts(6)
    rows = 10 * 8 + 2 * 8 + 3
    assert cats == [[5, rows], [5, 8 * parts], [5, 2 * parts], [4, 5]], cats
    assert rec.summary["params"]["layers.0.bias"]["why"].startswith("reduction: per-sample sum, its squares summed")


def test_stacked_rows_past_their_budget_get_reductions_of_their_own(monkeypatch):
    from dpcompile.passes import per_sample_norms

    monkeypatch.setattr(per_sample_norms, "STACKED_ROWS_MAX_BYTES", 6 * 4 * 8 * 6)  # 6 biases: fp32, 8 wide, 6 samples
    rec = token_stack_record("ghost")
    assert rec.counters["norm_rows_stacked"] == 6 and rec.counters["norm_sum_materialize"] == 13, rec.counters


def gram_parts(S: int) -> int:
    from dpcompile import gram_sq_norms

    return gram_sq_norms.parts(S, 8, 8)  # narrow layers: their features in one piece


def test_summary_says_where_the_compile_time_went():
    """summary["compile_seconds"]: the wall time of each dp pass that ran (a disabled one is absent), the
    order-and-lint after them, the min-cut partition and the kept graph texts, for profiling a slow compile."""
    from dpcompile.passes import BACKWARD_PASSES, PASSES

    torch._dynamo.reset()
    step, backend = compile_step(M.MLP(), M.ce, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4,
                                 compiler="eager", disable_passes=("comm_overlap",))
    step((torch.randn(4, 5),), (torch.randint(0, 3, (4,)),))
    seconds = backend.compiled[0].summary["compile_seconds"]
    ran = {p.name for p in PASSES + BACKWARD_PASSES if p.name != "comm_overlap" and not p.inductor_only}
    assert ran | {"min_cut_partition", "finalize", "graph_texts"} <= set(seconds), sorted(seconds)
    assert "comm_overlap" not in seconds and "view_chains" not in seconds  # disabled; Inductor's only
    assert all(v >= 0 for v in seconds.values()) and list(seconds.values()) == sorted(seconds.values(), reverse=True)
    assert seconds["min_cut_partition"] > 0


class BiasedLayerNormMLP(torch.nn.Module):
    """Under bf16 autocast the linears' bias gradients are bf16 and the LayerNorm's fp32 (autocast runs
    layer_norm in fp32); all are clipped sums of the norm pass's per-sample rows (one [B, N] buffer)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2, self.fc3 = (torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 6),
                                                 torch.nn.Linear(6, 3))

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(self.ln(self.fc1(x)))))


class TestClippedRowSums(TestCase):
    def test_bf16_bias_gradients_are_parts_of_one_cast(self):
        # a cast per bias made a Triton kernel per parameter (its part's offset in its code: 48 compiles and
        # autotunings of GPT-2's bf16 step); one cast of the whole clipped sum, split once, is the same values
        torch._dynamo.reset()
        torch.manual_seed(0)
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        # bf16 forward against the fp64 oracle (autocast leaves float64 alone): bf16's rounding, not a bias
        # gradient read from another parameter's part, which would be off by its whole size
        backend = check_against_reference(M.Autocast(BiasedLayerNormMLP()), M.ce, (x,), (y,), schedule="bk",
                                          rtol=5e-2, atol=2e-2)
        self.assertEqual(backend.compiled[0].counters["clipped_row_sums_cast"], 1)
        # with noise (which takes the parts' casts back to fp32 into its op): no part is cast on its own
        torch._dynamo.reset()
        # op by op: the graph dpcompile hands on is what is checked (Inductor's code for it: the step above)
        step, backend = compile_step(M.Autocast(BiasedLayerNormMLP()), M.ce, max_grad_norm=1.0, noise_multiplier=1.0,
                                     expected_batch_size=8, schedule="bk", compiler="eager")
        step((x,), (y,))
        rec = backend.compiled[0]
        self.assertEqual(rec.counters["bk_sums_from_rows"], 5)  # 3 biases, the LayerNorm's weight and bias
        self.assertEqual(rec.counters["clipped_row_sums_cast"], 1)
        text = rec.graphs["backward"]
        parts = set(re.findall(r"^\s*(\w+): \S+ = split_with_sizes\w*\[\d+\]", text, re.M))
        self.assertEqual(len(parts), 5, text)  # each a part of one of the two splits (fp32, bf16)
        self.assertEqual(len(re.findall(r"= torch\.ops\.aten\.split_with_sizes\.default\(", text)), 2, text)
        cast_of = re.findall(r"convert_element_type\.default\((\w+),", text)
        self.assertEqual(len([a for a in cast_of if a.startswith("sum_")]), 1, cast_of)  # the whole clipped sum
        self.assertFalse(parts & set(cast_of), cast_of)


@pytest.mark.parametrize("case,schedule", [("gpt", "bk"), ("conv_kinds", "ghost"), ("hf_gpt2", "ghost")])
def test_a_step_compiled_to_its_loss_has_the_whole_steps_dp_graph(case, schedule):
    """The tests' check_against_reference compiles the forward and loss only and calls loss.backward() on the
    compiled loss (CI time: helpers.compile_step). Users compile the whole step, and dynamo ends its graph at
    loss.backward(): the DP graphs at every stage, the counters and the gradients must be the same both ways,
    or those tests would check a graph users never get."""
    import cases

    c = cases.CASES[case]
    records, grads = [], []
    for whole_step in (True, False):
        torch.manual_seed(0)
        inputs, targets = c.data(6)
        model = c.model()
        torch._dynamo.reset()
        step, backend = compile_step(model, c.loss, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=7,
                                     schedule=schedule, compiler="eager", whole_step=whole_step)
        step(inputs, targets)
        (record,) = [r for r in backend.compiled if r.dp]
        records.append(record)
        grads.append({n: p.grad for n, p in model.named_parameters()})
        assert len(backend.compiled) == (2 if whole_step else 1)  # the whole step's rest after the break
    whole, loss_only = records
    assert whole.compile_reason != loss_only.compile_reason  # a graph break, against a return
    assert list(whole.graphs) == list(loss_only.graphs) and len(whole.graphs) >= 4, list(whole.graphs)

    def text(graphs, stage):  # but for the source lines of the loss (helpers.py's two functions)
        return re.sub(r"# File: .*helpers\.py:\d+ in (step|loss_of), ", "# File: helpers.py, ", graphs[stage])

    for stage in whole.graphs:
        assert text(whole.graphs, stage) == text(loss_only.graphs, stage), stage
    assert whole.counters == loss_only.counters, (whole.counters, loss_only.counters)
    assert sum(v for k, v in whole.counters.items() if k.startswith("norm_")) > 0, whole.counters
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name
