#!/usr/bin/env bash
# Development build: compiles the native modules with CMake into build/inplace and copies them
# next to the Python sources, so `python -m pytest` from the repository root uses this checkout
# (no pip install needed). Pass -DJAX_KERNELS_CUDA=OFF to skip the CUDA module, or
# -DCMAKE_CUDA_ARCHITECTURES=90 to build one architecture.
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/inplace
cmake -S . -B "$build" -G Ninja -DPython_EXECUTABLE="$(command -v python3)" "$@" >/dev/null
cmake --build "$build"
cp "$build"/cpp/_cpu*.so jax_kernels/
if ls "$build"/cpp/_cuda*.so >/dev/null 2>&1; then cp "$build"/cpp/_cuda*.so jax_kernels/; else rm -f jax_kernels/_cuda*.so; fi
