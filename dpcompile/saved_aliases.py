"""Saved tensors that alias are never donated to the backward.

AOTAutograd marks a saved tensor *donated* when it shares storage with no
input, user output or gradient (``collect_bw_donated_buffer_idxs``), and
Inductor may then write the backward's own buffers into a donated input once
that input is dead. The check does not compare saved tensors with each
other: it assumes that no two alias, which the stock partitioner mostly
ensures by running CSE on the joint graph first. dpcompile partitions without
CSE (it would merge identical collectives, and every rank must issue the same
ones), so two identical views of one activation (the input of two linears,
each reshaped for its own matmul) were both saved and both donated, and
Inductor reused one for a new buffer while the other was still to be read:
on an H100 the Llama test model's w1 weight gradient read w3's input
gradient (bf16, ghost; every gradient before w1 wrong). Views of one
projection (attention's q, k and v) are saved side by side by any partition.

Two measures, both exact whatever the layouts:

- ``merge_identical_saved_values``: a saved value computed by the same op
  from the same inputs as an earlier saved value (what CSE would have merged)
  is dropped; the backward reads the earlier one. Never a random draw: as
  torch's CSE, it leaves ops that draw random numbers apart.
- ``no_aliased_donations``: while dpcompile compiles, AOTAutograd's donated
  buffers leave out every saved tensor that shares storage with another one.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef


def storage_of(v) -> StorageWeakRef | None:
    """A strided tensor's storage, to compare by identity (fake values' too); None for anything else."""
    if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
        return None
    try:
        return StorageWeakRef(v.untyped_storage())
    except (NotImplementedError, RuntimeError):  # a tensor subclass without one storage
        return None


def _key(node: fx.Node):
    """What CSE compares: the op and its arguments (nodes by identity). None for an op that draws random
    numbers: two draws with the same arguments are different values (Hugging Face's drop paths each call
    ``torch.rand((B, 1, 1, 1))``, and merged, every block's backward read the first block's mask)."""
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
        return None
    try:
        return node.target, repr(node.args), repr(node.kwargs), tuple(node.all_input_nodes)
    except Exception:
        return None


def merge_identical_saved_values(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                                 counters: Counter | dict | None = None) -> int:
    """Drops every saved value that the same op computes from the same inputs as an earlier saved value;
    the backward reads the earlier one. Returns how many it dropped (counter ``saved_values_merged``)."""
    out = fw.graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    # the partitioner names each backward input after the saved value it receives (saved symbolic sizes
    # come first there, last in the forward's outputs)
    bw_input = {p.name: p for p in bw.graph.find_nodes(op="placeholder")}
    first: dict = {}
    dropped: list[int] = []
    for i in range(num_fwd_outputs, len(outs)):
        node = outs[i]
        if not isinstance(node, fx.Node) or node.name not in bw_input or storage_of(node.meta.get("val")) is None:
            continue
        key = _key(node)
        if key is None:
            continue
        if key not in first:
            first[key] = node
            continue
        bw_input[node.name].replace_all_uses_with(bw_input[first[key].name])
        dropped.append(i)
    for i in reversed(dropped):
        bw.graph.erase_node(bw_input[outs[i].name])
        del outs[i]
    if dropped:
        out.args = (tuple(outs),) + tuple(out.args[1:])
        for gm in (fw, bw):
            gm.graph.lint()
            gm.recompile()
        if counters is not None:
            counters["saved_values_merged"] = counters.get("saved_values_merged", 0) + len(dropped)
    return len(dropped)


def without_aliases(donated: list[int], saved_tensors: list, offset: int) -> list[int]:
    """The donated indexes (``offset`` + position among saved_tensors) whose saved tensor shares its storage
    with no other saved tensor."""
    refs = [storage_of(t) for t in saved_tensors]
    shared = {r for r, n in Counter(r for r in refs if r is not None).items() if n > 1}
    return [i for i in donated if not (0 <= i - offset < len(refs) and refs[i - offset] in shared)]


@contextlib.contextmanager
def no_aliased_donations(on_dropped: Callable[[int], None] | None = None) -> Iterator[None]:
    """AOTAutograd's donated buffers without saved tensors that alias one another, while this is open.

    Wraps ``collect_bw_donated_buffer_idxs`` where AOTAutograd calls it; where this torch has no such
    function, donation is turned off instead (exact, a little more memory).
    """
    try:
        from torch._functorch._aot_autograd import graph_compile as gc
    except ImportError:
        gc = None
    collect = getattr(gc, "collect_bw_donated_buffer_idxs", None)
    if collect is None:
        with torch._functorch.config.patch(donated_buffer=False):
            yield
        return

    def collect_without_aliases(*args, **kwargs):
        donated = collect(*args, **kwargs)
        try:
            fw_module, _, fw_metadata = args
            fw_outs = next(reversed(fw_module.graph.find_nodes(op="output"))).args[0]
            saved = [n.meta.get("val") if isinstance(n, fx.Node) else None
                     for n in fw_outs[fw_metadata.tensors_saved_for_backwards_slice]]
            kept = without_aliases(donated, saved, fw_metadata.num_symints_saved_for_bw or 0)
        except Exception:  # another torch's signature or metadata: donate nothing, which is always exact
            kept = []
        if on_dropped is not None and len(kept) < len(donated):
            on_dropped(len(donated) - len(kept))
        return kept

    gc.collect_bw_donated_buffer_idxs = collect_without_aliases
    try:
        yield
    finally:
        gc.collect_bw_donated_buffer_idxs = collect
