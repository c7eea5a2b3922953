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
// tree: binary tree rooted at rank 0 (parent (r-1)/2, children 2r+1, 2r+2). Partial sums
// go up: a node reduces [own, child 0, child 1] in that order and puts the result into its
// parent's window slot (its child index). The root's result is broadcast down into each
// child's window slot 2. Only the root computes the final value, so every rank ends with
// the same bits.
JG_HD int tree_parent(int r) { return r == 0 ? -1 : (r - 1) / 2; }
JG_HD int tree_child(int r, int k, int n) {
  int c = 2 * r + 1 + k;
  return c < n ? c : -1;
}
JG_HD int tree_child_index(int r) { return (r - 1) % 2; }  // which slot of the parent
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
// Window layout for one lane: `slots(algo, n)` slots of `slot_elems` elements each.
JG_HD int num_slots(Algorithm a, int n) {
  switch (a) {
    case Algorithm::kRing: return n > 1 ? 2 * (n - 1) : 1;
    case Algorithm::kTree: return 3;
    case Algorithm::kOneShot: return n;
    case Algorithm::kTwoShot: return 2 * n;
  }
  return 1;
}
// Do slots hold one segment (1/N of a round) or a whole round?
JG_HD bool slots_hold_segments(Algorithm a) {
  return a == Algorithm::kRing || a == Algorithm::kTwoShot;
}

// Slot size (elements, a multiple of `align`) that fits the lane's window.
JG_HD size_t slot_elems(Algorithm a, int n, size_t lane_bytes, size_t elem_size) {
  size_t al = align_elems(elem_size);
  size_t per = lane_bytes / elem_size / size_t(num_slots(a, n));
  return per / al * al;
}

// Largest number of elements one round of `a` can carry through a lane's window.
JG_HD size_t round_capacity(Algorithm a, int n, size_t lane_bytes, size_t elem_size) {
  size_t s = slot_elems(a, n, lane_bytes, elem_size);
  return slots_hold_segments(a) ? s * size_t(n) : s;
}

JG_HD size_t num_rounds(size_t count, size_t capacity) {
  return count == 0 ? 0 : ceil_div(count, capacity);
}

}  // namespace schedule
}  // namespace jax_gin
