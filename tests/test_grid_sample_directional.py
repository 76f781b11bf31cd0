"""Tests of grid_sample's directional FFI passes, called as raw targets:

  jk_grid_sample_fwd_directional        input, grid, u[, v] -> out
  jk_grid_sample_bwd_input_directional  dout, grid, u[, v] -> d_input (+ scratch)
  jk_grid_sample_bwd_grid_directional   dout, input, grid, u -> d_grid

The oracles are the existing targets (themselves checked against torch and a NumPy reference in
test_grid_sample.py): float64 finite differences of jk_grid_sample_fwd / _bwd_input / _bwd_grid
along grid directions, the transposition of forward and d_input, and the symmetry of the
Hessian (<bwd_grid, u> == <dout, fwd_dir(u)>, <bwd_grid_dir(u), v> == <dout, fwd_dir(u, v)>).
Points lie away from interpolation kinks (smooth_grid). Also: every dtype against float64,
batch maps (operands reused across the output batch, directions with their own maps), empty
shapes, non-finite coordinates, nearest (all zeros), validation errors and bitwise repetition.
Runs on whatever devices jax has (the GPU suite runs it with JAX_PLATFORMS=cuda).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kernels import _ffi
from jk_testing import assert_close, to_numpy64
from test_grid_sample import PADDINGS, RANK_MODES, random_array, smooth_grid

DEVICES = jax.devices()[:1]  # one device of the default platform (conftest makes 8 CPU devices)
MODE_CODES = _ffi.ENUMS["GridSampleMode"]
PADDING_CODES = _ffi.ENUMS["GridSamplePadding"]
# Relative to the expected array's magnitude (docs/design.md, "Testing").
DTYPE_RTOL = {np.dtype(jnp.float32): 1e-5, np.dtype(jnp.float16): 1e-2,
              np.dtype(jnp.bfloat16): 1e-2}
FD_RTOL = 1e-9  # five-point differences in float64 with step 1e-4: exact but for rounding
EXACT_RTOL = 1e-12


def device_ids(device):
    return f"{device.platform}{device.id}"


# --- raw target calls --------------------------------------------------------------------------


class Sampler:
    """Calls the grid_sample targets with fixed options on one device. `maps` gives (repeat,
    chunk) per operand in operand order (identity maps when None)."""

    def __init__(self, device, mode, padding, align):
        self.device, self.mode, self.padding, self.align = device, mode, padding, align

    def put(self, *arrays, dtype=jnp.float64):
        return [jax.device_put(jnp.asarray(a).astype(dtype), self.device) for a in arrays]

    def _attributes(self, operands, maps):
        if maps is None:
            maps = [(1, max(x.shape[0], 1)) for x in operands]
        assert len(maps) == len(operands)
        batch = operands[0].shape[0] // maps[0][1] * maps[0][0] * maps[0][1]
        return batch, dict(mode=np.int64(MODE_CODES[self.mode]),
                           padding=np.int64(PADDING_CODES[self.padding]),
                           align_corners=bool(self.align),
                           batch_maps=np.asarray([v for m in maps for v in m], np.int64),
                           deterministic=True)

    def forward(self, input, grid, *directions, maps=None):
        operands = (input, grid) + directions
        batch, attributes = self._attributes(operands, maps)
        target = "jk_grid_sample_fwd_directional" if directions else "jk_grid_sample_fwd"
        out = jax.ShapeDtypeStruct((batch, input.shape[1]) + grid.shape[1:-1], input.dtype)
        return _ffi.call(target, out, *operands, **attributes)

    def backward_input(self, dout, grid, *directions, cells_shape, maps=None):
        """d_input [M, *cells_shape] (cells_shape = (C, *spatial))."""
        operands = (dout, grid) + directions
        batch, attributes = self._attributes(operands, maps)
        target = ("jk_grid_sample_bwd_input_directional" if directions
                  else "jk_grid_sample_bwd_input")
        d_input = jax.ShapeDtypeStruct((batch,) + tuple(cells_shape), dout.dtype)

        def scratch_bytes():
            return _ffi.query("grid_sample_bwd_input_scratch", batch=batch,
                              points=int(np.prod(grid.shape[1:-1])),
                              cells=int(np.prod(cells_shape[1:])),
                              extended_cells=int(np.prod([s + 1 for s in cells_shape[1:]])),
                              dims=grid.shape[-1], mode=MODE_CODES[self.mode],
                              element_bytes=np.dtype(dout.dtype).itemsize, deterministic=1,
                              directional=int(bool(directions)))

        return _ffi.call_with_cuda_scratch(target, d_input, *operands,
                                           scratch_bytes=scratch_bytes, cpu_scratch=True,
                                           **attributes)

    def backward_grid(self, dout, input, grid, *directions, maps=None):
        operands = (dout, input, grid) + directions
        batch, attributes = self._attributes(operands, maps)
        target = "jk_grid_sample_bwd_grid_directional" if directions else "jk_grid_sample_bwd_grid"
        d_grid = jax.ShapeDtypeStruct((batch,) + grid.shape[1:], grid.dtype)
        return _ffi.call(target, d_grid, *operands, **attributes)


def derivative(f, grid, direction, step=1e-4):
    """d/de f(grid + e * direction) at e = 0: five-point central difference, float64."""
    at = lambda e: to_numpy64(f(grid + e * direction))
    return (8 * (at(step) - at(-step)) - (at(2 * step) - at(-2 * step))) / (12 * step)


def inner(a, b):
    return float(np.sum(to_numpy64(a) * to_numpy64(b)))


def assert_inner_equal(got, want, terms):
    """Two inner products agree to float64 rounding, relative to the sum of |terms|."""
    assert abs(got - want) <= EXACT_RTOL * max(terms, 1e-30), (got, want)


def problem(rank, align, seed=0, channels=3):
    """(input, grid, dout, u, v) in float64 NumPy: odd sizes, more points than a CPU tile."""
    if rank == 4:
        in_shape, points = (2, channels, 6, 7), (9, 11)
    else:
        in_shape, points = (2, channels, 4, 5, 6), (3, 5, 7)
    dims = rank - 2
    x = random_array(seed + 1, in_shape)
    grid = smooth_grid(seed + 2, 2, points, in_shape[2:], align)
    dout = random_array(seed + 3, in_shape[:2] + points)
    u = random_array(seed + 4, (2,) + points + (dims,))
    v = random_array(seed + 5, (2,) + points + (dims,))
    return x, grid, dout, u, v


# --- the identities, float64, every mode x padding x align_corners x rank -----------------------


@pytest.mark.parametrize("device", DEVICES, ids=device_ids)
@pytest.mark.parametrize("align", (False, True), ids=("edges", "align"))
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("rank,mode", [rm for rm in RANK_MODES if rm[1] != "nearest"])
def test_identities_float64(rank, mode, padding, align, device):
    s = Sampler(device, mode, padding, align)
    x, grid, dout, u, v = s.put(*problem(rank, align))
    cells = x.shape[1:]

    # Forward: first and second directional derivatives of the sampled values.
    fwd_u = s.forward(x, grid, u)
    assert fwd_u.shape == dout.shape and fwd_u.dtype == x.dtype
    assert_close(fwd_u, derivative(lambda g: s.forward(x, g), grid, u), rtol_=FD_RTOL)
    fwd_uv = s.forward(x, grid, u, v)
    assert_close(fwd_uv, derivative(lambda g: s.forward(x, g, u), grid, v), rtol_=FD_RTOL)
    # d_input: the directional derivative of the d_input pass, and the forward's transpose.
    bwd_u = s.backward_input(dout, grid, u, cells_shape=cells)
    assert bwd_u.shape == x.shape and bwd_u.dtype == x.dtype
    assert_close(bwd_u, derivative(lambda g: s.backward_input(dout, g, cells_shape=cells),
                                   grid, u), rtol_=FD_RTOL)
    bwd_uv = s.backward_input(dout, grid, u, v, cells_shape=cells)
    assert_close(bwd_uv, derivative(lambda g: s.backward_input(dout, g, u, cells_shape=cells),
                                    grid, v), rtol_=FD_RTOL)
    for forward, backward in ((fwd_u, bwd_u), (fwd_uv, bwd_uv)):
        terms = float(np.sum(np.abs(to_numpy64(dout) * to_numpy64(forward))))
        assert_inner_equal(inner(dout, forward), inner(x, backward), terms)
    # d_grid: the directional derivative of the d_grid pass, and the Hessian's symmetry.
    grid_u = s.backward_grid(dout, x, grid, u)
    assert grid_u.shape == grid.shape and grid_u.dtype == grid.dtype
    assert_close(grid_u, derivative(lambda g: s.backward_grid(dout, x, g), grid, u),
                 rtol_=FD_RTOL)
    d_grid = s.backward_grid(dout, x, grid)
    terms = float(np.sum(np.abs(to_numpy64(dout) * to_numpy64(fwd_u))))
    assert_inner_equal(inner(d_grid, u), inner(dout, fwd_u), terms)
    terms = float(np.sum(np.abs(to_numpy64(dout) * to_numpy64(fwd_uv))))
    assert_inner_equal(inner(grid_u, v), inner(dout, fwd_uv), terms)


@pytest.mark.parametrize("device", DEVICES, ids=device_ids)
@pytest.mark.parametrize("rank", (4, 5))
def test_nearest_is_zero(rank, device):
    s = Sampler(device, "nearest", "border", False)
    x, grid, dout, u, v = s.put(*problem(rank, False))
    for out in (s.forward(x, grid, u), s.forward(x, grid, u, v),
                s.backward_input(dout, grid, u, cells_shape=x.shape[1:]),
                s.backward_input(dout, grid, u, v, cells_shape=x.shape[1:]),
                s.backward_grid(dout, x, grid, u)):
        assert np.all(to_numpy64(out) == 0)
    # And so are the finite differences of the base passes.
    assert np.all(derivative(lambda g: s.forward(x, g), grid, u) == 0)


# --- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES, ids=device_ids)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.float16, jnp.bfloat16),
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rank,mode,padding,align", [
    (4, "bilinear", "zeros", False), (4, "bicubic", "reflection", True),
    (4, "bicubic", "border", False), (5, "bilinear", "reflection", True),
    (5, "bilinear", "border", False)], ids=str)
def test_dtypes_against_float64(rank, mode, padding, align, dtype, device):
    s = Sampler(device, mode, padding, align)
    arrays = problem(rank, align, seed=10, channels=5)
    # float64 on the inputs as rounded to the dtype, so that only the arithmetic differs.
    x, grid, dout, u, v = s.put(*(to_numpy64(jnp.asarray(a).astype(dtype)) for a in arrays))
    xd, gridd, doutd, ud, vd = s.put(*arrays, dtype=dtype)
    cells = x.shape[1:]
    pairs = [
        (s.forward(xd, gridd, ud), s.forward(x, grid, u)),
        (s.forward(xd, gridd, ud, vd), s.forward(x, grid, u, v)),
        (s.backward_input(doutd, gridd, ud, cells_shape=cells),
         s.backward_input(dout, grid, u, cells_shape=cells)),
        (s.backward_input(doutd, gridd, ud, vd, cells_shape=cells),
         s.backward_input(dout, grid, u, v, cells_shape=cells)),
        (s.backward_grid(doutd, xd, gridd, ud), s.backward_grid(dout, x, grid, u)),
    ]
    for got, want in pairs:
        assert got.dtype == jnp.dtype(dtype) and got.shape == want.shape
        assert_close(got, to_numpy64(want), rtol_=DTYPE_RTOL[np.dtype(dtype)])


# --- batch maps --------------------------------------------------------------------------------


def spelled_out(array, map_, batch):
    """The operand's rows for every output batch row m, as the kernels' BatchMap reads them."""
    repeat, chunk = map_
    m = np.arange(batch)
    rows = m if repeat == 1 else (m // (repeat * chunk)) * chunk + m % chunk
    return np.asarray(array)[rows]


@pytest.mark.parametrize("device", DEVICES, ids=device_ids)
@pytest.mark.parametrize("rank,mode", [(4, "bicubic"), (5, "bilinear")])
def test_batch_maps(rank, mode, device):
    """Operands reused across the output batch (input repeated twice, a direction per pair of
    rows, a direction shared by all) give what the same operands spelled out row by row give."""
    s = Sampler(device, mode, "reflection", False)
    x, grid, dout, u, v = problem(rank, False, seed=20)
    batch = 4
    # input rows 2, repeat 2 chunk 2: m -> m % 2; grid and dout have all 4 rows;
    # u rows 2, repeat 2 chunk 1: m -> m // 2; v one row, repeat 4 chunk 1.
    grid = smooth_grid(21, batch, grid.shape[1:-1], x.shape[2:], False)
    dout = random_array(22, (batch,) + dout.shape[1:])
    v = v[:1]
    x_map, u_map, v_map, full = (2, 2), (2, 1), (4, 1), (1, batch)
    spelled = [spelled_out(a, m, batch) for a, m in ((x, x_map), (u, u_map), (v, v_map))]
    x, grid, dout, u, v = s.put(x, grid, dout, u, v)
    x_all, u_all, v_all = s.put(*spelled)
    cells = x.shape[1:]
    same = np.testing.assert_array_equal
    same(s.forward(x, grid, u, maps=[x_map, full, u_map]), s.forward(x_all, grid, u_all))
    same(s.forward(x, grid, u, v, maps=[x_map, full, u_map, v_map]),
         s.forward(x_all, grid, u_all, v_all))
    same(s.backward_input(dout, grid, u, v, cells_shape=cells, maps=[full, full, u_map, v_map]),
         s.backward_input(dout, grid, u_all, v_all, cells_shape=cells))
    same(s.backward_grid(dout, x, grid, u, maps=[full, x_map, full, u_map]),
         s.backward_grid(dout, x_all, grid, u_all))
    # A grid reused by an output batch larger than its own, the direction following it.
    grid2, u2 = grid[:2], u[:2]
    dout4 = dout
    got = s.backward_input(dout4, grid2, u2, cells_shape=cells, maps=[full, (2, 2), (2, 2)])
    want = s.backward_input(dout4, *s.put(spelled_out(grid2, (2, 2), batch),
                                          spelled_out(u2, (2, 2), batch)), cells_shape=cells)
    same(got, want)


# --- shapes and coordinates --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES, ids=device_ids)
@pytest.mark.parametrize("in_shape,points", [
    ((0, 3, 4, 5), (2, 3)), ((2, 0, 4, 5), (2, 3)), ((2, 3, 4, 5), (0, 3)),
    ((2, 3, 4, 5, 6), (1, 0, 3)), ((1, 1, 1, 1), (1, 1)),
], ids=str)
def test_empty_and_tiny_shapes(in_shape, points, device):
    dims = len(in_shape) - 2
    mode = "bicubic" if dims == 2 else "bilinear"
    s = Sampler(device, mode, "zeros", False)
    n, c = in_shape[:2]
    x, grid, dout, u, v = s.put(random_array(30, in_shape),
                                random_array(31, (n,) + points + (dims,)) * 0.9,
                                random_array(32, (n, c) + points),
                                random_array(33, (n,) + points + (dims,)),
                                random_array(34, (n,) + points + (dims,)))
    out = s.forward(x, grid, u, v)
    d_input = s.backward_input(dout, grid, u, v, cells_shape=in_shape[1:])
    d_grid = s.backward_grid(dout, x, grid, u)
    assert out.shape == dout.shape and d_input.shape == x.shape and d_grid.shape == grid.shape
    for got in (out, d_input, d_grid):
        assert np.all(np.isfinite(to_numpy64(got)))
    if 0 in points:
        assert np.all(to_numpy64(d_input) == 0)  # no point touches the input
    if c == 0:
        assert np.all(to_numpy64(d_grid) == 0)
    if out.size:
        terms = float(np.sum(np.abs(to_numpy64(dout) * to_numpy64(out))))
        assert_inner_equal(inner(dout, out), inner(x, d_input), terms)


@pytest.mark.parametrize("device", DEVICES, ids=device_ids)
@pytest.mark.parametrize("rank,mode", [rm for rm in RANK_MODES if rm[1] != "nearest"])
def test_non_finite_coordinates(rank, mode, device):
    """NaN points contribute nothing and give zeros; ±Inf and huge coordinates stay finite; no
    out-of-bounds access (the GPU suite runs this under compute-sanitizer)."""
    dims = rank - 2
    x, grid, dout, u, v = problem(rank, False, seed=40)
    specials = np.array([np.nan, np.inf, -np.inf, 1e10, -1e30])
    flat = grid.reshape(-1, dims)
    chosen = np.arange(0, flat.shape[0], 7)
    flat[chosen, np.arange(chosen.size) % dims] = np.resize(specials, chosen.size)
    grid = flat.reshape(grid.shape)
    nan_points = np.isnan(grid).any(axis=-1)  # [N, *points]
    for padding, align in itertools.product(PADDINGS, (False, True)):
        s = Sampler(device, mode, padding, align)
        xs, gs, ds, us, vs = s.put(x, grid, dout, u, v)
        out = to_numpy64(s.forward(xs, gs, us, vs))
        d_input = to_numpy64(s.backward_input(ds, gs, us, vs, cells_shape=x.shape[1:]))
        d_grid = to_numpy64(s.backward_grid(ds, xs, gs, us))
        for got in (out, d_input, d_grid):
            assert np.all(np.isfinite(got))
        assert np.all(np.moveaxis(out, 1, -1)[nan_points] == 0)
        assert np.all(d_grid[nan_points] == 0)
        # d_input ignores the NaN points' dout.
        quiet = np.where(np.expand_dims(nan_points, 1), 0.0, dout)
        assert_close(d_input, to_numpy64(s.backward_input(*s.put(quiet), gs, us, vs,
                                                          cells_shape=x.shape[1:])),
                     rtol_=EXACT_RTOL)


# --- determinism and errors --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES, ids=device_ids)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: np.dtype(d).name)
def test_backward_input_bitwise_repeatable(dtype, device):
    """The directional d_input pass is always deterministic (the `deterministic` attribute is
    ignored): a degenerate grid piles every point on the same cells."""
    rng = np.random.default_rng(50)
    s = Sampler(device, "bilinear", "zeros", False)
    grid = np.concatenate([rng.uniform(-1, 1, (2, 40, 48, 2)), np.full((2, 40, 48, 2), 0.01)])
    u = rng.standard_normal(grid.shape)
    dout = rng.standard_normal((4, 8, 40, 48))
    dout, grid, u = s.put(dout, grid, u, dtype=dtype)
    first = np.asarray(s.backward_input(dout, grid, u, cells_shape=(8, 20, 24))).tobytes()
    for _ in range(3):
        again = np.asarray(s.backward_input(dout, grid, u, cells_shape=(8, 20, 24))).tobytes()
        assert again == first


@pytest.mark.parametrize("device", DEVICES, ids=device_ids)
def test_validation_errors(device):
    s = Sampler(device, "bilinear", "zeros", False)
    x, grid, dout, u, v = s.put(*problem(4, False))
    cells = x.shape[1:]
    with pytest.raises(Exception, match="direction shape does not match the grid"):
        s.forward(x, grid, u[:, :-1]).block_until_ready()
    with pytest.raises(Exception, match="direction shape does not match the grid"):
        s.backward_grid(dout, x, grid, u[..., :1]).block_until_ready()
    with pytest.raises(Exception, match="at most 2 direction operands, got 3"):
        s.forward(x, grid, u, v, v).block_until_ready()
    with pytest.raises(Exception, match="at most 1 direction operands, got 2"):
        s.backward_grid(dout, x, grid, u, v).block_until_ready()
    def raw_forward(*operands, batch_maps):
        return _ffi.call("jk_grid_sample_fwd_directional",
                         jax.ShapeDtypeStruct(dout.shape, dout.dtype), *operands,
                         mode=np.int64(0), padding=np.int64(0), align_corners=False,
                         batch_maps=np.asarray(batch_maps, np.int64), deterministic=True)

    with pytest.raises(Exception, match="expected one or two direction operands"):
        raw_forward(x, grid, batch_maps=[1, 2, 1, 2]).block_until_ready()
    with pytest.raises(Exception, match="batch_maps must hold"):
        raw_forward(x, grid, u, batch_maps=[1, 2, 1, 2]).block_until_ready()
    with pytest.raises(Exception, match="batch_maps do not fit"):
        s.backward_input(dout, grid, u, cells_shape=cells,
                         maps=[(1, 2), (1, 2), (2, 1)]).block_until_ready()
    with pytest.raises(Exception, match="differ in element type"):
        s.forward(x, grid, u.astype(jnp.float32)).block_until_ready()
