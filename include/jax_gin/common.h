// Definitions shared by the host (CPU backend, FFI handlers) and the device (CUDA kernels).
// This header compiles with a plain C++17 compiler and with nvcc; it includes nothing from
// XLA, nanobind or Python.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define JG_HD __host__ __device__ __forceinline__
#define JG_DEVICE_CODE 1
#else
#define JG_HD inline
#define JG_DEVICE_CODE 0
#endif

namespace jax_gin {

// Algorithm ids. The first kNumAlgorithms are the public ones: the same names and order as
// jax_gin.ALGORITHMS in Python, the ids check_enums accepts (the CUDA handlers also take
// kHierarchical, for groups that span nodes, before that check; the CPU handlers refuse it).
// kHierarchical (nodes of `ranks_per_node` ranks: intra-node reduce-scatter, inter-node ring,
// intra-node all-gather) is internal: the CPU backend runs it through the threads harness; on
// GPUs it is what groups that span nodes run (the runtime picks it; cuda/kernels.cu).
enum class Algorithm : int32_t {
  kRing = 0, kTree = 1, kOneShot = 2, kTwoShot = 3, kHierarchical = 4,
};
constexpr int kNumAlgorithms = 4;          // public algorithms
constexpr int kNumInternalAlgorithms = 5;  // public ones plus kHierarchical

// The element types and reduction ops, each listed once: the enums below, the kernels' and
// the CPU backend's dispatch, the FFI handlers' type checks, the per-type CUDA translation
// units (CMakeLists.txt reads this list) and Python's names (the nanobind module exports them)
// all expand these lists.
//
// X(ENUM, code, name, short_name, host_type, device_type, bytes): ENUM names DType::kENUM and
// xla::ffi::DataType::ENUM; `name` is the NumPy/JAX name, `short_name` the native harness's;
// host_type is the CPU backend's element type (host_types.h), device_type the kernels'.
// Codes are consecutive from 0, in this order. One entry per line, beginning
// "  X(ENUM, code, name, short_name,": CMakeLists.txt finds the entries by that pattern.
#define JAX_GIN_DTYPES(X)                                    \
  X(F32, 0, float32, f32, float, float, 4)                   \
  X(F64, 1, float64, f64, double, double, 8)                 \
  X(BF16, 2, bfloat16, bf16, bf16, __nv_bfloat16, 2)         \
  X(F16, 3, float16, f16, f16, __half, 2)                    \
  X(S32, 4, int32, i32, int32_t, int32_t, 4)                 \
  X(S64, 5, int64, i64, int64_t, int64_t, 8)                 \
  X(U32, 6, uint32, u32, uint32_t, uint32_t, 4)

// X(NAME, code, name, api_name): RedOp::kNAME, reduced by the functor jax_gin::NAME
// (reduce.h); `name` is Python's op name, `api_name` the jax_gin function's. Codes are
// consecutive from 0, in this order.
#define JAX_GIN_REDOPS(X) \
  X(Sum, 0, sum, psum)    \
  X(Max, 1, max, pmax)    \
  X(Min, 2, min, pmin)

#define JG_DTYPE_ENUM(E, code, ...) k##E = code,
enum class DType : int32_t { JAX_GIN_DTYPES(JG_DTYPE_ENUM) };
#undef JG_DTYPE_ENUM
#define JG_COUNT(...) +1
constexpr int kNumDTypes = 0 JAX_GIN_DTYPES(JG_COUNT);
constexpr int kNumRedOps = 0 JAX_GIN_REDOPS(JG_COUNT);
#undef JG_COUNT
#define JG_REDOP_ENUM(E, code, ...) k##E = code,
enum class RedOp : int32_t { JAX_GIN_REDOPS(JG_REDOP_ENUM) };
#undef JG_REDOP_ENUM
namespace detail {
#define JG_CODE(E, code, ...) code,
constexpr int kDTypeCodes[] = {JAX_GIN_DTYPES(JG_CODE)};
constexpr int kRedOpCodes[] = {JAX_GIN_REDOPS(JG_CODE)};
#undef JG_CODE
constexpr bool consecutive(const int* codes, int n) {
  for (int i = 0; i < n; ++i)
    if (codes[i] != i) return false;
  return true;
}
}  // namespace detail
static_assert(detail::consecutive(detail::kDTypeCodes, kNumDTypes), "DType codes: 0, 1, 2, ...");
static_assert(detail::consecutive(detail::kRedOpCodes, kNumRedOps), "RedOp codes: 0, 1, 2, ...");

JG_HD size_t dtype_size(DType t) {
  switch (t) {
#define JG_SIZE(E, code, name, short_name, host, device, bytes) case DType::k##E: return bytes;
    JAX_GIN_DTYPES(JG_SIZE)
#undef JG_SIZE
  }
  return 0;
}

// The NumPy/JAX name of `t` ("float32").
JG_HD const char* dtype_name(DType t) {
  switch (t) {
#define JG_NAME(E, code, name, ...) case DType::k##E: return #name;
    JAX_GIN_DTYPES(JG_NAME)
#undef JG_NAME
  }
  return "?";
}

// Calls f(ElemTag<T>{}), T the element type of `t` in `Elem` (HostElem in host_types.h,
// DeviceElem in the kernels), and returns its result; `otherwise` for an unknown `t`.
template <class T> struct ElemTag { using type = T; };
template <template <DType> class Elem, class R, class F>
R with_dtype(DType t, R otherwise, F&& f) {
  switch (t) {
#define JG_CASE(E, ...) case DType::k##E: return f(ElemTag<typename Elem<DType::k##E>::type>{});
    JAX_GIN_DTYPES(JG_CASE)
#undef JG_CASE
  }
  return otherwise;
}

JG_HD const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
    case Algorithm::kOneShot: return "one_shot";
    case Algorithm::kTwoShot: return "two_shot";
    case Algorithm::kHierarchical: return "hierarchical";
  }
  return "?";
}

// The jax_gin function of `op` ("psum").
JG_HD const char* redop_name(RedOp op) {
  switch (op) {
#define JG_NAME(E, code, name, api_name) case RedOp::k##E: return #api_name;
    JAX_GIN_REDOPS(JG_NAME)
#undef JG_NAME
  }
  return "?";
}

// What a call does, as recorder entries, hang reports and profiles name it: an all-reduce's
// RedOp code, or one of the calls below, numbered after the RedOps. psum_scatter always sums,
// as lax.psum_scatter does; all_gather reduces nothing; the fused norms sum, then add and
// normalize.
enum CallOp : int32_t {
  kOpReduceScatter = kNumRedOps,
  kOpAllGather = kNumRedOps + 1,
  kOpAddRmsNorm = kNumRedOps + 2,
  kOpAddLayerNorm = kNumRedOps + 3,
};
constexpr int kNumCallOps = kNumRedOps + 4;

JG_HD const char* call_op_name(int32_t op) {
  if (op >= 0 && op < kNumRedOps) return redop_name(RedOp(op));
  if (op == kOpReduceScatter) return "psum_scatter";
  if (op == kOpAllGather) return "all_gather";
  if (op == kOpAddRmsNorm) return "psum_add_rmsnorm";
  if (op == kOpAddLayerNorm) return "psum_add_layernorm";
  return "?";
}

// Limits shared by every backend.
constexpr int kMaxRanks = 128;   // ring uses 2(N-1) steps of up to kMaxChunks tags per round.
// Independent slices of one message (CTAs on GPU). With both GPUs pushing over NVLink, SM
// stores reach 345 GB/s per direction with 64 CTAs, 360 with 128 and 362 with 132
// (jax_gin_nvlink_bw on 2 x H200), so the large-message kernels need nearly every SM: 128
// lanes took two_shot at 1 GiB from 3193 to 2998 us (kernel alone); 132 lanes (one per SM)
// measured slower than 128 (3048 us; 2026-11-30, d34b21e and a9b6c65). GPUs with fewer SMs
// use one lane per SM (default_max_lanes), so that every lane is resident at once.
constexpr int kMaxLanes = 128;
constexpr int kMaxChunks = 64;   // pipelined chunks of one step of one lane (see schedule.h).
// Start/done pairs of asynchronous calls (GPU) per rank before their events are reused: a
// pair uses slot (its number among the pairs of its program) % kAsyncSlots. A reused slot only
// makes a done wait for a later start as well, never too little.
constexpr int kAsyncSlots = 64;
// Segment boundaries are multiples of 16 bytes so that the GPU can move 16-byte vectors.
constexpr size_t kAlignBytes = 16;
// Seconds any wait spins before it reports a timeout, unless told otherwise
// (jax_gin.runtime.settings.timeout_s reads it).
constexpr double kDefaultTimeoutS = 30.0;

// Flags. Each (receiver, lane, sender) pair has three monotonic 64-bit flags in the receiver's
// memory, written only by the sender:
//   kData:   "the data of step s of round e is in your window" = tag(e, s), or with
//            pipelining, "chunks 0..c of step s" = tag(e, s * chunks + c)
//   kCredit: "I finished round e and read everything you wrote me" = e
//   kDataB:  kData for the second tree of the double binary tree: in a tree the pair
//            (sender, receiver) may be child -> parent in one tree and parent -> child in
//            the other, and the two directions' tags are not emitted in increasing order
//            across trees, so each tree needs its own monotonic flag.
// Rounds are numbered from 1 per lane and never reset, so no flag is ever cleared. A sender
// emits a pair's tags in increasing order, and a receiver waits for flag >= tag, so seeing a
// later tag implies the earlier data arrived too (release/acquire is cumulative).
enum FlagKind : int { kData = 0, kCredit = 1, kDataB = 2, kNumFlagKinds = 3 };

constexpr uint64_t kTagsPerRound = 1u << 16;  // > 2 * (kMaxRanks - 1) * kMaxChunks
JG_HD uint64_t data_tag(uint64_t round, int step) {
  return round * kTagsPerRound + uint64_t(step) + 1u;
}
// The round a wait belongs to, from the flag value it waits for: the inverse of data_tag()
// for data (step >= 0), and credit (step < 0) for round e is awaited as e - 1.
JG_HD uint64_t round_of_wait(uint64_t expected, int step) {
  return step < 0 ? expected + 1 : (expected - 1) / kTagsPerRound;
}
// Where in its round a data wait (step >= 0) stands, from the flag value it waits for: the
// step argument of data_tag() (step * chunks + chunk where pipelined); 0 for a credit.
JG_HD uint32_t place_of_wait(uint64_t expected, int step) {
  return step < 0 ? 0u : uint32_t((expected - 1) % kTagsPerRound);
}

// Offset (in uint64 words) of a flag inside one rank's flag area.
JG_HD size_t flag_index(int lane, int sender, int kind, int nranks) {
  return (size_t(lane) * size_t(nranks) + size_t(sender)) * kNumFlagKinds + size_t(kind);
}
JG_HD size_t flag_words(int nranks) { return size_t(kMaxLanes) * size_t(nranks) * kNumFlagKinds; }

// What a timed-out wait leaves behind for the host to read (CPU: returned in the error;
// GPU: written into host-mapped memory before the kernel traps).
struct Diagnostic {
  int32_t valid;      // 1 once a wait timed out
  int32_t op;         // CallOp (call_op_name): a RedOp, psum_scatter, all_gather or a fused norm
  int32_t algorithm;  // Algorithm
  int32_t rank;       // rank that waited
  int32_t peer;       // rank it waited for
  int32_t step;       // step in the round (-1: waiting for the peer's credit)
  int32_t lane;
  int32_t group;
  uint64_t round;     // round (epoch) number
  uint64_t expected;  // flag value waited for
  uint64_t seen;      // flag value seen when the wait gave up
};

}  // namespace jax_gin
