"""Hostile but legal inputs: extreme paddings, dilations and strides, results too large for any
memory. Each regression case runs in its own subprocess (a crash fails the test, it does not
kill the run) and reports its peak memory; property tests compare conv2d's passes on random
geometries, enormous ones included, with a jnp reference that touches live taps only."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kernels as jk

try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except Exception as error:  # hypothesis is in the test extras; skip cleanly without it
    HYPOTHESIS_UNAVAILABLE = f"hypothesis is not importable ({type(error).__name__})"
else:
    HYPOTHESIS_UNAVAILABLE = ""


def run_isolated(code: str, timeout: float = 120) -> dict:
    """Runs `code` (which fills the dict `result`) in a fresh CPU-only Python; returns `result`
    with the growth of the peak resident memory during the case, in GB ("rss_gb"), over the
    process after a small conv2d forward and gradient (the libraries loaded: 0.2 GB on a CPU
    machine, 1.7 GB where jax's CUDA libraries are installed)."""
    wrapper = textwrap.dedent("""
        import json, resource, sys
        import jax, jax.numpy as jnp
        jax.config.update("jax_enable_x64", True)
        import jax_kernels as jk
        jax.grad(lambda x: jk.conv2d(x, jnp.ones((1, 1, 3, 3)), padding=1).sum())(
            jnp.ones((1, 1, 4, 4))).block_until_ready()
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = {}
        exec(compile(sys.stdin.read(), "<case>", "exec"), {"result": result})
        result["rss_gb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1e6
        print(json.dumps(result))
    """)
    proc = subprocess.run([sys.executable, "-c", wrapper], input=textwrap.dedent(code),
                          capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, f"the case crashed or failed (rc {proc.returncode}):\n" \
                                 f"{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def conv_reference(x, w, stride, padding, dilation, groups):
    """conv2d in jnp from gathers of the live taps (no padded copy): any geometry, float64,
    differentiable (its gradients are the dgrad / wgrad oracles)."""
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    p = (h + 2 * ph - dh * (r - 1) - 1) // sh + 1
    q = (wd + 2 * pw - dw * (s - 1) - 1) // sw + 1
    iy = np.arange(p)[:, None] * sh + np.arange(r)[None, :] * dh - ph       # [P, R]
    ix = np.arange(q)[:, None] * sw + np.arange(s)[None, :] * dw - pw       # [Q, S]
    my, mx = (iy >= 0) & (iy < h), (ix >= 0) & (ix < wd)
    patches = x[:, :, np.clip(iy, 0, h - 1)][:, :, :, :, np.clip(ix, 0, wd - 1)]  # [N,C,P,R,Q,S]
    patches = patches * (my[:, :, None, None] & mx[None, None]).astype(x.dtype)
    patches = patches.reshape(n, groups, c // groups, p, r, q, s)
    weights = w.reshape(groups, k // groups, cg, r, s)
    y = jnp.einsum("ngcprqs,gkcrs->ngkpq", patches, weights, precision="highest")
    return y.reshape(n, k, p, q)


def conv_errors(x_shape, w_shape, stride, padding, dilation, groups) -> dict:
    """conv2d's forward, input gradient and weight gradient against conv_reference's, in
    float64: the output shape and each pass's largest error relative to max(1, its largest
    reference value)."""
    x = jax.random.normal(jax.random.key(0), x_shape, jnp.float64)
    w = jax.random.normal(jax.random.key(1), w_shape, jnp.float64)
    y, vjp = jax.vjp(lambda x, w: jk.conv2d(x, w, stride=stride, padding=padding,
                                            dilation=dilation, groups=groups), x, w)
    y_ref, vjp_ref = jax.vjp(lambda x, w: conv_reference(x, w, stride, padding, dilation,
                                                         groups), x, w)
    dy = jax.random.normal(jax.random.key(2), y.shape, jnp.float64)
    errors = [float(jnp.max(jnp.abs(a - b)) / max(1.0, float(jnp.max(jnp.abs(b)))))
              if a.size else 0.0 for a, b in zip((y,) + vjp(dy), (y_ref,) + vjp_ref(dy))]
    return {"shape": list(y.shape), "errors": errors}


_CONV_CASE = """
import sys
sys.path.insert(0, {test_dir!r})
from test_hardening import conv_errors
result.update(conv_errors({x_shape}, {w_shape}, {stride}, {padding}, {dilation}, {groups}))
"""


@pytest.mark.parametrize("stride, padding, dilation, groups", [
    ((10000, 10000), (10000, 10000), (1, 1), 1),          # stride and padding dwarf the image
    ((1000, 999), (3000, 2999), (1, 1), 2),               # was 2 GB and 5 s per pass
    ((1, 1), (1 << 20, 1 << 20), (1 << 20, 1 << 20), 1),  # was std::bad_alloc
    ((3, 7000), (5, 7000), (2, 3000), 2),                 # mixed: one axis extreme
])
def test_conv2d_extreme_geometry(stride, padding, dilation, groups):
    """Every pass of conv2d on a 4x4 image whose padding, dilation or stride are enormous: the
    right values, memory of the tensors' order (not of the options), in seconds."""
    import pathlib
    result = run_isolated(_CONV_CASE.format(
        test_dir=str(pathlib.Path(__file__).parent), stride=stride, padding=padding,
        dilation=dilation, groups=groups, x_shape=(2, 4, 4, 5), w_shape=(4, 4 // groups, 3, 3)))
    assert all(e < 1e-12 for e in result["errors"]), result
    assert result["rss_gb"] < 0.5, result  # was +1.8 GB, or std::bad_alloc


@pytest.mark.parametrize("call", [
    "jk.conv2d(jnp.ones((1, 1, 4, 4)), jnp.ones((1, 1, 3, 3)), padding=1 << 40)",
    "jk.repeat(jnp.ones((4, 4)), (1 << 40, 1 << 40))",
    "jk.roi_align(jnp.ones((1, 1, 4, 4)), jnp.zeros((1, 5)), (1 << 40, 1 << 40))",
])
def test_results_past_any_memory_are_refused(call):
    """A result of more than 2^62 bytes made XLA abort the process (its shape arithmetic
    overflows): refused at trace time with a ValueError naming the op."""
    result = run_isolated(f"""
import jax, jax.numpy as jnp, jax_kernels as jk
try:
    jax.eval_shape(lambda: {call})
    result['error'] = None
except ValueError as e:
    result['error'] = str(e)
""")
    op = call.split("(")[0].split(".")[1]
    assert result["error"] and result["error"].startswith(f"{op}(): the result would have shape")


@pytest.mark.skipif(bool(HYPOTHESIS_UNAVAILABLE), reason=HYPOTHESIS_UNAVAILABLE or "-")
def test_conv2d_random_geometries():
    """Random shapes and options, strides / paddings / dilations up to 10^5, float64: the
    forward and both gradients equal the reference."""

    extent = st.one_of(st.integers(1, 4), st.integers(1, 100000))

    @st.composite
    def problems(draw):
        groups = draw(st.sampled_from([1, 2]))
        c, k = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
        h, w = draw(st.integers(1, 6)), draw(st.integers(1, 6))
        r, s = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        stride = (draw(extent), draw(extent))
        dilation = (draw(extent), draw(extent))
        padding = (draw(st.one_of(st.integers(0, 3), st.integers(0, 100000))),
                   draw(st.one_of(st.integers(0, 3), st.integers(0, 100000))))
        p = (h + 2 * padding[0] - dilation[0] * (r - 1) - 1)
        q = (w + 2 * padding[1] - dilation[1] * (s - 1) - 1)
        # a kernel that does not fit the padded input is an error (tested elsewhere); keep the
        # output small enough for the reference
        if p < 0 or q < 0 or (p // stride[0] + 1) * (q // stride[1] + 1) > 4096:
            from hypothesis import assume
            assume(False)
        return (1, c, h, w), (k, c // groups, r, s), stride, padding, dilation, groups

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(problems())
    def check(problem):
        result = conv_errors(*problem)
        assert all(e <= 1e-12 for e in result["errors"]), (problem, result)

    check()


def roi_align_separable_reference(image, box, output_size, sampling_ratio):
    """torchvision's RoIAlign of one box (aligned=False, spatial_scale 1) on one float64 image
    [C, H, W], written separably: the mean over a bin's sample grid of bilinear samples is
    Wy @ image @ Wx.T, with Wy[ph, h] the summed row weights of bin ph's samples (0 for samples
    outside [-1, H]) over the count. Returns (output [C, PH, PW], Wy, Wx)."""
    def axis_weights(first, second, bins, size):
        extent = max(second - first, 1.0)
        t = np.arange(bins * sampling_ratio)
        pos = first + (t // sampling_ratio) * (extent / bins) + \
            ((t % sampling_ratio) + 0.5) * (extent / bins) / sampling_ratio
        valid = (pos >= -1) & (pos <= size)
        p = np.clip(pos, 0, None)
        low = np.floor(p).astype(np.int64)
        at_end = low >= size - 1
        low = np.where(at_end, size - 1, low)
        high = np.where(at_end, size - 1, low + 1)
        p = np.where(at_end, low, p)
        w_high = p - low
        weights = np.zeros((bins, size))
        np.add.at(weights, (t // sampling_ratio, low), np.where(valid, 1 - w_high, 0))
        np.add.at(weights, (t // sampling_ratio, high), np.where(valid, w_high, 0))
        return weights

    _, h, w = image.shape
    _, x1, y1, x2, y2 = box
    wy = axis_weights(y1, y2, output_size, h) / sampling_ratio ** 2
    wx = axis_weights(x1, x2, output_size, w)
    return np.einsum("ph,chw,qw->cpq", wy, image, wx), wy, wx


def test_roi_align_empty_images_or_channels_with_boxes():
    """Boxes over an input with no image (N = 0) or no channel (C = 0), in both layouts and
    with either sampling rule: every pass returns its shape without running a sample (the CPU
    forward once divided the thread count by N * C: SIGFPE, found by test_properties). Each box
    pools nothing: zeros where C > 0; the gradients are zeros of the operands' shapes."""
    result = run_isolated("""
import jax, jax.numpy as jnp, jax_kernels as jk, numpy as np
boxes = jnp.asarray([[0.0, -0.5, 2.4, -0.5, 2.4], [0.0, 1.0, 1.0, 2.0, 2.0],
                     [-0.5, 0.0, 0.0, 3.0, 3.0]])
result['cases'] = []
for fmt in ('NCHW', 'NHWC'):
    for n, c in ((0, 3), (2, 0), (0, 0)):
        shape = (n, c, 4, 5) if fmt == 'NCHW' else (n, 4, 5, c)
        for ratio in (-1, 2):
            op = lambda x, b: jk.roi_align(x, b, (2, 1), 0.5, ratio, True, data_format=fmt)
            x = jnp.ones(shape)
            out, vjp = jax.vjp(op, x, boxes)
            d_x, d_b = vjp(jnp.ones_like(out))
            result['cases'].append([fmt, n, c, ratio, list(out.shape), bool(np.all(out == 0)),
                                    list(d_x.shape), list(d_b.shape),
                                    bool(np.all(d_b == 0))])
""")
    assert len(result["cases"]) == 12
    for fmt, n, c, ratio, out, zeros, d_x, d_b, d_b_zeros in result["cases"]:
        assert out == ([3, c, 2, 1] if fmt == "NCHW" else [3, 2, 1, c]), (fmt, n, c, ratio)
        assert zeros and d_b_zeros and d_b == [3, 5]
        assert d_x == ([n, c, 4, 5] if fmt == "NCHW" else [n, 4, 5, c])


def test_roi_align_fixed_grid_is_bounded():
    """A fixed sampling_ratio costs PH * PW * sampling_ratio^2 samples per box: the old cap of
    2^20 bounded nothing (one small box ran for hours on the CPU). Above 64 it is refused at
    trace time, naming the op; at 64 every pass of a small box and of one covering the image
    takes seconds and equals the separable float64 reference (input gradient: its transpose;
    box gradient: central differences of it)."""
    refused = run_isolated("""
import jax, jax.numpy as jnp, jax_kernels as jk
result['errors'] = []
for ratio in (65, 1 << 20):
    try:
        jax.eval_shape(lambda: jk.roi_align(jnp.ones((1, 1, 4, 4)), jnp.zeros((1, 5)), 7,
                                            sampling_ratio=ratio))
        result['errors'].append(None)
    except ValueError as e:
        result['errors'].append(str(e))
""")
    assert all(e and e.startswith("roi_align(): sampling_ratio must be at most 64") for e in
               refused["errors"]), refused

    result = run_isolated("""
import time
import jax, jax.numpy as jnp, jax_kernels as jk
import numpy as np
start = time.perf_counter()
x = jax.random.normal(jax.random.key(0), (1, 3, 24, 20), jnp.float64)
boxes = jnp.asarray([[0, 3.3, 4.1, 5.2, 6.9], [0, -2.5, -1.5, 21.5, 25.5]], jnp.float64)
dout = jax.random.normal(jax.random.key(1), (2, 3, 7, 7), jnp.float64)
op = lambda x, b: jk.roi_align(x, b, 7, 1.0, 64, False)
out, vjp = jax.vjp(op, x, boxes)
d_input, d_boxes = vjp(dout)
jax.block_until_ready((out, d_input, d_boxes))
result['seconds'] = time.perf_counter() - start
for name, value in (('x', x), ('boxes', boxes), ('dout', dout), ('out', out),
                    ('d_input', d_input), ('d_boxes', d_boxes)):
    result[name] = np.asarray(value).tolist()
""", timeout=300)
    assert result["seconds"] < 60, result["seconds"]
    x, boxes = np.asarray(result["x"])[0], np.asarray(result["boxes"])
    dout = np.asarray(result["dout"])
    d_input_ref = np.zeros_like(x)
    for k, box in enumerate(boxes):
        out_ref, wy, wx = roi_align_separable_reference(x, box, 7, 64)
        np.testing.assert_allclose(result["out"][k], out_ref, rtol=1e-10, atol=1e-12)
        d_input_ref += np.einsum("ph,cpq,qw->chw", wy, dout[k], wx)
        for j in range(1, 5):  # box gradient: the separable reference's central differences
            step = np.zeros(5)
            step[j] = 1e-6
            plus = roi_align_separable_reference(x, box + step, 7, 64)[0]
            minus = roi_align_separable_reference(x, box - step, 7, 64)[0]
            fd = np.sum(dout[k] * (plus - minus)) / 2e-6
            assert abs(result["d_boxes"][k][j] - fd) <= 1e-5 * max(1.0, abs(fd)), (k, j, fd)
        assert result["d_boxes"][k][0] == 0
    np.testing.assert_allclose(result["d_input"][0], d_input_ref, rtol=1e-10, atol=1e-12)
