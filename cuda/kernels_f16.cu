// Instantiations of the all-reduce kernels for __half.
#include "kernels_impl.cuh"

namespace jax_gin {
namespace gpu {
JAX_GIN_INSTANTIATE(__half)
}  // namespace gpu
}  // namespace jax_gin
