// Host-side launch API of jax_gin's CUDA kernels. Includes no nanobind, Python or XLA, so
// both the FFI handlers and the native test harness can use it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

struct ncclDevComm;  // nccl_device.h
namespace jax_gin {
struct RecEntry;  // recorder.h
struct RecState;
struct HangReport;
}

#include <cstddef>
#include <cstdint>

#include "jax_gin/common.h"
#include "jax_gin/message.h"

namespace jax_gin {
namespace gpu {

struct LaneParams;

// Where one rank's windows are: an NCCL window (LSA) or a device array of peer base pointers.
struct PeerAccess {
  ncclWindow_t win = nullptr;        // NCCL window, or
  char* const* table = nullptr;      // device array [nranks] of window bases (harness)
  // Groups that span nodes (hierarchical with an NCCL window): the device communicator with
  // GIN, copied into the kernel's arguments. With `table`, GIN is emulated over P2P instead.
  const ncclDevComm* devcomm = nullptr;
};

// LaunchConfig::rounds: each lane's round counter for the simple protocol, then for LL, then
// the word that the first timed-out wait claims to write the hang report (claim_report).
constexpr size_t kReportClaimIndex = 2 * size_t(kMaxLanes);
constexpr size_t kRoundCountersBytes = (kReportClaimIndex + 1) * sizeof(uint64_t);

struct LaunchConfig {
  int rank = 0, nranks = 1, group = 0;
  size_t flags_offset = 0;   // bytes, inside each window
  size_t data_offset = 0;    // bytes, inside each window
  size_t ll_offset = 0;      // bytes, inside each window: the LL area
  // one_shot uses the LL protocol up to this size (JAX_GIN_LL_MAX_BYTES), at most the LL
  // area's 256 KiB. On 2 x H200 the kernel alone (graph replay) took 4.5 / 4.9 us at
  // 128 / 256 KiB over LL against 8.3 / 8.8 us over flags and credits (2026-11-30, 2aa7255).
  size_t ll_max_bytes = 256 << 10;
  size_t lane_bytes = 0;     // data bytes per lane
  // Pipelining chunk of ring, tree and two_shot (JAX_GIN_CHUNK_BYTES; the same on every rank
  // of a group). Each chunk costs one system-scope release (NVLink acknowledgements). On 2 x
  // H200 with 1 MiB lanes, 128 KiB chunks were 1-3% slower than whole steps at 4-64 MiB
  // (harness, 2026-11-30, `cd615b5`: design.md): chunks only split larger lanes.
  size_t chunk_bytes = 512 << 10;
  // one_shot's pipelining chunk (JAX_GIN_ONE_SHOT_CHUNK_BYTES): smaller, because its point is
  // to overlap the local reduction with the transfer inside one lane's slice.
  size_t one_shot_chunk_bytes = 32 << 10;
  uint64_t* rounds = nullptr;   // device: kRoundCountersBytes (simple, then LL)
  HangReport* diag = nullptr;   // host-mapped (device pointer of it)
  // This rank's state block (recorder.h RecState) at `state_offset` of every window (within
  // one node; 0 and null where the group spans nodes): `state` points into its own window.
  size_t state_offset = 0;
  RecState* state = nullptr;
  uint64_t timeout_ns = uint64_t(kDefaultTimeoutS * 1e9);
  int fault_rank = -1;
  int threads = 512;
  int max_lanes = kMaxLanes;  // JAX_GIN_MAX_LANES
  // One lane per this many bytes (JAX_GIN_LANE_GRAIN_BYTES). 16 KiB: on 2 x H200 (2026-11-30,
  // float32, 64 KiB - 4 MiB) one_shot and two_shot were as fast or faster than with 64 KiB,
  // most at 4 MiB (one_shot 0.94x -> 1.06x of lax, two_shot 0.80x -> 1.06x); 4 KiB no better.
  size_t lane_grain_bytes = 16u << 10;
  // Groups that span nodes (set by set_window_layout with ranks_per_node): the node size and
  // the GIN areas of the window. ranks_per_node > 0 only for such groups.
  int ranks_per_node = 0;
  size_t rail_offset = 0;        // bytes: last-sent tags, then emulated signals
  size_t outbox_offset = 0;      // bytes: kMaxLanes outboxes of outbox_lane_bytes
  size_t outbox_lane_bytes = 0;
  // Flight recorder (device memory; null: none): the ring of rec_entries entries and the
  // control words ([0] recording on, [1] calls recorded), and the id the entries carry.
  RecEntry* rec_ring = nullptr;
  uint64_t* rec_ctl = nullptr;
  uint32_t rec_entries = 0;
  int rec_comm = 0;
  // The call as recorded and reported (CallOp) where it is not the launch's own op: the fused
  // norms' all-reduce. -1: the launch's op.
  int32_t call_op = -1;
};

// Number of lanes (CTAs) used for a message of `bytes` with `algo`. Depends only on its
// arguments, so every rank of a group makes the same choice.
int choose_lanes(Algorithm algo, size_t bytes, int nranks, int max_lanes, size_t grain = 16u << 10);

// Launches one rank's part of an all-reduce on `stream`. Returns the launch error, if any.
// kHierarchical (internal) runs only where cfg.ranks_per_node is set, over PeerAccess's
// `table` (GIN emulated over P2P) or `win` + `devcomm` (NCCL GIN).
cudaError_t launch_allreduce(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                             RedOp op, Algorithm algo, const void* in, void* out, size_t count,
                             cudaStream_t stream);

// Several buffers of one dtype reduced as one message (message.h), in one launch: `seg` holds
// each buffer's count, in and out (their logical starts are filled in here). Over an NCCL
// window, or the harness's table of peers; 1 <= nseg <= kMaxSegments. kHierarchical launches
// once per buffer.
cudaError_t launch_allreduce(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                             RedOp op, Algorithm algo, Segment* seg, int nseg,
                             cudaStream_t stream);

// Launches one rank's part of a reduce-scatter (call_op kOpReduceScatter: `in` holds nranks
// blocks of `block` elements, block q summed over the group into rank q's `out`) or an
// all-gather (kOpAllGather: `in` is one block, which lands as block `rank` of every rank's
// `out`), with algo one_shot or ring (collectives.h); block * dtype size must be a multiple
// of 16 bytes. Its lanes share the all-reduces' round counters and windows. Groups within
// one node only: cudaErrorNotSupported where cfg.ranks_per_node is set (groups that span
// nodes run only the hierarchical all-reduce); cudaErrorInvalidValue for another op or
// algorithm, a misaligned block, or lanes too small for one 16-byte vector per window slot.
cudaError_t launch_collective(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                              int call_op, Algorithm algo, const void* in, void* out, size_t block,
                              cudaStream_t stream);
// Lanes (CTAs) of a reduce-scatter or all-gather with `algo` of blocks of `block_bytes` over
// nranks: choose_lanes of its large side (nranks blocks), at most one per 16-byte vector of a
// block. Depends only on its arguments, so every rank of a group makes the same choice.
int collective_lanes(Algorithm algo, size_t block_bytes, int nranks, int max_lanes,
                     size_t grain = 16u << 10);

// The copy-engine path of asynchronous calls (copy_engine.cu): two_shot's schedule with the
// data moved by cudaMemcpyAsync into and out of the peers' windows, the SMs only reducing (a
// local kernel of at most `reduce_ctas` CTAs) and synchronizing (one-warp kernels on lane 0's
// flags, with the timeout). One buffer, a group within one node. `bases[q]`: rank q's window
// base as a pointer of this process (host array of nranks; lsa_window_bases for an NCCL
// window). Same results, bit for bit, as two_shot and one_shot.
// `aux` (optional): a second stream and two events of this rank, so that one round's pull
// runs beside the next round's push; without it every copy runs on `stream`.
struct CopyEngineAux {
  cudaStream_t stream = nullptr;
  cudaEvent_t reduced = nullptr, pulled = nullptr;
};
cudaError_t launch_allreduce_copy_engine(const PeerAccess& peers, char* const* bases,
                                         const LaunchConfig& cfg, DType dtype, RedOp op,
                                         const void* in, void* out, size_t count, int reduce_ctas,
                                         cudaStream_t stream, const CopyEngineAux* aux = nullptr);
// Elements of one rank's segment per round of the copy-engine path (its window's data area / N).
size_t copy_engine_slot_elems(const LaunchConfig& cfg, size_t elem_size);
// bases[0..nranks): every rank's window base through NCCL's LSA mapping, as pointers of this
// process (host array). Runs a kernel and synchronizes: call it while building the rank.
cudaError_t lsa_window_bases(ncclWindow_t win, int nranks, char** bases);

// Loads every kernel on the current device now, so that no lazy module load (which takes a
// global lock) happens while a peer's kernel spins: those over NCCL windows, and with
// `table_peers` those over the native harness's table of peers too.
cudaError_t preload_kernels(bool table_peers);

// Window layout of one rank: flags, the state area (kStateAreaBytes), the LL area, then kMaxLanes
// data areas of lane_bytes (set_window_layout).
// A group that spans nodes (0 < ranks_per_node < nranks, ranks_per_node dividing nranks) has
// no LL area and two more: the rail area (last-sent tags and emulated GIN signals) and
// kMaxLanes outboxes (GIN stages rail puts there). ranks_per_node = 0: one node.
size_t window_flags_bytes(int nranks);
size_t window_ll_bytes(int nranks);
bool spans_nodes(int nranks, int ranks_per_node);
size_t outbox_lane_bytes(int nranks, int ranks_per_node, size_t lane_bytes);
// Fills the offsets of `cfg` (and ranks_per_node, ll_max_bytes for spanning groups).
void set_window_layout(LaunchConfig& cfg, int nranks, size_t lane_bytes, int ranks_per_node = 0);
size_t window_bytes(int nranks, size_t lane_bytes, int ranks_per_node = 0);
size_t lane_bytes_for_workspace(size_t workspace_bytes);
// GIN signals a spanning group's device communicator needs (ginSignalCount).
int gin_signal_count(int nranks, int ranks_per_node);

// Native harness: how many CTAs of `threads` threads of the kernel that runs `algo` over a
// pointer table (GIN emulated for kHierarchical) fit on the current device at once. Ranks
// that share a GPU spin on each other, so all their lanes must be resident together.
cudaError_t resident_ctas(Algorithm algo, DType dtype, int threads, int* ctas);
// The same for the reduce-scatter / all-gather kernel (launch_collective).
cudaError_t resident_collective_ctas(DType dtype, int threads, int* ctas);
// The lanes an all-reduce uses at most by default on `device`: one per SM, up to kMaxLanes, so
// that all of them are resident at once (a lane may spin until its peers' same lane runs).
int default_max_lanes(int device);

// psum_add_rmsnorm's and psum_add_layernorm's epilogue (norm.h), after the all-reduce has
// written the sum of each element into `new_residual`: per row of d, new_residual = residual +
// sum and `normed` its RMSNorm times `weight` (bias null), or its LayerNorm times `weight` plus
// `bias`. float32, bfloat16 and float16 only (cudaErrorInvalidValue else).
cudaError_t launch_add_norm(DType dtype, const void* residual, void* new_residual,
                            const void* weight, const void* bias, void* normed, size_t rows,
                            size_t d, float eps, cudaStream_t stream);
// The same of x (rows x d) in one one_shot kernel over the LL protocol: the sum, the residual
// add and the norm (norm_row.cuh), the same bits as launch_allreduce (one_shot) then
// launch_add_norm. cudaErrorNotSupported where it does not apply (one_shot would not take LL,
// a row is larger than an LL lane's 8 KiB, or the rows need more than its 32 lanes, a lane
// taking the rows that fit both its 8 KiB and its block's norm groups): the caller then runs
// those two.
cudaError_t launch_add_norm_ll(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                               const void* x, const void* residual, void* new_residual,
                               const void* weight, const void* bias, void* normed, size_t rows,
                               size_t d, float eps, cudaStream_t stream);

}  // namespace gpu
}  // namespace jax_gin
