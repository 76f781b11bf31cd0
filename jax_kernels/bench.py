"""Benchmarks: ``python -m jax_kernels.bench [--ops lerp,repeat] [--json FILE] [--quick | --full]``.

On a GPU the full sizes run by default; on a CPU the small ones (``--quick``: 15 minutes measured
on two cores shared with other work, 2026-11-26, the train_step case 1 to 2 of them), unless
``--full`` asks for larger ones there (the GPU's for most ops; CPU sizes for grid_sample, conv2d
and train_step: the train_step case alone took 3 minutes).

Times each op and pass against what a user would pick instead, side by side in one run: the
pure-``jnp`` form, and torch when importable (on the same device). Every contender is timed the
same way: after warm-up, ``--dispatches`` back-to-back calls then one synchronization, repeated
``--rounds`` times; the median per-call time is reported. Inputs are random, never zeros.

The floor of a case is the bytes it must move (each input read once, each output written once)
over the device copy bandwidth measured in the same run; "-" where a case has none.

Each op contributes a ``cases_<op>(ctx)`` function returning :class:`Case` objects; ``CASES``
maps op names to them. ``conv2d_sweep`` (the convolutions of a ResNet-50 and a ConvNeXt-T, both
dtypes and layouts) runs by default on a GPU only: on two CPU cores its --quick form did not
finish in 15 minutes (lax.conv's depthwise weight gradients take up to 70 ms a call there).
``train_step`` is a whole training step of a model over every op
(:class:`TrainModel`, also used by tools/scaling_bench.py) against the same model in pure JAX,
torch and (GPU) torch.compile; its slow contenders get fewer timed calls (``Case.budget_s``), and
lines starting with ``#`` above a case's rows are its notes (a contender left out, the bitwise
reproducibility of the jax_kernels step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_kernels as jk

try:
    import torch
except Exception:  # torch is an optional peer: absent, or broken in this environment
    torch = None

try:
    import torchvision
except Exception:  # an optional peer (roi_align): absent, or built for another torch
    torchvision = None


@dataclass
class Contender:
    name: str
    fn: Callable[[], object]  # one dispatch; returns what must be waited for
    kind: str = "jax"  # "jax" or "torch"


@dataclass
class Case:
    name: str
    floor_bytes: int | None  # bytes that must move through device memory (per call); None: no floor
    contenders: list[Contender] = field(default_factory=list)
    calls: int = 1  # calls per dispatch: times are reported per call
    budget_s: float | None = None  # see time_contender: a cap on a slow contender's timed calls
    notes: list[str] = field(default_factory=list)  # printed above the case's rows; in the JSON


@dataclass
class Context:
    platform: str  # "gpu" or "cpu"
    quick: bool
    torch_device: str | None  # "cuda" / "cpu" when torch can run on the JAX device's kind

    def rng(self, seed: int = 0) -> np.random.Generator:
        return np.random.default_rng(seed)


def _sync(kind: str, out) -> None:
    if kind == "torch":
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    else:
        jax.block_until_ready(out)


def time_contender(c: Contender, dispatches: int, rounds: int,
                   budget_s: float | None = None) -> float:
    """Median milliseconds per call over `rounds` of `dispatches` back-to-back calls. With a
    `budget_s`, a contender whose timed calls would take longer gets fewer dispatches, then
    fewer rounds (down to 3 rounds of 1 call), judged from its last warm-up call."""
    for _ in range(3):
        start = time.perf_counter()
        _sync(c.kind, c.fn())
    if budget_s is not None:
        call_s = time.perf_counter() - start
        dispatches = max(1, min(dispatches, int(budget_s / (rounds * call_s))))
        rounds = max(min(rounds, 3), min(rounds, int(budget_s / (dispatches * call_s))))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(dispatches):
            out = c.fn()
        _sync(c.kind, out)
        samples.append((time.perf_counter() - start) * 1e3 / dispatches)
    return statistics.median(samples)


def copy_bandwidth(ctx: Context, dispatches: int, rounds: int) -> float:
    """Device copy bandwidth in bytes/s (bytes read + written), best of jnp and torch."""
    n = (1 << 28) if ctx.platform == "gpu" else (1 << 24)
    x = jnp.asarray(ctx.rng().standard_normal(n, dtype=np.float32))
    copy = jax.jit(lambda v: v + 1.0)
    best = time_contender(Contender("jnp copy", lambda: copy(x)), dispatches, rounds)
    if ctx.torch_device is not None:
        src = torch.from_numpy(np.array(x)).to(ctx.torch_device)
        dst = torch.empty_like(src)
        best = min(best, time_contender(Contender("torch copy", lambda: dst.copy_(src), "torch"),
                                        dispatches, rounds))
    return 2 * n * 4 / (best * 1e-3)


def dispatch_overhead(dispatches: int, rounds: int) -> float:
    """Milliseconds per call of a jitted one-element computation, timed like every case: the
    per-dispatch cost that every JAX contender carries on top of its kernels."""
    x = jnp.ones((1,), jnp.float32)
    tiny = jax.jit(lambda v: v + 1.0)
    return time_contender(Contender("tiny", lambda: tiny(x)), dispatches, rounds)


# --- cases ---------------------------------------------------------------------------------------


def _jnp_random(ctx: Context, shape, dtype=jnp.float32, seed=0) -> jax.Array:
    return jnp.asarray(ctx.rng(seed).uniform(-1, 1, size=shape).astype(np.float32)).astype(dtype)


def _to_torch(ctx: Context, x: jax.Array):
    return torch.from_numpy(np.array(x)).to(ctx.torch_device)


def cases_lerp(ctx: Context) -> list[Case]:
    n = (1 << 26) if not ctx.quick else (1 << 22)
    a, b, w = (_jnp_random(ctx, (n,), seed=s) for s in range(3))
    w = (w + 1) / 2
    jk_scalar = jax.jit(lambda a, b: jk.lerp(a, b, 0.3))
    jnp_scalar = jax.jit(lambda a, b: a + 0.3 * (b - a))
    jk_array = jax.jit(jk.lerp)
    jnp_array = jax.jit(lambda a, b, w: a + w * (b - a))
    jk_fused = jax.jit(lambda a, b: jnp.tanh(jk.lerp(a, b, 0.3)) * 2.0)
    jnp_fused = jax.jit(lambda a, b: jnp.tanh(a + 0.3 * (b - a)) * 2.0)
    grad_jk = jax.jit(jax.grad(lambda a, b, w: jnp.sum(jk.lerp(a, b, w)), argnums=(0, 1, 2)))
    grad_jnp = jax.jit(jax.grad(lambda a, b, w: jnp.sum(a + w * (b - a)), argnums=(0, 1, 2)))
    scalar = Case(f"lerp fwd {n >> 20}M f32, scalar weight", 3 * 4 * n, [
        Contender("jax_kernels", lambda: jk_scalar(a, b)),
        Contender("jnp", lambda: jnp_scalar(a, b)),
    ])
    array = Case(f"lerp fwd {n >> 20}M f32, array weight", 4 * 4 * n, [
        Contender("jax_kernels", lambda: jk_array(a, b, w)),
        Contender("jnp", lambda: jnp_array(a, b, w)),
    ])
    fused = Case(f"tanh(lerp(a, b, 0.3)) * 2, {n >> 20}M f32", 3 * 4 * n, [
        Contender("jax_kernels", lambda: jk_fused(a, b)),
        Contender("jnp", lambda: jnp_fused(a, b)),
    ])
    # The gradient of sum(lerp) reads a, b, w and writes three gradients.
    grads = Case(f"lerp grad (a, b, w) {n >> 20}M f32", 6 * 4 * n, [
        Contender("jax_kernels", lambda: grad_jk(a, b, w)),
        Contender("jnp", lambda: grad_jnp(a, b, w)),
    ])
    if ctx.torch_device is not None:
        ta, tb, tw = (_to_torch(ctx, v) for v in (a, b, w))
        scalar.contenders.append(Contender("torch", lambda: torch.lerp(ta, tb, 0.3), "torch"))
        array.contenders.append(Contender("torch", lambda: torch.lerp(ta, tb, tw), "torch"))
        fused.contenders.append(
            Contender("torch", lambda: torch.tanh(torch.lerp(ta, tb, 0.3)) * 2.0, "torch"))
    return [scalar, array, fused, grads]


def cases_repeat(ctx: Context) -> list[Case]:
    side = 2048 if not ctx.quick else 512
    x = _jnp_random(ctx, (side, side))
    reps = (4, 4)
    out_bytes = 4 * side * side * 16
    jk_fwd = jax.jit(lambda x: jk.repeat(x, reps))
    jnp_fwd = jax.jit(lambda x: jnp.tile(x, reps))
    dout = _jnp_random(ctx, (side * 4, side * 4), seed=1)
    jk_bwd = jax.jit(lambda x, g: jax.vjp(lambda v: jk.repeat(v, reps), x)[1](g))
    jnp_bwd = jax.jit(lambda x, g: jax.vjp(lambda v: jnp.tile(v, reps), x)[1](g))
    jk_fused = jax.jit(lambda x: jk.repeat(x, reps) * 2.0 + 1.0)
    jnp_fused = jax.jit(lambda x: jnp.tile(x, reps) * 2.0 + 1.0)
    fwd = Case(f"repeat fwd {side}x{side} by {reps} f32", out_bytes + 4 * side * side, [
        Contender("jax_kernels", lambda: jk_fwd(x)),
        Contender("jnp.tile", lambda: jnp_fwd(x)),
    ])
    bwd = Case(f"repeat bwd {side}x{side} by {reps} f32", out_bytes + 4 * side * side, [
        Contender("jax_kernels", lambda: jk_bwd(x, dout)),
        Contender("jnp.tile", lambda: jnp_bwd(x, dout)),
    ])
    fused = Case(f"repeat(x) * 2 + 1, {side}x{side} by {reps} f32", out_bytes + 4 * side * side, [
        Contender("jax_kernels", lambda: jk_fused(x)),
        Contender("jnp.tile", lambda: jnp_fused(x)),
    ])
    # Ten calls on ten inputs inside one jit: the per-call time without JAX's per-dispatch cost.
    xs = [_jnp_random(ctx, (side, side), seed=10 + i) for i in range(10)]
    jk_ten = jax.jit(lambda xs: [jk.repeat(v, reps) for v in xs])
    jnp_ten = jax.jit(lambda xs: [jnp.tile(v, reps) for v in xs])
    amortized = Case(f"repeat fwd {side}x{side} by {reps} f32, 10 calls in one jit",
                     out_bytes + 4 * side * side, [
        Contender("jax_kernels", lambda: jk_ten(xs)),
        Contender("jnp.tile", lambda: jnp_ten(xs)),
    ], calls=10)
    if ctx.torch_device is not None:
        tx = _to_torch(ctx, x)
        fwd.contenders.append(Contender("torch", lambda: tx.repeat(*reps), "torch"))
        fused.contenders.append(Contender("torch", lambda: tx.repeat(*reps) * 2.0 + 1.0, "torch"))
    return [fwd, amortized, bwd, fused]


def roi_align_gather(input, boxes, output_size, spatial_scale, sampling_ratio, aligned):
    """RoIAlign as a user writes it in jnp: per-axis sample positions and bilinear weights, one
    gather of channel rows (NHWC) per corner; its gradient is XLA's scatter-add. Takes a fixed
    sampling_ratio > 0 only (an adaptive grid has a data-dependent shape)."""
    n, c, h, w = input.shape
    ph_count, pw_count = output_size
    grid = sampling_ratio
    offset = 0.5 if aligned else 0.0
    x1 = boxes[:, 1] * spatial_scale - offset
    y1 = boxes[:, 2] * spatial_scale - offset
    width = boxes[:, 3] * spatial_scale - offset - x1
    height = boxes[:, 4] * spatial_scale - offset - y1
    if not aligned:
        width, height = jnp.maximum(width, 1.0), jnp.maximum(height, 1.0)

    def axis(start, size, bins, extent):
        # positions [K, bins * grid], then torchvision's clamping and weights
        t = jnp.arange(bins * grid)
        fraction = (t // grid) + ((t % grid) + 0.5) / grid
        pos = start[:, None] + fraction[None, :] * (size / bins)[:, None]
        valid = (pos >= -1) & (pos <= extent)
        p = jnp.clip(pos, 0, None)
        low = jnp.floor(p).astype(jnp.int32)
        edge = low >= extent - 1
        low = jnp.where(edge, extent - 1, low)
        high = jnp.where(edge, extent - 1, low + 1)
        w_high = jnp.where(edge, 0.0, p - low)
        return valid, low, high, 1.0 - w_high, w_high

    vy, y_low, y_high, hy, ly = axis(y1, height, ph_count, h)
    vx, x_low, x_high, hx, lx = axis(x1, width, pw_count, w)
    image = jnp.transpose(input, (0, 2, 3, 1))  # NHWC: a gather fetches contiguous channel rows
    b = boxes[:, 0].astype(jnp.int32)[:, None, None]

    def corner(rows, cols):
        return image[b, rows[:, :, None], cols[:, None, :]]  # [K, Sy, Sx, C]

    wy_low, wy_high = hy[:, :, None, None], ly[:, :, None, None]
    wx_low, wx_high = hx[:, None, :, None], lx[:, None, :, None]
    value = (wy_low * wx_low * corner(y_low, x_low) + wy_low * wx_high * corner(y_low, x_high)
             + wy_high * wx_low * corner(y_high, x_low)
             + wy_high * wx_high * corner(y_high, x_high))
    value = jnp.where((vy[:, :, None] & vx[:, None, :])[..., None], value, 0.0)
    k = boxes.shape[0]
    value = value.reshape(k, ph_count, grid, pw_count, grid, c).mean(axis=(2, 4))
    return jnp.transpose(value, (0, 3, 1, 2))


def _roi_boxes(rng: np.random.Generator, count: int, images: int, height: float, width: float):
    """Detection-like boxes in image coordinates: sides of 32 to 512 pixels, clipped to the
    image, on random images."""
    side_w, side_h = rng.uniform(32, 512, count), rng.uniform(32, 512, count)
    x1 = rng.uniform(0, width - side_w.clip(max=width))
    y1 = rng.uniform(0, height - side_h.clip(max=height))
    x2, y2 = np.minimum(x1 + side_w, width), np.minimum(y1 + side_h, height)
    batch = rng.integers(0, images, count)
    return np.stack([batch, x1, y1, x2, y2], axis=1).astype(np.float32)


def _roi_touched_cells(boxes, images, height, width, bins, scale, grid):
    """Input cells (n, h, w) that the samples of the boxes read (aligned=False, fixed grid)."""
    touched = np.zeros((images, height, width), bool)
    t = np.arange(bins * grid)
    fraction = (t // grid) + ((t % grid) + 0.5) / grid
    for b, x1, y1, x2, y2 in boxes.astype(np.float64):
        def indices(start, size, extent):
            pos = start + fraction * max(size, 1.0) / bins
            pos = pos[(pos >= -1) & (pos <= extent)].clip(0, extent - 1)
            low = np.floor(pos).astype(int)
            return np.unique(np.concatenate([low, np.minimum(low + 1, extent - 1)]))
        rows = indices(y1 * scale, (y2 - y1) * scale, height)
        cols = indices(x1 * scale, (x2 - x1) * scale, width)
        touched[int(b)][np.ix_(rows, cols)] = True
    return int(touched.sum())


def cases_roi_align(ctx: Context) -> list[Case]:
    """The FPN level of a detector (N2 C256 200x272, scale 1/4, sampling ratio 2): 1024 boxes
    pooled to 7x7 and 512 to 14x14, forward and forward+backward, NCHW and channels last."""
    if ctx.quick:
        return _roi_align_cases(ctx, 2, 16, 50, 68, 128, 7)
    return (_roi_align_cases(ctx, 2, 256, 200, 272, 1024, 7) +
            _roi_align_cases(ctx, 2, 256, 200, 272, 512, 14))


def _roi_align_cases(ctx, n, c, h, w, k, bins):
    scale, grid = 0.25, 2
    x = _jnp_random(ctx, (n, c, h, w))
    x_last = jnp.transpose(x, (0, 2, 3, 1))
    boxes_np = _roi_boxes(ctx.rng(1), k, n, h / scale, w / scale)
    boxes = jnp.asarray(boxes_np)
    dout = _jnp_random(ctx, (k, c, bins, bins), seed=2)
    dout_last = jnp.transpose(dout, (0, 2, 3, 1))
    args = ((bins, bins), scale, grid, False)

    def jk_op(deterministic, layout="NCHW"):
        return lambda x, b: jk.roi_align(x, b, *args, deterministic=deterministic,
                                         data_format=layout)

    gather_op = lambda x, b: roi_align_gather(x, b, *args)

    def fwd_bwd(op):
        def run(x, b, g):
            out, vjp = jax.vjp(lambda x: op(x, b), x)
            return out, vjp(g)[0]
        return jax.jit(run)

    jk_fwd, gather_fwd = jax.jit(jk_op(True)), jax.jit(gather_op)
    jk_fwd_last = jax.jit(jk_op(True, "NHWC"))
    jk_both, jk_both_atomic = fwd_bwd(jk_op(True)), fwd_bwd(jk_op(False))
    jk_both_last = fwd_bwd(jk_op(True, "NHWC"))
    gather_both = fwd_bwd(gather_op)
    output_bytes = 4 * k * c * bins * bins
    touched_bytes = 4 * c * _roi_touched_cells(boxes_np, n, h, w, bins, scale, grid)
    forward_bytes = boxes_np.nbytes + touched_bytes + output_bytes
    # The backward also reads dout and writes the whole input gradient.
    both_bytes = forward_bytes + output_bytes + 4 * n * c * h * w
    name = f"roi_align N{n} C{c} {h}x{w}, {k} boxes, {bins}x{bins} sr2 scale 1/4"
    fwd = Case(f"{name} fwd", forward_bytes, [
        Contender("jax_kernels", lambda: jk_fwd(x, boxes)),
        Contender("jk NHWC", lambda: jk_fwd_last(x_last, boxes)),
        Contender("jnp gather", lambda: gather_fwd(x, boxes)),
    ])
    both = Case(f"{name} fwd+bwd", both_bytes, [
        Contender("jax_kernels", lambda: jk_both(x, boxes, dout)),
        Contender("jk NHWC", lambda: jk_both_last(x_last, boxes, dout_last)),
        Contender("jk atomic", lambda: jk_both_atomic(x, boxes, dout)),
        Contender("jnp gather", lambda: gather_both(x, boxes, dout)),
    ])
    if torchvision is not None and ctx.torch_device is not None:
        tx = _to_torch(ctx, x).requires_grad_(True)
        tboxes, tdout = _to_torch(ctx, boxes), _to_torch(ctx, dout)
        fwd.contenders.append(Contender(
            "torchvision", lambda: torchvision.ops.roi_align(tx.detach(), tboxes, *args), "torch"))

        def torchvision_both():
            tx.grad = None
            out = torchvision.ops.roi_align(tx, tboxes, *args)
            out.backward(tdout)
            return out, tx.grad

        both.contenders.append(Contender("torchvision", torchvision_both, "torch"))
    return [fwd, both]


def jnp_grid_sample_bilinear(x: jax.Array, grid: jax.Array) -> jax.Array:
    """What a JAX user writes without jax_kernels: bilinear grid_sample (zeros padding,
    align_corners=False) from four gathers; its gradient is a scatter-add."""
    _, _, h, w = x.shape
    ix = ((grid[..., 0] + 1) * w - 1) / 2
    iy = ((grid[..., 1] + 1) * h - 1) / 2
    x0, y0 = jnp.floor(ix), jnp.floor(iy)

    def corner(xs, ys, weight):
        def one_image(image, cx, cy, wgt):  # image [C, H, W], cx/cy/wgt [Ho, Wo]
            inside = (cx >= 0) & (cx < w) & (cy >= 0) & (cy < h)
            cxi = jnp.clip(cx, 0, w - 1).astype(jnp.int32)
            cyi = jnp.clip(cy, 0, h - 1).astype(jnp.int32)
            return image[:, cyi, cxi] * jnp.where(inside, wgt, 0)
        return jax.vmap(one_image)(x, xs, ys, weight)

    return (corner(x0, y0, (x0 + 1 - ix) * (y0 + 1 - iy)) + corner(x0 + 1, y0, (ix - x0) * (y0 + 1 - iy))
            + corner(x0, y0 + 1, (x0 + 1 - ix) * (iy - y0)) + corner(x0 + 1, y0 + 1, (ix - x0) * (iy - y0)))


def _smooth_grid(ctx: Context, n: int, ho: int, wo: int) -> np.ndarray:
    """A rotated, slightly zoomed sampling grid with jitter: the smooth warp of augmentation
    and optical flow, partly outside the image."""
    rng = ctx.rng(7)
    ys, xs = np.meshgrid(np.linspace(-1, 1, ho), np.linspace(-1, 1, wo), indexing="ij")
    angle = rng.uniform(-0.3, 0.3, size=(n, 1, 1))
    zoom = rng.uniform(0.9, 1.1, size=(n, 1, 1))
    gx = zoom * (np.cos(angle) * xs - np.sin(angle) * ys)
    gy = zoom * (np.sin(angle) * xs + np.cos(angle) * ys)
    grid = np.stack([gx, gy], axis=-1) + rng.uniform(-0.01, 0.01, size=(n, ho, wo, 2))
    return grid.astype(np.float32)


def cases_grid_sample(ctx: Context) -> list[Case]:
    """Bilinear, zeros, f32: the forward and forward+backward on a smooth grid (the warp of
    augmentation) and on uniformly random coordinates (every tap its own sector), in NCHW and
    channels last, against the jnp gather and torch."""
    if ctx.platform == "gpu":
        shapes = [(32, 64, 64, 64), (8, 256, 128, 128), (4, 32, 512, 512), (64, 3, 224, 224)]
    else:
        shapes = [(8, 32, 64, 64)] if not ctx.quick else [(2, 8, 32, 32)]
    cases = []
    for n, c, h, w in shapes:
        for kind in ("smooth", "random"):
            cases += _grid_sample_cases(ctx, n, c, h, w, kind)
    return cases


def _grid_sample_cases(ctx, n, c, h, w, kind):
    x = _jnp_random(ctx, (n, c, h, w))
    x_last = jnp.transpose(x, (0, 2, 3, 1))
    if kind == "smooth":
        grid = jnp.asarray(_smooth_grid(ctx, n, h, w))
    else:
        grid = jnp.asarray(ctx.rng(11).uniform(-1, 1, size=(n, h, w, 2)).astype(np.float32))
    dout = _jnp_random(ctx, (n, c, h, w), seed=3)
    dout_last = jnp.transpose(dout, (0, 2, 3, 1))
    tensor, grid_bytes = 4 * n * c * h * w, 4 * n * h * w * 2
    label = f"N{n} C{c} {h}x{w}->{h}x{w} f32 {kind} grid"

    def fwd_and_bwd(f):
        def run(x, grid, dout):
            out, vjp = jax.vjp(f, x, grid)
            return (out,) + vjp(dout)
        return jax.jit(run)

    nhwc = lambda a, b: jk.grid_sample(a, b, data_format="NHWC")
    jk_fwd, jk_fwd_last = jax.jit(jk.grid_sample), jax.jit(nhwc)
    jnp_fwd = jax.jit(jnp_grid_sample_bilinear)
    jk_both, jk_both_last = fwd_and_bwd(jk.grid_sample), fwd_and_bwd(nhwc)
    jk_both_atomic = fwd_and_bwd(lambda a, b: jk.grid_sample(a, b, deterministic=False))
    jnp_both = fwd_and_bwd(jnp_grid_sample_bilinear)
    fwd = Case(f"grid_sample fwd {label}", 2 * tensor + grid_bytes, [
        Contender("jax_kernels", lambda x=x, g=grid: jk_fwd(x, g)),
        Contender("jk NHWC", lambda x=x_last, g=grid: jk_fwd_last(x, g)),
        Contender("jnp gather", lambda x=x, g=grid: jnp_fwd(x, g)),
    ])
    # fwd+bwd reads input, grid, dout and writes out, d_input, d_grid.
    both = Case(f"grid_sample fwd+bwd {label}", 4 * tensor + 2 * grid_bytes, [
        Contender("jax_kernels", lambda x=x, g=grid, d=dout: jk_both(x, g, d)),
        Contender("jk NHWC", lambda x=x_last, g=grid, d=dout_last: jk_both_last(x, g, d)),
        Contender("jk atomic", lambda x=x, g=grid, d=dout: jk_both_atomic(x, g, d)),
        Contender("jnp gather", lambda x=x, g=grid, d=dout: jnp_both(x, g, d)),
    ])
    # Ten forwards on ten grids inside one jit: the per-call time without JAX's dispatch
    # cost (distinct grids, so that XLA cannot merge the calls).
    grids = [grid * (1.0 - 0.01 * i) for i in range(10)]
    jk_ten = jax.jit(lambda x, gs: [jk.grid_sample(x, g) for g in gs])
    jk_ten_last = jax.jit(lambda x, gs: [nhwc(x, g) for g in gs])
    jnp_ten = jax.jit(lambda x, gs: [jnp_grid_sample_bilinear(x, g) for g in gs])
    ten = Case(f"grid_sample fwd {label}, 10 calls in one jit", 2 * tensor + grid_bytes, [
        Contender("jax_kernels", lambda x=x, gs=grids: jk_ten(x, gs)),
        Contender("jk NHWC", lambda x=x_last, gs=grids: jk_ten_last(x, gs)),
        Contender("jnp gather", lambda x=x, gs=grids: jnp_ten(x, gs)),
    ], calls=10)
    if ctx.torch_device is not None:
        tx = _to_torch(ctx, x).requires_grad_(True)
        tg = _to_torch(ctx, grid).requires_grad_(True)
        td = _to_torch(ctx, dout)
        sample = torch.nn.functional.grid_sample

        def torch_both(tx=tx, tg=tg, td=td):
            out = sample(tx, tg, align_corners=False)
            return (out,) + torch.autograd.grad(out, (tx, tg), td)

        fwd.contenders.append(Contender(
            "torch", lambda tx=tx, tg=tg: sample(tx.detach(), tg.detach(), align_corners=False),
            "torch"))
        both.contenders.append(Contender("torch", torch_both, "torch"))
    return [fwd, ten, both]


def cases_conv2d(ctx: Context) -> list[Case]:
    """The target cases: 3x3 64->64 (bf16, f32 in TF32), 1x1 256->64 (bf16) and depthwise
    7x7 (f32, bf16), each forward, dgrad and wgrad, in both layouts (NCHW with KCRS weights;
    channels-last NHWC with HWIO weights), against lax.conv in the same layout and torch (cuDNN
    on the GPU, channels_last memory format for NHWC; torch's default TF32 for f32 as jk's and
    lax's default precision). The CPU runs the depthwise case of section 8 (C96 N8 28x28) and
    the dense ones at that size."""
    gpu = ctx.platform == "gpu"
    if ctx.quick:
        N, side, depthwise = 2, 14, 32
    elif gpu:
        N, side, depthwise = 32, 56, 384
    else:
        N, side, depthwise = 8, 28, 96
    configs = [  # name, C, K, kernel, padding, groups, dtype
        ("3x3 64->64", 64, 64, 3, 1, 1, jnp.bfloat16),
        ("1x1 256->64", 256, 64, 1, 0, 1, jnp.bfloat16),
        ("3x3 64->64", 64, 64, 3, 1, 1, jnp.float32),
        (f"depthwise 7x7 C{depthwise}", depthwise, depthwise, 7, 3, depthwise, jnp.float32),
        (f"depthwise 7x7 C{depthwise}", depthwise, depthwise, 7, 3, depthwise, jnp.bfloat16),
    ]
    cases = []
    for seed, (name, C, K, size, pad, groups, dtype) in enumerate(configs):
        for layout in ("NCHW", "NHWC"):
            cases += _conv2d_cases(ctx, seed, layout, name, N, side, C, K, size, pad, groups,
                                   dtype)
    return cases


# The conv2d sweep: the convolutions of a ResNet-50 and a ConvNeXt-T at 224x224 (one of each
# distinct shape; name, input side, C, K, kernel, stride, padding, groups).
CONV_SWEEP = [
    ("resnet50 stem 7x7/2", 224, 3, 64, 7, 2, 3, 1),
    ("resnet50 1x1 64->256", 56, 64, 256, 1, 1, 0, 1),
    ("resnet50 1x1 256->64", 56, 256, 64, 1, 1, 0, 1),
    ("resnet50 3x3 64->64", 56, 64, 64, 3, 1, 1, 1),
    ("resnet50 3x3/2 128->128", 56, 128, 128, 3, 2, 1, 1),
    ("resnet50 1x1/2 256->512", 56, 256, 512, 1, 2, 0, 1),
    ("resnet50 3x3 256->256", 14, 256, 256, 3, 1, 1, 1),
    ("resnet50 1x1 1024->256", 14, 1024, 256, 1, 1, 0, 1),
    ("resnet50 3x3 512->512", 7, 512, 512, 3, 1, 1, 1),
    ("convnext stem 4x4/4", 224, 3, 96, 4, 4, 0, 1),
    ("convnext dw 7x7 C96", 56, 96, 96, 7, 1, 3, 96),
    ("convnext 1x1 96->384", 56, 96, 384, 1, 1, 0, 1),
    ("convnext 1x1 384->96", 56, 384, 96, 1, 1, 0, 1),
    ("convnext down 2x2/2 96->192", 56, 96, 192, 2, 2, 0, 1),
    ("convnext dw 7x7 C384", 14, 384, 384, 7, 1, 3, 384),
    ("convnext dw 7x7 C768", 7, 768, 768, 7, 1, 3, 768),
    ("convnext dw 7x7 C192", 28, 192, 192, 7, 1, 3, 192),  # last: the others keep their seeds
]


def cases_conv2d_sweep(ctx: Context) -> list[Case]:
    """CONV_SWEEP, each forward, dgrad and wgrad, in bfloat16 and float32 (TF32), in both layouts,
    per dispatch and 10 calls in one jit, against lax.conv and torch as cases_conv2d. Batch 32 on
    the GPU; on a CPU batch 2 at a quarter of the side (--quick: batch 1, an eighth, bf16 only)."""
    gpu = ctx.platform == "gpu"
    N, scale = (1, 8) if ctx.quick else (32, 1) if gpu else (2, 4)
    dtypes = (jnp.bfloat16,) if ctx.quick else (jnp.bfloat16, jnp.float32)
    cases = []
    for seed, (name, side, C, K, size, stride, pad, groups) in enumerate(CONV_SWEEP):
        side = max(side // scale, size)
        for dtype in dtypes:
            for layout in ("NCHW", "NHWC"):
                cases += _conv2d_cases(ctx, seed, layout, name, N, side, C, K, size, pad,
                                       groups, dtype, stride)
    return cases


def _conv2d_cases(ctx, seed, layout, name, N, side, C, K, size, pad, groups, dtype, stride=1):
    last = layout == "NHWC"
    out = (side + 2 * pad - size) // stride + 1
    x = _jnp_random(ctx, (N, side, side, C) if last else (N, C, side, side), dtype, seed=3 * seed)
    w = _jnp_random(ctx, (size, size, C // groups, K) if last else (K, C // groups, size, size),
                    dtype, seed=3 * seed + 1)
    dy = _jnp_random(ctx, (N, out, out, K) if last else (N, K, out, out), dtype,
                     seed=3 * seed + 2)
    item = np.dtype(dtype).itemsize
    x_bytes, w_bytes, y_bytes = x.size * item, w.size * item, dy.size * item
    numbers = ("NHWC", "HWIO", "NHWC") if last else ("NCHW", "OIHW", "NCHW")

    def ours(x, w, pad=pad, groups=groups):
        return jk.conv2d(x, w, stride=stride, padding=pad, groups=groups, data_format=layout)

    def lax_conv(x, w, pad=pad, groups=groups):
        return jax.lax.conv_general_dilated(x, w, (stride, stride), [(pad, pad), (pad, pad)],
                                            feature_group_count=groups,
                                            dimension_numbers=numbers)

    label = f"conv2d {name} N{N} {side}x{side} {np.dtype(dtype).name} {layout}"
    fwd = Case(f"{label} fwd", x_bytes + w_bytes + y_bytes)
    dgrad = Case(f"{label} dgrad", y_bytes + w_bytes + x_bytes)
    wgrad = Case(f"{label} wgrad", y_bytes + x_bytes + w_bytes)
    # Ten calls inside one jit, on ten weights (fwd) or ten output gradients (dgrad, wgrad)
    # so that XLA cannot merge them: the per-call time without JAX's per-dispatch cost,
    # which is most of the time of the small dense cases.
    ten = [Case(f"{case.name}, 10 calls in one jit", case.floor_bytes, calls=10)
           for case in (fwd, dgrad, wgrad)]
    ws = [w * (1 - 0.01 * i) for i in range(10)]
    dys = [dy * (1 - 0.01 * i) for i in range(10)]
    for contender, conv in (("jax_kernels", ours), ("lax.conv", lax_conv)):
        f = jax.jit(conv)
        d = jax.jit(lambda x, w, dy, conv=conv: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0])
        g = jax.jit(lambda x, w, dy, conv=conv: jax.vjp(lambda w: conv(x, w), w)[1](dy)[0])
        args = (x, w, dy)
        fwd.contenders.append(Contender(contender, lambda f=f, a=args: f(*a[:2])))
        dgrad.contenders.append(Contender(contender, lambda d=d, a=args: d(*a)))
        wgrad.contenders.append(Contender(contender, lambda g=g, a=args: g(*a)))
        f10 = jax.jit(lambda x, ws, conv=conv: [conv(x, v) for v in ws])
        d10 = jax.jit(lambda x, w, dys, conv=conv: [
            jax.vjp(lambda x: conv(x, w), x)[1](v)[0] for v in dys])
        g10 = jax.jit(lambda x, w, dys, conv=conv: [
            jax.vjp(lambda w: conv(x, w), w)[1](v)[0] for v in dys])
        many = (x, w, ws, dys)
        ten[0].contenders.append(Contender(contender, lambda f=f10, a=many: f(a[0], a[2])))
        ten[1].contenders.append(Contender(contender, lambda d=d10, a=many: d(a[0], a[1], a[3])))
        ten[2].contenders.append(Contender(contender, lambda g=g10, a=many: g(a[0], a[1], a[3])))
    if ctx.torch_device is not None:
        def to_torch(a, kind, dtype=dtype):
            if last:  # torch's logical NCHW / KCRS shapes over channels-last memory
                a = jnp.transpose(a, (3, 2, 0, 1) if kind == "w" else (0, 3, 1, 2))
            t = torch.from_numpy(np.asarray(a.astype(jnp.float32))).to(ctx.torch_device)
            t = t.to(torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32)
            return t.contiguous(memory_format=torch.channels_last) if last else t

        t = (to_torch(x, "x"), to_torch(w, "w"), to_torch(dy, "x"))
        o = dict(stride=stride, padding=pad, dilation=1, groups=groups)
        fwd.contenders.append(Contender(
            "torch", lambda t=t, o=o: torch.nn.functional.conv2d(t[0], t[1], None, **o),
            "torch"))
        dgrad.contenders.append(Contender(
            "torch", lambda t=t, o=o: torch.nn.grad.conv2d_input(t[0].shape, t[1], t[2], **o),
            "torch"))
        wgrad.contenders.append(Contender(
            "torch", lambda t=t, o=o: torch.nn.grad.conv2d_weight(t[0], t[1].shape, t[2], **o),
            "torch"))
    return [fwd, dgrad, wgrad, *ten]


# --- training step -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainModel:
    """The training-step model over every op (shared with tools/scaling_bench.py):

    - spatial transformer on the images: conv 5x5 stride 4 (3 -> loc_channels) + bias, SiLU,
      spatial mean, linear to the 6 affine parameters (around the identity), ``affine_grid``,
      bilinear ``grid_sample`` of the images;
    - stem conv 3x3 stride 2 (3 -> channels) + bias, SiLU;
    - ``blocks`` residual blocks: depthwise ``kernel`` x ``kernel`` (groups = channels), pointwise
      1x1 to 2 x channels + bias, SiLU, pointwise 1x1 back;
    - head: ``roi_align`` of ``boxes`` boxes per image (features at scale 1/2, sampling ratio 2,
      aligned) to ``pool`` x ``pool``, next to a learned embedding of the box's slot in its image
      (``boxes`` x channels, ``repeat``-ed over the images, as DETR's queries), a linear
      classifier over ``classes``, cross-entropy in float32;
    - one SGD step and an EMA of the parameters through ``lerp``.

    Boxes come ``boxes`` per image, in image order (what the slot embedding relies on).
    SiLU rather than ReLU: with a kink, where a pre-activation is near zero each implementation's
    rounding picks the gradient, and the implementations could not be compared at float32
    tolerance.
    """
    channels: int = 64
    blocks: int = 2
    kernel: int = 7
    boxes: int = 4
    pool: int = 7
    classes: int = 10
    loc_channels: int = 8
    learning_rate: float = 0.05
    ema_rate: float = 0.01


# model, batch, image side: a realistic step on the GPU, a small one on the CPU (--full there),
# a tiny one for --quick (a jax_kernels step in about 2 ms on two cores; compiling dominates).
TRAIN_SIZES = {
    "gpu": (TrainModel(channels=64, boxes=8, pool=7), 32, 128),
    "cpu": (TrainModel(channels=32, boxes=4, pool=7), 8, 64),
    "quick": (TrainModel(channels=16, boxes=4, pool=4), 2, 32),
}


def train_init(model: TrainModel, dtype=jnp.float32, seed: int = 0) -> dict[str, jax.Array]:
    """Parameters as a flat dict (the torch model takes the same): normal weights scaled by
    fan-in, zero biases."""
    rng = np.random.default_rng(seed)
    c, loc = model.channels, model.loc_channels

    def normal(shape, fan_in, gain=2.0):
        return rng.standard_normal(shape) * np.sqrt(gain / fan_in)

    params = {
        "loc_w": normal((loc, 3, 5, 5), 75), "loc_b": np.zeros(loc),
        # small: the transformer starts near the identity
        "loc_fc": 0.01 * rng.standard_normal((loc, 6)),
        "stem_w": normal((c, 3, 3, 3), 27), "stem_b": np.zeros(c),
    }
    for i in range(model.blocks):
        params[f"dw{i}"] = normal((c, 1, model.kernel, model.kernel), model.kernel ** 2)
        params[f"pw{i}_in"] = normal((2 * c, c, 1, 1), c)
        params[f"pw{i}_in_b"] = np.zeros(2 * c)
        # halved so the residual sum stays of unit scale
        params[f"pw{i}_out"] = normal((c, 2 * c, 1, 1), 2 * c, gain=0.5)
    params["slot"] = 0.1 * rng.standard_normal((model.boxes, c))
    features = c * model.pool ** 2 + c
    params["head_w"] = normal((features, model.classes), features, gain=1.0)
    params["head_b"] = np.zeros(model.classes)
    return {k: jnp.asarray(v.astype(np.float32)).astype(dtype) for k, v in params.items()}


def train_data(model: TrainModel, batch: int, side: int, dtype=jnp.float32, seed: int = 0):
    """Images [batch, 3, side, side], boxes [batch * model.boxes, 5] (image coordinates, in
    image order, of the images' dtype, as roi_align takes them) and int32 labels."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch, 3, side, side)).astype(np.float32)
    k = batch * model.boxes
    x1, y1 = rng.uniform(0, side * 0.6, k), rng.uniform(0, side * 0.6, k)
    w, h = rng.uniform(side / 8, side * 0.4, k), rng.uniform(side / 8, side * 0.4, k)
    boxes = np.stack([np.repeat(np.arange(batch), model.boxes), x1, y1, x1 + w, y1 + h], 1)
    labels = rng.integers(0, model.classes, k).astype(np.int32)
    return (jnp.asarray(images).astype(dtype), jnp.asarray(boxes.astype(np.float32)).astype(dtype),
            jnp.asarray(labels))


def _lax_conv(x, w, b=None, stride=1, padding=0, groups=1):
    y = jax.lax.conv_general_dilated(x, w, (stride, stride), [(padding, padding)] * 2,
                                     feature_group_count=groups,
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y if b is None else y + b[:, None, None]


def jnp_affine_grid(theta: jax.Array, size) -> jax.Array:
    """affine_grid (align_corners=False) as a jnp einsum over the base coordinates; half types
    computed in float32, as jk.affine_grid does."""
    _, _, h, w = size
    compute = jnp.float32 if theta.dtype in (jnp.float16, jnp.bfloat16) else theta.dtype
    ys, xs = np.meshgrid((2 * np.arange(h) + 1) / h - 1, (2 * np.arange(w) + 1) / w - 1,
                         indexing="ij")
    base = jnp.asarray(np.stack([xs, ys, np.ones_like(xs)], -1), compute)
    return jnp.einsum("hwk,njk->nhwj", base, theta.astype(compute)).astype(theta.dtype)


TRAIN_OPS = {
    "jax_kernels": dict(
        conv=jk.conv2d, affine_grid=jk.affine_grid, sample=jk.grid_sample, tile=jk.repeat,
        pool=lambda x, boxes, size: jk.roi_align(x, boxes, size, 0.5, 2, True), lerp=jk.lerp),
    "pure JAX": dict(
        conv=_lax_conv, affine_grid=jnp_affine_grid, sample=jnp_grid_sample_bilinear,
        tile=jnp.tile, lerp=lambda e, p, w: e + w * (p - e),
        # the gather's weights are float32: back to the features' dtype, as jk.roi_align's output
        pool=lambda x, boxes, size: roi_align_gather(x, boxes, (size, size), 0.5, 2,
                                                     True).astype(x.dtype)),
}


def train_loss(ops: dict, model: TrainModel) -> Callable:
    """loss(params, images, boxes, labels) of the model (see TrainModel) built from `ops`."""
    def loss(params, images, boxes, labels):
        conv = ops["conv"]
        loc = jax.nn.silu(conv(images, params["loc_w"], params["loc_b"], stride=4, padding=2))
        theta = (jnp.eye(2, 3, dtype=images.dtype)
                 + (loc.mean(axis=(2, 3)) @ params["loc_fc"]).reshape(-1, 2, 3))
        x = ops["sample"](images, ops["affine_grid"](theta, images.shape))
        h = jax.nn.silu(conv(x, params["stem_w"], params["stem_b"], stride=2, padding=1))
        for i in range(model.blocks):
            y = conv(h, params[f"dw{i}"], padding=model.kernel // 2, groups=model.channels)
            y = jax.nn.silu(conv(y, params[f"pw{i}_in"], params[f"pw{i}_in_b"]))
            h = h + conv(y, params[f"pw{i}_out"])
        k = boxes.shape[0]
        pooled = ops["pool"](h, boxes, model.pool).reshape(k, -1)
        slots = ops["tile"](params["slot"], (k // model.boxes, 1))
        logits = jnp.concatenate([pooled, slots], 1) @ params["head_w"] + params["head_b"]
        log_p = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(log_p, labels[:, None], axis=1))
    return loss


def train_step(ops: dict, model: TrainModel) -> Callable:
    """step(params, ema, images, boxes, labels) -> (params, ema, loss): value_and_grad, an SGD
    update, and the EMA of the updated parameters through ops["lerp"]. Not jitted."""
    value_and_grad = jax.value_and_grad(train_loss(ops, model))

    def step(params, ema, images, boxes, labels):
        value, grads = value_and_grad(params, images, boxes, labels)
        params = jax.tree.map(lambda p, g: p - model.learning_rate * g, params, grads)
        ema = jax.tree.map(lambda e, p: ops["lerp"](e, p, model.ema_rate), ema, params)
        return params, ema, value
    return step


def train_steps(ops: dict, model: TrainModel) -> Callable:
    """steps(params, ema, images, boxes, labels) over batches stacked on a leading axis, one
    step per batch through lax.scan -> (params, ema, losses). Not jitted."""
    step = train_step(ops, model)

    def steps(params, ema, images, boxes, labels):
        def body(state, batch):
            params, ema, value = step(*state, *batch)
            return (params, ema), value
        (params, ema), values = jax.lax.scan(body, (params, ema), (images, boxes, labels))
        return params, ema, values
    return steps


def torch_train_loss(model: TrainModel) -> Callable:
    """The same model in torch (torchvision's roi_align): loss(params, images, boxes, labels)."""
    F = torch.nn.functional

    def loss(p, images, boxes, labels):
        loc = F.silu(F.conv2d(images, p["loc_w"], p["loc_b"], stride=4, padding=2))
        theta = (torch.eye(2, 3, dtype=images.dtype, device=images.device)
                 + (loc.mean(dim=(2, 3)) @ p["loc_fc"]).reshape(-1, 2, 3))
        grid = F.affine_grid(theta, list(images.shape), align_corners=False)
        x = F.grid_sample(images, grid, align_corners=False)
        h = F.silu(F.conv2d(x, p["stem_w"], p["stem_b"], stride=2, padding=1))
        for i in range(model.blocks):
            y = F.conv2d(h, p[f"dw{i}"], padding=model.kernel // 2, groups=model.channels)
            y = F.silu(F.conv2d(y, p[f"pw{i}_in"], p[f"pw{i}_in_b"]))
            h = h + F.conv2d(y, p[f"pw{i}_out"])
        k = boxes.shape[0]
        pooled = torchvision.ops.roi_align(h, boxes, model.pool, 0.5, 2, True).reshape(k, -1)
        slots = p["slot"].repeat(k // model.boxes, 1)
        logits = torch.cat([pooled, slots], 1) @ p["head_w"] + p["head_b"]
        return F.cross_entropy(logits.float(), labels)
    return loss


def torch_train_step(model: TrainModel, params: dict, loss: Callable) -> Callable:
    """step(images, boxes, labels) -> loss: backward, torch.optim.SGD's step and a
    ``_foreach_lerp_`` EMA, on `params` (torch leaf tensors, updated in place) and a copy."""
    ema = [p.detach().clone() for p in params.values()]
    optimizer = torch.optim.SGD(list(params.values()), lr=model.learning_rate)

    def step(images, boxes, labels):
        optimizer.zero_grad(set_to_none=True)
        value = loss(params, images, boxes, labels)
        value.backward()
        optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, list(params.values()), model.ema_rate)
        return value
    return step


def _tree_bits(tree) -> bytes:
    return b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree))


def cases_train_step(ctx: Context) -> list[Case]:
    """One SGD step (+ lerp EMA) of TrainModel, f32 and bf16: per dispatch, and 10 steps on 10
    distinct batches in one jit (lax.scan); jax_kernels against the same model in pure JAX, in
    torch eager and (GPU) torch.compile. No floor: a training step has no bandwidth bound."""
    model, batch, side = TRAIN_SIZES["quick" if ctx.quick else
                                     "gpu" if ctx.platform == "gpu" else "cpu"]
    cases = []
    for dtype in (jnp.float32, jnp.bfloat16):
        cases += _train_step_cases(ctx, model, batch, side, dtype)
    return cases


def _train_step_cases(ctx, model, batch, side, dtype, steps=10):
    label = (f"train_step N{batch} 3x{side}x{side} C{model.channels} {model.boxes} boxes/img "
             f"{np.dtype(dtype).name}")
    params = train_init(model, dtype)
    data = [train_data(model, batch, side, dtype, seed=1 + i) for i in range(steps)]
    stacked = [jnp.stack(arrays) for arrays in zip(*data)]
    # The pure-JAX step is slow on the CPU (XLA's depthwise convolutions: 0.5 s a step at the
    # CPU size), so each contender's timed calls are capped.
    budget = 1.0 if ctx.quick else 5.0
    one = Case(f"{label}, per dispatch", None, budget_s=budget)
    scan = Case(f"{label}, {steps} steps in one jit", None, calls=steps, budget_s=budget)
    for name, ops in TRAIN_OPS.items():
        step, many = jax.jit(train_step(ops, model)), jax.jit(train_steps(ops, model))
        one.contenders.append(Contender(name, lambda s=step: s(params, params, *data[0])))
        scan.contenders.append(Contender(name, lambda s=many: s(params, params, *stacked)))
    # jax_kernels promises bitwise reproducible passes: the whole 10-step program must be too.
    jk_many = scan.contenders[0].fn
    same = _tree_bits(jk_many()) == _tree_bits(jk_many())
    scan.notes.append(f"jax_kernels {steps} steps run twice: "
                      f"{'bitwise identical' if same else 'RESULTS DIFFER'}")
    if ctx.torch_device is None:
        one.notes.append("torch left out: torch does not import or cannot use this device")
    elif torchvision is None:
        one.notes.append("torch left out: torchvision (roi_align) does not import")
    else:
        one.contenders += _torch_train_contenders(ctx, model, params, data[0], dtype, one.notes)
    return [one, scan]


def _torch_train_contenders(ctx, model, params, batch, dtype, notes) -> list[Contender]:
    tdtype = torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32

    def tensor(a):
        # Through float32 (torch takes no numpy bfloat16; exact), and a copy: np.asarray of a
        # JAX CPU array is a view of its buffer, which torch's in-place updates would overwrite.
        return torch.from_numpy(np.array(a.astype(jnp.float32))).to(ctx.torch_device, tdtype)

    images, boxes = tensor(batch[0]), tensor(batch[1])
    labels = torch.from_numpy(np.asarray(batch[2]).astype(np.int64)).to(ctx.torch_device)
    variants = [("torch", torch_train_loss(model))]
    if ctx.platform == "gpu":
        variants.append(("torch.compile", torch.compile(torch_train_loss(model))))
    contenders = []
    for name, loss in variants:
        leaves = {k: tensor(v).requires_grad_(True) for k, v in params.items()}
        step = torch_train_step(model, leaves, loss)
        try:  # compiles torch.compile's graphs; a failure is reported, not fatal
            step(images, boxes, labels)
        except Exception as e:
            notes.append(f"{name} left out: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        contenders.append(Contender(name, lambda s=step: s(images, boxes, labels), "torch"))
    return contenders


CASES: dict[str, Callable[[Context], list[Case]]] = {
    "grid_sample": cases_grid_sample,
    "lerp": cases_lerp,
    "repeat": cases_repeat,
    "roi_align": cases_roi_align,
    "conv2d": cases_conv2d,
    "conv2d_sweep": cases_conv2d_sweep,
    "train_step": cases_train_step,
}


# --- driver --------------------------------------------------------------------------------------


def run(ops: list[str], quick: bool, dispatches: int, rounds: int,
        match: list[str] | None = None, contenders: list[str] | None = None) -> dict:
    platform = jax.default_backend()
    torch_device = None
    if torch is not None:
        if platform == "gpu" and torch.cuda.is_available():
            torch_device = "cuda"
        elif platform == "cpu":
            torch_device = "cpu"
    ctx = Context(platform=platform, quick=quick, torch_device=torch_device)
    bandwidth = copy_bandwidth(ctx, dispatches, rounds)
    overhead = dispatch_overhead(dispatches, rounds)
    device = jax.devices()[0].device_kind
    report = {
        "device": device,
        "platform": platform,
        "jax": jax.__version__,
        "torch": getattr(torch, "__version__", None),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "jax_dispatch_ms": overhead,
        "dispatches": dispatches,
        "rounds": rounds,
        "cases": [],
    }
    print(f"# {device} ({platform}), jax {jax.__version__}, torch {report['torch']}, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write), "
          f"JAX dispatch of a one-element jit {overhead:.4f} ms")
    print(f"{'case':72s} {'contender':13s} {'ms':>9s} {'x floor':>8s} {'x jk':>7s}")
    for op in ops:
        for case in CASES[op](ctx):
            if match and not any(m in case.name for m in match):
                continue
            if contenders:
                case.contenders[:] = [c for c in case.contenders if c.name in contenders]
            floor_ms = None if case.floor_bytes is None else case.floor_bytes / bandwidth * 1e3
            times = {c.name: time_contender(c, dispatches, rounds, case.budget_s) / case.calls
                     for c in case.contenders}
            ours = times.get("jax_kernels")
            for note in case.notes:
                print(f"# {case.name}: {note}")
            for name, ms in times.items():
                ratio = f"{ms / ours:7.2f}" if ours else "      -"
                floor = f"{ms / floor_ms:8.2f}" if floor_ms else "       -"
                print(f"{case.name[:72]:72s} {name:13s} {ms:9.4f} {floor} {ratio}")
            report["cases"].append({"case": case.name, "floor_ms": floor_ms, "ms": times,
                                    "notes": case.notes})
            sys.stdout.flush()
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=None,
                        help="comma-separated ops (default: every op; on a CPU every op but "
                             "conv2d_sweep, whose lax.conv depthwise gradients take minutes "
                             "there)")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (the default on a CPU)")
    parser.add_argument("--full", action="store_true",
                        help="the full sizes on a CPU too (the default on a GPU)")
    parser.add_argument("--match", default=None,
                        help="comma-separated substrings: only the cases whose name holds one")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated contender names to time (default: all)")
    parser.add_argument("--dispatches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    if args.ops is None:
        on_cpu = jax.default_backend() == "cpu"
        args.ops = ",".join(op for op in CASES if not (on_cpu and op == "conv2d_sweep"))
    ops = [op for op in args.ops.split(",") if op]
    unknown = [op for op in ops if op not in CASES]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(CASES)}")
    if args.quick and args.full:
        parser.error("--quick and --full exclude each other")
    quick = args.quick or (not args.full and jax.default_backend() == "cpu")
    split = lambda text: [t for t in text.split(",") if t] if text else None  # noqa: E731
    report = run(ops, quick, args.dispatches, args.rounds, split(args.match),
                 split(args.contenders))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
