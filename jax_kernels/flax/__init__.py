"""Flax layers backed by jax_kernels' ops, channels-last as Flax is: NNX modules here
(``Conv2d``, ``GridSample``, ``RoIAlign``, ``SpatialTransformer``), the Linen ones in
:mod:`jax_kernels.flax.linen`.

``Conv2d`` is a drop-in for ``flax.nnx.Conv`` with a 2-D kernel: the same constructor arguments
(``strides``, ``padding``, ``kernel_dilation``, ``feature_group_count``, ``use_bias``, ``dtype``,
``param_dtype``, ``precision``, ``kernel_init``, ``bias_init``, ``rngs``), the same parameters
(``kernel`` HWIO ``[R, S, C / groups, K]``, ``bias`` ``[K]``), drawn from the same ``rngs`` streams
in the same order with the same default initialisers, so a model's checkpoint loads into either.
Inputs are ``[*batch, H, W, C]``; outputs ``[*batch, P, Q, K]``.

Needs Flax (``pip install jax_kernels[flax]``); ``import jax_kernels`` does not import it.
"""

from __future__ import annotations

try:
    from flax import nnx
except ImportError as error:  # pragma: no cover - exercised only where flax is missing
    raise ImportError("jax_kernels.flax needs Flax, which is not installed: "
                      "pip install jax_kernels[flax]") from error

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from .. import _layers
from . import _common
from ._common import PaddingLike

__all__ = ["Conv2d", "GridSample", "RoIAlign", "SpatialTransformer"]

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class Conv2d(nnx.Module):
    """2-D convolution on channels-last inputs, as ``flax.nnx.Conv`` with a 2-D kernel, computed
    by :func:`jax_kernels.conv2d` (``data_format="NHWC"``, HWIO kernel).

    Args:
      in_features: input channels C.
      out_features: output channels K.
      kernel_size: ``(R, S)``, or an int for a square kernel (``nnx.Conv`` would read an int
        as a 1-D kernel; this layer is 2-D only).
      strides: int or ``(h, w)``.
      padding: ``"SAME"`` (the default, as Flax), ``"VALID"``, ``"SAME_LOWER"``,
        ``"CIRCULAR"``, ``"REFLECT"`` (the input is padded by ``jnp.pad`` first, as Flax does),
        an int, ``(h, w)``, or ``((top, bottom), (left, right))``.
      kernel_dilation: int or ``(h, w)``.
      feature_group_count: groups; ``in_features`` is a depthwise convolution.
      use_bias: whether to add ``bias``.
      dtype: the computation's dtype; None promotes the inputs' and parameters' dtypes.
      param_dtype: the parameters' dtype.
      precision: ``None``/``"default"`` (TF32 on tensor cores for float32 on the GPU) or
        ``"highest"`` / ``jax.lax.Precision.HIGHEST``; see :func:`jax_kernels.conv2d`.
      kernel_init, bias_init: initialisers (Flax's defaults: LeCun normal and zeros).
      rngs: ``nnx.Rngs``; the kernel and then the bias take keys from its ``params`` stream.
    """

    def __init__(self, in_features: int, out_features: int, kernel_size: int | Sequence[int],
                 strides: int | Sequence[int] = 1, *, padding: PaddingLike = "SAME",
                 kernel_dilation: int | Sequence[int] = 1, feature_group_count: int = 1,
                 use_bias: bool = True, dtype: Any = None, param_dtype: Any = jnp.float32,
                 precision: Any = None,
                 kernel_init: Callable[..., jax.Array] = default_kernel_init,
                 bias_init: Callable[..., jax.Array] = default_bias_init, rngs: nnx.Rngs):
        _common.check_conv_features("Conv2d", in_features, out_features, feature_group_count)
        _common.check_padding(padding)
        kernel_size = _layers.pair("Conv2d", "kernel_size", kernel_size)
        self.kernel_shape = kernel_size + (in_features // feature_group_count, out_features)
        self.kernel = nnx.Param(kernel_init(rngs.params(), self.kernel_shape, param_dtype))
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.kernel_size = kernel_size
        self.strides = strides
        self.padding = padding
        self.kernel_dilation = kernel_dilation
        self.feature_group_count = feature_group_count
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """``inputs`` ``[*batch, H, W, C]`` -> ``[*batch, P, Q, K]``."""
        bias = self.bias[...] if self.bias is not None else None
        return _common.conv2d_nhwc(inputs, self.kernel[...], bias, self.strides, self.padding,
                                   self.kernel_dilation, self.feature_group_count,
                                   self.precision, self.dtype)


class GridSample(nnx.Module):
    """:func:`jax_kernels.grid_sample` on channels-last inputs, as a layer without parameters:
    ``layer(inputs [N, H, W, C], grid [N, Ho, Wo, 2]) -> [N, Ho, Wo, C]``; grid holds (x, y) in
    [-1, 1]. The options are ``grid_sample``'s."""

    def __init__(self, mode: str = "bilinear", padding_mode: str = "zeros",
                 align_corners: bool = False, *, deterministic: bool = True):
        self.mode = mode
        self.padding_mode = padding_mode
        self.align_corners = align_corners
        self.deterministic = deterministic

    def __call__(self, inputs: jax.Array, grid: jax.Array) -> jax.Array:
        return _common.grid_sample_nhwc(inputs, grid, self.mode, self.padding_mode,
                                        self.align_corners, self.deterministic)


class RoIAlign(nnx.Module):
    """:func:`jax_kernels.roi_align` on channels-last inputs, as a layer without parameters:
    ``layer(inputs [N, H, W, C], boxes) -> [K, h, w, C]``, boxes ``[K, 5]`` rows
    ``(batch_index, x1, y1, x2, y2)`` or a list of ``[L_i, 4]`` arrays, one per image.
    Differentiable with respect to the boxes too. The options are ``roi_align``'s."""

    def __init__(self, output_size: int | Sequence[int], spatial_scale: float = 1.0,
                 sampling_ratio: int = -1, aligned: bool = False, *, deterministic: bool = True):
        self.output_size = output_size
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned
        self.deterministic = deterministic

    def __call__(self, inputs: jax.Array, boxes: Any) -> jax.Array:
        return _common.roi_align_nhwc(inputs, boxes, self.output_size, self.spatial_scale,
                                      self.sampling_ratio, self.aligned, self.deterministic)


class SpatialTransformer(nnx.Module):
    """A spatial transformer (Jaderberg et al. 2015) on channels-last inputs: ``localization``
    maps ``inputs [N, H, W, C]`` to affine matrices (``[N, 6]`` or ``[N, 2, 3]``, from output to
    input coordinates in [-1, 1]), :func:`jax_kernels.affine_grid` makes their sampling grid and
    :func:`jax_kernels.grid_sample` resamples the inputs to ``[N, Ho, Wo, C]``.

    Args:
      localization: the localisation network, typically an ``nnx.Module`` (its parameters are
        this layer's), or any callable. Initialise its last layer to give the identity
        (weights 0, bias ``[1, 0, 0, 0, 1, 0]``) so that training starts from no warp.
      output_size: ``(Ho, Wo)``, or None for the input's size.
      mode, padding_mode, align_corners, deterministic: as :func:`jax_kernels.grid_sample`
        (``align_corners`` goes to ``affine_grid`` too).
    """

    def __init__(self, localization: Callable[[jax.Array], jax.Array],
                 output_size: int | Sequence[int] | None = None, mode: str = "bilinear",
                 padding_mode: str = "zeros", align_corners: bool = False, *,
                 deterministic: bool = True):
        self.localization = localization
        self.output_size = output_size
        self.mode = mode
        self.padding_mode = padding_mode
        self.align_corners = align_corners
        self.deterministic = deterministic

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return _common.spatial_transform(self.localization, inputs, self.output_size, self.mode,
                                         self.padding_mode, self.align_corners,
                                         self.deterministic)
