// The CPU backend: the same algorithms as the GPU (include/jax_gin/algorithms.h), run by the
// CPU devices of one process, each on its own thread, over a host "symmetric workspace":
// one window and one flag area per rank, written by peers with one-sided puts and signals.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "jax_gin/common.h"

namespace jax_gin {
namespace cpu {

struct CommConfig {
  int nranks = 1;                // ranks per group
  std::vector<int32_t> group_of;  // indexed by logical device id (XLA partition id)
  std::vector<int32_t> rank_of;   // indexed by logical device id
  size_t lane_bytes = 1 << 20;    // window bytes per rank (one lane on the CPU)
  double timeout_s = 30.0;        // every wait gives up after this long
  int fault_rank = -1;            // testing only: this rank's signals are dropped
};

// One group of ranks that reduce together, with its symmetric workspace.
struct Group {
  Group(int nranks, size_t lane_bytes);
  int nranks;
  size_t lane_bytes;
  std::vector<std::unique_ptr<char[]>> window;                   // per rank
  std::vector<std::unique_ptr<std::atomic<uint64_t>[]>> flags;  // per rank, flag_words(nranks)
  std::vector<uint64_t> round;  // per rank: touched only by that rank's own thread
  // per rank: 1 while a call runs. Two calls of one rank must never overlap (they share the
  // rank's round counter and window); if XLA ever ran them concurrently we fail loudly.
  std::unique_ptr<std::atomic<int>[]> busy;
  std::atomic<bool> broken{false};
  std::mutex error_mu;
  std::string first_error;
};

struct Comm {
  int64_t id = 0;
  CommConfig config;
  std::vector<std::unique_ptr<Group>> groups;
};

int64_t create_comm(const CommConfig& config);
void destroy_comm(int64_t id);
std::shared_ptr<Comm> find_comm(int64_t id);
int64_t num_comms();

// One rank's part of an all-reduce of `count` elements. Blocks until the rank is done.
// Returns an empty string on success, else a message naming op, rank, peer and step.
std::string allreduce(Comm& comm, int group, int rank, DType dtype, RedOp op, Algorithm algo,
                      const void* in, void* out, size_t count);

// Same, addressed by the logical device id that XLA reports as the partition id.
std::string allreduce_logical(Comm& comm, uint32_t logical_id, DType dtype, RedOp op,
                              Algorithm algo, const void* in, void* out, size_t count);

}  // namespace cpu
}  // namespace jax_gin
