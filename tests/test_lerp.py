"""lerp: forward and gradients against torch.lerp (CPU) and a float64 NumPy formula, exactness
at the ends, broadcasting, jit/vmap/grad composition, the lowered program and validation."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_kernels as jk
from jk_testing import (TORCH_UNAVAILABLE, DTYPES, assert_close, assert_lowered, from_torch, random,
                        to_torch, torch)

needs_torch = pytest.mark.skipif(torch is None, reason=TORCH_UNAVAILABLE)

# (input shape, end shape, weight shape or None for a Python-scalar weight)
SHAPES = [
    ((7,), (7,), None),
    ((3, 5), (3, 5), (3, 5)),
    ((2, 3, 4), (2, 3, 4), ()),
    ((3, 1), (1, 4), (3, 4)),
    ((4,), (2, 3, 4), (3, 1)),
    ((2, 1, 5), (2, 6, 5), (1, 6, 1)),
    ((), (3,), None),
    ((0, 3), (0, 3), (3,)),
    ((1025,), (1025,), None),  # not a multiple of any vector width
    ((2, 0), (1, 0), None),
]


def _reference(a, b, w):
    """torch.lerp's two-sided formula in float64."""
    a, b, w = (np.asarray(v, dtype=np.float64) for v in (a, b, w))
    return np.where(np.abs(w) < 0.5, a + w * (b - a), b - (b - a) * (1 - w))


def _operands(shapes, dtype, seed=0):
    a_shape, b_shape, w_shape = shapes
    a = random(seed, a_shape, dtype)
    b = random(seed + 1, b_shape, dtype, low=-3, high=3)
    w = 0.3 if w_shape is None else random(seed + 2, w_shape, dtype, low=-0.5, high=1.5)
    return a, b, w


@needs_torch
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_forward_matches_torch(shapes, dtype):
    a, b, w = _operands(shapes, dtype)
    out = jk.lerp(a, b, w)
    tw = w if isinstance(w, float) else to_torch(w)
    expected = torch.lerp(to_torch(a), to_torch(b), tw)
    assert out.dtype == a.dtype
    assert out.shape == tuple(expected.shape)
    # torch computes half types in float32 too: both round the same float32 value.
    assert_close(out, from_torch(expected), dtype)
    wv = np.float64(w) if isinstance(w, float) else w
    assert_close(out, _reference(a.astype(jnp.float64), b.astype(jnp.float64), jnp.asarray(wv).astype(jnp.float64)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_exact_at_both_ends(dtype):
    rng = np.random.default_rng(5)
    a = jnp.asarray(rng.standard_normal((33, 17)) * 1e4).astype(dtype)
    b = jnp.asarray(rng.standard_normal((33, 17)) * 1e-3).astype(dtype)
    for w, expected in ((0.0, a), (1.0, b)):
        assert np.array_equal(np.asarray(jk.lerp(a, b, w)), np.asarray(expected))
        weight = jnp.full(a.shape, w, dtype)
        assert np.array_equal(np.asarray(jk.lerp(a, b, weight)), np.asarray(expected))


@needs_torch
def test_nonfinite_and_extrapolation_like_torch():
    a = jnp.array([0.0, 1.0, jnp.inf, 2.0, jnp.nan, -jnp.inf, 1e300])
    b = jnp.array([1.0, 3.0, 1.0, 4.0, 1.0, jnp.inf, -1e300])
    w = jnp.array([2.0, -1.0, 0.25, jnp.nan, 0.0, 0.75, 0.5])
    out = np.asarray(jk.lerp(a, b, w))
    expected = from_torch(torch.lerp(to_torch(a), to_torch(b), to_torch(w)))
    np.testing.assert_array_equal(out, expected)  # equal, NaN where torch has NaN
    np.testing.assert_array_equal(out[:2], [2.0, -1.0])


@needs_torch
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shapes", [s for s in SHAPES if 0 not in sum((s[0], s[1], s[2] or ()), ())], ids=str)
def test_gradients_match_torch(shapes, dtype):
    a, b, w = _operands(shapes, dtype, seed=3)
    scalar = isinstance(w, float)
    out_shape = np.broadcast_shapes(a.shape, b.shape, () if scalar else w.shape)
    g = random(9, out_shape, dtype)
    if scalar:
        grads = jax.vjp(lambda a, b: jk.lerp(a, b, w), a, b)[1](g)
    else:
        grads = jax.vjp(jk.lerp, a, b, w)[1](g)
    ta, tb = to_torch(a).requires_grad_(), to_torch(b).requires_grad_()
    tw = w if scalar else to_torch(w).requires_grad_()
    torch.lerp(ta, tb, tw).backward(to_torch(g))
    expected = [ta.grad, tb.grad] + ([] if scalar else [tw.grad])
    for got, want in zip(grads, expected):
        assert got.shape == tuple(want.shape) and got.dtype == dtype
        assert_close(got, from_torch(want), dtype)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
def test_half_gradients_accumulate_in_float32(dtype):
    # d_weight of a broadcast weight sums 4096 products: a float16 running sum would be far off.
    a, b = random(0, (64, 64), dtype), random(1, (64, 64), dtype)
    w = jnp.asarray(0.25, dtype)
    dw = jax.grad(lambda w: jnp.sum(jk.lerp(a, b, w).astype(jnp.float32)))(w)
    expected = np.sum(np.asarray(b, np.float64) - np.asarray(a, np.float64))
    assert dw.dtype == dtype
    scale = np.sum(np.abs(np.asarray(b, np.float64) - np.asarray(a, np.float64)))
    assert_close(dw, expected, dtype, scale=scale)


def test_check_grads_float64():
    a, b, w = random(0, (3, 4)), random(1, (4,)), random(2, (3, 1), low=0.1, high=0.9)
    a, b, w = (v.astype(jnp.float64) for v in (a, b, w))
    check_grads(jk.lerp, (a, b, w), order=2)
    check_grads(lambda a, b: jk.lerp(a, b, 0.7), (a, b), order=2)


def test_jit_and_lowering():
    a, b, w = random(0, (8, 8)), random(1, (8, 8)), random(2, (8,))
    assert_lowered(lambda a, b: jk.lerp(a, b, 0.5), a, b, targets=["jk_lerp_scalar_fwd"])
    assert_lowered(jk.lerp, a, b, w, targets=["jk_lerp_fwd"])
    grad = jax.grad(lambda a, b, w: jnp.sum(jk.lerp(a, b, w)), argnums=(0, 1, 2))
    assert_lowered(grad, a, b, w, targets=["jk_lerp_bwd_input", "jk_lerp_bwd_end", "jk_lerp_bwd_weight"])
    # Only the gradient that is asked for is computed.
    text = assert_lowered(jax.grad(lambda w: jnp.sum(jk.lerp(a, b, w))), w, targets=["jk_lerp_bwd_weight"])
    assert "jk_lerp_bwd_input" not in text and "jk_lerp_bwd_end" not in text
    np.testing.assert_allclose(jax.jit(jk.lerp)(a, b, w), jk.lerp(a, b, w), rtol=0, atol=0)


AXES = [0, 1, None]


@pytest.mark.parametrize("in_axes", [p for p in itertools.product(AXES, AXES, AXES) if p != (None, None, None)], ids=str)
def test_vmap_every_axis_mix(in_axes):
    batch = 3
    base = [(4, 5), (4, 5), (5,)]
    args = []
    for i, (axis, shape) in enumerate(zip(in_axes, base)):
        if axis is None:
            args.append(random(i, shape, jnp.float64))
        else:
            full = list(shape)
            full.insert(min(axis, len(shape)), batch)
            args.append(random(i, tuple(full), jnp.float64))
    axes = tuple(None if a is None else min(a, len(s)) for a, s in zip(in_axes, base))
    out = jax.vmap(jk.lerp, in_axes=axes)(*args)
    moved = [a if ax is None else jnp.moveaxis(a, ax, 0) for a, ax in zip(args, axes)]
    expected = np.stack([
        _reference(*[m if ax is None else m[i] for m, ax in zip(moved, axes)]) for i in range(batch)
    ])
    assert_close(out, expected)
    assert_lowered(jax.vmap(jk.lerp, in_axes=axes), *args, targets=["jk_lerp_fwd"])


def test_nested_vmap_and_vmap_of_grad():
    a, b, w = random(0, (2, 3, 6)), random(1, (3, 6)), random(2, (2, 6))
    a, b, w = (v.astype(jnp.float64) for v in (a, b, w))
    nested = jax.vmap(jax.vmap(jk.lerp, in_axes=(0, 0, None)), in_axes=(0, None, 0))
    out = nested(a, b, w)
    expected = _reference(a, b[None], w[:, None, :])
    assert_close(out, expected)

    def loss(a, b, w):
        return jnp.sum(jk.lerp(a, b, w) ** 2)

    per_example = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, 0))(a, b, w)
    for i in range(a.shape[0]):
        single = jax.grad(loss, argnums=(0, 1, 2))(a[i], b, w[i])
        for got, want in zip(per_example, single):
            assert_close(got[i], want)
    assert_lowered(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, 0)), a, b, w,
                   targets=["jk_lerp_fwd", "jk_lerp_bwd_input", "jk_lerp_bwd_weight"])


def test_errors():
    f32 = jnp.ones((2, 3), jnp.float32)
    with pytest.raises(TypeError, match=r"lerp\(\).*dtype"):
        jk.lerp(f32, f32.astype(jnp.float64), 0.5)
    with pytest.raises(TypeError, match=r"lerp\(\).*int32"):
        jk.lerp(jnp.ones(3, jnp.int32), jnp.ones(3, jnp.int32), 0.5)
    with pytest.raises(TypeError, match=r"lerp\(\).*weight"):
        jk.lerp(f32, f32, jnp.ones((2, 3), jnp.float16))
    with pytest.raises(ValueError, match=r"lerp\(\): shapes do not broadcast: input\(2, 3\), end\(4,\)"):
        jk.lerp(f32, jnp.ones(4, jnp.float32), 0.5)
    with pytest.raises(TypeError, match=r"lerp\(\)"):
        jk.lerp(f32, "end", 0.5)


def test_vmap_past_the_kernels_broadcast_rank():
    """16 alternating broadcast patterns pass the rank check; a vmap over every operand adds a
    17th, past what the kernels index: the call runs on broadcast, flattened operands instead
    (it failed at run time with INVALID_ARGUMENT), forward and gradients against jnp."""
    a = jax.random.normal(jax.random.key(0), (3,) + (2, 1) * 8, jnp.float64)
    b = jax.random.normal(jax.random.key(1), (3,) + (1, 2) * 8, jnp.float64)
    w = jax.random.uniform(jax.random.key(2), (3,) + (1,) * 16, jnp.float64)

    def loss(op):
        return lambda a, b, w: (op(a, b, w) ** 2).sum()

    # torch's two-sided formula
    reference = lambda a, b, w: jnp.where(w < 0.5, a + w * (b - a), b - (b - a) * (1 - w))
    np.testing.assert_allclose(jax.vmap(jk.lerp)(a, b, w), jax.vmap(reference)(a, b, w),
                               rtol=1e-15, atol=1e-15)
    got = jax.vmap(jax.grad(loss(jk.lerp), argnums=(0, 1, 2)))(a, b, w)
    expected = jax.vmap(jax.grad(loss(reference), argnums=(0, 1, 2)))(a, b, w)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-12)
