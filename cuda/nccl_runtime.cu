#include "nccl_runtime.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <stdexcept>

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
  r.lsaBarrierCount = kMaxLanes;  // one LSA barrier per lane; never barrierCount (a GIN resource in 2.29.7+)
  r.lsaMultimem = false;          // NVLink multicast must stay off on these hosts
  return r;
}

void destroy_ranks(std::vector<RankState>& ranks) {
  for (auto& s : ranks) {
    if (s.device >= 0) cudaSetDevice(s.device), cudaDeviceSynchronize();
  }
  for (auto& s : ranks) {
    if (s.device < 0) continue;
    cudaSetDevice(s.device);
    if (s.has_devcomm) ncclDevCommDestroy(s.comm, &s.devcomm);
    if (s.win) ncclCommWindowDeregister(s.comm, s.win);
    if (s.window_ptr) ncclMemFree(s.window_ptr);
    if (s.rounds) cudaFree(s.rounds);
    if (s.diag_host) cudaFreeHost(s.diag_host);
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
  std::ostringstream os;
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

int64_t comm_create(const std::vector<std::vector<int>>& groups, size_t workspace_bytes,
                    double timeout_s, int fault_rank) {
  if (std::string why = check_nccl_version(); !why.empty()) throw std::runtime_error(why);
  auto comm = std::make_unique<Comm>();
  for (int& d : comm->by_device) d = -1;
  const size_t lane_bytes = lane_bytes_for_workspace(workspace_bytes);
  if (lane_bytes == 0) throw std::runtime_error("jax_gin: GPU workspace too small");
  try {
    for (size_t g = 0; g < groups.size(); ++g) {
      const int n = int(groups[g].size());
      const size_t base = comm->ranks.size();
      comm->ranks.resize(base + n);
      // Kernels of earlier programs may still spin on these devices: let them finish before
      // allocating (cudaMalloc while a peer kernel spins can deadlock).
      for (int r = 0; r < n; ++r) {
        JG_CUDA(cudaSetDevice(groups[g][r]));
        JG_CUDA(cudaDeviceSynchronize());
        JG_CUDA(preload_kernels());
      }
      std::vector<ncclComm_t> comms(n);
      JG_NCCL(ncclCommInitAll(comms.data(), n, groups[g].data()));
      const size_t wbytes = window_bytes(n, lane_bytes);
      for (int r = 0; r < n; ++r) {
        RankState& s = comm->ranks[base + r];
        s.device = groups[g][r];
        s.group = int(g);
        s.rank = r;
        s.nranks = n;
        s.comm = comms[r];
        JG_CUDA(cudaSetDevice(s.device));
        JG_NCCL(ncclMemAlloc(&s.window_ptr, wbytes));
        JG_CUDA(cudaMemset(s.window_ptr, 0, wbytes));
        JG_CUDA(cudaMalloc(&s.rounds, 2 * kMaxLanes * sizeof(uint64_t)));
        JG_CUDA(cudaMemset(s.rounds, 0, 2 * kMaxLanes * sizeof(uint64_t)));
        JG_CUDA(cudaHostAlloc(&s.diag_host, sizeof(Diagnostic), cudaHostAllocMapped | cudaHostAllocPortable));
        std::memset(s.diag_host, 0, sizeof(Diagnostic));
        JG_CUDA(cudaDeviceSynchronize());
      }
      // Registration and device-communicator creation are collective: one group for all
      // local ranks, or the first call waits forever for the others.
      JG_NCCL(ncclGroupStart());
      for (int r = 0; r < n; ++r) {
        RankState& s = comm->ranks[base + r];
        JG_CUDA(cudaSetDevice(s.device));
        JG_NCCL(ncclCommWindowRegister(s.comm, s.window_ptr, wbytes, &s.win, NCCL_WIN_COLL_SYMMETRIC));
      }
      JG_NCCL(ncclGroupEnd());
      const ncclDevCommRequirements reqs = lsa_requirements();
      JG_NCCL(ncclGroupStart());
      for (int r = 0; r < n; ++r) {
        RankState& s = comm->ranks[base + r];
        JG_CUDA(cudaSetDevice(s.device));
        JG_NCCL(ncclDevCommCreate(s.comm, &reqs, &s.devcomm));
      }
      JG_NCCL(ncclGroupEnd());
      for (int r = 0; r < n; ++r) {
        RankState& s = comm->ranks[base + r];
        s.has_devcomm = true;
        if (s.win == nullptr)
          throw std::runtime_error("jax_gin: NCCL gave no symmetric window (device API unsupported here?)");
        if (s.device < 0 || s.device >= 256 || comm->by_device[s.device] >= 0)
          throw std::runtime_error("jax_gin: a device appears twice in one communicator");
        comm->by_device[s.device] = int(base + r);
        Diagnostic* diag_dev = nullptr;
        JG_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&diag_dev), s.diag_host, 0));
        LaunchConfig& c = s.cfg;
        c.rank = r;
        c.nranks = n;
        c.group = int(g);
        set_window_layout(c, n, lane_bytes);
        c.rounds = s.rounds;
        c.diag = diag_dev;
        c.timeout_ns = uint64_t(timeout_s * 1e9);
        c.fault_rank = fault_rank;
        if (const char* v = std::getenv("JAX_GIN_MAX_LANES")) c.max_lanes = std::atoi(v);
        if (const char* v = std::getenv("JAX_GIN_LL_MAX_BYTES"))
          c.ll_max_bytes = std::min<size_t>(c.ll_max_bytes, std::strtoull(v, nullptr, 10));
      }
    }
  } catch (...) {
    destroy_ranks(comm->ranks);
    throw;
  }
  std::unique_lock<std::shared_mutex> lock(g_mu);
  comm->id = g_next++;
  const int64_t id = comm->id;
  g_comms[id] = std::move(comm);
  return id;
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

const RankState* find_rank(int64_t id, int device) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_comms.find(id);
  if (it == g_comms.end() || device < 0 || device >= 256) return nullptr;
  const int i = it->second->by_device[device];
  return i < 0 ? nullptr : &it->second->ranks[i];
}

std::string describe(const Diagnostic& d, int nranks) {
  std::ostringstream os;
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
