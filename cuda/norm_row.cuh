// One row of psum_add_rmsnorm's or psum_add_layernorm's norm on the GPU (norm.h), shared by the
// epilogue kernel (fused_norm.cu) and the one-kernel LL path (kernels_impl.cuh), so both give
// the same bits: a row's sums are taken in one fixed order (per thread in column order with
// kNormThreads threads, then a butterfly over each warp and over the warps), so every rank
// computes the same bits too.
#pragma once

#include "device_types.cuh"
#include "jax_gin/norm.h"

namespace jax_gin {
namespace gpu {

constexpr int kNormThreads = 256;  // threads that work on a row; a block may have more

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The sum over the block's first kNormThreads threads of `acc` (0 on the others), in the fixed
// order above; every thread gets it. Called by every thread of the block.
__device__ __forceinline__ float norm_block_sum(float acc) {
  __shared__ float part[kNormThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  acc = warp_sum(acc);
  if (lane == 0 && warp < kNormThreads / 32) part[warp] = acc;
  __syncthreads();
  const float total = warp_sum(lane < kNormThreads / 32 ? part[lane] : 0.0f);
  __syncthreads();  // `part` may be written again by the next row
  return total;
}

// The norm of the row whose new residual is `nr` (d elements) into `out` (norm.h): RMSNorm
// times `w`, or with a bias `b` LayerNorm, whose mean is one more sum over the block before
// the sum of squares. Called by every thread of the block; threads >= kNormThreads only wait.
template <class T>
__device__ void norm_row(const T* nr, const T* w, const T* b, T* out, size_t d, float eps) {
  float mean = 0.0f;
  if (b != nullptr) {
    float acc = 0.0f;
    if (threadIdx.x < kNormThreads)
      for (size_t i = threadIdx.x; i < d; i += kNormThreads) acc += Widen<T>::up(nr[i]);
    mean = norm_block_sum(acc) / float(d);
  }
  float acc = 0.0f;
  if (threadIdx.x < kNormThreads)
    for (size_t i = threadIdx.x; i < d; i += kNormThreads) {
      const float c = Widen<T>::up(nr[i]) - mean;
      acc += c * c;
    }
  const float inv = inv_rms(norm_block_sum(acc), d, eps);
  if (threadIdx.x < kNormThreads)
    for (size_t i = threadIdx.x; i < d; i += kNormThreads) {
      const float c = Widen<T>::up(nr[i]) - mean;
      out[i] = b != nullptr ? scale_shift(c, inv, w[i], b[i]) : scale(c, inv, w[i]);
    }
}

}  // namespace gpu
}  // namespace jax_gin
