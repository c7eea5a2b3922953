// XLA FFI handler for the CPU backend. Execute-only: it looks up the communicator that the
// Python runtime built before the program ran, and runs this device's rank on its thread.
#include "ffi_cpu.h"

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
