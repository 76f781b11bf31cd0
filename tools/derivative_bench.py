"""Derivative timings, in-jit (one compiled program per case, 10 calls on distinct inputs inside
it), median over rounds:

- first order: the forward + reverse-mode gradient of every op, and a jitted training step
  that uses all five ops; used to show that a change of the differentiation machinery leaves
  first-order speed alone (run it once per build or Python tree, in the same session);
- second order ("2nd ..." cases): Hessian-vector products and a gradient penalty, next to the
  same computation written with ``jnp`` gathers / ``lax.conv`` (the "peer" cases).

    python tools/derivative_bench.py [--rounds 15] [--json FILE] [--label NAME] [--only TEXT]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_kernels as jk
from jax_kernels.bench import jnp_grid_sample_bilinear, roi_align_gather

CALLS = 10  # calls per compiled program, on distinct inputs


def rand(seed, shape, low=-1.0, high=1.0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).uniform(low, high, size=shape), dtype)


def stacked(seed, shape, **kw):
    return rand(seed, (CALLS,) + tuple(shape), **kw)


def smooth_grid(seed, n, ho, wo):
    theta = np.tile(np.array([[0.9, 0.1, 0.05], [-0.1, 0.95, -0.05]]), (n, 1, 1))
    theta += np.random.default_rng(seed).uniform(-0.05, 0.05, theta.shape)
    ys, xs = np.meshgrid(np.linspace(-1, 1, ho), np.linspace(-1, 1, wo), indexing="ij")
    base = np.stack([xs, ys, np.ones_like(xs)], -1)
    return np.einsum("hwk,njk->nhwj", base, theta).astype(np.float32)


def boxes(seed, count, images, height, width):
    rng = np.random.default_rng(seed)
    x1, y1 = rng.uniform(0, width * 0.7, count), rng.uniform(0, height * 0.7, count)
    w, h = rng.uniform(8, width * 0.3, count), rng.uniform(8, height * 0.3, count)
    b = rng.integers(0, images, count)
    return np.stack([b, x1, y1, x1 + w, y1 + h], 1).astype(np.float32)


def in_jit(loss, *batched):
    """A program computing value and gradients of `loss` for CALLS distinct inputs."""
    grad = jax.value_and_grad(loss, argnums=tuple(range(len(batched))))

    @jax.jit
    def program(*args):
        def body(carry, xs):
            value, grads = grad(*xs)
            return carry + value + sum(jnp.sum(g) for g in grads) * 0, None
        return jax.lax.scan(body, jnp.zeros((), jnp.float32), args)[0]

    return functools.partial(program, *batched)


def scanned(fn, *batched):
    """A program applying `fn` to CALLS distinct inputs (a scan), summing its outputs."""

    @jax.jit
    def program(*args):
        def body(carry, xs):
            out = fn(*xs)
            return carry + sum(jnp.sum(o).astype(jnp.float32) for o in jax.tree.leaves(out)), None
        return jax.lax.scan(body, jnp.zeros((), jnp.float32), args)[0]

    return functools.partial(program, *batched)


def hvp(loss):
    """Forward over reverse: the Hessian-vector product of `loss` at x along v."""
    return lambda x, v, *rest: jax.jvp(lambda x: jax.grad(loss)(x, *rest), (x,), (v,))[1]


def second_order_cases():
    def grid_hvp(sample):
        def make():
            x = stacked(20, (32, 64, 64, 64))
            g = jnp.asarray(np.stack([smooth_grid(i, 32, 64, 64) for i in range(CALLS)]))
            target = stacked(21, (32, 64, 64, 64))
            loss = lambda g, x, t: jnp.sum((sample(x, g) - t) ** 2)
            return scanned(hvp(loss), g, stacked(22, g.shape[1:]) * 0.01, x, target)
        return make

    def roi_hvp(pool):
        def make():
            x = stacked(23, (2, 256, 200, 272))
            b = jnp.asarray(np.stack([boxes(i, 512, 2, 800, 1088) for i in range(CALLS)]))
            target = stacked(24, (512, 256, 7, 7))
            loss = lambda b, x, t: jnp.sum((pool(x, b) - t) ** 2)
            return scanned(hvp(loss), b, stacked(25, b.shape[1:]), x, target)
        return make

    def penalty(conv):
        def make():
            # Weights are operands, not constants, so that XLA cannot fold a convolution of the
            # peer at compile time.
            x = stacked(26, (32, 64, 56, 56))
            w1, w2 = stacked(27, (64, 64, 3, 3)) * 0.05, stacked(28, (64, 64, 3, 3)) * 0.05

            def critic(w, x):
                return jnp.sum(conv(jax.nn.softplus(conv(x, w[0])), w[1]))

            def gp(w, x):
                g = jax.grad(critic, argnums=1)(w, x)
                return jnp.mean((jnp.sqrt(jnp.sum(g ** 2, axis=(1, 2, 3))) - 1.0) ** 2)

            return scanned(lambda x, w1, w2: jax.grad(gp)((w1, w2), x), x, w1, w2)
        return make

    ours_conv = lambda x, w: jk.conv2d(x, w, padding=1)
    lax_conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)))
    return {
        "2nd grid_sample HVP along the grid N32 C64 64^2": grid_hvp(jk.grid_sample),
        "2nd grid_sample HVP along the grid, jnp gathers (peer)": grid_hvp(
            jnp_grid_sample_bilinear),
        "2nd roi_align HVP along the boxes, 512 boxes 7x7": roi_hvp(
            lambda x, b: jk.roi_align(x, b, 7, 0.25, 2, True)),
        "2nd roi_align HVP along the boxes, jnp gathers (peer)": roi_hvp(
            lambda x, b: roi_align_gather(x, b, (7, 7), 0.25, 2, True)),
        "2nd conv2d gradient penalty, 2 layers 3x3 64->64 N32 56^2": penalty(ours_conv),
        "2nd conv2d gradient penalty, lax.conv (peer)": penalty(lax_conv),
    }


def cases():
    """{name: factory of a zero-argument timed function} (inputs are built when timed)."""

    def grid_case():
        x = stacked(0, (32, 64, 64, 64))
        g = jnp.asarray(np.stack([smooth_grid(i, 32, 64, 64) for i in range(CALLS)]))
        return in_jit(lambda x, g: jnp.sum(jk.grid_sample(x, g) ** 2), x, g)

    def roi_case():
        x = stacked(1, (2, 256, 200, 272))
        b = jnp.asarray(np.stack([boxes(i, 512, 2, 800, 1088) for i in range(CALLS)]))
        return in_jit(lambda x, b: jnp.sum(jk.roi_align(x, b, 7, 0.25, 2, True) ** 2), x, b)

    def conv_case(dtype):
        x = stacked(2, (32, 64, 56, 56), dtype=dtype)
        w = stacked(3, (64, 64, 3, 3), dtype=dtype)
        return in_jit(lambda x, w: jnp.sum(jk.conv2d(x, w, padding=1).astype(jnp.float32) ** 2),
                      x, w)

    def depthwise_case():
        x, w = stacked(4, (32, 96, 28, 28)), stacked(5, (96, 1, 7, 7))
        return in_jit(lambda x, w: jnp.sum(jk.conv2d(x, w, padding=3, groups=96) ** 2), x, w)

    def lerp_case():
        a, e, t = stacked(6, (4096, 1024)), stacked(7, (4096, 1024)), stacked(8, (1, 1024))
        return in_jit(lambda a, e, t: jnp.sum(jk.lerp(a, e, t) ** 2), a, e, t)

    def repeat_case():
        return in_jit(lambda x: jnp.sum(jk.repeat(x, (4, 2)) ** 2), stacked(9, (256, 1024)))

    return {
        "grid_sample bilinear N32 C64 64^2 fwd+bwd": grid_case,
        "roi_align N2 C256 200x272 512 boxes 7x7 fwd+bwd": roi_case,
        "conv2d 3x3 64->64 N32 56^2 f32 fwd+bwd": lambda: conv_case(jnp.float32),
        "conv2d 3x3 64->64 N32 56^2 bf16 fwd+bwd": lambda: conv_case(jnp.bfloat16),
        "conv2d depthwise 7x7 C96 N32 28^2 fwd+bwd": depthwise_case,
        "lerp 4096x1024 broadcast weight fwd+bwd": lerp_case,
        "repeat 256x1024 by (4, 2) fwd+bwd": repeat_case,
        "training step (every op)": training_step,
        **second_order_cases(),
    }


def training_step():
    """One SGD step of a small detector-style model that uses every op, with an EMA (lerp) of
    the parameters: spatial transformer (conv -> affine grid -> grid_sample), depthwise +
    pointwise trunk, roi_align head, repeat of per-class biases."""
    n, classes = 32, 10
    images = stacked(10, (n, 3, 64, 64))
    labels = jnp.asarray(np.random.default_rng(11).integers(0, classes, (CALLS, n, 4)))
    rois = jnp.asarray(np.stack([boxes(i, n * 4, n, 64, 64) * np.array([1, 1, 1, 1, 1],
                                 np.float32) for i in range(CALLS)]))
    rois = rois.at[..., 0].set(jnp.repeat(jnp.arange(n, dtype=jnp.float32), 4)[None])
    params = {
        "loc_w": rand(12, (8, 3, 5, 5)) * 0.1, "loc_b": jnp.zeros(8),
        "loc_fc": rand(13, (8, 6)) * 0.01,
        "dw": rand(14, (3, 1, 3, 3)) * 0.3, "pw": rand(15, (32, 3, 1, 1)) * 0.3,
        "c2": rand(16, (32, 32, 3, 3)) * 0.05, "head": rand(17, (32 * 4, classes)) * 0.05,
        "class_b": jnp.zeros((1, classes)),
    }

    def forward(p, x, rois):
        h = jax.nn.relu(jk.conv2d(x, p["loc_w"], p["loc_b"], stride=4, padding=2))
        theta = (h.mean(axis=(2, 3)) @ p["loc_fc"]).reshape(-1, 2, 3) + jnp.asarray(
            [[1.0, 0, 0], [0, 1.0, 0]])
        ys, xs = jnp.meshgrid(jnp.linspace(-1, 1, 64), jnp.linspace(-1, 1, 64), indexing="ij")
        base = jnp.stack([xs, ys, jnp.ones_like(xs)], -1)
        grid = jnp.einsum("hwk,njk->nhwj", base, theta)
        x = jk.grid_sample(x, grid, align_corners=False)
        x = jk.conv2d(x, p["dw"], padding=1, groups=3)
        x = jax.nn.relu(jk.conv2d(x, p["pw"]))
        x = jax.nn.relu(jk.conv2d(x, p["c2"], padding=1))
        pooled = jk.roi_align(x, rois, 2, 1.0, 2, True)
        logits = pooled.reshape(pooled.shape[0], -1) @ p["head"]
        return logits + jk.repeat(p["class_b"], (pooled.shape[0], 1))

    def loss(p, x, rois, labels):
        logits = forward(p, x, rois)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                             labels.reshape(-1, 1), axis=1))

    @jax.jit
    def program(params, ema, images, rois, labels):
        def step(state, batch):
            p, e = state
            value, grads = jax.value_and_grad(loss)(p, *batch)
            p = jax.tree.map(lambda a, g: a - 0.05 * g, p, grads)
            e = jax.tree.map(lambda a, b: jk.lerp(a, b, 0.01), e, p)
            return (p, e), value
        return jax.lax.scan(step, (params, ema), (images, rois, labels))[1]

    return functools.partial(program, params, params, images, rois, labels)



def compiled_text(fn) -> str:
    """The optimized HLO of a case's program with names, metadata and ids taken out, so that two
    trees' programs can be compared (`--hlo DIR`)."""
    text = fn.func.lower(*fn.args).compile().as_text()
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.\-]+", "%_", text)
    return "\n".join(line for line in text.split("\n")
                     if " = " in line and "_id=" not in line and not line.startswith("HloModule"))


def time_case(fn, rounds):
    jax.block_until_ready(fn())  # compile and warm up
    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) / CALLS * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--label", default="")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--first-order", action="store_true", help="skip the second-order cases")
    parser.add_argument("--hlo", default=None, help="write each case's optimized HLO to this "
                        "directory instead of timing it")
    args = parser.parse_args()
    results = {}
    for name, factory in cases().items():
        if args.only not in name or (args.first_order and name.startswith("2nd")):
            continue
        if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            with open(os.path.join(args.hlo, re.sub(r"\W+", "_", name) + ".txt"), "w") as f:
                f.write(compiled_text(factory()))
            continue
        try:
            results[name] = time_case(factory(), args.rounds)
        except Exception as error:  # a case that cannot run here is reported, not fatal
            print(f"{args.label:8s} {name:55s} failed: {type(error).__name__}: {error}"[:300])
            continue
        print(f"{args.label:8s} {name:55s} {results[name]:9.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "device": str(jax.devices()[0]),
                       "jax": jax.__version__, "ms_per_call": results}, f, indent=1)


if __name__ == "__main__":
    main()
