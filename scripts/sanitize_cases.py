"""Small forward + backward cases of every op, for compute-sanitizer memcheck on the GPU
(scripts/gpu_check.sh). Shapes are odd on purpose: tails, broadcasts, zero repeats."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_kernels as jk

jax.config.update("jax_enable_x64", True)
rng = np.random.default_rng(0)


def rand(*shape, dtype=jnp.float32):
    return jnp.asarray(rng.uniform(-1, 1, size=shape)).astype(dtype)


for dtype in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
    a, b, w = rand(3, 37, dtype=dtype), rand(37, dtype=dtype), rand(3, 1, dtype=dtype)
    jax.block_until_ready(jax.grad(lambda a, b, w: jnp.sum(jk.lerp(a, b, w).astype(jnp.float32)), argnums=(0, 1, 2))(a, b, w))
    jax.block_until_ready(jax.grad(lambda a, b: jnp.sum(jk.lerp(a, b, 0.7).astype(jnp.float32)), argnums=(0, 1))(a, a))
    for shape, repeats in (((5, 7), (3, 2)), ((2, 3), (0, 2)), ((1, 1), (40, 70)), ((3,), (2, 1, 2)), ((64, 64), (2, 2))):
        x = rand(*shape, dtype=dtype)
        jax.block_until_ready(jax.grad(lambda v: jnp.sum(jk.repeat(v, repeats).astype(jnp.float32)))(x))
print("sanitize cases ran")
