// The message of one all-reduce call, as the algorithms see it: a range of elements
// [0, count) read from the caller's input and written to its output. It is either one buffer
// (Contiguous) or several buffers of one element type reduced together (Segmented: the leaves
// of one dtype of a pytree, one bucket, in a single kernel launch or CPU call).
//
// Both expose the same interface, used by algorithms.h:
//   at(off)            the message from element `off` on (lanes and rounds take sub-ranges)
//   each(off, n, f)    calls f(rel, in, out, k) for every contiguous piece of [off, off + n):
//                      `rel` is the piece's offset from `off`, in/out point at its first
//                      element in the caller's buffers, k is its length. Positions that
//                      belong to no buffer (the padding between segments) are skipped.
//
// A Segmented message lays its buffers out one after the other in a logical element space,
// each starting at a multiple of 16 bytes (kAlignBytes), so that every piece that `each`
// hands out starts 16-byte aligned whenever `off` is, in the caller's buffer as in the
// window: the transports move 16-byte vectors. Every rank lays out the same buffers in the
// same order, so the padding is the same everywhere and is never read.
#pragma once

#include "jax_gin/common.h"

namespace jax_gin {

// One buffer of a Segmented message: elements [start, start + count) of the logical space.
struct Segment {
  size_t start;   // logical element offset, a multiple of 16 bytes' worth of elements
  size_t count;   // elements
  const void* in;
  void* out;
};

// Most buffers one call takes. The GPU passes the segments in the kernel's parameters
// (SegmentTable), whose 4 KiB also hold the other arguments: 64 x 32 bytes leave room.
// Larger pytrees take one call per 64 leaves of a dtype (jax_gin/_primitive.py).
constexpr int kMaxSegments = 64;

struct SegmentTable {
  Segment seg[kMaxSegments];
  int n;
};

template <class T>
struct Contiguous {
  const T* in;
  T* out;
  JG_HD Contiguous at(size_t off) const { return Contiguous{in + off, out + off}; }
  template <class F>
  JG_HD void each(size_t off, size_t n, F&& f) const {
    if (n > 0) f(size_t(0), in + off, out + off, n);
  }
};

template <class T>
struct Segmented {
  const Segment* seg;  // nseg segments, in increasing `start`
  int nseg;
  size_t base;  // logical offset of element 0 of this view

  JG_HD Segmented at(size_t off) const { return Segmented{seg, nseg, base + off}; }

  // The first segment that ends after logical element x (nseg if none): a binary search,
  // since segments are sorted.
  JG_HD int first_ending_after(size_t x) const {
    int a = 0, b = nseg;
    while (a < b) {
      const int m = (a + b) / 2;
      if (seg[m].start + seg[m].count <= x) a = m + 1;
      else b = m;
    }
    return a;
  }

  // The segment that holds logical element `pos` (relative to base), or -1 in padding.
  JG_HD int locate(size_t pos) const {
    const size_t x = base + pos;
    const int a = first_ending_after(x);
    return a < nseg && seg[a].start <= x ? a : -1;
  }

  template <class F>
  JG_HD void each(size_t off, size_t n, F&& f) const {
    const size_t lo = base + off, hi = lo + n;
    for (int s = first_ending_after(lo); s < nseg && seg[s].start < hi; ++s) {
      const size_t p = seg[s].start > lo ? seg[s].start : lo;
      const size_t e = seg[s].start + seg[s].count;
      const size_t q = e < hi ? e : hi;
      if (p >= q) continue;
      const size_t in_seg = p - seg[s].start;
      f(p - lo, static_cast<const T*>(seg[s].in) + in_seg, static_cast<T*>(seg[s].out) + in_seg,
        q - p);
    }
  }
};

// Lays out `n` buffers of `counts[i]` elements of `elem_size` bytes (in, out filled by the
// caller): fills starts, returns the logical element count of the message.
JG_HD size_t lay_out_segments(Segment* seg, int n, size_t elem_size) {
  const size_t al = kAlignBytes / elem_size;
  size_t at = 0;
  for (int i = 0; i < n; ++i) {
    seg[i].start = at;
    at += (seg[i].count + al - 1) / al * al;
  }
  // the message ends where the last buffer ends: no trailing padding to move
  return n > 0 ? seg[n - 1].start + seg[n - 1].count : 0;
}

}  // namespace jax_gin
