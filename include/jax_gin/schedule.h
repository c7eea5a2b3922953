// The schedules of jax_gin's all-reduce algorithms: which chunk goes to which peer at which
// step, and where it lands in the peer's window. Pure integer arithmetic, compiled for the
// host (CPU backend, unit tests) and the device (CUDA kernels), so both backends follow the
// very same steps.
#pragma once

#include "jax_gin/common.h"

namespace jax_gin {
namespace schedule {

struct Range {
  size_t offset;  // in elements
  size_t count;   // in elements
};

JG_HD size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }
JG_HD size_t min_sz(size_t a, size_t b) { return a < b ? a : b; }

// Elements per 16-byte vector.
JG_HD size_t align_elems(size_t elem_size) { return kAlignBytes / elem_size; }

// Splits n elements into `parts` contiguous pieces whose boundaries are multiples of `align`
// elements; the last pieces may be short or empty. Piece j = [j*seg, min(n, (j+1)*seg)).
JG_HD size_t piece_size(size_t n, size_t parts, size_t align) {
  return ceil_div(ceil_div(n, parts), align) * align;
}
JG_HD Range piece(size_t n, size_t parts, size_t j, size_t align) {
  size_t seg = piece_size(n, parts, align);
  size_t lo = min_sz(n, j * seg);
  size_t hi = min_sz(n, lo + seg);
  return Range{lo, hi - lo};
}

JG_HD int mod(int a, int n) { return ((a % n) + n) % n; }

// ---------------------------------------------------------------------------------------
// ring: reduce-scatter then all-gather around r -> r+1. Round data is cut into N segments.
// Reduce-scatter step s (0..N-2): rank r sends segment (r - s) and receives (r - s - 1),
// which it reduces with its own input. After N-1 steps rank r owns segment (r + 1), fully
// reduced. All-gather step s (0..N-2): r sends segment (r + 1 - s) and receives (r - s).
// Step s of the whole round is numbered s for reduce-scatter and N-1+s for all-gather, and
// lands in window slot `step` of the next rank.
JG_HD int ring_next(int r, int n) { return mod(r + 1, n); }
JG_HD int ring_prev(int r, int n) { return mod(r - 1, n); }
JG_HD int ring_rs_send(int r, int s, int n) { return mod(r - s, n); }
JG_HD int ring_rs_recv(int r, int s, int n) { return mod(r - s - 1, n); }
JG_HD int ring_owned(int r, int n) { return mod(r + 1, n); }
JG_HD int ring_ag_send(int r, int s, int n) { return mod(r + 1 - s, n); }
JG_HD int ring_ag_recv(int r, int s, int n) { return mod(r - s, n); }
JG_HD int ring_steps(int n) { return 2 * (n - 1); }

// ---------------------------------------------------------------------------------------
// Pipelining within a lane. A step's piece is cut into `chunks` chunks, each signalled on its
// own (tag step * chunks + c), so the receiver starts reducing and forwarding chunk 0 while
// later chunks are still in flight, as NCCL's simple protocol streams slices through its
// FIFO. Every flag store after remote writes is a system-scope release (on GPU: a wait for
// NVLink acknowledgements), so chunks are kept large: `chunk_bytes` per chunk, at most
// kMaxChunks. Every rank computes the same count from the same largest piece, so the tags
// agree; chunks of a short piece may be empty and are still signalled.
JG_HD int chunks_for(size_t elems, size_t elem_size, size_t chunk_bytes) {
  if (chunk_bytes == 0) return 1;
  size_t c = ceil_div(elems * elem_size, chunk_bytes);
  if (c < 1) c = 1;
  if (c > size_t(kMaxChunks)) c = size_t(kMaxChunks);
  return int(c);
}
// Chunk c of a piece (offsets relative to the piece).
JG_HD Range chunk(const Range& piece_range, int chunks, int c, size_t align) {
  Range r = piece(piece_range.count, size_t(chunks), size_t(c), align);
  return Range{piece_range.offset + r.offset, r.count};
}

// ---------------------------------------------------------------------------------------
// tree: a double binary tree, as NCCL builds for large N. Tree 0 is the binary heap rooted at
// rank 0 (parent (r-1)/2, children 2r+1, 2r+2); tree 1 is its mirror image (rank r sits at
// position N-1-r), rooted at rank N-1. For even N the interior ranks of one tree are the
// leaves of the other, so every rank forwards data in one tree only and both directions of
// every link carry data. The first half of a round goes through tree 0, the second through
// tree 1 (separate flags: kData and kDataB). In a tree, partial sums go up: a node reduces
// [own, child 0, child 1] in that order and puts the result into its parent's window slot
// (its child index); the root's result goes down into each child's window slot 2. Only the
// root of a tree computes the final value of its half, so every rank ends with the same bits.
JG_HD int tree_pos(int r, int n, int t) { return t == 0 ? r : n - 1 - r; }  // its own inverse
JG_HD int tree_parent(int r, int n, int t) {
  const int pos = tree_pos(r, n, t);
  return pos == 0 ? -1 : tree_pos((pos - 1) / 2, n, t);
}
JG_HD int tree_child(int r, int k, int n, int t) {
  const int c = 2 * tree_pos(r, n, t) + 1 + k;
  return c < n ? tree_pos(c, n, t) : -1;
}
JG_HD int tree_child_index(int r, int n, int t) { return (tree_pos(r, n, t) - 1) % 2; }
// Part of a round that tree t reduces: the first or second half (16-byte aligned).
JG_HD Range tree_half(size_t n, int t, size_t align) { return piece(n, 2, size_t(t), align); }
constexpr int kTreeDownSlot = 2;
constexpr int kTreeUpStep = 0;
constexpr int kTreeDownStep = 1;

// ---------------------------------------------------------------------------------------
// one_shot: every rank puts its whole round into slot r of every peer's window, then reduces
// slots 0..N-1 (its own input for slot r) in rank order. Same order everywhere, same bits.
constexpr int kOneShotStep = 0;

// two_shot: segment j of the round belongs to rank j. Reduce-scatter: rank r puts segment p
// of its input into slot r of rank p (step 0); rank p reduces slots 0..N-1 in rank order.
// All-gather: the owner puts its reduced segment into slot N + owner of every peer (step 1).
constexpr int kTwoShotScatterStep = 0;
constexpr int kTwoShotGatherStep = 1;

// ---------------------------------------------------------------------------------------
// hierarchical (internal: not in jax_gin.ALGORITHMS; the CPU backend runs it, and the GPU's
// hierarchical kernel for groups that span nodes). The N ranks form M nodes of L ranks: rank r is local rank l = r % L of node
// m = r / L. `ranks_per_node` = L; 0 (or N) means one node, M = 1. A round is cut into L
// segments (piece(n, L, l)); segment l belongs to local rank l of every node.
//   1. intra-node reduce-scatter (step 0), as two_shot within the node: local rank l puts
//      segment q of its input into scatter slot l of local rank q; q reduces slots 0..L-1
//      in local-rank order into its output. Result: the node's partial of segment q.
//   2. inter-node all-reduce of segment l over the rail (the M ranks with local rank l), as
//      ring over node indices: the segment is cut into M sub-pieces (piece(seg, M, j)),
//      2(M-1) steps numbered 1 .. 2(M-1), ring step s landing in ring slot s of the next
//      node's rank. Each final element is computed once (by its owner) and then copied.
//   3. intra-node all-gather (step 2M-1): local rank l puts its final segment into gather
//      slot L + l of every local peer, which copies it into its output.
// Every element of every rank's output is a copy of the one value its rail owner computed,
// with the same reduction order (local ranks left to right, then nodes in ring order), so
// all ranks hold the same bits.
JG_HD int hier_local_size(int n, int ranks_per_node) {
  return ranks_per_node <= 0 || ranks_per_node > n ? n : ranks_per_node;
}
JG_HD bool hier_valid(int n, int ranks_per_node) {
  return n >= 1 && ranks_per_node >= 0 && ranks_per_node <= n &&
         n % hier_local_size(n, ranks_per_node) == 0;
}
JG_HD int hier_nodes(int n, int local_size) { return n / local_size; }
JG_HD int hier_node(int r, int local_size) { return r / local_size; }
JG_HD int hier_local(int r, int local_size) { return r % local_size; }
JG_HD int hier_rank(int node, int local, int local_size) { return node * local_size + local; }
// Neighbours in the rail ring (same local rank, next / previous node).
JG_HD int hier_rail_next(int r, int local_size, int nodes) {
  return hier_rank(ring_next(hier_node(r, local_size), nodes), hier_local(r, local_size), local_size);
}
JG_HD int hier_rail_prev(int r, int local_size, int nodes) {
  return hier_rank(ring_prev(hier_node(r, local_size), nodes), hier_local(r, local_size), local_size);
}
// Segment of a round of n elements owned by local rank l.
JG_HD Range hier_segment(size_t n, int local_size, int l, size_t align) {
  return piece(n, size_t(local_size), size_t(l), align);
}
// Sub-piece j of segment l (absolute offsets in the round), the unit of the rail ring.
JG_HD Range hier_subpiece(size_t n, int local_size, int nodes, int l, int j, size_t align) {
  Range seg = hier_segment(n, local_size, l, align);
  Range sub = piece(seg.count, size_t(nodes), size_t(j), align);
  return Range{seg.offset + sub.offset, sub.count};
}
// Steps (data tags) of one round. Phases use disjoint (sender, receiver) pairs: steps 0 and
// 2M-1 are intra-node pairs, ring steps are rail pairs.
constexpr int kHierScatterStep = 0;
JG_HD int hier_ring_step(int s) { return 1 + s; }        // s = 0 .. 2(M-1)-1
JG_HD int hier_gather_step(int nodes) { return 2 * nodes - 1; }
JG_HD int hier_steps(int nodes) { return 2 * nodes; }
// Window of one lane: first the segment slots (2L slots of `slot` elements, none if L = 1):
// scatter slot q (from local rank q), gather slot L + q; then 2(M-1) ring slots of
// hier_ring_slot_elems(slot, M) elements, ring step s in ring slot s.
JG_HD int hier_scatter_slot(int q) { return q; }
JG_HD int hier_gather_slot(int q, int local_size) { return local_size + q; }
JG_HD int hier_segment_slots(int local_size) { return local_size > 1 ? 2 * local_size : 0; }
JG_HD int hier_ring_slots(int nodes) { return nodes > 1 ? ring_steps(nodes) : 0; }
// A segment of at most `slot` elements has sub-pieces of at most this many elements.
JG_HD size_t hier_ring_slot_elems(size_t slot, int nodes, size_t align) {
  return piece_size(slot, size_t(nodes), align);
}
// Elements of the window used with segment slots of `slot` elements.
JG_HD size_t hier_window_elems(size_t slot, int local_size, int nodes, size_t align) {
  return size_t(hier_segment_slots(local_size)) * slot +
         size_t(hier_ring_slots(nodes)) * hier_ring_slot_elems(slot, nodes, align);
}
// Largest segment slot (a multiple of `align`) whose whole layout fits `w` elements. A ring
// slot of R elements takes segments of up to M*R elements, so the best slot is M*R for the
// largest R with 2L*M*R + 2(M-1)*R <= w, or the largest slot that fits with R one step up.
JG_HD size_t hier_slot_fit(size_t w, int local_size, int nodes, size_t align) {
  const size_t seg = size_t(hier_segment_slots(local_size)), ring = size_t(hier_ring_slots(nodes));
  if (ring == 0) return seg == 0 ? w / align * align : w / seg / align * align;
  const size_t m = size_t(nodes);
  const size_t r0 = w / (seg * m + ring) / align * align;
  size_t best = r0 * m;
  const size_t r1 = r0 + align;
  if (seg > 0 && ring * r1 <= w) {
    const size_t s1 = (w - ring * r1) / seg / align * align;
    if (s1 > best) best = s1;
  }
  return best;
}

// ---------------------------------------------------------------------------------------
// Window layout for one lane: `slots(algo, n)` slots of `slot_elems` elements each (for
// hierarchical: the slot count of its layout above, whose ring slots are smaller).
// `ranks_per_node` matters only for hierarchical (0: one node).
JG_HD int num_slots(Algorithm a, int n, int ranks_per_node = 0) {
  switch (a) {
    case Algorithm::kRing: return n > 1 ? 2 * (n - 1) : 1;
    case Algorithm::kTree: return 3;
    case Algorithm::kOneShot: return n;
    case Algorithm::kTwoShot: return 2 * n;
    case Algorithm::kHierarchical: {
      const int L = hier_local_size(n, ranks_per_node);
      const int k = hier_segment_slots(L) + hier_ring_slots(hier_nodes(n, L));
      return k > 0 ? k : 1;
    }
  }
  return 1;
}
// Do slots hold one segment (1/N of a round) or a whole round? (hierarchical: 1/L.)
JG_HD bool slots_hold_segments(Algorithm a) {
  return a == Algorithm::kRing || a == Algorithm::kTwoShot;
}

// Slot size (elements, a multiple of `align`) that fits the lane's window.
JG_HD size_t slot_elems(Algorithm a, int n, size_t lane_bytes, size_t elem_size,
                        int ranks_per_node = 0) {
  size_t al = align_elems(elem_size);
  if (a == Algorithm::kHierarchical) {
    const int L = hier_local_size(n, ranks_per_node);
    return hier_slot_fit(lane_bytes / elem_size, L, hier_nodes(n, L), al);
  }
  size_t per = lane_bytes / elem_size / size_t(num_slots(a, n));
  return per / al * al;
}

// Largest number of elements one round of `a` can carry through a lane's window.
JG_HD size_t round_capacity(Algorithm a, int n, size_t lane_bytes, size_t elem_size,
                            int ranks_per_node = 0) {
  size_t s = slot_elems(a, n, lane_bytes, elem_size, ranks_per_node);
  if (a == Algorithm::kHierarchical) return s * size_t(hier_local_size(n, ranks_per_node));
  return slots_hold_segments(a) ? s * size_t(n) : s;
}

JG_HD size_t num_rounds(size_t count, size_t capacity) {
  return count == 0 ? 0 : ceil_div(count, capacity);
}

}  // namespace schedule
}  // namespace jax_gin
