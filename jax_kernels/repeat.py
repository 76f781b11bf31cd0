"""``repeat``: torch.Tensor.repeat as a JAX op backed by the ``jk_repeat_*`` kernels.

The forward tiles x (any dtype of whole bytes; a byte copy); the backward sums, for each element of x, all of
its copies in the output gradient in a fixed order. Both are primitives, linear and each
other's transpose, so every derivative is one of them. Batching: the vmapped axis becomes a
leading dimension, which the kernels read (beyond ``len(repeats)``) as a batch dimension with
repeat 1.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import jax
import numpy as np

from . import _ffi
from . import _sharding as _partition
from ._checks import as_array, bit_width
from ._primitive import Kernel, aval, is_zero

_MAX_REPEATED_AXES = 15


def repeat(x: Any, repeats: int | Sequence[int]) -> jax.Array:
    """Tiles ``x``, as ``torch.Tensor.repeat(*repeats)``.

    ``len(repeats)`` must be at least ``x.ndim``; extra leading entries add new leading axes.
    Output axis i has size ``repeats[i] * x_padded.shape[i]`` (zero repeats give an empty axis).
    Any dtype of 1, 2, 4, 8 or 16 bytes tiles (sub-byte types such as int4 raise TypeError);
    floating dtypes (float16, bfloat16, float32, float64) are differentiable.
    """
    x = as_array("repeat", "x", x)
    bits = bit_width(x.dtype)
    if bits < 8 or np.dtype(x.dtype).itemsize not in (1, 2, 4, 8, 16):
        raise TypeError(f"repeat(): dtype {x.dtype} ({bits} bits per element) is not supported: "
                        "elements of 1, 2, 4, 8 or 16 whole bytes only (JAX packs sub-byte types "
                        "several to a byte); use jnp.tile, or cast to a byte type first")
    repeats = _check_repeats(x, repeats)
    return _forward(x, repeats)


def _check_repeats(x: jax.Array, repeats: Any) -> tuple[int, ...]:
    if isinstance(repeats, (int, np.integer)) and not isinstance(repeats, bool):
        repeats = (repeats,)
    try:
        repeats = tuple(operator.index(r) for r in repeats)
    except TypeError:
        raise TypeError(f"repeat(): `repeats` must be an int or a sequence of ints, got "
                        f"{repeats!r}") from None
    if len(repeats) < x.ndim:
        raise ValueError(
            f"repeat(): len(repeats) ({len(repeats)}) can not be smaller than the number of "
            f"dimensions of x (shape {tuple(x.shape)})"
        )
    if any(r < 0 for r in repeats):
        raise ValueError(f"repeat(): repeats must be non-negative, got {repeats}")
    if sum(r > 1 for r in repeats) > _MAX_REPEATED_AXES:
        raise ValueError(f"repeat(): at most {_MAX_REPEATED_AXES} axes with a repeat above 1 are supported, got {repeats}")
    return repeats


def _output_shape(shape: tuple[int, ...], repeats: tuple[int, ...]) -> tuple[int, ...]:
    padded = (1,) * (len(repeats) - len(shape)) + tuple(shape)
    return tuple(s * r for s, r in zip(padded, repeats))


def _forward(x: jax.Array, repeats: tuple[int, ...]) -> jax.Array:
    return _tile(x, repeats=repeats, batch=0)


# --- the two kernels as primitives ------------------------------------------------------------
# `batch` leading axes of the operand are batch axes (repeat 1) that vmap added; the kernels
# take them as such. The forward is linear in x and the backward in dout, and each is the
# other's transpose, so every derivative of any order is one of the two kernels.


def _tile_shape(x, *, repeats, batch):
    return x.shape[:batch] + _output_shape(x.shape[batch:], repeats), x.dtype


def _emit_tile(x, *, repeats, batch):
    out = jax.ShapeDtypeStruct(_tile_shape(x, repeats=repeats, batch=batch)[0], x.dtype)
    return _ffi.call("jk_repeat_fwd", out, x, repeats=np.asarray(repeats, dtype=np.int64))


def _sum_shape(dout, *, repeats, shape, batch):
    return dout.shape[:batch] + shape, dout.dtype


def _emit_sum(dout, *, repeats, shape, batch):
    dx = jax.ShapeDtypeStruct(dout.shape[:batch] + shape, dout.dtype)
    return _ffi.call("jk_repeat_bwd", dx, dout, repeats=np.asarray(repeats, dtype=np.int64))


def _sharding(small, large, repeats, batch, backward):
    """Batch axes and axes repeated once stay sharded; repeated and new axes are replicated.
    `small` is the operand of the forward, `large` its result (the other way round backward)."""
    lead = len(repeats) - (small.ndim - batch)
    s, l = [f"b{i}" for i in range(batch)], [f"b{i}" for i in range(batch)]
    l += [f"new{j}" for j in range(lead)]
    free = set(s)
    for j, r in enumerate(repeats[lead:]):
        if r == 1:
            s.append(f"d{j}"), l.append(f"d{j}"), free.add(f"d{j}")
        else:
            s.append(f"x{j}"), l.append(f"y{j}")
    if backward:
        return _partition.Spec((tuple(l),), tuple(s), frozenset(free), local=_local_sum)
    return _partition.Spec((tuple(s),), tuple(l), frozenset(free))


def _local_sum(operands, params, shape, offsets):
    return operands, dict(params, shape=shape[params["batch"]:])


def _batch_rule(kernel):
    def rule(axis_size, operands, batched, **params):
        (operand,) = operands
        return kernel(operand, **dict(params, batch=params["batch"] + 1)), True
    return rule


_tile = Kernel(
    "jk_repeat_fwd", shape=_tile_shape, emit=_emit_tile,
    batch=lambda *a, **p: _batch_rule(_tile)(*a, **p),
    jvp=lambda primals, tangents, **p: None if is_zero(tangents[0]) else _tile(tangents[0], **p),
    transpose=lambda ct, x, *, repeats, batch: [
        _sum(ct, repeats=repeats, shape=tuple(aval(x).shape[batch:]), batch=batch)],
    sharding=lambda x, *, repeats, batch: _sharding(x, None, repeats, batch, False),
)

_sum = Kernel(
    "jk_repeat_bwd", shape=_sum_shape, emit=_emit_sum,
    batch=lambda *a, **p: _batch_rule(_sum)(*a, **p),
    jvp=lambda primals, tangents, **p: None if is_zero(tangents[0]) else _sum(tangents[0], **p),
    transpose=lambda ct, dout, *, repeats, shape, batch: [_tile(ct, repeats=repeats, batch=batch)],
    sharding=lambda dout, *, repeats, shape, batch: _sharding(
        jax.ShapeDtypeStruct(dout.shape[:batch] + shape, dout.dtype), dout, repeats, batch, True),
)
