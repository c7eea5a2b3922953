// The reduction functors of both backends: each reduces two values of the wide type, the one
// an element type accumulates in (Widen<T>::type: float for the 16-bit floats, the type itself
// otherwise). The caller widens the sources, accumulates, and rounds back once per reduction
// pass. Compiles with a plain C++17 compiler (the CPU backend) and with nvcc (the kernels:
// __host__ __device__).
#pragma once

#include <type_traits>

#include "jax_gin/common.h"

namespace jax_gin {

// The type an element type T accumulates in, and the conversions to and from it. The 16-bit
// floats specialize it with float: host_types.h (the CPU backend's bf16 and f16) and
// transport.cuh (CUDA's __nv_bfloat16 and __half).
template <class T> struct Widen {
  using type = T;
  static JG_HD T up(T x) { return x; }
  static JG_HD T down(T x) { return x; }
};

template <class W> JG_HD bool is_nan(W x) { return x != x; }

// One functor per RedOp (JAX_GIN_REDOPS). max and min propagate NaN, like XLA's maximum and
// minimum. Sum adds signed integers as their unsigned type: XLA's integer sums wrap, and a
// signed overflow in C++ is undefined (the 64-bit sum of uint64 values travels as int64).
struct Sum {
  template <class W> static JG_HD W apply(W a, W b) {
    if constexpr (std::is_integral<W>::value && std::is_signed<W>::value) {
      using U = typename std::make_unsigned<W>::type;
      return static_cast<W>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
struct Max {
  template <class W> static JG_HD W apply(W a, W b) {
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return a < b ? b : a;
  }
};
struct Min {
  template <class W> static JG_HD W apply(W a, W b) {
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return b < a ? b : a;
  }
};

// Calls f(Op{}) with the functor of `op` and returns its result; `otherwise` for an unknown op.
template <class R, class F>
R with_redop(RedOp op, R otherwise, F&& f) {
  switch (op) {
#define JG_CASE(E, ...) case RedOp::k##E: return f(E{});
    JAX_GIN_REDOPS(JG_CASE)
#undef JG_CASE
  }
  return otherwise;
}

// f(Op{}) for every op, in code order, stopping at the first result that is not `ok`.
template <class R, class F>
R for_each_redop(R ok, F&& f) {
  R r = ok;
#define JG_EACH(E, ...) if (r == ok) r = f(E{});
  JAX_GIN_REDOPS(JG_EACH)
#undef JG_EACH
  return r;
}

}  // namespace jax_gin
