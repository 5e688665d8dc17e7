"""A bucketed all-gather's parameters copied out of the bucket by one op, so that every kernel reading a
gathered parameter reads a buffer of its own.

Inductor's FX bucketing (``torch._inductor.fx_passes.bucketing``) gathers the shards of a bucket's parameters
into one ``[world, bucket]`` buffer, and hands each parameter on as ``clone(split(bucket)[i]).view(shape)``.
Inductor fuses that clone into each kernel that reads the parameter, with the parameter's offset in the bucket
a constant of the kernel's code. So a kernel that every block of a model shares otherwise (a LayerNorm
backward, a GELU backward next to a weight's copy) is a new kernel per block: a C++ or Triton compile, and on
GPUs an autotuning, each. GPT-2-small's sharded bk backward on 2 gloo ranks had 67 distinct kernels where
the non-private backward, which reads parameters it saved, has 16 (BENCHMARKS.md, seventy-third section).

``split_gathered`` is one extern call per bucket that copies every parameter out into a contiguous buffer
of its own (``torch.split_with_sizes_copy``, one kernel on CUDA, as FSDP2's own copy-out), so the kernels
reading them index from 0 and blocks share them again. The bucket's buffer is freed right after the copy
(before, the views kept it until its last parameter's last use); the copies are what a contraction reading
the parameter needed anyway.
"""
from __future__ import annotations

import hashlib
import operator
import pickle
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import stable_topological_sort

aten = torch.ops.aten
COUNTER = "gathered_buckets_copied_out"
NAME = "gathered_copy_out"  # in disable_passes: no copy-out (the parameters stay views of their bucket)

_GATHERS = (torch.ops._c10d_functional.all_gather_into_tensor_out.default,
            torch.ops._c10d_functional.all_gather_into_tensor.default)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _parts(gathered: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """split_gathered's outputs, empty: per size n a contiguous [world * n]."""
    return [gathered.new_empty(gathered.shape[0] * n) for n in sizes]


@torch.library.custom_op("dpcompile::split_gathered", mutates_args=())
def split_gathered(gathered: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """gathered [world, sum(sizes)] -> per size n a new contiguous [world * n]: the columns of its part."""
    outs = _parts(gathered, sizes)
    world = gathered.shape[0]
    torch.split_with_sizes_copy(gathered, sizes, dim=1, out=[o.view(world, n) for o, n in zip(outs, sizes)])
    return outs


split_gathered.register_fake(_parts)


def _gathered_bucket(split: fx.Node) -> bool:
    """split is split_with_sizes(view(wait(all_gather(...)), [world, -1]), sizes, 1)."""
    if split.target is not aten.split_with_sizes.default or len(split.args) < 3 or split.args[2] != 1:
        return False
    src = split.args[0]
    if not (isinstance(src, fx.Node) and src.target in _VIEWS and len(src.meta["val"].shape) == 2):
        return False
    wait = src.args[0]
    return (isinstance(wait, fx.Node) and wait.target is torch.ops._c10d_functional.wait_tensor.default
            and isinstance(wait.args[0], fx.Node) and wait.args[0].target in _GATHERS)


def _parameter_views(split: fx.Node, count: int) -> list[fx.Node] | None:
    """The node giving each part as its parameter (getitem -> [clone] -> view), in order; None if any part
    is read otherwise. Without the clone the view reads the bucket in place, strided: where the parameter's
    dim 0 is the world size (a [2, d] table or a 2-class head at 2 ranks), its [world, n] part is already
    that shape. Its copy is contiguous instead, the same values."""
    finals: list[fx.Node | None] = [None] * count
    for item in split.users:
        if item.target is not operator.getitem or len(item.users) != 1:
            return None
        node = next(iter(item.users))
        if node.target is aten.clone.default and len(node.users) == 1:
            node = next(iter(node.users))
        if node.target not in _VIEWS:
            return None
        finals[item.args[1]] = node
    return None if any(f is None for f in finals) else finals


def split_gathered_pass(gm: fx.GraphModule) -> int:
    """Every bucketed all-gather's parameters through one ``split_gathered``; the number of buckets."""
    g = gm.graph
    done = 0
    for split in list(g.find_nodes(op="call_function", target=aten.split_with_sizes.default)):
        if not _gathered_bucket(split):
            continue
        sizes = [int(s) for s in split.args[1]]
        finals = _parameter_views(split, len(sizes))
        if finals is None:
            continue
        src = split.args[0]
        with g.inserting_after(split):
            outs = g.call_function(torch.ops.dpcompile.split_gathered.default, (src, sizes))
            outs.meta.update(split.meta)
            outs.meta["val"] = _parts(src.meta["val"], sizes)
        anchor = outs
        for i, final in enumerate(finals):
            with g.inserting_after(anchor):
                part = g.call_function(operator.getitem, (outs, i))
                part.meta.update(final.meta)
                part.meta["val"] = outs.meta["val"][i]
            with g.inserting_after(part):
                shape = list(final.meta["val"].shape)
                shaped = g.call_function(aten.view.default, (part, shape))
                shaped.meta.update(final.meta)
                shaped.meta["val"] = part.meta["val"].view(shape)  # contiguous (a strided view's was not)
            anchor = shaped
            final.replace_all_uses_with(shaped)
        for final in finals:  # the old chains, users first: each node's only user is the next
            chain = [final]
            while chain[-1].args[0] is not split:
                chain.append(chain[-1].args[0])
            for node in chain:
                g.erase_node(node)
        g.erase_node(split)
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


class BucketAllGathersCopiedOut(CustomGraphPass):
    """Inductor's all-gather bucketing followed by ``split_gathered_pass``, as Inductor's post-grad custom
    pass. Inductor runs its own bucketing after every custom pass, so ``patches`` turns that off for the
    compile and this pass runs it instead, with the settings it had: the same buckets, then the copy-out."""

    def __init__(self, *, fx_mode: str, cap, bucket_mode, count: Callable[[int], None]):
        self.fx_mode, self.cap, self.bucket_mode, self.count = fx_mode, cap, bucket_mode, count

    def __call__(self, graph: fx.Graph) -> None:
        from torch._inductor.fx_passes.bucketing import bucket_all_gather
        from torch._inductor.fx_passes.fsdp import bucket_fsdp_all_gather

        gm = graph.owning_module
        bucket = bucket_fsdp_all_gather if "fsdp" in self.fx_mode else bucket_all_gather
        bucket(gm, self.cap, self.bucket_mode)
        # as Inductor does after its bucketing, which leaves users of a bucket before its all-gather
        stable_topological_sort(graph)
        self.count(split_gathered_pass(gm))

    def uuid(self):
        try:  # Inductor's cache key takes the cap pickled too (dpcompile.bucketing._BucketCap is picklable)
            cap = hashlib.sha256(pickle.dumps(self.cap)).hexdigest()
        except Exception:  # noqa: BLE001 - a cap that does not pickle: no FX graph cache for these graphs
            return None
        return (get_hash_for_files((__file__,)), self.fx_mode, cap, self.bucket_mode)


def patches(*, count: Callable[[int], None]) -> dict:
    """Inductor settings that run its all-gather bucketing through ``BucketAllGathersCopiedOut``, which calls
    ``count`` with the number of buckets it copied out of in each graph; none when Inductor does not bucket
    all-gathers, or when the post-grad custom pass is the user's."""
    from torch._inductor import config

    if config.bucket_all_gathers_fx == "none" or config.post_grad_custom_post_pass is not None:
        return {}
    # the mode torch passes its bucketing: a setting of its own on torch 2.13, the fx setting on 2.11
    mode = getattr(config, "bucket_all_gathers_bucket_mode", config.bucket_all_gathers_fx)
    return {"bucket_all_gathers_fx": "none", "post_grad_custom_post_pass": BucketAllGathersCopiedOut(
        fx_mode=config.bucket_all_gathers_fx, cap=config.bucket_all_gathers_fx_bucket_size_determinator,
        bucket_mode=mode, count=count)}
