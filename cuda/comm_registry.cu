// The GPU runtime's communicators in this process: the registry that the FFI handlers look
// ranks up in, teardown, diagnostics, and the NCCL version check.
#include "comm_internal.h"

#include "jax_gin/laggard.h"
#include "jax_gin/text.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <shared_mutex>
#include <stdexcept>
#include <thread>

namespace jax_gin {
namespace gpu {
namespace detail {
namespace {

std::shared_mutex g_mu;
std::map<int64_t, std::unique_ptr<Comm>> g_comms;
int64_t g_next = 1;

}  // namespace

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
    if (s.rec_ring) cudaFree(s.rec_ring);
    if (s.rec_ctl) cudaFree(s.rec_ctl);
    if (s.ce_aux.stream) cudaStreamDestroy(s.ce_aux.stream);
    if (s.ce_aux.reduced) cudaEventDestroy(s.ce_aux.reduced);
    if (s.ce_aux.pulled) cudaEventDestroy(s.ce_aux.pulled);
    if (s.comm) ncclCommDestroy(s.comm);
  }
  ranks.clear();
}

// What comm_create and comm_create_ranks both start with: an NCCL new enough for the device
// API, an empty Comm with no device mapped, and lanes that fit the workspace.
std::unique_ptr<Comm> new_comm() {
  if (std::string why = check_nccl_version(); !why.empty()) throw std::runtime_error(why);
  auto comm = std::make_unique<Comm>();
  for (int& d : comm->by_device) d = -1;
  return comm;
}

// The watchdog: a kernel whose wait timed out writes its HangReport into host-mapped memory and
// traps, and XLA then reports only an opaque CUDA error ("unspecified launch failure"), at the
// process's next CUDA call. This thread polls every rank's report and prints jax_gin's
// report to stderr the moment a kernel records it, with what state the process is in.
namespace {
std::atomic<bool> g_watch_stop{false};
std::thread* g_watchdog = nullptr;  // never deleted: joined at exit by stop_watchdog

void watchdog_loop() {
  std::set<std::pair<int64_t, int>> reported;  // (communicator, device) already printed
  while (!g_watch_stop.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::shared_lock<std::shared_mutex> lock(g_mu);
    for (auto& [cid, c] : g_comms)
      for (auto& s : c->ranks) {
        if (s.diag_host == nullptr || !s.diag_host->diag.valid || reported.count({cid, s.device}))
          continue;
        reported.insert({cid, s.device});
        HangReport d;
        std::memcpy(&d, const_cast<const HangReport*>(s.diag_host), sizeof d);
        std::fprintf(stderr,
                     "jax_gin watchdog: %s\njax_gin watchdog: the kernel trapped, so the CUDA "
                     "context of device %d is lost: this process's next CUDA call fails with "
                     "an unspecified launch failure, and it cannot continue. Restart it, and "
                     "its peers.\n",
                     describe(d, s.nranks, s.group_text).c_str(), s.device);
        std::fflush(stderr);
      }
  }
}

void stop_watchdog() {
  g_watch_stop.store(true);
  if (g_watchdog && g_watchdog->joinable()) g_watchdog->join();
}
}  // namespace

void check_id_free(int64_t id) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  if (id > 0 && g_comms.count(id))
    throw std::invalid_argument("jax_gin: communicator id " + std::to_string(id) + " is taken");
}

int64_t register_comm(std::unique_ptr<Comm> comm, int64_t id) {
  static std::once_flag started;
  try {  // (a thread that cannot start leaves the flag unset: the next set-up tries again)
    std::call_once(started, [] {
      g_watchdog = new std::thread(watchdog_loop);
      std::atexit(stop_watchdog);  // before the registry's destruction (constructed earlier)
    });
  } catch (const std::exception& e) {  // a limit on threads (or memory): free what was made
    destroy_ranks(comm->ranks);
    throw std::runtime_error(std::string("jax_gin: cannot start the GPU watchdog thread (") +
                             e.what() + "); the communicator was not set up");
  }
  std::unique_lock<std::shared_mutex> lock(g_mu);
  if (id <= 0) {
    while (g_comms.count(g_next)) ++g_next;
    id = g_next++;
  } else if (g_comms.count(id)) {  // taken since check_id_free (a concurrent set-up)
    lock.unlock();
    destroy_ranks(comm->ranks);
    throw std::invalid_argument("jax_gin: communicator id " + std::to_string(id) + " is taken");
  }
  comm->id = id;
  for (RankState& s : comm->ranks) s.cfg.rec_comm = int(id);
  g_comms[id] = std::move(comm);
  return id;
}

}  // namespace detail

using namespace detail;

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

bool comm_exists(int64_t id, uint32_t fingerprint) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  auto it = g_comms.find(id);
  return it != g_comms.end() && !it->second->ranks.empty() &&
         it->second->ranks[0].fingerprint == fingerprint;
}

void set_group_text(int64_t id, const std::vector<std::string>& texts) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  auto it = g_comms.find(id);
  if (it == g_comms.end()) throw std::invalid_argument("jax_gin: no communicator " + std::to_string(id));
  for (RankState& s : it->second->ranks)
    if (s.group >= 0 && size_t(s.group) < texts.size()) s.group_text = texts[size_t(s.group)];
}

void set_fingerprint(int64_t id, uint32_t fingerprint) {
  std::unique_lock<std::shared_mutex> lock(g_mu);
  auto it = g_comms.find(id);
  if (it == g_comms.end()) throw std::invalid_argument("jax_gin: no communicator " + std::to_string(id));
  for (RankState& s : it->second->ranks) s.fingerprint = fingerprint;
}

std::string describe(const HangReport& r, int nranks, const std::string& group_text) {
  const Diagnostic& d = r.diag;
  Text os;
  os << "jax_gin " << call_op_name(d.op) << " (" << algorithm_name(Algorithm(d.algorithm))
     << ") on GPU: rank " << d.rank << " of group " << d.group << " (" << nranks
     << " ranks) timed out waiting for peer " << d.peer;
  if (d.step < 0) os << " to release its window (credit) before round " << d.round;
  else os << " at step " << d.step << " of round " << d.round;
  os << " (lane " << d.lane << ", flag " << d.seen << ", expected " << d.expected
     << "). Set JAX_GIN_TIMEOUT_S to wait longer.";
  // Who is behind, from every rank's state block as this rank read it through the windows.
  if (r.nstates == nranks) {
    std::vector<Seen> seen(static_cast<size_t>(nranks));
    for (int q = 0; q < nranks; ++q) {
      const RecState& st = r.states[q];
      seen[size_t(q)] = seen_of(st, st.seq, st.done, st.wait_seq);
    }
    os << "\n" << laggard_text(seen, d.group, d.rank, r.late ? d.peer : -1,
                                  /*turn_checked=*/false);
  }
  if (!group_text.empty()) os << "\n" << group_text;
  return os.str();
}

std::vector<std::string> diagnostics(int64_t id) {
  std::vector<std::string> out;
  std::shared_lock<std::shared_mutex> lock(g_mu);
  for (auto& [cid, c] : g_comms) {
    if (id >= 0 && cid != id) continue;
    for (auto& s : c->ranks) {
      HangReport d;
      std::memcpy(&d, const_cast<const HangReport*>(s.diag_host), sizeof d);
      if (d.diag.valid) out.push_back(describe(d, s.nranks, s.group_text));
    }
  }
  return out;
}

namespace {
std::atomic<bool> g_record{false};
}  // namespace

bool recording() { return g_record.load(); }

namespace {
// A copy between the host and rank s's device memory on a stream of its own, waited for; throws
// with `what` on failure. Not on the rank's side stream, which the asynchronous starts chain to
// XLA's stream (fork events): a copy there would wait for XLA's work and every start's kernel.
void side_copy(const RankState& s, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
               const char* what) {
  cudaSetDevice(s.device);
  cudaStream_t stream = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, bytes, kind, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (e != cudaSuccess) throw std::runtime_error(std::string("jax_gin: ") + what + ": " + cudaGetErrorString(e));
}

// The ranks of this process in communicator `id` (under g_mu, held by the caller).
const std::vector<RankState>& ranks_of(int64_t id) {
  auto it = g_comms.find(id);
  if (it == g_comms.end()) throw std::invalid_argument("jax_gin: no communicator " + std::to_string(id));
  return it->second->ranks;
}
}  // namespace

void set_record(bool on) {
  g_record.store(on);
  std::shared_lock<std::shared_mutex> lock(g_mu);
  for (auto& [cid, c] : g_comms)
    for (RankState& s : c->ranks) {
      if (s.rec_ctl == nullptr) continue;
      // pinned {0, 1}: the sources of the flag's copies (first needed here, with a GPU rank)
      static uint64_t* words = [] {
        uint64_t* w = nullptr;
        if (cudaHostAlloc(&w, 2 * sizeof(uint64_t), cudaHostAllocPortable) != cudaSuccess) return w;
        w[0] = 0, w[1] = 1;
        return w;
      }();
      if (words == nullptr) throw std::runtime_error("jax_gin: cudaHostAlloc failed (recorder flag)");
      side_copy(s, s.rec_ctl, words + (on ? 1 : 0), sizeof(uint64_t), cudaMemcpyHostToDevice,
                "setting the recorder flag");
    }
}

std::vector<RecEntry> recorder_entries(int64_t id) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  std::vector<RecEntry> out, ring, again;
  for (const RankState& s : ranks_of(id)) {
    if (s.rec_ring == nullptr) continue;
    // Kernels may write the ring while it is copied, so an entry can be read mid-update. It is
    // copied again until two copies agree; an entry is written within nanoseconds (at a call's
    // open and close, or stored whole at its end), so the second copy settles all but an entry
    // that a kernel wrote meanwhile, and the fourth is the last try: an entry that still
    // differs is left out rather than shown torn.
    const size_t n = size_t(s.cfg.rec_entries), bytes = n * sizeof(RecEntry);
    ring.resize(n);
    again.resize(n);
    side_copy(s, ring.data(), s.rec_ring, bytes, cudaMemcpyDeviceToHost, "reading the recorder");
    std::vector<bool> settled(n, false);
    for (int tries = 0; tries < 3; ++tries) {
      side_copy(s, again.data(), s.rec_ring, bytes, cudaMemcpyDeviceToHost, "reading the recorder");
      bool all = true;
      for (size_t i = 0; i < n; ++i) {
        settled[i] = std::memcmp(&ring[i], &again[i], sizeof(RecEntry)) == 0;
        all = all && settled[i];
      }
      ring.swap(again);
      if (all) break;
    }
    std::vector<RecEntry> mine;
    for (size_t i = 0; i < n; ++i)
      if (settled[i] && ring[i].seq != 0) mine.push_back(ring[i]);
    std::sort(mine.begin(), mine.end(), [](const RecEntry& a, const RecEntry& b) { return a.seq < b.seq; });
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

std::vector<std::array<int64_t, 3>> recorder_counts(int64_t id) {
  std::shared_lock<std::shared_mutex> lock(g_mu);
  std::vector<std::array<int64_t, 3>> out;
  for (const RankState& s : ranks_of(id)) {
    if (s.rec_ctl == nullptr) continue;
    uint64_t ctl[2] = {0, 0};
    side_copy(s, ctl, s.rec_ctl, sizeof ctl, cudaMemcpyDeviceToHost, "reading the recorder");
    out.push_back({int64_t(s.group), int64_t(s.rank), int64_t(ctl[1])});
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
