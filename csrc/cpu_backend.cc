#include "cpu_backend.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstddef>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <cstring>
#include <exception>
#include <map>
#include <new>
#include <set>
#include <shared_mutex>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "host_types.h"
#include "jax_gin/text.h"
#include "jax_gin/laggard.h"
#include "jax_gin/algorithms.h"
#include "jax_gin/collectives.h"
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

// Futex on one 32-bit half of a 64-bit word (x86-64 and aarch64 are little-endian): the low
// half of a flag, which every new value changes, or the high half of a turn word (`high`),
// whose call number every new value changes while its low half, a site, may repeat. A wait
// on a half that a new value leaves as it was would sleep through the wake-up. Not the
// private variant: the word may live in memory shared between processes.
uint32_t* futex_half(std::atomic<uint64_t>* word, bool high) {
  static_assert(sizeof(std::atomic<uint64_t>) == 8, "flags are plain 64-bit words");
  return reinterpret_cast<uint32_t*>(word) + (high ? 1 : 0);
}
void futex_wait(std::atomic<uint64_t>* word, uint64_t seen, long timeout_ns, bool high = false) {
  timespec ts{0, timeout_ns};
  syscall(SYS_futex, futex_half(word, high), FUTEX_WAIT, uint32_t(high ? seen >> 32 : seen), &ts,
          nullptr, 0);
}
void futex_wake(std::atomic<uint64_t>* word, bool high = false) {
  syscall(SYS_futex, futex_half(word, high), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace
}  // namespace cpu

namespace cpu {
namespace {

std::atomic<bool> g_record{false};

// The recorder's clock: CLOCK_MONOTONIC in ns, one clock for every process of a host (Python:
// time.monotonic_ns()).
uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

template <class T> void store_release(T& x, T v) { __atomic_store_n(&x, v, __ATOMIC_RELEASE); }
template <class T> T load_acquire(const T& x) { return __atomic_load_n(&x, __ATOMIC_ACQUIRE); }
// The state block's other fields: written by the rank's thread while peers (a hang report)
// and Python read them. Advisory values, but plain accesses from two threads are a data race
// (undefined behaviour; ThreadSanitizer reports it): relaxed atomic accesses instead.
template <class T> void store_relaxed(T& x, T v) { __atomic_store_n(&x, v, __ATOMIC_RELAXED); }
template <class T> T load_relaxed(const T& x) { return __atomic_load_n(&x, __ATOMIC_RELAXED); }
// A flight-recorder entry as 8-byte words: a call writes its entry in a copy of its own and
// publishes it to the ring slot word by word with atomic stores, and readers
// (recorder_entries) load the slot's words atomically, so that the seqlock around them has no
// plain access to shared memory (no data race, even mid-update).
typedef uint64_t __attribute__((may_alias)) RecWord;
static_assert(offsetof(RecEntry, seq) == 0 && sizeof(RecEntry) % sizeof(RecWord) == 0,
              "RecEntry is whole words, seq first");
constexpr size_t kRecHeaderWords = offsetof(RecEntry, events) / sizeof(RecWord);
static_assert(offsetof(RecEntry, events) % sizeof(RecWord) == 0 &&
              sizeof(RecEvent) % sizeof(RecWord) == 0, "events start and end on words");

// Stores e's events [first, end), then its header but seq (which the seqlock stores), into the
// ring slot: a reader that sees the new event count finds the events in place.
void publish_entry(RecEntry& slot, const RecEntry& e, int first, int end) {
  auto* dst = reinterpret_cast<RecWord*>(&slot);
  const auto* src = reinterpret_cast<const RecWord*>(&e);
  constexpr size_t per = sizeof(RecEvent) / sizeof(RecWord);
  for (size_t i = kRecHeaderWords + size_t(first) * per; i < kRecHeaderWords + size_t(end) * per; ++i)
    __atomic_store_n(dst + i, src[i], __ATOMIC_RELAXED);
  for (size_t i = 1; i < kRecHeaderWords; ++i) __atomic_store_n(dst + i, src[i], __ATOMIC_RELEASE);
}

struct RelaxedLoad {  // for seen_of (laggard.h)
  template <class T> T operator()(const T& x) const { return load_relaxed(x); }
};

// The communicators, by id. Never destroyed (heap objects, leaked on purpose): at exit, a
// static map's destructor would destroy the communicators still registered, and with them
// their workers, whose destructors join the threads: a thread in a call whose peers never come
// waits out the timeout (exit hung for a minute), one in a call's `done` runs XLA's
// continuation while the process tears XLA down, and a thread that outlives its RankWorker
// (detached) or a find_comm on an XLA thread would use the destroyed map or lock. Left alone,
// the threads end with the process, and the operating system frees what they held (a shared
// workspace's name is unlinked by jax_gin's atexit hook: unlink_all_workspaces).
std::shared_mutex& g_registry_mu = *new std::shared_mutex;
std::map<int64_t, std::shared_ptr<Comm>>& g_registry = *new std::map<int64_t, std::shared_ptr<Comm>>;
int64_t g_next_id = 1;
int64_t g_created = 0;  // communicators created so far (Comm::ordinal)

// Each rank's state block, as the hang report reads it (laggard.h).
std::vector<Seen> rank_states(const Workspace& ws) {
  const int n = ws.nranks();
  std::vector<Seen> s(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    const RecState& st = ws.rec_state(r);
    s[size_t(r)] = seen_of(st, load_acquire(st.seq), load_acquire(st.done),
                           load_acquire(st.wait_seq), RelaxedLoad{});
  }
  return s;
}

// For each rank of `group` in communicator `cfg` that `states` show behind the reporting rank
// (fewer calls entered than `seq`), where its device is in a call of another communicator of
// this process: a line saying which and what it waits for there. A rank that never entered a
// call here may be held in another communicator's call by the rank a report there would name
// (a cond that skipped a call on one device).
std::string elsewhere_text(const CommConfig& cfg, int group, const std::vector<Seen>& states,
                           uint64_t seq) {
  if (cfg.device_id.size() != cfg.group_of.size()) return std::string();
  std::vector<std::shared_ptr<Comm>> others;
  {
    std::shared_lock<std::shared_mutex> lock(g_registry_mu);
    for (const auto& kv : g_registry)
      if (kv.first != cfg.id) others.push_back(kv.second);
  }
  Text os;
  int lines = 0;
  for (size_t l = 0; l < cfg.group_of.size() && lines < 4; ++l) {
    if (cfg.group_of[l] != group) continue;
    const int r = cfg.rank_of[l];
    if (r < 0 || size_t(r) >= states.size() || states[size_t(r)].seq >= seq) continue;
    const int32_t device = cfg.device_id[l];
    for (const auto& c : others) {
      const CommConfig& oc = c->config;
      if (oc.device_id.size() != oc.group_of.size()) continue;
      auto at = std::find(oc.device_id.begin(), oc.device_id.end(), device);
      if (at == oc.device_id.end()) continue;
      const size_t ol = size_t(at - oc.device_id.begin());
      const int og = oc.group_of[ol], orank = oc.rank_of[ol];
      if (og < 0 || size_t(og) >= c->groups.size() || !c->groups[size_t(og)]->ws) continue;
      const Seen x = rank_states(*c->groups[size_t(og)]->ws)[size_t(orank)];
      if (!x.in_call() || x.failed) continue;  // (a failed call keeps its wait published)
      os << "\nnote: rank " << r << " (device " << device << ") is in another communicator's "
         << laggard_detail::call_name(x.seq, x.op, x.algo) << " as its rank " << orank
         << (x.waiting() ? ", " + laggard_detail::wait_text(x) : std::string(", running"));
      if (size_t(og) < oc.group_text.size() && !oc.group_text[size_t(og)].empty())
        os << " (" << oc.group_text[size_t(og)] << ")";
      ++lines;
      break;
    }
  }
  return os.str();
}

// Writes `what` (how `rank` failed: "timed out after 2 s waiting for ...") as the group's
// first failure, unless another rank's came first; the ranks that give up after it repeat it.
void note_first_failure(WorkspaceHeader& h, int rank, const std::string& what) {
  int32_t none = 0;
  if (!h.first_failed.compare_exchange_strong(none, -1)) return;  // another rank's is there
  const size_t n = std::min(what.size(), sizeof h.first_failure - 1);
  std::memcpy(h.first_failure, what.data(), n);
  h.first_failure[n] = '\0';
  h.first_failed.store(rank + 1, std::memory_order_release);  // the text is whole
}

// Marks group `g` failed by its rank `rank`, for both ways a rank fails: a wait that gave up
// (HostTransport::record) and a call that could not be handed to the rank's worker (submit).
// `error`, the rank's error as its caller sees it, becomes the group's first error, which
// later calls on the communicator repeat ("cannot be reused: ..."), unless one came first;
// `what`, how the rank failed ("timed out after 2 s waiting for ..."; empty: it gave up after
// another rank), the workspace's first failure, which the ranks that give up after it repeat,
// unless another's is there. Then the workspace is broken, so that the peers give up at once:
// last, so that a later call that sees it broken finds the first error already there.
void fail_group(Group& g, int rank, const std::string& what, const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(g.error_mu);
    if (g.first_error.empty()) g.first_error = error;
  }
  if (!g.ws) return;
  WorkspaceHeader& h = g.ws->header();
  if (!what.empty()) note_first_failure(h, rank, what);
  h.broken.store(1);
}

// The transport for one rank of a CPU group: peers' windows are plain host memory.
class HostTransport {
 public:
  // `entry`: the call's flight-recorder entry (null: not recording), whose first round is
  // `round0`, published to the ring `slot` as it changes (publish_entry).
  HostTransport(Group& g, const CommConfig& cfg, int group, int rank, size_t slot_bytes,
                int op, Algorithm algo, RecEntry* entry, RecEntry* slot, uint64_t round0)
      : g_(g), ws_(*g.ws), cfg_(cfg), group_(group), rank_(rank), slot_bytes_(slot_bytes), op_(op),
        algo_(algo), entry_(entry), slot_(slot), round0_(round0) {}

  int rank() const { return rank_; }
  int nranks() const { return ws_.nranks(); }

  template <class T>
  T* slot(int peer, int k) {
    return reinterpret_cast<T*>(ws_.window(peer) + size_t(k) * slot_bytes_);
  }

  template <class T>
  void copy(T* dst, const T* src, size_t n) {
    if (n && dst != src) std::memcpy(dst, src, n * sizeof(T));
  }

  size_t chunk_bytes() const { return cfg_.chunk_bytes; }
  void sync() {}  // one worker per rank

  template <class T, class D>
  void copy_to(const D& dsts, const T* src, size_t n) {
    for (int q = 0; q < dsts.count(); ++q) copy(dsts.get(q), src, n);
  }

  // Reduce into the first destination (cache-hot), then copy it to the others.
  template <class T, class Op, class Src, class D>
  void reduce_to(const D& dsts, const Src& srcs, size_t n) {
    if (dsts.count() == 0) return;
    reduce<T, Op>(dsts.get(0), srcs, n);
    for (int q = 1; q < dsts.count(); ++q) copy(dsts.get(q), dsts.get(0), n);
  }
  // Every peer is host memory: a put is a copy into its slot.
  template <class T>
  void put(int peer, int k, size_t off, const T* src, size_t n) {
    copy(slot<T>(peer, k) + off, src, n);
  }

  // Every peer may write to us (a later call may use any algorithm).
  bool needs_credit(int) const { return true; }

  // dst = srcs[0] op srcs[1] op ... op srcs[k-1], in that order, accumulated in the wide type
  // (float for 16-bit floats) and rounded once, as lax's own reduction does. Block by block,
  // every source of an element read before its result is stored, so dst may be a source.
  template <class T, class Op, class Src>
  void reduce(T* dst, const Src& srcs, size_t n) {
    using Wd = Widen<T>;
    using W = typename Wd::type;
    const int k = srcs.count();
    if (k == 1) { copy(dst, srcs.get(0), n); return; }
    constexpr size_t kBlock = 1024;
    W acc[kBlock];
    for (size_t lo = 0; lo < n; lo += kBlock) {
      const size_t m = n - lo < kBlock ? n - lo : kBlock;
      const T* a = srcs.get(0) + lo;
      for (size_t i = 0; i < m; ++i) acc[i] = Wd::up(a[i]);
      for (int q = 1; q < k; ++q) {
        const T* c = srcs.get(q) + lo;
        for (size_t i = 0; i < m; ++i) acc[i] = Op::apply(acc[i], Wd::up(c[i]));
      }
      for (size_t i = 0; i < m; ++i) dst[lo + i] = Wd::down(acc[i]);
    }
  }

  void signal(int peer, int kind, uint64_t value, int step) {
    if (entry_) note(kind == kCredit ? kRecCredit : kRecSend, step, peer, value);
    if (rank_ == cfg_.fault_rank) return;  // injected fault: this rank's signals are lost
    std::atomic<uint64_t>& f = ws_.flags(peer)[flag_index(0, rank_, kind, nranks())];
    // seq_cst store, then seq_cst load of the peer's sleeper count; the waiter does the
    // mirror image (count up, then read the flag), so either it sees the flag or we see it
    // asleep and wake it.
    f.store(value, std::memory_order_seq_cst);
    if (ws_.control(peer).sleepers.load(std::memory_order_seq_cst) != 0) futex_wake(&f);
  }

  // Spin briefly, then sleep on a futex until the peer's signal wakes us: 8 device threads
  // may share 2 cores, and a waiter that spins or yields in a loop starves the very peer it
  // waits for (measured: 8 ms per small all-reduce with yield/sleep back-off, see git log).
  bool wait(int peer, int kind, uint64_t value, int step) {
    return wait_on(ws_.flags(rank_)[flag_index(0, peer, kind, nranks())], peer, kind, value, step);
  }

  // Waits until the group's rank 0 (`leader`) starts call `seq` (run_call): its word in this
  // rank's control reaches seq << 32. Returns the word, or 0 where the wait failed (error()).
  uint64_t wait_turn(int leader, uint64_t seq) {
    std::atomic<uint64_t>& w = ws_.control(rank_).turn;
    return wait_on(w, leader, kData, seq << 32, kTurnStep) ? w.load(std::memory_order_acquire) : 0;
  }

  const std::string& error() const { return error_; }

 private:
  // Waits for flag (or turn word) `f` to reach `value`, sent by `peer` at `step` (kTurnStep:
  // the turn word, before the call's first step).
  bool wait_on(std::atomic<uint64_t>& f, int peer, int kind, uint64_t value, int step) {
    uint64_t seen = f.load(std::memory_order_acquire);
    if (seen >= value) return waited(peer, kind, value, step);
    for (int i = 0; i < 64; ++i) {
      JG_PAUSE();
      if ((seen = f.load(std::memory_order_acquire)) >= value) return waited(peer, kind, value, step);
    }
    // About to sleep: say what for in the state block, for a peer's hang report.
    RecState& st = ws_.rec_state(rank_);
    store_relaxed(st.wait_peer, int32_t(peer));
    const bool turn = step == kTurnStep;
    store_relaxed(st.wait_step, int32_t(step));
    store_relaxed(st.wait_round, turn ? round0_ : round_of_wait(value, step));
    store_relaxed(st.wait_place, uint16_t(turn ? 0 : place_of_wait(value, step)));
    store_relaxed(st.wait_kind, uint8_t(kind));
    store_release(st.wait_seq, st.seq);
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto limit = std::chrono::duration<double>(cfg_.timeout_s);
    uint32_t sleeps = 0;
    for (;;) {
      // Sleep until the flag word changes, at most 1 ms at a time, so that the timeout and
      // a failed peer are noticed.
      std::atomic<uint32_t>& sleepers = ws_.control(rank_).sleepers;
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      if ((seen = f.load(std::memory_order_seq_cst)) < value)
        futex_wait(&f, seen, 1000000, /*high=*/turn);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if ((seen = f.load(std::memory_order_acquire)) >= value) {
        store_release(st.wait_seq, uint64_t(0));
        return waited(peer, kind, value, step);
      }
      // A peer that already failed (in this process or another) will never signal: give up
      // now instead of waiting out the whole timeout. Where a process of the group is gone,
      // say so, whichever rank's error the caller sees first.
      const bool broken = ws_.header().broken.load(std::memory_order_relaxed);
      // A peer whose process is gone will never signal either (checked every ~100 ms).
      if (broken || (++sleeps & 127u) == 0) {
        std::string dead = gone_unfailed(peer);
        for (int r = 0; broken && dead.empty() && r < nranks(); ++r) dead = gone_unfailed(r);
        if (!dead.empty()) {
          const std::string why = "gave up because " + dead + " is gone (it exited or was killed)";
          record(f, peer, step, value, seen, why.c_str(),
                 " This process is intact, but no collective of this group can complete again: "
                 "restart the job.", &dead);
          return false;
        }
      }
      if (broken) {
        record(f, peer, step, value, seen, nullptr, nullptr, nullptr, /*after_another=*/true);
        return false;
      }
      if (clock::now() - start > limit) {
        record(f, peer, step, value, seen, nullptr);
        return false;
      }
    }
  }

  // The process of `rank` if it is gone and none of its ranks had failed (Workspace::gone), or
  // empty. A process that failed and then ended (its error raised, say) is not why its peers
  // fail: its failure is, which the header's first failure names.
  std::string gone_unfailed(int rank) const {
    std::string dead = ws_.gone(rank);
    if (dead.empty()) return dead;
    const int32_t pid = ws_.control(rank).pid.load(std::memory_order_relaxed);
    for (int r = 0; r < nranks(); ++r)
      if (ws_.control(r).pid.load(std::memory_order_relaxed) == pid &&
          load_relaxed(ws_.rec_state(r).failed) != 0)
        return std::string();
    return dead;
  }

  bool waited(int peer, int kind, uint64_t value, int step) {
    if (entry_) note(kind == kCredit ? kRecCreditWait : kRecWait, step, peer, value);
    return true;
  }

  void note(uint8_t kind, int step, int peer, uint64_t value) {
    rec_note(*entry_, kind, step, peer, value, round0_, now_ns());
    // rec_note changes the header and one of the last 4 events
    const int n = entry_->nevents;
    publish_entry(*slot_, *entry_, n > 4 ? n - 4 : 0, n);
  }

  // The wait on flag `f` for `expected` from `peer` gave up. `why`: why (null: the timeout);
  // `advice`: what to do (null: for the timeout, set a longer one; for a failed peer,
  // nothing); `gone`: the process that is gone, if that is why; `after_another`: another rank
  // failed first (the header says which, and how, and this error repeats it).
  void record(const std::atomic<uint64_t>& f, int peer, int step, uint64_t expected, uint64_t seen,
              const char* why,
              const char* advice = nullptr, const std::string* gone = nullptr,
              bool after_another = false) {
    WorkspaceHeader& h = ws_.header();
    Text wait;  // "waiting for peer 5 at step 2 of round 1 (flag 65538, expected 65539)"
    wait << "waiting for peer " << peer;
    if (step == kTurnStep) {
      // the turn word: (call number << 32) | site
      wait << " to start call #" << (expected >> 32);
      if ((seen >> 32) == 0) wait << " (it has started no call of the group)";
      else wait << " (it set the group's order of calls up to call #" << (seen >> 32) << ")";
    } else {
      const uint64_t round = round_of_wait(expected, step);
      if (step < 0) wait << " to release its window (credit) before round " << round;
      else wait << " at step " << step << " of round " << round;
      wait << " (flag " << seen << ", expected " << expected << ")";
    }
    Text os;
    os << "jax_gin " << call_op_name(op_) << " (" << algorithm_name(algo_) << ") on CPU: rank "
       << rank_ << " of group " << group_ << " (" << nranks() << " ranks) ";
    std::string what;  // this rank's own failure, from its wait (none: it gave up after another)
    if (after_another) {
      // first_failed > 0 once the first failure's text is whole (below); a rank that failed
      // at the same moment may have stored `broken` while that text was still being written
      int32_t first = h.first_failed.load(std::memory_order_acquire);
      // -1: the rank that failed first is writing its text (it has stored `broken` already
      // where another rank lost the race to be first): wait a little for it
      for (int i = 0; first < 0 && i < 100; ++i) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        first = h.first_failed.load(std::memory_order_acquire);
      }
      os << "gave up " << wait.str();
      std::string stopped_why;  // what stopped the group where no rank failed (reset, exit)
      if (first <= 0) {
        std::lock_guard<std::mutex> lock(g_.error_mu);
        stopped_why = g_.stop_reason;
      }
      if (first > 0) os << ", because rank " << first - 1 << " failed first: it " << h.first_failure;
      else if (!stopped_why.empty()) os << ", because " << stopped_why << ".";
      else os << ", because another rank of the group failed.";
    } else {
      Text t;
      if (why) t << why << ", while " << wait.str() << ".";
      else t << "timed out after " << cfg_.timeout_s << " s " << wait.str() << ".";
      t << (advice ? advice : why ? "" : " Set JAX_GIN_TIMEOUT_S to wait longer.");
      what = t.str();
      os << what;
    }
    // This rank failed: its own state says so before the states are read, as on GPUs
    // (fail_wait); run_call sets it again when the call returns.
    store_relaxed(ws_.rec_state(rank_).failed, uint8_t(1));
    // A process that is gone: its ranks' records stopped where it died, so a laggard or a cycle
    // read from them would mislead. The diagnosis is that it is gone; the last calls follow.
    const std::vector<Seen> states = rank_states(ws_);
    // A timed-out signal that is there now, after the states were read, came late (laggard.h).
    const bool late = !why && !after_another && f.load(std::memory_order_acquire) >= expected;
    os << "\n"
       << (gone ? "diagnosis: " + *gone + " is gone; the last calls below stop where it died\n" +
                      last_calls_text(states, group_)
                : laggard_text(states, group_, rank_, late ? peer : -1));
    const uint64_t seq = load_acquire(ws_.rec_state(rank_).seq);
    if (!gone) os << elsewhere_text(cfg_, group_, states, seq);
    if (!gone && !cfg_.absent_note.empty() &&
        std::any_of(states.begin(), states.end(), [&](const Seen& x) { return x.seq < seq; }))
      os << "\n" << cfg_.absent_note;
    // A process that is stopped (SIGSTOP, a debugger) takes no part until it resumes: its
    // ranks' records read as a laggard or lost signals, so say so.
    std::vector<std::string> stopped;
    for (int r = 0; !gone && r < nranks(); ++r) {
      std::string p = ws_.stopped(r);
      if (!p.empty() && std::find(stopped.begin(), stopped.end(), p) == stopped.end())
        stopped.push_back(std::move(p));
    }
    for (const std::string& p : stopped)
      os << "\nnote: " << p << " is stopped (by a signal such as SIGSTOP, or a debugger): its "
         << "ranks take no part in a call until it resumes";
    if (size_t(group_) < cfg_.group_text.size() && !cfg_.group_text[size_t(group_)].empty())
      os << "\n" << cfg_.group_text[size_t(group_)];
    error_ = os.str();
    fail_group(g_, rank_, what, error_);
  }

  Group& g_;
  Workspace& ws_;
  const CommConfig& cfg_;
  int group_;
  int rank_;
  size_t slot_bytes_;
  int op_;  // CallOp
  Algorithm algo_;
  RecEntry* entry_;
  RecEntry* slot_;
  uint64_t round0_;
  std::string error_;
};

// The whole message (one buffer, or several reduced as one), in as many rounds as the window
// needs. hierarchical also needs the node size; it takes one buffer at a time (the GPU runs
// it only for groups that span nodes, with one buffer per launch too).
template <class T, class Op>
bool run_all(HostTransport& tp, Algorithm algo, const Segment* seg, int nseg, size_t count,
             size_t lane_bytes, int ranks_per_node, uint64_t& round) {
  if (algo == Algorithm::kHierarchical) {
    for (int s = 0; s < nseg; ++s)
      if (!run_lane_hierarchical<T, Op>(tp, static_cast<const T*>(seg[s].in), static_cast<T*>(seg[s].out),
                                        seg[s].count, lane_bytes, ranks_per_node, round))
        return false;
    return true;
  }
  if (nseg == 1)
    return run_lane<T, Op>(tp, algo, Contiguous<T>{static_cast<const T*>(seg[0].in), static_cast<T*>(seg[0].out)},
                           count, lane_bytes, round);
  return run_lane<T, Op>(tp, algo, Segmented<T>{seg, nseg, 0}, count, lane_bytes, round);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Workspaces

namespace {

constexpr uint64_t kWorkspaceMagic = 0x314e49475f58414aull;  // "JAX_GIN1", little-endian
constexpr uint32_t kWorkspaceVersion = 7;  // 2: three flag kinds per (lane, sender); 3: kMaxLanes 128; 4: recorder; 5: pid per rank; 6: first failure; 7: turn word per rank
constexpr size_t kHeaderBytes = 4096;
constexpr size_t kPageBytes = 4096;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static_assert(sizeof(WorkspaceHeader) <= kHeaderBytes, "the header must fit its page");

std::string errno_text(int e) { return std::string(std::strerror(e)); }

// Names of segments that this process created or mapped and has not unlinked yet.
std::mutex g_names_mu;
std::set<std::string>& linked_names() {
  static auto* names = new std::set<std::string>();  // never destroyed: used at exit
  return *names;
}

}  // namespace

Workspace::Workspace(int nranks, size_t lane_bytes, int record_entries)
    : nranks_(nranks), lane_bytes_(lane_bytes), record_entries_(record_entries),
      local_(size_t(nranks), false) {
  if (!rec_entries_ok(record_entries))
    throw std::invalid_argument("jax_gin: record_entries must be a power of two from 1 to " +
                                std::to_string(kRecMaxEntries) + ", got " + std::to_string(record_entries));
  lay_out();
}

// The layout, a function of (nranks, lane_bytes) only, so it is the same in every process:
// header | control word per rank | flags per rank | recorder state per rank | recorder ring
// per rank | window per rank (page-aligned).
void Workspace::lay_out() {
  ctrl_off_ = kHeaderBytes;
  flags_off_ = round_up(ctrl_off_ + size_t(nranks_) * sizeof(RankControl), 64);
  rec_state_off_ = round_up(flags_off_ + size_t(nranks_) * flag_words(nranks_) * sizeof(uint64_t), 64);
  rec_ring_off_ = round_up(rec_state_off_ + size_t(nranks_) * sizeof(RecState), 64);
  windows_off_ = round_up(rec_ring_off_ + size_t(nranks_) * size_t(record_entries_) * sizeof(RecEntry),
                          kPageBytes);
  window_stride_ = round_up(lane_bytes_ == 0 ? 1 : lane_bytes_, kPageBytes);
  // A window per rank must fit beside the rest in a size_t: unchecked, 8 windows of 2**61
  // bytes wrap the total to a few pages, and the calls write past the mapping.
  if (window_stride_ > (SIZE_MAX - windows_off_) / size_t(nranks_)) {
    throw std::invalid_argument(
        "jax_gin: a workspace of " + std::to_string(lane_bytes_) + " bytes per rank (" +
        "JAX_GIN_WORKSPACE_BYTES, settings.cpu_workspace_bytes) over " + std::to_string(nranks_) +
        " ranks exceeds the address space");
  }
  total_ = windows_off_ + size_t(nranks_) * window_stride_;
}

// Maps the region (fd < 0: anonymous private memory). The creator constructs the atomics and
// writes the header, last of all `ready`.
void Workspace::map(int fd, bool create) {
  void* p = fd < 0 ? mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                   : mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw std::runtime_error("jax_gin: could not map a workspace of " + std::to_string(total_) +
                             " bytes" + (name_.empty() ? "" : " (" + name_ + ")") + ": " +
                             errno_text(errno));
  }
  base_ = static_cast<char*>(p);
  if (!create) return;
  // New memory is zero-filled; construct the atomics in place on it all the same.
  WorkspaceHeader* h = new (base_) WorkspaceHeader{};
  for (int r = 0; r < nranks_; ++r) new (&control(r)) RankControl{};
  std::atomic<uint64_t>* f = flags(0);
  for (size_t w = 0; w < size_t(nranks_) * flag_words(nranks_); ++w) new (f + w) std::atomic<uint64_t>(0);
  h->magic = kWorkspaceMagic;
  h->version = kWorkspaceVersion;
  h->nranks = uint32_t(nranks_);
  h->lane_bytes = lane_bytes_;
  h->total_bytes = total_;
  h->record_entries = uint64_t(record_entries_);
  h->ready.store(1, std::memory_order_release);
}

std::shared_ptr<Workspace> Workspace::create_private(int nranks, size_t lane_bytes,
                                                     int record_entries) {
  std::shared_ptr<Workspace> ws(new Workspace(nranks, lane_bytes, record_entries));
  ws->map(-1, true);
  for (int r = 0; r < nranks; ++r) ws->join(r);
  return ws;
}

std::shared_ptr<Workspace> Workspace::create_shared(const std::string& name, int nranks,
                                                    size_t lane_bytes, int record_entries) {
  std::shared_ptr<Workspace> ws(new Workspace(nranks, lane_bytes, record_entries));
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    const int e = errno;
    throw std::runtime_error("jax_gin: could not create the shared-memory segment " + name + ": " +
                             errno_text(e) +
                             (e == EEXIST ? " (a segment of that name exists already)" : ""));
  }
  ws->name_ = name;
  {
    std::lock_guard<std::mutex> lock(g_names_mu);
    linked_names().insert(name);
  }
  // Reserve the pages now: on a full /dev/shm a plain ftruncate succeeds and the first touch
  // of a missing page kills the process with SIGBUS instead.
  int rc = ftruncate(fd, off_t(ws->total_)) == 0 ? posix_fallocate(fd, 0, off_t(ws->total_)) : errno;
  if (rc != 0) {
    close(fd);
    ws->unlink();
    throw std::runtime_error("jax_gin: could not reserve " + std::to_string(ws->total_) +
                             " bytes of shared memory for " + name + ": " + errno_text(rc) +
                             (rc == ENOSPC ? " (is /dev/shm full or too small? lower "
                                             "JAX_GIN_WORKSPACE_BYTES or enlarge /dev/shm)" : ""));
  }
  try {
    ws->map(fd, true);
  } catch (...) {
    close(fd);
    ws->unlink();
    throw;
  }
  close(fd);
  return ws;
}

std::shared_ptr<Workspace> Workspace::attach_shared(const std::string& name, int nranks,
                                                    size_t lane_bytes, int record_entries) {
  std::shared_ptr<Workspace> ws(new Workspace(nranks, lane_bytes, record_entries));
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    throw std::runtime_error("jax_gin: could not open the shared-memory segment " + name +
                             " that another process created: " + errno_text(errno));
  }
  ws->name_ = name;
  {
    std::lock_guard<std::mutex> lock(g_names_mu);
    linked_names().insert(name);
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || size_t(st.st_size) != ws->total_) {
    close(fd);
    throw std::runtime_error("jax_gin: the shared-memory segment " + name + " has " +
                             std::to_string(st.st_size) + " bytes, expected " +
                             std::to_string(ws->total_) + " for " + std::to_string(nranks) +
                             " ranks of " + std::to_string(lane_bytes) +
                             " bytes and " + std::to_string(ws->record_entries_) +
                             " recorder entries (do all processes use the same "
                             "JAX_GIN_WORKSPACE_BYTES and JAX_GIN_RECORD_ENTRIES?)");
  }
  try {
    ws->map(fd, false);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  const WorkspaceHeader& h = ws->header();
  if (h.ready.load(std::memory_order_acquire) != 1 || h.magic != kWorkspaceMagic ||
      h.version != kWorkspaceVersion || h.nranks != uint32_t(nranks) ||
      h.lane_bytes != lane_bytes || h.total_bytes != ws->total_ ||
      h.record_entries != uint64_t(ws->record_entries_)) {
    Text os;
    os << "jax_gin: the shared-memory segment " << name << " does not hold a jax_gin workspace "
       << "of version " << kWorkspaceVersion << " for " << nranks << " ranks of " << lane_bytes
       << " bytes (found magic ";
    os.hex(h.magic) << ", version " << h.version
       << ", " << h.nranks << " ranks of " << h.lane_bytes << " bytes); do all processes run "
       << "the same jax_gin?";
    throw std::runtime_error(os.str());
  }
  return ws;
}

Workspace::~Workspace() {
  if (!name_.empty()) unlink();
  if (base_) munmap(base_, total_);
}

void Workspace::join(int rank, int process) {
  local_[size_t(rank)] = true;
  control(rank).process = process;
  control(rank).pid.store(int32_t(getpid()), std::memory_order_relaxed);
  control(rank).joined.store(1, std::memory_order_release);
}

namespace {
// The state letter of process `pid` in /proc (R, S, T, Z ...; 0 where it cannot be read):
// the field after the name, which is in parentheses and may hold spaces and parentheses.
char proc_state(int32_t pid) {
  char path[64], buf[512];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", int(pid));
  size_t n = 0;
  if (FILE* f = std::fopen(path, "r")) {
    n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
  }
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  return close && close[1] == ' ' && close[2] ? close[2] : 0;
}
}  // namespace

std::string Workspace::gone(int rank) const {
  const int32_t pid = control(rank).pid.load(std::memory_order_relaxed);
  if (pid <= 0 || pid == int32_t(getpid())) return "";
  // kill(pid, 0) delivers nothing; it fails with ESRCH once the process no longer exists (a
  // zombie still exists until its parent reaps it, hence also /proc's state).
  bool dead = kill(pid_t(pid), 0) != 0 && errno == ESRCH;
  if (!dead) {
    const char state = proc_state(pid);
    dead = state == 'Z' || state == 'X';
  }
  if (!dead) return "";
  return process_text(rank);
}

std::string Workspace::stopped(int rank) const {
  const int32_t pid = control(rank).pid.load(std::memory_order_relaxed);
  if (pid <= 0 || pid == int32_t(getpid())) return "";
  const char state = proc_state(pid);  // T: stopped by a signal; t: by a debugger (ptrace)
  return state == 'T' || state == 't' ? process_text(rank) : "";
}

std::string Workspace::process_text(int rank) const {
  const int32_t pid = control(rank).pid.load(std::memory_order_relaxed);
  Text os;
  os << "process " << control(rank).process << " (pid " << pid << "; ranks ";
  bool first = true;
  for (int r = 0; r < nranks_; ++r)
    if (control(r).pid.load(std::memory_order_relaxed) == pid) os << (first ? "" : ", ") << r, first = false;
  os << ")";
  return os.str();
}

std::vector<int> Workspace::wait_joined(double timeout_s) const {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  std::vector<int> missing;
  for (;;) {
    missing.clear();
    for (int r = 0; r < nranks_; ++r)
      if (control(r).joined.load(std::memory_order_acquire) == 0) missing.push_back(r);
    if (missing.empty() || clock::now() >= deadline) return missing;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool Workspace::linked() const {
  if (name_.empty()) return false;
  std::lock_guard<std::mutex> lock(g_names_mu);
  return linked_names().count(name_) != 0;
}

void Workspace::unlink() {
  if (name_.empty()) return;
  std::lock_guard<std::mutex> lock(g_names_mu);
  if (linked_names().erase(name_)) shm_unlink(name_.c_str());  // ENOENT: a peer did it first
}

void unlink_all_workspaces() {
  std::lock_guard<std::mutex> lock(g_names_mu);
  for (const std::string& n : linked_names()) shm_unlink(n.c_str());
  linked_names().clear();
}

// ---------------------------------------------------------------------------------------
// Communicators

int64_t create_comm(const CommConfig& config) {
  int ngroups = 0;
  for (int32_t g : config.group_of) ngroups = std::max(ngroups, g + 1);
  std::vector<std::shared_ptr<Workspace>> ws;
  for (int g = 0; g < ngroups; ++g)
    ws.push_back(Workspace::create_private(config.nranks, config.lane_bytes, config.record_entries));
  return create_comm(config, std::move(ws));
}

int64_t create_comm(const CommConfig& config, std::vector<std::shared_ptr<Workspace>> workspaces) {
  auto comm = std::make_shared<Comm>();
  comm->config = config;
  int ngroups = 0;
  for (int32_t g : config.group_of) ngroups = std::max(ngroups, g + 1);
  if (int(workspaces.size()) != ngroups)
    throw std::invalid_argument("jax_gin: " + std::to_string(workspaces.size()) +
                                " workspaces for " + std::to_string(ngroups) + " groups");
  for (int g = 0; g < ngroups; ++g) {
    const auto& w = workspaces[g];
    if (w && (w->nranks() != config.nranks || w->lane_bytes() != config.lane_bytes))
      throw std::invalid_argument("jax_gin: workspace of group " + std::to_string(g) +
                                  " does not match the communicator's ranks or lane bytes");
    comm->groups.emplace_back(new Group(w));
  }
  std::unique_lock<std::shared_mutex> lock(g_registry_mu);
  if (config.id > 0) {
    if (g_registry.count(config.id))
      throw std::invalid_argument("jax_gin: communicator id " + std::to_string(config.id) +
                                  " is taken");
    comm->id = config.id;
  } else {
    while (g_registry.count(g_next_id)) ++g_next_id;
    comm->id = g_next_id++;
  }
  comm->ordinal = ++g_created;
  g_registry[comm->id] = comm;
  return comm->id;
}

namespace {

// The calls running on `comm` give up at once, and later ones fail, saying `why` (the group's
// first error, where no rank failed first). Only where every rank is this process's: a shared
// workspace's header is read by the other processes too.
void stop_private_calls(const Comm& comm, const char* why) {
  for (const auto& g : comm.groups) {
    if (!g->ws || !g->ws->name().empty()) continue;
    {
      std::lock_guard<std::mutex> lock(g->error_mu);
      if (g->first_error.empty()) g->first_error = why;
      g->stop_reason = why;
    }
    g->ws->header().broken.store(1);
  }
}

}  // namespace

void destroy_comm(int64_t id) {
  std::unique_lock<std::shared_mutex> lock(g_registry_mu);
  auto it = g_registry.find(id);
  if (it == g_registry.end()) return;
  // A program still running on it (reset() waits only for programs whose results are alive)
  // would have ranks that no longer find it and ranks that wait for them until the timeout:
  // those give up at once instead.
  stop_private_calls(*it->second, "jax_gin.runtime.reset() destroyed this communicator while "
                                   "a program ran on it");
  g_registry.erase(it);
}

void shutdown() {
  std::shared_lock<std::shared_mutex> lock(g_registry_mu);
  for (const auto& kv : g_registry)
    stop_private_calls(*kv.second, "the interpreter is exiting (jax_gin's shutdown stops the "
                                   "calls still running)");
}

std::shared_ptr<Comm> find_comm(int64_t id) {
  std::shared_lock<std::shared_mutex> lock(g_registry_mu);
  auto it = g_registry.find(id);
  return it == g_registry.end() ? nullptr : it->second;
}

void set_fingerprint(int64_t id, uint32_t fingerprint) {
  std::unique_lock<std::shared_mutex> lock(g_registry_mu);
  auto it = g_registry.find(id);
  if (it == g_registry.end()) throw std::invalid_argument("jax_gin: no communicator " + std::to_string(id));
  it->second->fingerprint = fingerprint;
}

int64_t num_comms() {
  std::shared_lock<std::shared_mutex> lock(g_registry_mu);
  return int64_t(g_registry.size());
}

std::string allreduce(Comm& comm, int group, int rank, DType dtype, RedOp op, Algorithm algo,
                      const void* in, void* out, size_t count) {
  Segment seg{0, count, in, out};
  return allreduce(comm, group, rank, dtype, op, algo, &seg, 1);
}

namespace {

// What the error of a rank's call that started before its previous call finished advises.
enum class Overlap {
  // The rank's worker (submit): calls of another execution (XLA's run id) are queued or
  // running there: two programs that ran at once. (Calls of one execution are queued, and run
  // in the group's order: Turn.)
  kXlaPrograms,
  // The busy flag under the caller's own threads (the threads harness: module.cc).
  kThreads,
};

// The error of a rank's call that started before its previous call finished: the workspace's
// busy flag (run_call) and the rank's worker (submit) refuse it, each with its advice.
std::string concurrent_calls(const Comm& comm, int group, int rank, Overlap overlap) {
  Text os;
  os << "jax_gin: two collectives ran concurrently on rank " << rank << " of group " << group
     << " of communicator " << comm.id << "; calls on one communicator must be ordered. ";
  switch (overlap) {
    case Overlap::kXlaPrograms:
      os << "XLA orders the calls of one program, not those of two programs that use the "
            "communicator and run at once (called from two threads, say): wait for one's "
            "results before calling the other";
      break;
    case Overlap::kThreads:
      os << "Each rank's calls must come one after the other, from one thread at a time";
      break;
  }
  return os.str();
}

// How long a declined call's worker waits for the call that rank 0 started first
// (RankWorker::loop): half the timeout, so that where that call never comes, this rank's error,
// which names both calls, comes before rank 0's wait for this rank times out and says less.
double turn_wait_s(const CommConfig& cfg) { return cfg.timeout_s / 2; }

// The number of a program's call that messages give: its site's low 16 bits count the calls
// of the module that holds it; the high bits are a hash of the module's name (site_attrs,
// jax_gin/_primitive.py).
uint32_t site_number(uint32_t site) { return site & 0xffffu; }
bool same_module(uint32_t a, uint32_t b) { return (a >> 16) == (b >> 16); }

// The order of a group's calls (Turn): the group's rank 0 writes call `seq`'s site into the
// others' turn words as it starts it; another rank waits for that (as for a peer's signal:
// the timeout, a failed group, a process gone) and compares. Where rank 0 runs another call
// first, a call that may decline is declined (turn.declined); one that may not fails, and its
// group with it, since the ranks would pair different calls. An error, or empty. `round0`:
// the call's first round, for the hang report.
std::string take_turn(Comm& comm, Group& g, int group, int rank, Turn& turn, uint64_t seq,
                      int op, Algorithm algo, size_t slot_bytes, uint64_t round0) {
  Workspace& ws = *g.ws;
  const int nranks = ws.nranks();
  if (nranks == 1) return std::string();
  // This rank fails with `what` (how, as the peers repeat it) and `advice`, and its group too.
  auto fail = [&](const std::string& what, const std::string& advice) {
    Text os;
    os << "jax_gin " << call_op_name(op) << " (" << algorithm_name(algo) << ") on CPU: rank "
       << rank << " of group " << group << " (" << nranks << " ranks) " << what << advice;
    store_relaxed(ws.rec_state(rank).failed, uint8_t(1));  // before the peers read the states
    fail_group(g, rank, what + ".", os.str());
    return os.str();
  };
  if (turn.twin) {
    Text what;
    what << "had two calls of the program's jax_gin call " << site_number(turn.site)
         << " at once";
    return fail(what.str(),
                ": copies of one function's call (a jitted function called twice in one program "
                "is lowered once, or a jax.export'ed function whose name is this program's), "
                "which nothing orders against each other and nothing tells apart, so ranks "
                "could pair them crosswise. Make one copy take a value of the other's results, "
                "or export the function under another name (docs/design.md, Ordering)");
  }
  if (rank == 0) {
    const uint64_t word = (seq << 32) | turn.site;
    for (int p = 1; p < nranks; ++p) {
      // as HostTransport::signal: the store, then the peer's sleeper count
      std::atomic<uint64_t>& w = ws.control(p).turn;
      w.store(word, std::memory_order_seq_cst);
      if (ws.control(p).sleepers.load(std::memory_order_seq_cst) != 0)
        futex_wake(&w, /*high=*/true);
    }
    return std::string();
  }
  HostTransport tp(g, comm.config, group, rank, slot_bytes, op, algo, nullptr, nullptr, round0);
  const uint64_t word = tp.wait_turn(0, seq);
  if (word == 0) return tp.error();
  const uint32_t lead = uint32_t(word);
  if ((word >> 32) == seq && lead == turn.site) {
    // The same call number and site. Programs of one name number their sites alike, so
    // processes that run different programs can agree on both while the calls differ; they
    // would pair a psum with a pmax, or buffers of different sizes. Rank 0's state block says
    // what it started (stored before its turn words, read after this rank saw one; rank 0
    // cannot leave this call before this rank takes part).
    const RecState& mine = ws.rec_state(rank);
    const RecState& lead_st = ws.rec_state(0);
    auto same = [&](auto member) { return load_relaxed(lead_st.*member) == mine.*member; };
    if (same(&RecState::op) && same(&RecState::algorithm) && same(&RecState::dtype) &&
        same(&RecState::bytes))
      return std::string();
    auto call_text = [&](const RecState& x) {
      Text t;
      t << call_op_name(load_relaxed(x.op)) << " (" << algorithm_name(Algorithm(load_relaxed(x.algorithm)))
        << ") of " << load_relaxed(x.bytes) << " bytes of " << dtype_name(DType(load_relaxed(x.dtype)));
      return t.str();
    };
    Text what;
    what << "started call #" << seq << " as " << call_text(mine) << ", but rank 0 started call #"
         << seq << " as " << call_text(lead_st);
    return fail(what.str(),
                ". The ranks of a group make the same calls on a communicator, in the same "
                "order: do all processes run the same programs, in the same order?");
  }
  if ((word >> 32) == seq && turn.may_decline) {
    turn.declined = true;
    turn.leader_site = lead;
    return std::string();
  }
  Text what, advice;
  what << "started call #" << seq << " as the program's jax_gin call " << site_number(turn.site)
       << ", but rank 0 started call #" << (word >> 32) << " as "
       << (same_module(lead, turn.site) ? "its" : "another module's") << " call "
       << site_number(lead);
  advice << ". The ranks of a group make the same calls on a communicator, in rank 0's order, "
            "or they would pair different calls. ";
  if (turn.waited)
    advice << "This rank waited " << turn_wait_s(comm.config) << " s for rank 0's call, and it "
              "did not come: do all devices run the same program?";
  else
    advice << "Each rank's calls must come in the same order";
  return fail(what.str(), advice.str());
}

// Drops a message's closing full stop (and spaces), where a sentence goes on after it.
void strip_final_stop(std::string& text) {
  while (!text.empty() && (text.back() == '.' || text.back() == ' ')) text.pop_back();
}

// One rank's call: the checks, the busy flag and the flight recorder around `body(tp, round)`,
// which runs the schedule over a HostTransport whose slots are `slot_bytes` apart and returns
// false on failure. `op` is the call's op (CallOp), `bytes` its message size for the recorder.
template <class Body>
std::string run_call(Comm& comm, int group, int rank, Turn* turn, DType dtype, int op,
                     Algorithm algo, size_t slot_bytes, size_t bytes, Body&& body) {
  if (group < 0 || group >= int(comm.groups.size()) || rank < 0 || rank >= comm.config.nranks ||
      !comm.groups[group]->ws) {
    Text os;
    os << "jax_gin: communicator " << comm.id << " has no rank " << rank << " in group " << group
       << " in this process";
    return os.str();
  }
  Group& g = *comm.groups[group];
  Workspace& ws = *g.ws;
  if (ws.header().broken.load()) {
    std::lock_guard<std::mutex> lock(g.error_mu);
    std::string earlier = g.first_error;
    const char* where = "an earlier failure";
    if (earlier.empty()) {
      // The failure was in another process: the header holds what failed first, once whole
      // (as in HostTransport::record). This process may have been the one behind: that
      // process's own error has the diagnosis.
      const WorkspaceHeader& h = ws.header();
      const int32_t first = h.first_failed.load(std::memory_order_acquire);
      where = "a failure in another process";
      earlier = "a rank of group " + std::to_string(group) + " failed in another process";
      if (first > 0) {
        std::string failure(h.first_failure);
        strip_final_stop(failure);
        // a timed-out wait's report there names the rank that was behind (laggard.h)
        const bool timed_out = failure.find("timed out") != std::string::npos;
        earlier = "rank " + std::to_string(first - 1) + " of group " + std::to_string(group) +
                  " failed first: it " + failure +
                  (timed_out ? " (that process's error names the rank that was behind)" : "");
      }
    }
    strip_final_stop(earlier);  // the sentence goes on (after a question, a new one)
    const bool question = !earlier.empty() && earlier.back() == '?';
    return std::string("jax_gin: this communicator stopped after ") + where +
           " and cannot be reused: " + earlier + (question ? " " : ". ") +
           "To recover, fix the cause, call jax_gin.runtime.reset() in every process and call "
           "the jitted functions again (reset() clears JAX's compiled programs, so they are "
           "lowered again, with a new communicator)";
  }
  const int nranks = ws.nranks();
  if (nranks > 1 && slot_bytes == 0) {
    Text os;
    os << "jax_gin: workspace of " << ws.lane_bytes() << " bytes is too small for "
       << call_op_name(op) << " (" << algorithm_name(algo) << ") over " << nranks << " ranks";
    return os.str();
  }
  // injected fault: this rank returns at once, as if it never reached the call
  if (rank == comm.config.fault_rank && comm.config.fault_mode == 1) return std::string();
  RankControl& ctl = ws.control(rank);
  if (ctl.busy.exchange(1, std::memory_order_acquire) != 0) {
    return concurrent_calls(comm, group, rank, Overlap::kThreads);
  }
  struct Release {
    std::atomic<uint64_t>& b;
    ~Release() { b.store(0, std::memory_order_release); }
  } release{ctl.busy};
  uint64_t& round = ctl.round;
  // Flight recorder: the state block always (a few stores), the ring entry when recording.
  RecState& st = ws.rec_state(rank);
  const uint64_t seq = st.seq + 1;
  const RecState last = st;  // the last call's fields, which a declined call puts back
  store_relaxed(st.op, int8_t(op));
  store_relaxed(st.algorithm, int8_t(algo));
  store_relaxed(st.dtype, int8_t(dtype));
  store_relaxed(st.failed, uint8_t(0));
  store_relaxed(st.bytes, uint64_t(bytes));
  store_release(st.seq, seq);
  const bool recording = g_record.load(std::memory_order_relaxed);
  const uint64_t t_call = recording ? now_ns() : 0;  // before the turn's wait
  RecEntry* slot = nullptr;  // the ring's slot for this call, and `entry` its contents
  RecEntry entry;
  auto open_entry = [&](uint64_t t_start) {
    slot = ws.rec_ring(rank) + rec_slot(seq, uint64_t(ws.record_entries()));
    // A seqlock: a reader skips the slot while it is rewritten (seq 0). The fence keeps the
    // header's stores below from becoming visible before the 0.
    store_relaxed(slot->seq, uint64_t(0));
    std::atomic_thread_fence(std::memory_order_release);
    rec_open(entry, t_start, uint64_t(bytes), round + 1, int(comm.id), group, rank, op,
             int(algo), int(dtype), 0);
    publish_entry(*slot, entry, 0, 0);
    store_release(slot->seq, seq);
  };
  auto close_entry = [&](bool ok, uint32_t rounds) {
    entry.rounds = rounds;
    entry.status = ok ? kRecDone : kRecFailed;
    publish_entry(*slot, entry, 0, 0);  // (t_end still 0)
    store_release(slot->t_end, now_ns());
  };
  Turn unknown;
  std::string err = take_turn(comm, g, group, rank, turn ? *turn : unknown, seq, op, algo,
                              slot_bytes, round + 1);
  if (!err.empty() || (turn && turn->declined)) {
    if (err.empty()) {  // declined: the state block shows the last call again
      store_relaxed(st.op, last.op);
      store_relaxed(st.algorithm, last.algorithm);
      store_relaxed(st.dtype, last.dtype);
      store_relaxed(st.failed, last.failed);
      store_relaxed(st.bytes, last.bytes);
      store_release(st.seq, seq - 1);
    } else {
      if (recording) {  // the ring keeps the failed call too (a wait for rank 0's turn word)
        open_entry(t_call);
        close_entry(false, 0);
      }
      store_relaxed(st.failed, uint8_t(1));
      store_release(st.done, seq);
    }
    return err;
  }
  if (recording) open_entry(now_ns());
  HostTransport tp(g, comm.config, group, rank, slot_bytes, op, algo, slot ? &entry : nullptr,
                   slot, round + 1);
  const uint64_t round_before = round;
  const bool ok = body(tp, round);
  if (slot) close_entry(ok, uint32_t(round - round_before));
  store_relaxed(st.failed, uint8_t(ok ? 0 : 1));
  store_release(st.done, seq);
  return ok ? std::string() : tp.error();  // a failure marked the group failed (fail_group)
}

// The group and rank of logical device `logical_id`, or an error.
std::string locate(const Comm& comm, uint32_t logical_id, int* group, int* rank) {
  const auto& cfg = comm.config;
  if (logical_id >= cfg.group_of.size()) {
    Text os;
    os << "jax_gin: device with partition id " << logical_id << " is not in communicator "
       << comm.id << " (" << cfg.group_of.size() << " devices)";
    return os.str();
  }
  *group = cfg.group_of[logical_id];
  *rank = cfg.rank_of[logical_id];
  return std::string();
}

}  // namespace

std::string allreduce(Comm& comm, int group, int rank, DType dtype, RedOp op, Algorithm algo,
                      Segment* seg, int nseg, int call_op, Turn* turn) {
  if (nseg < 1 || nseg > kMaxSegments) return "jax_gin: " + std::to_string(nseg) + " buffers in one call (1.." +
                                              std::to_string(kMaxSegments) + " allowed)";
  const int nranks = comm.config.nranks;
  const size_t lane_bytes = comm.config.lane_bytes;
  const size_t esize = dtype_size(dtype);
  const size_t count = nseg == 1 ? seg[0].count : lay_out_segments(seg, nseg, esize);
  const int rpn = comm.config.ranks_per_node;
  if (int(algo) < 0 || int(algo) >= kNumInternalAlgorithms) {
    return "jax_gin: unknown algorithm id " + std::to_string(int(algo));
  }
  if (algo == Algorithm::kHierarchical && !schedule::hier_valid(nranks, rpn)) {
    Text os;
    os << "jax_gin: hierarchical over " << nranks << " ranks needs ranks_per_node in 1.."
       << nranks << " that divides " << nranks << " (or 0: one node), got " << rpn;
    return os.str();
  }
  const size_t slot_bytes = schedule::slot_elems(algo, nranks, lane_bytes, esize, rpn) * esize;
  return run_call(comm, group, rank, turn, dtype, call_op >= 0 ? call_op : int(op), algo,
                  slot_bytes, count * esize,
                  [&](HostTransport& tp, uint64_t& round) {
    return with_dtype<HostElem>(dtype, false, [&](auto elem) {
      using T = typename decltype(elem)::type;
      return with_redop(op, false, [&](auto red) {
        return run_all<T, decltype(red)>(tp, algo, seg, nseg, count, lane_bytes, rpn, round);
      });
    });
  });
}

std::string collective(Comm& comm, int group, int rank, DType dtype, int call_op, Algorithm algo,
                       const void* in, void* out, size_t block, Turn* turn) {
  if (call_op != kOpReduceScatter && call_op != kOpAllGather)
    return "jax_gin: unknown collective op " + std::to_string(call_op);
  if (!schedule::coll_supported(algo)) {
    return std::string("jax_gin: ") + call_op_name(call_op) + " runs one_shot or ring, not " +
           algorithm_name(algo);
  }
  const size_t esize = dtype_size(dtype);
  if ((block * esize) % kAlignBytes != 0) {
    Text os;
    os << "jax_gin: " << call_op_name(call_op) << " blocks of " << block * esize
       << " bytes; blocks must be multiples of " << kAlignBytes << " bytes";
    return os.str();
  }
  const int nranks = comm.config.nranks;
  const size_t lane_bytes = comm.config.lane_bytes;
  const size_t slot_bytes = schedule::coll_slot_elems(algo, nranks, lane_bytes, esize) * esize;
  // the recorder's size: the larger side, as nccl-tests reports these collectives
  const size_t bytes = block * esize * size_t(nranks);
  return run_call(comm, group, rank, turn, dtype, call_op, algo, slot_bytes, bytes,
                  [&](HostTransport& tp, uint64_t& round) {
    return with_dtype<HostElem>(dtype, false, [&](auto elem) {
      using T = typename decltype(elem)::type;
      const Blocks<T> b{static_cast<const T*>(in), static_cast<T*>(out), block};
      return run_lane_collective<T, Sum>(tp, call_op, algo, b, block, lane_bytes, round);
    });
  });
}

std::string collective_logical(Comm& comm, uint32_t logical_id, DType dtype, int call_op,
                               Algorithm algo, const void* in, void* out, size_t block,
                               Turn* turn) {
  int group = 0, rank = 0;
  std::string err = locate(comm, logical_id, &group, &rank);
  if (!err.empty()) return err;
  return collective(comm, group, rank, dtype, call_op, algo, in, out, block, turn);
}

std::string allreduce_logical(Comm& comm, uint32_t logical_id, DType dtype, RedOp op,
                              Algorithm algo, Segment* seg, int nseg, int call_op, Turn* turn) {
  int group = 0, rank = 0;
  std::string err = locate(comm, logical_id, &group, &rank);
  if (!err.empty()) return err;
  return allreduce(comm, group, rank, dtype, op, algo, seg, nseg, call_op, turn);
}

// ---------------------------------------------------------------------------------------
// Worker threads

namespace {

// How long a worker thread waits idle for its rank's next call before it ends. A new thread
// costs tens of microseconds (pthread_create, a stack's first pages), paid only by a call
// that comes after an idle second, next to calls that take tens of microseconds and more,
// while an idle thread costs its stack and a pid until its communicator goes: 60
// communicators on 8 CPU devices kept ~500 threads. A program's back-to-back calls (a training
// step's, the next step's) come well within it.
constexpr std::chrono::milliseconds kWorkerIdle{1000};

}  // namespace

RankWorker::RankWorker(int64_t ordinal, uint32_t logical_id, double turn_wait_s)
    : s_(std::make_shared<State>()),
      name_("jax_gin:" + std::to_string(ordinal) + "/" + std::to_string(logical_id)),
      turn_wait_s_(turn_wait_s) {}

RankWorker::~RankWorker() {
  std::thread t;
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stop = true;
    t = std::move(s_->thread);  // not joinable where the thread ended idle (it detached itself)
  }
  s_->cv.notify_one();
  if (!t.joinable()) return;
  // The communicator's last reference went on this worker (a call it ran held it): it cannot
  // join itself, and ends by itself once this call returns.
  if (t.get_id() == std::this_thread::get_id()) t.detach();
  else t.join();
}

bool RankWorker::submit(Work work, Done done, uint32_t site, int64_t run_id) {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->pending > 0 && s_->run_id != run_id) return false;
    if (!s_->running) {
      // The first call, or the thread ended idle (it decided so under this mutex, and detached
      // itself: s_->thread is empty): a fresh one runs this call.
      try {
        s_->thread = std::thread(&RankWorker::loop, s_, name_, turn_wait_s_);
      } catch (const std::system_error& e) {
        throw CannotStart(e.what());
      }
      s_->running = true;
    }
    s_->calls.push_back(Call{std::move(work), std::move(done), site});
    ++s_->pending;  // after the queueing, which may throw
    s_->run_id = run_id;
  }
  s_->cv.notify_one();
  return true;
}

void RankWorker::loop(std::shared_ptr<State> s, std::string name, double turn_wait_s) {
  name.resize(std::min<size_t>(name.size(), 15));  // the kernel's limit on a thread's name
  pthread_setname_np(pthread_self(), name.c_str());
  using clock = std::chrono::steady_clock;
  bool wanting = false;  // a declined call waits for rank 0's call:
  uint32_t want = 0;     // its site
  clock::time_point until;  // how long it waits
  for (;;) {
    Call call;
    Turn turn;
    turn.may_decline = true;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      auto it = s->calls.begin();
      if (wanting) {
        // The declined call is queued again: wait for rank 0's call to come too (rank 0
        // cannot go on without this rank's part of it). Where it does not come within
        // turn_wait_s, the first call runs, and fails (take_turn): the ranks would pair it
        // with another.
        auto wanted = [&] {
          it = std::find_if(s->calls.begin(), s->calls.end(),
                            [&](const Call& c) { return c.site == want; });
          return s->stop || it != s->calls.end();
        };
        s->cv.wait_until(lock, until, wanted);
        if (it == s->calls.end()) {
          it = s->calls.begin();
          turn.may_decline = false;
          turn.waited = !s->stop;
        }
        wanting = false;
      } else {
        s->cv.wait_for(lock, kWorkerIdle, [&] { return s->stop || !s->calls.empty(); });
        if (s->calls.empty()) {
          // Stopped (the queued calls have run; ~RankWorker took the thread out of the State,
          // to join it or, on this very thread, detach it), or idle for kWorkerIdle: end, and
          // detach this thread, so that it is reaped as it ends (no one joins it now).
          // Decided under the mutex that submit queues under: a call queued before this saw
          // no `running` thread starts a fresh one.
          s->running = false;
          if (s->thread.joinable()) s->thread.detach();
          return;
        }
        it = s->calls.begin();
      }
      const uint32_t site = it->site;
      call = std::move(*it);
      s->calls.erase(it);
      turn.twin = site != 0 && std::any_of(s->calls.begin(), s->calls.end(),
                                           [&](const Call& c) { return c.site == site; });
    }
    turn.site = call.site;
    const std::string err = call.work(turn);
    if (turn.declined) {
      // Rank 0 runs call `leader_site` first: this one waits at the front of the queue.
      std::lock_guard<std::mutex> lock(s->mu);
      s->calls.push_front(std::move(call));
      wanting = true;
      want = turn.leader_site;
      until = clock::now() + std::chrono::duration_cast<clock::duration>(
                                 std::chrono::duration<double>(turn_wait_s));
      continue;
    }
    {
      // Counted off before `done`: XLA may start this rank's next call from inside it.
      std::lock_guard<std::mutex> lock(s->mu);
      --s->pending;
    }
    call.done(err);
  }
}

std::string submit(Comm& comm, uint32_t logical_id, RankWorker::Work work,
                   RankWorker::Done done, uint32_t site, int64_t run_id) {
  int group = 0, rank = 0;
  std::string err = locate(comm, logical_id, &group, &rank);
  if (!err.empty()) return err;
  RankWorker* worker = nullptr;
  std::string what;  // why the call could not be handed to the worker
  try {
    {
      std::lock_guard<std::mutex> lock(comm.workers_mu);
      if (comm.workers.empty()) comm.workers.resize(comm.config.group_of.size());
      auto& w = comm.workers[logical_id];
      if (!w) w.reset(new RankWorker(comm.ordinal, logical_id, turn_wait_s(comm.config)));
      worker = w.get();
    }
    if (worker->submit(std::move(work), std::move(done), site, run_id))
      return std::string();
    return concurrent_calls(comm, group, rank, Overlap::kXlaPrograms);
  } catch (const RankWorker::CannotStart& e) {
    what = std::string("could not start its worker thread (") + e.what() + ")";
  } catch (const std::exception& e) {
    what = std::string(worker ? "could not queue its call on its worker thread ("
                              : "could not start its worker thread (") + e.what() + ")";
  }
  // An exception must not leave the FFI handler; and the peers, already in the call or
  // coming to it, would wait for this rank until the timeout: they give up at once,
  // repeating this rank's failure.
  Text os;
  os << "jax_gin: rank " << rank << " of group " << group << " of communicator " << comm.id
     << " " << what
     << ". Each communicator runs a thread per device of this process while it makes calls "
        "(a thread ends after a second without one): a limit on threads (ulimit -u, a "
        "container's pids limit) may have been reached";
  fail_group(*comm.groups[size_t(group)], rank, what + ".", os.str());
  return os.str() + ". To recover, call jax_gin.runtime.reset() and the jitted functions again";
}

// ---------------------------------------------------------------------------------------
// Flight recorder

void set_record(bool on) { g_record.store(on, std::memory_order_relaxed); }
bool recording() { return g_record.load(std::memory_order_relaxed); }

std::vector<RecEntry> recorder_entries(const Workspace& ws, int rank) {
  std::vector<RecEntry> out;
  const RecEntry* ring = ws.rec_ring(rank);
  for (int i = 0; i < ws.record_entries(); ++i) {
    // The other side of run_call's seqlock: the copy's loads may not move past the fence, so
    // that a seq still the same after it means the copy holds no field of a later call. (The
    // copy's loads are atomic word by word, as publish_entry's stores are: a running call's
    // rounds and events may be read mid-update, and are only advisory.)
    const uint64_t seq = load_acquire(ring[i].seq);
    if (seq == 0) continue;
    RecEntry e;
    const auto* src = reinterpret_cast<const RecWord*>(&ring[i]);
    auto* dst = reinterpret_cast<RecWord*>(&e);
    for (size_t w = 0; w < sizeof(RecEntry) / sizeof(RecWord); ++w)
      dst[w] = __atomic_load_n(src + w, __ATOMIC_RELAXED);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (load_relaxed(ring[i].seq) != seq) continue;  // rewritten meanwhile
    e.seq = seq;
    out.push_back(e);
  }
  std::sort(out.begin(), out.end(), [](const RecEntry& a, const RecEntry& b) { return a.seq < b.seq; });
  return out;
}

uint64_t calls_entered(const Workspace& ws, int rank) { return load_acquire(ws.rec_state(rank).seq); }

std::string laggard_report(const Workspace& ws, int group, int self) {
  return laggard_text(rank_states(ws), group, self);
}

}  // namespace cpu
}  // namespace jax_gin
