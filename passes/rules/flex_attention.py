"""FlexAttention (``torch.nn.attention.flex_attention``): its forward and backward higher-order ops.

Every tensor of the op (query, key, value, the block mask's tables, the buffers score_mod and mask_mod read)
has its batch in dim 0, and flex runs score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx, kv_idx)
for row b of the query. Row b of the output depends on other rows only through the mods: a mod keeps samples
apart when the batch index b is used for one thing only, to pick the sample's own entry of a per-sample
buffer (``padding_mask[b, kv_idx]``, ``document_ids[b, q_idx]``). b in arithmetic, or indexing a buffer that
is not per-sample, makes a sample's attention depend on its place in the batch; a per-sample buffer read at
any other index reads another sample's data. Both are refused, naming the mod.

The gradient of a tensor a mod reads that is not per-sample (a learned bias table) is summed over the
samples inside the kernel: refused, naming the tensor. A per-sample buffer's gradient is per-sample. So is
that of a tensor the batch shares expanded to the batch (``table.expand(B, ...)``, every row the same memory)
and read at [b]: each sample reads the same values, and its gradient lands in its own row.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from dpcompile.fx_utils import known

from ..batch_state import FREE, SINGLE, Batched, Mixed, fail_layout

aten = torch.ops.aten
hop = torch.ops.higher_order

# positions of the mods' arguments: score_mod(score, b, h, q_idx, kv_idx, *buffers),
# mask_mod(b, h, q_idx, kv_idx, *buffers)
_SCORE_MOD_B, _SCORE_MOD_ARGS = 1, 5
_MASK_MOD_B, _MASK_MOD_ARGS = 0, 4


def _query_state(an, node, tensors):
    """The layout all of the query, key and value (and output, logsumexp, output gradient) share."""
    found = None
    for a in tensors:
        s = an.st(a)
        if s is FREE:
            continue
        if not isinstance(s, Batched):
            return fail_layout(an, node, f"an attention input ({a.name}) is not per-sample: {s}")
        if s.dim is not None and s.dim != 0:
            return fail_layout(an, node, "attends across samples (flex_attention's batch is dim 0, the samples "
                                         f"of {a.name} are in dim {s.dim})")
        if found is not None and found != s:
            return fail_layout(an, node, "attention inputs with different sample layouts")
        found = s
    return found


def _check_tables(an, node, tables, q_state, buffers=False) -> None:
    """The block mask's tables: no samples (a mask shared by the batch) or the query's layout. The mods' buffers
    (``buffers``): their samples may lie in any dim (the mod picks them at [b] there, _check_mod)."""
    for a in tables:
        s = an.st(a)
        if s is FREE or s == SINGLE or s == q_state or buffers and isinstance(s, Batched) and s.moved(0) == q_state:
            continue
        if isinstance(s, Mixed):
            raise an._mixing_error(node, s)
        raise an.refuse(node, f"a block mask table or a mod's buffer ({a.name}) has samples laid out as {s}, not "
                              f"as the query's ({q_state})", "build the block mask for the same batch as the query")


def _check_mod(an, node, mod: fx.GraphModule, b_pos: int, n_args: int, buffers, q_state, what: str) -> None:
    """The batch index b of ``mod`` only picks per-sample buffers' own entries (module docstring)."""
    phs = [n for n in mod.graph.nodes if n.op == "placeholder"]
    b = phs[b_pos]
    outer = dict(zip(phs[n_args:], buffers))  # the mod's buffer placeholders -> the step's values
    per_sample = {ph: an.st(buf).dim for ph, buf in outer.items()
                  if isinstance(an.st(buf), Batched) and an.st(buf).dim is not None}
    per_sample |= {ph: 0 for ph, buf in outer.items() if _shared_rows(an, buf, q_state)}
    for n in mod.graph.nodes:  # in order: a cast of a per-sample buffer is added before its users are reached
        if n is not b and n not in per_sample:
            continue
        for user in n.users:
            if user.op == "output":
                raise an.refuse(node, f"{what} returns the batch index b" if n is b else
                                f"{what} returns a per-sample buffer")
            if _picks_own_entry(user, n, b, per_sample):
                continue
            if n is not b and _keeps_layout(user, n, b, per_sample):
                per_sample[user] = per_sample[n]
                continue
            if n is b and user.target is aten.index.Tensor and user.args[0] in outer:
                buf = outer[user.args[0]]
                why = (f"{what} indexes {_describe(an, buf)} with the batch index b, but that tensor is not "
                       f"per-sample data of the step (a tensor captured from outside the step's arguments, or one "
                       f"the batch shares): a sample's attention would depend on its place in the batch")
                todo = ("pass the per-sample tensor the mod reads to the compiled step as an argument (a "
                        "BlockMask built outside the step: build its mask_mod from the argument)")
            elif n is b:
                why = (f"{what} uses the batch index b in {user.target} (b may only pick a per-sample tensor's "
                       f"own entry, as in mask[b, kv_idx]): a sample's attention would depend on its place in "
                       f"the batch")
                todo = "index per-sample tensors in score_mod / mask_mod as t[b, ...]"
            else:
                root = n
                while root not in outer:
                    root = next(i for i in root.all_input_nodes if i in per_sample)
                why = (f"{what} reads {_describe(an, outer[root])}, per-sample, in {user.target} other than at "
                       f"[b] in its sample dim {per_sample[n]}: another sample's data")
                todo = "index per-sample tensors in score_mod / mask_mod as t[b, ...]"
            raise an.refuse(node, why, todo)


def _shared_rows(an, buf: fx.Node, q_state) -> bool:
    """buf holds no samples and is expanded to the batch in dim 0 (stride 0: every row is the same memory; or a
    batch of one), as the query's samples lie: its row b is the same values for every sample, so a mod may read
    it at [b] (and the gradient flex returns for it then has a row per sample)."""
    v = buf.meta.get("val")
    return (an.st(buf) is FREE and q_state == Batched(0) and isinstance(v, torch.Tensor) and v.dim() > 0
            and known(v.shape[0] == an.B) and (v.stride(0) == 0 or known(v.shape[0] == 1)))


def _keeps_layout(user: fx.Node, n: fx.Node, b: fx.Node, per_sample: dict) -> bool:
    """user is a pointwise op of the per-sample n (a cast, a comparison with a scalar) of n's shape, its other
    inputs neither b nor per-sample."""
    if not isinstance(user.target, torch._ops.OpOverload) or torch.Tag.pointwise not in user.target.tags:
        return False
    others = [i for i in user.all_input_nodes if i is not n]
    if any(i is b or i in per_sample for i in others):
        return False
    v, vn = user.meta.get("val"), n.meta.get("val")
    return isinstance(v, torch.Tensor) and isinstance(vn, torch.Tensor) and tuple(v.shape) == tuple(vn.shape)


def _describe(an, value: fx.Node) -> str:
    """A tensor of the step as the user knows it: the parameter or input it is (or is read from), else its
    node and shape."""
    seen, todo = set(), [value]
    params = {p.primal: p.name for p in an.ctx.params}
    inputs = {ph: name for ph, (name, _) in an.ctx.data_inputs.items()}
    while todo and len(seen) < 16:
        v = todo.pop(0)
        of = "" if v is value else "a tensor computed from "
        if v in params:
            return f"{of}parameter {params[v]}"
        if v in inputs:
            return f"{of}input {inputs[v]}"
        seen.add(v)
        todo += [i for i in v.all_input_nodes if i not in seen]
    return f"tensor {value.name} (shape {tuple(value.meta['val'].shape)})"


def _picks_own_entry(user: fx.Node, n: fx.Node, b: fx.Node, per_sample: dict) -> bool:
    """user is t[..., b (at t's sample dim), ...] of a per-sample buffer t, and n is t or that b."""
    if user.target is not aten.index.Tensor:
        return False
    t, idx = user.args[0], list(user.args[1])
    if t not in per_sample or n is not b and n is not t:
        return False
    d = per_sample[t]
    if d >= len(idx) or idx[d] is not b:
        return False
    return t is not b and all(i is not b for k, i in enumerate(idx) if k != d) and all(i is not t for i in idx)


def _subgraph(an, a) -> fx.GraphModule:
    assert isinstance(a, fx.Node) and a.op == "get_attr", a
    return operator.attrgetter(a.target)(an.gm)


def _block_mask_parts(block_mask: tuple):
    """(tables, mask_mod) of the block mask flex's ops take as a tuple (BlockMask.as_tuple: seq lengths,
    tables, block sizes, mask_mod last)."""
    return [a for a in block_mask if isinstance(a, fx.Node) and a.op != "get_attr"], block_mask[-1]


def _flex_forward(an, node):
    q, k, v, score_mod, block_mask, _scale, _options, score_bufs, mask_bufs = node.args[:9]
    return _flex(an, node, (q, k, v), block_mask, score_bufs, mask_bufs, [score_mod], n_outputs=None)


def _flex_backward(an, node):
    (q, k, v, out, lse, grad_out, grad_lse, fw_graph, _joint, block_mask, _scale, _options, score_bufs,
     mask_bufs) = node.args[:14]
    tensors = [a for a in (q, k, v, out, lse, grad_out, grad_lse) if isinstance(a, fx.Node)]
    return _flex(an, node, tensors, block_mask, score_bufs, mask_bufs, [fw_graph], n_outputs=3, inputs=(q, k, v))


def _flex(an, node, tensors, block_mask, score_bufs, mask_bufs, score_mods, n_outputs, inputs=()):
    tables, mask_mod = _block_mask_parts(block_mask)
    q_state = _query_state(an, node, tensors)
    if not isinstance(q_state, Batched):  # q, k and v hold no samples: only the mods' buffers might
        q_state = None
    if q_state is not None and q_state.dim is not None:
        _check_tables(an, node, tables, q_state)
        _check_tables(an, node, [*score_bufs, *mask_bufs], q_state, buffers=True)
        for mod in score_mods:
            _check_mod(an, node, _subgraph(an, mod), _SCORE_MOD_B, _SCORE_MOD_ARGS, score_bufs, q_state,
                       "score_mod")
        if isinstance(mask_mod, fx.Node):
            _check_mod(an, node, _subgraph(an, mask_mod), _MASK_MOD_B, _MASK_MOD_ARGS, mask_bufs, q_state,
                       "mask_mod")
    elif any(isinstance(an.st(a), Batched) and an.st(a).dim is not None for a in [*tables, *score_bufs, *mask_bufs]):
        raise an.refuse(node, "per-sample block mask tables or mod buffers with no per-sample query, key or value")
    an.ctx.counters["flex_attention_checked"] += 1
    out_state = q_state if q_state is not None else FREE
    v = node.meta["val"]
    if n_outputs is None:  # forward: output, logsumexp, max scores
        return tuple(out_state if isinstance(o, torch.Tensor) else FREE for o in v)
    grads = []
    for buf, g in zip(score_bufs, v[n_outputs]):
        if g is None:
            grads.append(FREE)
        elif q_state is not None and isinstance(an.st(buf), Batched) and an.st(buf).dim is not None:
            grads.append(an.st(buf))  # read at [b] only (checked above): its gradient's rows are per-sample
        elif q_state is not None and _shared_rows(an, buf, q_state):
            grads.append(q_state)  # the same, for a shared tensor expanded to the batch (_shared_rows)
        elif q_state is None or q_state.dim is None:
            grads.append(an.st(buf))
        else:  # refused where it is used (a parameter's gradient); torch's op returns one for every buffer
            grads.append(Mixed(node, f"the gradient of {_describe(an, buf)}, which flex_attention's score_mod "
                                     f"reads for every sample, is summed over the samples inside the kernel; expand "
                                     f"it to the batch and read its row b in score_mod (table.expand(B, ...) read "
                                     f"as t[b, ...]: each sample's gradient is then its own row), or add a learned "
                                     f"bias to the scores outside flex_attention"))
    return (*(_input_grad_state(an, node, x, g, out_state) for x, g in zip(inputs, v[:n_outputs])), tuple(grads))


def _input_grad_state(an, node, x, g, out_state):
    """The gradient of the query, key or value: per-sample where the input has a row per sample (per-sample data,
    or a tensor the batch shares expanded to it); the key and value of one row that the kernel broadcast over
    the batch get their gradient summed over the samples inside it."""
    if not isinstance(g, torch.Tensor) or out_state is FREE:
        return FREE
    if isinstance(an.st(x), Batched) or out_state.dim is None or known(x.meta["val"].shape[0] == an.B):
        return out_state
    return Mixed(node, f"the gradient of {_describe(an, x)}, a key or value of one row that flex_attention "
                       "broadcasts over the batch, is summed over the samples inside the kernel; expand it to the "
                       "batch before flex_attention (its gradient then has a row per sample)")


RULES: dict[Any, Any] = {}
if hasattr(hop, "flex_attention"):
    RULES[hop.flex_attention] = _flex_forward
    RULES[hop.flex_attention_backward] = _flex_backward
