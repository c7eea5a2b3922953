// The epilogue of psum_add_rmsnorm and psum_add_layernorm on the GPU: after the all-reduce has
// written the sum into new_residual, one CTA per row adds the residual and normalizes the row
// (norm_row.cuh).
#include "kernels.h"
#include "norm_row.cuh"

#include <climits>

namespace jax_gin {
namespace gpu {
namespace {

template <class T>
__global__ void __launch_bounds__(kNormThreads)
add_norm_kernel(const T* __restrict__ res, T* nr, const T* __restrict__ w,
                const T* __restrict__ b, T* __restrict__ out, size_t d, float eps) {
  const size_t row = blockIdx.x;
  res += row * d;
  nr += row * d;
  out += row * d;
  // each thread reads back, in norm_row, only the elements it writes here
  for (size_t i = threadIdx.x; i < d; i += kNormThreads) nr[i] = add_residual(res[i], nr[i]);
  norm_row(nr, w, b, out, d, eps);
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
      add_norm_kernel<T><<<unsigned(rows), kNormThreads, 0, stream>>>(
          static_cast<const T*>(residual), static_cast<T*>(new_residual),
          static_cast<const T*>(weight), static_cast<const T*>(bias), static_cast<T*>(normed), d,
          eps);
      return cudaGetLastError();
    } else {
      return cudaErrorInvalidValue;
    }
  });
}

}  // namespace gpu
}  // namespace jax_gin
