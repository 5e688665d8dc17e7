"""The states of the batch-dim analysis (which dim of a value holds the samples) and the helpers its rules
share. ``passes.batch_dims`` runs the analysis; ``passes.rules`` holds the per-op rules.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from dpcompile.errors import SamplesMixedError
from dpcompile.fx_utils import known, module_of, op_name, source_line

if TYPE_CHECKING:
    from .batch_dims import BatchDimAnalysis

aten = torch.ops.aten


class _Free:
    def __repr__(self) -> str:
        return "FREE"


FREE = _Free()


@dataclasses.dataclass(frozen=True)
class Batched:
    dim: int | None
    outer: Any = 1
    inner: Any = 1

    def moved(self, dim: int | None) -> "Batched":
        return Batched(dim, self.outer, self.inner)


SINGLE = Batched(None)


@dataclasses.dataclass(frozen=True, eq=False)
class Permuted:
    """Rows in an order sorted across the batch (routed experts' tokens grouped by expert): along ``dim``, row r
    is element perm[r] of the sorted dim, which was ``Batched(0, outer, inner)``, so it belongs to sample
    (perm[r] // inner) % B. ``sort`` is the aten.sort node whose indices are perm; ``keys``: the sort's values
    themselves (or a cast of them), from which group offsets may be counted. passes.rules.row_order."""
    sort: fx.Node
    outer: Any
    inner: Any
    dim: int = 0
    keys: bool = False

    def moved(self, dim: int) -> "Permuted":
        return Permuted(self.sort, self.outer, self.inner, dim)


@dataclasses.dataclass(frozen=True, eq=False)
class PermIndex:
    """An index tensor perm // k of a sort's permutation perm (k = 1: perm itself)."""
    sort: fx.Node
    k: int = 1


@dataclasses.dataclass(frozen=True, eq=False)
class InversePerm:
    """The inverse of a sort's permutation (an iota scattered to perm): indexing rows sorted by that sort with
    it puts them back in sample order."""
    sort: fx.Node


@dataclasses.dataclass(frozen=True, eq=False)
class GroupOffsets:
    """Counts (``cumulative`` False) or their cumulative sums, the offsets a grouped matmul takes, of a sort's
    keys in ``groups`` bins, each key proven in range: sorted row r then lies in group key[r], its own
    sample's routing, whatever the other samples' rows are. Counted before the sort (``sort`` None): ``keys``
    is the tensor counted (through views and casts), which a sort of the same keys matches."""
    sort: fx.Node | None
    groups: int
    cumulative: bool
    keys: fx.Node | None = None


ROW_ORDER_STATES = (Permuted, PermIndex, InversePerm, GroupOffsets)


def is_per_sample(s: Any) -> bool:
    """A value whose rows each belong to one sample: in sample order (Batched) or sorted across the batch."""
    return isinstance(s, (Batched, Permuted))


@dataclasses.dataclass(frozen=True, eq=False)
class Reduced:
    origin: fx.Node


@dataclasses.dataclass(frozen=True, eq=False)
class Mixed:
    origin: fx.Node
    why: str


@dataclasses.dataclass(eq=False)
class Contribution:
    """A backward node that sums a per-sample quantity over the samples.

    kind: "mm" (contraction over sample rows), "bmm" (a batched one, over a
    sample-free batch dim: per-head weights), "sum" (reduction over the
    sample dim), "index_put" (embedding backward: scatter-add of sample rows).
    operands: the argument positions (into node.args) of the per-sample inputs,
    with the layout of the sample dim in each.
    scaled_operand: the argument position that is linear in the loss tangent;
    per-sample row scaling is applied to it.
    """

    node: fx.Node
    kind: str
    layouts: dict[int, Batched]
    scaled_operand: int
    extra: dict = dataclasses.field(default_factory=dict)


def bytes_at_expected_batch(node: fx.Node, states: dict, B: Any, expected_batch_size: int | None) -> int | None:
    """Bytes node's value holds when the batch has expected_batch_size samples (its size per sample times
    that; a value without a sample dim: its size). Never from this rank's B, so every rank takes the same
    decisions. None when a size is symbolic beyond the batch (or data-dependent)."""
    v = node.meta["val"]
    try:
        if not is_per_sample(states.get(node)):
            return int(v.numel()) * v.element_size()
        per_sample = 0 if known(B == 0) else int(v.numel() // B)
    except Exception:
        return None
    return per_sample * int(expected_batch_size or 1) * v.element_size()


def is_zero_constant(a: Any) -> bool:
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return a == 0
    if isinstance(a, fx.Node) and a.op == "call_function":
        if a.target in (aten.full.default, aten.scalar_tensor.default):
            fill = a.args[1] if a.target is aten.full.default else a.args[0]
            return isinstance(fill, (int, float)) and fill == 0
        if a.target in (aten.zeros.default, aten.zeros_like.default):
            return True
    return False


def where_branches(node: fx.Node) -> list[fx.Node]:
    """The branches of where(cond, a, b) that are not zero constants."""
    return [x for x in node.args[1:3] if not is_zero_constant(x)]


# shape helpers
def ndim(x: fx.Node) -> int:
    return x.meta["val"].dim()


def shape_of(x: fx.Node):
    return list(x.meta["val"].shape)


def norm_dim(d: int, n: int) -> int:
    return d % n if n > 0 else 0


def prod(xs) -> Any:
    p = 1
    for x in xs:
        p = p * x
    return p


def view_layout(in_shape, out_shape, lay: Batched, B) -> Batched | None:
    """Where the sample index lands after a view (row-major reinterpretation).

    Sample of flat index f is (f // G) % B with G = inner * prod(in[dim+1:]).
    An output dim e with P = prod(out[e+1:]) carries it iff P | G and
    (G/P) * B | out[e]; then it is Batched(e, out[e] / ((G/P) B), G/P).
    """
    if lay.dim is None:
        return SINGLE
    G = lay.inner * prod(in_shape[lay.dim + 1 :])
    # with B > 1 at most one dim qualifies. With B == 1 several may: the one with the fewest copies of the batch
    # (outer) is where a batch of any size would land (copies of the batch split off into dims of their own: a
    # [E * B * T, d] of tokens repeated per expert viewed as [E, B * T, d]), the outermost among equals
    found = None
    for e in range(len(out_shape)):
        P = prod(out_shape[e + 1 :])
        if known(G % P == 0):
            i2 = G // P
            size = out_shape[e]
            if known(size % (i2 * B) == 0) and not known(size == 0):
                lay_e = Batched(e, size // (i2 * B), i2)
                if not known(B == 1):
                    return lay_e
                if found is None or known(lay_e.outer < found.outer):
                    found = lay_e
    return found


# rules: (analysis, node) -> state
def fail_layout(an: "BatchDimAnalysis", node: fx.Node, why: str):
    if known(an.B == 1):
        return SINGLE
    raise an.refuse(node, why)


def same_layout(a: Batched, b: Batched) -> bool:
    # outer/inner may be symbolic: equal only if provably so
    return a.dim == b.dim and known(a.outer == b.outer) and known(a.inner == b.inner)


def each_output(node: fx.Node, state):
    """state for every output of node: a tuple of it for an op with several outputs, else state itself."""
    vals = node.meta["val"]
    return tuple(state for _ in vals) if isinstance(vals, (tuple, list)) else state


def one_layout(an: "BatchDimAnalysis", node: fx.Node, allowed, why: str):
    """The one layout of node's per-sample tensor operands, each checked by allowed(operand, its state) (else
    refused with why); SINGLE if one is a single sample's, None if none is per sample."""
    name = node.target.overloadpacket.__name__
    found = None
    for a, s in an.tensor_args(node):
        if not isinstance(s, Batched):
            continue
        if s.dim is None:
            return SINGLE
        if not allowed(a, s):
            return fail_layout(an, node, f"{name} {why}")
        if found is not None and not same_layout(found, s):
            return fail_layout(an, node, f"{name} combines per-sample operands with different sample layouts")
        found = s
    return found


# cross-rank sums (FSDP gradient reduction): linear
_C10D = torch.ops._c10d_functional


COLLECTIVE_REDUCTIONS = {_C10D.reduce_scatter_tensor.default, _C10D.all_reduce.default}


def is_gradient_reduction(n) -> bool:
    """A cross-rank sum of something other than per-sample values: a gradient's reduction (FSDP's
    reduce-scatter). Tensor parallelism's all-reduce of activations keeps rows per sample (its result is
    Batched, rules/collectives.py) and is not one."""
    return n.op == "call_function" and n.target in COLLECTIVE_REDUCTIONS and \
        not isinstance(n.meta.get("dp_batch"), Batched)


def has_collective_reductions(graph) -> bool:
    """Whether any gradient of the graph is reduced across ranks (False on one process): passes that look
    for the reductions behind each gradient skip their per-parameter searches when there are none."""
    return any(is_gradient_reduction(n) for n in graph.nodes)


# ---------------------------------------------------------------------------
# the refusal of a loss that is not a sum or mean of per-sample losses (the analysis and the loss pass)
PER_SAMPLE_LOSS_HELP = (
    "Compute one loss per sample (shape [B]) and return its .mean() or .sum(): e.g. "
    "per_token = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction='none').view(B, T); "
    "per_sample = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1); loss = per_sample.mean()."
)

# A transformers model given labels= computes its own loss (transformers/loss/loss_utils.py): a token mean over
# the whole batch (not a loss per sample). Matched on the stack of the op that divides (or of a graph break in it).
HF_LOSS_MARKERS = ("self.loss_function(", "transformers/loss/")
HF_LOSS_ADVICE = (
    "a Hugging Face model given labels= computes its own loss, a token mean over the whole batch (not a loss per "
    "sample): call the model without labels and compute one loss per sample "
    "from .logits, e.g. per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), "
    "reduction='none').view(B, T - 1); loss = per_token.mean(1).mean()"
)

RATIO_OF_SUMS = "a ratio of two sums over the samples"
# BatchDimAnalysis._batch_size_mean at a static batch of one: sum / numel and sum / T are one graph
AMBIGUOUS_AT_ONE = object()
SUM_OVER_NUMEL_AT_ONE = "a sum over all elements of a batch of one divided by their number"
# BatchDimAnalysis._batch_size_mean: a sum over the samples scaled by a factor it cannot evaluate, made from the
# batch size (read as a constant, each sample's clipped share would depend on how many samples were drawn)
BATCH_SIZE_FACTOR = object()
BATCH_SIZE_FACTOR_WHY = ("a sum over the samples scaled by a value computed from the batch size that is not 1 / B; "
                         "write the mean as .mean() or as loss.sum() / x.shape[0]")
_CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


def sample_count_sum(node: Any) -> fx.Node | None:
    """The sum node when ``node`` is (a cast of) a sum of a boolean tensor: a count of elements that pass a
    test, such as F.cross_entropy's count of targets that are not ignore_index; None otherwise. Whether what
    it counts is samples (one element per sample) is the analysis' to check."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CASTS:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and getattr(node.target, "overloadpacket", None) is torch.ops.aten.sum):
        return None
    x = node.args[0]
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return node if isinstance(v, torch.Tensor) and v.dtype == torch.bool else None


def count_key(count: fx.Node) -> tuple:
    """What a count of samples (a cast of a sample_count_sum node) counts, the same for two counts of one test
    written differently: F.cross_entropy with label smoothing divides its two terms by ``(target != ignore_index).sum()``
    and by ``(~(target == ignore_index)).sum()``, one count of the targets that are not ignored."""
    x, negated = (sample_count_sum(count) or count).args[0], False  # (the sum under its casts)
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in (aten.bitwise_not.default,
                                                                             aten.logical_not.default):
        x, negated = x.args[0], not negated
    if isinstance(x, fx.Node) and x.op == "call_function" and x.target in (aten.eq.Scalar, aten.ne.Scalar):
        return ("eq", x.args[0], x.args[1], negated != (x.target is aten.ne.Scalar))
    return (x, negated)


def loss_not_per_sample(origin: fx.Node, why: str) -> SamplesMixedError:
    if why == SUM_OVER_NUMEL_AT_ONE:
        return SamplesMixedError(
            f"dp_fsdp: op {op_name(origin)} in module {module_of(origin)} computes {why}: compiled for one "
            "sample, loss.sum() / loss.numel() (a mean over the batch) and loss.sum() / T (a sum of per-sample "
            "means) are the same graph, and graphs for other batch sizes tell them apart."
            + (f"\n  at: {source_line(origin)}" if source_line(origin) else "")
            + "\n  What to do: use loss.mean() (or divide by the batch size, loss.sum() / B), or call "
            "dpcompile.mark_batch(...) on the step's inputs to compile one graph for every batch size.")
    example = ("F.cross_entropy and F.nll_loss with their default reduction='mean' divide by the number of "
               "targets that are not ignore_index, a count taken across samples; pass reduction='none'"
               if why == RATIO_OF_SUMS else
               "for example a token mean over the whole batch with ignore_index divides by a count taken across "
               "samples")
    return SamplesMixedError(
        f"dp_fsdp: the loss is not a sum or mean of per-sample losses: op {op_name(origin)} in module "
        f"{module_of(origin)} computes {why} ({example})."
        + (f"\n  at: {source_line(origin)}" if source_line(origin) else "")
        + "\n  What to do: " + (HF_LOSS_ADVICE + "." if _in_hf_loss(origin) else PER_SAMPLE_LOSS_HELP)
    )


def _in_hf_loss(node: fx.Node) -> bool:
    stack = (node.meta.get("stack_trace") or "").replace("\\", "/")
    return any(m in stack for m in HF_LOSS_MARKERS)
