"""``repeat``: torch.Tensor.repeat as a JAX op backed by the ``jk_repeat_*`` kernels.

The forward tiles x (any dtype; a byte copy); the backward sums, for each element of x, all of
its copies in the output gradient in a fixed order. Batching uses ``ffi_call``'s
``expand_dims`` method: the kernels read leading dimensions beyond ``len(repeats)`` as batch
dimensions with repeat 1.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Sequence

import jax
import numpy as np

from . import _ffi
from ._checks import FLOAT_DTYPES, as_array

_MAX_REPEATED_AXES = 15


def repeat(x: Any, repeats: int | Sequence[int]) -> jax.Array:
    """Tiles ``x``, as ``torch.Tensor.repeat(*repeats)``.

    ``len(repeats)`` must be at least ``x.ndim``; extra leading entries add new leading axes.
    Output axis i has size ``repeats[i] * x_padded.shape[i]`` (zero repeats give an empty axis).
    Any dtype tiles; floating dtypes (float16, bfloat16, float32, float64) are differentiable.
    """
    x = as_array("repeat", "x", x)
    if np.dtype(x.dtype).itemsize not in (1, 2, 4, 8, 16):
        raise TypeError(f"repeat(): dtype {x.dtype} is not supported (sub-byte element types)")
    repeats = _check_repeats(x, repeats)
    if np.dtype(x.dtype) in [np.dtype(d) for d in FLOAT_DTYPES]:
        return _repeat(x, repeats, tuple(x.shape))
    return _forward(x, repeats)


def _check_repeats(x: jax.Array, repeats: Any) -> tuple[int, ...]:
    if isinstance(repeats, (int, np.integer)) and not isinstance(repeats, bool):
        repeats = (repeats,)
    try:
        repeats = tuple(operator.index(r) for r in repeats)
    except TypeError:
        raise TypeError(f"repeat(): `repeats` must be a sequence of ints, got {repeats!r}") from None
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
    out = jax.ShapeDtypeStruct(_output_shape(x.shape, repeats), x.dtype)
    return _ffi.call("jk_repeat_fwd", out, x, vmap_method="expand_dims",
                     repeats=np.asarray(repeats, dtype=np.int64))


# x's shape is a static argument: the backward needs it (a zero repeat hides it in dout's shape).
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _repeat(x, repeats, shape):
    return _forward(x, repeats)


def _repeat_fwd(x, repeats, shape):
    return _forward(x, repeats), None


def _repeat_bwd(repeats, shape, _, dout):
    dx = jax.ShapeDtypeStruct(shape, dout.dtype)
    return (_ffi.call("jk_repeat_bwd", dx, dout, vmap_method="expand_dims",
                      repeats=np.asarray(repeats, dtype=np.int64)),)


_repeat.defvjp(_repeat_fwd, _repeat_bwd)
