"""Dense conv2d on the CPU: jax_kernels against torch (oneDNN), interleaved in one process.

    python tools/cpu_conv_bench.py [--shapes base,1x1,s2] [--dtypes float32,bfloat16,float16]
                                   [--passes fwd,dgrad,wgrad] [--layout NCHW|NHWC] [--rounds 9]

Each (shape, dtype, pass) warms both contenders up, then alternates rounds of back-to-back jitted
calls of ours and torch's calls (both with the same thread count: torch.set_num_threads, and
jax_kernels' pool, JAX_KERNELS_NUM_THREADS), and prints the median and minimum ms per call of
each with the 1-minute load average beside it. On a shared machine, time only when the load is
low, and compare figures of one run only. torch gets NCHW tensors whatever --layout is.
`--only ours` / `--only torch` times one library alone (torch's spinning OpenMP threads slow
what runs next to them in one process; on a 2-core Zen 5 VM its own 3x3 forward also measured
1.1 ms interleaved against 1.6-1.7 alone): run it once per library for a standing.
"""
import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_kernels as jk

SHAPES = {  # name: N, C, H (= W), K, R (= S), stride, padding
    "base": (8, 64, 28, 64, 3, 1, 1),
    "1x1": (8, 256, 28, 64, 1, 1, 0),
    "s2": (8, 64, 56, 128, 3, 2, 1),
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def per_call_ms(f, n):
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="base,1x1,s2")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--passes", default="fwd,dgrad,wgrad")
    p.add_argument("--layout", default="NCHW", choices=["NCHW", "NHWC"])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--ms", type=float, default=20.0, help="milliseconds per round and contender")
    p.add_argument("--only", choices=["ours", "torch"], default=None,
                   help="time one library alone (run once per library: torch's OpenMP threads "
                        "spin after its calls and slow whatever runs next in the process)")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("JAX_KERNELS_NUM_THREADS", os.cpu_count())))
    nhwc = a.layout == "NHWC"
    for shape in a.shapes.split(","):
        N, C, H, K, R, stride, pad = SHAPES[shape]
        rng = np.random.default_rng(0)
        x = rng.standard_normal((N, C, H, H)).astype(np.float32)
        w = (rng.standard_normal((K, C, R, R)) / np.sqrt(C * R * R)).astype(np.float32)
        P = (H + 2 * pad - R) // stride + 1
        dy = rng.standard_normal((N, K, P, P)).astype(np.float32)
        for dtype in a.dtypes.split(","):
            dt = jnp.dtype(dtype)
            act = (lambda v: v.transpose(0, 2, 3, 1)) if nhwc else (lambda v: v)
            jx, jdy = jnp.asarray(act(x), dt), jnp.asarray(act(dy), dt)
            jw = jnp.asarray(w.transpose(2, 3, 1, 0) if nhwc else w, dt)

            def conv(x, w):
                return jk.conv2d(x, w, stride=stride, padding=pad, data_format=a.layout)

            f = jax.jit(conv)
            d = jax.jit(lambda x, w, dy: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0])
            g = jax.jit(lambda x, w, dy: jax.vjp(lambda w: conv(x, w), w)[1](dy)[0])
            tx, tw, tdy = (torch.tensor(v).to(TORCH_DTYPES[dtype]) for v in (x, w, dy))
            o = dict(stride=stride, padding=pad)
            ours = {"fwd": lambda: f(jx, jw).block_until_ready(),
                    "dgrad": lambda: d(jx, jw, jdy).block_until_ready(),
                    "wgrad": lambda: g(jx, jw, jdy).block_until_ready()}
            theirs = {"fwd": lambda: torch.nn.functional.conv2d(tx, tw, None, **o),
                      "dgrad": lambda: torch.nn.grad.conv2d_input(tx.shape, tw, tdy, **o),
                      "wgrad": lambda: torch.nn.grad.conv2d_weight(tx, tw.shape, tdy, **o)}
            for name in a.passes.split(","):
                timed = [f for f, who in ((ours[name], "ours"), (theirs[name], "torch"))
                         if a.only in (None, who)]
                for _ in range(3):
                    for fn in timed:
                        fn()
                calls = [max(1, int(a.ms / max(per_call_ms(fn, 1), 0.01))) for fn in timed]
                times = [[] for _ in timed]
                for _ in range(a.rounds):
                    for fn, n, t in zip(timed, calls, times):
                        t.append(per_call_ms(fn, n))
                load = open("/proc/loadavg").read().split()[0]
                text = [f"{who} {statistics.median(t):8.3f} (min {min(t):8.3f}) ms" for who, t in
                        zip([w for w in ("jax_kernels", "torch") if a.only in (None, w.replace(
                            "jax_kernels", "ours"))], times)]
                ratio = (f"  torch/ours {statistics.median(times[1]) / statistics.median(times[0]):5.2f}"
                         if len(times) == 2 else "")
                print(f"{shape:5s} {a.layout} {dtype:9s} {name:6s} " + "  ".join(text) + ratio
                      + f"  load {load}", flush=True)


if __name__ == "__main__":
    main()
