"""What the Flax and Equinox layers (``jax_kernels.flax``, ``jax_kernels.equinox``) share: the
conversion of their libraries' padding arguments to :func:`jax_kernels.conv2d`'s, and the
non-zero padding modes (circular, reflect, replicate) that those libraries apply with ``jnp.pad``
before a convolution without padding. Imports neither Flax nor Equinox."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The libraries' names of the padding modes that pad with something other than zeros, and
# jnp.pad's name for each.
_JNP_PAD_MODES = {"CIRCULAR": "wrap", "REFLECT": "reflect", "REPLICATE": "edge"}


def pair(layer: str, name: str, value: int | Sequence[int]) -> tuple[int, int]:
    """``value`` (an int or a pair of ints) as a pair; errors name ``layer``."""
    def integer(v):
        if isinstance(v, bool):
            raise TypeError(f"{layer}: `{name}` must be an int or a pair of ints, got {value!r}")
        try:
            return operator.index(v)
        except TypeError:
            raise TypeError(f"{layer}: `{name}` must be an int or a pair of ints, "
                            f"got {value!r}") from None

    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{layer}: `{name}` must be an int or a pair of ints, got {value!r}")
        return integer(value[0]), integer(value[1])
    v = integer(value)
    return v, v


def explicit_padding(layer: str, padding: Any) -> Any:
    """Flax's and Equinox's padding forms in :func:`jax_kernels.conv2d`'s terms: a string is
    lax's (``"SAME"``, ``"VALID"``, ``"SAME_LOWER"``, case-insensitive, as both libraries pass
    strings to ``lax.conv_general_dilated``); an int or a pair of ints pads both sides alike; a
    pair whose items are ints or (low, high) pairs pads each axis as given. Errors name
    ``layer``: a ValueError for an unknown string or a wrong length, a TypeError for items that
    are not ints."""
    forms = ("a string, an int, or a pair of ints or of (low, high) pairs (one per spatial "
             f"axis), got {padding!r}")
    if isinstance(padding, str):
        upper = padding.upper()
        if upper not in ("SAME", "VALID", "SAME_LOWER"):
            raise ValueError(f"{layer}: padding must be 'SAME', 'VALID' or 'SAME_LOWER' (or one "
                             f"of the non-zero padding modes), got {padding!r}")
        return upper

    def integer(v):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{layer}: padding must be {forms}")
        return int(v)

    if isinstance(padding, (tuple, list)):
        if len(padding) != 2 or not all(not isinstance(p, (tuple, list)) or len(p) == 2
                                        for p in padding):
            raise ValueError(f"{layer}: padding must be {forms}")
        return tuple((integer(p[0]), integer(p[1])) if isinstance(p, (tuple, list))
                     else (integer(p), integer(p)) for p in padding)
    p = integer(padding)
    return ((p, p), (p, p))


def pad_nonzero(x: jax.Array, mode: str, pads: Sequence[tuple[int, int]],
                spatial_axes: tuple[int, int]) -> jax.Array:
    """``x`` padded on its two spatial axes by ``pads`` in mode ``"CIRCULAR"``, ``"REFLECT"`` or
    ``"REPLICATE"`` (the libraries' names)."""
    widths = [(0, 0)] * x.ndim
    for axis, p in zip(spatial_axes, pads):
        widths[axis] = tuple(p)
    return jnp.pad(x, widths, mode=_JNP_PAD_MODES[mode])


def centred_pads(kernel_size: tuple[int, int], dilation: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """The padding Flax applies for ``"CIRCULAR"`` and ``"REFLECT"``: ((k-1)//2, k//2) of the
    dilated kernel extent k, per axis."""
    spans = [(k - 1) * d + 1 for k, d in zip(kernel_size, dilation)]
    return tuple(((k - 1) // 2, k // 2) for k in spans)


def same_pads(hw: Sequence[int], kernel_size: tuple[int, int], stride: tuple[int, int],
              dilation: tuple[int, int], lower: bool = False) -> tuple[tuple[int, int], ...]:
    """lax's ``"SAME"`` (``"SAME_LOWER"``) padding: output ceil(size / stride); the odd one
    out at the end (start)."""
    pads = []
    for size, k, s, d in zip(hw, kernel_size, stride, dilation):
        span = (k - 1) * d + 1
        total = max((-(-size // s) - 1) * s + span - size, 0)
        low = total - total // 2 if lower else total // 2
        pads.append((low, total - low))
    return tuple(pads)


def check_rank(layer: str, name: str, x: jax.Array, ranks: tuple[int, ...], expected: str) -> None:
    if x.ndim not in ranks:
        raise ValueError(f"{layer}: expected {name} of shape {expected}, got {tuple(x.shape)}")
