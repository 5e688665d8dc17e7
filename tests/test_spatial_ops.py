"""Pooling, interpolation, padding and sliding windows (passes/rules/spatial.py): one DP step against the
vmap(grad) oracle with clipping active, both schedules, the samples on dim 0, on the channel dim, folded
into the leading dim of an unbatched input, and behind a Linear on the channel-last layout; samples on a
spatial dim are refused."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpcompile
from dpcompile.compat import reflection_pad_takes_unbacked_batch
import models as M
from helpers import check_against_reference
from reference import dp_reference


def _apply(op, h, layout):
    """op on h [B, C, *spatial] laid out as layout says (see SpatialNet), back to [B, ...]."""
    if layout == "cnhw":
        return op(h.transpose(0, 1)).transpose(0, 1)
    if layout == "flat":
        return op(h.flatten(0, 1)).reshape(h.shape[0], -1)
    return op(h)


class SpatialNet(nn.Module):
    """Spatial ops side by side between trainable layers, so that gradients flow through their backwards.

    source "vec": x [B, 6] -> Linear -> view(B, *shape); "image": x [B, *shape] is the ops' input.
    Each op is applied in a layout: "nchw" as is; "cnhw" with the samples on the channel dim; "flat" to
    [B*C, *spatial] (for an op with len(spatial) spatial dims an unbatched input, the samples folded into its
    leading dim with C rows each); "nhwc" between Linears over the channels of the channel-last layout.
    The outputs, flattened and concatenated, go to a Linear head.
    """

    def __init__(self, ops, shape, source="vec", d_in=6, n_out=3):
        super().__init__()
        self.ops, self.shape, self.source = ops, tuple(shape), source  # a list: the ops hold no parameters
        self.fc = nn.Linear(d_in, math.prod(shape)) if source == "vec" else None
        nhwc = any(layout == "nhwc" for _, layout in ops)
        self.mix_in = nn.Linear(shape[0], shape[0]) if nhwc else nn.Identity()
        with torch.no_grad():
            x = torch.zeros(1, *shape)
            self.mix_out = nn.ModuleList(nn.Linear(op(x).shape[1], op(x).shape[1]) if layout == "nhwc" else
                                         nn.Identity() for op, layout in ops)
            n = self.spatial(x).shape[1]
        self.head = nn.Linear(n, n_out)

    def spatial(self, h):
        B = h.shape[0]
        h_last = self.mix_in(h.movedim(1, -1)).movedim(-1, 1)
        outs = []
        for (op, layout), mix_out in zip(self.ops, self.mix_out):
            if layout == "nhwc":
                outs.append(mix_out(op(h_last).movedim(1, -1)).reshape(B, -1))
            else:
                outs.append(_apply(op, h, layout).reshape(B, -1))
        return torch.cat(outs, 1)

    def forward(self, x):
        B = x.shape[0]
        h = self.fc(x).view(B, *self.shape) if self.fc is not None else x
        return self.head(torch.tanh(self.spatial(h)))


def check(ops, shape, source="vec", *, schedule, compiler="eager", B=4):
    model = SpatialNet(ops, shape, source)
    x = torch.randn(B, 6) if source == "vec" else torch.randn(B, *shape)
    extra = {} if compiler == "inductor" else {"compiler": "eager"}
    check_against_reference(model, M.ce, (x,), (torch.randint(0, 3, (B,)),), schedule=schedule, **extra)


def alternating(groups: dict) -> list:
    """Each group once, the schedules alternating from group to group: every family runs both (CI time)."""
    return [(g, ("bk", "ghost")[i % 2]) for i, g in enumerate(sorted(groups))]


def interp(**kw):
    return lambda h: F.interpolate(h, **kw)


def pad(p, mode, **kw):
    return lambda h: F.pad(h, p, mode=mode, **kw)


# name -> (ops [(op, layout)], shape [C, *spatial], source); one compile per group and schedule, each op
# in one layout (compile time grows with the ops, and CI is short of it)
POOLS = {
    "1d": ([(lambda h: F.avg_pool1d(h, 3, 2, 1, ceil_mode=True, count_include_pad=False), "nchw"),
            (lambda h: F.max_pool1d(h, 3, 2, 1, ceil_mode=True), "flat"),
            (lambda h: F.adaptive_avg_pool1d(h, 4), "cnhw"),
            (lambda h: F.adaptive_max_pool1d(h, 4), "nchw")], (2, 9), "vec"),
    "2d": ([(lambda h: F.avg_pool2d(h, 3, 2, 1, divisor_override=5), "cnhw"),
            (lambda h: F.max_pool2d(h, 2, 2, 1, dilation=2, ceil_mode=True, return_indices=True)[0], "nchw"),
            (lambda h: F.adaptive_avg_pool2d(h, (3, 2)), "nhwc"),
            (lambda h: F.adaptive_max_pool2d(h, 3), "flat")], (2, 5, 5), "vec"),
    "3d": ([(lambda h: F.avg_pool3d(h, 2, 2, ceil_mode=True), "nchw"),
            (lambda h: F.max_pool3d(h, 2, 1), "cnhw"),
            (lambda h: F.adaptive_avg_pool3d(h, 2), "nhwc"),
            (lambda h: F.adaptive_max_pool3d(h, 2), "nchw")], (2, 3, 3, 3), "vec"),
}

PADS = {
    "1d": ([(pad((2, 1), "reflect"), "nchw"), (pad((1, 2), "replicate"), "flat"),
            (pad((2, 1), "circular"), "cnhw")], (2, 5), "vec"),
    "2d": ([(pad((1, 2, 2, 1), "reflect"), "cnhw"), (pad((1, 2, 2, 1), "circular"), "nchw"),
            (pad((1, 2, 0, 1), "replicate"), "nhwc"), (pad((1, 2, 0, 1), "constant", value=0.5), "nchw")],
           (2, 3, 4), "vec"),
    "3d": ([(pad((1, 1, 0, 1, 1, 0), "reflect"), "nhwc"), (pad((1, 0, 1, 1, 0, 1), "replicate"), "cnhw")],
           (2, 2, 3, 3), "vec"),
}

# no index_put in their backwards: antialiased interpolation keeps its own ops, "area" is an adaptive
# average pool, pixel (un)shuffle are views
RESAMPLES = {
    "2d": ([(interp(size=(2, 3), mode="bilinear", antialias=True), "nchw"),
            (interp(size=(3, 2), mode="bicubic", antialias=True), "cnhw"),
            (interp(size=(2, 3), mode="area"), "nhwc"),
            (nn.PixelShuffle(2), "nchw"), (nn.PixelUnshuffle(2), "nhwc")], (4, 4, 6), "vec"),
}

INTERPOLATIONS = {
    "1d": ([(interp(scale_factor=2), "nchw"), (interp(scale_factor=2.5, mode="linear"), "cnhw"),
            (interp(size=7, mode="linear", align_corners=True), "nhwc")], (2, 4), "vec"),
    "2d": ([(nn.Upsample(size=(5, 3)), "cnhw"), (interp(scale_factor=1.5, mode="nearest-exact"), "nchw"),
            (interp(scale_factor=2, mode="bilinear"), "nhwc"),
            (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), "nchw"),
            (interp(size=(4, 5), mode="bicubic"), "cnhw")], (2, 3, 3), "vec"),
    "3d": ([(interp(scale_factor=(1, 2, 2)), "nchw"), (interp(scale_factor=2, mode="trilinear"), "cnhw")],
           (2, 2, 2, 2), "vec"),
    "windows": ([(lambda h: F.unfold(h, 2, padding=1, stride=2), "nchw"),
                 (lambda h: F.unfold(h, (2, 1), dilation=(1, 2)), "cnhw"),
                 (lambda h: F.fold(h.flatten(2), (3, 5), 2), "nhwc"),
                 (lambda h: h.unfold(-1, 3, 1), "nchw")], (8, 2, 4), "vec"),
}


@pytest.mark.parametrize("group,schedule", alternating(POOLS))
def test_pooling(group, schedule):
    check(*POOLS[group], schedule=schedule)


@pytest.mark.parametrize("group,schedule", alternating(PADS))
def test_padding(group, schedule):
    check(*PADS[group], schedule=schedule)


@pytest.mark.parametrize("group,schedule", alternating(RESAMPLES))
def test_resampling(group, schedule):
    check(*RESAMPLES[group], schedule=schedule)


def test_image_input():
    """A per-sample image straight into the ops (no gradient flows back through them but for the nhwc
    branch, behind its Linear over the channels); one schedule: the ops' rules are the groups' above."""
    ops = [(lambda h: F.max_pool2d(h, 2), "nchw"), (lambda h: F.avg_pool2d(h, 3, 1, 1), "flat"),
           (pad((1, 2, 2, 1), "reflect"), "nhwc"), (interp(size=(2, 2), mode="bilinear", antialias=True), "cnhw")]
    check(ops, (3, 4, 4), "image", schedule="bk")


@pytest.mark.parametrize("group,schedule", alternating(INTERPOLATIONS))
def test_interpolation_and_windows(group, schedule):
    check(*INTERPOLATIONS[group], schedule=schedule)


@pytest.mark.parametrize("schedule, ops", [
    ("bk", [(lambda h: F.max_pool2d(h, 2, 2, 1, dilation=2, ceil_mode=True), "nchw")]),
    ("ghost", [(pad((1, 2, 2, 1), "reflect"), "cnhw"), (lambda h: F.avg_pool2d(h, 2, 1), "nchw")]),
], ids=["max_pool-bk", "pad_avg_pool-ghost"])
def test_inductor(schedule, ops):
    """Inductor's lowerings: max pooling (low-memory offsets, a scatter_add backward), padding, pooling."""
    check(ops, (2, 4, 4), schedule=schedule, compiler="inductor", B=5)


def test_one_graph_for_every_batch_size():
    """An unbacked batch size (dpcompile.mark_batch; Poisson sampling, sharded steps): one graph runs B = 3,
    0, 1, 4. Its sizes are symbols, read through the graph's SymInt nodes: the arange over the samples in
    reflection padding's backward, the [B*C, H*W] planes of max pooling's scatter_add."""
    ops = [(pad((1, 2, 2, 1), "reflect"), "cnhw"), (lambda h: F.max_pool2d(h, 2, 1), "nchw"),
           (pad((1, 2), "replicate"), "flat")]
    if not reflection_pad_takes_unbacked_batch():
        # torch 2.11's reflection_pad2d meta checks its input against an empty batch (Ne(u0, 0)): a graph break
        # for an unbacked batch size, which dpcompile refuses as a partial step; 2.13 traces it
        ops = ops[1:]
    model = SpatialNet(ops, (2, 3, 4))
    batches = [(torch.randn(B, 6), torch.randint(0, 3, (B,))) for B in (3, 0, 1, 4)]
    _, norms = dp_reference(model, M.ce, batches[0][:1], batches[0][1:], max_grad_norm=1.0, reduction="sum")
    C = float(norms.median())
    backend = dpcompile.DPBackend(max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=4, schedule="ghost",
                                  compiler="eager")

    def step(x, y):
        loss = M.ce(model(x), y).sum()
        loss.backward()
        return loss.detach()

    compiled = torch.compile(step, backend=backend)
    for x, y in batches:
        dpcompile.mark_batch(x, y)
        model.zero_grad(set_to_none=True)
        compiled(x, y)
        if len(x):
            ref, _ = dp_reference(model, M.ce, (x,), (y,), max_grad_norm=C, reduction="sum", expected_batch_size=4)
        for n, p in model.named_parameters():
            want = ref[n] if len(x) else torch.zeros_like(p, dtype=torch.float64)
            torch.testing.assert_close(p.grad.double(), want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
    assert len([r for r in backend.compiled if r.dp]) == 1


def _refusal(model, loss_of, inputs) -> dpcompile.DPCompileError:
    backend = dpcompile.DPBackend(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4,
                                  compiler="eager")

    def step(*xs):
        loss = loss_of(model, *xs)
        loss.backward()
        return loss.detach()

    with pytest.raises(Exception) as info:
        torch.compile(step, backend=backend)(*inputs)
    err = info.value
    while not isinstance(err, dpcompile.DPCompileError) and err.__cause__ is not None:
        err = err.__cause__  # dynamo wraps the backend's error
    assert isinstance(err, dpcompile.DPCompileError), repr(info.value)
    return err


@pytest.mark.parametrize("op, name", [
    (lambda h: F.avg_pool1d(h, 2, 1, padding=1)[..., :-1], "aten.avg_pool2d"),
    (lambda h: F.max_pool1d(h, 2, 1, padding=1)[..., :-1], "prims._low_memory_max_pool_with_offsets"),
    (lambda h: F.adaptive_avg_pool2d(h.unsqueeze(0), (6, 4)).squeeze(0), "aten._adaptive_avg_pool2d"),
], ids=["avg_pool", "max_pool", "adaptive_avg_pool"])
def test_samples_on_a_spatial_dim_are_refused(op, name):
    """h.t() puts the 4 samples on the last dim of [1, 6, B], which the op pools over."""
    def loss_of(model, x, y):
        return M.ce(op(model(x).t().unsqueeze(0)).squeeze(0).t(), y).mean()

    err = _refusal(nn.Linear(5, 6), loss_of, (torch.randn(4, 5), torch.randint(0, 6, (4,))))
    assert name in str(err) and "mixes along the sample dim" in str(err), str(err)


class ResizedGrid(nn.Module):
    """A learned grid resized to the input's size (a ViT position embedding at another resolution, PVT's): its
    gradient is an index_put at sample-free indices with the channel dims taken whole."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.grid = nn.Parameter(torch.randn(1, 2, 3, 3))
        self.fc = nn.Linear(2 * 6 * 6, 2)

    def forward(self, x):  # x [B, 2, 6, 6]
        return self.fc((x + F.interpolate(self.grid, size=(6, 6), mode=self.mode)).flatten(1))


@pytest.mark.parametrize("mode,schedule", [("bilinear", "bk"), ("bicubic", "ghost"), ("nearest", "bk")])
def test_a_parameter_resized_by_interpolation(mode, schedule):
    """Each sample's gradient of the grid is its gradient of the resized grid scattered back: exact against
    the oracle, the scatter replayed per sample with the dims it takes whole (counter)."""
    torch.manual_seed(0)
    backend = check_against_reference(ResizedGrid(mode), M.mse, (torch.randn(4, 2, 6, 6),), (torch.randn(4, 2),),
                                      schedule=schedule, compiler="eager")
    (record,) = [r for r in backend.compiled if r.dp]
    assert record.counters["norm_scatter_dims_whole"] >= 1, record.counters


class ChannelLastHead(nn.Module):
    """timm's ConvNeXt stage end: a residual added branch first, so that the sum keeps the branch's
    channel-last strides, then a global average pool. AOTAutograd restrides the pool's output (as_strided)
    and scatters its gradient back into a fresh buffer in the backward (as_strided_scatter)."""

    def __init__(self):
        super().__init__()
        self.conv, self.mix, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.conv(x)
        h = self.mix(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) + h
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


@pytest.mark.parametrize("schedule", ["bk", "ghost"])
def test_global_pool_of_a_channel_last_map(schedule):
    torch.manual_seed(0)
    backend = check_against_reference(ChannelLastHead(), M.ce, (torch.randn(4, 3, 5, 5),),
                                      (torch.randint(0, 3, (4,)),), schedule=schedule, compiler="eager")
    joint = [text for record in backend.compiled for stage, text in record.graphs.items() if "joint" in stage]
    assert any("as_strided_scatter" in text for text in joint), "the case no longer has the op it tests"


def test_a_partial_strided_scatter_of_samples_is_refused():
    """as_strided_scatter that writes only some entries (every other one here) keeps the rest of its
    base: no rule proves where the samples' entries go."""
    def loss_of(model, x, y):
        h = model(x)  # [4, 6]
        out = torch.as_strided_scatter(torch.zeros(2 * h.numel()), h.flatten(), (h.numel(),), (2,))
        return M.ce(out.view(4, 12)[:, :6], y).mean()

    err = _refusal(nn.Linear(5, 6), loss_of, (torch.randn(4, 5), torch.randint(0, 6, (4,))))
    assert "as_strided_scatter" in str(err) and "strides of its own" in str(err), str(err)
