"""jax.export: programs using the ops serialize with ``disabled_export_checks()`` and run in a
fresh process after ``import jax_kernels``; the targets carry their version."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_kernels as jk
from jax_kernels import _ffi
from jk_testing import custom_call_targets, random


def _every_op(x, w, grid, boxes, a):
    """A value and gradients through every op (forward and backward targets)."""
    def loss(x, w, grid, boxes, a):
        h = jk.conv2d(x, w, padding=1, groups=2)
        h = jk.grid_sample(h, grid, mode="bicubic") + jk.grid_sample(h, grid)
        pooled = jk.roi_align(h, boxes, 2, sampling_ratio=2)
        y = jk.lerp(pooled, jk.repeat(a, (boxes.shape[0], 1, 1, 1)), 0.25)
        return (y ** 2).sum()
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(x, w, grid, boxes, a)


def _arguments():
    return (random(0, (2, 4, 7, 8), jnp.float32), random(1, (4, 2, 3, 3), jnp.float32),
            random(2, (2, 5, 6, 2), jnp.float32, -1.1, 1.1),
            jnp.asarray([[0, 1.0, 1.5, 4.0, 3.5], [1, 0.5, 0.0, 5.0, 4.0]], jnp.float32),
            random(3, (1, 4, 2, 2), jnp.float32))


def test_targets_are_versioned():
    names = _ffi.targets()
    assert names and all(name.endswith(f"_v{_ffi.TARGET_VERSION}") for name in names)
    checks = jk.disabled_export_checks()
    assert len(checks) == len(names)
    assert checks == [export.DisabledSafetyCheck.custom_call(n) for n in names]


def test_export_needs_the_disabled_checks():
    with pytest.raises(ValueError, match="custom calls"):
        export.export(jax.jit(_every_op))(*_arguments())


def test_exported_program_runs_in_a_fresh_process(tmp_path):
    args = _arguments()
    exported = export.export(jax.jit(_every_op),
                             disabled_checks=jk.disabled_export_checks())(*args)
    called = set(custom_call_targets(exported.mlir_module()))
    assert called and called <= set(_ffi.targets()), called
    (tmp_path / "program.bin").write_bytes(exported.serialize())
    np.savez(tmp_path / "args.npz", *[np.asarray(a) for a in args])
    expected = jax.tree.leaves(_every_op(*args))

    script = tmp_path / "run.py"
    script.write_text(
        "import sys, numpy as np, jax\n"
        "from jax import export\n"
        "import jax_kernels  # registers the targets\n"
        "program = export.deserialize(open(sys.argv[1], 'rb').read())\n"
        "data = np.load(sys.argv[2])\n"
        "out = program.call(*[data[f'arr_{i}'] for i in range(len(data.files))])\n"
        "np.savez(sys.argv[3], *[np.asarray(x) for x in jax.tree.leaves(out)])\n")
    package_root = str(pathlib.Path(jk.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "program.bin"),
                             str(tmp_path / "args.npz"), str(tmp_path / "out.npz")],
                            capture_output=True, text=True, timeout=300, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = np.load(tmp_path / "out.npz")
    assert len(out.files) == len(expected)
    for i, e in enumerate(expected):
        np.testing.assert_array_equal(out[f"arr_{i}"], np.asarray(e))


def test_export_of_a_sharded_program():
    """A program exported for 8 devices runs with its shardings; exported ops are partitioned
    by XLA's default (the partitioning rules' callbacks cannot be serialized: docs/scaling.md)."""
    try:
        devices = jax.devices("cpu")
    except RuntimeError:  # JAX_PLATFORMS without cpu
        devices = []
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices")
    mesh = jax.sharding.Mesh(np.array(devices[:8]), ("batch",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = random(0, (8, 2, 6, 6), jnp.float64)
    w = random(1, (3, 2, 3, 3), jnp.float64)
    f = jax.jit(lambda x, w: jk.lerp(jk.conv2d(x, w, padding=1), 0 * x[:, :1], 0.5),
                in_shardings=(sharded, replicated))
    exported = export.export(f, platforms=("cpu",),
                             disabled_checks=jk.disabled_export_checks())(x, w)
    restored = export.deserialize(exported.serialize())
    y = restored.call(jax.device_put(x, sharded), jax.device_put(w, replicated))
    cpu = devices[0]  # the same CPU kernels on one device
    expected = 0.5 * jk.conv2d(jax.device_put(x, cpu), jax.device_put(w, cpu), padding=1)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
