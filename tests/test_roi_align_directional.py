"""Tests of roi_align's directional FFI passes (forward-mode and second-order derivatives in the
box coordinates), called as raw targets:

  jk_roi_align_fwd_directional        input, boxes, u[, v] -> [K, C, PH, PW]
  jk_roi_align_bwd_input_directional  dout, boxes, u[, v]  -> [N, C, H, W]
  jk_roi_align_bwd_boxes_directional  dout, input, boxes, u -> [K, 5]

Oracles: float64 central finite differences of the existing targets (jk_roi_align_fwd,
jk_roi_align_bwd_input, jk_roi_align_bwd_boxes) at boxes whose sample positions stay away from
the kinks of the bilinear weights (between kinks the output is quadratic in the coordinates, so
central differences are exact up to rounding), and the exact identities
  <bwd_boxes(dout, I, b), u> == <dout, fwd_dir(I, b, u)>,
  <bwd_boxes_dir(dout, I, b, u), v> == <dout, fwd_dir(I, b, u, v)>,
  <dout, fwd_dir(I, b, u[, v])> == <I, bwd_input_dir(dout, b, u[, v])>,
which hold at any boxes. Runs on whatever platform jax has (CPU here, CUDA on the GPU machine).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kernels import _ffi
from jax_kernels.roi_align import _Attrs, _Batching, _ffi_attributes
from jk_testing import assert_close, random, to_numpy64

SHAPE = (2, 3, 10, 13)  # N, C, H, W
OUT = (3, 4)  # PH, PW
MARGIN = 0.05  # pixels between every sample position (and adaptive bins) and a kink
STEP = 5e-3  # finite-difference step: moves a sample by at most 2 * STEP pixels < MARGIN
# Central differences of a quadratic are exact: their error is rounding, about
# eps * |f| / STEP (first order) and eps * |f| / STEP^2 (second order).
FD_RTOL = {1: 1e-11, 2: 1e-9}


# --- raw calls -----------------------------------------------------------------------------------


def attributes(scale, ratio, aligned, batching=None, deterministic=True, n=SHAPE[0]):
    attrs = _Attrs(OUT[0], OUT[1], float(scale), int(ratio), bool(aligned), deterministic)
    return _ffi_attributes(attrs, batching if batching is not None else _Batching(n))


def forward(x, b, a):
    k = b.shape[0]
    result = jax.ShapeDtypeStruct((k, x.shape[1]) + OUT, x.dtype)
    n, c, h, w = x.shape

    def scratch_bytes():
        return _ffi.query("roi_align_forward_scratch", N=n, C=c, H=h, W=w, boxes=k,
                          pooled_height=OUT[0], pooled_width=OUT[1],
                          sampling_ratio=int(a["sampling_ratio"]),
                          element_bytes=np.dtype(x.dtype).itemsize)

    return _ffi.call_with_cuda_scratch("jk_roi_align_fwd", result, x, b,
                                       scratch_bytes=scratch_bytes, **a)


def backward_input(dout, b, shape, a):
    result = jax.ShapeDtypeStruct(shape, dout.dtype)
    n, c, h, w = shape

    def scratch_bytes():
        return _ffi.query("roi_align_backward_input_scratch", N=n, C=c, H=h, W=w,
                          boxes=b.shape[0], pooled_height=OUT[0], pooled_width=OUT[1],
                          sampling_ratio=int(a["sampling_ratio"]),
                          element_bytes=np.dtype(dout.dtype).itemsize,
                          deterministic=bool(a["deterministic"]))

    return _ffi.call_with_cuda_scratch("jk_roi_align_bwd_input", result, dout, b,
                                       scratch_bytes=scratch_bytes, **a)


def backward_boxes(dout, x, b, a):
    return _ffi.call("jk_roi_align_bwd_boxes", jax.ShapeDtypeStruct(b.shape, b.dtype), dout, x, b,
                     **a)


def forward_dir(x, b, u, v=None, a=None):
    result = jax.ShapeDtypeStruct((b.shape[0], x.shape[1]) + OUT, x.dtype)
    directions = (u,) if v is None else (u, v)
    return _ffi.call("jk_roi_align_fwd_directional", result, x, b, *directions, **a)


def backward_input_dir(dout, b, u, v=None, shape=SHAPE, a=None):
    directions = (u,) if v is None else (u, v)
    return _ffi.call("jk_roi_align_bwd_input_directional", jax.ShapeDtypeStruct(shape, dout.dtype),
                     dout, b, *directions, **a)


def backward_boxes_dir(dout, x, b, u, a):
    return _ffi.call("jk_roi_align_bwd_boxes_directional", jax.ShapeDtypeStruct(b.shape, b.dtype),
                     dout, x, b, u, **a)


def dot(a, b):
    return float(np.vdot(to_numpy64(a), to_numpy64(b)))


# --- data ---------------------------------------------------------------------------------------


def axis_positions(first, second, bins, extent, scale, ratio, aligned):
    """Sample positions of one box axis (torchvision's geometry, in float64), and whether the
    size is clamped or the adaptive grid sits on a kink."""
    offset = 0.5 if aligned else 0.0
    start = first * scale - offset
    size = (second * scale - offset) - start
    clamped = not aligned and size < 1.0 + MARGIN
    bin_size = size / bins
    if ratio > 0:
        grid = ratio
        grid_kink = False
    else:
        grid = max(math.ceil(bin_size), 1)
        grid_kink = abs(bin_size - round(bin_size)) < MARGIN
    t = np.arange(bins * grid)
    positions = start + (t // grid) * bin_size + ((t % grid) + 0.5) * bin_size / grid
    return positions, clamped or grid_kink


def smooth_boxes(seed, count, scale, ratio, aligned, dtype=jnp.float64, n=SHAPE[0]):
    """[count, 5] boxes (valid batch indices) whose sample positions all lie at least MARGIN from
    an integer (every kink of the bilinear weights, the clamps and the validity bounds), sizes
    unclamped and adaptive grids away from their steps, after rounding to `dtype`."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        row = [float(i % n)]
        coords = {}
        for axis, extent, bins in (("x", SHAPE[3], OUT[1]), ("y", SHAPE[2], OUT[0])):
            while True:
                first = rng.uniform(-0.2 * extent, 0.7 * extent) / scale
                second = first + rng.uniform(1.5, 0.8 * extent) / scale
                first, second = (float(np.asarray(c, dtype=dtype).astype(np.float64))
                                 for c in (first, second))
                positions, kink = axis_positions(first, second, bins, extent, scale, ratio,
                                                 aligned)
                if not kink and np.all(np.abs(positions - np.round(positions)) > MARGIN):
                    coords[axis] = (first, second)
                    break
        row += [coords["x"][0], coords["y"][0], coords["x"][1], coords["y"][1]]
        rows.append(row)
    return jnp.asarray(np.asarray(rows)).astype(dtype)


def general_boxes(seed, scale):
    """Boxes of every kind (as test_roi_align's): inside, partly outside, tiny (clamped), larger
    than the input, zero-size, reversed, on pixel edges."""
    rng = np.random.default_rng(seed)
    h, w = SHAPE[2] / scale, SHAPE[3] / scale
    count = 8
    x1 = rng.uniform(-0.3 * w, 0.9 * w, count)
    y1 = rng.uniform(-0.3 * h, 0.9 * h, count)
    rows = np.stack([rng.integers(0, SHAPE[0], count).astype(np.float64), x1, y1,
                     x1 + rng.uniform(0.05, 0.8, count) * w,
                     y1 + rng.uniform(0.05, 0.8, count) * h], axis=1)
    rows[0, 3] = rows[0, 1] + 0.3 / scale
    rows[1, 4] = rows[1, 2] + 0.6 / scale
    rows[2, 1:] = [-0.7 * w, -0.4 * h, 1.6 * w, 1.3 * h]
    s = 1.0 / scale
    extra = np.array([[0, 2.3 * s, 1.7 * s, 2.3 * s, 6.1 * s], [1, 8.3 * s, 6.2 * s, 2.1 * s, 1.4 * s],
                      [0, 2.0 * s, 3.0 * s, 8.0 * s, 9.0 * s], [1, 0.0, 0.0, 13 * s, 10 * s]])
    return jnp.asarray(np.concatenate([rows, extra]))


def directions(seed, count, dtype=jnp.float64):
    """Directions u, v: random rows; column 0 (the batch index) holds garbage the passes must
    ignore."""
    rng = np.random.default_rng(seed)
    u = rng.uniform(-1, 1, (count, 5))
    v = rng.uniform(-1, 1, (count, 5))
    u[:, 0], v[:, 0] = 7.5, -3.25
    return jnp.asarray(u).astype(dtype), jnp.asarray(v).astype(dtype)


def coordinates_only(d):
    """d with its batch-index column zeroed: the step that moves only the coordinates."""
    return d.at[:, 0].set(0)


def problem(seed, boxes, dtype=jnp.float64):
    x = random(seed, SHAPE, dtype)
    dout = random(seed + 1, (boxes.shape[0], SHAPE[1]) + OUT, dtype)
    u, v = directions(seed + 2, boxes.shape[0], dtype)
    return x, dout, u, v


# --- float64 against finite differences of the existing passes ----------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("ratio", [2, -1])
@pytest.mark.parametrize("aligned", [False, True])
def test_matches_finite_differences(aligned, ratio, scale):
    a = attributes(scale, ratio, aligned)
    b = smooth_boxes(10, 6, scale, ratio, aligned)
    x, dout, u, v = problem(3, b)
    du, dv = STEP * coordinates_only(u), STEP * coordinates_only(v)

    # Forward, order 1: d/de fwd(b + e u).
    expected = (to_numpy64(forward(x, b + du, a)) - to_numpy64(forward(x, b - du, a))) / (2 * STEP)
    assert_close(forward_dir(x, b, u, a=a), expected, rtol_=FD_RTOL[1])
    # Order 2: the mixed second difference of fwd along u and v.
    second = (to_numpy64(forward(x, b + du + dv, a)) - to_numpy64(forward(x, b + du - dv, a))
              - to_numpy64(forward(x, b - du + dv, a)) + to_numpy64(forward(x, b - du - dv, a)))
    assert_close(forward_dir(x, b, u, v, a=a), second / (4 * STEP**2), rtol_=FD_RTOL[2])
    # ... which is also d/de fwd_dir(b + e v, u).
    expected = (to_numpy64(forward_dir(x, b + dv, u, a=a))
                - to_numpy64(forward_dir(x, b - dv, u, a=a))) / (2 * STEP)
    assert_close(forward_dir(x, b, u, v, a=a), expected, rtol_=FD_RTOL[1])

    # Box gradient along u: d/de bwd_boxes(b + e u).
    expected = (to_numpy64(backward_boxes(dout, x, b + du, a))
                - to_numpy64(backward_boxes(dout, x, b - du, a))) / (2 * STEP)
    d_boxes = backward_boxes_dir(dout, x, b, u, a)
    assert_close(d_boxes, expected, rtol_=FD_RTOL[1])
    assert np.all(np.asarray(d_boxes)[:, 0] == 0)

    # Input gradient along u: d/de bwd_input(b + e u), the transpose of fwd_dir in the input.
    expected = (to_numpy64(backward_input(dout, b + du, SHAPE, a))
                - to_numpy64(backward_input(dout, b - du, SHAPE, a))) / (2 * STEP)
    assert_close(backward_input_dir(dout, b, u, a=a), expected, rtol_=FD_RTOL[1])
    # Order 2: d/de of that along v.
    expected = (to_numpy64(backward_input_dir(dout, b + dv, u, a=a))
                - to_numpy64(backward_input_dir(dout, b - dv, u, a=a))) / (2 * STEP)
    assert_close(backward_input_dir(dout, b, u, v, a=a), expected, rtol_=FD_RTOL[1])


# --- exact identities, at boxes of every kind -----------------------------------------------------


def assert_same(lhs, rhs, tol=1e-12):
    assert abs(lhs - rhs) <= tol * max(abs(lhs), abs(rhs), 1e-300), (lhs, rhs)


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("ratio", [2, -1, 0, 3])
@pytest.mark.parametrize("aligned", [False, True])
def test_identities(aligned, ratio, scale):
    a = attributes(scale, ratio, aligned)
    b = general_boxes(20, scale)
    x, dout, u, v = problem(4, b)
    f_u, f_uv = forward_dir(x, b, u, a=a), forward_dir(x, b, u, v, a=a)
    assert_same(dot(backward_boxes(dout, x, b, a), u), dot(dout, f_u))
    h_u = backward_boxes_dir(dout, x, b, u, a)
    assert np.all(np.asarray(h_u)[:, 0] == 0)
    assert_same(dot(h_u, v), dot(dout, f_uv))
    assert_same(dot(backward_boxes_dir(dout, x, b, v, a), u), dot(h_u, v))  # symmetry
    assert_same(dot(x, backward_input_dir(dout, b, u, a=a)), dot(dout, f_u))
    assert_same(dot(x, backward_input_dir(dout, b, u, v, a=a)), dot(dout, f_uv))
    # fwd_dir is linear in the directions; the batch-index column is ignored.
    assert_close(forward_dir(x, b, 2.0 * u, a=a), 2.0 * to_numpy64(f_u))
    assert_close(forward_dir(x, b, coordinates_only(u), a=a), f_u, rtol_=0.0)
    assert_close(forward_dir(x, b, v, u, a=a), f_uv)  # symmetric in u and v (up to FMA order)


def test_input_gradient_directional_is_the_transpose_cell_by_cell():
    # Small enough to build fwd_dir's matrix in the input column by column.
    a = attributes(0.5, -1, True)
    b = general_boxes(30, 0.5)[:6]
    shape = (2, 1, 6, 7)
    dout = random(5, (b.shape[0], 1) + OUT)
    u, v = directions(6, b.shape[0])
    for second in (None, v):
        d_input = to_numpy64(backward_input_dir(dout.astype(jnp.float64), b, u, second,
                                                shape=shape, a=a))
        basis = np.eye(math.prod(shape)).reshape((-1,) + shape)
        expected = np.asarray([dot(forward_dir(jnp.asarray(e), b, u, second, a=a), dout)
                               for e in basis])
        assert_close(d_input, expected.reshape(shape))


# --- dtypes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("aligned", [False, True])
def test_dtypes_match_float64(dtype, aligned):
    a = attributes(0.5, 2, aligned)
    b = smooth_boxes(40, 6, 0.5, 2, aligned, dtype=dtype)
    x, dout, u, v = problem(7, b, dtype)
    # float64 on the same (rounded) values.
    x64, dout64, b64, u64, v64 = (t.astype(jnp.float64) for t in (x, dout, b, u, v))
    cases = [
        (forward_dir(x, b, u, a=a), forward_dir(x64, b64, u64, a=a)),
        (forward_dir(x, b, u, v, a=a), forward_dir(x64, b64, u64, v64, a=a)),
        (backward_input_dir(dout, b, u, a=a), backward_input_dir(dout64, b64, u64, a=a)),
        (backward_input_dir(dout, b, u, v, a=a), backward_input_dir(dout64, b64, u64, v64, a=a)),
        (backward_boxes_dir(dout, x, b, u, a), backward_boxes_dir(dout64, x64, b64, u64, a)),
    ]
    for actual, expected in cases:
        assert actual.dtype == dtype
        assert_close(actual, to_numpy64(expected), dtype)


# --- bad data, empty, batched -------------------------------------------------------------------


def test_invalid_batch_index_gives_zeros():
    a = attributes(1.0, 2, False)
    good = [0, 1.5, 2.5, 7.5, 8.5]
    bad = jnp.asarray([[-1, *good[1:]], [2, *good[1:]], [2.3, *good[1:]], [np.nan, *good[1:]],
                       [np.inf, *good[1:]], [1e30, *good[1:]]])
    x, dout, u, v = problem(8, bad)
    assert np.all(np.asarray(forward_dir(x, bad, u, a=a)) == 0)
    assert np.all(np.asarray(forward_dir(x, bad, u, v, a=a)) == 0)
    assert np.all(np.asarray(backward_input_dir(dout, bad, u, a=a)) == 0)
    assert np.all(np.asarray(backward_input_dir(dout, bad, u, v, a=a)) == 0)
    assert np.all(np.asarray(backward_boxes_dir(dout, x, bad, u, a)) == 0)
    # Mixed with a valid box, the invalid ones add nothing.
    both = jnp.concatenate([jnp.asarray([good]), bad])
    x, dout, u, v = problem(9, both)
    alone = backward_input_dir(dout[:1], both[:1], u[:1], v[:1], a=a)
    assert_close(backward_input_dir(dout, both, u, v, a=a), alone, rtol_=0.0)


def test_empty_boxes():
    a = attributes(1.0, -1, True)
    x = random(1, SHAPE, jnp.float64)
    b = jnp.zeros((0, 5))
    dout = jnp.zeros((0, SHAPE[1]) + OUT)
    assert forward_dir(x, b, b, a=a).shape == (0, SHAPE[1]) + OUT
    assert forward_dir(x, b, b, b, a=a).shape == (0, SHAPE[1]) + OUT
    d_input = backward_input_dir(dout, b, b, a=a)
    assert d_input.shape == SHAPE and np.all(np.asarray(d_input) == 0)
    d_input = backward_input_dir(dout, b, b, b, a=a)
    assert np.all(np.asarray(d_input) == 0)
    assert backward_boxes_dir(dout, x, b, b, a).shape == (0, 5)


def test_nonfinite_and_huge_coordinates_are_defined():
    boxes = jnp.asarray([
        [0, np.nan, 1, 5, 5], [0, 1, 1, np.nan, 5], [1, -np.inf, 1, np.inf, 5],
        [1, 1, 1, np.inf, 5], [0, -1e300, -1e300, 1e300, 1e300], [1, -1e30, 2, 1e30, 3],
        [0, 3e7, 1, 3e7 + 2, 4], [0, -5e8, -5e8, 5e8, 5e8], [1, 0.5, 0.5, 1e9, 8.0],
    ])
    x, dout, u, v = problem(10, boxes)
    for ratio, aligned in [(-1, False), (-1, True), (2, False)]:
        a = attributes(1.0, ratio, aligned)
        results = [forward_dir(x, boxes, u, a=a), forward_dir(x, boxes, u, v, a=a),
                   backward_input_dir(dout, boxes, u, a=a),
                   backward_input_dir(dout, boxes, u, v, a=a),
                   backward_boxes_dir(dout, x, boxes, u, a)]
        for r in results:
            assert np.all(np.isfinite(np.asarray(r)))
        # NaN and infinite coordinates put every sample outside: zeros.
        assert np.all(np.asarray(results[0][:4]) == 0)
        assert np.all(np.asarray(results[4][:4]) == 0)


def test_batched_attributes_match_slices():
    # Two problems folded as the vmap rules of roi_align.py fold them: inputs into N, boxes into
    # K, and a batch term mapping box k to image batch_index + (k // K) * N.
    n, k = SHAPE[0], 6
    a_plain = attributes(0.5, 2, True)
    batching = _Batching(n).fold_images(k, 2, n)
    a = attributes(0.5, 2, True, batching=batching)
    slices = []
    for s in range(2):
        b = smooth_boxes(50 + s, k, 0.5, 2, True)
        x, dout, u, v = problem(11 + s, b)
        slices.append((x, dout, b, u, v))
    x, dout, b, u, v = (jnp.concatenate([t[i] for t in slices]) for i in range(5))
    folded_shape = (2 * n,) + SHAPE[1:]
    results = {
        "fwd": forward_dir(x, b, u, a=a),
        "fwd2": forward_dir(x, b, u, v, a=a),
        "input": backward_input_dir(dout, b, u, shape=folded_shape, a=a),
        "input2": backward_input_dir(dout, b, u, v, shape=folded_shape, a=a),
        "boxes": backward_boxes_dir(dout, x, b, u, a),
    }
    for s, (xs, douts, bs, us, vs) in enumerate(slices):
        rows, images = slice(s * k, (s + 1) * k), slice(s * n, (s + 1) * n)
        assert_close(results["fwd"][rows], forward_dir(xs, bs, us, a=a_plain), rtol_=0.0)
        assert_close(results["fwd2"][rows], forward_dir(xs, bs, us, vs, a=a_plain), rtol_=0.0)
        assert_close(results["input"][images], backward_input_dir(douts, bs, us, a=a_plain),
                     rtol_=0.0)
        assert_close(results["input2"][images], backward_input_dir(douts, bs, us, vs, a=a_plain),
                     rtol_=0.0)
        assert_close(results["boxes"][rows], backward_boxes_dir(douts, xs, bs, us, a_plain),
                     rtol_=0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bitwise_reproducible(dtype):
    # Many boxes on one image so that cells receive terms from many boxes.
    b = general_boxes(60, 0.5).at[:, 0].set(0)
    b = jnp.concatenate([b] * 8).astype(dtype)
    x, dout, u, v = problem(12, b, dtype)
    for deterministic in (True, False):
        a = attributes(0.5, -1, False, deterministic=deterministic)
        runs = [(backward_input_dir(dout, b, u, a=a), backward_input_dir(dout, b, u, v, a=a),
                 forward_dir(x, b, u, v, a=a), backward_boxes_dir(dout, x, b, u, a))
                for _ in range(3)]
        for run in runs[1:]:
            for first, again in zip(runs[0], run):
                assert np.asarray(first).tobytes() == np.asarray(again).tobytes()


def test_bad_operands_raise():
    a = attributes(1.0, 2, False)
    b = smooth_boxes(70, 3, 1.0, 2, False)
    x, dout, u, v = problem(13, b)
    with pytest.raises(Exception, match="direction u"):
        jax.block_until_ready(forward_dir(x, b, u[:2], a=a))
    with pytest.raises(Exception, match="direction v"):
        jax.block_until_ready(forward_dir(x, b, u, v[:, :4], a=a))
    with pytest.raises(Exception, match="direction v"):
        jax.block_until_ready(backward_input_dir(dout, b, u, v.astype(jnp.float32), a=a))
    with pytest.raises(Exception, match="at most one"):
        jax.block_until_ready(_ffi.call("jk_roi_align_fwd_directional",
                                        jax.ShapeDtypeStruct((3, SHAPE[1]) + OUT, x.dtype),
                                        x, b, u, v, v, **a))
    with pytest.raises(Exception, match="direction u"):
        jax.block_until_ready(backward_boxes_dir(dout, x, b, u[:, :4], a))
    with pytest.raises(Exception, match="not \\[K, C, PH, PW\\]"):
        jax.block_until_ready(backward_input_dir(dout[:, :, :2], b, u, a=a))
