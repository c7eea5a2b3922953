// Host-side element types of the CPU backend. bfloat16 and float16 are reduced in float
// (Widen, reduce.h) and rounded back to nearest-even once per reduction pass (each hop of ring
// and tree rounds once), as on the GPU; integer-valued inputs therefore give the exact bits
// that lax gives.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "jax_gin/common.h"
#include "jax_gin/reduce.h"

namespace jax_gin {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

struct bf16 {
  uint16_t bits;
  static bf16 from_float(float f) {
    uint32_t u = f32_bits(f);
    // a NaN becomes the quiet NaN of its sign, payload dropped, as XLA's CPU rounding gives
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t(((u >> 16) & 0x8000u) | 0x7fc0u)};
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return bf16{uint16_t(u >> 16)};
  }
  float to_float() const { return bits_f32(uint32_t(bits) << 16); }
};

struct f16 {
  uint16_t bits;
  static f16 from_float(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};        // NaN
    if (a >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};       // overflow -> inf
    if (a < 0x38800000u) {                                           // subnormal or zero
      // scale into the subnormal grid (2^-24 per unit) and round to nearest even
      float m = bits_f32(a) * 16777216.0f;  // * 2^24
      float r = std::nearbyint(m);
      return f16{uint16_t(sign | uint16_t(r))};
    }
    uint32_t mant = a & 0x7fffffu;
    uint32_t exp = (a >> 23) - 112u;  // rebias 127 -> 15
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // may carry into exponent: ok
    return f16{uint16_t(sign | h)};
  }
  float to_float() const {
    uint32_t sign = uint32_t(bits & 0x8000u) << 16;
    uint32_t exp = (bits >> 10) & 0x1fu, mant = bits & 0x3ffu;
    if (exp == 0) {
      float f = float(mant) / 16777216.0f;  // * 2^-24
      return sign ? -f : f;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  }
};

template <> struct Widen<bf16> {
  using type = float;
  static float up(bf16 x) { return x.to_float(); }
  static bf16 down(float x) { return bf16::from_float(x); }
};
template <> struct Widen<f16> {
  using type = float;
  static float up(f16 x) { return x.to_float(); }
  static f16 down(float x) { return f16::from_float(x); }
};

// The CPU backend's element type of each DType (the host_type of JAX_GIN_DTYPES), for
// with_dtype<HostElem>.
template <DType> struct HostElem;
#define JG_HOST_ELEM(E, code, name, short_name, host, device, bytes) \
  template <> struct HostElem<DType::k##E> { using type = host; };    \
  static_assert(sizeof(host) == bytes, #host " is not " #bytes " bytes");
JAX_GIN_DTYPES(JG_HOST_ELEM)
#undef JG_HOST_ELEM

}  // namespace jax_gin
