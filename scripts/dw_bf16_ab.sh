#!/usr/bin/env bash
# A/B of the half-precision depthwise tensor-core stencil's mma chain counts (JK_DW_MMA_CHAINS
# 1, 2, 4): compiles scripts/depthwise_check.cu once per variant, checks each bitwise against the
# default (2) on the dump cases, runs each one's float64 check, then times them interleaved for
# three rounds. Run on the GPU machine from the repository root (about 4 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-/tmp/dwb}; mkdir -p "$B"
JAXINC=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
F="-std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp/include -Icpp/cuda -isystem $JAXINC"
ORDER="c2 c1 c4"
for v in $ORDER; do nvcc $F -DJK_DW_MMA_CHAINS="${v#c}" -o "$B/$v" scripts/depthwise_check.cu & done; wait
for v in $ORDER; do
  "$B/$v" dump "$B/$v.bin" >/dev/null
  cmp -s "$B/c2.bin" "$B/$v.bin" && echo "$v: bitwise equal to c2" || echo "$v: DIFFERS from c2"
done
for v in $ORDER; do echo "$v check: $("$B/$v" | tail -1)"; done
for i in 1 2 3; do for v in $ORDER; do
  echo "$v $("$B/$v" bench | grep -E 'bfloat16|float16' | tr '\n' ' ')"
done; done
