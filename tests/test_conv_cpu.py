"""The CPU conv2d kernels' instruction-set paths (cpp/cpu/conv.cc): each is selected once per
process (JAX_KERNELS_CPU_ISA=baseline forces the SSE2 loops on a machine with AVX2, =avx512 the
AVX-512 loops without the bfloat16 dot products), so every test here runs its checks in
subprocesses, one per instruction set and thread count.

- Dense geometries that reach the flat-tile stencil (at least 4 output channels per group:
  the forward at any stride, its rows and columns split into stride phases when strided, and
  the dgrad at any stride), with remainders of the register blocks
  (filters not a multiple of 4 or 8, several channel chunks), grouped non-depthwise problems and
  both layouts, forward and every gradient against torch float64, every dtype.
- The results do not depend on the thread count (bitwise), with the wgrad's images in
  several slices.
- Channels-last weight gradients, staged through register transposes, have the bits of NCHW's
  (float32, float64, bfloat16; strided, grouped, dilated and padded).
- The vectorized float16 / bfloat16 conversions: exact widening of every float16 bit pattern and
  round-to-nearest-even narrowing (subnormals, overflow, NaN) against NumPy / ml_dtypes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kernels as jk
from jk_testing import TORCH_UNAVAILABLE, torch


def _cpu_has(flag):
    try:
        with open("/proc/cpuinfo") as f:
            return flag in f.read().split()
    except OSError:
        return False


# With AVX512_BF16 the native loops run bfloat16 on its dot products (channel pairs in the flat
# tiles, pixel pairs in the wgrad's outer products); "avx512" keeps the float32 loops on such a
# CPU, so both are checked there.
ISAS = ["baseline", "native"] + (["avx512"] if _cpu_has("avx512_bf16") else [])

# (N, C, H, W), (K, C/groups, R, S), options, bias
DENSE = [
    ((2, 16, 9, 11), (20, 16, 3, 3), dict(padding=1), True),          # 20 = 16 + 4 filters
    ((1, 56, 12, 13), (9, 56, 3, 3), dict(padding=1), False),         # chunks of channels, 9 = 8 + 1
    ((2, 12, 7, 10), (8, 12, 1, 1), dict(), True),                     # 1x1
    ((2, 8, 13, 12), (12, 8, 3, 2), dict(stride=2, padding=(1, 0)), True),  # strided: dgrad flat
    ((1, 8, 12, 12), (16, 4, 5, 5), dict(padding=2, dilation=2, groups=2), False),
    ((2, 6, 10, 9), (7, 6, 3, 3), dict(stride=3, padding=1), True),
    ((1, 24, 30, 31), (32, 24, 3, 3), dict(padding=1), True),          # several bands
    ((2, 5, 17, 15), (8, 5, 3, 5), dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2)), False),
    ((1, 3, 31, 30), (12, 3, 7, 7), dict(stride=2, padding=3), True),  # a stem
    # The wgrad's image slices (4096 output positions or more each): 7 images of 30x30 in
    # slices of 3 and 4, its channel blocks rounded to its register block's columns.
    ((7, 24, 30, 30), (8, 24, 3, 3), dict(padding=1), False),
    # 1x1, unit stride, planes of whole vectors (48 pixels): NCHW wgrad reads x and dy in place.
    ((3, 20, 8, 6), (12, 10, 1, 1), dict(groups=2), True),
    # The same with 64 filters (whole register blocks) and rows of even length: the bfloat16
    # pair wgrad (AVX512_BF16) reads x's NCHW planes in place as well.
    ((2, 16, 8, 6), (64, 16, 1, 1), dict(), False),
    # The NCHW pointwise pass (1x1, unit stride, no padding: forward and dgrad on the planes in
    # place): several runs of tiles per image and a short last tile, 13 = 8 + 4 + 1 filters;
    # a plane shorter than one tile (staged alone), dilation (irrelevant to one tap).
    ((2, 9, 20, 20), (13, 9, 1, 1), dict(), True),
    ((1, 5, 5, 7), (9, 5, 1, 1), dict(dilation=2), False),
    # The channels-last pointwise pass (the same 1x1 passes on pixels in place): 70 filters,
    # a whole block of 64 (32 on AVX2, 16 on the baseline) and a tail across a vector; 70 pixels,
    # runs of 48 and register blocks of 6 with a short last one; its dgrad reduces 70 channels
    # into 33 (a tail inside the first vector). The grouped 1x1 above takes it per group.
    ((2, 33, 5, 7), (70, 33, 1, 1), dict(), True),
    # The channels-last 1x1 wgrad's pixel GEMM: 2790 pixels, two slices of its ordered sum and
    # chunks of 128 with a short last one; 20 filters, a short block.
    ((3, 8, 30, 31), (20, 8, 1, 1), dict(), False),
    # The same GEMM on NCHW float32 / float64 (64 filters: whole register blocks on every ISA):
    # 2907 pixels in two slices, chunks cut at each image's end (323 pixels: 128, 128, 67).
    ((3, 24, 17, 19), (64, 24, 1, 1), dict(), False),
    # The staged wgrad's outer products (64 filters a group: whole register blocks on every
    # ISA): a strided 3x3 (flat rows of 8 x 9 positions, one chunk), and two groups of 64 over
    # 16 x 19 positions (two chunks, the last short).
    ((2, 16, 15, 17), (64, 16, 3, 3), dict(stride=2, padding=1), True),
    ((2, 32, 16, 16), (128, 16, 3, 3), dict(padding=1, groups=2), False),
]

SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np, jax, jax.numpy as jnp, torch
    import jax_kernels as jk
    jax.config.update("jax_enable_x64", True)
    cases = json.loads(sys.argv[1])
    out = []
    for (xs, ws, options, bias, layout) in cases:
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
        rng = np.random.default_rng(0)
        x = rng.uniform(-1, 1, xs); w = rng.uniform(-1, 1, ws); b = rng.uniform(-1, 1, ws[0])
        tx = torch.tensor(x, requires_grad=True); tw = torch.tensor(w, requires_grad=True)
        tb = torch.tensor(b, requires_grad=True) if bias else None
        ty = torch.nn.functional.conv2d(tx, tw, tb, **options)
        dy = rng.uniform(-1, 1, ty.shape)
        ty.backward(torch.tensor(dy))
        expected = [ty.detach().numpy(), tx.grad.numpy(), tw.grad.numpy()]
        nhwc = layout == "NHWC"
        to = lambda a, perm: a.transpose(perm) if nhwc else a
        for dtype in ("float64", "float32", "bfloat16", "float16"):
            dt = jnp.dtype(dtype)
            args = (jnp.asarray(to(x, (0, 2, 3, 1)), dt), jnp.asarray(to(w, (2, 3, 1, 0)), dt),
                    jnp.asarray(b, dt) if bias else None)
            f = lambda x, w, b: jk.conv2d(x, w, b, data_format=layout, **options)
            y, vjp = jax.vjp(jax.jit(f), *args)
            gx, gw = vjp(jnp.asarray(to(dy, (0, 2, 3, 1)), dt))[:2]
            got = [np.asarray(y), np.asarray(gx), np.asarray(gw)]
            if nhwc:
                got = [got[0].transpose(0, 3, 1, 2), got[1].transpose(0, 3, 1, 2),
                       got[2].transpose(3, 2, 0, 1)]
            errors = [float(np.max(np.abs(a.astype(np.float64) - e)) /
                            max(np.max(np.abs(e)), 1e-30)) for a, e in zip(got, expected)]
            digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes()
                                             for a in got)).hexdigest()
            out.append(dict(dtype=dtype, errors=errors, digest=digest))
    print("RESULT", json.dumps(out))
""")


def _run(code, args, isa, threads):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_KERNELS_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(jk.__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    env.pop("JAX_KERNELS_CPU_ISA", None)
    if isa != "native":
        env["JAX_KERNELS_CPU_ISA"] = isa
    result = subprocess.run([sys.executable, "-c", code] + args, capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [l for l in result.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


@pytest.mark.skipif(torch is None, reason=TORCH_UNAVAILABLE)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("isa", ISAS)
def test_dense_paths_match_torch_and_ignore_the_thread_count(isa, layout):
    cases = [list(c) + [layout] for c in DENSE]
    runs = [_run(SCRIPT, [json.dumps(cases)], isa, threads) for threads in (1, 2)]
    for got in runs[0]:
        for name, error in zip(("output", "d_input", "d_weight"), got["errors"]):
            assert error <= TOLERANCE[got["dtype"]], (got["dtype"], name, error)
    assert [r["digest"] for r in runs[0]] == [r["digest"] for r in runs[1]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_channels_last_pointwise_gives_the_nchw_bits(dtype):
    """1x1 convolutions at unit stride without padding, channels last, run a GEMM over the
    pixels (conv.cc's run_pointwise_pixels: in place in float32 / float64, half types widened
    per run of pixels); channels first, the flat tiles over planes (run_pointwise: in place, or
    half types widened a tile at a time). Both sum the bias, then the channels in order, so the
    forward and dgrad give the same bits in either layout: a block and a tail of filters,
    groups, a bias and none, planes shorter than a tile, and whole tiles and a short last one
    in the last of several runs of tiles (16 x 16 = 5 tiles of 48 and 16 positions)."""
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    dt = jnp.dtype(dtype)
    with jax.default_device(cpu):  # conftest enables x64
        for N, C, H, W, K, groups, bias in ((2, 33, 5, 7, 70, 1, True), (3, 20, 8, 6, 12, 2, False),
                                            (2, 16, 16, 16, 24, 1, True)):
            x = jnp.asarray(rng.uniform(-1, 1, (N, C, H, W)), dt)
            w = jnp.asarray(rng.uniform(-1, 1, (K, C // groups, 1, 1)), dt)
            b = jnp.asarray(rng.uniform(-1, 1, (K,)), dt) if bias else None
            dy = jnp.asarray(rng.uniform(-1, 1, (N, K, H, W)), dt)
            y, vjp = jax.vjp(lambda x, w: jk.conv2d(x, w, b, groups=groups), x, w)
            dx = vjp(dy)[0]
            yl, vjpl = jax.vjp(lambda x, w: jk.conv2d(x, w, b, groups=groups, data_format="NHWC"),
                               x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0))
            dxl = vjpl(dy.transpose(0, 2, 3, 1))[0]
            assert y.dtype == yl.dtype == dt
            np.testing.assert_array_equal(np.asarray(y), np.asarray(yl.transpose(0, 3, 1, 2)))
            np.testing.assert_array_equal(np.asarray(dx), np.asarray(dxl.transpose(0, 3, 1, 2)))


CONVERSIONS = textwrap.dedent("""
    import json
    import numpy as np, jax, jax.numpy as jnp, ml_dtypes
    import jax_kernels as jk
    bits = np.arange(1 << 16, dtype=np.uint16)
    failures = []
    for name, np_dtype in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
        x = bits.view(np_dtype).reshape(1, 1, 256, 256)
        # A 1x1 convolution of one input channel into 4 filters: each output is w * x, exact in
        # float32 (two 11- or 8-bit significands), rounded once to the output type.
        for wv in (1.0, 0.3, 1.7, -2.5e-3, 3.0e4):
            w = np.full((4, 1, 1, 1), wv, np.float32).astype(np_dtype)
            y = np.asarray(jax.jit(lambda x, w: jk.conv2d(x, w))(jnp.asarray(x), jnp.asarray(w)))
            exact = x.astype(np.float32) * w.astype(np.float32)[:, :, 0, 0][None, :, :, None]
            expected = exact.astype(np_dtype)
            nan = np.isnan(expected.astype(np.float32))
            # XLA's CPU threads flush float32 subnormals (bfloat16's own range) to zero, and
            # 0 + (-0) is +0: zeros compare by value, and results or inputs below float32's
            # smallest normal are left out.
            zero = (y.astype(np.float32) == 0) & (expected.astype(np.float32) == 0)
            tiny = np.finfo(np.float32).tiny
            flushed = (np.abs(exact) < tiny) | (np.abs(x.astype(np.float32)) < tiny)
            same = (y.view(np.uint16) == expected.view(np.uint16)) | nan | zero | flushed
            if not (same.all() and np.array_equal(np.isnan(y.astype(np.float32)), nan)):
                failures.append([name, wv, int((~same).sum())])
    print("RESULT", json.dumps(failures))
""")


@pytest.mark.parametrize("isa", ISAS)
def test_half_conversions_are_exact(isa):
    pytest.importorskip("ml_dtypes")
    assert _run(CONVERSIONS, [], isa, 2) == []


# Channels-last weight gradients stage their planes differently (tiles transposed in registers
# at any stride, where NCHW copies rows) into the same buffers: the same bits as NCHW's on the
# same data. Shapes with whole and partial 16-channel tiles, groups, dilation, stride and
# padding. (1x1 unit-stride unpadded ones are a GEMM over the pixels
# instead, in another order: DENSE checks them against float64 torch.)
CHANNELS_LAST_WGRAD = [
    ((2, 20, 9, 11), (18, 20, 3, 3), dict(padding=1)),
    ((3, 40, 8, 6), (24, 20, 1, 1), dict(groups=2, stride=2)),
    ((2, 33, 7, 19), (17, 33, 3, 5), dict(padding=(1, 2), dilation=(1, 2))),
    ((1, 16, 16, 16), (16, 16, 1, 1), dict(padding=1)),
    ((2, 17, 12, 12), (16, 17, 3, 3), dict(stride=2, padding=1)),
    ((2, 35, 5, 40), (32, 35, 2, 2), dict(padding=3)),
    # Strided phases of whole 16-pixel runs (transposed at a pixel stride of stride * C).
    ((2, 32, 10, 40), (8, 32, 3, 3), dict(stride=2, padding=1)),
    ((1, 32, 9, 50), (16, 16, 2, 4), dict(stride=(3, 2), padding=(0, 3), groups=2)),
    # Outer products (64 filters a group: whole register blocks on every ISA).
    ((2, 24, 11, 13), (64, 24, 3, 3), dict(stride=2, padding=1)),
    ((2, 32, 8, 9), (128, 16, 2, 2), dict(groups=2)),
]


# 1x1 unit-stride unpadded weight gradients whose NCHW form (float32 / float64) runs the pixel
# GEMM too, where a group's filters fill whole register blocks: 64 filters, and two groups of
# 64 with a chunk of pixels that crosses no image.
POINTWISE_WGRAD = [
    ((3, 24, 17, 19), (64, 24, 1, 1), dict()),
    ((2, 40, 9, 10), (128, 20, 1, 1), dict(groups=2)),
]


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_channels_last_wgrad_has_the_bits_of_nchw(dtype):
    assert_wgrad_layouts_agree(dtype, CHANNELS_LAST_WGRAD)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_pointwise_wgrad_has_the_same_bits_in_both_layouts(dtype):
    assert_wgrad_layouts_agree(dtype, POINTWISE_WGRAD)


def assert_wgrad_layouts_agree(dtype, cases):
    import jax
    import jax.numpy as jnp
    import numpy as np

    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(1)
    dt = jnp.dtype(dtype)
    put = lambda a: jax.device_put(jnp.asarray(a, dt), cpu)
    for xs, ws, options in cases:
        x, w = rng.standard_normal(xs), rng.standard_normal(ws)
        y = jax.eval_shape(lambda x, w: jk.conv2d(x, w, **options),
                           jax.ShapeDtypeStruct(xs, dt), jax.ShapeDtypeStruct(ws, dt))
        dy = rng.standard_normal(y.shape)
        nchw = jax.vjp(lambda w: jk.conv2d(put(x), w, **options), put(w))[1](put(dy))[0]
        nhwc = jax.vjp(lambda w: jk.conv2d(put(x.transpose(0, 2, 3, 1)), w,
                                           data_format="NHWC", **options),
                       put(w.transpose(2, 3, 1, 0)))[1](put(dy.transpose(0, 2, 3, 1)))[0]
        nhwc = np.ascontiguousarray(np.asarray(nhwc).transpose(3, 2, 0, 1))
        assert np.asarray(nchw).tobytes() == nhwc.tobytes(), (xs, ws, options)
