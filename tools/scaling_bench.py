"""Data-parallel scaling of a jitted training step over every op, next to the same model in pure
JAX (lax.conv, jnp gathers), at a fixed per-device batch on 1, 2, 4, ... devices.

    python tools/scaling_bench.py [--devices 1,2,4,8] [--per-device-batch N] [--tests]
                                  [--json FILE] [--platform cpu|gpu]

Uses the accelerators of the default backend; ``--platform cpu`` forces 8 CPU devices (the
XLA flag is set before jax starts; on a 2-core machine the timings say nothing about scaling,
the collectives do). For each device count: the batch sharded over a mesh of the first devices,
the weights replicated; the step's median time over rounds, the weak-scaling efficiency
t(1) / t(d), and the collectives of the compiled program (kind, shape, count).
``--tests`` first runs the sharding tests (tests/test_sharding.py) on these devices.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

if "--platform" in sys.argv and sys.argv[sys.argv.index("--platform") + 1] == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_kernels as jk  # noqa: E402
from jax_kernels.bench import jnp_grid_sample_bilinear, roi_align_gather  # noqa: E402

CHANNELS, CLASSES, BOXES_PER_IMAGE, POOL = 32, 10, 4, 4


def _jnp_conv(x, w, b=None, padding=0, groups=1):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), [(padding, padding)] * 2,
                                     feature_group_count=groups,
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y if b is None else y + b[:, None, None]


OPS = {
    "jax_kernels": dict(
        conv=lambda x, w, b=None, padding=0, groups=1: jk.conv2d(x, w, b, padding=padding,
                                                                  groups=groups),
        sample=lambda x, g: jk.grid_sample(x, g),
        tile=lambda x: jk.repeat(x, (1, 2, 1, 1)),
        pool=lambda x, b: jk.roi_align(x, b, POOL, spatial_scale=1.0, sampling_ratio=2),
        lerp=lambda e, p, w: jk.lerp(e, p, w)),
    "pure JAX": dict(
        conv=_jnp_conv,
        sample=jnp_grid_sample_bilinear,
        tile=lambda x: jnp.tile(x, (1, 2, 1, 1)),
        pool=lambda x, b: roi_align_gather(x, b, (POOL, POOL), 1.0, 2, False),
        lerp=lambda e, p, w: e + w * (p - e)),
}


def init(key):
    k = jax.random.split(key, 5)
    c = CHANNELS
    return {
        "stem": 0.3 * jax.random.normal(k[0], (c, 3, 3, 3)), "stem_b": jnp.zeros(c),
        "dw": 0.3 * jax.random.normal(k[1], (c, 1, 3, 3)),
        "loc": 0.01 * jax.random.normal(k[2], (c, 6)),
        "pw": 0.1 * jax.random.normal(k[3], (c, 2 * c, 1, 1)),
        "head": 0.05 * jax.random.normal(k[4], (c * POOL * POOL, CLASSES)),
    }


def make_step(ops):
    def loss(params, images, boxes, labels):
        h = jax.nn.relu(ops["conv"](images, params["stem"], params["stem_b"], padding=1))
        h = ops["conv"](h, params["dw"], padding=1, groups=CHANNELS)
        theta = jnp.eye(2, 3) + (h.mean(axis=(2, 3)) @ params["loc"]).reshape(-1, 2, 3)
        h = ops["sample"](h, jk.affine_grid(theta, h.shape))
        h = ops["conv"](ops["tile"](h), params["pw"])
        pooled = ops["pool"](h, boxes)
        logits = pooled.reshape(pooled.shape[0], -1) @ params["head"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    def step(params, ema, images, boxes, labels):
        value, grads = jax.value_and_grad(loss)(params, images, boxes, labels)
        params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
        ema = jax.tree.map(lambda e, p: ops["lerp"](e, p, 0.01), ema, params)
        return params, ema, value

    return step


def data(batch: int, side: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    images = jnp.asarray(rng.standard_normal((batch, 3, side, side)), jnp.float32)
    k = batch * BOXES_PER_IMAGE
    x1 = rng.uniform(0, side * 0.6, k)
    y1 = rng.uniform(0, side * 0.6, k)
    boxes = np.stack([np.repeat(np.arange(batch), BOXES_PER_IMAGE), x1, y1,
                      x1 + rng.uniform(4, side * 0.4, k), y1 + rng.uniform(4, side * 0.4, k)], 1)
    labels = jnp.asarray(rng.integers(0, CLASSES, k))
    return images, jnp.asarray(boxes, jnp.float32), labels


_COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)(?:-start)?\(")


def collectives(text: str) -> dict[str, int]:
    found = collections.Counter()
    for types, kind in _COLLECTIVE.findall(text):
        for shape in re.findall(r"\w+\[[\d,]*\]", types):
            found[f"{kind} {shape}"] += 1
    return dict(found)


def measure(step, args, rounds: int) -> float:
    out = step(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default=None, help="comma-separated device counts")
    parser.add_argument("--per-device-batch", type=int, default=None)
    parser.add_argument("--side", type=int, default=None, help="image side")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default=None)
    parser.add_argument("--tests", action="store_true", help="run tests/test_sharding.py first")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    devices = jax.devices()
    gpu = devices[0].platform != "cpu"
    per_device = args.per_device_batch or (32 if gpu else 2)
    side = args.side or (64 if gpu else 24)
    counts = ([int(c) for c in args.devices.split(",")] if args.devices else
              [c for c in (1, 2, 4, 8) if c <= len(devices)])
    print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}; per-device batch "
          f"{per_device}, images 3x{side}x{side}, {BOXES_PER_IMAGE} boxes per image")

    if args.tests:
        env = dict(os.environ)
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/test_sharding.py"],
                             env=env)
        print(f"sharding tests: exit code {rc}")

    results = []
    for name, ops in OPS.items():
        step = make_step(ops)
        base = None
        for count in counts:
            if count > len(devices):
                continue
            mesh = Mesh(np.array(devices[:count]), ("batch",))
            replicated = NamedSharding(mesh, P())
            sharded = NamedSharding(mesh, P("batch"))
            params = jax.device_put(init(jax.random.key(0)), replicated)
            images, boxes, labels = data(per_device * count, side)
            call_args = (params, params, jax.device_put(images, sharded),
                         jax.device_put(boxes, replicated), jax.device_put(labels, replicated))
            jitted = jax.jit(step)
            text = jitted.lower(*call_args).compile().as_text()
            ms = measure(jitted, call_args, args.rounds)
            base = base or ms
            row = dict(model=name, devices=count, batch=per_device * count, step_ms=ms,
                       efficiency=base / ms, collectives=collectives(text))
            results.append(row)
            print(f"{name:12s} devices {count}  batch {row['batch']:4d}  step {ms:8.3f} ms  "
                  f"efficiency {row['efficiency']:.2f}  collectives {row['collectives']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(jax=jax.__version__, device=devices[0].device_kind,
                           per_device_batch=per_device, side=side, results=results), f, indent=1)


if __name__ == "__main__":
    main()
