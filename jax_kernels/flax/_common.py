"""The computations behind both Flax APIs' layers (NNX in ``jax_kernels.flax``, Linen in
``jax_kernels.flax.linen``): channels-last (NHWC) calls of the ops, with Flax's argument
conventions (``strides``, ``kernel_dilation``, ``feature_group_count``, lax's padding forms plus
``"CIRCULAR"`` and ``"REFLECT"``, dtype promotion as ``flax.nnx.Conv`` does it)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from .. import _layers
from ..affine_grid import affine_grid
from ..conv import conv2d
from ..grid_sample import grid_sample
from ..roi_align import roi_align

PaddingLike = Any  # str | int | Sequence[int | tuple[int, int]]


def check_conv_features(layer: str, in_features: int, out_features: int, groups: int) -> None:
    if groups < 1 or in_features % groups or out_features % groups:
        raise ValueError(f"{layer}: in_features ({in_features}) and out_features ({out_features}) "
                         f"must be divisible by feature_group_count ({groups})")


def check_padding(padding: PaddingLike) -> None:
    """Raises at construction for a padding that the layer's call would reject."""
    if isinstance(padding, str) and padding.upper() in ("CIRCULAR", "REFLECT"):
        return
    _layers.explicit_padding("Conv2d", padding)


def conv2d_nhwc(inputs: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                strides: int | Sequence[int], padding: PaddingLike,
                kernel_dilation: int | Sequence[int], feature_group_count: int,
                precision: Any, dtype: Any) -> jax.Array:
    """``flax.nnx.Conv``'s computation for 2-D kernels, by :func:`jax_kernels.conv2d` with
    ``data_format="NHWC"``. ``inputs`` is ``[*batch, H, W, C]`` (any number of batch axes,
    none included); the result has the same batch axes."""
    stride = _layers.pair("Conv2d", "strides", 1 if strides is None else strides)
    dilation = _layers.pair("Conv2d", "kernel_dilation", 1 if kernel_dilation is None else kernel_dilation)
    batch_shape = inputs.shape[:-3]
    if len(batch_shape) > 1:  # as Flax: every batch axis folded into one
        inputs = inputs.reshape((-1,) + inputs.shape[-3:])
    if isinstance(padding, str) and padding.upper() in ("CIRCULAR", "REFLECT"):
        pads = _layers.centred_pads(kernel.shape[:2], dilation)
        inputs = _layers.pad_nonzero(inputs, padding.upper(), pads,
                                     (inputs.ndim - 3, inputs.ndim - 2))
        padding = "VALID"
    else:
        padding = _layers.explicit_padding("Conv2d", padding)
    if dtype is None:
        dtype = jnp.result_type(*(a for a in (inputs, kernel, bias) if a is not None))
    inputs, kernel = inputs.astype(dtype), kernel.astype(dtype)
    bias = None if bias is None else bias.astype(dtype)
    y = conv2d(inputs, kernel, bias, stride, padding, dilation, feature_group_count,
               precision=precision, data_format="NHWC")
    if len(batch_shape) > 1:
        y = y.reshape(batch_shape + y.shape[1:])
    return y


def check_nhwc(layer: str, name: str, x: jax.Array) -> None:
    _layers.check_rank(layer, name, x, (4,), "(N, H, W, C)")


def spatial_transform(localization: Callable[[jax.Array], jax.Array], inputs: jax.Array,
                      output_size: Sequence[int] | None, mode: str, padding_mode: str,
                      align_corners: bool, deterministic: bool) -> jax.Array:
    """``inputs`` [N, H, W, C] resampled by the affine transforms ``localization(inputs)``
    (``[N, 6]`` or ``[N, 2, 3]``, reshaped to ``[N, 2, 3]``) to ``[N, Ho, Wo, C]``."""
    check_nhwc("SpatialTransformer", "inputs", inputs)
    n, h, w, c = inputs.shape
    ho, wo = (h, w) if output_size is None else _layers.pair("SpatialTransformer", "output_size", output_size)
    theta = jnp.reshape(localization(inputs), (n, 2, 3))
    grid = affine_grid(theta, (n, c, ho, wo), align_corners).astype(inputs.dtype)
    return grid_sample(inputs, grid, mode, padding_mode, align_corners,
                       deterministic=deterministic, data_format="NHWC")


def grid_sample_nhwc(inputs: jax.Array, grid: jax.Array, mode: str, padding_mode: str,
                     align_corners: bool, deterministic: bool) -> jax.Array:
    _layers.check_rank("GridSample", "inputs", inputs, (4, 5), "(N, H, W, C) or (N, D, H, W, C)")
    return grid_sample(inputs, grid, mode, padding_mode, align_corners,
                       deterministic=deterministic, data_format="NHWC")


def roi_align_nhwc(inputs: jax.Array, boxes: Any, output_size: int | Sequence[int],
                   spatial_scale: float, sampling_ratio: int, aligned: bool,
                   deterministic: bool) -> jax.Array:
    check_nhwc("RoIAlign", "inputs", inputs)
    return roi_align(inputs, boxes, output_size, spatial_scale, sampling_ratio, aligned,
                     deterministic=deterministic, data_format="NHWC")
