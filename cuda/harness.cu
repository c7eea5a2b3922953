// Native multi-rank test harness: runs N ranks of jax_gin's kernels as concurrent streams on
// the GPUs present (rank r on GPU r % G), with windows reached through a table of P2P
// pointers instead of NCCL, so group sizes larger than the machine (N = 4, 8 on 2 GPUs, or
// all on one GPU) are exercised with the very kernels and schedules that JAX runs. Checks
// every result bit for bit against a host reference on exact (small-integer) inputs.
//
//   jax_gin_cuda_harness [--ranks 2,3,4,8] [--counts 1,1000,...] [--algos all|ring,...]
//                        [--dtypes f32,bf16,...] [--ops sum,max,min] [--iters K]
//                        [--lane-bytes B] [--chunk-bytes B] [--timeout-s T] [--fault-rank R]
//                        [--ranks-per-node L,...] [--max-lanes K]
//                        [--collectives 0|1|only] [--block-bytes B,...] [--segments S]
//                        [--late-rank R --late-ms M] [--in-place 1]
// --ranks-per-node runs the hierarchical kernel of groups that span nodes (algorithm
// "hierarchical", the default algos then) for every L that divides N and is smaller: ranks
// node*L .. node*L+L-1 play a node, reached by load/store, and the rail between nodes goes
// through EmulatedGinRail (transport.cuh): GIN's staging, add-only signals and last-sent
// deltas, carried out over P2P. With --fault-rank R, rank R drops its rail (GIN) signals.
// Lanes per rank are capped so that every rank's CTAs on a GPU are resident together (ranks
// spin on each other); --max-lanes lowers the cap.
// Algorithm "copy_engine" runs the copy-engine path of asynchronous calls (copy_engine.cu),
// whose reduction uses at most --max-lanes CTAs (--ce-serial 1: all on one stream); its rounds share lane 0's flags with the
// other algorithms', which the default list interleaves.
// --add-rmsnorm 1 checks psum_add_rmsnorm's and psum_add_layernorm's one-kernel LL path
// against their two-kernel form; with --time-iters it also times the one kernel, the two
// kernels and the all-reduce alone.
// --collectives 1 checks reduce-scatter and all-gather (launch_collective) after each rank
// count's all-reduces, --collectives only instead of them: every --dtypes type, one_shot and
// ring (those of --algos, if given), blocks of each of --block-bytes (multiples of 16; default
// 16,48,1008,65584,1048592: 1, 3, 63, 4099 and 65537 vectors). With --time-iters it also
// prints each call's time and nccl-tests' algbw and busbw.
// --segments S (2 to 64) passes each all-reduce as S buffers of uneven counts in one call, the
// multi-operand kernels that reduce a pytree's leaves in one launch (message.h), each buffer at
// a 16-byte boundary as XLA's are (copy_engine takes one buffer; counts below S take fewer).
// --record 1 turns each rank's flight recorder on and checks its entries after each rank count;
// 0 (the default) leaves it off, as the runtime does; -1 gives the kernels no recorder at all
// (no ring, no switch to read), to measure what the recorder costs when it is off.
// --ll-round-start R starts every lane's LL round counter at R (2^32 - 2: across the flags' wrap).
// --in-place 1 gives each all-reduce one buffer as input and output, as the asynchronous start
// does (its results alias its inputs), and loads the inputs again before each iteration.
// --late-rank R --late-ms M launches rank R M ms after the others in every all-reduce, so that
// their waits spin long enough to be published in their state blocks (RecState,
// transport.cuh state_wait), and checks after each case that every published wait was
// cleared when it ended: no rank's block still shows a wait of its finished call, and with
// ring, tree and two_shot every other rank published one.
// --dtypes takes the short names of JAX_GIN_DTYPES (common.h): f32, f64, bf16, f16, i32, i64,
// u32 (unsigned types get inputs 0..14, the others -7..7).
// Exit code: 0 all correct; 1 a mismatch, a CUDA error, or a failed launch that left no hang
// report; 3 a wait timed out (its report printed).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "device_types.cuh"
#include "jax_gin/reduce.h"
#include "kernels.h"
#include "nccl_runtime.h"
#include "jax_gin/recorder.h"

using namespace jax_gin;

#define CK(call)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
                   __LINE__, #call);                                                        \
      return 1;                                                                             \
    }                                                                                       \
  } while (0)

static std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) if (!item.empty()) out.push_back(item);
  return out;
}

// The element types by their short names (JAX_GIN_DTYPES, common.h).
struct DT { const char* name; DType dt; size_t size; bool is_unsigned; };
static const DT kDTypes[] = {
#define JG_DT(E, code, name, short_name, host, device, bytes) \
  {#short_name, DType::k##E, bytes, std::is_unsigned_v<device>},
    JAX_GIN_DTYPES(JG_DT)
#undef JG_DT
};

// Host encode of an exact small integer in each dtype.
template <class T>
static void encode_as(double v, void* dst) {
  T t;
  if constexpr (std::is_arithmetic_v<T>) t = T(v);
  else t = T(float(v));  // __nv_bfloat16, __half: round to nearest
  std::memcpy(dst, &t, sizeof t);
}
static void encode(DType dt, double v, void* dst) {
  with_dtype<gpu::DeviceElem>(dt, 0, [&](auto elem) {
    encode_as<typename decltype(elem)::type>(v, dst);
    return 0;
  });
}

struct Rank {
  int dev;
  char* window = nullptr;
  uint64_t* rounds = nullptr;
  HangReport* diag_host = nullptr;
  HangReport* diag_dev = nullptr;
  char** table = nullptr;  // device copy of all ranks' window bases
  void* in = nullptr;
  void* out = nullptr;
  cudaStream_t stream;
  gpu::CopyEngineAux ce_aux;  // copy_engine's second stream and events
  RecEntry* rec_ring = nullptr;  // the flight recorder's ring and control words (null: --record -1)
  uint64_t* rec_ctl = nullptr;
  long calls = 0;                // calls launched on this rank (what the recorder must count)
};

constexpr int kHarnessRecEntries = 64;

// What every launch of rank R (rank r of N) needs: its window layout (ranks_per_node `rpn`,
// 0 within one node), round counters, diagnostic slot and timeout.
gpu::LaunchConfig rank_config(const Rank& R, int r, int N, size_t lane_bytes, int rpn,
                              double timeout_s) {
  gpu::LaunchConfig c;
  c.rank = r;
  c.nranks = N;
  gpu::set_window_layout(c, N, lane_bytes, rpn);
  c.state = c.state_offset ? reinterpret_cast<RecState*>(R.window + c.state_offset) : nullptr;
  c.rounds = R.rounds;
  c.diag = R.diag_dev;
  c.timeout_ns = uint64_t(timeout_s * 1e9);
  c.rec_ring = R.rec_ring;  // null with --record -1
  c.rec_ctl = R.rec_ctl;
  c.rec_entries = kHarnessRecEntries;
  return c;
}

// --record 1: rank R's recorder counted every call, and its last entries are whole: in order,
// done, named by a known call op, with their phases inside [t_start, t_end], and the phases
// their algorithm has; with `norms` (the fused norms ran last), some are named as those.
// Returns the number of problems (printed).
long check_recorder(const Rank& R, int r, bool norms) {
  uint64_t ctl[2];
  std::vector<RecEntry> ring(kHarnessRecEntries);
  CK(cudaSetDevice(R.dev));
  CK(cudaMemcpy(ctl, R.rec_ctl, sizeof ctl, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(ring.data(), R.rec_ring, ring.size() * sizeof(RecEntry), cudaMemcpyDeviceToHost));
  long bad = 0;
  if (long(ctl[1]) != R.calls) {
    std::printf("FAIL recorder rank %d: %llu calls recorded, %ld made\n", r, (unsigned long long)ctl[1], R.calls);
    ++bad;
  }
  const uint64_t last = ctl[1], first = last > ring.size() ? last - ring.size() + 1 : 1;
  long named_norms = 0;
  for (uint64_t seq = first; seq <= last; ++seq) {
    RecEntry& e = ring[rec_slot(seq, ring.size())];
    rec_settle(e);  // the kernels store phases raw
    named_norms += e.op == kOpAddRmsNorm || e.op == kOpAddLayerNorm;
    bool ok = e.seq == seq && e.status == kRecDone && e.t_end >= e.t_start && e.rank == r &&
              e.nevents <= kRecEvents && call_op_name(e.op)[0] != '?';
    // every phase inside the call; ring, two_shot and tree (flags at every rank count) sent
    // and awaited; ring's waits in schedule order (a lost mark count would overwrite events)
    bool sent = false, awaited = false;
    long last_wait = -1;
    for (int i = 0; ok && i < e.nevents; ++i) {
      const RecEvent& ev = e.events[i];
      ok = ev.t_first >= e.t_start && ev.t_last <= e.t_end && ev.t_first <= ev.t_last;
      sent |= ev.kind == kRecSend;
      awaited |= ev.kind == kRecWait;
      if (ok && ev.kind == kRecWait && e.algorithm == int8_t(Algorithm::kRing)) {
        const long at = long(ev.round) << 16 | long(ev.step);
        ok = at >= last_wait;
        last_wait = at;
      }
    }
    const bool flags = e.algorithm == int8_t(Algorithm::kRing) ||
                       e.algorithm == int8_t(Algorithm::kTwoShot) || e.algorithm == int8_t(Algorithm::kTree);
    ok = ok && (!flags || (sent && awaited));
    if (!ok) {
      std::printf("FAIL recorder rank %d: entry %llu (seq %llu, status %d, %d events)\n", r,
                  (unsigned long long)seq, (unsigned long long)e.seq, int(e.status), int(e.nevents));
      ++bad;
    }
  }
  if (norms && named_norms == 0) {
    std::printf("FAIL recorder rank %d: no entry named psum_add_rmsnorm or psum_add_layernorm\n", r);
    ++bad;
  }
  return bad;
}

// Microseconds per call of launch_all() (one launch of every rank), kernel-level latency
// without XLA: time_iters calls back to back after a synchronized start, timed on the host
// around the whole batch; with `graph`, as CUDA-graph replays (see --time-graph).
template <class F>
cudaError_t time_calls(std::vector<Rank>& rk, int N, int time_iters, bool graph, F&& launch_all,
                       double* us_per_call) {
#define CE(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) return e_; } while (0)
  auto sync_all = [&]() -> cudaError_t {
    for (int r = 0; r < N; ++r) {
      CE(cudaSetDevice(rk[r].dev));
      CE(cudaStreamSynchronize(rk[r].stream));
    }
    return cudaSuccess;
  };
  CE(sync_all());
  if (!graph) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < time_iters; ++it) CE(launch_all());
    CE(sync_all());
    *us_per_call = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / time_iters;
    return cudaSuccess;
  }
  // Capture every rank's stream at once (relaxed mode: cudaSetDevice between launches is
  // allowed), then replay one graph per rank, all in flight together.
  std::vector<cudaGraphExec_t> execs(N);
  std::vector<long> calls0(N);
  for (int r = 0; r < N; ++r) {
    calls0[r] = rk[r].calls;
    CE(cudaSetDevice(rk[r].dev));
    CE(cudaStreamBeginCapture(rk[r].stream, cudaStreamCaptureModeRelaxed));
  }
  for (int it = 0; it < time_iters; ++it) CE(launch_all());
  // launch_all counted each captured call once; the graph runs twice (warm-up, then timed)
  for (int r = 0; r < N; ++r) rk[r].calls += rk[r].calls - calls0[r];
  for (int r = 0; r < N; ++r) {
    cudaGraph_t g;
    CE(cudaSetDevice(rk[r].dev));
    CE(cudaStreamEndCapture(rk[r].stream, &g));
    CE(cudaGraphInstantiate(&execs[r], g, 0));
    CE(cudaGraphDestroy(g));
  }
  auto replay = [&]() -> cudaError_t {
    for (int r = 0; r < N; ++r) {
      CE(cudaSetDevice(rk[r].dev));
      CE(cudaGraphLaunch(execs[r], rk[r].stream));
    }
    return sync_all();
  };
  CE(replay());  // warm-up (uploads the graphs)
  auto t0 = std::chrono::steady_clock::now();
  CE(replay());
  *us_per_call = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / time_iters;
  for (int r = 0; r < N; ++r) {
    CE(cudaSetDevice(rk[r].dev));
    CE(cudaGraphExecDestroy(execs[r]));
  }
  return cudaSuccess;
#undef CE
}

// Waits for every rank's stream. 0 if all finished; 3 if one failed because a wait timed out
// (the kernel trapped), whose reports are printed; 1 if one failed and no rank wrote a report
// (a timeout must always leave one, trap_after_report).
int wait_all(std::vector<Rank>& rk, int N) {
  bool failed = false;
  for (int r = 0; r < N; ++r)
    if (cudaSetDevice(rk[r].dev) != cudaSuccess || cudaStreamSynchronize(rk[r].stream) != cudaSuccess)
      failed = true;
  if (!failed) return 0;
  int reports = 0;
  for (int r = 0; r < N; ++r)
    if (rk[r].diag_host->diag.valid) {
      std::printf("%s\n", gpu::describe(*rk[r].diag_host, N,
                                         "group 0 of the harness: its ranks are streams").c_str());
      ++reports;
    }
  if (reports == 0) {
    std::printf("FAIL: a launch failed and no rank wrote a hang report\n");
    return 1;
  }
  std::printf("launch failed (a wait timed out)\n");
  return 3;
}

// --late-rank: rank r's state block (RecState, in its window), as the kernels find it.
RecState* state_block(const Rank& R, int r, int N, size_t lane_bytes, int rpn) {
  return rank_config(R, r, N, lane_bytes, rpn, 0).state;
}

// --late-rank: every rank's block says "no wait published" (wait_peer -1) before a case.
// 0, or 1 after a CUDA error (printed).
int unmark_waits(std::vector<Rank>& rk, int N, size_t lane_bytes, int rpn) {
  const int32_t none = -1;
  for (int r = 0; r < N; ++r) {
    RecState* st = state_block(rk[r], r, N, lane_bytes, rpn);
    if (st == nullptr) continue;
    CK(cudaSetDevice(rk[r].dev));
    CK(cudaMemcpy(reinterpret_cast<char*>(st) + offsetof(RecState, wait_peer), &none, sizeof none,
                  cudaMemcpyHostToDevice));
  }
  return 0;
}

// --late-rank: after a case whose calls all returned, no rank's block may still show a wait
// of its last call, and where `published` (algorithms whose waits go through
// Transport::wait) every rank but `late` must have published one. Returns the problems
// (printed; a CUDA error counts as one).
long check_waits_cleared(std::vector<Rank>& rk, int N, size_t lane_bytes, int rpn, int late,
                         bool published, const char* what) {
  long bad = 0;
  for (int r = 0; r < N; ++r) {
    RecState* at = state_block(rk[r], r, N, lane_bytes, rpn);
    if (at == nullptr) continue;
    RecState st;
    CK(cudaSetDevice(rk[r].dev));
    CK(cudaMemcpy(&st, at, sizeof st, cudaMemcpyDeviceToHost));
    if (st.seq != 0 && st.wait_seq == st.seq) {
      std::printf("FAIL late rank %d, %s: rank %d still shows its wait for rank %d at step %d of "
                  "call #%llu, which returned\n", late, what, r, st.wait_peer, st.wait_step,
                  (unsigned long long)st.seq);
      ++bad;
    } else if (published && r != late && st.wait_peer < 0) {
      std::printf("FAIL late rank %d, %s: rank %d published no wait\n", late, what, r);
      ++bad;
    }
  }
  return bad;
}

// A run of cases with one window layout: ranks_per_node 0 for the one-node algorithms, L for
// hierarchical with nodes of L ranks.
struct Layout {
  int ranks_per_node;
  std::vector<std::string> algos;
};

// Round counters as a fresh communicator's (0), the LL ones at `ll_start` (--ll-round-start).
cudaError_t set_rounds(uint64_t* rounds, uint64_t ll_start) {
  std::vector<uint64_t> v(gpu::kRoundCountersBytes / sizeof(uint64_t), 0);  // with the claim word
  std::fill(v.begin() + kMaxLanes, v.begin() + 2 * kMaxLanes, ll_start);
  return cudaMemcpy(rounds, v.data(), gpu::kRoundCountersBytes, cudaMemcpyHostToDevice);
}

// --add-rmsnorm 1: psum_add_rmsnorm's and psum_add_layernorm's one-kernel LL path
// (launch_add_norm_ll) against its two-kernel composition (one_shot, then launch_add_norm),
// bit for bit on every rank, and the normed rows equal across ranks. With time_iters > 0, also
// times the one kernel, the two kernels and the all-reduce alone (time_calls). Returns the
// number of failures (printed).
long check_add_norm(std::vector<Rank>& rk, int N, size_t lane_bytes, double timeout_s,
                    const std::vector<std::string>& dtypes, int time_iters, bool time_graph) {
  struct Shape { size_t rows, d; };
  // element-wise chunks ({1, 7}, {4, 1001}, {16, 1001}), several rows per lane ({32, 1024},
  // {64, 24}, {16, 1001}), lanes of one call on both paths of the LL kernel (float32 {3, 1000}),
  // lanes whose rows start 4 or 6 bytes past an 8-byte boundary ({3, 1031}, {2, 1025},
  // {3, 2050}, {3, 2051}: one or two rows a lane)
  const Shape shapes[] = {{8, 4096}, {3, 1000}, {32, 1024}, {1, 7},    {5, 2048}, {4, 1001},
                          {64, 24},  {16, 1001}, {3, 1031}, {2, 1025}, {3, 2050}, {3, 2051}};
  long failures = 0;
  for (const auto& ds : dtypes) {
    const DT* dt = nullptr;
    for (const auto& x : kDTypes) if (ds == x.name) dt = &x;
    if (!dt || !(dt->dt == DType::kF32 || dt->dt == DType::kBF16 || dt->dt == DType::kF16)) continue;
    for (const bool layer : {false, true})
    for (const Shape& sh : shapes) {
      const size_t n = sh.rows * sh.d, bytes = n * dt->size;
      if (sh.d * dt->size > 8192) continue;  // a row larger than an LL lane: not this path
      std::mt19937 gen(unsigned(n * 7 + N));
      std::vector<char> host(bytes), res(bytes), w(sh.d * dt->size), bias(sh.d * dt->size);
      for (size_t i = 0; i < n; ++i) encode(dt->dt, double(int(gen() % 15) - 7), res.data() + i * dt->size);
      for (size_t i = 0; i < sh.d; ++i) encode(dt->dt, double(int(gen() % 7) - 3), w.data() + i * dt->size);
      for (size_t i = 0; i < sh.d; ++i) encode(dt->dt, double(int(gen() % 5) - 2), bias.data() + i * dt->size);
      struct Bufs { void *x, *res, *w, *b, *nr1, *out1, *nr2, *out2; };
      std::vector<Bufs> b(N);
      std::vector<gpu::LaunchConfig> cfg(N);
      for (int r = 0; r < N; ++r) {
        CK(cudaSetDevice(rk[r].dev));
        for (void** q : {&b[r].x, &b[r].res, &b[r].nr1, &b[r].out1, &b[r].nr2, &b[r].out2}) CK(cudaMalloc(q, bytes));
        CK(cudaMalloc(&b[r].w, sh.d * dt->size));
        CK(cudaMalloc(&b[r].b, sh.d * dt->size));
        CK(cudaMemcpy(b[r].b, bias.data(), sh.d * dt->size, cudaMemcpyHostToDevice));
        for (size_t i = 0; i < n; ++i) encode(dt->dt, double(int(gen() % 15) - 7), host.data() + i * dt->size);
        CK(cudaMemcpy(b[r].x, host.data(), bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(b[r].res, res.data(), bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(b[r].w, w.data(), sh.d * dt->size, cudaMemcpyHostToDevice));
        cfg[r] = rank_config(rk[r], r, N, lane_bytes, 0, timeout_s);
        cfg[r].call_op = layer ? kOpAddLayerNorm : kOpAddRmsNorm;  // as ffi_cuda.cc launches them
      }
      const float eps = 1e-6f;
      // every rank's one kernel; every rank's all-reduce, and with `epilogue` the epilogue
      auto one_kernel = [&]() -> cudaError_t {
        for (int r = 0; r < N; ++r) {
          cudaError_t e = cudaSetDevice(rk[r].dev);
          if (e == cudaSuccess)
            e = gpu::launch_add_norm_ll(gpu::PeerAccess{nullptr, rk[r].table}, cfg[r], dt->dt,
                                        b[r].x, b[r].res, b[r].nr1, b[r].w, layer ? b[r].b : nullptr,
                                        b[r].out1, sh.rows, sh.d, eps, rk[r].stream);
          if (e != cudaSuccess) return e;
          ++rk[r].calls;
        }
        return cudaSuccess;
      };
      auto two_kernels = [&](bool epilogue) -> cudaError_t {
        for (int r = 0; r < N; ++r) {
          cudaError_t e = cudaSetDevice(rk[r].dev);
          if (e == cudaSuccess)
            e = gpu::launch_allreduce(gpu::PeerAccess{nullptr, rk[r].table}, cfg[r], dt->dt, RedOp::kSum,
                                      Algorithm::kOneShot, b[r].x, b[r].nr2, n, rk[r].stream);
          if (e != cudaSuccess) return e;
          ++rk[r].calls;
        }
        for (int r = 0; epilogue && r < N; ++r) {
          cudaError_t e = cudaSetDevice(rk[r].dev);
          if (e == cudaSuccess)
            e = gpu::launch_add_norm(dt->dt, b[r].res, b[r].nr2, b[r].w, layer ? b[r].b : nullptr,
                                     b[r].out2, sh.rows, sh.d, eps, rk[r].stream);
          if (e != cudaSuccess) return e;
        }
        return cudaSuccess;
      };
      // every rank before any is synchronized; not supported where the rows do not fit LL lanes
      const cudaError_t launched = one_kernel();
      const bool supported = launched != cudaErrorNotSupported;
      if (supported) CK(launched);
      bool ok = supported;
      if (supported && time_iters > 0) {  // timed first, so that the check covers these calls too
        double one = 0, two = 0, alone = 0;
        CK(time_calls(rk, N, time_iters, time_graph, one_kernel, &one));
        CK(time_calls(rk, N, time_iters, time_graph, [&] { return two_kernels(true); }, &two));
        CK(time_calls(rk, N, time_iters, time_graph, [&] { return two_kernels(false); }, &alone));
        std::printf("time%s %s ranks=%d dtype=%s rows=%zu d=%zu: one kernel %.2f us, all-reduce "
                    "then epilogue %.2f us, all-reduce alone %.2f us\n",
                    time_graph ? "(graph)" : "", layer ? "add_layernorm" : "add_rmsnorm", N,
                    dt->name, sh.rows, sh.d, one, two, alone);
      }
      if (supported) {
        CK(two_kernels(true));
        std::vector<char> a(bytes), c(bytes), first(bytes);
        for (int r = 0; r < N; ++r) {
          CK(cudaSetDevice(rk[r].dev));
          CK(cudaStreamSynchronize(rk[r].stream));
          CK(cudaMemcpy(a.data(), b[r].nr1, bytes, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(c.data(), b[r].nr2, bytes, cudaMemcpyDeviceToHost));
          ok = ok && std::memcmp(a.data(), c.data(), bytes) == 0;
          CK(cudaMemcpy(a.data(), b[r].out1, bytes, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(c.data(), b[r].out2, bytes, cudaMemcpyDeviceToHost));
          ok = ok && std::memcmp(a.data(), c.data(), bytes) == 0;
          if (r == 0) first = a;
          ok = ok && std::memcmp(a.data(), first.data(), bytes) == 0;
        }
      }
      for (int r = 0; r < N; ++r) {
        CK(cudaSetDevice(rk[r].dev));
        CK(cudaStreamSynchronize(rk[r].stream));
        for (void* q : {b[r].x, b[r].res, b[r].w, b[r].b, b[r].nr1, b[r].out1, b[r].nr2, b[r].out2}) cudaFree(q);
      }
      std::printf("%s %s ranks=%d dtype=%s rows=%zu d=%zu%s\n", ok ? "ok" : "FAIL",
                  layer ? "add_layernorm" : "add_rmsnorm", N, dt->name,
                  sh.rows, sh.d, supported ? "" : " (one-kernel path not taken)");
      if (!ok) ++failures;
    }
  }
  return failures;
}

// What --collectives takes from the command line.
struct CollectiveArgs {
  std::vector<std::string> dtypes, algos;  // algos: those of --algos that are one_shot or ring
  std::vector<size_t> block_bytes;
  size_t lane_bytes, chunk_bytes, one_shot_chunk_bytes, lane_grain;
  double timeout_s;
  int iters, fault_rank, max_lanes, time_iters, time_graph;
};

// --collectives: reduce-scatter (psum_scatter) and all-gather (launch_collective,
// collectives.h) of every --dtypes type with one_shot and ring, for blocks of each of
// --block-bytes, each call made --iters times, bit for bit on every rank against a host
// reference on exact inputs: block q of a reduce-scatter is the sum of every rank's block q
// (exact in any order) and lands on rank q; every rank's all-gather output is the ranks'
// inputs in rank order. With --time-iters, also the time per call and nccl-tests' bandwidths:
// algbw = the large side's bytes (N blocks) / time, busbw = algbw * (N - 1) / N. Returns the
// failures (printed), or minus wait_all's exit code if a launch failed; adds the cases it ran
// to *cases.
long check_collectives(std::vector<Rank>& rk, int N, const CollectiveArgs& a, long* cases) {
  int ngpu = 0;
  for (const Rank& R : rk) ngpu = std::max(ngpu, R.dev + 1);
  std::vector<int> ranks_on(ngpu, 0);
  for (const Rank& R : rk) ranks_on[R.dev]++;
  long failures = 0;
  for (const auto& ds : a.dtypes) {
    const DT* dt = nullptr;
    for (const auto& x : kDTypes) if (ds == x.name) dt = &x;
    if (!dt) continue;  // main() refused unknown names
    // every rank the same lane cap, so that all ranks' CTAs on the most loaded GPU fit at once
    int max_lanes = a.max_lanes > 0 ? std::min(a.max_lanes, int(kMaxLanes)) : gpu::default_max_lanes(0);
    for (int g = 0; g < ngpu; ++g) {
      if (ranks_on[g] == 0) continue;
      int ctas = 0;
      CK(cudaSetDevice(g));
      CK(gpu::resident_collective_ctas(dt->dt, 512, &ctas));
      max_lanes = std::min(max_lanes, ctas / ranks_on[g]);
    }
    for (size_t bb : a.block_bytes) {
      const size_t block = bb / dt->size, large = block * size_t(N), lbytes = large * dt->size;
      // rank r's large-side input is v[r * large ..]; an all-gather's input is its first block
      std::mt19937 gen(unsigned(block * 131 + N * 7 + int(dt->dt)));
      std::vector<int8_t> v(size_t(N) * large);
      for (auto& x : v) x = int8_t(int(gen() % 15) - (dt->is_unsigned ? 0 : 7));
      std::vector<void*> in(N), out(N);
      std::vector<char> host(lbytes), got(lbytes);
      for (int r = 0; r < N; ++r) {
        for (size_t i = 0; i < large; ++i) encode(dt->dt, v[size_t(r) * large + i], host.data() + i * dt->size);
        CK(cudaSetDevice(rk[r].dev));
        CK(cudaMalloc(&in[r], lbytes + 16));
        CK(cudaMalloc(&out[r], lbytes + 16));
        CK(cudaMemcpy(in[r], host.data(), lbytes, cudaMemcpyHostToDevice));
      }
      for (int call_op : {int(kOpReduceScatter), int(kOpAllGather)}) {
        const bool rs = call_op == kOpReduceScatter;
        const size_t out_bytes = rs ? block * dt->size : lbytes;
        // want[r]: rank r's expected output (an all-gather's is every rank's: want[0])
        std::vector<std::vector<char>> want(rs ? N : 1, std::vector<char>(out_bytes));
        for (int r = 0; r < N; ++r) {
          if (rs) {
            for (size_t i = 0; i < block; ++i) {
              int sum = 0;
              for (int q = 0; q < N; ++q) sum += v[size_t(q) * large + size_t(r) * block + i];
              encode(dt->dt, sum, want[r].data() + i * dt->size);
            }
          } else if (r == 0) {
            for (int q = 0; q < N; ++q)
              for (size_t i = 0; i < block; ++i)
                encode(dt->dt, v[size_t(q) * large + i], want[0].data() + (size_t(q) * block + i) * dt->size);
          }
        }
        for (const auto& as : a.algos) {
          const Algorithm algo = as == "ring" ? Algorithm::kRing : Algorithm::kOneShot;
          for (int r = 0; r < N; ++r) {
            CK(cudaSetDevice(rk[r].dev));
            CK(cudaMemset(out[r], 0xff, out_bytes));  // poison
          }
          auto launch_all = [&]() -> cudaError_t {
            for (int r = 0; r < N; ++r) {
              Rank& R = rk[r];
              cudaError_t e = cudaSetDevice(R.dev);
              if (e != cudaSuccess) return e;
              gpu::LaunchConfig cfg = rank_config(R, r, N, a.lane_bytes, 0, a.timeout_s);
              cfg.max_lanes = max_lanes;
              cfg.chunk_bytes = a.chunk_bytes;
              cfg.one_shot_chunk_bytes = a.one_shot_chunk_bytes;
              cfg.lane_grain_bytes = a.lane_grain;
              cfg.fault_rank = a.fault_rank;
              if (block > 0) ++R.calls;  // a call of no elements launches nothing
              e = gpu::launch_collective(gpu::PeerAccess{nullptr, R.table}, cfg, dt->dt, call_op, algo,
                                         in[r], out[r], block, R.stream);
              if (e != cudaSuccess) return e;
            }
            return cudaSuccess;
          };
          for (int it = 0; it < a.iters; ++it) CK(launch_all());
          if (a.time_iters > 0) {
            double us = 0;
            CK(time_calls(rk, N, a.time_iters, a.time_graph, launch_all, &us));
            const double algbw = double(lbytes) / us * 1e-3;  // GB/s
            std::printf("time%s ranks=%d dtype=%s op=%s algo=%s bytes=%zu lanes=%d: %.2f us/call, "
                        "algbw %.2f GB/s, busbw %.2f GB/s\n",
                        a.time_graph ? "(graph)" : "", N, dt->name, call_op_name(call_op), as.c_str(),
                        lbytes, gpu::collective_lanes(algo, block * dt->size, N, max_lanes, a.lane_grain), us,
                        algbw, algbw * (N - 1) / N);
          }
          if (int rc = wait_all(rk, N)) return -rc;
          long bad = 0;
          for (int r = 0; r < N; ++r) {
            CK(cudaSetDevice(rk[r].dev));
            CK(cudaMemcpy(got.data(), out[r], out_bytes, cudaMemcpyDeviceToHost));
            const char* w = want[rs ? r : 0].data();
            if (std::memcmp(got.data(), w, out_bytes) == 0) continue;
            for (size_t i = 0; i < out_bytes / dt->size; ++i)
              bad += std::memcmp(got.data() + i * dt->size, w + i * dt->size, dt->size) != 0;
          }
          ++*cases;
          if (bad) {
            ++failures;
            std::printf("FAIL ranks=%d dtype=%s op=%s algo=%s block_bytes=%zu wrong=%ld\n", N, dt->name,
                        call_op_name(call_op), as.c_str(), bb, bad);
          }
        }
      }
      for (int r = 0; r < N; ++r) {
        CK(cudaSetDevice(rk[r].dev));
        CK(cudaFree(in[r]));
        CK(cudaFree(out[r]));
      }
    }
  }
  return failures;
}

int main(int argc, char** argv) {
  // Ranks that share a GPU spin on each other's work: with more streams than the device's
  // hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), one rank's work can queue
  // behind another's spinning kernel, which waits for it. Each rank has two streams
  // (copy_engine's second one), and up to 8 ranks share a GPU here. Before any CUDA call.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  std::vector<std::string> ranks_s = {"2", "3", "4", "8"}, counts_s = {"1", "7", "1000", "4099", "300001"};
  std::vector<std::string> algos_s = {"ring", "tree", "one_shot", "two_shot", "copy_engine"};
  std::vector<std::string> dtypes_s = {"f32", "bf16", "i32"}, ops_s = {"sum", "max", "min"};
  std::vector<std::string> rpn_s;
  bool algos_given = false;
  int iters = 3, fault_rank = -1, time_iters = 0, max_lanes_arg = -1;  // -1: as the runtime
  // --time-graph 1: time the kernels as CUDA-graph replays (every rank's time_iters launches
  // captured into one graph per rank), so that the host's launch rate does not bound the
  // figure; this is the device-side time per call that XLA's command buffers would see.
  int time_graph = 0;
  int ce_serial = 0;  // --ce-serial 1: copy_engine without its second stream
  int record = 0;     // --record 1: the flight recorder on, checked after each rank count (-1: none)
  int add_rmsnorm = 0;  // --add-rmsnorm 1: the fused norms' one-kernel path, after each rank count
  // --ll-round-start R: every lane's LL round counter starts at R rather than 0 (R = 2^32 - 2
  // runs the rounds around the 32-bit flags' wrap on zeroed buffers)
  uint64_t ll_round_start = 0;
  int segments = 1;     // --segments S: each all-reduce as S buffers in one call
  int in_place = 0;     // --in-place 1: input and output are one buffer
  std::string collectives = "0";  // --collectives 1 | only
  int late_rank = -1, late_ms = 0;  // --late-rank R --late-ms M
  std::vector<std::string> block_bytes_s = {"16", "48", "1008", "65584", "1048592"};
  size_t lane_bytes = 256 << 10;
  size_t ll_max_bytes = gpu::LaunchConfig().ll_max_bytes;
  size_t chunk_bytes = gpu::LaunchConfig().chunk_bytes;
  size_t lane_grain = gpu::LaunchConfig().lane_grain_bytes;
  size_t one_shot_chunk = gpu::LaunchConfig().one_shot_chunk_bytes;
  bool one_shot_chunk_set = false;
  double timeout_s = 20.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--ranks") ranks_s = split(v);
    else if (k == "--counts") counts_s = split(v);
    else if (k == "--algos") algos_s = v == "all" ? algos_s : split(v), algos_given = true;
    else if (k == "--ranks-per-node") rpn_s = split(v);
    else if (k == "--max-lanes") max_lanes_arg = std::atoi(v.c_str());
    else if (k == "--dtypes") dtypes_s = split(v);
    else if (k == "--ops") ops_s = split(v);
    else if (k == "--iters") iters = std::atoi(v.c_str());
    else if (k == "--lane-bytes") lane_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--timeout-s") timeout_s = std::atof(v.c_str());
    else if (k == "--fault-rank") fault_rank = std::atoi(v.c_str());
    else if (k == "--time-iters") time_iters = std::atoi(v.c_str());
    else if (k == "--time-graph") time_graph = std::atoi(v.c_str());
    else if (k == "--ll-max-bytes") ll_max_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--chunk-bytes") chunk_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--ce-serial") ce_serial = std::atoi(v.c_str());
    else if (k == "--record") record = std::atoi(v.c_str());
    else if (k == "--add-rmsnorm") add_rmsnorm = std::atoi(v.c_str());
    else if (k == "--ll-round-start") ll_round_start = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--segments") segments = std::atoi(v.c_str());
    else if (k == "--in-place") in_place = std::atoi(v.c_str());
    else if (k == "--collectives") collectives = v;
    else if (k == "--late-rank") late_rank = std::atoi(v.c_str());
    else if (k == "--late-ms") late_ms = std::atoi(v.c_str());
    else if (k == "--block-bytes") block_bytes_s = split(v);
    else if (k == "--lane-grain") lane_grain = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--one-shot-chunk-bytes") one_shot_chunk = std::strtoull(v.c_str(), nullptr, 10), one_shot_chunk_set = true;
    else { std::fprintf(stderr, "unknown flag %s\n", k.c_str()); return 2; }
  }
  if (!rpn_s.empty() && !algos_given) algos_s = {"hierarchical"};
  for (const auto& as : algos_s) {
    bool known = as == "hierarchical" || as == "copy_engine";
    for (int a = 0; a < kNumAlgorithms; ++a) known |= as == algorithm_name(Algorithm(a));
    if (!known) { std::fprintf(stderr, "unknown algorithm %s\n", as.c_str()); return 2; }
    if (as == "hierarchical" && rpn_s.empty()) {
      std::fprintf(stderr, "hierarchical needs --ranks-per-node L,...\n");
      return 2;
    }
  }
  if (segments < 1 || segments > kMaxSegments) {
    std::fprintf(stderr, "--segments takes 1 to %d\n", kMaxSegments);
    return 2;
  }
  if (collectives != "0" && collectives != "1" && collectives != "only") {
    std::fprintf(stderr, "--collectives takes 0, 1 or only\n");
    return 2;
  }
  if (in_place && time_iters > 0) {
    std::fprintf(stderr, "--in-place checks results; it does not time (--time-iters)\n");
    return 2;
  }
  if ((late_rank >= 0) != (late_ms > 0)) {
    std::fprintf(stderr, "--late-rank R and --late-ms M (M > 0) go together\n");
    return 2;
  }
  const bool coll_only = collectives == "only";
  // --chunk-bytes alone (tiny-chunk runs) sets one_shot's chunk too, as for the all-reduces
  CollectiveArgs coll{dtypes_s, {}, {}, lane_bytes, chunk_bytes,
                      one_shot_chunk_set ? one_shot_chunk : std::min(one_shot_chunk, chunk_bytes),
                      lane_grain, timeout_s, iters, fault_rank, max_lanes_arg, time_iters, time_graph};
  if (collectives != "0") {
    for (const auto& as : algos_s)
      if (as == "one_shot" || as == "ring") coll.algos.push_back(as);
    if (coll.algos.empty() && !algos_given) coll.algos = {"one_shot", "ring"};
    if (coll.algos.empty()) {
      std::fprintf(stderr, "--collectives runs one_shot and ring; --algos names neither\n");
      return 2;
    }
    for (const auto& ds : dtypes_s) {
      bool known = false;
      for (const auto& d : kDTypes) known |= ds == d.name;
      if (!known) { std::fprintf(stderr, "unknown dtype %s\n", ds.c_str()); return 2; }
    }
    for (const auto& b : block_bytes_s) {
      coll.block_bytes.push_back(std::strtoull(b.c_str(), nullptr, 10));
      if (coll.block_bytes.back() % kAlignBytes != 0) {
        std::fprintf(stderr, "--block-bytes %s: blocks are multiples of %zu bytes\n", b.c_str(), kAlignBytes);
        return 2;
      }
    }
  }
  int ngpu = 0;
  CK(cudaGetDeviceCount(&ngpu));
  if (ngpu < 1) { std::fprintf(stderr, "no GPU\n"); return 2; }
  for (int a = 0; a < ngpu; ++a) {
    CK(cudaSetDevice(a));
    CK(gpu::preload_kernels(/*table_peers=*/true));
    for (int b = 0; b < ngpu; ++b) {
      if (a == b) continue;
      int ok = 0;
      CK(cudaDeviceCanAccessPeer(&ok, a, b));
      if (ok) { cudaError_t e = cudaDeviceEnablePeerAccess(b, 0); if (e != cudaErrorPeerAccessAlreadyEnabled) CK(e); }
    }
  }
  std::printf("# jax_gin native harness: %d GPU(s), lane_bytes %zu, iters %d\n", ngpu, lane_bytes, iters);
  long failures = 0, cases = 0;
  for (const auto& nr : ranks_s) {
    const int N = std::atoi(nr.c_str());
    if (N < 1 || N > kMaxRanks) { std::fprintf(stderr, "bad rank count %d\n", N); return 2; }
    // The layouts to run: the one-node algorithms, then hierarchical for each node size.
    std::vector<Layout> layouts;
    Layout flat{0, {}}, hier_algos{0, {}};
    for (const auto& as : algos_s) (as == "hierarchical" ? hier_algos : flat).algos.push_back(as);
    if (!flat.algos.empty() && !coll_only) layouts.push_back(flat);
    if (!hier_algos.algos.empty() && !coll_only) {
      for (const auto& ls : rpn_s) {
        const int L = std::atoi(ls.c_str());
        if (gpu::spans_nodes(N, L)) layouts.push_back(Layout{L, hier_algos.algos});
        else std::printf("ranks=%d ranks_per_node=%d: skipped (L must divide N and be smaller)\n", N, L);
      }
    }
    std::vector<Rank> rk(N);
    size_t max_count = 0;
    for (const auto& c : counts_s) max_count = std::max<size_t>(max_count, std::strtoull(c.c_str(), nullptr, 10));
    size_t wbytes = 0;
    for (const Layout& lay : layouts)
      wbytes = std::max(wbytes, gpu::window_bytes(N, lane_bytes, lay.ranks_per_node));
    if (collectives != "0") wbytes = std::max(wbytes, gpu::window_bytes(N, lane_bytes, 0));
    std::vector<int> ranks_on(ngpu, 0);
    for (int r = 0; r < N; ++r) ranks_on[r % ngpu]++;
    std::vector<char*> bases(N);
    for (int r = 0; r < N; ++r) {
      Rank& R = rk[r];
      R.dev = r % ngpu;
      CK(cudaSetDevice(R.dev));
      CK(cudaMalloc(&R.window, wbytes));
      CK(cudaMemset(R.window, 0, wbytes));
      CK(cudaMalloc(&R.rounds, gpu::kRoundCountersBytes));
      CK(set_rounds(R.rounds, ll_round_start));
      CK(cudaHostAlloc(&R.diag_host, sizeof(HangReport), cudaHostAllocMapped | cudaHostAllocPortable));
      std::memset(R.diag_host, 0, sizeof(HangReport));
      CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&R.diag_dev), R.diag_host, 0));
      // (16 bytes of room per --segments buffer, for their alignment)
      CK(cudaMalloc(&R.in, max_count * 8 + 16 + size_t(kMaxSegments) * kAlignBytes));
      CK(cudaMalloc(&R.out, max_count * 8 + 16 + size_t(kMaxSegments) * kAlignBytes));
      CK(cudaStreamCreateWithFlags(&R.stream, cudaStreamNonBlocking));
      if (record >= 0) {  // as a communicator of the runtime: a ring and its switch
        CK(cudaMalloc(&R.rec_ring, kHarnessRecEntries * sizeof(RecEntry)));
        CK(cudaMemset(R.rec_ring, 0, kHarnessRecEntries * sizeof(RecEntry)));
        CK(cudaMalloc(&R.rec_ctl, 2 * sizeof(uint64_t)));
        const uint64_t on[2] = {uint64_t(record > 0), 0};
        CK(cudaMemcpy(R.rec_ctl, on, sizeof on, cudaMemcpyHostToDevice));
      }
      CK(cudaStreamCreateWithFlags(&R.ce_aux.stream, cudaStreamNonBlocking));
      CK(cudaEventCreateWithFlags(&R.ce_aux.reduced, cudaEventDisableTiming));
      CK(cudaEventCreateWithFlags(&R.ce_aux.pulled, cudaEventDisableTiming));
      bases[r] = R.window;
    }
    for (int r = 0; r < N; ++r) {
      CK(cudaSetDevice(rk[r].dev));
      CK(cudaMalloc(&rk[r].table, N * sizeof(char*)));
      CK(cudaMemcpy(rk[r].table, bases.data(), N * sizeof(char*), cudaMemcpyHostToDevice));
    }
    // Zeroed windows (flags, rail signals, last-sent tags) and round counters on every rank:
    // 0, or 1 after a CUDA error (printed).
    auto fresh_start = [&]() -> int {
      for (int r = 0; r < N; ++r) {
        CK(cudaSetDevice(rk[r].dev));
        CK(cudaDeviceSynchronize());
        CK(cudaMemset(rk[r].window, 0, wbytes));
        CK(set_rounds(rk[r].rounds, ll_round_start));
        CK(cudaDeviceSynchronize());
      }
      return 0;
    };
    for (const Layout& lay : layouts) {
      const int rpn = lay.ranks_per_node;
      // A fresh start for each layout: windows (flags, rail signals, last-sent tags) and round
      // counters are laid out differently for another node size.
      if (fresh_start()) return 1;
      for (const auto& ds : dtypes_s) {
        const DT* dt = nullptr;
        for (const auto& d : kDTypes) if (ds == d.name) dt = &d;
        if (!dt) { std::fprintf(stderr, "unknown dtype %s\n", ds.c_str()); return 2; }
        for (const auto& os_ : ops_s) {
          RedOp op = RedOp(-1);
#define JG_OP(E, code, name, api_name) if (os_ == #name) op = RedOp::k##E;
          JAX_GIN_REDOPS(JG_OP)
#undef JG_OP
          if (int(op) < 0) { std::fprintf(stderr, "unknown op %s\n", os_.c_str()); return 2; }
          for (const auto& as : lay.algos) {
            Algorithm algo = Algorithm::kHierarchical;
            for (int a = 0; a < kNumAlgorithms; ++a) if (as == algorithm_name(Algorithm(a))) algo = Algorithm(a);
            // "copy_engine": the copy-engine path of asynchronous calls (two_shot's schedule)
            const bool copy_engine = as == "copy_engine";
            if (copy_engine) algo = Algorithm::kTwoShot;
            // Every rank uses the same lane count; cap it so that all ranks' CTAs on the most
            // loaded GPU fit at once.
            int max_lanes = max_lanes_arg > 0 ? std::min(max_lanes_arg, int(kMaxLanes))
                                              : gpu::default_max_lanes(0);
            for (int g = 0; g < ngpu; ++g) {
              if (ranks_on[g] == 0) continue;
              int ctas = 0;
              CK(cudaSetDevice(g));
              CK(gpu::resident_ctas(algo, dt->dt, 512, &ctas));
              max_lanes = std::min(max_lanes, ctas / ranks_on[g]);
            }
            if (max_lanes < 1) {
              std::fprintf(stderr, "ranks=%d: %s kernels of all ranks cannot be resident on one GPU at once\n",
                           N, as.c_str());
              return 2;
            }
            for (const auto& cs : counts_s) {
              const size_t count = std::strtoull(cs.c_str(), nullptr, 10);
              std::mt19937 gen(unsigned(count * 131 + N));
              std::vector<std::vector<double>> vals(N, std::vector<double>(count));
              std::vector<double> ref(count);
              for (size_t i = 0; i < count; ++i) {
                // -7..7, or 0..14 for unsigned types
                for (int r = 0; r < N; ++r) vals[r][i] = double(int(gen() % 15) - (dt->is_unsigned ? 0 : 7));
                double acc = vals[0][i];
                for (int r = 1; r < N; ++r)
                  acc = with_redop(op, 0.0, [&](auto red) { return decltype(red)::apply(acc, vals[r][i]); });
                ref[i] = acc;
              }
              // Buffer k holds elements first[k] .. first[k + 1] of the message and lies at element
              // phys[k] of the rank's in and out (one buffer, or --segments of them).
              const size_t nbuf = copy_engine ? 1 : std::max<size_t>(1, std::min<size_t>(segments, count));
              std::vector<size_t> first(nbuf + 1), phys(nbuf);
              // uneven counts, most not whole 16-byte vectors: boundaries on a parabola plus k, each
              // buffer at least one element
              for (size_t k = 0; k <= nbuf; ++k)
                first[k] = k == nbuf ? count : std::min(count * k * k / (nbuf * nbuf) + k, count - (nbuf - k));
              const size_t align = kAlignBytes / dt->size;
              size_t plen = 0;  // elements of in and out in use
              for (size_t k = 0; k < nbuf; ++k) {
                phys[k] = (plen + align - 1) / align * align;
                plen = phys[k] + first[k + 1] - first[k];
              }
              auto place = [&](const std::vector<char>& logical) {
                std::vector<char> p(plen * dt->size, 0);
                for (size_t k = 0; k < nbuf; ++k)
                  std::memcpy(p.data() + phys[k] * dt->size, logical.data() + first[k] * dt->size,
                              (first[k + 1] - first[k]) * dt->size);
                return p;
              };
              std::vector<char> host(count * dt->size), want(count * dt->size);
              for (size_t i = 0; i < count; ++i) encode(dt->dt, ref[i], want.data() + i * dt->size);
              // --in-place: the output is the input buffer
              auto out_of = [&](const Rank& R) { return in_place ? R.in : R.out; };
              std::vector<std::vector<char>> placed(N);
              for (int r = 0; r < N; ++r) {
                for (size_t i = 0; i < count; ++i) encode(dt->dt, vals[r][i], host.data() + i * dt->size);
                placed[r] = place(host);
              }
              // Every rank's input, and its output poisoned, on the rank's stream, finished
              // before it returns (a cudaMemcpy from pageable memory may return before its DMA
              // ends, and the kernels' non-blocking streams do not wait for it); all ranks idle
              // (wait_all) first.
              auto load_inputs = [&]() -> cudaError_t {
                for (int r = 0; r < N; ++r) {
                  const Rank& R = rk[r];
                  cudaError_t e = cudaSetDevice(R.dev);
                  if (e == cudaSuccess)
                    e = cudaMemcpyAsync(R.in, placed[r].data(), placed[r].size(),
                                        cudaMemcpyHostToDevice, R.stream);
                  if (e == cudaSuccess && !in_place)
                    e = cudaMemsetAsync(R.out, 0xff, plen * dt->size, R.stream);
                  if (e == cudaSuccess) e = cudaStreamSynchronize(R.stream);
                  if (e != cudaSuccess) return e;
                }
                return cudaSuccess;
              };
              CK(load_inputs());
              // Each rank's buffers as segments (launch_allreduce fills in their logical starts).
              std::vector<std::vector<Segment>> segs(N, std::vector<Segment>(nbuf));
              for (int r = 0; r < N; ++r)
                for (size_t k = 0; k < nbuf; ++k)
                  segs[r][k] = Segment{0, first[k + 1] - first[k],
                                       static_cast<char*>(rk[r].in) + phys[k] * dt->size,
                                       static_cast<char*>(out_of(rk[r])) + phys[k] * dt->size};
              // One launch of every rank. All ranks are launched before any is synchronized (a
              // blocking call before the last launch would leave the others spinning); with
              // --late-rank, that rank last, --late-ms after the others.
              const bool late = late_ms > 0 && late_rank < N;
              auto launch_all = [&]() -> cudaError_t {
                for (int i = 0; i < N; ++i) {
                  const int r = !late ? i : i < late_rank ? i : i + 1 < N ? i + 1 : late_rank;
                  if (late && r == late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(late_ms));
                  Rank& R = rk[r];
                  cudaError_t e = cudaSetDevice(R.dev);
                  if (e != cudaSuccess) return e;
                  gpu::LaunchConfig cfg = rank_config(R, r, N, lane_bytes, rpn, timeout_s);
                  cfg.max_lanes = max_lanes;
                  if (cfg.ll_max_bytes > 0) cfg.ll_max_bytes = ll_max_bytes;  // 0: no LL area
                  cfg.chunk_bytes = chunk_bytes;
                  cfg.lane_grain_bytes = lane_grain;
                  // --chunk-bytes alone (tiny-chunk runs) sets one_shot's chunk too
                  cfg.one_shot_chunk_bytes = one_shot_chunk_set ? one_shot_chunk : std::min(one_shot_chunk, chunk_bytes);
                  cfg.fault_rank = fault_rank;
                  // a call of no elements launches nothing; hierarchical launches once per buffer
                  if (count > 0) R.calls += algo == Algorithm::kHierarchical ? long(nbuf) : 1;
                  e = copy_engine
                          ? gpu::launch_allreduce_copy_engine(gpu::PeerAccess{nullptr, R.table}, bases.data(),
                                                              cfg, dt->dt, op, R.in, out_of(R), count, max_lanes,
                                                              R.stream, ce_serial ? nullptr : &R.ce_aux)
                      : nbuf > 1 ? gpu::launch_allreduce(gpu::PeerAccess{nullptr, R.table}, cfg, dt->dt, op,
                                                         algo, segs[r].data(), int(nbuf), R.stream)
                                 : gpu::launch_allreduce(gpu::PeerAccess{nullptr, R.table}, cfg, dt->dt, op, algo,
                                                         R.in, out_of(R), count, R.stream);
                  if (e != cudaSuccess) return e;
                }
                return cudaSuccess;
              };
              if (late && unmark_waits(rk, N, lane_bytes, rpn)) return 1;
              for (int it = 0; it < iters; ++it) {
                if (in_place && it > 0) {  // the last iteration's results replaced the inputs
                  if (int rc = wait_all(rk, N)) return rc;
                  CK(load_inputs());
                }
                CK(launch_all());
              }
              if (time_iters > 0) {
                double us_per_iter = 0;
                CK(time_calls(rk, N, time_iters, time_graph, launch_all, &us_per_iter));
                std::printf("time%s ranks=%d%s dtype=%s op=%s algo=%s bytes=%zu%s: %.2f us/call\n",
                            time_graph ? "(graph)" : "", N,
                            rpn ? (" ranks_per_node=" + std::to_string(rpn)).c_str() : "", dt->name,
                            os_.c_str(), as.c_str(), count * dt->size,
                            nbuf > 1 ? (" buffers=" + std::to_string(nbuf)).c_str() : "", us_per_iter);
              }
              if (int rc = wait_all(rk, N)) return rc;
              long bad = 0, stale = 0;
              if (late) {
                // waits through Transport::wait publish; LL one_shot (small messages), the copy
                // engines and hierarchical's rail do not
                const bool published = !copy_engine && rpn == 0 && count > 0 &&
                                        (algo == Algorithm::kRing || algo == Algorithm::kTree ||
                                         algo == Algorithm::kTwoShot);
                const std::string what = std::string(as) + " count=" + std::to_string(count);
                stale = check_waits_cleared(rk, N, lane_bytes, rpn, late_rank, published, what.c_str());
              }
              std::vector<char> got(plen * dt->size);
              for (int r = 0; r < N; ++r) {
                CK(cudaSetDevice(rk[r].dev));
                CK(cudaMemcpy(got.data(), out_of(rk[r]), got.size(), cudaMemcpyDeviceToHost));
                for (size_t k = 0; k < nbuf; ++k)  // the buffers' elements, in message order
                  std::memcpy(host.data() + first[k] * dt->size, got.data() + phys[k] * dt->size,
                              (first[k + 1] - first[k]) * dt->size);
                if (std::memcmp(host.data(), want.data(), count * dt->size) != 0) {
                  for (size_t i = 0; i < count; ++i)
                    bad += std::memcmp(host.data() + i * dt->size, want.data() + i * dt->size, dt->size) != 0;
                }
              }
              ++cases;
              failures += bad || stale;  // a case fails once, whatever its problems (printed)
              if (bad)
                std::printf("FAIL ranks=%d ranks_per_node=%d dtype=%s op=%s algo=%s count=%zu buffers=%zu wrong=%ld\n",
                            N, rpn, dt->name, os_.c_str(), as.c_str(), count, nbuf, bad);
            }
          }
        }
      }
      if (rpn) std::printf("ranks=%d ranks_per_node=%d (%d nodes, GIN emulated): done\n", N, rpn, N / rpn);
    }
    if (collectives != "0") {
      // After the one-node all-reduces their windows and round counters carry on (calls of
      // every kind share them); after hierarchical, which gives credits to fewer peers, a fresh
      // start.
      if (!layouts.empty() && layouts.back().ranks_per_node > 0) {
        if (fresh_start()) return 1;
      }
      long n = 0;
      const long bad = check_collectives(rk, N, coll, &n);
      if (bad < 0) return int(-bad);
      failures += bad;
      cases += n;
      std::printf("ranks=%d: collectives %ld passed, %ld failed\n", N, n - bad, bad);
    }
    if (add_rmsnorm) {
      const long bad = check_add_norm(rk, N, lane_bytes, timeout_s, dtypes_s, time_iters, time_graph);
      failures += bad;
      ++cases;
    }
    if (record > 0) {
      for (int r = 0; r < N; ++r) {
        CK(cudaSetDevice(rk[r].dev));
        CK(cudaDeviceSynchronize());
      }
      long bad = 0;
      for (int r = 0; r < N; ++r) bad += check_recorder(rk[r], r, add_rmsnorm != 0);
      failures += bad;
      ++cases;
      std::printf("ranks=%d: recorder %s (%ld calls per rank)\n", N, bad ? "FAILED" : "ok", rk[0].calls);
    }
    std::printf("ranks=%d: done\n", N);
    for (auto& R : rk) {
      cudaSetDevice(R.dev);
      cudaFree(R.window); cudaFree(R.rounds); cudaFreeHost(R.diag_host); cudaFree(R.table);
      cudaFree(R.in); cudaFree(R.out); cudaStreamDestroy(R.stream);
      cudaStreamDestroy(R.ce_aux.stream); cudaEventDestroy(R.ce_aux.reduced); cudaEventDestroy(R.ce_aux.pulled);
      cudaFree(R.rec_ring); cudaFree(R.rec_ctl);
    }
  }
  std::printf("%ld passed, %ld failed\n", cases - failures, failures);
  return failures ? 1 : 0;
}
