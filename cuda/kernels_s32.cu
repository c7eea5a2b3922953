// Instantiations of the all-reduce kernels for int32_t.
#include "kernels_impl.cuh"

namespace jax_gin {
namespace gpu {
JAX_GIN_INSTANTIATE(int32_t)
}  // namespace gpu
}  // namespace jax_gin
