"""pytest configuration: float64 enabled for every test (gradient checks and oracles need it)."""

import jax

jax.config.update("jax_enable_x64", True)
