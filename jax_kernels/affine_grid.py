"""``affine_grid``: torch.nn.functional.affine_grid, the sampling grid of a spatial transformer.

Plain ``jnp`` (no kernel): the grid is a small batched product of the affine matrices with a
base grid, which XLA fuses with its neighbours; its derivatives are JAX's own. Meant to feed
:func:`jax_kernels.grid_sample`.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import as_array, check_bool, check_float_dtypes

_OP = "affine_grid"


def affine_grid(theta: Any, size: Sequence[int], align_corners: bool | None = False) -> jax.Array:
    """The grid of an affine transform, as ``torch.nn.functional.affine_grid``.

    Args:
      theta: ``[N, 2, 3]`` (for a 4-D ``size``) or ``[N, 3, 4]`` (5-D): per example, the matrix
        that maps output coordinates (x, y[, z], 1) to input coordinates, both normalized to
        [-1, 1]; float16, bfloat16, float32 or float64.
      size: the output size ``(N, C, H, W)`` or ``(N, C, D, H, W)`` (C is not used).
      align_corners: as in :func:`grid_sample`: whether -1 and 1 are the centres (True) or the
        outer edges (False) of the corner cells; pass the same value to both. ``None`` means False.

    Returns ``[N, H, W, 2]`` holding (x, y), or ``[N, D, H, W, 3]`` holding (x, y, z), in theta's
    dtype (half types computed in float32). An axis of size 1 sits at coordinate 0.
    Differentiable with respect to ``theta``.
    """
    theta = as_array(_OP, "theta", theta)
    check_float_dtypes(_OP, theta=theta)
    if align_corners is None:
        align_corners = False
    check_bool(_OP, "align_corners", align_corners)
    try:
        size = tuple(operator.index(s) for s in size)
    except TypeError:
        raise TypeError(f"{_OP}(): size must be a sequence of ints, got {size!r}") from None
    if len(size) not in (4, 5):
        raise ValueError(f"{_OP}(): only 4-D and 5-D sizes are supported, got size {size}")
    if min(size) < 0 or min(size[2:]) == 0:
        raise ValueError(f"{_OP}(): expected a non-negative batch and positive spatial sizes, got "
                         f"size {size}")
    dims = len(size) - 2
    expected = (size[0], dims, dims + 1)
    if tuple(theta.shape) != expected:
        kind = "Nx2x3" if dims == 2 else "Nx3x4"
        raise ValueError(f"{_OP}(): expected a batch of {dims}-D affine matrices of shape {kind} "
                         f"{expected} for size {size}, got theta of shape {tuple(theta.shape)}")
    # Coordinates along x, y(, z): the reverse of the spatial dimensions.
    spatial = size[2:][::-1]
    axes = [_base_coordinates(n, bool(align_corners)) for n in spatial]
    mesh = np.meshgrid(*axes[::-1], indexing="ij")  # [(D,) H, W] each, slowest axis first
    base = np.stack(list(mesh[::-1]) + [np.ones_like(mesh[0])], axis=-1)  # [..., (x, y(, z), 1)]
    compute = jnp.float32 if theta.dtype in (jnp.float16, jnp.bfloat16) else theta.dtype
    grid = jnp.einsum("...k,njk->n...j", jnp.asarray(base, compute), theta.astype(compute),
                      precision=jax.lax.Precision.HIGHEST)
    return grid.astype(theta.dtype)


def _base_coordinates(steps: int, align_corners: bool) -> np.ndarray:
    """torch's linspace_from_neg_one: the normalized coordinates of `steps` cells (0 for one)."""
    if steps <= 1:
        return np.zeros((steps,), np.float64)
    coords = np.linspace(-1.0, 1.0, steps)
    if not align_corners:
        coords = coords * (steps - 1) / steps
    return coords
