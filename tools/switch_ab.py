"""A/B of the kernels' environment switches on benchmark cases, one process per variant.

    python tools/switch_ab.py --ops conv2d_sweep --match "1x1,stem" [--require NHWC,10 calls]
        [--exclude wgrad] --variant before:JAX_KERNELS_CONV_POINTWISE=0 --variant after:
        [--rounds 11] [--dispatches 20]

Each variant (LABEL:NAME=VALUE,NAME=VALUE...; an empty list keeps the environment) runs the
matched cases of `python -m jax_kernels.bench` in a process of its own with its variables set
before JAX starts. Switching inside one process would not do: XLA's command buffers replay the
launches a compiled program recorded on its first run, so a handler's switch read later is not
seen (performance.md, run 28). Every contender of a case is timed in every process, so the
peers' own drift between processes shows beside ours. Prints one row per case: each variant's
time for `jax_kernels` (ms per call), the peers' range over the processes, and each variant's
time over the first one's.
"""
import argparse
import json
import os
import subprocess
import sys


def child(args) -> None:
    import jax  # noqa: F401  (the variant's environment is set before this import)

    from jax_kernels import bench

    platform = jax.default_backend()
    ctx = bench.Context(platform=platform, quick=platform == "cpu", torch_device=None)
    rows = []
    for op in args.ops.split(","):
        for case in bench.CASES[op](ctx):
            name = case.name
            if not any(m in name for m in args.match.split(",")):
                continue
            if any(r not in name for r in args.require.split(",") if r):
                continue
            if any(x in name for x in args.exclude.split(",") if x):
                continue
            times = {c.name: bench.time_contender(c, args.dispatches, args.rounds) / case.calls
                     for c in case.contenders}
            rows.append({"case": name, "ms": times})
            print(json.dumps(rows[-1]), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="conv2d_sweep")
    p.add_argument("--match", required=True, help="comma-separated substrings of case names")
    p.add_argument("--require", default="", help="comma-separated substrings all required")
    p.add_argument("--exclude", default="", help="comma-separated substrings excluded")
    p.add_argument("--variant", action="append", default=[],
                   help="LABEL:NAME=VALUE[,NAME=VALUE...] (at least two)")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--dispatches", type=int, default=20)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if len(args.variant) < 2:
        p.error("give at least two --variant")
    results = {}
    for variant in args.variant:
        label, _, assignments = variant.partition(":")
        env = dict(os.environ)
        for item in filter(None, assignments.split(",")):
            name, _, value = item.partition("=")
            env[name] = value
        command = [sys.executable, os.path.abspath(__file__), "--child", "--ops", args.ops,
                   "--match", args.match, "--require", args.require, "--exclude", args.exclude,
                   "--rounds", str(args.rounds), "--dispatches", str(args.dispatches)]
        out = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
        results[label] = {row["case"]: row["ms"] for row in
                          (json.loads(line) for line in out.stdout.splitlines()
                           if line.startswith("{"))}
        print(f"# {label}: {len(results[label])} cases", file=sys.stderr, flush=True)
        for case, ms in results[label].items():  # kept if a later variant is cut off
            print(f"#   {label} {json.dumps({'case': case, 'ms': ms})}", file=sys.stderr,
                  flush=True)
    labels = list(results)
    first = results[labels[0]]
    print(f"{'case':72s} " + " ".join(f"{label[:9]:>9s}" for label in labels)
          + "  peers (min-max over processes)  " + " ".join(f"{label[:7]}/{labels[0][:7]}"
                                                          for label in labels[1:]))
    for case in first:
        ours = [results[label].get(case, {}).get("jax_kernels") for label in labels]
        if None in ours:
            continue
        peers = {}
        for label in labels:
            for name, ms in results[label][case].items():
                if name != "jax_kernels":
                    peers.setdefault(name, []).append(ms)
        peer_text = " ".join(f"{name} {min(v):.4f}-{max(v):.4f}" for name, v in peers.items())
        print(f"{case[:72]:72s} " + " ".join(f"{t:9.4f}" for t in ours) + f"  {peer_text}  "
              + " ".join(f"{t / ours[0]:13.2f}" for t in ours[1:]))


if __name__ == "__main__":
    main()
