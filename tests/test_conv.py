"""Tests of jk.conv2d against torch.nn.functional.conv2d (float64 on the CPU as the oracle, and
torch CUDA side by side when it is available): forward and every gradient over a grid of
geometries, every dtype, gradient checks, batching, the lowered program, trace-time errors and
(on the GPU) bitwise determinism. The same file runs with JAX_PLATFORMS=cuda."""

from __future__ import annotations

import concurrent.futures
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_kernels as jk
from jax_kernels import _ffi
from jk_testing import (ON_GPU, TORCH_UNAVAILABLE, assert_close, assert_lowered, from_torch,
                        random, rtol, to_torch, torch)

pytestmark = [
    pytest.mark.skipif(torch is None, reason=TORCH_UNAVAILABLE),
    # torch's own remark about how it pads asymmetric "same" convolutions.
    pytest.mark.filterwarnings("ignore:Using padding='same'"),
]

TORCH_CUDA = torch is not None and ON_GPU and torch.cuda.is_available()
# Hopper (compute capability 9.0): the sm_90a kernels of the tensor-core path run there.
HOPPER = ON_GPU and getattr(jax.devices()[0], "compute_capability", "") == "9.0"
TARGETS = ("jk_conv2d_fwd", "jk_conv2d_bwd_input", "jk_conv2d_bwd_weight", "jk_conv2d_bwd_bias")


def torch_conv(x, w, b, dy, device="cpu", dtype=None, **options):
    """torch's output and gradients (input, weight, bias) as float64 NumPy arrays."""
    def tensor(a):
        return to_torch(a, dtype).to(device).requires_grad_()

    tx, tw = tensor(x), tensor(w)
    tb = tensor(b) if b is not None else None
    ty = torch.nn.functional.conv2d(tx, tw, tb, **options)
    ty.backward(to_torch(dy, dtype).to(device))
    grads = (tx.grad, tw.grad, tb.grad if tb is not None else None)
    grads = tuple(None if g is None else from_torch(g.cpu()) for g in grads)
    return (from_torch(ty.cpu()),) + grads


def jk_conv(x, w, b, dy, **options):
    """jk's output and gradients, through jit."""
    def f(x, w, b):
        return jk.conv2d(x, w, b, **options)

    y, vjp = jax.vjp(jax.jit(f), x, w, b)
    return (y,) + vjp(dy)


def operands(seed, shape_x, shape_w, bias, dtype, options):
    x = random(seed, shape_x, dtype)
    w = random(seed + 1, shape_w, dtype)
    b = random(seed + 2, (shape_w[0],), dtype) if bias else None
    y = jax.eval_shape(lambda x, w: jk.conv2d(x, w, None, **options), x, w)
    dy = random(seed + 3, y.shape, dtype)
    return x, w, b, dy


# (input shape, weight shape, options, bias): odd sizes, strides, dilations, padding modes,
# groups, depthwise with and without channel multiplier, 1x1, kernels as large as the input,
# and the geometries that select each CUDA kernel (unrolled 3x3/5x5/7x7 stencils with 7- and
# 8-row strips, the generic stencil, the global-memory stencil, generic weight gradients with
# more than 16 taps).
GEOMETRIES = [
    ((2, 3, 7, 9), (4, 3, 3, 3), dict(), True),
    ((2, 3, 8, 8), (5, 3, 3, 3), dict(padding=1), True),
    ((1, 4, 11, 10), (6, 2, 3, 2),
     dict(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=2), True),
    ((2, 5, 13, 12), (4, 5, 1, 1), dict(), False),
    ((1, 8, 9, 9), (16, 8, 1, 1), dict(stride=2), True),
    ((2, 4, 9, 11), (6, 4, 4, 4), dict(padding="same"), True),
    ((2, 4, 10, 9), (6, 4, 2, 3), dict(padding="same", dilation=(1, 3)), False),
    ((2, 6, 10, 10), (6, 3, 3, 3), dict(padding="valid", groups=2), True),
    ((2, 6, 12, 12), (6, 1, 7, 7), dict(padding=3, groups=6), True),
    ((2, 6, 14, 14), (6, 1, 7, 7), dict(padding="same", groups=6), False),
    ((2, 4, 16, 16), (4, 1, 3, 3), dict(padding=1, groups=4), True),
    ((1, 4, 9, 20), (4, 1, 5, 5), dict(padding=2, groups=4), True),
    ((2, 3, 10, 11), (6, 1, 3, 3), dict(padding=1, groups=3), True),  # channel multiplier 2
    ((2, 4, 12, 13), (12, 1, 5, 5), dict(stride=2, padding=2, groups=4), True),
    ((1, 4, 15, 15), (4, 1, 3, 3), dict(stride=2, padding=1, dilation=2, groups=4), False),
    ((2, 4, 17, 9), (4, 1, 5, 5), dict(stride=(2, 1), padding=(2, 0), groups=4), True),
    ((1, 2, 5, 6), (3, 2, 5, 6), dict(), True),  # the kernel covers the input
    ((1, 2, 3, 3), (2, 2, 5, 5), dict(padding=1), True),  # only with padding
    ((3, 16, 20, 33), (16, 16, 3, 3), dict(padding=1), False),
    ((1, 2, 70, 70), (2, 1, 3, 3), dict(dilation=30, padding=1, groups=2), True),
    ((2, 2, 9, 9), (2, 2, 5, 5), dict(stride=3, padding=4), True),
    ((1, 1, 66, 70), (1, 1, 3, 3), dict(padding=1), True),
    # depthwise over planes past the half types' strip bound (tensor-core stencils on the GPU)
    ((1, 4, 30, 30), (4, 1, 7, 7), dict(padding=3, groups=4), True),
]


def _id(geometry):
    shape_x, shape_w, options, bias = geometry
    text = "x" + "x".join(map(str, shape_x)) + "-w" + "x".join(map(str, shape_w))
    text += "".join(f"-{k}{v}" for k, v in options.items()).replace(" ", "")
    return text + ("-b" if bias else "")


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_id)
def test_float64_matches_torch(geometry):
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = operands(0, shape_x, shape_w, bias, jnp.float64, options)
    expected = torch_conv(x, w, b, dy, **options)
    got = jk_conv(x, w, b, dy, **options)
    for name, a, e in zip(("output", "d_input", "d_weight", "d_bias"), got, expected):
        if e is not None:
            assert_close(a, e, jnp.float64), name


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("geometry", [GEOMETRIES[i] for i in (1, 2, 9, 12, 13, 18, 22)],
                         ids=_id)
def test_low_precision_relative_error(dtype, geometry):
    """Half types accumulate in float32; float32 with precision='highest' is full precision on
    every path. The oracle is float64 on the same (rounded) inputs. On the GPU the depthwise
    geometries take the half types' strip kernels (14x14 and 10x11 planes) and the tensor-core
    stencils (30x30)."""
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = operands(1, shape_x, shape_w, bias, dtype, options)
    as64 = lambda a: None if a is None else a.astype(jnp.float64)
    expected = torch_conv(as64(x), as64(w), as64(b), as64(dy), **options)
    got = jk_conv(x, w, b, dy, precision="highest", **options)
    for name, a, e in zip(("output", "d_input", "d_weight", "d_bias"), got, expected):
        if e is not None:
            assert a.dtype == dtype, name
            assert_close(a, e, dtype), name


@pytest.mark.parametrize("geometry", [GEOMETRIES[i] for i in (1, 5, 18)], ids=_id)
def test_float32_default_precision(geometry):
    """precision=None may use TF32 on tensor cores (GPU): 1e-3 relative there, exact elsewhere."""
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = operands(2, shape_x, shape_w, bias, jnp.float32, options)
    as64 = lambda a: None if a is None else a.astype(jnp.float64)
    expected = torch_conv(as64(x), as64(w), as64(b), as64(dy), **options)
    got = jk_conv(x, w, b, dy, **options)
    tolerance = 1e-3 if ON_GPU else rtol(jnp.float32)
    for a, e in zip(got, expected):
        if e is not None:
            assert_close(a, e, rtol_=tolerance)


@pytest.mark.skipif(not TORCH_CUDA, reason="needs torch with CUDA next to JAX on the GPU")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("geometry", [GEOMETRIES[i] for i in (1, 9, 13, 18, 22)], ids=_id)
def test_matches_torch_cuda(dtype, geometry):
    """Side by side with torch CUDA in the same dtype (both may use TF32 for float32)."""
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = operands(3, shape_x, shape_w, bias, dtype, options)
    expected = torch_conv(x, w, b, dy, device="cuda", **options)
    got = jk_conv(x, w, b, dy, **options)
    tolerance = 2e-3 if dtype == jnp.float32 else 2e-2
    for a, e in zip(got, expected):
        if e is not None:
            assert_close(a, e, rtol_=tolerance)


def test_check_grads():
    for groups, shape_w in ((1, (3, 2, 3, 2)), (2, (4, 1, 3, 3))):
        x = random(4, (2, 2, 6, 7), jnp.float64)
        w = random(5, shape_w, jnp.float64)
        b = random(6, (shape_w[0],), jnp.float64)
        f = lambda x, w, b: jk.conv2d(x, w, b, stride=(1, 2), padding=(1, 0), dilation=(2, 1),
                                      groups=groups)
        check_grads(f, (x, w, b), order=2)


def test_unbatched_input_and_empty_batch():
    x = random(7, (3, 8, 9), jnp.float64)
    w = random(8, (4, 3, 3, 3), jnp.float64)
    dy = random(9, (4, 6, 7), jnp.float64)
    y, vjp = jax.vjp(lambda x, w: jk.conv2d(x, w), x, w)
    expected = torch_conv(x[None], w, None, dy[None])
    assert_close(y, expected[0][0], jnp.float64)
    dx, dw = vjp(dy)
    assert_close(dx, expected[1][0], jnp.float64)
    assert_close(dw, expected[2], jnp.float64)

    empty = jnp.zeros((0, 3, 8, 9), jnp.float32)
    w32, b32 = w.astype(jnp.float32), random(10, (4,), jnp.float32)
    assert jk.conv2d(empty, w32).shape == (0, 4, 6, 7)
    dw, db = jax.grad(lambda w, b: jnp.sum(jk.conv2d(empty, w, b)), argnums=(0, 1))(w32, b32)
    np.testing.assert_array_equal(np.asarray(dw), 0)
    np.testing.assert_array_equal(np.asarray(db), 0)  # an empty sum: zeros, written
    for data_format, dy in (("NCHW", jnp.full((0, 4, 6, 7), jnp.nan, jnp.float32)),
                            ("NHWC", jnp.full((0, 6, 7, 4), jnp.nan, jnp.float32))):
        db = jax.jit(lambda dy: jax.vjp(lambda b: jk.conv2d(
            jnp.moveaxis(empty, 1, -1) if data_format == "NHWC" else empty,
            jnp.transpose(w32, (2, 3, 1, 0)) if data_format == "NHWC" else w32, b,
            data_format=data_format), b32)[1](dy)[0])(dy)
        np.testing.assert_array_equal(np.asarray(db), 0)


# --- batching --------------------------------------------------------------------------------

def _reference(x, w, b, **options):
    """lax.conv with explicit padding: an oracle that vmaps on its own."""
    (ph, pw), stride = options.get("padding", (0, 0)), options.get("stride", 1)
    stride = (stride, stride) if isinstance(stride, int) else stride
    dilation = options.get("dilation", (1, 1))
    y = jax.lax.conv_general_dilated(x, w, stride, [(ph, ph), (pw, pw)], rhs_dilation=dilation,
                                     feature_group_count=options.get("groups", 1),
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                     precision="highest")
    return y if b is None else y + b[:, None, None]


BATCH_OPTIONS = dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)


@pytest.mark.parametrize("in_axes", [(0, None, None), (None, 0, None), (None, None, 0),
                                     (0, 0, None), (0, 0, 0), (None, 0, 0), (0, None, 0)])
def test_vmap_and_vmap_of_grad(in_axes):
    B = 3
    full = (random(10, (B, 2, 4, 9, 8), jnp.float64), random(11, (B, 6, 2, 3, 3), jnp.float64),
            random(12, (B, 6), jnp.float64))
    args = [a if axis == 0 else a[0] for a, axis in zip(full, in_axes)]
    f = lambda x, w, b: jk.conv2d(x, w, b, **BATCH_OPTIONS)
    r = lambda x, w, b: _reference(x, w, b, **BATCH_OPTIONS)
    assert_close(jax.vmap(f, in_axes)(*args), jax.vmap(r, in_axes)(*args), jnp.float64)
    loss = lambda g: jax.grad(lambda x, w, b: jnp.sum(g(x, w, b) ** 2), argnums=(0, 1, 2))
    got = jax.jit(jax.vmap(loss(f), in_axes))(*args)
    expected = jax.vmap(loss(r), in_axes)(*args)
    for a, e in zip(got, expected):
        assert_close(a, e, jnp.float64)


def test_nested_vmap_and_per_example_gradients():
    f = lambda x, w: jk.conv2d(x, w, None, **BATCH_OPTIONS)
    r = lambda x, w: _reference(x, w, None, **BATCH_OPTIONS)
    xs = random(13, (2, 3, 2, 4, 9, 8), jnp.float64)
    ws = random(14, (2, 3, 6, 2, 3, 3), jnp.float64)
    assert_close(jax.vmap(jax.vmap(f))(xs, ws), jax.vmap(jax.vmap(r))(xs, ws), jnp.float64)
    assert_close(jax.vmap(jax.vmap(f, (0, None)), (None, 0))(xs[0], ws[:, 0]),
                 jax.vmap(jax.vmap(r, (0, None)), (None, 0))(xs[0], ws[:, 0]), jnp.float64)

    # Per-sample gradients, the vmap(grad) of a training step: weights fold into groups.
    x = random(15, (5, 4, 9, 8), jnp.float64)
    w, b = random(16, (6, 2, 3, 3), jnp.float64), random(17, (6,), jnp.float64)

    def per_sample(conv):
        loss = lambda w, b, x: jnp.sum(jnp.tanh(conv(x[None], w, b)))
        return jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, None, 0))

    conv = lambda x, w, b: jk.conv2d(x, w, b, **BATCH_OPTIONS)
    ref = lambda x, w, b: _reference(x, w, b, **BATCH_OPTIONS)
    got = jax.jit(per_sample(conv))(w, b, x)
    for a, e in zip(got, per_sample(ref)(w, b, x)):
        assert_close(a, e, jnp.float64)
    # No input gradient is asked for, so its kernel is dropped.
    text = assert_lowered(per_sample(conv), w, b, x,
                          targets=("jk_conv2d_fwd", "jk_conv2d_bwd_weight", "jk_conv2d_bwd_bias"))
    assert "convolution" not in text and "jk_conv2d_bwd_input" not in text


def test_lowered_program_holds_custom_calls_only():
    x, w, b = random(18, (2, 4, 8, 8)), random(19, (4, 1, 3, 3)), random(20, (4,))
    f = lambda x, w, b: jnp.sum(jk.conv2d(x, w, b, padding=1, groups=4) ** 2)
    text = assert_lowered(jax.grad(f, argnums=(0, 1, 2)), x, w, b, targets=TARGETS)
    assert "convolution" not in text
    text = assert_lowered(jax.vmap(jax.grad(f, argnums=(0, 1, 2))), x[None], w[None], b[None],
                          targets=TARGETS)
    assert "convolution" not in text


@pytest.mark.skipif(not _ffi.CUDA_BUILT, reason="the CUDA module is not built")
def test_cuda_lowering_requests_scratch():
    """Cross-lowered for CUDA (possible without a GPU): every pass returns a uint8 scratch buffer
    next to its result (the bias gradient an empty one when one chunk per filter suffices)."""
    x, w, b = random(21, (2, 8, 10, 10)), random(22, (8, 1, 3, 3)), random(23, (8,))
    f = jax.grad(lambda x, w, b: jnp.sum(jk.conv2d(x, w, b, padding=1, groups=8) ** 2),
                 argnums=(0, 1, 2))
    text = jax.export.export(jax.jit(f), platforms=("cuda",),
                             disabled_checks=jk.disabled_export_checks())(x, w, b).mlir_module()
    for target in TARGETS:
        call = re.search(rf"custom_call @{_ffi.target_name(target)}\(.*", text).group(0)
        assert re.search(r"-> \(tensor<[0-9x]+xf32>, tensor<\d+xui8>\)", call), call
    assert "stablehlo.while" not in text and "convolution" not in text


@pytest.mark.skipif(not _ffi.CUDA_BUILT, reason="the CUDA module is not built")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_bias_gradient_scratch_follows_the_shape(layout):
    """The bias gradient cuts each filter's sum into chunks fixed by the shape (float partials in
    scratch): none for one chunk, at most 4096 chunks per filter however long the sum."""
    def scratch(batch, n, k, plane, dtype="float32"):
        return _ffi.query("conv2d_bias_scratch", layout=_ffi.ENUMS["ConvLayout"][layout],
                          dtype=_ffi.ENUMS["ConvDtype"][dtype], batch=batch, N=n, K=k,
                          plane=plane)
    assert scratch(1, 1, 8, 49) == 0
    many = scratch(1, 32, 64, 56 * 56)
    assert many > 0 and many % (64 * 4) == 0
    assert scratch(3, 32, 64, 56 * 56) == 3 * many
    assert scratch(1, 32, 64, 56 * 56, "float64") == 2 * many
    assert scratch(1, 2**20, 2, 4096) == 4096 * 2 * 4  # 2^32 terms per filter: capped chunks


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float64])
def test_bias_gradient_of_long_sums_matches_float64(layout, dtype):
    """The bias gradient where each filter's sum is cut into many chunks (on CUDA): planes of a
    multiple of 8 positions and not, 3, 20 and 64 filters (16-byte granules and element loads
    channels last), the kernel's own leading batch of 2; against the float64 sum of the same dy,
    and bitwise the same when run again. On CUDA the target called without its scratch result
    (as programs serialized before it had one: one pass per filter) meets the same bound."""
    from jax_kernels import conv as conv_module
    for seed, (n, k, p, q) in enumerate(((16, 64, 32, 32), (7, 20, 37, 41), (9, 3, 30, 31))):
        shape = (2, n, k, p, q) if layout == "NCHW" else (2, n, p, q, k)
        dy = random(40 + seed, shape, dtype)
        axes = (1, 3, 4) if layout == "NCHW" else (1, 2, 3)
        expected = np.sum(np.asarray(dy.astype(jnp.float64)), axis=axes)
        scale = np.sum(np.abs(np.asarray(dy.astype(jnp.float64))), axis=axes).max()
        bgrad = jax.jit(lambda dy: conv_module._bias_gradient(dy, layout))
        accumulate = 1e-13 if dtype == jnp.float64 else 1e-6

        def check(got):
            # float32 (float64) sums over |dy|, then one rounding to dtype.
            assert got.dtype == dtype and got.shape == (2, k)
            error = np.abs(np.asarray(got.astype(jnp.float64)) - expected)
            bound = float(jnp.finfo(dtype).eps) * np.abs(expected) + accumulate * scale
            assert np.all(error <= bound), (error.max(), (error - bound).max())

        got = bgrad(dy)
        check(got)
        np.testing.assert_array_equal(np.asarray(bgrad(dy)), np.asarray(got))
        if ON_GPU:
            check(jax.jit(lambda dy: _ffi.call(
                conv_module._target("jk_conv2d_bwd_bias", layout),
                jax.ShapeDtypeStruct((2, k), dtype), dy))(dy))


# NCHW through the layout kernel's transposes (two-byte elements move as pairs of columns with
# 16-byte accesses where rows allow 4-element ones): the benchmark's 3x3 64->64 over 56x56, and
# ragged tiles (72 channels: a second tile of 8 rows; 30x30 pixels: rows on 4 elements but not
# 8, a last tile of 4 columns).
@pytest.mark.skipif(not ON_GPU, reason="the tensor-core path's layout kernels run on a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(32, 64, 56, 56), (40, 72, 30, 30)], ids=str)
def test_nchw_layout_transposes_match_lax(dtype, shape):
    """Forward, dgrad and wgrad against lax.conv in float32 at HIGHEST precision (cuDNN) on the
    same values."""
    N, C, H, W = shape
    x, w, dy = random(21, shape, dtype), random(22, (C, C, 3, 3), dtype), random(23, shape, dtype)
    y, vjp = jax.vjp(jax.jit(lambda x, w: jk.conv2d(x, w, padding=1)), x, w)
    got = (y,) + vjp(dy)

    def reference(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), [(1, 1)] * 2,
                                            precision=jax.lax.Precision.HIGHEST)

    f32 = lambda a: a.astype(jnp.float32)
    y_ref, vjp_ref = jax.vjp(reference, f32(x), f32(w))
    expected = (y_ref,) + vjp_ref(f32(dy))
    tolerance = 1e-3 if dtype == jnp.float32 else rtol(dtype)  # float32 runs as TF32
    for name, a, e in zip(("output", "d_input", "d_weight"), got, expected):
        assert a.dtype == dtype, name
        assert_close(a, e, rtol_=tolerance), name


# NCHW outputs of one group with unpadded channels, which the Hopper fprop's epilogue writes NCHW
# through shared memory (forward y and unit-stride dgrad's dx; elsewhere the NHWC result is
# transposed): planes of odd sizes (63, 143 pixels: images straddle the 128-pixel tiles, single
# stores), planes of 60 pixels (8-byte vectors of half types, 16-byte ones of float32) and 360
# (16-byte vectors), a last partial tile of filters (136 = 128 + 8, and dgrad's 72 = 64 + 8
# channels), bias, stride and dilation.
NCHW_OUTPUTS = [
    ((3, 16, 7, 9), (24, 16, 3, 3), dict(padding=1), True),
    ((2, 16, 6, 10), (32, 16, 3, 3), dict(padding=1), True),
    ((5, 32, 13, 11), (136, 32, 3, 3), dict(stride=2, padding=1), True),
    ((2, 24, 20, 18), (40, 24, 3, 3), dict(padding=2, dilation=2), False),
    ((2, 72, 11, 13), (64, 72, 5, 5), dict(padding=2), True),
]


@pytest.mark.skipif(not ON_GPU, reason="the tensor-core path runs on a GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("geometry", NCHW_OUTPUTS, ids=_id)
def test_nchw_outputs_match_lax_and_the_bits_of_nhwc(dtype, geometry):
    """Forward and every gradient against lax.conv in float32 at HIGHEST precision on the same
    values, and the bits of the channels-last path (the same GEMM, written NHWC) transposed."""
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = operands(24, shape_x, shape_w, bias, dtype, options)
    got = jk_conv(x, w, b, dy, **options)

    stride = options.get("stride", 1)
    dilation = options.get("dilation", 1)
    pad = options["padding"]

    def reference(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, (stride,) * 2, [(pad, pad)] * 2,
                                         rhs_dilation=(dilation,) * 2,
                                         precision=jax.lax.Precision.HIGHEST)
        return y if b is None else y + b[None, :, None, None]

    f32 = lambda a: None if a is None else a.astype(jnp.float32)
    y_ref, vjp_ref = jax.vjp(reference, f32(x), f32(w), f32(b))
    expected = (y_ref,) + vjp_ref(f32(dy))
    tolerance = 1e-3 if dtype == jnp.float32 else rtol(dtype)  # float32 runs as TF32
    for name, a, e in zip(("output", "d_input", "d_weight", "d_bias"), got, expected):
        if e is not None:
            assert a.dtype == dtype, name
            assert_close(a, e, rtol_=tolerance), name

    nhwc = jax.jit(lambda x, w, b: jk.conv2d(x, w, b, data_format="NHWC", **options))
    y_last = nhwc(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), b)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(y_last.transpose(0, 3, 1, 2)))
    dx_last = jax.vjp(lambda x: nhwc(x, w.transpose(2, 3, 1, 0), b), x.transpose(0, 2, 3, 1))[1](
        dy.transpose(0, 2, 3, 1))[0]
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(dx_last.transpose(0, 3, 1, 2)))


# float32 weight gradients of one group, filters of more than one tap, 16 or more channels and
# filters and batches of 16 or more, which Hopper runs as TF32 over copies of dy and x with the
# batch innermost (implicit_gemm_sm90_wgrad_tf32.cuh; elsewhere the Sm80 kernel runs them): box
# rows of 16 and of 32 images with batch tails (17, 33, 40 images), 5x5 filters (tap groups of 3
# and 2) and 2x2 ones (a group of 2), dilation, asymmetric planes and padding past the filter's
# reach, filters and channels past a 64-wide tile (72, 96), channels off the 4-wide access (18,
# partials at a pitch of 20), strides (2, and 2 x 3 with dilation along W; the 2x2/2
# downsampling of ConvNeXt). Channels-last filters of under 9 taps (the 2x2 ones) run the Sm80
# kernel, which reads them in place (these cases then check that kernel).
BATCH_INNER_WGRAD = [
    ((16, 64, 12, 12), (64, 64, 3, 3), dict(padding=1), False),
    ((17, 72, 9, 11), (96, 72, 3, 3), dict(padding=1), False),
    ((33, 16, 8, 7), (24, 16, 5, 5), dict(padding=2), False),
    ((40, 32, 10, 9), (40, 32, 3, 3), dict(padding=(2, 3), dilation=2), False),
    ((16, 24, 5, 6), (16, 24, 2, 2), dict(padding=1), False),
    ((16, 18, 7, 9), (20, 18, 3, 3), dict(padding=1), False),
    ((32, 32, 15, 14), (40, 32, 3, 3), dict(stride=2, padding=1), False),
    ((17, 24, 11, 13), (16, 24, 3, 3), dict(stride=(2, 3), padding=(1, 2), dilation=(1, 2)), False),
    ((33, 32, 8, 8), (48, 32, 2, 2), dict(stride=2), False),
]


@pytest.mark.skipif(not ON_GPU, reason="the tensor-core path runs on a GPU")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("geometry", BATCH_INNER_WGRAD, ids=_id)
def test_float32_weight_gradient_of_large_batches_matches_lax(layout, geometry):
    """The weight gradient against lax.conv at HIGHEST precision (float32 runs as TF32), and
    the same bits from two calls (fixed split, ordered slice sum)."""
    shape_x, shape_w, options, _ = geometry
    x, w, _, dy = operands(25, shape_x, shape_w, False, jnp.float32, options)
    pad = options.get("padding", 0)
    pad = (pad, pad) if isinstance(pad, int) else pad
    pair = lambda v: (v, v) if isinstance(v, int) else v
    stride, dilation = pair(options.get("stride", 1)), pair(options.get("dilation", 1))

    def reference(w):
        return jax.lax.conv_general_dilated(x, w, stride, [(pad[0], pad[0]), (pad[1], pad[1])],
                                            rhs_dilation=dilation,
                                            precision=jax.lax.Precision.HIGHEST)

    expected = jax.vjp(reference, w)[1](dy)[0]
    if layout == "NHWC":
        x, dy, w = x.transpose(0, 2, 3, 1), dy.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0)
        expected = expected.transpose(2, 3, 1, 0)
    weight_gradient = jax.jit(lambda x, w, dy: jax.vjp(
        lambda w: jk.conv2d(x, w, data_format=layout, **options), w)[1](dy)[0])
    got = weight_gradient(x, w, dy)
    assert got.dtype == jnp.float32
    assert_close(got, expected, rtol_=1e-3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(weight_gradient(x, w, dy)))


def assert_same_non_finite(got, expected):
    """got (float32) has expected's (float64) NaN, +Inf and -Inf pattern, with some of each kind
    of element, and close finite values (TF32's tolerance)."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(expected))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    assert finite.sum() > 0 and (~finite).sum() > 0
    assert_close(got[finite], expected[finite].astype(np.float32), rtol_=1e-3)


@pytest.mark.skipif(not ON_GPU, reason="the tensor-core path runs on a GPU")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("n, dilation", [(17, 1), (33, 1), (33, 2)])
def test_float32_weight_gradient_forms_only_defined_products(layout, n, dilation):
    """An infinite x at the last column reaches only the taps that read it: against a float64
    NumPy reference (products summed elementwise, no BLAS), the same NaN and infinity pattern and
    close finite values. 17 images take box rows of 16 images and 2 pixels, here with a pixel
    past the odd Q = 7 (its dy is zeros: 0 x inf would be a NaN the convolution does not
    define); 33 images take rows of 32 (one box for a tap group, and a box per tap at
    dilation 2)."""
    x = np.asarray(random(40, (n, 8, 6, 7), jnp.float32), np.float64)
    x[n - 1, 0, 3, 6] = np.inf
    w = random(41, (8, 8, 3, 3), jnp.float32)
    options = dict(padding=dilation, dilation=dilation)
    dy = np.asarray(random(42, (n, 8, 6, 7), jnp.float32), np.float64)
    padded = np.pad(x, ((0, 0), (0, 0), (dilation, dilation), (dilation, dilation)))
    expected = np.zeros((8, 8, 3, 3))
    for r in range(3):
        for s in range(3):
            window = padded[:, :, r * dilation:r * dilation + 6, s * dilation:s * dilation + 7]
            expected[:, :, r, s] = (dy[:, :, None] * window[:, None]).sum(axis=(0, 3, 4))
    x32, dy32 = jnp.asarray(x, jnp.float32), jnp.asarray(dy, jnp.float32)
    if layout == "NHWC":
        x32, dy32 = x32.transpose(0, 2, 3, 1), dy32.transpose(0, 2, 3, 1)
        w = w.transpose(2, 3, 1, 0)
        expected = expected.transpose(2, 3, 1, 0)
    got = np.asarray(jax.jit(lambda x, w, dy: jax.vjp(
        lambda w: jk.conv2d(x, w, data_format=layout, **options), w)[1](dy)[0])(x32, w, dy32))
    assert_same_non_finite(got, expected)


def strided_input_gradient_numpy(dy, w, side, stride, pad):
    """dx [n][C][side][side] of a square conv from dy [n][K][out][out] and w [K][C][taps][taps],
    float64, each tap's products summed elementwise (a non-finite dy reaches only the pixels its
    taps read)."""
    n, taps, out = dy.shape[0], w.shape[2], dy.shape[2]
    expected = np.zeros((n, w.shape[1], side, side))
    for p in range(out):
        for q in range(out):
            for r in range(taps):
                for s in range(taps):
                    h, v = p * stride + r - pad, q * stride + s - pad
                    if 0 <= h < side and 0 <= v < side:
                        expected[:, :, h, v] += (dy[:, :, None, p, q] * w[None, :, :, r, s]).sum(1)
    return expected


# Strided input gradients on Hopper run as one unit-stride fprop per stride phase
# (dgrad_phases.cuh): each dx pixel gets only the products of the taps that reach it, and a phase
# no tap reaches (2x2/3, 1x1/2) is zeros.
@pytest.mark.skipif(not HOPPER, reason="the stride phases run on a Hopper GPU")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("taps, stride, pad", [(3, 2, 1), (2, 3, 0), (1, 2, 0), (7, 2, 3)],
                         ids=str)
def test_strided_input_gradient_forms_only_defined_products(layout, taps, stride, pad):
    """Infinities in dy reach only the dx pixels whose taps read them: against a float64 NumPy
    reference (products summed elementwise), the same NaN and infinity pattern and close finite
    values. (test_nchw_outputs_match_lax_and_the_bits_of_nhwc compares the layouts' bits.)"""
    n, channels, filters, side = 2, 8, 16, 13
    out = (side + 2 * pad - taps) // stride + 1
    dy = np.asarray(random(45, (n, filters, out, out), jnp.float32), np.float64)
    dy[1, 3, out - 1, 0] = np.inf
    dy[0, 5, 1, out - 2] = -np.inf
    w = np.asarray(random(46, (filters, channels, taps, taps), jnp.float32), np.float64)
    expected = strided_input_gradient_numpy(dy, w, side, stride, pad)
    x = jnp.zeros((n, channels, side, side), jnp.float32)
    dy32, w32 = jnp.asarray(dy, jnp.float32), jnp.asarray(w, jnp.float32)
    options = dict(stride=stride, padding=pad)
    if layout == "NHWC":
        x, dy32, w32 = x.transpose(0, 2, 3, 1), dy32.transpose(0, 2, 3, 1), w32.transpose(2, 3, 1, 0)
    got = np.asarray(jax.jit(lambda x, w, dy: jax.vjp(
        lambda x: jk.conv2d(x, w, data_format=layout, **options), x)[1](dy)[0])(x, w32, dy32))
    if layout == "NHWC":
        got = got.transpose(0, 3, 1, 2)
    assert_same_non_finite(got, expected)
    if stride * stride > taps * taps:
        assert (got == 0).any()  # a phase no tap reaches


@pytest.mark.skipif(not HOPPER, reason="the stride phases run on a Hopper GPU")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("taps, stride, pad",
                         [(3, 2, 1), (4, 4, 0), (2, 2, 0), (1, 2, 0), (7, 2, 3), (6, 2, 2)],
                         ids=str)
def test_strided_input_gradient_streams_give_the_bits_of_one(monkeypatch, layout, taps, stride,
                                                             pad):
    """The stride phases run spread over side streams forked off XLA's (4 streams unless
    JAX_KERNELS_PHASE_STREAMS says otherwise, read at every call), column phases of equal taps
    merged into one fprop (unless JAX_KERNELS_PHASE_MERGE=0): as they write disjoint pixels,
    one stream, two, the default and unmerged phases give the same bits, close to float64
    NumPy. 4x4/4 has 16 phases (over 30 columns, columns 0-1 and 2-3 merge: 8 and 7 pixels
    wide), 2x2/2 and 6x6/2 two merged fprops, 1x1/2 one phase and the zeros of the other three
    (written beside it), 7x7/2 four of 9 to 16 taps (none merged). Two threads calling at once
    take turns on the side streams (a lock) and get the same bits."""
    n, channels, filters, side = 3, 16, 24, 30
    out = (side + 2 * pad - taps) // stride + 1
    dy = np.asarray(random(47, (n, filters, out, out), jnp.float32), np.float64)
    w = np.asarray(random(48, (filters, channels, taps, taps), jnp.float32), np.float64)
    expected = strided_input_gradient_numpy(dy, w, side, stride, pad)
    x = jnp.zeros((n, channels, side, side), jnp.float32)
    dy32, w32 = jnp.asarray(dy, jnp.float32), jnp.asarray(w, jnp.float32)
    if layout == "NHWC":
        x, dy32, w32 = x.transpose(0, 2, 3, 1), dy32.transpose(0, 2, 3, 1), w32.transpose(2, 3, 1, 0)
    dgrad = jax.jit(lambda x, w, dy: jax.vjp(lambda x: jk.conv2d(
        x, w, stride=stride, padding=pad, data_format=layout), x)[1](dy)[0])

    def poisoned_dgrad():
        # A freed buffer of dx's size full of NaNs, which the allocator is likely to hand dx
        # next: a pixel the phases and the zeros left unwritten would show.
        poison = jnp.full(x.shape, jnp.nan, jnp.float32).block_until_ready()
        del poison
        return np.asarray(dgrad(x, w32, dy32))

    bits = {}
    for streams, merge in (("1", ""), ("2", ""), ("", ""), ("", "0"), ("1", "0")):
        monkeypatch.setenv("JAX_KERNELS_PHASE_STREAMS", streams)
        monkeypatch.setenv("JAX_KERNELS_PHASE_MERGE", merge)
        bits[streams, merge] = poisoned_dgrad()
    monkeypatch.setenv("JAX_KERNELS_PHASE_STREAMS", "")
    monkeypatch.setenv("JAX_KERNELS_PHASE_MERGE", "")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        threaded = list(pool.map(lambda i: np.asarray(dgrad(x, w32, dy32)), range(4)))
    for got in list(bits.values()) + threaded:
        assert got.tobytes() == bits["1", ""].tobytes()
    got = bits["", ""] if layout == "NCHW" else bits["", ""].transpose(0, 3, 1, 2)
    assert_close(got, expected, rtol_=1e-3)  # TF32


@pytest.mark.skipif(not _ffi.CUDA_BUILT, reason="the CUDA module is not built")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_tensor_core_path_declines_past_cutlass_int_indexing(layout):
    """CUTLASS indexes each tensor in int (int strides, GEMM extents such as N*P*Q formed in
    int): the tensor-core path takes a dense float16 3x3 conv whose input is just under 2 GiB
    and declines it just over, and a 1x1 conv whose N*P*Q passes 2^31 (the direct kernels run
    those; their forward needs no scratch, the tensor-core path's does)."""
    def forward_scratch(n, c, k, taps):
        return _ffi.query("conv2d_scratch", **{"pass": _ffi.ENUMS["ConvPass"]["forward"]},
                          dtype=_ffi.ENUMS["ConvDtype"]["float16"],
                          layout=_ffi.ENUMS["ConvLayout"][layout], N=n, C=c, H=64, W=64, K=k,
                          R=taps, S=taps, P=64, Q=64, stride_h=1, stride_w=1, pad_top=taps // 2,
                          pad_left=taps // 2, dilation_h=1, dilation_w=1, groups=1, precision=0)
    images_2gib = 2**31 // (16 * 64 * 64 * 2)
    assert forward_scratch(images_2gib - 1, 16, 16, 3) > 0
    assert forward_scratch(images_2gib + 1, 16, 16, 3) == 0
    assert forward_scratch(2**31 // (64 * 64) + 1, 8, 8, 1) == 0


# --- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape, w_shape, options, message", [
    ((1, 4, 8, 8), (2, 3, 3, 3), dict(), "expects 3 input channels"),
    ((1, 4, 8, 8), (3, 2, 3, 3), dict(groups=2), "divisible by groups=2"),
    ((1, 4, 8, 8), (6, 2, 3, 3), dict(groups=3), "expects 6 input channels"),
    ((1, 4, 8, 8), (2, 4, 3, 3), dict(groups=0), "groups must be positive"),
    ((1, 4, 3, 3), (2, 4, 5, 5), dict(), "larger than the padded input"),
    ((1, 4, 8, 8), (2, 4, 3, 3), dict(dilation=4), "larger than the padded input"),
    ((1, 4, 8, 8), (2, 4, 3, 3), dict(stride=0), "stride must be positive"),
    ((1, 4, 8, 8), (2, 4, 3, 3), dict(dilation=(1, -1)), "dilation must be positive"),
    ((1, 4, 8, 8), (2, 4, 3, 3), dict(padding="full"), "padding must be"),
    ((1, 4, 8, 8), (2, 4, 3, 3), dict(padding=-1), "non-negative"),
    ((1, 4, 8, 8), (2, 4, 3, 3), dict(padding="same", stride=2), "strided"),
    ((1, 4, 8, 8), (2, 4, 3, 3), dict(precision="fast"), "precision"),
    ((4, 8, 8), (2, 4, 3), dict(), "weight of shape"),
    ((8, 8), (2, 4, 3, 3), dict(), "input of shape"),
])
def test_trace_time_errors(x_shape, w_shape, options, message):
    x, w = jnp.zeros(x_shape), jnp.zeros(w_shape)
    with pytest.raises(ValueError, match=message) as info:
        jax.jit(lambda x, w: jk.conv2d(x, w, **options)).trace(x, w)
    assert "conv2d()" in str(info.value)


def test_type_errors():
    x, w = jnp.zeros((1, 2, 5, 5), jnp.float32), jnp.zeros((3, 2, 3, 3), jnp.float32)
    with pytest.raises(TypeError, match="conv2d"):
        jk.conv2d(x, w.astype(jnp.float16))
    with pytest.raises(TypeError, match="conv2d"):
        jk.conv2d(x, w, jnp.zeros((3,), jnp.bfloat16))
    with pytest.raises(TypeError, match="conv2d"):
        jk.conv2d(x.astype(jnp.int32), w.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"bias of shape \(3,\)"):
        jk.conv2d(x, w, jnp.zeros((4,), jnp.float32))


# --- determinism (GPU) ---------------------------------------------------------------------------

@pytest.mark.skipif(not ON_GPU, reason="the CPU kernels are deterministic by construction")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float64])
@pytest.mark.parametrize("geometry", [GEOMETRIES[i] for i in (9, 13, 18, 22)], ids=_id)
def test_gradients_are_bitwise_reproducible(dtype, geometry):
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = operands(24, shape_x, shape_w, bias, dtype, options)
    grads = jax.jit(lambda x, w, b, dy: jax.vjp(
        lambda x, w, b: jk.conv2d(x, w, b, **options), x, w, b)[1](dy))
    first = [np.asarray(g) for g in grads(x, w, b, dy) if g is not None]
    for _ in range(20):
        for a, e in zip(grads(x, w, b, dy), first):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), e.view(np.uint8))


# lax.conv's and Flax's padding forms, against lax.conv itself (which takes them natively).
LAX_PADDINGS = [
    ("SAME", (1, 1), (1, 1), (3, 3)),
    ("SAME", (2, 2), (1, 1), (3, 3)),
    ("SAME", (2, 3), (1, 2), (4, 2)),   # even kernel, strided, dilated: asymmetric totals
    ("SAME", (3, 1), (1, 1), (2, 5)),
    ("SAME_LOWER", (2, 2), (1, 1), (4, 4)),
    ("SAME_LOWER", (1, 1), (2, 1), (2, 3)),
    ("VALID", (2, 1), (1, 1), (3, 3)),
    (((1, 0), (1, 0)), (1, 1), (1, 1), (2, 2)),
    (((0, 2), (3, 1)), (2, 1), (1, 2), (3, 3)),
    ([[2, 2], [0, 0]], (1, 3), (1, 1), (5, 1)),
]


@pytest.mark.parametrize("padding,stride,dilation,kernel", LAX_PADDINGS, ids=str)
def test_lax_padding_forms_match_lax_conv(padding, stride, dilation, kernel):
    x = random(30, (2, 4, 11, 10), jnp.float64)
    w = random(31, (6, 2) + kernel, jnp.float64)
    b = random(32, (6,), jnp.float64)
    ours = lambda x, w, b: jk.conv2d(x, w, b, stride, padding, dilation, groups=2)
    lax_padding = padding if isinstance(padding, str) else [tuple(p) for p in padding]
    ref = lambda x, w, b: jax.lax.conv_general_dilated(
        x, w, stride, lax_padding, rhs_dilation=dilation, feature_group_count=2,
        precision=jax.lax.Precision.HIGHEST) + b[None, :, None, None]
    assert_close(ours(x, w, b), ref(x, w, b), jnp.float64)
    loss = lambda f: lambda *a: jnp.sum(jnp.tanh(f(*a)) ** 2)
    for got, want in zip(jax.grad(loss(ours), (0, 1, 2))(x, w, b),
                         jax.grad(loss(ref), (0, 1, 2))(x, w, b)):
        assert_close(got, want, jnp.float64)


@pytest.mark.parametrize("padding,error", [
    ("full", ValueError), ("same_lower", ValueError), (((1, 0), (1, 0, 2)), ValueError),
    (((1, -1), (0, 0)), ValueError), (((1.5, 0), (0, 0)), TypeError), ((1, 2, 3), ValueError),
    (1.5, TypeError),
])
def test_padding_errors_show_the_whole_value(padding, error):
    x, w = random(33, (1, 2, 6, 6)), random(34, (2, 2, 3, 3))
    with pytest.raises(error, match=r"conv2d\(\): padding must be") as info:
        jk.conv2d(x, w, padding=padding)
    if not isinstance(padding, str):
        assert repr(padding) in str(info.value)
