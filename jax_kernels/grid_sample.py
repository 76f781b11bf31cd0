"""``grid_sample``: torch.nn.functional.grid_sample as a JAX op backed by the
``jk_grid_sample_*`` kernels (4-D and 5-D input; bilinear, nearest and bicubic sampling; zeros,
border and reflection padding; align_corners either way), channels-first (NCHW, torch's layout)
or channels-last (``data_format="NHWC"``, Flax's).

The forward and each gradient are separate FFI calls, so XLA drops the gradient nobody uses:
``jk_grid_sample_fwd`` (input, grid), ``jk_grid_sample_bwd_input`` (dout, grid) and
``jk_grid_sample_bwd_grid`` (dout, input, grid). On the GPU the deterministic d_input pass
needs scratch memory, which it receives from XLA as an extra result sized at trace time. The
``*_directional`` targets are the derivatives of these passes along the grid (forward mode and
second order; see the comment above ``_GATHER``). Each pass is a primitive with batching, JVP
and transpose rules (``_primitive.Kernel``). Channels-last calls use the ``jk_grid_sample_nhwc_*``
targets (the same passes, reading and writing NHWC in place: no transposes).

Batching: every pass's rule carries, per operand, a batch map
(repeat, chunk): output batch row m reads operand row ``(m // (repeat*chunk)) * chunk +
m % chunk``. A vmapped axis is folded into the leading (batch) axis of the operands that carry
it; an operand without it is reused through its map rather than copied, so vmap over the input,
the grid or both, at any axis and nested, becomes one kernel call. Only a third level of mixed
nesting materializes an operand (a broadcast), never a loop.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from . import _sharding as _partition
from ._checks import as_array, check_bool, check_float_dtypes
from ._primitive import Kernel, add, aval, is_linear, is_zero, replaced, without

_MODES = _ffi.ENUMS["GridSampleMode"]
_PADDINGS = _ffi.ENUMS["GridSamplePadding"]


class _Attrs(NamedTuple):
    """The static attributes of a call (hashable: part of the jit cache key)."""

    mode: int
    padding: int
    align_corners: bool
    deterministic: bool
    channels_last: bool = False


def grid_sample(input: Any, grid: Any, mode: str = "bilinear", padding_mode: str = "zeros",
                align_corners: bool | None = False, *, deterministic: bool = True,
                data_format: str = "NCHW") -> jax.Array:
    """Samples ``input`` at the locations in ``grid``, as ``torch.nn.functional.grid_sample``.

    Args:
      input: ``[N, C, H, W]`` or ``[N, C, D, H, W]`` (channels-last: ``[N, H, W, C]`` or
        ``[N, D, H, W, C]``), float16, bfloat16, float32 or float64.
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
      data_format: ``"NCHW"`` (channels-first, the default) or ``"NHWC"`` (channels-last: the
        input is ``[N, (D,) H, W, C]`` and so is the result); ``"NCDHW"`` / ``"NDHWC"`` name the
        same for a 5-D input. The grid is the same in both. The kernels read and write
        channels-last directly.

    Returns:
      ``[N, C, Ho, Wo]`` (or ``[N, C, Do, Ho, Wo]``; channels-last ``[N, (Do,) Ho, Wo, C]``) in
      the input's dtype; half types compute in float32. Differentiable with respect to ``input``
      and ``grid`` (the grid gradient is zero for ``"nearest"``, as in torch). NaN grid
      coordinates sample zero.
    """
    input = as_array("grid_sample", "input", input)
    grid = as_array("grid_sample", "grid", grid)
    attrs = _check(input, grid, mode, padding_mode, align_corners, deterministic, data_format)
    return _grid_sample_jit(input, grid, attrs)


# data_format -> (channels_last, the input rank it requires or None for either).
_DATA_FORMATS = {"NCHW": (False, None), "NHWC": (True, None), "NCDHW": (False, 5),
                 "NDHWC": (True, 5)}


def _check_data_format(data_format, rank: int) -> bool:
    """Whether `data_format` is channels-last, for an input of `rank` dimensions."""
    if not isinstance(data_format, str):
        raise TypeError("grid_sample(): data_format must be a string ('NCHW' or 'NHWC'), got "
                        f"{type(data_format).__name__} {data_format!r}")
    if data_format not in _DATA_FORMATS:
        raise ValueError("grid_sample(): data_format must be 'NCHW' or 'NHWC' ('NCDHW' or "
                         f"'NDHWC' for a 5-D input), got {data_format!r}")
    channels_last, required_rank = _DATA_FORMATS[data_format]
    if required_rank is not None and rank != required_rank:
        raise ValueError(f"grid_sample(): data_format {data_format!r} is for a 5-D input, got a "
                         f"{rank}-D input (use 'NCHW' or 'NHWC')")
    return channels_last


def _check(input, grid, mode, padding_mode, align_corners, deterministic,
           data_format) -> _Attrs:
    check_float_dtypes("grid_sample", input=input, grid=grid)
    modes = f"expected mode to be 'bilinear', 'nearest' or 'bicubic', got {mode!r}"
    if not isinstance(mode, str):
        raise TypeError(f"grid_sample(): {modes}")
    if mode not in _MODES:
        raise ValueError(f"grid_sample(): {modes}")
    paddings = ("expected padding_mode to be 'zeros', 'border' or 'reflection', got "
                f"{padding_mode!r}")
    if not isinstance(padding_mode, str):
        raise TypeError(f"grid_sample(): {paddings}")
    if padding_mode not in _PADDINGS:
        raise ValueError(f"grid_sample(): {paddings}")
    if align_corners is None:
        align_corners = False
    check_bool("grid_sample", "align_corners", align_corners)
    check_bool("grid_sample", "deterministic", deterministic)
    shape, grid_shape = tuple(input.shape), tuple(grid.shape)
    if input.ndim not in (4, 5):
        raise ValueError(f"grid_sample(): expected a 4-D or 5-D input, got shape {shape}")
    channels_last = _check_data_format(data_format, input.ndim)
    dims = input.ndim - 2
    if grid.ndim != input.ndim or grid_shape[-1] != dims:
        expected = "(N, Ho, Wo, 2)" if dims == 2 else "(N, Do, Ho, Wo, 3)"
        raise ValueError(f"grid_sample(): expected grid of shape {expected} for a {input.ndim}-D "
                         f"input, got {grid_shape}")
    if grid_shape[0] != shape[0]:
        raise ValueError("grid_sample(): expected grid and input to have the same batch size, got "
                         f"input {shape} and grid {grid_shape}")
    if any(s == 0 for s in (shape[1:-1] if channels_last else shape[2:])):
        layout = " (channels-last)" if channels_last else ""
        raise ValueError("grid_sample(): expected input to have non-empty spatial dimensions, got "
                         f"{shape}{layout}")
    if mode == "bicubic" and dims != 2:
        raise ValueError(
            f"grid_sample(): mode 'bicubic' supports only 4-D input, got input of shape {shape}")
    return _Attrs(_MODES[mode], _PADDINGS[padding_mode], bool(align_corners), bool(deterministic),
                  channels_last)


# --- the kernels as primitives ------------------------------------------------------------------
# With W_t(g) the weight of tap t of an output point at grid coordinates g, and directions u, v
# (arrays shaped like the grid), three families of passes, k = 0, 1, 2 directions:
#   gather_k(input, grid, u..)   out[c, p]   = sum_t input[c, tap_t] D^k W_t[u..]
#   scatter_k(dout, grid, u..)   d_in[c, x]  = sum_{p, t: tap_t = x} dout[c, p] D^k W_t[u..]
#   reduce_j(dout, input, grid, u..)   d_grid[p, a] = sum_{c, t} dout[c, p] input[c, tap_t]
#                                                       D^(j+1) W_t[u.., e_a]
# gather_0 is the forward, scatter_0 the input gradient and reduce_0 the grid gradient (the
# existing targets); k >= 1 are the "directional" targets. Each pass is linear in its value
# operand (input or dout) and in each direction, and its derivative along the grid is the pass
# with one more direction, so the family is closed under JVP and transposition up to second
# order: gather_k is scatter_k's transpose in the values, and reduce_(k-1)'s in a direction.
# Third derivatives along the grid are not provided.

_MAX_ORDER = 2  # derivatives along the grid


def _grid_sample_call(input, grid, attrs):
    return _GATHER(input, grid, attrs=attrs, maps=_identity_maps(input, grid))


# Called through jit so that eager calls reuse compiled executables (the CUDA/CPU choice of the
# backward would otherwise be traced and compiled anew on every eager gradient).
_grid_sample_jit = jax.jit(_grid_sample_call, static_argnums=(2,))


def _identity_map(rows: int) -> tuple[int, int]:
    return (1, max(rows, 1))


def _identity_maps(*operands: jax.Array) -> tuple[tuple[int, int], ...]:
    return tuple(_identity_map(x.shape[0]) for x in operands)


def _output_batch(rows: int, map_: tuple[int, int]) -> int:
    """The output batch M implied by an operand's batch rows and its map."""
    repeat, chunk = map_
    return rows // chunk * repeat * chunk


def _unmap(x: jax.Array, map_: tuple[int, int], rows: int) -> jax.Array:
    """The cotangent of an operand with `rows` rows read through `map_` from per-output-row
    cotangents x [M, ...]: the rows that reused one operand row are summed."""
    repeat, chunk = map_
    if repeat == 1:
        return x
    acc = jnp.float32 if x.dtype in (jnp.float16, jnp.bfloat16) else x.dtype
    blocks = x.reshape((rows // chunk, repeat, chunk) + x.shape[1:]).astype(acc)
    return blocks.sum(axis=1).reshape((rows,) + x.shape[1:]).astype(x.dtype)


def _too_high() -> NotImplementedError:
    return NotImplementedError(
        f"grid_sample(): derivatives of order above {_MAX_ORDER} with respect to the grid are not "
        "supported")


def _nearest(attrs: _Attrs) -> bool:
    return attrs.mode == _MODES["nearest"]


def _target(attrs: _Attrs, pass_: str) -> str:
    """The FFI target of `pass_` (e.g. "fwd", "bwd_input_directional") in the call's layout."""
    return f"jk_grid_sample_{'nhwc_' if attrs.channels_last else ''}{pass_}"


def _channels(x, attrs: _Attrs) -> int:
    """The channel count of an input- or output-shaped array."""
    return x.shape[-1] if attrs.channels_last else x.shape[1]


def _spatial(shape, attrs: _Attrs) -> tuple[int, ...]:
    """The spatial extents of an input- or output-shaped array's shape."""
    return tuple(shape[1:-1] if attrs.channels_last else shape[2:])


def _with_channels(batch: int, channels: int, spatial, attrs: _Attrs) -> tuple[int, ...]:
    """An input- or output-shaped array's shape in the call's layout."""
    spatial = tuple(spatial)
    if attrs.channels_last:
        return (batch,) + spatial + (channels,)
    return (batch, channels) + spatial


# gather_k(input, grid, *directions)


def _gather_shape(input, grid, *directions, attrs, maps):
    M = _output_batch(input.shape[0], maps[0])
    return _with_channels(M, _channels(input, attrs), grid.shape[1:-1], attrs), input.dtype


def _gather_emit(input, grid, *directions, attrs, maps):
    out = jax.ShapeDtypeStruct(*_gather_shape(input, grid, attrs=attrs, maps=maps))
    if directions or attrs.channels_last:
        target = _target(attrs, "fwd_directional" if directions else "fwd")
        return _ffi.call(target, out, input, grid, *directions, **_ffi_attributes(attrs, maps))

    # The channels-first CUDA forward may sample a channels-last copy of the input, in scratch
    # (forward_copy.cu); where it may not, it asks for none and lowers to the plain target.
    def scratch_bytes():
        nbytes = _ffi.query("grid_sample_fwd_scratch", input_elements=int(np.prod(input.shape)),
                            channels=input.shape[1], dims=grid.shape[-1],
                            element_bytes=np.dtype(input.dtype).itemsize)
        if nbytes == _ffi.SIZE_OVERFLOW:
            raise ValueError(
                f"grid_sample(): the CUDA forward's copy of an input {tuple(input.shape)} needs "
                "more scratch memory than a 64-bit size can describe")
        return nbytes

    return _ffi.call_with_cuda_scratch("jk_grid_sample_fwd_adaptive", out, input, grid,
                                       scratch_bytes=scratch_bytes,
                                       plain_target="jk_grid_sample_fwd",
                                       **_ffi_attributes(attrs, maps))


def _gather_jvp(primals, tangents, *, attrs, maps):
    input, grid, *dirs = primals
    t_input, t_grid, *t_dirs = tangents
    terms = []
    if not is_zero(t_input):
        terms.append(_GATHER(t_input, grid, *dirs, attrs=attrs, maps=maps))
    for j, t in enumerate(t_dirs):
        if not is_zero(t):
            terms.append(_GATHER(input, grid, *replaced(dirs, j, t), attrs=attrs, maps=maps))
    if not is_zero(t_grid) and not _nearest(attrs):
        if len(dirs) == _MAX_ORDER:
            raise _too_high()
        terms.append(_GATHER(input, grid, *dirs, t_grid, attrs=attrs, maps=maps + (maps[1],)))
    return add(*terms)


def _gather_transpose(ct, input, grid, *dirs, attrs, maps):
    ct_map = _identity_map(ct.shape[0])
    cts = [None] * (2 + len(dirs))
    if is_linear(input):
        shape = aval(input).shape
        d_input = _SCATTER(ct, grid, *dirs, attrs=attrs, maps=(ct_map,) + maps[1:],
                           cells_shape=tuple(shape[1:]))
        cts[0] = _unmap(d_input, maps[0], shape[0])
    for j, d in enumerate(dirs):
        if is_linear(d):
            rest = without(dirs, j)
            d_dir = _REDUCE(ct, input, grid, *rest, attrs=attrs,
                            maps=(ct_map,) + maps[:2] + without(maps[2:], j))
            cts[2 + j] = _unmap(d_dir, maps[2 + j], aval(d).shape[0])
    return cts


# scatter_k(dout, grid, *directions)


def _scatter_shape(dout, grid, *directions, attrs, maps, cells_shape):
    return (_output_batch(dout.shape[0], maps[0]),) + cells_shape, dout.dtype


def _scatter_emit(dout, grid, *directions, attrs, maps, cells_shape):
    d_input = jax.ShapeDtypeStruct(*_scatter_shape(dout, grid, attrs=attrs, maps=maps,
                                                    cells_shape=cells_shape))
    # The directional passes always take the deterministic (sorted) CUDA path.
    deterministic = attrs.deterministic or bool(directions)

    def scratch_bytes():
        points = int(np.prod(grid.shape[1:-1]))
        spatial = _spatial(d_input.shape, attrs)
        nbytes = _ffi.query("grid_sample_bwd_input_scratch", batch=d_input.shape[0],
                            points=points, cells=int(np.prod(spatial)),
                            extended_cells=int(np.prod([s + 1 for s in spatial])),
                            dims=grid.shape[-1],
                            mode=attrs.mode, element_bytes=np.dtype(dout.dtype).itemsize,
                            deterministic=deterministic, directional=bool(directions))
        if nbytes == _ffi.SIZE_OVERFLOW:
            raise ValueError(
                f"grid_sample(): the deterministic CUDA input gradient of an input "
                f"{d_input.shape} sampled at {d_input.shape[0]} x {points} points needs more "
                "scratch memory than a 64-bit size can describe")
        return nbytes

    target = _target(attrs, "bwd_input_directional" if directions else "bwd_input")
    return _ffi.call_with_cuda_scratch(target, d_input, dout, grid, *directions,
                                       scratch_bytes=scratch_bytes, cpu_scratch=True,
                                       **_ffi_attributes(attrs, maps))


def _scatter_jvp(primals, tangents, *, attrs, maps, cells_shape):
    dout, grid, *dirs = primals
    t_dout, t_grid, *t_dirs = tangents
    kw = dict(attrs=attrs, maps=maps, cells_shape=cells_shape)
    terms = []
    if not is_zero(t_dout):
        terms.append(_SCATTER(t_dout, grid, *dirs, **kw))
    for j, t in enumerate(t_dirs):
        if not is_zero(t):
            terms.append(_SCATTER(dout, grid, *replaced(dirs, j, t), **kw))
    if not is_zero(t_grid) and not _nearest(attrs):
        if len(dirs) == _MAX_ORDER:
            raise _too_high()
        terms.append(_SCATTER(dout, grid, *dirs, t_grid, attrs=attrs, maps=maps + (maps[1],),
                              cells_shape=cells_shape))
    return add(*terms)


def _scatter_transpose(ct, dout, grid, *dirs, attrs, maps, cells_shape):
    ct_map = _identity_map(ct.shape[0])
    cts = [None] * (2 + len(dirs))
    if is_linear(dout):
        d_dout = _GATHER(ct, grid, *dirs, attrs=attrs, maps=(ct_map,) + maps[1:])
        cts[0] = _unmap(d_dout, maps[0], aval(dout).shape[0])
    for j, d in enumerate(dirs):
        if is_linear(d):
            d_dir = _REDUCE(dout, ct, grid, *without(dirs, j), attrs=attrs,
                            maps=(maps[0], ct_map, maps[1]) + without(maps[2:], j))
            cts[2 + j] = _unmap(d_dir, maps[2 + j], aval(d).shape[0])
    return cts


# reduce_j(dout, input, grid, *directions)


def _reduce_shape(dout, input, grid, *directions, attrs, maps):
    return (_output_batch(dout.shape[0], maps[0]),) + grid.shape[1:], grid.dtype


def _reduce_emit(dout, input, grid, *directions, attrs, maps):
    d_grid = jax.ShapeDtypeStruct(*_reduce_shape(dout, input, grid, attrs=attrs, maps=maps))
    if _nearest(attrs):  # the weights do not move with the grid
        return jnp.zeros(d_grid.shape, d_grid.dtype)
    target = _target(attrs, "bwd_grid_directional" if directions else "bwd_grid")
    return _ffi.call(target, d_grid, dout, input, grid, *directions,
                     **_ffi_attributes(attrs, maps))


def _reduce_jvp(primals, tangents, *, attrs, maps):
    if _nearest(attrs):
        return None
    dout, input, grid, *dirs = primals
    t_dout, t_input, t_grid, *t_dirs = tangents
    terms = []
    if not is_zero(t_dout):
        terms.append(_REDUCE(t_dout, input, grid, *dirs, attrs=attrs, maps=maps))
    if not is_zero(t_input):
        terms.append(_REDUCE(dout, t_input, grid, *dirs, attrs=attrs, maps=maps))
    for j, t in enumerate(t_dirs):
        if not is_zero(t):
            terms.append(_REDUCE(dout, input, grid, *replaced(dirs, j, t), attrs=attrs,
                                 maps=maps))
    if not is_zero(t_grid):
        if len(dirs) + 1 == _MAX_ORDER:
            raise _too_high()
        terms.append(_REDUCE(dout, input, grid, *dirs, t_grid, attrs=attrs,
                             maps=maps + (maps[2],)))
    return add(*terms)


def _reduce_transpose(ct, dout, input, grid, *dirs, attrs, maps):
    cts = [None] * (3 + len(dirs))
    if _nearest(attrs):
        return cts
    ct_map = _identity_map(ct.shape[0])
    if is_linear(dout):
        d_dout = _GATHER(input, grid, *dirs, ct, attrs=attrs, maps=maps[1:] + (ct_map,))
        cts[0] = _unmap(d_dout, maps[0], aval(dout).shape[0])
    if is_linear(input):
        shape = aval(input).shape
        d_input = _SCATTER(dout, grid, *dirs, ct, attrs=attrs,
                           maps=(maps[0],) + maps[2:] + (ct_map,), cells_shape=tuple(shape[1:]))
        cts[1] = _unmap(d_input, maps[1], shape[0])
    for j, d in enumerate(dirs):
        if is_linear(d):
            d_dir = _REDUCE(dout, input, grid, *without(dirs, j), ct, attrs=attrs,
                            maps=maps[:3] + without(maps[3:], j) + (ct_map,))
            cts[3 + j] = _unmap(d_dir, maps[3 + j], aval(d).shape[0])
    return cts


# --- batching ----------------------------------------------------------------------------------


def _batched(kernel):
    """The batching rule of a pass: the vmapped axis folds into the output batch M; operands
    without it are reused through their batch maps, not copied."""

    def rule(axis_size, operands, in_batched, *, maps, **params):
        if axis_size == 0:  # nothing to compute: an empty batch of per-example results
            per_example = [jax.ShapeDtypeStruct(x.shape[1:] if b else x.shape, x.dtype)
                           for x, b in zip(operands, in_batched)]
            out = jax.eval_shape(lambda *a: kernel(*a, maps=maps, **params), *per_example)
            return jnp.zeros((0,) + out.shape, out.dtype), True
        first = operands[0]
        batch = _output_batch(first.shape[1] if in_batched[0] else first.shape[0], maps[0])
        folded, folded_maps = _fold(axis_size, in_batched, operands, maps, batch)
        out = kernel(*folded, maps=folded_maps, **params)
        return out.reshape((axis_size, batch) + out.shape[1:]), True

    return rule


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


def _ffi_attributes(attrs: _Attrs, maps) -> dict[str, Any]:
    # GridSampleAttrs in grid_sample.h: every target takes all of them.
    return dict(
        mode=np.int64(attrs.mode),
        padding=np.int64(attrs.padding),
        align_corners=attrs.align_corners,
        batch_maps=np.asarray([v for m in maps for v in m], dtype=np.int64),
        deterministic=attrs.deterministic,
    )


# --- partitioning under sharded jit: the batch and the channels stay sharded, and so do the
# output points of the forward and the grid gradient (each point is computed alone); the input
# gradient sums over the points and the grid gradient over the channels. Operands reused
# through batch maps (vmap) are replicated.


def _dims(rank: int, prefix: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(rank))


def _batch_factors(maps, count: int) -> tuple[tuple[str, ...], frozenset[str]]:
    """The batch factor of each of `count` tensors (operands, then the result): one shared
    factor when no operand is reused through its map, else one replicated factor each."""
    if all(repeat == 1 for repeat, _ in maps):
        return ("n",) * count, frozenset({"n"})
    return tuple(f"n{i}" for i in range(count)), frozenset()


def _local_maps(operands, params, shape, offsets):
    """The parameters of a per-shard call: identity maps of the local batch (a reused operand
    is replicated: its map stays), the local input gradient's cells."""
    params = dict(params)
    if all(repeat == 1 for repeat, _ in params["maps"]):
        params["maps"] = tuple(_identity_map(x.shape[0]) for x in operands)
    if "cells_shape" in params:
        params["cells_shape"] = tuple(shape[1:])
    return operands, params


def _with_c(batch: str, spatial: tuple[str, ...], attrs: _Attrs) -> tuple[str, ...]:
    """The factors of an input- or output-shaped array: its channels "c" in the call's layout."""
    return (batch,) + spatial + ("c",) if attrs.channels_last else (batch, "c") + spatial


def _gather_sharding(input, grid, *dirs, attrs, maps):
    n, free = _batch_factors(maps, 3 + len(dirs))
    s, o = _dims(input.ndim - 2, "s"), _dims(grid.ndim - 2, "o")
    points = o + ("g",)
    return _partition.Spec((_with_c(n[0], s, attrs), (n[1],) + points)
                           + tuple((n[2 + j],) + points for j in range(len(dirs))),
                           _with_c(n[-1], o, attrs), free | {"c"} | set(o), local=_local_maps)


def _scatter_sharding(dout, grid, *dirs, attrs, maps, cells_shape):
    n, free = _batch_factors(maps, 3 + len(dirs))
    s, o = _dims(len(cells_shape) - 1, "s"), _dims(grid.ndim - 2, "o")
    points = o + ("g",)
    return _partition.Spec((_with_c(n[0], o, attrs), (n[1],) + points)
                           + tuple((n[2 + j],) + points for j in range(len(dirs))),
                           _with_c(n[-1], s, attrs), free | {"c"} | set(o), local=_local_maps)


def _reduce_sharding(dout, input, grid, *dirs, attrs, maps):
    if _nearest(attrs):  # zeros, no kernel
        return None
    n, free = _batch_factors(maps, 4 + len(dirs))
    s, o = _dims(input.ndim - 2, "s"), _dims(grid.ndim - 2, "o")
    points = o + ("g",)
    return _partition.Spec((_with_c(n[0], o, attrs), _with_c(n[1], s, attrs), (n[2],) + points)
                           + tuple((n[3 + j],) + points for j in range(len(dirs))),
                           (n[-1],) + points, free | {"c"} | set(o), local=_local_maps)


_GATHER = Kernel("jk_grid_sample_gather", shape=_gather_shape, emit=_gather_emit,
                 batch=lambda *a, **p: _batched(_GATHER)(*a, **p), jvp=_gather_jvp,
                 transpose=_gather_transpose, sharding=_gather_sharding)
_SCATTER = Kernel("jk_grid_sample_scatter", shape=_scatter_shape, emit=_scatter_emit,
                  batch=lambda *a, **p: _batched(_SCATTER)(*a, **p), jvp=_scatter_jvp,
                  transpose=_scatter_transpose, sharding=_scatter_sharding)
_REDUCE = Kernel("jk_grid_sample_reduce", shape=_reduce_shape, emit=_reduce_emit,
                 batch=lambda *a, **p: _batched(_REDUCE)(*a, **p), jvp=_reduce_jvp,
                 transpose=_reduce_transpose, sharding=_reduce_sharding)
