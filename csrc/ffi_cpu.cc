// XLA FFI handlers for the CPU backend. Execute-only: they look up the communicator that the
// Python runtime built before the program ran, check the call, and hand this device's rank of
// it to the rank's worker thread (cpu_backend.h: RankWorker), returning a future that the
// worker completes. The device's XLA thread meanwhile runs the operations that do not need the
// call's results: XLA's CPU runtime runs independent operations in whatever order they become
// ready, which can differ between devices, so a device that blocked inside a jax_gin call
// while its peers blocked in the rendezvous of an independent lax collective (or the other
// way round) deadlocked. XLA starts a call only once the previous one of its order chain has
// completed (the order token), so each rank's calls of one chain run one at a time, in order;
// calls of chains that nothing links are queued, and run in the order of the group's rank 0
// (cpu_backend.h: Turn), by the "site" attribute that tells a program's calls apart.
// The asynchronous pair's start is a call as any other here (its future completes when the
// rank's reduction has), and the done returns its operands (aliased).
#include "ffi_cpu.h"

#include <array>
#include <cstring>
#include <string>
#include <utility>

#include "cpu_backend.h"
#include "ffi_common.h"
#include "host_types.h"
#include "jax_gin/norm.h"

namespace ffi = xla::ffi;

namespace jax_gin {
namespace {

// A call that failed before it started (bad input, a missing communicator).
ffi::Future failed(ffi::Error err) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(err));
  return future;
}

// Runs `work` (this device's rank of a call: its error text, empty on success) on the rank's
// worker thread; the future completes there, with the error as an INTERNAL one, as the
// synchronous handlers returned it.
ffi::Future run_on_worker(cpu::Comm& c, uint32_t logical_id, ffi::RunId run, int32_t site,
                          cpu::RankWorker::Work work) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::string err = cpu::submit(c, logical_id, std::move(work),
                                [promise](const std::string& e) mutable {
                                  if (e.empty()) promise.SetAvailable();
                                  else promise.SetError(ffi::Error::Internal(e));
                                },
                                uint32_t(site), run.run_id);
  if (!err.empty()) promise.SetError(ffi::Error::Internal(err));
  return future;
}

// This device's rank of the all-reduce of xs into outs, on the rank's worker.
ffi::Future AllReduce(ffi::RunId run, ffi::Buffer<ffi::U32> partition_id,
                      ffi::RemainingArgs& xs, ffi::RemainingRets& outs, int64_t comm, int32_t op,
                      int32_t algorithm, int32_t site) {
  DType dtype;
  std::array<Segment, kMaxSegments> seg;
  int nseg = 0;
  if (ffi::Error err = collect_segments(xs, outs, seg.data(), &nseg, &dtype); err.failure())
    return failed(std::move(err));
  if (ffi::Error err = check_enums(op, algorithm); err.failure()) return failed(std::move(err));
  auto c = cpu::find_comm(comm_id(comm));
  if (!names_comm(c.get(), comm)) return failed(missing_comm(comm));
  const uint32_t logical_id = partition_id.typed_data()[0];
  // The call holds the communicator (cpu_backend.h: RankWorker).
  return run_on_worker(*c, logical_id, run, site,
                       [c, logical_id, dtype, op, algorithm, seg, nseg](cpu::Turn& turn) mutable {
    return cpu::allreduce_logical(*c, logical_id, dtype, RedOp(op), Algorithm(algorithm),
                                  seg.data(), nseg, -1, &turn);
  });
}

// The order token (an HLO token: _primitive.py's chain) orders the calls; it holds nothing.
ffi::Future CpuAllReduceImpl(ffi::RunId run, ffi::Buffer<ffi::U32> partition_id, ffi::Token order_in,
                            ffi::RemainingArgs xs, ffi::Result<ffi::Token> order_out,
                            ffi::RemainingRets outs, int64_t comm, int32_t op, int32_t algorithm,
                            int32_t site) {
  (void)order_in;
  (void)order_out;
  return AllReduce(run, partition_id, xs, outs, comm, op, algorithm, site);
}

// The synchronous all-reduce with a uint32 order token: what a partially-manual shard_map
// lowers to (XLA's batch partitioner takes no HLO token operands). The token's value is unused:
// it orders the calls of one block, and the calls of independent blocks, which XLA may hand a
// device at once, are queued on the rank's worker and run in the group's order (Turn).
ffi::Future CpuAllReducePartitionedImpl(ffi::RunId run, ffi::Buffer<ffi::U32> partition_id,
                                       ffi::Buffer<ffi::U32> order_in, ffi::RemainingArgs xs,
                                       ffi::Result<ffi::Buffer<ffi::U32>> order_out,
                                       ffi::RemainingRets outs, int64_t comm, int32_t op,
                                       int32_t algorithm, int32_t site) {
  (void)order_in;
  order_out->typed_data()[0] = 0;
  return AllReduce(run, partition_id, xs, outs, comm, op, algorithm, site);
}

ffi::Future CpuAllReduceStartImpl(ffi::RunId run, ffi::Buffer<ffi::U32> partition_id,
                                 ffi::Token order_in,
                                 ffi::RemainingArgs xs, ffi::Result<ffi::Token> order_out,
                                 ffi::RemainingRets outs, int64_t comm, int32_t op,
                                 int32_t algorithm, int32_t max_lanes, int32_t slot,
                                 int32_t copy_engine, int32_t site) {
  (void)max_lanes;  // one lane per rank on the CPU
  (void)slot;
  (void)copy_engine;  // a GPU transport; the CPU runs the algorithm's schedule (same results)
  (void)order_in;
  (void)order_out;
  return AllReduce(run, partition_id, xs, outs, comm, op, algorithm, site);
}

ffi::Error CpuAllReduceDoneImpl(ffi::Token order_in, ffi::RemainingArgs operands,
                                ffi::Result<ffi::Token> order_out,
                                ffi::RemainingRets outs, int64_t comm, int32_t slot) {
  (void)order_in;
  (void)comm;
  (void)slot;
  (void)order_out;
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


// psum_add_rmsnorm and psum_add_layernorm (bias non-null): x is reduced into new_residual by
// the all-reduce, then each row becomes residual + sum (rounded to the element type) and its
// norm (norm.h), in the same order on every rank, so that every rank's results are bitwise the
// same. Both run on the rank's worker.
ffi::Future cpu_add_norm(ffi::RunId run, ffi::Buffer<ffi::U32> partition_id, ffi::AnyBuffer x,
                         ffi::AnyBuffer residual, ffi::AnyBuffer weight, const ffi::AnyBuffer* bias,
                         ffi::Result<ffi::AnyBuffer> normed, ffi::Result<ffi::AnyBuffer> new_residual,
                         int64_t comm, int32_t algorithm, float eps, int32_t site) {
  size_t rows = 0, d = 0;
  DType dtype;
  // This also checks that the element type has the epilogue (NormElem).
  if (ffi::Error err = check_norm_buffers(x, residual, weight, bias, *normed, *new_residual,
                                          &dtype, &rows, &d);
      err.failure())
    return failed(std::move(err));
  if (ffi::Error err = check_enums(int32_t(RedOp::kSum), algorithm); err.failure())
    return failed(std::move(err));
  auto c = cpu::find_comm(comm_id(comm));
  if (!names_comm(c.get(), comm)) return failed(missing_comm(comm));
  const uint32_t logical_id = partition_id.typed_data()[0];
  const void* res = residual.untyped_data();
  const void* w = weight.untyped_data();
  const void* b = bias ? bias->untyped_data() : nullptr;
  void* nr = new_residual->untyped_data();
  void* out = normed->untyped_data();
  Segment seg{0, x.element_count(), x.untyped_data(), nr};
  const int call_op = bias ? kOpAddLayerNorm : kOpAddRmsNorm;
  return run_on_worker(*c, logical_id, run, site, [=](cpu::Turn& turn) mutable {
    std::string err = cpu::allreduce_logical(*c, logical_id, dtype, RedOp::kSum,
                                             Algorithm(algorithm), &seg, 1, call_op, &turn);
    if (!err.empty() || turn.declined) return err;
    with_dtype<HostElem>(dtype, false, [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (NormElem<T>::ok) {
        const T* rp = static_cast<const T*>(res);
        const T* wp = static_cast<const T*>(w);
        const T* bp = static_cast<const T*>(b);
        T* nrp = static_cast<T*>(nr);
        T* op = static_cast<T*>(out);
        for (size_t r = 0; r < rows; ++r)
          add_norm_row(rp + r * d, nrp + r * d, wp, bp, op + r * d, d, eps);
      }
      return true;
    });
    return std::string();
  });
}

ffi::Future CpuAddRmsNormImpl(ffi::RunId run, ffi::Buffer<ffi::U32> partition_id, ffi::Token,
                              ffi::AnyBuffer x,
                              ffi::AnyBuffer residual, ffi::AnyBuffer weight, ffi::Result<ffi::Token>,
                              ffi::Result<ffi::AnyBuffer> normed,
                              ffi::Result<ffi::AnyBuffer> new_residual, int64_t comm,
                              int32_t algorithm, float eps, int32_t site) {
  return cpu_add_norm(run, partition_id, x, residual, weight, nullptr, normed, new_residual, comm,
                      algorithm, eps, site);
}

ffi::Future CpuAddLayerNormImpl(ffi::RunId run, ffi::Buffer<ffi::U32> partition_id, ffi::Token,
                                ffi::AnyBuffer x,
                                ffi::AnyBuffer residual, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                                ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> normed,
                                ffi::Result<ffi::AnyBuffer> new_residual, int64_t comm,
                                int32_t algorithm, float eps, int32_t site) {
  return cpu_add_norm(run, partition_id, x, residual, weight, &bias, normed, new_residual, comm,
                      algorithm, eps, site);
}

// The fused norms' bindings, one list for both: this head, then LayerNorm's bias, then the tail
// (norm_operands and norm_results, ffi_common.h).
auto norm_binding_head() {
  return norm_operands(ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()             // XLA's execution (for errors)
                           .Arg<ffi::Buffer<ffi::U32>>()  // partition id (logical id)
                           .Arg<ffi::Token>());           // order token of the previous call
}
template <class Binding>
auto norm_binding_tail(Binding b) {
  return norm_results(std::move(b).template Ret<ffi::Token>())  // order token for the next call
      .template Attr<int32_t>("site");                            // the program's call (Turn)
}

// psum_scatter and all_gather (collectives.h): one buffer in, one out.
ffi::Future CpuCollectiveImpl(ffi::RunId run, ffi::Buffer<ffi::U32> partition_id, ffi::Token order_in,
                              ffi::AnyBuffer x, ffi::Result<ffi::Token> order_out,
                              ffi::Result<ffi::AnyBuffer> y, int64_t comm, int32_t op,
                              int32_t algorithm, int32_t site) {
  (void)order_in;
  (void)order_out;
  auto c = cpu::find_comm(comm_id(comm));
  if (!names_comm(c.get(), comm)) return failed(missing_comm(comm));
  DType dtype;
  size_t block = 0;
  if (ffi::Error err = check_collective(x, *y, op, algorithm, c->config.nranks, &dtype, &block);
      err.failure())
    return failed(std::move(err));
  const uint32_t logical_id = partition_id.typed_data()[0];
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  return run_on_worker(*c, logical_id, run, site, [=](cpu::Turn& turn) {
    return cpu::collective_logical(*c, logical_id, dtype, op, Algorithm(algorithm), in, out,
                                   block, &turn);
  });
}

}  // namespace
}  // namespace jax_gin

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAllReduce, jax_gin::CpuAllReduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()              // XLA's execution (for errors)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (logical id)
                                  .Arg<ffi::Token>()              // order token of the previous call
                                  .RemainingArgs()                // x_0..x_k: buffers of one dtype
                                  .Ret<ffi::Token>()              // order token for the next call
                                  .RemainingRets()                // their reductions, in order
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // RedOp
                                  .Attr<int32_t>("algorithm")     // Algorithm
                                  .Attr<int32_t>("site"));        // the program's call (Turn)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAllReducePartitioned, jax_gin::CpuAllReducePartitionedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()              // XLA's execution (for errors)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (logical id)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // order token (uint32, unused)
                                  .RemainingArgs()                // x_0..x_k: buffers of one dtype
                                  .Ret<ffi::Buffer<ffi::U32>>()   // order token for the next call
                                  .RemainingRets()                // their reductions, in order
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // RedOp
                                  .Attr<int32_t>("algorithm")     // Algorithm
                                  .Attr<int32_t>("site"));        // the program's call (Turn)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAllReduceStart, jax_gin::CpuAllReduceStartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()              // XLA's execution (for errors)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (logical id)
                                  .Arg<ffi::Token>()              // order token of the previous call
                                  .RemainingArgs()                // x_0..x_k: buffers of one dtype
                                  .Ret<ffi::Token>()              // order token for the next call
                                  .RemainingRets()                // their reductions
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // RedOp
                                  .Attr<int32_t>("algorithm")     // Algorithm
                                  .Attr<int32_t>("max_lanes")     // GPU lane cap (unused here)
                                  .Attr<int32_t>("slot")          // GPU event slot (unused here)
                                  .Attr<int32_t>("copy_engine")   // GPU transport (unused here)
                                  .Attr<int32_t>("site"));        // the program's call (Turn)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAllReduceDone, jax_gin::CpuAllReduceDoneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()              // order token of the start
                                  .RemainingArgs()                // the start's results
                                  .Ret<ffi::Token>()              // order token for the next call
                                  .RemainingRets()                // the reductions (aliased)
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("slot"));        // GPU event slot (unused here)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAddRmsNorm, jax_gin::CpuAddRmsNormImpl,
                              jax_gin::norm_binding_tail(jax_gin::norm_binding_head()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuAddLayerNorm, jax_gin::CpuAddLayerNormImpl,
                              jax_gin::norm_binding_tail(jax_gin::norm_binding_head()
                                                             .Arg<ffi::AnyBuffer>()));  // bias (d,)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxGinCpuCollective, jax_gin::CpuCollectiveImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()              // XLA's execution (for errors)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // partition id (logical id)
                                  .Arg<ffi::Token>()              // order token of the previous call
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Ret<ffi::Token>()              // order token for the next call
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Attr<int64_t>("comm")          // communicator id (runtime)
                                  .Attr<int32_t>("op")            // CallOp: psum_scatter, all_gather
                                  .Attr<int32_t>("algorithm")     // Algorithm: one_shot or ring
                                  .Attr<int32_t>("site"));        // the program's call (Turn)
