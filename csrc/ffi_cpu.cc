// XLA FFI handler for the CPU backend. Execute-only: it looks up the communicator that the
// Python runtime built before the program ran, and runs this device's rank on its thread.
#include "ffi_cpu.h"

#include <string>

#include "cpu_backend.h"
#include "ffi_common.h"

namespace ffi = xla::ffi;

namespace jax_gin {
namespace {

ffi::Error CpuAllReduceImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> partition_id,
                            ffi::Buffer<ffi::U32> order_in, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::U32>> order_out, int64_t comm, int32_t op,
                            int32_t algorithm) {
  (void)order_in;
  order_out->typed_data()[0] = 0;
  DType dtype;
  if (ffi::Error err = to_dtype(x.element_type(), &dtype); err.failure()) return err;
  if (ffi::Error err = check_enums(op, algorithm); err.failure()) return err;
  auto c = cpu::find_comm(comm);
  if (!c) {
    return ffi::Error::Internal("jax_gin: communicator " + std::to_string(comm) +
                                " does not exist (was jax_gin.runtime.reset() called after "
                                "compilation?)");
  }
  const uint32_t logical_id = partition_id.typed_data()[0];
  std::string err = cpu::allreduce_logical(*c, logical_id, dtype, RedOp(op), Algorithm(algorithm),
                                           x.untyped_data(), out->untyped_data(),
                                           x.element_count());
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_gin

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAllReduce, jax_gin::CpuAllReduceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x: this device's block
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (logical id)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // order token of the previous call
                                  .Ret<ffi::AnyBuffer>()          // the reduced block
                                  .Ret<ffi::Buffer<ffi::U32>>()   // order token for the next call
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // RedOp
                                  .Attr<int32_t>("algorithm"));   // Algorithm
