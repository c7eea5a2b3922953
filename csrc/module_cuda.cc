// The CUDA nanobind module: exports the CUDA FFI handlers and the GPU runtime's calls. Built
// only where nvcc and NCCL's headers exist; jax_gin works without it on CPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/vector.h>

#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "ffi_cuda.h"
#include "jax_gin/recorder.h"
#include "kernels.h"
#include "nccl_runtime.h"
#include "recorder_dict.h"

namespace nb = nanobind;
using namespace jax_gin;

namespace {

using OptBytes = std::optional<size_t>;

gpu::LaunchSettings launch_settings(std::optional<int> max_lanes, OptBytes lane_grain_bytes,
                                    OptBytes chunk_bytes, OptBytes one_shot_chunk_bytes,
                                    OptBytes ll_max_bytes, bool experimental_gin,
                                    int record_entries) {
  if (!rec_entries_ok(record_entries))
    throw nb::value_error(("jax_gin: record_entries must be a power of two from 1 to " +
                           std::to_string(kRecMaxEntries)).c_str());
  if (max_lanes && (*max_lanes < 1 || *max_lanes > kMaxLanes))
    throw nb::value_error(("jax_gin: max_lanes must be 1 to " + std::to_string(kMaxLanes)).c_str());
  if (lane_grain_bytes && *lane_grain_bytes == 0)
    throw nb::value_error("jax_gin: lane_grain_bytes must be positive");
  return gpu::LaunchSettings{max_lanes,    lane_grain_bytes, chunk_bytes, one_shot_chunk_bytes,
                             ll_max_bytes, experimental_gin, record_entries};
}

}  // namespace

// The launch settings of comm_create and comm_create_ranks (jax_gin.runtime.settings; None:
// the kernels' default).
#define JG_LAUNCH_ARGS                                                                        \
  nb::arg("max_lanes") = nb::none(), nb::arg("lane_grain_bytes") = nb::none(),               \
      nb::arg("chunk_bytes") = nb::none(), nb::arg("one_shot_chunk_bytes") = nb::none(),     \
      nb::arg("ll_max_bytes") = nb::none(), nb::arg("experimental_gin") = false,            \
      nb::arg("record_entries") = kRecDefaultEntries

NB_MODULE(_jax_gin_cuda, m) {
  m.doc() = "jax_gin CUDA backend: NCCL device-API communicators and kernels";
  // Refuse to load against an NCCL whose device-API structs differ from our headers.
  if (std::string why = gpu::check_nccl_version(); !why.empty()) throw std::runtime_error(why);
  // Peers that did not come to a set-up in time: Python's TimeoutError (jax_gin re-raises it
  // as BootstrapTimeoutError, like the key-value bootstrap's).
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const gpu::TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });

  m.def("registrations", []() {
    nb::dict d;
    d["jax_gin_all_reduce_cuda"] = nb::capsule(reinterpret_cast<void*>(JaxGinCudaAllReduce));
    d["jax_gin_all_reduce_start_cuda"] = nb::capsule(reinterpret_cast<void*>(JaxGinCudaAllReduceStart));
    d["jax_gin_all_reduce_done_cuda"] = nb::capsule(reinterpret_cast<void*>(JaxGinCudaAllReduceDone));
    d["jax_gin_add_rmsnorm_cuda"] = nb::capsule(reinterpret_cast<void*>(JaxGinCudaAddRmsNorm));
    d["jax_gin_add_layernorm_cuda"] = nb::capsule(reinterpret_cast<void*>(JaxGinCudaAddLayerNorm));
    d["jax_gin_collective_cuda"] = nb::capsule(reinterpret_cast<void*>(JaxGinCudaCollective));
    return d;
  });
  m.def("comm_create",
        [](std::vector<std::vector<int>> groups, size_t workspace_bytes, double timeout_s,
           int fault_rank, std::optional<int> max_lanes, OptBytes lane_grain_bytes,
           OptBytes chunk_bytes, OptBytes one_shot_chunk_bytes, OptBytes ll_max_bytes,
           bool experimental_gin, int record_entries, int64_t id) {
          const gpu::LaunchSettings launch =
              launch_settings(max_lanes, lane_grain_bytes, chunk_bytes, one_shot_chunk_bytes,
                              ll_max_bytes, experimental_gin, record_entries);
          nb::gil_scoped_release release;
          return gpu::comm_create(groups, workspace_bytes, timeout_s, fault_rank, launch, id);
        },
        nb::arg("groups"), nb::arg("workspace_bytes"), nb::arg("timeout_s"),
        nb::arg("fault_rank") = -1, JG_LAUNCH_ARGS, nb::arg("id") = 0);
  m.def("unique_id", []() {
          std::string id = gpu::unique_id();
          return nb::bytes(id.data(), id.size());
        },
        "A fresh ncclUniqueId, as bytes (this process hosts NCCL's bootstrap root for it).");
  m.def("comm_create_ranks",
        [](nb::list groups, size_t workspace_bytes, double timeout_s, int fault_rank,
           std::optional<int> max_lanes, OptBytes lane_grain_bytes, OptBytes chunk_bytes,
           OptBytes one_shot_chunk_bytes, OptBytes ll_max_bytes, bool experimental_gin,
           int record_entries, int64_t id) {
          const gpu::LaunchSettings launch =
              launch_settings(max_lanes, lane_grain_bytes, chunk_bytes, one_shot_chunk_bytes,
                              ll_max_bytes, experimental_gin, record_entries);
          // groups: [(group, nranks, unique_id bytes, [ranks here], [local CUDA ordinals])]
          std::vector<gpu::GroupSpec> specs;
          for (nb::handle h : groups) {
            nb::tuple t = nb::cast<nb::tuple>(h);
            if (t.size() != 5) throw nb::value_error("comm_create_ranks: each group is a 5-tuple");
            gpu::GroupSpec s;
            s.group = nb::cast<int>(t[0]);
            s.nranks = nb::cast<int>(t[1]);
            nb::bytes id = nb::cast<nb::bytes>(t[2]);
            s.unique_id.assign(id.c_str(), id.size());
            s.ranks = nb::cast<std::vector<int>>(t[3]);
            s.devices = nb::cast<std::vector<int>>(t[4]);
            specs.push_back(std::move(s));
          }
          nb::gil_scoped_release release;
          return gpu::comm_create_ranks(specs, workspace_bytes, timeout_s, fault_rank, launch,
                                        id);
        },
        nb::arg("groups"), nb::arg("workspace_bytes"), nb::arg("timeout_s"),
        nb::arg("fault_rank") = -1, JG_LAUNCH_ARGS, nb::arg("id") = 0,
        "Several processes: this process's ranks of each group, joined by ncclCommInitRank.");
  m.def("comm_destroy", [](int64_t id) {
    nb::gil_scoped_release release;
    gpu::comm_destroy(id);
  });
  m.def("comm_set_fingerprint", &gpu::set_fingerprint, nb::arg("comm"), nb::arg("fingerprint"),
        "the fingerprint that the custom calls' comm attribute carries (ffi_common.h)");
  m.def("comm_set_group_text", &gpu::set_group_text, nb::arg("comm"), nb::arg("texts"),
        "the last line of the hang reports of each group (by index): its mesh axes and devices");
  m.def("comm_ranks_per_node", &gpu::comm_ranks_per_node, nb::arg("comm"),
        "Ranks per node if the communicator's groups span nodes (hierarchical only), else 0.");
  m.def("diagnostics", &gpu::diagnostics, nb::arg("comm") = -1,
        "Messages of timed-out waits recorded on the device (readable after a failed launch).");
  // The recorder's functions wait for copies from the devices: without the GIL, so that a
  // host callback of a program in flight (which needs it) cannot stall them.
  m.def("set_record", &gpu::set_record, nb::arg("on"), nb::call_guard<nb::gil_scoped_release>(),
        "the flight recorder of every rank of this process, and of communicators created later");
  m.def("recording", &gpu::recording);
  m.def("recorder_entries", [](int64_t id) {
          std::vector<RecEntry> entries;
          try {
            nb::gil_scoped_release release;
            entries = gpu::recorder_entries(id);
          } catch (const std::invalid_argument& e) {
            throw nb::value_error(e.what());
          }
          nb::list out;
          for (const RecEntry& e : entries) out.append(entry_dict(e));
          return out;
        }, nb::arg("comm"), "the recorded calls of this process's ranks (lane 0), by rank, oldest first");
  m.def("recorder_counts", [](int64_t id) {
          try {
            nb::gil_scoped_release release;
            return gpu::recorder_counts(id);
          } catch (const std::invalid_argument& e) {
            throw nb::value_error(e.what());
          }
        }, nb::arg("comm"), "[(group, rank, calls recorded)] of this process's ranks");
  m.def("lane_bytes", &gpu::lane_bytes_for_workspace);
  m.def("default_max_lanes", &gpu::default_max_lanes,
        "The default lane cap on a local CUDA device: its SM count, at most kMaxLanes.");
  m.def("default_launch", []() {
          const gpu::LaunchConfig c;
          nb::dict d;
          d["max_lanes"] = c.max_lanes;
          d["lane_grain_bytes"] = c.lane_grain_bytes;
          d["chunk_bytes"] = c.chunk_bytes;
          d["one_shot_chunk_bytes"] = c.one_shot_chunk_bytes;
          d["ll_max_bytes"] = c.ll_max_bytes;
          return d;
        },
        "The kernels' defaults of the launch settings left None (LaunchConfig); a device caps "
        "max_lanes further at its SM count (default_max_lanes).");
  m.def("choose_lanes", [](int algo, size_t bytes, int nranks, int max_lanes) {
    return gpu::choose_lanes(Algorithm(algo), bytes, nranks, max_lanes);
  });
  m.def("nccl_version", &gpu::nccl_runtime_version);
  m.def("nccl_header_version", []() { return int(NCCL_VERSION_CODE); });
  m.def("shutdown", []() {
    nb::gil_scoped_release release;
    gpu::shutdown();
  });
}
