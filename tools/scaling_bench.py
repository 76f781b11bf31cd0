"""Data-parallel scaling of a jitted training step over every op, next to the same model in pure
JAX (lax.conv, jnp gathers), at a fixed per-device batch on 1, 2, 4, ... devices. The model and
its sizes are the benchmark's (``jax_kernels.bench.TrainModel``, ``TRAIN_SIZES``: the GPU one on
accelerators, the ``--quick`` one on the CPU).

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
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jax_kernels.bench import (TRAIN_OPS, TRAIN_SIZES, train_data, train_init,  # noqa: E402
                               train_step)

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
    model, batch, side = TRAIN_SIZES["gpu" if gpu else "quick"]
    per_device = args.per_device_batch or batch
    side = args.side or side
    counts = ([int(c) for c in args.devices.split(",")] if args.devices else
              [c for c in (1, 2, 4, 8) if c <= len(devices)])
    print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}; per-device batch "
          f"{per_device}, images 3x{side}x{side}, {model}")

    if args.tests:
        env = dict(os.environ)
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/test_sharding.py"],
                             env=env)
        print(f"sharding tests: exit code {rc}")

    results = []
    for name, ops in TRAIN_OPS.items():
        step = train_step(ops, model)
        base = None
        for count in counts:
            if count > len(devices):
                continue
            mesh = Mesh(np.array(devices[:count]), ("batch",))
            replicated = NamedSharding(mesh, P())
            sharded = NamedSharding(mesh, P("batch"))
            params = jax.device_put(train_init(model), replicated)
            images, boxes, labels = train_data(model, per_device * count, side)
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
