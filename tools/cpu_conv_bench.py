"""Dense conv2d on the CPU: jax_kernels against torch (oneDNN), interleaved in one process.

    python tools/cpu_conv_bench.py [--shapes base,1x1,s2] [--dtypes float32,bfloat16,float16]
                                   [--passes fwd,dgrad,wgrad] [--layout NCHW|NHWC] [--rounds 9]

Each (shape, dtype, pass) warms both contenders up, then alternates rounds of back-to-back jitted
calls of ours and torch's calls (both with the same thread count: torch.set_num_threads, and
jax_kernels' pool, JAX_KERNELS_NUM_THREADS), and prints the median and minimum ms per call of
each with the 1-minute load average beside it. On a shared machine, time only when the load is
low, and compare figures of one run only. torch gets NCHW tensors whatever --layout is.
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
                A, B = ours[name], theirs[name]
                for _ in range(3):
                    A()
                    B()
                na = max(1, int(a.ms / max(per_call_ms(A, 1), 0.01)))
                nb = max(1, int(a.ms / max(per_call_ms(B, 1), 0.01)))
                ta, tb = [], []
                for _ in range(a.rounds):
                    ta.append(per_call_ms(A, na))
                    tb.append(per_call_ms(B, nb))
                mo, mt = statistics.median(ta), statistics.median(tb)
                load = open("/proc/loadavg").read().split()[0]
                print(f"{shape:5s} {a.layout} {dtype:9s} {name:6s} jax_kernels {mo:8.3f} "
                      f"(min {min(ta):8.3f}) ms  torch {mt:8.3f} (min {min(tb):8.3f}) ms  "
                      f"torch/ours {mt / mo:5.2f}  load {load}", flush=True)


if __name__ == "__main__":
    main()
