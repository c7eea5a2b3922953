// The flight recorder's formats, shared by every backend: each rank keeps, in memory its
// peers (and the host) can read, a small state block that says which call it is in and what
// it waits for, and a ring of the last N calls with per-phase timestamps. The CPU backend
// (csrc/cpu_backend.cc) writes them into the group's workspace with a monotonic ns clock; the
// CUDA kernels (cuda/transport.cuh) write lane 0's entries into device memory with
// %globaltimer. Both open entries with rec_open below; the CPU folds each phase into runs as
// it comes (rec_note), a kernel stores it raw (rec_mark) and readers fold (rec_settle). Plain
// PODs: no std::atomic, so that the header compiles with nvcc; writers publish with release
// stores of the marked fields, readers load those with acquire and treat the rest as advisory.
#pragma once

#include <cstdint>

#include "jax_gin/common.h"

namespace jax_gin {

// What a phase event records.
enum RecEventKind : uint8_t {
  kRecSend = 1,        // data flag of `step` signalled to `peer`
  kRecWait = 2,        // data flag of `step` from `peer` seen (the wait was satisfied)
  kRecCredit = 3,      // credit given to `peer` at the end of a round (step -1)
  kRecCreditWait = 4,  // credit of `peer` seen before a round (step -1)
};

// One phase, or a run of equal phases (same kind, step and round: the chunks of a step, or
// one step's sends to several peers), coalesced: first and last time, how many, last peer.
// A GPU kernel stores its phases raw (rec_mark): count 0, t_last the flag value, round unset;
// readers fold them into runs with rec_settle.
struct RecEvent {
  uint64_t t_first;  // ns
  uint64_t t_last;   // ns
  int16_t step;      // step of the round (-1: credit)
  int16_t peer;      // the last peer of the run
  uint16_t round;    // round relative to the entry's first round (saturates)
  uint8_t kind;      // RecEventKind
  uint8_t count;     // events in the run (saturates at 255); 0: a raw event
};
static_assert(sizeof(RecEvent) == 24, "RecEvent is a fixed 24 bytes");

constexpr int kRecEvents = 40;  // phase events per entry; later ones only count as dropped

enum RecStatus : uint8_t { kRecRunning = 0, kRecDone = 1, kRecFailed = 2 };

// One call of one rank. The ring holds call `seq` in slot rec_slot(seq, N) (below).
struct RecEntry {
  uint64_t seq;      // call number of this rank on this communicator, from 1 (0: empty slot)
  uint64_t t_start;  // ns, when the call entered
  uint64_t t_end;    // ns, when it returned (0 while it runs)
  uint64_t bytes;    // message bytes
  uint64_t round0;   // the first round the call ran (rounds are numbered from 1)
  uint32_t rounds;   // rounds it ran
  int32_t comm;      // communicator id (per process)
  int16_t group;
  int16_t rank;
  int8_t op;         // CallOp (call_op_name): a RedOp, psum_scatter, all_gather or a fused norm
  int8_t algorithm;  // Algorithm
  int8_t dtype;      // DType
  uint8_t status;    // RecStatus
  uint16_t nevents;  // events[0 .. nevents)
  uint16_t dropped;  // events that did not fit (saturates)
  uint32_t lane;     // lane (0 on the CPU)
  RecEvent events[kRecEvents];
};
static_assert(sizeof(RecEntry) % 8 == 0, "RecEntry keeps 8-byte alignment in a ring");

// Always on, one per rank (a cache line): the call it is in and, while a wait sleeps (CPU) or
// has spun for a millisecond (GPU) and until it ends, what it waits for. On the CPU `seq` and `done` are stored
// with release and loaded with acquire; on the GPU the block lies in the rank's window, and a
// rank whose wait times out reads its peers' through theirs.
struct alignas(64) RecState {
  uint64_t seq;         // calls entered (the current or last call's number)
  uint64_t done;        // calls returned (== seq: between calls)
  uint64_t wait_round;  // round of the current wait (valid while wait_seq == seq != done)
  uint64_t wait_seq;    // call of the current wait
  int32_t wait_peer;
  int32_t wait_step;    // -1: credit; kTurnStep: before the call starts (CPU)
  int8_t op;            // of call `seq`
  int8_t algorithm;
  int8_t dtype;
  uint8_t failed;       // call `seq` returned an error
  uint16_t wait_place;  // place_of_wait (common.h): the chunk of a pipelined step
  uint8_t wait_kind;    // FlagKind: which of a double tree's two trees
  uint8_t pad;
  uint64_t bytes;       // of call `seq`
};
static_assert(sizeof(RecState) == 64, "RecState is one cache line");

// The wait_step of a CPU rank that waits for its group's rank 0 to start the call, before the
// call's first step: the ranks of a group run their calls in the order that rank 0 runs them
// (cpu_backend.cc: run_call).
constexpr int32_t kTurnStep = -2;

// What a GPU rank leaves for the host (in host-mapped memory) when one of its waits times
// out: the wait, then every rank's state block as read through the windows at that moment
// (`nstates` of them, by rank; 0 where they cannot be read: groups that span nodes), and
// whether the awaited signal was there when read again after them (`late`: laggard.h's
// late_peer).
struct HangReport {
  Diagnostic diag;
  int32_t nstates;
  int32_t late;
  RecState states[kMaxRanks];
};

// The most entries a ring may hold. The count is a power of two, so that a call's slot is a
// mask of its number: on a GPU the 64-bit remainder took about 0.1 us of a 2.7 us call
// (2026-12-01, 30b6e7c).
constexpr int kRecMaxEntries = 65536;
// Calls a ring keeps unless told otherwise (jax_gin.runtime.settings.record_entries reads it).
constexpr int kRecDefaultEntries = 64;
JG_HD bool rec_entries_ok(int64_t n) { return n >= 1 && n <= kRecMaxEntries && (n & (n - 1)) == 0; }
// The ring slot of call `seq` (from 1) in a ring of `entries` (rec_entries_ok) entries.
JG_HD uint64_t rec_slot(uint64_t seq, uint64_t entries) { return (seq - 1) & (entries - 1); }

// Fills entry e's header for a call that starts at `t` (ns) and runs rounds from round0;
// every field but `seq`, which the writer clears before and sets after. The CPU backend
// orders these as a seqlock (run_call, recorder_entries); a GPU ring is copied by the host
// until two copies agree (comm_registry.cu, recorder_entries), since a copy may catch an entry
// mid-update.
JG_HD void rec_open(RecEntry& e, uint64_t t, uint64_t bytes, uint64_t round0, int comm,
                           int group, int rank, int op, int algorithm, int dtype, int lane) {
  e.t_start = t;
  e.t_end = 0;
  e.bytes = bytes;
  e.round0 = round0;
  e.rounds = 0;
  e.comm = int32_t(comm);
  e.group = int16_t(group);
  e.rank = int16_t(rank);
  e.op = int8_t(op);
  e.algorithm = int8_t(algorithm);
  e.dtype = int8_t(dtype);
  e.status = kRecRunning;
  e.nevents = 0;
  e.dropped = 0;
  e.lane = uint32_t(lane);
}

// Appends a phase event at `t` to entry e (first round round0), or extends a recent run of the
// same kind, step and round (the chunks of a step, or its sends to several peers). `value` is
// the flag value sent or awaited (common.h): a credit's round, or a data tag.
JG_HD void rec_note(RecEntry& e, uint8_t kind, int step, int peer, uint64_t value,
                           uint64_t round0, uint64_t t) {
  const uint64_t rd = kind == kRecCredit ? value : round_of_wait(value, step);
  const uint64_t rel = rd >= round0 ? rd - round0 : 0;
  const uint16_t round = rel > 0xffff ? 0xffff : uint16_t(rel);
  const int lo = e.nevents > 4 ? e.nevents - 4 : 0;
  for (int i = e.nevents - 1; i >= lo; --i) {
    RecEvent& ev = e.events[i];
    if (ev.kind == kind && ev.step == step && ev.round == round) {
      ev.t_last = t;
      ev.peer = int16_t(peer);
      if (ev.count < 255) ++ev.count;
      return;
    }
  }
  if (e.nevents >= kRecEvents) {
    if (e.dropped < 0xffff) ++e.dropped;
    return;
  }
  RecEvent& ev = e.events[e.nevents++];
  ev.t_first = ev.t_last = t;
  ev.step = int16_t(step);
  ev.peer = int16_t(peer);
  ev.round = round;
  ev.kind = kind;
  ev.count = 1;
}

// Folds entry e's raw events (rec_mark), which follow its runs, into runs: the entry then
// reads as if every phase had gone through rec_note in order.
JG_HD void rec_settle(RecEntry& e) {
  const int n = e.nevents < kRecEvents ? int(e.nevents) : kRecEvents;
  int i = 0;
  while (i < n && e.events[i].count != 0) ++i;
  e.nevents = uint16_t(i);
  for (; i < n; ++i) {
    const RecEvent raw = e.events[i];  // rec_note may write slot i itself
    rec_note(e, raw.kind, raw.step, raw.peer, raw.t_last, e.round0, raw.t_first);
  }
}

// rec_note's cheap half, for a kernel's critical path: stores the entry's n-th phase raw (a
// timer read and a few stores; no loads: the writer keeps n, which starts at 0 for an open
// entry) and returns the next n. When the entry is full it folds what it holds into runs
// and notes the phase as rec_note does, from then on (n > kRecEvents: e.nevents is the count).
// rec_marked(e, n) closes the count.
JG_HD int rec_mark(RecEntry& e, int n, uint8_t kind, int step, int peer, uint64_t value, uint64_t t) {
  if (n < kRecEvents) {
    RecEvent& ev = e.events[n];
    ev.t_first = t;
    ev.t_last = value;
    ev.step = int16_t(step);
    ev.peer = int16_t(peer);
    ev.kind = kind;
    ev.count = 0;
    return n + 1;
  }
  if (n == kRecEvents) {
    e.nevents = uint16_t(kRecEvents);
    rec_settle(e);
  }
  rec_note(e, kind, step, peer, value, e.round0, t);
  return kRecEvents + 1;
}
JG_HD void rec_marked(RecEntry& e, int n) {
  if (n <= kRecEvents) e.nevents = uint16_t(n);
}

}  // namespace jax_gin
