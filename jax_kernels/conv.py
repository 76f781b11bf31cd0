"""``conv2d``: torch.nn.functional.conv2d as a JAX op backed by the ``jk_conv2d_*`` kernels.

Four FFI targets: the forward (input, weight, bias -> output), the input gradient (dgrad), the
weight gradient (wgrad) and the bias gradient, each dtype-dispatched inside; XLA drops the ones
nobody asked for. A missing bias travels as a zero-length array. On CUDA the forward, dgrad and
wgrad targets also return a uint8 scratch buffer whose size the CUDA module computes at trace
time (host query ``conv2d_scratch``: the tensor-core path's need when it takes the problem,
else the direct kernels'); only the CUDA lowering asks for it (``_ffi.call_with_cuda_scratch``)
and the wrapper drops it.

Each kernel is a primitive (``_primitive.Kernel``) with JVP and transpose rules made of the
other kernels (conv2d is bilinear), so every derivative of every order runs these four kernels.

Batching: each primitive has a rule that folds the vmapped axis into the kernel's batch or
groups and binds a primitive again, so ``vmap``, ``grad``, ``vmap(grad)`` and higher orders batch
without loops. A batched input folds into N. Batched
weights (per-example weights, per-sample gradients) fold into groups: B convolutions with
``groups=g`` are one convolution with ``groups=B*g`` over ``B*C`` channels (and when the
input is shared, one with ``B*K`` filters stacked group by group). The bias gradient kernel takes
one leading batch dimension itself.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from . import _sharding as _partition
from ._checks import as_array, check_float_dtypes
from ._primitive import Kernel, add, aval, is_linear, is_zero

_OP = "conv2d"

# The accepted spellings of `precision`, by their name in ConvPrecision (conv.h).
_PRECISIONS = {
    None: "default",
    "default": "default",
    jax.lax.Precision.DEFAULT: "default",
    "highest": "highest",
    jax.lax.Precision.HIGHEST: "highest",
}


def conv2d(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1, *, precision: Any = None,
           data_format: str = "NCHW") -> jax.Array:
    """2-D convolution (cross-correlation), as ``torch.nn.functional.conv2d``.

    Args:
      input: ``[N, C, H, W]`` (or unbatched ``[C, H, W]``); with ``data_format="NHWC"``,
        ``[N, H, W, C]`` (or ``[H, W, C]``).
      weight: ``[K, C / groups, R, S]``; with ``data_format="NHWC"``, HWIO ``[R, S, C / groups,
        K]`` (as ``lax.conv_general_dilated`` with ``("NHWC", "HWIO", "NHWC")`` and Flax).
      bias: ``[K]`` or None.
      stride, dilation: int or ``(h, w)``, positive.
      padding: torch's forms: an int or ``(h, w)`` (the same on both sides), ``"valid"`` (none)
        or ``"same"`` (output size = input size; stride 1 only; an odd total goes to the
        bottom/right); lax.conv's and Flax's forms: ``((top, bottom), (left, right))``,
        ``"VALID"``, ``"SAME"`` (output size = ceil(input / stride), any stride, the odd one out
        at the bottom/right) or ``"SAME_LOWER"`` (at the top/left). Non-negative.
      groups: input and output channels are split into this many groups (``groups == C`` is a
        depthwise convolution; ``K = m * C`` gives channel multiplier m).
      precision: None / ``"default"``: float32 runs on tensor cores in TF32 where the CUDA
        tensor-core path takes the problem (as ``lax.conv`` and cuDNN do by default);
        ``"highest"``: full float32 everywhere. The CPU and the direct CUDA kernels always use full
        float32. Half types accumulate in float32.
      data_format: ``"NCHW"`` (torch's layout, the default) or ``"NHWC"`` (channels last, with
        HWIO weights and an ``[N, P, Q, K]`` output). Both layouts have their own kernels that
        read and write them directly; the results are the same numbers.

    Returns ``[N, K, P, Q]`` (``[K, P, Q]`` for an unbatched input; NHWC: ``[N, P, Q, K]`` /
    ``[P, Q, K]``) in the input's dtype.
    Differentiable with respect to input, weight and bias. All arrays must share one dtype
    among float16, bfloat16, float32 and float64.
    """
    x = as_array(_OP, "input", input)
    w = as_array(_OP, "weight", weight)
    arrays = {"input": x, "weight": w}
    if bias is not None:
        arrays["bias"] = as_array(_OP, "bias", bias)
    check_float_dtypes(_OP, **arrays)
    layout = _layout(data_format)
    if x.ndim not in (3, 4):
        expected = "(N, C, H, W) or (C, H, W)" if layout == "NCHW" else "(N, H, W, C) or (H, W, C)"
        raise ValueError(f"{_OP}(): expected input of shape {expected}, got {tuple(x.shape)}")
    unbatched = x.ndim == 3
    if unbatched:
        x = x[None]
    conv = _make_conv(x.shape, w.shape, None if bias is None else arrays["bias"].shape, stride,
                      padding, dilation, groups, precision, layout)
    b = arrays["bias"] if bias is not None else jnp.zeros((0,), x.dtype)
    y = _conv2d_jit(x, w, b, conv)
    return y[0] if unbatched else y


# --- validation ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Attrs:
    """The static attributes of a convolution (hashable: part of the jit cache key)."""

    stride: tuple[int, int]
    padding: tuple[int, int, int, int]  # top, bottom, left, right
    dilation: tuple[int, int]
    groups: int
    precision: int
    layout: str = "NCHW"  # "NCHW" (KCRS weights) or "NHWC" (HWIO weights); not an attribute:
                          # each layout has its own targets

    def with_groups(self, groups: int) -> "_Attrs":
        return dataclasses.replace(self, groups=groups)

    def ffi_attributes(self) -> dict[str, np.int64]:
        """The kernels' attributes (ConvAttrs in conv.h); bottom/right padding is implied by the
        output extent."""
        return {
            "stride_h": np.int64(self.stride[0]),
            "stride_w": np.int64(self.stride[1]),
            "pad_top": np.int64(self.padding[0]),
            "pad_left": np.int64(self.padding[2]),
            "dilation_h": np.int64(self.dilation[0]),
            "dilation_w": np.int64(self.dilation[1]),
            "groups": np.int64(self.groups),
            "precision": np.int64(self.precision),
        }

    def output_hw(self, input_hw, kernel_rs) -> tuple[int, int]:
        (H, W), (R, S) = input_hw, kernel_rs
        top, bottom, left, right = self.padding
        P = (H + top + bottom - self.dilation[0] * (R - 1) - 1) // self.stride[0] + 1
        Q = (W + left + right - self.dilation[1] * (S - 1) - 1) // self.stride[1] + 1
        return P, Q


# --- layouts: the kernels describe every pass by logical extents; these map them to shapes ----


def _layout(data_format: Any) -> str:
    if not isinstance(data_format, str):
        raise TypeError(f"{_OP}(): data_format must be a string ('NCHW' or 'NHWC'), got "
                        f"{type(data_format).__name__} {data_format!r}")
    if data_format not in ("NCHW", "NHWC"):
        raise ValueError(f"{_OP}(): data_format must be 'NCHW' or 'NHWC', got {data_format!r}")
    return data_format


def _x_dims(shape, layout: str) -> tuple[int, int, int, int]:
    """(N, C, H, W) of an activation (input or output) shape."""
    return tuple(shape) if layout == "NCHW" else (shape[0], shape[3], shape[1], shape[2])


def _x_shape(n: int, c: int, hw: tuple[int, int], layout: str) -> tuple[int, ...]:
    return (n, c) + tuple(hw) if layout == "NCHW" else (n,) + tuple(hw) + (c,)


def _w_dims(shape, layout: str) -> tuple[int, int, int, int]:
    """(K, C / groups, R, S) of a weight shape (KCRS or HWIO)."""
    return tuple(shape) if layout == "NCHW" else (shape[3], shape[2], shape[0], shape[1])


def _w_shape(k: int, cg: int, rs: tuple[int, int], layout: str) -> tuple[int, ...]:
    return (k, cg) + tuple(rs) if layout == "NCHW" else tuple(rs) + (cg, k)


def _hw(shape, layout: str) -> tuple[int, int]:
    return tuple(shape[2:4]) if layout == "NCHW" else tuple(shape[1:3])


def _rs(shape, layout: str) -> tuple[int, int]:
    return tuple(shape[2:4]) if layout == "NCHW" else tuple(shape[0:2])


def _channel_axis(layout: str) -> int:
    """The channel axis of an (unbatched by vmap) activation."""
    return 1 if layout == "NCHW" else 3


def _filter_axis(layout: str) -> int:
    return 0 if layout == "NCHW" else 3


def _in_channel_axis(layout: str) -> int:
    return 1 if layout == "NCHW" else 2


def _target(name: str, layout: str) -> str:
    """The target of pass `name` (jk_conv2d_fwd, ...) for the layout (jk_conv2d_nhwc_fwd, ...)."""
    return name if layout == "NCHW" else name.replace("jk_conv2d_", "jk_conv2d_nhwc_")


def _int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{_OP}(): `{name}` must be an int or a pair of ints, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{_OP}(): `{name}` must be an int or a pair of ints, got {value!r}") from None


def _pair(name: str, value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{_OP}(): `{name}` must be an int or a pair of ints, got {value!r}")
        return _int(name, value[0]), _int(name, value[1])
    v = _int(name, value)
    return v, v


_PADDING_FORMS = ("an int, a pair of ints, a pair of (low, high) pairs, 'valid' or 'same' "
                  "(torch), or 'VALID', 'SAME' or 'SAME_LOWER' (lax)")


def _padding(padding: Any, hw: tuple[int, int], span: tuple[int, int],
             stride: tuple[int, int]) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) from every form torch and lax.conv / Flax accept."""
    if isinstance(padding, str):
        if padding in ("valid", "VALID"):
            return (0, 0, 0, 0)
        if padding == "same":  # torch: stride 1 only; the odd one out at the bottom/right
            if stride != (1, 1):
                raise ValueError(f"{_OP}(): padding='same' is not supported for strided "
                                 f"convolutions, got stride={stride} (lax's 'SAME' is)")
            ph, pw = span[0] - 1, span[1] - 1
            return (ph // 2, ph - ph // 2, pw // 2, pw - pw // 2)
        if padding in ("SAME", "SAME_LOWER"):  # lax: output ceil(size / stride), any stride
            pads = []
            for size, extent, step in zip(hw, span, stride):
                total = max((-(-size // step) - 1) * step + extent - size, 0)
                low = total // 2 if padding == "SAME" else total - total // 2
                pads += [low, total - low]
            return tuple(pads)
        raise ValueError(f"{_OP}(): padding must be {_PADDING_FORMS}, got {padding!r}")
    if (isinstance(padding, (tuple, list)) and len(padding) == 2
            and all(isinstance(p, (tuple, list)) for p in padding)):
        if not all(len(p) == 2 for p in padding):
            raise ValueError(f"{_OP}(): padding must be {_PADDING_FORMS}, got {padding!r}")
        try:
            pads = tuple(_int("padding", v) for pair in padding for v in pair)
        except TypeError:
            raise TypeError(f"{_OP}(): padding must be {_PADDING_FORMS}, got {padding!r}") from None
    else:
        try:
            ph, pw = _pair("padding", padding)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{_OP}(): padding must be {_PADDING_FORMS}, got "
                              f"{padding!r}") from None
        pads = (ph, ph, pw, pw)
    if min(pads) < 0:
        raise ValueError(f"{_OP}(): padding must be non-negative, got {padding!r}")
    return pads


def _make_conv(x_shape, w_shape, b_shape, stride, padding, dilation, groups, precision,
               layout: str = "NCHW") -> _Attrs:
    shapes = f"input {tuple(x_shape)}, weight {tuple(w_shape)}"
    if len(w_shape) != 4:
        expected = "(K, C / groups, R, S)" if layout == "NCHW" else "(R, S, C / groups, K) (HWIO)"
        raise ValueError(f"{_OP}(): expected weight of shape {expected}, got {tuple(w_shape)}")
    N, C, H, W = _x_dims(x_shape, layout)
    K, Cg, R, S = _w_dims(w_shape, layout)
    if isinstance(groups, (bool, np.bool_)) or not isinstance(groups, (int, np.integer)):
        raise TypeError(f"{_OP}(): `groups` must be an int, got {groups!r}")
    groups = int(groups)
    if groups <= 0:
        raise ValueError(f"{_OP}(): groups must be positive, got {groups}")
    stride = _pair("stride", stride)
    dilation = _pair("dilation", dilation)
    if min(stride) <= 0:
        raise ValueError(f"{_OP}(): stride must be positive, got {stride}")
    if min(dilation) <= 0:
        raise ValueError(f"{_OP}(): dilation must be positive, got {dilation}")
    if R <= 0 or S <= 0:
        raise ValueError(f"{_OP}(): the kernel's spatial size must be positive; {shapes}")
    if K % groups != 0:
        raise ValueError(f"{_OP}(): the number of filters K={K} must be divisible by "
                         f"groups={groups}; {shapes}")
    if C != Cg * groups:
        raise ValueError(f"{_OP}(): weight of shape {tuple(w_shape)} with groups={groups} "
                         f"expects {Cg * groups} input channels, but got {shapes}")
    if b_shape is not None and tuple(b_shape) != (K,):
        raise ValueError(f"{_OP}(): expected bias of shape ({K},), got {tuple(b_shape)}; "
                         f"{shapes}")
    span = (dilation[0] * (R - 1) + 1, dilation[1] * (S - 1) + 1)
    pads = _padding(padding, (H, W), span, stride)
    padded = (H + pads[0] + pads[1], W + pads[2] + pads[3])
    if span[0] > padded[0] or span[1] > padded[1]:
        raise ValueError(f"{_OP}(): the kernel spans {span} (size {(R, S)}, dilation "
                         f"{dilation}), larger than the padded input {padded}; {shapes}, "
                         f"padding (top, bottom, left, right) {pads}")
    precisions = f"precision must be None, 'default' or 'highest', got {precision!r}"
    if precision is not None and not isinstance(precision, (str, jax.lax.Precision)):
        raise TypeError(f"{_OP}(): {precisions}")
    try:
        precision_code = _ffi.ENUMS["ConvPrecision"][_PRECISIONS[precision]]
    except KeyError:
        raise ValueError(f"{_OP}(): {precisions}") from None
    return _Attrs(stride, pads, dilation, groups, precision_code, layout)


# --- the kernels as primitives ----------------------------------------------------------------
# conv2d is bilinear in (input, weight) and linear in the bias, so fprop, dgrad and wgrad are
# each other's transposes and every derivative of every order is one of the four kernels:
#   fwd(x, w, b) = x * w + b        dgrad(dy, w) = fwd's transpose in x
#   wgrad(dy, x) = fwd's transpose in w        bgrad(dy) = fwd's transpose in b
# dgrad(dy, w) is bilinear: its transpose in dy is fwd(., w), in w it is wgrad(dy, .); likewise
# wgrad(dy, x) transposes to fwd(x, .) in dy and to dgrad(dy, .) in x.


def _conv2d(x, w, b, conv: _Attrs):
    return _FWD(x, w, b, conv=conv)


# Called through jit so that eager calls reuse compiled executables (the CUDA/CPU choice in
# _emit would otherwise be traced and compiled anew on every eager call).
_conv2d_jit = jax.jit(_conv2d, static_argnums=(3,))


def _no_bias(dtype) -> jax.Array:
    return jnp.zeros((0,), dtype)


def _forward_shape(x, w, b, *, conv):
    N, _, H, W = _x_dims(x.shape, conv.layout)
    K, _, R, S = _w_dims(w.shape, conv.layout)
    return _x_shape(N, K, conv.output_hw((H, W), (R, S)), conv.layout), x.dtype


def _forward_emit(x, w, b, *, conv):
    N, C, H, W = _x_dims(x.shape, conv.layout)
    K, _, R, S = _w_dims(w.shape, conv.layout)
    P, Q = conv.output_hw((H, W), (R, S))
    result = jax.ShapeDtypeStruct(_x_shape(N, K, (P, Q), conv.layout), x.dtype)
    return _emit("jk_conv2d_fwd", "forward", conv, result, (x, w, b), (N, C, H, W, K, R, S, P, Q))


def _forward_jvp(primals, tangents, *, conv):
    x, w, b = primals
    tx, tw, tb = tangents
    has_bias = b.shape[0] > 0 and not is_zero(tb)
    terms = []
    if not is_zero(tx):
        terms.append(_FWD(tx, w, tb if has_bias else _no_bias(x.dtype), conv=conv))
    elif has_bias:
        terms.append(_BIAS(tb, shape=_FWD.result(x, w, b, conv=conv).shape, layout=conv.layout))
    if not is_zero(tw):
        terms.append(_FWD(x, tw, _no_bias(x.dtype), conv=conv))
    return add(*terms)


def _forward_transpose(dy, x, w, b, *, conv):
    cts = [None, None, None]
    if is_linear(x):
        cts[0] = _DGRAD(dy, w, conv=conv, input_hw=_hw(aval(x).shape, conv.layout))
    if is_linear(w):
        cts[1] = _WGRAD(dy, x, conv=conv, kernel_rs=_rs(aval(w).shape, conv.layout))
    if is_linear(b):
        cts[2] = (_BGRAD(dy, layout=conv.layout) if aval(b).shape[0] > 0
                  else _no_bias(dy.dtype))
    return cts


def _dgrad_shape(dy, w, *, conv, input_hw):
    N = dy.shape[0]
    _, Cg, _, _ = _w_dims(w.shape, conv.layout)
    return _x_shape(N, Cg * conv.groups, input_hw, conv.layout), dy.dtype


def _dgrad_emit(dy, w, *, conv, input_hw):
    N, K, P, Q = _x_dims(dy.shape, conv.layout)
    _, Cg, R, S = _w_dims(w.shape, conv.layout)
    C = Cg * conv.groups
    result = jax.ShapeDtypeStruct(_x_shape(N, C, input_hw, conv.layout), dy.dtype)
    return _emit("jk_conv2d_bwd_input", "backward_data", conv, result, (dy, w),
                 (N, C) + tuple(input_hw) + (K, R, S, P, Q))


def _dgrad_jvp(primals, tangents, *, conv, input_hw):
    dy, w = primals
    tdy, tw = tangents
    return add(None if is_zero(tdy) else _DGRAD(tdy, w, conv=conv, input_hw=input_hw),
               None if is_zero(tw) else _DGRAD(dy, tw, conv=conv, input_hw=input_hw))


def _dgrad_transpose(ct, dy, w, *, conv, input_hw):
    if is_linear(dy):
        return [_FWD(ct, w, _no_bias(ct.dtype), conv=conv), None]
    return [None, _WGRAD(dy, ct, conv=conv, kernel_rs=_rs(aval(w).shape, conv.layout))]


def _wgrad_shape(dy, x, *, conv, kernel_rs):
    K = _x_dims(dy.shape, conv.layout)[1]
    C = _x_dims(x.shape, conv.layout)[1]
    return _w_shape(K, C // conv.groups, kernel_rs, conv.layout), dy.dtype


def _wgrad_emit(dy, x, *, conv, kernel_rs):
    N, K, P, Q = _x_dims(dy.shape, conv.layout)
    _, C, H, W = _x_dims(x.shape, conv.layout)
    result = jax.ShapeDtypeStruct(_w_shape(K, C // conv.groups, kernel_rs, conv.layout),
                                  dy.dtype)
    return _emit("jk_conv2d_bwd_weight", "backward_weight", conv, result, (dy, x),
                 (N, C, H, W, K) + tuple(kernel_rs) + (P, Q))


def _wgrad_jvp(primals, tangents, *, conv, kernel_rs):
    dy, x = primals
    tdy, tx = tangents
    return add(None if is_zero(tdy) else _WGRAD(tdy, x, conv=conv, kernel_rs=kernel_rs),
               None if is_zero(tx) else _WGRAD(dy, tx, conv=conv, kernel_rs=kernel_rs))


def _wgrad_transpose(ct, dy, x, *, conv, kernel_rs):
    if is_linear(dy):
        return [_FWD(x, ct, _no_bias(ct.dtype), conv=conv), None]
    return [None, _DGRAD(dy, ct, conv=conv, input_hw=_hw(aval(x).shape, conv.layout))]


def _bgrad_shape(dy, *, layout):
    """dy [N, K, P, Q] -> db [K], or with one leading batch dimension [B, N, K, P, Q] -> [B, K]
    (NHWC: dy [(B,) N, P, Q, K])."""
    return dy.shape[:-4] + (dy.shape[-3] if layout == "NCHW" else dy.shape[-1],), dy.dtype


def _bgrad_emit(dy, *, layout):
    result = jax.ShapeDtypeStruct(*_bgrad_shape(dy, layout=layout))
    batch = dy.shape[0] if dy.ndim == 5 else 1
    N, K, P, Q = _x_dims(dy.shape[-4:], layout)

    def scratch_bytes():
        nbytes = _ffi.query("conv2d_bias_scratch", layout=_ffi.ENUMS["ConvLayout"][layout],
                            dtype=_ffi.ENUMS["ConvDtype"][np.dtype(dy.dtype).name],
                            batch=batch, N=N, K=K, plane=P * Q)
        if nbytes < 0:
            raise RuntimeError(f"{_OP}(): the CUDA module rejected the bias gradient of {dy.shape}")
        return nbytes

    return _ffi.call_with_cuda_scratch(_target("jk_conv2d_bwd_bias", layout), result, dy,
                                       scratch_bytes=scratch_bytes)


def _bgrad_transpose(ct, dy, *, layout):
    return [_BIAS(ct, shape=tuple(aval(dy).shape), layout=layout)]


# The bias added to every output position: the transpose of the bias gradient (a broadcast, not
# a kernel; a primitive so that its own transpose is the bias gradient kernel).
def _bias_shape(b, *, shape, layout):
    return shape, b.dtype


def _bias_emit(b, *, shape, layout):
    if layout == "NCHW":
        return jnp.broadcast_to(b[..., None, :, None, None], shape)
    return jnp.broadcast_to(b[..., None, None, None, :], shape)


def _bias_batched(batch, operands, in_batched, *, shape, layout):
    (b,) = operands
    return _BIAS(b, shape=(batch,) + shape, layout=layout), True


# --- FFI calls ---------------------------------------------------------------------------------


def _emit(target: str, pass_: str, conv: _Attrs, result: jax.ShapeDtypeStruct, operands,
          problem: tuple[int, ...]) -> jax.Array:
    """The custom call `target` of pass `pass_` (a ConvPass name); on CUDA with the scratch buffer
    its kernels need (dropped).

    `problem` is (N, C, H, W, K, R, S, P, Q) of the forward convolution."""

    def scratch_bytes():
        extents = dict(zip(("N", "C", "H", "W", "K", "R", "S", "P", "Q"), problem))
        nbytes = _ffi.query("conv2d_scratch", **{"pass": _ffi.ENUMS["ConvPass"][pass_]},
                            dtype=_ffi.ENUMS["ConvDtype"][np.dtype(result.dtype).name],
                            layout=_ffi.ENUMS["ConvLayout"][conv.layout],
                            **extents, **conv.ffi_attributes())
        if nbytes == _ffi.SIZE_OVERFLOW:
            raise ValueError(f"{_OP}(): the CUDA {pass_} pass of the problem (N, C, H, W, K, R, "
                             f"S, P, Q) = {problem} needs more scratch memory than a 64-bit size "
                             "can describe")
        if nbytes < 0:
            raise RuntimeError(f"{_OP}(): the CUDA module rejected the problem {problem}")
        return nbytes

    return _ffi.call_with_cuda_scratch(_target(target, conv.layout), result, *operands,
                                       scratch_bytes=scratch_bytes, **conv.ffi_attributes())


# --- batching: every rule folds the vmapped axis into the kernel's batch or its groups ----------
# The folds move the vmapped axis B (leading) into one axis of the unbatched operand, either as
# its major part (`_fold`: [B, ..., C, ...] -> [..., B*C, ...]) or inside its groups
# (`_fold_groups`: channel (b, j, c) -> (j, b, c) for g groups). The axes depend on the layout:
# channels at 1 (NCHW) or 3 (NHWC), filters at 0 (KCRS) or 3 (HWIO), a filter's input channels
# at 1 or 2.


def _merge_leading(x):
    """[B, N, ...] -> [B * N, ...]"""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _split_leading(x, batch: int):
    """[B * N, ...] -> [B, N, ...]"""
    return x.reshape((batch, x.shape[0] // batch) + x.shape[1:])


def _fold(x, axis: int):
    """[B, ...] -> the unbatched shape with axis `axis` (of size C) now B * C, b major."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _unfold(x, batch: int, axis: int):
    """The inverse of _fold."""
    x = x.reshape(x.shape[:axis] + (batch, x.shape[axis] // batch) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _fold_groups(x, batch: int, groups: int, axis: int):
    """[B, ...] -> axis `axis` (g groups of c) becomes g groups of B * c: (b, j, c) -> (j, b, c)."""
    x = jnp.moveaxis(x, 0, axis)  # [..., B, g * c, ...]
    size = x.shape[axis + 1]
    x = x.reshape(x.shape[:axis] + (batch, groups, size // groups) + x.shape[axis + 2:])
    x = jnp.swapaxes(x, axis, axis + 1)
    return x.reshape(x.shape[:axis] + (batch * size,) + x.shape[axis + 3:])


def _unfold_groups(x, batch: int, groups: int, axis: int):
    """The inverse of _fold_groups: axis `axis` of (j, b, c) -> [B, ...] with axis (j, c)."""
    size = x.shape[axis] // batch
    x = x.reshape(x.shape[:axis] + (groups, batch, size // groups) + x.shape[axis + 1:])
    x = jnp.swapaxes(x, axis, axis + 1)
    x = x.reshape(x.shape[:axis] + (batch, size) + x.shape[axis + 3:])
    return jnp.moveaxis(x, axis, 0)


def _forward_batched(batch, operands, in_batched, *, conv):
    """x [N, C, H, W], w [K, C/g, R, S], b [K] or [0] -> y [N, K, P, Q] (or NHWC/HWIO)."""
    x, w, b = operands
    x_batched, w_batched, b_batched = in_batched
    if b.shape[-1] == 0:  # no bias (or no filters): nothing to batch
        b, b_batched = _no_bias(x.dtype), False
    if not (w_batched or b_batched):
        return _split_leading(_FWD(_merge_leading(x), w, b, conv=conv), batch), True
    # Per-example weights (a per-example bias brings the weights along: they are small).
    if not w_batched:
        w = jnp.broadcast_to(w, (batch,) + w.shape)
    has_bias = b.shape[-1] > 0
    if has_bias and not b_batched:
        b = jnp.broadcast_to(b, (batch,) + b.shape)
    K = _w_dims(w.shape[1:], conv.layout)[0]
    g = conv.groups
    ca, fa = _channel_axis(conv.layout), _filter_axis(conv.layout)
    if x_batched:
        # Example b's channels and filters become groups b*g .. b*g + g - 1.
        b_folded = b.reshape(batch * K) if has_bias else b
        y = _FWD(_fold(x, ca), _fold(w, fa), b_folded, conv=conv.with_groups(batch * g))
        return _unfold(y, batch, ca), True
    # A shared input: every example's filters of group j go to group j.
    Kg = K // g
    b_folded = jnp.swapaxes(b.reshape(batch, g, Kg), 0, 1).reshape(-1) if has_bias else b
    y = _FWD(x, _fold_groups(w, batch, g, fa), b_folded, conv=conv)
    return _unfold_groups(y, batch, g, ca), True


def _dgrad_batched(batch, operands, in_batched, *, conv, input_hw):
    """dy [N, K, P, Q], w [K, C/g, R, S] -> dx [N, C, H, W] (or NHWC/HWIO)."""
    dy, w = operands
    dy_batched, w_batched = in_batched
    if not w_batched:
        return _split_leading(_DGRAD(_merge_leading(dy), w, conv=conv, input_hw=input_hw),
                              batch), True
    g = conv.groups
    ca, fa, ia = _channel_axis(conv.layout), _filter_axis(conv.layout), _in_channel_axis(conv.layout)
    if dy_batched:
        dx = _DGRAD(_fold(dy, ca), _fold(w, fa), conv=conv.with_groups(batch * g),
                    input_hw=input_hw)
        return _unfold(dx, batch, ca), True
    # A shared output gradient: example b's weights give input channels (j, b, c) of group j.
    dx = _DGRAD(dy, _fold(w, ia), conv=conv, input_hw=input_hw)
    return _unfold_groups(dx, batch, g, ca), True


def _wgrad_batched(batch, operands, in_batched, *, conv, kernel_rs):
    """dy [N, K, P, Q], x [N, C, H, W] -> dw [K, C/g, R, S] (or NHWC/HWIO)."""
    dy, x = operands
    dy_batched, x_batched = in_batched
    g = conv.groups
    ca, fa, ia = _channel_axis(conv.layout), _filter_axis(conv.layout), _in_channel_axis(conv.layout)
    if dy_batched and x_batched:
        dw = _WGRAD(_fold(dy, ca), _fold(x, ca), conv=conv.with_groups(batch * g),
                    kernel_rs=kernel_rs)
        return _unfold(dw, batch, fa), True
    if dy_batched:
        # A shared input: example b's filters of group j become filters (j, b, k) of group j.
        dw = _WGRAD(_fold_groups(dy, batch, g, ca), x, conv=conv, kernel_rs=kernel_rs)
        return _unfold_groups(dw, batch, g, fa), True
    # A shared output gradient: example b's channels of group j become (j, b, c).
    dw = _WGRAD(dy, _fold_groups(x, batch, g, ca), conv=conv, kernel_rs=kernel_rs)
    return _unfold(dw, batch, ia), True


def _bgrad_batched(batch, operands, in_batched, *, layout):
    (dy,) = operands
    if dy.ndim == 6:  # already carries the kernel's own batch dimension: merge the two
        k = dy.shape[3] if layout == "NCHW" else dy.shape[5]
        return _BGRAD(_merge_leading(dy), layout=layout).reshape(dy.shape[:2] + (k,)), True
    return _BGRAD(dy, layout=layout), True


# --- partitioning under sharded jit: the batch stays sharded, the weights are replicated; the
# weight and bias gradients of a sharded batch are local passes summed over the shards.
_N = frozenset({"n"})
_LETTERS = {  # (x, w, y) dimension letters per layout
    "NCHW": (("n", "c", "h", "w"), ("k", "cg", "r", "s"), ("n", "k", "p", "q")),
    "NHWC": (("n", "h", "w", "c"), ("r", "s", "cg", "k"), ("n", "p", "q", "k")),
}


def _forward_sharding(x, w, b, *, conv):
    X, W, Y = _LETTERS[conv.layout]
    return _partition.Spec((X, W, ("kb",)), Y, _N)


def _dgrad_sharding(dy, w, *, conv, input_hw):
    X, W, Y = _LETTERS[conv.layout]
    return _partition.Spec((Y, W), X, _N)


def _wgrad_sharding(dy, x, *, conv, kernel_rs):
    X, W, Y = _LETTERS[conv.layout]
    return _partition.Spec((Y, X), W, _N)


def _bgrad_sharding(dy, *, layout):
    Y = _LETTERS[layout][2]
    if dy.ndim == 5:  # [B, N, K, P, Q] -> [B, K]
        return _partition.Spec((("b",) + Y,), ("b", "k"), frozenset({"b", "n"}))
    return _partition.Spec((Y,), ("k",), _N)


_FWD = Kernel("jk_conv2d_fwd", shape=_forward_shape, emit=_forward_emit, batch=_forward_batched,
              jvp=_forward_jvp, transpose=_forward_transpose, sharding=_forward_sharding)
_DGRAD = Kernel("jk_conv2d_bwd_input", shape=_dgrad_shape, emit=_dgrad_emit,
                batch=_dgrad_batched, jvp=_dgrad_jvp, transpose=_dgrad_transpose,
                sharding=_dgrad_sharding)
_WGRAD = Kernel("jk_conv2d_bwd_weight", shape=_wgrad_shape, emit=_wgrad_emit,
                batch=_wgrad_batched, jvp=_wgrad_jvp, transpose=_wgrad_transpose,
                sharding=_wgrad_sharding)
_BGRAD = Kernel("jk_conv2d_bwd_bias", shape=_bgrad_shape, emit=_bgrad_emit,
                batch=_bgrad_batched,
                jvp=lambda primals, tangents, **p: None if is_zero(tangents[0])
                else _BGRAD(tangents[0], **p),
                transpose=_bgrad_transpose, sharding=_bgrad_sharding)
_BIAS = Kernel("jk_conv2d_bias", shape=_bias_shape, emit=_bias_emit, batch=_bias_batched,
               jvp=lambda primals, tangents, **p: None if is_zero(tangents[0])
               else _BIAS(tangents[0], **p),
               transpose=lambda ct, b, **p: [_bias_gradient(ct, p["layout"])])


def _bias_gradient(dy, layout: str):
    """The bias gradient of dy [..., N, K, P, Q] (NHWC: [..., N, P, Q, K]) with any number of
    leading batch axes."""
    if dy.ndim <= 5:
        return _BGRAD(dy, layout=layout)
    lead = dy.shape[:-4]
    k = dy.shape[-3] if layout == "NCHW" else dy.shape[-1]
    return _BGRAD(dy.reshape((-1,) + dy.shape[-4:]), layout=layout).reshape(lead + (k,))
