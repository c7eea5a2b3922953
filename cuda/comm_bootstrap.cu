// Creating the GPU runtime's communicators: NCCL communicators (ncclCommInitAll in one
// process, ncclCommInitRankConfig from a unique id over several), each rank's window, its
// registration and device communicator, and the launch configurations.
#include "comm_internal.h"

#include "jax_gin/text.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <utility>

namespace jax_gin {
namespace gpu {
namespace detail {

ncclDevCommRequirements lsa_requirements() {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
  ncclDevCommRequirements r = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;  // GIN off by default
#else
  ncclDevCommRequirements r;
  std::memset(&r, 0, sizeof r);  // 2.28: no initializer; zero means GIN off on one node
#endif
  // The kernels synchronize with their own flags, not LSA barriers; a few are requested as
  // before. Never barrierCount (a GIN resource in 2.29.7+).
  r.lsaBarrierCount = 64;
  r.lsaMultimem = false;          // NVLink multicast must stay off on these hosts
  return r;
}

namespace {

// Ranks in ascending order, consecutive ones as a range: "1", "1, 3", "4-7".
std::string rank_ranges(std::vector<int> v) {
  std::sort(v.begin(), v.end());
  Text os;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    os << (i ? ", " : "") << v[i];
    if (j > i) os << "-" << v[j];
    i = j + 1;
  }
  return os.str();
}

}  // namespace

// Finishes an NCCL call (or group) on `comms`, whose result was `r`. A nonblocking
// communicator (ncclConfig_t.blocking = 0) returns ncclInProgress and does the work in an NCCL
// thread: this polls ncclCommGetAsyncError on each communicator until all report ncclSuccess
// (which also joins NCCL's thread) or one reports an error, and returns that. If `timeout_s`
// passes first it returns ncclInProgress; the caller must then ncclCommAbort every
// communicator (destroy_comms, destroy_ranks). A blocking communicator reports at once.
ncclResult_t wait_comms(ncclResult_t r, const std::vector<ncclComm_t>& comms, double timeout_s) {
  if (r != ncclSuccess && r != ncclInProgress) return r;
  const double limit = std::min(std::max(timeout_s, 0.0), 1e7);  // no overflow below
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit));
  std::vector<char> done(comms.size(), 0);
  auto pause = std::chrono::microseconds(100);
  for (;;) {
    bool all = true;
    for (size_t i = 0; i < comms.size(); ++i) {
      if (done[i] || comms[i] == nullptr) continue;
      ncclResult_t state = ncclInProgress;
      const ncclResult_t q = ncclCommGetAsyncError(comms[i], &state);
      if (q != ncclSuccess) return q;
      if (state == ncclSuccess) done[i] = 1;
      else if (state == ncclInProgress) all = false;
      else return state;
    }
    if (all) return ncclSuccess;
    if (Clock::now() >= deadline) return ncclInProgress;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
}

// The error for a collective set-up step (`call`) of group g (n ranks; `ranks` in this
// process) that the group's other processes did not complete within timeout_s: they never
// joined the communicator (joining), or joined and then stopped taking part.
TimeoutError peers_did_not_come(const char* call, int g, int n, const std::vector<int>& ranks,
                                double timeout_s, bool joining) {
  std::vector<int> others;
  for (int r = 0; r < n; ++r)
    if (std::find(ranks.begin(), ranks.end(), r) == ranks.end()) others.push_back(r);
  const auto rk = [](const std::vector<int>& v) {
    return std::string(v.size() == 1 ? "rank " : "ranks ") + rank_ranges(v);
  };
  Text os;
  os << "jax_gin: timed out after " << timeout_s << " s in " << call << " for group " << g
     << " (" << n << " ranks; " << rk(ranks) << " in this process): the other processes of the "
     << "group (" << rk(others) << ") "
     << (joining ? "did not join it" : "joined it but stopped taking part in its set-up")
     << ". A process of the job may have died or not been started, or be running a different "
     << "program (every process must lower the same jax_gin programs in the same order). "
     << "Set JAX_GIN_TIMEOUT_S to wait longer.";
  return TimeoutError(os.str());
}

namespace {

// Kernels of earlier programs may still spin on `device`: let them finish before allocating
// (cudaMalloc while a peer kernel spins can deadlock), and load every kernel there now.
void quiesce_device(int device) {
  JG_CUDA(cudaSetDevice(device));
  JG_CUDA(cudaDeviceSynchronize());
  JG_CUDA(preload_kernels(/*table_peers=*/false));
}

}  // namespace

// A rank's own buffers: its window (ncclMemAlloc, zeroed: flags start at 0), its per-lane round
// counters, and the host-mapped hang report.
void alloc_rank(RankState& s, size_t wbytes) {
  JG_CUDA(cudaSetDevice(s.device));
  JG_NCCL(ncclMemAlloc(&s.window_ptr, wbytes));
  JG_CUDA(cudaMemset(s.window_ptr, 0, wbytes));
  JG_CUDA(cudaMalloc(&s.rounds, kRoundCountersBytes));
  JG_CUDA(cudaMemset(s.rounds, 0, kRoundCountersBytes));
  JG_CUDA(cudaHostAlloc(&s.diag_host, sizeof(HangReport), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(s.diag_host, 0, sizeof(HangReport));
  // The side stream of asynchronous calls: the highest priority, so that its CTAs are placed
  // before those of the compute kernels queued beside it.
  int least = 0, greatest = 0;
  JG_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  JG_CUDA(cudaStreamCreateWithPriority(&s.side, cudaStreamNonBlocking, greatest));
  JG_CUDA(cudaStreamCreateWithPriority(&s.ce_aux.stream, cudaStreamNonBlocking, greatest));
  JG_CUDA(cudaEventCreateWithFlags(&s.ce_aux.reduced, cudaEventDisableTiming));
  JG_CUDA(cudaEventCreateWithFlags(&s.ce_aux.pulled, cudaEventDisableTiming));
  for (int k = 0; k < kAsyncSlots; ++k) {
    JG_CUDA(cudaEventCreateWithFlags(&s.fork[k], cudaEventDisableTiming));
    JG_CUDA(cudaEventCreateWithFlags(&s.join[k], cudaEventDisableTiming));
  }
  JG_CUDA(cudaDeviceSynchronize());
}

namespace {

// Ends the NCCL group of one collective set-up step (`call`) of group g. Registration and
// device-communicator creation are collective: one group for all local ranks, or the first
// call waits forever for the others. On nonblocking communicators (comm_create_ranks)
// ncclGroupEnd returns ncclInProgress: wait for the step, as long as the timeout, before the
// next one may use the communicators.
void end_setup_group(const std::vector<ncclComm_t>& comms, const char* call, int g, int n,
                     const std::vector<int>& ranks, double timeout_s) {
  const ncclResult_t r = wait_comms(ncclGroupEnd(), comms, timeout_s);
  if (r == ncclInProgress) throw peers_did_not_come(call, g, n, ranks, timeout_s, false);
  if (r != ncclSuccess)
    throw std::runtime_error(std::string("jax_gin: ncclGroupEnd() (") + call +
                             "): " + ncclGetErrorString(r));
}

}  // namespace

// Registers every local rank's window (collective; one NCCL group).
void register_windows(Comm& comm, size_t base, const std::vector<ncclComm_t>& comms,
                      size_t wbytes, int g, int n, const std::vector<int>& ranks,
                      double timeout_s) {
  JG_NCCL(ncclGroupStart());
  for (size_t i = 0; i < comms.size(); ++i) {
    RankState& s = comm.ranks[base + i];
    JG_CUDA(cudaSetDevice(s.device));
    JG_NCCL(ncclCommWindowRegister(s.comm, s.window_ptr, wbytes, &s.win, NCCL_WIN_COLL_SYMMETRIC));
  }
  end_setup_group(comms, "ncclCommWindowRegister", g, n, ranks, timeout_s);
}

// Once its window is registered and its device communicator exists: indexes rank
// comm.ranks[i] by device and fills its launch configuration (window layout for
// `ranks_per_node`, 0 within one node; `launch`, the settings Python passed).
void finish_rank(Comm& comm, size_t i, int g, int n, size_t lane_bytes, int ranks_per_node,
                 double timeout_s, int fault_rank, const LaunchSettings& launch) {
  RankState& s = comm.ranks[i];
  if (s.win == nullptr)
    throw std::runtime_error("jax_gin: NCCL gave no symmetric window (device API unsupported here?)");
  if (s.device < 0 || s.device >= 256 || comm.by_device[s.device] >= 0)
    throw std::runtime_error("jax_gin: a device appears twice in one communicator");
  comm.by_device[s.device] = int(i);
  HangReport* diag_dev = nullptr;
  JG_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&diag_dev), s.diag_host, 0));
  LaunchConfig& c = s.cfg;
  c.rank = s.rank;
  c.nranks = n;
  c.group = g;
  set_window_layout(c, n, lane_bytes, ranks_per_node);  // ranks_per_node > 0: hierarchical
  c.state = c.state_offset ? reinterpret_cast<RecState*>(static_cast<char*>(s.window_ptr) + c.state_offset)
                           : nullptr;
  c.rounds = s.rounds;
  c.diag = diag_dev;
  c.timeout_ns = uint64_t(timeout_s * 1e9);
  c.fault_rank = fault_rank;
  c.max_lanes = launch.max_lanes ? *launch.max_lanes : default_max_lanes(s.device);
  // The LL limit may be lowered or raised (the launch caps it at the LL area's 256 KiB), but
  // never turned on where the window has no LL area (set_window_layout left it 0).
  if (launch.ll_max_bytes && c.ll_max_bytes > 0) c.ll_max_bytes = *launch.ll_max_bytes;
  if (launch.chunk_bytes) c.chunk_bytes = *launch.chunk_bytes;
  if (launch.one_shot_chunk_bytes) c.one_shot_chunk_bytes = *launch.one_shot_chunk_bytes;
  if (launch.lane_grain_bytes) c.lane_grain_bytes = *launch.lane_grain_bytes;
  // the flight recorder, as recording() says now
  const size_t ring = size_t(launch.record_entries) * sizeof(RecEntry);
  JG_CUDA(cudaSetDevice(s.device));
  JG_CUDA(cudaMalloc(&s.rec_ring, ring));
  JG_CUDA(cudaMemset(s.rec_ring, 0, ring));
  JG_CUDA(cudaMalloc(&s.rec_ctl, 2 * sizeof(uint64_t)));
  const uint64_t ctl[2] = {recording() ? 1u : 0u, 0};
  JG_CUDA(cudaMemcpy(s.rec_ctl, ctl, sizeof ctl, cudaMemcpyHostToDevice));
  c.rec_ring = s.rec_ring;
  c.rec_ctl = s.rec_ctl;
  c.rec_entries = uint32_t(launch.record_entries);
  if (ranks_per_node == 0) {
    s.ce_bases.assign(size_t(n), nullptr);
    JG_CUDA(cudaSetDevice(s.device));
    JG_CUDA(lsa_window_bases(s.win, n, s.ce_bases.data()));
  }
}

// Every rank of a group must run the same lanes (lane i talks to its peers' lane i only), but
// the default cap is per device (its SM count): this process's ranks of the group take the
// smallest. Across processes, the bootstrap compares each process's value (jax_gin's
// gpu_launch_settings) and names a difference.
void equalize_lanes(Comm& comm, size_t base, int k) {
  int lanes = kMaxLanes;
  for (int i = 0; i < k; ++i) lanes = std::min(lanes, comm.ranks[base + i].cfg.max_lanes);
  for (int i = 0; i < k; ++i) comm.ranks[base + i].cfg.max_lanes = lanes;
}

std::string ranks_text(const std::vector<int>& v) {
  Text os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os.str();
}

namespace {

// Sets up this process's ranks of group `g` (of `n` ranks), whose NCCL communicators exist:
// rank ranks[i] runs on local device devices[i] with communicator comms[i]. Allocates each
// rank's window, registers the windows and creates the device communicators (each phase in
// one NCCL group for all local ranks), and fills the launch configurations. Appends the ranks
// to comm.ranks.
void setup_ranks(Comm& comm, int g, int n, const std::vector<int>& ranks,
                 const std::vector<int>& devices, const std::vector<ncclComm_t>& comms,
                 size_t lane_bytes, double timeout_s, int fault_rank,
                 const LaunchSettings& launch) {
  const int k = int(ranks.size());
  const size_t base = comm.ranks.size();
  comm.ranks.resize(base + k);
  const size_t wbytes = window_bytes(n, lane_bytes);
  // Every rank owns its NCCL communicator before the first allocation, so that one that fails
  // leaves no communicator outside comm.ranks (destroy_ranks destroys those inside).
  for (int i = 0; i < k; ++i) {
    RankState& s = comm.ranks[base + i];
    s.device = devices[i];
    s.group = g;
    s.rank = ranks[i];
    s.nranks = n;
    s.comm = comms[i];
  }
  for (int i = 0; i < k; ++i) alloc_rank(comm.ranks[base + i], wbytes);
  register_windows(comm, base, comms, wbytes, g, n, ranks, timeout_s);
  const ncclDevCommRequirements reqs = lsa_requirements();
  JG_NCCL(ncclGroupStart());
  for (int i = 0; i < k; ++i) {
    RankState& s = comm.ranks[base + i];
    JG_CUDA(cudaSetDevice(s.device));
    JG_NCCL(ncclDevCommCreate(s.comm, &reqs, &s.devcomm));
  }
  end_setup_group(comms, "ncclDevCommCreate", g, n, ranks, timeout_s);
  for (int i = 0; i < k; ++i) {
    comm.ranks[base + i].has_devcomm = true;
    finish_rank(comm, base + i, g, n, lane_bytes, 0, timeout_s, fault_rank, launch);
  }
  equalize_lanes(comm, base, k);
}

size_t lane_bytes_checked(size_t workspace_bytes) {
  const size_t lane_bytes = lane_bytes_for_workspace(workspace_bytes);
  if (lane_bytes == 0) throw std::runtime_error("jax_gin: GPU workspace too small");
  return lane_bytes;
}

// Communicators not handed to setup_ranks yet: destroyed, or aborted if an operation is still
// in flight on them (a set-up that timed out) or failed.
void destroy_comms(std::vector<ncclComm_t>& comms) {
  for (ncclComm_t& c : comms) {
    if (c) comm_ready(c) ? ncclCommDestroy(c) : ncclCommAbort(c);
    c = nullptr;
  }
}

}  // namespace
}  // namespace detail

using namespace detail;

int64_t comm_create(const std::vector<std::vector<int>>& groups, size_t workspace_bytes,
                    double timeout_s, int fault_rank, const LaunchSettings& launch, int64_t id) {
  check_id_free(id);
  std::unique_ptr<Comm> comm = new_comm();
  const size_t lane_bytes = lane_bytes_checked(workspace_bytes);
  try {
    for (size_t g = 0; g < groups.size(); ++g) {
      const int n = int(groups[g].size());
      for (int r = 0; r < n; ++r) quiesce_device(groups[g][r]);
      std::vector<ncclComm_t> comms(n);
      JG_NCCL(ncclCommInitAll(comms.data(), n, groups[g].data()));
      std::vector<int> ranks(n);
      for (int r = 0; r < n; ++r) ranks[r] = r;
      setup_ranks(*comm, int(g), n, ranks, groups[g], comms, lane_bytes, timeout_s, fault_rank,
                  launch);
    }
  } catch (...) {
    destroy_ranks(comm->ranks);
    throw;
  }
  return register_comm(std::move(comm), id);
}

// ---- Several processes: ncclCommInitRank from a unique id bootstrapped by the caller --------

std::string unique_id() {
  ncclUniqueId id;
  JG_NCCL(ncclGetUniqueId(&id));
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}

int64_t comm_create_ranks(const std::vector<GroupSpec>& groups, size_t workspace_bytes,
                          double timeout_s, int fault_rank, const LaunchSettings& launch,
                          int64_t id) {
  check_id_free(id);
  std::unique_ptr<Comm> comm = new_comm();
  const size_t lane_bytes = lane_bytes_checked(workspace_bytes);
  std::vector<ncclComm_t> pending;  // initialized, not yet handed to setup_ranks
  try {
    for (const GroupSpec& spec : groups) {
      const int n = spec.nranks, k = int(spec.ranks.size());
      if (spec.unique_id.size() != sizeof(ncclUniqueId))
        throw std::runtime_error("jax_gin: an NCCL unique id has " +
                                 std::to_string(spec.unique_id.size()) + " bytes, expected " +
                                 std::to_string(sizeof(ncclUniqueId)));
      if (k == 0 || k != int(spec.devices.size()))
        throw std::runtime_error("jax_gin: comm_create_ranks: ranks and devices differ in length");
      for (int r : spec.ranks)
        if (r < 0 || r >= n) throw std::runtime_error("jax_gin: comm_create_ranks: rank out of range");
      for (int d : spec.devices) quiesce_device(d);
      ncclUniqueId id;
      std::memcpy(&id, spec.unique_id.data(), sizeof id);
      pending.assign(k, nullptr);
      // Nonblocking communicators: ncclCommInitRankConfig returns at once (ncclInProgress) and
      // NCCL's thread joins the group; wait_comms waits for it, for timeout_s at most, so a
      // peer process that never comes (died, not started, another program) fails this one
      // instead of leaving it inside NCCL forever. Those that do not finish are aborted
      // (destroy_comms). NCCL_COMM_BLOCKING=1 in the environment overrides this (no timeout).
      // One process may run several ranks of the group: their inits form one NCCL group, or
      // the first would wait forever for the others.
      const auto ok = [](ncclResult_t x) { return x == ncclSuccess || x == ncclInProgress; };
      if (k > 1) JG_NCCL(ncclGroupStart());
      ncclResult_t r = ncclSuccess;
      cudaError_t ce = cudaSuccess;
      for (int i = 0; i < k && ok(r) && ce == cudaSuccess; ++i) {
        ce = cudaSetDevice(spec.devices[i]);
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        if (ce == cudaSuccess) r = ncclCommInitRankConfig(&pending[i], n, id, spec.ranks[i], &config);
      }
      if (k > 1) {  // close the group even on failure
        const ncclResult_t end = ncclGroupEnd();
        if (ok(r)) r = end;
      }
      JG_CUDA(ce);
      r = wait_comms(r, pending, timeout_s);
      if (r == ncclInProgress)
        throw peers_did_not_come("ncclCommInitRank", spec.group, n, spec.ranks, timeout_s, true);
      if (r != ncclSuccess)
        throw std::runtime_error(std::string("jax_gin: ncclCommInitRank (group ") +
                                 std::to_string(spec.group) + ", ranks " + ranks_text(spec.ranks) +
                                 " of " + std::to_string(n) + "): " + ncclGetErrorString(r));
      // The kernels address peers by LSA rank and use the group rank for it: valid only when
      // the whole group is one LSA team (one node, or one NVLink domain).
      const int lsa = ncclTeamLsa(pending[0]).nRanks;
      if (lsa > 0 && lsa < n) {  // spans nodes: LSA within a node, GIN between nodes
        setup_spanning_group(*comm, spec, pending, lsa, lane_bytes, timeout_s, fault_rank, launch);
        continue;
      }
      std::vector<ncclComm_t> comms = pending;
      pending.clear();  // from here on, comm->ranks owns them (as in comm_create)
      const size_t base = comm->ranks.size();
      setup_ranks(*comm, spec.group, n, spec.ranks, spec.devices, comms, lane_bytes, timeout_s,
                  fault_rank, launch);
      for (int i = 0; i < k; ++i) {
        const ncclDevComm& dc = comm->ranks[base + i].devcomm;
        if (dc.nRanks != n || dc.rank != spec.ranks[i] || dc.lsaSize != n || dc.lsaRank != dc.rank)
          throw std::runtime_error(
              "jax_gin: NCCL's device communicator of group " + std::to_string(spec.group) +
              " has rank " + std::to_string(dc.rank) + " of " + std::to_string(dc.nRanks) +
              " and LSA rank " + std::to_string(dc.lsaRank) + " of " + std::to_string(dc.lsaSize) +
              ", expected rank " + std::to_string(spec.ranks[i]) + " of " + std::to_string(n) +
              " in one LSA team");
      }
    }
  } catch (...) {
    destroy_comms(pending);
    destroy_ranks(comm->ranks);
    throw;
  }
  return register_comm(std::move(comm), id);
}

}  // namespace gpu
}  // namespace jax_gin
