// The epilogue of psum_add_rmsnorm and psum_add_layernorm on the GPU: after the all-reduce has
// written the sum into new_residual, each row's group of threads adds the residual and
// normalizes the row (norm_row.cuh). A block holds one group, or several short rows' groups, so
// that no block is smaller than kMinBlock threads.
#include "kernels.h"
#include "norm_row.cuh"

#include <climits>

namespace jax_gin {
namespace gpu {
namespace {

constexpr int kMinBlock = 128;

template <class T>
__global__ void __launch_bounds__(kNormBlock)
add_norm_kernel(const T* res, T* nr, const T* __restrict__ w, const T* __restrict__ b,
                T* __restrict__ out, size_t rows, size_t d, float eps) {
  const size_t per_block = blockDim.x / norm_row_threads<T>(d), r0 = blockIdx.x * per_block;
  norm_rows(res, nr, w, b, out, r0, r0 + per_block < rows ? r0 + per_block : rows, d, eps);
}

}  // namespace

cudaError_t launch_add_norm(DType dtype, const void* residual, void* new_residual,
                            const void* weight, const void* bias, void* normed, size_t rows,
                            size_t d, float eps, cudaStream_t stream) {
  if (rows == 0 || d == 0) return cudaSuccess;
  if (rows > size_t(INT_MAX)) return cudaErrorInvalidValue;
  return with_dtype<DeviceElem>(dtype, cudaErrorInvalidValue, [&](auto tag) -> cudaError_t {
    using T = typename decltype(tag)::type;
    if constexpr (NormElem<T>::ok) {
      const int threads = norm_row_threads<T>(d), block = threads > kMinBlock ? threads : kMinBlock;
      const size_t per_block = size_t(block / threads), blocks = (rows + per_block - 1) / per_block;
      add_norm_kernel<T><<<unsigned(blocks), block, 0, stream>>>(
          static_cast<const T*>(residual), static_cast<T*>(new_residual),
          static_cast<const T*>(weight), static_cast<const T*>(bias), static_cast<T*>(normed), rows,
          d, eps);
      return cudaGetLastError();
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

// Loads add_norm_kernel of every type it has (preload_kernels).
cudaError_t preload_add_norm() {
  for (int dt = 0; dt < kNumDTypes; ++dt) {
    const cudaError_t e = with_dtype<DeviceElem>(DType(dt), cudaErrorInvalidValue, [](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (NormElem<T>::ok) {
        cudaFuncAttributes a;
        return cudaFuncGetAttributes(&a, add_norm_kernel<T>);
      } else {
        return cudaSuccess;
      }
    });
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace gpu
}  // namespace jax_gin
