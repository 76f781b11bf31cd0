"""The package's plumbing: both native modules register the same target names, capabilities()
describes what was built, enum codes and host queries cross the FFI boundary by name, and the
float16/bfloat16 conversions of the kernels round like
NumPy/ml_dtypes (round to nearest even, subnormals, overflow, NaN)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_kernels as jk
from jax_kernels import _ffi
from jk_testing import TORCH_UNAVAILABLE, torch


def test_same_targets_on_every_platform():
    records = _ffi.records()
    cpu_targets = {r[0] for r in records["cpu"]}
    assert {"jk_lerp_fwd_v1", "jk_repeat_fwd_v1", "jk_repeat_bwd_v1"} <= cpu_targets
    assert sorted(cpu_targets) == _ffi.targets()
    if _ffi.CUDA_BUILT:
        assert {r[0] for r in records["cuda"]} == cpu_targets
    else:
        assert "cuda" not in records


def test_capabilities_table():
    table = jk.capabilities()
    platforms = {row.platform for row in table}
    assert platforms == ({"cpu", "cuda"} if _ffi.CUDA_BUILT else {"cpu"})
    rows = {(r.op, r.pass_, r.dtype, r.platform): r for r in table}
    row = rows[("repeat", "backward d_input", "bfloat16", "cpu")]
    assert row.accumulator == "float32" and row.deterministic == "bitwise"
    assert rows[("lerp", "forward", "float64", "cpu")].accumulator == "float64"
    # Printed: a compact summary, one line per (op, pass), short enough to read.
    text = str(table)
    lines = text.splitlines()
    passes = {(r.op, r.pass_) for r in table}
    assert lines[1].split() == ["op", "pass"] + sorted(platforms)
    assert len(lines) <= len(passes) + 7 and max(len(line) for line in lines) <= 100
    assert any(line.split()[:3] == ["repeat", "backward", "d_input"] for line in lines)
    assert ("CUDA module built" in lines[0]) == _ffi.CUDA_BUILT
    # full=True: one line per row.
    full = str(jk.capabilities(full=True)).splitlines()
    assert full[0].split() == ["op", "pass", "dtype", "platform", "deterministic", "accumulator",
                               "backend"]
    assert len(full) == len(table) + 2


def test_capabilities_half_types_never_list_atomics(monkeypatch):
    """A pass that may take atomics with deterministic=False (the CUDA input gradients of
    grid_sample and roi_align) does so only for float32/float64: its half-type rows say they are
    always ordered. The records are the CUDA module's where it is built, else a stand-in row
    with its determinism text (the CPU registers no such pass)."""
    records = _ffi.records()
    if "cuda" not in records:
        atomic = ("jk_roi_align_bwd_input_v1", "roi_align", "backward d_input", "cuda sort",
                  "bitwise (deterministic=True); atomics otherwise for float32/float64")
        monkeypatch.setattr(_ffi, "records", lambda: {**records, "cuda": [atomic]})
    rows = [r for r in jk.capabilities() if r.platform == "cuda" and
            r.op in ("grid_sample", "roi_align") and r.pass_.startswith("backward d_input") and
            "directional" not in r.pass_]
    assert rows
    for r in rows:
        if r.dtype in ("float16", "bfloat16"):
            assert "atomics" not in r.deterministic and r.deterministic.startswith("bitwise"), r
        else:
            assert "atomics otherwise for float32/float64" in r.deterministic, r


def test_enum_codes_come_from_the_native_module():
    assert set(_ffi.ENUMS) == {"GridSampleMode", "GridSamplePadding", "ConvPass", "ConvPrecision",
                               "ConvDtype", "ConvLayout"}
    assert _ffi.ENUMS["ConvDtype"] == {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
    assert _ffi.ENUMS["ConvLayout"] == {"NCHW": 0, "NHWC": 1}
    # grid_sample's codes are torch's (ATen's GridSamplerInterpolation / GridSamplerPadding).
    if torch is None:
        pytest.skip(TORCH_UNAVAILABLE)
    functional = torch.nn.functional
    assert _ffi.ENUMS["GridSampleMode"] == functional.GRID_SAMPLE_INTERPOLATION_MODES
    assert _ffi.ENUMS["GridSamplePadding"] == functional.GRID_SAMPLE_PADDING_MODES


@pytest.mark.skipif(not _ffi.CUDA_BUILT, reason="host queries live in the CUDA module")
def test_host_queries_take_named_arguments():
    args = dict(batch=2, points=100, cells=64, extended_cells=81, dims=2,
                mode=_ffi.ENUMS["GridSampleMode"]["bilinear"], element_bytes=4)
    deterministic = _ffi.query("grid_sample_bwd_input_scratch", deterministic=1, directional=0,
                               **args)
    # Bilinear first order sorts one entry per point (keys and values, twice each, and its 4
    # tap weights before and after the sort) and marks the segments of the 2 x 9 x 9 extended
    # corners; the directional pass sorts one entry per (point, tap) with a weight each and marks
    # the segments of the 2 x 64 cells.
    assert deterministic > 4 * 2 * 100 * 4 + 2 * 2 * 100 * 16 + 2 * 2 * 81 * 4
    directional = _ffi.query("grid_sample_bwd_input_scratch", deterministic=1, directional=1,
                             **args)
    assert directional > 4 * 2 * 100 * 4 * 4 + 2 * 2 * 100 * 4 * 4 + 2 * 2 * 64 * 4
    assert directional > deterministic
    assert _ffi.query("grid_sample_bwd_input_scratch", deterministic=0, directional=0,
                      **args) == 0  # atomics
    with pytest.raises(ValueError, match="missing query argument 'deterministic'"):
        _ffi.query("grid_sample_bwd_input_scratch", **args)
    with pytest.raises(ValueError, match="takes no argument 'channels'"):
        _ffi.query("grid_sample_bwd_input_scratch", deterministic=1, directional=0, channels=3,
                   **args)
    with pytest.raises(ValueError, match="no host query named"):
        _ffi.query("no_such_query")


@pytest.mark.skipif(not _ffi.CUDA_BUILT, reason="host queries live in the CUDA module")
def test_scratch_queries_refuse_sizes_past_int64():
    """Scratch sizes are computed in checked 64-bit arithmetic: a problem whose scratch no
    64-bit size describes (traceable with jax.export, which allocates nothing) gets
    SIZE_OVERFLOW, never a wrapped size, and the op raises a ValueError naming itself; a
    query's own refusals stay -1."""
    overflow = _ffi.SIZE_OVERFLOW
    bilinear = _ffi.ENUMS["GridSampleMode"]["bilinear"]
    grid_sample = dict(batch=2**30, cells=16, extended_cells=25, dims=2, mode=bilinear,
                       element_bytes=4, deterministic=1, directional=0)
    assert _ffi.query("grid_sample_bwd_input_scratch", points=2**20, **grid_sample) > 0
    assert _ffi.query("grid_sample_bwd_input_scratch", points=2**29, **grid_sample) == overflow
    roi_align = dict(N=1, H=64, W=64, boxes=2**20, pooled_height=7, pooled_width=7,
                     sampling_ratio=2, element_bytes=4, deterministic=1)
    assert _ffi.query("roi_align_backward_input_scratch", C=256, **roi_align) > 0
    assert _ffi.query("roi_align_backward_input_scratch", C=2**60, **roi_align) == overflow
    forward = dict(N=2**20, H=2**10, W=2**10, pooled_height=7, pooled_width=7, sampling_ratio=2,
                   element_bytes=4)
    assert _ffi.query("roi_align_forward_scratch", C=2**22, boxes=4, **forward) == overflow
    assert _ffi.query("roi_align_forward_scratch", C=1, boxes=2**31, **forward) == -1
    conv = {"pass": _ffi.ENUMS["ConvPass"]["backward_weight"],
            "dtype": _ffi.ENUMS["ConvDtype"]["float32"], "layout": _ffi.ENUMS["ConvLayout"]["NCHW"],
            "N": 4, "H": 8, "W": 8, "R": 3, "S": 3, "P": 8, "Q": 8, "stride_h": 1, "stride_w": 1,
            "pad_top": 1, "pad_left": 1, "dilation_h": 1, "dilation_w": 1, "groups": 1,
            "precision": 0}
    assert _ffi.query("conv2d_scratch", C=3, K=5, **conv) > 0
    assert _ffi.query("conv2d_scratch", C=2**31 - 1, K=2**31 - 1, **conv) == overflow
    # The op's trace-time error: d_input of a grid_sample on 2^30 x 2^29 points.
    f = jax.grad(lambda x, g: jk.grid_sample(x, g).sum())
    shapes = (jax.ShapeDtypeStruct((2**30, 1, 4, 4), jnp.float32),
              jax.ShapeDtypeStruct((2**30, 2**15, 2**14, 2), jnp.float32))
    with pytest.raises(ValueError, match=r"grid_sample\(\).*64-bit size"):
        jax.export.export(jax.jit(f), platforms=("cuda",),
                          disabled_checks=jk.disabled_export_checks())(*shapes)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
def test_half_conversions_round_to_nearest_even(dtype):
    # repeat's backward sums the two copies of each element in float32 and rounds once to the
    # half type: the sum of two half values is exact in float32 and half of them are ties, so
    # this checks the kernels' float -> half rounding (ties to even, subnormals, overflow, NaN)
    # against ml_dtypes' rounding. The forward checks half -> float -> half round trips.
    rng = np.random.default_rng(0)
    finfo = ml_dtypes.finfo(dtype)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, float(finfo.max), float(finfo.smallest_subnormal),
                        float(finfo.smallest_normal), -float(finfo.smallest_subnormal) * 3], dtype=np.float32)
    n = 20000
    values = rng.standard_normal(n).astype(np.float32) * np.float32(2.0) ** rng.integers(-26, 15, n).astype(np.float32)
    first = np.concatenate([special, special, values]).astype(dtype)
    second = np.concatenate([special, special[::-1], values[::-1]]).astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        # the kernels start their sums at +0, as torch does: -0 + -0 gives +0
        expected = ((np.float32(0) + first.astype(np.float32)) + second.astype(np.float32)).astype(dtype)
    dout = jnp.asarray(np.concatenate([first, second]))
    (dx,) = jax.vjp(lambda v: jk.repeat(v, (2,)), jnp.zeros(first.shape, dtype))[1](dout)
    got = np.asarray(dx)
    nan = np.isnan(expected.astype(np.float32))
    # float32 subnormals (bfloat16's subnormals are float32's) may flush to zero: XLA's CPU
    # threads run with flush-to-zero, as jnp does there; the GPU keeps them.
    tiny = np.abs(np.concatenate([first, second]).astype(np.float32)) < np.finfo(np.float32).smallest_normal
    flushed = (tiny[: len(first)] | tiny[len(first):]) & (got.astype(np.float32) == 0)
    exact = ~nan & ~flushed
    np.testing.assert_array_equal(got.view(np.uint16)[exact], expected.view(np.uint16)[exact])
    assert np.all(np.isnan(got.astype(np.float32)[nan]))
    np.testing.assert_array_equal(np.asarray(jk.repeat(dout, (1,))).view(np.uint16), np.asarray(dout).view(np.uint16))


def test_subnormal_handling_does_not_depend_on_the_thread():
    # Large enough to be split over the CPU pool: every chunk must treat float32 subnormals as
    # the calling thread does (XLA's CPU threads flush them; the GPU keeps them).
    x = jnp.full((1 << 21,), 1e-40, jnp.float32)
    out = np.asarray(jk.lerp(x, x, 0.25))
    assert np.all(out == out[0]), np.unique(out)


def test_eager_calls_reuse_compiled_executables(caplog):
    # Each op's core runs through jit: repeated eager calls (forward and gradient) must not
    # compile anything new, or every eager call would pay tens of milliseconds.
    x = jax.random.normal(jax.random.key(0), (2, 3, 12, 12))
    grid = jax.random.uniform(jax.random.key(1), (2, 5, 6, 2), minval=-1, maxval=1)
    boxes = jnp.array([[0, 1.0, 1.0, 9.0, 7.0]])
    w = jax.random.normal(jax.random.key(2), (4, 3, 3, 3))
    calls = [
        lambda: jk.conv2d(x, w, padding=1),
        lambda: jax.grad(lambda w: jk.conv2d(x, w, padding=1).sum())(w),
        lambda: jk.grid_sample(x, grid),
        lambda: jax.grad(lambda g: jk.grid_sample(x, g).sum())(grid),
        lambda: jk.roi_align(x, boxes, 3),
        lambda: jax.grad(lambda b: jk.roi_align(x, b, 3).sum())(boxes),
        lambda: jk.lerp(x, 2 * x, 0.3),
        lambda: jk.repeat(x, (1, 2, 1, 1)),
    ]
    for call in calls:
        jax.block_until_ready(call())
    compiled = []
    for call in calls:
        caplog.clear()
        with jax.log_compiles(), caplog.at_level("WARNING"):
            jax.block_until_ready(call())
        compiled += [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert not compiled, compiled


def test_an_exception_in_a_worker_chunk_is_a_clean_error(tmp_path):
    """A chunk of a threaded CPU loop that throws (here std::bad_alloc from a conv2d whose padded
    rows cannot be allocated) gives the caller a JaxRuntimeError, as a single thread does, with
    every chunk finished first: no terminate, no use of a destroyed task. Run in a subprocess
    with two threads, so that a crash fails this test and not the suite."""
    import os
    import subprocess
    import sys
    script = tmp_path / "throw.py"
    script.write_text(
        "import jax.numpy as jnp, jax_kernels as jk\n"
        "x, w = jnp.ones((64, 8, 32, 4)), jnp.ones((8, 8, 1, 2))\n"
        "p = 10 ** 12\n"
        "try:\n"
        "    print('ok', jk.conv2d(x, w, padding=(0, p), dilation=(1, 2 * p)).shape)\n"
        "except Exception as error:\n"
        "    print('error', type(error).__name__, error)\n")
    env = dict(os.environ, JAX_KERNELS_NUM_THREADS="2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(jk.__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("ok") or last.startswith("error JaxRuntimeError"), last


def test_source_tree_without_native_module_says_so():
    """Importing the package when its native module cannot be imported (the source tree next to
    a non-editable install) names the missing module and what to do, not a circular import."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['jax_kernels._cpu'] = None  # as if it were not built\n"
            "import jax_kernels\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "jax_kernels._cpu is not built" in result.stderr
    assert "circular import" not in result.stderr.splitlines()[-1]


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="CUDA command buffers need a GPU")
def test_cuda_handlers_in_command_buffers(tmp_path):
    """Every CUDA handler is declared command-buffer compatible: with XLA capturing custom calls
    into CUDA graphs (even single ones), a jitted step over every op, run three times, gives the
    bits it gives without command buffers (in this process). Its strided conv's input gradient
    runs by stride phase on Hopper, spread over side streams forked off XLA's (captured as graph
    edges)."""
    import os
    import pathlib
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import sys, numpy as np, jax, jax.numpy as jnp\n"
        "import jax_kernels as jk\n"
        "def step(x, w, grid, boxes, x8, w8):\n"
        "    def loss(x, w, grid, boxes, x8, w8):\n"
        "        h = jk.conv2d(x, w, padding=1)\n"
        "        h = jk.lerp(jk.grid_sample(h, grid), jk.repeat(h[:, :1, :8, :8], (1, 4, 1, 1)), 0.3)\n"
        "        strided = jk.conv2d(x8, w8, stride=2, padding=1)\n"
        "        return (jk.roi_align(h, boxes, 2, sampling_ratio=2) ** 2).sum() + (strided ** 2).sum()\n"
        "    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))(x, w, grid, boxes, x8, w8)\n"
        "k = jax.random.split(jax.random.key(0), 5)\n"
        "x = jax.random.normal(k[0], (2, 3, 16, 16))\n"
        "w = jax.random.normal(k[1], (4, 3, 3, 3))\n"
        "grid = jax.random.uniform(k[2], (2, 8, 8, 2), minval=-1, maxval=1)\n"
        "boxes = jnp.array([[0, 1.0, 1.0, 6.0, 5.0], [1, 0.5, 2.0, 7.0, 7.0]])\n"
        "x8 = jax.random.normal(k[3], (2, 16, 12, 12))\n"
        "w8 = jax.random.normal(k[4], (16, 16, 3, 3))\n"
        "f = jax.jit(step)\n"
        "runs = [[np.asarray(g) for g in f(x, w, grid, boxes, x8, w8)] for _ in range(3)]\n"
        "np.savez(sys.argv[1], *runs[0], *runs[1], *runs[2])\n")
    outputs = {}
    for name, flags in [("plain", "--xla_gpu_enable_command_buffer="),
                        ("graphs", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                                   "--xla_gpu_graph_min_graph_size=1")]:
        env = dict(os.environ, XLA_FLAGS=flags,
                   PYTHONPATH=str(pathlib.Path(jk.__file__).resolve().parent.parent))
        result = subprocess.run([sys.executable, str(script), str(tmp_path / f"{name}.npz")],
                                capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        outputs[name] = np.load(tmp_path / f"{name}.npz")
    plain, graphs = outputs["plain"], outputs["graphs"]
    for key in plain.files:
        np.testing.assert_array_equal(graphs[key], plain[key])


def test_cpu_lowering_never_traces_the_cuda_branch(monkeypatch):
    """A CUDA scratch query may refuse a problem only the CUDA kernels cannot take (their sort
    limits). A program lowered for the CPU alone must not ask it: where the CUDA module was
    built, every lowering traced the CUDA branch too and raised for CPU programs. Lowered for
    both platforms (jax.export), the CUDA branch is still traced and its refusal raised."""
    asked = []

    def refusing_query(name, platform="cuda", **arguments):
        asked.append(name)
        raise ValueError("a CUDA-only limit")

    monkeypatch.setattr(_ffi, "CUDA_BUILT", True)
    monkeypatch.setattr(_ffi, "query", refusing_query)
    x = jnp.ones((1, 2, 8, 8))
    boxes = jnp.array([[0, 1.0, 1.0, 5.0, 5.0]])
    grid = jnp.zeros((1, 3, 3, 2))

    def f(x, boxes, grid):
        pooled = jax.grad(lambda x: jk.roi_align(x, boxes, 2).sum())(x)
        sampled = jax.grad(lambda x: jk.grid_sample(x, grid).sum())(x)
        return pooled + sampled + jk.conv2d(x, jnp.ones((2, 2, 3, 3)), padding=1)

    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(a, cpu) for a in (x, boxes, grid)]
    expected = jax.jit(f).lower(*args).compile()(*args)
    assert asked == [] and expected.shape == x.shape
    with pytest.raises(ValueError, match="a CUDA-only limit"):
        jax.export.export(jax.jit(f), platforms=("cpu", "cuda"))(*args)
    assert asked
