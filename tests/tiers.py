"""The two test tiers. The default tier is what CI runs (README's test command; its budget: 30 minutes on 2 cores);
``python -m pytest --extended`` adds the extended tier, which benchmarks/gpu_tests.sh always runs.

A test belongs to the extended tier when the default tier already runs the same code path in another
parametrisation:
- another schedule of a sharded case (every case runs sharded in the default tier, each schedule on about half of
  them), or another layout of a feature the default tier runs sharded;
- every layer kind with the CUDA padding rule forced on for CPU, and through Inductor (the padding rule itself runs
  in the default tier: a quarter of the kinds op by op, a GPT through Inductor);
- a sharded run through Inductor whose case runs op by op sharded in the default tier while another sharded run
  there takes its feature through Inductor (padding, recomputed logits), or one process does (dropout);
- a model variant's Inductor run (frozen, tied or low-rank weights, another loss or reduction of a model whose own
  Inductor run is in the default tier: the variant is dpcompile's rewrite, which its op-by-op run checks);
- the other schedule's (or norm form's, or batch's) Inductor run of a feature the default tier takes through Inductor
  with one and op by op with the other: dropout's masks, grouped Gram norms, micro-batch accumulation, padded
  contractions and padded values, the C++ wrapper, the norms' two-stage sums and blocks, dropped samples, the
  unbacked batch, per-head norm forms, the sorted experts' batch of one;
- an Inductor run whose path other default-tier tests take between them: a case another test takes through Inductor
  against the oracle (checkpointed in test_graphs, hf_llama with the reordered collectives in the sharded matrix,
  llama in the auto schedule, gpt's recomputed logits in the sharded matrix, sample_indexed with Inductor's
  reordering); a layer kind whose layers other cases lower (plain Linear, embeddings, weights used twice, a loss
  variant, HF's Conv1D, a padding mask, a kept state: test_per_sample_clipping's LOWERED_ELSEWHERE);
  multilabel_margin's fixed decomposition (traced by aot_eager, lowered in test_losses' DP step); transformers'
  flex-attention masks (the forward's, the same in both schedules).
Where a test's assertions read only dpcompile's graphs or counters, or a noiseless reference, its compile is op
by op in both tiers.
Privacy-relevant paths (every op rule, every case on one process in both schedules, every case sharded, refusals,
noise, accounting) stay in the default tier."""
import os

import pytest

ENV = "DPCOMPILE_EXTENDED_TESTS"  # "1": the extended tier runs (set by --extended, inherited by spawned ranks)
extended = pytest.mark.extended
REASON = "extended tier (the default tier runs this path in another parametrisation): python -m pytest --extended"


def op_by_op_here(*values) -> list:
    """A parametrisation the default tier runs op by op while its Inductor run is the extended tier's (the rules
    above): its values with compiler "eager", and with "inductor" marked extended (compiler the last argument)."""
    return [(*values, "eager"), pytest.param(*values, "inductor", marks=extended)]


def extended_tier() -> bool:
    return os.environ.get(ENV) == "1"
