"""``roi_align``: torchvision.ops.roi_align as a JAX op backed by the ``jk_roi_align_*`` kernels,
differentiable with respect to the input and the box coordinates.

The forward, the input gradient and the box gradient are separate FFI calls (XLA drops the
gradients nobody uses); the ``*_directional`` targets are their derivatives along the boxes
(forward mode and second order; see the comment above ``_GATHER``). Each pass is a primitive with
batching, JVP and transpose rules (``_primitive.Kernel``); its batching rule folds the mapped axis
into the kernel's own axes: boxes, output gradients and directions into K, the input (or the input
gradient) into N.
A fold into N adds a term to the box-to-image map that the kernels apply (``_Batching``), so batch
indices are never rewritten and no loop appears. On CUDA the forward stages the input in NHWC
order, and the deterministic input gradient sorts per-box row entries, in scratch memory that XLA
provides: its size comes from a host query at trace time, it is requested as an extra result, and
the wrapper drops it.

``data_format="NHWC"`` calls the ``jk_roi_align_nhwc_*`` targets, the same kernels instantiated
for channels-last tensors (input ``[N, H, W, C]``, output ``[K, PH, PW, C]``): they read and
write that layout in place, so no transpose appears in the program (and the CUDA forward and
input gradient skip their staging). Every rule below is the same for both layouts; only the
shapes and the sharding factors' order differ.
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
from . import _sharding as _partition
from ._checks import as_array, check_bool, check_float_dtypes
from ._primitive import Kernel, add, aval, is_linear, is_zero, replaced, without

_MAX_BATCH_TERMS = 8  # kRoiAlignMaxBatchTerms in roi_align.h
# kRoiAlignMaxFixedGrid: a fixed grid costs PH * PW * sampling_ratio^2 samples per box and channel.
_MAX_SAMPLING_RATIO = 64
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
    channels_last: bool = False  # data_format="NHWC": not an FFI attribute, it picks the targets


class _Batching(NamedTuple):
    """Box k reads image ``batch_index + sum(((k // divisor) % modulus) * stride)`` over the
    terms; ``images`` is the unbatched N, the range of valid batch indices."""

    images: int
    terms: tuple[tuple[int, int, int], ...] = ()

    def fold_images(self, boxes: int, axis_size: int, images: int) -> "_Batching":
        """The map after folding a mapped axis of size ``axis_size`` in front of ``boxes`` rows
        and ``images`` images."""
        if len(self.terms) == _MAX_BATCH_TERMS:
            raise ValueError(f"roi_align(): at most {_MAX_BATCH_TERMS} nested vmaps are "
                             "supported (of the input, or of the boxes in an input gradient)")
        return _Batching(self.images, self.terms + ((max(boxes, 1), axis_size, images),))


def roi_align(input: Any, boxes: Any, output_size: int | Sequence[int], spatial_scale: float = 1.0,
              sampling_ratio: int = -1, aligned: bool = False, *, deterministic: bool = True,
              data_format: str = "NCHW") -> jax.Array:
    """RoIAlign, as ``torchvision.ops.roi_align``, differentiable w.r.t. ``input`` and ``boxes``.

    Args:
      input: ``[N, C, H, W]`` (``[N, H, W, C]`` with ``data_format="NHWC"``) float16, bfloat16,
        float32 or float64.
      boxes: ``[K, 5]`` rows ``(batch_index, x1, y1, x2, y2)``, or a list of ``[L_i, 4]`` arrays
        ``(x1, y1, x2, y2)``, one per image; same dtype as ``input``.
      output_size: ``h`` or ``(h, w)``: bins per box.
      spatial_scale: maps box coordinates to input pixels.
      sampling_ratio: samples per bin along each axis, at most 64 (a fixed grid costs
        ``PH * PW * sampling_ratio**2`` samples per box; torchvision has no cap); ``<= 0`` means
        ``ceil(box size / bins)`` per box (at most 2^20; only samples that can lie inside the
        input are visited, so an adaptive grid costs at most about ``4 H W`` samples per box).
      aligned: shift the box by -0.5 pixel; when False, box sizes are raised to at least 1.
      deterministic: make the CUDA input gradient bitwise reproducible (the default); False
        allows atomics for float32 and float64. The CPU is always deterministic.
      data_format: ``"NCHW"`` (the default) or ``"NHWC"`` (channels last: input ``[N, H, W, C]``,
        output ``[K, h, w, C]``, read and written in that layout by the kernels).

    Returns ``[K, C, h, w]`` (``[K, h, w, C]`` for NHWC): the mean over each bin's sample grid
    of the bilinear samples; samples outside ``[-1, H] x [-1, W]`` count as 0. The batch index
    is truncated toward zero, as torchvision does (0.7 reads image 0); a box whose truncated
    index is not in ``[0, N)``, or whose index is NaN or infinite, gives zeros and no gradient.
    The box gradient is the exact derivative with the adaptive grid held fixed (zero where the
    size is clamped to 1); the batch-index column gets 0.
    """
    channels_last = _channels_last(data_format)
    input = as_array("roi_align", "input", input)
    if input.ndim != 4:
        raise ValueError(f"roi_align(): expected input of shape {_IMAGE_SHAPE[channels_last]}, "
                         f"got {tuple(input.shape)}")
    boxes = _rois(input, boxes)
    check_float_dtypes("roi_align", input=input, boxes=boxes)
    attrs = _Attrs(*_output_size(output_size), _spatial_scale(spatial_scale),
                   _sampling_ratio(sampling_ratio), check_bool("roi_align", "aligned", aligned),
                   check_bool("roi_align", "deterministic", deterministic), channels_last)
    return _roi_align_jit(input, boxes, attrs)


_IMAGE_SHAPE = {False: "(N, C, H, W)", True: "(N, H, W, C)"}


def _channels_last(data_format: Any) -> bool:
    if not isinstance(data_format, str):
        raise TypeError("roi_align(): data_format must be a string ('NCHW' or 'NHWC'), got "
                        f"{type(data_format).__name__} {data_format!r}")
    if data_format not in ("NCHW", "NHWC"):
        raise ValueError(f"roi_align(): data_format must be 'NCHW' or 'NHWC', got {data_format!r}")
    return data_format == "NHWC"


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
    if len(size) != 2:
        raise ValueError("roi_align(): output_size must be an int or a pair of ints, got "
                         f"{output_size!r}")
    if min(size) < 1:
        raise ValueError(f"roi_align(): output_size must be positive, got {output_size!r}")
    return size


def _spatial_scale(spatial_scale: Any) -> float:
    """A static float: a Python or NumPy number, or a concrete (not traced) JAX scalar."""
    if isinstance(spatial_scale, (jax.Array, np.ndarray)) and not isinstance(
            spatial_scale, jax.core.Tracer):
        if spatial_scale.shape == () and jnp.issubdtype(spatial_scale.dtype, jnp.floating):
            return float(spatial_scale)
    elif isinstance(spatial_scale, numbers.Real) and not isinstance(spatial_scale,
                                                                  (bool, np.bool_)):
        return float(spatial_scale)
    raise TypeError("roi_align(): spatial_scale must be a number or a concrete float scalar (a "
                    f"static argument, not traced), got {type(spatial_scale).__name__}")


def _sampling_ratio(sampling_ratio: Any) -> int:
    try:
        ratio = operator.index(sampling_ratio)
    except TypeError:
        raise TypeError(
            f"roi_align(): sampling_ratio must be an int, got {sampling_ratio!r}") from None
    if ratio > _MAX_SAMPLING_RATIO:
        raise ValueError(
            f"roi_align(): sampling_ratio must be at most {_MAX_SAMPLING_RATIO}, got {ratio}: a "
            "fixed grid costs output_size^2 * sampling_ratio^2 samples per box and channel "
            "(sampling_ratio=0 adapts the grid to each box)")
    return ratio


def _target(name: str, attrs: _Attrs) -> str:
    """The target of pass ``name`` (``jk_roi_align_fwd``, ...) in the call's layout: NHWC's are
    ``jk_roi_align_nhwc_*``; the host queries likewise (``roi_align_nhwc_*``)."""
    if not attrs.channels_last:
        return name
    return name.replace("roi_align_", "roi_align_nhwc_", 1)


def _image_extents(shape: Sequence[int], attrs: _Attrs) -> tuple[int, int, int, int]:
    """(N, C, H, W) of an input (or input gradient) shape in the call's layout."""
    if attrs.channels_last:
        n, h, w, c = shape
        return n, c, h, w
    return tuple(shape)


def _ffi_attributes(attrs: _Attrs, batching: _Batching) -> dict[str, Any]:
    """RoiAlignAttrs in roi_align.h: every target takes all of them (both layouts). An unbatched
    call passes one neutral term: the kernels always read an array."""
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


# --- the kernels as primitives ------------------------------------------------------------------
# Box k's samples sit at positions affine in its coordinates; with W_s the bilinear weights of
# sample s and directions u, v shaped like the boxes ([K, 5], the batch-index column ignored),
# three families of passes, k = 0, 1, 2 directions:
#   gather_k(input, boxes, u..)          out[k, c, bin] = mean_s sum_corners input D^k W_s[u..]
#   scatter_k(dout, boxes, u..)          d_input: gather_k's transpose in the input
#   reduce_j(dout, input, boxes, u..)    d_boxes[k, :] = D^(j+1) <dout, gather_0>[u.., .]
# gather_0 is the forward, scatter_0 the input gradient and reduce_0 the box gradient; k >= 1
# are the "directional" targets. Each pass is linear in its value operand and each direction,
# and its derivative along the boxes is the pass with one more direction: the family is closed
# under JVP and transposition up to second order (third derivatives along the boxes are not
# provided).

_MAX_ORDER = 2  # derivatives along the box coordinates


def _roi_align(input, boxes, attrs: _Attrs):
    return _GATHER(input, boxes, attrs=attrs, batching=_Batching(input.shape[0]))


# Called through jit so that eager calls reuse compiled executables (the CUDA/CPU choice of the
# backward would otherwise be traced and compiled anew on every eager gradient).
_roi_align_jit = jax.jit(_roi_align, static_argnums=(2,))


def _too_high() -> NotImplementedError:
    return NotImplementedError(
        f"roi_align(): derivatives of order above {_MAX_ORDER} with respect to the boxes are not "
        "supported")


# gather_k(input, boxes, *directions)


def _gather_shape(input, boxes, *directions, attrs, batching):
    k, c = boxes.shape[0], _image_extents(input.shape, attrs)[1]
    ph, pw = attrs.pooled_height, attrs.pooled_width
    return ((k, ph, pw, c) if attrs.channels_last else (k, c, ph, pw)), input.dtype


def _gather_emit(input, boxes, *directions, attrs, batching):
    result = jax.ShapeDtypeStruct(*_gather_shape(input, boxes, attrs=attrs, batching=batching))
    attributes = _ffi_attributes(attrs, batching)
    if directions:
        return _ffi.call(_target("jk_roi_align_fwd_directional", attrs), result, input, boxes,
                         *directions, **attributes)

    def scratch_bytes():
        # The CUDA forward buckets the output bins by input region in scratch memory, or sorts
        # the boxes by position there (and, for NCHW, stages the input in NHWC order).
        n, c, h, w = _image_extents(input.shape, attrs)
        nbytes = _ffi.query(_target("roi_align_forward_scratch", attrs), N=n, C=c, H=h, W=w,
                            boxes=boxes.shape[0], pooled_height=attrs.pooled_height,
                            pooled_width=attrs.pooled_width, sampling_ratio=attrs.sampling_ratio,
                            element_bytes=np.dtype(input.dtype).itemsize)
        if nbytes == _ffi.SIZE_OVERFLOW:
            raise ValueError(f"roi_align(): the CUDA forward of {boxes.shape[0]} boxes on an input "
                             f"{tuple(input.shape)} needs more scratch memory than a 64-bit size "
                             "can describe")
        if nbytes < 0:
            raise ValueError(f"roi_align(): {boxes.shape[0]} boxes on {n} images of {h} rows "
                             "exceed the 32-bit box sort of the CUDA forward: use fewer boxes per "
                             "call")
        return nbytes

    return _ffi.call_with_cuda_scratch(_target("jk_roi_align_fwd", attrs), result, input, boxes,
                                       scratch_bytes=scratch_bytes, **attributes)


def _gather_jvp(primals, tangents, *, attrs, batching):
    input, boxes, *dirs = primals
    t_input, t_boxes, *t_dirs = tangents
    kw = dict(attrs=attrs, batching=batching)
    terms = []
    if not is_zero(t_input):
        terms.append(_GATHER(t_input, boxes, *dirs, **kw))
    for j, t in enumerate(t_dirs):
        if not is_zero(t):
            terms.append(_GATHER(input, boxes, *replaced(dirs, j, t), **kw))
    if not is_zero(t_boxes):
        if len(dirs) == _MAX_ORDER:
            raise _too_high()
        terms.append(_GATHER(input, boxes, *dirs, t_boxes, **kw))
    return add(*terms)


def _gather_transpose(ct, input, boxes, *dirs, attrs, batching):
    kw = dict(attrs=attrs, batching=batching)
    cts = [None] * (2 + len(dirs))
    if is_linear(input):
        cts[0] = _SCATTER(ct, boxes, *dirs, shape=tuple(aval(input).shape), **kw)
    for j, d in enumerate(dirs):
        if is_linear(d):
            cts[2 + j] = _REDUCE(ct, input, boxes, *without(dirs, j), **kw)
    return cts


# scatter_k(dout, boxes, *directions)


def _scatter_shape(dout, boxes, *directions, attrs, batching, shape):
    return shape, dout.dtype


def _scatter_emit(dout, boxes, *directions, attrs, batching, shape):
    result = jax.ShapeDtypeStruct(shape, dout.dtype)
    attributes = _ffi_attributes(attrs, batching)
    if directions:
        return _ffi.call(_target("jk_roi_align_bwd_input_directional", attrs), result, dout,
                         boxes, *directions, **attributes)

    def scratch_bytes():
        # deterministic=False takes float atomics for float32/float64 (no scratch); the half
        # types have no fast atomics and always take the sorted, ordered gather.
        n, c, h, w = _image_extents(shape, attrs)
        nbytes = _ffi.query(_target("roi_align_backward_input_scratch", attrs), N=n, C=c, H=h, W=w,
                            boxes=boxes.shape[0], pooled_height=attrs.pooled_height,
                            pooled_width=attrs.pooled_width,
                            sampling_ratio=attrs.sampling_ratio,
                            element_bytes=np.dtype(dout.dtype).itemsize,
                            deterministic=attrs.deterministic)
        if nbytes == _ffi.SIZE_OVERFLOW:
            raise ValueError(
                f"roi_align(): the deterministic CUDA input gradient of {boxes.shape[0]} boxes of "
                f"{attrs.pooled_height} x {attrs.pooled_width} bins on an input {tuple(shape)} "
                "needs more scratch memory than a 64-bit size can describe: use "
                "deterministic=False (float32/float64) or fewer boxes per call")
        if nbytes < 0:
            raise ValueError(
                f"roi_align(): the deterministic CUDA input gradient sorts one entry per box, "
                f"touched input row and bin row in 32 bits; {boxes.shape[0]} boxes on {n} images "
                f"of {h} rows exceed that: use deterministic=False (float32/float64) or fewer "
                "boxes per call")
        return nbytes

    return _ffi.call_with_cuda_scratch(_target("jk_roi_align_bwd_input", attrs), result, dout,
                                       boxes, scratch_bytes=scratch_bytes, **attributes)


def _scatter_jvp(primals, tangents, *, attrs, batching, shape):
    dout, boxes, *dirs = primals
    t_dout, t_boxes, *t_dirs = tangents
    kw = dict(attrs=attrs, batching=batching, shape=shape)
    terms = []
    if not is_zero(t_dout):
        terms.append(_SCATTER(t_dout, boxes, *dirs, **kw))
    for j, t in enumerate(t_dirs):
        if not is_zero(t):
            terms.append(_SCATTER(dout, boxes, *replaced(dirs, j, t), **kw))
    if not is_zero(t_boxes):
        if len(dirs) == _MAX_ORDER:
            raise _too_high()
        terms.append(_SCATTER(dout, boxes, *dirs, t_boxes, **kw))
    return add(*terms)


def _scatter_transpose(ct, dout, boxes, *dirs, attrs, batching, shape):
    kw = dict(attrs=attrs, batching=batching)
    cts = [None] * (2 + len(dirs))
    if is_linear(dout):
        cts[0] = _GATHER(ct, boxes, *dirs, **kw)
    for j, d in enumerate(dirs):
        if is_linear(d):
            cts[2 + j] = _REDUCE(dout, ct, boxes, *without(dirs, j), **kw)
    return cts


# reduce_j(dout, input, boxes, *directions)


def _reduce_shape(dout, input, boxes, *directions, attrs, batching):
    return boxes.shape, boxes.dtype


def _reduce_emit(dout, input, boxes, *directions, attrs, batching):
    target = "jk_roi_align_bwd_boxes_directional" if directions else "jk_roi_align_bwd_boxes"
    return _ffi.call(_target(target, attrs), jax.ShapeDtypeStruct(boxes.shape, boxes.dtype),
                     dout, input, boxes, *directions, **_ffi_attributes(attrs, batching))


def _reduce_jvp(primals, tangents, *, attrs, batching):
    dout, input, boxes, *dirs = primals
    t_dout, t_input, t_boxes, *t_dirs = tangents
    kw = dict(attrs=attrs, batching=batching)
    terms = []
    if not is_zero(t_dout):
        terms.append(_REDUCE(t_dout, input, boxes, *dirs, **kw))
    if not is_zero(t_input):
        terms.append(_REDUCE(dout, t_input, boxes, *dirs, **kw))
    for j, t in enumerate(t_dirs):
        if not is_zero(t):
            terms.append(_REDUCE(dout, input, boxes, *replaced(dirs, j, t), **kw))
    if not is_zero(t_boxes):
        if len(dirs) + 1 == _MAX_ORDER:
            raise _too_high()
        terms.append(_REDUCE(dout, input, boxes, *dirs, t_boxes, **kw))
    return add(*terms)


def _reduce_transpose(ct, dout, input, boxes, *dirs, attrs, batching):
    kw = dict(attrs=attrs, batching=batching)
    cts = [None] * (3 + len(dirs))
    if is_linear(dout):
        cts[0] = _GATHER(input, boxes, *dirs, ct, **kw)
    if is_linear(input):
        cts[1] = _SCATTER(dout, boxes, *dirs, ct, shape=tuple(aval(input).shape), **kw)
    for j, d in enumerate(dirs):
        if is_linear(d):
            cts[3 + j] = _REDUCE(dout, input, boxes, *without(dirs, j), ct, **kw)
    return cts


# --- batching: boxes, output gradients and directions fold into K; the input into N -------------


def _gather_batched(axis_size, operands, in_batched, *, attrs, batching):
    input, *rows_operands = operands
    input_batched, *rows_batched = in_batched
    rows = _rows(rows_operands[0], rows_batched[0])
    folded = batching
    if input_batched:
        folded = batching.fold_images(rows, axis_size, input.shape[1])
        input = input.reshape((axis_size * input.shape[1],) + input.shape[2:])
    out = _GATHER(input, *(_fold_rows(x, b, axis_size) for x, b in zip(rows_operands, rows_batched)),
                  attrs=attrs, batching=folded)
    return out.reshape((axis_size, rows) + out.shape[1:]), True


def _scatter_batched(axis_size, operands, in_batched, *, attrs, batching, shape):
    rows = _rows(operands[1], in_batched[1])
    folded = batching.fold_images(rows, axis_size, shape[0])
    folded_shape = (axis_size * shape[0],) + shape[1:]
    d_input = _SCATTER(*(_fold_rows(x, b, axis_size) for x, b in zip(operands, in_batched)),
                       attrs=attrs, batching=folded, shape=folded_shape)
    return d_input.reshape((axis_size,) + shape), True


def _reduce_batched(axis_size, operands, in_batched, *, attrs, batching):
    dout, input, *rest = operands
    dout_batched, input_batched, *rest_batched = in_batched
    rows = _rows(rest[0], rest_batched[0])
    folded = batching
    if input_batched:
        folded = batching.fold_images(rows, axis_size, input.shape[1])
        input = input.reshape((axis_size * input.shape[1],) + input.shape[2:])
    d_boxes = _REDUCE(_fold_rows(dout, dout_batched, axis_size), input,
                      *(_fold_rows(x, b, axis_size) for x, b in zip(rest, rest_batched)),
                      attrs=attrs, batching=folded)
    return d_boxes.reshape((axis_size, rows, 5)), True


# --- partitioning under sharded jit ---------------------------------------------------------
# The channels and the boxes (K) stay sharded with no communication. Images (N) stay sharded too:
# each shard pools the boxes of its own images (batch indices shifted by the shard's first image,
# after truncation, so that every box belongs to exactly one shard) and the partial results are
# added: the output (and the box gradient) with one reduction of its size, while the input
# gradient comes back sharded like the input. Under vmap (batching terms that depend on the
# global box and image numbers) only the channels stay sharded. NHWC permutes the letters.
_BOXES = ("k", "f")


def _image(attrs: _Attrs) -> tuple[str, ...]:
    return ("n", "h", "w", "c") if attrs.channels_last else ("n", "c", "h", "w")


def _binned(attrs: _Attrs) -> tuple[str, ...]:
    return ("k", "ph", "pw", "c") if attrs.channels_last else ("k", "c", "ph", "pw")


def _roi_sharding(operands, result, batching, boxes_at, input_at):
    free = {"c"} if batching.terms else {"n", "c", "k"}
    local = functools.partial(_local_shard, boxes_at=boxes_at, input_at=input_at)
    return _partition.Spec(operands, result, frozenset(free), local=local,
                           offsets=frozenset({"n"}))


def _local_shard(operands, params, shape, offsets, *, boxes_at, input_at):
    """A shard's call: the boxes of its own images. `input_at`: the input operand (None: the
    result is the input gradient, of local shape `shape`)."""
    if params["batching"].terms:
        return operands, params
    if input_at is None:
        params["shape"] = tuple(shape)
        images = shape[0]
    else:
        images = operands[input_at].shape[0]
    params["batching"] = _Batching(images)
    if "n" in offsets:
        boxes = operands[boxes_at]
        first = offsets["n"].astype(boxes.dtype)
        operands = replaced(operands, boxes_at, boxes.at[:, 0].set(jnp.trunc(boxes[:, 0]) - first))
    return operands, params


def _gather_sharding(input, boxes, *dirs, attrs, batching):
    return _roi_sharding((_image(attrs), _BOXES) + (_BOXES,) * len(dirs), _binned(attrs),
                         batching, boxes_at=1, input_at=0)


def _scatter_sharding(dout, boxes, *dirs, attrs, batching, shape):
    return _roi_sharding((_binned(attrs), _BOXES) + (_BOXES,) * len(dirs), _image(attrs),
                         batching, boxes_at=1, input_at=None)


def _reduce_sharding(dout, input, boxes, *dirs, attrs, batching):
    return _roi_sharding((_binned(attrs), _image(attrs), _BOXES) + (_BOXES,) * len(dirs),
                         _BOXES, batching, boxes_at=2, input_at=1)


_GATHER = Kernel("jk_roi_align_gather", shape=_gather_shape, emit=_gather_emit,
                 batch=_gather_batched, jvp=_gather_jvp, transpose=_gather_transpose,
                 sharding=_gather_sharding)
_SCATTER = Kernel("jk_roi_align_scatter", shape=_scatter_shape, emit=_scatter_emit,
                  batch=_scatter_batched, jvp=_scatter_jvp, transpose=_scatter_transpose,
                  sharding=_scatter_sharding)
_REDUCE = Kernel("jk_roi_align_reduce", shape=_reduce_shape, emit=_reduce_emit,
                 batch=_reduce_batched, jvp=_reduce_jvp, transpose=_reduce_transpose,
                 sharding=_reduce_sharding)
