"""GPU tests at extents just under and just over 2^31 (issue 14): every backward pass, and the
forward where it shares the loop, with the extent its kernel's loop runs over (or, for the
32-bit index choice, the largest offset it forms) at 2^31 - a little and 2^31 + a little.

A 32-bit grid-stride index in the grid_sample backward overflowed when N*H*W lay just under
2^31 (an illegal address, the CUDA context lost); these cases fail on such a bug with a crash
or with wrong values near the end. Each case runs alone in a fresh process with
JAX_PLATFORMS=cuda, so a crash fails that case, not the run; each prints its time.

Oracles never call the kernels under test: the inputs are built on the GPU from index formulas
whose results are known in closed form (exact in the dtype used), or from sparse inputs whose
results a float64 NumPy reference computes from the few nonzero elements. Every element of a
result is checked with reductions on the GPU (so always the region around element 2^31).

The module skips without a CUDA device. On any machine, ``python tests/test_large_extents.py
--dry [case ...]`` lowers every case (or those named) for CUDA at full size with jax.export,
allocating nothing: shapes, arguments and the CUDA scratch queries are checked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Callable, NamedTuple

import numpy as np

LIMIT = 2**31
#: A case's process may use this much of the GPU's memory (the largest case needs ~42 GB).
MEMORY_FRACTION = "0.95"


class Case(NamedTuple):
    inputs: Callable[[], tuple]     # the operands, computed on the device from index formulas
    passes: Callable[..., tuple]    # the op's passes under test, on the operands
    errors: Callable[..., dict]     # {what: a 0-d array that must be exactly 0}, on both
    host_check: Callable[[], None] | None = None  # assertions on the host (planning queries)


# ---- grid_sample --------------------------------------------------------------------------------


def _grid_sample_sorted(layout: str, side: str) -> Case:
    """d_input, deterministic (sorted) path, float16, bilinear: the gather runs over N*H*W input
    cells. Each of N 9x9 images gets one point at an exact cell (align_corners, coordinates
    k/4 - 1), so d_input is dout at those cells and zero elsewhere."""
    import jax
    import jax.numpy as jnp
    import jax_kernels as jk

    cells = 81
    # Under: in the 32-bit path, within one grid's stride of 2^31 (the original overflow).
    n = (LIMIT - 2048) // cells if side == "under" else LIMIT // cells + 1
    shape = (n, 1, 9, 9) if layout == "NCHW" else (n, 9, 9, 1)

    def cell_of(m):
        return m % 9, (m // 9) % 9

    def inputs():
        m = jax.lax.iota(jnp.int32, n)
        x, y = cell_of(m)
        grid = jnp.stack([x, y], -1).astype(jnp.float16) / 4 - 1
        dout = (1 + m % 7).astype(jnp.float16)
        return grid.reshape(n, 1, 1, 2), dout.reshape(n, 1, 1, 1)

    def passes(grid, dout):
        def f(x):
            return jk.grid_sample(x, grid, align_corners=True, deterministic=True,
                                  data_format=layout)
        return jax.linear_transpose(f, jax.ShapeDtypeStruct(shape, jnp.float16))(dout)

    def errors(grid, dout, d_input):
        m = jax.lax.iota(jnp.int32, n)
        x, y = cell_of(m)
        got = d_input[m, 0, y, x] if layout == "NCHW" else d_input[m, y, x, 0]
        return {"d_input at the sampled cells": _max_abs(got, dout.reshape(n)),
                "nonzero d_input cells beyond the sampled ones":
                    jnp.count_nonzero(d_input) - n}

    return Case(inputs, passes, errors)


def _points(side: str, columns: int = 2048) -> tuple[int, int]:
    """(rows, columns) of an output grid with 2^31 - columns or 2^31 + columns points, or, for
    side "grid32", the most points whose kernels still take 32-bit indices (3 * points, the
    bound that also covers 3-D grids, 128 under 2^31)."""
    if side == "grid32":
        return (LIMIT - 128) // 3 // 64, 64
    return LIMIT // columns + (-1 if side == "under" else 1), columns


def _point_grid(rows: int, columns: int, period: int, width: int, scale: float, dtype):
    """grid [1, rows, columns, 2] sending point p to the exact cell (c % width, c // width),
    c = p % period (align_corners: coordinate k / scale - 1); and p."""
    import jax
    import jax.numpy as jnp

    i = jax.lax.broadcasted_iota(jnp.int64, (rows, columns), 0)
    j = jax.lax.broadcasted_iota(jnp.int64, (rows, columns), 1)
    p = i * columns + j
    c = p % period
    grid = jnp.stack([c % width, c // width], -1).astype(dtype) / scale - 1
    return grid[None], p


def _grid_sample_atomic(layout: str, side: str) -> Case:
    """d_input with deterministic=False (atomics), float32: the loop runs over the points. All
    2^31 +- 2048 points sample exact cells of one 257x257 image (point p: cell p % 257^2) with
    dout = 1 + p % 3, so each cell's sum is an integer below 2^24, exact in any order."""
    import jax
    import jax.numpy as jnp
    import jax_kernels as jk

    size, rows_cols = 257, _points(side)
    period = size * size
    shape = (1, 1, size, size) if layout == "NCHW" else (1, size, size, 1)

    def inputs():
        grid, p = _point_grid(*rows_cols, period, size, 128.0, jnp.float32)
        dout = (1 + p % 3).astype(jnp.float32)
        return grid, dout[None, None] if layout == "NCHW" else dout[None, :, :, None]

    def passes(grid, dout):
        def f(x):
            return jk.grid_sample(x, grid, align_corners=True, deterministic=False,
                                  data_format=layout)
        return jax.linear_transpose(f, jax.ShapeDtypeStruct(shape, jnp.float32))(dout)

    # Cell c gets points c + k * period, k < count(c); (c + k * period) % 3 == (c + k) % 3.
    total = rows_cols[0] * rows_cols[1]
    c = np.arange(period)
    count = total // period + (c < total % period)
    cycles, rest = count // 3, count % 3
    expected = count + 3 * cycles + (rest >= 2) * ((c + 1) % 3) + (rest >= 1) * (c % 3)

    def errors(grid, dout, d_input):
        got = d_input.reshape(size, size)
        return {"d_input": _max_abs(got, jnp.asarray(expected.reshape(size, size), jnp.float32))}

    return Case(inputs, passes, errors)


def _grid_sample_grid(layout: str, side: str) -> Case:
    """The forward and d_grid (both loop over the points), float16, bilinear, on a 9x9 image
    holding x + 2y: every point samples an exact interior cell (p % 64 of the 8x8 interior), so
    the output is x + 2y and d_grid is dout * (4, 8) (the slopes 1 and 2 times (size - 1) / 2)."""
    import jax
    import jax.numpy as jnp
    import jax_kernels as jk

    rows, columns = _points(side)

    def inputs():
        y, x = jnp.meshgrid(jnp.arange(9), jnp.arange(9), indexing="ij")
        image = (x + 2 * y).astype(jnp.float16)
        image = image[None, None] if layout == "NCHW" else image[None, :, :, None]
        grid, p = _point_grid(rows, columns, 64, 8, 4.0, jnp.float16)
        dout = (1 + p % 3).astype(jnp.float16)
        return image, grid, dout[None, None] if layout == "NCHW" else dout[None, :, :, None]

    def passes(image, grid, dout):
        out, pullback = jax.vjp(
            lambda g: jk.grid_sample(image, g, align_corners=True, data_format=layout), grid)
        return out, pullback(dout)[0]

    def errors(image, grid, dout, out, d_grid):
        _, p = _point_grid(rows, columns, 64, 8, 4.0, jnp.float16)
        c = p % 64
        sampled = (c % 8 + 2 * (c // 8)).astype(jnp.float32)
        g = dout.reshape(rows, columns).astype(jnp.float32)
        return {"forward": _max_abs(out.reshape(rows, columns), sampled),
                "d_grid x": _max_abs(d_grid[0, ..., 0], 4 * g),
                "d_grid y": _max_abs(d_grid[0, ..., 1], 8 * g)}

    return Case(inputs, passes, errors)


# ---- roi_align ----------------------------------------------------------------------------------


def _roi_align(layout: str, deterministic: bool, side: str) -> Case:
    """The forward, d_input and d_boxes, float32, on one image of 32768 -+ 1 rows of 65536
    columns holding x + 2y (exact), with 1x1 boxes sampled once at (x + 1/4, y + 1/4)
    (aligned=True): the output is x + 2y + 3/4, d_input is dout times the bilinear weights
    (9, 3, 3, 1)/16 at the four cells of each box, and d_boxes is dout * (0, 1/2, 1, 1/2, 1)."""
    import jax
    import jax.numpy as jnp
    import jax_kernels as jk

    height, width = LIMIT // 65536 + (-1 if side == "under" else 1), 65536
    shape = (1, 1, height, width) if layout == "NCHW" else (1, height, width, 1)
    # Boxes' top-left cells (each box touches its 2x2 cells; no two boxes share one): at the
    # start, and on the last rows, which straddle element 2^31 when there are 32769 of them.
    corners = [(0, 0), (0, 3), (2, 4464), (height - 4, width - 3), (height - 2, 0),
               (height - 2, 3), (height - 2, width // 2), (height - 2, width - 2)]
    ys, xs = (np.array(v, np.int64) for v in zip(*corners))
    k = len(corners)
    g = 1 + np.arange(k) % 3

    def inputs():
        y = jax.lax.broadcasted_iota(jnp.float32, (height, width), 0)
        x = jax.lax.broadcasted_iota(jnp.float32, (height, width), 1)
        image = (x + 2 * y).reshape(shape)
        boxes = jnp.asarray(np.stack([np.zeros(k), xs + 0.25, ys + 0.25, xs + 1.25, ys + 1.25],
                                     1), jnp.float32)
        return image, boxes, jnp.asarray(g, jnp.float32).reshape(k, 1, 1, 1)

    def passes(image, boxes, dout):
        def f(x, b):
            return jk.roi_align(x, b, 1, 1.0, 1, True, deterministic=deterministic,
                                data_format=layout)
        out, pullback = jax.vjp(f, image, boxes)
        return (out, *pullback(dout))

    def errors(image, boxes, dout, out, d_input, d_boxes):
        plane = d_input.reshape(height, width)
        cells = [(0, 0, 9 / 16), (0, 1, 3 / 16), (1, 0, 3 / 16), (1, 1, 1 / 16)]
        got = jnp.stack([plane[ys + dy, xs + dx] for dy, dx, _ in cells])
        want = np.stack([g * w for _, _, w in cells])
        return {"forward": _max_abs(out.reshape(k), jnp.asarray(xs + 2 * ys + 0.75, jnp.float32)),
                "d_input at the boxes' cells": _max_abs(got, jnp.asarray(want, jnp.float32)),
                "nonzero d_input cells beyond the boxes'": jnp.count_nonzero(plane) - 4 * k,
                "d_boxes": _max_abs(d_boxes, jnp.asarray(g[:, None] * [0, .5, 1, .5, 1],
                                                         jnp.float32))}

    return Case(inputs, passes, errors)


# ---- conv2d -------------------------------------------------------------------------------------


class _Conv(NamedTuple):
    n: int
    c: int
    k: int
    size: int   # H = W (= P = Q: stride 1, "same" padding)
    taps: int   # R = S
    groups: int
    dtype: str


def _conv(layout: str, spec: _Conv, tensor_cores: bool) -> Case:
    """The forward, dgrad, wgrad and bias gradient. x is zero but for a few spikes (at the
    start, around element 2^31 and at the end of its memory); the weights are a delta (the
    centre tap of filter k on channel k, or on its group's channel), so y = x (or, for one
    filter on two channels, x0 + 2 x1) and dx = dy * w. dy = (-1)^q (1 + (n + k + p) % 2), plus
    1 at q = 0 of the last image: each row of dy sums to 0 but that 1, so db = P; dw sums the
    spikes times dy in float64 NumPy. All values are small integers, exact in the dtype.
    `tensor_cores`: whether the tensor-core path must take the problem (checked through the
    scratch query), else the direct kernels run it."""
    import jax
    import jax.numpy as jnp
    import jax_kernels as jk

    n, c, k, size, taps, groups = spec.n, spec.c, spec.k, spec.size, spec.taps, spec.groups
    dtype = jnp.dtype(spec.dtype)
    pad = taps // 2
    nchw = layout == "NCHW"
    total = n * c * size * size
    cg = c // groups

    def physical(channels):  # the layout's shape of an activation
        return (n, channels, size, size) if nchw else (n, size, size, channels)

    def logical(index):  # (n, channel, y, x) of a physical index
        return index if nchw else (index[0], index[3], index[1], index[2])

    around = [0, 1, 777, LIMIT - 4097, LIMIT - 2, LIMIT - 1, LIMIT, LIMIT + 1, LIMIT + 4099,
              total - 2, total - 1]
    flats = np.array(sorted({f for f in around if f < total}), np.int64)
    spike_at = np.unravel_index(flats, physical(c))
    values = 1 + np.arange(len(flats)) % 3

    # Filter j reads the centre tap of channel j (dense: an identity), of its group's channel
    # (depthwise), or of both channels with weights 1 and 2 (one filter over two channels).
    w = np.zeros((k, cg, taps, taps))
    for j in range(k):
        if cg == k:
            w[j, j, pad, pad] = 1
        elif k == 1:
            w[0, :, pad, pad] = 1 + np.arange(cg)
        else:
            w[j, 0, pad, pad] = 1

    def dy_of(i, j, p, q, xp):
        return xp.where(q % 2 == 0, 1, -1) * (1 + (i + j + p) % 2) + ((q == 0) & (i == n - 1))

    def channel(a, i):  # channel i of an activation, kept as an axis
        return a[:, i:i + 1] if nchw else a[..., i:i + 1]

    def inputs():
        x = jnp.zeros(physical(c), dtype).at[spike_at].set(jnp.asarray(values, dtype))
        index = [jax.lax.broadcasted_iota(jnp.int32, physical(k), a) for a in range(4)]
        dy = dy_of(*logical(index), jnp).astype(dtype)
        weight = w if nchw else np.transpose(w, (2, 3, 1, 0))  # KCRS -> HWIO
        return x, jnp.asarray(weight, dtype), jnp.zeros((k,), dtype), dy

    def passes(x, weight, bias, dy):
        def f(x, weight, bias):
            return jk.conv2d(x, weight, bias, 1, pad, 1, groups, data_format=layout)
        y, pullback = jax.vjp(f, x, weight, bias)
        return (y, *pullback(dy))

    # dw[j, i, r, s] = sum over the spikes (m, ch, yy, xx) of filter j's channels
    # (ch = group(j) * cg + i) of value * dy[m, j, yy - r + pad, xx - s + pad].
    dw = np.zeros((k, cg, taps, taps))
    for (m, ch, yy, xx), v in zip(zip(*logical(spike_at)), values):
        for j in range(k):
            if ch // cg != j // (k // groups):
                continue
            for r in range(taps):
                for s in range(taps):
                    p, q = yy - r + pad, xx - s + pad
                    if 0 <= p < size and 0 <= q < size:
                        dw[j, ch % cg, r, s] += v * dy_of(m, j, p, q, np)

    def errors(x, weight, bias, dy, y, dx, d_weight, d_bias):
        if k == c:  # filter j is channel j (dense identity or depthwise delta)
            forward, dgrad = _max_abs(y, x), _max_abs(dx, dy)
        else:       # one filter over two channels, weights 1 and 2
            xf = x.astype(jnp.float32)
            forward = _max_abs(y, channel(xf, 0) + 2 * channel(xf, 1))
            dyf = dy.astype(jnp.float32)
            dgrad = jnp.maximum(_max_abs(channel(dx, 0), dyf), _max_abs(channel(dx, 1), 2 * dyf))
        kcrs = d_weight if nchw else jnp.transpose(d_weight, (3, 2, 0, 1))
        return {"forward": forward, "dgrad": dgrad,
                "wgrad": _max_abs(kcrs, jnp.asarray(dw, dtype)),
                "bias gradient": _max_abs(d_bias, jnp.full((k,), size, jnp.float32))}

    def host_check():
        # Whether the tensor-core path takes the problem: its forward needs scratch (the NCHW
        # route's NHWC copies, the NHWC route's reordered weights), the direct kernels' none.
        from jax_kernels import _ffi
        scratch = _ffi.query("conv2d_scratch", **{"pass": _ffi.ENUMS["ConvPass"]["forward"]},
                             dtype=_ffi.ENUMS["ConvDtype"][spec.dtype],
                             layout=_ffi.ENUMS["ConvLayout"][layout], N=n, C=c, H=size, W=size,
                             K=k, R=taps, S=taps, P=size, Q=size, stride_h=1, stride_w=1,
                             pad_top=pad, pad_left=pad, dilation_h=1, dilation_w=1,
                             groups=groups, precision=0)
        assert (scratch > 0) == tensor_cores, (
            f"the tensor-core path {'declined' if tensor_cores else 'took'} the problem "
            f"(forward scratch {scratch} bytes)")

    return Case(inputs, passes, errors, host_check)


# ---- lerp and repeat ----------------------------------------------------------------------------


def _lerp(side: str) -> Case:
    """The forward and the three gradients, bfloat16, 2^31 -+ 65536 elements of small integers
    and weights in {0, 1/4, ..., 1}: d_input = (1 - w) g, d_end = w g, d_weight = (end - input) g,
    all exact."""
    import jax
    import jax.numpy as jnp
    import jax_kernels as jk

    shape = (LIMIT // 65536 + (-1 if side == "under" else 1), 65536)

    def operands():
        i, j = (jax.lax.broadcasted_iota(jnp.int32, shape, a) for a in range(2))
        return ((i + j) % 7 - 3).astype(jnp.float32), ((2 * i + 3 * j) % 5 - 2).astype(
            jnp.float32), ((i + 2 * j) % 5).astype(jnp.float32) / 4, (1 + (3 * i + j) % 3).astype(
            jnp.float32)

    def inputs():
        return tuple(a.astype(jnp.bfloat16) for a in operands())

    def passes(a, b, w, g):
        out, pullback = jax.vjp(jk.lerp, a, b, w)
        return (out, *pullback(g))

    def errors(a, b, w, g, out, da, db, dw):
        a, b, w, g = operands()
        return {"forward": _max_abs(out, a + w * (b - a)), "d_input": _max_abs(da, (1 - w) * g),
                "d_end": _max_abs(db, w * g), "d_weight": _max_abs(dw, (b - a) * g)}

    return Case(inputs, passes, errors)


def _repeat(side: str) -> Case:
    """repeat (2,) of a float16 vector of 2^31 -+ 1 elements, then its gradient: the forward's
    rows of 2^32 -+ 2 elements cross its 32-bit column arithmetic (which wrapped), the backward
    runs over the 2^31 -+ 1 elements."""
    import jax
    import jax.numpy as jnp
    import jax_kernels as jk

    size = LIMIT + (-1 if side == "under" else 1)

    def inputs():
        i = jax.lax.iota(jnp.int64, size)
        d = jax.lax.iota(jnp.int64, 2 * size)
        return ((i % 2039) - 1019).astype(jnp.float16), ((d % 1021) - 510).astype(jnp.float16)

    def passes(x, dout):
        out, pullback = jax.vjp(lambda v: jk.repeat(v, (2,)), x)
        return out, pullback(dout)[0]

    def errors(x, dout, out, dx):
        d = dout.astype(jnp.float32)
        return {"forward, first copy": _max_abs(out[:size], x),
                "forward, second copy": _max_abs(out[size:], x),
                "backward": _max_abs(dx, d[:size] + d[size:])}

    return Case(inputs, passes, errors)


def _max_abs(got, want):
    """max |got - want| in float32 (NaN if any element of either is NaN)."""
    import jax.numpy as jnp
    return jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))


_DEPTHWISE = {side: _Conv(n, 64, 64, 64, 3, 64, "bfloat16")
              for side, n in (("under", LIMIT // 64**3 - 1), ("over", LIMIT // 64**3 + 1))}
# Dense 3x3, 16 -> 16 channels: x of 2 GiB - 128 KiB (the tensor-core path takes it) or
# 2 GiB + 128 KiB (CUTLASS indexes tensors in int and refuses 2 GiB: the direct kernels).
_DENSE = {side: _Conv(n, 16, 16, 64, 3, 1, "float16")
          for side, n in (("under", 2**30 // 16 // 64**2 - 1), ("over", 2**30 // 16 // 64**2 + 1))}
# Dense 1x1, 2 channels -> 1 filter with N*P*Q = 2^31 + 4096: past CUTLASS's int GEMM extent.
_NPQ = _Conv(LIMIT // 64**2 + 1, 2, 1, 64, 1, 1, "float16")

CASES: dict[str, Callable[[], Case]] = {}
for _layout in ("NCHW", "NHWC"):
    _l = _layout.lower()
    for _side in ("under", "over"):
        CASES[f"grid_sample-sorted-{_l}-{_side}"] = (
            lambda l=_layout, s=_side: _grid_sample_sorted(l, s))
        CASES[f"grid_sample-atomic-{_l}-{_side}"] = (
            lambda l=_layout, s=_side: _grid_sample_atomic(l, s))
        CASES[f"grid_sample-d_grid-{_l}-{_side}"] = (
            lambda l=_layout, s=_side: _grid_sample_grid(l, s))
        CASES[f"conv2d-depthwise-{_l}-{_side}"] = (
            lambda l=_layout, s=_side: _conv(l, _DEPTHWISE[s], False))
        CASES[f"conv2d-dense-{_l}-{_side}"] = (
            lambda l=_layout, s=_side: _conv(l, _DENSE[s], s == "under"))
    CASES[f"conv2d-npq-{_l}-over"] = lambda l=_layout: _conv(l, _NPQ, False)
for _side in ("under", "over"):
    for _det, _name in ((True, "deterministic"), (False, "atomic")):
        CASES[f"roi_align-{_name}-nchw-{_side}"] = (
            lambda d=_det, s=_side: _roi_align("NCHW", d, s))
    CASES[f"roi_align-deterministic-nhwc-{_side}"] = lambda s=_side: _roi_align("NHWC", True, s)
    CASES[f"lerp-{_side}"] = lambda s=_side: _lerp(s)
    CASES[f"repeat-{_side}"] = lambda s=_side: _repeat(s)
# The largest point loops in 32-bit indices.
CASES["grid_sample-d_grid-nchw-grid32"] = lambda: _grid_sample_grid("NCHW", "grid32")
CASES["grid_sample-atomic-nchw-grid32"] = lambda: _grid_sample_atomic("NCHW", "grid32")


# ---- running a case (in its own process) --------------------------------------------------------


def _run_case(name: str) -> None:
    """Runs case `name` on the GPU; prints its errors and time as JSON."""
    import jax
    jax.config.update("jax_enable_x64", True)
    start = time.perf_counter()
    case = CASES[name]()
    if case.host_check is not None:
        case.host_check()
    operands = jax.jit(case.inputs)()
    results = jax.jit(case.passes)(*operands)
    errors = jax.device_get(jax.jit(case.errors)(*operands, *results))
    seconds = time.perf_counter() - start
    print(json.dumps({"errors": {k: float(v) for k, v in errors.items()}, "seconds": seconds}))


def _dry(name: str) -> None:
    """Lowers case `name` for CUDA at full size (nothing is allocated or run)."""
    import jax
    import jax_kernels as jk
    jax.config.update("jax_enable_x64", True)
    case = CASES[name]()
    if case.host_check is not None:
        case.host_check()

    def whole():
        operands = case.inputs()
        return case.errors(*operands, *case.passes(*operands))

    exported = jax.export.export(jax.jit(whole), platforms=("cuda",),
                                 disabled_checks=jk.disabled_export_checks())()
    print(f"{name}: lowered for CUDA, results {[str(a) for a in exported.out_avals]}")


def _child_environment() -> dict:
    """This environment for a case's process, on the GPU, importing the jax_kernels that this
    process would import."""
    env = dict(os.environ, JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION=MEMORY_FRACTION)
    spec = importlib.util.find_spec("jax_kernels")
    if spec is not None and spec.origin is not None:
        package_root = os.path.dirname(os.path.dirname(spec.origin))
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _cuda_devices() -> int:
    """The CUDA devices a fresh process sees (0 without a GPU or a CUDA jaxlib); asked in a
    subprocess so that this one never takes the GPU."""
    code = "import jax; print(len(jax.devices('gpu')))"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, env=_child_environment())
    except (OSError, subprocess.TimeoutExpired):
        return 0
    lines = proc.stdout.split()
    return int(lines[-1]) if proc.returncode == 0 and lines else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        _run_case(sys.argv[2])
    elif sys.argv[1:2] == ["--dry"]:
        for _name in sys.argv[2:] or CASES:
            _dry(_name)
    else:
        sys.exit(f"usage: {sys.argv[0]} --case NAME | --dry [NAME ...]")
else:
    import pytest

    if _cuda_devices() == 0:
        pytest.skip("needs a CUDA device (extents near 2^31: tens of GB of GPU memory, and too "
                    "slow on the CPU)", allow_module_level=True)

    @pytest.mark.parametrize("name", list(CASES))
    def test_large_extent(name):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", name],
                              capture_output=True, text=True, timeout=600,
                              env=_child_environment())
        assert proc.returncode == 0, (f"{name} crashed or failed (rc {proc.returncode}):\n"
                                      f"{proc.stderr[-4000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: {result['seconds']:.1f} s")
        wrong = {what: e for what, e in result["errors"].items() if e != 0}
        assert not wrong, f"{name}: nonzero errors {wrong}"
