// XLA FFI handlers for the CUDA backend. Each looks up the state that jax_gin's runtime built
// before execution (by communicator attribute and device ordinal); none allocates, and none
// synchronizes with the host; rounds live on the device.
//   JaxGinCudaAllReduce       one kernel launch on XLA's stream; command-buffer compatible.
//   JaxGinCudaAllReduceStart  the same kernel on the rank's side stream, forked from XLA's
//                             stream by an event, with a cap on its lanes (CTAs), so that the
//                             compute XLA runs meanwhile keeps most SMs, or (copy_engine)
//                             the copy-engine path. Returns at once.
//   JaxGinCudaAllReduceDone   makes XLA's stream wait for the start's kernel. Its results are
//                             its operands, the start's results (aliased): XLA keeps them alive
//                             and untouched until then. The start reduces in place (its results
//                             alias its inputs; the kernels read every input element before
//                             they write its result), so the inputs live until the done too.
//   JaxGinCudaCollective      psum_scatter or all_gather (collectives.h): one kernel launch on
//                             XLA's stream; command-buffer compatible.
// Start and done are not command-buffer compatible: a captured start would leave work on the
// side stream unjoined at the end of its capture.
#include "ffi_cuda.h"

#include <string>
#include <utility>

#include "ffi_common.h"
#include "nccl_runtime.h"

namespace ffi = xla::ffi;

namespace jax_gin {
namespace {

// The rank of communicator `comm` on `device`; fills *st.
ffi::Error find_rank(int64_t comm, int32_t device, const gpu::RankState** st) {
  *st = gpu::find_rank(comm_id(comm), device);
  if (*st == nullptr && gpu::comm_exists(comm_id(comm), comm_fingerprint(comm))) {
    return ffi::Error::Internal(
        "jax_gin: this program's communicator " + std::to_string(comm_id(comm)) +
        " has no rank on GPU " + std::to_string(device) + ": the program was lowered for a mesh "
        "of other devices. Under jax.set_mesh, JAX lowers a jitted function once for all meshes "
        "of one shape; give its shard_map the mesh= it runs on");
  }
  if (!names_comm(*st, comm)) return missing_comm(comm);
  return ffi::Error::Success();
}

// The rank of communicator `comm` on `device`, refused if one of its kernels timed out
// earlier; fills *st.
ffi::Error live_rank(int64_t comm, int32_t device, const gpu::RankState** st) {
  if (ffi::Error err = find_rank(comm, device, st); err.failure()) return err;
  // A kernel of this rank timed out earlier (and trapped): say so instead of launching again.
  if ((*st)->diag_host->diag.valid) {
    return ffi::Error::Internal(
        "jax_gin: an earlier call failed: " +
        gpu::describe(*(*st)->diag_host, (*st)->nranks, (*st)->group_text) +
        " A kernel that timed out aborted this GPU's CUDA context: restart the process (CUDA "
        "cannot recover a context after a device-side trap)");
  }
  return ffi::Error::Success();
}

// Checks shared by the launching all-reduce handlers; fills *st.
ffi::Error rank_state(int64_t comm, int32_t device, int32_t algorithm, const gpu::RankState** st) {
  // kHierarchical (internal) is the one algorithm of groups that span nodes; the runtime
  // (_runtime.algorithm_code) passes it for those only (comm_ranks_per_node).
  const bool hier = algorithm == int32_t(Algorithm::kHierarchical);
  if (ffi::Error err = live_rank(comm, device, st); err.failure()) return err;
  if (hier != ((*st)->cfg.ranks_per_node > 0)) {
    return ffi::Error::InvalidArgument(
        hier ? std::string("jax_gin: the hierarchical algorithm runs only for groups that span nodes")
             : "jax_gin: group " + std::to_string((*st)->group) + " spans nodes and runs only the "
               "hierarchical algorithm (algorithm='auto'), not " + algorithm_name(Algorithm(algorithm)));
  }
  return ffi::Error::Success();
}

// One launch for all the buffers of the call (one, or a pytree bucket) on `stream`, with at
// most `max_lanes` lanes (0: the rank's configured cap).
ffi::Error launch(cudaStream_t stream, int32_t device, ffi::RemainingArgs& xs,
                  ffi::RemainingRets& outs, int64_t comm, int32_t op, int32_t algorithm,
                  int32_t max_lanes) {
  DType dtype;
  Segment seg[kMaxSegments];
  int nseg = 0;
  if (ffi::Error err = collect_segments(xs, outs, seg, &nseg, &dtype); err.failure()) return err;
  const bool hier = algorithm == int32_t(Algorithm::kHierarchical);
  if (ffi::Error err = check_enums(op, hier ? 0 : algorithm); err.failure()) return err;
  const gpu::RankState* st = nullptr;
  if (ffi::Error err = rank_state(comm, device, algorithm, &st); err.failure()) return err;
  gpu::LaunchConfig cfg = st->cfg;
  if (max_lanes > 0 && max_lanes < cfg.max_lanes) cfg.max_lanes = max_lanes;
  const gpu::PeerAccess peers{st->win, nullptr, hier ? &st->devcomm : nullptr};
  cudaError_t e = gpu::launch_allreduce(peers, cfg, dtype, RedOp(op), Algorithm(algorithm), seg,
                                        nseg, stream);
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_gin: kernel launch failed: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error cuda_error(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_gin: ") + what + ": " + cudaGetErrorString(e));
}

// The copy-engine path (cuda/copy_engine.cu) of an asynchronous call: one buffer, a group
// within one node; its reduction runs on at most `max_lanes` CTAs. _primitive.py chooses it.
ffi::Error launch_copy_engine(cudaStream_t stream, int32_t device, ffi::RemainingArgs& xs,
                              ffi::RemainingRets& outs, int64_t comm, int32_t op,
                              int32_t algorithm, int32_t max_lanes) {
  DType dtype;
  Segment seg[kMaxSegments];
  int nseg = 0;
  if (ffi::Error err = collect_segments(xs, outs, seg, &nseg, &dtype); err.failure()) return err;
  if (ffi::Error err = check_enums(op, algorithm); err.failure()) return err;
  const gpu::RankState* st = nullptr;
  if (ffi::Error err = rank_state(comm, device, algorithm, &st); err.failure()) return err;
  if (nseg != 1 || st->ce_bases.empty())
    return ffi::Error::Internal("jax_gin: the copy-engine path takes one buffer, in a group within one node");
  gpu::LaunchConfig cfg = st->cfg;
  const int ctas = max_lanes > 0 ? max_lanes : cfg.max_lanes;
  const gpu::PeerAccess peers{st->win, nullptr, nullptr};
  cudaError_t e = gpu::launch_allreduce_copy_engine(peers, st->ce_bases.data(), cfg, dtype, RedOp(op),
                                                    seg[0].in, seg[0].out, seg[0].count, ctas, stream,
                                                    &st->ce_aux);
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_gin: copy-engine all-reduce failed to launch: ") +
                                cudaGetErrorString(e));
  return ffi::Error::Success();
}

ffi::Error CudaAllReduceImpl(cudaStream_t stream, int32_t device,
                             ffi::Buffer<ffi::U32> partition_id, ffi::Buffer<ffi::U32> order_in,
                             ffi::RemainingArgs xs, ffi::Result<ffi::Buffer<ffi::U32>> order_out,
                             ffi::RemainingRets outs, int64_t comm, int32_t op, int32_t algorithm) {
  (void)partition_id;  // the rank comes from the device ordinal's cached state
  // The order tokens only make XLA run jax_gin calls in program order (see _primitive.py);
  // their values are never read, and on the GPU one stream orders the calls anyway.
  (void)order_in;
  (void)order_out;
  return launch(stream, device, xs, outs, comm, op, algorithm, 0);
}

// psum_scatter and all_gather (collectives.h): one buffer in, one out, one kernel on XLA's
// stream. Groups that span nodes are refused (_scatter_gather.py lowers those to XLA's own).
ffi::Error CudaCollectiveImpl(cudaStream_t stream, int32_t device,
                              ffi::Buffer<ffi::U32> partition_id, ffi::Buffer<ffi::U32> order_in,
                              ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U32>> order_out,
                              ffi::Result<ffi::AnyBuffer> y, int64_t comm, int32_t op,
                              int32_t algorithm) {
  (void)partition_id;  // the rank comes from the device ordinal's cached state
  (void)order_in;      // order tokens: as in CudaAllReduceImpl
  (void)order_out;
  const gpu::RankState* st = nullptr;
  if (ffi::Error err = live_rank(comm, device, &st); err.failure()) return err;
  DType dtype;
  size_t block = 0;
  if (ffi::Error err = check_collective(x, *y, op, algorithm, st->nranks, &dtype, &block);
      err.failure())
    return err;
  if (st->cfg.ranks_per_node > 0)
    return ffi::Error::InvalidArgument(
        std::string("jax_gin: ") + call_op_name(op) + " needs load/store access to every peer, but group " +
        std::to_string(st->group) + " spans nodes");
  // _scatter_gather.py checks this at trace time, against the settings' workspace
  if (st->nranks > 1 && schedule::coll_slot_elems(Algorithm(algorithm), st->nranks,
                                                  st->cfg.lane_bytes, dtype_size(dtype)) == 0)
    return ffi::Error::InvalidArgument(
        std::string("jax_gin: ") + call_op_name(op) + ": the workspace's " +
        std::to_string(st->cfg.lane_bytes) + "-byte lanes cannot hold one round of " +
        algorithm_name(Algorithm(algorithm)) + " over " + std::to_string(st->nranks) + " ranks");
  const gpu::PeerAccess peers{st->win, nullptr, nullptr};
  if (cudaError_t e = gpu::launch_collective(peers, st->cfg, dtype, op, Algorithm(algorithm),
                                             x.untyped_data(), y->untyped_data(), block, stream))
    return cuda_error("kernel launch failed", e);
  return ffi::Error::Success();
}

// The rank state of an asynchronous start or done, with its event slot checked.
ffi::Error async_rank(int64_t comm, int32_t device, int32_t slot, const gpu::RankState** st) {
  if (ffi::Error err = find_rank(comm, device, st); err.failure()) return err;
  if (slot < 0 || slot >= kAsyncSlots)
    return ffi::Error::Internal("jax_gin: no event slot " + std::to_string(slot));
  return ffi::Error::Success();
}

ffi::Error CudaAllReduceStartImpl(cudaStream_t stream, int32_t device,
                                  ffi::Buffer<ffi::U32> partition_id, ffi::Buffer<ffi::U32> order_in,
                                  ffi::RemainingArgs xs, ffi::Result<ffi::Buffer<ffi::U32>> order_out,
                                  ffi::RemainingRets outs, int64_t comm, int32_t op,
                                  int32_t algorithm, int32_t max_lanes, int32_t slot,
                                  int32_t copy_engine) {
  (void)partition_id;
  (void)order_in;
  (void)order_out;
  const gpu::RankState* st = nullptr;
  if (ffi::Error err = async_rank(comm, device, slot, &st); err.failure()) return err;
  // fork: the side stream waits for everything XLA's stream did so far (the inputs, and every
  // earlier jax_gin call of this rank, which the order tokens put before this one)
  if (cudaError_t e = cudaEventRecord(st->fork[slot], stream)) return cuda_error("cudaEventRecord", e);
  if (cudaError_t e = cudaStreamWaitEvent(st->side, st->fork[slot], 0)) return cuda_error("cudaStreamWaitEvent", e);
  if (copy_engine) {
    if (ffi::Error err = launch_copy_engine(st->side, device, xs, outs, comm, op, algorithm, max_lanes);
        err.failure())
      return err;
  } else if (ffi::Error err = launch(st->side, device, xs, outs, comm, op, algorithm, max_lanes);
             err.failure()) {
    return err;
  }
  if (cudaError_t e = cudaEventRecord(st->join[slot], st->side)) return cuda_error("cudaEventRecord", e);
  return ffi::Error::Success();
}

ffi::Error CudaAllReduceDoneImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::U32> order_in,
                                 ffi::RemainingArgs operands, ffi::Result<ffi::Buffer<ffi::U32>> order_out,
                                 ffi::RemainingRets outs, int64_t comm, int32_t slot) {
  (void)order_in;
  (void)order_out;
  (void)operands;  // the start's results (aliased to ours)
  (void)outs;
  const gpu::RankState* st = nullptr;
  if (ffi::Error err = async_rank(comm, device, slot, &st); err.failure()) return err;
  if (cudaError_t e = cudaStreamWaitEvent(stream, st->join[slot], 0)) return cuda_error("cudaStreamWaitEvent", e);
  return ffi::Error::Success();
}


// psum_add_rmsnorm and psum_add_layernorm (bias non-null): with one_shot over LL, one kernel
// (launch_add_norm_ll); otherwise the all-reduce of x into new_residual, then the epilogue
// kernel, both on XLA's stream.
ffi::Error cuda_add_norm(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                         ffi::AnyBuffer residual, ffi::AnyBuffer weight, const ffi::AnyBuffer* bias,
                         ffi::Result<ffi::AnyBuffer> normed,
                         ffi::Result<ffi::AnyBuffer> new_residual, int64_t comm, int32_t algorithm,
                         float eps) {
  size_t rows = 0, d = 0;
  DType dtype;
  if (ffi::Error err = check_norm_buffers(x, residual, weight, bias, *normed, *new_residual,
                                          &dtype, &rows, &d);
      err.failure())
    return err;
  const bool hier = algorithm == int32_t(Algorithm::kHierarchical);
  if (ffi::Error err = check_enums(int32_t(RedOp::kSum), hier ? 0 : algorithm); err.failure()) return err;
  const gpu::RankState* st = nullptr;
  if (ffi::Error err = rank_state(comm, device, algorithm, &st); err.failure()) return err;
  const gpu::PeerAccess peers{st->win, nullptr, hier ? &st->devcomm : nullptr};
  const void* b = bias ? bias->untyped_data() : nullptr;
  gpu::LaunchConfig cfg = st->cfg;  // recorded and reported as the fused call, not as psum
  cfg.call_op = bias ? kOpAddLayerNorm : kOpAddRmsNorm;
  // one_shot over LL: the sum, the add and the norm in one kernel where the rows fit it
  if (Algorithm(algorithm) == Algorithm::kOneShot) {
    const cudaError_t e = gpu::launch_add_norm_ll(
        peers, cfg, dtype, x.untyped_data(), residual.untyped_data(),
        new_residual->untyped_data(), weight.untyped_data(), b, normed->untyped_data(), rows, d,
        eps, stream);
    if (e == cudaSuccess) return ffi::Error::Success();
    if (e != cudaErrorNotSupported) return cuda_error("kernel launch failed", e);
  }
  Segment seg{0, x.element_count(), x.untyped_data(), new_residual->untyped_data()};
  if (cudaError_t e = gpu::launch_allreduce(peers, cfg, dtype, RedOp::kSum,
                                            Algorithm(algorithm), &seg, 1, stream))
    return cuda_error("kernel launch failed", e);
  if (cudaError_t e = gpu::launch_add_norm(dtype, residual.untyped_data(),
                                           new_residual->untyped_data(), weight.untyped_data(), b,
                                           normed->untyped_data(), rows, d, eps, stream))
    return cuda_error("norm launch failed", e);
  return ffi::Error::Success();
}

ffi::Error CudaAddRmsNormImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::U32>,
                              ffi::Buffer<ffi::U32>, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                              ffi::AnyBuffer weight, ffi::Result<ffi::Buffer<ffi::U32>>,
                              ffi::Result<ffi::AnyBuffer> normed,
                              ffi::Result<ffi::AnyBuffer> new_residual, int64_t comm,
                              int32_t algorithm, float eps) {
  return cuda_add_norm(stream, device, x, residual, weight, nullptr, normed, new_residual, comm,
                       algorithm, eps);
}

ffi::Error CudaAddLayerNormImpl(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::U32>,
                                ffi::Buffer<ffi::U32>, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                                ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                                ffi::Result<ffi::Buffer<ffi::U32>>,
                                ffi::Result<ffi::AnyBuffer> normed,
                                ffi::Result<ffi::AnyBuffer> new_residual, int64_t comm,
                                int32_t algorithm, float eps) {
  return cuda_add_norm(stream, device, x, residual, weight, &bias, normed, new_residual, comm,
                       algorithm, eps);
}

// The fused norms' bindings, one list for both: this head, then LayerNorm's bias, then the tail
// (norm_operands and norm_results, ffi_common.h).
auto norm_binding_head() {
  return norm_operands(ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                           .Ctx<ffi::DeviceOrdinal>()                 // local CUDA ordinal
                           .Arg<ffi::Buffer<ffi::U32>>()   // partition id (unused on GPU)
                           .Arg<ffi::Buffer<ffi::U32>>());  // order token of the previous call
}
template <class Binding>
auto norm_binding_tail(Binding b) {
  // order token for the next call
  return norm_results(std::move(b).template Ret<ffi::Buffer<ffi::U32>>());
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCudaAllReduceStart, jax_gin::CudaAllReduceStartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()      // local CUDA ordinal
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (unused on GPU)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // order token of the previous call
                                  .RemainingArgs()                // x_0..x_k: buffers of one dtype
                                  .Ret<ffi::Buffer<ffi::U32>>()   // order token for the next call
                                  .RemainingRets()                // their reductions, in place (valid after the done)
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // RedOp
                                  .Attr<int32_t>("algorithm")     // Algorithm
                                  .Attr<int32_t>("max_lanes")     // lane cap of this call
                                  .Attr<int32_t>("slot")          // event slot shared with its done
                                  .Attr<int32_t>("copy_engine")); // 1: data moved by copy engines

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCudaAllReduceDone, jax_gin::CudaAllReduceDoneImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()      // local CUDA ordinal
                                  .Arg<ffi::Buffer<ffi::U32>>()   // order token of the start
                                  .RemainingArgs()                // the start's results
                                  .Ret<ffi::Buffer<ffi::U32>>()   // order token for the next call
                                  .RemainingRets()                // the same buffers (aliased)
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("slot"));        // event slot of its start

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCudaCollective, jax_gin::CudaCollectiveImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                                  .Ctx<ffi::DeviceOrdinal>()      // local CUDA ordinal
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (unused on GPU)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // order token of the previous call
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Ret<ffi::Buffer<ffi::U32>>()   // order token for the next call
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // CallOp: psum_scatter, all_gather
                                  .Attr<int32_t>("algorithm"),    // Algorithm: one_shot or ring
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCudaAddRmsNorm, jax_gin::CudaAddRmsNormImpl,
                              jax_gin::norm_binding_tail(jax_gin::norm_binding_head()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCudaAddLayerNorm, jax_gin::CudaAddLayerNormImpl,
                              jax_gin::norm_binding_tail(jax_gin::norm_binding_head()
                                                             .Arg<ffi::AnyBuffer>()),  // bias (d,)
                              {ffi::Traits::kCmdBufferCompatible});
