// Tensor-core convolution path: not implemented yet, so it takes no problem and the direct
// kernels run everything.
#include "conv_dense.h"

namespace jax_kernels {

int64_t conv2d_dense_scratch_bytes(const ConvQuery&) { return -1; }

ffi::Error conv2d_dense(cudaStream_t, const ConvQuery&, const void*, const void*, const void*, void*,
                        void*, int64_t) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "conv2d: tensor-core path not built");
}

namespace {
int64_t conv2d_dense_scratch_query(const std::vector<int64_t>& arguments) {
  ConvQuery query;
  if (!parse_conv_query(arguments, &query)) return -1;
  return conv2d_dense_scratch_bytes(query);
}
}  // namespace

JK_REGISTER_QUERY("conv2d_dense_scratch", conv2d_dense_scratch_query);

}  // namespace jax_kernels
