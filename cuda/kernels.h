// Host-side launch API of jax_gin's CUDA kernels. Includes no nanobind, Python or XLA, so
// both the FFI handlers and the native test harness can use it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>

#include "jax_gin/common.h"

namespace jax_gin {
namespace gpu {

struct LaneParams;

// Where one rank's windows are: an NCCL window (LSA) or a device array of peer base pointers.
struct PeerAccess {
  ncclWindow_t win = nullptr;        // NCCL window, or
  char* const* table = nullptr;      // device array [nranks] of window bases (harness)
};

struct LaunchConfig {
  int rank = 0, nranks = 1, group = 0;
  size_t flags_offset = 0;   // bytes, inside each window
  size_t data_offset = 0;    // bytes, inside each window
  size_t ll_offset = 0;      // bytes, inside each window: the LL area
  size_t ll_max_bytes = 64 << 10;  // one_shot uses the LL protocol up to this size (JAX_GIN_LL_MAX_BYTES)
  size_t lane_bytes = 0;     // data bytes per lane
  // Pipelining chunk of ring, tree and two_shot (JAX_GIN_CHUNK_BYTES; the same on every rank
  // of a group). Each chunk costs one system-scope release (NVLink acknowledgements). On 2 x
  // H200 with 1 MiB lanes, 128 KiB chunks were 1-3% slower than whole steps at 4-64 MiB and
  // 512 KiB within 2% either way (harness, 2026-11-30): chunks only split larger lanes.
  size_t chunk_bytes = 512 << 10;
  uint64_t* rounds = nullptr;   // device: 2 * kMaxLanes round counters (simple, then LL)
  Diagnostic* diag = nullptr;   // host-mapped (device pointer of it)
  uint64_t timeout_ns = 30ull * 1000 * 1000 * 1000;
  int fault_rank = -1;
  int threads = 512;
  int max_lanes = kMaxLanes;  // JAX_GIN_MAX_LANES
};

// Number of lanes (CTAs) used for a message of `bytes` with `algo`. Depends only on its
// arguments, so every rank of a group makes the same choice.
int choose_lanes(Algorithm algo, size_t bytes, int nranks, int max_lanes);

// Launches one rank's part of an all-reduce on `stream`. Returns the launch error, if any.
cudaError_t launch_allreduce(const PeerAccess& peers, const LaunchConfig& cfg, DType dtype,
                             RedOp op, Algorithm algo, const void* in, void* out, size_t count,
                             cudaStream_t stream);

// Loads every kernel on the current device now, so that no lazy module load (which takes a
// global lock) happens while a peer's kernel spins.
cudaError_t preload_kernels();

// Window layout of one rank: flags, then the LL area, then kMaxLanes data areas of lane_bytes.
size_t window_flags_bytes(int nranks);
size_t window_ll_bytes(int nranks);
// Fills flags_offset, ll_offset and data_offset of `cfg` for this layout.
void set_window_layout(LaunchConfig& cfg, int nranks, size_t lane_bytes);
size_t window_bytes(int nranks, size_t lane_bytes);
size_t lane_bytes_for_workspace(size_t workspace_bytes);

}  // namespace gpu
}  // namespace jax_gin
