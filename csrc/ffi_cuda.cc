// XLA FFI handler for the CUDA backend. Execute-only and command-buffer compatible: it looks
// up the state that jax_gin's runtime built before execution (by communicator attribute and
// device ordinal) and launches one kernel on XLA's stream. No allocation, no host
// synchronization, no host-side counters: rounds live on the device.
#include "ffi_cuda.h"

#include <string>

#include "ffi_common.h"
#include "nccl_runtime.h"

namespace ffi = xla::ffi;

namespace jax_gin {
namespace {

ffi::Error CudaAllReduceImpl(cudaStream_t stream, int32_t device,
                             ffi::Buffer<ffi::U32> partition_id, ffi::Buffer<ffi::U32> order_in,
                             ffi::RemainingArgs xs, ffi::Result<ffi::Buffer<ffi::U32>> order_out,
                             ffi::RemainingRets outs, int64_t comm, int32_t op, int32_t algorithm) {
  (void)partition_id;  // the rank comes from the device ordinal's cached state
  // The order tokens only make XLA run jax_gin calls in program order (see _primitive.py);
  // their values are never read, and on the GPU one stream orders the calls anyway.
  (void)order_in;
  (void)order_out;
  DType dtype;
  Segment seg[kMaxSegments];
  int nseg = 0;
  if (ffi::Error err = collect_segments(xs, outs, seg, &nseg, &dtype); err.failure()) return err;
  // kHierarchical (internal) is the one algorithm of groups that span nodes; _primitive.py
  // passes it for those only (comm_ranks_per_node).
  const bool hier = algorithm == int32_t(Algorithm::kHierarchical);
  if (ffi::Error err = check_enums(op, hier ? 0 : algorithm); err.failure()) return err;
  const gpu::RankState* st = gpu::find_rank(comm, device);
  if (st == nullptr) {
    return ffi::Error::Internal("jax_gin: no communicator " + std::to_string(comm) +
                                " state for CUDA device " + std::to_string(device));
  }
  if (hier != (st->cfg.ranks_per_node > 0)) {
    return ffi::Error::InvalidArgument(
        hier ? std::string("jax_gin: the hierarchical algorithm runs only for groups that span nodes")
             : "jax_gin: group " + std::to_string(st->group) + " spans nodes and runs only the "
               "hierarchical algorithm (algorithm='auto'), not " + algorithm_name(Algorithm(algorithm)));
  }
  // A kernel of this rank timed out earlier (and trapped): say so instead of launching again.
  if (st->diag_host->valid) {
    Diagnostic d = *st->diag_host;
    return ffi::Error::Internal("jax_gin: an earlier call failed: " + gpu::describe(d, st->nranks));
  }
  const gpu::PeerAccess peers{st->win, nullptr, hier ? &st->devcomm : nullptr};
  // One launch for all the buffers of the call (one, or a pytree bucket).
  cudaError_t e = gpu::launch_allreduce(peers, st->cfg, dtype, RedOp(op), Algorithm(algorithm),
                                        seg, nseg, stream);
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_gin: kernel launch failed: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_gin

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCudaAllReduce, jax_gin::CudaAllReduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()      // local CUDA ordinal
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (unused on GPU)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // order token of the previous call
                                  .RemainingArgs()                // x_0..x_k: buffers of one dtype
                                  .Ret<ffi::Buffer<ffi::U32>>()   // order token for the next call
                                  .RemainingRets()                // their reductions, in order
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // RedOp
                                  .Attr<int32_t>("algorithm"),    // Algorithm
                              {ffi::Traits::kCmdBufferCompatible});
