// One row of psum_add_rmsnorm's norm on the GPU (norm.h), shared by the epilogue kernel
// (fused_norm.cu) and the one-kernel LL path (kernels_impl.cuh), so both give the same bits:
// the squares of a row are summed in one fixed order (per thread in column order with
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

// out = T(r * inv) * w for the row whose new residual is `nr` (d elements), inv from the sum
// of its squares. Called by every thread of the block; threads >= kNormThreads only wait.
template <class T>
__device__ void norm_row(const T* nr, const T* w, T* out, size_t d, float eps) {
  float acc = 0.0f;
  if (threadIdx.x < kNormThreads)
    for (size_t i = threadIdx.x; i < d; i += kNormThreads) {
      const float r = Widen<T>::up(nr[i]);
      acc += r * r;
    }
  const float inv = inv_rms(norm_block_sum(acc), d, eps);
  if (threadIdx.x < kNormThreads)
    for (size_t i = threadIdx.x; i < d; i += kNormThreads) out[i] = scale(Widen<T>::up(nr[i]), inv, w[i]);
}

}  // namespace gpu
}  // namespace jax_gin
