// The kernel template and its typed launchers. Included by one translation unit per element
// type, so that the instantiations compile in parallel: CMakeLists.txt generates
// kernels_<short_name>.cu for each entry of JAX_GIN_DTYPES (common.h), which expands
// JAX_GIN_INSTANTIATE_DTYPE with its DType.
#pragma once

#include "kernels.h"
#include "norm_row.cuh"
#include "transport.cuh"

#include "jax_gin/message.h"
#include "jax_gin/schedule.h"

#include <type_traits>

namespace jax_gin {
namespace gpu {

// One lane (CTA) of a message `io` of `count` elements (message.h: one buffer, or several),
// with the flat algorithm A (Algorithm).
template <class T, class Op, class Peers, int A, class IO>
__device__ __forceinline__ void allreduce_lane(const Peers& peers, const LaneParams& p,
                                               const IO& io, size_t count) {
  const int lane = blockIdx.x;
  constexpr Algorithm algo = Algorithm(A);
  const schedule::Range mine = schedule::piece(count, gridDim.x, lane, schedule::align_elems(sizeof(T)));
  const size_t slot_bytes = schedule::slot_elems(algo, p.nranks, p.lane_bytes, sizeof(T)) * sizeof(T);
  GpuTransport<Peers> tp(peers, p, lane, slot_bytes);
  run_recorded_lane(p, lane, tp, [&](uint64_t& round) {
    run_lane<T, Op, A>(tp, algo, io.at(mine.offset), mine.count, p.lane_bytes, round);
  });
}

// One kernel per algorithm A: each holds only its schedule's code, so it keeps fewer values
// live and spills less than one kernel that switches at run time (docs/performance.md).
// __launch_bounds__(512, 2): at most 64 registers per thread, so that a lane takes at most
// half of its SM's registers and leaves the rest to other kernels' blocks (the compute that
// an overlapped all-reduce runs beside).
// `in` and `out` may be one buffer (the asynchronous start reduces in place), which
// __restrict__ allows here: every schedule loads an element's input before it stores that
// element's result, and never loads it again afterwards.
template <class T, class Op, class Peers, int A>
__global__ void __launch_bounds__(512, 2)
    allreduce_kernel(Peers peers, LaneParams p, const T* __restrict__ in, T* __restrict__ out,
                     size_t count) {
  allreduce_lane<T, Op, Peers, A>(peers, p, Contiguous<T>{in, out}, count);
}

// Several buffers of one dtype as one message (a pytree bucket): the segment table travels in
// the kernel's parameters (__grid_constant__: read in place, never copied per thread).
template <class T, class Op, class Peers, int A>
__global__ void __launch_bounds__(512, 2)
    allreduce_multi_kernel(Peers peers, LaneParams p, const __grid_constant__ SegmentTable table,
                           size_t count) {
  allreduce_lane<T, Op, Peers, A>(peers, p, Segmented<T>{table.seg, table.n, 0}, count);
}

// f(std::integral_constant<int, A>) for the flat algorithm A == algo (the public ones, codes
// 0 .. kNumAlgorithms - 1); `fail` for any other.
template <int A = 0, class R, class F>
__host__ R with_flat_algorithm(Algorithm algo, R fail, F&& f) {
  if constexpr (A < kNumAlgorithms) {
    return int(algo) == A ? f(std::integral_constant<int, A>{})
                          : with_flat_algorithm<A + 1>(algo, fail, f);
  } else {
    return fail;
  }
}
// f(A) for every flat algorithm, stopping at the first error.
template <class F>
__host__ cudaError_t for_each_flat_algorithm(F&& f) {
  for (int a = 0; a < kNumAlgorithms; ++a) {
    const cudaError_t e = with_flat_algorithm(Algorithm(a), cudaErrorInvalidValue, f);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// hierarchical (groups that span nodes): run_lane_hierarchical over HierTransport, which
// reaches the ranks of this node by LSA and rail peers through `Rail` (GIN, or its emulation
// over P2P in the native harness). Same lane split and round counters as allreduce_kernel.
template <class T, class Op, class Peers, class Rail>
__global__ void __launch_bounds__(512)
    hierarchical_kernel(Peers peers, Rail rail, LaneParams p, const T* __restrict__ in,
                        T* __restrict__ out, size_t count) {
  const int lane = blockIdx.x;
  const Algorithm algo = Algorithm::kHierarchical;
  const schedule::Range mine = schedule::piece(count, gridDim.x, lane, schedule::align_elems(sizeof(T)));
  const size_t slot_bytes =
      schedule::slot_elems(algo, p.nranks, p.lane_bytes, sizeof(T), p.ranks_per_node) * sizeof(T);
  HierTransport<Peers, Rail> tp(peers, rail, p, lane, slot_bytes);
  uint64_t round = p.rounds[lane];
  const uint64_t round0 = round + 1;
  const LaneRecord rec = rec_open_lane(p, lane, round0, nullptr);  // no phases: in place
  run_lane_hierarchical<T, Op>(tp, in + mine.offset, out + mine.offset, mine.count, p.lane_bytes,
                               p.ranks_per_node, round);
  tp.finish();
  if (threadIdx.x == 0) p.rounds[lane] = round;
  rec_close_lane(p, rec, nullptr, round + 1 - round0);
}

// one_shot over the LL protocol (transport.cuh). Purpose: the smallest latency for messages up
// to ll_max_bytes per rank (256 KiB by default: kLLMaxLanes lanes of kLLLanePayload) and up to
// 16 ranks. Each thread owns lines: it pushes its 8 input bytes
// with the round's flag to every peer, then polls its own window for every peer's line and
// reduces the N contributions in rank order (same order on every rank: same bits).
__device__ __forceinline__ uint64_t ll_load8(const char* base, size_t line, size_t nbytes) {
  const size_t off = line * 8;
  if (off + 8 <= nbytes) return *reinterpret_cast<const uint64_t*>(base + off);
  uint64_t v = 0;
  for (size_t b = 0; off + b < nbytes; ++b) v |= uint64_t(uint8_t(base[off + b])) << (8 * b);
  return v;
}
__device__ __forceinline__ void ll_store8(char* base, size_t line, size_t nbytes, uint64_t v) {
  const size_t off = line * 8;
  if (off + 8 <= nbytes) { *reinterpret_cast<uint64_t*>(base + off) = v; return; }
  for (size_t b = 0; off + b < nbytes; ++b) base[off + b] = char(uint8_t(v >> (8 * b)));
}

// ll_load8 / ll_store8 where `base` may be aligned to 2 bytes only: a fused norm's lane starts
// at row row0 of its operands, row0 * d elements in, which is a multiple of 8 bytes only where
// row0 * d * sizeof(T) is. The access is 8, 4 or 2 bytes wide, as the address allows (the
// lane's lines share one alignment, so a warp takes one branch).
__device__ __forceinline__ uint64_t ll_load8_any(const char* base, size_t line, size_t nbytes) {
  const size_t off = line * 8;
  const uintptr_t a = reinterpret_cast<uintptr_t>(base + off);
  if (off + 8 > nbytes || (a & 7) == 0) return ll_load8(base, line, nbytes);
  uint64_t v = 0;
  if ((a & 3) == 0) {
    for (int k = 0; k < 2; ++k)
      v |= uint64_t(reinterpret_cast<const uint32_t*>(base + off)[k]) << (32 * k);
  } else {
    for (int k = 0; k < 4; ++k)
      v |= uint64_t(reinterpret_cast<const uint16_t*>(base + off)[k]) << (16 * k);
  }
  return v;
}
__device__ __forceinline__ void ll_store8_any(char* base, size_t line, size_t nbytes, uint64_t v) {
  const size_t off = line * 8;
  const uintptr_t a = reinterpret_cast<uintptr_t>(base + off);
  if (off + 8 > nbytes || (a & 7) == 0) { ll_store8(base, line, nbytes, v); return; }
  if ((a & 3) == 0) {
    for (int k = 0; k < 2; ++k) reinterpret_cast<uint32_t*>(base + off)[k] = uint32_t(v >> (32 * k));
  } else {
    for (int k = 0; k < 4; ++k) reinterpret_cast<uint16_t*>(base + off)[k] = uint16_t(v >> (16 * k));
  }
}

// The 8 bytes of the message at byte `b` (a multiple of 8) of `total`: zero-padded past the
// end of a buffer, zero in the padding between segments; stores there are dropped.
template <class T>
__device__ __forceinline__ uint64_t ll_read(const Contiguous<T>& io, size_t b, size_t total) {
  return ll_load8(reinterpret_cast<const char*>(io.in), b / 8, total);
}
template <class T>
__device__ __forceinline__ void ll_write(const Contiguous<T>& io, size_t b, size_t total, uint64_t v) {
  ll_store8(reinterpret_cast<char*>(io.out), b / 8, total, v);
}
template <class T>
__device__ __forceinline__ uint64_t ll_read(const Segmented<T>& io, size_t b, size_t) {
  const int s = io.locate(b / sizeof(T));
  if (s < 0) return 0;
  const Segment& g = io.seg[s];
  return ll_load8(static_cast<const char*>(g.in), (b - g.start * sizeof(T)) / 8, g.count * sizeof(T));
}
template <class T>
__device__ __forceinline__ void ll_write(const Segmented<T>& io, size_t b, size_t, uint64_t v) {
  const int s = io.locate(b / sizeof(T));
  if (s < 0) return;
  const Segment& g = io.seg[s];
  ll_store8(static_cast<char*>(g.out), (b - g.start * sizeof(T)) / 8, g.count * sizeof(T), v);
}

// The flag of LL round `round`, the high half of each line: its low 32 bits. Rounds e and
// e - 2, which share a buffer, differ in them; ll_next_round skips the rounds whose flag would
// be 0. (Setting the lowest bit instead cost 0.01-0.17 us a call, and a modulo 0.04-0.16 us,
// on one H200, 2026-12-03, e1f3f4e: the flag is computed on every line's path.)
__device__ __forceinline__ uint32_t ll_flag(uint64_t round) { return uint32_t(round); }

// The LL round after `round`. A window starts zeroed, and 0 is the flag of a round whose low
// 32 bits are 0 (after 2^32 calls of one lane: hours of back-to-back calls), which would take
// a line that no round has written for a peer's. Such a round is skipped for the next of the
// same parity, so that consecutive rounds still alternate buffers.
__device__ __forceinline__ uint64_t ll_next_round(uint64_t round) {
  const uint64_t next = round + 1;
  return uint32_t(next) == 0 ? next + 2 : next;
}

// Line i (8 bytes, `mine`) of lane `lane` in an LL round: pushes it, tagged with the round's
// flag, to every peer, then reduces the N ranks' lines in rank order, polling for the peers'
// ones; accumulates in the wide type (float for 16-bit floats) and rounds once.
template <class T, class Op, class Peers>
__device__ __forceinline__ uint64_t ll_reduce_line(const Peers& peers, const LaneParams& p, int lane,
                                                   size_t i, uint64_t mine, uint64_t round) {
  const int r = p.rank, N = p.nranks;
  const uint32_t flag = ll_flag(round);
  const int parity = int(round & 1);
  const uint64_t hi = uint64_t(flag) << 32;
  constexpr int E = 8 / sizeof(T);
  if (r != p.fault_rank) {
    for (int k = 1; k < N; ++k) {
      const int q = (r + k) % N;
      uint64_t* dst = reinterpret_cast<uint64_t*>(peers.base(q) + p.ll_offset +
                                                  ll_slot_offset(parity, lane, r, N)) + 2 * i;
      st_volatile_v2(dst, hi | (mine & 0xffffffffull), hi | (mine >> 32));
    }
  }
  using Wd = Widen<T>;
  typename Wd::type acc[E];
  union { uint64_t u; T e[E]; } x;
  for (int q = 0; q < N; ++q) {
    if (q == r) {
      x.u = mine;
    } else {
      const uint64_t* src = reinterpret_cast<const uint64_t*>(
          peers.base(r) + p.ll_offset + ll_slot_offset(parity, lane, q, N)) + 2 * i;
      uint64_t a, b;
      ld_volatile_v2(src, a, b);
      if ((a >> 32) != flag || (b >> 32) != flag) {
        const uint64_t start = globaltimer_ns();
        for (uint32_t spins = 1;; ++spins) {
          ld_volatile_v2(src, a, b);
          if ((a >> 32) == flag && (b >> 32) == flag) break;
          if ((spins & 1023u) == 0 && globaltimer_ns() - start > p.timeout_ns) {
            fail_wait(peers, p, lane, q, 0, round, flag, (a >> 32) != flag ? (a >> 32) : (b >> 32),
                      0, kData, [&] {
                        ld_volatile_v2(src, a, b);
                        return (a >> 32) == flag && (b >> 32) == flag;
                      });
          }
        }
      }
      x.u = (a & 0xffffffffull) | (b << 32);
    }
#pragma unroll
    for (int j = 0; j < E; ++j) acc[j] = q == 0 ? Wd::up(x.e[j]) : Op::apply(acc[j], Wd::up(x.e[j]));
  }
#pragma unroll
  for (int j = 0; j < E; ++j) x.e[j] = Wd::down(acc[j]);
  return x.u;
}

// The LL round number of lane `lane` for this call, read by thread 0 and shared.
__device__ __forceinline__ uint64_t ll_round(const LaneParams& p, int lane) {
  __shared__ uint64_t s_round;
  if (threadIdx.x == 0) s_round = ll_next_round(p.rounds[kMaxLanes + lane]);
  __syncthreads();
  return s_round;
}

template <class T, class Op, class Peers, class IO>
__device__ __forceinline__ void one_shot_ll_lane(const Peers& peers, const LaneParams& p,
                                                 const IO& io, size_t count) {
  const int lane = blockIdx.x;
  const LaneLoads loads = rec_lane_loads(p, lane);  // in flight while ll_round waits
  const uint64_t round = ll_round(p, lane);
  // LL has no flags of its own to note: the recorder keeps the call's start and end, in place
  const LaneRecord rec = rec_open_lane(p, lane, round, nullptr, loads);
  const size_t total = count * sizeof(T);
  const size_t lo = size_t(lane) * kLLLanePayload;
  const size_t nbytes = total > lo ? (total - lo < kLLLanePayload ? total - lo : kLLLanePayload) : 0;
  const size_t nlines = (nbytes + 7) / 8;
  for (size_t i = threadIdx.x; i < nlines; i += blockDim.x) {
    const uint64_t sum = ll_reduce_line<T, Op>(peers, p, lane, i, ll_read(io, lo + 8 * i, total), round);
    ll_write(io, lo + 8 * i, total, sum);
  }
  if (threadIdx.x == 0) p.rounds[kMaxLanes + lane] = round;
  // The close follows the lane's data: where thread kRecThread reduced a line of its own, it
  // has waited for every peer's data of this round, and it closes without a barrier (the
  // entry's end is then that of its last line, which the other threads' come within a line's
  // time of); where it had none, lane 0 ends at a barrier first. Lanes other than 0 record
  // nothing and wait for none (one H200, 2 ranks as streams, 4 KiB: 0.04-0.05 us a call;
  // 2026-12-02, 357acde).
  if (lane == 0 && p.rec_ctl != nullptr && nlines <= size_t(kRecThread)) __syncthreads();
  rec_close_lane(p, rec, nullptr, 1);
}

// psum_add_rmsnorm (b null) or psum_add_layernorm in one kernel over the LL protocol (norm.h,
// norm_row.cuh): lane l owns rows [l * rows_per_lane, ...) of x, whose bytes fit one LL lane's
// payload and whose norm groups fit its block; it sums each line of them over the ranks, adds
// the residual into new_residual, then normalizes its rows, all at once, exactly as the
// epilogue kernel does (fused_norm.cu), so that the results are the same bits.
//
// Where every row is a whole number of 16-byte chunks (and every pointer aligned), and the lane
// has more lines than its block has threads, thread l of group g exchanges the two LL lines of
// chunk l of the lane's row g itself, and keeps the chunk, its residual, weight and bias in
// registers for the norm: a row of at most 8 KiB has at most as many chunks as its group has
// threads (norm_row_threads), so a thread holds one chunk at most. Its loads of residual, weight
// and bias are issued before the exchange, and the norm reads nothing back from memory.
// Otherwise the threads take the lane's lines in turn, and norm_rows reads the new residual
// back: where that is one line a thread, it is the faster (rows of 24 elements, 16 a lane, cost
// about 1 us more in registers on an H200, where most of a block's threads hold no chunk;
// 2026-12-01, aaf49e1).
static_assert(kLLLanePayload / 16 <= size_t(kNormBlock), "a row of one lane: one chunk a thread");
template <class T, class Peers>
__global__ void __launch_bounds__(kNormBlock)
    ll_add_norm_kernel(Peers peers, LaneParams p, const T* __restrict__ x,
                       const T* __restrict__ res, T* nr, const T* __restrict__ w,
                       const T* __restrict__ b, T* __restrict__ out, size_t rows, size_t d,
                       size_t rows_per_lane, float eps) {
  const int lane = blockIdx.x;
  const LaneLoads loads = rec_lane_loads(p, lane);  // in flight while ll_round waits
  const uint64_t round = ll_round(p, lane);
  // recorded as its all-reduce (a psum, one_shot), as the CPU backend records it
  const LaneRecord rec = rec_open_lane(p, lane, round, nullptr, loads);  // no phases: in place
  const size_t row0 = size_t(lane) * rows_per_lane;
  const size_t row1 = row0 + rows_per_lane < rows ? row0 + rows_per_lane : rows;
  constexpr int V = NormChunk<T>::V;
  const size_t lines = ((row1 - row0) * d * sizeof(T) + 7) / 8;
  const bool in_registers = d % V == 0 && lines > blockDim.x && aligned16(x) && aligned16(res) &&
                            aligned16(nr) && aligned16(w) && aligned16(out) &&
                            (b == nullptr || aligned16(b));
  if (in_registers) {
    const int threads = norm_row_threads<T>(d);
    const size_t row = row0 + threadIdx.x / threads, c = threadIdx.x % threads;
    const bool on = row < row1 && c < d / V;
    union Line2 { NormChunk<T> chunk; uint64_t u[2]; };
    Line2 v;
    NormChunk<T> rv{}, wv{}, bv{};
    if (on) {
      v.chunk = load_chunk(x + row * d, c, d, true);
      rv = load_chunk(res + row * d, c, d, true);
      wv = load_chunk(w, c, d, true);
      if (b != nullptr) bv = load_chunk(b, c, d, true);
      // the chunk's first line in the lane's payload
      const size_t line = ((row - row0) * d + c * V) * sizeof(T) / 8;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        v.u[h] = ll_reduce_line<T, Sum>(peers, p, lane, line + h, v.u[h], round);
#pragma unroll
      for (int j = 0; j < V; ++j) v.chunk.e[j] = add_residual(rv.e[j], v.chunk.e[j]);
      store_chunk(nr + row * d, c, d, true, v.chunk);
    }
    if (threadIdx.x == 0) p.rounds[kMaxLanes + lane] = round;
    float acc = 0.0f;
    if (on) norm_accumulate(acc, v.chunk, c, d, b != nullptr ? NormSum::kPlain : NormSum::kSquares, 0.0f);
    float mean = 0.0f;
    if (b != nullptr) {
      mean = norm_group_sum(acc, threads) / float(d);
      acc = 0.0f;
      if (on) norm_accumulate(acc, v.chunk, c, d, NormSum::kCentred, mean);
    }
    const float inv = inv_rms(norm_group_sum(acc, threads), d, eps);
    if (on) store_chunk(out + row * d, c, d, true, norm_output(v.chunk, wv, b != nullptr, bv, inv, mean));
  } else {
    const size_t nbytes = (row1 - row0) * d * sizeof(T);
    const char* xb = reinterpret_cast<const char*>(x + row0 * d);
    const char* rb = reinterpret_cast<const char*>(res + row0 * d);
    char* nb = reinterpret_cast<char*>(nr + row0 * d);
    constexpr int E = 8 / sizeof(T);
    for (size_t i = threadIdx.x; i < (nbytes + 7) / 8; i += blockDim.x) {
      union { uint64_t u; T e[E]; } sum, rl;
      sum.u = ll_reduce_line<T, Sum>(peers, p, lane, i, ll_load8_any(xb, i, nbytes), round);
      rl.u = ll_load8_any(rb, i, nbytes);
#pragma unroll
      for (int j = 0; j < E; ++j) sum.e[j] = add_residual(rl.e[j], sum.e[j]);
      ll_store8_any(nb, i, nbytes, sum.u);
    }
    if (threadIdx.x == 0) p.rounds[kMaxLanes + lane] = round;
    __syncthreads();  // the lane's new residual rows are written (visible to the block)
    norm_rows(static_cast<const T*>(nullptr), nr, w, b, out, row0, row1, d, eps);
  }
  // No barrier before the close: every thread's last norm sum (norm_group_sum) ends at a
  // barrier of the whole block after its lines, so kRecThread has waited for every peer's data
  // of the round, and the entry's end comes within a row's stores of the lane's.
  rec_close_lane(p, rec, nullptr, 1);
}

template <class T, class Peers>
cudaError_t launch_ll_add_norm(const Peers& peers, const LaneParams& p, int lanes, const void* x,
                               const void* res, void* nr, const void* w, const void* b, void* out,
                               size_t rows, size_t d, size_t rows_per_lane, float eps,
                               cudaStream_t s) {
  if constexpr (NormElem<T>::ok) {
    ll_add_norm_kernel<T, Peers><<<lanes, kNormBlock, 0, s>>>(
        peers, p, static_cast<const T*>(x), static_cast<const T*>(res), static_cast<T*>(nr),
        static_cast<const T*>(w), static_cast<const T*>(b), static_cast<T*>(out), rows, d,
        rows_per_lane, eps);
    return cudaGetLastError();
  } else {
    return cudaErrorInvalidValue;
  }
}

template <class T, class Peers>
cudaError_t preload_ll_add_norm_type() {
  if constexpr (NormElem<T>::ok) {
    cudaFuncAttributes a;
    return cudaFuncGetAttributes(&a, ll_add_norm_kernel<T, Peers>);
  } else {
    return cudaSuccess;  // no fused norm of this type
  }
}

template <class T, class Op, class Peers>
__global__ void __launch_bounds__(512)
    one_shot_ll_kernel(Peers peers, LaneParams p, const T* __restrict__ in, T* __restrict__ out,
                       size_t count) {
  one_shot_ll_lane<T, Op>(peers, p, Contiguous<T>{in, out}, count);
}

template <class T, class Op, class Peers>
__global__ void __launch_bounds__(512)
    one_shot_ll_multi_kernel(Peers peers, LaneParams p, const __grid_constant__ SegmentTable table,
                             size_t count) {
  one_shot_ll_lane<T, Op>(peers, p, Segmented<T>{table.seg, table.n, 0}, count);
}

template <class T, class Op, class Peers>
cudaError_t launch_typed(const Peers& peers, const LaneParams& p, int lanes, int threads,
                         Algorithm algo, const void* in, void* out, size_t count, cudaStream_t s) {
  if (p.ll) {
    one_shot_ll_kernel<T, Op, Peers><<<lanes, threads, 0, s>>>(
        peers, p, static_cast<const T*>(in), static_cast<T*>(out), count);
  } else {
    return with_flat_algorithm(algo, cudaErrorInvalidValue, [&](auto a) {
      allreduce_kernel<T, Op, Peers, decltype(a)::value><<<lanes, threads, 0, s>>>(
          peers, p, static_cast<const T*>(in), static_cast<T*>(out), count);
      return cudaGetLastError();
    });
  }
  return cudaGetLastError();
}

template <class T, class Op, class Peers>
cudaError_t launch_multi_typed(const Peers& peers, const LaneParams& p, int lanes, int threads,
                               Algorithm algo, const SegmentTable& table, size_t count, cudaStream_t s) {
  if (p.ll) {
    one_shot_ll_multi_kernel<T, Op, Peers><<<lanes, threads, 0, s>>>(peers, p, table, count);
  } else {
    return with_flat_algorithm(algo, cudaErrorInvalidValue, [&](auto a) {
      allreduce_multi_kernel<T, Op, Peers, decltype(a)::value><<<lanes, threads, 0, s>>>(
          peers, p, table, count);
      return cudaGetLastError();
    });
  }
  return cudaGetLastError();
}

template <class T, class Peers>
cudaError_t launch_multi_op(RedOp op, const Peers& peers, const LaneParams& p, int lanes, int threads,
                            Algorithm algo, const SegmentTable& table, size_t count, cudaStream_t s) {
  return with_redop(op, cudaErrorInvalidValue, [&](auto red) {
    return launch_multi_typed<T, decltype(red)>(peers, p, lanes, threads, algo, table, count, s);
  });
}

template <class T, class Peers>
cudaError_t launch_op(RedOp op, const Peers& peers, const LaneParams& p, int lanes, int threads,
                      Algorithm algo, const void* in, void* out, size_t count, cudaStream_t s) {
  return with_redop(op, cudaErrorInvalidValue, [&](auto red) {
    return launch_typed<T, decltype(red)>(peers, p, lanes, threads, algo, in, out, count, s);
  });
}

template <class T, class Peers, class Rail>
cudaError_t launch_hier_op(RedOp op, const Peers& peers, const Rail& rail, const LaneParams& p,
                           int lanes, int threads, const void* in, void* out, size_t count,
                           cudaStream_t s) {
  const T* i = static_cast<const T*>(in);
  T* o = static_cast<T*>(out);
  return with_redop(op, cudaErrorInvalidValue, [&](auto red) {
    hierarchical_kernel<T, decltype(red), Peers, Rail><<<lanes, threads, 0, s>>>(peers, rail, p, i, o, count);
    return cudaGetLastError();
  });
}

template <class T, class Peers, class Rail>
cudaError_t preload_hier_type() {
  return for_each_redop(cudaSuccess, [](auto red) {
    cudaFuncAttributes a;
    return cudaFuncGetAttributes(&a, hierarchical_kernel<T, decltype(red), Peers, Rail>);
  });
}

// CTAs per SM of the table-peer kernel that runs `algo` (the fewest over the ops).
template <class T>
cudaError_t table_occupancy(Algorithm algo, int threads, int* per_sm) {
  int fewest = -1;
  const cudaError_t e = for_each_redop(cudaSuccess, [&](auto red) {
    using Op = decltype(red);
    int n = 0;
    const cudaError_t q =
        algo == Algorithm::kHierarchical
            ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                  &n, hierarchical_kernel<T, Op, TablePeers, EmulatedGinRail>, threads, 0)
            : with_flat_algorithm(algo, cudaErrorInvalidValue, [&](auto a) {
                return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                    &n, allreduce_kernel<T, Op, TablePeers, decltype(a)::value>, threads, 0);
              });
    if (q == cudaSuccess && (fewest < 0 || n < fewest)) fewest = n;
    return q;
  });
  if (e != cudaSuccess) return e;
  *per_sm = fewest;
  return cudaSuccess;
}

template <class T, class Peers>
cudaError_t preload_type() {
  return for_each_redop(cudaSuccess, [](auto red) {
    using Op = decltype(red);
    cudaFuncAttributes a;
    cudaError_t e = for_each_flat_algorithm([&](auto alg) {
      return cudaFuncGetAttributes(&a, allreduce_kernel<T, Op, Peers, decltype(alg)::value>);
    });
    return e != cudaSuccess ? e : cudaFuncGetAttributes(&a, one_shot_ll_kernel<T, Op, Peers>);
  });
}

template <class T, class Peers>
cudaError_t preload_multi_type() {
  return for_each_redop(cudaSuccess, [](auto red) {
    using Op = decltype(red);
    cudaFuncAttributes a;
    cudaError_t e = for_each_flat_algorithm([&](auto alg) {
      return cudaFuncGetAttributes(&a, allreduce_multi_kernel<T, Op, Peers, decltype(alg)::value>);
    });
    return e != cudaSuccess ? e : cudaFuncGetAttributes(&a, one_shot_ll_multi_kernel<T, Op, Peers>);
  });
}

// The copy-engine path's reduction (copy_engine.cu): this rank's segment of one round, from
// the peers' contributions the copy engines put into slots 0..N-1 of its window and its own
// input, in rank order, into its output and into its own slot (where the peers' copy engines
// fetch it). The whole grid splits the vectors; `in` may be `out` (the start reduces in place).
template <class T, class Op>
__global__ void __launch_bounds__(512)
    ce_reduce_kernel(const T* slot0, size_t slot_stride, int self, int nranks, const T* in, T* out,
                     T* staging, size_t n) {
  SlotSources<T> src{slot0, slot_stride, self, in, nranks};
  Dests<T, 2> dst;
  dst.add(out);
  dst.add(staging);
  reduce_vectors<T, Op, 4>(dst, src, n, size_t(blockIdx.x) * blockDim.x + threadIdx.x,
                           size_t(gridDim.x) * blockDim.x);
}

template <class T>
cudaError_t launch_ce_reduce(RedOp op, const void* slot0, size_t slot_stride, int self, int nranks,
                             const void* in, void* out, void* staging, size_t n, int ctas,
                             int threads, cudaStream_t s) {
  return with_redop(op, cudaErrorInvalidValue, [&](auto red) {
    ce_reduce_kernel<T, decltype(red)><<<ctas, threads, 0, s>>>(
        static_cast<const T*>(slot0), slot_stride, self, nranks, static_cast<const T*>(in),
        static_cast<T*>(out), static_cast<T*>(staging), n);
    return cudaGetLastError();
  });
}

template <class T>
cudaError_t preload_ce_type() {
  return for_each_redop(cudaSuccess, [](auto red) {
    cudaFuncAttributes a;
    return cudaFuncGetAttributes(&a, ce_reduce_kernel<T, decltype(red)>);
  });
}

// Explicit instantiation of everything one element type needs.
#define JAX_GIN_INSTANTIATE(T)                                                                   \
  template cudaError_t launch_op<T, NcclPeers>(RedOp, const NcclPeers&, const LaneParams&, int, \
                                               int, Algorithm, const void*, void*, size_t,       \
                                               cudaStream_t);                                    \
  template cudaError_t launch_op<T, TablePeers>(RedOp, const TablePeers&, const LaneParams&,     \
                                                int, int, Algorithm, const void*, void*, size_t, \
                                                cudaStream_t);                                   \
  template cudaError_t preload_type<T, NcclPeers>();                                             \
  template cudaError_t launch_multi_op<T, NcclPeers>(RedOp, const NcclPeers&, const LaneParams&, \
                                                     int, int, Algorithm, const SegmentTable&,   \
                                                     size_t, cudaStream_t);                      \
  template cudaError_t preload_multi_type<T, NcclPeers>();                                       \
  template cudaError_t launch_multi_op<T, TablePeers>(RedOp, const TablePeers&,                  \
                                                      const LaneParams&, int, int, Algorithm,    \
                                                      const SegmentTable&, size_t, cudaStream_t);\
  template cudaError_t preload_multi_type<T, TablePeers>();                                      \
  template cudaError_t preload_type<T, TablePeers>();                                            \
  template cudaError_t launch_hier_op<T, NcclNodePeers, GinRail>(                                \
      RedOp, const NcclNodePeers&, const GinRail&, const LaneParams&, int, int, const void*,     \
      void*, size_t, cudaStream_t);                                                              \
  template cudaError_t launch_hier_op<T, TablePeers, EmulatedGinRail>(                           \
      RedOp, const TablePeers&, const EmulatedGinRail&, const LaneParams&, int, int, const void*,\
      void*, size_t, cudaStream_t);                                                              \
  template cudaError_t preload_hier_type<T, NcclNodePeers, GinRail>();                           \
  template cudaError_t preload_hier_type<T, TablePeers, EmulatedGinRail>();                     \
  template cudaError_t table_occupancy<T>(Algorithm, int, int*);                                \
  template cudaError_t launch_ce_reduce<T>(RedOp, const void*, size_t, int, int, const void*,    \
                                           void*, void*, size_t, int, int, cudaStream_t);        \
  template cudaError_t preload_ce_type<T>();                                                     \
  template cudaError_t launch_ll_add_norm<T, NcclPeers>(                                         \
      const NcclPeers&, const LaneParams&, int, const void*, const void*, void*, const void*,   \
      const void*, void*, size_t, size_t, size_t, float, cudaStream_t);                          \
  template cudaError_t launch_ll_add_norm<T, TablePeers>(                                        \
      const TablePeers&, const LaneParams&, int, const void*, const void*, void*, const void*,  \
      const void*, void*, size_t, size_t, size_t, float, cudaStream_t);                          \
  template cudaError_t preload_ll_add_norm_type<T, NcclPeers>();                                 \
  template cudaError_t preload_ll_add_norm_type<T, TablePeers>();
// ... for the element type of DType::k<E> (a generated kernels_<short_name>.cu).
#define JAX_GIN_INSTANTIATE_DTYPE(E) JAX_GIN_INSTANTIATE(DeviceElem<DType::k##E>::type)

}  // namespace gpu
}  // namespace jax_gin
