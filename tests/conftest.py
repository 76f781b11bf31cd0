"""pytest configuration: 8 CPU devices (the sharding tests; set before jax starts, unless
XLA_FLAGS already asks for a count) and float64 enabled for every test (gradient checks and
oracles need it)."""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
