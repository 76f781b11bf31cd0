"""Flax Linen layers backed by jax_kernels' ops, channels-last: ``Conv2d`` (a drop-in for
``flax.linen.Conv`` with a 2-D kernel: same fields, parameters ``kernel`` HWIO and ``bias``,
same default initialisers), ``GridSample``, ``RoIAlign`` and ``SpatialTransformer``. The NNX
versions are in :mod:`jax_kernels.flax`; both compute through the same code."""

from __future__ import annotations

try:
    import flax.linen as nn
except ImportError as error:  # pragma: no cover - exercised only where flax is missing
    raise ImportError("jax_kernels.flax.linen needs Flax, which is not installed: "
                      "pip install jax_kernels[flax]") from error

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from .. import _layers
from . import _common
from ._common import PaddingLike

__all__ = ["Conv2d", "GridSample", "RoIAlign", "SpatialTransformer"]

default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()


class Conv2d(nn.Module):
    """2-D convolution on channels-last inputs, as ``flax.linen.Conv`` with a 2-D kernel,
    computed by :func:`jax_kernels.conv2d` (``data_format="NHWC"``). Parameters ``kernel``
    ``[R, S, C / groups, features]`` (C from the first input) and ``bias`` ``[features]``.
    Fields as in :class:`jax_kernels.flax.Conv2d` (``features`` is the output channels)."""

    features: int
    kernel_size: int | Sequence[int]
    strides: int | Sequence[int] = 1
    padding: PaddingLike = "SAME"
    kernel_dilation: int | Sequence[int] = 1
    feature_group_count: int = 1
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Callable[..., jax.Array] = default_kernel_init
    bias_init: Callable[..., jax.Array] = default_bias_init

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs`` ``[*batch, H, W, C]`` -> ``[*batch, P, Q, features]``."""
        in_features = inputs.shape[-1]
        _common.check_conv_features("Conv2d", in_features, self.features,
                                    self.feature_group_count)
        _common.check_padding(self.padding)
        kernel_shape = _layers.pair("Conv2d", "kernel_size", self.kernel_size) + (
            in_features // self.feature_group_count, self.features)
        kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        return _common.conv2d_nhwc(inputs, kernel, bias, self.strides, self.padding,
                                   self.kernel_dilation, self.feature_group_count,
                                   self.precision, self.dtype)


class GridSample(nn.Module):
    """``GridSample()(inputs [N, H, W, C], grid [N, Ho, Wo, 2]) -> [N, Ho, Wo, C]``: see
    :class:`jax_kernels.flax.GridSample`."""

    mode: str = "bilinear"
    padding_mode: str = "zeros"
    align_corners: bool = False
    deterministic: bool = True

    def __call__(self, inputs: jax.Array, grid: jax.Array) -> jax.Array:
        return _common.grid_sample_nhwc(inputs, grid, self.mode, self.padding_mode,
                                        self.align_corners, self.deterministic)


class RoIAlign(nn.Module):
    """``RoIAlign(output_size)(inputs [N, H, W, C], boxes) -> [K, h, w, C]``: see
    :class:`jax_kernels.flax.RoIAlign`."""

    output_size: int | Sequence[int]
    spatial_scale: float = 1.0
    sampling_ratio: int = -1
    aligned: bool = False
    deterministic: bool = True

    def __call__(self, inputs: jax.Array, boxes: Any) -> jax.Array:
        return _common.roi_align_nhwc(inputs, boxes, self.output_size, self.spatial_scale,
                                      self.sampling_ratio, self.aligned, self.deterministic)


class SpatialTransformer(nn.Module):
    """``SpatialTransformer(localization)(inputs [N, H, W, C]) -> [N, Ho, Wo, C]``:
    ``localization`` (a Linen module, a submodule of this one, or any callable) gives ``[N, 6]``
    or ``[N, 2, 3]`` affine matrices; see :class:`jax_kernels.flax.SpatialTransformer`."""

    localization: Callable[[jax.Array], jax.Array]
    output_size: int | Sequence[int] | None = None
    mode: str = "bilinear"
    padding_mode: str = "zeros"
    align_corners: bool = False
    deterministic: bool = True

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return _common.spatial_transform(self.localization, inputs, self.output_size, self.mode,
                                         self.padding_mode, self.align_corners,
                                         self.deterministic)
