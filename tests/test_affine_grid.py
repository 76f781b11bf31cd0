"""jk.affine_grid against torch.nn.functional.affine_grid (CPU), and a float64 NumPy reference
written from torch's documentation where torch is not installed; gradients by finite
differences; the composition with grid_sample against torch's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_kernels as jk
from jk_testing import assert_close, to_numpy64, torch

jax.config.update("jax_enable_x64", True)

SIZES = [(2, 3, 5, 7), (1, 1, 1, 4), (3, 2, 6, 1), (2, 1, 3, 4, 5), (1, 2, 1, 2, 3)]


def theta_for(size, seed=0, dtype=jnp.float64):
    dims = len(size) - 2
    rng = np.random.default_rng(seed)
    theta = np.eye(dims, dims + 1)[None] + rng.uniform(-0.3, 0.3, (size[0], dims, dims + 1))
    return jnp.asarray(theta, dtype)


def numpy_reference(theta, size, align):
    """From the documentation: output coordinates of each cell, normalized, then the affine map."""
    spatial = size[2:]
    def axis(n):
        if n == 1:
            return np.zeros(1)
        c = np.linspace(-1, 1, n)
        return c if align else c * (n - 1) / n
    mesh = np.meshgrid(*[axis(n) for n in spatial], indexing="ij")  # (z,) y, x
    coords = np.stack(list(mesh[::-1]) + [np.ones_like(mesh[0])], axis=-1)
    return np.einsum("...k,njk->n...j", coords, to_numpy64(theta))


@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_matches_torch_and_reference(size, align):
    theta = theta_for(size)
    got = jk.affine_grid(theta, size, align_corners=align)
    assert got.shape == (size[0],) + size[2:] + (len(size) - 2,)
    assert_close(got, numpy_reference(theta, size, align), jnp.float64)
    if torch is not None:
        expected = torch.nn.functional.affine_grid(
            torch.from_numpy(to_numpy64(theta)), list(size), align_corners=align).numpy()
        assert_close(got, expected, jnp.float64)
        got32 = jk.affine_grid(theta.astype(jnp.float32), size, align_corners=align)
        expected32 = torch.nn.functional.affine_grid(
            torch.from_numpy(to_numpy64(theta)).float(), list(size), align_corners=align).numpy()
        assert got32.dtype == jnp.float32
        assert_close(got32, expected32, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_types_compute_in_float32(dtype):
    size = (2, 1, 4, 6)
    theta = theta_for(size, dtype=dtype)
    got = jk.affine_grid(theta, size)
    assert got.dtype == dtype
    expected = numpy_reference(theta.astype(jnp.float64), size, False)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("size", [(2, 3, 4, 5), (1, 1, 2, 3, 4)], ids=str)
def test_gradients_and_spatial_transformer(size):
    theta = theta_for(size, seed=3)
    check_grads(lambda t: jk.affine_grid(t, size, align_corners=True), (theta,), order=2)
    # The spatial transformer of the demo: grid_sample of affine_grid, differentiated w.r.t. theta.
    x = jnp.asarray(np.random.default_rng(4).uniform(-1, 1, size))
    f = lambda t: jnp.sum(jk.grid_sample(x, jk.affine_grid(t, size), align_corners=False) ** 2)
    if torch is not None:
        tt = torch.from_numpy(to_numpy64(theta)).requires_grad_(True)
        tx = torch.from_numpy(to_numpy64(x))
        out = torch.nn.functional.grid_sample(
            tx, torch.nn.functional.affine_grid(tt, list(size), align_corners=False),
            align_corners=False)
        (out ** 2).sum().backward()
        assert_close(f(theta), float((out ** 2).sum().detach()), jnp.float64)
        assert_close(jax.grad(f)(theta), tt.grad.numpy(), jnp.float64)


def test_vmap_and_jit():
    size = (2, 1, 3, 4)
    thetas = jnp.stack([theta_for(size, seed=s) for s in range(3)])
    got = jax.jit(jax.vmap(lambda t: jk.affine_grid(t, size)))(thetas)
    for i in range(3):
        assert_close(got[i], jk.affine_grid(thetas[i], size), jnp.float64)


@pytest.mark.parametrize("theta_shape,size,error,message", [
    ((2, 2, 3), (2, 3, 4), ValueError, "4-D and 5-D"),
    ((2, 3, 3), (2, 3, 4, 5), ValueError, r"Nx2x3 \(2, 2, 3\)"),
    ((2, 2, 3), (2, 3, 4, 4, 5), ValueError, "Nx3x4"),
    ((3, 2, 3), (2, 3, 4, 5), ValueError, "for size"),
    ((2, 2, 3), (2, 3, 0, 5), ValueError, "positive spatial"),
])
def test_validation_errors(theta_shape, size, error, message):
    with pytest.raises(error, match=message):
        jk.affine_grid(jnp.zeros(theta_shape), size)


def test_type_errors():
    with pytest.raises(TypeError, match="affine_grid"):
        jk.affine_grid(jnp.zeros((1, 2, 3), jnp.int32), (1, 1, 2, 2))
    with pytest.raises(TypeError, match="align_corners"):
        jk.affine_grid(jnp.zeros((1, 2, 3)), (1, 1, 2, 2), align_corners="yes")
    with pytest.raises(TypeError, match="size"):
        jk.affine_grid(jnp.zeros((1, 2, 3)), (1, 1, 2.5, 2))
