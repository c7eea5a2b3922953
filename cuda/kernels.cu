// jax_gin's CUDA all-reduce kernels: one kernel per (dtype, op, peer access), the algorithm
// chosen at run time. Each CTA is an independent lane that runs run_lane() from
// include/jax_gin/algorithms.h on its slice of the message, through its own slice of every
// window and its own flags, so lanes never synchronize with each other.
//
// Kernel doc blocks for the four algorithms live next to their code in algorithms.h:
// one_shot (latency), two_shot (bandwidth at small N), ring (bandwidth at any N), tree (log N
// latency). Synchronization: per-(lane, sender) monotonic flags in the receiver's window,
// release/acquire at system scope; rounds never reset. A wait that exceeds the timeout writes
// a Diagnostic to host-mapped memory and traps.
#include "kernels.h"
#include "transport.cuh"

#include "jax_gin/schedule.h"

namespace jax_gin {
namespace gpu {

// Defined in kernels_<type>.cu (one translation unit per element type).
template <class T, class Peers>
cudaError_t launch_op(RedOp op, const Peers& peers, const LaneParams& p, int lanes, int threads,
                      Algorithm algo, const void* in, void* out, size_t count, cudaStream_t s);
template <class T, class Peers>
cudaError_t preload_type();

namespace {

// The one list of instantiations: dtype x op x peer access (the algorithm is a run-time
// argument of each kernel).
template <class Peers>
cudaError_t launch_dtype(DType dt, RedOp op, const Peers& peers, const LaneParams& p, int lanes,
                         int threads, Algorithm algo, const void* in, void* out, size_t count,
                         cudaStream_t s) {
  switch (dt) {
    case DType::kF32: return launch_op<float>(op, peers, p, lanes, threads, algo, in, out, count, s);
    case DType::kF64: return launch_op<double>(op, peers, p, lanes, threads, algo, in, out, count, s);
    case DType::kBF16: return launch_op<__nv_bfloat16>(op, peers, p, lanes, threads, algo, in, out, count, s);
    case DType::kF16: return launch_op<__half>(op, peers, p, lanes, threads, algo, in, out, count, s);
    case DType::kS32: return launch_op<int32_t>(op, peers, p, lanes, threads, algo, in, out, count, s);
    case DType::kS64: return launch_op<int64_t>(op, peers, p, lanes, threads, algo, in, out, count, s);
    case DType::kU32: return launch_op<uint32_t>(op, peers, p, lanes, threads, algo, in, out, count, s);
  }
  return cudaErrorInvalidValue;
}

template <class Peers>
cudaError_t preload_peers() {
  cudaError_t e;
  if ((e = preload_type<float, Peers>()) != cudaSuccess) return e;
  if ((e = preload_type<double, Peers>()) != cudaSuccess) return e;
  if ((e = preload_type<__nv_bfloat16, Peers>()) != cudaSuccess) return e;
  if ((e = preload_type<__half, Peers>()) != cudaSuccess) return e;
  if ((e = preload_type<int32_t, Peers>()) != cudaSuccess) return e;
  if ((e = preload_type<int64_t, Peers>()) != cudaSuccess) return e;
  return preload_type<uint32_t, Peers>();
}

}  // namespace

int choose_lanes(Algorithm algo, size_t bytes, int nranks, int max_lanes) {
  // Small messages: one lane (fewest flags). Larger: one lane per 64 KiB of message, up to
  // max_lanes, so that many CTAs move data over NVLink at once.
  (void)algo;
  (void)nranks;
  size_t lanes = (bytes + (64u << 10) - 1) / (64u << 10);
  if (max_lanes < 1 || max_lanes > kMaxLanes) max_lanes = kMaxLanes;
  if (lanes < 1) lanes = 1;
  if (lanes > size_t(max_lanes)) lanes = size_t(max_lanes);
  return int(lanes);
}

cudaError_t launch_allreduce(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                             RedOp op, Algorithm algo, const void* in, void* out, size_t count,
                             cudaStream_t stream) {
  // Only the public algorithms run on GPUs: kHierarchical needs a GIN transport (not yet).
  if (int(algo) < 0 || int(algo) >= kNumAlgorithms) return cudaErrorInvalidValue;
  LaneParams p;
  p.rank = cfg.rank;
  p.nranks = cfg.nranks;
  p.group = cfg.group;
  p.flags_offset = cfg.flags_offset;
  p.data_offset = cfg.data_offset;
  p.lane_bytes = cfg.lane_bytes;
  p.rounds = cfg.rounds;
  p.diag = cfg.diag;
  p.timeout_ns = cfg.timeout_ns;
  p.fault_rank = cfg.fault_rank;
  p.op = int32_t(op);
  p.algorithm = int32_t(algo);
  p.ll_offset = cfg.ll_offset;
  p.chunk_bytes = cfg.chunk_bytes;
  const size_t bytes = count * dtype_size(dtype);
  // Small one_shot messages take the LL protocol: no separate signal, fence or credit.
  p.ll = algo == Algorithm::kOneShot && bytes <= cfg.ll_max_bytes &&
         bytes <= kLLLanePayload * kLLMaxLanes && cfg.nranks <= kLLMaxRanks && cfg.nranks > 1;
  const int lanes = p.ll ? int((bytes + kLLLanePayload - 1) / kLLLanePayload)
                         : choose_lanes(algo, bytes, cfg.nranks, cfg.max_lanes);
  if (lanes == 0) return cudaSuccess;  // nothing to reduce
  if (peers.table != nullptr)
    return launch_dtype(dtype, op, TablePeers{peers.table}, p, lanes, cfg.threads, algo, in, out, count, stream);
  return launch_dtype(dtype, op, NcclPeers{peers.win}, p, lanes, cfg.threads, algo, in, out, count, stream);
}

cudaError_t preload_kernels() {
  cudaError_t e = preload_peers<NcclPeers>();
  if (e != cudaSuccess) return e;
  return preload_peers<TablePeers>();
}

size_t window_flags_bytes(int nranks) {
  size_t b = flag_words(nranks) * sizeof(uint64_t);
  return (b + 4095) / 4096 * 4096;
}

size_t lane_bytes_for_workspace(size_t workspace_bytes) {
  return workspace_bytes / kMaxLanes / 4096 * 4096;
}

size_t window_ll_bytes(int nranks) {
  return nranks <= kLLMaxRanks ? ll_area_bytes(nranks) : 0;
}

size_t window_bytes(int nranks, size_t lane_bytes) {
  return window_flags_bytes(nranks) + window_ll_bytes(nranks) + size_t(kMaxLanes) * lane_bytes;
}

void set_window_layout(LaunchConfig& cfg, int nranks, size_t lane_bytes) {
  cfg.flags_offset = 0;
  cfg.ll_offset = window_flags_bytes(nranks);
  cfg.data_offset = cfg.ll_offset + window_ll_bytes(nranks);
  cfg.lane_bytes = lane_bytes;
  if (window_ll_bytes(nranks) == 0) cfg.ll_max_bytes = 0;
}

}  // namespace gpu
}  // namespace jax_gin
