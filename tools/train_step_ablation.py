"""Which op makes the benchmark's training step (jax_kernels.bench, case train_step) faster or
slower than the pure-JAX step: the jax_kernels step with one op at a time replaced by its pure-JAX
form (lax.conv, the jnp gathers, jnp.tile, the jnp lerp), the convolutions split into depthwise
and the others. Per-dispatch milliseconds of the jitted step, the best of a few rounds. Then each convolution
of the model alone (forward + both gradients, jitted), jax_kernels against lax.conv.

    python tools/train_step_ablation.py [--dtype bfloat16] [--size gpu|cpu|quick]
"""

import argparse
import time

import jax
import jax.numpy as jnp

from jax_kernels import bench


def timed(step, args, calls=30, rounds=5):
    out = step(*args)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = step(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--size", default="gpu" if jax.default_backend() == "gpu" else "cpu")
    a = parser.parse_args()
    dtype = jnp.dtype(a.dtype)
    model, batch, side = bench.TRAIN_SIZES[a.size]
    params = bench.train_init(model, dtype)
    images, boxes, labels = bench.train_data(model, batch, side, dtype)
    jk_ops, jnp_ops = bench.TRAIN_OPS["jax_kernels"], bench.TRAIN_OPS["pure JAX"]

    def conv_split(depthwise, others):
        def conv(x, w, b=None, stride=1, padding=0, groups=1):
            f = depthwise if groups > 1 else others
            return f(x, w, b, stride=stride, padding=padding, groups=groups)
        return conv

    variants = {"jax_kernels": jk_ops, "pure JAX": jnp_ops}
    for key in jk_ops:
        variants[f"jax_kernels, {key} from JAX"] = {**jk_ops, key: jnp_ops[key]}
    variants["jax_kernels, depthwise conv from JAX"] = {
        **jk_ops, "conv": conv_split(jnp_ops["conv"], jk_ops["conv"])}
    variants["jax_kernels, other convs from JAX"] = {
        **jk_ops, "conv": conv_split(jk_ops["conv"], jnp_ops["conv"])}
    variants["pure JAX, depthwise conv from jax_kernels"] = {
        **jnp_ops, "conv": conv_split(jk_ops["conv"], jnp_ops["conv"])}

    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {a.size} size "
          f"(batch {batch}, side {side}, channels {model.channels}), {dtype.name}")
    base = None
    for name, ops in variants.items():
        step = jax.jit(bench.train_step(ops, model))
        ms = timed(step, (params, params, images, boxes, labels))
        base = base or ms
        print(f"{name:48s} {ms:8.4f} ms  {ms / base:5.2f} x jax_kernels", flush=True)

    # The model's convolutions: (name, input shape, weight shape, stride, padding, groups).
    c, s2 = model.channels, side // 2
    convs = [("loc 5x5 s4", (batch, 3, side, side), (model.loc_channels, 3, 5, 5), 4, 2, 1),
             ("stem 3x3 s2", (batch, 3, side, side), (c, 3, 3, 3), 2, 1, 1),
             ("depthwise", (batch, c, s2, s2), (c, 1, model.kernel, model.kernel), 1,
              model.kernel // 2, c),
             ("pointwise in", (batch, c, s2, s2), (2 * c, c, 1, 1), 1, 0, 1),
             ("pointwise out", (batch, 2 * c, s2, s2), (c, 2 * c, 1, 1), 1, 0, 1)]
    key = jax.random.key(1)
    for name, xs, ws, stride, pad, groups in convs:
        x = jax.random.normal(key, xs, jnp.float32).astype(dtype)
        w = jax.random.normal(key, ws, jnp.float32).astype(dtype)
        row = []
        for label, conv in (("jax_kernels", jk_ops["conv"]), ("lax.conv", jnp_ops["conv"])):
            f = lambda x, w, conv=conv: jnp.sum(
                conv(x, w, stride=stride, padding=pad, groups=groups).astype(jnp.float32) ** 2)
            step = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
            row.append(f"{label} {timed(step, (x, w)):7.4f} ms")
        print(f"conv {name:14s} x{list(xs)} w{list(ws)}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
