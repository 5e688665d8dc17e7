"""Small FX helpers shared by the passes: naming, fake-value node building."""
from __future__ import annotations

import operator
import re
from typing import Any, Callable

import torch
import torch._inductor.inductor_prims  # noqa: F401  registers prims.inductor_lookup_seed (noise seeds)
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

aten = torch.ops.aten

# Meta keys carried from an original node onto the nodes built for it, so the
# dumps and error messages keep pointing at the user's module and source line.
_CARRIED_META = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "seq_nr", "source_fn_stack")
# Ops whose value is cheaper to state than to propagate: prims.inductor_lookup_seed's fake propagation
# (index and clone of the seeds) took 12 ms per noise node, 1.7 s of a GPT-2-small compile on CPU.
_META_BY_SHAPE = {
    torch.ops.prims.inductor_lookup_seed.default:
        lambda seeds, index: torch.empty((), dtype=seeds.dtype, device=seeds.device),
}


# the functional collectives' namespaces: the current one, and the legacy one that graphs traced through older
# DTensor code still hold
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")


def is_collective(node: fx.Node) -> bool:
    """A functional collective (its output is another rank's data: a pass must not give it another layout, nor
    take its buffer for its own)."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in COLLECTIVE_NAMESPACES


def known(cond: Any) -> bool:
    """True only when ``cond`` holds for every value of the symbols in it."""
    if isinstance(cond, bool):
        return cond
    return statically_known_true(cond)


def contiguous_strides(shape) -> list:
    strides, acc = [], 1
    for n in reversed(list(shape)):
        strides.append(acc)
        acc = acc * n
    return strides[::-1]


def permutation_of(node: fx.Node) -> list[int] | None:
    """The dim order of a permute, t or transpose node (output dim i reads input dim perm[i]); None for any
    other node."""
    if node.op != "call_function":
        return None
    aten = torch.ops.aten
    nd = node.meta["val"].dim()
    if node.target is aten.permute.default:
        return [d % nd for d in node.args[1]]
    if node.target is aten.t.default:
        return [1, 0] if nd == 2 else list(range(nd))
    if node.target is aten.transpose.int:
        perm = list(range(nd))
        if nd:
            d0, d1 = (d % nd for d in node.args[1:3])
            perm[d0], perm[d1] = d1, d0
        return perm
    return None


def row_major(shape, stride) -> bool:
    """The strides are the contiguous ones of the shape for every value of the symbols in them (a dim of size
    one may have any stride)."""
    return all(known(s == c) or known(n == 1) for s, c, n in zip(stride, contiguous_strides(shape), shape))


def clean_module_path(path: str) -> str:
    """``L['model']._modules['fc']`` / ``G['m'].layers[0].fc`` -> ``fc`` / ``layers.0.fc``."""
    path = re.sub(r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    path = re.sub(r"^(L|G)\.[^.]+", "", path)
    path = path.replace("._orig_mod", "")
    return path.lstrip(".") or "<root>"


def module_of(node: fx.Node) -> str:
    """The innermost user module a graph node came from, e.g. ``blocks.0.mlp.fc (Linear)``."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return "<top level of the step function>"
    path, ty = list(stack.values())[-1]
    name = getattr(ty, "__name__", None) or str(ty).rsplit(".", 1)[-1].rstrip("'>")
    return f"{clean_module_path(path)} ({name})"


def op_name(node: fx.Node) -> str:
    t = node.target
    if t is operator.getitem:
        return "getitem"
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def source_line(node: fx.Node) -> str:
    st = node.meta.get("stack_trace")
    if not st:
        return ""
    lines = [l.strip() for l in st.strip().splitlines() if l.strip() and set(l.strip()) - set("^~ ")]
    # the innermost frame: 'File "...", line N, in f' followed by its code line
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"{lines[i]}: {code}" if code else lines[i]
    return lines[-1] if lines else ""


def recomputable(node: fx.Node) -> bool:
    """A pointwise op or a view that draws no random numbers: copying it recomputes the same value."""
    t = node.target
    return (node.op == "call_function" and isinstance(t, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in t.tags
            and (torch.Tag.pointwise in t.tags or bool(t.is_view)))


def tangent_dependent(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of a joint graph that read a tangent, directly or not: those the partitioner puts in the
    backward."""
    dep: set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of a joint graph the backward runs: those that read a tangent, and those dpcompile placed in
    the backward without reading one (a forward value the ghost second backward recomputes)."""
    return tangent_dependent(graph) | {n for n in graph.nodes
                                       if n.meta.get("partitioner_tag") == "must_be_in_backward"}


def retarget_calls(gm: fx.GraphModule, target: Any, replacement: Any, where: Any = None) -> int:
    """Points every call of ``target`` in ``gm`` (that ``where(node)`` accepts) at ``replacement``, a function
    of the same arguments, and recompiles; returns how many calls. For dynamo's graphs, before AOTAutograd
    traces the replacement's ops."""
    n = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=target)):
        if where is None or where(node):
            node.target = replacement
            n += 1
    if n:
        gm.graph.lint()
        gm.recompile()
    return n


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def fake_mode_of(graph: fx.Graph) -> FakeTensorMode:
    from torch._guards import detect_fake_mode

    vals = [n.meta.get("val") for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    mode = detect_fake_mode(vals)
    assert mode is not None, "joint graph nodes carry no fake values"
    return mode


# rows per sample the first of two per-sample reductions keeps, and the per-
# sample size below which one reduction is fast enough (see sum_per_sample)
ROWS_PER_SAMPLE = 1024
SINGLE_PASS_LIMIT = 1 << 16


def _at_least(n: Any, k: int) -> bool:
    """n >= k for a static size; a symbolic size (a dynamic sequence length) counts as large."""
    return n >= k if isinstance(n, int) else True  # int() on a SymInt would add a guard


class GraphBuilder:
    """Inserts aten calls into a graph and fills ``meta['val']`` by running the
    op on the fake values of its arguments (so the partitioner and Inductor see
    correct shapes, dtypes and strides)."""

    def __init__(self, graph: fx.Graph, *, tag: str = "is_backward", counter: Callable[[str], None] | None = None):
        self.graph = graph
        self.fake_mode = fake_mode_of(graph)
        self.tag = tag
        self.meta_source: fx.Node | None = None
        self.counter = counter
        self.added = 0
        self._syms: dict[Any, fx.Node] | None = None
        # values a pass builds once and reads many times (clip_schedule's per-sample layouts of r and keep)
        self.memo: dict[Any, fx.Node] = {}

    # -- symbolic sizes -----------------------------------------------------------
    def _symbol_nodes(self) -> dict[Any, fx.Node]:
        if self._syms is not None:
            return self._syms
        syms: dict[Any, fx.Node] = {}
        for n in self.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
                syms.setdefault(v.node.expr, n)
        placeholders = self.graph.find_nodes(op="placeholder")
        for ph in placeholders:
            v = ph.meta.get("val")
            if not isinstance(v, torch.Tensor):
                continue
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol and size.node.expr not in syms:
                    with self.graph.inserting_after(placeholders[-1]):
                        n = self.graph.call_function(aten.sym_size.int, (ph, d))
                    n.meta["val"] = size
                    syms[size.node.expr] = n
        self._syms = syms
        return syms

    def sym_node(self, s: torch.SymInt) -> Any:
        """A graph node computing the symbolic size ``s`` (an int if it is one)."""
        import sympy
        from torch.utils._sympy.functions import FloorDiv, Max, Min

        syms = self._symbol_nodes()
        shape_env = s.node.shape_env

        def build(e):
            if e.is_Integer:
                return int(e)
            if e in syms:
                return syms[e]
            if isinstance(e, sympy.Mul):
                op = operator.mul
            elif isinstance(e, sympy.Add):
                op = operator.add
            elif isinstance(e, FloorDiv):
                op = operator.floordiv
            elif isinstance(e, (Max, Min, sympy.Max, sympy.Min)):
                # a contiguous stride over a dim that may be empty: Max(1, u0) with an unbacked batch size
                op = torch.sym_max if isinstance(e, (Max, sympy.Max)) else torch.sym_min
            else:
                raise NotImplementedError(f"dpcompile cannot rebuild the symbolic size {e}")
            parts = [build(a) for a in e.args]
            acc = parts[0]
            for p in parts[1:]:
                node = self.graph.call_function(op, (acc, p))
                va = acc.meta["val"] if isinstance(acc, fx.Node) else acc
                vp = p.meta["val"] if isinstance(p, fx.Node) else p
                node.meta["val"] = op(va, vp)
                acc = node
            syms[e] = acc
            return acc

        return build(shape_env.simplify(s.node.expr) if shape_env is not None else s.node.expr)

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        # Symbolic sizes (dynamic batch) must be graph values, not constants.
        args, kwargs = torch.utils._pytree.tree_map_only(torch.SymInt, self.sym_node, (args, kwargs))
        node = self.graph.call_function(target, args, kwargs)
        fargs, fkwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = _META_BY_SHAPE.get(target, target)(*fargs, **fkwargs)
        if self.meta_source is not None:
            for k in _CARRIED_META:
                if k in self.meta_source.meta:
                    node.meta[k] = self.meta_source.meta[k]
        if self.tag:
            node.meta["partitioner_tag"] = self.tag
        if isinstance(target, torch._ops.OpOverload):
            # what AOTAutograd records for traced nodes; Inductor names kernels after it, so the DP
            # kernels show up in profiles as e.g. triton_red_fused_mul_sum, not triton_red_fused_12
            node.meta["original_aten"] = target
        node.meta["dpcompile"] = True
        self.added += 1
        return node

    # -- conveniences -------------------------------------------------------
    def stored(self, x: fx.Node) -> fx.Node:
        """x written to a buffer of its own, not inlined into its readers.

        Inductor inlines a pointwise value into every reader, and stores a reader whose inlined reads or ops
        grow past its limits (``realize_acc_reads_threshold``, ``realize_opcount_threshold``) in that
        reader's own dtype and size. A small value that many ops went into (a per-sample scaled loss
        tangent) is best stored once: its readers stay small. A stride requirement
        makes Inductor store its input; eagerly it returns x itself (the strides are x's own).

        Strides that hold an unbacked size (samples inside the rows, with a sharded step's batch size u0:
        (3, 3*Max(1, u0), 1)) are left as they are: torch 2.11's Inductor cannot order them ("cannot determine
        truth value of Relational") and the requirement is only about where the value is stored.
        """
        stride = tuple(x.meta["val"].stride())
        if any(free_unbacked_symbols(s) for s in stride if isinstance(s, torch.SymInt)):
            return x
        return self.call(torch.ops.prims.inductor_force_stride_order.default, x, stride)

    def f32(self, x: fx.Node) -> fx.Node:
        if x.meta["val"].dtype == torch.float32:
            return x
        return self.call(torch.ops.prims.convert_element_type.default, x, torch.float32)

    def view(self, x: fx.Node, shape) -> fx.Node:
        return self.call(aten.view.default, x, list(shape))

    def reshape(self, x: fx.Node, shape) -> fx.Node:
        return self.call(aten.reshape.default, x, list(shape))

    def arange(self, n: Any, device: torch.device) -> fx.Node:
        """int64 [0, n) (prims.iota: the graph is past the decompositions that lower aten.arange)."""
        return self.call(torch.ops.prims.iota.default, n, start=0, step=1, dtype=torch.int64, device=device,
                         requires_grad=False)

    def permute(self, x: fx.Node, dims) -> fx.Node:
        dims = list(dims)
        if dims == list(range(len(dims))):
            return x
        return self.call(aten.permute.default, x, dims)

    def sq_sum_per_sample(self, x: fx.Node) -> fx.Node:
        """[B, ...] -> [B]: sum of squares in fp32."""
        x = self.f32(x)
        return self.sum_per_sample(self.call(aten.mul.Tensor, x, x))

    def sum_per_sample(self, x: fx.Node) -> fx.Node:
        """[B, ...] -> [B]: sum over everything but the leading sample dim.

        In two reductions when the per-sample tensor has more than one dim and
        at least SINGLE_PASS_LIMIT elements: first over the trailing dims,
        leaving [B, d1..dj] with d1*..*dj >= ROWS_PER_SAMPLE (or all but the
        last dim), then over those. Inductor splits a reduction with few
        outputs into parallel partial sums only when it knows the output size;
        a sharded step's batch size is unbacked, so a single sum to [B] runs
        one program per sample over the whole per-sample tensor (a [B, V, d]
        LM-head gradient took 57 ms instead of about 1 ms on an H200).
        """
        shape = list(x.meta["val"].shape)
        nd = len(shape)
        if nd == 1:
            return x
        per_sample = 1
        for n in shape[1:]:
            per_sample = per_sample * n
        if nd == 2 or not _at_least(per_sample, SINGLE_PASS_LIMIT):
            return self.call(aten.sum.dim_IntList, x, list(range(1, nd)))
        j, rows = 1, shape[1]
        while j < nd - 2 and not _at_least(rows, ROWS_PER_SAMPLE):
            j += 1
            rows = rows * shape[j]
        if self.counter is not None:
            self.counter("per_sample_two_stage_sums")
        part = self.call(aten.sum.dim_IntList, x, list(range(j + 1, nd)))
        return self.call(aten.sum.dim_IntList, part, list(range(1, j + 1)))
