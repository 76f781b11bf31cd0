"""The Flax (NNX, Linen) and Equinox layers: Conv2d against the libraries' own convolutions (the
same parameters copied in: outputs, gradients, parameter names, shapes and initialisation),
GridSample / RoIAlign / SpatialTransformer against the functional ops, every example of
docs/layers.md executed, and the lazy imports."""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kernels as jk

flax = pytest.importorskip("flax", reason="flax is not installed (pip install jax_kernels[flax])")
eqx = pytest.importorskip("equinox",
                          reason="equinox is not installed (pip install jax_kernels[equinox])")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_kernels.equinox as jke  # noqa: E402
import jax_kernels.flax as jkf  # noqa: E402
import jax_kernels.flax.linen as jkl  # noqa: E402

from jk_testing import rtol  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The Flax GridSample / RoIAlign / SpatialTransformer call the ops with data_format="NHWC";
# until both ops take it (branches nhwc-grid-sample and nhwc-roi-align), those tests skip.
_NHWC_OPS = all("data_format" in inspect.signature(op).parameters
                for op in (jk.grid_sample, jk.roi_align))
needs_nhwc_ops = pytest.mark.skipif(
    not _NHWC_OPS, reason="grid_sample / roi_align have no data_format='NHWC' in this checkout")


def assert_close(actual, expected, dtype):
    """Equal to the dtype's relative tolerance (docs/design.md, "Testing"), relative to the
    largest magnitude of the expected values."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = max(np.abs(expected).max(initial=0.0), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=4 * rtol(dtype) * scale)


def normal(seed, shape, dtype=jnp.float64):
    """Random data made by NumPy (jax.random would compile one small program per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def uniform(seed, shape, low, high, dtype=jnp.float64):
    return jnp.asarray(np.random.default_rng(seed).uniform(low, high, shape).astype(dtype))


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def nchw(x):
    return jnp.moveaxis(x, -1, 1)


def nhwc(x):
    return jnp.moveaxis(x, 1, -1)


# --- the documentation's examples ------------------------------------------------------------


def _doc_examples():
    """(heading, code) of each fenced python block of docs/layers.md."""
    examples, heading = [], "top"
    text = (ROOT / "docs" / "layers.md").read_text()
    for match in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```", text, re.S | re.M):
        if match.group(1):
            heading = match.group(1).strip()
        else:
            examples.append((heading, match.group(2)))
    return examples


_EXAMPLES = _doc_examples()


@pytest.mark.parametrize("code", [
    pytest.param(code, id=f"{heading}-{i}".replace(" ", "_"),
                 marks=[needs_nhwc_ops] if "GridSample" in code and "jkf" in code else [])
    for i, (heading, code) in enumerate(_EXAMPLES)])
def test_doc_example_runs(code):
    exec(compile(code, "docs/layers.md", "exec"), {"__name__": "docs_layers"})


def test_doc_has_examples_for_every_module():
    code = "\n".join(c for _, c in _EXAMPLES)
    for module in ("jax_kernels.flax as", "jax_kernels.flax.linen as", "jax_kernels.equinox as"):
        assert module in code
    for layer in ("Conv2d", "GridSample", "RoIAlign", "SpatialTransformer"):
        assert f"jkf.{layer}" in code and f"jke.{layer}" in code


# --- imports ----------------------------------------------------------------------------------


def _run(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh Python that imports the jax_kernels this process tests (the
    source tree, or an installed wheel when the tests run from a copy)."""
    import os
    package_root = str(pathlib.Path(jk.__file__).resolve().parents[1])
    path = os.pathsep.join([package_root] + [p for p in os.environ.get("PYTHONPATH", "")
                                             .split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=package_root,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": path})


def test_import_jax_kernels_imports_neither_library():
    result = _run("""
        import sys
        import jax_kernels
        assert jax_kernels.__file__ == %r, jax_kernels.__file__
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'equinox')))
    """ % jk.__file__)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("module,library", [("jax_kernels.flax", "flax"),
                                            ("jax_kernels.flax.linen", "flax"),
                                            ("jax_kernels.equinox", "equinox")])
def test_missing_library_raises_clear_import_error(module, library):
    result = _run(f"""
        import sys
        sys.modules[{library!r}] = None  # as if not installed
        try:
            import {module}
        except ImportError as error:
            print(error)
    """)
    assert result.returncode == 0, result.stderr
    assert f"pip install jax_kernels[{library}]" in result.stdout


# --- Flax NNX Conv2d against nnx.Conv ----------------------------------------------------------

# (in, out, kernel_size, nnx.Conv keyword arguments, input shape [*batch, H, W])
_FLAX_CONFIGS = {
    "dense_same": (3, 5, (3, 3), dict(), (2, 9, 8)),
    "strided_valid": (4, 6, (3, 2), dict(strides=(2, 1), padding="VALID"), (2, 11, 9)),
    "same_stride2": (4, 4, 3, dict(strides=2, padding="SAME"), (2, 9, 10)),
    "same_lower": (2, 3, (2, 3), dict(padding="SAME_LOWER", strides=(1, 2)), (1, 7, 8)),
    "int_padding_no_bias": (3, 4, 3, dict(padding=1, use_bias=False), (2, 8, 8)),
    "pairs_dilation": (4, 6, 3, dict(padding=((2, 0), (1, 3)), kernel_dilation=(2, 1)),
                       (2, 10, 9)),
    "per_axis_ints": (3, 3, (3, 5), dict(padding=(1, 2)), (2, 8, 9)),
    "depthwise": (6, 6, 5, dict(feature_group_count=6), (2, 12, 12)),
    "channel_multiplier": (4, 8, 3, dict(feature_group_count=4, strides=2), (2, 9, 9)),
    "grouped": (6, 4, 3, dict(feature_group_count=2, kernel_dilation=2), (2, 10, 10)),
    "circular": (3, 4, 3, dict(padding="CIRCULAR"), (2, 7, 8)),
    "reflect_dilated": (3, 4, 3, dict(padding="REFLECT", kernel_dilation=2), (2, 9, 9)),
    "unbatched": (3, 4, 3, dict(), (7, 8)),
    "two_batch_axes": (3, 4, 3, dict(strides=2), (2, 3, 7, 8)),
}


def _cases(configs, float32_names):
    """Every configuration in float64, the ones named in float32 too (runtime)."""
    return ([pytest.param(name, jnp.float64, id=f"{name}-f64") for name in configs]
            + [pytest.param(name, jnp.float32, id=f"{name}-f32") for name in float32_names])


@pytest.mark.parametrize("name,dtype", _cases(_FLAX_CONFIGS, ["dense_same", "strided_valid",
                                                             "depthwise", "circular"]))
def test_flax_conv2d_matches_nnx_conv(name, dtype):
    cin, cout, kernel_size, kwargs, shape = _FLAX_CONFIGS[name]
    precision = "highest" if dtype == jnp.float32 else None
    ours = jkf.Conv2d(cin, cout, kernel_size, param_dtype=dtype, rngs=nnx.Rngs(0),
                      precision=precision, **kwargs)
    # (nnx.Conv reads an int kernel_size as a 1-D kernel; a 2-D layer reads it as (k, k).)
    ref = nnx.Conv(cin, cout, _pair(kernel_size), param_dtype=dtype, rngs=nnx.Rngs(0),
                   precision=jax.lax.Precision.HIGHEST, **kwargs)
    # The same parameters from the same Rngs: names, shapes and values.
    ours_params, ref_params = nnx.state(ours, nnx.Param), nnx.state(ref, nnx.Param)
    assert jax.tree.structure(ours_params) == jax.tree.structure(ref_params)
    for a, b in zip(jax.tree.leaves(ours_params), jax.tree.leaves(ref_params)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    if ref.bias is not None:  # a bias that is not zero, so that its gradient path shows
        ref.bias[...] = normal(3, ref.bias.shape, dtype)
        ours.bias[...] = ref.bias[...]

    x = normal(1, shape + (cin,), dtype)
    cotangent = normal(2, ref(x).shape, dtype)

    @nnx.jit
    def outputs_and_gradients(model, x):
        def loss(model, x):
            return jnp.sum(model(x) * cotangent)
        return model(x), nnx.value_and_grad(loss, argnums=(0, 1))(model, x)

    y_ours, (l_ours, (g_ours, gx_ours)) = outputs_and_gradients(ours, x)
    y_ref, (l_ref, (g_ref, gx_ref)) = outputs_and_gradients(ref, x)
    assert y_ours.shape == y_ref.shape and y_ours.dtype == y_ref.dtype
    assert_close(y_ours, y_ref, dtype)
    assert_close(l_ours, l_ref, dtype)
    assert_close(gx_ours, gx_ref, dtype)
    assert jax.tree.structure(g_ours) == jax.tree.structure(g_ref)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        assert_close(a, b, dtype)


def test_flax_conv2d_dtype_and_param_dtype_follow_nnx_conv():
    x = normal(0, (2, 8, 8, 3))
    for kwargs in (dict(dtype=jnp.float32), dict(param_dtype=jnp.bfloat16, dtype=jnp.float32),
                   dict(param_dtype=jnp.float32)):
        # Full float32 on both sides: by default each may multiply in TF32 on a GPU (jk's
        # tensor-core path, cuDNN), with its own rounding.
        ours = jkf.Conv2d(3, 4, 3, rngs=nnx.Rngs(0), precision="highest", **kwargs)
        ref = nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0), precision=jax.lax.Precision.HIGHEST,
                       **kwargs)
        assert ours.kernel.dtype == ref.kernel.dtype == kwargs["param_dtype"] \
            if "param_dtype" in kwargs else ours.kernel.dtype == jnp.float32
        y_ours, y_ref = ours(x), ref(x)
        assert y_ours.dtype == y_ref.dtype
        assert_close(y_ours, y_ref, y_ref.dtype)


def test_flax_conv2d_initialisation_statistics():
    # nnx.Conv's defaults: LeCun normal (truncated, variance 1 / fan_in) kernel, zero bias.
    layer = jkf.Conv2d(64, 128, (3, 3), feature_group_count=2, rngs=nnx.Rngs(7))
    kernel = np.asarray(layer.kernel[...])
    fan_in = 3 * 3 * 32
    assert kernel.shape == (3, 3, 32, 128) and layer.bias.shape == (128,)
    assert abs(kernel.mean()) < 0.05 / np.sqrt(fan_in) * 10
    assert abs(kernel.std() * np.sqrt(fan_in) - 1.0) < 0.03
    assert np.all(layer.bias[...] == 0)
    ref = nnx.Conv(64, 128, (3, 3), feature_group_count=2, rngs=nnx.Rngs(7))
    assert np.array_equal(kernel, ref.kernel[...])


def test_flax_conv2d_rejects_bad_arguments():
    with pytest.raises(ValueError, match="feature_group_count"):
        jkf.Conv2d(6, 4, 3, feature_group_count=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="padding"):
        jkf.Conv2d(3, 4, 3, padding="CAUSAL", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="padding"):
        jkf.Conv2d(3, 4, 3, padding=(1, 2, 3), rngs=nnx.Rngs(0))


# --- Flax Linen Conv2d against linen.Conv -----------------------------------------------------


@pytest.mark.parametrize("kwargs", [dict(), dict(strides=2, padding="VALID", use_bias=False),
                                    dict(feature_group_count=4, kernel_dilation=2, padding=2),
                                    dict(padding="CIRCULAR", strides=(2, 1))],
                         ids=["default", "strided_valid", "depthwise", "circular"])
def test_linen_conv2d_matches_linen_conv(kwargs):
    x = normal(0, (2, 9, 10, 4))
    ours, ref = jkl.Conv2d(8, (3, 3), **kwargs), nn.Conv(8, (3, 3), **kwargs)
    variables = ours.init(jax.random.key(1), x)
    ref_variables = ref.init(jax.random.key(1), x)
    assert jax.tree.structure(variables) == jax.tree.structure(ref_variables)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(ref_variables)):
        assert np.array_equal(a, b)
    variables = jax.tree.map(lambda v: v + 0.1, variables)  # a non-zero bias
    assert_close(ours.apply(variables, x), ref.apply(variables, x), jnp.float64)
    g_ours = jax.grad(lambda v: jnp.sum(ours.apply(v, x) ** 2))(variables)
    g_ref = jax.grad(lambda v: jnp.sum(ref.apply(v, x) ** 2))(variables)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        assert_close(a, b, jnp.float64)


# --- Equinox Conv2d against eqx.nn.Conv2d ------------------------------------------------------

# (in, out, kernel_size, eqx.nn.Conv2d keyword arguments, H, W)
_EQX_CONFIGS = {
    "dense": (3, 5, 3, dict(), 8, 9),
    "padded_strided": (4, 6, (3, 2), dict(stride=(2, 1), padding=1), 11, 9),
    "same": (4, 4, 3, dict(padding="SAME", stride=2), 9, 10),
    "same_lower": (2, 3, (2, 3), dict(padding="same_lower"), 7, 8),
    "pairs_dilation_no_bias": (4, 6, 3, dict(padding=((2, 0), (1, 3)), dilation=(2, 1),
                                             use_bias=False), 10, 9),
    "per_axis_ints": (3, 3, (3, 5), dict(padding=(1, 2)), 8, 9),
    "depthwise": (6, 6, 5, dict(groups=6, padding=2), 12, 12),
    "channel_multiplier": (4, 8, 3, dict(groups=4, stride=2), 9, 9),
    "grouped": (6, 4, 3, dict(groups=2, dilation=2, padding="VALID"), 10, 10),
    "reflect": (3, 4, 3, dict(padding=1, padding_mode="REFLECT"), 7, 8),
    "replicate_same": (3, 4, 3, dict(padding="SAME", padding_mode="REPLICATE", stride=2), 9, 8),
    "circular": (3, 4, (3, 2), dict(padding=((1, 1), (0, 1)), padding_mode="CIRCULAR"), 7, 8),
}


@pytest.mark.parametrize("name,dtype", _cases(_EQX_CONFIGS, ["dense", "same", "channel_multiplier",
                                                           "reflect"]))
def test_equinox_conv2d_matches_eqx_conv2d_under_vmap(name, dtype):
    cin, cout, kernel_size, kwargs, h, w = _EQX_CONFIGS[name]
    key = jax.random.key(0)
    ours = jke.Conv2d(cin, cout, kernel_size, dtype=dtype, precision="highest", key=key,
                      **kwargs)
    ref = eqx.nn.Conv2d(cin, cout, kernel_size, dtype=dtype, key=key, **kwargs)
    # The same initialisation from the same key (eqx's uniform(-1/sqrt(fan_in), ...)).
    assert ours.weight.shape == ref.weight.shape and ours.weight.dtype == ref.weight.dtype
    assert np.array_equal(ours.weight, ref.weight)
    assert (ours.bias is None) == (ref.bias is None)
    if ref.bias is not None:
        assert np.array_equal(ours.bias, ref.bias)
    # Copy the reference's weights in (here the same values, but a copy is what users do).
    ours = eqx.tree_at(lambda m: m.weight, ours, ref.weight)

    x = normal(1, (3, cin, h, w), dtype)
    cotangent = normal(2, jax.eval_shape(jax.vmap(ref), x).shape, dtype)

    @eqx.filter_jit
    def outputs_and_gradients(model, x):
        def loss(model, x):
            return jnp.sum(jax.vmap(model)(x) * cotangent)
        with jax.default_matmul_precision("highest"):  # eqx.nn.Conv2d takes no precision
            return (jax.vmap(model)(x), eqx.filter_grad(loss)(model, x),
                    jax.grad(loss, argnums=1)(model, x))

    y_ours, g_ours, gx_ours = outputs_and_gradients(ours, x)
    y_ref, g_ref, gx_ref = outputs_and_gradients(ref, x)
    assert y_ours.shape == y_ref.shape and y_ours.dtype == y_ref.dtype
    assert_close(y_ours, y_ref, dtype)
    assert_close(gx_ours, gx_ref, dtype)
    assert_close(g_ours.weight, g_ref.weight, dtype)
    if ref.bias is not None:
        assert g_ours.bias.shape == ref.bias.shape
        assert_close(g_ours.bias, g_ref.bias, dtype)


def test_equinox_conv2d_initialisation_statistics():
    layer = jke.Conv2d(64, 96, 3, groups=4, key=jax.random.key(5), dtype=jnp.float32)
    bound = 1 / np.sqrt(16 * 9)
    for values in (np.asarray(layer.weight), np.asarray(layer.bias)):
        assert values.dtype == np.float32
        assert values.min() >= -bound and values.max() <= bound
    weight = np.asarray(layer.weight)
    assert weight.shape == (96, 16, 3, 3) and layer.bias.shape == (96, 1, 1)
    assert abs(weight.std() / (bound / np.sqrt(3)) - 1) < 0.03  # uniform's standard deviation
    assert jke.Conv2d(3, 4, 3, key=jax.random.key(0)).weight.dtype == jnp.float64  # x64 on


def test_equinox_conv2d_rejects_bad_arguments():
    with pytest.raises(ValueError, match="groups"):
        jke.Conv2d(6, 4, 3, groups=4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="padding_mode"):
        jke.Conv2d(3, 4, 3, padding_mode="WRAP", key=jax.random.key(0))
    layer = jke.Conv2d(3, 4, 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        layer(jnp.ones((2, 3, 8, 8)))  # a batch: vmap instead, as eqx.nn.Conv2d


def test_equinox_train_step_reduces_loss():
    model = jke.Conv2d(2, 3, 3, padding="SAME", key=jax.random.key(0))
    x = normal(1, (4, 2, 8, 8))
    target = jax.vmap(eqx.nn.Conv2d(2, 3, 3, padding="SAME", key=jax.random.key(2)))(x)

    @eqx.filter_jit
    def step(model):
        loss, grads = eqx.filter_value_and_grad(
            lambda m: jnp.mean((jax.vmap(m)(x) - target) ** 2))(model)
        return loss, jax.tree.map(lambda p, g: p - 0.5 * g, model, grads)

    losses = []
    for _ in range(10):
        loss, model = step(model)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


def test_nnx_train_step_reduces_loss():
    model = jkf.Conv2d(2, 3, 3, rngs=nnx.Rngs(0))
    x = normal(1, (4, 8, 8, 2))
    target = nnx.Conv(2, 3, (3, 3), rngs=nnx.Rngs(1))(x)
    optimizer = nnx.Optimizer(model, __import__("optax").sgd(0.5), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0]


# --- GridSample, RoIAlign, SpatialTransformer against the ops ----------------------------------

_GRID_OPTIONS = [("bilinear", "zeros", False), ("nearest", "border", True),
                 ("bicubic", "reflection", False)]


def _image_and_grid(dtype=jnp.float64):
    x = normal(0, (2, 3, 9, 11), dtype)  # NCHW
    grid = uniform(1, (2, 5, 6, 2), -1.2, 1.2, dtype)
    return x, grid


@pytest.mark.parametrize("mode,padding_mode,align_corners", _GRID_OPTIONS)
def test_equinox_grid_sample_matches_op(mode, padding_mode, align_corners):
    x, grid = _image_and_grid()
    layer = jke.GridSample(mode, padding_mode, align_corners)
    expected = jk.grid_sample(x, grid, mode, padding_mode, align_corners)
    np.testing.assert_array_equal(jax.vmap(layer)(x, grid), expected)
    g = jax.grad(lambda x, grid: jnp.sum(jax.vmap(layer)(x, grid) ** 2), argnums=(0, 1))(x, grid)
    g_op = jax.grad(lambda x, grid: jnp.sum(
        jk.grid_sample(x, grid, mode, padding_mode, align_corners) ** 2), argnums=(0, 1))(x, grid)
    for a, b in zip(g, g_op):
        assert_close(a, b, jnp.float64)


@needs_nhwc_ops
@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("mode,padding_mode,align_corners", _GRID_OPTIONS)
def test_flax_grid_sample_matches_op(api, mode, padding_mode, align_corners):
    x, grid = _image_and_grid()
    expected = nhwc(jk.grid_sample(x, grid, mode, padding_mode, align_corners))
    if api == "nnx":
        layer = jkf.GridSample(mode, padding_mode, align_corners)
        apply = layer
    else:
        layer = jkl.GridSample(mode, padding_mode, align_corners)
        apply = lambda x, grid: layer.apply({}, x, grid)  # noqa: E731
    assert_close(apply(nhwc(x), grid), expected, jnp.float64)
    g = jax.grad(lambda x: jnp.sum(apply(x, grid) ** 2))(nhwc(x))
    g_op = jax.grad(lambda x: jnp.sum(
        jk.grid_sample(x, grid, mode, padding_mode, align_corners) ** 2))(x)
    assert_close(g, nhwc(g_op), jnp.float64)


_BOXES = np.array([[0, 1.0, 1.5, 7.0, 6.0], [1, 0.5, 2.0, 10.0, 8.5], [1, 3.0, 0.0, 6.0, 4.0]])


@pytest.mark.parametrize("output_size,spatial_scale,sampling_ratio,aligned",
                         [(3, 1.0, 2, False), ((2, 4), 0.5, -1, True)])
def test_equinox_roi_align_matches_op(output_size, spatial_scale, sampling_ratio, aligned):
    x, _ = _image_and_grid()
    boxes = jnp.asarray(_BOXES[1:, 1:])[None].repeat(2, axis=0)  # two boxes per image
    layer = jke.RoIAlign(output_size, spatial_scale, sampling_ratio, aligned)
    expected = jk.roi_align(x, [boxes[0], boxes[1]], output_size, spatial_scale,
                            sampling_ratio, aligned)
    out = jax.vmap(layer)(x, boxes)  # [N, K, C, h, w]
    np.testing.assert_array_equal(out.reshape(expected.shape), expected)
    g = jax.grad(lambda b: jnp.sum(jax.vmap(layer)(x, b) ** 2))(boxes)
    g_op = jax.grad(lambda b: jnp.sum(jk.roi_align(
        x, [b[0], b[1]], output_size, spatial_scale, sampling_ratio, aligned) ** 2))(boxes)
    assert_close(g, g_op, jnp.float64)


@needs_nhwc_ops
@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("output_size,spatial_scale,sampling_ratio,aligned",
                         [(3, 1.0, 2, False), ((2, 4), 0.5, -1, True)])
def test_flax_roi_align_matches_op(api, output_size, spatial_scale, sampling_ratio, aligned):
    x, _ = _image_and_grid()
    boxes = jnp.asarray(_BOXES)
    args = (output_size, spatial_scale, sampling_ratio, aligned)
    if api == "nnx":
        apply = jkf.RoIAlign(*args)
    else:
        layer = jkl.RoIAlign(*args)
        apply = lambda x, b: layer.apply({}, x, b)  # noqa: E731
    expected = nhwc(jk.roi_align(x, boxes, *args))
    assert_close(apply(nhwc(x), boxes), expected, jnp.float64)
    g = jax.grad(lambda b: jnp.sum(apply(nhwc(x), b) ** 2))(boxes)
    g_op = jax.grad(lambda b: jnp.sum(jk.roi_align(x, b, *args) ** 2))(boxes)
    assert_close(g, g_op, jnp.float64)


def _theta_of(features):
    """A fixed 'localisation network' for the comparisons: a smooth map to 6 numbers near the
    identity transform."""
    pooled = jnp.mean(features, axis=tuple(range(1, features.ndim)))
    return (jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 0.0], features.dtype)
            + 0.2 * jnp.tanh(pooled[..., None] * jnp.arange(1.0, 7.0, dtype=features.dtype)))


def _stn_reference(x, output_size, mode, padding_mode, align_corners):
    """The functional spatial transformer on NCHW x, with the localisation above."""
    theta = _theta_of(x).reshape(x.shape[0], 2, 3)
    grid = jk.affine_grid(theta, x.shape[:2] + output_size, align_corners)
    return jk.grid_sample(x, grid, mode, padding_mode, align_corners)


@pytest.mark.parametrize("output_size,mode,padding_mode,align_corners",
                         [((9, 11), "bilinear", "zeros", False),
                          ((6, 7), "bicubic", "border", True)])
def test_equinox_spatial_transformer_matches_ops(output_size, mode, padding_mode, align_corners):
    x, _ = _image_and_grid()
    layer = jke.SpatialTransformer(lambda e: _theta_of(e[None])[0],
                                   None if output_size == (9, 11) else output_size,
                                   mode, padding_mode, align_corners)
    expected = _stn_reference(x, output_size, mode, padding_mode, align_corners)
    assert_close(jax.vmap(layer)(x), expected, jnp.float64)
    g = jax.grad(lambda x: jnp.sum(jax.vmap(layer)(x) ** 2))(x)
    g_op = jax.grad(lambda x: jnp.sum(
        _stn_reference(x, output_size, mode, padding_mode, align_corners) ** 2))(x)
    assert_close(g, g_op, jnp.float64)


def test_equinox_spatial_transformer_trains_its_localization():
    key1, key2 = jax.random.split(jax.random.key(0))
    head = eqx.nn.Linear(2 * 4 * 4, 6, key=key2)
    head = eqx.tree_at(lambda l: (l.weight, l.bias), head,
                       (jnp.zeros_like(head.weight), jnp.array([1.0, 0, 0, 0, 1, 0])))
    loc = eqx.nn.Sequential([jke.Conv2d(2, 2, 3, stride=2, padding=1, key=key1),
                             eqx.nn.Lambda(jnp.ravel), head])
    stn = jke.SpatialTransformer(loc)
    x = normal(1, (3, 2, 8, 8))
    np.testing.assert_allclose(jax.vmap(stn)(x), jax.vmap(jke.GridSample())(
        x, jk.affine_grid(jnp.tile(jnp.eye(2, 3), (3, 1, 1)), x.shape)), atol=1e-12)
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)[:, :, :4] ** 2))(stn)
    assert jnp.any(grads.localization.layers[2].bias != 0)
    assert jnp.any(grads.localization.layers[2].weight != 0)


@needs_nhwc_ops
@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("output_size,mode,padding_mode,align_corners",
                         [((9, 11), "bilinear", "zeros", False),
                          ((6, 7), "bicubic", "border", True)])
def test_flax_spatial_transformer_matches_ops(api, output_size, mode, padding_mode,
                                              align_corners):
    x, _ = _image_and_grid()
    size = None if output_size == (9, 11) else output_size
    if api == "nnx":
        apply = jkf.SpatialTransformer(_theta_of, size, mode, padding_mode, align_corners)
    else:
        layer = jkl.SpatialTransformer(_theta_of, size, mode, padding_mode, align_corners)
        apply = lambda x: layer.apply({}, x)  # noqa: E731
    expected = nhwc(_stn_reference(x, output_size, mode, padding_mode, align_corners))
    assert_close(apply(nhwc(x)), expected, jnp.float64)
    g = jax.grad(lambda x: jnp.sum(apply(x) ** 2))(nhwc(x))
    g_op = jax.grad(lambda x: jnp.sum(
        _stn_reference(x, output_size, mode, padding_mode, align_corners) ** 2))(x)
    assert_close(g, nhwc(g_op), jnp.float64)


@needs_nhwc_ops
def test_linen_spatial_transformer_with_a_submodule_localization():
    class Localization(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jkl.Conv2d(4, (3, 3), strides=2)(x)
            return nn.Dense(6, kernel_init=nn.initializers.zeros,
                            bias_init=lambda *_: jnp.array([1.0, 0, 0, 0, 1, 0]))(
                jnp.mean(h, axis=(1, 2)))

    stn = jkl.SpatialTransformer(Localization(), output_size=(6, 6))
    x = normal(0, (2, 8, 8, 3))
    variables = stn.init(jax.random.key(1), x)
    assert set(variables["params"]["localization"]) == {"Conv2d_0", "Dense_0"}
    y = stn.apply(variables, x)
    assert y.shape == (2, 6, 6, 3)
    grads = jax.grad(lambda v: jnp.sum(stn.apply(v, x)[:, :3] ** 2))(variables)
    assert jnp.any(grads["params"]["localization"]["Dense_0"]["bias"] != 0)
