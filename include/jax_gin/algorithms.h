// jax_gin's all-reduce algorithms, each written once over a small transport interface.
// The CPU backend (csrc/cpu_backend.cc) runs them with one host thread per rank; the CUDA
// kernels (cuda/kernels.cu) run them with one CTA per lane over NCCL's LSA windows.
//
// A transport `Tp` is one rank's view of one lane (an independent slice of the message):
//   int rank(), nranks()
//   T* slot<T>(peer, k)              slot k of `peer`'s window for this lane (LSA pointer)
//   void copy<T>(dst, src, n)        by all workers of the lane; dst may be a peer's slot (a put)
//   void put<T>(peer, k, off, src, n)  n elements from src into slot k of `peer`'s window, at
//                                    element `off`; its data flag follows as signal(peer, kData)
//                                    (load/store transports: copy(slot<T>(peer, k) + off, ...);
//                                    the GPU's GIN rail stages src in its window and puts it)
//   void reduce<T, Op>(dst, srcs, n) dst[i] = srcs[0][i] op srcs[1][i] op ... in source order
//   void signal(peer, kind, value)   release: everything this lane wrote before is visible to
//                                    `peer` once it sees the flag
//   bool wait(peer, kind, value, step)  acquire; false once the timeout fired (the transport
//                                    has recorded op, rank, peer, step for the host)
//   bool needs_credit(peer)          whether `peer` may write into this rank's window, so that
//                                    it awaits this rank's credits (load/store: every peer)
// Flags are monotonic (see common.h): rounds are never reset, so no flag is ever cleared.
#pragma once

#include "jax_gin/common.h"
#include "jax_gin/schedule.h"

namespace jax_gin {

// Sources of a reduction: slot q of my own window for every rank q, except my own
// contribution, which is read where it already is (my input or my output).
template <class T>
struct SlotSources {
  const T* slot0;      // slot `first_slot` of my window
  size_t slot_stride;  // elements between consecutive slots
  int self;
  const T* self_ptr;
  int n;
  JG_HD int count() const { return n; }
  JG_HD const T* get(int q) const { return q == self ? self_ptr : slot0 + size_t(q) * slot_stride; }
};

template <class T, int kMax>
struct ListSources {
  const T* p[kMax];
  int n = 0;
  JG_HD void add(const T* x) { p[n++] = x; }
  JG_HD int count() const { return n; }
  JG_HD const T* get(int q) const { return p[q]; }
};

// Before writing into `peer`'s window in round `round`, make sure it has read what we wrote
// there in the previous round.
template <class Tp>
JG_HD bool await_credit(Tp& tp, int peer, uint64_t round) {
  return round <= 1 || tp.wait(peer, kCredit, round - 1, -1);
}

// Every rank credits every peer that may write to it at the end of each round, whatever the
// algorithm: a later call may use another algorithm in which other peers write to us. With
// load/store transports that is every peer; a group that spans nodes runs only hierarchical,
// so its GPU transport credits only the ranks of its node and its rail predecessor.
template <class Tp>
JG_HD void give_credit(Tp& tp, uint64_t round) {
  for (int p = 0; p < tp.nranks(); ++p)
    if (p != tp.rank() && tp.needs_credit(p)) tp.signal(p, kCredit, round);
}

// ---------------------------------------------------------------------------------------
// one_shot. Purpose: smallest latency: one synchronization step. Every rank pushes its whole
// round to every peer and reduces all N contributions locally in rank order.
// Moves (N-1)*S per rank: best for small S or N = 2.
template <class T, class Op, class Tp>
JG_HD bool one_shot_round(Tp& tp, const T* in, T* out, size_t n, size_t slot, uint64_t round) {
  const int r = tp.rank(), N = tp.nranks();
  // step 0: push my data into slot r of every peer
  for (int k = 1; k < N; ++k) {
    int p = schedule::mod(r + k, N);  // stagger so that peers are not all hit at once
    if (!await_credit(tp, p, round)) return false;
    tp.copy(tp.template slot<T>(p, r), in, n);
    tp.signal(p, kData, data_tag(round, schedule::kOneShotStep));
  }
  for (int p = 0; p < N; ++p)
    if (p != r && !tp.wait(p, kData, data_tag(round, schedule::kOneShotStep), schedule::kOneShotStep))
      return false;
  // reduce the N contributions in rank order
  SlotSources<T> src{tp.template slot<T>(r, 0), slot, r, in, N};
  tp.template reduce<T, Op>(out, src, n);
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// two_shot. Purpose: bandwidth at small N. Reduce-scatter (rank j reduces segment j from all
// peers' pushes) then all-gather (the owner pushes its reduced segment to everyone).
// Moves 2(N-1)/N * S per rank in two synchronization steps.
template <class T, class Op, class Tp>
JG_HD bool two_shot_round(Tp& tp, const T* in, T* out, size_t n, size_t slot, uint64_t round) {
  const int r = tp.rank(), N = tp.nranks();
  const size_t al = schedule::align_elems(sizeof(T));
  const uint64_t scatter = data_tag(round, schedule::kTwoShotScatterStep);
  const uint64_t gather = data_tag(round, schedule::kTwoShotGatherStep);
  // step 0: push segment p of my input into slot r of rank p
  for (int k = 1; k < N; ++k) {
    int p = schedule::mod(r + k, N);
    schedule::Range seg = schedule::piece(n, N, p, al);
    if (!await_credit(tp, p, round)) return false;
    tp.copy(tp.template slot<T>(p, r), in + seg.offset, seg.count);
    tp.signal(p, kData, scatter);
  }
  for (int p = 0; p < N; ++p)
    if (p != r && !tp.wait(p, kData, scatter, schedule::kTwoShotScatterStep)) return false;
  // reduce my segment from slots 0..N-1 in rank order, straight into my output
  schedule::Range mine = schedule::piece(n, N, r, al);
  SlotSources<T> src{tp.template slot<T>(r, 0), slot, r, in + mine.offset, N};
  tp.template reduce<T, Op>(out + mine.offset, src, mine.count);
  // step 1: push my reduced segment into slot N + r of every peer
  for (int k = 1; k < N; ++k) {
    int p = schedule::mod(r + k, N);
    tp.copy(tp.template slot<T>(p, N + r), out + mine.offset, mine.count);
    tp.signal(p, kData, gather);
  }
  for (int k = 1; k < N; ++k) {
    int p = schedule::mod(r + k, N);
    if (!tp.wait(p, kData, gather, schedule::kTwoShotGatherStep)) return false;
    schedule::Range seg = schedule::piece(n, N, p, al);
    tp.copy(out + seg.offset, tp.template slot<T>(r, N + p), seg.count);
  }
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// ring. Purpose: bandwidth at any N with nearest-neighbour traffic only. Reduce-scatter then
// all-gather around the ring, 2(N-1) steps; the output buffer doubles as the partial-sum
// buffer, so no extra scratch is needed.
template <class T, class Op, class Tp>
JG_HD bool ring_round(Tp& tp, const T* in, T* out, size_t n, size_t slot, uint64_t round) {
  (void)slot;
  const int r = tp.rank(), N = tp.nranks();
  const int next = schedule::ring_next(r, N), prev = schedule::ring_prev(r, N);
  const size_t al = schedule::align_elems(sizeof(T));
  if (!await_credit(tp, next, round)) return false;
  // reduce-scatter
  for (int s = 0; s < N - 1; ++s) {
    schedule::Range snd = schedule::piece(n, N, schedule::ring_rs_send(r, s, N), al);
    schedule::Range rcv = schedule::piece(n, N, schedule::ring_rs_recv(r, s, N), al);
    const T* src = (s == 0 ? in : out) + snd.offset;  // step 0 sends raw input
    tp.copy(tp.template slot<T>(next, s), src, snd.count);
    tp.signal(next, kData, data_tag(round, s));
    if (!tp.wait(prev, kData, data_tag(round, s), s)) return false;
    ListSources<T, 2> srcs;
    srcs.add(tp.template slot<T>(r, s));  // partial sum from upstream
    srcs.add(in + rcv.offset);            // my contribution
    tp.template reduce<T, Op>(out + rcv.offset, srcs, rcv.count);
  }
  // all-gather: circulate the owned, fully reduced segments
  for (int s = 0; s < N - 1; ++s) {
    const int step = N - 1 + s;
    schedule::Range snd = schedule::piece(n, N, schedule::ring_ag_send(r, s, N), al);
    schedule::Range rcv = schedule::piece(n, N, schedule::ring_ag_recv(r, s, N), al);
    tp.copy(tp.template slot<T>(next, step), out + snd.offset, snd.count);
    tp.signal(next, kData, data_tag(round, step));
    if (!tp.wait(prev, kData, data_tag(round, step), step)) return false;
    tp.copy(out + rcv.offset, tp.template slot<T>(r, step), rcv.count);
  }
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// tree. Purpose: latency that grows with log2(N) rather than N. Reduce up a binary tree,
// broadcast down it; the root alone computes the final value.
template <class T, class Op, class Tp>
JG_HD bool tree_round(Tp& tp, const T* in, T* out, size_t n, size_t slot, uint64_t round) {
  (void)slot;
  const int r = tp.rank(), N = tp.nranks();
  const int parent = schedule::tree_parent(r);
  const uint64_t up = data_tag(round, schedule::kTreeUpStep);
  const uint64_t down = data_tag(round, schedule::kTreeDownStep);
  // step 0: reduce [own, child 0, child 1] into my output
  ListSources<T, 3> srcs;
  srcs.add(in);
  for (int k = 0; k < 2; ++k) {
    int c = schedule::tree_child(r, k, N);
    if (c < 0) continue;
    if (!tp.wait(c, kData, up, schedule::kTreeUpStep)) return false;
    srcs.add(tp.template slot<T>(r, k));
  }
  tp.template reduce<T, Op>(out, srcs, n);
  if (parent >= 0) {
    // push the partial sum up, then wait for the final value to come down
    if (!await_credit(tp, parent, round)) return false;
    tp.copy(tp.template slot<T>(parent, schedule::tree_child_index(r)), out, n);
    tp.signal(parent, kData, up);
    if (!tp.wait(parent, kData, down, schedule::kTreeDownStep)) return false;
    tp.copy(out, tp.template slot<T>(r, schedule::kTreeDownSlot), n);
  }
  // step 1: broadcast down
  for (int k = 0; k < 2; ++k) {
    int c = schedule::tree_child(r, k, N);
    if (c < 0) continue;
    if (!await_credit(tp, c, round)) return false;
    tp.copy(tp.template slot<T>(c, schedule::kTreeDownSlot), out, n);
    tp.signal(c, kData, down);
  }
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// hierarchical (internal; schedule in schedule.h). Purpose: groups that span nodes, where
// only ranks of one node reach each other by load/store and the inter-node links are the
// scarce resource: each rank sends only 2(M-1)/(L*M) of the data across nodes, to one peer.
// Intra-node reduce-scatter (two_shot's first half over the L local ranks), a ring over the
// M ranks of the rail on the owned segment, then intra-node all-gather. Ranks of a node are
// reached by load/store (slot, copy); rail peers only through put + signal + wait, which the
// GPU implements with GIN between nodes (cuda/transport.cuh) and load/store transports as a
// copy into the peer's slot. `ranks_per_node` = L (0: one node); it must divide N.
template <class T, class Op, class Tp>
JG_HD bool hierarchical_round(Tp& tp, const T* in, T* out, size_t n, size_t slot, uint64_t round,
                              int ranks_per_node) {
  const int r = tp.rank(), N = tp.nranks();
  const int L = schedule::hier_local_size(N, ranks_per_node), M = schedule::hier_nodes(N, L);
  const int node = schedule::hier_node(r, L), l = schedule::hier_local(r, L);
  const size_t al = schedule::align_elems(sizeof(T));
  const schedule::Range mine = schedule::hier_segment(n, L, l, al);
  // 1. intra-node reduce-scatter: segment q of my input into scatter slot l of local rank q,
  //    then reduce my segment from scatter slots 0..L-1 in local-rank order
  if (L > 1) {
    const uint64_t tag = data_tag(round, schedule::kHierScatterStep);
    for (int k = 1; k < L; ++k) {
      const int q = schedule::mod(l + k, L), p = schedule::hier_rank(node, q, L);
      const schedule::Range seg = schedule::hier_segment(n, L, q, al);
      if (!await_credit(tp, p, round)) return false;
      tp.copy(tp.template slot<T>(p, schedule::hier_scatter_slot(l)), in + seg.offset, seg.count);
      tp.signal(p, kData, tag);
    }
    for (int q = 0; q < L; ++q)
      if (q != l && !tp.wait(schedule::hier_rank(node, q, L), kData, tag, schedule::kHierScatterStep))
        return false;
    SlotSources<T> src{tp.template slot<T>(r, schedule::hier_scatter_slot(0)), slot, l,
                       in + mine.offset, L};
    tp.template reduce<T, Op>(out + mine.offset, src, mine.count);
  }
  // 2. ring over the rail on my segment: its input is the node's partial (in my output; my
  //    raw input when L = 1), reduced in place. Sub-piece offsets are relative to `mine`.
  if (M > 1) {
    const T* rin = (L > 1 ? out : in) + mine.offset;
    T* rout = out + mine.offset;
    const int next = schedule::hier_rail_next(r, L, M), prev = schedule::hier_rail_prev(r, L, M);
    const int ring0 = schedule::hier_segment_slots(L);
    const size_t rslot = schedule::hier_ring_slot_elems(slot, M, al);
    const T* mine_ring = tp.template slot<T>(r, ring0);
    if (!await_credit(tp, next, round)) return false;
    for (int s = 0; s < M - 1; ++s) {  // reduce-scatter
      const int step = schedule::hier_ring_step(s);
      const schedule::Range snd = schedule::piece(mine.count, M, schedule::ring_rs_send(node, s, M), al);
      const schedule::Range rcv = schedule::piece(mine.count, M, schedule::ring_rs_recv(node, s, M), al);
      tp.template put<T>(next, ring0, size_t(s) * rslot, (s == 0 ? rin : rout) + snd.offset, snd.count);
      tp.signal(next, kData, data_tag(round, step));
      if (!tp.wait(prev, kData, data_tag(round, step), step)) return false;
      ListSources<T, 2> srcs;
      srcs.add(mine_ring + size_t(s) * rslot);  // partial from upstream
      srcs.add(rin + rcv.offset);               // this node's partial
      tp.template reduce<T, Op>(rout + rcv.offset, srcs, rcv.count);
    }
    for (int s = 0; s < M - 1; ++s) {  // all-gather
      const int k = M - 1 + s, step = schedule::hier_ring_step(k);
      const schedule::Range snd = schedule::piece(mine.count, M, schedule::ring_ag_send(node, s, M), al);
      const schedule::Range rcv = schedule::piece(mine.count, M, schedule::ring_ag_recv(node, s, M), al);
      tp.template put<T>(next, ring0, size_t(k) * rslot, rout + snd.offset, snd.count);
      tp.signal(next, kData, data_tag(round, step));
      if (!tp.wait(prev, kData, data_tag(round, step), step)) return false;
      tp.copy(rout + rcv.offset, mine_ring + size_t(k) * rslot, rcv.count);
    }
  }
  // 3. intra-node all-gather: my final segment into gather slot L + l of every local peer
  //    (their credits were awaited in step 1 of this round)
  if (L > 1) {
    const int step = schedule::hier_gather_step(M);
    const uint64_t tag = data_tag(round, step);
    for (int k = 1; k < L; ++k) {
      const int p = schedule::hier_rank(node, schedule::mod(l + k, L), L);
      tp.copy(tp.template slot<T>(p, schedule::hier_gather_slot(l, L)), out + mine.offset, mine.count);
      tp.signal(p, kData, tag);
    }
    for (int k = 1; k < L; ++k) {
      const int q = schedule::mod(l + k, L);
      if (!tp.wait(schedule::hier_rank(node, q, L), kData, tag, step)) return false;
      const schedule::Range seg = schedule::hier_segment(n, L, q, al);
      tp.copy(out + seg.offset, tp.template slot<T>(r, schedule::hier_gather_slot(q, L)), seg.count);
    }
  }
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// One lane's whole message: rounds of at most `capacity` elements through the lane's window.
// `round` is the lane's persistent round counter; it advances by the number of rounds run.
template <class T, class Op, class Tp>
JG_HD bool run_lane(Tp& tp, Algorithm algo, const T* in, T* out, size_t count, size_t lane_bytes,
                    uint64_t& round) {
  if (tp.nranks() == 1) {
    tp.copy(out, in, count);
    return true;
  }
  const size_t slot = schedule::slot_elems(algo, tp.nranks(), lane_bytes, sizeof(T));
  const size_t cap = schedule::round_capacity(algo, tp.nranks(), lane_bytes, sizeof(T));
  for (size_t off = 0; off < count; off += cap) {
    const size_t n = schedule::min_sz(cap, count - off);
    const uint64_t rd = ++round;
    bool ok = false;
    switch (algo) {
      case Algorithm::kOneShot: ok = one_shot_round<T, Op>(tp, in + off, out + off, n, slot, rd); break;
      case Algorithm::kTwoShot: ok = two_shot_round<T, Op>(tp, in + off, out + off, n, slot, rd); break;
      case Algorithm::kRing: ok = ring_round<T, Op>(tp, in + off, out + off, n, slot, rd); break;
      case Algorithm::kTree: ok = tree_round<T, Op>(tp, in + off, out + off, n, slot, rd); break;
      case Algorithm::kHierarchical: break;  // needs ranks_per_node: run_lane_hierarchical()
    }
    if (!ok) return false;
  }
  return true;
}

// run_lane for the hierarchical schedule, which also needs the node size. Kept apart from
// run_lane: the GPU runs it in its own kernel (hierarchical_kernel in cuda/kernels_impl.cuh),
// over a transport that reaches rail peers through GIN.
template <class T, class Op, class Tp>
JG_HD bool run_lane_hierarchical(Tp& tp, const T* in, T* out, size_t count, size_t lane_bytes,
                                 int ranks_per_node, uint64_t& round) {
  if (tp.nranks() == 1) {
    tp.copy(out, in, count);
    return true;
  }
  const Algorithm algo = Algorithm::kHierarchical;
  const size_t slot = schedule::slot_elems(algo, tp.nranks(), lane_bytes, sizeof(T), ranks_per_node);
  const size_t cap = schedule::round_capacity(algo, tp.nranks(), lane_bytes, sizeof(T), ranks_per_node);
  for (size_t off = 0; off < count; off += cap) {
    const size_t n = schedule::min_sz(cap, count - off);
    if (!hierarchical_round<T, Op>(tp, in + off, out + off, n, slot, ++round, ranks_per_node))
      return false;
  }
  return true;
}

}  // namespace jax_gin
