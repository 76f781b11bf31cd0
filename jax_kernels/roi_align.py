"""``roi_align``: torchvision.ops.roi_align as a JAX op backed by the ``jk_roi_align_*`` kernels,
differentiable with respect to the input and the box coordinates.

The forward, the input gradient and the box gradient are separate FFI calls (XLA drops the
gradients nobody uses). Each call has its own ``custom_vmap`` rule that folds the mapped axis into
the kernel's own axes: boxes and output gradients into K, the input (or the input gradient) into N.
A fold into N adds a term to the box-to-image map that the kernels apply (``_Batching``), so batch
indices are never rewritten and no loop appears. On CUDA the forward stages the input in NHWC
order, and the deterministic input gradient sorts per-box row entries, in scratch memory that XLA
provides: its size comes from a host query at trace time, it is requested as an extra result, and
the wrapper drops it.
"""

from __future__ import annotations

import functools
import numbers
import operator
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from ._checks import as_array, check_float_dtypes

_MAX_BATCH_TERMS = 8  # kRoiAlignMaxBatchTerms in roi_align.h
_MAX_SAMPLING_RATIO = 1 << 20  # kRoiAlignMaxAdaptiveGrid
# Largest batch index a list of boxes may need, per dtype: consecutive integers stay exact below.
_EXACT_INTEGERS = {np.dtype(jnp.float16): 2048, np.dtype(jnp.bfloat16): 256}


class _Attrs(NamedTuple):
    """The static attributes of a call (hashable: part of the jit cache key)."""

    pooled_height: int
    pooled_width: int
    spatial_scale: float
    sampling_ratio: int
    aligned: bool
    deterministic: bool


class _Batching(NamedTuple):
    """Box k reads image ``batch_index + sum(((k // divisor) % modulus) * stride)`` over the
    terms; ``images`` is the unbatched N, the range of valid batch indices."""

    images: int
    terms: tuple[tuple[int, int, int], ...] = ()

    def fold_images(self, boxes: int, axis_size: int, images: int) -> "_Batching":
        """The map after folding a mapped axis of size ``axis_size`` in front of ``boxes`` rows
        and ``images`` images."""
        if len(self.terms) == _MAX_BATCH_TERMS:
            raise ValueError(f"roi_align(): at most {_MAX_BATCH_TERMS} nested vmaps over the input "
                             "are supported")
        return _Batching(self.images, self.terms + ((max(boxes, 1), axis_size, images),))


def roi_align(input: Any, boxes: Any, output_size: int | Sequence[int], spatial_scale: float = 1.0,
              sampling_ratio: int = -1, aligned: bool = False, *,
              deterministic: bool = True) -> jax.Array:
    """RoIAlign, as ``torchvision.ops.roi_align``, differentiable w.r.t. ``input`` and ``boxes``.

    Args:
      input: ``[N, C, H, W]`` float16, bfloat16, float32 or float64.
      boxes: ``[K, 5]`` rows ``(batch_index, x1, y1, x2, y2)``, or a list of ``[L_i, 4]`` arrays
        ``(x1, y1, x2, y2)``, one per image; same dtype as ``input``.
      output_size: ``h`` or ``(h, w)``: bins per box.
      spatial_scale: maps box coordinates to input pixels.
      sampling_ratio: samples per bin along each axis; ``<= 0`` means ``ceil(box size / bins)``
        per box (at most 2^20; only samples that can lie inside the input are visited).
      aligned: shift the box by -0.5 pixel; when False, box sizes are raised to at least 1.
      deterministic: make the CUDA input gradient bitwise reproducible (the default); False
        allows atomics for float32 and float64. The CPU is always deterministic.

    Returns ``[K, C, h, w]``: the mean over each bin's sample grid of the bilinear samples; samples
    outside ``[-1, H] x [-1, W]`` count as 0. A box whose batch index is not an integer in
    ``[0, N)`` gives zeros and no gradient. The box gradient is the exact derivative with the
    adaptive grid held fixed (zero where the size is clamped to 1); the batch-index column gets 0.
    """
    input = as_array("roi_align", "input", input)
    if input.ndim != 4:
        raise ValueError("roi_align(): expected input of shape (N, C, H, W), got "
                         f"{tuple(input.shape)}")
    boxes = _rois(input, boxes)
    check_float_dtypes("roi_align", input=input, boxes=boxes)
    attrs = _Attrs(*_output_size(output_size), _spatial_scale(spatial_scale),
                   _sampling_ratio(sampling_ratio), bool(aligned), bool(deterministic))
    return _roi_align_jit(input, boxes, attrs)


def _rois(input: jax.Array, boxes: Any) -> jax.Array:
    """``boxes`` as one ``[K, 5]`` array (a list of per-image ``[L_i, 4]`` arrays gets its batch
    index column, in the input's dtype)."""
    if not isinstance(boxes, (list, tuple)):
        boxes = as_array("roi_align", "boxes", boxes)
        if boxes.ndim != 2 or boxes.shape[1] != 5:
            raise ValueError("roi_align(): expected boxes of shape (K, 5) or a list of (L, 4) "
                             f"arrays, got {tuple(boxes.shape)}")
        return boxes
    parts = [as_array("roi_align", f"boxes[{i}]", b) for i, b in enumerate(boxes)]
    for i, b in enumerate(parts):
        if b.ndim != 2 or b.shape[1] != 4:
            raise ValueError("roi_align(): expected each array in the list of boxes of shape "
                             f"(L, 4), got {tuple(b.shape)} at index {i}")
        check_float_dtypes("roi_align", input=input, **{f"boxes[{i}]": b})
    limit = _EXACT_INTEGERS.get(np.dtype(input.dtype))
    if limit is not None and len(parts) > limit:
        raise ValueError(f"roi_align(): a list of {len(parts)} box arrays needs batch indices that "
                         f"{np.dtype(input.dtype).name} cannot represent (at most {limit})")
    if not parts:
        return jnp.zeros((0, 5), input.dtype)
    return jnp.concatenate(
        [jnp.concatenate([jnp.full((b.shape[0], 1), i, input.dtype), b], axis=1)
         for i, b in enumerate(parts)], axis=0)


def _output_size(output_size: Any) -> tuple[int, int]:
    try:
        size = (operator.index(output_size),) * 2
    except TypeError:
        try:
            size = tuple(operator.index(s) for s in output_size)
        except TypeError:
            raise TypeError("roi_align(): output_size must be an int or a pair of ints, got "
                            f"{output_size!r}") from None
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"roi_align(): output_size must be positive (h, w), got {output_size!r}")
    return size


def _spatial_scale(spatial_scale: Any) -> float:
    if isinstance(spatial_scale, (bool, np.bool_)) or not isinstance(spatial_scale, numbers.Real):
        raise TypeError("roi_align(): spatial_scale must be a Python float (a static argument), "
                        f"got {type(spatial_scale).__name__}")
    return float(spatial_scale)


def _sampling_ratio(sampling_ratio: Any) -> int:
    try:
        ratio = operator.index(sampling_ratio)
    except TypeError:
        raise TypeError(
            f"roi_align(): sampling_ratio must be an int, got {sampling_ratio!r}") from None
    if ratio > _MAX_SAMPLING_RATIO:
        raise ValueError(f"roi_align(): sampling_ratio must be at most 2^20, got {ratio}")
    return ratio


def _ffi_attributes(attrs: _Attrs, batching: _Batching) -> dict[str, Any]:
    """RoiAlignAttrs in roi_align.h: every target takes all of them. An unbatched call passes one
    neutral term: the kernels always read an array."""
    terms = batching.terms or ((1, 1, 0),)
    return dict(
        pooled_height=np.int64(attrs.pooled_height),
        pooled_width=np.int64(attrs.pooled_width),
        spatial_scale=np.float64(attrs.spatial_scale),
        sampling_ratio=np.int64(attrs.sampling_ratio),
        aligned=bool(attrs.aligned),
        batch_images=np.int64(batching.images),
        batch_terms=np.asarray([v for term in terms for v in term], dtype=np.int64),
        deterministic=bool(attrs.deterministic),
    )


def _fold_rows(x: jax.Array, batched: bool, axis_size: int) -> jax.Array:
    """``x`` with the mapped axis (leading) folded into its first axis; an unbatched ``x`` is
    repeated once per mapped index (boxes and output gradients are small next to the input)."""
    if not batched:
        x = jnp.broadcast_to(x, (axis_size,) + x.shape)
    return x.reshape((axis_size * x.shape[1],) + x.shape[2:])


def _rows(x: jax.Array, batched: bool) -> int:
    return x.shape[1] if batched else x.shape[0]


# --- forward ------------------------------------------------------------------------------------


def _forward_call(attrs: _Attrs, batching: _Batching, input: jax.Array,
                  boxes: jax.Array) -> jax.Array:
    shape = (boxes.shape[0], input.shape[1], attrs.pooled_height, attrs.pooled_width)
    result = jax.ShapeDtypeStruct(shape, input.dtype)

    def scratch_bytes():
        # The CUDA forward stages the input in NHWC order and sorts the boxes by position in
        # scratch memory.
        n, c, h, w = input.shape
        nbytes = _ffi.query("roi_align_forward_scratch", N=n, C=c, H=h, W=w, boxes=boxes.shape[0],
                            element_bytes=np.dtype(input.dtype).itemsize)
        if nbytes < 0:
            raise ValueError(f"roi_align(): {boxes.shape[0]} boxes on {input.shape[0]} images of "
                             f"{input.shape[2]} rows exceed the 32-bit box sort of the CUDA "
                             "forward: use fewer boxes per call")
        return nbytes

    return _ffi.call_with_cuda_scratch("jk_roi_align_fwd", result, input, boxes,
                                       scratch_bytes=scratch_bytes, **_ffi_attributes(attrs, batching))


@functools.lru_cache(maxsize=None)
def _forward(attrs: _Attrs, batching: _Batching):
    @jax.custom_batching.custom_vmap
    def forward(input, boxes):
        return _forward_call(attrs, batching, input, boxes)

    @forward.def_vmap
    def forward_rule(axis_size, in_batched, input, boxes):
        input_batched, boxes_batched = in_batched
        rows = _rows(boxes, boxes_batched)
        folded = batching
        if input_batched:
            folded = batching.fold_images(rows, axis_size, input.shape[1])
            input = input.reshape((axis_size * input.shape[1],) + input.shape[2:])
        out = _forward(attrs, folded)(input, _fold_rows(boxes, boxes_batched, axis_size))
        return out.reshape((axis_size, rows) + out.shape[1:]), True

    return forward


# --- backward: input gradient ---------------------------------------------------------------------


def _backward_input_call(attrs: _Attrs, batching: _Batching, shape: tuple[int, ...],
                         dout: jax.Array, boxes: jax.Array) -> jax.Array:
    result = jax.ShapeDtypeStruct(shape, dout.dtype)

    def scratch_bytes():
        # deterministic=False takes float atomics for float32/float64 (no scratch); the half
        # types have no fast atomics and always take the sorted, ordered gather.
        n, c, h, w = shape
        nbytes = _ffi.query("roi_align_backward_input_scratch", N=n, C=c, H=h, W=w,
                            boxes=boxes.shape[0], pooled_height=attrs.pooled_height,
                            pooled_width=attrs.pooled_width,
                            sampling_ratio=attrs.sampling_ratio,
                            element_bytes=np.dtype(dout.dtype).itemsize,
                            deterministic=attrs.deterministic)
        if nbytes < 0:
            raise ValueError(
                f"roi_align(): the deterministic CUDA input gradient sorts one entry per box, "
                f"touched input row and bin row in 32 bits; {boxes.shape[0]} boxes on {n} images "
                f"of {h} rows exceed that: use deterministic=False (float32/float64) or fewer "
                "boxes per call")
        return nbytes

    return _ffi.call_with_cuda_scratch("jk_roi_align_bwd_input", result, dout, boxes,
                                       scratch_bytes=scratch_bytes,
                                       **_ffi_attributes(attrs, batching))


@functools.lru_cache(maxsize=None)
def _backward_input(attrs: _Attrs, batching: _Batching, shape: tuple[int, ...]):
    @jax.custom_batching.custom_vmap
    def backward_input(dout, boxes):
        return _backward_input_call(attrs, batching, shape, dout, boxes)

    @backward_input.def_vmap
    def backward_input_rule(axis_size, in_batched, dout, boxes):
        dout_batched, boxes_batched = in_batched
        folded = batching.fold_images(_rows(boxes, boxes_batched), axis_size, shape[0])
        folded_shape = (axis_size * shape[0],) + shape[1:]
        d_input = _backward_input(attrs, folded, folded_shape)(
            _fold_rows(dout, dout_batched, axis_size), _fold_rows(boxes, boxes_batched, axis_size))
        return d_input.reshape((axis_size,) + shape), True

    return backward_input


# --- backward: box gradient -----------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _backward_boxes(attrs: _Attrs, batching: _Batching):
    @jax.custom_batching.custom_vmap
    def backward_boxes(dout, input, boxes):
        return _ffi.call("jk_roi_align_bwd_boxes", jax.ShapeDtypeStruct(boxes.shape, boxes.dtype),
                         dout, input, boxes, **_ffi_attributes(attrs, batching))

    @backward_boxes.def_vmap
    def backward_boxes_rule(axis_size, in_batched, dout, input, boxes):
        dout_batched, input_batched, boxes_batched = in_batched
        rows = _rows(boxes, boxes_batched)
        folded = batching
        if input_batched:
            folded = batching.fold_images(rows, axis_size, input.shape[1])
            input = input.reshape((axis_size * input.shape[1],) + input.shape[2:])
        d_boxes = _backward_boxes(attrs, folded)(_fold_rows(dout, dout_batched, axis_size), input,
                                                  _fold_rows(boxes, boxes_batched, axis_size))
        return d_boxes.reshape((axis_size, rows, 5)), True

    return backward_boxes


# --- differentiation --------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _roi_align(input, boxes, attrs: _Attrs):
    return _forward(attrs, _Batching(input.shape[0]))(input, boxes)


def _roi_align_fwd(input, boxes, attrs):
    return _roi_align(input, boxes, attrs), (input, boxes)


def _roi_align_bwd(attrs, residuals, dout):
    input, boxes = residuals
    batching = _Batching(input.shape[0])
    d_input = _backward_input(attrs, batching, tuple(input.shape))(dout, boxes)
    d_boxes = _backward_boxes(attrs, batching)(dout, input, boxes)
    return d_input, d_boxes


_roi_align.defvjp(_roi_align_fwd, _roi_align_bwd)
# Called through jit so that eager calls reuse compiled executables (the CUDA/CPU choice of the
# backward would otherwise be traced and compiled anew on every eager gradient).
_roi_align_jit = jax.jit(_roi_align, static_argnums=(2,))
