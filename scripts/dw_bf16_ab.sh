#!/usr/bin/env bash
# A/B of the half-precision depthwise tensor-core stencil variants (docs/dw_bf16_v2_plan.md):
# compiles scripts/depthwise_check.cu once per variant, checks each bitwise against the first
# kernel (JK_DW_MMA_V1) on the dump cases, runs the float64 check of every variant, then times
# them interleaved for three rounds. Run on the GPU machine from the repository root.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-/tmp/dwb}; mkdir -p "$B"
JAXINC=$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")
F="-std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp/include -Icpp/cuda -isystem $JAXINC"
S=scripts/depthwise_check.cu
declare -A V=([v1]="-DJK_DW_MMA_V1" [c1]="-DJK_DW_MMA_CHAINS=1" [c2]="" [c4]="-DJK_DW_MMA_CHAINS=4"
              [c2w]="-DJK_DW_MMA_WNEXT" [c4w]="-DJK_DW_MMA_CHAINS=4 -DJK_DW_MMA_WNEXT")
ORDER="v1 c1 c2 c4 c2w c4w"
for v in $ORDER; do nvcc $F ${V[$v]} -o "$B/$v" $S & done; wait
for v in $ORDER; do
  "$B/$v" dump "$B/$v.bin" >/dev/null
  cmp -s "$B/v1.bin" "$B/$v.bin" && echo "$v: bitwise equal to v1" || echo "$v: DIFFERS from v1"
done
for v in $ORDER; do echo "$v check: $("$B/$v" | tail -1)"; done
for i in 1 2 3; do for v in $ORDER; do
  echo "$v $("$B/$v" bench | grep -E 'bfloat16|float16' | tr '\n' ' ')"
done; done
