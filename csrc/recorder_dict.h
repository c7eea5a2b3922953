// A flight-recorder entry (include/jax_gin/recorder.h) as a Python dict, for both nanobind
// modules (CPU and CUDA), so that jax_gin.trace reads one format.
#pragma once

#include <nanobind/nanobind.h>

#include "jax_gin/common.h"
#include "jax_gin/recorder.h"

namespace jax_gin {

// One flight-recorder entry (recorder.h) as a dict, its phases folded into runs; events as
// (kind, step, peer, round, t_first, t_last, count) tuples, round relative to round0.
inline nanobind::dict entry_dict(const RecEntry& raw) {
  RecEntry e = raw;
  rec_settle(e);  // a GPU kernel's phases are stored raw
  nanobind::dict d;
  d["seq"] = e.seq;
  d["t_start"] = e.t_start;
  d["t_end"] = e.t_end;
  d["bytes"] = e.bytes;
  d["round0"] = e.round0;
  d["rounds"] = e.rounds;
  d["comm"] = e.comm;
  d["group"] = e.group;
  d["rank"] = e.rank;
  d["lane"] = e.lane;
  d["op"] = call_op_name(e.op);
  d["algorithm"] = algorithm_name(Algorithm(e.algorithm));
  d["dtype"] = dtype_name(DType(e.dtype));
  d["status"] = e.status == kRecDone ? "done" : e.status == kRecFailed ? "failed" : "running";
  d["dropped"] = e.dropped;
  nanobind::list ev;
  static const char* kinds[] = {"?", "send", "wait", "credit", "credit_wait"};
  for (int i = 0; i < e.nevents && i < kRecEvents; ++i) {
    const RecEvent& x = e.events[i];
    ev.append(nanobind::make_tuple(kinds[x.kind <= 4 ? x.kind : 0], int(x.step), int(x.peer),
                                   int(x.round), x.t_first, x.t_last, int(x.count)));
  }
  d["events"] = ev;
  return d;
}

}  // namespace jax_gin
