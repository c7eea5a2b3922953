// The epilogue of psum_add_rmsnorm on the GPU: after the all-reduce has written the sum into
// new_residual, one CTA per row adds the residual and normalizes the row (norm.h). The
// squares of a row are summed in one fixed order (per thread in column order, then a
// butterfly over each warp and over the warps), so every rank computes the same bits.
#include "kernels.h"
#include "device_types.cuh"

#include "jax_gin/norm.h"

#include <climits>

namespace jax_gin {
namespace gpu {
namespace {

constexpr int kNormThreads = 256;

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <class T>
__global__ void __launch_bounds__(kNormThreads)
add_rmsnorm_kernel(const T* __restrict__ res, T* nr, const T* __restrict__ w,
                   T* __restrict__ out, size_t d, float eps) {
  const size_t row = blockIdx.x;
  res += row * d;
  nr += row * d;
  out += row * d;
  float acc = 0.0f;
  for (size_t i = threadIdx.x; i < d; i += kNormThreads) {
    const T v = add_residual(res[i], nr[i]);
    nr[i] = v;
    const float r = Widen<T>::up(v);
    acc += r * r;
  }
  __shared__ float part[kNormThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  acc = warp_sum(acc);
  if (lane == 0) part[warp] = acc;
  __syncthreads();
  acc = warp_sum(lane < kNormThreads / 32 ? part[lane] : 0.0f);
  const float inv = inv_rms(acc, d, eps);
  // each thread reads back only the elements it wrote above
  for (size_t i = threadIdx.x; i < d; i += kNormThreads) out[i] = scale(Widen<T>::up(nr[i]), inv, w[i]);
}

}  // namespace

cudaError_t launch_add_rmsnorm(DType dtype, const void* residual, void* new_residual,
                               const void* weight, void* normed, size_t rows, size_t d, float eps,
                               cudaStream_t stream) {
  if (rows == 0 || d == 0) return cudaSuccess;
  if (rows > size_t(INT_MAX)) return cudaErrorInvalidValue;
  return with_dtype<DeviceElem>(dtype, cudaErrorInvalidValue, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    if constexpr (NormElem<T>::ok) {
      add_rmsnorm_kernel<T><<<unsigned(rows), kNormThreads, 0, stream>>>(
          static_cast<const T*>(residual), static_cast<T*>(new_residual),
          static_cast<const T*>(weight), static_cast<T*>(normed), d, eps);
      return cudaGetLastError();
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

}  // namespace gpu
}  // namespace jax_gin
