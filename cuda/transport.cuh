// The GPU transport: one CTA is one lane of one rank. Peers' windows are reached by load/store
// over NVLink (NCCL LSA pointers, or a plain pointer table in the native test harness);
// signals are 64-bit flags written with release semantics at system scope into the peer's
// window and read with acquire semantics. No kernel includes nanobind, Python or XLA.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include <nccl.h>
#include <nccl_device.h>

#include "jax_gin/algorithms.h"
#include "jax_gin/common.h"

namespace jax_gin {
namespace gpu {

// ---- element types and ops (pairwise, widened to float for 16-bit floats, like NCCL) -------
template <class T> struct Widen { using W = T; __device__ static T up(T x) { return x; } __device__ static T down(T x) { return x; } };
template <> struct Widen<__nv_bfloat16> {
  using W = float;
  __device__ static float up(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 down(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Widen<__half> {
  using W = float;
  __device__ static float up(__half x) { return __half2float(x); }
  __device__ static __half down(float x) { return __float2half_rn(x); }
};

template <class W> __device__ __forceinline__ bool isnan_(W x) { return x != x; }

struct DevSum {
  template <class T> __device__ static T apply(T a, T b) {
    return Widen<T>::down(Widen<T>::up(a) + Widen<T>::up(b));
  }
};
struct DevMax {  // propagates NaN like XLA's maximum
  template <class T> __device__ static T apply(T a, T b) {
    auto x = Widen<T>::up(a), y = Widen<T>::up(b);
    if (isnan_(x)) return a;
    if (isnan_(y)) return b;
    return x < y ? b : a;
  }
};
struct DevMin {
  template <class T> __device__ static T apply(T a, T b) {
    auto x = Widen<T>::up(a), y = Widen<T>::up(b);
    if (isnan_(x)) return a;
    if (isnan_(y)) return b;
    return y < x ? b : a;
  }
};

// ---- flags --------------------------------------------------------------------------------
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Everything a kernel needs to find its windows and report a timeout.
struct LaneParams {
  int rank, nranks, group;
  size_t flags_offset;   // byte offset of the flag area inside each window
  size_t data_offset;    // byte offset of lane 0's data area inside each window
  size_t lane_bytes;     // data bytes per lane
  uint64_t* rounds;      // this rank's per-lane round counters (device memory)
  Diagnostic* diag;      // host-mapped: written before a trap
  uint64_t timeout_ns;
  int fault_rank;        // testing only: this rank's signals are dropped
  int32_t op, algorithm;
  size_t ll_offset;      // byte offset of the LL (low-latency) area inside each window
  int ll;                // 1: this launch uses the LL one-shot kernel
};

// ---- LL protocol (one_shot for small messages) ----------------------------------------
// Each 16-byte line carries 8 payload bytes as two (data32, flag32) pairs written with one
// v2.u64 store; every 64-bit half is single-copy atomic, so a reader that sees the flag of
// the current round in both halves also sees their data. No separate signal, no fence, no
// credit: one NVLink one-way latency per call. Buffers alternate by round parity; a rank in
// round e has received its peers' round e-1 data, so they finished reading round e-2's
// buffer (each call is one kernel, and kernels of one rank are stream-ordered).
constexpr size_t kLLLanePayload = 8 << 10;  // payload bytes per lane
constexpr int kLLMaxLanes = 32;             // so LL can carry up to 256 KiB per rank
constexpr int kLLMaxRanks = 16;
constexpr size_t kLLLinesPerLane = kLLLanePayload / 8;
__host__ __device__ inline size_t ll_area_bytes(int nranks) {
  return 2ull * kLLMaxLanes * size_t(nranks) * kLLLinesPerLane * 16;
}
__host__ __device__ inline size_t ll_slot_offset(int parity, int lane, int sender, int nranks) {
  return ((size_t(parity) * kLLMaxLanes + size_t(lane)) * size_t(nranks) + size_t(sender)) *
         kLLLinesPerLane * 16;
}
__device__ __forceinline__ void st_volatile_v2(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void ld_volatile_v2(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// Peers reached through an NCCL window (LSA pointers).
struct NcclPeers {
  ncclWindow_t win;
  __device__ char* base(int peer) const { return static_cast<char*>(ncclGetLsaPointer(win, 0, peer)); }
};
// Peers reached through a table of device pointers with P2P access (native test harness).
struct TablePeers {
  char* const* bases;
  __device__ char* base(int peer) const { return bases[peer]; }
};

__device__ inline void record_timeout(const LaneParams& p, int lane, int peer, int step,
                                      uint64_t round, uint64_t expected, uint64_t seen) {
  volatile Diagnostic* d = p.diag;
  if (d == nullptr) return;
  d->op = p.op;
  d->algorithm = p.algorithm;
  d->rank = p.rank;
  d->peer = peer;
  d->step = step;
  d->lane = lane;
  d->group = p.group;
  d->round = round;
  d->expected = expected;
  d->seen = seen;
  __threadfence_system();
  d->valid = 1;
  __threadfence_system();
}

template <class Peers>
class GpuTransport {
 public:
  __device__ GpuTransport(const Peers& peers, const LaneParams& p, int lane, size_t slot_bytes)
      : peers_(peers), p_(p), lane_(lane), slot_bytes_(slot_bytes) {}

  __device__ int rank() const { return p_.rank; }
  __device__ int nranks() const { return p_.nranks; }

  template <class T>
  __device__ T* slot(int peer, int k) const {
    return reinterpret_cast<T*>(peers_.base(peer) + p_.data_offset + size_t(lane_) * p_.lane_bytes +
                                size_t(k) * slot_bytes_);
  }

  // Copy by the whole CTA in 16-byte vectors (all segment boundaries are 16-byte aligned).
  template <class T>
  __device__ void copy(T* dst, const T* src, size_t n) const {
    constexpr size_t V = 16 / sizeof(T);
    const size_t nv = n / V;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (size_t i = threadIdx.x; i < nv; i += blockDim.x) d[i] = s[i];
    for (size_t i = nv * V + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }

  // dst = srcs[0] op srcs[1] op ... in source order, 16 bytes at a time.
  template <class T, class Op, class Src>
  __device__ void reduce(T* dst, const Src& srcs, size_t n) const {
    constexpr size_t V = 16 / sizeof(T);
    const size_t nv = n / V;
    const int k = srcs.count();
    for (size_t i = threadIdx.x; i < nv; i += blockDim.x) {
      union { uint4 u; T e[V]; } acc, x;
      acc.u = reinterpret_cast<const uint4*>(srcs.get(0))[i];
      for (int q = 1; q < k; ++q) {
        x.u = reinterpret_cast<const uint4*>(srcs.get(q))[i];
#pragma unroll
        for (size_t j = 0; j < V; ++j) acc.e[j] = Op::apply(acc.e[j], x.e[j]);
      }
      reinterpret_cast<uint4*>(dst)[i] = acc.u;
    }
    for (size_t i = nv * V + threadIdx.x; i < n; i += blockDim.x) {
      T acc = srcs.get(0)[i];
      for (int q = 1; q < k; ++q) acc = Op::apply(acc, srcs.get(q)[i]);
      dst[i] = acc;
    }
  }

  // Every peer is reached by load/store: a put is a copy into its slot.
  template <class T>
  __device__ void put(int peer, int k, size_t off, const T* src, size_t n) const {
    copy(slot<T>(peer, k) + off, src, n);
  }
  __device__ bool needs_credit(int) const { return true; }

  // All threads' earlier stores (local and remote) happen before the flag: the CTA barrier
  // orders them before thread 0's store, and a release store at system scope is cumulative
  // (the pattern NCCL's LSA barrier uses), so no separate __threadfence_system is needed.
  __device__ void signal(int peer, int kind, uint64_t value) const {
    __syncthreads();
    if (threadIdx.x == 0 && p_.rank != p_.fault_rank) {
      uint64_t* f = reinterpret_cast<uint64_t*>(peers_.base(peer) + p_.flags_offset) +
                    flag_index(lane_, p_.rank, kind, p_.nranks);
      st_release_sys(f, value);
    }
  }

  // Thread 0 spins on our own flag; on timeout it records who waited for whom and traps, so
  // the launch fails instead of hanging.
  __device__ bool wait(int peer, int kind, uint64_t value, int step) const {
    if (threadIdx.x == 0) {
      const uint64_t* f = reinterpret_cast<const uint64_t*>(peers_.base(p_.rank) + p_.flags_offset) +
                          flag_index(lane_, peer, kind, p_.nranks);
      uint64_t seen = ld_acquire_sys(f);
      if (seen < value) {
        const uint64_t start = globaltimer_ns();
        uint32_t spins = 0;
        while ((seen = ld_acquire_sys(f)) < value) {
          if ((++spins & 1023u) == 0 && globaltimer_ns() - start > p_.timeout_ns) {
            report(peer, step, value, seen);
            __trap();
          }
        }
      }
    }
    __syncthreads();
    return true;
  }

 private:
  __device__ void report(int peer, int step, uint64_t expected, uint64_t seen) const {
    record_timeout(p_, lane_, peer, step, round_of_wait(expected, step), expected, seen);
  }

  Peers peers_;
  LaneParams p_;
  int lane_;
  size_t slot_bytes_;
};

}  // namespace gpu
}  // namespace jax_gin
