// XLA FFI handlers for the CPU backend. Execute-only: they look up the communicator that the
// Python runtime built before the program ran, and run this device's rank on its thread.
// A CPU device runs its program on one thread, so the asynchronous pair of the GPU is
// synchronous here: the start reduces, the done returns its operands (aliased).
#include "ffi_cpu.h"

#include <cstring>
#include <string>

#include "cpu_backend.h"
#include "ffi_common.h"

namespace ffi = xla::ffi;

namespace jax_gin {
namespace {

ffi::Error CpuAllReduceImpl(ffi::Buffer<ffi::U32> partition_id, ffi::Buffer<ffi::U32> order_in,
                            ffi::RemainingArgs xs, ffi::Result<ffi::Buffer<ffi::U32>> order_out,
                            ffi::RemainingRets outs, int64_t comm, int32_t op, int32_t algorithm) {
  (void)order_in;
  order_out->typed_data()[0] = 0;
  DType dtype;
  Segment seg[kMaxSegments];
  int nseg = 0;
  if (ffi::Error err = collect_segments(xs, outs, seg, &nseg, &dtype); err.failure()) return err;
  if (ffi::Error err = check_enums(op, algorithm); err.failure()) return err;
  auto c = cpu::find_comm(comm);
  if (!c) {
    return ffi::Error::Internal("jax_gin: communicator " + std::to_string(comm) +
                                " does not exist (was jax_gin.runtime.reset() called after "
                                "compilation?)");
  }
  const uint32_t logical_id = partition_id.typed_data()[0];
  std::string err = cpu::allreduce_logical(*c, logical_id, dtype, RedOp(op), Algorithm(algorithm),
                                           seg, nseg);
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

ffi::Error CpuAllReduceStartImpl(ffi::Buffer<ffi::U32> partition_id, ffi::Buffer<ffi::U32> order_in,
                                 ffi::RemainingArgs xs, ffi::Result<ffi::Buffer<ffi::U32>> order_out,
                                 ffi::RemainingRets outs, int64_t comm, int32_t op,
                                 int32_t algorithm, int32_t max_lanes, int32_t slot) {
  (void)max_lanes;  // one lane per rank on the CPU
  (void)slot;
  return CpuAllReduceImpl(partition_id, order_in, xs, order_out, outs, comm, op, algorithm);
}

ffi::Error CpuAllReduceDoneImpl(ffi::Buffer<ffi::U32> order_in, ffi::RemainingArgs operands,
                                ffi::Result<ffi::Buffer<ffi::U32>> order_out,
                                ffi::RemainingRets outs, int64_t comm, int32_t slot) {
  (void)order_in;
  (void)comm;
  (void)slot;
  order_out->typed_data()[0] = 0;
  // outs alias the first operands (the start's results); copy only if XLA did not alias them
  for (size_t i = 0; i < outs.size(); ++i) {
    auto src = operands.get<ffi::AnyBuffer>(i);
    auto dst = outs.get<ffi::AnyBuffer>(i);
    if (src.has_error()) return src.error();
    if (dst.has_error()) return dst.error();
    if ((*dst)->untyped_data() != src->untyped_data())
      std::memcpy((*dst)->untyped_data(), src->untyped_data(), src->size_bytes());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_gin

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAllReduce, jax_gin::CpuAllReduceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (logical id)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // order token of the previous call
                                  .RemainingArgs()                // x_0..x_k: buffers of one dtype
                                  .Ret<ffi::Buffer<ffi::U32>>()   // order token for the next call
                                  .RemainingRets()                // their reductions, in order
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // RedOp
                                  .Attr<int32_t>("algorithm"));   // Algorithm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAllReduceStart, jax_gin::CpuAllReduceStartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (logical id)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // order token of the previous call
                                  .RemainingArgs()                // x_0..x_k: buffers of one dtype
                                  .Ret<ffi::Buffer<ffi::U32>>()   // order token for the next call
                                  .RemainingRets()                // their reductions
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // RedOp
                                  .Attr<int32_t>("algorithm")     // Algorithm
                                  .Attr<int32_t>("max_lanes")     // GPU lane cap (unused here)
                                  .Attr<int32_t>("slot"));        // GPU event slot (unused here)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAllReduceDone, jax_gin::CpuAllReduceDoneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // order token of the start
                                  .RemainingArgs()                // the start's results
                                  .Ret<ffi::Buffer<ffi::U32>>()   // order token for the next call
                                  .RemainingRets()                // the reductions (aliased)
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("slot"));        // GPU event slot (unused here)
