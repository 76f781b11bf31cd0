"""Tests of channels-last conv2d (data_format="NHWC": NHWC input, HWIO weights, NPQK output, the
jk_conv2d_nhwc_* targets): against torch (float64 on the CPU, the oracle of test_conv.py, through
transposes done in the test only), against lax.conv with ("NHWC", "HWIO", "NHWC"), against the
NCHW form, every derivative (forward and reverse, second order), batching, the compiled program
(no transpose of a batch-sized tensor), partitioning, determinism and errors. The same file runs
with JAX_PLATFORMS=cuda,cpu, where the tensor-core path takes the aligned dense problems in place
and the direct channels-last kernels the rest."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_kernels as jk
from jk_testing import ON_GPU, TORCH_UNAVAILABLE, assert_close, random, rtol, torch
from test_conv import GEOMETRIES, HOPPER, _id, jk_conv, operands, torch_conv

needs_torch = pytest.mark.skipif(torch is None, reason=TORCH_UNAVAILABLE)
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")

NHWC_TARGETS = ("jk_conv2d_nhwc_fwd", "jk_conv2d_nhwc_bwd_input", "jk_conv2d_nhwc_bwd_weight",
                "jk_conv2d_nhwc_bwd_bias")


def to_nhwc(a):
    return None if a is None else jnp.transpose(a, (0, 2, 3, 1))


def to_hwio(w):
    return jnp.transpose(w, (2, 3, 1, 0))


def nhwc_operands(seed, shape_x, shape_w, bias, dtype, options):
    """x [N, H, W, C], w HWIO, b, dy [N, P, Q, K] from torch-layout shapes."""
    N, C, H, W = shape_x
    K, Cg, R, S = shape_w
    x = random(seed, (N, H, W, C), dtype)
    w = random(seed + 1, (R, S, Cg, K), dtype)
    b = random(seed + 2, (K,), dtype) if bias else None
    y = jax.eval_shape(lambda x, w: jk.conv2d(x, w, None, data_format="NHWC", **options), x, w)
    dy = random(seed + 3, y.shape, dtype)
    return x, w, b, dy


def jk_nhwc(x, w, b, dy, **options):
    def f(x, w, b):
        return jk.conv2d(x, w, b, data_format="NHWC", **options)

    y, vjp = jax.vjp(jax.jit(f), x, w, b)
    return (y,) + vjp(dy)


def torch_nhwc(x, w, b, dy, **options):
    """torch's results for NHWC operands, moved back to NHWC / HWIO (float64 NumPy)."""
    nchw = lambda a: None if a is None else jnp.transpose(a, (0, 3, 1, 2))
    y, dx, dw, db = torch_conv(nchw(x), jnp.transpose(w, (3, 2, 0, 1)), b, nchw(dy), **options)
    back = lambda a: np.transpose(a, (0, 2, 3, 1))
    return back(y), back(dx), np.transpose(dw, (2, 3, 1, 0)), db


@needs_torch
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_id)
def test_float64_matches_torch(geometry):
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = nhwc_operands(0, shape_x, shape_w, bias, jnp.float64, options)
    expected = torch_nhwc(x, w, b, dy, **options)
    got = jk_nhwc(x, w, b, dy, **options)
    for name, a, e in zip(("output", "d_input", "d_weight", "d_bias"), got, expected):
        if e is not None:
            assert a.shape == e.shape, name
            assert_close(a, e, jnp.float64), name


# Dense problems with channel counts on the 128-bit access (the GPU's tensor-core path takes
# them in place: fprop, unit-stride dgrad as fprop, strided dgrad, wgrad), and ones it declines.
LOW_PRECISION = [
    ((2, 16, 12, 12), (16, 16, 3, 3), dict(padding=1), True),
    ((2, 16, 11, 12), (32, 16, 3, 3), dict(stride=2, padding=1), True),
    ((2, 32, 9, 9), (16, 32, 1, 1), dict(), True),
    ((1, 8, 15, 13), (8, 8, 5, 5), dict(padding=2, dilation=(1, 2)), False),
    ((2, 3, 14, 14), (16, 3, 7, 7), dict(stride=2, padding=3), True),  # a stem: C = 3
    ((2, 16, 10, 10), (16, 1, 3, 3), dict(padding=1, groups=16), True),  # depthwise
    # depthwise 7x7 and 5x5 (channel multiplier 2): the GPU's depthwise block and rows kernels,
    # with row and column tails
    ((2, 6, 13, 19), (6, 1, 7, 7), dict(padding=3, groups=6), True),
    ((1, 4, 9, 21), (8, 1, 5, 5), dict(padding=2, groups=4), False),
    ((2, 32, 8, 8), (32, 16, 3, 3), dict(padding=1, groups=2), False),
    # depthwise with one filter per channel and an even channel count: the GPU's channel-pair
    # kernels in half types. 35 pairs (a second block of 32 with 3 live lanes), three column
    # chunk groups, two row slices, padding past the taps' reach on the columns; 3x3 unpadded
    # with three images; 7x7 in five row slices of 8.
    ((2, 70, 17, 37), (70, 1, 5, 5), dict(padding=(2, 3), groups=70), False),
    ((3, 8, 9, 11), (8, 1, 3, 3), dict(groups=8), True),
    ((1, 64, 40, 20), (64, 1, 7, 7), dict(padding=3, groups=64), True),
]


@needs_torch
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("geometry", LOW_PRECISION, ids=_id)
def test_low_precision_relative_error(dtype, geometry):
    """Half types accumulate in float32; float32 with precision='highest' is full precision on
    every path. The oracle is float64 on the same (rounded) inputs."""
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = nhwc_operands(1, shape_x, shape_w, bias, dtype, options)
    as64 = lambda a: None if a is None else a.astype(jnp.float64)
    expected = torch_nhwc(as64(x), as64(w), as64(b), as64(dy), **options)
    got = jk_nhwc(x, w, b, dy, precision="highest", **options)
    for name, a, e in zip(("output", "d_input", "d_weight", "d_bias"), got, expected):
        if e is not None:
            assert a.dtype == dtype, name
            assert_close(a, e, dtype), name


@pytest.mark.parametrize("geometry", LOW_PRECISION[:3], ids=_id)
def test_float32_default_precision_matches_lax(geometry):
    """precision=None may use TF32 on the GPU's tensor cores (1e-3 relative there); lax.conv in
    NHWC/HWIO at HIGHEST precision is the oracle."""
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = nhwc_operands(2, shape_x, shape_w, bias, jnp.float32, options)
    got = jk_nhwc(x, w, b, dy, **options)

    def reference(x, w, b):
        stride = options.get("stride", 1)
        pad = options.get("padding", 0)
        y = jax.lax.conv_general_dilated(
            x.astype(jnp.float64), w.astype(jnp.float64), (stride, stride),
            [(pad, pad), (pad, pad)], dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision="highest")
        return y + b.astype(jnp.float64)

    y, vjp = jax.vjp(reference, x, w, b)
    expected = (y,) + vjp(dy.astype(jnp.float64))
    tolerance = 1e-3 if ON_GPU else rtol(jnp.float32)
    for a, e in zip(got, expected):
        assert_close(a, np.asarray(e), rtol_=tolerance)


@pytest.mark.parametrize("geometry", [GEOMETRIES[i] for i in (0, 2, 9, 13, 16)], ids=_id)
def test_same_numbers_as_nchw(geometry):
    """The NHWC form against the NCHW form on the same values (transposed in the test)."""
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = nhwc_operands(3, shape_x, shape_w, bias, jnp.float32, options)
    got = jk_nhwc(x, w, b, dy, precision="highest", **options)

    def nchw(x, w, b):
        return jk.conv2d(x, w, b, precision="highest", **options)

    xt, wt = jnp.transpose(x, (0, 3, 1, 2)), jnp.transpose(w, (3, 2, 0, 1))
    y, vjp = jax.vjp(nchw, xt, wt, b)
    dx, dw, db = vjp(jnp.transpose(dy, (0, 3, 1, 2)))
    expected = (to_nhwc(y), to_nhwc(dx), to_hwio(dw), db)
    for a, e in zip(got, expected):
        if e is not None:
            assert_close(a, e, jnp.float32)


@pytest.mark.parametrize("groups", [1, 2])
def test_check_grads_forward_and_reverse_second_order(groups):
    x = random(4, (2, 6, 7, 2), jnp.float64)
    w = random(5, (3, 2, 2 // groups, 4), jnp.float64)
    b = random(6, (4,), jnp.float64)
    f = lambda x, w, b: jk.conv2d(x, w, b, stride=(1, 2), padding=(1, 0), dilation=(2, 1),
                                  groups=groups, data_format="NHWC")
    check_grads(f, (x, w, b), order=2, modes=("fwd", "rev"))


def test_unbatched_input_and_empty_batch():
    x = random(7, (8, 9, 3), jnp.float64)
    w = random(8, (3, 3, 3, 4), jnp.float64)
    y = jk.conv2d(x, w, data_format="NHWC")
    expected = jk.conv2d(x[None], w, data_format="NHWC")[0]
    assert y.shape == (6, 7, 4)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))
    lax = jax.lax.conv_general_dilated(x[None], w, (1, 1), "VALID",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                       precision="highest")[0]
    assert_close(y, lax, jnp.float64)
    empty = jnp.zeros((0, 8, 9, 3), jnp.float32)
    w32 = w.astype(jnp.float32)
    assert jk.conv2d(empty, w32, data_format="NHWC").shape == (0, 6, 7, 4)
    dw = jax.grad(lambda w: jnp.sum(jk.conv2d(empty, w, data_format="NHWC")))(w32)
    np.testing.assert_array_equal(np.asarray(dw), 0)


# --- batching --------------------------------------------------------------------------------

OPTIONS = dict(stride=(2, 1), padding=((1, 0), (2, 1)), dilation=(1, 2), groups=2)


def _lax(x, w, b):
    y = jax.lax.conv_general_dilated(x, w, OPTIONS["stride"], OPTIONS["padding"],
                                     rhs_dilation=OPTIONS["dilation"],
                                     feature_group_count=OPTIONS["groups"],
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                     precision="highest")
    return y + b


def _jk(x, w, b):
    return jk.conv2d(x, w, b, data_format="NHWC", **OPTIONS)


@pytest.mark.parametrize("axes", [(0, None, None), (None, 0, None), (0, 0, 0), (None, 0, 0),
                                  (1, 2, None)])
def test_vmap_forward_and_gradients(axes):
    """vmap over the input, the weights, the bias or all, at several axes, and vmap of every
    gradient, against lax.conv (which batches on its own)."""
    B = 3
    x = random(10, (2, 7, 8, 4), jnp.float64)
    w = random(11, (3, 2, 2, 6), jnp.float64)
    b = random(12, (6,), jnp.float64)
    args = []
    for a, axis in zip((x, w, b), axes):
        args.append(a if axis is None else jnp.stack([a * (i + 1) for i in range(B)], axis))
    y = jax.vjp(_jk, x, w, b)[0]
    ct = random(13, (B,) + y.shape, jnp.float64)
    got = jax.vmap(_jk, in_axes=axes)(*args)
    expected = jax.vmap(_lax, in_axes=axes)(*args)
    assert_close(got, expected, jnp.float64)

    def grads(f):
        def one(x, w, b, ct):
            return jax.vjp(f, x, w, b)[1](ct)
        return jax.vmap(one, in_axes=axes + (0,))(*args, ct)

    for a, e in zip(grads(_jk), grads(_lax)):
        assert_close(a, e, jnp.float64)


# --- the compiled program ------------------------------------------------------------------------

_TRANSPOSE = re.compile(r"= \w+\[([\d,]*)\]\{[^}]*\} transpose\(")


def batch_sized_transposes(fn, *args, threshold: int) -> list[int]:
    """Element counts of the transposes in the compiled program with at least `threshold`."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for dims in _TRANSPOSE.findall(text)]
    return [s for s in sizes if s >= threshold]


def test_no_transpose_of_a_batch_sized_tensor():
    x = random(20, (4, 12, 12, 16), jnp.float32)
    w = random(21, (3, 3, 16, 16), jnp.float32)
    b = random(22, (16,), jnp.float32)

    def step(x, w, b):
        def loss(x, w, b):
            y = jk.conv2d(x, w, b, padding=1, data_format="NHWC")
            return (jnp.tanh(y) ** 2).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, b)

    text = jax.jit(step).lower(x, w, b).as_text()
    for target in NHWC_TARGETS:
        assert target in text, target
    assert batch_sized_transposes(step, x, w, b, threshold=x.size // 2) == []

    # The check sees the transposes of an NCHW convolution on the same channels-last data.
    def transposed(x, w, b):
        def loss(x, w, b):
            y = jk.conv2d(jnp.transpose(x, (0, 3, 1, 2)), jnp.transpose(w, (3, 2, 0, 1)), b,
                          padding=1)
            return (jnp.tanh(jnp.transpose(y, (0, 2, 3, 1))) ** 2).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(x, w, b)

    assert batch_sized_transposes(transposed, x, w, b, threshold=x.size // 2) != []


def test_deterministic_bits():
    x = random(30, (4, 10, 10, 16), jnp.float32)
    w = random(31, (3, 3, 8, 16), jnp.float32)
    b = random(32, (16,), jnp.float32)
    loss = lambda x, w, b: (jk.conv2d(x, w, b, padding=1, groups=2, data_format="NHWC") ** 2).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first = [np.asarray(g) for g in grads(x, w, b)]
    for _ in range(2):
        for a, e in zip(grads(x, w, b), first):
            np.testing.assert_array_equal(np.asarray(a), e)


# --- errors ------------------------------------------------------------------------------------


def test_errors_name_the_op():
    x = jnp.zeros((2, 8, 8, 4))
    w = jnp.zeros((3, 3, 4, 6))
    with pytest.raises(ValueError, match=r"conv2d\(\): data_format must be 'NCHW' or 'NHWC'"):
        jk.conv2d(x, w, data_format="NCW")
    with pytest.raises(TypeError, match=r"conv2d\(\): data_format"):
        jk.conv2d(x, w, data_format=None)
    # KCRS weights given with NHWC: the channel counts do not match.
    with pytest.raises(ValueError, match=r"conv2d\(\): weight of shape \(6, 4, 3, 3\)"):
        jk.conv2d(x, jnp.zeros((6, 4, 3, 3)), data_format="NHWC")
    with pytest.raises(ValueError, match=r"conv2d\(\): expected input of shape \(N, H, W, C\)"):
        jk.conv2d(jnp.zeros((8, 8)), w, data_format="NHWC")
    with pytest.raises(ValueError, match=r"conv2d\(\): expected bias of shape \(6,\)"):
        jk.conv2d(x, w, jnp.zeros((4,)), data_format="NHWC")


# --- partitioning --------------------------------------------------------------------------------


def _cpu_devices():
    try:
        return jax.devices("cpu")[:8]
    except RuntimeError:
        return []


@pytest.mark.skipif(len(_cpu_devices()) < 8, reason="needs 8 CPU devices (conftest.py)")
def test_batch_sharded_on_8_devices():
    """Channels last keeps the batch sharded: the weight and bias gradients are reduced once
    (their own size), the activations never move."""
    m = Mesh(np.array(_cpu_devices()), ("batch",))
    put = lambda a, *spec: jax.device_put(a, NamedSharding(m, P(*spec)))
    x = jax.device_put(random(0, (16, 10, 9, 8), jnp.float64), jax.devices("cpu")[0])
    w = jax.device_put(random(1, (3, 3, 4, 8), jnp.float64), jax.devices("cpu")[0])
    b = jax.device_put(random(2, (8,), jnp.float64), jax.devices("cpu")[0])

    def loss(x, w, b):
        y = jk.conv2d(x, w, b, padding=1, stride=(1, 2), groups=2, data_format="NHWC")
        return (jnp.tanh(y) ** 2).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))
    args = (put(x, "batch"), put(w), put(b))
    shardings = tuple(NamedSharding(m, s) for s in (P("batch"), P(), P()))
    text = jax.jit(grads, out_shardings=shardings).lower(*args).compile().as_text()
    for kind in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert kind not in text, kind
    reduced = re.findall(r"= (.*?) all-reduce(?:-start)?\(", text)
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
             for types in reduced for dims in re.findall(r"\w+\[([\d,]*)\]", types)]
    assert sizes and max(sizes) <= w.size, sizes
    actual = jax.jit(grads, out_shardings=shardings)(*args)
    assert actual[0].sharding.spec == P("batch")
    with jax.default_device(jax.devices("cpu")[0]):
        expected = jax.jit(grads)(x, w, b)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-12, atol=1e-12)


# Dense problems the tensor-core path takes, for both kernel families (torch-layout shapes): a
# narrow and a wide filter tile, bias, stride 2 with padding, a 1x1 stride-2 conv that leaves the
# last input row unread, dilation, a unit-stride dgrad (an fprop on flipped weights) with
# padding on one side only, 3-channel stems (im2col, both column layouts), grouped convs and
# padded weights. Strided dgrads of one group run on Hopper as one fprop per stride phase
# (dgrad_phases.cuh): besides the two above (3x3/2 over an odd width; 1x1/2, whose phases past
# the first are zeros), six phases of 1 and 2 taps (stride 2 x 3), 7x7/2 (phases with top
# padding), 4x4/4 (16 phases of one tap), 2x2/3 (five of nine phases zeros), padded channels
# and filters, and 3x3/3 with padding 1 (a phase would need negative padding: the Sm80 kernel
# keeps it).
TENSOR_CORE_GEOMETRIES = [
    ((2, 16, 20, 33), (32, 16, 3, 3), dict(padding=1), True),
    ((2, 64, 14, 15), (128, 64, 3, 3), dict(stride=2, padding=1), True),
    ((2, 32, 16, 17), (64, 32, 1, 1), dict(stride=2), False),
    ((1, 8, 13, 11), (16, 8, 5, 3), dict(padding=(2, 0), dilation=(1, 2)), True),
    ((3, 24, 9, 10), (8, 24, 2, 2), dict(padding="same"), False),
    # Channels last off the access width, and groups: repacked into the kernels' layout.
    ((2, 3, 17, 18), (16, 3, 7, 7), dict(stride=2, padding=3), True),
    ((2, 32, 9, 10), (48, 16, 3, 3), dict(padding=1, groups=2), True),
    # Channels and filters both off the access width (zero-padded weights on both sides, through
    # the weights' tiled transpose when channels last), one group and two.
    ((2, 12, 11, 9), (20, 12, 3, 3), dict(padding=1), True),
    ((2, 36, 8, 9), (44, 18, 3, 2), dict(padding=1, groups=2), True),
    # Filters of 2^17 weights and more, which the weights' tiled transpose takes (HWIO forward
    # and strided dgrad; KCRS unit-stride dgrad): padded filters, padded channels in two
    # strided groups, a stem's im2col columns.
    ((2, 128, 5, 6), (132, 128, 3, 3), dict(padding=1), True),
    ((2, 200, 7, 6), (264, 100, 3, 3), dict(stride=2, padding=1, groups=2), False),
    ((1, 3, 12, 12), (896, 3, 7, 7), dict(stride=2, padding=3), True),
    # Strided dgrads by stride phase (above).
    ((2, 16, 13, 20), (24, 16, 3, 5), dict(stride=(2, 3), padding=(1, 2)), True),
    ((2, 32, 15, 16), (64, 32, 7, 7), dict(stride=2, padding=3), False),
    ((2, 16, 16, 18), (32, 16, 4, 4), dict(stride=4), False),
    ((2, 16, 10, 11), (16, 16, 2, 2), dict(stride=3), False),
    ((2, 20, 11, 9), (12, 20, 3, 3), dict(stride=2, padding=1), True),
    ((2, 16, 9, 10), (16, 16, 3, 3), dict(stride=3, padding=1), False),
    # Few channels whose output pixels and filters are on the access width: NCHW through the
    # batched GEMM on channel-major columns (wgrad too with enough images' worth of blocks).
    ((16, 3, 8, 8), (128, 3, 3, 3), dict(padding=1), True),
    ((4, 3, 32, 32), (8, 3, 5, 5), dict(stride=4, padding=2), True),
    ((4, 2, 20, 20), (8, 2, 5, 5), dict(stride=2, padding=2), False),
    # The Hopper wgrad (half types, channels a multiple of 64): a reduction split into 29
    # slices, the last one short; filters off the tile (40), dilation; a 1x1 stride-2 wide
    # tile; groups of 64 channels (repacked, one launch per group).
    ((16, 64, 32, 32), (64, 64, 3, 3), dict(padding=1), False),
    ((2, 128, 15, 16), (40, 128, 3, 3), dict(padding=2, dilation=2), False),
    ((3, 64, 16, 17), (72, 64, 1, 1), dict(stride=2), True),
    ((2, 128, 9, 10), (64, 64, 3, 3), dict(padding=1, groups=2), False),
]


@needs_torch
@pytest.mark.skipif(not ON_GPU, reason="the tensor-core kernels run on a GPU")
@pytest.mark.parametrize("hopper", ["1", "0"], ids=["sm90-kernels", "sm80-kernels"])
@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("geometry", TENSOR_CORE_GEOMETRIES, ids=_id)
def test_tensor_core_kernel_families_match_float64(monkeypatch, hopper, data_format, dtype,
                                                   geometry):
    """On a Hopper GPU the forward, unit-stride dgrad and (half types) wgrad run CUTLASS 3.x
    sm_90a kernels (TMA im2col, WGMMA); JAX_KERNELS_CONV_SM90=0 keeps the Sm80 ones (the Ampere
    path), read when each call is planned. Both against float64 torch on the same rounded inputs (TF32 for float32:
    1e-3, as test_conv's default-precision test)."""
    monkeypatch.setenv("JAX_KERNELS_CONV_SM90", hopper)
    shape_x, shape_w, options, bias = geometry
    if data_format == "NHWC":
        x, w, b, dy = nhwc_operands(5, shape_x, shape_w, bias, dtype, options)
        got = jk_nhwc(x, w, b, dy, **options)
        cast = lambda a: None if a is None else a.astype(jnp.float64)
        expected = torch_nhwc(cast(x), cast(w), cast(b), cast(dy), **options)
    else:
        x, w, b, dy = operands(5, shape_x, shape_w, bias, dtype, options)
        got = jk_conv(x, w, b, dy, **options)
        cast = lambda a: None if a is None else a.astype(jnp.float64)
        expected = torch_conv(cast(x), cast(w), cast(b), cast(dy), **options)
    tolerance = 1e-3 if dtype == jnp.float32 else rtol(dtype)
    for name, a, e in zip(("output", "d_input", "d_weight", "d_bias"), got, expected):
        if e is not None:
            assert a.dtype == dtype, name
            assert_close(a, e, rtol_=tolerance), name


# Channels-last 1x1 convolutions with unit stride and no padding, whose forward and dgrad the
# Hopper pointwise GEMM runs (implicit_gemm_sm90_pointwise.cuh): a narrow filter tile with bias,
# a wide one whose dgrad reduces over several k-blocks with a short last one, the fewest channels
# the tensor cores take (8) with filters off every tile, and enough tiles (196 wide ones) that the
# persistent CTAs loop over several, and ConvNeXt's 96 <-> 384 channels. Pixel counts are off the
# 128-row tile.
POINTWISE_GEOMETRIES = [
    ((2, 64, 14, 15), (64, 64, 1, 1), {}, True),
    ((3, 32, 17, 19), (256, 32, 1, 1), {}, True),
    ((2, 8, 9, 7), (24, 8, 1, 1), {}, False),
    ((4, 64, 56, 56), (256, 64, 1, 1), {}, True),
    ((2, 96, 15, 17), (384, 96, 1, 1), {}, True),
]


@needs_torch
@pytest.mark.skipif(not HOPPER, reason="the pointwise GEMM runs on a Hopper GPU")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("geometry", POINTWISE_GEOMETRIES, ids=_id)
def test_pointwise_gemm_matches_float64(monkeypatch, dtype, geometry):
    """The forward and dgrad of channels-last 1x1 stride-1 convolutions on the persistent GEMM,
    against float64 torch on the same rounded inputs, and against the implicit-GEMM conv kernel
    (JAX_KERNELS_CONV_POINTWISE=0): the same reduction in the same k order, so
    the same bits. Two calls give the same bits."""
    shape_x, shape_w, options, bias = geometry
    x, w, b, dy = nhwc_operands(7, shape_x, shape_w, bias, dtype, options)
    monkeypatch.setenv("JAX_KERNELS_CONV_POINTWISE", "1")
    got = jk_nhwc(x, w, b, dy, **options)
    again = jk_nhwc(x, w, b, dy, **options)
    cast = lambda a: None if a is None else a.astype(jnp.float64)
    expected = torch_nhwc(cast(x), cast(w), cast(b), cast(dy), **options)
    tolerance = 1e-3 if dtype == jnp.float32 else rtol(dtype)
    for name, a, e in zip(("output", "d_input"), got, expected):
        assert a.dtype == dtype, name
        assert_close(a, e, rtol_=tolerance), name
    # The switch is read when a call runs its handler; XLA's command buffers replay what they
    # recorded, so the executables are compiled and recorded afresh.
    monkeypatch.setenv("JAX_KERNELS_CONV_POINTWISE", "0")
    jax.clear_caches()
    conv_kernel = jk_nhwc(x, w, b, dy, **options)
    for name, a, r, c in zip(("output", "d_input"), got, again, conv_kernel):
        assert np.asarray(a).tobytes() == np.asarray(r).tobytes(), name
        assert np.asarray(a).tobytes() == np.asarray(c).tobytes(), name


# Channels-last 1x1 stride-1 weight gradients, which the Hopper pointwise wgrad GEMM runs over
# equal slices of the pixels (implicit_gemm_sm90_pointwise_wgrad.cuh, plan_pointwise_wgrad in
# implicit_gemm.cu) in float32 where its column tiles are full, and in half types where the
# channels are off the Hopper half wgrad's 64-wide tiles. Float32: filters as the GEMM's rows
# and channels as its rows, column tiles of 64, 96 (96 <-> 384) and 128, 16 slices whose pixels
# end mid k-block, 4 and 32 slices of whole k-blocks, one slice off the k-block. Half types: 96,
# 40 and 32 channels under more filters (rows), 160 channels over 32 filters (channels as
# rows). The other rows check the conv kernels that keep the rest (200 x 40 in float32, 53^2
# pixels, whose divisors leave too few slices in float32).
POINTWISE_WGRAD_GEOMETRIES = [
    ((4, 64, 56, 56), (256, 64, 1, 1), {}, False),
    ((4, 256, 28, 28), (64, 256, 1, 1), {}, False),
    ((2, 128, 20, 24), (256, 128, 1, 1), {}, False),
    ((8, 256, 16, 16), (128, 256, 1, 1), {}, False),
    ((16, 64, 32, 32), (128, 64, 1, 1), {}, False),
    ((2, 96, 15, 17), (384, 96, 1, 1), {}, False),
    ((3, 384, 13, 14), (96, 384, 1, 1), {}, False),
    ((2, 40, 31, 32), (200, 40, 1, 1), {}, False),
    ((4, 160, 12, 12), (32, 160, 1, 1), {}, False),
    ((1, 32, 53, 53), (64, 32, 1, 1), {}, False),
]


@needs_torch
@pytest.mark.skipif(not HOPPER, reason="the pointwise wgrad GEMM runs on a Hopper GPU")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("geometry", POINTWISE_WGRAD_GEOMETRIES, ids=_id)
def test_pointwise_wgrad_matches_float64(monkeypatch, dtype, geometry):
    """The weight gradient of channels-last 1x1 stride-1 convolutions on the pointwise wgrad
    GEMM, against float64 torch on the same rounded inputs; two calls give the same bits. The
    split-K conv kernels (JAX_KERNELS_CONV_POINTWISE_WGRAD=0) sum in another order: close to it,
    not the same bits."""
    shape_x, shape_w, _, _ = geometry
    monkeypatch.setenv("JAX_KERNELS_CONV_POINTWISE_WGRAD", "1")
    jax.clear_caches()
    assert_wgrad_reproducible(11, shape_x, shape_w, {}, dtype)
    x, w, _, dy = nhwc_operands(11, shape_x, shape_w, False, dtype, {})
    grad = lambda: np.asarray(jk_nhwc(x, w, None, dy)[2]).astype(np.float64)
    pointwise = grad()
    monkeypatch.setenv("JAX_KERNELS_CONV_POINTWISE_WGRAD", "0")
    jax.clear_caches()
    assert_close(pointwise, grad(), rtol_=1e-3 if dtype == jnp.float32 else rtol(dtype))


# Strided 1x1 convolutions, whose TF32 wgrad and NCHW forward run as unit-stride ones over x's
# sampled pixels (plan_sampled in implicit_gemm.cu: a gather, then the batched GEMM NCHW or the
# pointwise wgrad GEMM channels last; the other passes and dtypes keep the strided kernels, checked
# here too): an odd width whose last column goes unread, padding (sampled as zeros)
# under strides 2 x 3, channels off the 16-byte units, two groups, and a ResNet-like 256->512
# over 28^2.
SAMPLED_GEOMETRIES = [
    ((2, 32, 16, 17), (64, 32, 1, 1), dict(stride=2), True),
    ((2, 24, 15, 14), (40, 24, 1, 1), dict(stride=(2, 3), padding=1), False),
    ((2, 12, 11, 9), (20, 12, 1, 1), dict(stride=2), True),
    ((2, 64, 14, 15), (128, 32, 1, 1), dict(stride=2, groups=2), False),
    ((4, 256, 28, 28), (512, 256, 1, 1), dict(stride=2), False),
]


@needs_torch
@pytest.mark.skipif(not ON_GPU, reason="the tensor-core kernels run on a GPU")
@pytest.mark.parametrize("data_format", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("geometry", SAMPLED_GEOMETRIES, ids=_id)
def test_sampled_pixels_match_float64(monkeypatch, data_format, dtype, geometry):
    """Strided 1x1 convolutions over x's sampled pixels, against float64 torch on the same
    rounded inputs; two calls give the same bits; the strided kernels
    (JAX_KERNELS_CONV_SAMPLED=0, which sets the scratch's size, so the programs are traced
    afresh) agree to the tolerance."""
    shape_x, shape_w, options, bias = geometry
    cast = lambda a: None if a is None else a.astype(jnp.float64)
    if data_format == "NHWC":
        x, w, b, dy = nhwc_operands(13, shape_x, shape_w, bias, dtype, options)
        run = lambda: jk_nhwc(x, w, b, dy, **options)
        expected = torch_nhwc(cast(x), cast(w), cast(b), cast(dy), **options)
    else:
        x, w, b, dy = operands(13, shape_x, shape_w, bias, dtype, options)
        run = lambda: jk_conv(x, w, b, dy, **options)
        expected = torch_conv(cast(x), cast(w), cast(b), cast(dy), **options)
    monkeypatch.setenv("JAX_KERNELS_CONV_SAMPLED", "1")
    jax.clear_caches()
    got, again = run(), run()
    tolerance = 1e-3 if dtype == jnp.float32 else rtol(dtype)
    names = ("output", "d_input", "d_weight", "d_bias")
    for name, a, r, e in zip(names, got, again, expected):
        if e is not None:
            assert a.dtype == dtype, name
            assert_close(a, e, rtol_=tolerance), name
            assert np.asarray(a).tobytes() == np.asarray(r).tobytes(), name
    monkeypatch.setenv("JAX_KERNELS_CONV_SAMPLED", "0")
    jax.clear_caches()
    for name, a, s in zip(names, got, run()):
        if s is not None:
            assert_close(np.asarray(a).astype(np.float64), s, rtol_=tolerance), name


def assert_wgrad_reproducible(seed, shape_x, shape_w, options, dtype, reference=None):
    """Two calls of the weight gradient give the same bits, close to float64 (torch, or
    reference(x, dy) on float64 NumPy arrays; float32 multiplies as TF32 on the tensor cores,
    1e-3 as the other tensor-core tests)."""
    x, w, _, dy = nhwc_operands(seed, shape_x, shape_w, False, dtype, options)
    grad = jax.jit(jax.grad(lambda w: (jk.conv2d(x, w, data_format="NHWC", **options)
                                       * dy).astype(jnp.float32).sum()))
    first, second = np.asarray(grad(w)), np.asarray(grad(w + 0))
    assert first.tobytes() == second.tobytes()
    cast = lambda a: a.astype(jnp.float64)
    if reference is None:
        expected = torch_nhwc(cast(x), cast(w), None, cast(dy), **options)[2]
    else:
        expected = reference(np.asarray(cast(x)), np.asarray(cast(dy)))
    assert_close(first, expected, rtol_=1e-3 if dtype == jnp.float32 else rtol(dtype))


@needs_torch
@pytest.mark.skipif(not ON_GPU, reason="the tensor-core kernels run on a GPU")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("channels,groups", [(64, 1), (128, 2)])
def test_split_wgrad_is_reproducible(dtype, channels, groups):
    """The weight gradient's split-K slices (Hopper's and the Sm80 kernel's) are reduced in a
    fixed order: two calls give the same bits, and the result stays close to float64. Both
    cases have more slices than the ordered sum's runs; one group sums the partials in place,
    two groups through the repacked layout's placement (slice_sum.cuh, implicit_gemm.cu)."""
    assert_wgrad_reproducible(9, (16, channels, 32, 32), (channels, 64, 3, 3),
                              dict(padding=1, groups=groups), dtype)


def depthwise_wgrad_numpy(x, dy, taps, pad):
    """dw [taps, taps, 1, C] of a unit-stride depthwise conv, NHWC x and dy, float64."""
    N, H, W, C = x.shape
    P, Q = dy.shape[1:3]
    padded = np.zeros((N, H + 2 * pad + taps, W + 2 * pad + taps, C))
    padded[:, pad:pad + H, pad:pad + W] = x
    dw = np.empty((taps, taps, 1, C))
    for r in range(taps):
        for s in range(taps):
            dw[r, s, 0] = np.einsum("npqc,npqc->c", dy, padded[:, r:r + P, s:s + Q])
    return dw


@pytest.mark.skipif(not ON_GPU, reason="the channel-pair kernels run on a GPU")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_depthwise_pair_wgrad_folds_images(dtype):
    """The channel-pair depthwise wgrad keeps at most 2^24 float32 partials: with 4096 7x7
    filters a slice holds two images (90 images, 45 slices). Same bits twice, close to float64
    (NumPy: torch's CPU grouped conv is slow at 4096 groups)."""
    assert_wgrad_reproducible(11, (90, 4096, 4, 4), (4096, 1, 7, 7),
                              dict(padding=3, groups=4096), dtype,
                              lambda x, dy: depthwise_wgrad_numpy(x, dy, 7, 3))
