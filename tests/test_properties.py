"""Property-based tests (hypothesis) of every op and pass on the CPU, with a fixed budget
(issue 14): random shapes (empty ones included), options, dtypes, layouts and values, each
property against an independent oracle, never the package itself (the one exception is
roi_align's channels-last form, which the docs promise is the NCHW result transposed, bitwise).

- grid_sample, 4-D and 5-D, both layouts: forward, d_input and d_grid against torch (float64,
  autograd) and the float64 NumPy reference of test_grid_sample.py; grids with NaN, +-Inf and
  +-1e30 give exactly what docs/grid_sample.md and docs/errors.md ("Wild data") promise.
- lerp: broadcast shapes, scalar or array weights, every dtype, against torch.lerp and the
  two-sided formula in float64; gradients against jax.vjp of that formula written in jnp.
- repeat: every whole-byte dtype bitwise against np.tile; gradients against jnp.tile's and the
  float64 sum of the copies.
- conv2d: dtypes x layouts x small geometries (groups, depthwise, stride / dilation / padding
  0..3, bias, unbatched) against torch float64 on the same rounded inputs (or, without torch,
  the jnp reference of test_hardening.py); the enormous geometries are
  test_hardening.test_conv2d_random_geometries.
- roi_align: data_format="NHWC" against the NCHW result transposed, bitwise, every pass, on
  random boxes (degenerate, reversed, outside the image, bad batch indices, non-finite).

Tolerances are jk_testing's per dtype (and test_grid_sample.py's 1e-9 against torch for
float64 grid_sample, as docs/grid_sample.md states), relative to max(|expected|, a scale) where
the scale is the sum of the absolute values of the summed terms (the error of a sum in a dtype is
bounded by its unit roundoff times that). The budget is fixed: derandomize=True gives the same
examples on every run, so CI time does not vary (about 25 s on a 2-core machine). Each property
jits its passes once per shape and options (module-level jits, reused by similar examples).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kernels as jk
from jk_testing import DTYPES, assert_close, rtol, torch

try:
    from hypothesis import HealthCheck, given, settings, strategies as st
    from hypothesis.extra import numpy as hnp
except Exception as error:  # hypothesis is in the test extras; skip cleanly without it
    HYPOTHESIS_UNAVAILABLE = f"hypothesis is not importable ({type(error).__name__})"
else:
    HYPOTHESIS_UNAVAILABLE = ""

needs_hypothesis = pytest.mark.skipif(bool(HYPOTHESIS_UNAVAILABLE),
                                      reason=HYPOTHESIS_UNAVAILABLE or "-")


def budget(examples):
    """The fixed CI budget: the same examples on every run, no deadline (first calls compile)."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def seeded(seed, shape, low=-1.0, high=1.0):
    """float64 values (never zeros: they hide unwritten outputs)."""
    return np.random.default_rng(seed).uniform(low, high, size=shape)


def in_dtype(values, dtype):
    """values rounded to the dtype, a NumPy array (NumPy's and ml_dtypes' casts: no XLA
    compilation per shape, which would dominate the budget)."""
    with np.errstate(over="ignore"):  # 1e30 is inf in float16, as intended
        return np.asarray(values).astype(np.dtype(dtype))


def f64(values):
    return np.asarray(values).astype(np.float64)


def rounded(values, dtype):
    """values as the dtype holds them, in float64 (the oracles see the rounded inputs)."""
    return f64(in_dtype(values, dtype))


def check_close(what, actual, expected, dtype=None, **kw):
    """jk_testing.assert_close, naming what is compared (actual cast in NumPy: no compilation).
    With a dtype, an error of half its smallest subnormal is always allowed: a result in the
    subnormal range (a float16 product of 1e-7 and 0.3, say) rounds to a multiple of it, the
    best any implementation can store."""
    if dtype is not None:
        tol = kw.get("rtol_") or rtol(dtype)
        floor = float(jnp.finfo(dtype).smallest_subnormal) / 2 / tol
        kw["scale"] = max(kw.get("scale") or 0.0, floor)
    try:
        assert_close(f64(actual), expected, dtype, **kw)
    except AssertionError as error:
        raise AssertionError(f"{what}: {error}") from None


def assert_bitwise(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.tobytes() == expected.tobytes()


# --- grid_sample --------------------------------------------------------------------------------

MODES = ("bilinear", "nearest", "bicubic")
PADDINGS = ("zeros", "border", "reflection")
WILD = (np.nan, np.inf, -np.inf, 1e30, -1e30)
GRID_TORCH_RTOL = 1e-9       # docs/grid_sample.md, "Precision": float64 against torch
GRID_REFERENCE_RTOL = 1e-12  # against the float64 NumPy reference
KEYS_BOUND = 1.375           # max over t of the sum of |Keys weights| (a = -0.75), per axis


def _unnormalize(c, size, align):
    return (c + 1) / 2 * (size - 1) if align else ((c + 1) * size - 1) / 2


def _normalize(u, size, align):
    return 2 * u / (size - 1) - 1 if align else (2 * u + 1) / size - 1


def _grid_reference(x, grid, dout, mode, padding, align):
    from test_grid_sample import reference  # the float64 NumPy reference, from torch's docs
    return reference(x, grid, dout, mode, padding, align)


def _grid_term_bound(x, grid, dout, mode, padding, align):
    """[N, *P, dims]: the sum over taps and channels of |d weight / d coordinate| |x| |dout|,
    the size of d_grid's terms. d_grid is a sum that can cancel to rounding noise (bicubic on a
    size-1 axis with border padding is 0 analytically), so its errors are measured against this
    rather than against its own values. Likewise the forward's and d_input's errors are
    measured against the values they interpolate (x, dout) or their own, whichever is larger: a
    weight that should be 0 (a coordinate an ulp off a cell edge, where the two sides round the
    position differently) is not 0 in relative terms."""
    from test_grid_sample import _point_taps
    n = x.shape[0]
    batch = np.arange(n).reshape((n,) + (1,) * (grid.ndim - 2))
    x_last, dout_last = np.abs(np.moveaxis(x, 1, -1)), np.abs(np.moveaxis(dout, 1, -1))
    bound = np.zeros(grid.shape)
    for cells, valid, _, slopes in _point_taps(grid, x.shape[2:], mode, padding, align):
        products = np.sum(x_last[(batch,) + cells] * dout_last, axis=-1)
        for a, slope in enumerate(slopes):
            bound[..., a] += np.where(valid, np.abs(slope) * products, 0.0)
    return bound


def _grid_torch(x, grid, dout, mode, padding, align):
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tg = torch.tensor(grid, dtype=torch.float64, requires_grad=True)
    out = torch.nn.functional.grid_sample(tx, tg, mode=mode, padding_mode=padding,
                                          align_corners=align)
    out.backward(torch.tensor(dout, dtype=torch.float64))
    return tuple(t.detach().numpy() for t in (out, tx.grad, tg.grad))


def _grid_oracles(x, grid, dout, mode, padding, align):
    """[(name, (out, d_input, d_grid), rtol)]: torch where it is importable, and the NumPy
    reference always (so that the properties run without torch)."""
    oracles = [("reference", _grid_reference(x, grid, dout, mode, padding, align),
                GRID_REFERENCE_RTOL)]
    if torch is not None:
        oracles.append(("torch", _grid_torch(x, grid, dout, mode, padding, align),
                        GRID_TORCH_RTOL))
    return oracles


@functools.partial(jax.jit, static_argnames=("options", "data_format"))
def _grid_passes(x, grid, dout, options, data_format):
    out, vjp = jax.vjp(lambda a, g: jk.grid_sample(a, g, **dict(options),
                                                   data_format=data_format), x, grid)
    return (out,) + vjp(dout)


def _grid_ours(x, grid, dout, data_format, options):
    """(out, d_input, d_grid) of jk.grid_sample, channels first whatever the layout."""
    last = data_format == "NHWC"
    to_layout = (lambda a: np.moveaxis(a, 1, -1)) if last else (lambda a: a)
    from_layout = (lambda a: np.moveaxis(np.asarray(a), -1, 1)) if last else np.asarray
    out, d_input, d_grid = _grid_passes(to_layout(x), grid, to_layout(dout),
                                        tuple(options.items()), data_format)
    for a in (out, d_input, d_grid):
        assert a.dtype == jnp.float64
    return from_layout(out), from_layout(d_input), np.asarray(d_grid)


def _grid_kinks(grid, spatial, align):
    """[N, *P] mask of the points that have a coordinate within 1e-6 of a kink (a multiple of
    0.5 in unnormalized coordinates: cell centres, cell edges, borders, reflection axes) without
    being exact. Exact coordinates (multiples of 1/64) are unnormalized without rounding by every
    formula, so torch's conventions at kinks apply to them and they are compared; elsewhere
    one rounding more or less crosses the kink, and d_grid (and nearest's cell) jumps."""
    dims = grid.shape[-1]
    near = np.zeros(grid.shape[:-1], bool)
    for a in range(dims):
        c = grid[..., a]
        with np.errstate(invalid="ignore", over="ignore"):
            u2 = 2 * _unnormalize(c, spatial[dims - 1 - a], align)
            close = np.isfinite(u2) & (np.abs(u2 - np.rint(u2)) < 2e-6)
            exact = np.isfinite(c) & (np.abs(c) < 8) & (c * 64 == np.rint(c * 64))
        near |= close & ~exact
    return near


@st.composite if not HYPOTHESIS_UNAVAILABLE else (lambda f: f)
def grid_problems(draw, wild=False):
    rank = draw(st.sampled_from([4, 5]))
    mode = draw(st.sampled_from(MODES if rank == 4 else MODES[:2]))
    padding = draw(st.sampled_from(PADDINGS))
    align = draw(st.booleans())
    data_format = draw(st.sampled_from(["NCHW", "NHWC"]))
    dims = rank - 2
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    spatial = tuple(draw(st.integers(1, 6)) for _ in range(dims))
    points = [draw(st.integers(1, 5 if rank == 4 else 3)) for _ in range(dims)]
    empty = draw(st.sampled_from(["none"] * 5 + ["N", "C", "points"]))  # now and then
    if empty == "points":
        points[draw(st.integers(0, dims - 1))] = 0
    n, c = (0 if empty == "N" else n), (0 if empty == "C" else c)
    points = (n,) + tuple(points)
    axes = []
    for a in range(dims):  # grid[..., a] indexes spatial axis dims - 1 - a (x, y, z)
        size = spatial[dims - 1 - a]
        choices = [st.floats(-2.5, 2.5),                          # anywhere
                   st.integers(-40, 40).map(lambda k: k / 16)]    # exact: often on a kink
        if not (align and size == 1):                             # cell centres and edges
            choices.append(st.integers(-6, 2 * size + 4).map(
                lambda h, size=size: _normalize(h / 2 - 1, size, align)))
        if wild:
            choices.append(st.sampled_from(WILD))
        axes.append(draw(hnp.arrays(np.float64, points, elements=st.one_of(*choices))))
    grid = np.stack(axes, axis=-1)
    seed = draw(st.integers(0, 2**32 - 1))
    x = seeded(seed, (n, c) + spatial)
    dout = seeded(seed + 1, (n, c) + points[1:])
    return x, grid, dout, dict(mode=mode, padding_mode=padding, align_corners=align), data_format


def _peak(a):
    return np.max(np.abs(a), initial=0.0)


def _points_last(a):
    """[N, C, *P] -> [N, *P, C]: a point mask [N, *P] then selects rows of channels."""
    return np.moveaxis(a, 1, -1)


@needs_hypothesis
def test_grid_sample_matches_torch():
    """Random sizes (N, C or the grid empty included), every mode, padding, align_corners,
    rank and layout, coordinates anywhere in [-2.5, 2.5] and exactly on centres, edges and
    borders: the forward and both gradients equal torch's and the NumPy reference's; nearest's
    grid gradient is exactly 0. Points within 1e-6 of a kink (not exactly on it) are left out
    of d_grid (and, for nearest, of everything: their cotangent is 0)."""

    @budget(40)
    @given(grid_problems())
    def check(problem):
        x, grid, dout, options, data_format = problem
        mode, padding, align = options.values()
        kinks = _grid_kinks(grid, x.shape[2:], align)
        if mode == "nearest":  # the cell itself jumps at a half-integer
            dout = np.where(kinks[:, None], 0.0, dout)
        out, d_input, d_grid = _grid_ours(x, grid, dout, data_format, options)
        assert out.shape == dout.shape and d_input.shape == x.shape
        assert d_grid.shape == grid.shape
        if mode == "nearest":
            assert np.all(d_grid == 0)
        smooth = ~kinks
        out_rows = smooth if mode == "nearest" else np.ones_like(smooth)
        bound = np.max(_grid_term_bound(x, grid, dout, mode, padding, align)[smooth], initial=0)
        for name, (e_out, e_input, e_grid), tolerance in _grid_oracles(x, grid, dout, mode,
                                                                        padding, align):
            check_close(f"out vs {name}", _points_last(out)[out_rows],
                        _points_last(e_out)[out_rows], rtol_=tolerance, scale=_peak(x))
            check_close(f"d_input vs {name}", d_input, e_input, rtol_=tolerance,
                        scale=_peak(dout))
            check_close(f"d_grid vs {name}", d_grid[smooth], e_grid[smooth], rtol_=tolerance,
                        scale=bound)

    check()


@needs_hypothesis
def test_grid_sample_wild_coordinates():
    """Grids with NaN, +-Inf and +-1e30 among ordinary coordinates (docs/grid_sample.md,
    "Non-finite and huge coordinates"): every result is finite and of the right shape; a point
    with a NaN coordinate, an infinite one (zeros, reflection) or a huge one (zeros) reads
    nothing: output 0, grid gradient 0, and it sends nothing to d_input; with border padding an
    infinite or huge coordinate is the edge (the same as +-5, past it); with reflection a huge
    one folds to some position (compared only as a bounded interpolation). Everything else is
    compared with the oracles as in test_grid_sample_matches_torch."""

    @budget(30)
    @given(grid_problems(wild=True))
    def check(problem):
        x, grid, dout, options, data_format = problem
        mode, padding, align = options.values()
        nan, inf = np.isnan(grid), np.isinf(grid)
        huge = np.isfinite(grid) & (np.abs(grid) > 1e20)
        dims = grid.shape[-1]
        # Along an axis of size 1 with align_corners=True every coordinate but NaN is position
        # 0 (the scale (size - 1) / 2 is 0; docs/grid_sample.md): there a huge or infinite one
        # reads the cell in every padding, as torch's border and reflection do.
        pinned = np.array([align and x.shape[2:][dims - 1 - a] == 1 for a in range(dims)],
                          bool)
        far = huge & ~pinned
        endless = inf & ~pinned
        dead = nan.any(-1)
        if padding in ("zeros", "reflection"):
            dead |= endless.any(-1)
        if padding == "zeros":
            dead |= far.any(-1)
        folded = ~dead & far.any(-1) & (padding == "reflection")
        # The oracles' grid: border edges at +-5 (past the border in every mode and size), the
        # others anywhere readable (their cotangent is 0 for the oracles).
        safe = np.where(nan | inf | huge, 0.0, grid)
        if padding == "border":
            safe = np.where((inf | huge) & ~pinned, np.sign(grid) * 5.0, safe)
        kinks = _grid_kinks(safe, x.shape[2:], align) & ~dead & ~folded
        if mode == "nearest":
            dout = np.where(kinks[:, None], 0.0, dout)
        out, d_input, d_grid = _grid_ours(x, grid, dout, data_format, options)
        assert out.shape == dout.shape and d_input.shape == x.shape
        assert d_grid.shape == grid.shape
        for a in (out, d_input, d_grid):
            assert np.all(np.isfinite(a))
        assert np.all(_points_last(out)[dead] == 0)
        assert np.all(d_grid[dead] == 0)
        if mode == "nearest":
            assert np.all(d_grid == 0)
        bound = (KEYS_BOUND if mode == "bicubic" else 1.0) ** grid.shape[-1]
        assert np.all(np.abs(out) <= bound * np.max(np.abs(x), initial=0.0) * (1 + 1e-12))
        # Folded points go to positions no oracle pins down: their cotangent is 0 from here on,
        # the dead points keep theirs (they must send nothing to d_input).
        dout_ours = np.where(folded[:, None], 0.0, dout)
        dout_oracle = np.where((dead | folded)[:, None], 0.0, dout)
        _, d_input, _ = _grid_ours(x, grid, dout_ours, data_format, options)
        compared = ~dead & ~folded
        out_rows = compared & ~kinks if mode == "nearest" else compared
        bound = np.max(_grid_term_bound(x, safe, dout_oracle, mode, padding, align)[
            compared & ~kinks], initial=0)
        for name, (e_out, e_input, e_grid), tolerance in _grid_oracles(x, safe, dout_oracle,
                                                                        mode, padding, align):
            check_close(f"out vs {name}", _points_last(out)[out_rows],
                        _points_last(e_out)[out_rows], rtol_=tolerance, scale=_peak(x))
            check_close(f"d_input vs {name}", d_input, e_input, rtol_=tolerance,
                        scale=_peak(dout_oracle))
            check_close(f"d_grid vs {name}", d_grid[compared & ~kinks],
                        e_grid[compared & ~kinks], rtol_=tolerance, scale=bound)

    check()


# --- lerp ---------------------------------------------------------------------------------------


def _lerp_formula(a, b, w):
    """torch.lerp's two-sided formula (jnp: differentiable, float64 under x64)."""
    return jnp.where(jnp.abs(w) < 0.5, a + w * (b - a), b - (b - a) * (1 - w))


def _unbroadcast(t, shape):
    """t summed over the axes along which an operand of `shape` was broadcast."""
    t = t.sum(axis=tuple(range(t.ndim - len(shape))))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and t.shape[i] != 1)
    return t.sum(axis=axes, keepdims=True).reshape(shape)


@functools.partial(jax.jit, static_argnames=("weight",))
def _lerp_passes(ja, jb, jw, g, a64, b64, w64, g64, weight):
    """jk.lerp's forward and gradients (a Python weight is static, as in jk.lerp) next to the
    formula's in float64, in one compilation."""
    if jw is None:
        out, vjp = jax.vjp(lambda a, b: jk.lerp(a, b, weight), ja, jb)
        want, want_vjp = jax.vjp(lambda a, b: _lerp_formula(a, b, w64), a64, b64)
    else:
        out, vjp = jax.vjp(jk.lerp, ja, jb, jw)
        want, want_vjp = jax.vjp(_lerp_formula, a64, b64, w64)
    return out, vjp(g), want, want_vjp(g64)


@st.composite if not HYPOTHESIS_UNAVAILABLE else (lambda f: f)
def lerp_problems(draw):
    shapes, _ = draw(hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=5,
                                                       min_side=1, max_side=3))
    rank = max(len(shape) for shape in shapes)
    if rank and draw(st.sampled_from([False] * 4 + [True])):  # now and then an empty result
        axis = -draw(st.integers(1, rank))  # counted from the right, as broadcasting aligns
        having = [i for i, shape in enumerate(shapes) if len(shape) >= -axis]
        wide = [i for i in having if shapes[i][axis] != 1] or having[:1]
        shapes = [tuple(0 if i in wide and j == len(shape) + axis else d
                        for j, d in enumerate(shape)) for i, shape in enumerate(shapes)]
    a_shape, b_shape, w_shape = shapes
    dtype = draw(st.sampled_from(DTYPES))
    # On the CPU subnormal operands, products and results are flushed to zero, as by XLA's own
    # CPU arithmetic (docs/lerp.md, "exact ends"), where torch keeps them:
    #   jk.lerp(np.float64(2.2250738585072e-309), np.float64(0.0), 0.0)  # 0.0; torch: the start
    # Values below 1e-30 in magnitude are drawn as 0 here, which keeps every operand, product and
    # result of these examples a normal number (or 0) in every compute type.
    no_tiny = lambda v: 0.0 if abs(v) < 1e-30 else v
    values = st.floats(-4, 4).map(no_tiny)
    a = draw(hnp.arrays(np.float64, a_shape, elements=values))
    b = draw(hnp.arrays(np.float64, b_shape, elements=values))
    weight = draw(st.one_of(
        st.floats(-1, 2).map(no_tiny), st.sampled_from([0.0, 1.0, 0.5, -0.5]),
        hnp.arrays(np.float64, w_shape, elements=st.one_of(st.floats(-1, 2).map(no_tiny),
                                                             st.sampled_from([0.0, 1.0, 0.5])))))
    seed = draw(st.integers(0, 2**32 - 1))
    return a, b, weight, dtype, seed


@needs_hypothesis
def test_lerp_matches_torch_and_formula():
    """Broadcast shapes up to rank 5 (size-0 and size-1 axes included), a Python-float or an
    array weight in [-1, 2], every dtype: the forward equals torch.lerp and the two-sided formula
    in float64 on the same rounded inputs (exactly the start where w == 0 and the end where
    w == 1); the gradients of input, end and an array weight equal jax.vjp of the formula in
    float64, each summed over its broadcast axes."""

    @budget(40)
    @given(lerp_problems())
    def check(problem):
        a, b, weight, dtype, seed = problem
        scalar = isinstance(weight, float)
        ja, jb = in_dtype(a, dtype), in_dtype(b, dtype)
        jw = weight if scalar else in_dtype(weight, dtype)
        a64, b64 = f64(ja), f64(jb)
        # A Python weight is cast to the compute type (float32 for the half types).
        compute = jnp.float64 if dtype == jnp.float64 else jnp.float32
        w64 = np.float64(np.asarray(weight, compute)) if scalar else f64(jw)
        shape = np.broadcast_shapes(a.shape, b.shape, () if scalar else np.shape(weight))

        g = in_dtype(seeded(seed, shape), dtype)
        g64 = f64(g)

        out, grads, expected, want = _lerp_passes(ja, jb, None if scalar else jw, g, a64, b64,
                                                  w64, g64, weight if scalar else None)
        assert out.shape == shape and out.dtype == dtype
        ab, bb, wb = np.broadcast_arrays(a64, b64, w64)
        scale = np.max(np.abs(ab) + np.abs(bb), initial=0.0)
        check_close("out vs formula", out, expected, dtype, scale=scale)
        if torch is not None:
            tw = float(w64) if scalar else torch.tensor(w64)
            want_torch = torch.lerp(torch.tensor(a64), torch.tensor(b64), tw).numpy()
            check_close("out vs torch", out, want_torch, dtype, scale=scale)
        got = np.asarray(out)
        ends = np.broadcast_to(np.asarray(ja), shape), np.broadcast_to(np.asarray(jb), shape)
        for w_end, end in zip((0.0, 1.0), ends):
            at = wb == w_end
            # == (not the bytes): -0.0 + 0.0 is +0.0, in torch's formula too
            assert np.array_equal(got[at], end[at]), f"lerp at w == {w_end} is not exact"

        g64 = np.asarray(g64)
        terms = (g64 * (1 - wb), g64 * wb) + (() if scalar else (g64 * (bb - ab),))
        for name, got_grad, want_grad, term, operand in zip(
                ("d_input", "d_end", "d_weight"), grads, want, terms, (a, b, weight)):
            assert got_grad.shape == np.shape(operand) and got_grad.dtype == dtype
            scale = np.max(_unbroadcast(np.abs(term), np.shape(operand)), initial=0.0)
            check_close(name, got_grad, want_grad, dtype, scale=scale)

    check()


# --- repeat -------------------------------------------------------------------------------------

REPEAT_DTYPES = (np.bool_, np.int8, np.uint8, np.int32, np.uint16, np.int64, jnp.float16,
                 jnp.bfloat16, jnp.float32, jnp.float64, np.complex64, np.complex128)
FLOATS = tuple(np.dtype(d) for d in DTYPES)


@st.composite if not HYPOTHESIS_UNAVAILABLE else (lambda f: f)
def repeat_problems(draw, dtypes=REPEAT_DTYPES):
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
    repeats = tuple(draw(st.lists(st.integers(0, 3), min_size=len(shape),
                                  max_size=len(shape) + 2)))
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    as_int = len(repeats) == 1 and draw(st.booleans())  # repeat(x, 3) for a 0-D or 1-D x
    return shape, repeats[0] if as_int else repeats, dtype, draw(st.integers(0, 2**32 - 1))


def _random_bits(seed, shape, dtype):
    """Any bit patterns of the dtype (NaN payloads, infinities, subnormals: a byte copy keeps
    them), 0 / 1 for bool."""
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    count = int(np.prod(shape)) * dtype.itemsize
    return np.frombuffer(rng.bytes(count), dtype=dtype).reshape(shape).copy()


_repeat = jax.jit(jk.repeat, static_argnums=1)


@functools.partial(jax.jit, static_argnames=("repeats",))
def _repeat_passes(x, g, repeats):
    """jk.repeat's forward and gradient, and jnp.tile's gradient."""
    y, vjp = jax.vjp(lambda v: jk.repeat(v, repeats), x)
    reps = (repeats,) if isinstance(repeats, int) else repeats
    (tile,) = jax.vjp(lambda v: jnp.tile(v, reps), x)[1](g)
    return y, vjp(g)[0], tile


@needs_hypothesis
def test_repeat_matches_np_tile():
    """Ranks 0..4 with extents 0..4, repeats of length >= ndim (or one int) from 0..3, every
    whole-byte dtype (bool, integers, half types, complex): the result is np.tile's, bitwise,
    whatever the bits (NaN payloads included)."""

    @budget(40)
    @given(repeat_problems())
    def check(problem):
        shape, repeats, dtype, seed = problem
        x = _random_bits(seed, shape, dtype)
        assert_bitwise(_repeat(x, repeats), np.tile(x, repeats))

    check()


@needs_hypothesis
def test_repeat_gradient_sums_the_copies():
    """The same shapes, the floating dtypes: the gradient is the sum of each element's copies,
    as jnp.tile's gradient in float64 (to 1e-12) and, in every dtype, as the float64 sum of the
    copies rounded to the dtype (half types accumulate in float32, then round once)."""

    @budget(25)
    @given(repeat_problems(dtypes=DTYPES))
    def check(problem):
        shape, repeats, dtype, seed = problem
        x = in_dtype(seeded(seed, shape), dtype)
        reps = (repeats,) if isinstance(repeats, int) else repeats
        padded = (1,) * (len(reps) - len(shape)) + shape
        out_shape = tuple(r * s for r, s in zip(reps, padded))
        g = in_dtype(seeded(seed + 1, out_shape), dtype)
        y, dx, tile = _repeat_passes(x, g, repeats)
        assert y.shape == out_shape and dx.shape == shape and dx.dtype == dtype
        # copy k of element j sits at k * size + j along each axis
        copies = f64(g).reshape(tuple(itertools.chain(*zip(reps, padded))))
        copy_axes = tuple(range(0, 2 * len(reps), 2))
        expected = copies.sum(axis=copy_axes).reshape(shape)
        scale = np.max(np.abs(copies).sum(axis=copy_axes), initial=0.0)
        if dtype == np.float64:
            check_close("dx vs jnp.tile", dx, tile, dtype, scale=scale)
        check_close("dx vs the sum of copies", dx, rounded(expected, dtype), dtype, scale=scale)

    check()


# --- conv2d -------------------------------------------------------------------------------------


def _conv_oracle(x, w, b, dy, stride, padding, dilation, groups):
    """conv2d's (output, d_input, d_weight, d_bias) in float64, NCHW / OIHW: torch where it
    is importable, else the jnp reference of test_hardening.py (gathers of the live taps)."""
    if torch is not None:
        tensors = [None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=True)
                   for a in (x, w, b)]
        ty = torch.nn.functional.conv2d(*tensors, stride=stride, padding=padding,
                                        dilation=dilation, groups=groups)
        ty.backward(torch.tensor(dy, dtype=torch.float64))
        grads = tuple(None if t is None else t.grad.numpy() for t in tensors)
        return (ty.detach().numpy(),) + grads
    from test_hardening import conv_reference

    def f(x, w, b):
        y = conv_reference(x, w, stride, padding, dilation, groups)
        return y if b is None else y + b[:, None, None]
    y, vjp = jax.vjp(f, x, w, b)
    return tuple(None if a is None else np.asarray(a) for a in (y,) + vjp(dy))


@functools.partial(jax.jit, static_argnames=("options", "data_format"))
def _conv_passes(dy, operands, options, data_format):
    f = lambda *o: jk.conv2d(*o, **dict(options), precision="highest", data_format=data_format)
    y, vjp = jax.vjp(f, *operands)
    return (y,) + vjp(dy)


@st.composite if not HYPOTHESIS_UNAVAILABLE else (lambda f: f)
def conv_problems(draw):
    kind = draw(st.sampled_from(["dense", "grouped", "depthwise"]))
    if kind == "dense":
        groups, c, k = 1, draw(st.integers(1, 3)), draw(st.integers(1, 3))
    elif kind == "grouped":
        groups = 2
        c, k = 2 * draw(st.integers(1, 2)), 2 * draw(st.integers(1, 2))
    else:  # depthwise, with a channel multiplier of 1 or 2
        c = draw(st.integers(1, 4))
        groups, k = c, c * draw(st.integers(1, 2))
    r, s = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    # the dilated kernel must fit the padded input (else a ValueError, tested elsewhere)
    h = max(1, dilation[0] * (r - 1) + 1 - 2 * padding[0]) + draw(st.integers(0, 4))
    w = max(1, dilation[1] * (s - 1) + 1 - 2 * padding[1]) + draw(st.integers(0, 4))
    batched = draw(st.booleans())
    n = draw(st.integers(0, 2)) if batched else 1
    options = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return ((n, c, h, w), (k, c // groups, r, s), draw(st.booleans()), batched, options,
            draw(st.sampled_from(DTYPES)), draw(st.sampled_from(["NCHW", "NHWC"])),
            draw(st.integers(0, 2**32 - 1)))


@needs_hypothesis
def test_conv2d_dtypes_and_layouts():
    """Small random geometries (dense, 2 groups, depthwise with multiplier 1 or 2; stride and
    dilation 1..3, padding 0..3; a bias or not; N = 0 and unbatched inputs), every dtype, both
    layouts: the forward and the input, weight and bias gradients equal torch's float64 results
    on the same rounded inputs (without torch, the jnp reference) to the dtype's tolerance."""

    @budget(30)
    @given(conv_problems())
    def check(problem):
        x_shape, w_shape, with_bias, batched, options, dtype, data_format, seed = problem
        x = rounded(seeded(seed, x_shape), dtype)
        w = rounded(seeded(seed + 1, w_shape), dtype)
        b = rounded(seeded(seed + 2, w_shape[:1]), dtype) if with_bias else None
        y_shape = jax.eval_shape(lambda: jk.conv2d(jnp.zeros(x_shape), jnp.zeros(w_shape),
                                                   **options)).shape
        dy = rounded(seeded(seed + 3, y_shape), dtype)
        expected = _conv_oracle(x, w, b, dy, **options)
        # each pass is a sum: its rounding error is bounded relative to the sum of |terms|
        bounds = _conv_oracle(np.abs(x), np.abs(w), None if b is None else np.abs(b),
                              np.abs(dy), **options)

        last = data_format == "NHWC"
        image = (lambda a: np.moveaxis(a, 1, -1)) if last else (lambda a: a)
        image_back = (lambda a: np.moveaxis(np.asarray(a), -1, 1)) if last else np.asarray
        kernel = (lambda a: a.transpose(2, 3, 1, 0)) if last else (lambda a: a)   # OIHW -> HWIO
        kernel_back = (lambda a: np.asarray(a).transpose(3, 2, 0, 1)) if last else np.asarray
        unbatch = (lambda a: a) if batched else (lambda a: a[0])
        rebatch = np.asarray if batched else (lambda a: np.asarray(a)[None])

        cast = lambda a: in_dtype(a, dtype)
        operands = [cast(unbatch(image(x))), cast(kernel(w))] + ([cast(b)] if with_bias else [])

        got = _conv_passes(cast(unbatch(image(dy))), tuple(operands),
                           tuple(sorted(options.items())), data_format)
        for a in got:
            assert a.dtype == dtype
        got = [image_back(rebatch(got[0])), image_back(rebatch(got[1])), kernel_back(got[2])] \
            + ([np.asarray(got[3])] if with_bias else [])
        for name, a, e, bound in zip(("output", "d_input", "d_weight", "d_bias"), got,
                                     expected, bounds):
            assert a.shape == e.shape, (name, a.shape, e.shape)
            check_close(name, a, e, dtype, scale=np.max(bound, initial=0.0))

    check()


# --- roi_align ----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("options",))
def _roi_passes(x, b, dout, options):
    """(out, d_input, d_boxes) of the NHWC op, and of the NCHW op between transposes."""
    def channels_last(x, b):
        return jk.roi_align(x, b, **dict(options), data_format="NHWC")

    def through_nchw(x, b):
        return jnp.transpose(jk.roi_align(jnp.transpose(x, (0, 3, 1, 2)), b, **dict(options)),
                             (0, 2, 3, 1))
    results = []
    for f in (channels_last, through_nchw):
        out, vjp = jax.vjp(f, x, b)
        results.append((out,) + vjp(dout))
    return results


@st.composite if not HYPOTHESIS_UNAVAILABLE else (lambda f: f)
def roi_problems(draw):
    """test_roi_align.py's problems with every dtype, and wilder boxes: degenerate, reversed,
    outside the image, bad or fractional batch indices, NaN, infinite and huge coordinates."""
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    h, w = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    empty = draw(st.sampled_from(["none"] * 5 + ["N", "C", "K"]))  # now and then
    n, c = (0 if empty == "N" else n), (0 if empty == "C" else c)
    size = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    scale = draw(st.sampled_from([1.0, 0.5, 2.0]))
    sampling_ratio = draw(st.sampled_from([-1, 0, 1, 2, 3]))
    aligned = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))

    def coordinate(extent):
        lo, hi = -0.5 * extent / scale, 1.5 * extent / scale
        return draw(st.one_of(st.integers(int(lo), int(hi)).map(float),
                              st.integers(2 * int(lo), 2 * int(hi)).map(lambda v: v / 2),
                              st.floats(lo, hi),
                              st.sampled_from([np.nan, np.inf, -np.inf, 1e30, -1e6])))

    rows = []
    for _ in range(0 if empty == "K" else draw(st.integers(1, 8))):
        batch = draw(st.one_of(st.integers(0, max(n - 1, 0)).map(float),
                               st.sampled_from([-1.0, float(n), 0.7, -0.5, n - 0.5, np.nan])))
        x1, y1 = coordinate(w), coordinate(h)
        if draw(st.booleans()):  # degenerate: a point, a line, or reversed corners
            x2, y2 = draw(st.sampled_from([(x1, y1), (x1, coordinate(h)), (x1 - 1.5, y1 - 0.25)]))
        else:
            x2, y2 = coordinate(w), coordinate(h)
        rows.append([batch, x1, y1, x2, y2])
    boxes = np.asarray(rows, dtype=np.float64).reshape(-1, 5)
    seed = draw(st.integers(0, 2**32 - 1))
    return (n, h, w, c), boxes, size, scale, sampling_ratio, aligned, dtype, seed


@needs_hypothesis
def test_roi_align_channels_last_equals_nchw():
    """docs/roi_align.md, "Channels last": the NHWC result equals the NCHW result transposed,
    bitwise (the same terms in the same order), for the forward, the input gradient and the box
    gradient, in every dtype, on random boxes including degenerate, reversed, out-of-image and
    non-finite ones and bad batch indices."""

    @budget(30)
    @given(roi_problems())
    def check(problem):
        shape, boxes, size, scale, sampling_ratio, aligned, dtype, seed = problem
        x = in_dtype(seeded(seed, shape), dtype)
        b = in_dtype(boxes, dtype)
        options = dict(output_size=size, spatial_scale=scale, sampling_ratio=sampling_ratio,
                       aligned=aligned)
        out_shape = (boxes.shape[0],) + size + (shape[3],)
        dout = in_dtype(seeded(seed + 1, out_shape), dtype)
        ours, expected = _roi_passes(x, b, dout, tuple(options.items()))
        assert ours[0].shape == out_shape
        assert ours[1].shape == x.shape and ours[2].shape == b.shape
        for name, a, e in zip(("output", "d_input", "d_boxes"), ours, expected):
            assert np.asarray(a).tobytes() == np.asarray(e).tobytes(), name

    check()
