"""Tests of jk.roi_align against an independent float64 reference written from torchvision's
documented semantics (in torch, so that autograd gives the reference gradients of the input and
the box coordinates), and against torchvision itself where it is installed (the GPU machine).

The same file runs on the GPU with JAX_PLATFORMS=cuda; there it also checks that the backward is
bitwise reproducible and that deterministic=False agrees with the deterministic path.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import jax_kernels as jk
from jk_testing import (ON_GPU, TORCH_UNAVAILABLE, assert_close, assert_lowered, random, rtol,
                        to_numpy64, torch)

if torch is None:  # the reference is written in torch (float64 autograd)
    pytest.skip(TORCH_UNAVAILABLE, allow_module_level=True)

try:
    import torchvision
except Exception as error:  # optional: absent, or built for another torch (RuntimeError)
    torchvision = None
    TORCHVISION_UNAVAILABLE = f"torchvision is not importable ({type(error).__name__}: {error})"[:200]
else:
    TORCHVISION_UNAVAILABLE = ""

HALF = (jnp.float16, jnp.bfloat16)
FORBIDDEN = ("stablehlo.while", "stablehlo.gather", "stablehlo.scatter")


# --- reference ---------------------------------------------------------------------------------


def _axis_weights(pos, size):
    """torchvision's bilinear footprint along one axis for sample positions `pos` (1-D float64
    tensor): (valid, low, high, w_low, w_high). Clamped positions carry no gradient."""
    valid = (pos >= -1) & (pos <= size)
    p = torch.where(pos <= 0, torch.zeros_like(pos), pos)
    p = torch.where(valid, p, torch.zeros_like(p))  # keeps NaN away from the integer casts
    low = torch.floor(p).long()
    at_edge = low >= size - 1
    low = torch.where(at_edge, torch.full_like(low, size - 1), low)
    high = torch.where(at_edge, low, low + 1)
    p = torch.where(at_edge, low.to(p.dtype), p)
    w_high = p - low.to(p.dtype)
    return valid, low, high, 1 - w_high, w_high


def reference_roi_align(input, rois, output_size, spatial_scale, sampling_ratio, aligned):
    """RoIAlign of float64 torch tensors input [N, C, H, W] and rois [K, 5], from torchvision's
    documentation: per box, bins of (box size / output size); per bin a grid of sampling_ratio
    (or ceil(box size / output size)) samples per axis at bin fractions (i + 0.5) / grid; bilinear
    samples, 0 outside [-1, size]; the mean over the grid. Box sizes are raised to 1 unless
    aligned, which instead shifts the box by half a pixel. The batch index is truncated toward zero
    (torchvision's int cast); one outside [0, N) after that, NaN or infinite gives zeros."""
    n_images, channels, height, width = input.shape
    ph_count, pw_count = output_size
    outputs = []
    for k in range(rois.shape[0]):
        batch = float(rois[k, 0].detach())
        zero = torch.zeros(channels, ph_count, pw_count, dtype=input.dtype) + 0 * rois[k].sum()
        if not (-1 < batch < n_images):  # torchvision truncates the index toward zero
            outputs.append(zero)
            continue
        offset = 0.5 if aligned else 0.0
        x1 = rois[k, 1] * spatial_scale - offset
        y1 = rois[k, 2] * spatial_scale - offset
        width_k = (rois[k, 3] * spatial_scale - offset) - x1
        height_k = (rois[k, 4] * spatial_scale - offset) - y1
        if not aligned:
            width_k = torch.clamp(width_k, min=1.0)
            height_k = torch.clamp(height_k, min=1.0)
        bin_h, bin_w = height_k / ph_count, width_k / pw_count
        if sampling_ratio > 0:
            grid_h = grid_w = sampling_ratio
        else:
            grid_h = max(int(math.ceil(float(height_k.detach()) / ph_count)), 0)
            grid_w = max(int(math.ceil(float(width_k.detach()) / pw_count)), 0)
        count = max(grid_h * grid_w, 1)
        if grid_h == 0 or grid_w == 0:
            outputs.append(zero)
            continue
        ph = torch.arange(ph_count, dtype=input.dtype).repeat_interleave(grid_h)
        iy = torch.arange(grid_h, dtype=input.dtype).repeat(ph_count)
        pw = torch.arange(pw_count, dtype=input.dtype).repeat_interleave(grid_w)
        ix = torch.arange(grid_w, dtype=input.dtype).repeat(pw_count)
        y = y1 + ph * bin_h + (iy + 0.5) * bin_h / grid_h
        x = x1 + pw * bin_w + (ix + 0.5) * bin_w / grid_w
        vy, y_low, y_high, hy, ly = _axis_weights(y, height)
        vx, x_low, x_high, hx, lx = _axis_weights(x, width)
        image = input[int(batch)]

        def corner(rows, cols):
            return image[:, rows[:, None], cols[None, :]]

        value = (hy[:, None] * hx[None, :] * corner(y_low, x_low)
                 + hy[:, None] * lx[None, :] * corner(y_low, x_high)
                 + ly[:, None] * hx[None, :] * corner(y_high, x_low)
                 + ly[:, None] * lx[None, :] * corner(y_high, x_high))
        value = torch.where(vy[:, None] & vx[None, :], value, torch.zeros_like(value))
        value = value.reshape(channels, ph_count, grid_h, pw_count, grid_w)
        outputs.append(value.sum(dim=(2, 4)) / count)
    if not outputs:
        return torch.zeros(0, channels, ph_count, pw_count, dtype=input.dtype) + 0 * rois.sum()
    return torch.stack(outputs)


def reference(input, boxes, output_size, spatial_scale=1.0, sampling_ratio=-1, aligned=False):
    size = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    t_in = torch.from_numpy(to_numpy64(input).copy())
    t_boxes = torch.from_numpy(to_numpy64(boxes).copy())
    return reference_roi_align(t_in, t_boxes, size, spatial_scale, sampling_ratio, aligned).numpy()


def reference_grads(input, boxes, dout, output_size, spatial_scale, sampling_ratio, aligned):
    """(d_input, d_boxes) of sum(dout * reference(...)) by torch autograd in float64."""
    size = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    t_in = torch.from_numpy(to_numpy64(input).copy()).requires_grad_(True)
    t_boxes = torch.from_numpy(to_numpy64(boxes).copy()).requires_grad_(True)
    out = reference_roi_align(t_in, t_boxes, size, spatial_scale, sampling_ratio, aligned)
    (out * torch.from_numpy(to_numpy64(dout).copy())).sum().backward()
    # Without a valid box the output does not depend on the input at all.
    return tuple(np.zeros(t.shape) if t.grad is None else t.grad.numpy() for t in (t_in, t_boxes))


# --- data --------------------------------------------------------------------------------------


def make_boxes(seed, n_images, height, width, spatial_scale, count=12):
    """Boxes in image coordinates (the input scaled by 1 / spatial_scale): inside, partly
    outside, tiny, wider than the image, with real-valued corners that keep samples off the
    pixel grid."""
    rng = np.random.default_rng(seed)
    h, w = height / spatial_scale, width / spatial_scale
    x1 = rng.uniform(-0.3 * w, 0.9 * w, count)
    y1 = rng.uniform(-0.3 * h, 0.9 * h, count)
    x2 = x1 + rng.uniform(0.05, 0.8, count) * w
    y2 = y1 + rng.uniform(0.05, 0.8, count) * h
    batch = rng.integers(0, n_images, count).astype(np.float64)
    rows = np.stack([batch, x1, y1, x2, y2], axis=1)
    # Tiny boxes (below one pixel, so aligned=False raises their size to 1) and a box larger
    # than the whole input.
    rows[0, 3] = rows[0, 1] + 0.3 / spatial_scale
    rows[1, 4] = rows[1, 2] + 0.6 / spatial_scale
    rows[2, 1:] = [-0.7 * w, -0.4 * h, 1.6 * w, 1.3 * h]
    return rows


def degenerate_boxes(spatial_scale):
    """Zero width, zero height, reversed corners, a point: all defined by torchvision."""
    s = 1.0 / spatial_scale
    return np.array([
        [0, 2.3 * s, 1.7 * s, 2.3 * s, 6.1 * s],
        [1, 1.2 * s, 4.4 * s, 7.9 * s, 4.4 * s],
        [0, 8.3 * s, 6.2 * s, 2.1 * s, 1.4 * s],
        [1, 3.3 * s, 3.6 * s, 3.3 * s, 3.6 * s],
    ])


SHAPE = (2, 3, 10, 13)


def inputs(dtype=jnp.float64, spatial_scale=0.5, seed=0):
    x = random(seed, SHAPE, dtype)
    boxes = np.concatenate([make_boxes(seed + 1, SHAPE[0], SHAPE[2], SHAPE[3], spatial_scale),
                            degenerate_boxes(spatial_scale)])
    return x, jnp.asarray(boxes).astype(dtype)


# --- forward vs the reference ------------------------------------------------------------------


@pytest.mark.parametrize("output_size", [1, (2, 3), 7])
@pytest.mark.parametrize("spatial_scale", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("sampling_ratio", [-1, 0, 1, 2])
@pytest.mark.parametrize("aligned", [False, True])
def test_forward_matches_reference(aligned, sampling_ratio, spatial_scale, output_size):
    x, boxes = inputs(spatial_scale=spatial_scale)
    out = jk.roi_align(x, boxes, output_size, spatial_scale, sampling_ratio, aligned)
    expected = reference(x, boxes, output_size, spatial_scale, sampling_ratio, aligned)
    assert out.shape == expected.shape
    assert_close(out, expected, jnp.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("aligned", [False, True])
def test_forward_dtypes(dtype, aligned):
    x, boxes = inputs(dtype)
    out = jk.roi_align(x, boxes, (3, 4), 0.5, -1, aligned)
    assert out.dtype == dtype
    # The reference sees the same (rounded) values, in float64.
    assert_close(out, reference(x, boxes, (3, 4), 0.5, -1, aligned), dtype)


def test_list_of_boxes_matches_rows():
    x, _ = inputs()
    per_image = [jnp.asarray(make_boxes(s, 1, 10, 13, 1.0, count=4)[:, 1:]) for s in (3, 4)]
    rows = jnp.concatenate([jnp.concatenate([jnp.full((4, 1), i, jnp.float64), b], axis=1)
                            for i, b in enumerate(per_image)])
    assert_close(jk.roi_align(x, per_image, 2, 1.0, 2), jk.roi_align(x, rows, 2, 1.0, 2))
    assert_close(jk.roi_align(x, per_image, 2, 1.0, 2), reference(x, rows, 2, 1.0, 2))


def test_large_adaptive_box_visits_only_inside_samples():
    # A 600-pixel box on a 10x13 input: 300 x 300 samples per bin, almost all outside. The count
    # still includes them all (torchvision's mean).
    x, _ = inputs()
    boxes = jnp.asarray([[0, -290.3, -295.1, 310.2, 305.7], [1, -2.0, -1.0, 640.0, 9.0]])
    out = jk.roi_align(x, boxes, 2, 1.0, -1, False)
    assert_close(out, reference(x, boxes, 2, 1.0, -1, False), jnp.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("aligned", [False, True])
def test_forward_bands_chunks_and_box_groups(dtype, aligned):
    """The CPU forward packs 64-byte chunks of channels (16 float32, 8 float64) of an image a band
    of rows at a time (about 256 KiB), adds each box's sample rows band after band to its bins'
    sums, in groups of boxes (4 MiB of sums), and computes the other boxes from the input in place
    (reversed boxes with aligned=True; every box of an image where the bands would pack more cells
    than its boxes read taps). Here: several bands, chunks with a tail of channels, two groups of
    boxes on image 0; image 1 is a copy of image 0 holding one box that covers it, computed in
    place, whose twin on image 0 is banded: the two agree bitwise, every box equals the float64
    reference, and the channels-last form equals the NCHW form bitwise."""
    height, width, channels, size = 70, 300, 21, (32, 32)
    image = random(5, (1, channels, height, width), dtype)
    x = jnp.concatenate([image, image])
    # Corners and sizes that put every sample position on a grid of 1/8 pixel, which float32
    # holds exactly at these coordinates (off it, rounded positions would move float32 samples
    # by more than the tolerance from the float64 reference's).
    rng = np.random.default_rng(6)
    count = 70
    x1, y1 = rng.integers(-20, width, count), rng.integers(-10, height, count)
    x2, y2 = x1 + 16 * rng.integers(1, 13, count), y1 + 16 * rng.integers(1, 5, count)
    rows = np.stack([np.zeros(count), x1, y1, x2, y2], axis=1).astype(np.float64)
    rows[:4, 1:] = rows[:4, [3, 4, 1, 2]]  # reversed corners
    cover = [-8.0, -8.0, width + 12.0, height + 10.0]
    boxes = jnp.asarray(np.concatenate([rows, [[0, *cover], [1, *cover]]])).astype(dtype)
    op = lambda x, b, layout="NCHW": jk.roi_align(x, b, size, 1.0, 2, aligned, data_format=layout)
    out = op(x, boxes)
    assert np.asarray(out[-1]).tobytes() == np.asarray(out[-2]).tobytes()
    assert_close(out, reference(x, boxes, size, 1.0, 2, aligned), dtype)
    channels_last = op(jnp.transpose(x, (0, 2, 3, 1)), boxes, "NHWC")
    assert np.asarray(channels_last).tobytes() == np.asarray(
        jnp.transpose(out, (0, 2, 3, 1))).tobytes()


# --- gradients ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling_ratio", [-1, 2])
@pytest.mark.parametrize("aligned", [False, True])
def test_gradients_match_reference_autodiff(aligned, sampling_ratio):
    x, boxes = inputs()
    dout = random(9, (boxes.shape[0], SHAPE[1], 3, 4), jnp.float64)
    f = lambda x, b: jk.roi_align(x, b, (3, 4), 0.5, sampling_ratio, aligned)
    _, vjp = jax.vjp(f, x, boxes)
    d_input, d_boxes = vjp(dout)
    ref_input, ref_boxes = reference_grads(x, boxes, dout, (3, 4), 0.5, sampling_ratio, aligned)
    assert_close(d_input, ref_input, jnp.float64)
    assert_close(d_boxes, ref_boxes, jnp.float64)
    assert np.all(np.asarray(d_boxes)[:, 0] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_gradient_dtypes(dtype):
    x, boxes = inputs(dtype)
    dout = random(9, (boxes.shape[0], SHAPE[1], 2, 2), dtype)
    _, vjp = jax.vjp(lambda x, b: jk.roi_align(x, b, 2, 0.5, 2, True), x, boxes)
    d_input, d_boxes = vjp(dout)
    assert d_input.dtype == dtype and d_boxes.dtype == dtype
    ref_input, ref_boxes = reference_grads(x, boxes, dout, 2, 0.5, 2, True)
    assert_close(d_input, ref_input, dtype)
    assert_close(d_boxes, ref_boxes, dtype)


@pytest.mark.parametrize("sampling_ratio", [-1, 3])
@pytest.mark.parametrize("aligned", [False, True])
def test_check_grads(aligned, sampling_ratio):
    # Only the coordinates are perturbed: the batch index is not a differentiable quantity.
    x, boxes = inputs(seed=5)
    batch, coords = boxes[:6, :1], boxes[:6, 1:]
    f = lambda x, c: jk.roi_align(x, jnp.concatenate([batch, c], axis=1), (2, 3), 0.5,
                                  sampling_ratio, aligned)
    check_grads(f, (x, coords), order=1)  # order 2: test_derivatives.py


@st.composite
def problems(draw):
    """Small random problems: any sizes from 1, boxes with round and real coordinates (samples on
    pixel edges and on the clamping boundaries included), reversed, outside, and invalid indices."""
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 20))
    h, w = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    size = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    scale = draw(st.sampled_from([1.0, 0.5, 2.0]))
    sampling_ratio = draw(st.sampled_from([-1, 0, 1, 2, 3]))
    aligned = draw(st.booleans())

    def coordinate(extent):
        lo, hi = -0.5 * extent / scale, 1.5 * extent / scale
        return draw(st.one_of(st.integers(int(lo), int(hi)).map(float),
                              st.integers(2 * int(lo), 2 * int(hi)).map(lambda v: v / 2),
                              st.floats(lo, hi, allow_nan=False)))

    rows = []
    for _ in range(draw(st.integers(0, 8))):
        batch = draw(st.one_of(st.integers(0, n - 1), st.sampled_from([-1, n])))
        rows.append([batch, coordinate(w), coordinate(h), coordinate(w), coordinate(h)])
    boxes = np.asarray(rows, dtype=np.float64).reshape(-1, 5)
    seed = draw(st.integers(0, 2**16))
    x = random(seed, (n, c, h, w), jnp.float64)
    return x, jnp.asarray(boxes), size, scale, sampling_ratio, aligned


@settings(max_examples=40, deadline=None)
@given(problems())
def test_random_problems_match_reference(problem):
    x, boxes, size, scale, sampling_ratio, aligned = problem
    op = lambda x, b: jk.roi_align(x, b, size, scale, sampling_ratio, aligned)
    out, vjp = jax.vjp(op, x, boxes)
    assert_close(out, reference(x, boxes, size, scale, sampling_ratio, aligned), jnp.float64)
    dout = random(1, out.shape, jnp.float64)
    d_input, d_boxes = vjp(dout)
    ref_input, ref_boxes = reference_grads(x, boxes, dout, size, scale, sampling_ratio, aligned)
    assert_close(d_input, ref_input, jnp.float64)
    assert_close(d_boxes, ref_boxes, jnp.float64)


# --- bad data, degenerate and empty ------------------------------------------------------------


def test_invalid_batch_index_gives_zeros_and_no_gradient():
    x, _ = inputs()
    good = [0, 1.5, 2.5, 7.5, 8.5]
    bad = [[-1, *good[1:]], [2, *good[1:]], [2.3, *good[1:]], [np.nan, *good[1:]],
           [np.inf, *good[1:]], [-1.5, *good[1:]]]
    boxes = jnp.asarray([good] + bad)
    out = jk.roi_align(x, boxes, 2, 1.0, 2)
    assert np.all(np.asarray(out[1:]) == 0)
    d_input, d_boxes = jax.grad(lambda x, b: jnp.sum(jk.roi_align(x, b, 2, 1.0, 2)),
                                argnums=(0, 1))(x, boxes[1:])
    assert np.all(np.asarray(d_input) == 0) and np.all(np.asarray(d_boxes) == 0)


def test_batch_index_is_truncated_toward_zero_as_torchvision():
    x, _ = inputs()
    coords = [1.5, 2.5, 7.5, 8.5]
    indices = [0.7, -0.5, -0.0, 1.99, 1.0]  # images 0, 0, 0, 1, 1
    boxes = jnp.asarray([[i, *coords] for i in indices])
    images = [0, 0, 0, 1, 1]
    out = jk.roi_align(x, boxes, 2, 1.0, 2)
    expected = jk.roi_align(x, jnp.asarray([[i, *coords] for i in images], x.dtype), 2, 1.0, 2)
    assert_close(out, expected, jnp.float64)
    if torchvision is not None:
        tv = torchvision.ops.roi_align(torch.from_numpy(to_numpy64(x)),
                                       torch.from_numpy(to_numpy64(boxes)), 2, 1.0, 2)
        assert_close(out, tv.numpy(), jnp.float64)
    # [K, 5] boxes pass check_grads where a nudged index truncates to the same image (every
    # index of image 0, and fractional ones): the index column's derivative is 0, as the finite
    # differences see. (An integral index n >= 1 sits on a step of the truncation: n - eps reads
    # image n - 1, there and in torchvision, so no finite difference holds across it.)
    off_the_steps = jnp.asarray([[i, *coords] for i in (0.0, 0.7, -0.5, 1.5, 1.25)])
    check_grads(lambda x, b: jk.roi_align(x, b, 2, 1.0, 2), (x, off_the_steps), order=1)


def test_nonfinite_and_huge_coordinates_are_defined_and_fast():
    x, _ = inputs()
    boxes = jnp.asarray([
        [0, np.nan, 1, 5, 5], [0, 1, 1, np.nan, 5], [1, -np.inf, 1, np.inf, 5],
        [1, 1, 1, np.inf, 5], [0, -1e300, -1e300, 1e300, 1e300], [1, -1e30, 2, 1e30, 3],
        [0, 3e7, 1, 3e7 + 2, 4],
    ])
    start = time.perf_counter()
    for sampling_ratio, aligned in [(-1, False), (-1, True), (2, False)]:
        op = lambda x, b: jk.roi_align(x, b, 7, 1.0, sampling_ratio, aligned)
        out, vjp = jax.vjp(op, x, boxes)
        d_input, d_boxes = vjp(jnp.ones_like(out))
        for a in (out, d_input, d_boxes):
            assert np.all(np.isfinite(np.asarray(a)))
        # NaN and infinite coordinates put every sample outside: zeros.
        assert np.all(np.asarray(out[:4]) == 0)
    assert time.perf_counter() - start < 60


def test_adaptive_grid_is_bounded():
    # ceil(1e9 / 7) samples per bin would take hours; the grid stops at 2^20 per axis and only
    # samples inside the input are visited.
    x, _ = inputs()
    boxes = jnp.asarray([[0, -5e8, -5e8, 5e8, 5e8], [1, 0.5, 0.5, 1e9, 8.0]])
    start = time.perf_counter()
    out, vjp = jax.vjp(lambda x, b: jk.roi_align(x, b, 7, 1.0, -1, True), x, boxes)
    d_input, d_boxes = vjp(jnp.ones_like(out))
    jax.block_until_ready((out, d_input, d_boxes))
    assert time.perf_counter() - start < 30
    assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("aligned", [False, True])
def test_empty_boxes(aligned):
    x, _ = inputs()
    for boxes in (jnp.zeros((0, 5)), []):
        out = jk.roi_align(x, boxes, 3, 1.0, -1, aligned)
        assert out.shape == (0, SHAPE[1], 3, 3)
    d_input = jax.grad(lambda x: jnp.sum(jk.roi_align(x, jnp.zeros((0, 5)), 3)))(x)
    assert d_input.shape == x.shape and np.all(np.asarray(d_input) == 0)
    batched = jax.vmap(lambda x: jk.roi_align(x, jnp.zeros((0, 5)), 3))(jnp.stack([x, x]))
    assert batched.shape == (2, 0, SHAPE[1], 3, 3)


# --- transforms --------------------------------------------------------------------------------


def _op(x, b):
    return jk.roi_align(x, b, (2, 3), 0.5, 2, True)


def test_jit_matches_eager():
    x, boxes = inputs()
    assert_close(jax.jit(_op)(x, boxes), _op(x, boxes))


@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (0, 0), (1, 0)])
def test_vmap_matches_loop(in_axes):
    x, boxes = inputs()
    xs = jnp.stack([x, x * 2 + 1, -x])
    bs = jnp.stack([boxes, boxes.at[:, 1:].add(0.75), boxes.at[:, 1:].add(-1.25)])
    xs_in = jnp.moveaxis(xs, 0, in_axes[0]) if in_axes[0] is not None else x
    bs_in = bs if in_axes[1] is not None else boxes
    batched = jax.vmap(_op, in_axes=in_axes)(xs_in, bs_in)
    loop = [_op(xs[i] if in_axes[0] is not None else x, bs[i] if in_axes[1] is not None else boxes)
            for i in range(3)]
    assert_close(batched, jnp.stack(loop))


def test_vmap_keeps_invalid_batch_indices_invalid():
    # Folding the mapped axis into N must not turn an out-of-range index into another image.
    x, _ = inputs()
    boxes = jnp.asarray([[2, 1, 1, 6, 6], [-1, 1, 1, 6, 6], [1, 1, 1, 6, 6]], jnp.float64)
    out = jax.vmap(_op, in_axes=(0, None))(jnp.stack([x, x + 1]), boxes)
    assert np.all(np.asarray(out[:, :2]) == 0) and np.all(np.asarray(out[:, 2]) != 0)


def test_nested_vmap_and_vmap_of_grad():
    x, boxes = inputs()
    xs = jnp.stack([jnp.stack([x + i + 2 * j for i in range(2)]) for j in range(3)])  # [3, 2, ...]
    bs = jnp.stack([boxes.at[:, 1:].add(0.5 * j) for j in range(3)])  # [3, K, 5]
    loss = lambda x, b: jnp.sum(jnp.sin(_op(x, b)))
    grad = jax.grad(loss, argnums=(0, 1))
    # Outer axis: input and boxes; inner axis: input only.
    nested = jax.vmap(jax.vmap(grad, in_axes=(0, None)), in_axes=(0, 0))(xs, bs)
    for j in range(3):
        for i in range(2):
            expected = grad(xs[j, i], bs[j])
            assert_close(nested[0][j, i], expected[0])
            assert_close(nested[1][j, i], expected[1])
    # Inner axis: boxes only, outer: input only (the box-to-image map gains a term at the outer
    # level after a boxes-only fold).
    nested = jax.vmap(jax.vmap(_op, in_axes=(None, 0)), in_axes=(0, None))(xs[:, 0], bs)
    for j in range(3):
        for i in range(3):
            assert_close(nested[j, i], _op(xs[j, 0], bs[i]))


def test_lowered_program_is_custom_calls_only():
    x, boxes = inputs()
    assert_lowered(_op, x, boxes, targets=("jk_roi_align_fwd",), forbidden=FORBIDDEN)
    grad = jax.grad(lambda x, b: jnp.sum(_op(x, b) ** 2), argnums=(0, 1))
    assert_lowered(grad, x, boxes, targets=("jk_roi_align_fwd", "jk_roi_align_bwd_input",
                                            "jk_roi_align_bwd_boxes"), forbidden=FORBIDDEN)
    batched = jax.vmap(grad, in_axes=(0, 0))
    assert_lowered(batched, jnp.stack([x, x]), jnp.stack([boxes, boxes]),
                   targets=("jk_roi_align_bwd_input", "jk_roi_align_bwd_boxes"),
                   forbidden=FORBIDDEN)


def test_unused_box_gradient_is_dropped():
    x, boxes = inputs()
    grad = jax.jit(jax.grad(lambda x, b: jnp.sum(_op(x, b)))).lower(x, boxes).compile().as_text()
    assert "jk_roi_align_bwd_input" in grad and "jk_roi_align_bwd_boxes" not in grad


def test_deterministic_false_agrees():
    x, boxes = inputs(jnp.float32)
    grads = [jax.grad(lambda x: jnp.sum(jk.roi_align(x, boxes, 3, 0.5, -1, True,
                                                     deterministic=d) ** 2))(x)
             for d in (True, False)]
    assert_close(grads[1], grads[0], jnp.float32)


@pytest.mark.skipif(not ON_GPU, reason="bitwise determinism is checked on the GPU (the CPU is "
                    "deterministic by construction)")
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_backward_is_bitwise_reproducible(dtype, sampling_ratio):
    for seed in range(3):
        x = random(seed, (2, 64, 40, 52), dtype)
        boxes = jnp.asarray(make_boxes(seed, 2, 40, 52, 0.25, count=300)).astype(dtype)
        dout = random(seed + 7, (300, 64, 7, 7), dtype)
        vjp = jax.jit(lambda x, b, g: jax.vjp(
            lambda x, b: jk.roi_align(x, b, 7, 0.25, sampling_ratio, True), x, b)[1](g))
        first = [np.asarray(a).tobytes() for a in vjp(x, boxes, dout)]
        for _ in range(20):
            again = [np.asarray(a).tobytes() for a in vjp(x, boxes, dout)]
            assert again == first


# --- the CUDA region forward (GPU machine) ----------------------------------------------------


def region_problem(dtype, channels=None, height=45, width=70, count=300, seed=0):
    """A crowded problem for the CUDA forward by image regions (scale 1: box corners in cells):
    boxes of 2 to 60 cells over two images of 4 x 6 tiles (partial tiles at the edges), 300
    more crowded into one tile (over 256 entries there), a box larger than the image (taps outside
    every staged region), reversed corners, invalid batch indices, NaN and infinite corners.
    Channels: three slabs of float32 (64, 64, 22), two of a half type (128, 20)."""
    channels = channels or (150 if dtype == jnp.float32 else 148)
    rng = np.random.default_rng(seed)
    x = random(seed, (2, channels, height, width), dtype)
    x1, y1 = rng.uniform(-5, width, count), rng.uniform(-5, height, count)
    rows = np.stack([rng.integers(0, 2, count), x1, y1, x1 + rng.uniform(2, 60, count),
                     y1 + rng.uniform(2, 60, count)], axis=1)
    at = rng.uniform(0, 9, (300, 2))
    crowd = np.column_stack([np.zeros(300), at[:, 0] + 13, at[:, 1] + 13, at[:, 0] + 14.5,
                             at[:, 1] + 13.7])
    extra = [[0, -30, -20, width + 40, height + 25], [1, 60, 40, 3, 2], [-1, 1, 1, 5, 5],
             [2, 1, 1, 5, 5], [np.nan, 1, 1, 5, 5], [0, np.nan, 1, 5, 5], [1, 1, 1, np.inf, 5]]
    boxes = np.concatenate([rows, crowd, np.asarray(extra, np.float64)])
    return x, jnp.asarray(boxes).astype(dtype)


@pytest.mark.skipif(not ON_GPU, reason="the forward by image regions is CUDA's")
@pytest.mark.parametrize("sampling_ratio,aligned", [(1, False), (2, True), (2, False), (3, True),
                                                    (8, False)])
@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_region_forward_equals_gather_bitwise(monkeypatch, dtype, data_format, sampling_ratio,
                                              aligned):
    """The CUDA forward by image regions (fixed grids of float32 and half types, both layouts:
    JAX_KERNELS_ROI_ALIGN_REGIONS=all) adds every bin's terms in the gather's order: the same
    bits as the gather over boxes (=0), read in the same compiled program; and it equals the
    float64 reference where float32 holds every sample position exactly (corners on a grid of
    1/16 cell, 8 bins, a sampling ratio of 1, 2 or 8; the reference makes the zeros of a NaN batch
    index NaN, so that box is left out there). Sampling ratio 8 takes chunks of 12 bins."""
    monkeypatch.setenv("JAX_KERNELS_ROI_ALIGN_REGIONS", "all")  # default: float32 NHWC only
    x, boxes = region_problem(dtype)
    x_in = x if data_format == "NCHW" else jnp.transpose(x, (0, 2, 3, 1))
    op = jax.jit(lambda x, b, size=7: jk.roi_align(x, b, size, 1.0, sampling_ratio, aligned,
                                                    data_format=data_format), static_argnums=2)
    regions = np.asarray(op(x_in, boxes))
    if dtype == jnp.float32 and data_format == "NCHW":
        monkeypatch.setenv("JAX_KERNELS_ROI_ALIGN_SLABS_PER_BLOCK", "2")
        assert np.asarray(op(x_in, boxes)).tobytes() == regions.tobytes()
        if sampling_ratio != 3:
            exact = jnp.round(boxes * 16) / 16
            keep = ~np.isnan(np.asarray(boxes[:, 0]))
            expected = reference(x, exact[keep], 8, 1.0, sampling_ratio, aligned)
            assert_close(np.asarray(op(x_in, exact, 8))[keep], expected, dtype)
    monkeypatch.setenv("JAX_KERNELS_ROI_ALIGN_REGIONS", "0")
    gather = np.asarray(op(x_in, boxes))
    assert regions.tobytes() == gather.tobytes()


@pytest.mark.skipif(not ON_GPU, reason="the forward by image regions is CUDA's")
def test_region_forward_under_vmap_equals_gather(monkeypatch):
    """vmap folds the mapped axis into the images (batching terms): the regions of image n + 2
    hold the boxes of the second mapped problem."""
    monkeypatch.setenv("JAX_KERNELS_ROI_ALIGN_REGIONS", "all")
    x, boxes = region_problem(jnp.float32, channels=37)
    boxes = jnp.round(boxes[~np.isnan(np.asarray(boxes[:, 0]))] * 16) / 16  # exact positions
    xs, bs = jnp.stack([x, -x]), jnp.stack([boxes, boxes[::-1]])
    op = jax.jit(jax.vmap(lambda x, b: jk.roi_align(x, b, (4, 8), 1.0, 2, False)))
    regions = np.asarray(op(xs, bs))
    monkeypatch.setenv("JAX_KERNELS_ROI_ALIGN_REGIONS", "0")
    assert np.asarray(op(xs, bs)).tobytes() == regions.tobytes()
    assert_close(regions[1], reference(-x, boxes[::-1], (4, 8), 1.0, 2, False), jnp.float32)


# --- torchvision (GPU machine) -----------------------------------------------------------------


@pytest.mark.skipif(torchvision is None, reason=TORCHVISION_UNAVAILABLE)
@pytest.mark.parametrize("output_size", [1, (2, 3), 7])
@pytest.mark.parametrize("spatial_scale", [1.0, 0.25])
@pytest.mark.parametrize("sampling_ratio", [-1, 0, 2])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_matches_torchvision(dtype, aligned, sampling_ratio, spatial_scale, output_size):
    device = "cuda" if ON_GPU and torch.cuda.is_available() else "cpu"
    x, boxes = inputs(dtype, spatial_scale)
    tdtype = torch.float32 if dtype == jnp.float32 else torch.float64
    t_in = torch.from_numpy(to_numpy64(x)).to(device, tdtype).requires_grad_(True)
    t_boxes = torch.from_numpy(to_numpy64(boxes)).to(device, tdtype)
    expected = torchvision.ops.roi_align(t_in, t_boxes, output_size, spatial_scale, sampling_ratio,
                                         aligned)
    dout = random(3, tuple(expected.shape), dtype)
    expected.backward(torch.from_numpy(to_numpy64(dout)).to(device, tdtype))
    out, vjp = jax.vjp(lambda x: jk.roi_align(x, boxes, output_size, spatial_scale, sampling_ratio,
                                              aligned), x)
    tol = 2e-4 if dtype == jnp.float32 else rtol(dtype)
    assert_close(out, expected.detach().cpu().double().numpy(), rtol_=tol)
    assert_close(vjp(dout)[0], t_in.grad.cpu().double().numpy(), rtol_=tol)


# --- errors ------------------------------------------------------------------------------------


def test_errors_name_the_op_and_show_shapes():
    x, boxes = inputs()
    with pytest.raises(ValueError, match=r"roi_align\(\): expected input of shape "
                                         r"\(N, C, H, W\), got \(3, 4\)"):
        jk.roi_align(jnp.zeros((3, 4)), boxes, 2)
    with pytest.raises(ValueError,
                       match=r"roi_align\(\): expected boxes of shape \(K, 5\).*got \(3, 4\)"):
        jk.roi_align(x, jnp.zeros((3, 4)), 2)
    with pytest.raises(ValueError, match=r"roi_align\(\).*\(L, 4\), got \(2, 5\) at index 1"):
        jk.roi_align(x, [jnp.zeros((1, 4)), jnp.zeros((2, 5))], 2)
    with pytest.raises(TypeError, match=r"roi_align\(\).*share one dtype"):
        jk.roi_align(x, boxes.astype(jnp.float32), 2)
    with pytest.raises(TypeError, match=r"roi_align\(\).*int32"):
        jk.roi_align(x.astype(jnp.int32), boxes.astype(jnp.int32), 2)
    with pytest.raises(ValueError, match=r"roi_align\(\): output_size"):
        jk.roi_align(x, boxes, (0, 2))
    with pytest.raises(TypeError, match=r"roi_align\(\): output_size"):
        jk.roi_align(x, boxes, "7")
    with pytest.raises(TypeError, match=r"roi_align\(\): spatial_scale"):
        jax.jit(lambda s: jk.roi_align(x, boxes, 2, s))(0.5)
    with pytest.raises(TypeError, match=r"roi_align\(\): spatial_scale"):
        jk.roi_align(x, boxes, 2, jnp.ones(2))
    with pytest.raises(TypeError, match=r"roi_align\(\): deterministic must be a bool"):
        jk.roi_align(x, boxes, 2, deterministic="no")
    with pytest.raises(TypeError, match=r"roi_align\(\): aligned must be a bool"):
        jk.roi_align(x, boxes, 2, aligned=1)
    with pytest.raises(TypeError, match=r"roi_align\(\): sampling_ratio"):
        jk.roi_align(x, boxes, 2, 1.0, 1.5)
    with pytest.raises(ValueError, match=r"roi_align\(\).*float16 cannot represent"):
        jk.roi_align(x.astype(jnp.float16), [jnp.zeros((1, 4), jnp.float16)] * 2049, 2)


def test_concrete_scalars_are_static_arguments():
    """A concrete jnp or NumPy scalar is a number like any other (only a traced one is not)."""
    x, boxes = inputs()
    expected = jk.roi_align(x, boxes, 2, 0.5)
    for scale in (jnp.asarray(0.5), np.float32(0.5), jnp.asarray(0.5, jnp.float32)):
        assert_close(jk.roi_align(x, boxes, 2, scale), expected, jnp.float64)


def test_capabilities_list_roi_align():
    rows = [r for r in jk.capabilities() if r.op == "roi_align"]
    passes = {r.pass_ for r in rows}
    assert {"forward", "backward d_input", "backward d_boxes"} <= passes
