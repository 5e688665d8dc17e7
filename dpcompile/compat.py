"""Fixes for older torch releases that the DP graphs run into.

A sharded step runs one graph for every batch size, so a rank with no
samples launches Inductor's Triton kernels with zero-size dims. torch 2.11's
grid for 2-D kernels whose y dim may exceed the CUDA limit divides by the
number of y-grid splits, which is 0 for an empty y dim (ZeroDivisionError
at launch). Newer torch guards it (``0 if y_grid_div_ == 0 else ...``); this
adds the same guard where it is missing. It changes nothing where torch
already has it.

torch 2.11's Triton codegen for a "mix-order" reduction (a row reduction
fused with a column reduction over the same input, e.g. a LayerNorm
backward) picks its split size from ``sizevars.size_hint(numel)``, which
raises on an unbacked batch size even when the user gave a hint
(``hint_override``); newer torch asks ``optimization_hint``, which uses the
hint. ``hint_mix_order_split`` makes the older codegen do the same.

torch 2.11's Triton codegen gives every kernel dim whose size has an unbacked
symbol the size hint 8192, hint or not (``TritonKernel.codegen_kernel``); newer
torch asks ``optimization_hint``. A sharded step's kernels were tuned as if a
rank's batch were 8192 elements (a reduction over 32 samples given configs
for 8192 rows, a pointwise kernel over millions of elements the blocks of
8192). ``hint_kernel_size_hints`` makes the older codegen ask the same as newer
torch: GPT-2 32x256 fp32 sharded on two H200s, bk's step 59.2-59.9 -> 56.5 ms.
A size hint only picks the configs a kernel is tuned over: every config is
exact for every size.

torch 2.11's scheduler scores a fusion by the bytes two nodes share, and it
scores every buffer whose size has an unbacked symbol as 0 bytes, hint or
not; a score of 0 forbids the fusion. Under an unbacked batch size almost
every buffer has one, so a LayerNorm's mean and variance, a matmul's bias and
the residual add that follows it, the softmax's max and sum each became
kernels of their own (41 launches against 12 for a two-layer GPT forward on
one H200). Newer torch scores such a buffer by its size at the hint when
every unbacked symbol in it has one (``hint_override``, which
``mark_batch(..., hint=)`` and sharded steps give); ``hint_fusion_scores``
does the same on the older scheduler. The score is a heuristic: what may be
fused is decided elsewhere, so this changes no value.

``nll_loss_nd`` (``F.cross_entropy`` / ``F.nll_loss`` on ``[N, C, d1, ...]``,
the class dim 1 form) branches on ``numel > 0`` in C++ (torch 2.11 and 2.13),
which dynamo cannot decide for an unbacked batch size: it graph-breaks inside
the loss and the DP step is split. ``size_oblivious_nll_loss_nd`` gives the op
a Python decomposition, used only while tracing (the Python dispatcher) and
only when a size of the input is unbacked: move the class dim last, flatten to
``[N * d1 * ..., C]`` with explicit sizes and take the 2-D ``nll_loss``, which
is the same per-element loss and the same reduction.

``reshape`` with a -1 of a tensor it cannot view infers the -1 in C++ with a guard that an unbacked
batch size cannot answer (``size_oblivious_reshape``: the -1 inferred in Python, where provably exact).

``F.cross_entropy`` with probability targets asks torch 2.11's C++ for a plain size of the input
(``size_oblivious_prob_cross_entropy``: torch's formula in Python while tracing).

``F.one_hot`` asks in C++ whether its input is empty (torch 2.11; ``size_oblivious_one_hot``: a comparison with
``arange`` after the range asserts, as torch 2.13 traces it).

The autograd formula of ``repeat`` asks whether each count is 1, which an unbacked count (a repeat over the
batch) cannot answer (``size_oblivious_repeat``: views and a copy, whose backward does not ask).

The autograd formula of ``torch.cumsum`` asks whether the gradient has at most one element
(``size_oblivious_cumsum``: torch's backward without the question); ``torch.roll``'s decomposition asks whether
its input is empty (``size_oblivious_roll``: torch's gather without the question where the rolled dims are known).

``F.logsigmoid``'s backward asks on CPU whether its saved buffer, of the batch's size, is empty
(``size_oblivious_log_sigmoid_backward``: asked with ``guard_or_false``, exp(-|x|) recomputed where it cannot tell).

``torch.logsumexp`` asks whether its input is empty (``size_oblivious_logsumexp``: torch's formula without the
question where no reduced dim is unbacked).

``torch.cummax`` and ``torch.cummin``'s fake kernel asks whether the input is empty before it checks the dim
(``size_oblivious_cummaxmin``: the same outputs without the question).

``torch.linalg.solve_triangular``'s fake kernel asks whether A is contiguous before whether it is conjugated
(``size_oblivious_solve_triangular``: for a real A, the answer torch's other branch gives).

A convolution of a channels-last input with an unbacked batch size: torch's stride check takes a size that
may be 0 as "not channels-last", so fake and real outputs disagreed (``size_oblivious_channels_last``: an
unbacked size taken as nonzero there); torch 2.11's fake ``convolution_backward`` lays its gradients out as
the output gradient where its kernels follow the input (``conv_backward_layout_as_input``: torch 2.13's rule).
torch's fake ``convolution`` lays its output out contiguous wherever a size is unbacked, where the kernels return
channels-last output for a channels-last input (a transformer's convolution over its tokens;
``conv_layout_of_an_unbacked_batch``: the layout torch's fake kernel gives the same strides with the batch given a
value).

torch's CPU lowering of ``bmm`` decides whether to copy an operand by comparing its fake sizes and strides,
which raises on an unbacked batch among them (XLNet's sequence-first attention, sharded through Inductor):
``hint_cpu_bmm_layouts`` makes such an operand contiguous first, so the lowering asks nothing of it.

Inductor's C++ vector codegen simplifies every index with ``sympy.simplify`` to find its strides, which ran
for more than ten minutes on one index of Funnel's with an unbacked batch size in it
(``expand_unbacked_vec_indices``: such an index is expanded instead, which gives the same value).

Inductor's reshape indexing of a view it cannot take by strides settles an equality of sizes with an
unbacked symbol by a runtime assert (torch 2.13): ``nn.MultiheadAttention``'s head split asserted that the
batch is 1 (``reshape_indexer_refuses_unbacked_guesses``: such an equality makes the indexer take its
flattened fallback, exact for every size).

torch's C++ asks of a tensor with an unbacked batch size whether it is empty, and whether its sizes exceed 1,
before telling its layout (``is_contiguous()``, ``suggest_memory_format``: under ``group_norm``, ``to(...,
memory_format=...)``, a LayerNorm's backward): a channels-last activation stopped the step
(``dpcompile.cpp_size_questions``: such a question from C++ answered size-obliviously, as torch's Python
answers its own).

An equality of an unbacked size that no integer satisfies (``3*u0 == 1``: a dim that folds the samples with
something else, asked whether it is 1) is answered false (``integer_equalities_decided``).

``F.group_norm``'s check for one value per channel asks ``size_prods == 1`` of an unbacked size
(``size_oblivious_norm_batch_check``: asked with ``guard_or_false``). Its C++ kernel then asks whether a
channels-last input (timm's PoolFormer) is channels-last, which asks whether the batch is empty, and so does
its autograd formula (``dpcompile.cpp_size_questions``: every such question torch's C++ asks of an unbacked
size, answered as torch's Python answers its own: size-obliviously).

Inductor's joint-graph constant folding asks whether a uniform tensor is contiguous, which guards on an
unbacked batch size (``uniform_fold_skips_unbacked_guards``: the folding stops there instead of the compile).

``scaled_dot_product_attention`` with an ``attn_mask`` and an unbacked batch
size: torch's C++ kernel choice asks whether the mask's batch is 1 (to
broadcast it; torch 2.11, every Hugging Face model passes such a mask), or,
for a mask of batch 1 (T5's decoder mask), whether the query's is (torch
2.13 too), which dynamo cannot decide; it graph-breaks inside the attention.
``size_oblivious_sdpa`` gives the op a Python kernel,
used only while tracing: torch's own composite wherever it traces (a dry run
on the fake inputs, outside the graph, tells), else the math attention on the
additive form of the mask, which is what torch's composite computes when it
picks the math backend.

Hugging Face ``transformers`` 5.x builds its causal mask with
``masking_utils._preprocess_mask_arguments``, which (no attention mask, no
cache: ``use_cache=False`` training) asks ``batch_size !=
position_ids.shape[0]`` to expand position ids of batch 1 to the batch. On an
unbacked batch size dynamo cannot decide that (is the batch 1?) and breaks the
step. ``hf_expand_position_ids`` expands such position ids before the call:
for a batch of 1 ``expand(1, ...)`` is the tensor itself, for any other size
it is what the function does, so the mask is the same for every batch size.

torch 2.13 types the process-group argument of the functional collectives
``Any`` (``_c10d_functional.all_gather_into_tensor(Tensor input, int
group_size, Any group_name)``: a name or a group object), and Inductor's C++
wrapper (``cpp_wrapper``) has no conversion for an ``Any`` argument, so a
sharded step with ``cpp_wrapper=True`` fails to compile ("arg type Any is not
yet supported by custom_op_wrapper"). ``cpp_wrapper_any_args`` converts an
``Any`` argument whose value in the graph is a string or a number as that
type; any other value still raises there.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import re
import sys

_done = False
_fusion_scores_done = False
_hinted: set[str] = set()  # the codegen methods _hinted_where_torch_is_older has looked at


def guard_empty_y_grid() -> None:
    global _done
    if _done:
        return
    _done = True
    try:
        from torch._inductor.runtime import triton_heuristics as th
    except ImportError:  # no Triton runtime: nothing launches Triton kernels
        return
    def wrap(original):
        def generate(self, meta, *args, **kwargs):  # (meta) in torch 2.11, (meta, is_lazy) later
            original(self, meta, *args, **kwargs)
            y = str(self.y_grid)
            if "y_grid_div_" in y and "y_grid_div_ == 0" not in y:
                self.y_grid = (f"(0 if y_grid_div_ == 0 else {y})" if getattr(self, "mode", "python") == "python"
                               else f"(y_grid_div_ == 0 ? 0 : {y})")
        return generate

    _wrap_once(getattr(th, "Grid2DWithYZOverflow", None), "generate", wrap)


def _wrap_once(owner, name: str, wrap) -> None:
    """owner.name replaced by wrap(original), once: nothing where owner or its attribute is missing, where it is
    dpcompile's wrapper already, or where wrap returns None (this version does not need it). The wrapper is
    marked (``_dpcompile_guarded``) and keeps the original (``_dpcompile_original``); a staticmethod's wrapper
    is stored as a staticmethod (wrap sees the plain function)."""
    original = inspect.getattr_static(owner, name, None) if owner is not None else None
    static = isinstance(original, staticmethod)
    if static:
        original = original.__func__
    elif original is not None:
        original = getattr(owner, name)  # bound and class methods as the attribute gives them
    if original is None or getattr(original, "_dpcompile_guarded", False):
        return
    new = wrap(original)
    if new is None:
        return
    _mark_wrapper(new, original)
    setattr(owner, name, staticmethod(new) if static else new)


def wrap_method_once(owner, name: str, wrap) -> None:
    """_wrap_once for dpcompile's other modules: owner.name replaced by wrap(original), once."""
    _wrap_once(owner, name, wrap)


def _wrap_entry_once(table: dict, key, wrap) -> bool:
    """table[key] (a registry: an op's kernels, a HOP's fake function, transformers' mask functions) replaced by
    wrap(original), once, as _wrap_once does an attribute; whether it was replaced."""
    original = table.get(key)
    if original is None or getattr(original, "_dpcompile_guarded", False):
        return False
    new = wrap(original)
    if new is None:
        return False
    _mark_wrapper(new, original)
    table[key] = new
    return True


def _mark_wrapper(new, original) -> None:
    """dpcompile's wrapper of original: marked so it is never wrapped again, the original kept."""
    new._dpcompile_guarded = True
    new._dpcompile_original = original


@contextlib.contextmanager
def unbacked_size_hints(sizevars, method: str = "size_hint"):
    """Within the block, ``sizevars.<method>`` (``size_hint``, which raises on unbacked expressions, or
    ``symbolic_hint``, which leaves them symbolic) answers an expression with unbacked symbols with
    ``optimization_hint`` (the user's hint_override, else Inductor's fallback), as newer torch asks;
    other expressions are answered as before."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    original = getattr(sizevars, method, None)

    def hint(expr, *args, **kwargs):
        if original is None or (not args and not kwargs and free_unbacked_symbols(expr)):
            return sizevars.optimization_hint(expr)
        return original(expr, *args, **kwargs)

    setattr(sizevars, method, hint)
    try:
        yield
    finally:
        delattr(sizevars, method)  # the class's method again


def _hinted_where_torch_is_older(module: str, owner: str, name: str, markers: tuple[str, ...], method: str) -> None:
    """module.owner.name runs under unbacked_size_hints(V.graph.sizevars, method) where its source still has
    every marker (the older torch's flat question); nothing where torch asks for an optimization hint already.
    Looked at once per process (the backend asks at every compile)."""
    key = f"{module}.{owner}.{name}"
    if key in _hinted:
        return
    _hinted.add(key)
    try:
        cls = getattr(importlib.import_module(module), owner)
    except (ImportError, AttributeError):
        return

    def wrap(original):
        try:
            source = inspect.getsource(original)
        except (OSError, TypeError):
            return None
        if not all(m in source for m in markers):
            return None

        def hinted(self, *args, **kwargs):
            from torch._inductor.virtualized import V

            with unbacked_size_hints(V.graph.sizevars, method):
                return original(self, *args, **kwargs)
        return hinted

    _wrap_once(cls, name, wrap)


def hint_mix_order_split() -> None:
    """On a torch whose mix-order reduction codegen asks size_hint of an unbacked size (it raises), ask it the hint."""
    _hinted_where_torch_is_older("torch._inductor.codegen.simd", "SIMDScheduling", "_codegen_mix_order_reduction",
                                 ("sizevars.size_hint(numel)",), "size_hint")


_FINAL_REDUCE = re.compile(r"^(\w+) = \w+\[.*\]\.view\(.*\)\.\w+\(dim=0\)")


def mix_order_reduction_keeps_shapes() -> None:
    """Inductor's mix-order reduction (CUDA: a LayerNorm backward's row and column reductions in one kernel)
    ends with one more reduction in the wrapper, ``buf = ws[...].view(nsplit, rnumel).sum(dim=0)``, which on
    torch 2.11 gives a flat ``[rnumel]`` tensor whatever the buffer's shape: a LayerNorm over ``[C, H, W]``
    returned its weight gradient as ``[C*H*W]`` and autograd refused it (torch 2.13 views it back). Where the
    codegen still lacks that view, its line gets ``.view(<the buffer's size>)``. Apply after
    hint_mix_order_split, which wraps the same method. Looked at once per process, as the hints are (the
    backend asks at every compile)."""
    if "mix_order_reduction_keeps_shapes" in _hinted:
        return
    _hinted.add("mix_order_reduction_keeps_shapes")
    cls = getattr(importlib.import_module("torch._inductor.codegen.simd"), "SIMDScheduling", None)
    current = getattr(cls, "_codegen_mix_order_reduction", None)
    if current is None or getattr(current, "_dpcompile_shapes_kept", False):
        return
    try:
        source = inspect.getsource(getattr(current, "_dpcompile_original", current))
    except (OSError, TypeError):
        return
    if ".view({nsplit}, {rnumel})" not in source or "final_shape" in source:
        return

    def shapes_kept(self, *args, **kwargs):
        from torch._inductor.virtualized import V

        wrapper = V.graph.wrapper_code
        writeline = wrapper.writeline

        def viewed(line):
            match = _FINAL_REDUCE.match(line) if isinstance(line, str) else None
            buffer = V.graph.get_buffer(match.group(1)) if match else None
            if buffer is not None and len(buffer.get_layout().size) != 1:
                size = ", ".join(wrapper.codegen_python_sizevar(s) for s in buffer.get_layout().size)
                line += f".view({size})"
            return writeline(line)

        wrapper.writeline = viewed
        try:
            return current(self, *args, **kwargs)
        finally:
            del wrapper.writeline  # the class's method again

    _mark_wrapper(shapes_kept, current)
    shapes_kept._dpcompile_shapes_kept = True
    cls._codegen_mix_order_reduction = shapes_kept


def hint_kernel_size_hints() -> None:
    """On a torch whose Triton codegen hints every unbacked kernel dim as 8192, hint it as newer torch does."""
    _hinted_where_torch_is_older("torch._inductor.codegen.triton", "TritonKernel", "codegen_kernel",
                                 ("size_hint = 8192", "symbolic_hint(numel)"), "symbolic_hint")


def hint_same_ordered_strides() -> None:
    """Inductor lays a buffer out in another's stride order (``FlexibleLayout.same_ordered``, where an op requires
    a stride order: a convolution's output reshaped to ``[1, B*C, H, W]`` for batch_norm) by sorting that
    layout's strides' guarding hints, which a stride holding an unbacked batch size has none of: the compile
    failed (GuardOnDataDependentSymNode). The order only chooses how a buffer Inductor allocates is laid out (any
    order is exact); where the guarding hints fail it is taken from the optimization hints (the batch's hint)."""
    if "same_ordered" in _hinted:
        return
    _hinted.add("same_ordered")
    try:
        from torch._inductor import ir
        from torch._inductor.virtualized import V
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    except ImportError:  # pragma: no cover
        return

    def wrap(original):
        def same_ordered(sizes, stride):
            try:
                return original(sizes, stride)
            except GuardOnDataDependentSymNode:
                hints = V.graph.sizevars.optimization_hints(stride)
                return ir.FlexibleLayout.fill_ordered(sizes, sorted(range(len(hints)), key=hints.__getitem__))
        return same_ordered

    _wrap_once(getattr(ir, "FlexibleLayout", None), "same_ordered", wrap)


def hint_cpu_bmm_layouts() -> None:
    """torch's CPU lowering of bmm (``kernel/bmm.py``, ``tuned_bmm``) copies an operand that is contiguous on
    neither of its last two dims, and decides that, for an operand whose layout is not fixed yet, from the FX
    node's fake value by comparing its sizes and strides: with an unbacked batch size among them (XLNet's
    attention, sharded: ``16*Max(1, u0) >= 8``) the comparison raises GuardOnDataDependentSymNode and the compile
    fails. Such an operand is made contiguous before the lowering instead (a copy where it is not: what the
    lowering would choose for most layouts), which fixes its layout, and the lowering asks nothing of it. The
    copy is exact; CPU only, where the question is asked. Nothing where the lowering does not ask (other torch
    versions)."""
    if "cpu_bmm_layouts" in _hinted:
        return
    _hinted.add("cpu_bmm_layouts")
    import torch

    try:
        from torch._inductor.kernel import bmm as bmm_module
        from torch._inductor.lowering import lowerings
        source = inspect.getsource(bmm_module.tuned_bmm)
    except (ImportError, AttributeError, OSError, TypeError):
        return
    if "is_preferred_layout_as_bmm_input" not in source or "current_node.args" not in source:
        return

    def wrap(original):
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        def lowered(mat1, mat2, *args, **kwargs):
            import torch.fx
            from torch._inductor import ir
            from torch._inductor.virtualized import V

            node = V.graph.current_node
            mats = [mat1, mat2]
            if node is not None and all(m.get_device().type == "cpu" for m in mats):
                for i, a in enumerate(node.args[:2]):
                    val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
                    if isinstance(val, torch.Tensor) and free_unbacked_symbols((*val.shape, *val.stride())):
                        mats[i] = ir.ExternKernel.require_contiguous(mats[i])
            return original(*mats, *args, **kwargs)
        return lowered

    _wrap_entry_once(lowerings, torch.ops.aten.bmm.default, wrap)


def expand_unbacked_vec_indices() -> None:
    """Inductor's C++ vector codegen asks, of every index a kernel reads or writes, its stride along a loop
    variable (``stride_at_vec_range``: ``simplify_index_in_vec_range``, then ``stride_at``), and
    settles both with ``sympy.simplify``, which rebuilds every nested function of the index and recurses into
    its arguments. With an unbacked batch size in the index (Funnel's pooled relative attention, sharded) it
    ran for more than ten minutes on one kernel. For an index with an unbacked symbol the two simplify with
    ``sympy.expand`` instead: the same value (any expression equal to the stride is what the callers may
    print), found without simplify's rewriting of every nested function; where expand leaves a stride that is
    0 or 1 unrecognised, the codegen loads by gather instead of a contiguous vector (slower, exact). Other
    indices: unchanged."""
    if "unbacked_vec_indices" in _hinted:
        return
    _hinted.add("unbacked_vec_indices")
    module = vec_index_module()
    if module is None:
        return

    def wrap(original):
        import sympy
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        try:
            source = inspect.getsource(original)
        except (OSError, TypeError):
            return None
        if "sympy.simplify(" not in source:
            return None

        def expanded(index, var, *args):
            if not free_unbacked_symbols(index):
                return original(index, var, *args)
            with _sympy_simplify_as(sympy, sympy.expand):
                return original(index, var, *args)
        return expanded

    _wrap_once(module, "simplify_index_in_vec_range", wrap)
    _wrap_once(module, "stride_at", wrap)


def vec_index_module():
    """The module whose ``stride_at_vec_range`` the C++ codegen calls, which looks its two helpers up in its own
    globals: ``torch._inductor.sizevars`` on torch 2.13, ``torch._inductor.codegen.cpp`` on 2.11; None where
    there is none."""
    try:
        from torch._inductor.codegen import cpp
    except ImportError:
        return None
    fn = getattr(cpp, "stride_at_vec_range", None)
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or not all(hasattr(module, n) for n in ("simplify_index_in_vec_range", "stride_at")):
        return None
    return module


@contextlib.contextmanager
def _sympy_simplify_as(sympy, fn):
    """sympy.simplify is fn within the block (the torch functions above call it by that attribute)."""
    original = sympy.simplify
    sympy.simplify = fn
    try:
        yield
    finally:
        sympy.simplify = original


def hint_fusion_scores(*, force: bool = False) -> None:
    """On a torch whose scheduler scores unbacked buffers 0 even when hinted, score them at the hint
    (``force``: also where torch does it itself, for tests)."""
    global _fusion_scores_done
    if _fusion_scores_done and not force:
        return
    _fusion_scores_done = True
    try:
        from torch._inductor.graph import GraphLowering
        from torch._inductor.sizevars import SizeVarAllocator
    except ImportError:
        return
    if hasattr(SizeVarAllocator, "all_unbacked_explicitly_hinted") and not force:
        return  # this torch scores hinted unbacked buffers itself

    def wrap(original):
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        def get_dep_size_hint(self, dep, count_bytes: bool = True) -> int:
            size = original(self, dep, count_bytes)
            if size:
                return size
            try:
                unbacked = free_unbacked_symbols(dep.get_numel())
                if not unbacked or not unbacked <= self.sizevars.shape_env.var_to_hint_override.keys():
                    return size
                size = dep.numbytes_hint() if count_bytes else dep.numel_hint()
            except (KeyError, NotImplementedError):  # as the original: a dep of no buffer, no layout
                return size
            self.dep_size_hint_cache[(dep, count_bytes)] = size
            return size
        return get_dep_size_hint

    _wrap_once(GraphLowering, "get_dep_size_hint", wrap)


def reshape_indexer_refuses_unbacked_guesses() -> None:
    """Inductor's reshape indexing (``View._dynamic_reshape_indexer``) of a view it cannot take by strides
    pairs the old and new dims from the right and ends each pair with ``check_equals``, which for sizes with
    an unbacked symbol adds a runtime assert instead of deciding. ``nn.MultiheadAttention``'s head split
    ``[T, u0, E] -> [T, u0 * heads, E / heads]`` pairs ``E / heads * (u0 * heads)`` with ``E`` and asserted
    ``u0 == 1``: the step failed at its first call with any other batch ("Guard failed on the same frame",
    stock ``torch.compile`` with ``mark_unbacked`` too; torch 2.13). Here such an undecidable equality raises
    ``GuardOnDataDependentSymNode``, which the indexer's callers already take as "not this way": the reshape
    goes through the flattened index (or a contiguous copy), exact for every size. A decidable one is checked
    as before."""
    try:
        import sympy
        from torch._inductor.ir import View
        from torch._inductor.virtualized import V
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols
    except ImportError:
        return

    def wrap(original):
        try:  # torch 2.11 makes a view of unbacked sizes contiguous first, and its fallback takes no such error
            if "GuardOnDataDependentSymNode" not in inspect.getsource(View.dynamic_reshape_indexer):
                return None
        except (AttributeError, OSError, TypeError):
            return None

        def _dynamic_reshape_indexer(*args, **kwargs):
            sizevars = V.graph.sizevars
            own = "check_equals" in vars(sizevars)  # an outer call's (nested lowering)
            check_equals = sizevars.check_equals

            def checked(left, right):
                if (free_unbacked_symbols(left) or free_unbacked_symbols(right)) and \
                        not sizevars.statically_known_equals(left, right):  # the cheap test first
                    raise GuardOnDataDependentSymNode(sympy.Eq(left, right))
                return check_equals(left, right)

            sizevars.check_equals = checked  # an instance attribute: this call's only
            try:
                return original(*args, **kwargs)
            finally:
                if own:
                    sizevars.check_equals = check_equals
                else:
                    del sizevars.check_equals  # the class's method again
        return _dynamic_reshape_indexer

    _wrap_once(View, "_dynamic_reshape_indexer", wrap)


def cpp_wrapper_any_args() -> None:
    try:
        import torch
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:
        return

    def wrap(original):
        def generate_py_arg(self, py_args_var, idx, raw_arg, arg_type):
            if isinstance(arg_type, torch.AnyType):
                if isinstance(raw_arg, str):
                    arg_type = torch.StringType.get()
                elif isinstance(raw_arg, (bool, int, float)):
                    arg_type = torch.NumberType.get()
            return original(self, py_args_var, idx, raw_arg, arg_type)
        return generate_py_arg

    _wrap_once(CppWrapperCpu, "generate_py_arg", wrap)


def size_oblivious_nll_loss_nd() -> None:
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    packet = getattr(torch.ops.aten, "nll_loss_nd", None)
    key = DispatchKey.CompositeImplicitAutograd
    if packet is None or key in packet.default.py_kernels:
        return
    op = packet.default

    def nll_loss_nd(self, target, weight=None, reduction=1, ignore_index=-100):
        if self.dim() < 3 or not free_unbacked_symbols(self.shape):
            return op._op_dk(key, self, target, weight, reduction, ignore_index)  # torch's own
        n, c, spatial = self.shape[0], self.shape[1], tuple(self.shape[2:])
        torch._check(target.dim() == self.dim() - 1, lambda: f"Expected target of {self.dim() - 1} dims")
        for want, got in zip((n, *spatial), target.shape):  # one check per size: no guard on a tuple
            torch._check(got == want, lambda: f"Expected target size {(n, *spatial)}, got {tuple(target.shape)}")
        rows = n
        for d in spatial:
            rows = rows * d
        flat = self.movedim(1, -1).reshape(rows, c)
        out = torch.ops.aten.nll_loss.default(flat, target.reshape(rows), weight, reduction, ignore_index)
        return out.view(target.shape) if reduction == 0 else out

    op.py_impl(key)(nll_loss_nd)


def size_oblivious_prob_cross_entropy() -> None:
    """``F.cross_entropy`` with probability targets (label smoothing written out, mixup, distillation:
    ``target`` floating point, of the input's shape) and an unbacked batch size: torch 2.11's C++ kernel
    asks for a plain size of the input (``Could not extract specialized integer from data-dependent
    expression u0``), and dynamo splits the step inside the loss; its mean also asks whether the input is
    empty. A Python kernel, used only while tracing and only for such a call, computes what torch's does:
    ``-(log_softmax(x) * t [* w])`` summed over the classes, or over everything (``sum``), or that sum over
    the number of rows (``mean``; 0/0 = nan for an empty batch, as torch gives), label smoothing applied to
    the targets first. Any other call is torch's own kernel."""
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    op = torch.ops.aten.cross_entropy_loss.default
    key = DispatchKey.CompositeImplicitAutograd
    if key in op.py_kernels:
        return

    def cross_entropy_loss(self, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
        if (not free_unbacked_symbols(self.shape) or not target.is_floating_point() or target.dim() != self.dim()
                or self.dim() == 0):
            return op._op_dk(key, self, target, weight, reduction, ignore_index, label_smoothing)  # torch's own
        for want, got in zip(self.shape, target.shape):  # one check per size: no guard on a tuple
            torch._check(got == want, lambda: f"Expected target size {tuple(self.shape)}, got {tuple(target.shape)}")
        torch._check(ignore_index < 0, lambda: "ignore_index is not supported for floating point target")
        torch._check(0.0 <= label_smoothing <= 1.0,
                     lambda: f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
        class_dim = 0 if self.dim() == 1 else 1
        n_classes = self.shape[class_dim]
        if label_smoothing > 0.0:
            target = target * (1 - label_smoothing) + label_smoothing / n_classes
        prod = torch.log_softmax(self, class_dim) * target
        if weight is not None:
            shape = [1] * self.dim()
            shape[class_dim] = n_classes
            prod = prod * weight.view(shape)
        if reduction == 0:
            return -prod.sum(class_dim)
        if reduction == 2:
            return -prod.sum()
        return -prod.sum() / (self.numel() // n_classes)

    op.py_impl(key)(cross_entropy_loss)


def size_oblivious_global_avg_pool() -> None:
    """``adaptive_avg_pool2d`` to one position (a global average pool: timm's ConvNeXt and ResNet heads,
    ``nn.AdaptiveAvgPool2d(1)``) asks in C++ whether its input is channel-last (``suggest_memory_format``),
    which guards on an unbacked batch size (``Eq(u0, 0)``, torch 2.13): dynamo breaks the graph inside the
    pool and the sharded DP step is split. A Python decomposition, used only while tracing and only when a
    size of the input is unbacked, takes the mean over the positions: the same values; its strides differ
    from eager's only in the two dims of size 1."""
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    op = torch.ops.aten.adaptive_avg_pool2d.default
    key = DispatchKey.CompositeImplicitAutograd
    if key in op.py_kernels:
        return

    def adaptive_avg_pool2d(self, output_size):
        if free_unbacked_symbols(self.shape) and all(type(s) is int and s == 1 for s in output_size):
            return self.mean((-2, -1), keepdim=True)
        return op._op_dk(key, self, output_size)  # torch's own

    op.py_impl(key)(adaptive_avg_pool2d)


def size_oblivious_reshape() -> None:
    """``reshape(..., -1, ...)`` of a tensor it cannot view (Bloom's and many attention implementations'
    ``q.transpose(1, 2).reshape(B * H, -1, D)``) infers the -1 in C++ by asking whether the other sizes'
    product is 0 (torch 2.13: ``Ne(8*u0, 0)``), which an unbacked batch size cannot answer: dynamo breaks the
    graph there and the sharded DP step is split. A Python kernel, used only while tracing and only when a
    size is unbacked, infers the -1 itself (numel // the other sizes' product, kept only where the shape
    environment proves it exact, e.g. ``64*u0 // (8*u0) = 8``) and calls torch's own with every size given.
    For an empty batch any -1 fits; the graph then uses the value every other batch size gives."""
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

    op = torch.ops.aten.reshape.default
    key = DispatchKey.CompositeImplicitAutograd
    if key in op.py_kernels:
        return

    def explicit(self, shape):
        free = [i for i, s in enumerate(shape) if type(s) is int and s == -1]
        if len(free) != 1 or not free_unbacked_symbols(self.shape):
            return shape
        known = 1
        for i, s in enumerate(shape):
            if i != free[0]:
                known = known * s
        inferred = self.numel() // known
        if not statically_known_true(inferred * known == self.numel()):
            return shape  # not provably exact: torch's own decides (and may break the graph, as before)
        return [inferred if i == free[0] else s for i, s in enumerate(shape)]

    def reshape(self, shape):
        return op._op_dk(key, self, explicit(self, list(shape)))  # torch's own, every size given

    op.py_impl(key)(reshape)


def size_oblivious_one_hot() -> None:
    """``F.one_hot(y, k)`` with an unbacked batch size (label smoothing, Dice and focal losses made in a sharded
    step): torch 2.11's C++ kernel asks whether ``y`` is empty (``numel() == 0``), which an unbacked size cannot
    answer, and dynamo splits the step there (torch 2.13 no longer asks). A Python kernel, used only while
    tracing and only when a size is unbacked and the class count is given, checks the targets' range with
    runtime asserts as torch 2.13 does and compares them with ``arange(k)``: the same int64 tensor, empty for
    an empty batch. Any other call is torch's own kernel."""
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    op = torch.ops.aten.one_hot.default
    key = DispatchKey.CompositeImplicitAutograd
    if key in op.py_kernels:
        return

    def one_hot(self, num_classes=-1):
        if num_classes < 0 or self.dtype != torch.int64 or not free_unbacked_symbols(self.shape):
            return op._op_dk(key, self, num_classes)  # torch's own
        torch._assert_async((self >= 0).all(), "Class values must be non-negative.")
        torch._assert_async((self < num_classes).all(), "Class values must be smaller than num_classes.")
        return (self.unsqueeze(-1) == torch.arange(num_classes, device=self.device)).to(torch.int64)

    op.py_impl(key)(one_hot)


def size_oblivious_repeat() -> None:
    """``x.repeat(n, ...)`` with an unbacked count (DeBERTa's relative-position projections repeated over the
    batch, ``.repeat(query.size(0) // heads, 1, 1)``): the autograd formula of ``repeat`` asks whether each
    count is 1 (torch 2.13: ``Ne(u0, 1)``), which an unbacked count cannot answer, and the compile of a sharded
    step fails, with stock ``torch.compile`` and ``mark_unbacked`` too. A Python autograd kernel, used only
    while tracing and only for an unbacked count, builds the same tensor from views and one copy
    (``[1, s0, 1, s1, ...]`` expanded to ``[r0, s0, r1, s1, ...]``, reshaped to ``[r0 * s0, ...]``), whose
    backward is a sum over the repeats with no such question; any other call is torch's own kernel."""
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    op = torch.ops.aten.repeat.default

    def repeat(self, repeats):
        repeats = list(repeats)
        if len(repeats) < self.dim() or not any(
                isinstance(r, torch.SymInt) and free_unbacked_symbols(r.node.expr) for r in repeats):
            return op._op_dk(DispatchKey.Autograd, self, repeats)  # torch's own autograd kernel
        sizes = [1] * (len(repeats) - self.dim()) + list(self.shape)
        x = self.reshape([v for s in sizes for v in (1, s)])
        x = x.expand([v for r, s in zip(repeats, sizes) for v in (r, s)])
        # the copy, as repeat's own: a reshape alone views where it can (a count of r over a dim of size 1
        # merges with it as stride 0), and the fake tensor's strides would then not be the real output's
        return x.clone(memory_format=torch.contiguous_format).view([r * s for r, s in zip(repeats, sizes)])

    _autograd_kernel_while_tracing(op, repeat)


def size_oblivious_cumsum() -> None:
    """``torch.cumsum`` with an unbacked batch size (a scan over the sequence: Mamba-2's and Bamba's segment
    sums, Qwen3-Next's gated delta rule): its autograd formula (torch 2.11 and 2.13, C++) first asks whether the
    gradient has at most one element (``40*u0 <= 1``), which an unbacked size cannot answer, and the compile of
    a sharded step fails, with stock ``torch.compile`` and ``mark_unbacked`` too. A Python autograd kernel, used
    only while tracing and only where the input's size has an unbacked symbol, applies torch's own kernel below
    autograd with torch's backward (the gradient cast to the input's dtype, cumsum'd reversed along the dim),
    without the question: for zero or one element that backward is the gradient itself, as torch's shortcut
    gives. Any other call is torch's own autograd kernel."""
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    op = torch.ops.aten.cumsum.default

    class _Cumsum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, dim, dtype):
            ctx.dim, ctx.in_dtype = dim, x.dtype
            with torch._C._AutoDispatchBelowAutograd():
                return op(x, dim, dtype=dtype)

        @staticmethod
        def backward(ctx, grad):
            g = grad.to(ctx.in_dtype)
            return g.flip(ctx.dim).cumsum(ctx.dim).flip(ctx.dim), None, None

    def cumsum(self, dim, *, dtype=None):
        if not free_unbacked_symbols(self.shape) or not self.requires_grad:
            return op._op_dk(DispatchKey.Autograd, self, dim, dtype=dtype)  # torch's own autograd kernel
        return _Cumsum.apply(self, dim, dtype)

    _autograd_kernel_while_tracing(op, cumsum)


def _autograd_kernel_while_tracing(op, kernel) -> None:
    """kernel as op's autograd kernel on CPU and CUDA, once: a Python kernel, which only the Python dispatcher
    (tracing) calls; eager calls keep torch's own."""
    from torch._C import DispatchKey

    for key in (DispatchKey.AutogradCPU, DispatchKey.AutogradCUDA):
        if key not in op.py_kernels:
            op.py_impl(key)(kernel)


def multilabel_margin_loss_stops_at_the_first_negative() -> None:
    """``F.multilabel_margin_loss``: a sample's labels are its target's entries before the first -1. torch's
    decomposition (2.11 and 2.13, which every compiled step traces, stock torch.compile too: pytorch#141017)
    masks the classes that are labels but not the target slots after the -1: each such slot reads class 0 as
    a label, and the loss and its gradient are wrong for every sample with fewer labels than classes. The same
    decomposition with those slots masked replaces it, in the kernel tracing calls and in the decomposition
    tables; eager calls keep torch's C++ kernel."""
    import torch
    from torch._C import DispatchKey

    op = torch.ops.aten.multilabel_margin_loss_forward.default

    def multilabel_margin_loss_forward(input, target, reduction):
        shape, tshape = input.shape, target.shape
        torch._check(input.dim() <= 2 and input.shape[-1] != 0 if input.dim() else False,
                     lambda: f"Expected non-empty vector or matrix with optional 0-dim batch size, but got: {shape}")
        torch._check(target.dim() <= 2 and tshape == shape,
                     lambda: f"inconsistent target size: {tshape} for input of size: {shape}")
        x, t = torch.atleast_2d(input), torch.atleast_2d(target)
        classes = x.shape[1]
        idx = torch.arange(classes, device=t.device)
        # the slots before a row's first negative entry hold its labels (the others are not read)
        first_end = torch.amin(torch.where(t < 0, idx, classes), dim=-1, keepdim=True)
        slot = idx < first_end  # [N, slots]
        labels = torch.where(slot, t, 0)
        is_target = (torch.where(slot, t, -1).unsqueeze(-1) == idx).any(1)  # [N, classes]
        u = torch.gather(x, 1, labels)  # each slot's label score
        z = (1.0 - u.unsqueeze(-1) + x.unsqueeze(1)).clamp_min(0) / classes  # [N, slots, classes]
        z = torch.where(slot.unsqueeze(-1) & ~is_target.unsqueeze(1), z, 0)
        per_sample = z.sum((1, 2))
        if reduction == 1:  # mean
            loss = per_sample.mean()
        elif reduction == 2:  # sum
            loss = per_sample.sum()
        else:
            loss = per_sample.reshape(shape[:-1])
        return loss, is_target.to(input.dtype).reshape(tshape)

    if getattr(op.py_kernels.get(DispatchKey.Autograd), "_dpcompile_guarded", False):
        return
    multilabel_margin_loss_forward._dpcompile_guarded = True
    op.py_kernels[DispatchKey.Autograd] = multilabel_margin_loss_forward
    op._dispatch_cache.clear()
    _wrap_decomposition_once(op, lambda original: multilabel_margin_loss_forward)


def gaussian_nll_loss_checks_in_graph() -> None:
    """``F.gaussian_nll_loss`` (and ``nn.GaussianNLLLoss``) checks ``if torch.any(var < 0): raise``, a branch on
    the values that dynamo cannot trace: it splits the step there, and a DP step must be one graph. While
    compiling, the same loss with that check made a runtime assertion in the graph (a negative variance still
    raises, when the step runs); eager calls keep torch's function."""
    import math

    import torch
    import torch.nn.functional as F
    from torch._guards import detect_fake_mode

    original = F.gaussian_nll_loss
    if getattr(original, "_dpcompile_guarded", False):
        return

    def gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
        # tracing: dynamo inlining this, or running it on fake tensors as one of torch's functions (torch 2.11
        # under fully_shard)
        tracing = torch.compiler.is_compiling() or detect_fake_mode((input, target, var)) is not None
        if not tracing or not isinstance(var, torch.Tensor):
            return original(input, target, var, full=full, eps=eps, reduction=reduction)
        torch._assert_async(torch.logical_not(torch.any(var < 0)), "var has negative entry/entries")
        if var.size() != input.size():
            # one dim short of the input (unsqueezed), or one dim of size 1 to broadcast; torch's cases
            if input.size()[:-1] == var.size():
                var = torch.unsqueeze(var, -1)
            elif not (input.ndim == var.ndim and
                      sum(v for i, v in zip(input.size(), var.size(), strict=True) if i != v) == 1):
                raise ValueError("var is of incorrect size")
        if reduction not in ("none", "mean", "sum"):
            raise ValueError(reduction + " is not valid")
        var = var.clone()
        with torch.no_grad():
            var.clamp_(min=eps)  # torch's clamp, out of the gradient's way
        loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
        if full:
            loss = loss + 0.5 * math.log(2 * math.pi)
        return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss

    gaussian_nll_loss._dpcompile_guarded = True
    gaussian_nll_loss.__doc__ = original.__doc__
    gaussian_nll_loss.__wrapped__ = original
    F.gaussian_nll_loss = gaussian_nll_loss


def size_oblivious_channels_last() -> None:
    """A convolution's output layout follows its input's (``suggest_memory_format``): channels-last strides in,
    channels-last out, eager and fake tensors alike. torch's Python check of the strides
    (``_prims_common.are_strides_like_channels_last_or_false``, torch 2.11 and 2.13) answers "not channels-last"
    when a size might be 0, which an unbacked batch size always might; so for a convolution reading a
    channels-last input (ConvNeXt: a LayerNorm over channels between permutes) the fake output was contiguous,
    the real one channels-last, and Inductor's stride assert stopped the step (stock ``torch.compile`` with
    ``mark_unbacked`` too). Where a size has an unbacked symbol the check is ``channels_last_strides``, which
    takes it as nonzero: the layout of an empty tensor is never read (Inductor's assert skips its strides,
    kernels touch none of it) and eager keeps an empty channels-last input channels-last. Any other shape is
    torch's own check."""
    import torch._prims_common as prims_common

    from dpcompile.batching import is_unbacked  # (batching imports this module)

    def wrap(original):
        def are_strides_like_channels_last_or_false(shape, strides):
            if len(shape) not in (4, 5) or not any(is_unbacked(s) for s in shape):
                return original(shape, strides)
            return channels_last_strides(shape, strides)
        return are_strides_like_channels_last_or_false

    _wrap_once(prims_common, "are_strides_like_channels_last_or_false", wrap)


def conv_layout_of_an_unbacked_batch() -> None:
    """A convolution's fake output with an unbacked batch size laid out as its kernel lays it out. torch's fake
    ``convolution`` (torch 2.11 and 2.13) asks the backend which layout it returns only where every size has a
    hint; with an unbacked batch it takes the meta kernel's, always contiguous, while the CPU and CUDA kernels
    return channels-last output for a channels-last input. A transformer's convolution over its tokens
    (``x.transpose(1, 2).view(B, C, H, W)``: Twins' and PVT's position convolutions, SegFormer's Mix-FFN) then
    had a contiguous fake output and a channels-last real one, and a ``flatten`` traced as a view of it failed at
    run time ("view size is not compatible"), the sharded step stopping on that rank (stock ``torch.compile``
    with ``mark_unbacked`` too). Here such a call also runs torch's own fake kernel on stand-ins of its inputs
    with the unbacked sizes given a value (2; the same strides otherwise), and where that output is not
    contiguous (channels-last), this one's dims are nested as its are. Calls without an unbacked size are torch's
    own."""
    import torch
    from torch._subclasses import fake_impls

    table = getattr(fake_impls, "op_implementations_dict", None)
    if table is None:
        return
    for op in (torch.ops.aten.convolution.default, torch.ops.aten._convolution.default):
        original = table.get(op)
        if original is None or getattr(original, "_dpcompile_guarded", False):
            continue
        conv = _conv_laid_out_as_its_kernel(original)
        _mark_wrapper(conv, original)
        table[op] = conv


def _conv_laid_out_as_its_kernel(original):
    import torch
    import torch.utils._pytree as pytree
    from dpcompile.batching import is_unbacked  # (batching imports this module)

    def unbacked(t) -> bool:
        return isinstance(t, torch.Tensor) and any(is_unbacked(s) for s in (*t.shape, *t.stride()))

    def conv(fake_mode, func, *args, **kwargs):
        out = original(fake_mode, func, *args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.dim() < 3 or \
                not any(unbacked(t) for t in pytree.tree_leaves((args, kwargs))):
            return out
        try:
            with fake_mode:
                hinted = pytree.tree_map_only(torch.Tensor, lambda t: _stand_in(t) if unbacked(t) else t,
                                              (args, kwargs))
            kernel = original(fake_mode, func, *hinted[0], **hinted[1])
        except Exception:  # noqa: BLE001 - the stand-in only refines a layout; torch's answer stands
            return out
        if kernel.is_contiguous():
            return out
        with fake_mode:  # (channels-last, or a Conv1d's channels-innermost layout where a backend returns one)
            return torch.empty_strided(out.shape, _strides_ordered_as(out.shape, kernel), dtype=out.dtype,
                                       device=out.device)

    return conv


def _strides_ordered_as(shape, like) -> list:
    """Dense strides for ``shape`` (sizes maybe symbolic) with the dims nested as in ``like`` (concrete): the dim
    of the smallest stride innermost; among equal strides the size-one dim inside, which changes no stride."""
    strides, extent = [0] * len(shape), 1
    for d in sorted(range(len(shape)), key=lambda d: (like.stride(d), like.shape[d])):
        strides[d] = extent
        extent = extent * shape[d]
    return strides


def _stand_in(t):
    """An empty tensor like ``t`` (a fake one, under its mode) with every unbacked size given the value 2 and
    every backed one its hint, in sizes and strides alike."""
    import torch

    def value(s):
        if not isinstance(s, torch.SymInt):
            return int(s)
        expr = s.node.expr
        env = s.node.shape_env  # torch 2.13 names the hints backed_var_to_val (var_to_val deprecated)
        known = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else getattr(env, "var_to_val", {})
        return int(expr.xreplace({sym: known.get(sym, 2) for sym in expr.free_symbols}))

    return torch.empty_strided([value(s) for s in t.shape], [value(s) for s in t.stride()], dtype=t.dtype,
                               device=t.device)


def conv_backward_layout_follows_input() -> bool:
    """Whether this torch's fake ``convolution_backward`` lays the input gradient out as the convolution's
    input and weight (as the CPU and GPU kernels do; torch 2.13), not as the output gradient and weight (torch
    2.11: a channels-last input with a contiguous output gradient gets a channels-last gradient for real and a
    contiguous fake one, which Inductor's stride assert stops, with an unbacked batch)."""
    try:
        import torch._meta_registrations as meta

        source = inspect.getsource(meta.meta_convolution_backward)
    except (AttributeError, OSError, TypeError):
        return True
    return "_conv_memory_format(grad_output_" not in source


def impl_overriding(lib, name: str, fn, dispatch_key: str) -> None:
    """``lib.impl(name, fn, dispatch_key)`` over a kernel torch registered from Python itself (its Meta kernels):
    ``Library.impl`` refuses that unless told to override, a keyword torch 2.13 defaults to True and torch 2.11
    to False."""
    import warnings

    override = {"allow_override": True} if "allow_override" in inspect.signature(lib.impl).parameters else {}
    with warnings.catch_warnings():  # "overriding a previously registered kernel": meant
        warnings.simplefilter("ignore")
        lib.impl(name, fn, dispatch_key, **override)


def override_meta(name: str, kernel, original):
    """Install ``kernel`` (marked as dpcompile's wrapper of ``original``) as aten ``name``'s Meta kernel, for the
    dispatcher and for tracing's Python dispatcher: the Library holding it (keep it alive), or None where torch
    refuses the override (the kernel stays torch's)."""
    import torch
    from torch._C import DispatchKey

    _mark_wrapper(kernel, original)
    lib = torch.library.Library("aten", "IMPL")
    try:
        impl_overriding(lib, name, kernel, "Meta")
    except RuntimeError:
        lib._destroy()
        return None
    op = getattr(torch.ops.aten, name).default
    op.py_kernels[DispatchKey.Meta] = kernel
    op._dispatch_cache.clear()
    return lib


_conv_backward_meta_lib = None  # the Library holding conv_backward_layout_as_input's Meta kernel (kept alive)


def conv_backward_layout_as_input(*, force: bool = False) -> None:
    """On a torch whose fake ``convolution_backward`` lays the input and weight gradients out as the output
    gradient (torch 2.11; ``conv_backward_layout_follows_input``), lay them out as the kernels do: channels-last
    where the input or the weight is (torch 2.13's rule, pytorch/pytorch#171622). A fixed batch size never
    reaches this (the fake kernel asks the real backend's choice); a graph with an unbacked batch size does, and
    a channels-last input with a contiguous output gradient (ConvNeXt) then got a contiguous fake gradient, a
    channels-last real one, and Inductor's stride assert. ``force``: also where torch has the rule (tests)."""
    global _conv_backward_meta_lib
    if _conv_backward_meta_lib is not None or (conv_backward_layout_follows_input() and not force):
        return
    import warnings

    import torch
    import torch._prims_common as prims_common
    from torch._C import DispatchKey

    op = torch.ops.aten.convolution_backward.default
    original = op.py_kernels.get(DispatchKey.Meta)
    if original is None:
        return

    def layout(input, weight):
        formats = {prims_common.suggest_memory_format(input), prims_common.suggest_memory_format(weight)}
        for fmt in (torch.channels_last, torch.channels_last_3d):
            if fmt in formats:
                return fmt
        return torch.contiguous_format

    def convolution_backward(grad_output, input, weight, *args, **kwargs):
        grads = original(grad_output, input, weight, *args, **kwargs)
        fmt = layout(input, weight)
        return tuple(g if g is None or i == 2 else g.to(memory_format=fmt) for i, g in enumerate(grads))

    _mark_wrapper(convolution_backward, original)
    lib = torch.library.Library("aten", "IMPL")
    try:
        impl_overriding(lib, "convolution_backward", convolution_backward, "Meta")  # the C++ dispatcher's
    except RuntimeError as err:  # the rule stays torch's: only an unbacked batch with mixed layouts meets it
        warnings.warn(f"dpcompile could not install torch 2.13's convolution_backward layout rule: {err}",
                      stacklevel=2)
        lib._destroy()
        return
    _conv_backward_meta_lib = lib
    op.py_kernels[DispatchKey.Meta] = convolution_backward  # what the Python dispatcher (tracing) calls
    op._dispatch_cache.clear()


_solve_triangular_meta_lib = None  # the Library holding size_oblivious_solve_triangular's Meta kernel (kept alive)


def size_oblivious_solve_triangular() -> None:
    """``torch.linalg.solve_triangular`` (Qwen3-Next's gated delta rule) with an unbacked batch size: torch's
    fake kernel (torch 2.11 and 2.13) first asks whether A's transpose is contiguous, and only then whether A
    is conjugated, so a real A still gets a question about its size (``Eq(50*u0, 0)``) that an unbacked one
    cannot answer: dynamo splits the step there. For a real A (never conjugated) the answer is torch's other
    branch: the broadcast right-hand side's shape, column-major, as the kernel returns it. A complex A, and
    every call without an unbacked size, is torch's own."""
    global _solve_triangular_meta_lib
    if _solve_triangular_meta_lib is not None:
        return
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    op = torch.ops.aten.linalg_solve_triangular.default
    original = op.py_kernels.get(DispatchKey.Meta)
    if original is None:
        return
    meta = importlib.import_module("torch._meta_registrations")
    broadcast = getattr(meta, "_linalg_broadcast_batch_dims_name", None)
    if broadcast is None:
        return

    def linalg_solve_triangular(A, B, *, upper, left=True, unitriangular=False):
        if A.is_complex() or not (free_unbacked_symbols(A.shape) or free_unbacked_symbols(B.shape)):
            return original(A, B, upper=upper, left=left, unitriangular=unitriangular)
        B_, _ = broadcast(B, A, None)
        return B_.new_empty(B_.transpose(-2, -1).shape).transpose(-2, -1)

    # only an unbacked batch meets the question: where torch refuses the override its kernel stays
    _solve_triangular_meta_lib = override_meta("linalg_solve_triangular", linalg_solve_triangular, original)


_cummaxmin_meta_lib = None  # the Libraries holding size_oblivious_cummaxmin's Meta kernels (kept alive)


def size_oblivious_cummaxmin() -> None:
    """``torch.cummax`` / ``torch.cummin`` (a running maximum along a sequence) with an unbacked batch size: torch's
    fake kernel (torch 2.11 and 2.13) asks whether the input is empty (``Eq(12*u0, 0)``) before it checks the dim,
    which an unbacked size cannot answer: dynamo splits the step there. The outputs (values and int64 indices of
    the input's shape) do not depend on the answer, and the dim is checked either way. Every call without an
    unbacked size is torch's own."""
    global _cummaxmin_meta_lib
    if _cummaxmin_meta_lib is not None:
        return
    import torch
    from torch._C import DispatchKey
    from torch._prims_common import canonicalize_dim
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    libs = []
    for name in ("cummax", "cummin"):
        original = getattr(torch.ops.aten, name).default.py_kernels.get(DispatchKey.Meta)
        if original is None:
            continue

        def kernel(self, dim, original=original):
            if not free_unbacked_symbols(self.shape):
                return original(self, dim)
            canonicalize_dim(self.ndim, dim)  # raises on a dim out of range, as torch's check
            return (torch.empty(self.shape, device=self.device, dtype=self.dtype),
                    torch.empty(self.shape, device=self.device, dtype=torch.int64))

        libs.append(override_meta(name, kernel, original))  # None where torch keeps its kernel
    _cummaxmin_meta_lib = libs


_lu_solve_meta_lib = None  # the Library holding size_oblivious_lu_solve's Meta kernel (kept alive)


def size_oblivious_lu_solve() -> None:
    """``torch.linalg.lu_solve`` with an unbacked batch size, which ``linalg.solve``'s and ``linalg.det``'s
    backwards run: torch's fake kernel (torch 2.11 and 2.13) makes the result, then asks whether it is empty
    (``Ne(5*u0, 0)``) before it asks whether the solve is from the right of a complex matrix (to conjugate it).
    An unbacked size cannot answer, and dynamo splits the step there. For real operands the result is the
    same either way: the broadcast right-hand side's shape, column-major for a left solve. A complex one, and
    every call without an unbacked size, is torch's own (the kernel that runs checks the operands as ever)."""
    global _lu_solve_meta_lib
    if _lu_solve_meta_lib is not None:
        return
    import torch
    from torch._C import DispatchKey
    from torch._prims_common import make_contiguous_strides_for
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    op = torch.ops.aten.linalg_lu_solve.default
    original = op.py_kernels.get(DispatchKey.Meta)
    broadcast = getattr(importlib.import_module("torch._meta_registrations"), "_linalg_broadcast_batch_dims", None)
    if original is None or broadcast is None:
        return

    def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
        if LU.is_complex() or B.is_complex() or not (free_unbacked_symbols(LU.shape) or
                                                     free_unbacked_symbols(B.shape)):
            return original(LU, pivots, B, left=left, adjoint=adjoint)
        size, _ = broadcast(B, LU)
        return torch.empty_strided(size, make_contiguous_strides_for(size, row_major=not left), dtype=B.dtype,
                                   device=B.device)

    # only an unbacked batch meets the question: where torch refuses the override its kernel stays
    _lu_solve_meta_lib = override_meta("linalg_lu_solve", linalg_lu_solve, original)


_cdist_backward_meta_lib = None  # the Library holding size_oblivious_cdist_backward's Meta kernel (kept alive)


def size_oblivious_cdist_backward() -> None:
    """``torch.cdist``'s backward with an unbacked batch size (samples' distances to centres or prototypes):
    torch's fake kernel (torch 2.11 and 2.13) asks whether any size is zero (``Eq(u0, 0)``), to return zeros of x1's
    layout, which an unbacked size cannot answer: dynamo splits the step there. x1's gradient has the broadcast
    x1's shape either way, and an empty one holds no value; every call without an unbacked size is torch's own."""
    global _cdist_backward_meta_lib
    if _cdist_backward_meta_lib is not None:
        return
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    original = torch.ops.aten._cdist_backward.default.py_kernels.get(DispatchKey.Meta)
    if original is None:
        return

    def cdist_backward(grad, x1, x2, p, cdist):
        if not any(free_unbacked_symbols(t.shape) for t in (grad, x1, x2, cdist)):
            return original(grad, x1, x2, p, cdist)
        size = [*torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2]), *x1.shape[-2:]]
        return x1.new_empty(size)

    _cdist_backward_meta_lib = override_meta("_cdist_backward", cdist_backward, original)


def channels_last_strides(shape, strides) -> bool:
    """Whether 4-d (5-d) strides are NHWC (NDHWC): channels innermost, then the spatial dims from the last, the
    batch outermost, each dim's stride at least the extent of the dims inside it; spatial dims spanning no more
    than the channels' stride are size one, ambiguous, and not channels-last. What cannot be decided is not
    channels-last, except that a size with an unbacked symbol is taken as nonzero."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

    from dpcompile.batching import is_unbacked  # (batching imports this module)

    if len(shape) not in (4, 5) or guard_or_true(strides[1] == 0):
        return False
    extent = 0
    for d in [1, *range(len(shape) - 1, 1, -1), 0]:
        if (guard_or_false if is_unbacked(shape[d]) else guard_or_true)(shape[d] == 0):
            return False
        if guard_or_true(strides[d] < extent) or (d == 0 and guard_or_true(extent == strides[1])):
            return False
        extent = strides[d] * shape[d]
    return True


def size_oblivious_norm_batch_check() -> None:
    """``F.group_norm`` (and instance and batch norm) first checks in Python that there is more than one value
    per channel (``_verify_batch_size``: ``size_prods == 1`` raises), which for an unbacked batch size is a
    question dynamo cannot decide (torch 2.13, wav2vec2's feature encoder: ``Eq(39*u0, 1)``): the sharded step
    is split at the norm. The same check asked with ``guard_or_false``: a batch size known when tracing gets
    the same answer and the same ValueError as before; an unbacked one is taken as not making a single value
    (a rank with 1 sample still has many values per channel wherever the other sizes are not all 1)."""
    import torch.nn.functional as F

    def wrap(original):
        from torch.fx.experimental.symbolic_shapes import guard_or_false

        def _verify_batch_size(size):
            size_prods = size[0]
            for i in range(len(size) - 2):
                size_prods *= size[i + 2]
            if guard_or_false(size_prods == 1):
                raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")
        return _verify_batch_size

    _wrap_once(F, "_verify_batch_size", wrap)


def size_oblivious_cdist_mode() -> None:
    """``torch.cdist`` with p = 2 picks its kernel in C++ by the rows' count (matrix products where either side has
    more than 25 rows), a question an unbacked batch size cannot answer: dynamo split the step there (and on a
    sharded step's batch bounded below by 1 the split frame kept a guard that fails on an empty rank). The same
    choice asked with ``guard_or_false`` and passed as ``compute_mode``: sizes known when tracing get torch's
    choice; an unbacked batch counts as at most 25 rows, so the other operand's rows decide (more than 25 centres:
    matrix products, as eager takes them from 26 samples on; both kernels compute the same distances)."""
    import torch
    import torch.functional

    def wrap(original):
        from torch.fx.experimental.symbolic_shapes import guard_or_false

        def cdist(x1, x2, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary"):
            if compute_mode == "use_mm_for_euclid_dist_if_necessary" and p == 2:
                many = guard_or_false(x1.shape[-2] > 25) or guard_or_false(x2.shape[-2] > 25)
                compute_mode = "use_mm_for_euclid_dist" if many else "donot_use_mm_for_euclid_dist"
            return original(x1, x2, p, compute_mode)
        return cdist

    _wrap_once(torch.functional, "cdist", wrap)
    torch.cdist = torch.functional.cdist


def _affine_grid_by_ops(theta, spatial: list, align_corners: bool):
    """``torch.affine_grid_generator(theta, [N, C, *spatial], align_corners)`` as plain ops: every output
    point's normalised coordinates (x fastest, then y, then z; each from -1 to 1 at the corners' centres, or
    at the corners with align_corners; 0 for a size of one), with a trailing 1, times each sample's matrix."""
    import torch

    def axis(n: int):
        if n <= 1:
            return torch.zeros(max(n, 0), dtype=theta.dtype, device=theta.device)
        end = 1.0 if align_corners else (n - 1) / n
        return torch.linspace(-end, end, n, dtype=theta.dtype, device=theta.device)

    axes = torch.meshgrid(*[axis(int(n)) for n in spatial], indexing="ij")  # z, y, x (or y, x)
    points = torch.stack([*reversed(axes), torch.ones_like(axes[0])], dim=-1)  # [*spatial, k + 1]: x, y(, z), 1
    k = len(spatial)
    grid = (points.reshape(1, -1, 1, k + 1) * theta.unsqueeze(1)).sum(-1)  # [N, prod(spatial), k]
    return grid.reshape(theta.shape[0], *spatial, k)


def size_oblivious_affine_grid() -> None:
    """``F.affine_grid`` (spatial transformers) refuses a size that is not positive with ``min(size) <= 0``,
    which with an unbacked batch size compares it with the others (``u0 > 3``): dynamo splits the sharded step
    there. The same checks, each size asked with ``guard_or_false``: a size known when tracing gets torch's
    answer and its ValueError, an unbacked batch size is not refused, and a rank with no samples takes an
    empty grid (no matrices, no grid, no gradient), which eager ``F.affine_grid`` refuses to make. Under
    ``torch.compile`` the grid is made of plain ops (``_affine_grid_by_ops``: the generator's autograd formula
    takes only sizes known when tracing, and dynamo 2.11 cannot trace torch's decomposition of it). A tensor
    subclass's call (``__torch_function__``) and the default ``align_corners`` (torch's warning) are torch's
    own."""
    import torch
    import torch.nn.functional as F
    from torch.fx.experimental.symbolic_shapes import guard_or_false
    from torch.overrides import has_torch_function_unary

    def wrap(original):
        def affine_grid(theta, size, align_corners=None):
            if align_corners is None or has_torch_function_unary(theta) or len(size) not in (4, 5):
                return original(theta, size, align_corners)
            if not theta.is_floating_point():
                raise ValueError(f"Expected theta to have floating point type, but got {theta.dtype}")
            rows, cols = (2, 3) if len(size) == 4 else (3, 4)
            if theta.dim() != 3 or theta.shape[-2] != rows or theta.shape[-1] != cols:
                raise ValueError(f"Expected a batch of {len(size) - 2}D affine matrices of shape Nx{rows}x{cols} "
                                 f"for size {size}. Got {theta.shape}.")
            if align_corners and min(size[2:]) == 1:
                return original(theta, size, align_corners)  # torch's warning for unit-size grids
            if any(guard_or_false(s <= 0) for s in size):
                raise ValueError(f"Expected non-zero, positive output size. Got {size}")
            if torch.compiler.is_compiling():
                # the generator's autograd formula takes only sizes known when tracing (not a symbolic batch
                # size): the grid as plain ops
                return _affine_grid_by_ops(theta, list(size[2:]), align_corners)
            return torch.affine_grid_generator(theta, size, align_corners)
        return affine_grid

    _wrap_once(F, "affine_grid", wrap)


def size_oblivious_log_sigmoid_backward() -> None:
    """``F.logsigmoid``'s backward (DPO's loss, ``F.multilabel_soft_margin_loss``) decomposes (torch 2.11 and
    2.13) as ``z = buffer if buffer.numel() > 0 else exp(-|x|)``: on CPU the forward saves ``buffer = exp(-|x|)``,
    of the input's size, so the question is about the batch size, which an unbacked one cannot answer
    (GuardOnDataDependentSymNode ``4*u0 > 0``): a sharded step with ``compiler="eager"`` failed to compile on
    CPU (CUDA, and Inductor's decomposition of the forward, save an empty buffer: nothing is asked). The same
    decomposition, the question asked with ``guard_or_false``: where it cannot tell, it recomputes exp(-|x|),
    the values the CPU forward saved; a size known when tracing gets the same answer as before."""
    import torch
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    def wrap(original):
        def log_sigmoid_backward(grad_output, self, buffer):
            # an empty buffer makes the original recompute exp(-|x|): no question about the size
            return original(grad_output, self,
                            buffer if guard_or_false(buffer.numel() > 0) else buffer.new_empty(0))
        return log_sigmoid_backward

    _wrap_decomposition_once(torch.ops.aten.log_sigmoid_backward.default, wrap)


def size_oblivious_logsumexp() -> None:
    """``torch.logsumexp`` (a z-loss, an MoE router's z-loss, contrastive and CRF losses) with an unbacked batch
    size: torch's decomposition (``torch._refs.logsumexp``, torch 2.11 and 2.13), which fake tensors and Inductor
    run, first asks whether the input is empty (``Eq(3*u0, 0)``), which an unbacked size cannot answer: dynamo
    splits the step there. Its formula without the question, where no reduced dim has an unbacked size: a
    reduction over the other dims is the same for an empty batch (an empty result, as torch's empty branch
    gives). A reduction over an unbacked dim, and every call without one, is torch's own. Replaced in torch's
    decomposition table and in Inductor's copy of it."""
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def wrap(original):
        def logsumexp(self, dim, keepdim=False):
            dims = [d % max(self.dim(), 1) for d in (dim if isinstance(dim, (list, tuple)) else (dim,))]
            if not free_unbacked_symbols(self.shape) or not dims or \
                    any(free_unbacked_symbols(self.shape[d]) for d in dims) or self.is_complex():
                return original(self, dim, keepdim)
            if not self.is_floating_point():  # INT_TO_FLOAT, as torch's
                self = self.to(torch.get_default_dtype())
            maxes = torch.amax(self, dims, keepdim=True)
            maxes = torch.masked_fill(maxes, maxes.abs() == float("inf"), 0)
            maxes_squeezed = maxes if keepdim else torch.squeeze(maxes, dims)
            return torch.sum(torch.exp(self - maxes), dims, keepdim).log().add(maxes_squeezed)
        return logsumexp

    _wrap_decomposition_once(torch.ops.aten.logsumexp.default, wrap)


def size_oblivious_roll() -> None:
    """``torch.roll`` with an unbacked batch size (a shift along the sequence or the channels, token shift in
    RWKV-like mixers): torch's decomposition (``torch._refs.roll``, torch 2.11 and 2.13), which fake tensors and
    Inductor run, first asks whether the input is empty (``Eq(40*u0, 0)``), which an unbacked size cannot
    answer: dynamo splits the step there. Where every rolled dim has a size known when tracing, the same gather
    torch's formula takes (``index_select`` at ``(start + arange(size)) % size``, dim by dim), without the
    question: an empty batch gives an empty result, as torch's empty branch does. A roll of an unbacked dim, a
    flattened roll and every call without an unbacked size are torch's own."""
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def wrap(original):
        def roll(a, shifts, dims=()):
            shifts = tuple(shifts) if isinstance(shifts, (list, tuple)) else (shifts,)
            dims = tuple(dims) if isinstance(dims, (list, tuple)) else (dims,)
            if not free_unbacked_symbols(a.shape) or a.dim() == 0 or not dims or len(shifts) != len(dims) or \
                    any(free_unbacked_symbols(a.shape[d]) or isinstance(s, torch.SymInt)
                        for s, d in zip(shifts, dims)):
                return original(a, shifts, dims)
            out = a
            for shift, dim in zip(shifts, dims):
                size = int(a.shape[dim])
                if size == 0:
                    return a.clone()
                index = torch.fmod((size - shift) % size + torch.arange(size, device=a.device), size)
                out = out.index_select(dim, index)
            return out if out is not a else a.clone()
        return roll

    _wrap_decomposition_once(torch.ops.aten.roll.default, wrap)


def fft_out_strides(in_strides, out_sizes, dim) -> tuple[list, object]:
    """The strides torch's FFT kernels give their output (and its number of entries): the batch dims (those
    not transformed) in the input's stride order, then the transformed dims in ``dim``'s order, contiguous in
    that order (aten/src/ATen/native/mkl/SpectralOps.cpp, _exec_fft)."""
    batch = [d for d in range(len(out_sizes)) if d not in dim]
    order = sorted(batch, key=lambda d: in_strides[d], reverse=True) + list(dim)
    out_strides, step = [0] * len(out_sizes), 1
    for d in reversed(order):
        out_strides[d] = step
        step = step * out_sizes[d]
    return out_strides, step


def size_oblivious_fft() -> None:
    """torch.fft with an unbacked batch size (a transform along the sequence or the features only: FNet-style
    mixers, spectral layers): the fake-tensor kernels of ``aten._fft_r2c/_fft_c2c/_fft_c2r`` (torch 2.11 and
    2.13, ``torch._meta_registrations._exec_fft``) lay the output out by resizing it to the batch dims
    collapsed into one (``out.resize_``), which asks whether that size is 0 (``Eq(18*u0, 0)``): dynamo
    splits the step there. Where the output already holds exactly those entries (fake kernels make it with
    the output's sizes), its strides are set directly: the collapsed layout's contiguous strides spread back
    over the permuted dims, as torch's formula does after the resize. Transforms with no unbacked size, and
    outputs of another size (cuFFT's two-sided r2c), take torch's own path."""
    import torch
    import torch._meta_registrations as meta
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true

    original = getattr(meta, "_exec_fft", None)
    if original is None or getattr(original, "_dpcompile_guarded", False):
        return

    def exec_fft(out, self, out_sizes, dim, *, forward):
        if not (free_unbacked_symbols(self.shape) or free_unbacked_symbols(out.shape)):
            return original(out, self, out_sizes, dim, forward=forward)
        out_strides, numel = fft_out_strides(self.stride(), out_sizes, dim)
        if not statically_known_true(out.numel() == numel):
            return original(out, self, out_sizes, dim, forward=forward)
        out.as_strided_(out_sizes, out_strides, out.storage_offset())
        return out

    _mark_wrapper(exec_fft, original)
    meta._exec_fft = exec_fft


def _wrap_decomposition_once(op, wrap) -> None:
    """op's decomposition replaced by wrap(original), once, in torch's table and in Inductor's copy of it (the
    decomposition tables' _wrap_once): nothing where torch has none or where it is dpcompile's wrapper already."""
    from torch._decomp import decomposition_table

    original = decomposition_table.get(op)
    if original is None or getattr(original, "_dpcompile_guarded", False):
        return
    new = wrap(original)
    _mark_wrapper(new, original)
    tables = [decomposition_table]
    try:
        from torch._inductor import decomposition as inductor_decomposition

        tables.append(inductor_decomposition.decompositions)
    except ImportError:  # no Inductor: torch's table only
        pass
    for table in tables:
        if table.get(op) is original:
            table[op] = new


def integer_equalities_decided() -> None:
    """The shape environment answers ``a == b`` (and ``!=``) of integer polynomials that no integers can make
    equal: ``3*u0 == 1`` has no integer solution, whatever u0. torch decides equalities of unbacked sizes by
    their value ranges only (u0 in [0, inf) allows 3*u0 to be 1), so such a question raised
    GuardOnDataDependentSymNode: Inductor's CPU matmul lowering asks whether a dim is 1, and with samples folded
    into it (Funnel's attention, ``[3*B, ...]``) a sharded step failed to compile. Where the gcd of the
    non-constant coefficients does not divide the constant, the equality is false for every integer value, so
    the answer holds for every batch size: no guard and no runtime assert is needed. Anything else is left to
    torch as before."""
    try:
        import functools
        import math

        import sympy
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
    except ImportError:
        return

    # cached: Inductor asks statically_known_* of the same undecided equalities many times, and a Poly is slow
    @functools.lru_cache(maxsize=4096)
    def no_integer_solution(diff) -> bool:
        symbols = diff.free_symbols
        if not symbols or not all(s.is_integer for s in symbols):
            return False
        try:
            terms = sympy.Poly(diff, *sorted(symbols, key=str)).terms()
        except sympy.PolynomialError:  # FloorDiv, Mod, ...: not a polynomial
            return False
        g, const = 0, 0
        for monom, coeff in terms:
            if not coeff.is_integer:
                return False
            if any(monom):
                g = math.gcd(g, int(coeff))
            else:
                const = int(coeff)
        return g > 1 and const % g != 0

    def wrap(original):
        def _maybe_evaluate_static(self, expr, *args, **kwargs):
            out = original(self, expr, *args, **kwargs)
            if out is None and isinstance(expr, (sympy.Eq, sympy.Ne)) and no_integer_solution(expr.lhs - expr.rhs):
                return sympy.false if isinstance(expr, sympy.Eq) else sympy.true
            return out

        if hasattr(original, "cache_clear"):  # ShapeEnv clears the original's cache when it learns new facts
            _maybe_evaluate_static.cache_clear = original.cache_clear
        return _maybe_evaluate_static

    _wrap_once(ShapeEnv, "_maybe_evaluate_static", wrap)


def dynamo_config_logging_takes_functions() -> None:
    """dynamo logs its settings with every compile's metrics, sorting each set-valued setting; torch 2.11 leaves
    ``ignore_logging_functions`` (the new name of ``ignore_logger_methods``) off its list of sets not to log,
    so once it holds functions (a DP step's frames ignore transformers' logging calls: step_frames) the sort
    raised and every compile logged "Unexpected exception logging compilation metrics" with a traceback. The
    settings' entry of the metrics is then left out (None, as torch does where it has none); torch 2.13
    skips that set itself."""
    try:
        from torch._dynamo import utils as dynamo_utils
    except ImportError:  # pragma: no cover
        return

    def wrap(original):
        def _get_dynamo_config_for_logging():
            try:
                return original()
            except TypeError:  # a set of functions cannot be sorted
                return None
        return _get_dynamo_config_for_logging

    _wrap_once(dynamo_utils, "_get_dynamo_config_for_logging", wrap)


def uniform_fold_skips_unbacked_guards() -> None:
    """Inductor's joint-graph pass ``constant_fold_uniform_value`` replaces a tensor of one repeated value by a
    ``full`` call, after asking whether it is contiguous; for a tensor with an unbacked batch size (BART's and
    T5's attention masks in a sharded step) that question guards (torch 2.13: ``Eq(u0, 1) | Eq(5*u0, 0)``) and
    the whole compile fails, with stock ``torch.compile`` and ``mark_unbacked`` too. The pass only folds
    constants (each replacement is whole before the next begins), so where it meets such a guard the rest of
    its folding is left undone and the graph, correct as it stands, goes on to the next pass."""
    try:
        from torch._inductor.fx_passes import joint_graph
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    except ImportError:  # pragma: no cover
        return

    def wrap(original):
        def constant_fold_uniform_value(gm):
            try:
                return original(gm)
            except GuardOnDataDependentSymNode:
                gm.graph.lint()
                return None
        return constant_fold_uniform_value

    _wrap_once(joint_graph, "constant_fold_uniform_value", wrap)


def size_oblivious_sdpa() -> None:
    import torch
    from torch._C import DispatchKey
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols

    op = torch.ops.aten.scaled_dot_product_attention.default
    key = DispatchKey.CompositeImplicitAutograd
    if key in op.py_kernels:
        return

    def torch_own(*args, scale=None, enable_gqa=False):
        return op._op_dk(key, *args, scale=scale, enable_gqa=enable_gqa)

    def choice_guards(*args, **kwargs) -> bool:
        with disable_proxy_modes_tracing():  # a dry run: nothing of it reaches the graph
            try:
                torch_own(*args, **kwargs)
            except GuardOnDataDependentSymNode:
                return True
        return False

    def sdpa(query, key_, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        args = (query, key_, value, attn_mask, dropout_p, is_causal)
        # a mask of batch 1 (T5's decoder mask) asks whether the query's unbacked batch is 1 as well
        unbacked = attn_mask is not None and any(free_unbacked_symbols(t.shape)
                                                 for t in (query, key_, value, attn_mask))
        if (not unbacked or not _SDPA_FALLBACK["always"]
                and not choice_guards(*args, scale=scale, enable_gqa=enable_gqa)):
            return torch_own(*args, scale=scale, enable_gqa=enable_gqa)
        _SDPA_FALLBACK["traced"] += 1
        if attn_mask.dtype == torch.bool:  # True = attend, as torch's composite converts it for every backend
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
        return torch.ops.aten._scaled_dot_product_attention_math.default(
            query, key_, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]

    op.py_impl(key)(sdpa)


# "always": tests set it to check the math path on a torch that does not need it; "traced": how often it ran
_SDPA_FALLBACK = {"always": False, "traced": 0}


_HF_SEEN: set = set()  # transformers functions already looked at (patched or not needing it)


def hf_expand_position_ids() -> None:
    """Installs the position-id expansion in front of transformers' mask pre-processing (module doc);
    nothing when transformers is not imported or its function does not ask that question."""
    def wrap(original):
        if original in _HF_SEEN:
            return None
        _HF_SEEN.add(original)  # looked at once (mark_batch calls this every step)
        try:
            source = inspect.getsource(original)
            names = list(inspect.signature(original).parameters)
        except (OSError, TypeError, ValueError):
            return None
        if "batch_size != position_ids.shape[0]" not in source or "inputs_embeds" not in names \
                or "position_ids" not in names:
            return None
        i_embeds, i_pos = names.index("inputs_embeds"), names.index("position_ids")

        def preprocess_mask_arguments(*args, **kwargs):
            args = list(args)
            embeds = args[i_embeds] if len(args) > i_embeds else kwargs.get("inputs_embeds")
            pos = args[i_pos] if len(args) > i_pos else kwargs.get("position_ids")
            if pos is not None and embeds is not None and pos.dim() == 2 and isinstance(pos.shape[0], int) \
                    and pos.shape[0] == 1:
                pos = pos.expand(embeds.shape[0], -1)
                if len(args) > i_pos:
                    args[i_pos] = pos
                else:
                    kwargs["position_ids"] = pos
            return original(*args, **kwargs)

        preprocess_mask_arguments.__wrapped__ = original  # type: ignore[attr-defined]
        return preprocess_mask_arguments

    _wrap_once(sys.modules.get("transformers.masking_utils"), "_preprocess_mask_arguments", wrap)


def hf_flex_padding_mask() -> None:
    """transformers' ``flex_attention_mask`` adds the padding mask only when the attention mask has a zero
    (``if attention_mask is not None and not fast_all(attention_mask)``): a branch on data, where dynamo breaks
    the step (stock torch.compile too), which dp_fsdp refuses. While compiling, the wrapper adds the padding mask
    whatever its values (an all-ones mask keeps every position it was keeping: the same block mask) and passes
    no attention mask on, so the branch is not taken. It then calls ``create_block_mask(..., _compile=True)``,
    whose deprecation warning dynamo breaks the step at (torch 2.13): while compiling, masking_utils'
    create_block_mask runs without ``_compile`` (the step's compile compiles it anyway). Nothing when
    transformers is not imported or its function is not of that form."""
    mu = sys.modules.get("transformers.masking_utils")
    mapping = getattr(getattr(mu, "AttentionMaskInterface", None), "_global_mapping", None)
    if isinstance(mapping, dict):
        _wrap_entry_once(mapping, "flex_attention", lambda original: _padding_always_added(mu, original))


def _padding_always_added(mu, original):
    """hf_flex_padding_mask's wrapper of transformers' flex_attention_mask, or None where it is not of the form
    the wrapper knows (looked at once)."""
    if original in _HF_SEEN:
        return None
    _HF_SEEN.add(original)
    try:
        source = inspect.getsource(original)
        signature = inspect.signature(original)
    except (OSError, TypeError, ValueError):
        return None
    if "not fast_all(attention_mask)" not in source or \
            "prepare_padding_mask(attention_mask, kv_length, kv_offset)" not in source or \
            not {"attention_mask", "mask_function", "kv_length", "kv_offset"} <= set(signature.parameters):
        return None

    def flex_attention_mask(*args, **kwargs):
        import torch

        if not torch.compiler.is_compiling():
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if a["attention_mask"] is not None:
            padding = mu.prepare_padding_mask(a["attention_mask"], a["kv_length"], a["kv_offset"])
            a["mask_function"] = mu.and_masks(a["mask_function"], mu.padding_mask_function(padding))
            a["attention_mask"] = None
        return original(*bound.args, **bound.kwargs)

    def uncompiled(create_block_mask):
        def create_block_mask_in_the_step(*args, **kwargs):
            import torch

            if torch.compiler.is_compiling():
                kwargs.pop("_compile", None)
            return create_block_mask(*args, **kwargs)

        return create_block_mask_in_the_step

    _wrap_once(mu, "create_block_mask", uncompiled)
    flex_attention_mask.__wrapped__ = original  # type: ignore[attr-defined]
    return flex_attention_mask


def flex_backward_takes_unbacked_batch() -> None:
    """torch's shape function (fake kernel) of ``flex_attention_backward`` decides whether key and value were
    broadcast over the query's batch with ``Bq > 1 and Bkv == 1``. With the unbacked batch size of a sharded
    step (or mark_batch) that is u0 > 1, which cannot be decided: the step fails, with stock torch.compile too
    (torch 2.13). Where key and value have the query's own batch size the answer is no whatever u0 is, and the
    wrapper gives the shapes that branch gives (the gradients of query, key and value in their inputs' stride
    order, the mods' buffers' gradients contiguous); every other call goes to torch's function."""
    try:
        flex = importlib.import_module("torch._higher_order_ops.flex_attention")  # the module, not the op
        from torch._higher_order_ops.utils import registered_hop_fake_fns
    except ImportError:
        return
    permute_strides = getattr(flex, "_permute_strides", None)
    if permute_strides is not None:
        _wrap_entry_once(registered_hop_fake_fns, getattr(flex, "flex_attention_backward", None),
                         lambda original: _same_batch_shapes(original, permute_strides))


def _same_batch_shapes(original, permute_strides):
    """flex_backward_takes_unbacked_batch's wrapper of torch's shape function, or None where torch's is not of
    that form."""
    try:
        if "Bq > 1 and Bkv == 1" not in inspect.getsource(original):
            return None
    except (OSError, TypeError):
        return None

    def flex_attention_backward_fake(query, key, value, *args, **kwargs):
        import torch

        Bq, Bkv = query.shape[0], value.shape[0]
        if not isinstance(Bq, torch.SymInt) or not (Bkv is Bq or isinstance(Bkv, torch.SymInt)
                                                    and Bkv.node.expr == Bq.node.expr):
            return original(query, key, value, *args, **kwargs)
        buffers = kwargs["score_mod_other_buffers"] if "score_mod_other_buffers" in kwargs else \
            args[9] if len(args) > 9 else ()
        _, Hkv, S, v_dim = value.shape
        grad_query = permute_strides(query.new_empty(query.shape), query.stride())
        grad_key = permute_strides(key.new_empty((Bq, Hkv, S, query.shape[-1])), key.stride())
        grad_value = permute_strides(value.new_empty((Bq, Hkv, S, v_dim)), value.stride())
        grad_buffers = tuple(torch.empty_like(b, memory_format=torch.contiguous_format)
                             if isinstance(b, torch.Tensor) else None for b in buffers)
        return grad_query, grad_key, grad_value, grad_buffers

    return flex_attention_backward_fake


def flex_dense_takes_an_empty_batch() -> None:
    """flex_attention's own (dense) forward and backward, which run where Inductor does not generate its kernels
    (compiler="eager", CPU), fail on a batch of 0 samples when a mod indexes a tensor with b ("indexing
    tensors could not be broadcast together with shapes [0], [8]", torch 2.13): a sharded step's rank with no
    samples. With nothing to compute, the wrappers return the op's outputs from its shape function: empty
    outputs and per-sample gradients, zero gradients of the tensors the batch shares."""
    try:
        flex = importlib.import_module("torch._higher_order_ops.flex_attention")
        from torch._C import DispatchKey
        from torch._higher_order_ops.utils import registered_hop_fake_fns
    except ImportError:
        return
    for name, backward in (("flex_attention", False), ("flex_attention_backward", True)):
        hop = getattr(flex, name, None)
        shapes = registered_hop_fake_fns.get(hop)
        kernels = getattr(hop, "py_kernels", {})
        if shapes is not None and _wrap_entry_once(kernels, DispatchKey.CompositeExplicitAutograd,
                                                   lambda dense: _empty_batch_from_shapes(dense, shapes, backward)):
            getattr(hop, "_dispatch_cache", {}).clear()


def _empty_batch_from_shapes(dense, shapes, backward: bool):
    """flex_dense_takes_an_empty_batch's wrapper of one dense kernel."""
    def empty_batch(*args, **kwargs):
        if args[0].shape[0] != 0:
            return dense(*args, **kwargs)
        out = shapes(*args, **kwargs)
        if backward:  # the gradients of the mods' buffers: sums over no samples
            out = (*out[:3], tuple(g.zero_() if g is not None else None for g in out[3]))
        return out

    return empty_batch


_KERNELS_UNSET = object()  # hf_kernel_routing_in_checkpoints' token: nothing was set


def hf_kernel_routing_in_checkpoints() -> None:
    """transformers 5.25 routes calls of hub-kernel functions (``kernels`` 0.19's ``use_kernel_func_from_hub``)
    through a context variable that every wrapped module's forward sets and resets; while compiling, that is an
    attribute of a global object (``CompileableContextVar.global_var``), and setting it inside an activation-
    checkpointed layer is a side effect dynamo refuses in the checkpoint (``HOP: Unsafe side effect``): the
    model's own gradient checkpointing (``gradient_checkpointing_enable``) split every step. While compiling, a
    set whose routes all lead to the functions' own forward (no module kernelized: the routing then calls the
    plain function, as with nothing set) sets nothing, and its reset restores nothing; any other set is
    kernels' own."""
    layer = sys.modules.get("kernels._internals.layer.layer")
    owner = getattr(layer, "CompileableContextVar", None)

    def wrap_set(original):
        def set(self, value):  # noqa: A001 - the method's name
            import torch

            if torch.compiler.is_compiling() and isinstance(value, dict) and all(
                    isinstance(route, tuple) and len(route) == 2 and route[1] is type(route[0]).forward
                    for route in value.values()):
                return _KERNELS_UNSET
            return original(self, value)
        return set

    def wrap_reset(original):
        def reset(self, token):
            if token is _KERNELS_UNSET:
                return None
            return original(self, token)
        return reset

    _wrap_once(owner, "set", wrap_set)
    _wrap_once(owner, "reset", wrap_reset)


def install_hf_shims() -> None:
    """The transformers shims above, before dynamo traces a step (idempotent, cheap when installed)."""
    hf_expand_position_ids()
    hf_flex_padding_mask()
    hf_kernel_routing_in_checkpoints()


def _torch_at_least(major: int, minor: int) -> bool:
    import torch

    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


def dtensor_takes_unbacked_batch() -> bool:
    """torch 2.13's DTensor propagates shardings over an unbacked batch size; 2.11's guards on it (its view
    rule asks "u0 == 1", its embedding rule "u0 < 2"), which fails dynamo's trace."""
    return _torch_at_least(2, 13)


def dtensor_calls_are_closures() -> bool:
    """torch 2.11's dynamo records a DTensor's redistribute and to_local, and DTensor.from_local, as calls of
    closures it makes per call (``prim_redistribute``, ``prim_to_local``, ``prim from_local``), which its
    AOTAutograd cache refuses ("Unsupported call_function target ...redistribute_fn_with_prim_types", seen with
    TORCH_LOGS=+torch._functorch._aot_autograd.autograd_cache): dpcompile.cacheable_dtensor_calls rewrites them.
    torch 2.13 records method calls, which its cache takes."""
    return not _torch_at_least(2, 13)


def reflection_pad_takes_unbacked_batch() -> bool:
    """torch 2.13's reflection_pad meta traces an unbacked batch size; 2.11's checks it against 0 (Ne(u0, 0),
    a GPU run): dynamo breaks the graph there, which dpcompile refuses as a partial step."""
    return _torch_at_least(2, 13)


def scatter_reads_in_order() -> bool:
    """torch 2.13's Inductor runs a CPU scatter before the readers of its result; 2.11's could fuse them ahead of
    it (passes/scatter_reads.py)."""
    return _torch_at_least(2, 13)


def meshes_are_graph_inputs() -> bool:
    """torch 2.13 hands a sharded step's device meshes to the compiled graph as opaque inputs (the cache keys
    them: dpcompile.compile_cache.stable_mesh_keys); 2.11 bakes them into the graph."""
    return _torch_at_least(2, 13)


def rng_states_before_saved_objects(fw, bw, num_fwd_outputs: int) -> int:
    """Where the partitioner recomputes a random op in the backward (activation checkpointing over a
    dropout, or over SDPA, which the partitioner counts as random as it may drop out), it saves the op's RNG
    state: it appends the state to the forward's saved tensors,
    just before the saved symbolic sizes, and as a backward input just before the tangents. Saved opaque
    objects (torch 2.13 hands a sharded step's device meshes to the graph as such) sit between the two, and
    AOTAutograd reads its saved values as (tensors, opaque objects, sizes): the mesh is then taken for a
    tensor ("expected all tensors_saved_with_vc_check to be Tensors", torch 2.13; a sharded Llama with its
    activation checkpointing on). Moves the states to the end of the saved tensors, in both graphs.
    Returns how many states moved (0: nothing to do)."""
    import operator

    import torch
    from torch._prims.rng_prims import run_and_save_rng_state as run_and_save_rng

    def opaque(n) -> bool:
        v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        return v is not None and not isinstance(v, (torch.Tensor, torch.SymInt, torch.SymFloat, int, float))

    def rng_state(n) -> bool:
        return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target is operator.getitem and \
            n.args[0].target is run_and_save_rng and n.args[1] == 0

    out = fw.graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    saved = outs[num_fwd_outputs:]
    states = [n for n in saved if rng_state(n)]
    objects = [n for n in saved if opaque(n)]
    if not states or not objects or saved.index(states[0]) < saved.index(objects[-1]):
        return 0
    first = saved.index(objects[0])
    rest = [n for n in saved if n not in states]
    out.args = (tuple(outs[:num_fwd_outputs] + rest[:first] + states + rest[first:]),) + tuple(out.args[1:])
    placeholders = bw.graph.find_nodes(op="placeholder")
    names = {n.name for n in objects}
    bw_objects = [p for p in placeholders if p.name in names]
    bw_states = [p for p in placeholders if p.name.startswith("rng_state_output")]
    assert len(bw_states) == len(states) and bw_objects, (bw_states, states, bw_objects)
    for p in bw_states:
        bw_objects[0].prepend(p)
    fw.recompile()
    bw.recompile()
    return len(states)


def decompositions_for_one_sample() -> dict:
    """Inductor's decompositions less its matmul ones (``aten.mm``, ``addmm``, ``bmm``), for a step compiled at
    a static batch of one. On CPU those turn a contraction with one row, the sample's (``[1, d] @ [d, n]``,
    n <= 16: a small classification or regression head), into a broadcast product and a sum (torch 2.11 and
    2.13), which spreads the size-one sample dim over the output's: the analysis then cannot tell where the
    sample is, nor whether the loss is a mean or a sum over samples (a ``.mean()`` was taken as a sum, k = 1
    where it is 1 / expected_batch_size). Inductor lowers the matmuls it keeps itself."""
    import torch
    from torch._inductor.decomposition import select_decomp_table

    aten = torch.ops.aten
    drop = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    return {op: fn for op, fn in select_decomp_table().items() if op not in drop}
