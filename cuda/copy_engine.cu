// The copy-engine path of asynchronous all-reduces (psum(..., overlap=True) and
// psum_overlapping): two_shot's schedule with its data moved by the GPU's copy engines instead
// of by CTAs, so that the compute XLA runs meanwhile keeps its SMs.
//
// An SM-driven kernel holds its CTAs' SMs for the whole transfer; beside a matmul chain on
// 2 x H200, 32 such CTAs slowed both the matmuls and the all-reduce by ~29% at 256 MiB
// (docs/overlap.md). Here the SMs only reduce (one local pass per round) and synchronize
// (one-warp kernels that spin on the flags, with the timeout); everything that crosses NVLink
// is a cudaMemcpyAsync between this rank's buffers and its peers' windows.
//
// Round e of a call takes up to N * P elements of the message, P = the window's data area / N:
//   enter     (first round only) signal tag(e, 0) to every peer, wait for theirs: every peer
//             has finished everything before, its earlier calls' lanes included
//   push      copy segment q of my input into slot r of rank q's window, for every peer q
//             (rank q read that slot in its reduction of round e-1, before its tag(e-1, 2))
//   scattered signal tag(e, 1), wait for every peer's (each sends it after its round e-1 pull,
//             so my slot r, which they pulled from, may be written again)
//   reduce    my segment from slots 0..N-1 of my window (my own input for slot r), in rank
//             order, into my output and into slot r of my window
//   reduced   signal tag(e, 2), wait for every peer's
//   pull      copy slot q of rank q's window (its reduced segment) into my output, every peer q
//             (beside the next round's push, on a second stream, where one is given)
// After the last round: signal tag(e, 3), wait for every peer's (nobody writes into a window a
// peer still reads from), and credit e to every peer.
// The flags and the round counter are lane 0's (common.h): the tags of a round are above every
// tag of an earlier round, and the closing credit is what lane 0 of a later SM-driven call
// awaits, so both paths share lane 0's monotonic sequence. Reductions are in rank order with
// one rounding, as two_shot's and one_shot's: the results are the same bits.
#include "kernels.h"
#include "transport.cuh"

#include "jax_gin/schedule.h"

#include <algorithm>

namespace jax_gin {
namespace gpu {

LaneParams lane_params(const LaunchConfig& cfg, int32_t op, Algorithm algo, DType dtype,
                       size_t count);  // kernels.cu
template <class T>
cudaError_t launch_ce_reduce(RedOp op, const void* slot0, size_t slot_stride, int self, int nranks,
                             const void* in, void* out, void* staging, size_t n, int ctas,
                             int threads, cudaStream_t s);  // kernels_impl.cuh

namespace {

enum CeStep : int { kCeEnter = 0, kCeScattered = 1, kCeReduced = 2, kCeDone = 3 };

// One warp's thread 0: `step` of the current round, or of a new one (`begin`), as above.
// Everything this rank did before on the stream (copies, the reduction) happens before its
// flags: kernel boundaries order them, and the system-scope fence publishes them to the peers.
template <class Peers>
__global__ void ce_sync_kernel(Peers peers, LaneParams p, int step, int begin) {
  if (threadIdx.x != 0) return;
  const int r = p.rank, N = p.nranks;
  uint64_t round = p.rounds[0];
  if (begin) p.rounds[0] = ++round;
  // the recorder's entry: opened by the call's first kernel, closed by its last
  RecEntry* rec = step == kCeEnter ? rec_begin(p, round, nullptr) : rec_current(p);
  __threadfence_system();
  const uint64_t tag = data_tag(round, step);
  for (int k = 1; k < N; ++k) {
    const int q = schedule::mod(r + k, N);
    if (r != p.fault_rank)
      st_release_sys(reinterpret_cast<uint64_t*>(peers.base(q) + p.flags_offset) +
                         flag_index(0, r, kData, N), tag);
    if (rec) rec_note(*rec, kRecSend, step, q, tag, rec->round0, globaltimer_ns());
  }
  const uint64_t* mine = reinterpret_cast<const uint64_t*>(peers.base(r) + p.flags_offset);
  for (int k = 1; k < N; ++k) {
    const int q = schedule::mod(r + k, N);
    const uint64_t* f = mine + flag_index(0, q, kData, N);
    uint64_t seen = ld_acquire_sys(f);
    const uint64_t start = seen >= tag ? 0 : globaltimer_ns();
    uint32_t spins = 0;
    while (seen < tag) {
      seen = ld_acquire_sys(f);
      if ((++spins & 1023u) == 0 && globaltimer_ns() - start > p.timeout_ns) {
        fail_wait(peers, p, 0, q, step, round, tag, seen, place_of_wait(tag, step), kData,
                  [&] { return ld_acquire_sys(f) >= tag; });
      }
    }
    if (rec) rec_note(*rec, kRecWait, step, q, tag, rec->round0, globaltimer_ns());
  }
  if (step == kCeDone && r != p.fault_rank)
    for (int k = 1; k < N; ++k) {
      const int q = schedule::mod(r + k, N);
      st_release_sys(reinterpret_cast<uint64_t*>(peers.base(q) + p.flags_offset) +
                         flag_index(0, r, kCredit, N), round);
    }
  if (step == kCeDone) rec_end(p, rec, rec ? round + 1 - rec->round0 : 0);  // (and the state)
}

// Segment q of a round of m elements (schedule::piece, as two_shot cuts its rounds).
schedule::Range segment(size_t m, int N, int q, size_t al) { return schedule::piece(m, N, q, al); }

template <class Peers>
cudaError_t run(const Peers& peers, char* const* bases, const LaunchConfig& cfg, DType dtype,
                RedOp op, const void* in, void* out, size_t count, int reduce_ctas,
                cudaStream_t s, const CopyEngineAux* aux) {
  const int N = cfg.nranks, r = cfg.rank;
  const size_t es = dtype_size(dtype), al = schedule::align_elems(es);
  const size_t P = copy_engine_slot_elems(cfg, es);
  if (P == 0 || N < 2) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const LaneParams p = lane_params(cfg, int32_t(op), Algorithm::kTwoShot, dtype, count);
  auto sync = [&](int step, bool begin = false) {
    ce_sync_kernel<Peers><<<1, 32, 0, s>>>(peers, p, step, int(begin));
    return cudaGetLastError();
  };
  const char* inb = static_cast<const char*>(in);
  char* outb = static_cast<char*>(out);
  auto slot = [&](int owner, int q) { return bases[owner] + cfg.data_offset + size_t(q) * P * es; };
  // The copies of one direction for every peer: push (my input into their slots) or pull
  // (their reduced segments into my output).
  auto copies = [&](bool push, size_t b, size_t m, cudaStream_t st) {
    for (int k = 1; k < N; ++k) {
      const int q = schedule::mod(r + k, N);
      const schedule::Range g = segment(m, N, q, al);
      if (g.count == 0) continue;
      char* mine = outb + (b + g.offset) * es;
      cudaError_t e = push ? cudaMemcpyAsync(slot(q, r), inb + (b + g.offset) * es, g.count * es,
                                             cudaMemcpyDefault, st)
                           : cudaMemcpyAsync(mine, slot(q, q), g.count * es, cudaMemcpyDefault, st);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };
  // With `aux`, round e's pull runs on aux->stream beside round e+1's push: the pull reads
  // the peers' slot q, the push writes their slot r (both free once every rank signalled
  // round e's tag 2), and round e+1's tag 1, which tells the peers that my pull of round e
  // is over, waits for it (aux->pulled).
  const bool piped = aux != nullptr && aux->stream != nullptr;
  const int ctas = std::max(1, reduce_ctas);
  for (size_t b = 0; b < count; b += P * N) {
    const size_t m = std::min(P * N, count - b);
    if (b == 0)
      if (cudaError_t e = sync(kCeEnter, true)) return e;
    if (cudaError_t e = copies(true, b, m, s)) return e;
    if (piped && b > 0)
      if (cudaError_t e = cudaStreamWaitEvent(s, aux->pulled, 0)) return e;
    if (cudaError_t e = sync(kCeScattered, b > 0)) return e;
    const schedule::Range mine = segment(m, N, r, al);
    if (mine.count > 0) {
      cudaError_t e = with_dtype<DeviceElem>(dtype, cudaErrorInvalidValue, [&](auto t) {
        using T = typename decltype(t)::type;
        const size_t vecs = (mine.count * es + 15) / 16;
        const int grid = int(std::min<size_t>(size_t(ctas), (vecs + cfg.threads - 1) / cfg.threads));
        return launch_ce_reduce<T>(op, slot(r, 0), P, r, N, inb + (b + mine.offset) * es,
                                   outb + (b + mine.offset) * es, slot(r, r), mine.count,
                                   std::max(grid, 1), cfg.threads, s);
      });
      if (e != cudaSuccess) return e;
    }
    if (cudaError_t e = sync(kCeReduced)) return e;
    if (!piped) {
      if (cudaError_t e = copies(false, b, m, s)) return e;
      continue;
    }
    if (cudaError_t e = cudaEventRecord(aux->reduced, s)) return e;
    if (cudaError_t e = cudaStreamWaitEvent(aux->stream, aux->reduced, 0)) return e;
    if (cudaError_t e = copies(false, b, m, aux->stream)) return e;
    if (cudaError_t e = cudaEventRecord(aux->pulled, aux->stream)) return e;
  }
  if (piped)
    if (cudaError_t e = cudaStreamWaitEvent(s, aux->pulled, 0)) return e;
  return sync(kCeDone);
}

__global__ void lsa_bases_kernel(ncclWindow_t win, int n, char** out) {
  for (int q = threadIdx.x; q < n; q += blockDim.x) out[q] = static_cast<char*>(ncclGetLsaPointer(win, 0, q));
}

}  // namespace

size_t copy_engine_slot_elems(const LaunchConfig& cfg, size_t elem_size) {
  if (cfg.nranks < 1 || elem_size == 0) return 0;
  const size_t data = size_t(kMaxLanes) * cfg.lane_bytes;
  return data / size_t(cfg.nranks) / kAlignBytes * kAlignBytes / elem_size;
}

cudaError_t launch_allreduce_copy_engine(const PeerAccess& peers, char* const* bases,
                                         const LaunchConfig& cfg, DType dtype, RedOp op,
                                         const void* in, void* out, size_t count, int reduce_ctas,
                                         cudaStream_t stream, const CopyEngineAux* aux) {
  if (bases == nullptr || cfg.ranks_per_node > 0) return cudaErrorInvalidValue;
  if (peers.table != nullptr)
    return run(TablePeers{peers.table}, bases, cfg, dtype, op, in, out, count, reduce_ctas, stream, aux);
  if (peers.win == nullptr) return cudaErrorInvalidValue;
  return run(NcclPeers{peers.win}, bases, cfg, dtype, op, in, out, count, reduce_ctas, stream, aux);
}

cudaError_t lsa_window_bases(ncclWindow_t win, int nranks, char** bases) {
  char** dev = nullptr;
  if (cudaError_t e = cudaMalloc(&dev, size_t(nranks) * sizeof(char*))) return e;
  lsa_bases_kernel<<<1, 32>>>(win, nranks, dev);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaMemcpy(bases, dev, size_t(nranks) * sizeof(char*), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  return e;
}

cudaError_t preload_copy_engine() {
  cudaFuncAttributes a;
  if (cudaError_t e = cudaFuncGetAttributes(&a, ce_sync_kernel<NcclPeers>)) return e;
  if (cudaError_t e = cudaFuncGetAttributes(&a, ce_sync_kernel<TablePeers>)) return e;
  return cudaFuncGetAttributes(&a, lsa_bases_kernel);
}

}  // namespace gpu
}  // namespace jax_gin
