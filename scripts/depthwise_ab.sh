#!/usr/bin/env bash
# A/B of compile-time variants of the depthwise kernels (scripts/depthwise_check.cu):
#   scripts/depthwise_ab.sh NAME=FLAGS ...   e.g.  base=  c4=-DJK_DW_MMA_CHAINS=4
# compiles one binary per variant in parallel, compares each one's half-type forward and dgrad
# outputs bitwise with the first's (the dump cases), runs each one's float64 check (last line:
# the failure count), then times them interleaved for three rounds (bf16 and f16 lines).
# Run on the GPU machine from the repository root.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-/tmp/dwb}; mkdir -p "$B"
JAXINC=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
F="-std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -lineinfo -Icpp/include -Icpp/cuda -isystem $JAXINC"
names=()
for spec in "$@"; do
  name=${spec%%=*}; flags=${spec#*=}; names+=("$name")
  # shellcheck disable=SC2086
  nvcc $F $flags -o "$B/$name" scripts/depthwise_check.cu &
done
wait
for v in "${names[@]}"; do
  "$B/$v" dump "$B/$v.bin" >/dev/null
  cmp -s "$B/${names[0]}.bin" "$B/$v.bin" && echo "$v: fwd/dgrad bitwise equal to ${names[0]}" \
    || echo "$v: fwd/dgrad DIFFER from ${names[0]}"
done
for v in "${names[@]}"; do echo "$v check: $("$B/$v" | tail -1)"; done
for i in 1 2 3; do for v in "${names[@]}"; do
  echo "$v $("$B/$v" bench | grep -E 'bfloat16|float16' | tr '\n' ' ')"
done; done
