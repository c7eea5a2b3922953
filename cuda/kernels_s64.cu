// Instantiations of the all-reduce kernels for int64_t.
#include "kernels_impl.cuh"

namespace jax_gin {
namespace gpu {
JAX_GIN_INSTANTIATE(int64_t)
}  // namespace gpu
}  // namespace jax_gin
