"""Equinox layers backed by jax_kernels' ops, channels-first and on one unbatched example, as
``equinox.nn`` layers are (``jax.vmap`` over the batch; the ops' batching rules turn the vmap
into one kernel call): ``Conv2d``, ``GridSample``, ``RoIAlign`` and ``SpatialTransformer``.

``Conv2d`` is a drop-in for ``equinox.nn.Conv2d``: the same constructor arguments and fields,
``weight`` ``[K, C / groups, R, S]`` and ``bias`` ``[K, 1, 1]``, initialised as Equinox does
(uniform in ±1/sqrt(fan_in), from the same split of ``key``), so the two are interchangeable
parameter for parameter; it adds ``precision``.

Needs Equinox (``pip install jax_kernels[equinox]``); ``import jax_kernels`` does not import it.
"""

from __future__ import annotations

try:
    import equinox as eqx
except ImportError as error:  # pragma: no cover - exercised only where equinox is missing
    raise ImportError("jax_kernels.equinox needs Equinox, which is not installed: "
                      "pip install jax_kernels[equinox]") from error

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from . import _layers
from .affine_grid import affine_grid
from .conv import conv2d
from .grid_sample import grid_sample
from .roi_align import roi_align

__all__ = ["Conv2d", "GridSample", "RoIAlign", "SpatialTransformer"]

_PADDING_MODES = ("ZEROS", "REFLECT", "REPLICATE", "CIRCULAR")


def _default_dtype() -> Any:
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


class Conv2d(eqx.Module):
    """2-D convolution of one ``[C, H, W]`` example, as ``equinox.nn.Conv2d``, computed by
    :func:`jax_kernels.conv2d`.

    Args:
      in_channels, out_channels: C and K.
      kernel_size, stride, dilation: int or ``(h, w)``.
      padding: an int, ``(h, w)``, ``((top, bottom), (left, right))``, ``"VALID"``, ``"SAME"``
        or ``"SAME_LOWER"`` (as Equinox: output ceil(size / stride); the odd one out at the
        end, or the start for SAME_LOWER).
      groups: ``in_channels`` is a depthwise convolution.
      use_bias: whether to add ``bias``.
      padding_mode: ``"ZEROS"`` (the kernel pads), ``"REFLECT"``, ``"REPLICATE"`` or
        ``"CIRCULAR"`` (the input is padded by ``jnp.pad`` first, as Equinox does).
      dtype: the parameters' dtype (float32, or float64 when x64 is on).
      precision: ``None``/``"default"`` or ``"highest"``; see :func:`jax_kernels.conv2d`.
      key: the initialisation's key (keyword only).
    """

    weight: jax.Array
    bias: jax.Array | None
    in_channels: int = eqx.field(static=True)
    out_channels: int = eqx.field(static=True)
    kernel_size: tuple[int, int] = eqx.field(static=True)
    stride: tuple[int, int] = eqx.field(static=True)
    padding: str | tuple[tuple[int, int], tuple[int, int]] = eqx.field(static=True)
    dilation: tuple[int, int] = eqx.field(static=True)
    groups: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    padding_mode: str = eqx.field(static=True)
    precision: Any = eqx.field(static=True)

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | Sequence[int],
                 stride: int | Sequence[int] = (1, 1),
                 padding: str | int | Sequence[int] | Sequence[tuple[int, int]] = (0, 0),
                 dilation: int | Sequence[int] = (1, 1), groups: int = 1, use_bias: bool = True,
                 padding_mode: str = "ZEROS", dtype: Any = None, *, precision: Any = None,
                 key: jax.Array):
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv2d: in_channels ({in_channels}) and out_channels "
                             f"({out_channels}) must be divisible by groups ({groups})")
        if not isinstance(padding_mode, str):
            raise TypeError(f"Conv2d: padding_mode must be a string, one of {_PADDING_MODES}, "
                            f"got {padding_mode!r}")
        if padding_mode.upper() not in _PADDING_MODES:
            raise ValueError(f"Conv2d: padding_mode must be one of {_PADDING_MODES}, got "
                             f"{padding_mode!r}")
        self.kernel_size = _layers.pair("Conv2d", "kernel_size", kernel_size)
        self.stride = _layers.pair("Conv2d", "stride", stride)
        self.dilation = _layers.pair("Conv2d", "dilation", dilation)
        self.padding = _layers.explicit_padding("Conv2d", padding)
        dtype = _default_dtype() if dtype is None else dtype
        weight_key, bias_key = jax.random.split(key, 2)
        fan_in = in_channels // groups * math.prod(self.kernel_size)
        bound = 1 / math.sqrt(fan_in)
        self.weight = jax.random.uniform(weight_key, (out_channels, in_channels // groups)
                                         + self.kernel_size, dtype, -bound, bound)
        self.bias = (jax.random.uniform(bias_key, (out_channels, 1, 1), dtype, -bound, bound)
                     if use_bias else None)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.groups = groups
        self.use_bias = use_bias
        self.padding_mode = padding_mode.upper()
        self.precision = precision

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """``x`` ``[C, H, W]`` -> ``[K, P, Q]``. ``key`` is ignored (Equinox's layer API)."""
        del key
        _layers.check_rank("Conv2d", "x", x, (3,), "(C, H, W) (vmap over a batch)")
        padding = self.padding
        if self.padding_mode != "ZEROS":
            if isinstance(padding, str):
                padding = _layers.same_pads(x.shape[1:], self.kernel_size, self.stride,
                                            self.dilation, lower=padding == "SAME_LOWER") \
                    if padding != "VALID" else ((0, 0), (0, 0))
            x = _layers.pad_nonzero(x, self.padding_mode, padding, (1, 2))
            padding = "VALID"
        bias = None if self.bias is None else self.bias.reshape(-1)
        return conv2d(x, self.weight, bias, self.stride, padding, self.dilation, self.groups,
                      precision=self.precision)


class GridSample(eqx.Module):
    """:func:`jax_kernels.grid_sample` of one example: ``layer(x [C, H, W], grid [Ho, Wo, 2])
    -> [C, Ho, Wo]`` (5-D: ``[C, D, H, W]``, ``[Do, Ho, Wo, 3]`` -> ``[C, Do, Ho, Wo]``); grid
    holds (x, y[, z]) in [-1, 1]. No parameters; the options are ``grid_sample``'s."""

    mode: str = eqx.field(static=True, default="bilinear")
    padding_mode: str = eqx.field(static=True, default="zeros")
    align_corners: bool = eqx.field(static=True, default=False)
    deterministic: bool = eqx.field(static=True, default=True, kw_only=True)

    def __call__(self, x: jax.Array, grid: jax.Array, *,
                 key: jax.Array | None = None) -> jax.Array:
        del key
        _layers.check_rank("GridSample", "x", x, (3, 4), "(C, H, W) or (C, D, H, W)")
        return grid_sample(x[None], jnp.asarray(grid)[None], self.mode, self.padding_mode,
                           self.align_corners, deterministic=self.deterministic)[0]


class RoIAlign(eqx.Module):
    """:func:`jax_kernels.roi_align` on one image: ``layer(x [C, H, W], boxes [K, 4]) ->
    [K, C, h, w]``, boxes ``(x1, y1, x2, y2)`` in the image (no batch-index column: the example
    is its own batch). Differentiable with respect to the boxes too. No parameters; the options
    are ``roi_align``'s."""

    output_size: int | tuple[int, int] = eqx.field(static=True)
    spatial_scale: float = eqx.field(static=True, default=1.0)
    sampling_ratio: int = eqx.field(static=True, default=-1)
    aligned: bool = eqx.field(static=True, default=False)
    deterministic: bool = eqx.field(static=True, default=True, kw_only=True)

    def __call__(self, x: jax.Array, boxes: jax.Array, *,
                 key: jax.Array | None = None) -> jax.Array:
        del key
        _layers.check_rank("RoIAlign", "x", x, (3,), "(C, H, W)")
        boxes = jnp.asarray(boxes)
        _layers.check_rank("RoIAlign", "boxes", boxes, (2,), "(K, 4)")
        if boxes.shape[1] != 4:
            raise ValueError(f"RoIAlign: expected boxes of shape (K, 4) (x1, y1, x2, y2) for "
                             f"one example, got {tuple(boxes.shape)}")
        return roi_align(x[None], [boxes], self.output_size, self.spatial_scale,
                         self.sampling_ratio, self.aligned, deterministic=self.deterministic)


class SpatialTransformer(eqx.Module):
    """A spatial transformer (Jaderberg et al. 2015) for one ``[C, H, W]`` example:
    ``localization(x)`` gives the affine matrix (6 values or ``[2, 3]``, from output to input
    coordinates in [-1, 1]), :func:`jax_kernels.affine_grid` its sampling grid, and
    :func:`jax_kernels.grid_sample` resamples ``x`` to ``[C, Ho, Wo]``.

    Args:
      localization: the localisation network (an ``eqx.Module``: its parameters are this
        layer's), or any callable. Initialise its last layer to give the identity (weights 0,
        bias ``[1, 0, 0, 0, 1, 0]``) so that training starts from no warp.
      output_size: ``(Ho, Wo)``, or None for the input's size.
      mode, padding_mode, align_corners, deterministic: as :func:`jax_kernels.grid_sample`
        (``align_corners`` goes to ``affine_grid`` too).
    """

    localization: Callable[[jax.Array], jax.Array]
    output_size: tuple[int, int] | None = eqx.field(static=True, default=None)
    mode: str = eqx.field(static=True, default="bilinear")
    padding_mode: str = eqx.field(static=True, default="zeros")
    align_corners: bool = eqx.field(static=True, default=False)
    deterministic: bool = eqx.field(static=True, default=True, kw_only=True)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        del key
        _layers.check_rank("SpatialTransformer", "x", x, (3,), "(C, H, W) (vmap over a batch)")
        c, h, w = x.shape
        ho, wo = (h, w) if self.output_size is None else _layers.pair("SpatialTransformer", "output_size",
                                                                      self.output_size)
        theta = jnp.reshape(self.localization(x), (1, 2, 3))
        grid = affine_grid(theta, (1, c, ho, wo), self.align_corners).astype(x.dtype)
        return grid_sample(x[None], grid, self.mode, self.padding_mode, self.align_corners,
                           deterministic=self.deterministic)[0]
