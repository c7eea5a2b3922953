// Instantiations of the all-reduce kernels for __nv_bfloat16.
#include "kernels_impl.cuh"

namespace jax_gin {
namespace gpu {
JAX_GIN_INSTANTIATE(__nv_bfloat16)
}  // namespace gpu
}  // namespace jax_gin
