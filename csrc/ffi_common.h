// Helpers shared by the CPU and CUDA FFI handlers (host code only).
#pragma once

#include <string>
#include <utility>

#include "jax_gin/common.h"
#include "host_types.h"
#include "jax_gin/collectives.h"
#include "jax_gin/message.h"
#include "jax_gin/norm.h"
#include "xla/ffi/api/ffi.h"

namespace jax_gin {

// The "comm" attribute of every jax_gin custom call (_runtime.comm_attribute): the
// communicator's id in its low 32 bits and, above them, its fingerprint (_runtime._free_id
// says how both are chosen). A program that runs in a process that did not lower it (a
// serialized executable, an exported module) finds its communicator where that process set it
// up; where the id there is another communicator's, the fingerprint check turns that into an
// error instead of a reduction over other groups.
inline int64_t comm_id(int64_t attr) { return attr & 0xffffffffLL; }
inline uint32_t comm_fingerprint(int64_t attr) { return uint32_t(uint64_t(attr) >> 32); }
// Whether `c`, what this process has under comm_id(attr) (a CPU communicator or a GPU rank's
// state; nullptr where it has none), is the communicator that `attr` names.
template <class C>
bool names_comm(const C* c, int64_t attr) {
  return c != nullptr && c->fingerprint == comm_fingerprint(attr);
}

// The error of a call whose communicator this process does not have (no communicator of that
// id, or one with another fingerprint).
inline xla::ffi::Error missing_comm(int64_t attr) {
  return xla::ffi::Error::Internal(
      "jax_gin: this program's communicator " + std::to_string(comm_id(attr)) +
      " (fingerprint " + std::to_string(comm_fingerprint(attr)) +
      ") does not exist in this process: jax_gin.runtime.reset() destroyed it, or the program "
      "was lowered in another process (a serialized executable or an exported module) and "
      "this process has not set that communicator up. Call the jitted function again, so that "
      "JAX lowers it in this process; a jax_gin program runs where a lowering has set up its "
      "communicators (the same mesh, axes and shared settings, after as many "
      "jax_gin.runtime.reset() calls)");
}

// "float32, float64, ...": every supported element type.
inline std::string supported_dtype_names() {
  std::string s;
  for (int t = 0; t < kNumDTypes; ++t) s += std::string(t ? ", " : "") + dtype_name(DType(t));
  return s;
}

inline xla::ffi::Error to_dtype(xla::ffi::DataType t, DType* out) {
  switch (t) {
#define JG_CASE(E, ...) case xla::ffi::DataType::E: *out = DType::k##E; return xla::ffi::Error::Success();
    JAX_GIN_DTYPES(JG_CASE)
#undef JG_CASE
    default:
      return xla::ffi::Error::InvalidArgument("jax_gin: unsupported element type " +
                                              std::to_string(int(t)) + " (supported: " +
                                              supported_dtype_names() + ")");
  }
}

inline xla::ffi::Error check_enums(int32_t op, int32_t algorithm) {
  if (op < 0 || op >= kNumRedOps)
    return xla::ffi::Error::InvalidArgument("jax_gin: unknown reduction op " + std::to_string(op));
  if (algorithm < 0 || algorithm >= kNumAlgorithms)
    return xla::ffi::Error::InvalidArgument("jax_gin: unknown algorithm id " +
                                            std::to_string(algorithm));
  return xla::ffi::Error::Success();
}

// The buffers of one call: operand i is reduced into result i, all of one element type (the
// lowering groups a pytree's leaves by dtype). Fills seg[0..*nseg) with counts and pointers.
inline xla::ffi::Error collect_segments(const xla::ffi::RemainingArgs& args,
                                        xla::ffi::RemainingRets& rets, Segment* seg, int* nseg,
                                        DType* dtype) {
  namespace ffi = xla::ffi;
  const size_t n = args.size();
  if (n < 1 || n > size_t(kMaxSegments) || rets.size() != n)
    return ffi::Error::InvalidArgument("jax_gin: " + std::to_string(n) + " operands and " +
                                       std::to_string(rets.size()) + " results in one call (1.." +
                                       std::to_string(kMaxSegments) + " of each, as many results as operands)");
  for (size_t i = 0; i < n; ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (y.has_error()) return y.error();
    DType t;
    if (ffi::Error err = to_dtype(x->element_type(), &t); err.failure()) return err;
    if (i == 0) *dtype = t;
    if (t != *dtype || (*y)->element_type() != x->element_type() ||
        (*y)->element_count() != x->element_count())
      return ffi::Error::InvalidArgument("jax_gin: operand " + std::to_string(i) +
                                         " differs in element type or size from the others or its result");
    seg[i] = Segment{0, x->element_count(), x->untyped_data(), (*y)->untyped_data()};
  }
  *nseg = int(n);
  return ffi::Error::Success();
}

// The buffers of a reduce-scatter (call_op kOpReduceScatter: x holds nranks blocks, y one) or
// all-gather (kOpAllGather: the other way round), of one element type; the algorithm one of
// theirs (collectives.h). Fills *dtype and *block (elements per block).
inline xla::ffi::Error check_collective(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& y,
                                        int32_t call_op, int32_t algorithm, int nranks,
                                        DType* dtype, size_t* block) {
  namespace ffi = xla::ffi;
  if (call_op != kOpReduceScatter && call_op != kOpAllGather)
    return ffi::Error::InvalidArgument("jax_gin: unknown collective op " + std::to_string(call_op));
  if (algorithm < 0 || algorithm >= kNumAlgorithms || !schedule::coll_supported(Algorithm(algorithm)))
    return ffi::Error::InvalidArgument("jax_gin: algorithm id " + std::to_string(algorithm) +
                                       " is not one of " + call_op_name(call_op) + "'s");
  if (ffi::Error err = to_dtype(x.element_type(), dtype); err.failure()) return err;
  const size_t small = call_op == kOpReduceScatter ? y.element_count() : x.element_count();
  const size_t large = call_op == kOpReduceScatter ? x.element_count() : y.element_count();
  if (y.element_type() != x.element_type() || large != small * size_t(nranks) ||
      (small * dtype_size(*dtype)) % kAlignBytes != 0)
    return ffi::Error::InvalidArgument(
        std::string("jax_gin: ") + call_op_name(call_op) + " over " + std::to_string(nranks) +
        " ranks takes blocks of a multiple of 16 bytes, the large side nranks blocks, of one "
        "element type; got " + std::to_string(x.element_count()) + " -> " +
        std::to_string(y.element_count()) + " elements");
  *block = small;
  return ffi::Error::Success();
}

// "psum_add_rmsnorm: ... " (or layernorm) for an element type without a norm (norm.h).
inline std::string norm_dtype_error(DType t, bool layer) {
  return std::string("jax_gin: ") + (layer ? "psum_add_layernorm" : "psum_add_rmsnorm") +
         " supports float32, bfloat16 and float16, not " + dtype_name(t);
}

// The buffers of psum_add_rmsnorm and psum_add_layernorm: x, residual, normed and
// new_residual of one element type and shape (..., d), weight and (LayerNorm) bias (d,) of
// that type; bias null for RMSNorm. Fills *dtype, *rows and *d.
inline xla::ffi::Error check_norm_buffers(const xla::ffi::AnyBuffer& x,
                                          const xla::ffi::AnyBuffer& residual,
                                          const xla::ffi::AnyBuffer& weight,
                                          const xla::ffi::AnyBuffer* bias,
                                          const xla::ffi::AnyBuffer& normed,
                                          const xla::ffi::AnyBuffer& new_residual, DType* dtype,
                                          size_t* rows, size_t* d) {
  namespace ffi = xla::ffi;
  if (ffi::Error err = to_dtype(x.element_type(), dtype); err.failure()) return err;
  const bool norm_type = with_dtype<HostElem>(
      *dtype, false, [](auto tag) { return NormElem<typename decltype(tag)::type>::ok; });
  if (!norm_type) return ffi::Error::InvalidArgument(norm_dtype_error(*dtype, bias != nullptr));
  auto dims = x.dimensions();
  auto is_row = [&](const ffi::AnyBuffer& v) {
    return v.element_type() == x.element_type() && v.dimensions().size() == 1 &&
           dims.size() >= 1 && v.dimensions()[0] == dims[dims.size() - 1];
  };
  const bool same = residual.element_type() == x.element_type() &&
                    normed.element_type() == x.element_type() &&
                    new_residual.element_type() == x.element_type() &&
                    residual.element_count() == x.element_count() &&
                    normed.element_count() == x.element_count() &&
                    new_residual.element_count() == x.element_count();
  if (!same || !is_row(weight) || (bias != nullptr && !is_row(*bias)))
    return ffi::Error::InvalidArgument(
        std::string("jax_gin: ") + (bias ? "psum_add_layernorm" : "psum_add_rmsnorm") +
        " takes x and residual of one shape (..., d) and a weight" + (bias ? " and a bias" : "") +
        " (d,), all of one element type");
  *d = size_t(dims[dims.size() - 1]);
  *rows = *d == 0 ? 0 : x.element_count() / *d;
  return ffi::Error::Success();
}

// The fused norms' FFI binding, written once for both platforms. After the platform's own head
// (its contexts, the partition id and the order token): x, residual, weight; LayerNorm then
// adds its bias as one more operand. After the order token result: the rest below.
template <class Binding>
auto norm_operands(Binding b) {
  return std::move(b)
      .template Arg<xla::ffi::AnyBuffer>()   // x (..., d): summed over the group
      .template Arg<xla::ffi::AnyBuffer>()   // residual (..., d)
      .template Arg<xla::ffi::AnyBuffer>();  // weight (d,)
}
template <class Binding>
auto norm_results(Binding b) {
  return std::move(b)
      .template Ret<xla::ffi::AnyBuffer>()  // normed (..., d)
      .template Ret<xla::ffi::AnyBuffer>()  // new residual (..., d)
      .template Attr<int64_t>("comm")       // communicator id (runtime)
      .template Attr<int32_t>("algorithm")
      .template Attr<float>("eps");
}

}  // namespace jax_gin
