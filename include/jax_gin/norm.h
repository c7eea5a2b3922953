// The epilogues of psum_add_rmsnorm and psum_add_layernorm, shared by the CPU backend and the
// CUDA kernels: per row of d elements, new_residual = residual + sum (rounded to the element
// type T), and with r = float(new_residual), all in float:
//   RMSNorm:   inv = rsqrt(sum(r * r) / d + eps),            normed = T(T(r * inv) * weight)
//   LayerNorm: mean = sum(r) / d, c = r - mean,
//              inv = rsqrt(sum(c * c) / d + eps),            normed = T(T(T(c * inv) * weight) + bias)
// the rsqrt correctly rounded. Only the element types that accumulate in float (Widen, reduce.h)
// have them: float32, bfloat16 and float16. Compiles with a plain C++17 compiler and with nvcc.
#pragma once

#include <cmath>
#include <cstddef>
#include <type_traits>

#include "jax_gin/common.h"
#include "jax_gin/reduce.h"

namespace jax_gin {

template <class T> struct NormElem {
  static constexpr bool ok = std::is_same<typename Widen<T>::type, float>::value;
};

// residual + sum, rounded to T once (as residual + psum(x) in T is).
template <class T> JG_HD T add_residual(T residual, T sum) {
  return Widen<T>::down(Widen<T>::up(residual) + Widen<T>::up(sum));
}

// rsqrt(sum_sq / d + eps) with each step rounded to float, and the rsqrt rounded once to float
// from a double 1 / sqrt: a definite result (XLA's and CUDA's float rsqrt are approximate),
// the same on the host and on the device. Once per row, so its cost does not matter.
JG_HD float inv_rms(float sum_sq, size_t d, float eps) {
  const float v = sum_sq / float(d) + eps;
  return float(1.0 / sqrt(double(v)));
}

// a * b rounded to float on its own. A compiler may contract a product and the add after it
// into one fused multiply-add, which rounds once: nvcc does by default (-fmad=true), as host
// compilers may where the target has FMA (CMakeLists.txt turns that off for the host code).
JG_HD float mul_rounded(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// T(r * inv) * weight: the product rounded to T, then the product with the weight in T.
template <class T> JG_HD T scale(float r, float inv, T weight) {
  const T n = Widen<T>::down(r * inv);
  return Widen<T>::down(mul_rounded(Widen<T>::up(n), Widen<T>::up(weight)));
}

// T(T(T(c * inv) * weight) + bias): LayerNorm's affine step, rounded as each jnp operation
// in T rounds.
template <class T> JG_HD T scale_shift(float c, float inv, T weight, T bias) {
  return Widen<T>::down(Widen<T>::up(scale(c, inv, weight)) + Widen<T>::up(bias));
}

// One row on the host: `nr` holds the row's sum on entry and new_residual on return; `b`:
// LayerNorm's bias, or null for RMSNorm. Every sum runs in element order, in double, and is
// rounded to float once at its end: a float accumulator in element order loses accuracy as d
// grows (LayerNorm rows of mean 24 at d = 16384: normed 1.6e-5 from the float64 value, where
// jnp's was 1.4e-6; tests/test_fused.py). Where the sum is exact in float (exact inputs) the
// result is the same bits.
template <class T>
inline void add_norm_row(const T* res, T* nr, const T* w, const T* b, T* out, size_t d, float eps) {
  double sum = 0.0;  // LayerNorm's only
  for (size_t i = 0; i < d; ++i) {
    nr[i] = add_residual(res[i], nr[i]);
    if (b) sum += double(Widen<T>::up(nr[i]));
  }
  const float mean = b ? float(sum) / float(d) : 0.0f;
  double sum_sq = 0.0;
  for (size_t i = 0; i < d; ++i) {
    const float c = Widen<T>::up(nr[i]) - mean;
    sum_sq += double(c * c);
  }
  const float inv = inv_rms(float(sum_sq), d, eps);
  for (size_t i = 0; i < d; ++i) {
    const float c = Widen<T>::up(nr[i]) - mean;
    out[i] = b ? scale_shift(c, inv, w[i], b[i]) : scale(c, inv, w[i]);
  }
}

}  // namespace jax_gin
