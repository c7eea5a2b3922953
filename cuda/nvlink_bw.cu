// The NVLink ceilings that jax_gin's large-message kernels are held to, measured on the
// machine: how many GB/s per direction two GPUs exchange when both send at once, by the copy
// engines (cudaMemcpyPeerAsync) and by SM kernels that store into (push) or load from (pull)
// the peer's memory with 16-byte vectors, as jax_gin's kernels do, for several CTA counts.
//
// A two-GPU all-reduce moves S bytes each way per rank (two_shot, ring: S/2 in the
// reduce-scatter, S/2 in the all-gather; one_shot: S), both directions at once, so the
// bidirectional per-direction figure bounds its algbw: algbw <= that figure for N = 2.
//
//   jax_gin_nvlink_bw [--bytes 67108864,1073741824] [--ctas 16,32,64,132] [--iters 10]
// Needs 2 GPUs with peer access. Prints one line per measurement.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#define CK(call)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__,  \
                   __LINE__, #call);                                                         \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

static std::vector<size_t> parse(const std::string& s) {
  std::vector<size_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) if (!item.empty()) out.push_back(std::strtoull(item.c_str(), nullptr, 10));
  return out;
}

// dst[i] = src[i] over n 16-byte vectors, grid-stride: one of src, dst is in the peer GPU.
__global__ void __launch_bounds__(512) copy16(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

struct Gpu {
  int dev;
  char* local;   // source of a push, destination of a pull
  char* remote;  // written by the other GPU's push, read by its pull
  cudaStream_t stream;
  cudaEvent_t start, stop;
};

enum class Mode { kCopyEngine, kPush, kPull };

// Seconds for both GPUs to move `bytes` to each other at once (the slower of the two), median
// of `iters`. unidirectional: only GPU 0 sends.
static double exchange(Gpu (&g)[2], Mode mode, size_t bytes, int ctas, int iters, bool unidirectional) {
  std::vector<double> times;
  for (int it = 0; it < iters + 2; ++it) {  // two warm-ups
    for (int a = 0; a < 2; ++a) {  // both wait for a common start (host-side, then events)
      CK(cudaSetDevice(g[a].dev));
      CK(cudaStreamSynchronize(g[a].stream));
    }
    for (int a = 0; a < 2; ++a) {
      if (unidirectional && a == 1) continue;
      Gpu& me = g[a];
      Gpu& peer = g[1 - a];
      CK(cudaSetDevice(me.dev));
      CK(cudaEventRecord(me.start, me.stream));
      const size_t n = bytes / 16;
      switch (mode) {
        case Mode::kCopyEngine:
          CK(cudaMemcpyPeerAsync(peer.remote, peer.dev, me.local, me.dev, bytes, me.stream));
          break;
        case Mode::kPush:
          copy16<<<ctas, 512, 0, me.stream>>>(reinterpret_cast<uint4*>(peer.remote),
                                              reinterpret_cast<const uint4*>(me.local), n);
          break;
        case Mode::kPull:
          copy16<<<ctas, 512, 0, me.stream>>>(reinterpret_cast<uint4*>(me.local),
                                              reinterpret_cast<const uint4*>(peer.remote), n);
          break;
      }
      CK(cudaGetLastError());
      CK(cudaEventRecord(me.stop, me.stream));
    }
    double worst = 0;
    for (int a = 0; a < 2; ++a) {
      if (unidirectional && a == 1) continue;
      CK(cudaSetDevice(g[a].dev));
      CK(cudaEventSynchronize(g[a].stop));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, g[a].start, g[a].stop));
      worst = std::max(worst, double(ms) * 1e-3);
    }
    if (it >= 2) times.push_back(worst);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

int main(int argc, char** argv) {
  std::vector<size_t> sizes = {64ull << 20, 256ull << 20, 1ull << 30};
  std::vector<size_t> ctas = {16, 32, 64, 132};
  int iters = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--bytes") sizes = parse(v);
    else if (k == "--ctas") ctas = parse(v);
    else if (k == "--iters") iters = std::atoi(v.c_str());
    else { std::fprintf(stderr, "unknown flag %s\n", k.c_str()); return 2; }
  }
  int ngpu = 0;
  CK(cudaGetDeviceCount(&ngpu));
  if (ngpu < 2) { std::fprintf(stderr, "needs 2 GPUs, found %d\n", ngpu); return 2; }
  const size_t most = *std::max_element(sizes.begin(), sizes.end());
  Gpu g[2];
  for (int a = 0; a < 2; ++a) {
    g[a].dev = a;
    CK(cudaSetDevice(a));
    int ok = 0;
    CK(cudaDeviceCanAccessPeer(&ok, a, 1 - a));
    if (!ok) { std::fprintf(stderr, "no peer access between GPU 0 and 1\n"); return 2; }
    cudaError_t e = cudaDeviceEnablePeerAccess(1 - a, 0);
    if (e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
    CK(cudaMalloc(&g[a].local, most));
    CK(cudaMalloc(&g[a].remote, most));
    CK(cudaMemset(g[a].local, a + 1, most));
    CK(cudaStreamCreateWithFlags(&g[a].stream, cudaStreamNonBlocking));
    CK(cudaEventCreate(&g[a].start));
    CK(cudaEventCreate(&g[a].stop));
  }
  std::printf("# NVLink ceilings between GPU 0 and GPU 1: GB/s per direction (1e9 B/s), median of %d\n", iters);
  for (size_t bytes : sizes) {
    auto gbs = [&](double s) { return double(bytes) / s / 1e9; };
    std::printf("bytes=%zu copy-engine unidirectional: %.1f\n", bytes,
                gbs(exchange(g, Mode::kCopyEngine, bytes, 0, iters, true)));
    std::printf("bytes=%zu copy-engine bidirectional: %.1f\n", bytes,
                gbs(exchange(g, Mode::kCopyEngine, bytes, 0, iters, false)));
    for (size_t c : ctas) {
      std::printf("bytes=%zu sm-push ctas=%zu bidirectional: %.1f\n", bytes, c,
                  gbs(exchange(g, Mode::kPush, bytes, int(c), iters, false)));
      std::printf("bytes=%zu sm-pull ctas=%zu bidirectional: %.1f\n", bytes, c,
                  gbs(exchange(g, Mode::kPull, bytes, int(c), iters, false)));
    }
  }
  return 0;
}
