// The rows of psum_add_rmsnorm's or psum_add_layernorm's norm on the GPU (norm.h), shared by the
// epilogue kernel (fused_norm.cu) and the one-kernel LL path (kernels_impl.cuh), so both give
// the same bits. A row of d elements is worked on by a group of norm_row_threads<T>(d) threads,
// a number that depends on d alone: thread l of the group takes the row's 16-byte chunks l,
// l + threads, ... A row's sums run in one fixed order (each thread over its chunks in order,
// then a butterfly over each warp and over the group's warps), so every rank, and both kernels,
// compute the same bits.
//
// Why chunks and groups: each thread issues one 16-byte load per chunk rather than a chain of
// 2-byte loads, and a block works on several short rows at once rather than one after another.
// Each pass over a row then costs about one memory latency (docs/performance.md).
#pragma once

#include <cstdint>

#include "device_types.cuh"
#include "jax_gin/norm.h"

namespace jax_gin {
namespace gpu {

constexpr int kNormBlock = 512;  // the most threads on one row, and the LL kernel's block

template <class T> struct NormChunk {
  static constexpr int V = 16 / int(sizeof(T));  // elements in a 16-byte chunk
  T e[V];
};

// The threads that work on a row of d elements of T: the fewest whole warps, a power of two up
// to kNormBlock, that give each thread at most one chunk where they can.
template <class T> __host__ __device__ inline int norm_row_threads(size_t d) {
  const size_t chunks = (d + NormChunk<T>::V - 1) / NormChunk<T>::V;
  int t = 32;
  while (t < kNormBlock && size_t(t) < chunks) t *= 2;
  return t;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The sum of `acc` over the group of `threads` (a power of two, >= 32) that this thread belongs
// to, in the fixed order above; every thread of the group gets it. Called by every thread of
// the block.
__device__ __forceinline__ float norm_group_sum(float acc, int threads) {
  __shared__ float part[kNormBlock / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = threads / 32;
  acc = warp_sum(acc);
  if (lane == 0) part[warp] = acc;
  __syncthreads();
  const float total = warp_sum(lane < warps ? part[warp / warps * warps + lane] : 0.0f);
  __syncthreads();  // `part` may be written again by the next sum
  return total;
}

// Chunk c of a row of d elements: one 16-byte access where `vec` (d a multiple of the chunk and
// every row pointer 16-byte aligned), else element by element; past d, zeros are loaded and
// nothing is stored. (Leaving the bounds check out of a row's full chunks measured no faster.)
template <class T>
__device__ __forceinline__ NormChunk<T> load_chunk(const T* row, size_t c, size_t d, bool vec) {
  constexpr int V = NormChunk<T>::V;
  NormChunk<T> x;
  const T* p = row + c * V;
  if (vec) {
    *reinterpret_cast<uint4*>(x.e) = *reinterpret_cast<const uint4*>(p);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) x.e[j] = c * V + j < d ? p[j] : T{};
  }
  return x;
}
template <class T>
__device__ __forceinline__ void store_chunk(T* row, size_t c, size_t d, bool vec, const NormChunk<T>& x) {
  constexpr int V = NormChunk<T>::V;
  T* p = row + c * V;
  if (vec) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(x.e);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (c * V + j < d) p[j] = x.e[j];
  }
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The per-chunk arithmetic, shared by norm_rows and the LL kernel's rows held in registers
// (kernels_impl.cuh), so that both run each sum in the same order.
enum class NormSum { kPlain, kSquares, kCentred };  // f, f², (f − mean)² with f = float(x)
template <class T>
__device__ __forceinline__ void norm_accumulate(float& acc, const NormChunk<T>& x, size_t c,
                                                size_t d, NormSum what, float mean) {
#pragma unroll
  for (int j = 0; j < NormChunk<T>::V; ++j)
    if (c * NormChunk<T>::V + j < d) {
      const float f = Widen<T>::up(x.e[j]) - (what == NormSum::kCentred ? mean : 0.0f);
      acc += what == NormSum::kPlain ? f : f * f;
    }
}
// normed of new_residual chunk x: LayerNorm with the bias bb, or RMSNorm (bb unused) (norm.h)
template <class T>
__device__ __forceinline__ NormChunk<T> norm_output(const NormChunk<T>& x, const NormChunk<T>& ww,
                                                    bool layer, const NormChunk<T>& bb, float inv,
                                                    float mean) {
  NormChunk<T> o;
#pragma unroll
  for (int j = 0; j < NormChunk<T>::V; ++j)
    o.e[j] = layer ? scale_shift(Widen<T>::up(x.e[j]) - mean, inv, ww.e[j], bb.e[j])
                   : scale(Widen<T>::up(x.e[j]), inv, ww.e[j]);
  return o;
}

// Rows [r0, r1) of the matrices (d columns) `nr` (new_residual) and `out`: RMSNorm times `w`,
// or with a bias `b` LayerNorm, whose mean is one more sum before the sum of squares. With
// `res`, nr holds the rows' sums on entry and each element first becomes res + nr, as norm.h
// rounds it (the epilogue); without, nr already holds new_residual (the LL kernel). Each group
// of norm_row_threads<T>(d) threads takes one row at a time; blockDim.x must be a multiple of
// it. Called by every thread of the block.
template <class T>
__device__ void norm_rows(const T* res, T* nr, const T* w, const T* b, T* out, size_t r0,
                          size_t r1, size_t d, float eps) {
  constexpr int V = NormChunk<T>::V;
  const int threads = norm_row_threads<T>(d);
  const int groups = int(blockDim.x) / threads, g = int(threadIdx.x) / threads;
  const size_t l = threadIdx.x % threads, chunks = (d + V - 1) / V;
  const bool vec = d % V == 0 && aligned16(nr) && aligned16(w) && aligned16(out) &&
                   (b == nullptr || aligned16(b)) && (res == nullptr || aligned16(res));
  const NormSum first_sum = b != nullptr ? NormSum::kPlain : NormSum::kSquares;
  // the loop runs the same number of times on every thread, since every one takes part in the
  // group sums; a group past r1 adds nothing
  for (size_t first = r0; first < r1; first += size_t(groups)) {
    const size_t row = first + size_t(g);
    const bool on = row < r1;
    T* const rn = nr + row * d;
    float acc = 0.0f;  // LayerNorm: the sum; RMSNorm: the sum of squares
    if (on)
      for (size_t c = l; c < chunks; c += threads) {
        NormChunk<T> x = load_chunk(rn, c, d, vec);
        if (res != nullptr) {
          const NormChunk<T> q = load_chunk(res + row * d, c, d, vec);
#pragma unroll
          for (int j = 0; j < V; ++j) x.e[j] = add_residual(q.e[j], x.e[j]);
          store_chunk(rn, c, d, vec, x);
        }
        norm_accumulate(acc, x, c, d, first_sum, 0.0f);
      }
    float mean = 0.0f;
    if (b != nullptr) {
      mean = norm_group_sum(acc, threads) / float(d);
      acc = 0.0f;
      if (on)
        for (size_t c = l; c < chunks; c += threads)
          norm_accumulate(acc, load_chunk(rn, c, d, vec), c, d, NormSum::kCentred, mean);
    }
    const float inv = inv_rms(norm_group_sum(acc, threads), d, eps);
    if (on)
      for (size_t c = l; c < chunks; c += threads) {
        NormChunk<T> bb{};
        if (b != nullptr) bb = load_chunk(b, c, d, vec);
        store_chunk(out + row * d, c, d, vec,
                    norm_output(load_chunk(rn, c, d, vec), load_chunk(w, c, d, vec),
                                b != nullptr, bb, inv, mean));
      }
  }
}

}  // namespace gpu
}  // namespace jax_gin
