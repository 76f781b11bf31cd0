// Independent launches spread over the stream XLA hands a handler and a few side streams forked
// off it, so that launches each too small to fill the GPU (a strided dgrad's stride phases, whose
// last wave leaves most multiprocessors idle) fill each other's tails. The side streams wait for
// the stream's earlier work (an event recorded on it) and the stream's later work waits for
// theirs (an event recorded on each): the order XLA sees is the stream's alone. Under CUDA graph
// capture (XLA's command buffers) the same fork and join are captured as graph edges.
//
// Each (device, stream) pair gets its own side streams and events, created on first use and kept
// for the process (never destroyed: no teardown order against the CUDA runtime at exit); a mutex
// keeps one fork-join sequence at a time on them. Where they cannot be created, the launches run
// on the stream alone, in order. Launches on different streams must not write the same memory:
// the results are then the same bits whichever order the GPU runs them in.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "common/status.h"

namespace jax_kernels {

constexpr int kMaxSideStreams = 3;

struct SideStreams {
  std::mutex mutex;
  cudaStream_t side[kMaxSideStreams] = {};
  cudaEvent_t fork = nullptr;
  cudaEvent_t join[kMaxSideStreams] = {};
};

// The side streams of `stream` on the current device, or nullptr where they cannot be made.
inline SideStreams* side_streams(cudaStream_t stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  static std::mutex registry_mutex;
  static auto* registry = new std::map<std::pair<int, cudaStream_t>, SideStreams*>;
  std::lock_guard<std::mutex> lock(registry_mutex);
  SideStreams*& entry = (*registry)[{device, stream}];
  if (entry != nullptr) return entry;
  // Creating streams and events queues nothing, but a global-mode capture in progress refuses
  // such calls: relaxed mode while they are made, then the caller's mode back.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  auto* made = new SideStreams;
  int priority = 0;
  bool ok = cudaStreamGetPriority(stream, &priority) == cudaSuccess &&
            cudaEventCreateWithFlags(&made->fork, cudaEventDisableTiming) == cudaSuccess;
  for (int i = 0; ok && i < kMaxSideStreams; ++i)
    ok = cudaStreamCreateWithPriority(&made->side[i], cudaStreamNonBlocking, priority) ==
             cudaSuccess &&
         cudaEventCreateWithFlags(&made->join[i], cudaEventDisableTiming) == cudaSuccess;
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (!ok) {
    cudaGetLastError();
    return nullptr;  // (what was made is leaked; the next call tries again)
  }
  entry = made;
  return entry;
}

// Runs launch(i, s) for i in [0, count), each on a stream s: `stream` and up to lanes - 1 side
// streams, round robin (launch i on lane i mod lanes), all after the stream's earlier work and
// before its later work. Returns the first launch's failure, after the join (a capture in
// progress needs every forked stream joined back).
template <class Launch>
ffi::Error run_on_lanes(const char* op, cudaStream_t stream, int count, int lanes,
                        Launch&& launch) {
  lanes = std::min({lanes, count, kMaxSideStreams + 1});
  SideStreams* sides = lanes > 1 ? side_streams(stream) : nullptr;
  if (sides == nullptr) {
    for (int i = 0; i < count; ++i)
      if (ffi::Error e = launch(i, stream); e.failure()) return e;
    return ffi::Error::Success();
  }
  std::lock_guard<std::mutex> lock(sides->mutex);
  if (cudaError_t e = cudaEventRecord(sides->fork, stream); e != cudaSuccess)
    return cuda_status(op, e);
  int forked = 0;  // side streams that joined the fork
  while (forked < lanes - 1 &&
         cudaStreamWaitEvent(sides->side[forked], sides->fork, 0) == cudaSuccess)
    ++forked;
  if (forked < lanes - 1) cudaGetLastError();  // a refused wait leaves its lanes to the stream
  ffi::Error first = ffi::Error::Success();
  for (int i = 0; i < count && first.success(); ++i) {
    const int lane = i % (forked + 1);
    first = launch(i, lane == 0 ? stream : sides->side[lane - 1]);
  }
  cudaError_t joined = cudaSuccess;
  for (int s = 0; s < forked; ++s) {
    cudaError_t e = cudaEventRecord(sides->join[s], sides->side[s]);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, sides->join[s], 0);
    if (e != cudaSuccess && joined == cudaSuccess) joined = e;
  }
  if (first.failure()) return first;
  return cuda_status(op, joined);
}

}  // namespace jax_kernels
