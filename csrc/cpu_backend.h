// The CPU backend: the same algorithms as the GPU (include/jax_gin/algorithms.h), run by CPU
// devices, each on its own thread, over a host "symmetric workspace": one window and one flag
// area per rank, written by peers with one-sided puts and signals.
//
// A group's whole state (header, per-rank control words, flags and windows) lives in one
// memory region with the same layout everywhere. When every rank of the group runs in this
// process the region is private memory; when the group spans processes (jax.distributed) it
// is a POSIX shared-memory segment that one process creates and the others map, so that the
// device threads of all processes run the very same code on it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "jax_gin/common.h"
#include "jax_gin/message.h"
#include "jax_gin/recorder.h"

namespace jax_gin {
namespace cpu {

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "flags in shared memory need lock-free (address-free) 64-bit atomics");

struct CommConfig {
  int nranks = 1;                // ranks per group
  std::vector<int32_t> group_of;  // indexed by logical device id (XLA partition id)
  std::vector<int32_t> rank_of;   // indexed by logical device id
  // Window bytes per rank, one lane on the CPU (jax_gin.runtime.settings.cpu_workspace_bytes
  // reads its default from here).
  size_t lane_bytes = 1 << 20;
  // Pipelining granularity of ring, tree and two_shot (schedule::chunks_for). Small, so that
  // the tests' messages are cut into several chunks; the same in every process of a group.
  size_t chunk_bytes = 16 << 10;
  double timeout_s = kDefaultTimeoutS;  // every wait gives up after this long
  int fault_rank = -1;            // testing only: the faulty rank (see fault_mode)
  int fault_mode = 0;             // 0: its signals are dropped; 1: it never enters a call
  int ranks_per_node = 0;         // hierarchical only: ranks of a group per "node" (0: all)
  int record_entries = kRecDefaultEntries;  // flight-recorder ring per rank (private groups)
  // Added to a timeout's report where a rank of the group never entered the call (empty:
  // nothing): jax_gin.runtime's note on XLA's CPU threads, where they are too few.
  std::string absent_note;
  // The communicator's id, which the custom calls name (ffi_common.h), as jax_gin.runtime
  // chooses it (_runtime._free_id); 0: the next free one of a counter.
  int64_t id = 0;
  // Per group: the last line of a report from its ranks (empty or missing: none), in which
  // jax_gin.runtime names the group's mesh axes and devices, since the report's ranks and
  // call numbers are the group's own.
  std::vector<std::string> group_text;
  // The JAX device id of each logical device id (empty: not known), by which a report finds
  // where a rank that is behind here is in another communicator of this process.
  std::vector<int32_t> device_id;
};

// The first bytes of a workspace. Attaching processes check it against what they expect.
struct WorkspaceHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t nranks;
  uint64_t lane_bytes;
  uint64_t total_bytes;
  uint64_t record_entries;       // flight-recorder calls per rank
  std::atomic<uint64_t> ready;   // 1 once the creator has laid the workspace out
  std::atomic<uint64_t> broken;  // 1 once any rank of the group failed: the others give up
  // The rank that failed first (1 + rank, once first_failure is whole; 0: none; -1: being
  // written) and what failed, from its wait ("timed out after 2 s waiting for peer 5 at step 2
  // ..."): the ranks that give up after it say so in their own errors, whichever rank's error
  // the caller sees.
  std::atomic<int32_t> first_failed;
  int32_t pad;
  char first_failure[1024];
};

// Per-rank control words, one cache line each.
struct alignas(64) RankControl {
  std::atomic<uint64_t> joined;  // 1 once the process that runs this rank has mapped it
  std::atomic<uint64_t> busy;    // 1 while a call of this rank runs
  uint64_t round;                // rounds run so far; touched only by this rank's thread
  std::atomic<uint32_t> sleepers;  // waits of this rank asleep on a futex: signals skip the
                                   // wake-up syscall when there are none
  std::atomic<int32_t> pid;        // the process that runs this rank (set by join)
  int32_t process;                 // its jax.process_index()
  // The call that the group's rank 0 runs: (its call number << 32) | its site (Turn), written
  // by rank 0 into every other rank's word as it starts the call (run_call).
  std::atomic<uint64_t> turn;
};
static_assert(sizeof(RankControl) == 64, "RankControl is one cache line");

// One group's symmetric workspace: all ranks' windows, flags and round counters, and the
// flight recorder (recorder.h): each rank's state block and ring of `record_entries` calls.
class Workspace {
 public:
  // Private memory: every rank of the group runs in this process.
  static std::shared_ptr<Workspace> create_private(int nranks, size_t lane_bytes,
                                                   int record_entries = kRecDefaultEntries);
  // A new POSIX shared-memory segment `name` (fails if it exists), for other processes to
  // map with attach_shared(). Throws std::runtime_error with a message that says why.
  static std::shared_ptr<Workspace> create_shared(const std::string& name, int nranks,
                                                  size_t lane_bytes,
                                                  int record_entries = kRecDefaultEntries);
  static std::shared_ptr<Workspace> attach_shared(const std::string& name, int nranks,
                                                  size_t lane_bytes,
                                                  int record_entries = kRecDefaultEntries);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // This process (jax.process_index() `process`) runs `rank`.
  void join(int rank, int process = 0);
  // "process 1 (pid 4242; ranks 4, 5, 6, 7)" if the process that runs `rank` has exited or
  // was killed, else empty. Ranks of this process are alive.
  std::string gone(int rank) const;
  // The same text if that process is stopped (by a signal such as SIGSTOP, or a debugger),
  // else empty.
  std::string stopped(int rank) const;
  // "process 1 (pid 4242; ranks 4, 5, 6, 7)": the process that runs `rank`.
  std::string process_text(int rank) const;
  // Waits until every rank has joined; returns the ranks still missing after `timeout_s`
  // (empty: all joined).
  std::vector<int> wait_joined(double timeout_s) const;
  // Removes the segment's name (idempotent); the mapping stays valid until destruction.
  void unlink();

  int nranks() const { return nranks_; }
  size_t lane_bytes() const { return lane_bytes_; }
  int record_entries() const { return record_entries_; }
  bool runs_here(int rank) const { return local_[size_t(rank)]; }  // join()ed by this process
  const std::string& name() const { return name_; }  // empty for private memory
  bool linked() const;

  WorkspaceHeader& header() const { return *reinterpret_cast<WorkspaceHeader*>(base_); }
  RankControl& control(int rank) const {
    return reinterpret_cast<RankControl*>(base_ + ctrl_off_)[rank];
  }
  std::atomic<uint64_t>* flags(int rank) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base_ + flags_off_) + size_t(rank) * flag_words(nranks_);
  }
  char* window(int rank) const { return base_ + windows_off_ + size_t(rank) * window_stride_; }
  RecState& rec_state(int rank) const {
    return reinterpret_cast<RecState*>(base_ + rec_state_off_)[rank];
  }
  RecEntry* rec_ring(int rank) const {
    return reinterpret_cast<RecEntry*>(base_ + rec_ring_off_) + size_t(rank) * size_t(record_entries_);
  }

 private:
  Workspace(int nranks, size_t lane_bytes, int record_entries);
  void map(int fd, bool create);
  void lay_out();

  int nranks_;
  size_t lane_bytes_;
  int record_entries_;
  std::vector<bool> local_;
  size_t ctrl_off_ = 0, flags_off_ = 0, rec_state_off_ = 0, rec_ring_off_ = 0, windows_off_ = 0,
         window_stride_ = 0, total_ = 0;
  char* base_ = nullptr;
  std::string name_;
};

// Unlinks every segment name this process created or mapped and has not unlinked yet (at
// exit, so that a process that fails during set-up leaves nothing in /dev/shm).
void unlink_all_workspaces();

// One group of ranks that reduce together. `ws` is null when none of its ranks runs here.
struct Group {
  explicit Group(std::shared_ptr<Workspace> w) : ws(std::move(w)) {}
  std::shared_ptr<Workspace> ws;
  std::mutex error_mu;
  std::string first_error;  // the first failed rank's error here (fail_group), or empty
  // What stopped the group's calls where no rank failed (stop_private_calls: reset(), the
  // interpreter's exit), or empty; under error_mu.
  std::string stop_reason;
};

// Which call of its program a rank's call is, and whether it may wait for another. The ranks of
// a group run their calls in the order that the group's rank 0 runs them: rank 0 writes each
// call's site into the others' control words as it starts it, and another rank's call first
// waits for that and compares (run_call). Where XLA hands a rank two calls that nothing orders
// against each other (two independent shard_map blocks of one program), each rank's worker
// thus runs them in rank 0's order, whichever came first to it.
struct Turn {
  // The program's custom call (the lowering's "site" attribute, the same in every process: a
  // hash of its module's name in the high 16 bits, the module's count of calls in the low 16,
  // from 1, wrapping after 65535; _primitive.site_attrs); 0 where not known (the threads
  // harness).
  uint32_t site = 0;
  // On the rank's worker: where rank 0 runs another call first, the call returns at once
  // without running (declined), naming that call's site, which the worker runs first.
  // Elsewhere (the threads harness) the call fails: its rank would pair it with another call.
  bool may_decline = false;
  // The worker waited half the timeout for rank 0's call, which did not come; this one runs,
  // and fails.
  bool waited = false;
  // Another call of this site is queued on the rank's worker: copies of one function's call
  // (a jitted function called twice is lowered once), which nothing tells apart, so ranks
  // could pair them crosswise. This one fails.
  bool twin = false;
  bool declined = false;
  uint32_t leader_site = 0;  // the site of rank 0's call, where declined
};

// The thread that runs one rank's calls, one after another, for the FFI handlers (ffi_cpu.cc).
// They hand a call to it and return a future at once, so that the device's XLA thread goes on
// with the operations that do not need the call's results (a lax collective, say) while the
// rank waits for its peers here: a device blocked inside a jax_gin call while its peers block
// in XLA's rendezvous of a lax collective was a deadlock. A call's `done` runs on this thread
// (XLA continues the program from the future's completion there, and may hand it the rank's
// next call). Calls of one program that XLA hands it while one runs (two independent blocks'
// calls) are queued, and run in the order of the group's rank 0 (Turn). The thread starts at
// the first call, and ends by itself after about a second without one (cpu_backend.cc:
// kWorkerIdle); the next call starts a fresh one. A queued call holds its communicator, so the
// communicator's last reference may go on this very thread, which then outlives its
// RankWorker: the thread uses only its shared State. The thread is named
// "jax_gin:<ordinal>/<device>" (Comm::ordinal; as gdb and top show it).
class RankWorker {
 public:
  // The call (its error, or empty), told its site and whether it may decline (Turn).
  using Work = std::function<std::string(Turn&)>;
  using Done = std::function<void(const std::string&)>;  // told the call's error, or empty
  // submit's error where no thread can start (a limit on threads): what() is the system's.
  struct CannotStart : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  // `turn_wait_s`: how long a declined call waits for the call that rank 0 runs first.
  RankWorker(int64_t ordinal, uint32_t logical_id, double turn_wait_s);  // starts no thread
  ~RankWorker();  // runs the calls already queued, then ends the thread
  RankWorker(const RankWorker&) = delete;
  RankWorker& operator=(const RankWorker&) = delete;
  // Queues call `site` of XLA's execution `run_id`, starting a thread where none runs
  // (CannotStart where it cannot); false (and nothing queued) while calls of another execution
  // are queued or running.
  bool submit(Work work, Done done, uint32_t site, int64_t run_id);

 private:
  struct Call {
    Work work;
    Done done;
    uint32_t site;
  };
  struct State {
    std::mutex mu;  // guards all of the below
    std::condition_variable cv;
    std::deque<Call> calls;  // queued, not yet taken by the thread
    int pending = 0;     // calls queued or running (their `done` not yet called)
    int64_t run_id = 0;  // XLA's execution that the pending calls belong to
    bool stop = false;
    // A thread runs loop() and will take a queued call: false before the first call and once
    // the thread decided to end (idle), which it does under `mu`, detaching itself.
    bool running = false;
    std::thread thread;  // the running thread, for ~RankWorker to join; empty once detached
  };
  static void loop(std::shared_ptr<State> s, std::string name, double turn_wait_s);
  std::shared_ptr<State> s_;
  std::string name_;  // the thread's
  double turn_wait_s_;
};

struct Comm {
  int64_t id = 0;
  // The communicators of this process counted from 1 in set-up order: its workers' thread
  // names (RankWorker), which the kernel cuts to 15 characters, too few for the id.
  int64_t ordinal = 0;
  uint32_t fingerprint = 0;  // the high half of the custom calls' "comm" attribute (ffi_common.h)
  CommConfig config;
  std::vector<std::unique_ptr<Group>> groups;
  // The worker of each logical device (XLA partition id) that has made a call here, made at
  // its first call; its thread runs while calls come (RankWorker). Declared last, so that they
  // end before the rest of the communicator goes.
  std::mutex workers_mu;
  std::vector<std::unique_ptr<RankWorker>> workers;
};

// Every group in private memory (one process).
int64_t create_comm(const CommConfig& config);
// One workspace per group (null for groups without a rank in this process).
int64_t create_comm(const CommConfig& config, std::vector<std::shared_ptr<Workspace>> workspaces);
void destroy_comm(int64_t id);
// At interpreter exit (jax_gin's atexit hook): the calls still running on communicators whose
// ranks are all this process's give up at once, as destroy_comm makes them, so that JAX's
// shutdown, which waits for the programs in flight, does not wait out the timeout of a call
// whose peers never come. The communicators stay registered (the registry is never destroyed).
void shutdown();
std::shared_ptr<Comm> find_comm(int64_t id);
// Sets communicator `id`'s fingerprint, before any program that uses it is lowered.
void set_fingerprint(int64_t id, uint32_t fingerprint);
int64_t num_comms();

// The flight recorder's ring (recorder.h) is written while this is on (process-wide; off by
// default). Each rank's state block is written always.
void set_record(bool on);
bool recording();
// The ring of `rank` (a rank this process runs), oldest call first; empty slots left out.
std::vector<RecEntry> recorder_entries(const Workspace& ws, int rank);
// The calls `rank` has entered (its state block's seq: recorded or not), which numbers them.
uint64_t calls_entered(const Workspace& ws, int rank);
// Each rank's state and last recorded call, and who is behind, as text (the hang report).
std::string laggard_report(const Workspace& ws, int group, int self);

// One rank's part of an all-reduce of `count` elements. Blocks until the rank is done.
// Returns an empty string on success, else a message naming op, rank, peer and step.
std::string allreduce(Comm& comm, int group, int rank, DType dtype, RedOp op, Algorithm algo,
                      const void* in, void* out, size_t count);

// Several buffers of one dtype reduced as one message (message.h): `seg` holds each buffer's
// count, in and out; this fills in their logical starts. 1 <= nseg <= kMaxSegments.
// `call_op`: the call as recorded and reported (CallOp) where it is not `op`'s all-reduce
// (the fused norms'); -1: op. `turn`: the call's site, and whether it may decline (null:
// site 0, and it may not).
std::string allreduce(Comm& comm, int group, int rank, DType dtype, RedOp op, Algorithm algo,
                      Segment* seg, int nseg, int call_op = -1, Turn* turn = nullptr);

// One rank's part of a reduce-scatter (call_op kOpReduceScatter, a sum) or all-gather
// (kOpAllGather) of blocks of `block` elements (collectives.h): a reduce-scatter reads
// nranks blocks from `in` and writes one to `out`, an all-gather the other way round.
// block * dtype size must be a multiple of 16 bytes.
std::string collective(Comm& comm, int group, int rank, DType dtype, int call_op, Algorithm algo,
                       const void* in, void* out, size_t block, Turn* turn = nullptr);
std::string collective_logical(Comm& comm, uint32_t logical_id, DType dtype, int call_op,
                               Algorithm algo, const void* in, void* out, size_t block,
                               Turn* turn);

// Same, addressed by the logical device id that XLA reports as the partition id.
std::string allreduce_logical(Comm& comm, uint32_t logical_id, DType dtype, RedOp op,
                              Algorithm algo, Segment* seg, int nseg, int call_op, Turn* turn);

// Runs `work` (call `site` of logical device `logical_id` in XLA's execution `run_id`:
// allreduce_logical or collective_logical, say) on that device's worker thread, then `done`
// with its error (empty: success) on the same thread. Returns an error, and runs neither,
// where the device is not in the communicator, its worker thread cannot start (a limit on
// threads; the group then fails, so that its peers give up at once, repeating this error; a
// thread starts at a rank's first call and after an idle second) or calls of another
// execution are queued or running there (two programs that run at once). XLA starts a call
// once the call whose order token it takes is done, so the calls of one chain come one after
// the other; those of chains that nothing links (two independent blocks of one program) may
// come at once, and are queued (Turn).
std::string submit(Comm& comm, uint32_t logical_id, RankWorker::Work work,
                   RankWorker::Done done, uint32_t site, int64_t run_id);

}  // namespace cpu
}  // namespace jax_gin
