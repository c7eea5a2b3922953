// The reduce-scatter (psum_scatter) and all-gather kernel and its typed launchers. Included by
// one translation unit per element type, as kernels_impl.cuh is: CMakeLists.txt generates
// collectives_<short_name>.cu for each entry of JAX_GIN_DTYPES (common.h), which expands
// JAX_GIN_INSTANTIATE_COLLECTIVES_DTYPE with its DType.
#pragma once

#include "kernels.h"
#include "transport.cuh"

#include "jax_gin/collectives.h"
#include "jax_gin/schedule.h"

namespace jax_gin {
namespace gpu {

// One lane (CTA) of a reduce-scatter or all-gather of blocks of `block` elements: the lanes
// split the elements of a block into 16-byte-aligned pieces, and each runs
// run_lane_collective (collectives.h) on its piece of every block, through its own slice of
// every window and its own flags and round counter, as an all-reduce lane does. The call
// (p.op: kOpReduceScatter or kOpAllGather) and the schedule (p.algorithm: one_shot or ring)
// are read at run time, so that one kernel per element type and peer access serves all four;
// a reduce-scatter sums, as lax.psum_scatter does.
template <class T, class Peers>
__global__ void __launch_bounds__(512)
    collective_kernel(Peers peers, LaneParams p, const T* __restrict__ in, T* __restrict__ out,
                      size_t block) {
  const int lane = blockIdx.x;
  const Algorithm algo = Algorithm(p.algorithm);
  const schedule::Range mine = schedule::piece(block, gridDim.x, lane, schedule::align_elems(sizeof(T)));
  const size_t slot_bytes = schedule::coll_slot_elems(algo, p.nranks, p.lane_bytes, sizeof(T)) * sizeof(T);
  GpuTransport<Peers> tp(peers, p, lane, slot_bytes);
  const Blocks<T> b{in + mine.offset, out + mine.offset, block};
  run_recorded_lane(p, lane, tp, [&](uint64_t& round) {
    run_lane_collective<T, Sum>(tp, p.op, algo, b, mine.count, p.lane_bytes, round);
  });
}

template <class T, class Peers>
cudaError_t launch_collective_typed(const Peers& peers, const LaneParams& p, int lanes, int threads,
                                    const void* in, void* out, size_t block, cudaStream_t s) {
  collective_kernel<T, Peers><<<lanes, threads, 0, s>>>(peers, p, static_cast<const T*>(in),
                                                        static_cast<T*>(out), block);
  return cudaGetLastError();
}

template <class T, class Peers>
cudaError_t preload_collective_type() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, collective_kernel<T, Peers>);
}

// CTAs per SM of the table-peer kernel (the native harness's).
template <class T>
cudaError_t collective_occupancy(int threads, int* per_sm) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, collective_kernel<T, TablePeers>, threads, 0);
}

// Explicit instantiation of everything one element type needs.
#define JAX_GIN_INSTANTIATE_COLLECTIVES(T)                                                       \
  template cudaError_t launch_collective_typed<T, NcclPeers>(                                    \
      const NcclPeers&, const LaneParams&, int, int, const void*, void*, size_t, cudaStream_t);  \
  template cudaError_t launch_collective_typed<T, TablePeers>(                                   \
      const TablePeers&, const LaneParams&, int, int, const void*, void*, size_t, cudaStream_t); \
  template cudaError_t preload_collective_type<T, NcclPeers>();                                  \
  template cudaError_t preload_collective_type<T, TablePeers>();                                 \
  template cudaError_t collective_occupancy<T>(int, int*);
// ... for the element type of DType::k<E> (a generated collectives_<short_name>.cu).
#define JAX_GIN_INSTANTIATE_COLLECTIVES_DTYPE(E) JAX_GIN_INSTANTIATE_COLLECTIVES(DeviceElem<DType::k##E>::type)

}  // namespace gpu
}  // namespace jax_gin
