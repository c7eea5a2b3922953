// jax_gin's CUDA all-reduce kernels: one kernel per (dtype, op, peer access), the algorithm
// chosen at run time. Each CTA is an independent lane that runs run_lane() (or, for groups
// that span nodes, run_lane_hierarchical()) from include/jax_gin/algorithms.h on its slice of
// the message, through its own slice of every window and its own flags, so lanes never
// synchronize with each other.
//
// Kernel doc blocks for the four algorithms live next to their code in algorithms.h:
// one_shot (latency), two_shot (bandwidth at small N), ring (bandwidth at any N), tree (log N
// latency). Synchronization: per-(lane, sender) monotonic flags in the receiver's window,
// release/acquire at system scope; rounds never reset. A wait that exceeds the timeout writes
// a Diagnostic to host-mapped memory and traps.
//
// launch_collective runs reduce-scatter and all-gather (include/jax_gin/collectives.h) the
// same way: one CTA per lane, over the same windows, flags and round counters
// (collectives_impl.cuh).
#include "kernels.h"
#include "norm_row.cuh"
#include "transport.cuh"

#include "jax_gin/collectives.h"
#include "jax_gin/schedule.h"

#include <algorithm>

namespace jax_gin {
namespace gpu {

// Defined in the generated kernels_<short_name>.cu, one translation unit per element type
// (kernels_impl.cuh).
template <class T, class Peers>
cudaError_t launch_op(RedOp op, const Peers& peers, const LaneParams& p, int lanes, int threads,
                      Algorithm algo, const void* in, void* out, size_t count, cudaStream_t s);
template <class T, class Peers>
cudaError_t preload_type();
template <class T, class Peers>
cudaError_t launch_multi_op(RedOp op, const Peers& peers, const LaneParams& p, int lanes, int threads,
                            Algorithm algo, const SegmentTable& table, size_t count, cudaStream_t s);
template <class T, class Peers>
cudaError_t preload_multi_type();
template <class T, class Peers, class Rail>
cudaError_t launch_hier_op(RedOp op, const Peers& peers, const Rail& rail, const LaneParams& p,
                           int lanes, int threads, const void* in, void* out, size_t count,
                           cudaStream_t s);
template <class T, class Peers, class Rail>
cudaError_t preload_hier_type();
template <class T>
cudaError_t table_occupancy(Algorithm algo, int threads, int* per_sm);
template <class T>
cudaError_t preload_ce_type();
template <class T, class Peers>
cudaError_t launch_ll_add_norm(const Peers& peers, const LaneParams& p, int lanes, const void* x,
                               const void* res, void* nr, const void* w, const void* b, void* out,
                               size_t rows, size_t d, size_t rows_per_lane, float eps,
                               cudaStream_t s);
template <class T, class Peers>
cudaError_t preload_ll_add_norm_type();
cudaError_t preload_copy_engine();  // copy_engine.cu
cudaError_t preload_add_norm();     // fused_norm.cu
// Defined in the generated collectives_<short_name>.cu (collectives_impl.cuh).
template <class T, class Peers>
cudaError_t launch_collective_typed(const Peers& peers, const LaneParams& p, int lanes, int threads,
                                    const void* in, void* out, size_t block, cudaStream_t s);
template <class T, class Peers>
cudaError_t preload_collective_type();
template <class T>
cudaError_t collective_occupancy(int threads, int* per_sm);

LaneParams lane_params(const LaunchConfig& cfg, int32_t op, Algorithm algo, DType dtype,
                       size_t count);

namespace {

// Instantiations are dtype x op x peer access (the algorithm is a run-time argument of each
// kernel). with_type calls f(ElemTag<T>{}) with the kernels' element type T of `dt`
// (JAX_GIN_DTYPES, common.h).
template <class F>
cudaError_t with_type(DType dt, F&& f) {
  return with_dtype<DeviceElem>(dt, cudaErrorInvalidValue, f);
}

// f for every element type, stopping at the first error.
template <class F>
cudaError_t for_each_type(F&& f) {
  for (int dt = 0; dt < kNumDTypes; ++dt)
    if (cudaError_t e = with_type(DType(dt), f); e != cudaSuccess) return e;
  return cudaSuccess;
}

template <class Peers>
cudaError_t launch_dtype(DType dt, RedOp op, const Peers& peers, const LaneParams& p, int lanes,
                         int threads, Algorithm algo, const void* in, void* out, size_t count,
                         cudaStream_t s) {
  return with_type(dt, [&](auto t) {
    return launch_op<typename decltype(t)::type>(op, peers, p, lanes, threads, algo, in, out, count, s);
  });
}

template <class Peers, class Rail>
cudaError_t launch_hier_dtype(DType dt, RedOp op, const Peers& peers, const Rail& rail,
                              const LaneParams& p, int lanes, int threads, const void* in,
                              void* out, size_t count, cudaStream_t s) {
  return with_type(dt, [&](auto t) {
    return launch_hier_op<typename decltype(t)::type>(op, peers, rail, p, lanes, threads, in, out, count, s);
  });
}

template <class Peers, class Rail>
cudaError_t preload_hier() {
  return for_each_type([](auto t) { return preload_hier_type<typename decltype(t)::type, Peers, Rail>(); });
}


// The hierarchical all-reduce of a group that spans nodes (cfg.ranks_per_node set by
// set_window_layout): LSA within the node, the rail between nodes through GIN (an NCCL window
// with its device communicator) or emulated GIN (a pointer table, native harness).
cudaError_t launch_hierarchical(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                                RedOp op, const void* in, void* out, size_t count,
                                cudaStream_t stream) {
  const Algorithm algo = Algorithm::kHierarchical;
  const int L = cfg.ranks_per_node;
  if (!spans_nodes(cfg.nranks, L) || cfg.outbox_lane_bytes == 0) return cudaErrorInvalidValue;
  const LaneParams p = lane_params(cfg, int32_t(op), algo, dtype, count);
  const int lanes = choose_lanes(algo, p.bytes, cfg.nranks, cfg.max_lanes, cfg.lane_grain_bytes);
  if (count == 0) return cudaSuccess;  // nothing to reduce
  if (peers.table != nullptr) {
    const EmulatedGinRail rail{peers.table, cfg.rank, cfg.rail_offset + rail_words(cfg.nranks / L) * 8};
    return launch_hier_dtype(dtype, op, TablePeers{peers.table}, rail, p, lanes, cfg.threads, in, out, count, stream);
  }
  if (peers.win == nullptr || peers.devcomm == nullptr) return cudaErrorInvalidValue;
  return launch_hier_dtype(dtype, op, NcclNodePeers{peers.win, L}, GinRail{*peers.devcomm, peers.win},
                           p, lanes, cfg.threads, in, out, count, stream);
}

template <class Peers>
cudaError_t preload_peers() {
  return for_each_type([](auto t) { return preload_type<typename decltype(t)::type, Peers>(); });
}

// Whether one_shot takes the LL protocol for a message of `bytes`; the lanes of either kind.
bool use_ll(const LaunchConfig& cfg, Algorithm algo, size_t bytes) {
  return algo == Algorithm::kOneShot && bytes <= cfg.ll_max_bytes &&
         bytes <= kLLLanePayload * kLLMaxLanes && cfg.nranks <= kLLMaxRanks && cfg.nranks > 1;
}
int lanes_for(const LaunchConfig& cfg, Algorithm algo, size_t bytes, bool ll) {
  return ll ? int((bytes + kLLLanePayload - 1) / kLLLanePayload)
            : choose_lanes(algo, bytes, cfg.nranks, cfg.max_lanes, cfg.lane_grain_bytes);
}

}  // namespace

// A launch's kernel parameters from the rank's configuration, for a call of `count` elements
// of `dtype` (also copy_engine.cu). `op` is what the recorder and hang reports name the call
// by (call_op_name): a RedOp's code, or kOpReduceScatter / kOpAllGather; cfg.call_op, where
// set, instead (the fused norms).
LaneParams lane_params(const LaunchConfig& cfg, int32_t op, Algorithm algo, DType dtype,
                       size_t count) {
  LaneParams p;
  p.rank = cfg.rank;
  p.nranks = cfg.nranks;
  p.group = cfg.group;
  p.flags_offset = cfg.flags_offset;
  p.data_offset = cfg.data_offset;
  p.lane_bytes = cfg.lane_bytes;
  p.rounds = cfg.rounds;
  p.diag = cfg.diag;
  p.state_offset = cfg.state_offset;
  p.state = cfg.state;
  p.timeout_ns = cfg.timeout_ns;
  p.fault_rank = cfg.fault_rank;
  p.op = cfg.call_op >= 0 ? cfg.call_op : op;
  p.algorithm = int32_t(algo);
  p.ll_offset = cfg.ll_offset;
  p.ll = 0;
  p.chunk_bytes = algo == Algorithm::kOneShot ? cfg.one_shot_chunk_bytes : cfg.chunk_bytes;
  p.ranks_per_node = cfg.ranks_per_node;
  p.rail_offset = cfg.rail_offset;
  p.outbox_offset = cfg.outbox_offset;
  p.outbox_lane_bytes = cfg.outbox_lane_bytes;
  p.rec_ring = cfg.rec_ring;
  p.rec_ctl = cfg.rec_ctl;
  p.rec_entries = cfg.rec_entries;
  p.rec_comm = cfg.rec_comm;
  p.dtype = int32_t(dtype);
  p.bytes = count * dtype_size(dtype);
  return p;
}

int choose_lanes(Algorithm algo, size_t bytes, int nranks, int max_lanes, size_t grain) {
  // Small messages: one lane (fewest flags). Larger: one lane per `grain` bytes of message
  // (JAX_GIN_LANE_GRAIN_BYTES, 16 KiB by default), up to max_lanes, so that many CTAs move
  // data over NVLink at once.
  (void)algo;
  (void)nranks;
  if (grain == 0) grain = 16u << 10;
  size_t lanes = (bytes + grain - 1) / grain;
  if (max_lanes < 1 || max_lanes > kMaxLanes) max_lanes = kMaxLanes;
  if (lanes < 1) lanes = 1;
  if (lanes > size_t(max_lanes)) lanes = size_t(max_lanes);
  return int(lanes);
}

cudaError_t launch_allreduce(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                             RedOp op, Algorithm algo, const void* in, void* out, size_t count,
                             cudaStream_t stream) {
  // The public algorithms need load/store access to every peer; kHierarchical runs only for
  // groups that span nodes (LSA within a node, GIN between nodes).
  if (algo == Algorithm::kHierarchical)
    return launch_hierarchical(peers, cfg, dtype, op, in, out, count, stream);
  if (int(algo) < 0 || int(algo) >= kNumAlgorithms) return cudaErrorInvalidValue;
  LaneParams p = lane_params(cfg, int32_t(op), algo, dtype, count);
  const size_t bytes = p.bytes;
  // Small one_shot messages take the LL protocol: no separate signal, fence or credit.
  p.ll = use_ll(cfg, algo, bytes);
  const int lanes = lanes_for(cfg, algo, bytes, p.ll);
  if (lanes == 0) return cudaSuccess;  // nothing to reduce
  if (peers.table != nullptr)
    return launch_dtype(dtype, op, TablePeers{peers.table}, p, lanes, cfg.threads, algo, in, out, count, stream);
  return launch_dtype(dtype, op, NcclPeers{peers.win}, p, lanes, cfg.threads, algo, in, out, count, stream);
}

cudaError_t launch_allreduce(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                             RedOp op, Algorithm algo, Segment* seg, int nseg,
                             cudaStream_t stream) {
  if (nseg < 1 || nseg > kMaxSegments) return cudaErrorInvalidValue;
  if (nseg == 1)
    return launch_allreduce(peers, cfg, dtype, op, algo, seg[0].in, seg[0].out, seg[0].count, stream);
  // hierarchical (groups that span nodes) takes one buffer per launch
  if (algo == Algorithm::kHierarchical) {
    for (int s = 0; s < nseg; ++s)
      if (cudaError_t e = launch_hierarchical(peers, cfg, dtype, op, seg[s].in, seg[s].out, seg[s].count, stream))
        return e;
    return cudaSuccess;
  }
  if (int(algo) < 0 || int(algo) >= kNumAlgorithms || (peers.win == nullptr && peers.table == nullptr))
    return cudaErrorInvalidValue;
  SegmentTable table;
  for (int s = 0; s < nseg; ++s) table.seg[s] = seg[s];
  table.n = nseg;
  const size_t count = lay_out_segments(table.seg, nseg, dtype_size(dtype));
  LaneParams p = lane_params(cfg, int32_t(op), algo, dtype, count);
  const size_t bytes = p.bytes;
  p.ll = use_ll(cfg, algo, bytes);
  const int lanes = lanes_for(cfg, algo, bytes, p.ll);
  if (lanes == 0 || count == 0) return cudaSuccess;
  return with_type(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    if (peers.table != nullptr)
      return launch_multi_op<T>(op, TablePeers{peers.table}, p, lanes, cfg.threads, algo, table, count, stream);
    return launch_multi_op<T>(op, NcclPeers{peers.win}, p, lanes, cfg.threads, algo, table, count, stream);
  });
}

int collective_lanes(Algorithm algo, size_t block_bytes, int nranks, int max_lanes, size_t grain) {
  const size_t lanes = size_t(choose_lanes(algo, block_bytes * size_t(nranks), nranks, max_lanes, grain));
  return int(std::max<size_t>(1, std::min(lanes, block_bytes / kAlignBytes)));
}

cudaError_t launch_collective(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                              int call_op, Algorithm algo, const void* in, void* out, size_t block,
                              cudaStream_t stream) {
  // Both schedules store into every peer's window: groups that span nodes (no load/store
  // access to the other nodes) run only the hierarchical all-reduce.
  if (cfg.ranks_per_node > 0) return cudaErrorNotSupported;
  if (call_op != kOpReduceScatter && call_op != kOpAllGather) return cudaErrorInvalidValue;
  if (int(algo) < 0 || int(algo) >= kNumAlgorithms || !schedule::coll_supported(algo))
    return cudaErrorInvalidValue;
  const size_t esize = dtype_size(dtype);
  if (esize == 0 || (block * esize) % kAlignBytes != 0) return cudaErrorInvalidValue;
  // A round moves at least one vector per block: every window slot must hold one.
  if (cfg.nranks > 1 && schedule::coll_slot_elems(algo, cfg.nranks, cfg.lane_bytes, esize) == 0)
    return cudaErrorInvalidValue;
  if (block == 0) return cudaSuccess;  // nothing to move
  // the recorder's size: the large side, as nccl-tests reports these collectives
  const LaneParams p = lane_params(cfg, call_op, algo, dtype, block * size_t(cfg.nranks));
  const int lanes = collective_lanes(algo, block * esize, cfg.nranks, cfg.max_lanes, cfg.lane_grain_bytes);
  return with_type(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    if (peers.table != nullptr)
      return launch_collective_typed<T>(TablePeers{peers.table}, p, lanes, cfg.threads, in, out, block, stream);
    if (peers.win == nullptr) return cudaErrorInvalidValue;
    return launch_collective_typed<T>(NcclPeers{peers.win}, p, lanes, cfg.threads, in, out, block, stream);
  });
}

cudaError_t launch_add_norm_ll(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                               const void* x, const void* residual, void* new_residual,
                               const void* weight, const void* bias, void* normed, size_t rows,
                               size_t d, float eps, cudaStream_t stream) {
  const size_t row_bytes = d * dtype_size(dtype), bytes = rows * row_bytes;
  if (rows == 0 || d == 0 || row_bytes > kLLLanePayload || !use_ll(cfg, Algorithm::kOneShot, bytes))
    return cudaErrorNotSupported;
  LaneParams p = lane_params(cfg, int32_t(RedOp::kSum), Algorithm::kOneShot, dtype, rows * d);
  p.ll = 1;
  return with_type(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    // a lane takes as many rows as fit both its payload and its block's norm groups, so that it
    // normalizes them all at once
    const size_t fit = kLLLanePayload / row_bytes, groups = size_t(kNormBlock / norm_row_threads<T>(d));
    const size_t rows_per_lane = fit < groups ? fit : groups;
    const size_t lanes = (rows + rows_per_lane - 1) / rows_per_lane;
    if (lanes > size_t(kLLMaxLanes)) return cudaErrorNotSupported;
    if (peers.table != nullptr)
      return launch_ll_add_norm<T>(TablePeers{peers.table}, p, int(lanes), x, residual,
                                   new_residual, weight, bias, normed, rows, d, rows_per_lane, eps,
                                   stream);
    return launch_ll_add_norm<T>(NcclPeers{peers.win}, p, int(lanes), x, residual, new_residual,
                                 weight, bias, normed, rows, d, rows_per_lane, eps, stream);
  });
}

cudaError_t preload_kernels(bool table_peers) {
  if (cudaError_t e = for_each_type([&](auto t) {
        using T = typename decltype(t)::type;
        const cudaError_t m = preload_multi_type<T, NcclPeers>();
        return m != cudaSuccess || !table_peers ? m : preload_multi_type<T, TablePeers>();
      }))
    return e;
  if (cudaError_t e = for_each_type([](auto t) { return preload_ce_type<typename decltype(t)::type>(); }))
    return e;
  if (cudaError_t e = preload_copy_engine()) return e;
  if (cudaError_t e = preload_add_norm()) return e;
  if (cudaError_t e = for_each_type([&](auto t) {
        using T = typename decltype(t)::type;
        const cudaError_t m = preload_ll_add_norm_type<T, NcclPeers>();
        return m != cudaSuccess || !table_peers ? m : preload_ll_add_norm_type<T, TablePeers>();
      }))
    return e;
  cudaError_t e = preload_peers<NcclPeers>();
  if (e != cudaSuccess) return e;
  if (table_peers && (e = preload_peers<TablePeers>()) != cudaSuccess) return e;
  if ((e = preload_hier<NcclNodePeers, GinRail>()) != cudaSuccess) return e;
  if (table_peers && (e = preload_hier<TablePeers, EmulatedGinRail>()) != cudaSuccess) return e;
  return for_each_type([&](auto t) {
    using T = typename decltype(t)::type;
    const cudaError_t c = preload_collective_type<T, NcclPeers>();
    return c != cudaSuccess || !table_peers ? c : preload_collective_type<T, TablePeers>();
  });
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

namespace {
size_t round_up_4k(size_t b) { return (b + 4095) / 4096 * 4096; }
}  // namespace

bool spans_nodes(int nranks, int ranks_per_node) {
  return ranks_per_node > 0 && ranks_per_node < nranks && nranks % ranks_per_node == 0;
}

// A lane's outbox mirrors its ring slots: the largest ring area over the element sizes.
size_t outbox_lane_bytes(int nranks, int ranks_per_node, size_t lane_bytes) {
  if (!spans_nodes(nranks, ranks_per_node)) return 0;
  const int M = schedule::hier_nodes(nranks, ranks_per_node);
  size_t most = 0;
  for (size_t e : {size_t(2), size_t(4), size_t(8)}) {
    const size_t slot = schedule::slot_elems(Algorithm::kHierarchical, nranks, lane_bytes, e, ranks_per_node);
    const size_t ring = schedule::hier_ring_slot_elems(slot, M, schedule::align_elems(e));
    most = std::max(most, size_t(schedule::hier_ring_slots(M)) * ring * e);
  }
  return (most + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
}

int gin_signal_count(int nranks, int ranks_per_node) {
  return spans_nodes(nranks, ranks_per_node) ? int(rail_words(nranks / ranks_per_node)) : 0;
}

// The state blocks' page (within one node): one RecState, this rank's, at its start.
constexpr size_t kStateAreaBytes = 4096;
static_assert(sizeof(RecState) <= kStateAreaBytes, "a state block fits its page");

size_t window_bytes(int nranks, size_t lane_bytes, int ranks_per_node) {
  const size_t data = size_t(kMaxLanes) * lane_bytes;
  if (!spans_nodes(nranks, ranks_per_node))
    return window_flags_bytes(nranks) + kStateAreaBytes + window_ll_bytes(nranks) + data;
  return window_flags_bytes(nranks) + round_up_4k(data) +
         round_up_4k(rail_area_bytes(nranks / ranks_per_node)) +
         size_t(kMaxLanes) * outbox_lane_bytes(nranks, ranks_per_node, lane_bytes);
}

void set_window_layout(LaunchConfig& cfg, int nranks, size_t lane_bytes, int ranks_per_node) {
  cfg.flags_offset = 0;
  cfg.lane_bytes = lane_bytes;
  if (!spans_nodes(nranks, ranks_per_node)) {
    // [flags | state | LL | data]
    cfg.state_offset = window_flags_bytes(nranks);
    cfg.ll_offset = cfg.state_offset + kStateAreaBytes;
    cfg.data_offset = cfg.ll_offset + window_ll_bytes(nranks);
    if (window_ll_bytes(nranks) == 0) cfg.ll_max_bytes = 0;
    cfg.ranks_per_node = 0;
    cfg.rail_offset = cfg.outbox_offset = cfg.outbox_lane_bytes = 0;
    return;
  }
  // [flags | data | rail | outboxes]: no LL area (hierarchical does not use it), and no state
  // blocks (a timed-out wait cannot read those of the other nodes' ranks).
  cfg.state_offset = 0;
  cfg.ll_offset = cfg.data_offset = window_flags_bytes(nranks);
  cfg.ll_max_bytes = 0;
  cfg.ranks_per_node = ranks_per_node;
  cfg.rail_offset = cfg.data_offset + round_up_4k(size_t(kMaxLanes) * lane_bytes);
  cfg.outbox_offset = cfg.rail_offset + round_up_4k(rail_area_bytes(nranks / ranks_per_node));
  cfg.outbox_lane_bytes = outbox_lane_bytes(nranks, ranks_per_node, lane_bytes);
}

int default_max_lanes(int device) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1)
    return 64;
  return std::min(sms, int(kMaxLanes));
}

namespace {
// CTAs of `per_sm` per SM on the whole current device.
cudaError_t on_every_sm(int per_sm, int* ctas) {
  int dev = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) *ctas = per_sm * sms;
  return e;
}
}  // namespace

cudaError_t resident_ctas(Algorithm algo, DType dtype, int threads, int* ctas) {
  int per_sm = 0;
  cudaError_t e = with_type(dtype, [&](auto t) {
    return table_occupancy<typename decltype(t)::type>(algo, threads, &per_sm);
  });
  return e != cudaSuccess ? e : on_every_sm(per_sm, ctas);
}

cudaError_t resident_collective_ctas(DType dtype, int threads, int* ctas) {
  int per_sm = 0;
  cudaError_t e = with_type(dtype, [&](auto t) {
    return collective_occupancy<typename decltype(t)::type>(threads, &per_sm);
  });
  return e != cudaSuccess ? e : on_every_sm(per_sm, ctas);
}

}  // namespace gpu
}  // namespace jax_gin
