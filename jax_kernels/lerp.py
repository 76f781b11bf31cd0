"""``lerp``: torch.lerp as a JAX op backed by the ``jk_lerp_*`` kernels.

The forward and each gradient are separate FFI calls (XLA drops the gradients nobody uses).
Operands are passed at the output's rank with size-1 dimensions where they broadcast; the
kernels broadcast by strides, so nothing is materialized. Each kernel is a primitive with JVP
and transpose rules made of the others (see the comment above ``_shape_rule``). Batching: a
vmapped axis becomes one more leading dimension, broadcast (size 1) for the unbatched operands,
and the kernels fold it into their own iteration.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from . import _sharding as _partition
from ._checks import as_array, check_float_dtypes, is_python_scalar
from ._primitive import Kernel, add, aval, instantiate, is_linear, is_zero

_MAX_RANK = 16  # kMaxBroadcastRank: collapsed dimensions the kernels index
_MAX_KERNEL_RANK = 64  # operand ranks the kernels' host code takes


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
    """The result's shape by NumPy's rules, computed here: np.broadcast_shapes refuses results
    of 2^63 elements or more with its own 'do not broadcast' error, and those are size errors."""
    names = ("input", "end", "weight")
    rank = max(a.ndim for a in arrays)
    padded = [(1,) * (rank - a.ndim) + tuple(a.shape) for a in arrays]
    shape = []
    for extents in zip(*padded):
        sizes = {n for n in extents if n != 1}
        if len(sizes) > 1:
            shown = ", ".join(f"{n}{tuple(a.shape)}" for n, a in zip(names, arrays))
            raise ValueError(f"lerp(): shapes do not broadcast: {shown}")
        shape.append(sizes.pop() if sizes else 1)
    shape = tuple(shape)
    if len(shape) > _MAX_RANK:
        raise ValueError(f"lerp(): at most {_MAX_RANK} dimensions are supported, got {len(shape)}")
    return tuple(shape)


def _at_rank(x: jax.Array, rank: int) -> jax.Array:
    return x.reshape((1,) * (rank - x.ndim) + x.shape)


def _lerp_array(input, end, weight):
    shape = _broadcast_shape(input, end, weight)
    rank = len(shape)
    return _FORWARD(*(_at_rank(x, rank) for x in (input, end, weight)), shape=shape,
                    dtype=input.dtype)


def _lerp_scalar(input, end, weight: float):
    shape = _broadcast_shape(input, end)
    rank = len(shape)
    return _SCALAR_FORWARD(_at_rank(input, rank), _at_rank(end, rank), shape=shape,
                           dtype=input.dtype, weight=weight)


# --- the kernels as primitives ------------------------------------------------------------------
# Every kernel is elementwise over `shape` (the output's; operands come at its rank with size-1
# axes where they broadcast) and writes `dtype` (the operands' dtype, or float32 for half-type
# gradients that are summed over broadcast axes). lerp is affine in (input, end) and bilinear in
# (weight, end - input), so each kernel is linear in some operands and its derivatives and
# transposes are kernels of the same family:
#   fwd(i, e, w) = i + w (e - i)      bwd_input(d, w) = d (1 - w)     bwd_end(d, w) = d w
#   bwd_weight(d, i, e) = d (e - i)   scalar_*: the same with a static weight.


def _shape_rule(*operands, shape, dtype, **_):
    return shape, dtype


def _collapsed_rank(shape, operand_shapes) -> int:
    """The rank the kernels iterate over (broadcast.h, make_broadcast_geometry): the output's
    dimensions above 1, neighbours merged where every operand is broadcast alike."""
    patterns = []
    for d, n in enumerate(shape):
        if n != 1:
            pattern = tuple(s[d] == 1 for s in operand_shapes)
            if not patterns or patterns[-1] != pattern:
                patterns.append(pattern)
    return len(patterns)


def _emit(target):
    def emit(*operands, shape, dtype, weight=None):
        attrs = {} if weight is None else {"weight": np.float64(weight)}
        if (len(shape) > _MAX_KERNEL_RANK or
                _collapsed_rank(shape, [x.shape for x in operands]) > _MAX_RANK):
            # A vmap can add axes to a call that passed the rank check, up to more broadcast
            # patterns than the kernels index: then they run on the operands broadcast to the
            # output and flattened (memory of the output per operand, for such shapes only).
            flat = [jnp.broadcast_to(x, shape).reshape(-1) for x in operands]
            out = _ffi.call(target, jax.ShapeDtypeStruct((math.prod(shape),), dtype), *flat,
                            **attrs)
            return out.reshape(shape)
        return _ffi.call(target, jax.ShapeDtypeStruct(shape, dtype), *operands, **attrs)
    return emit


def _sharding(*operands, shape, dtype, weight=None):
    """Elementwise: every axis of the output may stay sharded, with the operands' axes that
    match it (their broadcast size-1 axes are their own, replicated)."""
    result = tuple(f"d{i}" for i in range(len(shape)))
    return _partition.Spec(
        tuple(tuple(f"d{i}" if n == shape[i] else f"x{j}_{i}" for i, n in enumerate(x.shape))
              for j, x in enumerate(operands)),
        result, frozenset(result), local=lambda ops, params, local_shape, offsets:
        (ops, dict(params, shape=local_shape)))


def _batch(kernel):
    def rule(axis_size, operands, batched, *, shape, **params):
        operands = [x if b else x.reshape((1,) + x.shape) for x, b in zip(operands, batched)]
        return kernel(*operands, shape=(axis_size,) + shape, **params), True
    return rule


def _reduced(kernel, like, *operands, shape, **params):
    """`kernel` over `shape`, summed over the axes along which operand `like` (at the output's
    rank) was broadcast; half types are summed in float32."""
    like = aval(like)
    axes = tuple(i for i, (p, s) in enumerate(zip(like.shape, shape)) if p != s)
    if not axes:
        return kernel(*operands, shape=shape, dtype=like.dtype, **params)
    accumulate = jnp.float32 if like.dtype in (jnp.float16, jnp.bfloat16) else like.dtype
    full = kernel(*operands, shape=shape, dtype=accumulate, **params)
    return jnp.sum(full, axis=axes, keepdims=True).astype(like.dtype)


def _as(x, dtype):
    return x if x.dtype == dtype else x.astype(dtype)


def _forward_jvp(primals, tangents, *, shape, dtype):
    i, e, w = primals
    ti, te, tw = tangents
    # The weight's term first: reverse mode transposes the terms in reverse order, which then
    # emits the gradients in the order input, end, weight.
    terms = []
    if not is_zero(tw):
        terms.append(_BWD_WEIGHT(tw, i, e, shape=shape, dtype=dtype))
    if not is_zero(ti) and not is_zero(te):
        terms.append(_FORWARD(ti, te, w, shape=shape, dtype=dtype))
    elif not is_zero(ti):
        terms.append(_BWD_INPUT(ti, w, shape=shape, dtype=dtype))
    elif not is_zero(te):
        terms.append(_BWD_END(te, w, shape=shape, dtype=dtype))
    return add(*terms)


def _forward_transpose(ct, i, e, w, *, shape, dtype):
    ct = _as(ct, aval(w).dtype)
    return [_reduced(_BWD_INPUT, i, ct, w, shape=shape) if is_linear(i) else None,
            _reduced(_BWD_END, e, ct, w, shape=shape) if is_linear(e) else None,
            None]


def _bwd_input_jvp(primals, tangents, *, shape, dtype):
    d, w = primals
    td, tw = tangents
    return add(None if is_zero(td) else _BWD_INPUT(td, w, shape=shape, dtype=dtype),
               None if is_zero(tw) else -_BWD_END(d, tw, shape=shape, dtype=dtype))


def _bwd_input_transpose(ct, d, w, *, shape, dtype):
    return [_reduced(_BWD_INPUT, d, _as(ct, aval(w).dtype), w, shape=shape), None]


def _bwd_end_jvp(primals, tangents, *, shape, dtype):
    d, w = primals
    td, tw = tangents
    return add(None if is_zero(td) else _BWD_END(td, w, shape=shape, dtype=dtype),
               None if is_zero(tw) else _BWD_END(d, tw, shape=shape, dtype=dtype))


def _bwd_end_transpose(ct, d, w, *, shape, dtype):
    # Bilinear and symmetric: the transpose in either operand multiplies by the other.
    if is_linear(d):
        return [_reduced(_BWD_END, d, _as(ct, aval(w).dtype), w, shape=shape), None]
    return [None, _reduced(_BWD_END, w, _as(ct, aval(d).dtype), d, shape=shape)]


def _bwd_weight_jvp(primals, tangents, *, shape, dtype):
    d, i, e = primals
    td, ti, te = tangents
    terms = []
    if not is_zero(td):
        terms.append(_BWD_WEIGHT(td, i, e, shape=shape, dtype=dtype))
    if not (is_zero(ti) and is_zero(te)):
        terms.append(_BWD_WEIGHT(d, instantiate(ti, i), instantiate(te, e), shape=shape,
                                 dtype=dtype))
    return add(*terms)


def _bwd_weight_transpose(ct, d, i, e, *, shape, dtype):
    if is_linear(d):
        return [_reduced(_BWD_WEIGHT, d, _as(ct, aval(i).dtype), i, e, shape=shape),
                None, None]
    # Linear in (i, e) jointly: d (e - i).
    ct = _as(ct, aval(d).dtype)
    return [None,
            -_reduced(_BWD_END, i, ct, d, shape=shape) if is_linear(i) else None,
            _reduced(_BWD_END, e, ct, d, shape=shape) if is_linear(e) else None]


def _scalar_forward_jvp(primals, tangents, *, shape, dtype, weight):
    ti, te = tangents
    if not is_zero(ti) and not is_zero(te):
        return _SCALAR_FORWARD(ti, te, shape=shape, dtype=dtype, weight=weight)
    if not is_zero(ti):
        return _SCALAR_BWD_INPUT(ti, shape=shape, dtype=dtype, weight=weight)
    if not is_zero(te):
        return _SCALAR_BWD_END(te, shape=shape, dtype=dtype, weight=weight)
    return None


def _scalar_forward_transpose(ct, i, e, *, shape, dtype, weight):
    ct = _as(ct, dtype)
    return [_reduced(_SCALAR_BWD_INPUT, i, ct, shape=shape, weight=weight)
            if is_linear(i) else None,
            _reduced(_SCALAR_BWD_END, e, ct, shape=shape, weight=weight)
            if is_linear(e) else None]


def _scalar_linear(name):
    """scalar_bwd_input / scalar_bwd_end: a multiplication by a constant, its own transpose."""

    def jvp(primals, tangents, **params):
        return None if is_zero(tangents[0]) else kernel(tangents[0], **params)

    def transpose(ct, d, *, shape, dtype, weight):
        return [_reduced(kernel, d, _as(ct, aval(d).dtype), shape=shape,
                         weight=weight)]

    kernel = Kernel(name, shape=_shape_rule, emit=_emit(name),
                    batch=lambda *a, **p: _batch(kernel)(*a, **p), jvp=jvp, transpose=transpose,
                    sharding=_sharding)
    return kernel


def _kernel(name, jvp, transpose):
    kernel = Kernel(name, shape=_shape_rule, emit=_emit(name),
                    batch=lambda *a, **p: _batch(kernel)(*a, **p), jvp=jvp, transpose=transpose,
                    sharding=_sharding)
    return kernel


_FORWARD = _kernel("jk_lerp_fwd", _forward_jvp, _forward_transpose)
_BWD_INPUT = _kernel("jk_lerp_bwd_input", _bwd_input_jvp, _bwd_input_transpose)
_BWD_END = _kernel("jk_lerp_bwd_end", _bwd_end_jvp, _bwd_end_transpose)
_BWD_WEIGHT = _kernel("jk_lerp_bwd_weight", _bwd_weight_jvp, _bwd_weight_transpose)
_SCALAR_FORWARD = _kernel("jk_lerp_scalar_fwd", _scalar_forward_jvp, _scalar_forward_transpose)
_SCALAR_BWD_INPUT = _scalar_linear("jk_lerp_scalar_bwd_input")
_SCALAR_BWD_END = _scalar_linear("jk_lerp_scalar_bwd_end")
