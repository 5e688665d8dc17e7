"""Zero-pad contractions whose static sizes break cuBLAS's 16-byte alignment.

A bf16 GEMM with a dimension that is not a multiple of 8 (an LM head with
GPT-2's vocabulary of 50257) runs on cuBLAS's unaligned fallback kernels:
2.2-3.3 ms each for GPT-2-small's LM head on an H200 against 0.4 ms aligned
(BENCHMARKS.md, fourth run). Inductor's pad_mm fixes this in the non-private
step, but dp_fsdp turns it off: it rewrites the joint graph before the dp
passes see it, and its shape checks skip the unbacked batch size. This pass
runs after the dp rewrite, on every contraction, and pads only static
sizes.

Exactness: zeros appended to the contracted dim add exact zero products;
rows or columns appended to an output are sliced off again. The per-sample
norms and the clipped gradients are bit-for-bit the same sums.

An operand that is a transpose or permute of another node is padded at its
base and permuted again, so one padded copy serves every contraction that
reads the same tensor (an LM head's output gradient feeds the input gradient,
the weight gradient and the norm Gram). A row mask ``where(keep, x, 0)`` is
padded as ``where(keep, pad(x), 0)``: zeros stay zeros, and bk's weight
gradient then reads the masked padded buffer (masked in place after the
partition) instead of a second padded copy.

A padded value the step computes with a pointwise op (an LM head's logits
gradient) is computed padded: its other readers read a slice of the padded
buffer, so Inductor fuses the pad into the op that makes the value and writes
one buffer, not the value and a padded copy of it (GPT-2-small's [8192, 50257]
bf16 logits gradient: two 0.57 ms copies a step on an H100, BENCHMARKS.md).
A reader that needs the value's own layout (a graph output, a collective, a
kernel that reads memory as contiguous, a view that cannot be taken of the
slice) keeps reading the value.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._inductor import config as inductor_config

from dpcompile.fx_utils import GraphBuilder, is_collective, permutation_of
from .context import DPPassContext
from .inplace_row_masks import ROW_MASK

aten = torch.ops.aten
# The devices whose GEMM libraries want aligned sizes (the CPU tests add "cpu").
PAD_DEVICES = ("cuda",)
# Elements per 16 bytes for the dtypes cuBLAS runs on tensor cores.
ALIGNMENT = {torch.bfloat16: 8, torch.float16: 8}
_TF32_ALIGNMENT = 4
_PERMUTES = (aten.permute.default, aten.t.default, aten.transpose.int)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# readers that read a value through its strides and make a tensor of their own (beside pointwise ops); the
# gathers: a tied LM head's cross term reads the logits gradient at the token ids (shared_norms), and while it
# kept the unpadded value, GPT-2's [8192, 50257] bf16 logits gradient was written, then copied padded
# (0.43 ms on an H200)
_STRIDED_READERS = {aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.mean.dim,
                    aten.constant_pad_nd.default, aten.gather.default, aten.index_select.default,
                    aten.index.Tensor}
# mat1, mat2 at args 0, 1; addmm (bias first) is handled apart
_CONTRACTIONS = {getattr(op, name) for op in (aten.mm, aten.bmm) for name in ("default", "dtype") if hasattr(op, name)}


# kernels that read an input's memory as if contiguous: torch 2.13's CPU _weight_norm_interface_backward
# gives other values for a strided grad_w than for the same values contiguous
_DENSE_INPUTS = {torch.ops.aten._weight_norm_interface_backward.default}


def _alignment(dtype: torch.dtype) -> int:
    if dtype in ALIGNMENT:
        return ALIGNMENT[dtype]
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return _TF32_ALIGNMENT  # TF32 tensor cores
    return 0


def _extra(size, align: int, itemsize: int) -> int:
    """How many zeros make a static ``size`` a multiple of ``align`` (symbolic sizes: none).

    A size past Inductor's stride-padding threshold is padded to the width Inductor pads such a buffer's
    stride to (``padding_alignment_bytes``: 64 bf16 elements): a value computed padded then has rows as wide
    as the stride Inductor would have given it unpadded, so the kernel that writes it reads and writes at the
    same offsets (vectorised), and no padded row holds a second, unused gap."""
    if not isinstance(size, int) or align == 0 or size <= 1 or size % align == 0:
        return 0
    if inductor_config.comprehensive_padding and size > inductor_config.padding_stride_threshold:
        align = max(align, inductor_config.padding_alignment_bytes // itemsize)
    return -size % align


class _Padder:
    def __init__(self, gm: fx.GraphModule):
        self.b = GraphBuilder(gm.graph, tag=None)
        self.cache: dict[tuple[fx.Node, int, int], fx.Node] = {}
        self.created: list[fx.Node] = []
        # a node the graph had -> (the padded node standing in for it, padded dim, its size there)
        self.stand_ins: dict[fx.Node, tuple[fx.Node, int, int]] = {}

    def drop_unused(self) -> None:
        """Intermediate views of padded bases that no contraction ended up reading."""
        kept = []
        for n in reversed(self.created):
            if n.users:
                kept.append(n)
            else:
                n.graph.erase_node(n)
        self.created = kept[::-1]

    def pad(self, x: fx.Node, dim: int, extra: int) -> fx.Node:
        nd = x.meta["val"].dim()
        dim %= nd
        key = (x, dim, extra)
        if key in self.cache:
            return self.cache[key]
        base_dim = self._base_dim(x, dim)
        if base_dim is not None:  # pad the tensor this one is a view of, and view that again
            padded_base = self.pad(x.args[0], base_dim, extra)
            args = list(x.args[1:])
            target = x.target
            if x.target in _VIEWS:
                args[0] = [*args[0][:dim], args[0][dim] + extra, *args[0][dim + 1:]]
                if not _viewable(padded_base, args[0]):
                    # the padded base is laid out as its own base was, which the view's regrouping may not
                    # fit (einsum's [h, B, S, d] of a [B, S, h, d] projection, grouped to [h, B*S, d])
                    target = aten.reshape.default
            self._like(x)
            out = self.b.call(target, padded_base, *args)
        elif self._is_row_mask(x, dim):  # where(keep, x, 0) padded is where(keep, pad(x), 0)
            keep, inner, zero = x.args
            padded_inner = self.pad(inner, dim, extra)
            self._like(x)
            out = self.b.call(x.target, keep, padded_inner, zero)
            for k, v in x.meta.items():  # the row-mask tag and the dp tags travel with it
                out.meta.setdefault(k, v)
            self._stand_in(x, out, dim)
        else:
            self._like(x)
            out = self.b.call(aten.constant_pad_nd.default, x, [0, 0] * (nd - 1 - dim) + [0, extra], 0.0)
            self._stand_in(x, out, dim)
        self.cache[key] = out
        self.created.append(out)
        return out

    def _stand_in(self, x: fx.Node, out: fx.Node, dim: int) -> None:
        if x in self.stand_ins:  # padded along two dims or by two amounts: its readers keep x
            self.stand_ins[x] = None
        else:
            self.stand_ins[x] = (out, dim, x.meta["val"].shape[dim])

    def share_with_readers(self) -> int:
        """Let the other readers of a pointwise value read a slice of its padded stand-in, so that Inductor
        computes the value padded in one buffer instead of the value and a padded copy. Returns how many
        values now have no reader but their stand-in."""
        shared = 0
        created = set(self.created)
        live = _live_nodes(self.b.graph) if self.stand_ins else set()
        for x, entry in list(self.stand_ins.items()):
            if entry is None or x in created or not _computed_pointwise(x):
                continue
            out, dim, size = entry
            readers = {}
            for u in x.users:
                if u is out or u in created or u not in live:
                    continue
                vals = _vals_with_slice(u, x, out, dim, size, self.b.fake_mode)
                if vals is not None:
                    readers[u] = vals
            if not readers or not self._move_after(out, x, created):
                continue
            with x.graph.inserting_after(out):
                self._like(x)
                view = self.b.call(aten.slice.Tensor, out, dim, 0, size)
            self.created.append(view)
            for u, vals in readers.items():
                u.replace_input_with(x, view)
                for n, v in vals.items():
                    n.meta["val"] = v
            shared += all(u is out or u in created or u not in live for u in x.users)
        return shared

    @staticmethod
    def _move_after(out: fx.Node, x: fx.Node, created: set[fx.Node]) -> bool:
        """Place ``out`` and the padded nodes it is built from right after x (so x's earlier readers can read
        it), where everything else they read comes before x."""
        chain, seen = [], set()

        def visit(n):
            if n in seen or n not in created:
                return
            seen.add(n)
            for a in n.all_input_nodes:
                visit(a)
            chain.append(n)  # inputs first
        visit(out)
        order = {n: i for i, n in enumerate(x.graph.nodes)}
        if any(order[a] > order[x] for n in chain for a in n.all_input_nodes if a not in seen):
            return False
        anchor = x
        for n in chain:
            if order[n] > order[x]:
                anchor.append(n)
                anchor = n
        return True

    @staticmethod
    def _is_row_mask(x: fx.Node, dim: int) -> bool:
        """``where(keep, inner, 0)`` with keep constant along ``dim`` (a per-sample or per-row mask)."""
        if x.op != "call_function" or x.target is not aten.where.self or ROW_MASK not in x.meta:
            return False
        keep, inner, zero = x.args
        if not (isinstance(inner, fx.Node) and isinstance(keep, fx.Node) and isinstance(zero, fx.Node)):
            return False
        vx, vi = x.meta["val"], inner.meta["val"]
        if tuple(vi.shape) != tuple(vx.shape) or vi.dtype != vx.dtype:
            return False
        vk, vz = keep.meta["val"], zero.meta["val"]
        k = dim - (vx.dim() - vk.dim())
        if k >= 0 and vk.shape[k] != 1:
            return False
        z = dim - (vx.dim() - vz.dim())
        if z >= 0 and vz.shape[z] != 1:
            return False
        return _is_zero(zero)

    @staticmethod
    def _base_dim(x: fx.Node, dim: int) -> int | None:
        """The dim of x's base that x's ``dim`` is, when x is a permute or a view that keeps it whole."""
        if x.op != "call_function" or not isinstance(x.args[0], fx.Node):
            return None
        if x.target in _PERMUTES:
            return permutation_of(x)[dim]
        if x.target in _VIEWS and isinstance(x.args[1][dim], int) and x.args[1][dim] == x.meta["val"].shape[dim]:
            # a view that only regroups the dims before ``dim``: [B*T, V] <-> [B, T, V]
            shape, base_shape = x.meta["val"].shape, x.args[0].meta["val"].shape
            tail = len(shape) - dim
            kept = zip(shape[dim:], base_shape[len(base_shape) - tail:])
            if tail <= len(base_shape) and all(isinstance(a, int) and isinstance(b, int) and a == b for a, b in kept):
                return len(base_shape) - tail
        return None

    def _like(self, x: fx.Node) -> None:
        # new nodes belong where the node they stand in for was made (forward or backward)
        self.b.meta_source = x
        self.b.tag = x.meta.get("partitioner_tag")


def _viewable(x: fx.Node, shape: list) -> bool:
    """Whether x's value can be viewed (not copied) as ``shape``."""
    try:
        x.meta["val"].view(shape)
    except Exception:  # a stride mismatch, or a question about a symbolic size: reshape then
        return False
    return True


def _sizes(node: fx.Node):
    """(mat1, mat2, M, K, N) of mm/bmm/addmm-like nodes; ``None`` for others."""
    t = node.target
    if t in _CONTRACTIONS:
        a, b = node.args[0], node.args[1]
    elif t is aten.addmm.default:
        a, b = node.args[1], node.args[2]
    else:
        return None
    sa, sb = a.meta["val"].shape, b.meta["val"].shape
    return a, b, sa[-2], sa[-1], sb[-1]


def aligned_contractions_pass(gm: fx.GraphModule, ctx: DPPassContext) -> fx.GraphModule:
    padder = _Padder(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        sizes = _sizes(node)
        if sizes is None:
            continue
        a, b, M, K, N = sizes
        va, vb = a.meta["val"], b.meta["val"]
        if va.device.type not in PAD_DEVICES or va.dtype != vb.dtype:
            continue
        align = _alignment(va.dtype)
        itemsize = va.dtype.itemsize
        pm, pk, pn = _extra(M, align, itemsize), _extra(K, align, itemsize), _extra(N, align, itemsize)
        if not (pm or pk or pn):
            continue
        with gm.graph.inserting_before(node):
            out = _padded_contraction(padder, node, a, b, (pm, pk, pn), (M, N))
            # a slice across the padded columns (or rows of a bmm) is strided; collectives, graph outputs,
            # kernels that read their input's memory as contiguous (_DENSE_INPUTS) and views the slice's strides
            # do not allow (a bmm's [E, N, d] output viewed as [E * N, d]) get a contiguous copy (collectives
            # need it, callers expect eager's strides)
            strict = [u for u in node.users if u.op == "output" or is_collective(u) or u.target in _DENSE_INPUTS
                      or u.target in _VIEWS and not _viewable(out, fx.node.map_arg(u.args[1], lambda n: n.meta["val"]))]
            dense = padder.b.call(aten.clone.default, out, memory_format=torch.contiguous_format) if strict and (
                pn or (pm and out.meta["val"].dim() == 3)) else out
        node.replace_all_uses_with(out)
        for u in strict:
            u.replace_input_with(out, dense)
        gm.graph.erase_node(node)
        ctx.counters["contractions_padded"] += 1
    shared = padder.share_with_readers()
    if shared:
        ctx.counters["padded_values_shared"] += shared
    padder.drop_unused()
    pads = sum(n.target is aten.constant_pad_nd.default for n in padder.created)
    if pads:
        ctx.counters["contraction_operands_padded"] += pads
    return gm


def _live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value reaches the output or an op with side effects (the rest is dead code the contractions
    left behind: the unpadded operands' views)."""
    live: set[fx.Node] = set()
    for n in reversed(graph.nodes):
        if n.op == "output" or n.is_impure() or any(u in live for u in n.users):
            live.add(n)
    return live


def _is_zero(node: fx.Node) -> bool:
    t = node.target
    if t is aten.scalar_tensor.default:
        return node.args[0] == 0
    if t is aten.full.default:
        return node.args[1] == 0
    return False


def _computed_pointwise(x: fx.Node) -> bool:
    """A value a pointwise op makes in the step: Inductor can write it padded in the same kernel."""
    t = x.target
    return (x.op == "call_function" and isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags
            and not t._schema.is_mutable)


def _vals_with_slice(u: fx.Node, x: fx.Node, out: fx.Node, dim: int, size: int, fake_mode):
    """Whether reader u of x can read ``out[..., :size, ...]`` (the slice of x's padded stand-in) instead:
    the new fake values of u and of the views after it (their strides change), or None where it cannot."""
    with fake_mode:
        sliced = out.meta["val"].narrow(dim, 0, size)
    return _reader_vals(u, {x: sliced}, fake_mode)


def _reader_vals(u: fx.Node, subst: dict, fake_mode):
    t = u.target
    if u.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable:
        return None  # graph outputs keep eager's strides; mutations and unknown readers keep x
    view = t.is_view or t in _VIEWS
    if not (view or torch.Tag.pointwise in t.tags or t in _STRIDED_READERS or t in _CONTRACTIONS
            or t is aten.addmm.default or t.namespace == "dpcompile"):
        return None
    args, kwargs = fx.node.map_arg((u.args, u.kwargs), lambda n: subst[n] if n in subst else n.meta.get("val"))
    try:
        with fake_mode:
            val = t(*args, **kwargs)
    except Exception:  # e.g. a view the slice's strides do not allow
        return None
    if not view:
        return {}  # a tensor of its own: its layout does not follow the slice's
    if not isinstance(val, torch.Tensor) or tuple(val.shape) != tuple(u.meta["val"].shape):
        return None
    vals = {u: val}
    for w in u.users:
        more = _reader_vals(w, {u: val}, fake_mode)
        if more is None:
            return None
        vals.update(more)
    return vals


def _padded_contraction(padder: _Padder, node: fx.Node, a: fx.Node, b: fx.Node, extra, out_sizes) -> fx.Node:
    pm, pk, pn = extra
    if pk:
        a, b = padder.pad(a, -1, pk), padder.pad(b, -2, pk)
    if pm:
        a = padder.pad(a, -2, pm)
    if pn:
        b = padder.pad(b, -1, pn)
    args = list(node.args)
    if node.target is aten.addmm.default:
        args[0] = _pad_bias(padder, args[0], pm, pn)
        args[1], args[2] = a, b
    else:
        args[0], args[1] = a, b
    padder._like(node)
    out = padder.b.call(node.target, *args, **node.kwargs)
    nd = out.meta["val"].dim()
    if pm:
        out = padder.b.call(aten.slice.Tensor, out, nd - 2, 0, out_sizes[0])
    if pn:
        out = padder.b.call(aten.slice.Tensor, out, nd - 1, 0, out_sizes[1])
    return out


def _pad_bias(padder: _Padder, bias, pm: int, pn: int):
    """addmm's bias broadcasts to [M, N]: pad the dims it actually has."""
    if not isinstance(bias, fx.Node):
        return bias
    shape = bias.meta["val"].shape
    if pn and len(shape) >= 1 and shape[-1] != 1:
        bias = padder.pad(bias, -1, pn)
    if pm and len(shape) == 2 and shape[0] != 1:
        bias = padder.pad(bias, -2, pm)
    return bias
