"""``grid_sample``: torch.nn.functional.grid_sample as a JAX op backed by the
``jk_grid_sample_*`` kernels (4-D and 5-D input; bilinear, nearest and bicubic sampling; zeros,
border and reflection padding; align_corners either way).

The forward and each gradient are separate FFI calls, so XLA drops the gradient nobody uses:
``jk_grid_sample_fwd`` (input, grid), ``jk_grid_sample_bwd_input`` (dout, grid) and
``jk_grid_sample_bwd_grid`` (dout, input, grid). On the GPU the deterministic d_input pass
needs scratch memory, which it receives from XLA as an extra result sized at trace time.

Batching: every call is a ``custom_vmap`` function that carries, per operand, a batch map
(repeat, chunk): output batch row m reads operand row ``(m // (repeat*chunk)) * chunk +
m % chunk``. A vmapped axis is folded into the leading (batch) axis of the operands that carry
it; an operand without it is reused through its map rather than copied, so vmap over the input,
the grid or both, at any axis and nested, becomes one kernel call. Only a third level of mixed
nesting materializes an operand (a broadcast), never a loop.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from . import _ffi
from ._checks import as_array, check_float_dtypes

_MODES = _ffi.ENUMS["GridSampleMode"]
_PADDINGS = _ffi.ENUMS["GridSamplePadding"]


class _Attrs(NamedTuple):
    """The static attributes of a call (hashable: part of the jit cache key)."""

    mode: int
    padding: int
    align_corners: bool
    deterministic: bool


def grid_sample(input: Any, grid: Any, mode: str = "bilinear", padding_mode: str = "zeros",
                align_corners: bool | None = False, *, deterministic: bool = True) -> jax.Array:
    """Samples ``input`` at the locations in ``grid``, as ``torch.nn.functional.grid_sample``.

    Args:
      input: ``[N, C, H, W]`` or ``[N, C, D, H, W]``, float16, bfloat16, float32 or float64.
      grid: ``[N, Ho, Wo, 2]`` holding (x, y), or ``[N, Do, Ho, Wo, 3]`` holding (x, y, z), in
        normalized coordinates (-1 and 1 are the image's extremes); same dtype as ``input``.
      mode: ``"bilinear"`` (trilinear for 5-D), ``"nearest"`` (rounds half to even) or
        ``"bicubic"`` (4-D only).
      padding_mode: ``"zeros"``, ``"border"`` or ``"reflection"``: what points outside the
        image read.
      align_corners: whether -1 and 1 are the centres (True) or the outer edges (False) of the
        corner cells. ``None`` means False, as in torch.
      deterministic: the backward is bitwise reproducible run to run (default). False lets the
        GPU add d_input with atomics for float32/float64, which is faster for few channels.

    Returns:
      ``[N, C, Ho, Wo]`` (or ``[N, C, Do, Ho, Wo]``) in the input's dtype; half types compute
      in float32. Differentiable with respect to ``input`` and ``grid`` (the grid gradient is
      zero for ``"nearest"``, as in torch). NaN grid coordinates sample zero.
    """
    input = as_array("grid_sample", "input", input)
    grid = as_array("grid_sample", "grid", grid)
    attrs = _check(input, grid, mode, padding_mode, align_corners, deterministic)
    return _grid_sample_jit(input, grid, attrs)


def _check(input, grid, mode, padding_mode, align_corners, deterministic) -> _Attrs:
    check_float_dtypes("grid_sample", input=input, grid=grid)
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(
            f"grid_sample(): expected mode to be 'bilinear', 'nearest' or 'bicubic', got {mode!r}")
    if not isinstance(padding_mode, str) or padding_mode not in _PADDINGS:
        raise ValueError("grid_sample(): expected padding_mode to be 'zeros', 'border' or "
                         f"'reflection', got {padding_mode!r}")
    if align_corners is None:
        align_corners = False
    if not isinstance(align_corners, (bool, np.bool_)):
        raise TypeError(f"grid_sample(): align_corners must be a bool, got {align_corners!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"grid_sample(): deterministic must be a bool, got {deterministic!r}")
    shape, grid_shape = tuple(input.shape), tuple(grid.shape)
    if input.ndim not in (4, 5):
        raise ValueError(f"grid_sample(): expected a 4-D or 5-D input, got shape {shape}")
    dims = input.ndim - 2
    if grid.ndim != input.ndim or grid_shape[-1] != dims:
        expected = "(N, Ho, Wo, 2)" if dims == 2 else "(N, Do, Ho, Wo, 3)"
        raise ValueError(f"grid_sample(): expected grid of shape {expected} for a {input.ndim}-D "
                         f"input, got {grid_shape}")
    if grid_shape[0] != shape[0]:
        raise ValueError("grid_sample(): expected grid and input to have the same batch size, got "
                         f"input {shape} and grid {grid_shape}")
    if any(s == 0 for s in shape[2:]):
        raise ValueError(
            f"grid_sample(): expected input to have non-empty spatial dimensions, got {shape}")
    if mode == "bicubic" and dims != 2:
        raise ValueError(
            f"grid_sample(): mode 'bicubic' supports only 4-D input, got input of shape {shape}")
    return _Attrs(_MODES[mode], _PADDINGS[padding_mode], bool(align_corners), bool(deterministic))


# --- differentiation ------------------------------------------------------------------------


def _identity_maps(*operands: jax.Array) -> tuple[tuple[int, int], ...]:
    return tuple((1, max(x.shape[0], 1)) for x in operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _grid_sample(input, grid, attrs):
    return _kernel("fwd", attrs, _identity_maps(input, grid), ())(input, grid)


def _grid_sample_fwd(input, grid, attrs):
    return _grid_sample(input, grid, attrs), (input, grid)


def _grid_sample_bwd(attrs, residuals, dout):
    input, grid = residuals
    d_input = _kernel("bwd_input", attrs, _identity_maps(dout, grid), tuple(input.shape[1:]))(
        dout, grid)
    if attrs.mode == _MODES["nearest"]:
        d_grid = jnp.zeros_like(grid)
    else:
        d_grid = _kernel("bwd_grid", attrs, _identity_maps(dout, input, grid), ())(
            dout, input, grid)
    return d_input, d_grid


_grid_sample.defvjp(_grid_sample_fwd, _grid_sample_bwd)
# Called through jit so that eager calls reuse compiled executables (the CUDA/CPU choice of the
# backward would otherwise be traced and compiled anew on every eager gradient).
_grid_sample_jit = jax.jit(_grid_sample, static_argnums=(2,))


# --- kernel calls and their batching ---------------------------------------------------------


def _output_batch(rows: int, map_: tuple[int, int]) -> int:
    """The output batch M implied by an operand's batch rows and its map."""
    repeat, chunk = map_
    return rows // chunk * repeat * chunk


@functools.lru_cache(maxsize=None)
def _kernel(pass_: str, attrs: _Attrs, maps: tuple[tuple[int, int], ...],
            cells_shape: tuple[int, ...]):
    """The FFI call of one pass ("fwd", "bwd_input", "bwd_grid") for the given batch maps, as a
    custom_vmap function of the pass's operands. `cells_shape` is d_input's (C, *spatial)."""

    @custom_vmap
    def call(*operands):
        return _emit(pass_, attrs, maps, cells_shape, operands)

    @call.def_vmap
    def rule(axis_size, in_batched, *operands):
        if axis_size == 0:  # nothing to compute: an empty batch of per-example results
            per_example = [jax.ShapeDtypeStruct(x.shape[1:] if b else x.shape, x.dtype)
                           for x, b in zip(operands, in_batched)]
            out = jax.eval_shape(call, *per_example)
            return jnp.zeros((0,) + out.shape, out.dtype), True
        first = operands[0]
        batch = _output_batch(first.shape[1] if in_batched[0] else first.shape[0], maps[0])
        folded, folded_maps = _fold(axis_size, in_batched, operands, maps, batch)
        out = _kernel(pass_, attrs, folded_maps, cells_shape)(*folded)
        return out.reshape((axis_size, batch) + out.shape[1:]), True

    return call


def _fold(axis_size, in_batched, operands, maps, batch):
    """Folds a new vmap axis (at the front of the batched operands) into the batch axis."""
    folded, folded_maps = [], []
    for x, batched, (repeat, chunk) in zip(operands, in_batched, maps):
        if batched:
            x = x.reshape((axis_size * x.shape[1],) + x.shape[2:])
            if repeat == 1:
                chunk = max(x.shape[0], 1)
        else:
            rows = x.shape[0]
            if rows not in (0, chunk):
                # Reused in blocks already: a second reuse pattern needs the rows spelled out.
                x = jnp.broadcast_to(x.reshape((rows // chunk, 1, chunk) + x.shape[1:]),
                                     (rows // chunk, repeat, chunk) + x.shape[1:])
                x = x.reshape((batch,) + x.shape[3:])
                repeat, chunk = 1, max(batch, 1)
            repeat *= axis_size
        folded.append(x)
        folded_maps.append((repeat, chunk))
    return folded, tuple(folded_maps)


def _emit(pass_, attrs, maps, cells_shape, operands):
    batch = _output_batch(operands[0].shape[0], maps[0])
    # GridSampleAttrs in grid_sample.h: every target takes all of them.
    attributes = dict(
        mode=np.int64(attrs.mode),
        padding=np.int64(attrs.padding),
        align_corners=attrs.align_corners,
        batch_maps=np.asarray([v for m in maps for v in m], dtype=np.int64),
        deterministic=attrs.deterministic,
    )
    if pass_ == "fwd":
        input, grid = operands
        out = jax.ShapeDtypeStruct((batch, input.shape[1]) + grid.shape[1:-1], input.dtype)
        return _ffi.call("jk_grid_sample_fwd", out, input, grid, **attributes)
    if pass_ == "bwd_grid":
        dout, input, grid = operands
        d_grid = jax.ShapeDtypeStruct((batch,) + grid.shape[1:], grid.dtype)
        return _ffi.call("jk_grid_sample_bwd_grid", d_grid, dout, input, grid, **attributes)
    dout, grid = operands
    d_input = jax.ShapeDtypeStruct((batch,) + cells_shape, dout.dtype)
    return _backward_input(dout, grid, d_input, attrs, attributes)


def _backward_input(dout, grid, d_input, attrs, attributes):
    """The d_input call; its scratch result (empty except for the CUDA sorted path) is dropped."""

    def scratch_bytes():
        return _ffi.query("grid_sample_bwd_input_scratch", batch=d_input.shape[0],
                          points=int(np.prod(grid.shape[1:-1])),
                          cells=int(np.prod(d_input.shape[2:])), dims=grid.shape[-1],
                          mode=attrs.mode, element_bytes=np.dtype(dout.dtype).itemsize,
                          deterministic=attrs.deterministic)

    return _ffi.call_with_cuda_scratch("jk_grid_sample_bwd_input", d_input, dout, grid,
                                       scratch_bytes=scratch_bytes, cpu_scratch=True,
                                       **attributes)
