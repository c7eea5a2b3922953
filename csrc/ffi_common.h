// Helpers shared by the CPU and CUDA FFI handlers (host code only).
#pragma once

#include <string>

#include "jax_gin/common.h"
#include "xla/ffi/api/ffi.h"

namespace jax_gin {

inline xla::ffi::Error to_dtype(xla::ffi::DataType t, DType* out) {
  using xla::ffi::DataType;
  switch (t) {
    case DataType::F32: *out = DType::kF32; break;
    case DataType::F64: *out = DType::kF64; break;
    case DataType::BF16: *out = DType::kBF16; break;
    case DataType::F16: *out = DType::kF16; break;
    case DataType::S32: *out = DType::kS32; break;
    case DataType::S64: *out = DType::kS64; break;
    case DataType::U32: *out = DType::kU32; break;
    default:
      return xla::ffi::Error::InvalidArgument(
          "jax_gin: unsupported element type " + std::to_string(int(t)) +
          " (supported: float32, float64, bfloat16, float16, int32, int64, uint32)");
  }
  return xla::ffi::Error::Success();
}

inline xla::ffi::Error check_enums(int32_t op, int32_t algorithm) {
  if (op < 0 || op > 2)
    return xla::ffi::Error::InvalidArgument("jax_gin: unknown reduction op " + std::to_string(op));
  if (algorithm < 0 || algorithm >= kNumAlgorithms)
    return xla::ffi::Error::InvalidArgument("jax_gin: unknown algorithm id " +
                                            std::to_string(algorithm));
  return xla::ffi::Error::Success();
}

}  // namespace jax_gin
