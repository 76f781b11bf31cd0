"""Which op makes the benchmark's training step (jax_kernels.bench, case train_step) faster or
slower than the pure-JAX step: the jax_kernels step with one op at a time replaced by its pure-JAX
form (lax.conv, the jnp gathers, jnp.tile, the jnp lerp), the convolutions split into depthwise
and the others. Per-dispatch milliseconds of the jitted step, the best of a few rounds. Then each convolution
of the model alone (forward + both gradients, jitted), jax_kernels against lax.conv.

    python tools/train_step_ablation.py [--dtype bfloat16] [--size gpu|cpu|quick] [--profile DIR]

--profile DIR instead traces 20 steps of the jax_kernels step and of the pure-JAX step with
jax.profiler (a Perfetto trace under DIR) and prints each step's device kernels: total device
time per step and the kernels that take it, by name; then the same for each convolution alone
(no op-swapped variants).
"""

import argparse
import collections
import glob
import gzip
import json
import os
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


def device_kernels(trace_dir, steps):
    """(name -> device ms per step) of the Perfetto trace that jax.profiler wrote to trace_dir:
    the complete events on the device processes' stream lines (not the host threads, nor the
    "XLA Ops" / "XLA Modules" lines, which repeat the kernels' times per op and module)."""
    path = max(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
               key=os.path.getmtime)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: str(e.get("args", {}).get("name", ""))
                 for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
               for e in meta if e.get("name") == "thread_name"}
    devices = {pid for pid, name in processes.items() if "/device:" in name and "CPU" not in name}
    streams = {key for key, name in threads.items()
               if key[0] in devices and name.lower().startswith("stream")}
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
            totals[e["name"]] += e.get("dur", 0) / 1e3 / steps
    if not totals:
        print("  no device stream events; lines seen:",
              sorted(processes.values())[:20], sorted(set(threads.values()))[:40])
    return totals


def profile(step, args, trace_dir, steps=20, top=25):
    out = step(*args)
    jax.block_until_ready(out)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(steps):
            out = step(*args)
        jax.block_until_ready(out)
    totals = device_kernels(trace_dir, steps)
    print(f"  device time per step {sum(totals.values()):.4f} ms in {len(totals)} kernel names")
    for name, ms in totals.most_common(top):
        print(f"  {ms:8.4f} ms  {name[:150]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--size", default="gpu" if jax.default_backend() == "gpu" else "cpu")
    parser.add_argument("--profile", metavar="DIR", help="trace the two steps' kernels instead")
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

    if a.profile:
        for name, ops in (("jax_kernels", jk_ops), ("pure JAX", jnp_ops)):
            print(f"# {name} step, {dtype.name}, {jax.devices()[0].device_kind}", flush=True)
            profile(jax.jit(bench.train_step(ops, model)), (params, params, images, boxes, labels),
                    os.path.join(a.profile, name.replace(" ", "_")))

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
    for name, ops in ({} if a.profile else variants).items():
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
            if a.profile:
                print(f"# conv {name}, {label}: forward + both gradients", flush=True)
                profile(step, (x, w), os.path.join(a.profile, f"{name}_{label}".replace(" ", "_")),
                        top=8)
        print(f"conv {name:14s} x{list(xs)} w{list(ws)}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
