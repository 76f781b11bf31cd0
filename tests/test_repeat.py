"""repeat: forward and gradient against torch.Tensor.repeat (CPU) and NumPy's tile, new leading
axes, zero repeats, any dtype forward, jit/vmap/grad composition, the lowered program and
validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_kernels as jk
from jk_testing import (TORCH_UNAVAILABLE, DTYPES, assert_close, assert_lowered, from_torch, random,
                        to_torch, torch)

needs_torch = pytest.mark.skipif(torch is None, reason=TORCH_UNAVAILABLE)

CASES = [
    ((5,), (3,)),
    ((2, 3), (2, 2)),
    ((2, 3), (1, 4)),
    ((2, 3), (3, 1)),
    ((3,), (2, 1, 2)),  # new leading axes
    ((), (4, 2)),
    ((2, 1, 3), (1, 5, 1)),
    ((2, 3), (0, 2)),  # zero repeats: empty output
    ((0, 3), (2, 2)),  # empty input
    ((3, 7), (2, 3)),  # rows that no 16-byte chunk divides
    ((64, 48), (3, 2)),
    ((1, 1), (40, 70)),  # few elements, many copies
    ((4,), (1,)),
    ((5, 256), (3, 2)),  # rows of >= 512 bytes: the GPU's bulk-copy path
    ((2, 9000), (2, 3)),  # rows over one 32 KB tile
    ((1, 128), (300, 5)),  # one x row, many copies split over blocks
    ((3, 1, 256), (2, 4, 1)),
]


def _reference(x, repeats):
    x = np.asarray(x)
    padded = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
    return np.tile(padded, repeats)


@needs_torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,repeats", CASES, ids=str)
def test_forward_matches_torch(shape, repeats, dtype):
    x = random(0, shape, dtype)
    out = jk.repeat(x, repeats)
    expected = to_torch(x).repeat(*repeats)
    assert out.shape == tuple(expected.shape) and out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float64)), from_torch(expected))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.uint16, jnp.int64, jnp.bool_, jnp.complex64],
                         ids=lambda d: np.dtype(d).name)
def test_forward_any_dtype(dtype):
    x = jnp.asarray(np.random.default_rng(0).integers(0, 2, size=(3, 5))).astype(dtype)
    for repeats in ((2, 3), (2, 1, 2), (1, 1)):
        np.testing.assert_array_equal(np.asarray(jk.repeat(x, repeats)), _reference(x, repeats))


@needs_torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,repeats", CASES, ids=str)
def test_gradient_matches_torch(shape, repeats, dtype):
    x = random(1, shape, dtype)
    out_shape = _reference(np.zeros(shape), repeats).shape
    g = random(2, out_shape, dtype)
    (dx,) = jax.vjp(lambda v: jk.repeat(v, repeats), x)[1](g)
    tx = to_torch(x).requires_grad_()
    tx.repeat(*repeats).backward(to_torch(g))
    assert dx.shape == x.shape and dx.dtype == x.dtype
    # float64 sum of each element's copies: output axis i is (copy, element) = (r_i, s_i).
    padded = (1,) * (len(repeats) - len(shape)) + tuple(shape)
    blocks = tuple(v for r, s in zip(repeats, padded) for v in (r, s))
    g64 = np.asarray(g, np.float64).reshape(blocks)
    copy_axes = tuple(range(0, 2 * len(repeats), 2))
    expected = g64.sum(axis=copy_axes).reshape(shape)
    scale = np.abs(g64).sum(axis=copy_axes).max(initial=0)
    assert_close(dx, expected, dtype, scale=scale)
    assert_close(dx, from_torch(tx.grad), dtype, scale=scale)


def test_gradient_many_copies_is_accurate():
    # x small, copies many: the backward's cooperative reduction path on the GPU.
    x = random(3, (2, 3), jnp.float32)
    g = random(4, (2 * 300, 3 * 200), jnp.float32)
    (dx,) = jax.vjp(lambda v: jk.repeat(v, (300, 200)), x)[1](g)
    expected = np.asarray(g, np.float64).reshape(300, 2, 200, 3).sum(axis=(0, 2))
    assert_close(dx, expected, jnp.float32, scale=np.abs(np.asarray(g, np.float64)).reshape(300, 2, 200, 3).sum(axis=(0, 2)).max())


def test_check_grads_float64():
    x = random(0, (2, 3), jnp.float64)
    check_grads(lambda v: jk.repeat(v, (2, 1, 3)), (x,), order=2)


def test_jit_lowering_and_dce():
    x = random(0, (4, 5))
    assert_lowered(lambda v: jk.repeat(v, (2, 3)), x, targets=["jk_repeat_fwd"])
    grad = jax.grad(lambda v: jnp.sum(jk.repeat(v, (2, 3)) ** 2))
    assert_lowered(grad, x, targets=["jk_repeat_fwd", "jk_repeat_bwd"])
    np.testing.assert_array_equal(jax.jit(lambda v: jk.repeat(v, (3, 1)))(x), _reference(x, (3, 1)))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_vmap(axis):
    x = random(0, (3, 4, 2) if axis == 0 else (4, 3, 2) if axis == 1 else (4, 2, 3), jnp.float64)
    f = jax.vmap(lambda v: jk.repeat(v, (2, 2, 3)), in_axes=axis)
    out = f(x)
    moved = np.moveaxis(np.asarray(x), axis, 0)
    expected = np.stack([_reference(m, (2, 2, 3)) for m in moved])
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert_lowered(f, x, targets=["jk_repeat_fwd"])


def test_nested_vmap_and_vmap_of_grad():
    x = random(0, (2, 3, 4, 5), jnp.float64)
    nested = jax.vmap(jax.vmap(lambda v: jk.repeat(v, (3, 1, 2))), in_axes=1)
    out = nested(x)
    expected = np.stack([np.stack([_reference(x[i, j], (3, 1, 2)) for i in range(2)]) for j in range(3)])
    np.testing.assert_array_equal(np.asarray(out), expected)

    w = random(1, (3 * 4, 2 * 5), jnp.float64)

    def loss(v):
        return jnp.sum(jk.repeat(v, (3, 2)) * w)

    per_example = jax.vmap(jax.grad(loss))(x[0])
    for i in range(x.shape[1]):
        assert_close(per_example[i], jax.grad(loss)(x[0, i]))
    assert_lowered(jax.vmap(jax.grad(loss)), x[0], targets=["jk_repeat_bwd"])


def test_errors():
    x = jnp.ones((2, 3))
    with pytest.raises(ValueError, match=r"repeat\(\).*smaller than the number of dimensions of x \(shape \(2, 3\)\)"):
        jk.repeat(x, (2,))
    with pytest.raises(ValueError, match=r"repeat\(\).*non-negative"):
        jk.repeat(x, (2, -1))
    with pytest.raises(TypeError, match=r"repeat\(\).*ints"):
        jk.repeat(x, (2, 1.5))
    with pytest.raises(TypeError, match=r"repeat\(\)"):
        jk.repeat(None, (2,))


@pytest.mark.parametrize("dtype", ["int4", "uint4", "int2", "uint2", "float4_e2m1fn"])
def test_sub_byte_dtypes_are_refused(dtype):
    """JAX packs these several to a byte while NumPy reports itemsize 1: tiling them as bytes
    gave wrong values and heap corruption. They are refused at trace time, naming the op."""
    import ml_dtypes

    x = jnp.zeros((3, 5), getattr(ml_dtypes, dtype))
    with pytest.raises(TypeError, match=r"repeat\(\): dtype .* bits per element"):
        jk.repeat(x, (2, 3))
    with pytest.raises(TypeError, match=r"repeat\(\)"):
        jax.jit(lambda v: jk.repeat(v, 2)).trace(x)
