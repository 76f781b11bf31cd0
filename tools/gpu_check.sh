#!/usr/bin/env bash
# One-call GPU check for a GPU machine without network: install the carried CUTLASS wheel,
# build and install jax_kernels with CUDA, check the conv kernels standalone (implicit_gemm_check,
# conv_direct_check), run the test suite on the GPU, run compute-sanitizer
# memcheck on small cases of every kernel, record the digests of every deterministic pass's bits
# (tools/pass_digests.py, to compare before and after a change), then the benchmark against
# jnp/lax and torch.
#
#   tools/gpu_check.sh [pytest args...]      (carry .whl; results land in $OUT)
#
# Environment: SKIP_CONV_CHECKS=1, SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_DIGESTS=1, SKIP_BENCH=1, BENCH_OPS=lerp,repeat,
# CUDA_ARCHS (default 90), SANITIZER_OPS="conv2d" / SANITIZER_DTYPES=bfloat16 (a subset of the
# memcheck cases; default all), SANITIZER_SECONDS (default 300), RACECHECK_OPS="conv2d grid_sample"
# (adds a racecheck run of those ops' cases, RACECHECK_DTYPES default float32,bfloat16, limited to
# RACECHECK_SECONDS, default 300). The sanitizer runs are killed as a group at their limit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jk_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__)"

start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --no-build-isolation --no-deps -e . \
  --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" \
  --config-settings=build-dir=build/gpu 2>&1 | tail -20 || exit 1
echo "build: $(( $(date +%s) - start )) s"
python3 -c "import jax_kernels._ffi as f; assert f.CUDA_BUILT, 'CUDA module missing'; print('CUDA module built')" || exit 1

if [ -z "${SKIP_CONV_CHECKS:-}" ]; then  # the conv kernels alone against a float64 reference
  start=$(date +%s)
  for tool in implicit_gemm_check conv_direct_check; do
    cmake --build build/gpu --target "$tool" -j "$(nproc)" >/dev/null 2>&1 &&
      "build/gpu/cpp/$tool" 2>&1 | tee "$OUT/$tool.log" | tail -20
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  echo "conv checks: $(( $(date +%s) - start )) s"
fi

if [ -z "${SKIP_TESTS:-}" ]; then
  start=$(date +%s)
  JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/tests.xml" "${@:-tests}" \
    2>&1 | tee "$OUT/tests.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "GPU tests: $(( $(date +%s) - start )) s"
fi

# Runs "$@" in its own process group with output to $log, killing the whole group (the
# sanitizer and the Python process under it) after $secs seconds.
run_limited() {
  local secs=$1 log=$2; shift 2
  setsid "$@" >"$log" 2>&1 &
  local pid=$! killer rc
  (sleep "$secs"; kill -KILL -- "-$pid" 2>/dev/null && echo "killed after $secs s" >>"$log") &
  killer=$!
  wait "$pid"; rc=$?
  kill "$killer" 2>/dev/null
  tail -8 "$log"
  return $rc
}

if [ -z "${SKIP_SANITIZER:-}" ]; then
  start=$(date +%s)
  # shellcheck disable=SC2086
  JAX_PLATFORMS=cuda run_limited "${SANITIZER_SECONDS:-300}" "$OUT/sanitizer.log" compute-sanitizer \
    --tool memcheck --kernel-name kns=jax_kernels --error-exitcode 3 python3 tools/sanitize_cases.py \
    --dtypes "${SANITIZER_DTYPES:-float16,bfloat16,float32,float64}" ${SANITIZER_OPS:-} || status=1
  echo "sanitizer: $(( $(date +%s) - start )) s"
fi

if [ -n "${RACECHECK_OPS:-}" ]; then  # shared-memory hazards; slow, so a subset of the cases
  start=$(date +%s)
  # shellcheck disable=SC2086
  JAX_PLATFORMS=cuda run_limited "${RACECHECK_SECONDS:-300}" "$OUT/racecheck.log" compute-sanitizer \
    --tool racecheck --kernel-name kns=jax_kernels --error-exitcode 3 python3 tools/sanitize_cases.py \
    --dtypes "${RACECHECK_DTYPES:-float32,bfloat16}" $RACECHECK_OPS || status=1
  echo "racecheck: $(( $(date +%s) - start )) s"
fi

if [ -z "${SKIP_DIGESTS:-}" ]; then  # bits of every deterministic pass, GPU-sized shapes included
  start=$(date +%s)
  JAX_PLATFORMS=cuda python3 tools/pass_digests.py --large --repeats 3 --out "$OUT/digests.json" || status=1
  echo "digests: $(( $(date +%s) - start )) s"
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  JAX_PLATFORMS=cuda python3 -m jax_kernels.bench --ops "${BENCH_OPS:-$(python3 -c 'from jax_kernels.bench import CASES; print(",".join(CASES))')}" \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
