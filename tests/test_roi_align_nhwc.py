"""Tests of jk.roi_align(..., data_format="NHWC"): channels-last input [N, H, W, C] and output
[K, h, w, C], computed by the jk_roi_align_nhwc_* targets.

Oracle: the NCHW form (itself tested against float64 references and torchvision in
test_roi_align.py). The NHWC kernels are the NCHW kernels instantiated for another layout and add
the same terms in the same order, so every deterministic pass must equal the transposed NCHW
result bitwise; deterministic=False (atomics on CUDA) is compared at the dtype's tolerance.
Derivatives are also checked on their own with check_grads (float64, fwd and rev, order 2).

The same file runs on the GPU with JAX_PLATFORMS=cuda,cpu (the sharding test then uses the
accelerators where there are several, else the 8 CPU devices that conftest.py asks for).
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
from jk_testing import DTYPES, ON_GPU, assert_close, assert_lowered, random

TO_NHWC, TO_NCHW = (0, 2, 3, 1), (0, 3, 1, 2)
SHAPE = (2, 10, 13, 5)  # N, H, W, C
FORBIDDEN = ("stablehlo.while", "stablehlo.gather", "stablehlo.scatter", "stablehlo.transpose")


def nhwc(x):
    return jnp.transpose(x, TO_NHWC)


def nchw(x):
    return jnp.transpose(x, TO_NCHW)


def make_boxes(seed, n_images, height, width, spatial_scale, count=10):
    """Boxes in image coordinates: inside, partly outside, tiny (clamped to one pixel when not
    aligned), larger than the image, degenerate (zero width, reversed corners), and invalid batch
    indices (-1, N, 2.5 past N, NaN: zero rows), with fractional indices (truncated)."""
    rng = np.random.default_rng(seed)
    h, w = height / spatial_scale, width / spatial_scale
    x1 = rng.uniform(-0.3 * w, 0.9 * w, count)
    y1 = rng.uniform(-0.3 * h, 0.9 * h, count)
    x2 = x1 + rng.uniform(0.05, 0.8, count) * w
    y2 = y1 + rng.uniform(0.05, 0.8, count) * h
    batch = rng.integers(0, n_images, count) + np.where(np.arange(count) % 3 == 0, 0.6, 0.0)
    rows = np.stack([batch, x1, y1, x2, y2], axis=1)
    rows[0, 3] = rows[0, 1] + 0.3 / spatial_scale
    rows[1, 4] = rows[1, 2] + 0.6 / spatial_scale
    rows[2, 1:] = [-0.7 * w, -0.4 * h, 1.6 * w, 1.3 * h]
    s = 1.0 / spatial_scale
    extra = [[0, 2.3 * s, 1.7 * s, 2.3 * s, 6.1 * s], [1, 8.3 * s, 6.2 * s, 2.1 * s, 1.4 * s],
             [-1, 1, 1, 5, 5], [n_images, 1, 1, 5, 5], [n_images + 0.5, 1, 1, 5, 5],
             [np.nan, 1, 1, 5, 5]]
    return np.concatenate([rows, np.asarray(extra, np.float64)])


def inputs(dtype=jnp.float64, spatial_scale=0.5, seed=0, shape=SHAPE):
    """An NHWC input and its boxes."""
    x = random(seed, shape, dtype)
    boxes = make_boxes(seed + 1, shape[0], shape[1], shape[2], spatial_scale)
    return x, jnp.asarray(boxes).astype(dtype)


def assert_same(actual, expected):
    """Bitwise equal (NaN where NaN)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert actual.tobytes() == expected.tobytes(), np.max(np.abs(
        actual.astype(np.float64) - expected.astype(np.float64)))


def pair(sampling_ratio, aligned, output_size=(3, 4), spatial_scale=0.5, **kw):
    """The NHWC op and the NCHW op written on NHWC arrays (transposes around it)."""
    def channels_last(x, b):
        return jk.roi_align(x, b, output_size, spatial_scale, sampling_ratio, aligned,
                            data_format="NHWC", **kw)

    def through_nchw(x, b):
        return nhwc(jk.roi_align(nchw(x), b, output_size, spatial_scale, sampling_ratio, aligned,
                                 **kw))
    return channels_last, through_nchw


# --- every pass equals the NCHW form --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
@pytest.mark.parametrize("aligned", [False, True])
def test_forward_and_gradients_equal_nchw(aligned, sampling_ratio, dtype):
    x, boxes = inputs(dtype)
    f, g = pair(sampling_ratio, aligned)
    out, vjp = jax.vjp(f, x, boxes)
    expected, vjp_expected = jax.vjp(g, x, boxes)
    assert out.shape == (boxes.shape[0], 3, 4, SHAPE[3]) and out.dtype == dtype
    assert_same(out, expected)
    assert np.all(np.asarray(out[-4:]) == 0)  # invalid batch indices
    dout = random(3, out.shape, dtype)
    d_input, d_boxes = vjp(dout)
    assert d_input.shape == x.shape and d_boxes.shape == boxes.shape
    for a, e in zip((d_input, d_boxes), vjp_expected(dout)):
        assert_same(a, e)


@pytest.mark.parametrize("sampling_ratio", [-1, 3])
@pytest.mark.parametrize("aligned", [False, True])
def test_directional_passes_equal_nchw(aligned, sampling_ratio):
    """Forward mode along the boxes and Hessian-vector products (the *_directional targets)."""
    x, boxes = inputs()
    f, g = pair(sampling_ratio, aligned, spatial_scale=0.5)
    t_x, t_boxes = random(4, x.shape, x.dtype), random(5, boxes.shape, boxes.dtype)
    assert_same(jax.jvp(f, (x, boxes), (t_x, t_boxes))[1],
                jax.jvp(g, (x, boxes), (t_x, t_boxes))[1])

    def hvp(op):
        loss = lambda x, b: jnp.sum(jnp.nan_to_num(op(x, b)) ** 3)
        return jax.jvp(jax.grad(loss, argnums=(0, 1)), (x, boxes), (t_x, t_boxes))[1]

    for a, e in zip(hvp(f), hvp(g)):
        assert_same(a, e)
    # Second order in reverse mode (grad of grad).
    gg = lambda op: jax.grad(lambda x, b: jnp.sum(jax.grad(
        lambda x, b: jnp.sum(jnp.sin(op(x, b))), argnums=1)(x, b) ** 2), argnums=(0, 1))
    for a, e in zip(gg(f)(x, boxes), gg(g)(x, boxes)):
        assert_same(a, e)


def test_list_of_boxes_and_empty_boxes():
    x, _ = inputs()
    parts = [jnp.asarray([[1.0, 2.0, 9.5, 7.25], [0.5, 0.5, 3.0, 4.0]]),
             jnp.asarray([[2.5, 1.5, 12.0, 9.0]])]
    out = jk.roi_align(x, parts, 2, 0.5, 2, data_format="NHWC")
    assert_same(out, nhwc(jk.roi_align(nchw(x), parts, 2, 0.5, 2)))
    empty = jk.roi_align(x, jnp.zeros((0, 5)), 3, data_format="NHWC")
    assert empty.shape == (0, 3, 3, SHAPE[3])
    d_input = jax.grad(lambda x: jnp.sum(jk.roi_align(x, jnp.zeros((0, 5)), 3,
                                                      data_format="NHWC")))(x)
    assert d_input.shape == x.shape and np.all(np.asarray(d_input) == 0)


def test_deterministic_backward_is_repeatable_and_atomics_agree():
    """deterministic=True gives the same bits run to run (the GPU's ordered gather; the CPU is
    deterministic by construction); deterministic=False (float atomics on CUDA) agrees."""
    shape = (2, 24, 20, 48) if ON_GPU else SHAPE
    for dtype in (jnp.float32, jnp.float16):
        x, boxes = inputs(dtype, 0.25, seed=2, shape=shape)
        dout = random(6, (boxes.shape[0], 7, 7, shape[3]), dtype)
        vjp = jax.jit(lambda x, b, g, d: jax.vjp(lambda x, b: jk.roi_align(
            x, b, 7, 0.25, -1, True, deterministic=d, data_format="NHWC"), x, b)[1](g),
            static_argnums=3)
        first = [np.asarray(a).tobytes() for a in vjp(x, boxes, dout, True)]
        for _ in range(10 if ON_GPU else 2):
            assert [np.asarray(a).tobytes() for a in vjp(x, boxes, dout, True)] == first
        for a, e in zip(vjp(x, boxes, dout, False), vjp(x, boxes, dout, True)):
            assert_close(a, e, dtype)


# --- derivatives on their own ---------------------------------------------------------------------


@pytest.mark.parametrize("sampling_ratio", [2, -1])
@pytest.mark.parametrize("aligned", [False, True])
def test_check_grads_order2(aligned, sampling_ratio):
    # Boxes whose samples lie strictly inside cells and whose sizes are not clamped; only the
    # coordinates are perturbed (the batch index is an integer label).
    x = random(0, (2, 9, 10, 2), jnp.float64)
    coords = jnp.asarray([[0.9, 1.3, 6.1, 5.7], [2.2, 0.6, 7.7, 7.3], [1.35, 2.15, 4.6, 6.4]])
    batch = jnp.asarray([[0.0], [1.0], [1.0]])
    f = lambda x, c: jk.roi_align(x, jnp.concatenate([batch, c], axis=1), (2, 3), 1.0,
                                  sampling_ratio, aligned, data_format="NHWC")
    check_grads(f, (x, coords), order=2, modes=("fwd", "rev"), eps=1e-5)


# --- transforms -----------------------------------------------------------------------------------


def _op(x, b):
    return jk.roi_align(x, b, (2, 3), 0.5, 2, True, data_format="NHWC")


@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (0, 0), (3, 0)])
def test_vmap_matches_loop(in_axes):
    x, boxes = inputs()
    xs = jnp.stack([x, x * 2 + 1, -x])
    bs = jnp.stack([boxes, boxes.at[:, 1:].add(0.75), boxes.at[:, 1:].add(-1.25)])
    xs_in = jnp.moveaxis(xs, 0, in_axes[0]) if in_axes[0] is not None else x
    bs_in = bs if in_axes[1] is not None else boxes
    batched = jax.vmap(_op, in_axes=in_axes)(xs_in, bs_in)
    pick = lambda a, single, i, axis: a[i] if axis is not None else single
    loop = [_op(pick(xs, x, i, in_axes[0]), pick(bs, boxes, i, in_axes[1])) for i in range(3)]
    assert_same(batched, jnp.stack(loop))
    # vmap of grad, against the loop of grads.
    grad = jax.grad(lambda x, b: jnp.sum(jnp.sin(_op(x, b))), argnums=(0, 1))
    batched = jax.vmap(grad, in_axes=in_axes)(xs_in, bs_in)
    for i in range(3):
        expected = grad(pick(xs, x, i, in_axes[0]), pick(bs, boxes, i, in_axes[1]))
        for a, e in zip(batched, expected):
            assert_close(a[i], e)


def test_lowered_program_calls_the_nhwc_targets_only():
    x, boxes = inputs()
    grad = jax.grad(lambda x, b: jnp.sum(_op(x, b) ** 2), argnums=(0, 1))
    text = assert_lowered(grad, x, boxes, forbidden=FORBIDDEN, targets=(
        "jk_roi_align_nhwc_fwd", "jk_roi_align_nhwc_bwd_input", "jk_roi_align_nhwc_bwd_boxes"))
    assert "jk_roi_align_fwd_v" not in text and "jk_roi_align_bwd_" not in text
    hvp = lambda x, b: jax.jvp(grad, (x, b), (x, b))[1]
    assert_lowered(hvp, x, boxes, forbidden=FORBIDDEN, targets=(
        "jk_roi_align_nhwc_fwd_directional", "jk_roi_align_nhwc_bwd_input_directional",
        "jk_roi_align_nhwc_bwd_boxes_directional"))


# An instruction of the compiled (optimized) HLO: "name = type[dims]{layout} op(". XLA moves data
# to another layout either with a transpose or with a bitcast and a layout-changing copy.
_MOVE = re.compile(r"= \w+\[([\d,]*)\][^ ]* (transpose|copy)\(")


def moved_arrays(fn, *args, at_least: int) -> list[tuple[str, int]]:
    """(op, elements) of every transpose or copy of at least `at_least` elements in the compiled
    program of jit(fn)(*args), fusions included."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    found = []
    for dims, op in _MOVE.findall(text):
        elements = int(np.prod([int(d) for d in dims.split(",") if d]))
        if elements >= at_least:
            found.append((op, elements))
    return found


def test_compiled_program_has_no_batch_sized_transpose():
    x, boxes = inputs(shape=(2, 12, 16, 6))
    f = lambda x, b: jk.roi_align(x, b, 2, 0.5, 2, data_format="NHWC")
    loss = lambda op: lambda x, b: jnp.sum(jnp.nan_to_num(op(x, b)) ** 2)
    grad = jax.grad(loss(f), argnums=(0, 1))
    hvp = lambda x, b: jax.jvp(grad, (x, b), (x, b))[1]
    pooled = boxes.shape[0] * 2 * 2 * x.shape[3]
    limit = min(x.size, pooled)  # neither the input nor the output is moved
    for fn in (f, jax.value_and_grad(loss(f), argnums=(0, 1)), hvp):
        assert moved_arrays(fn, x, boxes, at_least=limit) == []
    # The check sees a transpose where there is one: the NCHW op on a transposed input.
    g = lambda x, b: jk.roi_align(nchw(x), b, 2, 0.5, 2)
    assert moved_arrays(jax.value_and_grad(loss(g), argnums=(0, 1)), x, boxes,
                        at_least=limit) != []


# --- errors ---------------------------------------------------------------------------------------


def test_data_format_errors():
    x, boxes = inputs()
    with pytest.raises(ValueError, match=r"roi_align\(\): data_format must be 'NCHW' or 'NHWC', "
                       r"got 'NWHC'"):
        jk.roi_align(x, boxes, 2, data_format="NWHC")
    with pytest.raises(ValueError, match=r"roi_align\(\): data_format"):
        jk.roi_align(x, boxes, 2, data_format="nhwc")
    for bad in (None, 1, ("NHWC",)):
        with pytest.raises(TypeError, match=r"roi_align\(\): data_format must be a string"):
            jk.roi_align(x, boxes, 2, data_format=bad)
    with pytest.raises(ValueError, match=r"roi_align\(\): expected input of shape "
                       r"\(N, H, W, C\), got \(10, 13, 5\)"):
        jk.roi_align(x[0], boxes, 2, data_format="NHWC")
    with pytest.raises(TypeError):  # keyword-only
        jk.roi_align(x, boxes, 2, 1.0, -1, False, True, "NHWC")
    # Raised at trace time: under jit, before any kernel runs.
    with pytest.raises(ValueError, match=r"roi_align\(\): data_format"):
        jax.jit(lambda x, b: jk.roi_align(x, b, 2, data_format="CHWN")).lower(x, boxes)


def test_capabilities_list_the_nhwc_passes():
    rows = [r for r in jk.capabilities() if r.op == "roi_align"]
    passes = {r.pass_ for r in rows}
    assert {"forward (NHWC)", "backward d_input (NHWC)", "backward d_boxes (NHWC)",
            "forward directional (NHWC)", "backward d_input directional (NHWC)",
            "backward d_boxes directional (NHWC)"} <= passes
    targets = {r.target for r in rows if r.pass_ == "forward (NHWC)"}
    assert targets == {"jk_roi_align_nhwc_fwd_v1"}


# --- sharding (as test_sharding.py's roi_align cases, channels last) ------------------------------


def _devices() -> list:
    """8, 4 or 2 accelerators where there are several, else 8 CPU devices."""
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:  # JAX_PLATFORMS without cpu
        cpus = []
    for pool in (accelerators, cpus):
        for count in (8, 4, 2):
            if len(pool) >= count:
                return pool[:count]
    return []


DEVICES = _devices()
_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)(?:-start)?\(")


def collectives(fn, *args, **jit_kwargs) -> list[tuple[str, int]]:
    text = jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()
    found = []
    for types, kind in _COLLECTIVE.findall(text):
        for dims in re.findall(r"\w+\[([\d,]*)\]", types):
            found.append((kind, int(np.prod([int(d) for d in dims.split(",") if d]))))
    return found


def assert_no_gather(found, reduce_limit: int = 0) -> None:
    for kind, elements in found:
        assert kind == "all-reduce" and elements <= reduce_limit, found


def assert_tree_close(actual, expected) -> None:
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-12, atol=1e-12)


def _sharding_boxes(images: int) -> jax.Array:
    """test_sharding.py's boxes: every image, fractional indices near shard boundaries, invalid
    indices."""
    rows = [[i % images + (0.7 if i % 3 == 0 else 0.0), 1.0 + i, 2.0 + i / 2, 9.0 + i / 3, 11.0]
            for i in range(14)]
    rows += [[-0.5, 1, 1, 5, 5], [images, 1, 1, 5, 5], [np.nan, 1, 1, 5, 5], [-1, 1, 1, 5, 5]]
    return jnp.asarray(rows, jnp.float64)


@pytest.mark.skipif(not DEVICES, reason="needs 2+ accelerators or 8 CPU devices "
                    "(XLA_FLAGS=--xla_force_host_platform_device_count=8)")
def test_sharded_by_image_channel_and_boxes():
    m = Mesh(np.array(DEVICES), ("batch",))
    d = len(DEVICES)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(m, P(*spec)))
    loss = lambda op: lambda x, b: (jnp.nan_to_num(op(x, b)) ** 2).sum()

    # By image: each shard pools its own images' boxes; one reduction of the output's size; the
    # input gradient stays sharded by image.
    x, boxes = random(0, (d, 12, 13, 4), jnp.float64), _sharding_boxes(d)
    f = lambda x, b: jk.roi_align(x, b, (3, 2), spatial_scale=0.9, sampling_ratio=2,
                                  data_format="NHWC")
    args = (put(x, "batch"), put(boxes))
    pooled = boxes.shape[0] * 4 * 3 * 2
    assert_no_gather(collectives(f, *args), reduce_limit=pooled)
    np.testing.assert_allclose(jax.jit(f)(*args), f(x, boxes), rtol=1e-12, atol=1e-12)
    grads = jax.grad(loss(f), argnums=(0, 1))
    shardings = (NamedSharding(m, P("batch")), NamedSharding(m, P()))
    assert_no_gather(collectives(grads, *args, out_shardings=shardings),
                     reduce_limit=max(pooled, boxes.size))
    actual = jax.jit(grads, out_shardings=shardings)(*args)
    assert_tree_close(actual, grads(x, boxes))
    assert actual[0].sharding.spec == P("batch")

    # By channel (the last axis): no communication for the output; the box gradient sums over
    # the channels (one reduction of the boxes' size).
    x, boxes = random(1, (3, 12, 13, d), jnp.float64), _sharding_boxes(3)
    f = lambda x, b: jk.roi_align(x, b, 3, sampling_ratio=-1, aligned=True, data_format="NHWC")
    args = (put(x, None, None, None, "batch"), put(boxes))
    assert collectives(f, *args) == []
    y = jax.jit(f)(*args)
    assert y.sharding.spec == P(None, None, None, "batch")
    np.testing.assert_allclose(y, f(x, boxes), rtol=1e-12, atol=1e-12)
    grads = jax.grad(loss(f), argnums=(0, 1))
    shardings = (NamedSharding(m, P(None, None, None, "batch")), NamedSharding(m, P()))
    assert_no_gather(collectives(grads, *args, out_shardings=shardings), reduce_limit=boxes.size)
    assert_tree_close(jax.jit(grads, out_shardings=shardings)(*args), grads(x, boxes))

    # By box: each shard pools its own boxes.
    x, boxes = random(2, (2, 12, 13, 3), jnp.float64), _sharding_boxes(2)[:16]
    f = lambda x, b: jk.roi_align(x, b, 2, data_format="NHWC")
    args = (put(x), put(boxes, "batch"))
    assert collectives(f, *args) == []
    y = jax.jit(f)(*args)
    assert y.sharding.spec == P("batch")
    np.testing.assert_allclose(y, f(x, boxes), rtol=1e-12, atol=1e-12)
