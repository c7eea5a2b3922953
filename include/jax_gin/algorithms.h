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
//   void copy_to<T>(dsts, src, n)    copy to every destination of a Dests list, reading once
//   void reduce_to<T, Op>(dsts, srcs, n)  reduce once, store to every destination: a fused
//                                    "receive, reduce, send on" step, one pass over the data
//   size_t chunk_bytes()             pipelining granularity (schedule::chunks_for)
//   void sync()                      barrier of the lane's workers. copy/reduce split a range
//                                    among workers by position, so a worker may read back only
//                                    what it wrote at the same position of the same range;
//                                    reading output written under another range needs sync()
//                                    (GPU: __syncthreads; CPU: one worker, a no-op)
//   void signal(peer, kind, value, step)  release: everything this lane wrote before is visible
//                                    to `peer` once it sees the flag; `step` (-1: credit) is
//                                    for the flight recorder (recorder.h)
//   bool wait(peer, kind, value, step)  acquire; false once the timeout fired (the transport
//                                    has recorded op, rank, peer, step for the host)
//   bool needs_credit(peer)          whether `peer` may write into this rank's window, so that
//                                    it awaits this rank's credits (load/store: every peer)
// Flags are monotonic (see common.h): rounds are never reset, so no flag is ever cleared.
//
// The caller's input and output are a message `io` (message.h): one buffer or several of one
// dtype. Every step names a range of the message and works on its pieces (io.each), so the
// windows see one logical message either way.
#pragma once

#include "jax_gin/common.h"
#include "jax_gin/message.h"
#include "jax_gin/schedule.h"

namespace jax_gin {

// Sources of a reduction: slot q of my own window for every rank q, except my own
// contribution, which is read where it already is (my input or my output).
template <class T>
struct SlotSources {
  const T* slot0;      // slot 0 of the slots read, in my window
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

// Destinations of a fused copy or reduction (my output and/or peers' slots).
template <class T, int kMax>
struct Dests {
  T* p[kMax];
  int n = 0;
  JG_HD void add(T* x) { p[n++] = x; }
  JG_HD int count() const { return n; }
  JG_HD T* get(int q) const { return p[q]; }
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
    if (p != tp.rank() && tp.needs_credit(p)) tp.signal(p, kCredit, round, -1);
}

// ---------------------------------------------------------------------------------------
// one_shot. Purpose: smallest latency: one synchronization step. Every rank pushes its whole
// round to every peer and reduces all N contributions locally in rank order.
// Moves (N-1)*S per rank: best for small S or N = 2. Pipelined: the round is cut into chunks,
// and chunk c+1 is stored to the peers before chunk c is reduced, so that the local reduction
// overlaps the NVLink transfer; chunk c+1's flag follows the reduction of chunk c (a release
// right after the stores would wait for their acknowledgements and undo the overlap).
template <class T, class Tp, class IO>
JG_HD void one_shot_push(Tp& tp, const IO& io, size_t n, int C, int c) {
  const int r = tp.rank(), N = tp.nranks();
  const schedule::Range ch = schedule::chunk(schedule::Range{0, n}, C, c, schedule::align_elems(sizeof(T)));
  for (int k = 1; k < N; ++k) {
    const int p = schedule::mod(r + k, N);  // stagger so that peers are not all hit at once
    T* dst = tp.template slot<T>(p, r) + ch.offset;
    io.each(ch.offset, ch.count, [&](size_t rel, const T* in, T*, size_t m) { tp.copy(dst + rel, in, m); });
  }
}

template <class Tp>
JG_HD void one_shot_signal(Tp& tp, uint64_t round, int C, int c) {
  const int r = tp.rank(), N = tp.nranks();
  for (int k = 1; k < N; ++k)
    tp.signal(schedule::mod(r + k, N), kData, data_tag(round, schedule::kOneShotStep * C + c),
              schedule::kOneShotStep);
}

template <class T, class Op, class Tp, class IO>
JG_HD bool one_shot_round(Tp& tp, const IO& io, size_t n, size_t slot, uint64_t round) {
  const int r = tp.rank(), N = tp.nranks();
  const size_t al = schedule::align_elems(sizeof(T));
  const int C = schedule::chunks_for(n, sizeof(T), tp.chunk_bytes());
  for (int k = 1; k < N; ++k)
    if (!await_credit(tp, schedule::mod(r + k, N), round)) return false;
  one_shot_push<T>(tp, io, n, C, 0);
  one_shot_signal(tp, round, C, 0);
  for (int c = 0; c < C; ++c) {
    if (c + 1 < C) one_shot_push<T>(tp, io, n, C, c + 1);
    // Chunk c of every peer, then the N contributions in rank order. A peer flags chunk c
    // after reducing its chunk c-1, which needed only our chunk c-1's flag (sent one
    // iteration ago, or before the loop), so no two ranks ever wait for each other.
    for (int p = 0; p < N; ++p)
      if (p != r && !tp.wait(p, kData, data_tag(round, schedule::kOneShotStep * C + c), schedule::kOneShotStep))
        return false;
    const schedule::Range ch = schedule::chunk(schedule::Range{0, n}, C, c, al);
    const T* slots = tp.template slot<T>(r, 0) + ch.offset;
    io.each(ch.offset, ch.count, [&](size_t rel, const T* in, T* out, size_t m) {
      SlotSources<T> src{slots + rel, slot, r, in, N};
      tp.template reduce<T, Op>(out, src, m);
    });
    if (c + 1 < C) one_shot_signal(tp, round, C, c + 1);
  }
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// two_shot. Purpose: bandwidth at small N. Reduce-scatter (rank j reduces segment j from all
// peers' pushes) then all-gather (the owner pushes its reduced segment to everyone).
// Moves 2(N-1)/N * S per rank in two synchronization steps. Pipelined: segments are cut into
// chunks, each signalled on its own, so the owner reduces chunk c while chunk c+1 is still
// arriving, and the reduction writes my output and every peer's gather slot in one pass.
template <class T, class Op, class Tp, class IO>
JG_HD bool two_shot_round(Tp& tp, const IO& io, size_t n, size_t slot, uint64_t round) {
  const int r = tp.rank(), N = tp.nranks();
  const size_t al = schedule::align_elems(sizeof(T));
  const int C = schedule::chunks_for(schedule::piece_size(n, N, al), sizeof(T), tp.chunk_bytes());
  const int S0 = schedule::kTwoShotScatterStep, S1 = schedule::kTwoShotGatherStep;
  // step 0: push segment p of my input into slot r of rank p, chunk by chunk
  for (int k = 1; k < N; ++k)
    if (!await_credit(tp, schedule::mod(r + k, N), round)) return false;
  for (int c = 0; c < C; ++c) {
    for (int k = 1; k < N; ++k) {
      const int p = schedule::mod(r + k, N);
      const schedule::Range seg = schedule::piece(n, N, p, al);
      const schedule::Range ch = schedule::chunk(seg, C, c, al);
      T* dst = tp.template slot<T>(p, r) + (ch.offset - seg.offset);
      io.each(ch.offset, ch.count, [&](size_t rel, const T* in, T*, size_t m) { tp.copy(dst + rel, in, m); });
      tp.signal(p, kData, data_tag(round, S0 * C + c), S0);
    }
  }
  // reduce my segment chunk by chunk from slots 0..N-1 in rank order, straight into my output
  // and into slot N + r of every peer (step 1)
  const schedule::Range mine = schedule::piece(n, N, r, al);
  constexpr int kFused = 8;  // destinations one pass writes; more peers get a copy
  for (int c = 0; c < C; ++c) {
    for (int p = 0; p < N; ++p)
      if (p != r && !tp.wait(p, kData, data_tag(round, S0 * C + c), S0)) return false;
    const schedule::Range ch = schedule::chunk(mine, C, c, al);
    const size_t rel = ch.offset - mine.offset;
    io.each(ch.offset, ch.count, [&](size_t sub, const T* in, T* out, size_t m) {
      SlotSources<T> src{tp.template slot<T>(r, 0) + rel + sub, slot, r, in, N};
      Dests<T, kFused> dst;
      dst.add(out);
      for (int k = 1; k < N && dst.count() < kFused; ++k)
        dst.add(tp.template slot<T>(schedule::mod(r + k, N), N + r) + rel + sub);
      tp.template reduce_to<T, Op>(dst, src, m);
      for (int k = kFused; k < N; ++k)
        tp.copy(tp.template slot<T>(schedule::mod(r + k, N), N + r) + rel + sub, out, m);
    });
    for (int k = 1; k < N; ++k) tp.signal(schedule::mod(r + k, N), kData, data_tag(round, S1 * C + c), S1);
  }
  // receive every peer's reduced segment, chunk by chunk, into my output
  for (int c = 0; c < C; ++c) {
    for (int k = 1; k < N; ++k) {
      const int p = schedule::mod(r + k, N);
      if (!tp.wait(p, kData, data_tag(round, S1 * C + c), S1)) return false;
      const schedule::Range seg = schedule::piece(n, N, p, al);
      const schedule::Range ch = schedule::chunk(seg, C, c, al);
      const T* src = tp.template slot<T>(r, N + p) + (ch.offset - seg.offset);
      io.each(ch.offset, ch.count, [&](size_t rel, const T*, T* out, size_t m) { tp.copy(out, src + rel, m); });
    }
  }
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// ring. Purpose: bandwidth at any N with nearest-neighbour traffic only. Reduce-scatter then
// all-gather around the ring, 2(N-1) steps. Each step is fused as in NCCL's primitives: what
// arrives from the previous rank is reduced with my input (or, in the all-gather, copied to
// my output) and put into the next rank's window in the same pass, and every step is cut
// into chunks signalled one by one, so a chunk travels on while the next one arrives and
// all links stay busy. Step s lands in slot s of the next rank's window.
template <class T, class Op, class Tp, class IO>
JG_HD bool ring_round(Tp& tp, const IO& io, size_t n, size_t slot, uint64_t round) {
  (void)slot;
  const int r = tp.rank(), N = tp.nranks();
  const int next = schedule::ring_next(r, N), prev = schedule::ring_prev(r, N);
  const size_t al = schedule::align_elems(sizeof(T));
  const int C = schedule::chunks_for(schedule::piece_size(n, N, al), sizeof(T), tp.chunk_bytes());
  const int last = 2 * (N - 1) - 1;  // the last step
  auto tag = [&](int step, int c) { return data_tag(round, step * C + c); };
  if (!await_credit(tp, next, round)) return false;
  // step 0: send my raw input segment
  {
    const schedule::Range snd = schedule::piece(n, N, schedule::ring_rs_send(r, 0, N), al);
    for (int c = 0; c < C; ++c) {
      const schedule::Range ch = schedule::chunk(snd, C, c, al);
      T* dst = tp.template slot<T>(next, 0) + (ch.offset - snd.offset);
      io.each(ch.offset, ch.count, [&](size_t rel, const T* in, T*, size_t m) { tp.copy(dst + rel, in, m); });
      tp.signal(next, kData, tag(0, c), 0);
    }
  }
  // steps 1 .. 2N-3: receive step s-1 from prev, then forward it as step s; the last one
  // only receives. Reduce-scatter steps (s <= N-1) reduce [upstream partial, my input]; step
  // N-1 completes my owned segment, which goes to my output as well; all-gather steps copy.
  for (int s = 1; s <= last + 1; ++s) {
    const int rs = s - 1;  // the step whose data arrives
    const schedule::Range rcv =
        schedule::piece(n, N, rs < N - 1 ? schedule::ring_rs_recv(r, rs, N)
                                         : schedule::ring_ag_recv(r, rs - (N - 1), N), al);
    for (int c = 0; c < C; ++c) {
      if (!tp.wait(prev, kData, tag(rs, c), rs)) return false;
      const schedule::Range ch = schedule::chunk(rcv, C, c, al);
      const size_t rel = ch.offset - rcv.offset;
      io.each(ch.offset, ch.count, [&](size_t sub, const T* in, T* out, size_t m) {
        const T* arrived = tp.template slot<T>(r, rs) + rel + sub;
        Dests<T, 2> dst;
        if (s <= last) dst.add(tp.template slot<T>(next, s) + rel + sub);  // forward
        if (s >= N - 1) dst.add(out);                                      // final value
        if (rs < N - 1) {
          ListSources<T, 2> srcs;
          srcs.add(arrived);  // partial sum from upstream
          srcs.add(in);       // my contribution
          tp.template reduce_to<T, Op>(dst, srcs, m);
        } else {
          tp.copy_to(dst, arrived, m);
        }
      });
      if (s <= last) tp.signal(next, kData, tag(s, c), s);
    }
  }
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// tree. Purpose: latency that grows with log2(N) rather than N. A double binary tree
// (schedule.h): the first half of the round goes up and down tree 0, the second half tree 1,
// so both directions of the links carry data and every rank forwards in one tree only (even
// N). Pipelined in chunks: a node reduces [own, child 0, child 1] chunk by chunk straight
// into its parent's window; the root writes each final chunk to its output and its
// children's windows in one pass; the others forward each chunk down as it arrives. All
// ranks first send every chunk up, then pass every chunk down: up never waits for down, so
// no cycle of waits exists.
template <class T, class Op, class Tp, class IO>
JG_HD bool tree_round(Tp& tp, const IO& io, size_t n, size_t slot, uint64_t round) {
  (void)slot;
  const int r = tp.rank(), N = tp.nranks();
  const size_t al = schedule::align_elems(sizeof(T));
  const int C = schedule::chunks_for(schedule::piece_size(n, 2, al), sizeof(T), tp.chunk_bytes());
  const int kind[2] = {kData, kDataB};
  auto up = [&](int c) { return data_tag(round, schedule::kTreeUpStep * C + c); };
  auto down = [&](int c) { return data_tag(round, schedule::kTreeDownStep * C + c); };
  // every peer this round writes to must have read the previous round
  for (int t = 0; t < 2; ++t) {
    const int parent = schedule::tree_parent(r, N, t);
    if (parent >= 0 && !await_credit(tp, parent, round)) return false;
    for (int k = 0; k < 2; ++k) {
      const int ch = schedule::tree_child(r, k, N, t);
      if (ch >= 0 && !await_credit(tp, ch, round)) return false;
    }
  }
  // up (and, at a tree's root, down): chunks of both halves, interleaved
  for (int c = 0; c < C; ++c) {
    for (int t = 0; t < 2; ++t) {
      const schedule::Range half = schedule::tree_half(n, t, al);
      const schedule::Range ch = schedule::chunk(half, C, c, al);
      const int parent = schedule::tree_parent(r, N, t);
      for (int k = 0; k < 2; ++k) {
        const int child = schedule::tree_child(r, k, N, t);
        if (child >= 0 && !tp.wait(child, kind[t], up(c), schedule::kTreeUpStep)) return false;
      }
      io.each(ch.offset, ch.count, [&](size_t rel, const T* in, T* out, size_t m) {
        const size_t at = ch.offset + rel;
        ListSources<T, 3> srcs;  // [own, child 0, child 1]
        srcs.add(in);
        for (int k = 0; k < 2; ++k)
          if (schedule::tree_child(r, k, N, t) >= 0) srcs.add(tp.template slot<T>(r, k) + at);
        Dests<T, 3> dst;
        if (parent >= 0) {
          dst.add(tp.template slot<T>(parent, schedule::tree_child_index(r, N, t)) + at);
        } else {
          dst.add(out);
          for (int k = 0; k < 2; ++k) {
            const int child = schedule::tree_child(r, k, N, t);
            if (child >= 0) dst.add(tp.template slot<T>(child, schedule::kTreeDownSlot) + at);
          }
        }
        tp.template reduce_to<T, Op>(dst, srcs, m);
      });
      if (parent >= 0) {
        tp.signal(parent, kind[t], up(c), schedule::kTreeUpStep);
      } else {
        for (int k = 0; k < 2; ++k) {
          const int child = schedule::tree_child(r, k, N, t);
          if (child >= 0) tp.signal(child, kind[t], down(c), schedule::kTreeDownStep);
        }
      }
    }
  }
  // down: receive each final chunk from my parent, keep it and pass it to my children
  for (int c = 0; c < C; ++c) {
    for (int t = 0; t < 2; ++t) {
      const int parent = schedule::tree_parent(r, N, t);
      if (parent < 0) continue;
      const schedule::Range ch = schedule::chunk(schedule::tree_half(n, t, al), C, c, al);
      if (!tp.wait(parent, kind[t], down(c), schedule::kTreeDownStep)) return false;
      io.each(ch.offset, ch.count, [&](size_t rel, const T*, T* out, size_t m) {
        const size_t at = ch.offset + rel;
        Dests<T, 3> dst;
        dst.add(out);
        for (int k = 0; k < 2; ++k) {
          const int child = schedule::tree_child(r, k, N, t);
          if (child >= 0) dst.add(tp.template slot<T>(child, schedule::kTreeDownSlot) + at);
        }
        tp.copy_to(dst, tp.template slot<T>(r, schedule::kTreeDownSlot) + at, m);
      });
      for (int k = 0; k < 2; ++k) {
        const int child = schedule::tree_child(r, k, N, t);
        if (child >= 0) tp.signal(child, kind[t], down(c), schedule::kTreeDownStep);
      }
    }
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
      tp.signal(p, kData, tag, schedule::kHierScatterStep);
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
    // the ring reads sub-pieces of the segment that step 1 reduced as a whole
    if (L > 1) tp.sync();
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
      tp.signal(next, kData, data_tag(round, step), step);
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
      tp.signal(next, kData, data_tag(round, step), step);
      if (!tp.wait(prev, kData, data_tag(round, step), step)) return false;
      tp.copy(rout + rcv.offset, mine_ring + size_t(k) * rslot, rcv.count);
    }
  }
  // 3. intra-node all-gather: my final segment into gather slot L + l of every local peer
  //    (their credits were awaited in step 1 of this round)
  if (L > 1) {
    if (M > 1) tp.sync();  // the segment, whose sub-pieces the ring wrote, is read whole
    const int step = schedule::hier_gather_step(M);
    const uint64_t tag = data_tag(round, step);
    for (int k = 1; k < L; ++k) {
      const int p = schedule::hier_rank(node, schedule::mod(l + k, L), L);
      tp.copy(tp.template slot<T>(p, schedule::hier_gather_slot(l, L)), out + mine.offset, mine.count);
      tp.signal(p, kData, tag, step);
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
// kAlgo >= 0: the algorithm is fixed at compile time (a GPU kernel per algorithm, which keeps
// only that schedule's code, and so fewer live values), and `algo` must equal it.
template <class T, class Op, int kAlgo = -1, class Tp, class IO>
JG_HD bool run_lane(Tp& tp, Algorithm algo_arg, const IO& io, size_t count, size_t lane_bytes,
                    uint64_t& round) {
  const Algorithm algo = kAlgo >= 0 ? Algorithm(kAlgo) : algo_arg;
  if (tp.nranks() == 1) {
    io.each(0, count, [&](size_t, const T* in, T* out, size_t m) { tp.copy(out, in, m); });
    return true;
  }
  const size_t slot = schedule::slot_elems(algo, tp.nranks(), lane_bytes, sizeof(T));
  const size_t cap = schedule::round_capacity(algo, tp.nranks(), lane_bytes, sizeof(T));
  for (size_t off = 0; off < count; off += cap) {
    const size_t n = schedule::min_sz(cap, count - off);
    const uint64_t rd = ++round;
    bool ok = false;
    switch (algo) {
      case Algorithm::kOneShot: ok = one_shot_round<T, Op>(tp, io.at(off), n, slot, rd); break;
      case Algorithm::kTwoShot: ok = two_shot_round<T, Op>(tp, io.at(off), n, slot, rd); break;
      case Algorithm::kRing: ok = ring_round<T, Op>(tp, io.at(off), n, slot, rd); break;
      case Algorithm::kTree: ok = tree_round<T, Op>(tp, io.at(off), n, slot, rd); break;
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
