// Internals of the GPU runtime (nccl_runtime.h), shared by its three parts:
// comm_registry.cu (the communicators of this process, their teardown and diagnostics),
// comm_bootstrap.cu (creating them: NCCL communicators, windows, device communicators and
// launch configurations) and comm_spanning.cu (groups that span nodes: GIN).
// Host code only; no nanobind, Python or XLA.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "nccl_runtime.h"

#define JG_CUDA(call)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess)                                                             \
      throw std::runtime_error(std::string("jax_gin: ") + #call + ": " + cudaGetErrorString(e_)); \
  } while (0)
#define JG_NCCL(call)                                                                  \
  do {                                                                                 \
    ncclResult_t r_ = (call);                                                          \
    if (r_ != ncclSuccess)                                                             \
      throw std::runtime_error(std::string("jax_gin: ") + #call + ": " + ncclGetErrorString(r_)); \
  } while (0)

namespace jax_gin {
namespace gpu {
namespace detail {

struct Comm {
  int64_t id = 0;
  std::vector<RankState> ranks;
  int by_device[256];
};

using Clock = std::chrono::steady_clock;

// ---- comm_registry.cu -----------------------------------------------------------------------
bool comm_ready(ncclComm_t comm);
void destroy_ranks(std::vector<RankState>& ranks);
std::unique_ptr<Comm> new_comm();
// Registers `comm` under `id` (0: the next free one of a counter) and returns its id.
int64_t register_comm(std::unique_ptr<Comm> comm, int64_t id);
// Throws std::invalid_argument if a communicator has `id` (> 0) already.
void check_id_free(int64_t id);

// ---- comm_bootstrap.cu ----------------------------------------------------------------------
ncclDevCommRequirements lsa_requirements();
ncclResult_t wait_comms(ncclResult_t r, const std::vector<ncclComm_t>& comms, double timeout_s);
TimeoutError peers_did_not_come(const char* call, int g, int n, const std::vector<int>& ranks,
                                double timeout_s, bool joining);
std::string ranks_text(const std::vector<int>& v);
void alloc_rank(RankState& s, size_t wbytes);
void register_windows(Comm& comm, size_t base, const std::vector<ncclComm_t>& comms,
                      size_t wbytes, int g, int n, const std::vector<int>& ranks,
                      double timeout_s);
void finish_rank(Comm& comm, size_t i, int g, int n, size_t lane_bytes, int ranks_per_node,
                 double timeout_s, int fault_rank, const LaunchSettings& launch);
void equalize_lanes(Comm& comm, size_t base, int k);

// ---- comm_spanning.cu -----------------------------------------------------------------------
void setup_spanning_group(Comm& comm, const GroupSpec& spec, std::vector<ncclComm_t>& pending,
                          int lsa_size, size_t lane_bytes, double timeout_s, int fault_rank,
                          const LaunchSettings& launch);

}  // namespace detail
}  // namespace gpu
}  // namespace jax_gin
