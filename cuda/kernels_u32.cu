// Instantiations of the all-reduce kernels for uint32_t.
#include "kernels_impl.cuh"

namespace jax_gin {
namespace gpu {
JAX_GIN_INSTANTIATE(uint32_t)
}  // namespace gpu
}  // namespace jax_gin
