// The kernels' element types: CUDA's 16-bit floats accumulate in float (Widen, reduce.h), like
// NCCL; DeviceElem maps each DType to its device type (JAX_GIN_DTYPES, common.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "jax_gin/common.h"
#include "jax_gin/reduce.h"

namespace jax_gin {

template <> struct Widen<__nv_bfloat16> {
  using type = float;
  __device__ static float up(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 down(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Widen<__half> {
  using type = float;
  __device__ static float up(__half x) { return __half2float(x); }
  __device__ static __half down(float x) { return __float2half_rn(x); }
};

namespace gpu {

// The kernels' element type of each DType (the device_type of JAX_GIN_DTYPES), for
// with_dtype<DeviceElem>.
template <DType> struct DeviceElem;
#define JG_DEVICE_ELEM(E, code, name, short_name, host, device, bytes) \
  template <> struct DeviceElem<DType::k##E> { using type = device; };  \
  static_assert(sizeof(device) == bytes, #device " is not " #bytes " bytes");
JAX_GIN_DTYPES(JG_DEVICE_ELEM)
#undef JG_DEVICE_ELEM

}  // namespace gpu
}  // namespace jax_gin
