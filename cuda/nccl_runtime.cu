#include "nccl_runtime.h"

#include "jax_gin/text.h"
#include "jax_gin/schedule.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <thread>

namespace jax_gin {
namespace gpu {
namespace {

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

struct Comm {
  int64_t id = 0;
  std::vector<RankState> ranks;
  int by_device[256];
};

std::shared_mutex g_mu;
std::map<int64_t, std::unique_ptr<Comm>> g_comms;
int64_t g_next = 1;

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

// A communicator with no NCCL operation in flight and no error: safe to destroy. Any other
// (a nonblocking operation still running, e.g. set-up whose peers stopped, or a failed one)
// must be aborted instead: ncclCommDestroy refuses such a communicator.
bool comm_ready(ncclComm_t comm) {
  ncclResult_t state = ncclInProgress;
  return ncclCommGetAsyncError(comm, &state) == ncclSuccess && state == ncclSuccess;
}

void destroy_ranks(std::vector<RankState>& ranks) {
  for (auto& s : ranks) {
    if (s.device >= 0) cudaSetDevice(s.device), cudaDeviceSynchronize();
  }
  for (auto& s : ranks) {  // abort first: it frees the windows and device communicators too
    if (s.device < 0 || !s.comm || comm_ready(s.comm)) continue;
    cudaSetDevice(s.device);
    ncclCommAbort(s.comm);
    s.comm = nullptr;
    s.win = nullptr;
    s.has_devcomm = false;
  }
  // On nonblocking communicators (comm_create_ranks) each of these calls may return
  // ncclInProgress and finish in NCCL's thread: settle() waits for it (10 s at most: this is
  // teardown) before the next call, and before the window's memory is freed.
  const auto settle = [](ncclComm_t c) {
    ncclResult_t st = ncclInProgress;
    for (int i = 0; i < 100000 && ncclCommGetAsyncError(c, &st) == ncclSuccess &&
                    st == ncclInProgress; ++i)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  };
  for (auto& s : ranks) {
    if (s.device < 0) continue;
    cudaSetDevice(s.device);
    if (s.has_devcomm) ncclDevCommDestroy(s.comm, &s.devcomm), settle(s.comm);
    if (s.win) ncclCommWindowDeregister(s.comm, s.win), settle(s.comm);
    if (s.window_ptr) ncclMemFree(s.window_ptr);
    if (s.rounds) cudaFree(s.rounds);
    if (s.diag_host) cudaFreeHost(s.diag_host);
    for (int k = 0; k < kAsyncSlots; ++k) {
      if (s.fork[k]) cudaEventDestroy(s.fork[k]);
      if (s.join[k]) cudaEventDestroy(s.join[k]);
    }
    if (s.side) cudaStreamDestroy(s.side);
    if (s.comm) ncclCommDestroy(s.comm);
  }
  ranks.clear();
}

}  // namespace

int nccl_runtime_version() {
  int v = 0;
  ncclGetVersion(&v);
  return v;
}

std::string check_nccl_version() {
  const int rt = nccl_runtime_version();
  Text os;
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 29, 0)
  const bool ok = rt >= NCCL_VERSION(2, 28, 7) && rt < NCCL_VERSION(2, 29, 0);
#else
  const bool ok = rt >= NCCL_VERSION_CODE;
#endif
  if (!ok) {
    os << "jax_gin was built against NCCL " << NCCL_VERSION_CODE << " but NCCL " << rt
       << " is loaded; the device API is not ABI-stable across these versions (needs 2.28.7+ "
          "and the same 2.28/2.29+ family): rebuild jax_gin against the NCCL that JAX loads";
  }
  return os.str();
}

namespace {

using Clock = std::chrono::steady_clock;

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

// Kernels of earlier programs may still spin on `device`: let them finish before allocating
// (cudaMalloc while a peer kernel spins can deadlock), and load every kernel there now.
void quiesce_device(int device) {
  JG_CUDA(cudaSetDevice(device));
  JG_CUDA(cudaDeviceSynchronize());
  JG_CUDA(preload_kernels());
}

// A rank's own buffers: its window (ncclMemAlloc, zeroed: flags start at 0), its per-lane round
// counters, and the host-mapped diagnostic slot.
void alloc_rank(RankState& s, size_t wbytes) {
  JG_CUDA(cudaSetDevice(s.device));
  JG_NCCL(ncclMemAlloc(&s.window_ptr, wbytes));
  JG_CUDA(cudaMemset(s.window_ptr, 0, wbytes));
  JG_CUDA(cudaMalloc(&s.rounds, kRoundCountersBytes));
  JG_CUDA(cudaMemset(s.rounds, 0, kRoundCountersBytes));
  JG_CUDA(cudaHostAlloc(&s.diag_host, sizeof(Diagnostic), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(s.diag_host, 0, sizeof(Diagnostic));
  // The side stream of asynchronous calls: the highest priority, so that its CTAs are placed
  // before those of the compute kernels queued beside it.
  int least = 0, greatest = 0;
  JG_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  JG_CUDA(cudaStreamCreateWithPriority(&s.side, cudaStreamNonBlocking, greatest));
  for (int k = 0; k < kAsyncSlots; ++k) {
    JG_CUDA(cudaEventCreateWithFlags(&s.fork[k], cudaEventDisableTiming));
    JG_CUDA(cudaEventCreateWithFlags(&s.join[k], cudaEventDisableTiming));
  }
  JG_CUDA(cudaDeviceSynchronize());
}

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
  Diagnostic* diag_dev = nullptr;
  JG_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&diag_dev), s.diag_host, 0));
  LaunchConfig& c = s.cfg;
  c.rank = s.rank;
  c.nranks = n;
  c.group = g;
  set_window_layout(c, n, lane_bytes, ranks_per_node);  // ranks_per_node > 0: hierarchical
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
  for (int i = 0; i < k; ++i) {
    RankState& s = comm.ranks[base + i];
    s.device = devices[i];
    s.group = g;
    s.rank = ranks[i];
    s.nranks = n;
    s.comm = comms[i];
    alloc_rank(s, wbytes);
  }
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

// What comm_create and comm_create_ranks both start with: an NCCL new enough for the device
// API, an empty Comm with no device mapped, and lanes that fit the workspace.
std::unique_ptr<Comm> new_comm() {
  if (std::string why = check_nccl_version(); !why.empty()) throw std::runtime_error(why);
  auto comm = std::make_unique<Comm>();
  for (int& d : comm->by_device) d = -1;
  return comm;
}

size_t lane_bytes_checked(size_t workspace_bytes) {
  const size_t lane_bytes = lane_bytes_for_workspace(workspace_bytes);
  if (lane_bytes == 0) throw std::runtime_error("jax_gin: GPU workspace too small");
  return lane_bytes;
}

int64_t register_comm(std::unique_ptr<Comm> comm) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  comm->id = g_next++;
  const int64_t id = comm->id;
  g_comms[id] = std::move(comm);
  return id;
}

}  // namespace

int64_t comm_create(const std::vector<std::vector<int>>& groups, size_t workspace_bytes,
                    double timeout_s, int fault_rank, const LaunchSettings& launch) {
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
  return register_comm(std::move(comm));
}

// ---- Several processes: ncclCommInitRank from a unique id bootstrapped by the caller --------

std::string unique_id() {
  ncclUniqueId id;
  JG_NCCL(ncclGetUniqueId(&id));
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}

namespace {

// The requirements a device communicator of a group that spans nodes asks for: LSA as in one
// node, plus GIN (GPU-initiated networking) between nodes with one signal per (lane, sending
// node, kind) (transport.cuh, rail_index). Only requested for such groups.
ncclDevCommRequirements gin_requirements(int signals) {
  ncclDevCommRequirements r = lsa_requirements();
  r.ginForceEnable = true;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7)
  r.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
#endif
  r.ginContextCount = 1;  // a hint: NCCL may give more or fewer; the kernels use context 0
  r.ginSignalCount = signals;
  return r;
}

std::string ranks_text(const std::vector<int>& v) {
  Text os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os.str();
}

// Why a rank cannot run its spanning group. Every rank of the group must take the same
// decision, or those that go on would wait forever in the next collective call, so the
// reasons are combined over the group (an NCCL all-reduce, max) before anyone acts on them.
enum SpanReason { kNoGin = 0, kNotNodeMajor, kWorkspace, kNotEnabled, kNumSpanReasons };

// Frees what agree() allocated, also when it throws. After a timeout the all-reduce is still
// waiting for peers that will not come: its stream would never drain, so the buffers and
// streams are abandoned (a few bytes, on an error path) and the caller aborts the
// communicators, which ends the NCCL kernel.
struct AgreeBuffers {
  std::vector<int> devices;
  std::vector<int*> bufs;
  std::vector<cudaStream_t> streams;
  bool abandon = false;
  ~AgreeBuffers() {
    if (abandon) return;
    for (size_t i = 0; i < devices.size(); ++i) {
      cudaSetDevice(devices[i]);
      if (i < streams.size() && streams[i]) cudaStreamSynchronize(streams[i]), cudaStreamDestroy(streams[i]);
      if (i < bufs.size() && bufs[i]) cudaFree(bufs[i]);
    }
  }
};

// The element-wise max of every rank's `mine` over the whole group (collective).
std::vector<int> agree(const GroupSpec& spec, const std::vector<ncclComm_t>& comms,
                       const std::vector<std::vector<int>>& mine, double timeout_s) {
  const int k = int(comms.size()), len = int(mine[0].size());
  AgreeBuffers b;
  b.devices = spec.devices;
  b.bufs.assign(k, nullptr);
  b.streams.assign(k, nullptr);
  for (int i = 0; i < k; ++i) {
    JG_CUDA(cudaSetDevice(spec.devices[i]));
    JG_CUDA(cudaStreamCreateWithFlags(&b.streams[i], cudaStreamNonBlocking));
    JG_CUDA(cudaMalloc(&b.bufs[i], len * sizeof(int)));
    JG_CUDA(cudaMemcpy(b.bufs[i], mine[i].data(), len * sizeof(int), cudaMemcpyHostToDevice));
  }
  JG_NCCL(ncclGroupStart());
  ncclResult_t r = ncclSuccess;
  for (int i = 0; i < k && r == ncclSuccess; ++i) {
    cudaSetDevice(spec.devices[i]);
    r = ncclAllReduce(b.bufs[i], b.bufs[i], len, ncclInt32, ncclMax, comms[i], b.streams[i]);
  }
  // Nonblocking communicators: the group ends in ncclInProgress; then the all-reduce kernels
  // wait for the other processes, so the streams are polled against the same deadline.
  const char* call = "ncclAllReduce (agreeing on the spanning group's set-up)";
  const ncclResult_t end = wait_comms(ncclGroupEnd(), comms, timeout_s);
  b.abandon = true;  // until the kernels have finished
  if (r != ncclInProgress) JG_NCCL(r);
  if (end == ncclInProgress) throw peers_did_not_come(call, spec.group, spec.nranks, spec.ranks, timeout_s, false);
  JG_NCCL(end);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(std::min(timeout_s, 1e7)));
  std::vector<int> all(len);
  for (int i = 0; i < k; ++i) {
    JG_CUDA(cudaSetDevice(spec.devices[i]));
    cudaError_t q;
    while ((q = cudaStreamQuery(b.streams[i])) == cudaErrorNotReady) {
      if (Clock::now() >= deadline)
        throw peers_did_not_come(call, spec.group, spec.nranks, spec.ranks, timeout_s, false);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    JG_CUDA(q);
  }
  b.abandon = false;
  JG_CUDA(cudaSetDevice(spec.devices[0]));
  JG_CUDA(cudaMemcpy(all.data(), b.bufs[0], len * sizeof(int), cudaMemcpyDeviceToHost));
  return all;
}

// A group that spans nodes: NCCL's LSA team (the ranks that reach each other's memory by
// load/store) is smaller than the group. Creates its device communicators with GIN (collective
// over the group, like every other step here); then, unless every rank of the group can run
// it, throws the same error on every rank: NCCL has no GIN here; the ranks are not node-major;
// the workspace is too small; or the GIN path is not enabled (launch.experimental_gin,
// JAX_GIN_EXPERIMENTAL_GIN=1: it is built but was never run on two nodes). Otherwise sets up the ranks like setup_ranks, with
// the window layout of a spanning group, and appends them to comm.ranks. Takes over `pending`
// (the group's communicators, cleared once comm.ranks owns them).
void setup_spanning_group(Comm& comm, const GroupSpec& spec, std::vector<ncclComm_t>& pending,
                          int lsa_size, size_t lane_bytes, double timeout_s, int fault_rank,
                          const LaunchSettings& launch) {
  const int n = spec.nranks, k = int(pending.size());
  const bool divides = lsa_size > 0 && n % lsa_size == 0;
  const ncclDevCommRequirements reqs = gin_requirements(divides ? gin_signal_count(n, lsa_size) : 0);
  std::vector<ncclDevComm> dcs(k);
  ncclResult_t r = ncclGroupStart();
  for (int i = 0; i < k && r == ncclSuccess; ++i) {
    cudaSetDevice(spec.devices[i]);
    r = ncclDevCommCreate(pending[i], &reqs, &dcs[i]);
  }
  const ncclResult_t end = wait_comms(ncclGroupEnd(), pending, timeout_s);  // nonblocking comms
  if (end == ncclInProgress)  // the peers did not take part: not a lack of GIN
    throw peers_did_not_come("ncclDevCommCreate (with GIN)", spec.group, n, spec.ranks, timeout_s, false);
  if (r == ncclSuccess) r = end;
  auto destroy_dcs = [&]() {  // only once all were created
    for (int i = 0; i < k; ++i) {
      cudaSetDevice(spec.devices[i]);
      ncclDevCommDestroy(pending[i], &dcs[i]);
    }
  };
  int contexts = 0, type = -1;
  std::vector<std::vector<int>> why(k, std::vector<int>(kNumSpanReasons, 0));
  if (r == ncclSuccess) {
    contexts = int(dcs[0].ginContextCount);
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 29, 0)
    if (contexts > 0) type = int(dcs[0].ginTypes[0]);  // 2 = proxy, 3 = GDAKI
#endif
    for (int i = 0; i < k; ++i) {
      const ncclDevComm& dc = dcs[i];
      why[i][kNoGin] = dc.ginContextCount == 0;
      why[i][kNotNodeMajor] = !divides || dc.lsaSize != lsa_size || dc.rank != spec.ranks[i] ||
                              dc.nRanks != n || dc.lsaRank != spec.ranks[i] % lsa_size;
      why[i][kWorkspace] = !divides || schedule::slot_elems(Algorithm::kHierarchical, n, lane_bytes,
                                                           8, lsa_size) == 0;
      why[i][kNotEnabled] = !launch.experimental_gin;
    }
    try {
      why[0] = agree(spec, pending, why, timeout_s);
    } catch (const TimeoutError&) {
      throw;  // an operation is still in flight: the caller aborts, which frees the dcs too
    } catch (...) {
      destroy_dcs();
      throw;
    }
  }
  Text os;
  os << "jax_gin: group " << spec.group << " (" << n << " ranks; ranks " << ranks_text(spec.ranks)
     << " in this process) spans nodes: NCCL's LSA team, the ranks that reach each other's "
     << "memory over NVLink, has only " << lsa_size << " of them. Between nodes jax_gin needs "
     << "NCCL's GPU-initiated networking (GIN). ";
  if (r != ncclSuccess || why[0][kNoGin]) {
    if (r == ncclSuccess) destroy_dcs();
    os << "NCCL reports no GIN support here ("
       << (r != ncclSuccess ? std::string("ncclDevCommCreate with GIN: ") + ncclGetErrorString(r)
                            : std::string("a device communicator of the group has 0 GIN contexts"))
       << "; NCCL " << nccl_runtime_version() << "). To check: an InfiniBand or RoCE NIC with "
       << "GPUDirect RDMA on every node (ibv_devinfo; nvidia-smi topo -m; the nvidia-peermem "
       << "module or DMA-BUF); NCCL >= 2.28.7 with GIN (NCCL_GIN_ENABLE not 0; NCCL_GIN_TYPE "
       << "unset, 2 = proxy or 3 = GDAKI); NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET prints "
       << "why NCCL found no GIN device; on NCCL >= 2.29, ncclCommQueryProperties reports "
       << "ginType. See docs/multi-node.md.";
    throw std::runtime_error(os.str());
  }
  os << "NCCL offers GIN here (" << contexts << " contexts";
  if (type >= 0) os << ", type " << type;
  os << "). ";
  if (why[0][kNotNodeMajor]) {
    destroy_dcs();
    os << "But jax_gin's hierarchical all-reduce needs node-major ranks: rank r must be local "
       << "rank r % " << lsa_size << " of node r / " << lsa_size << " (NCCL's lsaRank), and "
       << lsa_size << " must divide " << n << "; here some rank is not. Order the mesh "
       << "axis (or axes) reduced over node by node, every node's devices together in the same "
       << "order, as jax.devices() lists them.";
    throw std::runtime_error(os.str());
  }
  if (why[0][kWorkspace]) {
    destroy_dcs();
    os << "But the workspace of " << lane_bytes << " bytes per lane cannot hold one round of "
       << "the hierarchical all-reduce: raise JAX_GIN_WORKSPACE_BYTES.";
    throw std::runtime_error(os.str());
  }
  if (why[0][kNotEnabled]) {
    destroy_dcs();
    os << "jax_gin's GIN path (hierarchical: intra-node reduce-scatter over LSA, a ring over "
       << "GIN between the nodes' ranks of the same local rank, intra-node all-gather over LSA) "
       << "is built, and tested on one GPU with GIN emulated, but has never run on multi-node "
       << "hardware, so it is off by default. Set JAX_GIN_EXPERIMENTAL_GIN=1 in every process "
       << "(or jax_gin.runtime.settings.experimental_gin = True) to use it, or reduce over mesh axes whose devices share a node. See "
       << "docs/multi-node.md.";
    throw std::runtime_error(os.str());
  }
  // Every rank of the group goes on: the same steps as setup_ranks, with GIN's window layout.
  const size_t base = comm.ranks.size();
  comm.ranks.resize(base + k);
  for (int i = 0; i < k; ++i) {
    RankState& s = comm.ranks[base + i];
    s.device = spec.devices[i];
    s.group = spec.group;
    s.rank = spec.ranks[i];
    s.nranks = n;
    s.comm = pending[i];
    s.devcomm = dcs[i];
    s.has_devcomm = true;
  }
  std::vector<ncclComm_t> comms;
  comms.swap(pending);  // comm.ranks owns the communicators and device communicators now
  const size_t wbytes = window_bytes(n, lane_bytes, lsa_size);
  for (int i = 0; i < k; ++i) alloc_rank(comm.ranks[base + i], wbytes);
  // GIN is on in these communicators already, so registration also registers the windows
  // with GIN.
  register_windows(comm, base, comms, wbytes, spec.group, n, spec.ranks, timeout_s);
  for (int i = 0; i < k; ++i)
    finish_rank(comm, base + i, spec.group, n, lane_bytes, lsa_size, timeout_s, fault_rank, launch);
  equalize_lanes(comm, base, k);
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

int64_t comm_create_ranks(const std::vector<GroupSpec>& groups, size_t workspace_bytes,
                          double timeout_s, int fault_rank, const LaunchSettings& launch) {
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
  return register_comm(std::move(comm));
}

void comm_destroy(int64_t id) {
  std::unique_ptr<Comm> c;
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    auto it = g_comms.find(id);
    if (it == g_comms.end()) return;
    c = std::move(it->second);
    g_comms.erase(it);
  }
  destroy_ranks(c->ranks);
}

int comm_ranks_per_node(int64_t id) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_comms.find(id);
  if (it == g_comms.end()) throw std::runtime_error("jax_gin: no communicator " + std::to_string(id));
  const std::vector<RankState>& ranks = it->second->ranks;
  const int rpn = ranks.empty() ? 0 : ranks[0].cfg.ranks_per_node;
  for (const RankState& s : ranks) {
    if (s.cfg.ranks_per_node != rpn)
      throw std::runtime_error(
          "jax_gin: the groups of one reduction differ here: group " + std::to_string(ranks[0].group) +
          (rpn > 0 ? " spans nodes" : " lies in one node") + " but group " + std::to_string(s.group) +
          (s.cfg.ranks_per_node > 0 ? " spans nodes" : " lies in one node") +
          "; they would need different algorithms. Use a mesh whose groups are alike (the "
          "same number of devices of each node in every group).");
  }
  return rpn;
}

const RankState* find_rank(int64_t id, int device) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_comms.find(id);
  if (it == g_comms.end() || device < 0 || device >= 256) return nullptr;
  const int i = it->second->by_device[device];
  return i < 0 ? nullptr : &it->second->ranks[i];
}

std::string describe(const Diagnostic& d, int nranks) {
  Text os;
  os << "jax_gin " << redop_name(RedOp(d.op)) << " (" << algorithm_name(Algorithm(d.algorithm))
     << ") on GPU: rank " << d.rank << " of group " << d.group << " (" << nranks
     << " ranks) timed out waiting for peer " << d.peer;
  if (d.step < 0) os << " to release its window (credit) before round " << d.round;
  else os << " at step " << d.step << " of round " << d.round;
  os << " (lane " << d.lane << ", flag " << d.seen << ", expected " << d.expected
     << "). Set JAX_GIN_TIMEOUT_S to wait longer.";
  return os.str();
}

std::vector<std::string> diagnostics(int64_t id) {
  std::vector<std::string> out;
  std::shared_lock<std::shared_mutex> lock(g_mu);
  for (auto& [cid, c] : g_comms) {
    if (id >= 0 && cid != id) continue;
    for (auto& s : c->ranks) {
      Diagnostic d;
      std::memcpy(&d, const_cast<const Diagnostic*>(s.diag_host), sizeof d);
      if (d.valid) out.push_back(describe(d, s.nranks));
    }
  }
  return out;
}

void shutdown() {
  std::map<int64_t, std::unique_ptr<Comm>> all;
  {
    std::unique_lock<std::shared_mutex> lock(g_mu);
    all.swap(g_comms);
  }
  for (auto& [id, c] : all) destroy_ranks(c->ranks);
}

}  // namespace gpu
}  // namespace jax_gin
