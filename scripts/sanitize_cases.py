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
    # roi_align: boxes inside, outside, reversed, degenerate, NaN, huge and with invalid batch
    # indices; fixed and adaptive grids, both input-gradient paths, a vmap, no boxes.
    x = rand(2, 5, 9, 11, dtype=dtype)
    boxes = jnp.asarray([[0, 1.5, 2.0, 7.5, 6.0], [1, -4.0, -3.0, 20.0, 15.0],
                         [0, 6.0, 5.0, 2.0, 1.0], [1, 3.0, 3.0, 3.0, 3.0], [0, np.nan, 1, 5, 5],
                         [1, -1e30, 2, 1e30, 3], [2, 1, 1, 5, 5], [-1, 1, 1, 5, 5],
                         [0.5, 1, 1, 5, 5]]).astype(dtype)
    for sampling_ratio, aligned, deterministic in ((2, False, True), (-1, True, True), (-1, False, False)):
        op = lambda x, b: jk.roi_align(x, b, (3, 2), 0.9, sampling_ratio, aligned,
                                       deterministic=deterministic).astype(jnp.float32)
        grad = jax.grad(lambda x, b: jnp.sum(op(x, b)), argnums=(0, 1))
        jax.block_until_ready(grad(x, boxes))
        jax.block_until_ready(jax.vmap(grad)(jnp.stack([x, -x]), jnp.stack([boxes, boxes])))
    no_boxes = lambda x: jnp.sum(jk.roi_align(x, boxes[:0], 3).astype(jnp.float32))
    jax.block_until_ready(jax.grad(no_boxes)(x))
print("sanitize cases ran")
