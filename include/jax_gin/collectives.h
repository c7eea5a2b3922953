// jax_gin's reduce-scatter (psum_scatter) and all-gather, written once over the transport of
// algorithms.h, for the CPU backend and the CUDA kernels.
//
// Both work on N blocks of m elements, N the group's size: block q of a reduce-scatter's
// input is reduced over the group into rank q's output; block q of an all-gather's output is
// rank q's input. Block q starts at element q * m, and m * sizeof(T) is a multiple of 16 bytes
// (the caller pads a block otherwise: jax_gin/_scatter_gather.py), so that every block starts
// 16-byte aligned and the GPU moves 16-byte vectors. A lane takes elements [lo, hi) of every
// block, and a round at most a window's worth of them: `Blocks` is that view.
//
// Two schedules, with the names of the all-reduce algorithms they resemble:
//   one_shot ("direct"): one step. Reduce-scatter: rank r puts its block p into slot r of
//     rank p's window; p reduces slots 0..N-1 in rank order (its own block read in place).
//     All-gather: r puts its input into slot r of every peer; each copies slot q into its
//     block q. N slots. Both in chunks signalled one by one, so that the receiver works on a
//     chunk while the next ones arrive.
//   ring: N-1 steps around r -> r+1, each rank sending 1/N of the data per step over one
//     link. Reduce-scatter step s: r sends block (r - s - 1) mod N (its raw input at s = 0,
//     else the partial it just reduced) and receives block (r - s - 2) mod N, which it reduces
//     with its own input; after N-1 steps it holds block r. All-gather step s: r sends block
//     (r - s) mod N (its own input at s = 0) and receives block (r - s - 1) mod N, which it
//     keeps and forwards. Step s lands in window slot s of the next rank: N-1 slots.
// Each element of a reduce-scatter is reduced at one rank only, so the result's bits do not
// depend on which rank holds it; one_shot reduces in rank order, ring in ring order from the
// owner's successor (the same for integers and exact sums, as lax's own reduce-scatter).
#pragma once

#include "jax_gin/algorithms.h"
#include "jax_gin/common.h"
#include "jax_gin/schedule.h"

namespace jax_gin {

// Blocks of one lane and round: `in` and `out` point at element `off` of block 0 of the
// caller's input and output; block q of the large side (a reduce-scatter's input, an
// all-gather's output) is `stride` elements further on, q * stride.
template <class T>
struct Blocks {
  const T* in;
  T* out;
  size_t stride;  // m
  JG_HD Blocks at(size_t off) const { return Blocks{in + off, out + off, stride}; }
};

namespace schedule {
JG_HD int coll_rs_send(int r, int s, int n) { return mod(r - s - 1, n); }
JG_HD int coll_rs_recv(int r, int s, int n) { return mod(r - s - 2, n); }
JG_HD int coll_ag_send(int r, int s, int n) { return mod(r - s, n); }
JG_HD int coll_ag_recv(int r, int s, int n) { return mod(r - s - 1, n); }

// The algorithms a reduce-scatter or all-gather runs.
JG_HD bool coll_supported(Algorithm a) { return a == Algorithm::kOneShot || a == Algorithm::kRing; }
// Window slots of one lane: one per sender (one_shot) or per ring step.
JG_HD int coll_slots(Algorithm a, int n) { return a == Algorithm::kRing ? (n > 1 ? n - 1 : 1) : n; }
// Slot size in elements (a multiple of 16 bytes), which is also one round's elements per block.
JG_HD size_t coll_slot_elems(Algorithm a, int n, size_t lane_bytes, size_t elem_size) {
  const size_t al = align_elems(elem_size);
  return lane_bytes / elem_size / size_t(coll_slots(a, n)) / al * al;
}
}  // namespace schedule

// ---------------------------------------------------------------------------------------
// one_shot's step: src(p), n elements for peer p, into slot `rank` of every peer p's window,
// in C chunks, each chunk c signalled to every peer with tag(c) as soon as it is stored, so
// that receivers work on chunk c while later chunks travel. Awaits round's credits first.
template <class T, class Tp, class Tag, class Src>
JG_HD bool direct_push(Tp& tp, size_t n, int C, uint64_t round, const Tag& tag, const Src& src) {
  const int r = tp.rank(), N = tp.nranks();
  const size_t al = schedule::align_elems(sizeof(T));
  for (int k = 1; k < N; ++k)
    if (!await_credit(tp, schedule::mod(r + k, N), round)) return false;
  for (int c = 0; c < C; ++c) {
    const schedule::Range ch = schedule::chunk(schedule::Range{0, n}, C, c, al);
    for (int k = 1; k < N; ++k) {
      const int p = schedule::mod(r + k, N);  // staggered, so that peers are not all hit at once
      tp.copy(tp.template slot<T>(p, r) + ch.offset, src(p) + ch.offset, ch.count);
      tp.signal(p, kData, tag(c), schedule::kOneShotStep);
    }
  }
  return true;
}

// Reduce-scatter of n elements per block (one round). Pipelined as two_shot's first half: the
// blocks are pushed chunk by chunk, each chunk signalled on its own, and the owner reduces
// chunk c as soon as every peer's chunk c is in, while later chunks still arrive.
template <class T, class Op, class Tp>
JG_HD bool rs_one_shot_round(Tp& tp, const Blocks<T>& b, size_t n, size_t slot, uint64_t round) {
  const int r = tp.rank(), N = tp.nranks();
  const size_t al = schedule::align_elems(sizeof(T));
  const int C = schedule::chunks_for(n, sizeof(T), tp.chunk_bytes());
  const schedule::Range all{0, n};
  auto tag = [&](int c) { return data_tag(round, schedule::kOneShotStep * C + c); };
  if (!direct_push<T>(tp, n, C, round, tag, [&](int p) { return b.in + size_t(p) * b.stride; }))
    return false;
  for (int c = 0; c < C; ++c) {
    for (int k = 1; k < N; ++k)
      if (!tp.wait(schedule::mod(r - k, N), kData, tag(c), schedule::kOneShotStep)) return false;
    const schedule::Range ch = schedule::chunk(all, C, c, al);
    SlotSources<T> srcs{tp.template slot<T>(r, 0) + ch.offset, slot, r,
                        b.in + size_t(r) * b.stride + ch.offset, N};
    tp.template reduce<T, Op>(b.out + ch.offset, srcs, ch.count);
  }
  give_credit(tp, round);
  return true;
}

// Pipelined in chunks as the all-reduce ring: a chunk is reduced and forwarded as soon as it
// arrives, straight into the next rank's slot (one pass: "receive, reduce, send on").
template <class T, class Op, class Tp>
JG_HD bool rs_ring_round(Tp& tp, const Blocks<T>& b, size_t n, size_t slot, uint64_t round) {
  (void)slot;
  const int r = tp.rank(), N = tp.nranks();
  const int next = schedule::ring_next(r, N), prev = schedule::ring_prev(r, N);
  const size_t al = schedule::align_elems(sizeof(T));
  const int C = schedule::chunks_for(n, sizeof(T), tp.chunk_bytes());
  const schedule::Range all{0, n};
  auto tag = [&](int step, int c) { return data_tag(round, step * C + c); };
  if (!await_credit(tp, next, round)) return false;
  {  // step 0: my raw block
    const T* src = b.in + size_t(schedule::coll_rs_send(r, 0, N)) * b.stride;
    for (int c = 0; c < C; ++c) {
      const schedule::Range ch = schedule::chunk(all, C, c, al);
      tp.copy(tp.template slot<T>(next, 0) + ch.offset, src + ch.offset, ch.count);
      tp.signal(next, kData, tag(0, c), 0);
    }
  }
  // step s = 1 .. N-1 receives step s-1's partial, adds my own block, and sends the sum on as
  // step s; the last one (my block, complete) goes to my output.
  for (int s = 1; s < N; ++s) {
    const int rs = s - 1;
    const T* mine = b.in + size_t(schedule::coll_rs_recv(r, rs, N)) * b.stride;
    for (int c = 0; c < C; ++c) {
      if (!tp.wait(prev, kData, tag(rs, c), rs)) return false;
      const schedule::Range ch = schedule::chunk(all, C, c, al);
      ListSources<T, 2> srcs;
      srcs.add(tp.template slot<T>(r, rs) + ch.offset);  // partial from upstream
      srcs.add(mine + ch.offset);                        // my contribution
      Dests<T, 1> dst;
      dst.add(s < N - 1 ? tp.template slot<T>(next, s) + ch.offset : b.out + ch.offset);
      tp.template reduce_to<T, Op>(dst, srcs, ch.count);
      if (s < N - 1) tp.signal(next, kData, tag(s, c), s);
    }
  }
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// All-gather of n elements per block (one round).
// Pipelined in chunks as rs_one_shot_round: a peer's chunk c is copied out while later chunks
// arrive. My own block is copied while the first chunks travel.
template <class T, class Tp>
JG_HD bool ag_one_shot_round(Tp& tp, const Blocks<T>& b, size_t n, size_t slot, uint64_t round) {
  (void)slot;
  const int r = tp.rank(), N = tp.nranks();
  const size_t al = schedule::align_elems(sizeof(T));
  const int C = schedule::chunks_for(n, sizeof(T), tp.chunk_bytes());
  const schedule::Range all{0, n};
  auto tag = [&](int c) { return data_tag(round, schedule::kOneShotStep * C + c); };
  if (!direct_push<T>(tp, n, C, round, tag, [&](int) { return b.in; })) return false;
  tp.copy(b.out + size_t(r) * b.stride, b.in, n);
  for (int c = 0; c < C; ++c) {
    const schedule::Range ch = schedule::chunk(all, C, c, al);
    for (int k = 1; k < N; ++k) {
      const int q = schedule::mod(r - k, N);
      if (!tp.wait(q, kData, tag(c), schedule::kOneShotStep)) return false;
      tp.copy(b.out + size_t(q) * b.stride + ch.offset, tp.template slot<T>(r, q) + ch.offset, ch.count);
    }
  }
  give_credit(tp, round);
  return true;
}

template <class T, class Tp>
JG_HD bool ag_ring_round(Tp& tp, const Blocks<T>& b, size_t n, size_t slot, uint64_t round) {
  (void)slot;
  const int r = tp.rank(), N = tp.nranks();
  const int next = schedule::ring_next(r, N), prev = schedule::ring_prev(r, N);
  const size_t al = schedule::align_elems(sizeof(T));
  const int C = schedule::chunks_for(n, sizeof(T), tp.chunk_bytes());
  const schedule::Range all{0, n};
  auto tag = [&](int step, int c) { return data_tag(round, step * C + c); };
  if (!await_credit(tp, next, round)) return false;
  for (int c = 0; c < C; ++c) {  // step 0: my input, to the next rank and my own block
    const schedule::Range ch = schedule::chunk(all, C, c, al);
    Dests<T, 2> dst;
    dst.add(tp.template slot<T>(next, 0) + ch.offset);
    dst.add(b.out + size_t(r) * b.stride + ch.offset);
    tp.copy_to(dst, b.in + ch.offset, ch.count);
    tp.signal(next, kData, tag(0, c), 0);
  }
  // step s = 1 .. N-1 receives step s-1's block, keeps it and (but the last) sends it on
  for (int s = 1; s < N; ++s) {
    const int rs = s - 1;
    T* keep = b.out + size_t(schedule::coll_ag_recv(r, rs, N)) * b.stride;
    for (int c = 0; c < C; ++c) {
      if (!tp.wait(prev, kData, tag(rs, c), rs)) return false;
      const schedule::Range ch = schedule::chunk(all, C, c, al);
      Dests<T, 2> dst;
      dst.add(keep + ch.offset);
      if (s < N - 1) dst.add(tp.template slot<T>(next, s) + ch.offset);
      tp.copy_to(dst, tp.template slot<T>(r, rs) + ch.offset, ch.count);
      if (s < N - 1) tp.signal(next, kData, tag(s, c), s);
    }
  }
  give_credit(tp, round);
  return true;
}

// ---------------------------------------------------------------------------------------
// One lane's part of a reduce-scatter (op kOpReduceScatter, reducing with Op) or all-gather
// (kOpAllGather): `count` elements of every block from `b`, in rounds of at most a slot.
// `round` is the lane's persistent round counter, shared with the all-reduces.
template <class T, class Op, class Tp>
JG_HD bool run_lane_collective(Tp& tp, int call_op, Algorithm algo, const Blocks<T>& b,
                               size_t count, size_t lane_bytes, uint64_t& round) {
  const int N = tp.nranks();
  if (N == 1) {
    tp.copy(b.out, b.in, count);
    return true;
  }
  const size_t slot = schedule::coll_slot_elems(algo, N, lane_bytes, sizeof(T));
  for (size_t off = 0; off < count; off += slot) {
    const size_t n = schedule::min_sz(slot, count - off);
    const uint64_t rd = ++round;
    const Blocks<T> at = b.at(off);
    bool ok = false;
    if (call_op == kOpReduceScatter) {
      ok = algo == Algorithm::kRing ? rs_ring_round<T, Op>(tp, at, n, slot, rd)
                                    : rs_one_shot_round<T, Op>(tp, at, n, slot, rd);
    } else {
      ok = algo == Algorithm::kRing ? ag_ring_round<T>(tp, at, n, slot, rd)
                                    : ag_one_shot_round<T>(tp, at, n, slot, rd);
    }
    if (!ok) return false;
  }
  return true;
}

}  // namespace jax_gin
