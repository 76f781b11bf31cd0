"""``lerp``: torch.lerp as a JAX op backed by the ``jk_lerp_*`` kernels.

The forward and each gradient are separate FFI calls (XLA drops the gradients nobody uses).
Operands are passed at the output's rank with size-1 dimensions where they broadcast; the
kernels broadcast by strides, so nothing is materialized. Batching uses ``ffi_call``'s
``expand_dims`` method: a vmapped axis becomes one more leading dimension, broadcast (size 1)
for the unbatched operands, and the kernels fold it into their own iteration.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._checks import as_array, check_float_dtypes, is_python_scalar

_MAX_RANK = 16


def lerp(input: Any, end: Any, weight: Any) -> jax.Array:
    """Linear interpolation ``input + weight * (end - input)``, as ``torch.lerp``.

    Args:
      input, end: floating arrays (float16, bfloat16, float32 or float64) of one dtype.
      weight: a Python scalar (kept in float64 and used at the computation precision, like
        torch's ``Scalar`` weight) or an array of the same dtype.
    The three broadcast together. Uses torch's two-sided formula, so ``lerp(a, b, 0) == a`` and
    ``lerp(a, b, 1) == b`` exactly; half types compute in float32. Differentiable with respect
    to ``input``, ``end`` and an array ``weight``.
    """
    input = as_array("lerp", "input", input)
    end = as_array("lerp", "end", end)
    if is_python_scalar(weight):
        check_float_dtypes("lerp", input=input, end=end)
        _broadcast_shape(input, end)
        return _lerp_scalar(input, end, float(weight))
    weight = as_array("lerp", "weight", weight)
    check_float_dtypes("lerp", input=input, end=end, weight=weight)
    _broadcast_shape(input, end, weight)
    return _lerp_array(input, end, weight)


def _broadcast_shape(*arrays: jax.Array) -> tuple[int, ...]:
    names = ("input", "end", "weight")
    try:
        shape = np.broadcast_shapes(*(a.shape for a in arrays))
    except ValueError:
        shown = ", ".join(f"{n}{tuple(a.shape)}" for n, a in zip(names, arrays))
        raise ValueError(f"lerp(): shapes do not broadcast: {shown}") from None
    if len(shape) > _MAX_RANK:
        raise ValueError(f"lerp(): at most {_MAX_RANK} dimensions are supported, got {len(shape)}")
    return tuple(shape)


def _at_rank(x: jax.Array, rank: int) -> jax.Array:
    return x.reshape((1,) * (rank - x.ndim) + x.shape)


def _result(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _call(target: str, shape: tuple[int, ...], dtype: Any, *operands: jax.Array, **attrs: Any):
    rank = len(shape)
    return _ffi.call(target, _result(shape, dtype), *(_at_rank(x, rank) for x in operands),
                     vmap_method="expand_dims", **attrs)


def _gradient(target: str, like: jax.Array, shape: tuple[int, ...], *operands: jax.Array,
              **attrs: Any) -> jax.Array:
    """The gradient for operand ``like`` from an elementwise kernel over the output shape,
    summed over the axes along which ``like`` was broadcast (in float32 for half types)."""
    padded = (1,) * (len(shape) - like.ndim) + like.shape
    axes = tuple(i for i, (p, s) in enumerate(zip(padded, shape)) if p != s)
    if not axes:
        return _call(target, shape, like.dtype, *operands, **attrs).reshape(like.shape)
    accumulate = jnp.float32 if like.dtype in (jnp.float16, jnp.bfloat16) else like.dtype
    full = _call(target, shape, accumulate, *operands, **attrs)
    return jnp.sum(full, axis=axes).reshape(like.shape).astype(like.dtype)


# --- array weight ---------------------------------------------------------------------------


@jax.custom_vjp
def _lerp_array(input, end, weight):
    shape = _broadcast_shape(input, end, weight)
    return _call("jk_lerp_fwd", shape, input.dtype, input, end, weight)


def _lerp_array_fwd(input, end, weight):
    return _lerp_array(input, end, weight), (input, end, weight)


def _lerp_array_bwd(residuals, dout):
    input, end, weight = residuals
    shape = dout.shape
    return (
        _gradient("jk_lerp_bwd_input", input, shape, dout, weight),
        _gradient("jk_lerp_bwd_end", end, shape, dout, weight),
        _gradient("jk_lerp_bwd_weight", weight, shape, dout, input, end),
    )


_lerp_array.defvjp(_lerp_array_fwd, _lerp_array_bwd)


# --- Python-scalar weight (static) ------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lerp_scalar(input, end, weight: float):
    shape = _broadcast_shape(input, end)
    return _call("jk_lerp_scalar_fwd", shape, input.dtype, input, end, weight=np.float64(weight))


def _lerp_scalar_fwd(input, end, weight):
    return _lerp_scalar(input, end, weight), (input, end)


def _lerp_scalar_bwd(weight, residuals, dout):
    input, end = residuals
    shape = dout.shape
    w = np.float64(weight)
    return (
        _gradient("jk_lerp_scalar_bwd_input", input, shape, dout, weight=w),
        _gradient("jk_lerp_scalar_bwd_end", end, shape, dout, weight=w),
    )


_lerp_scalar.defvjp(_lerp_scalar_fwd, _lerp_scalar_bwd)
