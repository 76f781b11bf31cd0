"""Benchmarks: ``python -m jax_kernels.bench [--ops lerp,repeat] [--json FILE] [--quick]``.

Times each op and pass against what a user would pick instead, side by side in one run: the
pure-``jnp`` form, and torch when importable (on the same device). Every contender is timed the
same way: after warm-up, ``--dispatches`` back-to-back calls then one synchronization, repeated
``--rounds`` times; the median per-call time is reported. Inputs are random, never zeros.

The floor of a case is the bytes it must move (each input read once, each output written once)
over the device copy bandwidth measured in the same run.

Each op contributes a ``cases_<op>(ctx)`` function returning :class:`Case` objects; ``CASES``
maps op names to them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_kernels as jk

try:
    import torch
except ImportError:  # torch is an optional peer
    torch = None


@dataclass
class Contender:
    name: str
    fn: Callable[[], object]  # one dispatch; returns what must be waited for
    kind: str = "jax"  # "jax" or "torch"


@dataclass
class Case:
    name: str
    floor_bytes: int  # bytes that must move through device memory
    contenders: list[Contender] = field(default_factory=list)


@dataclass
class Context:
    platform: str  # "gpu" or "cpu"
    quick: bool
    torch_device: str | None  # "cuda" / "cpu" when torch can run on the JAX device's kind

    def rng(self, seed: int = 0) -> np.random.Generator:
        return np.random.default_rng(seed)


def _sync(kind: str, out) -> None:
    if kind == "torch":
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    else:
        jax.block_until_ready(out)


def time_contender(c: Contender, dispatches: int, rounds: int) -> float:
    """Median milliseconds per call over `rounds` of `dispatches` back-to-back calls."""
    for _ in range(3):
        _sync(c.kind, c.fn())
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(dispatches):
            out = c.fn()
        _sync(c.kind, out)
        samples.append((time.perf_counter() - start) * 1e3 / dispatches)
    return statistics.median(samples)


def copy_bandwidth(ctx: Context, dispatches: int, rounds: int) -> float:
    """Device copy bandwidth in bytes/s (bytes read + written), best of jnp and torch."""
    n = (1 << 28) if ctx.platform == "gpu" else (1 << 24)
    x = jnp.asarray(ctx.rng().standard_normal(n, dtype=np.float32))
    copy = jax.jit(lambda v: v + 1.0)
    best = time_contender(Contender("jnp copy", lambda: copy(x)), dispatches, rounds)
    if ctx.torch_device is not None:
        src = torch.from_numpy(np.asarray(x)).to(ctx.torch_device)
        dst = torch.empty_like(src)
        best = min(best, time_contender(Contender("torch copy", lambda: dst.copy_(src), "torch"),
                                        dispatches, rounds))
    return 2 * n * 4 / (best * 1e-3)


# --- cases ---------------------------------------------------------------------------------------


def _jnp_random(ctx: Context, shape, dtype=jnp.float32, seed=0) -> jax.Array:
    return jnp.asarray(ctx.rng(seed).uniform(-1, 1, size=shape).astype(np.float32)).astype(dtype)


def _to_torch(ctx: Context, x: jax.Array):
    return torch.from_numpy(np.asarray(x)).to(ctx.torch_device)


def cases_lerp(ctx: Context) -> list[Case]:
    n = (1 << 26) if not ctx.quick else (1 << 22)
    a, b, w = (_jnp_random(ctx, (n,), seed=s) for s in range(3))
    w = (w + 1) / 2
    jk_scalar = jax.jit(lambda a, b: jk.lerp(a, b, 0.3))
    jnp_scalar = jax.jit(lambda a, b: a + 0.3 * (b - a))
    jk_array = jax.jit(jk.lerp)
    jnp_array = jax.jit(lambda a, b, w: a + w * (b - a))
    jk_fused = jax.jit(lambda a, b: jnp.tanh(jk.lerp(a, b, 0.3)) * 2.0)
    jnp_fused = jax.jit(lambda a, b: jnp.tanh(a + 0.3 * (b - a)) * 2.0)
    grad_jk = jax.jit(jax.grad(lambda a, b, w: jnp.sum(jk.lerp(a, b, w)), argnums=(0, 1, 2)))
    grad_jnp = jax.jit(jax.grad(lambda a, b, w: jnp.sum(a + w * (b - a)), argnums=(0, 1, 2)))
    scalar = Case(f"lerp fwd {n >> 20}M f32, scalar weight", 3 * 4 * n, [
        Contender("jax_kernels", lambda: jk_scalar(a, b)),
        Contender("jnp", lambda: jnp_scalar(a, b)),
    ])
    array = Case(f"lerp fwd {n >> 20}M f32, array weight", 4 * 4 * n, [
        Contender("jax_kernels", lambda: jk_array(a, b, w)),
        Contender("jnp", lambda: jnp_array(a, b, w)),
    ])
    fused = Case(f"tanh(lerp(a, b, 0.3)) * 2, {n >> 20}M f32", 3 * 4 * n, [
        Contender("jax_kernels", lambda: jk_fused(a, b)),
        Contender("jnp", lambda: jnp_fused(a, b)),
    ])
    # The gradient of sum(lerp) reads a, b, w and writes three gradients.
    grads = Case(f"lerp grad (a, b, w) {n >> 20}M f32", 6 * 4 * n, [
        Contender("jax_kernels", lambda: grad_jk(a, b, w)),
        Contender("jnp", lambda: grad_jnp(a, b, w)),
    ])
    if ctx.torch_device is not None:
        ta, tb, tw = (_to_torch(ctx, v) for v in (a, b, w))
        scalar.contenders.append(Contender("torch", lambda: torch.lerp(ta, tb, 0.3), "torch"))
        array.contenders.append(Contender("torch", lambda: torch.lerp(ta, tb, tw), "torch"))
        fused.contenders.append(
            Contender("torch", lambda: torch.tanh(torch.lerp(ta, tb, 0.3)) * 2.0, "torch"))
    return [scalar, array, fused, grads]


def cases_repeat(ctx: Context) -> list[Case]:
    side = 2048 if not ctx.quick else 512
    x = _jnp_random(ctx, (side, side))
    reps = (4, 4)
    out_bytes = 4 * side * side * 16
    jk_fwd = jax.jit(lambda x: jk.repeat(x, reps))
    jnp_fwd = jax.jit(lambda x: jnp.tile(x, reps))
    dout = _jnp_random(ctx, (side * 4, side * 4), seed=1)
    jk_bwd = jax.jit(lambda x, g: jax.vjp(lambda v: jk.repeat(v, reps), x)[1](g))
    jnp_bwd = jax.jit(lambda x, g: jax.vjp(lambda v: jnp.tile(v, reps), x)[1](g))
    jk_fused = jax.jit(lambda x: jk.repeat(x, reps) * 2.0 + 1.0)
    jnp_fused = jax.jit(lambda x: jnp.tile(x, reps) * 2.0 + 1.0)
    fwd = Case(f"repeat fwd {side}x{side} by {reps} f32", out_bytes + 4 * side * side, [
        Contender("jax_kernels", lambda: jk_fwd(x)),
        Contender("jnp.tile", lambda: jnp_fwd(x)),
    ])
    bwd = Case(f"repeat bwd {side}x{side} by {reps} f32", out_bytes + 4 * side * side, [
        Contender("jax_kernels", lambda: jk_bwd(x, dout)),
        Contender("jnp.tile", lambda: jnp_bwd(x, dout)),
    ])
    fused = Case(f"repeat(x) * 2 + 1, {side}x{side} by {reps} f32", out_bytes + 4 * side * side, [
        Contender("jax_kernels", lambda: jk_fused(x)),
        Contender("jnp.tile", lambda: jnp_fused(x)),
    ])
    if ctx.torch_device is not None:
        tx = _to_torch(ctx, x)
        fwd.contenders.append(Contender("torch", lambda: tx.repeat(*reps), "torch"))
        fused.contenders.append(Contender("torch", lambda: tx.repeat(*reps) * 2.0 + 1.0, "torch"))
    return [fwd, bwd, fused]


def cases_conv2d(ctx: Context) -> list[Case]:
    """DESIGN.md section 8: 3x3 64->64 (bf16, f32 in TF32), 1x1 256->64 (bf16) and depthwise
    7x7 (f32, bf16), each forward, dgrad and wgrad, NCHW, against lax.conv and torch (cuDNN on
    the GPU; torch's default TF32 for f32 as jk's and lax's default precision). The CPU runs the
    depthwise case of section 8 (C96 N8 28x28) and the dense ones at that size."""
    gpu = ctx.platform == "gpu"
    if ctx.quick:
        N, side, depthwise = 2, 14, 32
    elif gpu:
        N, side, depthwise = 32, 56, 384
    else:
        N, side, depthwise = 8, 28, 96
    configs = [  # name, C, K, kernel, padding, groups, dtype
        ("3x3 64->64", 64, 64, 3, 1, 1, jnp.bfloat16),
        ("1x1 256->64", 256, 64, 1, 0, 1, jnp.bfloat16),
        ("3x3 64->64", 64, 64, 3, 1, 1, jnp.float32),
        (f"depthwise 7x7 C{depthwise}", depthwise, depthwise, 7, 3, depthwise, jnp.float32),
        (f"depthwise 7x7 C{depthwise}", depthwise, depthwise, 7, 3, depthwise, jnp.bfloat16),
    ]
    cases = []
    for seed, (name, C, K, size, pad, groups, dtype) in enumerate(configs):
        x = _jnp_random(ctx, (N, C, side, side), dtype, seed=3 * seed)
        w = _jnp_random(ctx, (K, C // groups, size, size), dtype, seed=3 * seed + 1)
        dy = _jnp_random(ctx, (N, K, side, side), dtype, seed=3 * seed + 2)
        item = np.dtype(dtype).itemsize
        x_bytes, w_bytes, y_bytes = x.size * item, w.size * item, dy.size * item

        def ours(x, w, pad=pad, groups=groups):
            return jk.conv2d(x, w, padding=pad, groups=groups)

        def lax_conv(x, w, pad=pad, groups=groups):
            return jax.lax.conv_general_dilated(x, w, (1, 1), [(pad, pad), (pad, pad)],
                                                feature_group_count=groups,
                                                dimension_numbers=("NCHW", "OIHW", "NCHW"))

        label = f"conv2d {name} N{N} {side}x{side} {np.dtype(dtype).name}"
        fwd = Case(f"{label} fwd", x_bytes + w_bytes + y_bytes)
        dgrad = Case(f"{label} dgrad", y_bytes + w_bytes + x_bytes)
        wgrad = Case(f"{label} wgrad", y_bytes + x_bytes + w_bytes)
        for contender, conv in (("jax_kernels", ours), ("lax.conv", lax_conv)):
            f = jax.jit(conv)
            d = jax.jit(lambda x, w, dy, conv=conv: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0])
            g = jax.jit(lambda x, w, dy, conv=conv: jax.vjp(lambda w: conv(x, w), w)[1](dy)[0])
            args = (x, w, dy)
            fwd.contenders.append(Contender(contender, lambda f=f, a=args: f(*a[:2])))
            dgrad.contenders.append(Contender(contender, lambda d=d, a=args: d(*a)))
            wgrad.contenders.append(Contender(contender, lambda g=g, a=args: g(*a)))
        if ctx.torch_device is not None:
            def to_torch(a, dtype=dtype):
                t = torch.from_numpy(np.asarray(a.astype(jnp.float32))).to(ctx.torch_device)
                return t.to(torch.bfloat16 if dtype == jnp.bfloat16 else torch.float32)

            t = (to_torch(x), to_torch(w), to_torch(dy))
            o = dict(stride=1, padding=pad, dilation=1, groups=groups)
            fwd.contenders.append(Contender(
                "torch", lambda t=t, o=o: torch.nn.functional.conv2d(t[0], t[1], None, **o),
                "torch"))
            dgrad.contenders.append(Contender(
                "torch", lambda t=t, o=o: torch.nn.grad.conv2d_input(t[0].shape, t[1], t[2], **o),
                "torch"))
            wgrad.contenders.append(Contender(
                "torch", lambda t=t, o=o: torch.nn.grad.conv2d_weight(t[0], t[1].shape, t[2], **o),
                "torch"))
        cases += [fwd, dgrad, wgrad]
    return cases


CASES: dict[str, Callable[[Context], list[Case]]] = {
    "lerp": cases_lerp,
    "repeat": cases_repeat,
    "conv2d": cases_conv2d,
}


# --- driver --------------------------------------------------------------------------------------


def run(ops: list[str], quick: bool, dispatches: int, rounds: int) -> dict:
    platform = jax.default_backend()
    torch_device = None
    if torch is not None:
        if platform == "gpu" and torch.cuda.is_available():
            torch_device = "cuda"
        elif platform == "cpu":
            torch_device = "cpu"
    ctx = Context(platform=platform, quick=quick, torch_device=torch_device)
    bandwidth = copy_bandwidth(ctx, dispatches, rounds)
    device = jax.devices()[0].device_kind
    report = {
        "device": device,
        "platform": platform,
        "jax": jax.__version__,
        "torch": getattr(torch, "__version__", None),
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "dispatches": dispatches,
        "rounds": rounds,
        "cases": [],
    }
    print(f"# {device} ({platform}), jax {jax.__version__}, torch {report['torch']}, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    print(f"{'case':58s} {'contender':12s} {'ms':>9s} {'x floor':>8s} {'x jk':>7s}")
    for op in ops:
        for case in CASES[op](ctx):
            floor_ms = case.floor_bytes / bandwidth * 1e3
            times = {c.name: time_contender(c, dispatches, rounds) for c in case.contenders}
            ours = times.get("jax_kernels")
            for name, ms in times.items():
                ratio = f"{ms / ours:7.2f}" if ours else "      -"
                print(f"{case.name[:58]:58s} {name:12s} {ms:9.4f} {ms / floor_ms:8.2f} {ratio}")
            report["cases"].append({"case": case.name, "floor_ms": floor_ms, "ms": times})
            sys.stdout.flush()
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(CASES), help="comma-separated ops")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU smoke test)")
    parser.add_argument("--dispatches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    ops = [op for op in args.ops.split(",") if op]
    unknown = [op for op in ops if op not in CASES]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(CASES)}")
    report = run(ops, args.quick, args.dispatches, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
