"""``python -m jax_kernels.demo``: a small, real program on jax_kernels.

Fits a coarse 8x8 image whose nearest-neighbour upsampling (``repeat``) best matches a 64x64
target, by gradient descent in a jitted, differentiated step, and keeps an exponential moving
average of the parameters with ``lerp``. The optimum is known in closed form (the mean of each
8x8 block), so the program checks itself and prints how close it got.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kernels as jk

SIDE, FACTOR = 8, 8


def make_target(seed: int = 0) -> jax.Array:
    """A 64x64 test image: a smooth blob plus noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIDE * FACTOR, 0:SIDE * FACTOR] / (SIDE * FACTOR)
    blob = np.exp(-((x - 0.4) ** 2 + (y - 0.6) ** 2) / 0.05)
    return jnp.asarray(blob + 0.1 * rng.standard_normal(blob.shape), jnp.float32)


def loss(coarse: jax.Array, target: jax.Array) -> jax.Array:
    upsampled = jk.repeat(coarse[:, None, :, None], (1, FACTOR, 1, FACTOR)).reshape(target.shape)
    return jnp.mean((upsampled - target) ** 2)


@jax.jit
def step(coarse, average, target, learning_rate):
    value, grad = jax.value_and_grad(loss)(coarse, target)
    coarse = coarse - learning_rate * grad
    average = jk.lerp(average, coarse, 0.1)  # EMA: average += 0.1 * (coarse - average)
    return coarse, average, value


def main() -> None:
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    target = make_target()
    coarse = jnp.zeros((SIDE, SIDE), jnp.float32)
    average = coarse
    # Each coarse pixel gets the gradient of FACTOR^2 of the mean's terms: this rate converges.
    learning_rate = jnp.float32(0.5 * SIDE * SIDE)
    start = time.perf_counter()
    for i in range(200):
        coarse, average, value = step(coarse, average, target, learning_rate)
        if i % 40 == 0:
            print(f"step {i:3d}  loss {float(value):.6f}")
    jax.block_until_ready(average)
    elapsed = time.perf_counter() - start
    optimum = target.reshape(SIDE, FACTOR, SIDE, FACTOR).mean(axis=(1, 3))
    best = float(loss(optimum, target))
    error = float(jnp.max(jnp.abs(coarse - optimum)))
    ema_error = float(jnp.max(jnp.abs(average - optimum)))
    print(f"final loss {float(loss(coarse, target)):.6f} (closed-form optimum {best:.6f})")
    print(f"max |coarse - block means| = {error:.2e}; EMA of the iterates: {ema_error:.2e}")
    print(f"200 jitted steps in {elapsed * 1e3:.1f} ms")
    if error > 1e-4:
        raise SystemExit("demo: did not converge to the block means")
    print("ok")


if __name__ == "__main__":
    main()
