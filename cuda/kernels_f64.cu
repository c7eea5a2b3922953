// Instantiations of the all-reduce kernels for double.
#include "kernels_impl.cuh"

namespace jax_gin {
namespace gpu {
JAX_GIN_INSTANTIATE(double)
}  // namespace gpu
}  // namespace jax_gin
