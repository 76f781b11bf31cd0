"""Kernel passes as JAX primitives.

Every FFI pass of an op (a forward, a gradient, a directional derivative) is a primitive with
five rules, so that the ops differentiate like ``jnp`` functions in every mode and order:

- a shape rule (the result's shape and dtype from the operands' and the static parameters);
- a lowering: the op's function that emits the custom call (through ``_ffi``);
- a batching rule: folds a vmapped axis into the kernel's own batch and binds the primitive
  again (never the raw custom call), so that ``grad(vmap(f))`` and ``vmap(grad(f))`` agree;
- a JVP rule: the tangent built from other passes of the op (each pass is linear in some of its
  operands: the forward in the input, the gradients in the output gradient, ...);
- a transpose rule for the operands in which the pass is linear, again other passes.

This is the one module that uses JAX's primitive machinery (``jax.extend.core.Primitive`` and
``jax.interpreters.ad / batching / mlir``); the op modules declare their rules through it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _ffi, _sharding

UndefinedPrimal = ad.UndefinedPrimal


def is_zero(tangent: Any) -> bool:
    """Whether a JVP tangent is a symbolic zero."""
    return type(tangent) is ad.Zero


def is_linear(operand: Any) -> bool:
    """Whether a transpose rule's operand is the unknown (linear) one."""
    return ad.is_undefined_primal(operand)


def aval(operand: Any):
    """The abstract value of an operand, known or linear."""
    return operand.aval if is_linear(operand) else jax.typeof(operand)


def zeros_like(operand: Any) -> jax.Array:
    a = aval(operand)
    return jnp.zeros(a.shape, a.dtype)


def instantiate(tangent: Any, primal: Any) -> jax.Array:
    """A tangent as an array (zeros for a symbolic zero)."""
    return zeros_like(primal) if is_zero(tangent) else tangent


def add(*terms: Any) -> Any:
    """The sum of tangent terms, None for none (a zero tangent)."""
    terms = [t for t in terms if t is not None]
    if not terms:
        return None
    return functools.reduce(jnp.add, terms)


def replaced(seq: Sequence[Any], index: int, value: Any) -> tuple:
    """`seq` as a tuple with item `index` replaced by `value` (a tangent in place of a primal)."""
    out = list(seq)
    out[index] = value
    return tuple(out)


def without(seq: Sequence[Any], index: int) -> tuple:
    """`seq` as a tuple without item `index` (the operand being transposed)."""
    return tuple(s for i, s in enumerate(seq) if i != index)


def moved_to_front(x: jax.Array, dim: int | None) -> jax.Array:
    return x if dim is None or dim == 0 else jnp.moveaxis(x, dim, 0)


class Kernel:
    """A kernel pass as a primitive.

    Args:
      name: the primitive's name.
      shape: ``shape(*operands, **params) -> (shape, dtype)``, called with abstract values.
      emit: ``emit(*operands, **params) -> array``: the custom call(s), traced at lowering.
      batch: ``batch(axis_size, operands, batched, **params) -> (out, out_batched)`` with the
        vmapped axis leading every batched operand; it calls kernels again, never ``emit``.
      jvp: ``jvp(primals, tangents, **params) -> tangent or None`` (None: a zero tangent);
        tangents may be symbolic zeros (``is_zero``).
      transpose: ``transpose(cotangent, *operands, **params) -> list`` with one cotangent (or
        None) per operand; the linear operands are ``UndefinedPrimal`` (``is_linear``).
      sharding: ``sharding(*avals, **params) -> _sharding.Spec`` (or None: not partitioned):
        how the pass partitions under sharded ``jit`` (see ``_sharding``).
    Params must be hashable.
    """

    def __init__(self, name: str, *, shape: Callable, emit: Callable, batch: Callable,
                 jvp: Callable, transpose: Callable | None = None,
                 sharding: Callable | None = None) -> None:
        self.name = name
        self.primitive = Primitive(name)
        self._shape = shape
        self.primitive.def_abstract_eval(self._abstract_eval)
        self.primitive.def_impl(self._eager)
        self._emit = emit
        self._sharding = sharding
        if sharding is not None:
            _sharding.requires_devices(self.primitive)
        mlir.register_lowering(self.primitive, self._lowering)
        batching.primitive_batchers[self.primitive] = self._batch_rule
        ad.primitive_jvps[self.primitive] = self._jvp_rule
        if transpose is not None:
            ad.primitive_transposes[self.primitive] = self._transpose_rule
        self._batch = batch
        self._jvp = jvp
        self._transpose = transpose

    def __call__(self, *operands: Any, **params: Any) -> jax.Array:
        return self.primitive.bind(*operands, **params)

    def result(self, *operands: Any, **params: Any) -> jax.ShapeDtypeStruct:
        shape, dtype = self._shape(*(aval(x) for x in operands), **params)
        return jax.ShapeDtypeStruct(tuple(shape), dtype)

    def _abstract_eval(self, *avals: Any, **params: Any) -> ShapedArray:
        shape, dtype = self._shape(*avals, **params)
        _check_size(self.name, tuple(shape), dtype)
        return ShapedArray(tuple(shape), dtype)

    def _lowering(self, ctx, *operands, **params):
        with _ffi.lowering_for(getattr(ctx.module_context, "platforms", None)):
            if self._sharding is not None and _sharding.partitionable(ctx):
                spec = self._sharding(*ctx.avals_in, **params)
                if spec is not None:
                    function = _sharding.partitioned(self._emit, params, ctx.avals_in,
                                                     ctx.avals_out[0], spec)
                    return mlir.lower_fun(function, multiple_results=False)(ctx, *operands)
            return mlir.lower_fun(self._emit, multiple_results=False)(ctx, *operands, **params)

    def _eager(self, *operands: Any, **params: Any) -> jax.Array:
        return _compiled(self, tuple(sorted(params.items())))(*operands)

    def _batch_rule(self, operands: Sequence[Any], dims: Sequence[int | None], **params: Any):
        sizes = {x.shape[d] for x, d in zip(operands, dims) if d is not None}
        (axis_size,) = sizes
        moved = [moved_to_front(x, d) for x, d in zip(operands, dims)]
        batched = tuple(d is not None for d in dims)
        out, out_batched = self._batch(axis_size, moved, batched, **params)
        return out, (0 if out_batched else None)

    def _jvp_rule(self, primals: Sequence[Any], tangents: Sequence[Any], **params: Any):
        out = self(*primals, **params)
        tangent = self._jvp(tuple(primals), tuple(tangents), **params)
        if tangent is None:
            return out, ad.Zero(jax.typeof(out).to_tangent_aval())
        return out, tangent

    def _transpose_rule(self, cotangent: Any, *operands: Any, **params: Any):
        if is_zero(cotangent):
            return [None] * len(operands)
        return list(self._transpose(cotangent, *operands, **params))


_OPS = ("grid_sample", "roi_align", "conv2d", "lerp", "repeat")
_MAX_BYTES = 1 << 62


def _check_size(name: str, shape: tuple[int, ...], dtype: Any) -> None:
    """A result that no memory can hold (its byte count past 2^62, where XLA's own shape
    arithmetic overflows and aborts the process) is refused at trace time."""
    elements = 1
    for extent in shape:
        elements *= int(extent)
    if elements * jnp.dtype(dtype).itemsize > _MAX_BYTES:
        op = next((o for o in _OPS if name.startswith("jk_" + o)), name)
        raise ValueError(f"{op}(): the result would have shape {shape} ({jnp.dtype(dtype).name}), "
                         f"more than 2^62 bytes")


@functools.lru_cache(maxsize=None)
def _compiled(kernel: Kernel, params: tuple[tuple[str, Any], ...]) -> Callable:
    """An eager call of a primitive runs it through jit (compiled once per parameter set)."""
    kwargs = dict(params)
    return jax.jit(lambda *operands: kernel.primitive.bind(*operands, **kwargs))
