"""Trace-time validation shared by the ops: dtype checks whose messages name the op."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def as_array(op: str, name: str, value: Any) -> jax.Array:
    """``value`` as a JAX array; TypeError naming ``op`` if it is not array-like."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{op}(): expected an array for `{name}`, got {type(value).__name__}")
    try:
        return jnp.asarray(value)
    except TypeError as error:
        raise TypeError(f"{op}(): expected an array for `{name}`, got {type(value).__name__}") from error


def check_float_dtypes(op: str, **arrays: Any) -> np.dtype:
    """All ``arrays`` share one floating dtype among float16/bfloat16/float32/float64."""
    dtypes = {name: np.dtype(a.dtype) for name, a in arrays.items()}
    for name, dtype in dtypes.items():
        if dtype not in [np.dtype(d) for d in FLOAT_DTYPES]:
            raise TypeError(
                f"{op}(): `{name}` has dtype {dtype}; expected float16, bfloat16, float32 or float64"
            )
    if len(set(dtypes.values())) > 1:
        shown = ", ".join(f"{name}={dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"{op}(): arrays must share one dtype (as in torch), got {shown}")
    return next(iter(dtypes.values()))


def bit_width(dtype: Any) -> int:
    """Bits per element. NumPy reports itemsize 1 for the sub-byte types of ml_dtypes (int4,
    uint4, int2, uint2, float4_e2m1fn), which JAX packs several to a byte; their own finfo /
    iinfo know the width."""
    import ml_dtypes

    dtype = np.dtype(dtype)
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo):
        try:
            return int(info(dtype).bits)
        except (ValueError, TypeError):
            pass
    return dtype.itemsize * 8


def check_bool(op: str, name: str, value: Any) -> bool:
    """A flag option as a bool; anything but a Python or NumPy bool is a TypeError naming the op
    (a truthy string such as 'no' must not pass as True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op}(): {name} must be a bool, got {value!r}")
    return bool(value)


def is_python_scalar(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
