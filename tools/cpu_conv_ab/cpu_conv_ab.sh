#!/usr/bin/env bash
# In-process A/B of the CPU conv2d kernels: a git revision of cpp/cpu/conv.cc (+ conv_loops.inc)
# against the working tree, f32 NCHW (or NHWC: PASS wgrad-nhwc / fwd-nhwc), on six dense shapes
# (main.cc).
#
#   tools/cpu_conv_ab/cpu_conv_ab.sh [OLD_REV (default HEAD)] [wgrad|fwd|wgrad-nhwc|fwd-nhwc]
#                                    [ROUNDS] [NAME_FILTER]
#
# Each build is a shared library of pass.cc over its copy of conv.cc; the driver loads both and
# calls them alternately, so that a noisy shared machine slows both alike (separate processes
# varied up to 30% between runs on the 2-core development VM, this ~5-10%). Threads: the
# package's pool (JAX_KERNELS_NUM_THREADS, default one per core). Needs g++ and jax (for the
# XLA FFI headers that conv.cc includes).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
rev="${1:-HEAD}" pass="${2:-wgrad}" rounds="${3:-5}" filter="${4:-}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old" "$work/new"
git -C "$root" show "$rev:cpp/cpu/conv.cc" > "$work/old/conv.cc"
git -C "$root" show "$rev:cpp/cpu/conv_loops.inc" > "$work/old/conv_loops.inc"
cp "$root/cpp/cpu/conv.cc" "$root/cpp/cpu/conv_loops.inc" "$work/new/"
ffi="$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')"
flags=(-O3 -DNDEBUG -std=gnu++17 -fPIC -shared -fvisibility=hidden -fno-trapping-math
       -I"$root/cpp/include" -isystem "$ffi")
g++ "${flags[@]}" -DCONV_SRC="\"$work/old/conv.cc\"" -DPREFIX=old "$here/pass.cc" \
    -o "$work/libold.so" -lpthread &
g++ "${flags[@]}" -DCONV_SRC="\"$work/new/conv.cc\"" -DPREFIX=new "$here/pass.cc" \
    -o "$work/libnew.so" -lpthread &
g++ -O2 -std=gnu++17 "$here/main.cc" -o "$work/main" -ldl
wait
cd "$work"
echo "old: $rev ($(git -C "$root" rev-parse --short "$rev")), new: working tree; $pass, $rounds rounds"
./main "$pass" "$rounds" ${filter:+"$filter"}
