// The kernel template and its typed launchers. Included by one translation unit per element
// type (kernels_<type>.cu), so that the instantiations compile in parallel.
#pragma once

#include "kernels.h"
#include "transport.cuh"

#include "jax_gin/schedule.h"

namespace jax_gin {
namespace gpu {

template <class T, class Op, class Peers>
__global__ void __launch_bounds__(512)
    allreduce_kernel(Peers peers, LaneParams p, int algorithm, const T* __restrict__ in,
                     T* __restrict__ out, size_t count) {
  const int lane = blockIdx.x;
  const Algorithm algo = Algorithm(algorithm);
  const schedule::Range mine = schedule::piece(count, gridDim.x, lane, schedule::align_elems(sizeof(T)));
  const size_t slot_bytes = schedule::slot_elems(algo, p.nranks, p.lane_bytes, sizeof(T)) * sizeof(T);
  GpuTransport<Peers> tp(peers, p, lane, slot_bytes);
  // Every thread keeps its own copy of the lane's round counter; all threads follow the
  // same control flow, so the copies agree, and thread 0 writes it back.
  uint64_t round = p.rounds[lane];
  run_lane<T, Op>(tp, algo, in + mine.offset, out + mine.offset, mine.count, p.lane_bytes, round);
  if (threadIdx.x == 0) p.rounds[lane] = round;
}


template <class T, class Op, class Peers>
cudaError_t launch_typed(const Peers& peers, const LaneParams& p, int lanes, int threads,
                         Algorithm algo, const void* in, void* out, size_t count, cudaStream_t s) {
  allreduce_kernel<T, Op, Peers><<<lanes, threads, 0, s>>>(
      peers, p, int(algo), static_cast<const T*>(in), static_cast<T*>(out), count);
  return cudaGetLastError();
}

template <class T, class Peers>
cudaError_t launch_op(RedOp op, const Peers& peers, const LaneParams& p, int lanes, int threads,
                      Algorithm algo, const void* in, void* out, size_t count, cudaStream_t s) {
  switch (op) {
    case RedOp::kSum: return launch_typed<T, DevSum>(peers, p, lanes, threads, algo, in, out, count, s);
    case RedOp::kMax: return launch_typed<T, DevMax>(peers, p, lanes, threads, algo, in, out, count, s);
    case RedOp::kMin: return launch_typed<T, DevMin>(peers, p, lanes, threads, algo, in, out, count, s);
  }
  return cudaErrorInvalidValue;
}

template <class T, class Peers>
cudaError_t preload_type() {
  cudaFuncAttributes a;
  cudaError_t e;
  if ((e = cudaFuncGetAttributes(&a, allreduce_kernel<T, DevSum, Peers>)) != cudaSuccess) return e;
  if ((e = cudaFuncGetAttributes(&a, allreduce_kernel<T, DevMax, Peers>)) != cudaSuccess) return e;
  return cudaFuncGetAttributes(&a, allreduce_kernel<T, DevMin, Peers>);
}


// Explicit instantiation of everything one element type needs.
#define JAX_GIN_INSTANTIATE(T)                                                                   \
  template cudaError_t launch_op<T, NcclPeers>(RedOp, const NcclPeers&, const LaneParams&, int, \
                                               int, Algorithm, const void*, void*, size_t,       \
                                               cudaStream_t);                                    \
  template cudaError_t launch_op<T, TablePeers>(RedOp, const TablePeers&, const LaneParams&,     \
                                                int, int, Algorithm, const void*, void*, size_t, \
                                                cudaStream_t);                                   \
  template cudaError_t preload_type<T, NcclPeers>();                                             \
  template cudaError_t preload_type<T, TablePeers>();

}  // namespace gpu
}  // namespace jax_gin
