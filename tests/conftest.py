"""pytest configuration: 8 CPU devices (the sharding tests; set before jax starts, unless
XLA_FLAGS already asks for a count) and float64 enabled for every test (gradient checks and
oracles need it). Under pytest-xdist (`pytest -n 2`, the README's command) each worker
allocates GPU memory as it needs it rather than taking 75% of the GPU up front, so that the
workers share one GPU (unless XLA_PYTHON_CLIENT_PREALLOCATE is set)."""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
