// Groups that span nodes: NCCL's LSA team is smaller than the group, so the ranks of a node
// reach each other by load/store and the nodes talk through GIN (GPU-initiated networking).
// Every rank of such a group agrees on whether it can run before any goes on.
#include "comm_internal.h"

#include "jax_gin/schedule.h"
#include "jax_gin/text.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace jax_gin {
namespace gpu {
namespace detail {
namespace {

// The requirements a device communicator of a group that spans nodes asks for: LSA as in one
// node, plus GIN (GPU-initiated networking) between nodes with one signal per (lane, sending
// node, kind) (transport.cuh, rail_index). Only requested for such groups.
ncclDevCommRequirements gin_requirements(int signals) {
  ncclDevCommRequirements r = lsa_requirements();
  r.ginForceEnable = true;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7)
  r.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
#endif
  r.ginContextCount = 1;  // a hint: NCCL may give more or fewer; the kernels use context 0
  r.ginSignalCount = signals;
  return r;
}

// Why a rank cannot run its spanning group. Every rank of the group must take the same
// decision, or those that go on would wait forever in the next collective call, so the
// reasons are combined over the group (an NCCL all-reduce, max) before anyone acts on them.
enum SpanReason { kNoGin = 0, kNotNodeMajor, kWorkspace, kNotEnabled, kNumSpanReasons };

// Frees what agree() allocated, also when it throws. After a timeout the all-reduce is still
// waiting for peers that will not come: its stream would never drain, so the buffers and
// streams are abandoned (a few bytes, on an error path) and the caller aborts the
// communicators, which ends the NCCL kernel.
struct AgreeBuffers {
  std::vector<int> devices;
  std::vector<int*> bufs;
  std::vector<cudaStream_t> streams;
  bool abandon = false;
  ~AgreeBuffers() {
    if (abandon) return;
    for (size_t i = 0; i < devices.size(); ++i) {
      cudaSetDevice(devices[i]);
      if (i < streams.size() && streams[i]) cudaStreamSynchronize(streams[i]), cudaStreamDestroy(streams[i]);
      if (i < bufs.size() && bufs[i]) cudaFree(bufs[i]);
    }
  }
};

// The element-wise max of every rank's `mine` over the whole group (collective).
std::vector<int> agree(const GroupSpec& spec, const std::vector<ncclComm_t>& comms,
                       const std::vector<std::vector<int>>& mine, double timeout_s) {
  const int k = int(comms.size()), len = int(mine[0].size());
  AgreeBuffers b;
  b.devices = spec.devices;
  b.bufs.assign(k, nullptr);
  b.streams.assign(k, nullptr);
  for (int i = 0; i < k; ++i) {
    JG_CUDA(cudaSetDevice(spec.devices[i]));
    JG_CUDA(cudaStreamCreateWithFlags(&b.streams[i], cudaStreamNonBlocking));
    JG_CUDA(cudaMalloc(&b.bufs[i], len * sizeof(int)));
    JG_CUDA(cudaMemcpy(b.bufs[i], mine[i].data(), len * sizeof(int), cudaMemcpyHostToDevice));
  }
  JG_NCCL(ncclGroupStart());
  ncclResult_t r = ncclSuccess;
  for (int i = 0; i < k && r == ncclSuccess; ++i) {
    cudaSetDevice(spec.devices[i]);
    r = ncclAllReduce(b.bufs[i], b.bufs[i], len, ncclInt32, ncclMax, comms[i], b.streams[i]);
  }
  // Nonblocking communicators: the group ends in ncclInProgress; then the all-reduce kernels
  // wait for the other processes, so the streams are polled against the same deadline.
  const char* call = "ncclAllReduce (agreeing on the spanning group's set-up)";
  const ncclResult_t end = wait_comms(ncclGroupEnd(), comms, timeout_s);
  b.abandon = true;  // until the kernels have finished
  if (r != ncclInProgress) JG_NCCL(r);
  if (end == ncclInProgress) throw peers_did_not_come(call, spec.group, spec.nranks, spec.ranks, timeout_s, false);
  JG_NCCL(end);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(std::min(timeout_s, 1e7)));
  std::vector<int> all(len);
  for (int i = 0; i < k; ++i) {
    JG_CUDA(cudaSetDevice(spec.devices[i]));
    cudaError_t q;
    while ((q = cudaStreamQuery(b.streams[i])) == cudaErrorNotReady) {
      if (Clock::now() >= deadline)
        throw peers_did_not_come(call, spec.group, spec.nranks, spec.ranks, timeout_s, false);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    JG_CUDA(q);
  }
  b.abandon = false;
  JG_CUDA(cudaSetDevice(spec.devices[0]));
  JG_CUDA(cudaMemcpy(all.data(), b.bufs[0], len * sizeof(int), cudaMemcpyDeviceToHost));
  return all;
}

}  // namespace

// A group that spans nodes: NCCL's LSA team (the ranks that reach each other's memory by
// load/store) is smaller than the group. Creates its device communicators with GIN (collective
// over the group, like every other step here); then, unless every rank of the group can run
// it, throws the same error on every rank: NCCL has no GIN here; the ranks are not node-major;
// the workspace is too small; or the GIN path is not enabled (launch.experimental_gin,
// JAX_GIN_EXPERIMENTAL_GIN=1: it is built but was never run on two nodes). Otherwise sets up the ranks like setup_ranks, with
// the window layout of a spanning group, and appends them to comm.ranks. Takes over `pending`
// (the group's communicators, cleared once comm.ranks owns them).
void setup_spanning_group(Comm& comm, const GroupSpec& spec, std::vector<ncclComm_t>& pending,
                          int lsa_size, size_t lane_bytes, double timeout_s, int fault_rank,
                          const LaunchSettings& launch) {
  const int n = spec.nranks, k = int(pending.size());
  const bool divides = lsa_size > 0 && n % lsa_size == 0;
  const ncclDevCommRequirements reqs = gin_requirements(divides ? gin_signal_count(n, lsa_size) : 0);
  std::vector<ncclDevComm> dcs(k);
  ncclResult_t r = ncclGroupStart();
  for (int i = 0; i < k && r == ncclSuccess; ++i) {
    cudaSetDevice(spec.devices[i]);
    r = ncclDevCommCreate(pending[i], &reqs, &dcs[i]);
  }
  const ncclResult_t end = wait_comms(ncclGroupEnd(), pending, timeout_s);  // nonblocking comms
  if (end == ncclInProgress)  // the peers did not take part: not a lack of GIN
    throw peers_did_not_come("ncclDevCommCreate (with GIN)", spec.group, n, spec.ranks, timeout_s, false);
  if (r == ncclSuccess) r = end;
  auto destroy_dcs = [&]() {  // only once all were created
    for (int i = 0; i < k; ++i) {
      cudaSetDevice(spec.devices[i]);
      ncclDevCommDestroy(pending[i], &dcs[i]);
    }
  };
  int contexts = 0, type = -1;
  std::vector<std::vector<int>> why(k, std::vector<int>(kNumSpanReasons, 0));
  if (r == ncclSuccess) {
    contexts = int(dcs[0].ginContextCount);
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 29, 0)
    if (contexts > 0) type = int(dcs[0].ginTypes[0]);  // 2 = proxy, 3 = GDAKI
#endif
    for (int i = 0; i < k; ++i) {
      const ncclDevComm& dc = dcs[i];
      why[i][kNoGin] = dc.ginContextCount == 0;
      why[i][kNotNodeMajor] = !divides || dc.lsaSize != lsa_size || dc.rank != spec.ranks[i] ||
                              dc.nRanks != n || dc.lsaRank != spec.ranks[i] % lsa_size;
      why[i][kWorkspace] = !divides || schedule::slot_elems(Algorithm::kHierarchical, n, lane_bytes,
                                                           8, lsa_size) == 0;
      why[i][kNotEnabled] = !launch.experimental_gin;
    }
    try {
      why[0] = agree(spec, pending, why, timeout_s);
    } catch (const TimeoutError&) {
      throw;  // an operation is still in flight: the caller aborts, which frees the dcs too
    } catch (...) {
      destroy_dcs();
      throw;
    }
  }
  Text os;
  os << "jax_gin: group " << spec.group << " (" << n << " ranks; ranks " << ranks_text(spec.ranks)
     << " in this process) spans nodes: NCCL's LSA team, the ranks that reach each other's "
     << "memory over NVLink, has only " << lsa_size << " of them. Between nodes jax_gin needs "
     << "NCCL's GPU-initiated networking (GIN). ";
  if (r != ncclSuccess || why[0][kNoGin]) {
    if (r == ncclSuccess) destroy_dcs();
    os << "NCCL reports no GIN support here ("
       << (r != ncclSuccess ? std::string("ncclDevCommCreate with GIN: ") + ncclGetErrorString(r)
                            : std::string("a device communicator of the group has 0 GIN contexts"))
       << "; NCCL " << nccl_runtime_version() << "). To check: an InfiniBand or RoCE NIC with "
       << "GPUDirect RDMA on every node (ibv_devinfo; nvidia-smi topo -m; the nvidia-peermem "
       << "module or DMA-BUF); NCCL >= 2.28.7 with GIN (NCCL_GIN_ENABLE not 0; NCCL_GIN_TYPE "
       << "unset, 2 = proxy or 3 = GDAKI); NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET prints "
       << "why NCCL found no GIN device; on NCCL >= 2.29, ncclCommQueryProperties reports "
       << "ginType. See docs/multi-node.md.";
    throw std::runtime_error(os.str());
  }
  os << "NCCL offers GIN here (" << contexts << " contexts";
  if (type >= 0) os << ", type " << type;
  os << "). ";
  if (why[0][kNotNodeMajor]) {
    destroy_dcs();
    os << "But jax_gin's hierarchical all-reduce needs node-major ranks: rank r must be local "
       << "rank r % " << lsa_size << " of node r / " << lsa_size << " (NCCL's lsaRank), and "
       << lsa_size << " must divide " << n << "; here some rank is not. Order the mesh "
       << "axis (or axes) reduced over node by node, every node's devices together in the same "
       << "order, as jax.devices() lists them.";
    throw std::runtime_error(os.str());
  }
  if (why[0][kWorkspace]) {
    destroy_dcs();
    os << "But the workspace of " << lane_bytes << " bytes per lane cannot hold one round of "
       << "the hierarchical all-reduce: raise JAX_GIN_WORKSPACE_BYTES.";
    throw std::runtime_error(os.str());
  }
  if (why[0][kNotEnabled]) {
    destroy_dcs();
    os << "jax_gin's GIN path (hierarchical: intra-node reduce-scatter over LSA, a ring over "
       << "GIN between the nodes' ranks of the same local rank, intra-node all-gather over LSA) "
       << "is built, and tested on one GPU with GIN emulated, but has never run on multi-node "
       << "hardware, so it is off by default. Set JAX_GIN_EXPERIMENTAL_GIN=1 in every process "
       << "(or jax_gin.runtime.settings.experimental_gin = True) to use it, or reduce over mesh axes whose devices share a node. See "
       << "docs/multi-node.md.";
    throw std::runtime_error(os.str());
  }
  // Every rank of the group goes on: the same steps as setup_ranks, with GIN's window layout.
  const size_t base = comm.ranks.size();
  comm.ranks.resize(base + k);
  for (int i = 0; i < k; ++i) {
    RankState& s = comm.ranks[base + i];
    s.device = spec.devices[i];
    s.group = spec.group;
    s.rank = spec.ranks[i];
    s.nranks = n;
    s.comm = pending[i];
    s.devcomm = dcs[i];
    s.has_devcomm = true;
  }
  std::vector<ncclComm_t> comms;
  comms.swap(pending);  // comm.ranks owns the communicators and device communicators now
  const size_t wbytes = window_bytes(n, lane_bytes, lsa_size);
  for (int i = 0; i < k; ++i) alloc_rank(comm.ranks[base + i], wbytes);
  // GIN is on in these communicators already, so registration also registers the windows
  // with GIN.
  register_windows(comm, base, comms, wbytes, spec.group, n, spec.ranks, timeout_s);
  for (int i = 0; i < k; ++i)
    finish_rank(comm, base + i, spec.group, n, lane_bytes, lsa_size, timeout_s, fault_rank, launch);
  equalize_lanes(comm, base, k);
}

}  // namespace detail
}  // namespace gpu
}  // namespace jax_gin
