// Instantiations of the all-reduce kernels for float.
#include "kernels_impl.cuh"

namespace jax_gin {
namespace gpu {
JAX_GIN_INSTANTIATE(float)
}  // namespace gpu
}  // namespace jax_gin
