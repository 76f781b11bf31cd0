"""Tests of jk.grid_sample against independent oracles: a float64 NumPy reference written from
the PyTorch documentation (below), torch CPU, and torch CUDA when it is available.

Covers every mode x padding x align_corners x rank x dtype forward and backward, gradient
checks in float64, edge and non-finite coordinates, tiny and empty shapes, vmap in all its
forms, the lowered programs (custom calls, no gather / scatter / while), the validation errors,
and on the GPU the bitwise determinism of the backward. Runs unchanged with JAX_PLATFORMS=cuda.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_kernels as jk
from jk_testing import TORCH_UNAVAILABLE, ON_GPU, assert_close, assert_lowered, to_numpy64, torch

MODES = ("bilinear", "nearest", "bicubic")
PADDINGS = ("zeros", "border", "reflection")
# (rank, mode) pairs torch supports: bicubic is 4-D only.
RANK_MODES = [(4, m) for m in MODES] + [(5, m) for m in MODES if m != "bicubic"]
DTYPES = (jnp.float64, jnp.float32, jnp.float16, jnp.bfloat16)
# Tolerances relative to the magnitude of the expected array (the issue's; never loosened).
TORCH_RTOL = {np.dtype(jnp.float64): 1e-9, np.dtype(jnp.float32): 2e-4}
REFERENCE_RTOL = {np.dtype(jnp.float64): 1e-12, np.dtype(jnp.float16): 1e-2,
                  np.dtype(jnp.bfloat16): 1e-2}

needs_torch = pytest.mark.skipif(torch is None, reason=TORCH_UNAVAILABLE)


# --- float64 NumPy reference, from the torch.nn.functional.grid_sample documentation ----------
#
# A grid coordinate c in [-1, 1] maps to a source position u along an axis of `size` cells:
# align_corners=True puts -1 and 1 at the centres of the corner cells, False at their outer
# edges. Padding: "border" clamps u to [0, size - 1]; "reflection" folds u back and forth over
# the borders (the corner centres with align_corners, the outer edges without) and then clamps.
# Nearest picks round-half-to-even(u); bilinear blends floor(u) and floor(u) + 1; bicubic
# blends floor(u) - 1 .. floor(u) + 2 with the Keys kernel (a = -0.75), padding each of those
# cell indices. Cells outside the input read zero. Documented here (as in jax_kernels): a NaN
# coordinate reads nothing; ±Inf reads the edge with border padding and nothing otherwise.


def _unnormalize(c, size, align):
    return (c + 1) / 2 * (size - 1) if align else ((c + 1) * size - 1) / 2


def _clip(u, size):
    slope = ((u > 0) & (u < size - 1)).astype(np.float64)
    return np.clip(u, 0, size - 1), slope


def _reflect(u, size, align):
    lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
    span = hi - lo
    if span == 0:
        return np.zeros_like(u), np.zeros_like(u)
    d = u - lo
    sign = np.where(d < 0, -1.0, 1.0)
    with np.errstate(invalid="ignore"):
        folded_at = np.mod(np.abs(d), 2 * span)
    back = folded_at > span
    return np.where(back, 2 * span - folded_at, folded_at) + lo, np.where(back, -sign, sign)


def _pad(u, size, padding, align):
    """Padded position and d(padded)/du."""
    slope = np.ones_like(u)
    if padding == "reflection":
        u, s = _reflect(u, size, align)
        slope = slope * s
    if padding in ("border", "reflection"):
        u, s = _clip(u, size)
        slope = slope * s
    return u, slope


def _keys(d):
    """Keys cubic kernel (a = -0.75) at distance d and its derivative."""
    a, x = -0.75, np.abs(d)
    inner = ((a + 2) * x - (a + 3)) * x * x + 1
    outer = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    d_inner = (3 * (a + 2) * x - 2 * (a + 3)) * x
    d_outer = (3 * a * x - 10 * a) * x + 8 * a
    value = np.where(x <= 1, inner, np.where(x < 2, outer, 0.0))
    slope = np.where(x <= 1, d_inner, np.where(x < 2, d_outer, 0.0)) * np.sign(d)
    return value, slope


def _axis_taps(c, size, mode, padding, align):
    """[(cell index, valid, weight, d weight / d c)] along one axis for coordinates c."""
    scale = (size - 1) / 2 if align else size / 2
    u = _unnormalize(c, size, align)
    readable = ~np.isnan(c)
    if mode == "bicubic":
        infinite = np.isinf(u)
        if padding == "border":
            u = np.where(infinite, np.where(u > 0, size + 2.0, -3.0), u)
        else:
            readable &= ~infinite
        u = np.where(readable, u, 0.0)
        u0 = np.floor(u)
        t = u - u0
        taps = []
        for i in range(4):
            w, dw = _keys(t + 1 - i)  # distance from the tap at u0 - 1 + i
            cell, _ = _pad(u0 - 1 + i, size, padding, align)
            valid = readable & (cell >= 0) & (cell < size)
            taps.append((np.where(valid, np.trunc(cell), 0).astype(np.int64), valid, w, dw * scale))
        return taps
    u, pad_slope = _pad(u, size, padding, align)
    slope = scale * pad_slope
    readable &= np.isfinite(u)
    u = np.where(readable, u, -10.0)
    if mode == "nearest":
        cell = np.rint(u)
        valid = readable & (cell >= 0) & (cell < size)
        return [(np.where(valid, cell, 0).astype(np.int64), valid, np.ones_like(u), np.zeros_like(u))]
    u0 = np.floor(u)
    taps = []
    for cell, w, s in ((u0, u0 + 1 - u, -slope), (u0 + 1, u - u0, slope)):
        valid = readable & (cell >= 0) & (cell < size)
        taps.append((np.where(valid, cell, 0).astype(np.int64), valid, w, s))
    return taps


def _point_taps(grid, spatial, mode, padding, align):
    """Taps of every grid point as (cells tuple (z,) y, x; valid; weight; slopes per axis)."""
    dims = grid.shape[-1]
    per_axis = [_axis_taps(grid[..., a], spatial[dims - 1 - a], mode, padding, align)
                for a in range(dims)]
    for combo in itertools.product(*per_axis):  # combo[a] is a tap along axis a (x, y, z)
        cells = tuple(combo[a][0] for a in reversed(range(dims)))
        valid = np.logical_and.reduce([t[1] for t in combo])
        weight = np.prod([t[2] for t in combo], axis=0)
        slopes = [np.prod([t[3] if b == a else t[2] for b, t in enumerate(combo)], axis=0)
                  for a in range(dims)]
        yield cells, valid, weight, slopes


def reference(x, grid, dout, mode, padding, align):
    """(out, d_input, d_grid) in float64 for input x [N, C, *S], grid [N, *P, dims], dout."""
    x, grid, dout = (np.asarray(v, np.float64) for v in (x, grid, dout))
    n, channels = x.shape[:2]
    batch = np.arange(n).reshape((n,) + (1,) * (grid.ndim - 2))
    out = np.zeros(dout.shape)
    d_input = np.zeros(x.shape)
    d_grid = np.zeros(grid.shape)
    dout_last = np.moveaxis(dout, 1, -1)  # [N, *P, C]
    for cells, valid, weight, slopes in _point_taps(grid, x.shape[2:], mode, padding, align):
        values = np.where(valid[..., None], np.moveaxis(x, 1, -1)[(batch,) + cells], 0.0)
        out += np.moveaxis(np.where(valid[..., None], weight[..., None] * values, 0.0), -1, 1)
        contribution = np.where(valid[..., None], weight[..., None] * dout_last, 0.0)
        np.add.at(np.moveaxis(d_input, 1, -1), (batch,) + cells, contribution)
        for a, slope in enumerate(slopes):
            d_grid[..., a] += np.where(valid, slope * np.sum(values * dout_last, axis=-1), 0.0)
    return out, d_input, d_grid


# --- helpers ---------------------------------------------------------------------------------


def _normalize(u, size, align):
    return 2 * u / (size - 1) - 1 if align else (2 * u + 1) / size - 1


def smooth_grid(seed, n, points_shape, spatial, align):
    """Grid coordinates whose source positions lie 0.2-0.4 or 0.6-0.8 past an integer, within
    two cells around the input: away from every kink of every mode and padding, so gradients
    are well defined and half-precision rounding cannot cross one."""
    rng = np.random.default_rng(seed)
    dims = len(spatial)
    coords = []
    for a in range(dims):
        size = spatial[dims - 1 - a]
        shape = (n,) + tuple(points_shape)
        whole = rng.integers(-2, size + 1, size=shape)
        frac = rng.uniform(0.2, 0.4, size=shape) + 0.4 * rng.integers(0, 2, size=shape)
        coords.append(_normalize(whole + frac, size, align))
    return np.stack(coords, axis=-1)


def random_array(seed, shape):
    return np.random.default_rng(seed).uniform(-1, 1, size=shape)


def shapes(rank):
    """(input shape, grid shape): odd sizes, 5 channels (a block of 4 and one more), more than
    128 output points (two CPU tiles)."""
    if rank == 4:
        return (2, 5, 6, 7), (2, 12, 13, 2)
    return (2, 5, 4, 5, 6), (2, 3, 6, 9, 3)


def run(x, grid, dout, *, dtype, **options):
    """(out, d_input, d_grid) from jax_kernels, jitted."""
    def value_and_grads(x, grid, dout):
        out, vjp = jax.vjp(lambda a, b: jk.grid_sample(a, b, **options), x, grid)
        return (out,) + vjp(dout)
    args = [jnp.asarray(v).astype(dtype) for v in (x, grid, dout)]
    return jax.jit(value_and_grads)(*args)


def torch_run(x, grid, dout, device="cpu", dtype=None, **options):
    dtype = dtype or torch.float64
    tx = torch.tensor(np.asarray(x), dtype=dtype, device=device, requires_grad=True)
    tg = torch.tensor(np.asarray(grid), dtype=dtype, device=device, requires_grad=True)
    out = torch.nn.functional.grid_sample(tx, tg, **options)
    out.backward(torch.tensor(np.asarray(dout), dtype=dtype, device=device))
    return tuple(t.detach().cpu().to(torch.float64).numpy() for t in (out, tx.grad, tg.grad))


def rounded(values, dtype):
    return to_numpy64(jnp.asarray(values).astype(dtype))


# --- every mode x padding x align_corners x rank x dtype ------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("align", (False, True), ids=("edges", "align"))
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("rank,mode", RANK_MODES)
def test_matches_oracles(rank, mode, padding, align, dtype):
    in_shape, grid_shape = shapes(rank)
    x = random_array(1, in_shape)
    grid = smooth_grid(2, grid_shape[0], grid_shape[1:-1], in_shape[2:], align)
    dout = random_array(3, in_shape[:2] + grid_shape[1:-1])
    options = dict(mode=mode, padding_mode=padding, align_corners=align)
    ours = run(x, grid, dout, dtype=dtype, **options)
    for got, like in zip(ours, (dout, x, grid)):
        assert got.dtype == jnp.dtype(dtype) and got.shape == like.shape
    dt = np.dtype(dtype)
    if dt in REFERENCE_RTOL:  # the reference sees the inputs as rounded to the dtype
        expected = reference(*(rounded(v, dtype) for v in (x, grid, dout)), mode, padding, align)
        for got, want in zip(ours, expected):
            assert_close(got, want, rtol_=REFERENCE_RTOL[dt])
    if dt in TORCH_RTOL and torch is not None:
        expected = torch_run(x, grid, dout, dtype=getattr(torch, dt.name), **options)
        for got, want in zip(ours, expected):
            assert_close(got, want, rtol_=TORCH_RTOL[dt])


@pytest.mark.parametrize("align", (False, True), ids=("edges", "align"))
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("rank,mode", RANK_MODES)
def test_check_grads(rank, mode, padding, align):
    in_shape, _ = shapes(rank)
    in_shape = in_shape[:1] + (2,) + in_shape[2:]
    x = jnp.asarray(random_array(4, in_shape))
    grid = jnp.asarray(smooth_grid(5, 2, (3, 4) if rank == 4 else (2, 2, 3), in_shape[2:], align))
    f = lambda a, b: jk.grid_sample(a, b, mode=mode, padding_mode=padding, align_corners=align)
    check_grads(f, (x, grid), order=1, eps=1e-5)  # order 2: test_derivatives.py


# --- edges, kinks and non-finite coordinates ---------------------------------------------------


# Dyadic coordinates on sides of 2, 4 and 8 cells: every formula of the unnormalization (torch
# CPU and CUDA round differently) lands exactly on cell centres, cell edges and borders.
EDGE_VALUES = (-1.0, 1.0, 0.0, -1.25, 1.25, -0.5, 0.5, 0.25, -0.125, 0.375, 3.0, -3.0)


@needs_torch
@pytest.mark.parametrize("align", (False, True), ids=("edges", "align"))
@pytest.mark.parametrize("rank,mode", RANK_MODES)
def test_edge_coordinates_match_torch(rank, mode, align):
    """Coordinates exactly on cell centres, cell edges, image borders and reflection axes,
    where torch's conventions (borders count as outside for the gradient, half to even for
    nearest) decide the values and gradients."""
    in_shape = (1, 2, 4, 8) if rank == 4 else (1, 2, 2, 4, 8)
    dims = rank - 2
    coords = np.array(list(itertools.product(EDGE_VALUES, repeat=2)))
    if dims == 3:
        coords = np.concatenate([coords, np.resize(EDGE_VALUES, (len(coords), 1))], axis=1)
    grid = coords.reshape((1,) * dims + (-1, dims))
    x = random_array(6, in_shape)
    dout = random_array(7, in_shape[:2] + grid.shape[1:-1])
    for padding in PADDINGS:
        options = dict(mode=mode, padding_mode=padding, align_corners=align)
        ours = run(x, grid, dout, dtype=jnp.float64, **options)
        for got, want in zip(ours, torch_run(x, grid, dout, **options)):
            assert_close(got, want, rtol_=1e-9)


@pytest.mark.parametrize("rank,mode", RANK_MODES)
def test_non_finite_and_huge_coordinates(rank, mode):
    """NaN reads nothing; ±Inf reads the edge with border padding and nothing otherwise; huge
    finite coordinates behave as far-away points. Nothing is read or written out of bounds."""
    dims = rank - 2
    in_shape = (1, 3, 4, 5) if rank == 4 else (1, 3, 3, 4, 5)
    specials = np.array([np.nan, np.inf, -np.inf, 1e10, -1e10, 1e30, -1e30, 0.3])
    coords = np.stack([np.resize(specials, specials.size * 2),
                       np.repeat([0.1, np.nan], specials.size)], axis=-1)
    if dims == 3:
        coords = np.concatenate([coords, np.full((len(coords), 1), -0.2)], axis=1)
    grid = coords.reshape((1,) * dims + (-1, dims))
    x = random_array(8, in_shape)
    dout = random_array(9, in_shape[:2] + grid.shape[1:-1])
    for padding, align in itertools.product(PADDINGS, (False, True)):
        out, d_input, d_grid = (to_numpy64(v) for v in run(
            x, grid, dout, dtype=jnp.float64, mode=mode, padding_mode=padding, align_corners=align))
        for v in (out, d_input, d_grid):
            assert np.all(np.isfinite(v))
        expected = reference(x, grid, dout, mode, padding, align)
        points = coords.shape[0]
        flat = lambda v: v.reshape(v.shape[:2] + (points,))
        finite_rows = np.all(np.isfinite(coords) & (np.abs(coords) < 1e9), axis=1)
        # Far-away reflected points fold with float rounding: compare everything else exactly.
        keep = finite_rows | (padding != "reflection")
        assert_close(flat(out)[..., keep], flat(expected[0])[..., keep], rtol_=1e-12)
        nan_rows = np.any(np.isnan(coords), axis=1)
        assert np.all(flat(out)[..., nan_rows] == 0)
        assert np.all(d_grid.reshape(points, dims)[nan_rows] == 0)
        if padding == "reflection":
            assert np.all(np.abs(out) <= np.abs(x).max() * 2.5)  # bounded: interpolated values
        else:
            assert_close(d_input, expected[1], rtol_=1e-12)


# --- shapes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_shape,grid_shape", [
    ((1, 1, 1, 1), (1, 1, 1, 2)),
    ((1, 2, 1, 5), (1, 3, 1, 2)),
    ((3, 1, 2, 1), (3, 1, 4, 2)),
    ((1, 1, 1, 1, 1), (1, 2, 1, 1, 3)),
    ((0, 3, 4, 5), (0, 2, 3, 2)),
    ((2, 0, 4, 5), (2, 2, 3, 2)),
    ((2, 3, 4, 5), (2, 0, 3, 2)),
    ((2, 3, 4, 5, 6), (2, 1, 0, 3, 3)),
], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_tiny_and_empty_shapes(in_shape, grid_shape, mode):
    if mode == "bicubic" and len(in_shape) == 5:
        pytest.skip("bicubic is 4-D only")
    x = random_array(10, in_shape)
    grid = random_array(11, grid_shape) * 1.5
    dout = random_array(12, in_shape[:2] + grid_shape[1:-1])
    for padding, align in itertools.product(PADDINGS, (False, True)):
        ours = run(x, grid, dout, dtype=jnp.float64, mode=mode, padding_mode=padding,
                   align_corners=align)
        expected = reference(x, grid, dout, mode, padding, align)
        # Against the data's scale (values in [-1, 1]): a 1-cell bicubic d_grid is zero but
        # for rounding.
        for got, want in zip(ours, expected):
            assert_close(got, want, scale=1.0, rtol_=1e-12)


# --- batching ----------------------------------------------------------------------------------


def _per_example(f, *args_axes):
    """Stacks f over the leading axis of the batched arguments (axis None: unbatched)."""
    size = next(a.shape[ax] for a, ax in args_axes if ax is not None)
    rows = [f(*[a if ax is None else jnp.take(a, i, axis=ax) for a, ax in args_axes])
            for i in range(size)]
    return jax.tree.map(lambda *r: jnp.stack(r), *rows)


@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0), (2, 1), (-1, None), (None, -2)],
                         ids=str)
@pytest.mark.parametrize("rank", (4, 5))
def test_vmap(rank, in_axes):
    in_shape, grid_shape = ((2, 3, 5, 6), (2, 4, 3, 2)) if rank == 4 else \
        ((2, 3, 3, 4, 5), (2, 2, 3, 2, 3))
    x = jnp.asarray(random_array(13, in_shape))
    grid = jnp.asarray(random_array(14, grid_shape) * 1.2)
    f = lambda a, b: jk.grid_sample(a, b, mode="bilinear", padding_mode="reflection")
    xs = x if in_axes[0] is None else jnp.stack([x, x * 2 - 0.5, -x], axis=in_axes[0])
    gs = grid if in_axes[1] is None else jnp.stack([grid, grid * 0.7, -grid], axis=in_axes[1])
    got = jax.vmap(f, in_axes=in_axes)(xs, gs)
    expected = _per_example(f, (xs, in_axes[0]), (gs, in_axes[1]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    text = assert_lowered(jax.vmap(f, in_axes=in_axes), xs, gs, targets=["jk_grid_sample_fwd"],
                          forbidden=("stablehlo.while", "stablehlo.gather", "stablehlo.scatter"))
    assert text.count("custom_call @jk_grid_sample_fwd") == 1
    if in_axes[0] is None:  # the unbatched input reaches the kernel as is: no copy per grid
        shape = "x".join(map(str, x.shape))
        assert f"(tensor<{shape}xf64>, " in text


def test_vmap_over_an_empty_axis():
    x = jnp.asarray(random_array(28, (2, 3, 4, 5)))
    grids = jnp.zeros((0, 2, 3, 3, 2))
    f = lambda a, b: jnp.sum(jk.grid_sample(a, b) ** 2)
    out = jax.vmap(jk.grid_sample, (None, 0))(x, grids)
    assert out.shape == (0, 2, 3, 3, 3)
    d_input, d_grid = jax.vmap(jax.grad(f, argnums=(0, 1)), (None, 0))(x, grids)
    assert d_input.shape == (0,) + x.shape and d_grid.shape == grids.shape


def test_nested_vmap_and_grads():
    x = jnp.asarray(random_array(15, (3, 2, 2, 4, 5)))  # [A, B?..] input batches
    grid = jnp.asarray(random_array(16, (4, 2, 3, 3, 2)))
    f = lambda a, b: jk.grid_sample(a, b, mode="bicubic", padding_mode="border", align_corners=True)
    # Outer over the input, inner over the grid, and the reverse order.
    got = jax.vmap(jax.vmap(f, (None, 0)), (0, None))(x, grid)
    expected = np.stack([np.stack([f(x[i], grid[j]) for j in range(4)]) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(got), expected)
    got = jax.vmap(jax.vmap(f, (0, None)), (None, 0))(x, grid)
    np.testing.assert_array_equal(np.asarray(got), expected.transpose(1, 0, 2, 3, 4, 5))
    # Three levels, the input batched at the outer and inner ones: materializes, never loops.
    x3 = jnp.stack([x, x + 1])
    h = jax.vmap(jax.vmap(jax.vmap(f, (0, None)), (None, 0)), (0, None))
    got = h(x3, grid)
    expected = np.stack([np.stack([np.stack([f(x3[a, c], grid[b]) for c in range(3)])
                                   for b in range(4)]) for a in range(2)])
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert_lowered(h, x3, grid, targets=["jk_grid_sample_fwd"])

    def loss(a, b):
        return jnp.sum(jnp.sin(f(a, b)))

    grads = jax.grad(loss, argnums=(0, 1))
    # vmap of grad: per-example gradients, batched over the input only, the grid only, both.
    for in_axes, xs, gs in (((0, None), x, grid[0]), ((None, 0), x[0], grid), ((0, 0), x, grid[:3])):
        got = jax.vmap(grads, in_axes)(xs, gs)
        expected = _per_example(grads, (xs, in_axes[0]), (gs, in_axes[1]))
        for g_got, g_want in zip(got, expected):
            assert_close(g_got, g_want, rtol_=1e-12)
        assert_lowered(jax.vmap(grads, in_axes), xs, gs,
                       targets=["jk_grid_sample_bwd_input", "jk_grid_sample_bwd_grid"],
                       forbidden=("stablehlo.while", "stablehlo.gather", "stablehlo.scatter"))
    # grad of vmap: the gradient of an unbatched input sums over the vmapped grids.
    got = jax.grad(lambda a, b: jnp.sum(jnp.sin(jax.vmap(f, (None, 0))(a, b))), argnums=(0, 1))(
        x[0], grid)
    expected = jax.grad(lambda a, b: sum(loss(a, b[i]) for i in range(4)), argnums=(0, 1))(x[0], grid)
    for g_got, g_want in zip(got, expected):
        assert_close(g_got, g_want, rtol_=1e-12)


# --- lowered programs ------------------------------------------------------------------------


@pytest.mark.parametrize("rank,mode", RANK_MODES)
def test_lowered_program(rank, mode):
    in_shape, grid_shape = shapes(rank)
    x = jnp.asarray(random_array(17, in_shape), jnp.float32)
    grid = jnp.asarray(random_array(18, grid_shape), jnp.float32)
    f = lambda a, b: jk.grid_sample(a, b, mode=mode)
    forbidden = ("stablehlo.while", "stablehlo.gather", "stablehlo.scatter")
    assert_lowered(f, x, grid, targets=["jk_grid_sample_fwd"], forbidden=forbidden)
    grads = jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1))
    backward = ["jk_grid_sample_bwd_input"] + (["jk_grid_sample_bwd_grid"] if mode != "nearest" else [])
    assert_lowered(grads, x, grid, targets=["jk_grid_sample_fwd"] + backward, forbidden=forbidden)
    # Only the gradient asked for is computed: XLA drops the other kernel.
    compiled = jax.jit(jax.grad(lambda b: jnp.sum(f(x, b) ** 2))).lower(grid).compile().as_text()
    assert "jk_grid_sample_bwd_input" not in compiled
    for op in ("conditional", "while", "gather", "scatter"):
        assert op not in compiled


# --- determinism -------------------------------------------------------------------------------


def _backward(x, grid, dout, deterministic, mode="bilinear"):
    f = jax.jit(lambda a, b, d: jax.vjp(
        lambda a, b: jk.grid_sample(a, b, mode=mode, deterministic=deterministic), a, b)[1](d))
    return f(x, grid, dout)


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_flag_agrees(mode):
    """deterministic=False may add with atomics (GPU, float32/float64); it must agree."""
    in_shape = (3, 6, 20, 24)
    for dtype, rtol in ((jnp.float64, 1e-12), (jnp.float32, 1e-5)):
        x = jnp.asarray(random_array(19, in_shape), dtype)
        grid = jnp.asarray(random_array(20, (3, 31, 17, 2)) * 1.1, dtype)
        dout = jnp.asarray(random_array(21, (3, 6, 31, 17)), dtype)
        exact = _backward(x, grid, dout, True, mode)
        fast = _backward(x, grid, dout, False, mode)
        for a, b in zip(exact, fast):
            assert_close(b, to_numpy64(a), rtol_=rtol)


@pytest.mark.skipif(not ON_GPU, reason="bitwise run-to-run determinism is a GPU property")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_backward_bitwise_deterministic(dtype):
    # Smooth upsampling (several points per cell), a random grid, and a degenerate grid that
    # sends every point to the same cells (one long segment per cell).
    rng = np.random.default_rng(22)
    n, c = 4, 16
    x = jnp.asarray(rng.standard_normal((n, c, 40, 48)), dtype)
    smooth = np.stack(np.meshgrid(np.linspace(-1, 1, 96), np.linspace(-1, 1, 80)), -1)
    grids = [np.broadcast_to(smooth, (n, 80, 96, 2)), rng.uniform(-1.1, 1.1, (n, 80, 96, 2)),
             np.full((n, 80, 96, 2), 0.01)]
    dout = jnp.asarray(rng.standard_normal((n, c, 80, 96)), dtype)
    for grid in grids:
        grid = jnp.asarray(grid, dtype)
        for mode in ("bilinear", "bicubic", "nearest"):
            first = [np.asarray(v).tobytes() for v in _backward(x, grid, dout, True, mode)]
            for _ in range(5):
                again = [np.asarray(v).tobytes() for v in _backward(x, grid, dout, True, mode)]
                assert again == first


@pytest.mark.skipif(not ON_GPU, reason="the CUDA input gradient's two sorted paths")
@pytest.mark.parametrize("channels", [3, 5])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("spatial,padding,align", [
    ((40, 56), "zeros", False), ((40, 56), "border", True), ((40, 56), "reflection", False),
    ((12, 14, 16), "zeros", True), ((12, 14, 16), "reflection", False)])
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16, jnp.float64),
                         ids=lambda d: np.dtype(d).name)
def test_bilinear_corner_sort_matches_the_entries_sort(spatial, padding, align, channels_last,
                                                       channels, dtype):
    """The deterministic bilinear input gradient sorts the points by corner when its scratch
    holds that layout (what the op asks for), else the (point, tap) entries (what programs
    serialized before the corner sort bring). Both add the same terms in the same order: the
    same bits. A few points per batch row over a large input makes the entries' scratch the
    smaller one (precondition, asserted), so that the target can be called with either size.
    Half the points crowd into a few cells near an edge (long segments, taps off the input).
    3 channels take the gathers' few-channel form (channels-last: one thread per cell)."""
    from jax_kernels import _ffi
    rng = np.random.default_rng(23)
    batch, points = 24, (2, 3)
    dims = len(spatial)
    out_points = points if dims == 2 else (2,) + points
    crowd = rng.uniform(-1.08, -0.9, (batch,) + out_points + (dims,))
    spread = rng.uniform(-1.1, 1.1, (batch,) + out_points + (dims,))
    grid = jnp.asarray(np.where(rng.random(crowd.shape[:-1] + (1,)) < 0.5, crowd, spread), dtype)
    dout_shape = ((batch,) + out_points + (channels,) if channels_last
                  else (batch, channels) + out_points)
    dout = jnp.asarray(rng.standard_normal(dout_shape), dtype)
    cells_shape = spatial + (channels,) if channels_last else (channels,) + spatial
    d_input = jax.ShapeDtypeStruct((batch,) + cells_shape, dtype)
    sizes = {}
    for directional in (0, 1):  # bilinear: 0 sizes the corner sort, 1 the entries' sort
        sizes[directional] = _ffi.query(
            "grid_sample_bwd_input_scratch", batch=batch, points=int(np.prod(out_points)),
            cells=int(np.prod(spatial)), extended_cells=int(np.prod([s + 1 for s in spatial])),
            dims=dims, mode=_ffi.ENUMS["GridSampleMode"]["bilinear"],
            element_bytes=np.dtype(dtype).itemsize, deterministic=1, directional=directional)
    assert sizes[1] < sizes[0], sizes
    target = "jk_grid_sample_nhwc_bwd_input" if channels_last else "jk_grid_sample_bwd_input"
    attributes = dict(mode=np.int64(_ffi.ENUMS["GridSampleMode"]["bilinear"]),
                      padding=np.int64(_ffi.ENUMS["GridSamplePadding"][padding]),
                      align_corners=align,
                      batch_maps=np.asarray([1, batch, 1, batch], np.int64), deterministic=True)

    def run(nbytes):
        scratch = jax.ShapeDtypeStruct((nbytes,), jnp.uint8)
        return np.asarray(jax.jit(lambda d, g: _ffi.call(target, (d_input, scratch), d, g,
                                                         **attributes)[0])(dout, grid))

    by_corner, by_entry = run(sizes[0]), run(sizes[1])
    assert np.abs(to_numpy64(by_corner)).max() > 0
    assert by_corner.tobytes() == by_entry.tobytes()
    # and both are the gradient: against the op's own float64 CPU result
    x = jnp.zeros((batch,) + cells_shape, jnp.float64)
    fmt = "NHWC" if channels_last else "NCHW"
    with jax.default_device(jax.devices("cpu")[0]):
        _, vjp = jax.vjp(lambda a: jk.grid_sample(a, jnp.asarray(to_numpy64(grid)),
                                                  padding_mode=padding, align_corners=align,
                                                  data_format=fmt), x)
        (expected,) = vjp(jnp.asarray(to_numpy64(dout)))
    assert_close(by_corner, np.asarray(expected), dtype)


# The channels-first CUDA forward's channels-last copy (forward_copy.cu): channel counts that fill
# a warp's lanes or not (3 and 8 of a slab of 32; 33 of 64; 70 of 128; 150: a slab of 128 and a
# tail of 22), spatial extents that are no multiple of the 32 x 64 transpose tile or of the
# 32-point output tile.
COPY_GEOMETRIES = [((2, 33, 37, 41), (29, 45)), ((3, 8, 64, 50), (33, 31)),
                   ((1, 70, 19, 23), (40, 37)), ((2, 3, 31, 33), (17, 19)),
                   ((2, 150, 21, 19), (23, 35))]


@needs_torch
@pytest.mark.skipif(not ON_GPU, reason="the CUDA forward's two routes")
@pytest.mark.parametrize("geometry", COPY_GEOMETRIES, ids=lambda g: "x".join(map(str, g[0])))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16, jnp.float16),
                         ids=lambda d: np.dtype(d).name)
def test_forward_through_a_channels_last_copy(monkeypatch, geometry, dtype):
    """On far-apart points the channels-first CUDA forward samples a channels-last copy of its
    input, or its input in place with more loads in flight (the scattered route).
    JAX_KERNELS_GRID_SAMPLE_COPY=1 takes the copy on every grid (without the survey), =2 the
    scattered route, =0 neither: the same sums in the same order, so the same bits, for every
    mode, padding and align_corners, a vmap over grids that shares one input, random and smooth
    grids; against float64 torch on the same rounded inputs; the programs name the adaptive
    target only where another route may be taken."""
    from jax_kernels import _ffi
    shape, out_hw = geometry
    rng = np.random.default_rng(31)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    n = shape[0]
    ys, xs = np.meshgrid(np.linspace(-1, 1, out_hw[0]), np.linspace(-1, 1, out_hw[1]),
                         indexing="ij")
    # (off the cells' centres and edges: float32 and float64 coordinates would round ties of
    # nearest sampling apart)
    smooth = np.broadcast_to(np.stack([0.9 * xs + 0.1 * ys + 0.0137, 0.9 * ys - 0.1 * xs - 0.0071],
                                      -1), (n,) + out_hw + (2,))
    grids = [jnp.asarray(rng.uniform(-1.1, 1.1, (n,) + out_hw + (2,)), dtype),
             jnp.asarray(smooth, dtype)]
    options = [("bilinear", "zeros", False), ("nearest", "border", True),
               ("bicubic", "reflection", False), ("bilinear", "reflection", True)]

    def run():
        outs, texts = [], []
        for grid in grids:
            for mode, padding, align in options:
                f = jax.jit(lambda x, g: jk.grid_sample(x, g, mode, padding, align))
                texts.append(f.lower(x, grid).as_text())
                outs.append(np.asarray(f(x, grid)))
            pair = jnp.stack([grid, -grid])
            outs.append(np.asarray(jax.jit(jax.vmap(lambda g: jk.grid_sample(x, g)))(pair)))
        return outs, texts

    results = {}
    for switch in ("1", "2", "0"):
        # The switch sizes the scratch at trace time and is read when the handler runs: trace
        # and record afresh.
        monkeypatch.setenv("JAX_KERNELS_GRID_SAMPLE_COPY", switch)
        jax.clear_caches()
        results[switch] = run()
    monkeypatch.delenv("JAX_KERNELS_GRID_SAMPLE_COPY")
    jax.clear_caches()
    adaptive = _ffi.target_name("jk_grid_sample_fwd_adaptive")
    assert all(adaptive in t for t in results["1"][1] + results["2"][1])
    assert not any(adaptive in t for t in results["0"][1])
    for copied, scattered, in_place in zip(results["1"][0], results["2"][0], results["0"][0]):
        assert np.abs(to_numpy64(in_place)).max() > 0
        assert copied.tobytes() == in_place.tobytes()
        assert scattered.tobytes() == in_place.tobytes()
    # and both are grid_sample: against float64 torch
    tolerance = TORCH_RTOL.get(np.dtype(dtype), REFERENCE_RTOL.get(np.dtype(dtype)))
    outs = iter(results["1"][0])
    for grid in grids:
        tx, tg = (torch.from_numpy(np.array(to_numpy64(a))) for a in (x, grid))
        for mode, padding, align in options:
            expected = torch.nn.functional.grid_sample(tx, tg, mode, padding, align).numpy()
            assert_close(next(outs), expected, rtol_=tolerance)
        expected = [torch.nn.functional.grid_sample(tx, s * tg, align_corners=False).numpy()
                    for s in (1, -1)]
        assert_close(next(outs), np.stack(expected), rtol_=tolerance)


@needs_torch
@pytest.mark.skipif(not ON_GPU, reason="the CUDA forward's survey")
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: np.dtype(d).name)
def test_forward_survey_keeps_the_bits(monkeypatch, dtype):
    """Inputs large enough for the survey (no switch set): on a random grid and on a smooth one
    the survey picks a route per call; any gives the bits of the in-place forward
    (JAX_KERNELS_GRID_SAMPLE_COPY=0), of the copy (=1) and of the scattered route (=2), with 64
    channels (which may take the copy) and 16 (which may not). The survey starts at 16 MiB
    here (32 by default), to keep the inputs small."""
    monkeypatch.setenv("JAX_KERNELS_GRID_SAMPLE_SURVEY_MIB", "16")
    rng = np.random.default_rng(32)
    inputs = [jnp.asarray(rng.standard_normal((8, 64, 128, 136)), dtype),
              jnp.asarray(rng.standard_normal((8, 16, 256, 272)), dtype)]
    ys, xs = np.meshgrid(np.linspace(-1, 1, 90), np.linspace(-1, 1, 100), indexing="ij")
    grids = [jnp.asarray(rng.uniform(-1, 1, (8, 90, 100, 2)), dtype),
             jnp.asarray(np.broadcast_to(np.stack([xs, ys], -1), (8, 90, 100, 2)), dtype)]
    results = {}
    for switch in ("", "0", "1", "2"):
        if switch:
            monkeypatch.setenv("JAX_KERNELS_GRID_SAMPLE_COPY", switch)
        else:
            monkeypatch.delenv("JAX_KERNELS_GRID_SAMPLE_COPY", raising=False)
        jax.clear_caches()
        f = jax.jit(lambda x, g: jk.grid_sample(x, g))
        results[switch] = [np.asarray(f(x, g)).tobytes() for x in inputs for g in grids]
    monkeypatch.delenv("JAX_KERNELS_GRID_SAMPLE_COPY")
    jax.clear_caches()
    assert results[""] == results["0"] == results["1"] == results["2"]


@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs torch CUDA")
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.float64), ids=("float32", "float64"))
@pytest.mark.parametrize("rank,mode", RANK_MODES)
def test_matches_torch_cuda(rank, mode, dtype):
    in_shape = (3, 10, 33, 40) if rank == 4 else (2, 6, 9, 11, 13)
    grid_shape = (in_shape[0], 45, 38, 2) if rank == 4 else (in_shape[0], 7, 12, 14, 3)
    dims = rank - 2
    x = random_array(23, in_shape)
    dout = random_array(24, in_shape[:2] + grid_shape[1:-1])
    for padding, align in itertools.product(PADDINGS, (False, True)):
        grid = smooth_grid(25, grid_shape[0], grid_shape[1:-1], in_shape[2:], align)
        assert grid.shape[-1] == dims
        options = dict(mode=mode, padding_mode=padding, align_corners=align)
        for deterministic in (True, False):
            ours = run(x, grid, dout, dtype=dtype, deterministic=deterministic, **options)
            theirs = torch_run(x, grid, dout, device="cuda",
                               dtype=getattr(torch, np.dtype(dtype).name), **options)
            for got, want in zip(ours, theirs):
                assert_close(got, want, rtol_=TORCH_RTOL[np.dtype(dtype)])


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("x_shape,grid_shape,kwargs,error,message", [
    ((2, 3, 4), (2, 3, 2), {}, ValueError, r"expected a 4-D or 5-D input, got shape \(2, 3, 4\)"),
    ((2, 3, 4, 5), (2, 5, 6, 3), {}, ValueError,
     r"expected grid of shape \(N, Ho, Wo, 2\) for a 4-D input, got \(2, 5, 6, 3\)"),
    ((2, 3, 4, 5, 6), (2, 5, 6, 3), {}, ValueError,
     r"expected grid of shape \(N, Do, Ho, Wo, 3\) for a 5-D input, got \(2, 5, 6, 3\)"),
    ((2, 3, 4, 5), (3, 5, 6, 2), {}, ValueError,
     r"same batch size, got input \(2, 3, 4, 5\) and grid \(3, 5, 6, 2\)"),
    ((2, 3, 0, 5), (2, 5, 6, 2), {}, ValueError, r"non-empty spatial dimensions, got \(2, 3, 0, 5\)"),
    ((2, 3, 4, 5), (2, 5, 6, 2), {"mode": "linear"}, ValueError, r"expected mode .* got 'linear'"),
    ((2, 3, 4, 5), (2, 5, 6, 2), {"padding_mode": "wrap"}, ValueError,
     r"expected padding_mode .* got 'wrap'"),
    ((2, 3, 4, 5, 6), (2, 5, 6, 7, 3), {"mode": "bicubic"}, ValueError,
     r"mode 'bicubic' supports only 4-D input"),
    ((2, 3, 4, 5), (2, 5, 6, 2), {"align_corners": "yes"}, TypeError, r"align_corners must be a bool"),
    ((2, 3, 4, 5), (2, 5, 6, 2), {"deterministic": 1}, TypeError, r"deterministic must be a bool"),
], ids=["rank", "grid-last-dim-4d", "grid-last-dim-5d", "batch", "empty-spatial", "mode",
        "padding", "bicubic-5d", "align-corners-type", "deterministic-type"])
def test_validation_errors(x_shape, grid_shape, kwargs, error, message):
    with pytest.raises(error, match=r"grid_sample\(\): .*" + message):
        jk.grid_sample(jnp.zeros(x_shape), jnp.zeros(grid_shape), **kwargs)


def test_dtype_errors():
    x = jnp.zeros((1, 1, 2, 2), jnp.float32)
    with pytest.raises(TypeError, match=r"grid_sample\(\): arrays must share one dtype"):
        jk.grid_sample(x, jnp.zeros((1, 1, 1, 2), jnp.float64))
    with pytest.raises(TypeError, match=r"grid_sample\(\): `input` has dtype int32"):
        jk.grid_sample(x.astype(jnp.int32), jnp.zeros((1, 1, 1, 2), jnp.int32))
    with pytest.raises(TypeError, match=r"grid_sample\(\): expected an array for `grid`"):
        jk.grid_sample(x, "grid")


def test_torch_style_positional_options_and_capabilities():
    x = jnp.asarray(random_array(26, (1, 2, 3, 4)))
    grid = jnp.asarray(random_array(27, (1, 2, 2, 2)))
    np.testing.assert_array_equal(
        np.asarray(jk.grid_sample(x, grid, "nearest", "border", True)),
        np.asarray(jk.grid_sample(x, grid, mode="nearest", padding_mode="border", align_corners=True)))
    np.testing.assert_array_equal(np.asarray(jk.grid_sample(x, grid, align_corners=None)),
                                  np.asarray(jk.grid_sample(x, grid)))
    rows = [r for r in jk.capabilities() if r.op == "grid_sample"]
    assert {r.pass_ for r in rows} == {"forward", "backward d_input", "backward d_grid",
                                       "forward directional", "backward d_input directional",
                                       "backward d_grid directional"}
