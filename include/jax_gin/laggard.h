// The hang report's diagnosis, shared by the CPU backend and the GPU's reports: from every
// rank's recorder state (recorder.h RecState, as one reader saw it), which rank is behind and
// what the others wait for, as text. Host code only (std::string).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "jax_gin/common.h"
#include "jax_gin/recorder.h"
#include "jax_gin/text.h"

namespace jax_gin {

// One rank's state as read: calls entered and returned, and the wait it was in (its place in
// the round and its flag kind order the waits of one step: chunks, a double tree's halves).
struct Seen {
  uint64_t seq, done, wseq, wround;
  int wpeer, wstep, op, algo;
  bool failed;
  int wplace = 0, wkind = kData;
  // In its last call: not returned, or waiting in it. On GPUs lane 0 marks the call returned
  // while other lanes may still wait; a lane's wait stays published until it ends.
  bool in_call() const { return seq != 0 && (done != seq || waiting()); }
  bool waiting() const { return seq != 0 && wseq == seq && wpeer >= 0; }
};

// Reads a state block's advisory field as it is.
struct PlainLoad {
  template <class T> T operator()(const T& x) const { return x; }
};

// State block `st` as a reader saw it: its calls entered and returned and its wait's call as
// the reader loaded them (the CPU, with acquire), the other fields (advisory) each read with
// `load`: as they are by default; the CPU backend, whose ranks' threads write them while a
// peer reads, passes a relaxed atomic load.
template <class Load = PlainLoad>
inline Seen seen_of(const RecState& st, uint64_t seq, uint64_t done, uint64_t wait_seq,
                    Load load = {}) {
  return Seen{seq, done, wait_seq, load(st.wait_round), load(st.wait_peer), load(st.wait_step),
              load(st.op), load(st.algorithm), load(st.failed) != 0, load(st.wait_place),
              load(st.wait_kind)};
}

namespace laggard_detail {

inline std::string call_name(uint64_t seq, int op, int algo) {
  Text os;
  os << "call #" << seq << " (" << call_op_name(op) << ", " << algorithm_name(Algorithm(algo)) << ")";
  return os.str();
}

inline std::string wait_text(const Seen& s) {
  Text os;
  os << "waiting for rank " << s.wpeer;
  if (s.wstep == kTurnStep) os << " to start the call";
  else if (s.wstep < 0) os << " (credit) before round " << s.wround;
  else os << " at step " << s.wstep << " of round " << s.wround;
  return os.str();
}

// "0, 2-7"
inline std::string rank_list(const std::vector<int>& r) {
  Text os;
  for (size_t i = 0; i < r.size();) {
    size_t j = i;
    while (j + 1 < r.size() && r[j + 1] == r[j] + 1) ++j;
    if (i) os << ", ";
    os << r[i];
    if (j > i) os << (j == i + 1 ? ", " : "-") << r[j];
    i = j + 1;
  }
  return os.str();
}

inline std::string ranks_word(const std::vector<int>& r) {
  return (r.size() == 1 ? "rank " : "ranks ") + rank_list(r);
}

inline std::string steps_text(const std::vector<int>& steps) {
  std::vector<int> u(steps);
  std::sort(u.begin(), u.end());
  u.erase(std::unique(u.begin(), u.end()), u.end());
  Text os;
  if (u.size() == 1) {
    if (u[0] == kTurnStep) os << "before the call starts";
    else if (u[0] < 0) os << "for its credit";
    else os << "at step " << u[0];
  } else {
    os << "at steps ";
    for (size_t i = 0; i < u.size(); ++i) os << (i ? ", " : "") << u[i];
  }
  return os.str();
}

}  // namespace laggard_detail

// "last calls of group 0: rank 0: #1842 psum/one_shot, waiting for rank 3 at step 0 of round
// 5; ..." for the ranks' states `s`.
inline std::string last_calls_text(const std::vector<Seen>& s, int group) {
  using namespace laggard_detail;
  Text os;
  os << "last calls of group " << group << ":";
  for (int r = 0; r < int(s.size()); ++r) {
    const Seen& x = s[size_t(r)];
    os << (r ? ";" : "") << " rank " << r << ": ";
    if (x.seq == 0) { os << "none"; continue; }
    os << "#" << x.seq << " " << call_op_name(x.op) << "/" << algorithm_name(Algorithm(x.algo));
    // A rank that timed out keeps the wait it failed in published: failed before in_call.
    if (x.failed) os << ", failed" << (x.waiting() ? " " + wait_text(x) : std::string());
    else if (x.in_call()) os << (x.waiting() ? ", " + wait_text(x) : std::string(", running"));
    else os << ", done";
  }
  return os.str();
}

// "diagnosis: rank 3 never entered call #1842 (psum, one_shot); ranks 0-2 wait for it at step 0.
// last calls of group 0: ..." for the ranks' states `s`, as rank `self` of `group` reports it
// (where more ranks never entered the call, the diagnosis ends "; ranks 4-5 never entered call
// #1842 either"; where every rank that never entered it is in no call of this communicator,
// it adds that their programs have not come to it yet, held in another communicator's call
// maybe, or that the ranks in it make a call theirs do not).
// `late_peer` >= 0: the signal that `self` waited for, from that rank, was there when `self`
// read its flag again after reading the states. It arrived late, not never: the ranks were
// about a timeout apart, and the states, read as that rank went on, would name it as a rank
// whose signals did not arrive.
// `turn_checked`: the states are a CPU group's, whose ranks check their turn (cpu_backend.cc,
// take_turn) and may fail in a call outside a wait. A GPU rank that failed keeps its wait,
// though another lane's end of a wait with the same fields may clear it (transport.cuh,
// state_unwait), so there a failed rank that shows no wait is not taken for such a failure.
inline std::string laggard_text(const std::vector<Seen>& s, int group, int self, int late_peer = -1,
                                bool turn_checked = true) {
  using namespace laggard_detail;
  const int n = int(s.size());
  const Seen& me = s[size_t(self)];
  const uint64_t k = me.seq;
  if (late_peer >= 0) {
    Text os;
    os << "diagnosis: the signal that rank " << self << " waited for in " << call_name(k, me.op, me.algo)
       << " arrived just after its wait timed out: nothing was lost, but rank " << late_peer
       << ", or a rank that it waited for, was late by about the timeout.\n"
       << last_calls_text(s, group);
    return os.str();
  }
  // The rank that is behind: the lowest call number, then the earliest phase (waiting in an
  // earlier round, step, chunk of a step, or tree of a double tree's step (kData's before
  // kDataB's), before a rank that finished the call). A rank waits in this order.
  using Phase = std::tuple<uint64_t, int, int, int>;
  auto phase = [](const Seen& x) -> Phase {
    if (!x.in_call() && !x.failed) return Phase{~0ull, 0, 0, 0};
    if (!x.waiting()) return Phase{0, 0, 0, 0};
    return Phase{x.wround, x.wstep + 1, x.wplace, x.wkind};
  };
  int behind = 0;
  for (int r = 1; r < n; ++r) {
    const Seen& a = s[size_t(r)];
    const Seen& b = s[size_t(behind)];
    if (a.seq < b.seq || (a.seq == b.seq && phase(a) < phase(b))) behind = r;
  }
  // Who waits in call k for `target` (those of them that keep(x) holds for), and at which step.
  auto waiters_where = [&](int target, auto keep, std::vector<int>& ranks, std::vector<int>& steps) {
    for (int r = 0; r < n; ++r) {
      const Seen& x = s[size_t(r)];
      if (x.seq == k && x.waiting() && x.wpeer == target && keep(x)) {
        ranks.push_back(r);
        steps.push_back(x.wstep);
      }
    }
  };
  auto waiters_for = [&](int target, std::vector<int>& ranks, std::vector<int>& steps) {
    waiters_where(target, [](const Seen&) { return true; }, ranks, steps);
  };
  // The first rank p that is_suspect(p) holds for and that some rank waits for with
  // waits_in_vain(p, x) (filling w and steps with those), or -1.
  auto first_waited = [&](auto is_suspect, auto waits_in_vain, std::vector<int>& w,
                          std::vector<int>& steps) {
    for (int r = 0; r < n; ++r) {
      const Seen& p = s[size_t(r)];
      if (!is_suspect(p)) continue;
      waiters_where(r, [&](const Seen& x) { return waits_in_vain(p, x); }, w, steps);
      if (!w.empty()) return r;
    }
    return -1;
  };
  Text os;
  os << "diagnosis: ";
  // "; ranks 0-2 wait for it at step 0" for waiters `ws` at `at`, where there are any.
  auto say_waiters = [&](const std::vector<int>& ws, const std::vector<int>& at) {
    if (!ws.empty()) os << "; " << ranks_word(ws) << " wait" << (ws.size() == 1 ? "s" : "")
                        << " for it " << steps_text(at);
  };
  // say_waiters of the ranks in call k that wait for `target`, then ", and ranks 3-4 wait in
  // that call at steps 1, 2" of those that wait there for another rank.
  auto say_waits_around = [&](int target) {
    std::vector<int> ws, at, others, other_at;
    waiters_for(target, ws, at);
    for (int r = 0; r < n; ++r) {
      const Seen& x = s[size_t(r)];
      if (x.seq == k && x.waiting() && x.wpeer != target) {
        others.push_back(r);
        other_at.push_back(x.wstep);
      }
    }
    say_waiters(ws, at);
    if (!others.empty()) os << (ws.empty() ? "; " : ", and ") << ranks_word(others) << " wait"
                            << (others.size() == 1 ? "s" : "") << " in that call " << steps_text(other_at);
  };
  const Seen& lb = s[size_t(behind)];
  std::vector<int> w, steps;
  // A rank that failed in call k outside a wait (a CPU rank whose turn check failed:
  // cpu_backend.cc, take_turn) is the cause, whose own error says how; the ranks that had not
  // yet entered the call when the group failed stopped there, and come after it.
  int failed_outside = -1;
  for (int r = 0; turn_checked && r < n && failed_outside < 0; ++r) {
    const Seen& x = s[size_t(r)];
    if (x.seq == k && x.failed && !x.waiting()) failed_outside = r;
  }
  if (failed_outside >= 0) {
    const Seen& p = s[size_t(failed_outside)];
    os << "rank " << failed_outside << " failed in " << call_name(k, p.op, p.algo)
       << ", not in a wait (its own error says how)";
    say_waits_around(failed_outside);
    std::vector<int> absent;
    for (int r = 0; r < n; ++r)
      if (s[size_t(r)].seq < k) absent.push_back(r);
    if (!absent.empty()) os << "; " << ranks_word(absent) << " had not entered it";
  } else if (lb.seq < k) {
    os << "rank " << behind << " never entered " << call_name(k, me.op, me.algo);
    say_waits_around(behind);
    if (lb.seq == 0) os << "; it made no call on this communicator";
    else if (lb.in_call()) os << "; it is still in its " << call_name(lb.seq, lb.op, lb.algo)
                             << (lb.waiting() ? ", " + wait_text(lb) : std::string(", not waiting"));
    else os << "; its last call was " << call_name(lb.seq, lb.op, lb.algo) << (lb.failed ? ", failed" : ", done");
    // It waits, in its call, for a rank that has gone on to a later call, or for ranks that
    // wait in that call for each other up to one that has: that rank finished the call, so
    // what it sent there did not arrive.
    std::vector<int> via;
    for (int q = behind; s[size_t(q)].waiting() && s[size_t(q)].wpeer < n && int(via.size()) < n;) {
      const int p = s[size_t(q)].wpeer;
      if (s[size_t(p)].seq > lb.seq) {
        if (via.empty()) os << "; rank " << p << " has finished that call";
        else os << "; it waits, through " << ranks_word(via) << ", for rank " << p
                << ", which has finished that call";
        os << ": its signals did not arrive";
        break;
      }
      if (s[size_t(p)].seq != lb.seq) break;
      via.push_back(p);
      q = p;
    }
    // the others that never entered it (as when a whole process is behind)
    std::vector<int> absent;
    for (int r = 0; r < n; ++r)
      if (r != behind && s[size_t(r)].seq < k) absent.push_back(r);
    if (!absent.empty())
      os << "; " << ranks_word(absent) << " never entered call #" << k << " either";
    // Every rank that never entered it has made calls here and is in none: their programs
    // may not have come to it yet, or those in it make a call that theirs do not.
    absent.push_back(behind);
    std::vector<int> in_k;
    for (int r = 0; r < n; ++r)
      if (s[size_t(r)].seq == k) in_k.push_back(r);
    const bool idle = std::all_of(absent.begin(), absent.end(), [&](int r) {
      const Seen& x = s[size_t(r)];
      return x.seq > 0 && !x.in_call() && !x.failed;
    });
    const bool one = absent.size() == 1;
    if (idle)
      os << "; " << (one ? "it is in no call of this communicator: its program has"
                         : "none of them is in a call of this communicator: their programs have")
         << " not come to call #" << k << " yet (it may be held in another communicator's "
         << "call), or " << ranks_word(in_k) << " entered a call that "
         << (one ? "its program does" : "theirs do") << " not make (a loop or a cond that "
         << "differs between devices)";
  } else {
    // Every rank entered call k. A rank waited for that has finished the call (it returned,
    // or is in a later call) did not deliver its signals; else follow the waits from this rank
    // to one that is not waiting.
    const int culprit = first_waited(
        [&](const Seen& p) { return p.seq > k || (p.seq == k && !p.in_call() && !p.failed); },
        [](const Seen&, const Seen&) { return true; }, w, steps);
    // Else a rank waited for at a phase of call k that it has passed: it waits at a later
    // round, step, chunk or tree of the call. Each algorithm sends a chunk's signals before it
    // waits at a later phase, and a signal's tag names its round, step and chunk alike on both
    // sides (data_tag), so it sent what the others wait for, and that did not arrive. (A rank
    // at the same phase may still be about to send.)
    const int ahead = culprit >= 0 ? -1 : first_waited(
        [&](const Seen& p) { return p.seq == k && p.waiting(); },
        [&](const Seen& p, const Seen& x) { return x.wstep >= 0 && phase(x) < phase(p); }, w,
        steps);
    if (culprit >= 0) {
      os << "rank " << culprit << " finished " << call_name(k, me.op, me.algo) << ", but "
         << ranks_word(w) << " still wait" << (w.size() == 1 ? "s" : "") << " for it "
         << steps_text(steps) << ": its signals did not arrive";
    } else if (ahead >= 0) {
      const Seen& p = s[size_t(ahead)];
      // Where the waits are at one step, say what sets this rank's wait after theirs.
      bool same_step = true;
      int place = 0;  // the latest chunk a waiter waits at
      for (int q : w) {
        const Seen& x = s[size_t(q)];
        same_step = same_step && x.wround == p.wround && x.wstep == p.wstep;
        place = std::max(place, x.wplace);
      }
      std::string note = !same_step ? "" : p.wplace > place ? "a later chunk"
                                         : p.wkind == kDataB ? "its second tree" : "";
      if (p.failed) note += note.empty() ? "failed" : "; failed";
      os << "rank " << ahead << " is further on in " << call_name(k, me.op, me.algo) << ", "
         << wait_text(p) << (note.empty() ? "" : " (" + note + ")") << ", but " << ranks_word(w)
         << " still wait" << (w.size() == 1 ? "s" : "") << " for it " << steps_text(steps)
         << ": its signals did not arrive";
    } else {
      // A rank that failed (timed out) keeps the wait it failed in: follow it too.
      auto stuck = [&](int q) { const Seen& x = s[size_t(q)]; return x.waiting() && (x.in_call() || x.failed); };
      int r = self, hops = 0;
      while (stuck(r) && hops++ < n) r = s[size_t(r)].wpeer;
      if (hops > n) {
        // No rank is free to move: the waits form a cycle, which no algorithm makes by itself,
        // so a signal along it was sent and did not arrive, from one of the ranks in it.
        std::vector<int> cycle{r};
        for (int q = s[size_t(r)].wpeer; q != r && int(cycle.size()) <= n; q = s[size_t(q)].wpeer)
          cycle.push_back(q);
        os << "the ranks of " << call_name(k, me.op, me.algo) << " wait for each other in a cycle (";
        for (size_t i = 0; i < cycle.size(); ++i) os << cycle[i] << " waits for ";
        os << r << "): one of them sent signals that did not arrive";
      } else if (r == self) {
        os << "rank " << behind << " is behind in " << call_name(k, me.op, me.algo);
      } else {
        // Not waiting: busy or stopped, or (GPU states only: on CPU such a rank is named
        // above) failed with its wait cleared.
        waiters_for(r, w, steps);
        if (s[size_t(r)].failed)
          os << "rank " << r << " failed in " << call_name(k, me.op, me.algo)
             << ", not in a wait (its own error says how)";
        else
          os << "rank " << r << " is in " << call_name(k, me.op, me.algo) << " but not waiting (busy or stopped)";
        say_waiters(w, steps);
      }
    }
  }
  os << ".\n" << last_calls_text(s, group);
  return os.str();
}

}  // namespace jax_gin
