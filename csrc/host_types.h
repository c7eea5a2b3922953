// Host-side element types and reduction ops for the CPU backend.
// bfloat16 and float16 are reduced by widening to float and rounding back to nearest-even
// after every pairwise op, as NCCL does on the GPU; integer-valued inputs therefore give the
// exact bits that lax gives.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jax_gin {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

struct bf16 {
  uint16_t bits;
  static bf16 from_float(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
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

template <class T> struct Widen { using type = T; static T up(T x) { return x; } static T down(T x) { return x; } };
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

template <class W> inline bool is_nan(W x) { return x != x; }

struct HostSum {
  template <class T> static T apply(T a, T b) {
    using W = Widen<T>;
    return W::down(W::up(a) + W::up(b));
  }
};
// max/min propagate NaN, like XLA's maximum/minimum.
struct HostMax {
  template <class T> static T apply(T a, T b) {
    using W = Widen<T>;
    auto x = W::up(a), y = W::up(b);
    if (is_nan(x)) return a;
    if (is_nan(y)) return b;
    return x < y ? b : a;
  }
};
struct HostMin {
  template <class T> static T apply(T a, T b) {
    using W = Widen<T>;
    auto x = W::up(a), y = W::up(b);
    if (is_nan(x)) return a;
    if (is_nan(y)) return b;
    return y < x ? b : a;
  }
};

}  // namespace jax_gin
