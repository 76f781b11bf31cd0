"""Tests of jk.grid_sample(..., data_format="NHWC"): channels-last input and output, read and
written in place by the jk_grid_sample_nhwc_* kernels.

Oracles independent of the channels-last kernels: the NCHW form (itself tested against torch
and a NumPy reference in test_grid_sample.py) — the NHWC result must be its transpose, bitwise
where both layouts add the same terms in the same order (the forward, and the deterministic
input gradient; on the CPU every pass), else at a tight tolerance — and finite differences
(check_grads, float64, both modes, order 2). Also: vmap, bitwise repeatability of the
backward, the compiled program (no transpose of a batch-sized array), the data_format errors
and partitioning on 8 CPU devices. Runs unchanged with JAX_PLATFORMS=cuda,cpu (the kernels then
run on the GPU; the sharding test stays on the CPU devices).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_kernels as jk
from jk_testing import ON_GPU, assert_lowered, random

MODES = ("bilinear", "nearest", "bicubic")
PADDINGS = ("zeros", "border", "reflection")
RANK_MODES = [(4, m) for m in MODES] + [(5, m) for m in MODES if m != "bicubic"]
DTYPES = (jnp.float64, jnp.float32, jnp.float16, jnp.bfloat16)


def to_last(x):
    return jnp.moveaxis(x, 1, -1)


def to_first(x):
    return jnp.moveaxis(x, -1, 1)


def _problem(rank, dtype=jnp.float64, batch=2, channels=5, seed=0):
    """An NCHW input, a grid reaching past the borders, and an output cotangent."""
    spatial = (6, 7) if rank == 4 else (4, 5, 6)
    out_spatial = (4, 5) if rank == 4 else (3, 4, 2)
    x = random(seed, (batch, channels) + spatial, dtype)
    grid = random(seed + 1, (batch,) + out_spatial + (rank - 2,), dtype, -1.2, 1.2)
    ct = random(seed + 2, (batch, channels) + out_spatial, dtype)
    return x, grid, ct


def _value_and_grads(data_format, **options):
    """jit of (output, d_input, d_grid) for a cotangent, in one layout."""

    @jax.jit
    def run(x, grid, ct):
        y, vjp = jax.vjp(lambda x, g: jk.grid_sample(x, g, data_format=data_format, **options),
                         x, grid)
        return (y,) + vjp(ct)

    return run


def _assert_equal(actual, expected, bitwise, dtype=jnp.float64):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if bitwise:
        np.testing.assert_array_equal(actual, expected)
    else:
        tol = {np.dtype(jnp.float64): 1e-13, np.dtype(jnp.float32): 1e-6}.get(np.dtype(dtype), 1e-2)
        a, e = actual.astype(np.float64), expected.astype(np.float64)
        assert np.max(np.abs(a - e), initial=0) <= tol * max(np.max(np.abs(e), initial=0), 1e-30)


def _compare_layouts(rank, mode, padding, align, dtype, deterministic=True, channels=5):
    x, grid, ct = _problem(rank, dtype, channels=channels)
    options = dict(mode=mode, padding_mode=padding, align_corners=align,
                   deterministic=deterministic)
    y, dx, dg = _value_and_grads("NCHW", **options)(x, grid, ct)
    yl, dxl, dgl = _value_and_grads("NHWC", **options)(to_last(x), grid, to_last(ct))
    # The same terms in the same order in both layouts, except on the GPU: the channel slices
    # of the d_grid reduction differ by layout, and atomics have no order.
    _assert_equal(yl, to_last(y), bitwise=True)
    _assert_equal(dxl, to_last(dx), bitwise=deterministic or not ON_GPU, dtype=dtype)
    _assert_equal(dgl, dg, bitwise=not ON_GPU, dtype=dtype)


@pytest.mark.parametrize("rank,mode", RANK_MODES)
def test_matches_nchw_every_option(rank, mode):
    for padding in PADDINGS:
        for align in (False, True):
            _compare_layouts(rank, mode, padding, align, jnp.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rank,mode", RANK_MODES)
def test_matches_nchw_every_dtype(rank, mode, dtype):
    _compare_layouts(rank, mode, "reflection" if rank == 4 else "border", rank == 5, dtype)


@pytest.mark.parametrize("channels", [1, 3, 40])
def test_matches_nchw_channel_counts(channels):
    """Fewer channels than a warp's slices, a few, more than a warp (GPU lanes along C)."""
    for deterministic in (True, False):
        _compare_layouts(4, "bilinear", "zeros", False, jnp.float32, deterministic, channels)


def test_directional_passes_match_nchw():
    """Forward mode and second order (the *_directional targets) agree with NCHW's."""
    for rank, mode in [(4, "bicubic"), (5, "bilinear")]:
        x, grid, ct = _problem(rank)
        tx, tg = random(7, x.shape, jnp.float64), random(8, grid.shape, jnp.float64)

        def hvp(data_format, x, grid, tx, tg, ct):
            def loss(x, g):
                y = jk.grid_sample(x, g, mode=mode, padding_mode="border", data_format=data_format)
                return jnp.sum(y * ct) + 0.5 * jnp.sum(y ** 2)
            grads = lambda x, g: jax.grad(loss, argnums=(0, 1))(x, g)
            y_t = jax.jvp(lambda x, g: jk.grid_sample(x, g, mode=mode, padding_mode="border",
                                                      data_format=data_format),
                          (x, grid), (tx, tg))[1]
            return (y_t,) + jax.jvp(grads, (x, grid), (tx, tg))[1]

        first = jax.jit(hvp, static_argnums=0)("NCHW", x, grid, tx, tg, ct)
        last = jax.jit(hvp, static_argnums=0)("NHWC", to_last(x), grid, to_last(tx), tg,
                                              to_last(ct))
        _assert_equal(last[0], to_last(first[0]), bitwise=not ON_GPU)
        _assert_equal(last[1], to_last(first[1]), bitwise=not ON_GPU)
        _assert_equal(last[2], first[2], bitwise=not ON_GPU)


@pytest.mark.parametrize("rank,mode", [(4, "bilinear"), (4, "bicubic"), (5, "bilinear")])
def test_check_grads_second_order(rank, mode):
    """Finite differences in float64, forward and reverse mode, to second order; points away
    from the pixel boundaries (the weights' kinks)."""
    spatial = (5, 6) if rank == 4 else (4, 4, 5)
    x = random(10, (1,) + spatial + (3,), jnp.float64)
    cells = np.array(spatial[::-1], np.float64)  # x, y[, z] extents
    points = (1, 3, 2) if rank == 4 else (1, 2, 2, 2)
    frac = np.random.default_rng(11).uniform(0.3, 0.7, points + (rank - 2,))
    whole = np.random.default_rng(12).integers(1, 3, points + (rank - 2,))
    grid = jnp.asarray((2 * (whole + frac) + 1) / cells - 1)  # align_corners=False
    f = lambda x, g: jk.grid_sample(x, g, mode=mode, padding_mode="zeros", data_format="NHWC")
    check_grads(f, (x, grid), order=2, modes=("fwd", "rev"), eps=1e-5)


def test_vmap_over_input_and_grid():
    x, grid, ct = _problem(4)
    xs = jnp.stack([to_last(x), to_last(x) * 2 + 1, -to_last(x)], axis=2)  # [N, H, B, W, C]
    grids = jnp.stack([grid, grid * 0.5, grid[:, ::-1]], axis=0)  # [B, N, Ho, Wo, 2]
    f = lambda x, g: jk.grid_sample(x, g, mode="bicubic", data_format="NHWC")
    cases = [((2, None), (xs, grid), lambda b: (xs[:, :, b], grid)),
             ((None, 0), (to_last(x), grids), lambda b: (to_last(x), grids[b])),
             ((2, 0), (xs, grids), lambda b: (xs[:, :, b], grids[b]))]
    for in_axes, args, per_example in cases:
        actual = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
        expected = jnp.stack([f(*per_example(b)) for b in range(3)])
        np.testing.assert_allclose(actual, expected, rtol=1e-13, atol=1e-13)
        # and vmap of the gradients
        loss = lambda x, g: jnp.sum(f(x, g) ** 2)
        grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=in_axes))(*args)
        for b in range(3):
            dx, dg = jax.grad(loss, argnums=(0, 1))(*per_example(b))
            np.testing.assert_allclose(grads[0][b], dx, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(grads[1][b], dg, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
def test_deterministic_backward_is_bitwise_repeatable(dtype):
    x, grid, ct = _problem(4, dtype, batch=4, channels=16)
    grid = grid * 0.3  # many points per cell: the scatter has real collisions
    run = _value_and_grads("NHWC", padding_mode="border")
    first = [np.asarray(a) for a in run(to_last(x), grid, to_last(ct))]
    for seed in range(3):  # other work in between, then the same call again
        run(to_last(random(100 + seed, x.shape, dtype)), grid, to_last(ct))
        again = run(to_last(x), grid, to_last(ct))
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, np.asarray(b))


def test_empty_and_tiny_shapes():
    for shape, grid_shape in [((2, 3, 4, 0), (2, 5, 6, 2)), ((0, 3, 4, 2), (0, 5, 6, 2)),
                              ((2, 3, 4, 2), (2, 0, 6, 2)), ((1, 1, 1, 1), (1, 1, 1, 2))]:
        x, grid = random(0, shape), random(1, grid_shape)
        y = jk.grid_sample(x, grid, data_format="NHWC")
        expected = to_last(jk.grid_sample(to_first(x), grid))
        assert y.shape == grid_shape[:-1] + shape[-1:]
        np.testing.assert_array_equal(y, expected)
        dx, dg = jax.grad(lambda x, g: jnp.sum(jk.grid_sample(x, g, data_format="NHWC") ** 2),
                          argnums=(0, 1))(x, grid)
        assert dx.shape == x.shape and dg.shape == grid.shape


def test_five_d_aliases():
    x, grid, _ = _problem(5)
    np.testing.assert_array_equal(jk.grid_sample(x, grid, data_format="NCDHW"),
                                  jk.grid_sample(x, grid))
    np.testing.assert_array_equal(jk.grid_sample(to_last(x), grid, data_format="NDHWC"),
                                  jk.grid_sample(to_last(x), grid, data_format="NHWC"))


def test_data_format_errors():
    x, grid, _ = _problem(4)
    with pytest.raises(ValueError, match=r"grid_sample\(\): data_format 'NCDHW' is for a 5-D"):
        jk.grid_sample(x, grid, data_format="NCDHW")
    with pytest.raises(ValueError, match=r"grid_sample\(\): data_format 'NDHWC' is for a 5-D"):
        jk.grid_sample(to_last(x), grid, data_format="NDHWC")
    for bad in ("nhwc", "NWHC", "CHW", ""):
        with pytest.raises(ValueError, match=r"grid_sample\(\): data_format must be"):
            jk.grid_sample(x, grid, data_format=bad)
    for bad in (None, 1, ("NHWC",)):
        with pytest.raises(TypeError, match=r"grid_sample\(\): data_format must be a string"):
            jk.grid_sample(x, grid, data_format=bad)
    with pytest.raises(TypeError):
        jk.grid_sample(x, grid, "bilinear", "zeros", False, True, "NHWC")  # keyword-only
    # Raised at trace time, and the shape checks read the channels-last shape.
    with pytest.raises(ValueError, match=r"grid_sample\(\): data_format"):
        jax.jit(lambda x, g: jk.grid_sample(x, g, data_format="NCDHW")).lower(x, grid)
    with pytest.raises(ValueError, match=r"non-empty spatial dimensions.*channels-last"):
        jk.grid_sample(jnp.zeros((1, 0, 4, 3)), jnp.zeros((1, 2, 2, 2)), data_format="NHWC")
    with pytest.raises(ValueError, match=r"expected grid of shape \(N, Do, Ho, Wo, 3\)"):
        jk.grid_sample(jnp.zeros((1, 2, 3, 4, 5)), jnp.zeros((1, 2, 2, 2)), data_format="NDHWC")


# --- the compiled program ------------------------------------------------------------------------

# An HLO instruction "%name = dtype[dims]{layout} op(" (arrays only).
_INSTRUCTION = re.compile(r"= \w+\[([\d,]*)\]\{([\d,]*)[^}]*\} ([\w-]+)\(")


def _layout_changes(text: str, min_elements: int) -> list[str]:
    """Instructions of the compiled program that move at least `min_elements` elements to
    another order: transposes, and any array whose layout is not the default (row-major)."""
    found = []
    for dims, layout, op in _INSTRUCTION.findall(text):
        shape = [int(d) for d in dims.split(",") if d]
        if int(np.prod(shape)) < min_elements:
            continue
        row_major = ",".join(str(d) for d in reversed(range(len(shape))))
        if op == "transpose" or (layout and layout != row_major):
            found.append(f"{op} {shape} {{{layout}}}")
    return found


def _compiled(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("rank,mode", [(4, "bilinear"), (5, "bilinear"), (4, "bicubic")])
def test_no_transpose_in_the_compiled_program(rank, mode):
    x, grid, _ = _problem(rank, channels=4)
    x = to_last(x)
    out = grid.shape[:-1] + (4,)
    batch_sized = min(x.size, int(np.prod(out)))
    assert grid.size < batch_sized  # the grid itself is never in question

    def loss(x, g):
        return jnp.sum(jk.grid_sample(x, g, mode=mode, data_format="NHWC") ** 2)

    def manual(x, g):  # what the kernels spare: the NCHW kernels between two transposes
        y = to_last(jk.grid_sample(to_first(x), g, mode=mode))
        return jnp.sum(y ** 2)

    for f in (loss, manual):
        text = _compiled(jax.value_and_grad(f, argnums=(0, 1)), x, grid)
        changes = _layout_changes(text, batch_sized)
        if f is loss:
            assert changes == [], changes
            assert "jk_grid_sample_nhwc_fwd" in text and "jk_grid_sample_nhwc_bwd_input" in text
            assert "jk_grid_sample_nhwc_bwd_grid" in text
        else:
            assert changes, "the check cannot see a transpose"
    # Forward mode and second order: the directional targets, no transpose either.
    hvp = lambda x, g: jax.jvp(jax.grad(loss, argnums=(0, 1)), (x, g), (x, g))[1]
    text = _compiled(hvp, x, grid)
    assert _layout_changes(text, batch_sized) == []
    assert "jk_grid_sample_nhwc_fwd_directional" in text
    assert_lowered(lambda x, g: jk.grid_sample(x, g, data_format="NHWC"), x, grid,
                   targets=("jk_grid_sample_nhwc_fwd",))


def test_capabilities_list_the_channels_last_targets():
    rows = [r for r in jk.capabilities() if r.op == "grid_sample"]
    targets = {r.target.rsplit("_v", 1)[0] for r in rows}
    for pass_ in ("fwd", "bwd_input", "bwd_grid", "fwd_directional", "bwd_input_directional",
                  "bwd_grid_directional"):
        assert {f"jk_grid_sample_{pass_}", f"jk_grid_sample_nhwc_{pass_}"} <= targets
    # One row per target and dtype; the full table tells the layouts apart by implementation.
    keys = [(r.pass_, r.dtype, r.platform, r.backend) for r in rows]
    assert len(keys) == len(set(keys))
    assert all(("NHWC" in r.backend) == ("_nhwc_" in r.target) for r in rows)


# --- partitioning on 8 CPU devices (as test_sharding.py's grid_sample cases) ----------------------


def _cpu_mesh():
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:
        cpus = []
    if len(cpus) < 8:
        pytest.skip("needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(cpus[:8]), ("batch",))


def _put(x, mesh, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


_COLLECTIVE = re.compile(r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                         r"(?:-start)?\(")


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    shardy = request.param == "shardy"
    try:
        previous = jax.config.jax_use_shardy_partitioner
        jax.config.update("jax_use_shardy_partitioner", shardy)
    except (AttributeError, ValueError):
        if not shardy:
            pytest.skip("this jax has no GSPMD partitioner")
        previous = None
    yield request.param
    if previous is not None:
        jax.config.update("jax_use_shardy_partitioner", previous)


@pytest.mark.parametrize("rank", [4, 5])
def test_batch_sharded(partitioner, rank):
    m = _cpu_mesh()
    spatial = (6, 7) if rank == 4 else (4, 5, 6)
    x = np.asarray(random(0, (16,) + spatial + (3,), jnp.float64))
    grid = np.asarray(random(1, (16,) + (3,) * (rank - 2) + (rank - 2,), jnp.float64, -1.1, 1.1))

    def loss(x, grid):
        return (jk.grid_sample(x, grid, padding_mode="border", data_format="NHWC") ** 2).sum()

    grads = jax.grad(loss, argnums=(0, 1))
    args = (_put(x, m, "batch"), _put(grid, m, "batch"))
    shardings = (NamedSharding(m, P("batch")),) * 2
    text = jax.jit(grads, out_shardings=shardings).lower(*args).compile().as_text()
    assert _COLLECTIVE.findall(text) == []
    actual = jax.jit(grads, out_shardings=shardings)(*args)
    cpu = jax.devices("cpu")[0]
    expected = jax.jit(grads)(jax.device_put(x, cpu), jax.device_put(grid, cpu))
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-12, atol=1e-12)


def test_channels_and_points_sharded(partitioner):
    """Channels (the last axis) sharded with the grid replicated, and output points sharded with
    the input replicated: each shard samples alone."""
    m = _cpu_mesh()
    x = np.asarray(random(0, (2, 6, 7, 8), jnp.float64))
    grid = np.asarray(random(1, (2, 8, 5, 2), jnp.float64, -1.1, 1.1))
    f = lambda x, g: jk.grid_sample(x, g, mode="bicubic", align_corners=True, data_format="NHWC")
    cpu = jax.devices("cpu")[0]
    expected = jax.jit(f)(jax.device_put(x, cpu), jax.device_put(grid, cpu))
    for x_spec, g_spec, y_spec in [((None, None, None, "batch"), (), P(None, None, None, "batch")),
                                   ((), (None, "batch"), P(None, "batch"))]:
        args = (_put(x, m, *x_spec), _put(grid, m, *g_spec))
        assert _COLLECTIVE.findall(jax.jit(f).lower(*args).compile().as_text()) == []
        y = jax.jit(f)(*args)
        assert y.sharding.spec == y_spec
        np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-12, atol=1e-12)
