"""Partitioning under sharded jit, shard_map and meshes with explicit axes, on the accelerators
where there are several, else on 8 CPU devices (conftest.py asks XLA for them before jax starts).

Every test compares with the same function on one device (float64: equal to rounding) and reads
the compiled program's collectives: a batch-sized operand is never all-gathered, and the only
reductions are of a weight's, a box list's or a pooled output's size.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_kernels as jk
from jk_testing import random



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
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs 2+ accelerators or 8 CPU devices "
                                "(XLA_FLAGS=--xla_force_host_platform_device_count=8)")

# An HLO instruction "name = <type> <collective>(...)"; the type may be a tuple (combined
# collectives), each of whose shapes is counted.
_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)(?:-start)?\(")


def mesh() -> Mesh:
    return Mesh(np.array(DEVICES), ("batch",))


def put(x, mesh_: Mesh, *spec):
    return jax.device_put(x, NamedSharding(mesh_, P(*spec)))


def collectives(fn, *args, **jit_kwargs) -> list[tuple[str, int]]:
    """(kind, elements) of every collective in the compiled program of jit(fn)(*args)."""
    text = jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()
    found = []
    for types, kind in _COLLECTIVE.findall(text):
        for dims in re.findall(r"\w+\[([\d,]*)\]", types):
            found.append((kind, int(np.prod([int(d) for d in dims.split(",") if d]))))
    return found


def assert_no_gather(found, reduce_limit: int = 0) -> None:
    """No collective but all-reduces of at most `reduce_limit` elements each."""
    for kind, elements in found:
        assert kind == "all-reduce" and elements <= reduce_limit, found


def assert_tree_close(actual, expected) -> None:
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-12, atol=1e-12)


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    """Both of XLA's partitioners (GSPMD while this jax still has it)."""
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


# --- one op at a time ----------------------------------------------------------------------------


def test_lerp_and_repeat_stay_sharded(partitioner):
    m = mesh()
    a, b = random(0, (16, 4, 6), jnp.float64), random(1, (16, 4, 6), jnp.float64)
    w = random(2, (1, 4, 6), jnp.float64)  # broadcast over the batch: its gradient is reduced

    def loss(a, b, w):
        y = jk.lerp(a, b, w) + jk.lerp(a, b, 0.3)
        return (jk.repeat(y, (1, 2, 3)) ** 2).sum()

    args = (put(a, m, "batch"), put(b, m, "batch"), put(w, m))
    grads = jax.grad(loss, argnums=(0, 1, 2))
    out = (P("batch"), P("batch"), P())
    assert_no_gather(collectives(grads, *args, out_shardings=tuple(NamedSharding(m, s) for s in out)),
                     reduce_limit=w.size)
    assert_tree_close(jax.jit(grads)(*args), grads(a, b, w))
    forward = jax.jit(lambda a, b: jk.repeat(jk.lerp(a, b, 0.5), (1, 1, 2)))
    assert collectives(forward, *args[:2]) == []
    y = forward(*args[:2])
    assert y.sharding.spec == P("batch")
    np.testing.assert_allclose(y, jnp.tile(a + 0.5 * (b - a), (1, 1, 2)), rtol=1e-12)


def test_lerp_any_axis(partitioner):
    """Elementwise: a sharded non-batch axis stays sharded too."""
    m = mesh()
    a, b, w = (random(i, (3, 16, 5), jnp.float64) for i in range(3))
    args = [put(x, m, None, "batch") for x in (a, b, w)]
    f = lambda a, b, w: jk.lerp(a, b, w)
    assert collectives(f, *args) == []
    y = jax.jit(f)(*args)
    assert y.sharding.spec == P(None, "batch")
    np.testing.assert_allclose(y, a + w * (b - a), rtol=1e-12)


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_conv2d_batch_sharded(partitioner, groups):
    """fprop, dgrad, wgrad and the bias gradient on the local batch; the weight and bias
    gradients are reduced once (their own size), the activations never move."""
    m = mesh()
    x = random(0, (16, 8, 10, 9), jnp.float64)
    w = random(1, (8, 8 // groups, 3, 3), jnp.float64)
    b = random(2, (8,), jnp.float64)

    def loss(x, w, b):
        y = jk.conv2d(x, w, b, padding=1, stride=(1, 2), groups=groups)
        return (jnp.tanh(y) ** 2).sum()

    args = (put(x, m, "batch"), put(w, m), put(b, m))
    grads = jax.grad(loss, argnums=(0, 1, 2))
    shardings = tuple(NamedSharding(m, s) for s in (P("batch"), P(), P()))
    assert_no_gather(collectives(grads, *args, out_shardings=shardings), reduce_limit=w.size)
    actual = jax.jit(grads, out_shardings=shardings)(*args)
    assert_tree_close(actual, grads(x, w, b))
    assert actual[0].sharding.spec == P("batch")
    y = jax.jit(lambda x, w, b: jk.conv2d(x, w, b, padding=1, groups=groups))(*args)
    assert y.sharding.spec == P("batch")
    expected = jax.lax.conv_general_dilated(x, w, (1, 1), [(1, 1), (1, 1)],
                                            feature_group_count=groups,
                                            precision="highest") + b[:, None, None]
    np.testing.assert_allclose(y, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rank", [4, 5])
def test_grid_sample_batch_sharded(partitioner, rank):
    m = mesh()
    spatial = (6, 7) if rank == 4 else (4, 5, 6)
    x = random(0, (16, 3) + spatial, jnp.float64)
    grid = random(1, (16,) + (3,) * (rank - 2) + (rank - 2,), jnp.float64, -1.1, 1.1)

    def loss(x, grid):
        return (jk.grid_sample(x, grid, padding_mode="border") ** 2).sum()

    args = (put(x, m, "batch"), put(grid, m, "batch"))
    grads = jax.grad(loss, argnums=(0, 1))
    shardings = (NamedSharding(m, P("batch")),) * 2
    assert collectives(grads, *args, out_shardings=shardings) == []
    actual = jax.jit(grads, out_shardings=shardings)(*args)
    assert_tree_close(actual, grads(x, grid))


def test_grid_sample_channels_and_points_sharded(partitioner):
    """Channels sharded (grid replicated) and output points sharded (input replicated): each
    shard samples alone, with no communication."""
    m = mesh()
    x = random(0, (2, 8, 6, 7), jnp.float64)
    grid = random(1, (2, 8, 5, 2), jnp.float64, -1.1, 1.1)
    f = lambda x, g: jk.grid_sample(x, g, mode="bicubic", align_corners=True)
    expected = f(x, grid)
    for x_spec, g_spec, y_spec in [((None, "batch"), (), P(None, "batch")),
                                   ((), (None, "batch"), P(None, None, "batch"))]:
        args = (put(x, m, *x_spec), put(grid, m, *g_spec))
        assert collectives(f, *args) == []
        y = jax.jit(f)(*args)
        assert y.sharding.spec == y_spec
        np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


def _boxes(images: int) -> jax.Array:
    """Boxes on every image, fractional batch indices (truncated, as torchvision) next to shard
    boundaries, and invalid indices (-1, N, NaN: zero rows)."""
    rows = [[i % images + (0.7 if i % 3 == 0 else 0.0), 1.0 + i, 2.0 + i / 2, 9.0 + i / 3, 11.0]
            for i in range(14)]
    rows += [[-0.5, 1, 1, 5, 5], [images, 1, 1, 5, 5], [np.nan, 1, 1, 5, 5], [-1, 1, 1, 5, 5]]
    return jnp.asarray(rows, jnp.float64)


def _roi_loss(x, boxes):
    y = jk.roi_align(x, boxes, (3, 2), spatial_scale=0.9, sampling_ratio=2)
    return (jnp.nan_to_num(y) ** 2).sum()


def test_roi_align_batch_sharded_features(partitioner):
    """Data-parallel detection: features sharded by image, boxes replicated. Each shard pools
    the boxes of its own images; one reduction of the output's size; the input gradient stays
    sharded by image."""
    m = mesh()
    x = random(0, (8, 4, 12, 13), jnp.float64)
    boxes = _boxes(8)
    args = (put(x, m, "batch"), put(boxes, m))
    f = lambda x, b: jk.roi_align(x, b, (3, 2), spatial_scale=0.9, sampling_ratio=2)
    pooled = boxes.shape[0] * 4 * 3 * 2
    assert_no_gather(collectives(f, *args), reduce_limit=pooled)
    np.testing.assert_allclose(jax.jit(f)(*args), f(x, boxes), rtol=1e-12, atol=1e-12)

    grads = jax.grad(_roi_loss, argnums=(0, 1))
    shardings = (NamedSharding(m, P("batch")), NamedSharding(m, P()))
    assert_no_gather(collectives(grads, *args, out_shardings=shardings),
                     reduce_limit=max(pooled, boxes.size))
    actual = jax.jit(grads, out_shardings=shardings)(*args)
    assert_tree_close(actual, grads(x, boxes))
    assert actual[0].sharding.spec == P("batch")


def test_roi_align_channel_sharded_features(partitioner):
    """Features sharded by channel, boxes replicated: pooling needs no communication."""
    m = mesh()
    x = random(0, (3, 8, 12, 13), jnp.float64)
    boxes = _boxes(3)
    args = (put(x, m, None, "batch"), put(boxes, m))
    f = lambda x, b: jk.roi_align(x, b, 3, sampling_ratio=-1, aligned=True)
    assert collectives(f, *args) == []
    y = jax.jit(f)(*args)
    assert y.sharding.spec == P(None, "batch")
    np.testing.assert_allclose(y, f(x, boxes), rtol=1e-12, atol=1e-12)
    grads = jax.grad(_roi_loss, argnums=(0, 1))
    shardings = (NamedSharding(m, P(None, "batch")), NamedSharding(m, P()))
    # the box gradient sums over the channels: one reduction of the boxes' size
    assert_no_gather(collectives(grads, *args, out_shardings=shardings), reduce_limit=boxes.size)
    assert_tree_close(jax.jit(grads, out_shardings=shardings)(*args), grads(x, boxes))


def test_roi_align_boxes_sharded(partitioner):
    """Boxes sharded, features replicated: each shard pools its own boxes."""
    m = mesh()
    x = random(0, (2, 3, 12, 13), jnp.float64)
    boxes = _boxes(2)[:16]
    args = (put(x, m), put(boxes, m, "batch"))
    f = lambda x, b: jk.roi_align(x, b, 2)
    assert collectives(f, *args) == []
    y = jax.jit(f)(*args)
    assert y.sharding.spec == P("batch")
    np.testing.assert_allclose(y, f(x, boxes), rtol=1e-12, atol=1e-12)


def test_second_order_sharded(partitioner):
    """Hessian-vector products (the directional passes) partition like the first order."""
    m = mesh()
    x = random(0, (8, 2, 6, 7), jnp.float64)
    grid = random(1, (8, 3, 4, 2), jnp.float64, -1.1, 1.1)
    boxes = _boxes(8)
    w = random(2, (3, 2, 3, 3), jnp.float64)

    def loss(x, grid, boxes, w):
        y = jk.grid_sample(x, grid) ** 2
        z = jk.roi_align(x, boxes, 2, sampling_ratio=2)
        c = jk.conv2d(x, w, padding=1)
        return y.sum() + (jnp.nan_to_num(z) ** 3).sum() + (c ** 3).sum()

    def hvp(x, grid, boxes, w):
        primals = (x, grid, boxes, w)
        return jax.jvp(jax.grad(loss, argnums=(0, 1, 2, 3)), primals,
                       tuple(jnp.ones_like(p) for p in primals))[1]

    args = (put(x, m, "batch"), put(grid, m, "batch"), put(boxes, m), put(w, m))
    shardings = tuple(NamedSharding(m, s) for s in (P("batch"), P("batch"), P(), P()))
    assert_no_gather(collectives(hvp, *args, out_shardings=shardings),
                     reduce_limit=boxes.shape[0] * 2 * 2 * 2)
    assert_tree_close(jax.jit(hvp, out_shardings=shardings)(*args), hvp(x, grid, boxes, w))


def test_unservable_shardings_fall_back(partitioner):
    """Shardings a rule cannot keep (spatial axes, batches a mesh axis does not divide, operands
    reused under vmap) are gathered, and the results stay right."""
    m = mesh()
    x = random(0, (2, 3, 8, 16), jnp.float64)
    w = random(1, (4, 3, 3, 3), jnp.float64)
    f = lambda x, w: jk.conv2d(x, w, padding=1)
    y = jax.jit(f)(put(x, m, None, None, None, "batch"), put(w, m))
    np.testing.assert_allclose(y, f(x, w), rtol=1e-12)

    grid = random(2, (8, 2, 5, 3, 2), jnp.float64)  # vmap over grids, one shared input
    g = jax.vmap(lambda gr: jk.grid_sample(x, gr))
    np.testing.assert_allclose(jax.jit(g)(put(grid, m, "batch")), g(grid), rtol=1e-12)


# --- a training step over every op ---------------------------------------------------------------


def _init(key):
    k = jax.random.split(key, 6)
    return {
        "stem": 0.3 * jax.random.normal(k[0], (8, 3, 3, 3), jnp.float64),
        "stem_b": jnp.zeros(8, jnp.float64),
        "dw": 0.3 * jax.random.normal(k[1], (8, 1, 3, 3), jnp.float64),
        "loc": 0.01 * jax.random.normal(k[2], (8, 6), jnp.float64),
        "pw": 0.3 * jax.random.normal(k[3], (16, 16, 1, 1), jnp.float64),
        "head": 0.1 * jax.random.normal(k[4], (16 * 2 * 2, 5), jnp.float64),
    }


def _model_loss(params, images, boxes, labels):
    h = jax.nn.relu(jk.conv2d(images, params["stem"], params["stem_b"], padding=1))
    h = jk.conv2d(h, params["dw"], padding="same", groups=8)                    # depthwise
    theta = jnp.eye(2, 3) + (h.mean(axis=(2, 3)) @ params["loc"]).reshape(-1, 2, 3)
    h = jk.grid_sample(h, jk.affine_grid(theta, h.shape), padding_mode="border")
    h = jk.conv2d(jk.repeat(h, (1, 2, 1, 1)), params["pw"])                    # pointwise
    pooled = jk.roi_align(h, boxes, 2, spatial_scale=1.0, sampling_ratio=2)
    logits = pooled.reshape(pooled.shape[0], -1) @ params["head"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def _train_step(params, ema, images, boxes, labels):
    loss, grads = jax.value_and_grad(_model_loss)(params, images, boxes, labels)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    ema = jax.tree.map(lambda e, p: jk.lerp(e, p, 0.01), ema, params)
    return params, ema, loss, grads


def test_training_step_data_parallel(partitioner):
    """A jitted step over every op with the batch sharded and the weights replicated: no
    all-gather, reductions of weight or pooled-output size only, the one-device results."""
    m = mesh()
    params = _init(jax.random.key(0))
    images = random(1, (16, 3, 12, 12), jnp.float64)
    boxes = jnp.asarray([[i, 1.0, 2.0, 9.0, 10.0] for i in range(16)]
                        + [[i, 0.0, 0.0, 6.0, 5.0] for i in range(16)], jnp.float64)
    labels = jnp.arange(32) % 5
    replicated = NamedSharding(m, P())
    args = (jax.device_put(params, replicated), jax.device_put(params, replicated),
            put(images, m, "batch"), put(boxes, m), put(labels, m))
    found = collectives(_train_step, *args)
    pooled = boxes.shape[0] * 16 * 2 * 2
    assert_no_gather(found, reduce_limit=max(pooled, *(p.size for p in jax.tree.leaves(params))))
    assert_tree_close(jax.jit(_train_step)(*args),
                      _train_step(params, params, images, boxes, labels))


# --- shard_map and explicit axes -----------------------------------------------------------------


def test_shard_map_per_shard_calls():
    """Inside shard_map each call is the plain per-shard kernel; weight gradients summed with
    the user's psum equal the one-device gradients."""
    m = mesh()
    x = random(0, (16, 3, 8, 8), jnp.float64)
    w = random(1, (4, 3, 3, 3), jnp.float64)
    grid = random(2, (16, 5, 5, 2), jnp.float64)

    def local_loss(w, x, grid):
        y = jk.grid_sample(jk.conv2d(x, w, padding=1), grid)
        return (y ** 2).sum()

    def sharded_grad(w, x, grid):
        return jax.lax.psum(jax.grad(local_loss)(w, x, grid), "batch")

    f = jax.jit(jax.shard_map(sharded_grad, mesh=m, in_specs=(P(), P("batch"), P("batch")),
                              out_specs=P()))
    args = (put(w, m), put(x, m, "batch"), put(grid, m, "batch"))
    assert_no_gather(collectives(f, *args), reduce_limit=w.size)
    np.testing.assert_allclose(f(*args), jax.grad(local_loss)(w, x, grid), rtol=1e-12)


def test_explicit_axes():
    """Explicit mesh axes (sharding in types): the same partitioning rules apply; values are
    right and a batch-sharded convolution keeps its batch sharded in its type, with no
    collective (docs/scaling.md)."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    set_mesh = getattr(jax, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)
    if axis_type is None or set_mesh is None:
        pytest.skip("this jax has no explicit axes")
    if DEVICES[0].platform != jax.default_backend():
        # e.g. the CPU devices of a one-GPU machine, where compiling this program failed with
        # "No registered implementation for untyped custom call to Sharding for Host"
        # (jax 0.11.2; not investigated further)
        pytest.skip("explicit axes need a mesh of the default backend's devices")
    m = jax.make_mesh((len(DEVICES),), ("batch",), axis_types=(axis_type.Explicit,),
                      devices=DEVICES)
    x = random(0, (16, 3, 8, 8), jnp.float64)
    w = random(1, (4, 3, 3, 3), jnp.float64)
    args = (put(x, m, "batch"), put(w, m))
    expected = 0.5 * (jk.conv2d(x, w, padding=1) + x[:, :1])
    with set_mesh(m):
        f = lambda x, w: jk.lerp(jk.conv2d(x, w, padding=1), x[:, :1], 0.5)
        y = jax.jit(f)(*args)
        assert collectives(f, *args) == []
        assert jax.typeof(y).sharding.spec[0] == "batch"
        grads = jax.grad(lambda w, x: (jk.conv2d(x, w, padding=1) ** 2).sum(), argnums=(0, 1))
        actual = jax.jit(grads)(args[1], args[0])
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    assert_tree_close(actual, grads(w, x))
