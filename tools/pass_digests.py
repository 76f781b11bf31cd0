"""Digests of the bits every deterministic pass produces, to prove that a change of the code's
shape (a refactor, a moved kernel) changed no result.

    python tools/pass_digests.py --out before.json [--large] [--repeats 3]
    python tools/pass_digests.py --compare before.json after.json

Each case runs one op's forward and its vjp on fixed seeded inputs and records a SHA-256 of the
bytes of every output (the forward and each gradient apart), per dtype. ``--large`` adds shapes
that reach the GPU's big-problem paths (tensor-core implicit GEMM, pipelined depthwise stencils
and weight gradients, sorted scatters over many points); run it on the GPU machine. Only the
deterministic paths are digested (``deterministic=False`` may sum in any order); ``--repeats N``
runs each case N times and reports the outputs whose bits change from run to run. grid_sample
and roi_align cases also digest Hessian-vector products (forward over reverse and reverse over
reverse: every directional pass); ``--first-order`` leaves them out (for trees without them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _inputs(seed: int, dtype, *shapes):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.uniform(-1, 1, size=s)).astype(dtype) for s in shapes]


REPEATS = 1  # --repeats: runs of each case whose bits must agree
SECOND_ORDER = True  # --first-order turns it off


def _vjp_digests(fn, args, seed: int, second_order: bool = False) -> dict[str, str]:
    """Digests of fn(*args) and of each argument's gradient for a fixed random cotangent (with
    `second_order`, also of the Hessian-vector products of <dy, fn> along random tangents, forward
    over reverse "hvp<i>" and reverse over reverse "rr<i>", which run every directional pass); an
    output whose bits differ between the REPEATS runs is marked "nondeterministic"."""
    y = jax.eval_shape(fn, *args)
    (dy,) = _inputs(seed + 1000, y.dtype, y.shape)
    tangents = _inputs(seed + 2000, args[0].dtype, *(a.shape for a in args))

    @jax.jit
    def forward_and_vjp(args, dy, tangents):
        y, pullback = jax.vjp(fn, *args)
        out = {"forward": y, **{f"d{i}": g for i, g in enumerate(pullback(dy))}}
        if second_order and SECOND_ORDER:
            def gradient(*a):
                return jax.vjp(fn, *a)[1](dy)

            def along(*a):
                return sum(jnp.vdot(g.astype(jnp.float32), t.astype(jnp.float32))
                           for g, t in zip(gradient(*a), tangents))

            hvp = jax.jvp(gradient, tuple(args), tuple(tangents))[1]
            rr = jax.grad(along, argnums=tuple(range(len(args))))(*args)
            out.update({f"hvp{i}": h for i, h in enumerate(hvp)})
            out.update({f"rr{i}": r for i, r in enumerate(rr)})
        return out

    runs = []
    for _ in range(REPEATS):
        out = forward_and_vjp(args, dy, tangents)
        runs.append({name: hashlib.sha256(np.asarray(jax.device_get(v)).tobytes()).hexdigest()[:24]
                     for name, v in out.items()})
    return {name: digest if all(r[name] == digest for r in runs) else "nondeterministic"
            for name, digest in runs[0].items()}


def _grid(seed, dtype, n, points, dims, spread):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.uniform(-spread, spread, size=(n, *points, dims))).astype(dtype)


def cases(large: bool):
    """(name, thunk(dtype) -> {output: digest}) for every case."""
    import jax_kernels as jk  # here, so that --compare needs no build

    out = []

    for shape, weight_kind in (((3, 37), "array"), ((64, 129), "scalar")):
        def lerp_case(dtype, shape=shape, weight_kind=weight_kind):
            a, b, w = _inputs(1, dtype, shape, shape[-1:], (shape[0], 1))
            if weight_kind == "scalar":
                return _vjp_digests(lambda a, b: jk.lerp(a, b, 0.3), (a, b), 1)
            return _vjp_digests(jk.lerp, (a, b, w), 1)
        out.append((f"lerp {shape} {weight_kind} weight", lerp_case))

    for shape, repeats in (((5, 7), (3, 2)), ((3,), (2, 1, 2)), ((64, 64), (2, 2)),
                           *((((512, 512), (4, 4)),) if large else ())):
        def repeat_case(dtype, shape=shape, repeats=repeats):
            (x,) = _inputs(2, dtype, shape)
            return _vjp_digests(lambda x: jk.repeat(x, repeats), (x,), 2)
        out.append((f"repeat {shape} by {repeats}", repeat_case))

    gs_shapes = [((2, 5, 9, 11), (7, 6)), ((2, 3, 4, 7, 9), (3, 5, 4))]
    if large:
        gs_shapes += [((8, 64, 64, 64), (64, 64)), ((4, 3, 224, 224), (224, 224)),
                      ((2, 16, 16, 32, 32), (16, 32, 32))]
    for input_shape, points in gs_shapes:
        rank = len(input_shape)
        modes = ("bilinear", "nearest", "bicubic") if rank == 4 else ("bilinear", "nearest")
        big = input_shape[-1] >= 32
        for mode in modes:
            for padding, align in (("zeros", False), ("border", True), ("reflection", False)):
                if big and padding == "border":
                    continue
                def gs_case(dtype, input_shape=input_shape, points=points, mode=mode,
                            padding=padding, align=align, rank=rank):
                    (x,) = _inputs(3, dtype, input_shape)
                    grid = _grid(4, dtype, input_shape[0], points, rank - 2, 1.2)
                    return _vjp_digests(
                        lambda x, g: jk.grid_sample(x, g, mode, padding, align), (x, grid), 3,
                        second_order=True)
                out.append((f"grid_sample {input_shape} -> {points} {mode} {padding} "
                            f"align={align}", gs_case))

    roi_shapes = [((2, 5, 9, 11), 9, (3, 2))]
    if large:
        roi_shapes += [((2, 256, 50, 68), 1024, (7, 7)), ((2, 64, 100, 136), 512, (14, 14))]
    for input_shape, count, size in roi_shapes:
        for sampling_ratio, aligned in ((2, False), (-1, True)):
            def roi_case(dtype, input_shape=input_shape, count=count, size=size,
                         sampling_ratio=sampling_ratio, aligned=aligned):
                (x,) = _inputs(5, dtype, input_shape)
                rng = np.random.default_rng(6)
                n, _, h, w = input_shape
                xy = rng.uniform(0, [w, h], size=(count, 2, 2))
                lo, hi = xy.min(axis=1), xy.max(axis=1)
                coords = jnp.asarray(np.concatenate([lo, hi], axis=1)).astype(dtype)
                index = jnp.asarray(rng.integers(0, n, size=(count, 1))).astype(dtype)
                fn = lambda x, c: jk.roi_align(x, jnp.concatenate([index, c], axis=1), size,
                                               0.9, sampling_ratio, aligned)
                return _vjp_digests(fn, (x, coords), 6, second_order=True)
            out.append((f"roi_align {input_shape} {count} boxes {size} "
                        f"ratio={sampling_ratio} aligned={aligned}", roi_case))

    conv_shapes = [
        ((2, 4, 14, 14), (4, 1, 7, 7), dict(padding=3, groups=4)),
        ((1, 3, 16, 20), (6, 1, 5, 5), dict(padding=2, groups=3)),
        ((2, 4, 16, 16), (4, 1, 3, 3), dict(padding=1, groups=4)),
        ((2, 4, 13, 12), (8, 1, 3, 3), dict(stride=2, padding=1, groups=4)),
        ((2, 2, 11, 11), (4, 2, 5, 5), dict(stride=2, padding=2)),
        ((1, 2, 30, 30), (2, 1, 3, 3), dict(dilation=6, padding=1, groups=2)),
        ((2, 16, 9, 9), (8, 16, 3, 3), dict(padding=1)),
        ((2, 4, 56, 56), (4, 1, 7, 7), dict(padding=3, groups=4)),
        ((2, 3, 64, 72), (3, 1, 7, 7), dict(padding=3, groups=3)),
        ((1, 2, 70, 136), (2, 1, 5, 5), dict(padding=2, groups=2)),
        ((2, 8, 12, 12), (8, 2, 3, 3), dict(padding=1, groups=4)),
    ]
    if large:
        conv_shapes += [
            ((8, 64, 28, 28), (64, 64, 3, 3), dict(padding=1)),
            ((8, 64, 28, 28), (128, 64, 3, 3), dict(stride=2, padding=1)),
            ((8, 64, 28, 28), (256, 64, 1, 1), dict()),
            ((4, 3, 64, 64), (32, 3, 7, 7), dict(stride=2, padding=3)),
            ((4, 96, 56, 56), (96, 1, 7, 7), dict(padding=3, groups=96)),
            ((4, 96, 28, 28), (96, 1, 3, 3), dict(padding=1, groups=96)),
            ((4, 64, 32, 32), (64, 16, 3, 3), dict(padding=1, groups=4)),
        ]
    for x_shape, w_shape, options in conv_shapes:
        for precision in (None, "highest"):
            def conv_case(dtype, x_shape=x_shape, w_shape=w_shape, options=options,
                          precision=precision):
                x, w, b = _inputs(7, dtype, x_shape, w_shape, w_shape[:1])
                return _vjp_digests(
                    lambda x, w, b: jk.conv2d(x, w, b, precision=precision, **options),
                    (x, w, b), 7)
            out.append((f"conv2d {x_shape} * {w_shape} {options} precision={precision}",
                        conv_case))
    return out


def compute(large: bool, dtypes) -> dict[str, dict[str, str]]:
    results = {}
    for dtype in dtypes:
        for name, case in cases(large):
            if "precision=highest" in name and dtype != "float32":
                continue  # precision only changes float32
            results[f"{name} [{dtype}]"] = case(jnp.dtype(dtype))
    return results


def compare(before_path: str, after_path: str) -> int:
    with open(before_path) as f:
        before = json.load(f)
    with open(after_path) as f:
        after = json.load(f)
    changed = [(case, out) for case, outputs in before.items() if case in after
               for out, digest in outputs.items() if after[case].get(out) != digest]
    missing = sorted(set(before) ^ set(after))
    for case, out in changed:
        print(f"changed: {case}: {out}")
    for case in missing:
        print(f"only in one file: {case}")
    compared = sum(len(v) for k, v in before.items() if k in after)
    print(f"{compared} outputs compared, {len(changed)} changed, {len(missing)} cases unmatched")
    return 1 if changed or missing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the digests to this JSON file")
    parser.add_argument("--large", action="store_true", help="add the GPU-sized shapes")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each case this many times and mark outputs whose bits differ")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--first-order", action="store_true",
                        help="no Hessian-vector products (for trees without second order)")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    jax.config.update("jax_enable_x64", True)
    global REPEATS, SECOND_ORDER
    REPEATS = args.repeats
    SECOND_ORDER = not args.first_order
    results = compute(args.large, args.dtypes.split(","))
    unstable = [f"{case}: {name}" for case, outputs in results.items()
                for name, digest in outputs.items() if digest == "nondeterministic"]
    for line in unstable:
        print(f"nondeterministic: {line}")
    print(f"{sum(len(v) for v in results.values())} outputs digested over {len(results)} cases "
          f"on {jax.devices()[0].platform}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
