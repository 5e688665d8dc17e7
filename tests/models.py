"""Small models covering the layer kinds the backend must decompose per sample."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=5, hidden=7, d_out=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class SeqLinear(nn.Module):
    """nn.Linear (bias) and F.linear (no bias) on inputs with extra dims: [B, T, d] or [B, H, T, d]."""

    def __init__(self, d=6, p=4, n_out=3):
        super().__init__()
        self.fc = nn.Linear(d, p)
        self.w = nn.Parameter(torch.randn(n_out, p) / math.sqrt(p))

    def forward(self, x):
        return F.linear(F.gelu(self.fc(x)), self.w)


class EinsumNet(nn.Module):
    """Weights applied by torch.einsum, which lowers a contraction without a shared batch dim to a bmm over a batch
    of one: a token projection ("bsd,hd->bsh"), then XLNet's sequence-first head merge ("ibnd,hnd->ibh")."""

    def __init__(self, d=6, heads=2, head_dim=4, n_out=3):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.w_in = nn.Parameter(torch.randn(heads * head_dim, d) / math.sqrt(d))
        self.w_out = nn.Parameter(torch.randn(n_out, heads, head_dim) / math.sqrt(heads * head_dim))

    def forward(self, x):  # [B, S, d] -> [B, S, n_out]
        h = torch.tanh(torch.einsum("bsd,hd->bsh", x, self.w_in))
        h = h.transpose(0, 1).unflatten(2, (self.heads, self.head_dim))  # [S, B, heads, head_dim]
        return torch.einsum("ibnd,hnd->ibh", h, self.w_out).transpose(0, 1)


class RecurrentNet(nn.Module):
    """nn.LSTM (bidirectional, batch-first), nn.GRU (sequence-first) and nn.RNN (ReLU): each weight used at every
    time step, so its gradient sums over the sequence. Dynamo traces them in DP steps (dpcompile/step_frames.py
    sets allow_rnn while it compiles them). A second LSTM reads the batch itself (one-hot tokens, which need no
    gradient): torch decomposes a CPU LSTM whose input needs no gradient into mkldnn's opaque op, dpcompile into
    its cells (dpcompile/recurrent.py)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lstm = nn.LSTM(6, 5, batch_first=True, bidirectional=True)
        self.first = nn.LSTM(11, 2, batch_first=True)
        self.gru = nn.GRU(12, 4)
        self.rnn = nn.RNN(4, 4, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # [B, T] token ids
        h, _ = self.lstm(self.emb(x))
        g, _ = self.first(F.one_hot(x, 11).to(self.emb.weight.dtype))
        h, _ = self.gru(torch.cat([h, g], -1).transpose(0, 1))
        h, _ = self.rnn(h.transpose(0, 1))
        return self.head(h)


class CrossAttention(nn.Module):
    """nn.MultiheadAttention with key and value apart from the query (cross-attention, as in
    nn.TransformerDecoderLayer): its packed in_proj_weight meets three inputs in three chunks, so its gradient
    joins three blocks (aten.cat)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(6, 8)
        self.memory = nn.Linear(6, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # [B, T, 6]
        m = torch.tanh(self.memory(x))
        out, _ = self.attn(self.q(x), m, m, need_weights=False)
        return self.head(out)


class SequenceOps(nn.Module):
    """Reorderings and scans along the sequence (flip, roll, cumsum), RMSNorm, a LayerNorm without bias and a
    max over time: per-sample ops that move or combine entries within a sample. Then two views of the batch
    through one layer, taken apart again by slicing (a contrastive model's halves: the slices' backward
    scatters each half back into its place)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.rms = nn.RMSNorm(8)
        self.ln = nn.LayerNorm(8, bias=False)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # [B, T, 6]
        B = x.shape[0]
        h = self.ln(self.rms(self.fc(x)))
        h = torch.cumsum(h, 1) + torch.flip(h, [1, 2]) + torch.roll(h, 1, 1)
        views = self.mix(torch.cat([h, h.flip(1)]))  # [2B, T, 8]
        h = views[:B] + views[B:2 * B] * h
        return self.head(h.amax(1, keepdim=True) + h)


class CheckpointedBlocks(nn.Module):
    """Two GPT blocks under activation checkpointing (torch.utils.checkpoint, non-reentrant, as Hugging
    Face's activation_checkpointing_enable uses): each block's forward runs again in the backward. Their SDPA
    is a random op to the partitioner (it may drop out), whose RNG state it saves for the recomputation
    (sharded on torch 2.13 that state met the device mesh among the saved values:
    compat.rng_states_before_saved_objects)."""

    def __init__(self, d=6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, 2) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class BilinearNet(nn.Module):
    """nn.Bilinear twice: of a hidden activation and the input (with bias), and of one activation with
    itself (without): rewritten as a matmul with the weight before tracing (dpcompile/bilinear.py)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.bil = nn.Bilinear(4, 6, 5)
        self.bil2 = nn.Bilinear(5, 5, 3, bias=False)

    def forward(self, x):
        h = self.bil(torch.tanh(self.a(x)), x)
        return self.bil2(h, h)


class EmbeddingBagNet(nn.Module):
    """nn.EmbeddingBag over 2-D input (a bag per sample) in its three modes: a sum weighted per entry and a
    mean, both skipping padding_idx, and a max: rewritten as embeddings and reductions before tracing
    (dpcompile/embedding_bag.py)."""

    def __init__(self, vocab=11, d=4):
        super().__init__()
        self.sum = nn.EmbeddingBag(vocab, d, mode="sum", padding_idx=0)
        self.mean = nn.EmbeddingBag(vocab, d, mode="mean", padding_idx=0)
        self.max = nn.EmbeddingBag(vocab, d, mode="max")
        self.head = nn.Linear(3 * d, 3)

    def forward(self, ids, weights):  # [B, L] token ids, [B, L] per-entry weights
        bags = [self.sum(ids, per_sample_weights=weights), self.mean(ids), self.max(ids)]
        return self.head(torch.cat(bags, -1))


class RunningInputMean(nn.Module):
    """Keeps a running mean of its inputs in a buffer (as a hand-written normaliser might): the buffer would
    carry the samples without noise, so a DP step that updates it is refused (passes/state_updates.py)."""

    def __init__(self, d=5, out=3):
        super().__init__()
        self.fc = nn.Linear(d, out)
        self.register_buffer("running_mean", torch.zeros(d))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):  # [B, d]
        out = self.fc(x - self.running_mean)  # last step's mean: sample-free here
        self.steps.add_(1)  # sample-free: allowed
        self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return out


class KeptState(nn.Module):
    """A block that keeps its output on an attribute (RecurrentGemma's recurrent state, read by no loss): an
    output of the compiled step with a gradient besides the loss. passes.side_gradients."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.state = None

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        self.state = h
        return self.head(h)


class ClampedWeight(nn.Module):
    """A weight whose ``.data`` the forward clamps in place before it is used (Gemma3n's AltUp coefficients):
    the clamped parameter is an output of the compiled step with a gradient besides the loss."""

    def __init__(self, bound: float = 0.3):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.coef = nn.Linear(6, 6, bias=False)
        self.head = nn.Linear(6, 3)
        self.bound = bound

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        self.coef.weight.data.clamp_(-self.bound, self.bound)
        return self.head(h + self.coef(h))


class SpectralNormNet(nn.Module):
    """A Linear under torch's spectral_norm parametrization: in training mode each forward updates its power
    iteration's buffers in place, and the weight's gradient reads the vectors (u, v) it made. The min-cut
    partitioner recomputed them in the backward from the updated buffers at this shape (a 6 x 4 weight; 8 x 6 it
    saved): passes.mutated_input_reads."""

    def __init__(self):
        super().__init__()
        self.fc = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 6))
        self.head = nn.Linear(6, 3)
        # vectors far from the power iteration's fixed point (which its construction approached), so that the
        # step's iteration moves them: reading the updated ones instead would change the gradient visibly
        sn = self.fc.parametrizations.weight[0]
        with torch.no_grad():
            sn._u.copy_(F.normalize(torch.randn_like(sn._u), dim=0))
            sn._v.copy_(F.normalize(torch.randn_like(sn._v), dim=0))

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)))


class RoutedExperts(nn.Module):
    """A top-k routed mixture of experts in the form Hugging Face's MoE models take with
    experts_implementation="batched_mm" (Mixtral, Qwen-MoE, ...): a router's softmax picks each token's top_k
    experts (topk: its backward scatters the gradient back), each token repeated top_k times goes through its
    experts' weights gathered by index (w[e]: a per-token weight, whose gradient is an index_put of per-token
    outer products) and a batched matmul, the outputs weighted by the renormalised router probabilities.
    The up-projections are read through a fixed per-expert gain (a buffer): their gradient reaches the table
    through a sample-free factor, so its norm comes from the per-sample gradient, materialised. Three experts:
    on 2 ranks the expert tables' shards are uneven (2 and 1), so rank 1 cuts its reduced gradient's padding.
    Beside them Llama 4's form: every token repeated once per expert (a repeat of the token dim), scaled by its
    sigmoid router score, through the experts' weights as one bmm over [experts, tokens, d], summed over the
    experts."""

    def __init__(self, d=6, hidden=8, n_out=3, experts=3, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, experts, bias=False)
        self.w_all = nn.Parameter(torch.randn(experts, d, d) / math.sqrt(d))
        self.w_in = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(d))
        self.register_buffer("gain", torch.linspace(0.5, 1.5, experts).view(experts, 1, 1))
        self.w_out = nn.Parameter(torch.randn(experts, d, hidden) / math.sqrt(hidden))
        self.b_out = nn.Parameter(torch.zeros(experts, d))
        self.head = nn.Linear(d, n_out)

    def forward(self, x):  # [B, S, d] -> [B, S, n_out]
        d = x.shape[-1]
        h = x.reshape(-1, d)
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k, dim=-1)  # [N, top_k]
        weights = weights / weights.sum(-1, keepdim=True)
        e = chosen.reshape(-1)
        tokens = h.repeat_interleave(self.top_k, dim=0)  # [N * top_k, d]
        up = F.silu(torch.bmm((self.w_in * self.gain)[e], tokens.unsqueeze(-1)).squeeze(-1))
        down = torch.bmm(self.w_out[e], up.unsqueeze(-1)).squeeze(-1) + self.b_out[e]
        mixed = (down * weights.reshape(-1, 1)).view(-1, self.top_k, d).sum(1)
        E = self.w_all.shape[0]
        routed = h.repeat(E, 1) * torch.sigmoid(self.router(h)).transpose(0, 1).reshape(-1, 1)  # [E * N, d]
        mixed = mixed + torch.bmm(routed.view(E, -1, d), self.w_all).view(-1, d).view(E, -1, d).sum(0)
        return self.head(mixed.view(x.shape) + x)


def grouped_fallback_traceable() -> bool:
    """Whether this transformers release's grouped_mm_fallback (the grouped matmul outside bf16) can be traced
    in a training step: older releases loop over the expert offsets on the host in its backward (stock
    torch.compile fails there too, and dpcompile says what to do); transformers 5.24 has a backward op."""
    try:
        import transformers.integrations.moe  # noqa: F401  (registers the ops)
    except ImportError:
        return False
    from dpcompile.backend import grouped_fallback_has_backward_op

    return grouped_fallback_has_backward_op()


class SortedExpertsLayer(nn.Module):
    """One routed-experts layer in the grouped form, Hugging Face's default (experts_implementation="grouped_mm",
    transformers.integrations.moe): the batch's (token, expert) pairs sorted by expert across the whole batch,
    each expert's block of rows through its weight by one grouped matmul whose offsets count the sorted ids
    (histc, cumsum), the rows put back in sample order. Compiled, the grouped matmul is torch._grouped_mm in bf16
    and transformers' custom op otherwise (torch._grouped_mm takes bf16 only); run eagerly (the oracle: vmap
    cannot run the custom op's loop on the host) each sorted row is multiplied by its expert's weight gathered, the
    same sums. ``invert``, how the sort is undone: "iota" (an arange scattered to the permutation, as
    transformers does), "argsort" (the permutation's argsort) or "scatter" (the rows written back at the
    permutation, and the offsets counted from the ids before their sort, as torchtitan does)."""

    def __init__(self, d, hidden, experts, top_k, invert):
        super().__init__()
        self.top_k, self.experts, self.invert = top_k, experts, invert
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(d))  # [E, out, in], read transposed
        self.w_out = nn.Parameter(torch.randn(experts, hidden, d) / math.sqrt(hidden))  # [E, in, out]
        if invert not in ("iota", "argsort", "scatter"):
            raise ValueError(invert)
        import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    def _grouped(self, rows, w, offs, ids):
        if not torch.compiler.is_compiling():
            return torch.bmm(rows.unsqueeze(1), w[ids]).squeeze(1)
        if w.dtype == torch.bfloat16:
            return torch._grouped_mm(rows, w, offs=offs)
        return torch.ops.transformers.grouped_mm_fallback(rows, w, offs)

    def forward(self, h):  # [N, d] tokens
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        ids, perm = torch.sort(chosen.reshape(-1))
        rows = h[perm // self.top_k]
        offs = None
        if torch.compiler.is_compiling():
            # transformers counts the sorted ids; torchtitan the ids before the sort, its histogram up to E
            counted, top = (ids, self.experts - 1) if self.invert != "scatter" else (chosen.view(-1), self.experts)
            counts = torch.histc(counted.float(), bins=self.experts, min=0, max=top)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
        up = F.silu(self._grouped(rows, self.w_in.transpose(-2, -1), offs, ids))
        down = self._grouped(up, self.w_out, offs, ids) * weights.reshape(-1)[perm].unsqueeze(-1)
        if self.invert == "iota":
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel(), device=perm.device)
            down = down[inv]
        elif self.invert == "argsort":
            down = down[perm.argsort()]
        else:
            down = torch.zeros_like(down).index_put((perm,), down)
        return h + down.view(-1, self.top_k, h.shape[-1]).sum(1)


class SortedExperts(nn.Module):
    """Three routed-experts layers in the grouped form (SortedExpertsLayer), one per way of undoing the sort,
    three experts each (uneven shards on 2 ranks), top-2."""

    def __init__(self, d=6, hidden=8, n_out=3, experts=3, top_k=2):
        super().__init__()
        self.layers = nn.ModuleList(SortedExpertsLayer(d, hidden, experts, top_k, invert)
                                    for invert in ("iota", "argsort", "scatter"))
        self.head = nn.Linear(d, n_out)

    def forward(self, x):  # [B, S, d] -> [B, S, n_out]
        h = x.reshape(-1, x.shape[-1])
        for layer in self.layers:
            h = layer(h)
        return self.head(h.view(x.shape))


class PerHeadNet(nn.Module):
    """Per-head weights that share a batch dim with the activations: einsum("bhsd,hde->bhse") is a batched matmul
    over the heads whose weight gradient contracts each head's sample rows (a "bmm" contribution); also with one
    row per sample and head ("bhd,hde->bhe": rank one), and on sequence-first rows ("shbd,hde->shbe": samples
    inside the rows)."""

    def __init__(self, d=6, heads=2, head_dim=4, n_out=3):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.proj = nn.Linear(d, heads * head_dim)
        self.w_head = nn.Parameter(torch.randn(heads, head_dim, head_dim) / math.sqrt(head_dim))
        self.w_seq = nn.Parameter(torch.randn(heads, head_dim, head_dim) / math.sqrt(head_dim))
        self.w_pool = nn.Parameter(torch.randn(heads, head_dim, 2) / math.sqrt(head_dim))
        self.out = nn.Linear(heads * head_dim + heads * 2, n_out)

    def forward(self, x):  # [B, S, d] -> [B, S, n_out]
        B, S, _ = x.shape
        h = self.proj(x).unflatten(2, (self.heads, self.head_dim)).transpose(1, 2)  # [B, heads, S, head_dim]
        h = torch.tanh(torch.einsum("bhsd,hde->bhse", h, self.w_head))
        hs = torch.einsum("shbd,hde->shbe", h.permute(2, 1, 0, 3), self.w_seq)  # [S, heads, B, head_dim]
        h = h + torch.tanh(hs).permute(2, 1, 0, 3)
        pooled = torch.einsum("bhd,hde->bhe", h.mean(2), self.w_pool)  # [B, heads, 2]
        y = torch.cat([h.transpose(1, 2).flatten(2), pooled.flatten(1).unsqueeze(1).expand(B, S, -1)], -1)
        return self.out(y)


class Conv1D(nn.Module):
    """GPT-2's Conv1D: y = addmm(b, x, W) with W stored [in, out]."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) * 0.3)
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x):
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)


class Conv1DNet(nn.Module):
    def __init__(self, d=6, n_out=3):
        super().__init__()
        self.c1 = Conv1D(d, 8)
        self.c2 = Conv1D(8, n_out)

    def forward(self, x):
        return self.c2(F.relu(self.c1(x)))


class HandRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class NormNet(nn.Module):
    """LayerNorm, nn.RMSNorm and a hand-written RMSNorm between linears."""

    def __init__(self, d=6, n_out=3):
        super().__init__()
        self.fc = nn.Linear(d, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8, eps=1e-6)
        self.hrms = HandRMSNorm(8)
        self.head = nn.Linear(8, n_out)
        with torch.no_grad():
            for m in (self.ln, self.rms):
                m.weight.add_(0.1 * torch.randn_like(m.weight))
            self.ln.bias.add_(0.1 * torch.randn_like(self.ln.bias))

    def forward(self, x):
        return self.head(self.hrms(self.rms(self.ln(self.fc(x)))))


class WeightNormNet(nn.Module):
    """Weight-normalised layers (w = g v / ||v||, the parametrization's tensors are the parameters): a Linear
    normalised per output row (dim 0), a grouped Conv1d over frames normalised per kernel tap (dim 2, the
    last: wav2vec2's positional convolution) and a Linear normalised per input column. (dim=None, a scalar
    gain, cannot be sharded: test_per_sample_clipping has it on one process.)"""

    def __init__(self, d=6, n_out=3):
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.fc = wn(nn.Linear(d, 8))
        self.conv = wn(nn.Conv1d(4, 4, 3, padding=1, groups=2), dim=2)
        self.head = wn(nn.Linear(8, n_out), dim=1)  # per input column

    def forward(self, x):
        h = torch.tanh(self.fc(x))  # [B, T, 8]
        h = h + self.conv(h.view(*h.shape[:-1], 4, 2).flatten(0, 1)).view(h.shape)  # frames: 2 per token
        return self.head(h)


class StandardisedNet(nn.Module):
    """Weights standardised before they meet the samples (the gradient is the standardisation's backward
    of a sum over samples: sums over the weight's dims, broadcasts, sample-free factors): timm's StdConv2d
    (F.batch_norm over the reshaped weight, ResNetV2/BiT and NFNets) and a hand-written standardisation of
    a Linear's rows with a learned gain."""

    def __init__(self, n_out=3):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(16, 8)
        self.gain = nn.Parameter(torch.full((8, 1), 0.5))
        self.head = nn.Linear(8, n_out)

    def forward(self, x):  # x [B, 3, 4, 4]
        w = F.batch_norm(self.conv.weight.reshape(1, 4, -1), None, None, training=True, momentum=0.0, eps=1e-6)
        h = torch.tanh(F.conv2d(x, w.reshape_as(self.conv.weight), self.conv.bias, padding=1)).mean(1).flatten(1)
        v = self.fc.weight
        v = (v - v.mean(1, keepdim=True)) * torch.rsqrt(v.var(1, keepdim=True, unbiased=False) + 1e-5) * self.gain
        return self.head(torch.tanh(F.linear(h, v, self.fc.bias)))


class ProjectedTableNet(nn.Module):
    """Parameters multiplied by other parameters before they meet the samples (DeBERTa's relative position
    embeddings through the attention's projections): a position table through a Linear (mm), and a per-head
    table through per-head matrices (bmm). Each gradient is a matrix product of a sum over samples with a
    sample-free matrix."""

    def __init__(self, t=5, d=6, heads=2, n_out=3):
        super().__init__()
        self.table = nn.Parameter(0.5 * torch.randn(t, d))
        self.proj = nn.Linear(d, d)
        self.head_table = nn.Parameter(0.5 * torch.randn(heads, t, d // heads))
        self.head_mix = nn.Parameter(0.5 * torch.randn(heads, d // heads, d // heads))
        self.head = nn.Linear(d, n_out)

    def forward(self, x):  # x [B, t, d]
        pos = self.proj(self.table) + torch.bmm(self.head_table, self.head_mix).transpose(0, 1).flatten(1)
        return self.head(torch.tanh(x + pos))


class BiasedScores(nn.Module):
    """Attention scores as one baddbmm (Bloom's ALiBi): a bias plus q kᵀ over [B*heads, T, T], the bias a
    per-head slope times the key position (sample-free) plus a per-sample term (Bloom's comes from the
    padding mask)."""

    def __init__(self, d=6, heads=2, n_out=3):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.slopes = nn.Parameter(torch.rand(heads, 1, 1))
        self.head = nn.Linear(d, n_out)

    def forward(self, x):  # [B, T, d]
        B, T, d = x.shape
        H = self.heads
        q, k, v = self.qkv(x).view(B, T, 3, H, d // H).permute(2, 0, 3, 1, 4).reshape(3, B * H, T, d // H)
        bias = (self.slopes * torch.arange(T, dtype=x.dtype)).expand(B, H, 1, T).reshape(B * H, 1, T)
        bias = bias + x.mean(-1).repeat_interleave(H, 0).unsqueeze(1)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=1.0, alpha=(d // H) ** -0.5)
        out = torch.bmm(scores.softmax(-1), v).view(B, H, T, d // H).transpose(1, 2).reshape(B, T, d)
        return self.head(out)


class LearnedActivation(nn.Module):
    """Activations whose parameters pass through functions of their own: xIELU's (transformers' Apertus) two
    scalars through softplus, whose backward is a where over the gradient summed over the samples with both
    branches on it, and a per-channel gain picked piecewise by the parameter's sign (a where with a zero
    branch)."""

    def __init__(self, d):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.tensor([0.5])), nn.Parameter(torch.tensor([0.2]))
        self.gain = nn.Parameter(torch.randn(d))

    def forward(self, x):
        ap, an = F.softplus(self.alpha_p), 0.5 + F.softplus(self.alpha_n)
        y = torch.where(x > 0, ap * x * x + 0.5 * x, (torch.expm1(torch.clamp(x, max=-1e-6)) - x) * an + 0.5 * x)
        return y * torch.where(self.gain > 0, self.gain * 2.0, self.gain.sigmoid())


class ReparametrisedNet(nn.Module):
    """The parameters-through-functions-of-parameters layers in one net (CI time: one compile):
    WeightNormNet, StandardisedNet, ProjectedTableNet and BiasedScores side by side on [B, 5, 6] tokens, then
    LearnedActivation; a row and a matrix of stacked parameters picked by a constant index (Zamba's per-layer
    biases: their gradient a select_scatter into zeros); a position embedding resized with F.interpolate (a
    ViT at another resolution, PVT: its gradient an index_put with dims taken whole) and a table indexed in two
    dims apart (t[i, :, j])."""

    def __init__(self, n_out=3):
        super().__init__()
        self.wn, self.proj, self.scores = WeightNormNet(6, 6), ProjectedTableNet(5, 6, 2, 6), BiasedScores(6, 2, 6)
        self.std = StandardisedNet(6)
        self.act = LearnedActivation(6)
        self.rows, self.mats = nn.Parameter(torch.randn(3, 6) * 0.3), nn.Parameter(torch.randn(2, 6, 6) * 0.3)
        self.pos, self.grid = nn.Parameter(torch.randn(1, 6, 2, 2) * 0.3), nn.Parameter(torch.randn(4, 6, 3) * 0.3)
        self.register_buffer("at_i", torch.tensor([0, 2, 3, 1, 2]), persistent=False)
        self.register_buffer("at_j", torch.tensor([1, 0, 2, 2, 1]), persistent=False)
        self.head = nn.Linear(6, n_out)

    def forward(self, x):  # [B, 5, 6]
        img = F.pad(x[:, :3, :4].reshape(x.shape[0], 3, 2, 2), (1, 1, 1, 1))  # [B, 3, 4, 4]
        h = self.wn(x) + self.proj(x) + self.scores(x) + self.std(img).unsqueeze(1)
        pos = F.interpolate(self.pos, size=(3, 2), mode="bicubic", align_corners=False)  # [1, 6, 3, 2]
        h = h + pos.flatten(2).transpose(1, 2)[:, :5] + self.grid[self.at_i, :, self.at_j]  # ([5, 6])
        h = self.act(torch.tanh(h + self.rows[1]))
        return self.head(h @ self.mats[1] + self.rows.select(0, 2))


class BatchShapedAttention(nn.Module):
    """Third-party shape code that asks questions of the batch size (dpcompile.compat answers them for an
    unbacked one, as in sharded steps), in one block on [B, 5, 6] tokens: Bloom's heads merged by a reshape with
    -1 of a transposed tensor; DeBERTa's position projection repeated over the batch (.repeat(B, 1, 1)); T5's
    decoder mask of batch 1 in SDPA with transposed heads; wav2vec2's GroupNorm with a group per channel (here
    on the inputs, before a Conv1d); BART's all-ones mask expanded over the heads; Qwen3-Next's triangular solve
    per sample and head."""

    def __init__(self, T=5, d=6, heads=2, n_out=3):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.qkv, self.pos_proj, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, n_out)
        self.pos = nn.Parameter(torch.randn(T, d) * 0.5)
        self.conv, self.norm = nn.Conv1d(d, d, 3, padding=1), nn.GroupNorm(d, d)
        self.register_buffer("mask", torch.triu(torch.full((1, heads, T, T), -1e4), 1))

    def forward(self, x):  # [B, T, d]
        B, T, d = x.shape
        H, D = self.heads, self.hd
        # the norm on the inputs: on the attention's output, a group per channel over 5 tokens amplified fp32
        # rounding into the upstream gradients by its 1/std (1e-4 of their scale, against 1e-8 in fp64)
        x = x + self.conv(self.norm(x.transpose(1, 2))).transpose(1, 2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(d, -1))  # [B, H, T, D] views
        pos = self.pos_proj(self.pos).view(T, H, D).transpose(0, 1).repeat(B, 1, 1)  # [B * H, T, D]
        q = (q.reshape(B * H, -1, D) + pos).view(B, H, T, D)
        ones = torch.ones(B, 1, T, T, dtype=x.dtype, device=x.device).expand(-1, H, -1, -1)
        a = F.scaled_dot_product_attention(q, k, v * ones[..., :1], attn_mask=self.mask)
        # Qwen3-Next's gated delta rule over one chunk: a lower-triangular system per sample and head
        system = torch.eye(T, dtype=x.dtype, device=x.device) + torch.tril(k @ k.transpose(-1, -2) * 0.1, -1)
        a = a + torch.linalg.solve_triangular(system, v, upper=False)
        return self.out(torch.tanh(a.transpose(1, 2).reshape(B, T, d)))


class EmbNet(nn.Module):
    def __init__(self, vocab=11, d=6, n_out=3, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.head = nn.Linear(d, n_out)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


class Block(nn.Module):
    """Pre-LN GPT block: causal SDPA attention and a GELU MLP."""

    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PaddedAttention(nn.Module):
    """Attention that skips padding keys: a boolean mask of shape [B, 1, T, T] built from the token ids, as
    Hugging Face models pass one (a per-sample mask, so its batch dim is the batch)."""

    def __init__(self, vocab=11, d=6, n_head=2, pad=0):
        super().__init__()
        self.n_head, self.pad = n_head, pad
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, 3)

    def forward(self, ids):
        B, T = ids.shape
        x = self.emb(ids)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        keep = (ids != self.pad)[:, None, None, :] & causal
        keep = keep | torch.eye(T, dtype=torch.bool, device=ids.device)  # every query sees itself: no empty row
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.proj(a.transpose(1, 2).reshape(B, T, -1))


class SampleIndexed(nn.Module):
    """Indexing a per-sample tensor's sample dim with torch.arange(batch size), as Hugging Face models do: the
    attention mask gathered from the padding mask with the batch and key positions as index tensors
    (transformers' masking_utils), the last non-padding token of each sample taken as its summary (sequence
    classifiers' pooling), and the first token taken from a sequence-first layout (the samples on dim 1)."""

    def __init__(self, vocab=11, d=6, n_head=2, pad=0):
        super().__init__()
        self.n_head, self.pad = n_head, pad
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        B, T = ids.shape
        x = self.emb(ids)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        kept = ids != self.pad
        batch, kv = torch.arange(B, device=ids.device), torch.arange(T, device=ids.device)
        mask = kept[batch[:, None, None, None], kv[None, None, None, :]]  # [B, 1, 1, T]
        mask = mask | torch.eye(T, dtype=torch.bool, device=ids.device)  # every query sees itself
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, -1)
        last = (kept.long().sum(1) - 1).clamp(min=0)  # per-sample positions
        pooled = h[batch, last]  # [B, d]
        first = h.transpose(0, 1)[torch.zeros_like(batch), batch]  # [T, B, d] -> [B, d]
        every = h.transpose(0, 1)[:, batch].mean(0)  # [T, B, d] with a slice before the index: samples on dim 1
        return self.head(pooled + 0.5 * first + 0.25 * every)


class FourierMixer(nn.Module):
    """FNet-style token mixing: the real part of a 2-D Fourier transform over tokens and features (torch.fft's
    r2c and c2c transforms, view_as_real), between two Linears; features tiled with Tensor.repeat."""

    def __init__(self, d=6):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.out = nn.Linear(2 * d, 3)

    def forward(self, x):  # [B, T, 3]
        h = self.inp(x)
        mixed = torch.fft.fft2(h, dim=(-2, -1)).real + torch.fft.irfft(torch.fft.rfft(h, dim=1), n=h.shape[1], dim=1)
        return self.out(torch.tanh(mixed).repeat(1, 1, 2)).mean(1)


class LinalgNet(nn.Module):
    """Per-sample matrices through torch.linalg (a solve against a shared right-hand side, a log-determinant) and
    distances: to learnable centres (an RBF layer; p = 2 and more than 25 centres, which torch computes through
    matrix products) and to fixed anchors (p = 1: torch's direct cdist kernel)."""

    def __init__(self, d=6, n_out=3, centres=30):
        super().__init__()
        self.to_matrix = nn.Linear(d, 9)
        self.centres = nn.Parameter(torch.randn(centres, d))
        self.register_buffer("anchors", torch.randn(4, d))
        self.head = nn.Linear(centres + 4 + 3 + 1, n_out)

    def forward(self, x):  # [B, T, d]
        h = x.mean(1)
        eye = torch.eye(3, dtype=h.dtype, device=h.device)
        a = self.to_matrix(h).view(-1, 3, 3) + 3 * eye
        solved = torch.linalg.solve(a, eye[0])  # [B, 3]
        logdet = torch.linalg.slogdet(a)[1].unsqueeze(-1)
        near = torch.exp(-0.1 * torch.cdist(h, self.centres))
        return self.head(torch.cat([near, torch.cdist(h, self.anchors, p=1.0), solved, logdet], -1))


class SpatialTransformer(nn.Module):
    """A spatial transformer: a per-sample affine grid from a Linear (F.affine_grid), the image resampled on it
    (F.grid_sample, whose backward gives both the image's and the grid's gradients), then a convolution."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Linear(3 * 8 * 8, 6)
        with torch.no_grad():
            self.loc.weight.mul_(0.05)
            self.loc.bias.copy_(torch.tensor([1.0, 0.1, 0.0, -0.1, 0.9, 0.05]))
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # [B, 3, 8, 8]
        theta = self.loc(x.flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.head(self.conv(F.grid_sample(x, grid, align_corners=False)).mean((2, 3)))


def _scan_step(left, right):
    """(a, b) pairs of h_t = a_t * h_(t-1) + b_t composed: associative, as associative_scan needs."""
    a_left, b_left = left
    a_right, b_right = right
    return a_left * a_right, a_right * b_left + b_right


class SelectiveScan(nn.Module):
    """Mamba's selective scan as Hugging Face compiles it: a gated recurrence h_t = a_t * h_(t-1) + b_t over the
    tokens by torch's associative_scan, inside Falcon-Mamba's and Jamba's ``if x.numel() > 0:`` (their scan
    cannot take an empty chunk). Both ask about an unbacked batch size: is it empty?"""

    def __init__(self, d=4):
        super().__init__()
        self.inp = nn.Linear(3, 2 * d)
        self.out = nn.Linear(d, 3)

    def forward(self, x):  # [B, T, 3]
        from torch._higher_order_ops.associative_scan import associative_scan

        gate, b = self.inp(x).chunk(2, dim=-1)
        a = torch.sigmoid(gate)
        if b.numel() > 0:  # (the generic mode: torch's gradient of the pointwise one is wrong, tests/test_scans.py)
            _, h = associative_scan(_scan_step, (a, b), dim=1, combine_mode="generic")
        else:
            h = b
        return self.out(torch.tanh(h)).mean(1)


class TiedBlocks(nn.Module):
    """Blocks of a ModuleList whose first and last hold one Parameter object (how transformers ties Zamba's shared
    attention block across its hybrid layers): the sharded runs shard block by block, and the tie must hold."""

    def __init__(self, d=6, n=3):
        super().__init__()
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n))
        self.blocks[-1][0].weight = self.blocks[0][0].weight
        self.out = nn.Linear(d, 3)

    def forward(self, x):  # [B, T, 3]
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


class Autocast(nn.Module):
    """The wrapped model under bf16 autocast on its input's device, output in fp32: fp32 parameters, bf16
    compute, what users train in (autocast leaves float64 alone, so the fp64 oracle's copy runs in fp64)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *xs):
        with torch.autocast(xs[0].device.type, dtype=torch.bfloat16):
            return self.inner(*xs).float()


class GPT(nn.Module):
    def __init__(self, vocab=13, d=8, n_head=2, n_layer=2, max_t=8, tied=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_t, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        T = ids.shape[1]
        pos = torch.arange(T, device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


class SharedWeights(nn.Module):
    """Weights used several times, in both orientations: an embedding looked up twice and tied to the LM head,
    which is also applied transposed (logits back to the model width, through an einsum too), and a square
    weight applied as F.linear and, transposed, through an einsum. Their per-sample norms are the norms of
    the sums of every use's gradient."""

    def __init__(self, vocab=13, d=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mix = nn.Parameter(torch.randn(d, d) * 0.4)
        self.ln = nn.LayerNorm(d)

    def forward(self, ids):
        w = self.wte.weight
        x = self.wte(ids) + 0.5 * self.wte(ids.flip(1))
        x = torch.tanh(F.linear(x, self.mix) + torch.einsum("bsd,ed->bse", x, self.mix))
        h = self.ln(x) @ w.t()
        back = torch.tanh(h) @ w + torch.einsum("bsv,vd->bsd", torch.sigmoid(h), w)
        return h + 0.5 * F.linear(back, w)


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update: W x + (alpha / r) B A x."""

    def __init__(self, base: nn.Linear, r=2, alpha=4.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(r, base.in_features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, r) * 0.3)  # nonzero, so A gets gradients
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


class LoRAGPT(GPT):
    """A frozen GPT with LoRA adapters on every block's qkv and fc: only the adapters train."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.requires_grad_(False)
        for b in self.blocks:
            b.qkv, b.fc = LoRALinear(b.qkv), LoRALinear(b.fc)


def rotary(x, base=10000.0):
    """Rotary position embedding on [B, H, T, hd] (pairs of halves)."""
    T, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, d=8, n_head=2, hidden=12):
        super().__init__()
        self.n_head = n_head
        self.attn_norm = nn.RMSNorm(d, eps=1e-6)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=1e-6)
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        hd = D // self.n_head
        h = self.attn_norm(x)
        # heads counted from the projections' width: under tensor parallelism (ColwiseParallel wq/wk/wv)
        # each rank holds n_head / tp of them
        q, k, v = (w(h).view(B, T, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q), rotary(k)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.wo(a)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LlamaLM(nn.Module):
    def __init__(self, vocab=13, d=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.block = LlamaBlock(d)
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.block(self.tok(ids))))


def seq_ce(logits, y):
    """Per-sample loss of a sequence model: token cross-entropy averaged within each sample."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


def ce(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


def mse(out, y):
    return (out - y).pow(2).flatten(1).sum(1)


class TitanAttention(nn.Module):
    """Attention with its projections as submodules, as torchtitan's Llama lays it out (a tensor-parallel plan
    can gather a sequence-parallel input once for wq/wk/wv with PrepareModuleInput)."""

    def __init__(self, d, n_head, bias, rope):
        super().__init__()
        self.hd, self.rope = d // n_head, rope
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=bias) for _ in range(4))

    def forward(self, h):
        B, T, _ = h.shape
        q, k, v = (w(h).view(B, T, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.rope:
            q, k = rotary(q), rotary(k)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        return self.wo(a)


class TitanFeedForward(nn.Module):
    def __init__(self, d, hidden, bias, gated):
        super().__init__()
        self.gated = gated
        self.w1 = nn.Linear(d, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, d, bias=bias)
        self.w3 = nn.Linear(d, hidden, bias=bias) if gated else None

    def forward(self, x):
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class TitanBlock(nn.Module):
    def __init__(self, d, n_head, hidden, kind):
        super().__init__()
        llama = kind == "llama"
        norm = (lambda: nn.RMSNorm(d, eps=1e-6)) if llama else (lambda: nn.LayerNorm(d))
        self.attention_norm, self.ffn_norm = norm(), norm()
        self.attention = TitanAttention(d, n_head, bias=not llama, rope=llama)
        self.feed_forward = TitanFeedForward(d, hidden, bias=not llama, gated=llama)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLM(nn.Module):
    """A decoder laid out as torchtitan's Llama (tok_embeddings, layers.i.{attention_norm, attention.wq..wo,
    ffn_norm, feed_forward.w1..w3}, norm, output), the layout its tensor- and sequence-parallel plan names.
    kind="llama": RMSNorm, rotary, SwiGLU, no biases; kind="gpt": LayerNorm, GELU MLP, biases everywhere (a
    sequence-parallel LayerNorm's bias and a RowwiseParallel bias added to a sequence shard are partial sums
    over the tensor-parallel group). Positions are rotary or none, so the residual stream can be split along
    the sequence."""

    def __init__(self, vocab=13, d=8, n_head=2, hidden=12, n_layer=1, kind="llama"):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(TitanBlock(d, n_head, hidden, kind) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d, eps=1e-6) if kind == "llama" else nn.LayerNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def titan_tp_plan(model: "TitanLM", sequence_parallel: bool):
    """(module, plan) pairs in torchtitan's form: Colwise in, Rowwise out; with sequence parallelism the
    residual stream is split along the sequence between the tensor-parallel regions (norms SequenceParallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    seq = Shard(1) if sequence_parallel else Replicate()
    root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    pairs = [(model, root)]
    for layer in model.layers:
        plan = {"attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if layer.feed_forward.gated:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        pairs.append((layer, plan))
    return pairs


class VisionBlocks(nn.Module):
    """Blocks of other vision architectures in one small net: squeeze-excitation (EfficientNet: global pool,
    1x1 convs, a sigmoid gate on the map), a ConvNeXt block (7x7 depthwise, channel-last LayerNorm and
    Linear MLP, a layer-scale vector), a U-Net skip (strided conv down, transposed conv up, concatenated with
    the skip, plus a bilinear upsample), MLP-Mixer token mixing (a Linear over the positions) and a gated
    Conv1d (GLU over channels) pooled by adaptive max pooling."""

    def __init__(self, c_in=3, d_out=3, c=4):
        super().__init__()
        self.stem = nn.Conv2d(c_in, c, 3, padding=1)
        self.se_down, self.se_up = nn.Conv2d(c, 2, 1), nn.Conv2d(2, c, 1)
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.ln = nn.LayerNorm(c)
        self.mlp1, self.mlp2 = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))
        self.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.fuse = nn.Conv2d(2 * c, c, 1)
        self.tokens = nn.Linear(16, 16)  # over the 4x4 positions of the pooled map
        self.gated = nn.Conv1d(c, 2 * c, 3, padding=1)
        self.head = nn.Linear(c, d_out)

    def forward(self, x):
        h = F.silu(self.stem(x))  # [B, c, 8, 8]
        h = h * torch.sigmoid(self.se_up(F.silu(self.se_down(F.adaptive_avg_pool2d(h, 1)))))
        y = self.ln(self.dw(h).permute(0, 2, 3, 1))
        h = h + (self.mlp2(F.gelu(self.mlp1(y))) * self.gamma).permute(0, 3, 1, 2)
        d = F.relu(self.down(h))  # [B, c, 4, 4]
        h = self.fuse(torch.cat([self.up(d), h], 1)) + F.interpolate(d, scale_factor=2, mode="bilinear")
        t = F.avg_pool2d(h, 2).flatten(2)  # [B, c, 16]
        t = t + self.tokens(t)
        g = F.glu(self.gated(t), dim=1)  # [B, c, 16]
        return self.head(F.adaptive_max_pool1d(g, 1).squeeze(-1))


class ConvNet(nn.Module):
    """Every convolution form in one small net: strided and padded Conv2d with GroupNorm, depthwise, a
    grouped transposed convolution, a dilated Conv1d over frames ([B*H, C, W] rows: several rows per
    sample), a Conv3d, an affine InstanceNorm (a DP step computes it as group_norm with a group per channel:
    any batch size, dpcompile.instance_norm), a LayerNorm over channels (channel-last) and PoolFormer's norms: a
    LayerNorm over channels between permutes, then GroupNorm(1, C) of its channels-last output (torch's
    group_norm asks whether an unbacked batch is empty: dpcompile.cpp_size_questions). The stem and the
    frames' Conv1d have 16 output channels: their norms run in
    dpcompile's kernel (dpcompile.conv_sq_norms), the frames' with 8 rows per sample. ``viewed_norm``: an
    instance norm written by hand after the transposed convolution, batch_norm over the batch viewed as channels
    ([1, B*C, H, W]: its backward divides numel by B*C, and Inductor lays the view out in the convolution's
    stride order; torch 2.11 cannot trace it with an unbacked batch)."""

    def __init__(self, c_in=3, d_out=3, viewed_norm=False):
        super().__init__()
        self.viewed_norm = viewed_norm
        self.stem = nn.Conv2d(c_in, 16, 3, stride=2, padding=1)  # [16, 4, 4] from 8x8
        self.gn = nn.GroupNorm(2, 16)
        self.cl_ln, self.cl_gn = nn.LayerNorm(16), nn.GroupNorm(1, 16)
        self.dw = nn.Conv2d(16, 16, 3, padding="same", groups=16, bias=False)
        self.inorm = nn.InstanceNorm2d(16, affine=True)
        self.up = nn.ConvTranspose2d(16, 4, 3, stride=2, padding=1, output_padding=1, groups=2)  # [4, 8, 8]
        self.frames = nn.Conv1d(4, 16, 5, dilation=2, padding=4)
        self.ln = nn.LayerNorm(16)
        self.vol = nn.Conv3d(1, 2, (2, 3, 3), stride=(1, 2, 2))
        self.head = nn.Linear(2 * 15 * 3 * 3, d_out)

    def forward(self, x):
        B = x.shape[0]
        h = F.relu(self.gn(self.stem(x)))
        h = h + self.cl_gn(self.cl_ln(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))  # [B, 16, 4, 4] channels-last
        h = h + torch.tanh(self.inorm(self.dw(h)))
        h = self.up(h)  # [B, 4, 8, 8]
        if self.viewed_norm:
            h = F.batch_norm(h.reshape(1, B * 4, 8, 8), None, None, training=True).view(B, 4, 8, 8)
        rows = h.permute(0, 2, 1, 3).reshape(B * 8, 4, 8)  # each image row a sequence of its own
        rows = self.ln(self.frames(rows).transpose(1, 2)).transpose(1, 2)  # [B * 8, 16, 8]
        h = rows.reshape(B, 8, 16, 8).permute(0, 2, 1, 3)  # [B, 16, 8, 8]
        v = self.vol(torch.tanh(h).unsqueeze(1))  # [B, 2, 15, 3, 3]
        return self.head(v.flatten(1))


class ChannelsLastNet(nn.Module):
    """A conv net as vision users run it on GPUs: converted with ``model.to(memory_format=torch.channels_last)``
    and fed channels-last images, so every activation is channels-last. It asks its layout
    (``is_contiguous()``), and normalises with GroupNorm and a LayerNorm over [C, H, W]: torch's C++ asks each
    whether an unbacked batch is empty (``dpcompile.cpp_size_questions``)."""

    def __init__(self, d_out=3):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.ln = nn.LayerNorm([8, 8, 8])
        self.head = nn.Linear(8 * 2 * 2, d_out)

    def forward(self, x):
        h = F.gelu(self.gn(self.stem(x)))
        h = h + self.dw(h)
        if not h.is_contiguous():  # a layout question in model code (the same values either way)
            h = h.contiguous()
        h = F.gelu(self.ln(h))
        return self.head(F.adaptive_avg_pool2d(h, 2).flatten(1))


def allow_flex_backward_on_cpu() -> None:
    """torch refuses flex_attention's backward on CPU up front (``_validate_device``: Inductor's CPU lowering has
    no backward), although the op's own dense forward and backward run there. The CPU tests run dp_fsdp's graphs
    op by op (compiler="eager"), so the check is lifted for CPU inputs only; on CUDA nothing changes and Inductor
    generates the flex kernels (tests/test_gpu.py)."""
    import torch.nn.attention.flex_attention as flex

    check = flex._validate_device
    if getattr(check, "_cpu_backward_allowed", False):
        return

    def validate_device(query, key, value):
        if query.device.type != "cpu":
            check(query, key, value)

    validate_device._cpu_backward_allowed = True
    flex._validate_device = validate_device


class FlexAttentionNet(nn.Module):
    """Two flex_attention layers over token ids (id 0 = padding): the first's score_mod reads the per-sample
    padding mask at [b, kv_idx]; the second uses grouped-query heads, a causal block mask the batch shares (built
    once, B=None) and an ALiBi score_mod reading a slope per head from a tensor the batch shares, plus a learned
    bias per head and relative position (a parameter expanded to the batch, read at [b]: its gradient per sample).
    Heads of 16 dims: Inductor's flex kernels take no fewer. ``documents``: the first layer's block mask is
    built in the step from per-sample document ids (the id's parity) with create_block_mask(B=batch);
    ``block_mask``: one built outside the step (flex_document_mask). ``dense``: the same function with
    scaled_dot_product_attention and explicit masks, which torch.func's vmap oracle runs (flex's own ops run
    under vmap too, but slowly)."""

    def __init__(self, vocab=11, d=32, heads=2, kv_heads=1, T=8, documents=False, dense=False):
        super().__init__()
        from torch.nn.attention.flex_attention import create_block_mask

        allow_flex_backward_on_cpu()
        self.heads, self.kv_heads, self.documents, self.dense = heads, kv_heads, documents, dense
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.q2 = nn.Linear(d, d)
        self.kv2 = nn.Linear(d, 2 * d * kv_heads // heads)
        self.out = nn.Linear(d, 3)
        self.register_buffer("slopes", 2.0 ** (-torch.arange(1, heads + 1, dtype=torch.float32)), persistent=False)
        self.T = T
        self.rel = nn.Parameter(0.5 * torch.randn(heads, 2 * T - 1))  # bias of relative position kv - q, per head
        self.causal = None if dense else create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T,
                                                           device="cpu")

    def _apply(self, fn, *args, **kwargs):
        # the block mask is a plain attribute (module state the batch shares, not a buffer): .to(device) moves it
        if self.causal is not None:
            self.causal = self.causal.to(fn(torch.empty(0)).device)
        return super()._apply(fn, *args, **kwargs)

    def _heads(self, x, n):
        B, T, _ = x.shape
        return x.view(B, T, n, -1).transpose(1, 2)

    def forward(self, ids, block_mask=None):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        x = self.emb(ids)
        B, T, d = x.shape
        keep = ids != 0
        docs = ids % 2
        q, k, v = (self._heads(t, self.heads) for t in self.qkv(x).chunk(3, -1))
        if self.dense:
            allowed = keep[:, None, None, :].expand(B, 1, T, T)
            if self.documents:
                causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
                allowed = (docs[:, None, :, None] == docs[:, None, None, :]) & causal
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        elif block_mask is not None:  # built outside the step, for this batch (a step argument)
            y = flex_attention(q, k, v, block_mask=block_mask)
        elif self.documents:
            def same_document(b, h, qi, kv):
                return (docs[b, qi] == docs[b, kv]) & (qi >= kv)

            mask = create_block_mask(same_document, B, None, T, T, device=ids.device)
            y = flex_attention(q, k, v, block_mask=mask)
        else:
            y = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: torch.where(keep[b, kv], s, -1e4))
        x = x + y.transpose(1, 2).reshape(B, T, d)
        q = self._heads(self.q2(x), self.heads)
        k, v = (self._heads(t, self.kv_heads) for t in self.kv2(x).chunk(2, -1))
        if self.dense:
            pos = torch.arange(T, device=ids.device)
            bias = self.slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None])
            bias = bias + self.rel[:, pos[None, :] - pos[:, None] + self.T - 1]
            bias = bias.masked_fill(pos[None, None, :] > pos[None, :, None], float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), enable_gqa=True)
        else:
            slopes, rel, off = self.slopes, self.rel.expand(B, -1, -1), self.T - 1
            y = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + slopes[h] * (kv - qi)
                               + rel[b, h, kv - qi + off], block_mask=self.causal, enable_gqa=True)
        return self.out(x + y.transpose(1, 2).reshape(B, T, d))


def flex_document_mask(ids, T=8):
    """The block mask FlexAttentionNet(documents=True) builds in its step, built for this batch outside it."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = ids % 2

    def same_document(b, h, qi, kv):
        return (docs[b, qi] == docs[b, kv]) & (qi >= kv)

    return create_block_mask(same_document, ids.shape[0], None, T, T, device=ids.device)


class DropoutLM(nn.Module):
    """A GPT-2-style LM trained with its dropouts on, as users train: dropout after the embedding, in SDPA's
    attention weights, on both residual branches and in the MLP (nn.Dropout and F.dropout), per-sample drop paths
    (timm's DropPath: one Bernoulli draw per sample, the branch scaled by 1/keep; Hugging Face's, one
    torch.rand per sample, on both branches) and nn.Dropout1d (whole channels of a sample). The oracle replays
    the step's draws (reference.replayed_per_sample_gradients)."""

    def __init__(self, vocab=13, d=8, n_head=2, p=0.25):
        super().__init__()
        self.n_head, self.p = n_head, p
        self.emb = nn.Embedding(vocab, d)
        self.drop = nn.Dropout(p)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)
        self.channels = nn.Dropout1d(p)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        B, T = ids.shape
        x = self.drop(self.emb(ids))
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self.hf_drop_path(self.drop(self.proj(a.transpose(1, 2).reshape(B, T, -1))))
        h = F.dropout(F.gelu(self.fc(self.ln2(x))), self.p, self.training)
        keep = x.new_empty(B, 1, 1).bernoulli_(1 - self.p) / (1 - self.p) if self.training else 1.0
        x = x + self.hf_drop_path(self.out(h) * keep)
        return self.head(self.channels(x.transpose(1, 2)).transpose(1, 2))

    def hf_drop_path(self, h):
        """Hugging Face's drop path (Swin, PoolFormer, BEiT, ...): torch.rand((B, 1, 1)), a draw whose arguments
        are the same at every call (two such masks were once taken for one value: dpcompile/saved_aliases.py)."""
        if not self.training:
            return h
        keep = torch.floor(torch.rand((h.shape[0], 1, 1), dtype=h.dtype, device=h.device) + 1 - self.p)
        return h / (1 - self.p) * keep
