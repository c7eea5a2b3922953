// The GPU transport: one CTA is one lane of one rank. Peers' windows are reached by load/store
// over NVLink (NCCL LSA pointers, or a plain pointer table in the native test harness);
// signals are 64-bit flags written with release semantics at system scope into the peer's
// window and read with acquire semantics. No kernel includes nanobind, Python or XLA.
#pragma once

#include <cstddef>
#include <cstdint>

#include <nccl.h>
#include <nccl_device.h>

#include "jax_gin/algorithms.h"
#include "jax_gin/common.h"
#include "jax_gin/recorder.h"
#include "jax_gin/reduce.h"
#include "device_types.cuh"
#include "kernels.h"
#include "jax_gin/schedule.h"

namespace jax_gin {
namespace gpu {

// ---- flags --------------------------------------------------------------------------------
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Everything a kernel needs to find its windows and report a timeout.
struct LaneParams {
  int rank, nranks, group;
  size_t flags_offset;   // byte offset of the flag area inside each window
  size_t data_offset;    // byte offset of lane 0's data area inside each window
  size_t lane_bytes;     // data bytes per lane
  uint64_t* rounds;      // this rank's per-lane round counters (device memory)
  HangReport* diag;      // host-mapped: written before a trap
  uint64_t timeout_ns;
  int fault_rank;        // testing only: this rank's signals are dropped
  int32_t op, algorithm;  // op: the call's code for the recorder and hang reports (call_op_name)
  size_t ll_offset;      // byte offset of the LL (low-latency) area inside each window
  int ll;                // 1: this launch uses the LL one-shot kernel
  size_t chunk_bytes;    // pipelining granularity within a lane (schedule::chunks_for)
  // Groups that span nodes (hierarchical_kernel only; see the rail section below).
  int ranks_per_node = 0;        // L: ranks of a node (0: one node)
  size_t rail_offset = 0;        // byte offset of the rail area (last-sent tags, emulated signals)
  size_t outbox_offset = 0;      // byte offset of lane 0's outbox
  size_t outbox_lane_bytes = 0;  // outbox bytes per lane
  // Flight recorder (recorder.h), device memory: this rank's ring of rec_entries entries and
  // its control words, [0] recording on, [1] calls recorded. Null: no recorder.
  RecEntry* rec_ring = nullptr;
  uint64_t* rec_ctl = nullptr;
  uint32_t rec_entries = 0;
  int32_t rec_comm = 0;    // communicator id, for the entries
  int32_t dtype = 0;       // DType of the call, for the entries
  uint64_t bytes = 0;      // message bytes of the call, for the entries
  // The rank's state block (recorder.h RecState) at `state_offset` of every window: this
  // rank's own, in its window (null: none).
  size_t state_offset = 0;
  RecState* state = nullptr;
};

// ---- LL protocol (one_shot for small messages) ----------------------------------------
// Each 16-byte line carries 8 payload bytes as two (data32, flag32) pairs written with one
// v2.u64 store; every 64-bit half is single-copy atomic, so a reader that sees the flag of
// the current round in both halves also sees their data. No separate signal, no fence, no
// credit: one NVLink one-way latency per call. Buffers alternate by round parity; a rank in
// round e has received its peers' round e-1 data, so they finished reading round e-2's
// buffer (each call is one kernel, and kernels of one rank are stream-ordered).
constexpr size_t kLLLanePayload = 8 << 10;  // payload bytes per lane
constexpr int kLLMaxLanes = 32;             // so LL can carry up to 256 KiB per rank
constexpr int kLLMaxRanks = 16;
constexpr size_t kLLLinesPerLane = kLLLanePayload / 8;
__host__ __device__ inline size_t ll_area_bytes(int nranks) {
  return 2ull * kLLMaxLanes * size_t(nranks) * kLLLinesPerLane * 16;
}
__host__ __device__ inline size_t ll_slot_offset(int parity, int lane, int sender, int nranks) {
  return ((size_t(parity) * kLLMaxLanes + size_t(lane)) * size_t(nranks) + size_t(sender)) *
         kLLLinesPerLane * 16;
}
__device__ __forceinline__ void st_volatile_v2(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void ld_volatile_v2(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// Peers reached through an NCCL window (LSA pointers).
struct NcclPeers {
  ncclWindow_t win;
  __device__ char* base(int peer) const { return static_cast<char*>(ncclGetLsaPointer(win, 0, peer)); }
};
// Peers reached through a table of device pointers with P2P access (native test harness).
struct TablePeers {
  char* const* bases;
  __device__ char* base(int peer) const { return bases[peer]; }
};

// The flight recorder's device side. Thread kRecThread (warp 1's first) of lane 0 records: it
// opens an entry when the call starts (if recording is on: one load of a device word
// otherwise), notes each signal and satisfied wait of lane 0 raw just after the barrier that
// ends it (rec_mark, recorder.h: readers fold them into runs), and closes it at the end;
// times are %globaltimer ns. Thread 0, which stores the flags and spins on them, runs no
// recorder code, so a mark overlaps the other threads' data movement instead of delaying the
// barrier they wait at (one H200, 2 ranks as streams, 4 KiB: marks by thread 0 cost two_shot
// and ring 0.38-0.46 us a call and tree 0.68; by warp 1, at most 0.02 us; 2026-12-02,
// 614f616; docs/design.md).
// Every kernel that records runs at least 64 threads a block. Calls of one rank are
// stream-ordered, so the counter needs no atomics.
// A kernel that marks phases keeps its entry in shared memory while it runs (a phase is a few
// stores, and an entry that fills folds there) and warp 1 of lane 0 stores it into the ring
// at the end, a 16-byte piece a thread (rec_open_lane .. rec_close_lane): stored by one
// thread, each piece's load waited for the store before it, about 0.3 us a call of 6 phases
// on an H200 (2026-12-02, 1b1e9cc). Kernels that mark none (LL, the fused norms,
// hierarchical) and the copy-engine path, whose call spans several kernels, write the ring's
// entry in place (rec_open_lane with s = null; rec_begin with local = null, rec_current,
// rec_end).
// The state block (always on, whether or not the recorder is): the thread that opens a call
// marks it entered, and marks it returned when lane 0 is done; a wait that has
// spun for kWaitPublishNs says what it waits for, and clears that when it ends (so a rank
// whose lane 0 returned while another lane waits is still in the call: laggard.h, in_call). Plain
// volatile stores into the rank's own window: peers read them only when a wait times out.
constexpr uint64_t kWaitPublishNs = 1000000;
constexpr int kRecThread = 32;  // lane 0's recording thread, and its warp stores the entry
// The calls this rank has entered (state_calls), then the call marked entered (state_enter):
// a kernel loads the count with the recorder's switch, before either is used, so that the
// two loads' round trips overlap.
__device__ inline uint64_t state_calls(const LaneParams& p) {
  const volatile RecState* st = p.state;
  return st != nullptr ? st->seq : 0;
}
__device__ inline void state_enter(const LaneParams& p, uint64_t calls) {
  volatile RecState* st = p.state;
  if (st == nullptr) return;
  st->op = int8_t(p.op);
  st->algorithm = int8_t(p.algorithm);
  st->dtype = int8_t(p.dtype);
  st->failed = 0;
  st->bytes = p.bytes;
  st->seq = calls + 1;
}
__device__ inline void state_wait(const LaneParams& p, int peer, int step, uint64_t round,
                                  uint32_t place, int kind) {
  volatile RecState* st = p.state;
  if (st == nullptr) return;
  st->wait_peer = peer;
  st->wait_step = step;
  st->wait_round = round;
  st->wait_place = uint16_t(place);
  st->wait_kind = uint8_t(kind);
  st->wait_seq = st->seq;
}
// The wait that state_wait published with these fields is over: unless another lane's wait
// has replaced it, the rank no longer waits (as the CPU clears its own). A clear that races
// with another lane's state_wait can hide that lane's wait; Transport::wait publishes again
// every kWaitPublishNs while it spins, so a wait that lasts is shown again within that time.
__device__ inline void state_unwait(const LaneParams& p, int peer, int step, uint64_t round,
                                    uint32_t place, int kind) {
  volatile RecState* st = p.state;
  if (st == nullptr) return;
  if (st->wait_peer == peer && st->wait_step == step && st->wait_round == round &&
      st->wait_place == uint16_t(place) && st->wait_kind == uint8_t(kind))
    st->wait_seq = 0;
}

// The switch: recording on, and the calls recorded so far (both 0 without a recorder), in
// one load (one memory round trip).
struct RecSwitch {
  uint64_t on = 0, calls = 0;
};
__device__ inline RecSwitch rec_switch(const LaneParams& p) {
  RecSwitch w;
  if (p.rec_ctl != nullptr)
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(w.on), "=l"(w.calls) : "l"(p.rec_ctl));
  return w;
}
// If `w` says so, opens the call's entry: `local`, or the ring's in place (local = null).
// rec_begin also marks the call entered (the state block).
__device__ inline RecEntry* rec_open_entry(const LaneParams& p, uint64_t round0, RecEntry* local,
                                           RecSwitch w) {
  if (w.on == 0) return nullptr;
  const uint64_t seq = w.calls + 1;
  p.rec_ctl[1] = seq;
  RecEntry* e = local ? local : p.rec_ring + rec_slot(seq, p.rec_entries);
  if (!local) e->seq = 0;
  rec_open(*e, globaltimer_ns(), p.bytes, round0, p.rec_comm, p.group, p.rank, p.op, p.algorithm,
           p.dtype, 0);
  e->seq = seq;
  return e;
}
__device__ inline RecEntry* rec_begin(const LaneParams& p, uint64_t round0, RecEntry* local) {
  const RecSwitch w = rec_switch(p);
  state_enter(p, state_calls(p));
  return rec_open_entry(p, round0, local, w);
}
// The ring's entry of the call in progress, for the later kernels of a call made of several
// (the copy-engine path); null if none is open.
__device__ inline RecEntry* rec_current(const LaneParams& p) {
  if (p.rec_ctl == nullptr || p.rec_ctl[1] == 0) return nullptr;
  RecEntry* e = p.rec_ring + rec_slot(p.rec_ctl[1], p.rec_entries);
  return e->seq == p.rec_ctl[1] && e->status == kRecRunning ? e : nullptr;
}
// Closes entry e (of rec_begin or rec_current; null: not recording).
__device__ inline void rec_end_entry(RecEntry* e, uint64_t rounds) {
  if (e == nullptr) return;
  e->rounds = uint32_t(rounds);
  e->status = kRecDone;
  e->t_end = globaltimer_ns();
}
// Closes entry e and marks the call returned, for the copy-engine path, whose last kernel
// reads the call number from the state block (rec_close_lane keeps it).
__device__ inline void rec_end(const LaneParams& p, RecEntry* e, uint64_t rounds) {
  if (p.state != nullptr) {
    volatile RecState* st = p.state;
    st->done = st->seq;
  }
  rec_end_entry(e, rounds);
}
// The call number that lane 0's kRecThread marked entered, kept for its close in shared
// memory: read back from the state block, a load after the lane's last barrier would hold the
// kernel's end by one memory round trip.
__shared__ uint64_t s_state_seq;

// A kernel's call as lane 0 records it: into shared memory `s`, for a kernel that marks phases,
// or (s null) into the ring's entry in place, for one that marks none (its open and close
// stores are all it writes, and then no copy is left for the end). Every thread of lane 0's
// warp 1 reads the switch (one warp-wide load: their copies agree), so that the warp knows
// without a barrier whether it stores the entry at the end; thread kRecThread opens it.
struct LaneRecord {
  RecEntry* e = nullptr;  // kRecThread's open entry (null elsewhere, or when not recording)
  bool store = false;     // this thread stores a share of the entry at the end
  bool closes = false;    // this thread marks the call returned (kRecThread of lane 0)
};
// What the recording warp loads to open a call: the switch and the state block's call count,
// both by the whole warp, before it diverges (issued one after the other, the two round trips
// ran in sequence: one H200, recorder off, 4 KiB, 0.15-0.21 us more than without a recorder;
// 2026-12-02, 2116b75).
// A kernel that first waits at a barrier for another load (LL's round counter) issues these
// before it, so that the round trips overlap (one H200, 2 ranks as streams, LL at 4 KiB:
// 0.05-0.06 us a call with no recorder or with it on; 2026-12-02, 357acde).
struct LaneLoads {
  RecSwitch w;
  uint64_t calls = 0;
};
__device__ inline LaneLoads rec_lane_loads(const LaneParams& p, int lane) {
  LaneLoads l;
  if (lane != 0 || threadIdx.x / 32 != kRecThread / 32) return l;
  l.w = rec_switch(p);
  l.calls = state_calls(p);
  return l;
}
__device__ inline LaneRecord rec_open_lane(const LaneParams& p, int lane, uint64_t round0, RecEntry* s,
                                           const LaneLoads& l) {
  LaneRecord r;
  if (lane != 0 || threadIdx.x / 32 != kRecThread / 32) return r;
  r.store = l.w.on != 0 && s != nullptr;
  if (threadIdx.x == kRecThread) {
    r.closes = true;
    state_enter(p, l.calls);
    s_state_seq = l.calls + 1;
    r.e = rec_open_entry(p, round0, s, l.w);
  }
  return r;
}
__device__ inline LaneRecord rec_open_lane(const LaneParams& p, int lane, uint64_t round0, RecEntry* s) {
  return rec_open_lane(p, lane, round0, s, rec_lane_loads(p, lane));
}
// Closes the call: kRecThread closes the entry (`nevents`: its rec_mark count, if it marked
// phases) and marks the call returned; when recording into shared memory, its warp then stores
// the header and the events the entry holds into the ring, all pieces' loads before their
// stores.
__device__ inline void rec_close_lane(const LaneParams& p, const LaneRecord& r, const RecEntry* s,
                                      uint64_t rounds, int nevents = 0) {
  if (r.e != nullptr) rec_marked(*r.e, nevents);
  if (r.closes) {
    if (p.state != nullptr) static_cast<volatile RecState*>(p.state)->done = s_state_seq;
    rec_end_entry(r.e, rounds);
  }
  if (!r.store) return;
  __syncwarp();
  static_assert(offsetof(RecEntry, events) % 16 == 0 && sizeof(RecEntry) % 16 == 0, "16-byte copies");
  constexpr int kPieces = int(sizeof(RecEntry)) / 16;
  static_assert(kPieces <= 64, "two pieces a thread");
  const int n = int(offsetof(RecEntry, events) + s->nevents * sizeof(RecEvent) + 15) / 16;
  const uint4* src = reinterpret_cast<const uint4*>(s);
  uint4* dst = reinterpret_cast<uint4*>(p.rec_ring + rec_slot(s->seq, p.rec_entries));
  const int i = int(threadIdx.x) % 32, j = i + 32;
  const uint4 a = src[i];  // the header's 4 pieces and the first events: n > i for i < 4
  uint4 b;
  if (j < n) b = src[j];
  if (i < n) dst[i] = a;
  if (j < n) dst[j] = b;
}

// One call's rounds in lane `lane`: body(round) runs them from the lane's persistent round
// counter, of which every thread keeps a copy (all threads follow the same control flow, so
// the copies agree) and thread 0 writes it back; lane 0 records the call (rec_open_lane ..
// rec_close_lane) and, through `tp` (GpuTransport::record_into), its kRecThread its signals
// and waits.
template <class Tp, class Body>
__device__ __forceinline__ void run_recorded_lane(const LaneParams& p, int lane, Tp& tp, Body&& body) {
  uint64_t round = p.rounds[lane];
  const uint64_t round0 = round + 1;
  __shared__ __align__(16) RecEntry s_rec;  // lane 0's recorder entry while the call runs
  const LaneRecord rec = rec_open_lane(p, lane, round0, &s_rec);
  tp.record_into(rec.e);
  body(round);
  if (threadIdx.x == 0) p.rounds[lane] = round;
  rec_close_lane(p, rec, &s_rec, round + 1 - round0, tp.recorded());
}

// Writes this rank's hang report's diagnostic and marks the report valid. `late`: the awaited
// signal was there when read again after the wait timed out (laggard.h's late_peer).
__device__ inline void record_timeout(const LaneParams& p, int lane, int peer, int step,
                                      uint64_t round, uint64_t expected, uint64_t seen, bool late) {
  volatile Diagnostic* d = &p.diag->diag;
  d->op = p.op;
  d->algorithm = p.algorithm;
  d->rank = p.rank;
  d->peer = peer;
  d->step = step;
  d->lane = lane;
  d->group = p.group;
  d->round = round;
  d->expected = expected;
  d->seen = seen;
  static_cast<volatile HangReport*>(p.diag)->late = late ? 1 : 0;
  __threadfence_system();
  d->valid = 1;
  __threadfence_system();
}

// Whether this thread writes the rank's hang report: only the first of its waits to time out
// does. Waits of many lanes (every thread of an LL kernel) often time out together, and a
// report written by several would mix their fields. The claim is a word of device memory after
// the round counters (kReportClaimIndex); it is never cleared, since a communicator whose wait
// timed out takes no further calls (its kernel traps).
__device__ inline bool claim_report(const LaneParams& p) {
  auto* word = reinterpret_cast<unsigned long long*>(p.rounds + kReportClaimIndex);
  return atomicCAS(word, 0ull, 1ull) == 0ull;
}

// Ends the launch after a wait timed out. A trap ends every thread of the launch at once, and
// the waits of many threads (every thread of an LL kernel, thread 0 of every lane) often time
// out together: the first traps to come while the thread that claimed the report (claim_report)
// still copies the state blocks would leave no report. So each waits until this rank's report
// is marked valid, for at most kReportWaitNs (the claimant may itself be stuck on a bad
// window), then traps.
constexpr uint64_t kReportWaitNs = 1000000000ull;
__device__ inline void trap_after_report(const LaneParams& p) {
  if (p.diag != nullptr) {
    const volatile int32_t* valid = &p.diag->diag.valid;
    const uint64_t start = globaltimer_ns();
    while (*valid == 0 && globaltimer_ns() - start < kReportWaitNs) {
    }
  }
  __trap();
}

// A wait of a group within one node timed out: this rank's state says so, then the first such
// wait (claim_report) reads every rank's state block through its window into the report (the
// host names the rank that is behind from them), reads the awaited signal again
// (`arrived()`: whether it is there now) and writes its own diagnostic; then the launch ends
// (trap_after_report). `place` and `kind` as state_wait's.
template <class Peers, class Arrived>
__device__ inline void fail_wait(const Peers& peers, const LaneParams& p, int lane, int peer,
                                 int step, uint64_t round, uint64_t expected, uint64_t seen,
                                 uint32_t place, int kind, Arrived&& arrived) {
  state_wait(p, peer, step, round, place, kind);
  if (p.state != nullptr) static_cast<volatile RecState*>(p.state)->failed = 1;
  if (p.diag != nullptr && claim_report(p)) {
    if (p.state != nullptr) {
      constexpr int kWords = sizeof(RecState) / sizeof(uint64_t);
      for (int q = 0; q < p.nranks; ++q) {
        const volatile uint64_t* src =
            reinterpret_cast<const volatile uint64_t*>(peers.base(q) + p.state_offset);
        volatile uint64_t* dst = reinterpret_cast<volatile uint64_t*>(&p.diag->states[q]);
        for (int w = 0; w < kWords; ++w) dst[w] = src[w];
      }
      p.diag->nstates = p.nranks;
    }
    record_timeout(p, lane, peer, step, round, expected, seen, arrived());
  }
  trap_after_report(p);
}

// dsts[*][i] = srcs[0][i] op srcs[1][i] op ... in source order, for i < n, by `nthreads`
// threads of which this is `tid`, 16 bytes at a time: vector v is always handled by thread
// v % nthreads. Accumulates in the wide type (float for 16-bit floats) and rounds once per
// result, as lax's own reduction does; a thread reads every source of its vectors before it
// stores their results, so a destination may be a source. Each thread has U vectors of a
// source in flight at once: a lane (GpuTransport) uses U = 1 (more measured slower at 128
// lanes, docs/overlap.md), the copy-engine path's reduction, a local pass that should take
// as few SM-microseconds as it can beside compute, U = 4.
template <class T, class Op, int U = 1, class Src, class D>
__device__ __forceinline__ void reduce_vectors(const D& dsts, const Src& srcs, size_t n, size_t tid,
                                               size_t nthreads) {
  using Wd = Widen<T>;
  using W = typename Wd::type;
  constexpr size_t V = 16 / sizeof(T);
  union Vec { uint4 u; T e[V]; };
  const size_t nv = n / V;
  const int k = srcs.count(), nd = dsts.count();
  size_t i = tid;
  for (; i + (U - 1) * nthreads < nv; i += U * nthreads) {
    Vec x[U];
    W acc[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) x[u].u = reinterpret_cast<const uint4*>(srcs.get(0))[i + u * nthreads];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (size_t j = 0; j < V; ++j) acc[u][j] = Wd::up(x[u].e[j]);
    for (int q = 1; q < k; ++q) {
#pragma unroll
      for (int u = 0; u < U; ++u) x[u].u = reinterpret_cast<const uint4*>(srcs.get(q))[i + u * nthreads];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (size_t j = 0; j < V; ++j) acc[u][j] = Op::apply(acc[u][j], Wd::up(x[u].e[j]));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (size_t j = 0; j < V; ++j) x[u].e[j] = Wd::down(acc[u][j]);
      for (int q = 0; q < nd; ++q) reinterpret_cast<uint4*>(dsts.get(q))[i + u * nthreads] = x[u].u;
    }
  }
  for (; i < nv; i += nthreads) {  // this thread's vectors after its last group of U
    Vec x;
    W acc[V];
    x.u = reinterpret_cast<const uint4*>(srcs.get(0))[i];
#pragma unroll
    for (size_t j = 0; j < V; ++j) acc[j] = Wd::up(x.e[j]);
    for (int q = 1; q < k; ++q) {
      x.u = reinterpret_cast<const uint4*>(srcs.get(q))[i];
#pragma unroll
      for (size_t j = 0; j < V; ++j) acc[j] = Op::apply(acc[j], Wd::up(x.e[j]));
    }
#pragma unroll
    for (size_t j = 0; j < V; ++j) x.e[j] = Wd::down(acc[j]);
    for (int q = 0; q < nd; ++q) reinterpret_cast<uint4*>(dsts.get(q))[i] = x.u;
  }
  for (size_t e = nv * V + tid; e < n; e += nthreads) {
    W acc = Wd::up(srcs.get(0)[e]);
    for (int q = 1; q < k; ++q) acc = Op::apply(acc, Wd::up(srcs.get(q)[e]));
    const T r = Wd::down(acc);
    for (int q = 0; q < nd; ++q) dsts.get(q)[e] = r;
  }
}

template <class Peers>
class GpuTransport {
 public:
  __device__ GpuTransport(const Peers& peers, const LaneParams& p, int lane, size_t slot_bytes)
      : peers_(peers), p_(p), lane_(lane), slot_bytes_(slot_bytes) {}

  __device__ int rank() const { return p_.rank; }
  __device__ int nranks() const { return p_.nranks; }

  template <class T>
  __device__ T* slot(int peer, int k) const {
    return reinterpret_cast<T*>(peers_.base(peer) + p_.data_offset + size_t(lane_) * p_.lane_bytes +
                                size_t(k) * slot_bytes_);
  }

  __device__ size_t chunk_bytes() const { return p_.chunk_bytes; }
  // Lane 0's kRecThread notes its signals and satisfied waits into `e` (rec_mark; null: none).
  __device__ void record_into(RecEntry* e) { rec_ = e, rec_n_ = 0; }
  __device__ int recorded() const { return rec_n_; }  // rec_mark's count (rec_marked)
  __device__ void sync() const { __syncthreads(); }

  // Copy by the whole CTA in 16-byte vectors (all segment boundaries are 16-byte aligned).
  template <class T>
  __device__ void copy(T* dst, const T* src, size_t n) const {
    Dests<T, 1> d;
    d.add(dst);
    copy_to(d, src, n);
  }

  // One read of src, one store to every destination. Thread i always handles the same
  // vectors of a range, in copy, copy_to, reduce and reduce_to alike, so a thread may read
  // back what it stored a moment before without a barrier.
  template <class T, class D>
  __device__ void copy_to(const D& dsts, const T* src, size_t n) const {
    constexpr size_t V = 16 / sizeof(T);
    const size_t nv = n / V;
    const int nd = dsts.count();
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (size_t i = threadIdx.x; i < nv; i += blockDim.x) {
      const uint4 v = s[i];
      for (int q = 0; q < nd; ++q) reinterpret_cast<uint4*>(dsts.get(q))[i] = v;
    }
    for (size_t i = nv * V + threadIdx.x; i < n; i += blockDim.x) {
      const T v = src[i];
      for (int q = 0; q < nd; ++q) dsts.get(q)[i] = v;
    }
  }

  // dst = srcs[0] op srcs[1] op ... in source order, 16 bytes at a time.
  template <class T, class Op, class Src>
  __device__ void reduce(T* dst, const Src& srcs, size_t n) const {
    Dests<T, 1> d;
    d.add(dst);
    reduce_to<T, Op>(d, srcs, n);
  }

  // reduce, storing the result to every destination in the same pass (NCCL's fused
  // "receive, reduce, copy, send"): reduce_vectors by the lane's threads.
  template <class T, class Op, class Src, class D>
  __device__ void reduce_to(const D& dsts, const Src& srcs, size_t n) const {
    reduce_vectors<T, Op>(dsts, srcs, n, threadIdx.x, blockDim.x);
  }

  // Every peer is reached by load/store: a put is a copy into its slot.
  template <class T>
  __device__ void put(int peer, int k, size_t off, const T* src, size_t n) const {
    copy(slot<T>(peer, k) + off, src, n);
  }
  __device__ bool needs_credit(int) const { return true; }

  // All threads' earlier stores (local and remote) happen before the flag: the CTA barrier
  // orders them before thread 0's store, and a release store at system scope is cumulative
  // (the pattern NCCL's LSA barrier uses), so no separate __threadfence_system is needed.
  // `step`: for the flight recorder (include/jax_gin/recorder.h).
  __device__ void signal(int peer, int kind, uint64_t value, int step = -1) const {
    __syncthreads();
    if (threadIdx.x == 0 && p_.rank != p_.fault_rank) {
      uint64_t* f = reinterpret_cast<uint64_t*>(peers_.base(peer) + p_.flags_offset) +
                    flag_index(lane_, p_.rank, kind, p_.nranks);
      st_release_sys(f, value);
    }
    if (rec_) rec_n_ = rec_mark(*rec_, rec_n_, kind == kCredit ? kRecCredit : kRecSend, step, peer, value, globaltimer_ns());
  }

  // Thread 0 spins on our own flag; on timeout it records who waited for whom and traps, so
  // the launch fails instead of hanging.
  __device__ bool wait(int peer, int kind, uint64_t value, int step) const {
    if (threadIdx.x == 0) {
      const uint64_t* f = reinterpret_cast<const uint64_t*>(peers_.base(p_.rank) + p_.flags_offset) +
                          flag_index(lane_, peer, kind, p_.nranks);
      uint64_t seen = ld_acquire_sys(f);
      if (seen < value) {
        const uint64_t start = globaltimer_ns();
        uint32_t spins = 0;
        uint64_t publish = kWaitPublishNs;  // when this wait is next put in the state block
        while ((seen = ld_acquire_sys(f)) < value) {
          if ((++spins & 1023u) == 0) {
            const uint64_t waited = globaltimer_ns() - start;
            if (waited > publish) {
              state_wait(p_, peer, step, round_of_wait(value, step), place_of_wait(value, step), kind);
              publish = waited + kWaitPublishNs;
            }
            if (waited > p_.timeout_ns)
              fail_wait(peers_, p_, lane_, peer, step, round_of_wait(value, step), value, seen,
                        place_of_wait(value, step), kind, [&] { return ld_acquire_sys(f) >= value; });
          }
        }
        if (publish != kWaitPublishNs)
          state_unwait(p_, peer, step, round_of_wait(value, step), place_of_wait(value, step), kind);
      }
    }
    __syncthreads();
    if (rec_) rec_n_ = rec_mark(*rec_, rec_n_, kind == kCredit ? kRecCreditWait : kRecWait, step, peer, value, globaltimer_ns());
    return true;
  }

 private:
  Peers peers_;
  LaneParams p_;
  int lane_;
  size_t slot_bytes_;
  RecEntry* rec_ = nullptr;  // lane 0's kRecThread while recording
  mutable int rec_n_ = 0;    // phases marked (rec_mark), kept here so that a mark loads nothing
};

// ---- groups that span nodes: LSA within a node, a GIN "rail" between nodes --------------
// hierarchical_round (algorithms.h) reaches the ranks of its node by load/store and its rail
// peers (same local rank, other nodes) only by put + signal + wait. Between nodes those go
// through NCCL's GIN (GPU-initiated networking), which differs from LSA in three ways:
//   * a put is a one-sided RDMA write from a registered window to a peer's window at an
//     offset; it cannot read the caller's buffer, so the data is first staged into this
//     rank's outbox (a per-lane area of its own window that mirrors the lane's ring slots);
//   * the receiver learns of the data through a signal: a 64-bit counter that puts and
//     signal operations can only add to (ncclGin_SignalAdd), separate from our flags. A
//     sender keeps, per (lane, destination node, kind), the last tag it sent (in its window,
//     so it survives launches) and adds tag - last: the receiver's signal then equals the
//     last tag, and waiting for "signal >= tag" is the same monotonic-flag wait as on LSA;
//   * the data flag rides on the put itself (a put with SignalAdd makes the signal visible
//     only after its payload), so a put is held back until its signal(peer, kData) comes.
// Outbox reuse: outbox slot s is rewritten in step s of a later round only after the next
// rank's credit for this round, which it sends after it saw (so GIN delivered) every put of
// this round; GIN has therefore consumed the outbox. Each launch also flushes GIN before
// the kernel exits. Signal ids and last-sent tags: rail_index(lane, node, kind), with the
// sender's node at the receiver and the receiver's node at the sender.
// Ranks are node-major: rank r is local rank r % L of node r / L (the runtime checks that
// NCCL's lsaRank is r % L), so the LSA index of a peer of the node is peer % L.
__host__ __device__ inline size_t rail_index(int lane, int node, int kind, int nodes) {
  return (size_t(lane) * size_t(nodes) + size_t(node)) * kNumFlagKinds + size_t(kind);
}
__host__ __device__ inline size_t rail_words(int nodes) {
  return size_t(kMaxLanes) * size_t(nodes) * kNumFlagKinds;
}
// Rail area of a window: last-sent tags, then the emulated signals (EmulatedGinRail only).
__host__ __device__ inline size_t rail_area_bytes(int nodes) { return 2 * rail_words(nodes) * 8; }

// Peers of the node through an NCCL window whose LSA team is the node (node-major ranks).
struct NcclNodePeers {
  ncclWindow_t win;
  int lsa_size;
  __device__ char* base(int peer) const {
    return static_cast<char*>(ncclGetLsaPointer(win, 0, peer % lsa_size));
  }
};

__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Rail policies. Every member is called by all threads of the CTA; `delta` matters only in
// thread 0, which issues the operation. Offsets are bytes inside the (symmetric) window.
//   put(peer, dst, src, bytes, sig, id, delta): bytes from my window at src to peer's at dst,
//       then (if sig) add delta to signal `id` of peer, visible only after the payload
//   signal(peer, id, delta)   add delta to signal `id` of peer, after my earlier puts to it
//   read(id)                  my signal `id` (acquire); thread 0 only
//   flush()                   my puts have consumed their sources
//
// GinRail: NCCL's GIN on the world team (group rank = NCCL rank), context 0 (signals live per
// context, so sender and receiver must use the same one). COMPILED, NEVER RUN: no machine
// here has two nodes with an RDMA network.
struct GinRail {
  ncclDevComm comm;
  ncclWindow_t win;
  __device__ void put(int peer, size_t dst, size_t src, size_t bytes, bool sig, uint32_t id,
                      uint64_t delta) const {
    __syncthreads();  // the staged data of every thread ...
    if (threadIdx.x == 0) {
      __threadfence_system();  // ... is visible to the NIC before it reads it
      ncclGin gin(comm, 0);
      if (sig)
        gin.put(ncclTeamWorld(comm), peer, win, dst, win, src, bytes, ncclGin_SignalAdd{id, delta});
      else
        gin.put(ncclTeamWorld(comm), peer, win, dst, win, src, bytes);
    }
  }
  __device__ void signal(int peer, uint32_t id, uint64_t delta) const {
    __syncthreads();  // every thread is done with the window (a credit releases it)
    if (threadIdx.x == 0) {
      __threadfence_system();
      ncclGin gin(comm, 0);
      gin.signal(ncclTeamWorld(comm), peer, ncclGin_SignalAdd{id, delta});
    }
  }
  __device__ uint64_t read(uint32_t id) const {
    ncclGin gin(comm, 0);
    return gin.readSignal(id);
  }
  __device__ void flush() const {
    ncclGin gin(comm, 0);
    gin.flush(ncclCoopCta());
  }
};

// EmulatedGinRail: the same operations with GIN's semantics (the put copies out of my
// outbox, never out of the caller's buffer; signals are add-only counters apart from the
// flags, in the rail area of the receiver's window), carried out by the CTA over P2P
// pointers. Lets the native harness run the whole hierarchical kernel, with the GIN-shaped
// staging, signal ids and last-sent deltas, on one GPU.
struct EmulatedGinRail {
  char* const* bases;     // every rank's window, by group rank
  int rank;
  size_t signals_offset;  // byte offset of the emulated signals inside each window
  __device__ void put(int peer, size_t dst, size_t src, size_t bytes, bool sig, uint32_t id,
                      uint64_t delta) const {
    __syncthreads();  // the staged data is complete
    const char* s = bases[rank] + src;
    char* d = bases[peer] + dst;
    const size_t nv = bytes / 16;  // dst and src are 16-byte aligned
    for (size_t i = threadIdx.x; i < nv; i += blockDim.x)
      reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
    for (size_t i = nv * 16 + threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
    if (sig) signal(peer, id, delta);
  }
  __device__ void signal(int peer, uint32_t id, uint64_t delta) const {
    __syncthreads();  // release below is cumulative over the CTA's stores, as in signal()
    if (threadIdx.x == 0)
      red_add_release_sys(reinterpret_cast<uint64_t*>(bases[peer] + signals_offset) + id, delta);
  }
  __device__ uint64_t read(uint32_t id) const {
    return ld_acquire_sys(reinterpret_cast<const uint64_t*>(bases[rank] + signals_offset) + id);
  }
  __device__ void flush() const {}
};

// The transport of hierarchical_kernel: peers of this rank's node through GpuTransport
// (LSA), rail peers through `Rail`. An injected fault (fault_rank) drops only that rank's
// rail signals: the inter-node signal is the one a lost NIC message would take away.
template <class Peers, class Rail>
class HierTransport {
 public:
  __device__ HierTransport(const Peers& peers, const Rail& rail, const LaneParams& p, int lane,
                           size_t slot_bytes)
      : local_(peers, without_fault(p), lane, slot_bytes), peers_(peers), rail_(rail), p_(p),
        lane_(lane), slot_bytes_(slot_bytes) {
    L_ = schedule::hier_local_size(p.nranks, p.ranks_per_node);
    M_ = schedule::hier_nodes(p.nranks, L_);
    node_ = schedule::hier_node(p.rank, L_);
    prev_ = schedule::hier_rail_prev(p.rank, L_, M_);
    ring0_ = schedule::hier_segment_slots(L_);
  }

  __device__ int rank() const { return p_.rank; }
  __device__ int nranks() const { return p_.nranks; }
  __device__ bool same_node(int peer) const { return schedule::hier_node(peer, L_) == node_; }
  __device__ void sync() const { __syncthreads(); }
  // Ranks of the node may write to any slot of ours; of the rail, only the ring predecessor.
  __device__ bool needs_credit(int peer) const { return same_node(peer) || peer == prev_; }

  // Only for this rank and the ranks of its node (rail peers' windows are not mapped).
  template <class T>
  __device__ T* slot(int peer, int k) const { return local_.template slot<T>(peer, k); }
  template <class T>
  __device__ void copy(T* dst, const T* src, size_t n) const { local_.copy(dst, src, n); }
  template <class T, class Op, class Src>
  __device__ void reduce(T* dst, const Src& srcs, size_t n) const {
    local_.template reduce<T, Op>(dst, srcs, n);
  }

  // Rail: stage into the outbox (its position mirrors the destination's position in the
  // lane's ring slots, k >= ring0) and hold the put until its data signal.
  template <class T>
  __device__ void put(int peer, int k, size_t off, const T* src, size_t n) {
    if (same_node(peer)) {
      local_.copy(local_.template slot<T>(peer, k) + off, src, n);
      return;
    }
    if (pending_) issue(false, 0, 0);  // not expected: hierarchical_round signals every put
    const size_t pos = size_t(k) * slot_bytes_ + off * sizeof(T);  // in the lane's data area
    const size_t box = p_.outbox_offset + size_t(lane_) * p_.outbox_lane_bytes +
                       (pos - size_t(ring0_) * slot_bytes_);
    local_.copy(reinterpret_cast<T*>(peers_.base(p_.rank) + box), src, n);
    pending_ = true;
    put_peer_ = peer;
    put_dst_ = p_.data_offset + size_t(lane_) * p_.lane_bytes + pos;
    put_src_ = box;
    put_bytes_ = n * sizeof(T);
  }

  __device__ void signal(int peer, int kind, uint64_t value, int step = -1) {
    if (same_node(peer)) {
      local_.signal(peer, kind, value, step);
      return;
    }
    const bool drop = p_.rank == p_.fault_rank;
    const uint32_t id = uint32_t(rail_index(lane_, node_, kind, M_));  // at the receiver
    uint64_t* last = reinterpret_cast<uint64_t*>(peers_.base(p_.rank) + p_.rail_offset) +
                     rail_index(lane_, schedule::hier_node(peer, L_), kind, M_);
    const uint64_t delta = threadIdx.x == 0 ? value - *last : 0;
    if (pending_ && put_peer_ == peer && kind == kData) {
      issue(!drop, id, delta);
    } else {
      if (pending_) issue(false, 0, 0);
      if (!drop) rail_.signal(peer, id, delta);
    }
    if (threadIdx.x == 0 && !drop) *last = value;
  }

  __device__ bool wait(int peer, int kind, uint64_t value, int step) const {
    if (same_node(peer)) return local_.wait(peer, kind, value, step);
    if (threadIdx.x == 0) {
      const uint32_t id = uint32_t(rail_index(lane_, schedule::hier_node(peer, L_), kind, M_));
      uint64_t seen = rail_.read(id);
      if (seen < value) {
        const uint64_t start = globaltimer_ns();
        uint32_t spins = 0;
        while ((seen = rail_.read(id)) < value) {
          if ((++spins & 1023u) == 0 && globaltimer_ns() - start > p_.timeout_ns) {
            if (p_.diag != nullptr && claim_report(p_))
              record_timeout(p_, lane_, peer, step, round_of_wait(value, step), value, seen,
                             /*late=*/false);  // no states, so no diagnosis for it to correct
            trap_after_report(p_);
          }
        }
      }
    }
    __syncthreads();
    return true;
  }

  // End of the launch: every put issued and its source consumed.
  __device__ void finish() {
    if (pending_) issue(false, 0, 0);
    if (M_ > 1) rail_.flush();
  }

 private:
  __device__ static LaneParams without_fault(LaneParams p) {
    p.fault_rank = -1;
    return p;
  }
  __device__ void issue(bool sig, uint32_t id, uint64_t delta) {
    rail_.put(put_peer_, put_dst_, put_src_, put_bytes_, sig, id, delta);
    pending_ = false;
  }

  GpuTransport<Peers> local_;
  Peers peers_;
  Rail rail_;
  LaneParams p_;
  int lane_;
  size_t slot_bytes_;
  int L_ = 1, M_ = 1, node_ = 0, prev_ = 0, ring0_ = 0;
  bool pending_ = false;
  int put_peer_ = -1;
  size_t put_dst_ = 0, put_src_ = 0, put_bytes_ = 0;
};

}  // namespace gpu
}  // namespace jax_gin
