"""Helpers shared by the test files: tolerances per dtype, conversions to and from torch (the
CPU oracle), and inspection of the lowered program."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from jax_kernels import _ffi

try:
    import torch
except Exception as error:  # torch is an optional oracle: absent, or broken in this environment
    torch = None
    TORCH_UNAVAILABLE = f"torch is not importable ({type(error).__name__}: {error})"[:200]
else:
    TORCH_UNAVAILABLE = ""

DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)

# Relative tolerances by dtype (docs/design.md, "Testing"); never loosen one to make a test pass.
RTOL = {
    np.dtype(jnp.float16): 1e-2,
    np.dtype(jnp.bfloat16): 1e-2,
    np.dtype(jnp.float32): 1e-5,
    np.dtype(jnp.float64): 1e-12,
}

ON_GPU = jax.default_backend() == "gpu"


def rtol(dtype) -> float:
    return RTOL[np.dtype(dtype)]


def random(key_or_seed, shape, dtype=jnp.float32, low=-1.0, high=1.0) -> jax.Array:
    """Uniform random array (never zeros: they hide unwritten outputs)."""
    rng = np.random.default_rng(key_or_seed)
    return jnp.asarray(rng.uniform(low, high, size=shape)).astype(dtype)


def to_numpy64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float64))


def to_torch(x, dtype=None):
    """A CPU torch tensor with x's values, in x's dtype (or `dtype`)."""
    dtype = np.dtype(x.dtype if dtype is None else dtype)
    t = torch.from_numpy(np.array(jnp.asarray(x).astype(jnp.float64)))
    return t.to(torch_dtype(dtype))


def torch_dtype(dtype):
    return {
        np.dtype(jnp.float16): torch.float16,
        np.dtype(jnp.bfloat16): torch.bfloat16,
        np.dtype(jnp.float32): torch.float32,
        np.dtype(jnp.float64): torch.float64,
    }[np.dtype(dtype)]


def from_torch(t) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def assert_close(actual, expected, dtype=None, scale=None, rtol_=None):
    """max |actual - expected| <= rtol * max(|expected|, scale): a relative error against the
    array's magnitude (elementwise relative error is meaningless near zeros)."""
    actual = to_numpy64(actual)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    tol = rtol_ if rtol_ is not None else rtol(dtype if dtype is not None else np.float64)
    magnitude = max(np.max(np.abs(expected), initial=0.0), scale or 0.0, 1e-30)
    error = np.max(np.abs(actual - expected), initial=0.0)
    assert np.all(np.isfinite(actual) == np.isfinite(expected)), "finite/non-finite mismatch"
    assert error <= tol * magnitude, f"max abs error {error:.3e} > {tol:.1e} * {magnitude:.3e}"


def lowered_text(fn, *args) -> str:
    """The StableHLO text of jit(fn) lowered for the default backend."""
    return jax.jit(fn).lower(*args).as_text()


def custom_call_targets(text: str) -> list[str]:
    return re.findall(r'custom_call @([\w.]+)', text) + re.findall(r'call_target_name = "([^"]+)"', text)


def assert_lowered(fn, *args, targets=(), forbidden=("stablehlo.while",)) -> str:
    """The lowered program calls every target in `targets` and holds none of `forbidden`."""
    text = lowered_text(fn, *args)
    called = custom_call_targets(text)
    for target in targets:  # a pass's name; registered with its version (_ffi.target_name)
        assert _ffi.target_name(target) in called, f"{target} not in {called}"
    for op in forbidden:
        assert op not in text, f"{op} found in the lowered program"
    return text
