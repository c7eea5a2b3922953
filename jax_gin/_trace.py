"""Timelines from the flight recorder: jax_gin.trace(path) and `python -m jax_gin.trace merge`.

Inside `with jax_gin.trace(path):` the recorder (include/jax_gin/recorder.h) is on; at exit
every call that the devices of this process ran in the block is written as a Chrome/Perfetto
trace (JSON `traceEvents`): pid = process index, tid = device id, one span per call named
"<op> <algorithm>" with args (bytes, dtype, round, rounds, seq, ...), and within it a span or
instant per recorded phase (sends and satisfied waits of each step, coalesced over chunks and
peers; on GPUs, lane 0's). Times are the recorder's clock in microseconds: CLOCK_MONOTONIC on
CPU devices, which the processes of one host share, and the GPUs' %globaltimer on GPUs;
`merge` rebases files onto their earliest event.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
import warnings

CLOCK = "CLOCK_MONOTONIC"
GPU_CLOCK = "%globaltimer"  # the GPUs' global nanosecond timer (their entries' times)


def _events(entries: list, pid: int) -> list:
    out = []
    for e in entries:
        tid = e["tid"]
        t0, t1 = e["t_start"], e["t_end"] or e["t_start"]
        args = {k: e[k] for k in ("bytes", "dtype", "round0", "rounds", "seq", "comm", "group",
                                  "rank", "status", "dropped")}
        args["round"] = args.pop("round0")
        out.append({"name": f"{e['op']} {e['algorithm']}", "cat": "jax_gin", "ph": "X",
                    "pid": pid, "tid": tid, "ts": t0 / 1e3, "dur": (t1 - t0) / 1e3, "args": args})
        for kind, step, peer, rnd, first, last, count in e["events"]:
            name = kind.replace("_", " ") if kind.startswith("credit") else f"{kind} step {step}"
            ev = {"name": name, "cat": "jax_gin.phase", "pid": pid, "tid": tid, "ts": first / 1e3,
                  "args": {"kind": kind, "step": step, "peer": peer,
                           "round": e["round0"] + rnd, "count": count}}
            if last > first:
                ev.update(ph="X", dur=(last - first) / 1e3)
            else:
                ev.update(ph="i", s="t")
            out.append(ev)
    return out


def gpu_marks() -> dict:
    """(comm, group, rank) -> calls recorded so far, for this process's GPU ranks."""
    from . import _native, _runtime
    marks = {}
    if not hasattr(_native.cuda, "recorder_counts"):
        return marks
    for comm in list(_runtime.gpu_comm_devices):
        try:
            for group, rank, n in _native.cuda.recorder_counts(comm):
                marks[(comm, group, rank)] = n
        except ValueError:  # destroyed meanwhile
            continue
    return marks


def _gather(comms: dict, read, keep) -> list:
    """The entries read(comm) of every communicator of `comms` ({comm: (device ids by logical
    id, GroupLayout)}) that keep(comm, entry) accepts, each with its device id as "tid"."""
    entries = []
    for comm, (device_ids, layout) in list(comms.items()):
        try:
            got = read(comm)
        except ValueError:  # destroyed meanwhile
            continue
        device = {(layout.group_of[i], layout.rank_of[i]): d for i, d in enumerate(device_ids)}
        for e in got:
            if keep(comm, e):
                e["tid"] = device.get((e["group"], e["rank"]), 1_000_000 + e["rank"])
                entries.append(e)
    return entries


def collect(t_begin_ns: int, t_end_ns: int | None = None, marks: dict | None = None) -> list:
    """The recorded calls of this process's ranks, as trace events with metadata for the
    process and each device: CPU calls that entered in [t_begin_ns, t_end_ns]
    (time.monotonic_ns()), GPU calls recorded after `marks` (gpu_marks())."""
    import jax

    from . import _native, _runtime
    pid = int(jax.process_index())
    entries = _gather(_runtime.comm_devices, _native.cpu.cpu_recorder_entries,
                      lambda comm, e: e["t_start"] >= t_begin_ns and
                      (t_end_ns is None or e["t_start"] <= t_end_ns))
    if hasattr(_native.cuda, "recorder_entries"):
        marks = marks or {}
        entries += _gather(_runtime.gpu_comm_devices, _native.cuda.recorder_entries,
                           lambda comm, e: e["seq"] > marks.get((comm, e["group"], e["rank"]), 0))
    entries.sort(key=lambda e: (e["t_start"], e["rank"]))
    events = [{"name": "process_name", "ph": "M", "pid": pid,
               "args": {"name": f"process {pid} ({socket.gethostname()})"}}]
    for tid in sorted({e["tid"] for e in entries}):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": f"device {tid}"}})
    return events + _events(entries, pid)


def write(path, events: list, **meta) -> None:
    import jax
    info = {"clock": CLOCK, "host": socket.gethostname(), "process": int(jax.process_index())}
    info.update(meta)
    doc = {"traceEvents": events, "displayTimeUnit": "ns", "metadata": {"jax_gin": info}}
    with open(path, "w") as f:
        json.dump(doc, f)


def _check_writable(path, who: str) -> None:
    """Raise OSError naming `path` if a file cannot be created there (checked before any
    work, so that a bad path does not cost the run that would fill it)."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{who}: cannot write {path}: it is a directory")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{who}: cannot write {path}: directory {d} does not exist")
    if not os.access(d, os.W_OK | os.X_OK) or (os.path.exists(path) and
                                                not os.access(path, os.W_OK)):
        raise PermissionError(f"{who}: cannot write {path}: permission denied")


@contextlib.contextmanager
def trace(path):
    """Write every jax_gin call that this process's devices run inside the block to `path`
    as a Chrome/Perfetto trace (see the module docstring). The recorder is on for the block;
    results must be ready (jax.block_until_ready) before the block ends. The recorder keeps
    the last JAX_GIN_RECORD_ENTRIES calls per rank: a longer block keeps only its last ones.
    A path that cannot be written raises on entry; if writing fails at exit while the block
    raised, the block's exception propagates and the failure is a warning."""
    from . import _runtime
    _check_writable(path, "jax_gin.trace")
    before = _runtime.settings.record
    marks = gpu_marks()
    _runtime.settings.record = True
    t0 = time.monotonic_ns()
    body_raised = False
    try:
        yield path
    except BaseException:
        body_raised = True
        raise
    finally:
        t1 = time.monotonic_ns()
        _runtime.settings.record = before
        try:
            events = collect(t0, t1, marks)
            gpu = bool(_runtime.gpu_comm_devices)
            write(path, events, **({"clock": GPU_CLOCK} if gpu else {}))
        except Exception as err:
            if not body_raised:
                raise
            # the block's own exception is the one to see; this one must not replace it
            warnings.warn(f"jax_gin.trace: {os.fspath(path)} not written: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)


def merge(paths: list, out) -> dict:
    """One trace from the per-process files `paths`: events of every file, on one time axis
    (the recorded clock, rebased to the earliest event), a file's pid kept unless another
    file used it already."""
    docs = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or "traceEvents" not in doc:
            raise ValueError(f"jax_gin.trace merge: {p} is not a trace (no traceEvents)")
        docs.append((p, doc))
    clocks = {(d.get("metadata", {}).get("jax_gin", {}).get("clock"),
               d.get("metadata", {}).get("jax_gin", {}).get("host")) for _, d in docs}
    if len(clocks) > 1:
        print("jax_gin.trace merge: the files come from different clocks or hosts "
              f"({sorted(map(str, clocks))}); their times are not aligned", file=sys.stderr)
    stamps = [e["ts"] for _, d in docs for e in d["traceEvents"] if "ts" in e]
    base = min(stamps) if stamps else 0.0
    used: set = set()
    events: list = []
    for _, d in docs:
        pids = {e.get("pid") for e in d["traceEvents"] if "pid" in e}
        remap = {}
        for p in sorted(pids, key=str):
            q = p
            while q in used:
                q = (q if isinstance(q, int) else 0) + 1000
            remap[p] = q
        used |= set(remap.values())
        for e in d["traceEvents"]:
            e = dict(e)
            if "pid" in e:
                e["pid"] = remap[e["pid"]]
            if "ts" in e:
                e["ts"] = e["ts"] - base
            events.append(e)
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0.0)))
    doc = {"traceEvents": events, "displayTimeUnit": "ns",
           "metadata": {"jax_gin": {"clock": sorted(map(str, clocks)), "origin_us": base,
                                    "merged": [str(p) for p in paths]}}}
    with open(out, "w") as f:
        json.dump(doc, f)
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_gin.trace",
                                 description="jax_gin trace files (Chrome/Perfetto JSON)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge per-process trace files into one")
    m.add_argument("files", nargs="+", metavar="FILE",
                   help="trace files that jax_gin.trace wrote, one per process")
    m.add_argument("-o", "--output", required=True, metavar="PATH",
                   help="the merged trace: every file's events on one time axis, starting at "
                        "the earliest")
    args = ap.parse_args(argv)
    doc = merge(args.files, args.output)
    n = sum(1 for e in doc["traceEvents"] if e.get("cat") == "jax_gin")
    print(f"{args.output}: {n} calls from {len(args.files)} files")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
