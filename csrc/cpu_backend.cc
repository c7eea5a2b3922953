#include "cpu_backend.h"

#include <chrono>
#include <cstring>
#include <map>
#include <shared_mutex>
#include <sstream>
#include <thread>

#include "host_types.h"
#include "jax_gin/algorithms.h"
#include "jax_gin/schedule.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JG_PAUSE() _mm_pause()
#else
#define JG_PAUSE() ((void)0)
#endif

namespace jax_gin {
namespace cpu {
namespace {

std::shared_mutex g_registry_mu;
std::map<int64_t, std::shared_ptr<Comm>> g_registry;
int64_t g_next_id = 1;

// The transport for one rank of a CPU group: peers' windows are plain host memory.
class HostTransport {
 public:
  HostTransport(Group& g, const CommConfig& cfg, int group, int rank, size_t slot_bytes,
                RedOp op, Algorithm algo)
      : g_(g), cfg_(cfg), group_(group), rank_(rank), slot_bytes_(slot_bytes), op_(op),
        algo_(algo) {}

  int rank() const { return rank_; }
  int nranks() const { return g_.nranks; }

  template <class T>
  T* slot(int peer, int k) {
    return reinterpret_cast<T*>(g_.window[peer].get() + size_t(k) * slot_bytes_);
  }

  template <class T>
  void copy(T* dst, const T* src, size_t n) {
    if (n) std::memcpy(dst, src, n * sizeof(T));
  }

  // dst = srcs[0] op srcs[1] op ... op srcs[k-1], in that order, pairwise.
  template <class T, class Op, class Src>
  void reduce(T* dst, const Src& srcs, size_t n) {
    const int k = srcs.count();
    if (k == 1) { copy(dst, srcs.get(0), n); return; }
    const T* a = srcs.get(0);
    const T* b = srcs.get(1);
    for (size_t i = 0; i < n; ++i) dst[i] = Op::apply(a[i], b[i]);
    for (int q = 2; q < k; ++q) {
      const T* c = srcs.get(q);
      for (size_t i = 0; i < n; ++i) dst[i] = Op::apply(dst[i], c[i]);
    }
  }

  void signal(int peer, int kind, uint64_t value) {
    if (rank_ == cfg_.fault_rank) return;  // injected fault: this rank's signals are lost
    g_.flags[peer][flag_index(0, rank_, kind, g_.nranks)].store(value, std::memory_order_release);
  }

  // Spin briefly, then yield, then sleep: 8 device threads may share 2 cores, and a waiter
  // that keeps its core busy would starve the peer it waits for.
  bool wait(int peer, int kind, uint64_t value, int step) {
    std::atomic<uint64_t>& f = g_.flags[rank_][flag_index(0, peer, kind, g_.nranks)];
    uint64_t seen = f.load(std::memory_order_acquire);
    if (seen >= value) return true;
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto limit = std::chrono::duration<double>(cfg_.timeout_s);
    for (uint64_t it = 0;; ++it) {
      seen = f.load(std::memory_order_acquire);
      if (seen >= value) return true;
      if (it < 64) { JG_PAUSE(); continue; }
      if (it < 2048) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(it < 8192 ? 5 : 50));
      if ((it & 15) == 0) {
        // A peer that already failed will never signal: give up now instead of waiting out
        // the whole timeout.
        if (g_.broken.load(std::memory_order_relaxed)) {
          record(peer, step, value, seen, "gave up because another rank of the group failed");
          return false;
        }
        if (clock::now() - start > limit) {
          record(peer, step, value, seen, nullptr);
          return false;
        }
      }
    }
  }

  const std::string& error() const { return error_; }
  uint64_t current_round = 0;

 private:
  void record(int peer, int step, uint64_t expected, uint64_t seen, const char* why) {
    std::ostringstream os;
    os << "jax_gin " << redop_name(op_) << " (" << algorithm_name(algo_) << ") on CPU: rank "
       << rank_ << " of group " << group_ << " (" << g_.nranks << " ranks) ";
    if (why) {
      os << why << ", while waiting for peer " << peer;
    } else {
      os << "timed out after " << cfg_.timeout_s << " s waiting for peer " << peer;
    }
    if (step < 0) os << " to release its window (credit) before round " << current_round;
    else os << " at step " << step << " of round " << current_round;
    os << " (flag " << seen << ", expected " << expected << ")."
       << (why ? "" : " Set JAX_GIN_TIMEOUT_S to wait longer.");
    error_ = os.str();
    g_.broken.store(true);
  }

  Group& g_;
  const CommConfig& cfg_;
  int group_;
  int rank_;
  size_t slot_bytes_;
  RedOp op_;
  Algorithm algo_;
  std::string error_;
};

// Keeps the rank's round counter in the transport so that error messages can name it.
template <class T, class Op>
bool run(HostTransport& tp, Algorithm algo, const T* in, T* out, size_t count, size_t lane_bytes,
         uint64_t& round) {
  // run_lane advances `round`; mirror it for diagnostics by running round by round.
  const size_t cap = schedule::round_capacity(algo, tp.nranks(), lane_bytes, sizeof(T));
  if (tp.nranks() == 1 || count <= cap) {
    tp.current_round = round + 1;
    return run_lane<T, Op>(tp, algo, in, out, count, lane_bytes, round);
  }
  for (size_t off = 0; off < count; off += cap) {
    tp.current_round = round + 1;
    if (!run_lane<T, Op>(tp, algo, in + off, out + off, schedule::min_sz(cap, count - off),
                         lane_bytes, round))
      return false;
  }
  return true;
}

template <class T>
bool dispatch_op(HostTransport& tp, RedOp op, Algorithm algo, const void* in, void* out,
                 size_t count, size_t lane_bytes, uint64_t& round) {
  const T* i = static_cast<const T*>(in);
  T* o = static_cast<T*>(out);
  switch (op) {
    case RedOp::kSum: return run<T, HostSum>(tp, algo, i, o, count, lane_bytes, round);
    case RedOp::kMax: return run<T, HostMax>(tp, algo, i, o, count, lane_bytes, round);
    case RedOp::kMin: return run<T, HostMin>(tp, algo, i, o, count, lane_bytes, round);
  }
  return false;
}

}  // namespace

Group::Group(int n, size_t lb)
    : nranks(n), lane_bytes(lb), round(size_t(n), 0), busy(new std::atomic<int>[n]) {
  for (int r = 0; r < n; ++r) busy[r].store(0);
  for (int r = 0; r < n; ++r) {
    window.emplace_back(new char[lane_bytes]());
    const size_t words = flag_words(n);
    flags.emplace_back(new std::atomic<uint64_t>[words]);
    for (size_t w = 0; w < words; ++w) flags.back()[w].store(0);
  }
}

int64_t create_comm(const CommConfig& config) {
  auto comm = std::make_shared<Comm>();
  comm->config = config;
  int ngroups = 0;
  for (int32_t g : config.group_of) ngroups = std::max(ngroups, g + 1);
  for (int g = 0; g < ngroups; ++g)
    comm->groups.emplace_back(new Group(config.nranks, config.lane_bytes));
  std::unique_lock<std::shared_mutex> lock(g_registry_mu);
  comm->id = g_next_id++;
  g_registry[comm->id] = comm;
  return comm->id;
}

void destroy_comm(int64_t id) {
  std::unique_lock<std::shared_mutex> lock(g_registry_mu);
  g_registry.erase(id);
}

std::shared_ptr<Comm> find_comm(int64_t id) {
  std::shared_lock<std::shared_mutex> lock(g_registry_mu);
  auto it = g_registry.find(id);
  return it == g_registry.end() ? nullptr : it->second;
}

int64_t num_comms() {
  std::shared_lock<std::shared_mutex> lock(g_registry_mu);
  return int64_t(g_registry.size());
}

std::string allreduce(Comm& comm, int group, int rank, DType dtype, RedOp op, Algorithm algo,
                      const void* in, void* out, size_t count) {
  if (group < 0 || group >= int(comm.groups.size()) || rank < 0 || rank >= comm.config.nranks) {
    std::ostringstream os;
    os << "jax_gin: communicator " << comm.id << " has no rank " << rank << " in group " << group;
    return os.str();
  }
  Group& g = *comm.groups[group];
  if (g.broken.load()) {
    std::lock_guard<std::mutex> lock(g.error_mu);
    return "jax_gin: this communicator stopped after an earlier failure and cannot be reused: " +
           g.first_error;
  }
  const size_t esize = dtype_size(dtype);
  const size_t slot_bytes = schedule::slot_elems(algo, g.nranks, g.lane_bytes, esize) * esize;
  if (g.nranks > 1 && slot_bytes == 0) {
    std::ostringstream os;
    os << "jax_gin: workspace of " << g.lane_bytes << " bytes is too small for "
       << algorithm_name(algo) << " over " << g.nranks << " ranks";
    return os.str();
  }
  if (g.busy[rank].exchange(1, std::memory_order_acquire) != 0) {
    std::ostringstream os;
    os << "jax_gin: two collectives ran concurrently on rank " << rank << " of group " << group
       << " of communicator " << comm.id << "; calls on one communicator must be ordered";
    return os.str();
  }
  struct Release {
    std::atomic<int>& b;
    ~Release() { b.store(0, std::memory_order_release); }
  } release{g.busy[rank]};
  HostTransport tp(g, comm.config, group, rank, slot_bytes, op, algo);
  uint64_t& round = g.round[rank];
  bool ok = false;
  switch (dtype) {
    case DType::kF32: ok = dispatch_op<float>(tp, op, algo, in, out, count, g.lane_bytes, round); break;
    case DType::kF64: ok = dispatch_op<double>(tp, op, algo, in, out, count, g.lane_bytes, round); break;
    case DType::kBF16: ok = dispatch_op<bf16>(tp, op, algo, in, out, count, g.lane_bytes, round); break;
    case DType::kF16: ok = dispatch_op<f16>(tp, op, algo, in, out, count, g.lane_bytes, round); break;
    case DType::kS32: ok = dispatch_op<int32_t>(tp, op, algo, in, out, count, g.lane_bytes, round); break;
    case DType::kS64: ok = dispatch_op<int64_t>(tp, op, algo, in, out, count, g.lane_bytes, round); break;
    case DType::kU32: ok = dispatch_op<uint32_t>(tp, op, algo, in, out, count, g.lane_bytes, round); break;
  }
  if (ok) return std::string();
  {
    std::lock_guard<std::mutex> lock(g.error_mu);
    if (g.first_error.empty()) g.first_error = tp.error();
  }
  return tp.error();
}

std::string allreduce_logical(Comm& comm, uint32_t logical_id, DType dtype, RedOp op,
                              Algorithm algo, const void* in, void* out, size_t count) {
  const auto& cfg = comm.config;
  if (logical_id >= cfg.group_of.size()) {
    std::ostringstream os;
    os << "jax_gin: device with partition id " << logical_id << " is not in communicator "
       << comm.id << " (" << cfg.group_of.size() << " devices)";
    return os.str();
  }
  return allreduce(comm, cfg.group_of[logical_id], cfg.rank_of[logical_id], dtype, op, algo, in,
                   out, count);
}

}  // namespace cpu
}  // namespace jax_gin
