// jax_gin's GPU runtime: its own NCCL communicators, symmetric windows and device
// communicators, built before any program runs and looked up by the FFI handler.
// Host code only; no nanobind, Python or XLA.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <array>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#include "jax_gin/recorder.h"

namespace jax_gin {
namespace gpu {

// Thrown when the other processes of a group do not take part in setting it up within the
// timeout (Python: TimeoutError). Other failures throw std::runtime_error.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct RankState {
  int device = -1;        // local CUDA ordinal
  int group = 0, rank = 0, nranks = 1;
  uint32_t fingerprint = 0;  // its communicator's (the custom calls' "comm" attribute, ffi_common.h)
  ncclComm_t comm = nullptr;
  void* window_ptr = nullptr;       // ncclMemAlloc'd: [flags | state | LL | data] (kernels.h)
  ncclWindow_t win = nullptr;
  ncclDevComm devcomm{};
  bool has_devcomm = false;
  uint64_t* rounds = nullptr;       // device: per-lane round counters, never reset
  HangReport* diag_host = nullptr;  // host-mapped: what a timed-out wait leaves
  LaunchConfig cfg;                 // everything a launch needs, precomputed
  // Asynchronous calls (psum(..., overlap=True)): their kernels run on `side`, a stream of the
  // highest priority, forked from XLA's stream by fork[slot] at the start and joined into it
  // by join[slot] at the done. Created with the rank, before any program runs.
  cudaStream_t side = nullptr;
  cudaEvent_t fork[kAsyncSlots] = {};
  cudaEvent_t join[kAsyncSlots] = {};
  // Every rank's window base as a pointer of this process, for the copy engines
  // (launch_allreduce_copy_engine); empty for groups that span nodes.
  std::vector<char*> ce_bases;
  CopyEngineAux ce_aux;  // its second stream (as `side`'s priority) and events
  // Flight recorder (recorder.h): lane 0's ring and control words in device memory
  // (LaunchConfig::rec_ring, rec_ctl).
  RecEntry* rec_ring = nullptr;
  uint64_t* rec_ctl = nullptr;
  // The last line of its hang reports (empty: none): jax_gin.runtime names the group's mesh
  // axes and devices there (set_group_text), since a report's ranks are the group's own.
  std::string group_text;
};

// The launch settings of a communicator's ranks, from jax_gin.runtime.settings (Python reads
// and checks them, JAX_GIN_* in the environment; native code reads no environment variable).
// Unset: LaunchConfig's default (kernels.h).
struct LaunchSettings {
  std::optional<int> max_lanes;               // unset: the device's SM count (default_max_lanes)
  std::optional<size_t> lane_grain_bytes;
  std::optional<size_t> chunk_bytes;
  std::optional<size_t> one_shot_chunk_bytes;
  std::optional<size_t> ll_max_bytes;         // never turns LL on where the window has no LL area
  bool experimental_gin = false;              // groups that span nodes may run over GIN
  int record_entries = kRecDefaultEntries;     // the flight recorder's ring per rank
};

// Creates one communicator per group. groups[g][r] is the local CUDA ordinal of rank r of
// group g. Throws std::runtime_error with NCCL's or CUDA's message on failure. `id`: the
// communicator's id, which the custom calls name (ffi_common.h), as jax_gin.runtime chooses
// it (_runtime._free_id), or 0 for the next free one of a counter; std::invalid_argument if
// taken.
int64_t comm_create(const std::vector<std::vector<int>>& groups, size_t workspace_bytes,
                    double timeout_s, int fault_rank, const LaunchSettings& launch = {},
                    int64_t id = 0);
// Several processes: this process's ranks of some groups, each group with an NCCL unique id
// that the caller shared among the processes (the process of rank 0 made it with unique_id()).
struct GroupSpec {
  int group = 0;            // index of the group in its communicator (diagnostics)
  int nranks = 1;           // ranks in the whole group, over every process
  std::string unique_id;    // sizeof(ncclUniqueId) bytes
  std::vector<int> ranks;   // this process's ranks of the group ...
  std::vector<int> devices; // ... and their local CUDA ordinals
};
// A fresh ncclUniqueId (ncclGetUniqueId) as bytes. The calling process hosts NCCL's bootstrap
// root for the group until its ranks have joined.
std::string unique_id();
// Like comm_create, for groups whose ranks live in several processes: ncclCommInitRankConfig
// (nonblocking) for each local rank (one NCCL group when a process has several), then the same
// windows and device communicators as comm_create. Collective: every process of every group
// must call it with its own ranks, groups in the same order. Each collective step waits at
// most timeout_s for the other processes, then aborts the communicators and throws
// TimeoutError naming the group and the ranks that did not come. A group that spans nodes
// (NCCL's LSA team is smaller than the group) gets a device communicator with GIN and runs
// only hierarchical; it throws (the same error on every rank) if NCCL has no GIN, the ranks
// are not node-major, or launch.experimental_gin is off (JAX_GIN_EXPERIMENTAL_GIN; that path
// is built but never ran on two nodes).
int64_t comm_create_ranks(const std::vector<GroupSpec>& groups, size_t workspace_bytes,
                          double timeout_s, int fault_rank, const LaunchSettings& launch = {},
                          int64_t id = 0);
void comm_destroy(int64_t id);
// Ranks per node of communicator `id`'s groups if they span nodes (they then run only the
// hierarchical algorithm), else 0. Throws if this process's groups of it differ.
int comm_ranks_per_node(int64_t id);
// The state of the rank that runs on `device`, or nullptr.
const RankState* find_rank(int64_t id, int device);
// Whether communicator `id` exists in this process with `fingerprint` (on any device).
bool comm_exists(int64_t id, uint32_t fingerprint);
// Sets communicator `id`'s fingerprint, before any program that uses it is lowered.
void set_fingerprint(int64_t id, uint32_t fingerprint);
// Sets the last line of the hang reports of each group of communicator `id` (by group index),
// before any program that uses it is lowered.
void set_group_text(int64_t id, const std::vector<std::string>& texts);
// Messages of every timed-out wait recorded for communicator `id` (all if id < 0).
std::vector<std::string> diagnostics(int64_t id);
// A timed-out wait's report as text: the wait, the diagnosis of who is behind (from the
// ranks' state blocks, where it has them), and `group_text` as the last line where not empty.
std::string describe(const HangReport& r, int nranks, const std::string& group_text = std::string());
void shutdown();
// The flight recorder of every rank of this process, now and for communicators created later:
// on or off. Waits for its copies only (each on a stream of its own), not for XLA's streams.
void set_record(bool on);
bool recording();
// Communicator `id`'s recorded calls of this process's ranks (seq != 0), oldest first by rank;
// and how many calls each rank recorded so far: (group, rank, count).
std::vector<RecEntry> recorder_entries(int64_t id);
std::vector<std::array<int64_t, 3>> recorder_counts(int64_t id);
int nccl_runtime_version();
// Empty if the loaded NCCL matches the headers we were built against, else why not.
std::string check_nccl_version();

}  // namespace gpu
}  // namespace jax_gin
