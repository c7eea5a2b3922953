// The one nanobind module of jax_gin's CPU build: it exports the FFI handlers as capsules,
// the runtime's communicator calls, and the schedules (for unit tests).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sys/mman.h>

#include <array>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpu_backend.h"
#include "ffi_cpu.h"
#include "host_types.h"
#include "jax_gin/collectives.h"
#include "jax_gin/laggard.h"
#include "jax_gin/schedule.h"
#include "recorder_dict.h"

namespace nb = nanobind;
using namespace jax_gin;

namespace {

template <typename T>
nb::capsule encapsulate_ffi_handler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// The DType of a NumPy array: the types NumPy has natively (not bfloat16, nor float16,
// which nanobind does not map to a C++ type).
template <class A>
DType dtype_of(const A& a) {
  std::string names;
#define JG_MATCH(E, code, name, short_name, host, device, bytes)                 \
  if constexpr (std::is_arithmetic_v<host>) {                                     \
    if (a.dtype() == nb::dtype<host>()) return DType::k##E;                       \
    names += std::string(names.empty() ? "" : ", ") + #name;                      \
  }
  JAX_GIN_DTYPES(JG_MATCH)
#undef JG_MATCH
  throw nb::type_error(("threads_allreduce: use " + names).c_str());
}

// Runs call(comm, r, out_row) `repeats` times (until it fails) for every rank r of one group
// of `cfg.nranks` ranks, each on its own std::thread, through a fresh CPU communicator of
// `cfg`; `out_row` is row r of a (nranks, out_count) result of `inputs`' dtype, which it
// returns. Throws the first rank's error.
template <class F>
nb::ndarray<nb::numpy> on_threads(cpu::CommConfig cfg, const nb::ndarray<nb::c_contig, nb::device::cpu>& inputs,
                                  size_t out_count, size_t esize, int repeats, F&& call) {
  const int nranks = cfg.nranks;
  for (int r = 0; r < nranks; ++r) { cfg.group_of.push_back(0); cfg.rank_of.push_back(r); }
  const int64_t id = cpu::create_comm(cfg);
  auto comm = cpu::find_comm(id);
  const size_t row = out_count * esize;
  char* out = new char[row * size_t(nranks) + 1];
  std::vector<std::string> errors(nranks);
  {
    nb::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (int r = 0; r < nranks; ++r) {
      threads.emplace_back([&, r] {
        for (int i = 0; i < repeats && errors[r].empty(); ++i)
          errors[r] = call(*comm, r, out + size_t(r) * row);
      });
    }
    for (auto& t : threads) t.join();
  }
  cpu::destroy_comm(id);
  for (int r = 0; r < nranks; ++r) {
    if (!errors[r].empty()) { delete[] out; throw std::runtime_error(errors[r]); }
  }
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<char*>(p); });
  size_t shape[2] = {size_t(nranks), out_count};
  return nb::ndarray<nb::numpy>(out, 2, shape, owner, nullptr, inputs.dtype());
}

// Runs one all-reduce among `inputs.shape[0]` ranks, each on its own std::thread, through a
// fresh CPU communicator: a harness for schedules and group sizes that no JAX mesh here has.
// `ranks_per_node` (hierarchical only; 0: one node) makes ranks node*L .. node*L+L-1 a node.
// `sites`: each rank's call site (cpu_backend.h: Turn; empty: 0 for all).
nb::ndarray<nb::numpy> threads_allreduce(nb::ndarray<nb::c_contig, nb::device::cpu> inputs,
                                         int op, int algorithm, size_t lane_bytes, int repeats,
                                         double timeout_s, int fault_rank, int ranks_per_node,
                                         size_t chunk_bytes, int fault_mode,
                                         std::vector<uint32_t> sites) {
  if (inputs.ndim() != 2) throw nb::value_error("inputs must have shape (nranks, count)");
  const int nranks = int(inputs.shape(0));
  const size_t count = inputs.shape(1);
  const DType dt = dtype_of(inputs);
  const size_t row = count * dtype_size(dt);
  if (nranks < 1 || nranks > kMaxRanks)
    throw nb::value_error(("threads_allreduce: 1 to " + std::to_string(kMaxRanks) + " ranks").c_str());
  if (op < 0 || op >= kNumRedOps) throw nb::value_error("threads_allreduce: unknown op");
  if (algorithm < 0 || algorithm >= kNumInternalAlgorithms)
    throw nb::value_error("threads_allreduce: unknown algorithm id");
  if (!schedule::hier_valid(nranks, ranks_per_node))
    throw nb::value_error(("threads_allreduce: ranks_per_node must be 0 (one node) or divide " +
                           std::to_string(nranks) + ", got " + std::to_string(ranks_per_node)).c_str());
  if (!sites.empty() && int(sites.size()) != nranks)
    throw nb::value_error("threads_allreduce: one site per rank");
  cpu::CommConfig cfg;
  cfg.nranks = nranks;
  cfg.lane_bytes = lane_bytes;
  cfg.timeout_s = timeout_s;
  cfg.fault_rank = fault_rank;
  cfg.fault_mode = fault_mode;
  cfg.ranks_per_node = ranks_per_node;
  cfg.chunk_bytes = chunk_bytes;
  const char* in = static_cast<const char*>(inputs.data());
  return on_threads(cfg, inputs, count, dtype_size(dt), repeats,
                    [&](cpu::Comm& comm, int r, char* out) {
                      Segment seg{0, count, in + r * row, out};
                      cpu::Turn turn;
                      turn.site = sites.empty() ? 0 : sites[size_t(r)];
                      return cpu::allreduce(comm, 0, r, dt, RedOp(op), Algorithm(algorithm), &seg,
                                            1, -1, &turn);
                    });
}

// Runs one reduce-scatter (call_op kOpReduceScatter) or all-gather (kOpAllGather) among
// `inputs.shape[0]` ranks on threads, as threads_allreduce: row r of `inputs` is rank r's
// input (nranks blocks for a reduce-scatter, one for an all-gather), row r of the result its
// output.
nb::ndarray<nb::numpy> threads_collective(nb::ndarray<nb::c_contig, nb::device::cpu> inputs,
                                          int call_op, int algorithm, size_t lane_bytes,
                                          int repeats, double timeout_s, int fault_rank,
                                          size_t chunk_bytes) {
  if (inputs.ndim() != 2) throw nb::value_error("inputs must have shape (nranks, count)");
  const int nranks = int(inputs.shape(0));
  const DType dt = dtype_of(inputs);
  const size_t esize = dtype_size(dt);
  if (nranks < 1 || nranks > kMaxRanks)
    throw nb::value_error(("threads_collective: 1 to " + std::to_string(kMaxRanks) + " ranks").c_str());
  if (call_op != kOpReduceScatter && call_op != kOpAllGather)
    throw nb::value_error("threads_collective: unknown collective op");
  const bool rs = call_op == kOpReduceScatter;
  const size_t in_count = inputs.shape(1);
  if (rs && in_count % size_t(nranks) != 0)
    throw nb::value_error("threads_collective: a reduce-scatter's row holds nranks blocks");
  const size_t block = rs ? in_count / size_t(nranks) : in_count;
  const size_t out_count = rs ? block : block * size_t(nranks);
  cpu::CommConfig cfg;
  cfg.nranks = nranks;
  cfg.lane_bytes = lane_bytes;
  cfg.timeout_s = timeout_s;
  cfg.fault_rank = fault_rank;
  cfg.chunk_bytes = chunk_bytes;
  const char* in = static_cast<const char*>(inputs.data());
  return on_threads(cfg, inputs, out_count, esize, repeats,
                    [&](cpu::Comm& comm, int r, char* out) {
                      return cpu::collective(comm, 0, r, dt, call_op, Algorithm(algorithm),
                                             in + size_t(r) * in_count * esize, out, block);
                    });
}

// Queues calls on the ranks' worker threads as the FFI handlers do (cpu::submit), each rank
// all of its calls at once, in the order `sites[r]` lists their sites (cpu_backend.h: Turn):
// rank r's j-th call all-reduces (sums) inputs[r, j] into out[r, j]. A harness for the order
// of a group's calls, which XLA's programs reach only where it hands a rank calls at once.
// Throws every call's error, one line each ("rank 1 call 0: ..."), by rank and call.
nb::ndarray<nb::numpy> worker_allreduce(nb::ndarray<nb::c_contig, nb::device::cpu> inputs,
                                        std::vector<std::vector<uint32_t>> sites,
                                        int algorithm, size_t lane_bytes, double timeout_s) {
  if (inputs.ndim() != 3) throw nb::value_error("inputs must have shape (nranks, ncalls, count)");
  const int nranks = int(inputs.shape(0));
  const size_t ncalls = inputs.shape(1), count = inputs.shape(2);
  const DType dt = dtype_of(inputs);
  const size_t row = count * dtype_size(dt);
  if (nranks < 1 || nranks > kMaxRanks)
    throw nb::value_error(("worker_allreduce: 1 to " + std::to_string(kMaxRanks) + " ranks").c_str());
  if (int(sites.size()) != nranks)
    throw nb::value_error("worker_allreduce: one list of sites per rank");
  for (const auto& list : sites)
    if (list.size() != ncalls) throw nb::value_error("worker_allreduce: one site per call");
  if (algorithm < 0 || algorithm >= kNumAlgorithms)
    throw nb::value_error("worker_allreduce: unknown algorithm id");
  cpu::CommConfig cfg;
  cfg.nranks = nranks;
  cfg.lane_bytes = lane_bytes;
  cfg.timeout_s = timeout_s;
  for (int r = 0; r < nranks; ++r) { cfg.group_of.push_back(0); cfg.rank_of.push_back(r); }
  const int64_t id = cpu::create_comm(cfg);
  std::shared_ptr<cpu::Comm> comm = cpu::find_comm(id);
  const char* in = static_cast<const char*>(inputs.data());
  const size_t total = size_t(nranks) * ncalls;
  char* out = new char[row * total + 1];
  std::vector<std::string> errors(total);
  std::mutex mu;
  std::condition_variable cv;
  size_t left = total;
  {
    nb::gil_scoped_release release;
    for (int r = 0; r < nranks; ++r) {
      for (size_t j = 0; j < ncalls; ++j) {
        const size_t k = size_t(r) * ncalls + j;
        Segment seg{0, count, in + k * row, out + k * row};
        auto finish = [&, k](const std::string& e) {
          std::lock_guard<std::mutex> lock(mu);
          errors[k] = e;
          --left;
          cv.notify_all();
        };
        const std::string err = cpu::submit(
            *comm, uint32_t(r),
            [comm, r, dt, algorithm, seg](cpu::Turn& turn) mutable {
              return cpu::allreduce_logical(*comm, uint32_t(r), dt, RedOp::kSum,
                                            Algorithm(algorithm), &seg, 1, -1, &turn);
            },
            finish, sites[size_t(r)][j], /*run_id=*/1);
        if (!err.empty()) finish(err);
      }
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return left == 0; });
  }
  comm.reset();
  cpu::destroy_comm(id);
  std::string all;
  for (size_t k = 0; k < total; ++k) {
    if (!errors[k].empty())
      all += "rank " + std::to_string(k / ncalls) + " call " + std::to_string(k % ncalls) + ": " +
             errors[k] + "\n";
  }
  if (!all.empty()) { delete[] out; throw std::runtime_error(all); }
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<char*>(p); });
  size_t shape[3] = {size_t(nranks), ncalls, count};
  return nb::ndarray<nb::numpy>(out, 3, shape, owner, nullptr, inputs.dtype());
}

}  // namespace

NB_MODULE(_jax_gin, m) {
  m.doc() = "jax_gin native module (CPU backend, FFI handlers, schedules)";
  // Communicators (and the workspaces they hold) live until the process exits, by design:
  // compiled programs refer to them. Do not report them as leaks at interpreter exit.
  nb::set_leak_warnings(false);

  m.def("registrations", []() {
    nb::dict d;
    d["jax_gin_all_reduce_cpu"] = encapsulate_ffi_handler(JaxGinCpuAllReduce);
    d["jax_gin_all_reduce_cpu_partitioned"] = encapsulate_ffi_handler(JaxGinCpuAllReducePartitioned);
    d["jax_gin_all_reduce_start_cpu"] = encapsulate_ffi_handler(JaxGinCpuAllReduceStart);
    d["jax_gin_all_reduce_done_cpu"] = encapsulate_ffi_handler(JaxGinCpuAllReduceDone);
    d["jax_gin_add_rmsnorm_cpu"] = encapsulate_ffi_handler(JaxGinCpuAddRmsNorm);
    d["jax_gin_add_layernorm_cpu"] = encapsulate_ffi_handler(JaxGinCpuAddLayerNorm);
    d["jax_gin_collective_cpu"] = encapsulate_ffi_handler(JaxGinCpuCollective);
    return d;
  });
  // Names by code of the element types and reduction ops (JAX_GIN_DTYPES, JAX_GIN_REDOPS in
  // common.h): what Python passes and checks.
  m.def("dtype_names", []() {
    std::vector<std::string> v;
#define JG_NAME(E, code, name, ...) v.push_back(#name);
    JAX_GIN_DTYPES(JG_NAME)
#undef JG_NAME
    return v;
  });
  m.def("op_names", []() {
    std::vector<std::pair<std::string, std::string>> v;  // (op, jax_gin function)
#define JG_NAME(E, code, name, api_name) v.emplace_back(#name, #api_name);
    JAX_GIN_REDOPS(JG_NAME)
#undef JG_NAME
    return v;
  });
  // The op codes of psum_scatter and all_gather (CallOp in common.h), by jax_gin function.
  m.def("collective_ops", []() {
    nb::dict d;
    d[call_op_name(kOpReduceScatter)] = int(kOpReduceScatter);
    d[call_op_name(kOpAllGather)] = int(kOpAllGather);
    return d;
  });
  m.def("algorithm_names", []() {
    std::vector<std::string> v;
    for (int a = 0; a < kNumAlgorithms; ++a) v.push_back(algorithm_name(Algorithm(a)));
    return v;
  });

  // Runtime: communicators of the CPU backend.
  m.def("cpu_comm_create",
        [](int nranks, std::vector<int32_t> group_of, std::vector<int32_t> rank_of,
           size_t lane_bytes, double timeout_s, int fault_rank, nb::object workspaces,
           int fault_mode, int record_entries, std::string absent_note, int64_t id,
           std::vector<std::string> group_text, std::vector<int32_t> device_id) {
          if (nranks < 1 || nranks > kMaxRanks)
            throw nb::value_error(("jax_gin supports 1 to " + std::to_string(kMaxRanks) +
                                   " ranks per group, got " + std::to_string(nranks)).c_str());
          if (group_of.size() != rank_of.size()) throw nb::value_error("group_of/rank_of differ");
          cpu::CommConfig cfg;
          cfg.nranks = nranks;
          cfg.group_of = std::move(group_of);
          cfg.rank_of = std::move(rank_of);
          cfg.lane_bytes = lane_bytes;
          cfg.timeout_s = timeout_s;
          cfg.fault_rank = fault_rank;
          cfg.fault_mode = fault_mode;
          cfg.record_entries = record_entries;
          cfg.absent_note = std::move(absent_note);
          cfg.id = id;
          cfg.group_text = std::move(group_text);
          cfg.device_id = std::move(device_id);
          if (workspaces.is_none()) return cpu::create_comm(cfg);
          // One Workspace (or None: no rank of that group runs here) per group.
          std::vector<std::shared_ptr<cpu::Workspace>> ws;
          for (nb::handle w : workspaces)
            ws.push_back(w.is_none() ? nullptr : nb::cast<std::shared_ptr<cpu::Workspace>>(w));
          try {
            return cpu::create_comm(cfg, std::move(ws));
          } catch (const std::invalid_argument& e) {
            throw nb::value_error(e.what());
          }
        },
        nb::arg("nranks"), nb::arg("group_of"), nb::arg("rank_of"), nb::arg("lane_bytes"),
        nb::arg("timeout_s"), nb::arg("fault_rank") = -1, nb::arg("workspaces") = nb::none(),
        nb::arg("fault_mode") = 0, nb::arg("record_entries") = kRecDefaultEntries,
        nb::arg("absent_note") = std::string(), nb::arg("id") = 0,
        nb::arg("group_text") = std::vector<std::string>(),
        nb::arg("device_id") = std::vector<int32_t>());

  // Flight recorder (include/jax_gin/recorder.h).
  m.def("set_record", &cpu::set_record, nb::arg("on"), "write the recorder's ring (process-wide)");
  m.def("recording", &cpu::recording);
  m.def("cpu_recorder_entries", [](int64_t id) {
          auto comm = cpu::find_comm(id);
          if (!comm) throw nb::value_error(("jax_gin: no communicator " + std::to_string(id)).c_str());
          nb::list out;
          for (const auto& g : comm->groups) {
            if (!g->ws) continue;
            for (int r = 0; r < g->ws->nranks(); ++r)
              if (g->ws->runs_here(r))
                for (const RecEntry& e : cpu::recorder_entries(*g->ws, r)) out.append(entry_dict(e));
          }
          return out;
        }, nb::arg("comm"), "the recorded calls of the ranks this process runs, by rank, oldest first");
  m.def("cpu_call_counts", [](int64_t id) {
          auto comm = cpu::find_comm(id);
          if (!comm) throw nb::value_error(("jax_gin: no communicator " + std::to_string(id)).c_str());
          std::vector<std::array<int64_t, 3>> out;
          for (size_t g = 0; g < comm->groups.size(); ++g) {
            const auto& ws = comm->groups[g]->ws;
            if (!ws) continue;
            for (int r = 0; r < ws->nranks(); ++r)
              if (ws->runs_here(r)) out.push_back({int64_t(g), r, int64_t(cpu::calls_entered(*ws, r))});
          }
          return out;
        }, nb::arg("comm"),
        "(group, rank, calls entered) of the ranks this process runs: a recorded call's seq "
        "numbers it among them");
  m.def("cpu_laggard_report", [](int64_t id, int group, int rank) {
          auto comm = cpu::find_comm(id);
          if (!comm || group < 0 || group >= int(comm->groups.size()) || !comm->groups[group]->ws)
            throw nb::value_error("jax_gin: no such communicator or group here");
          return cpu::laggard_report(*comm->groups[group]->ws, group, rank);
        }, nb::arg("comm"), nb::arg("group"), nb::arg("rank"));
  m.attr("RECORD_EVENTS") = kRecEvents;
  // An entry filled from notes (kind, step, peer, value, t), with round0 1, as entry_dict
  // reads it: by rec_mark, as the GPU kernels note (raw), or by rec_note, as the CPU backend.
  m.def("rec_notes", [](const std::vector<std::array<int64_t, 5>>& notes, bool raw) {
          RecEntry e{};
          rec_open(e, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0);
          int k = 0;  // rec_mark's count
          for (const auto& n : notes) {
            if (raw)
              k = rec_mark(e, k, uint8_t(n[0]), int(n[1]), int(n[2]), uint64_t(n[3]), uint64_t(n[4]));
            else
              rec_note(e, uint8_t(n[0]), int(n[1]), int(n[2]), uint64_t(n[3]), 1, uint64_t(n[4]));
          }
          if (raw) rec_marked(e, k);
          return entry_dict(e);
        }, nb::arg("notes"), nb::arg("raw"));
  // The hang report's diagnosis from the ranks' states (include/jax_gin/laggard.h), as the
  // CPU backend and the GPU's reports write it; each state is (seq, done, wait_seq,
  // wait_round, wait_peer, wait_step, op, algorithm, failed, wait_place, wait_kind);
  // late_peer as laggard_text's.
  m.def("laggard_text", [](const std::vector<std::vector<int64_t>>& states, int group, int self,
                           int late_peer, bool turn_checked) {
          std::vector<Seen> s;
          for (const auto& v : states) {
            if (v.size() != 11) throw nb::value_error("laggard_text: 11 fields per rank");
            s.push_back(Seen{uint64_t(v[0]), uint64_t(v[1]), uint64_t(v[2]), uint64_t(v[3]),
                             int(v[4]), int(v[5]), int(v[6]), int(v[7]), v[8] != 0, int(v[9]),
                             int(v[10])});
          }
          return laggard_text(s, group, self, late_peer, turn_checked);
        }, nb::arg("states"), nb::arg("group"), nb::arg("self"), nb::arg("late_peer") = -1,
        nb::arg("turn_checked") = true);

  // Workspaces: one group's windows, flags and round counters, in private memory or in a
  // POSIX shared-memory segment that several processes map (see jax_gin/_distributed.py).
  nb::class_<cpu::Workspace>(m, "Workspace",
                             "one group's symmetric workspace (private or POSIX shared memory)")
      .def_static("private", &cpu::Workspace::create_private, nb::arg("nranks"),
                  nb::arg("lane_bytes"), nb::arg("record_entries") = kRecDefaultEntries,
                  "private memory; every rank joined")
      .def_static("create", &cpu::Workspace::create_shared, nb::arg("name"), nb::arg("nranks"),
                  nb::arg("lane_bytes"), nb::arg("record_entries") = kRecDefaultEntries,
                  "a new shared-memory segment (fails if it exists)")
      .def_static("attach", &cpu::Workspace::attach_shared, nb::arg("name"), nb::arg("nranks"),
                  nb::arg("lane_bytes"), nb::arg("record_entries") = kRecDefaultEntries,
                  "map a segment that another process created")
      .def("join", [](cpu::Workspace& w, std::vector<int> ranks, int process) {
             for (int r : ranks) {
               if (r < 0 || r >= w.nranks()) throw nb::index_error("rank out of range");
               w.join(r, process);
             }
           }, nb::arg("ranks"), nb::arg("process") = 0,
           "this process (jax.process_index() `process`) runs `ranks`")
      .def("wait_joined", &cpu::Workspace::wait_joined, nb::arg("timeout_s"),
           nb::call_guard<nb::gil_scoped_release>(),
           "wait until every rank joined; returns the ranks still missing after the timeout")
      .def("unlink", &cpu::Workspace::unlink, "remove the segment's name; the mapping stays")
      .def_prop_ro("name", &cpu::Workspace::name)
      .def_prop_ro("linked", &cpu::Workspace::linked)
      .def_prop_ro("nranks", &cpu::Workspace::nranks)
      .def_prop_ro("broken", [](cpu::Workspace& w) { return w.header().broken.load() != 0; });
  m.def("cpu_unlink_all_workspaces", &cpu::unlink_all_workspaces,
        "unlink every segment name this process created or mapped and has not unlinked");
  m.def("shm_unlink", [](const std::string& name) { return shm_unlink(name.c_str()) == 0; },
        nb::arg("name"), "remove a POSIX shared-memory name; False if there was none");
  m.def("cpu_comm_destroy", &cpu::destroy_comm);
  m.def("cpu_shutdown", &cpu::shutdown,
        "At interpreter exit: calls still running on this process's communicators give up.");
  m.def("cpu_comm_set_fingerprint", &cpu::set_fingerprint, nb::arg("comm"), nb::arg("fingerprint"),
        "the fingerprint that the custom calls' comm attribute carries (ffi_common.h)");
  m.def("cpu_num_comms", &cpu::num_comms);
  m.def("threads_allreduce", &threads_allreduce, nb::arg("inputs"), nb::arg("op"),
        nb::arg("algorithm"), nb::arg("lane_bytes"), nb::arg("repeats") = 1,
        nb::arg("timeout_s") = kDefaultTimeoutS, nb::arg("fault_rank") = -1, nb::arg("ranks_per_node") = 0,
        nb::arg("chunk_bytes") = cpu::CommConfig().chunk_bytes, nb::arg("fault_mode") = 0,
        nb::arg("sites") = std::vector<uint32_t>());
  m.def("worker_allreduce", &worker_allreduce, nb::arg("inputs"), nb::arg("sites"),
        nb::arg("algorithm"), nb::arg("lane_bytes"), nb::arg("timeout_s") = kDefaultTimeoutS);
  m.def("threads_collective", &threads_collective, nb::arg("inputs"), nb::arg("op"),
        nb::arg("algorithm"), nb::arg("lane_bytes"), nb::arg("repeats") = 1,
        nb::arg("timeout_s") = kDefaultTimeoutS, nb::arg("fault_rank") = -1,
        nb::arg("chunk_bytes") = cpu::CommConfig().chunk_bytes);
  // Internal algorithm ids (not in jax_gin.ALGORITHMS): the id the FFI handlers take for a
  // group that spans nodes (_runtime.algorithm_code), and for tests through threads_allreduce.
  m.attr("ALGORITHM_HIERARCHICAL") = int(Algorithm::kHierarchical);
  // Segment and block boundaries are multiples of this many bytes (common.h kAlignBytes).
  m.attr("ALIGN_BYTES") = kAlignBytes;
  // Most buffers one call reduces as one message (message.h); larger pytrees take more calls.
  m.attr("MAX_SEGMENTS") = kMaxSegments;
  // Event slots per rank of asynchronous start/done pairs (GPU).
  m.attr("ASYNC_SLOTS") = kAsyncSlots;
  // The largest group and the most lanes (CTAs) of one call (common.h), for Python's checks.
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_LANES") = kMaxLanes;
  // The most entries of a flight-recorder ring, and whether a count is one the backends take
  // (recorder.h: a power of two up to that).
  m.attr("REC_MAX_ENTRIES") = kRecMaxEntries;
  m.attr("REC_DEFAULT_ENTRIES") = kRecDefaultEntries;
  // Defaults of jax_gin.runtime.settings that native code also needs (common.h, cpu_backend.h).
  m.attr("DEFAULT_TIMEOUT_S") = kDefaultTimeoutS;
  m.attr("CPU_DEFAULT_LANE_BYTES") = cpu::CommConfig().lane_bytes;
  m.def("rec_entries_ok", [](int64_t n) { return rec_entries_ok(n); }, nb::arg("n"));

  // Schedules (include/jax_gin/schedule.h), exposed for unit tests.
  nb::module_ s = m.def_submodule("schedule", "the shared schedule header, for tests");
  s.def("piece", [](size_t n, size_t parts, size_t j, size_t align) {
    auto r = schedule::piece(n, parts, j, align);
    return std::make_pair(r.offset, r.count);
  });
  s.def("ring_next", &schedule::ring_next);
  s.def("ring_prev", &schedule::ring_prev);
  s.def("ring_rs_send", &schedule::ring_rs_send);
  s.def("ring_rs_recv", &schedule::ring_rs_recv);
  s.def("ring_owned", &schedule::ring_owned);
  s.def("ring_ag_send", &schedule::ring_ag_send);
  s.def("ring_ag_recv", &schedule::ring_ag_recv);
  s.def("tree_parent", [](int r, int n, int t) { return schedule::tree_parent(r, n, t); },
        nb::arg("r"), nb::arg("n"), nb::arg("t") = 0);
  s.def("tree_child", [](int r, int k, int n, int t) { return schedule::tree_child(r, k, n, t); },
        nb::arg("r"), nb::arg("k"), nb::arg("n"), nb::arg("t") = 0);
  s.def("tree_child_index", [](int r, int n, int t) { return schedule::tree_child_index(r, n, t); },
        nb::arg("r"), nb::arg("n"), nb::arg("t") = 0);
  s.def("tree_half", [](size_t n, int t, size_t align) {
    auto r = schedule::tree_half(n, t, align);
    return std::make_pair(r.offset, r.count);
  });
  s.def("chunks_for", &schedule::chunks_for);
  s.def("coll_slot_elems", [](int algo, int n, size_t lane_bytes, size_t elem_size) {
    return schedule::coll_slot_elems(Algorithm(algo), n, lane_bytes, elem_size);
  }, "psum_scatter / all_gather: elements per window slot (0: the window is too small)");
  s.def("coll_slots", [](int algo, int n) { return schedule::coll_slots(Algorithm(algo), n); });
  s.def("chunk", [](size_t off, size_t count, int chunks, int c, size_t align) {
    auto r = schedule::chunk(schedule::Range{off, count}, chunks, c, align);
    return std::make_pair(r.offset, r.count);
  });
  s.attr("MAX_CHUNKS") = kMaxChunks;
  s.def("num_slots", [](int a, int n, int rpn) { return schedule::num_slots(Algorithm(a), n, rpn); },
        nb::arg("a"), nb::arg("n"), nb::arg("ranks_per_node") = 0);
  s.def("slot_elems", [](int a, int n, size_t lane_bytes, size_t esize, int rpn) {
    return schedule::slot_elems(Algorithm(a), n, lane_bytes, esize, rpn);
  }, nb::arg("a"), nb::arg("n"), nb::arg("lane_bytes"), nb::arg("esize"), nb::arg("ranks_per_node") = 0);
  s.def("round_capacity", [](int a, int n, size_t lane_bytes, size_t esize, int rpn) {
    return schedule::round_capacity(Algorithm(a), n, lane_bytes, esize, rpn);
  }, nb::arg("a"), nb::arg("n"), nb::arg("lane_bytes"), nb::arg("esize"), nb::arg("ranks_per_node") = 0);
  s.def("hier_local_size", &schedule::hier_local_size);
  s.def("hier_valid", &schedule::hier_valid);
  s.def("hier_nodes", &schedule::hier_nodes);
  s.def("hier_node", &schedule::hier_node);
  s.def("hier_local", &schedule::hier_local);
  s.def("hier_rank", &schedule::hier_rank);
  s.def("hier_rail_next", &schedule::hier_rail_next);
  s.def("hier_rail_prev", &schedule::hier_rail_prev);
  s.def("hier_segment", [](size_t n, int L, int l, size_t align) {
    auto r = schedule::hier_segment(n, L, l, align);
    return std::make_pair(r.offset, r.count);
  });
  s.def("hier_subpiece", [](size_t n, int L, int M, int l, int j, size_t align) {
    auto r = schedule::hier_subpiece(n, L, M, l, j, align);
    return std::make_pair(r.offset, r.count);
  });
  s.attr("HIER_SCATTER_STEP") = schedule::kHierScatterStep;
  s.def("hier_ring_step", &schedule::hier_ring_step);
  s.def("hier_gather_step", &schedule::hier_gather_step);
  s.def("hier_steps", &schedule::hier_steps);
  s.def("hier_scatter_slot", &schedule::hier_scatter_slot);
  s.def("hier_gather_slot", &schedule::hier_gather_slot);
  s.def("hier_segment_slots", &schedule::hier_segment_slots);
  s.def("hier_ring_slots", &schedule::hier_ring_slots);
  s.def("hier_ring_slot_elems", &schedule::hier_ring_slot_elems);
  s.def("hier_window_elems", &schedule::hier_window_elems);
  s.def("hier_slot_fit", &schedule::hier_slot_fit);
}
