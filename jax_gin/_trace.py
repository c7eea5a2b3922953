"""Timelines from the flight recorder: jax_gin.trace(path) and `python -m jax_gin.trace merge`.

Inside `with jax_gin.trace(path):` the recorder (include/jax_gin/recorder.h) is on; at exit
every call that the devices of this process ran in the block is written as a Chrome/Perfetto
trace (JSON `traceEvents`): pid = process index, tid = device id, one span per call named
"<op> <algorithm>" with args (bytes, dtype, round, rounds, seq, ...), and within it a span or
instant per recorded phase (sends and satisfied waits of each step, coalesced over chunks and
peers; on GPUs, lane 0's). Times are the recorder's clock in microseconds: CLOCK_MONOTONIC on
CPU devices, which the processes of one host share, and the GPUs' %globaltimer on GPUs;
`merge` rebases files onto their earliest event. A rank whose ring wrapped in the block (it
ran more calls than JAX_GIN_RECORD_ENTRIES) gets an instant event "N earlier calls not kept"
before its first kept call, and the block warns, as it does for calls still running at its
end and for a jax_gin.runtime.reset() in it (which destroys the calls recorded before it).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import math
import os
import socket
import sys
import tempfile
import threading
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


def _backends() -> list:
    """(backend, its communicators ({comm: (device ids by logical id, GroupLayout)}), its
    call counts reader, its entries reader) of each backend this process has."""
    from . import _native, _runtime
    out = [("cpu", _runtime.comm_devices, _native.cpu.cpu_call_counts,
            _native.cpu.cpu_recorder_entries)]
    if hasattr(_native.cuda, "recorder_entries"):
        out.append(("gpu", _runtime.gpu_comm_devices, _native.cuda.recorder_counts,
                    _native.cuda.recorder_entries))
    return out


def marks() -> dict:
    """(backend, comm, group, rank) -> the seq of its last call so far, for this process's
    ranks: on CPUs the calls entered (every call is numbered), on GPUs the calls recorded
    (only recorded calls are). A call recorded later has a higher seq."""
    out = {}
    for backend, comms, read, _ in _backends():
        for comm in list(comms):
            try:
                rows = read(comm)
            except ValueError:  # destroyed meanwhile
                continue
            for group, rank, n in rows:
                out[(backend, comm, group, rank)] = n
    return out


def _gather(backend: str, comms: dict, read, keep) -> list:
    """The entries read(comm) of every communicator of `comms` ({comm: (device ids by logical
    id, GroupLayout)}) that keep(comm, entry) accepts, each with its device id as "tid", its
    communicator as "comm" and `backend` ("cpu" or "gpu") as "backend"."""
    entries = []
    for comm, (device_ids, layout) in list(comms.items()):
        try:
            got = read(comm)
        except ValueError:  # destroyed meanwhile
            continue
        device = {(layout.group_of[i], layout.rank_of[i]): d for i, d in enumerate(device_ids)}
        # entries each rank's ring holds (its size, once it has wrapped)
        held = collections.Counter((e["group"], e["rank"]) for e in got)
        for e in got:
            if keep(comm, e):
                e["tid"] = device.get((e["group"], e["rank"]), 1_000_000 + e["rank"])
                e["comm"], e["backend"] = comm, backend
                e["held"] = held[(e["group"], e["rank"])]
                entries.append(e)
    return entries


def collect(since: dict, t_end_ns: int | None = None) -> tuple:
    """The calls of this process's ranks recorded after `since` (marks()), and on CPUs
    entered by t_end_ns (time.monotonic_ns()), as trace events with metadata for the process
    and each device; and the calls not kept: {device id: count} of the calls after `since`
    that a wrapped ring no longer holds."""
    import jax

    def keep(backend):
        # GPU entries are on the GPUs' clock, which t_end_ns is not
        return lambda comm, e: (e["seq"] > since.get((backend, comm, e["group"], e["rank"]), 0)
                                and (backend != "cpu" or t_end_ns is None
                                     or e["t_start"] <= t_end_ns))

    pid = int(jax.process_index())
    entries = []
    for backend, comms, _, read in _backends():
        entries += _gather(backend, comms, read, keep(backend))
    entries.sort(key=lambda e: (e["t_start"], e["rank"]))
    # A rank's calls after its mark are numbered without a gap, so those before its first
    # kept one were overwritten.
    first, kept = {}, {}
    for e in entries:
        key = (e["backend"], e["comm"], e["group"], e["rank"])
        kept[key] = kept.get(key, 0) + 1
        if key not in first or e["seq"] < first[key]["seq"]:
            first[key] = e
    lost: dict = {}
    gaps = []
    for key, e in first.items():
        n = e["seq"] - since.get(key, 0) - 1
        if n > 0:
            lost[e["tid"]] = lost.get(e["tid"], 0) + n
            gaps.append({"name": f"{_calls(n, 'earlier ')} not kept", "cat": "jax_gin.lost",
                         "ph": "i", "s": "t", "pid": pid, "tid": e["tid"], "ts": e["t_start"] / 1e3,
                         "args": {"calls": n, "kept": kept[key], "ring": e["held"],
                                  "comm": e["comm"]}})
    events = [{"name": "process_name", "ph": "M", "pid": pid,
               "args": {"name": f"process {pid} ({socket.gethostname()})"}}]
    for tid in sorted({e["tid"] for e in entries}):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": f"device {tid}"}})
    return events + gaps + _events(entries, pid), lost


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
    if not path:
        raise FileNotFoundError(f"{who}: cannot write '': the path is empty")
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{who}: cannot write {path}: it is a directory")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{who}: cannot write {path}: directory {d} does not exist")
    if not os.access(d, os.W_OK | os.X_OK) or (os.path.exists(path) and
                                                not os.access(path, os.W_OK)):
        raise PermissionError(f"{who}: cannot write {path}: permission denied")
    try:  # what access() does not see: a read-only filesystem, a directory root cannot write
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as err:
        raise PermissionError(f"{who}: cannot write {path}: no file can be created in {d} "
                              f"({err.strerror or err})") from None


def _calls(n: int, what: str = "") -> str:
    """'1 call', '3 calls' ('3 earlier calls' with what='earlier ')."""
    return f"{n} {what}call{'s' if n != 1 else ''}"


def _devices(ids: list) -> str:
    """'device 3', 'devices 0-7', 'devices 0, 2'."""
    from ._explain import _ranges
    return f"device{'s' if len(ids) > 1 else ''} {_ranges(ids)}"


def _block_warnings(path, events: list, lost: dict, reset: bool) -> list:
    """What a trace block's file lacks: calls that the ring no longer held (lost: {device:
    count}), calls still running at the block's end, calls destroyed by a reset() in it."""
    from . import _runtime
    path = os.fspath(path)
    out = []
    if lost:
        by_count: dict = {}  # calls lost -> the devices that lost that many
        for device in sorted(lost):
            by_count.setdefault(lost[device], []).append(device)
        devices = _devices(sorted(lost))
        if len(by_count) == 1:
            (n,) = by_count
            what = (f"the first {_calls(n)} that {'each of ' if len(lost) > 1 else ''}{devices} "
                    f"ran in the block are not in {path}")
        else:
            counts = ", ".join(f"{n} of {_devices(d)}" for n, d in by_count.items())
            what = f"the first calls that {devices} ran in the block are not in {path} ({counts})"
        # the sizes of the rings that wrapped (the entries they held)
        held = sorted({e["args"]["ring"] for e in events if e.get("cat") == "jax_gin.lost"})
        held = f" ({', '.join(map(str, held))} in these programs' communicators)" if held else ""
        out.append(f"jax_gin.trace: {what}: the recorder keeps the last "
                   f"JAX_GIN_RECORD_ENTRIES calls of each rank{held}; raise it (a power of "
                   f"two, at most {_runtime.REC_MAX_ENTRIES}) before the programs are first "
                   f"lowered, or call jax_gin.runtime.reset() after raising it, so that they "
                   f"are lowered again (a program lowered before keeps its communicators)")
    running = sum(1 for e in events if e.get("cat") == "jax_gin" and
                  e["args"]["status"] == "running")
    if running:
        out.append(f"jax_gin.trace: {_calls(running)} still running when the block ended; "
                   f"their spans in {path} have no end (dur 0, status 'running'): keep their "
                   f"results, or wait for them (jax.block_until_ready) inside the block")
    if reset:
        out.append(f"jax_gin.trace: jax_gin.runtime.reset() ran in the block; the calls before "
                   f"it are not in {path} (their communicators, and the recorder's entries "
                   f"with them, were destroyed)")
    return out


# Open trace blocks: the recorder is on while any is open (blocks may overlap without
# nesting, as in two threads); the last to close puts back the setting the first found.
_blocks_lock = threading.Lock()
_blocks = {"open": 0, "record": False}


def _open_block() -> None:
    from . import _runtime
    with _blocks_lock:
        if _blocks["open"] == 0:
            _blocks["record"] = _runtime.settings.record
            _runtime.settings.record = True
        _blocks["open"] += 1


def _close_block() -> None:
    from . import _runtime
    with _blocks_lock:
        _blocks["open"] -= 1
        if _blocks["open"] == 0:
            _runtime.settings.record = _blocks["record"]


def _write_calls(path, since: dict, t_end_ns: int | None = None) -> tuple:
    """Writes collect(since, t_end_ns)'s events to `path`, on the GPUs' clock where this
    process has GPU communicators; returns them and the calls not kept."""
    from . import _runtime
    events, lost = collect(since, t_end_ns)
    write(path, events, **({"clock": GPU_CLOCK} if _runtime.gpu_comm_devices else {}))
    return events, lost


class trace(contextlib.ContextDecorator):
    """Write every jax_gin call that this process's devices run inside the block to `path`
    as a Chrome/Perfetto trace: ``with jax_gin.trace("t.json"): ...``, or as a decorator, a
    block per call (_block says more). One object opens one block at a time, and may open
    another after it ends (the file is written anew)."""

    def __init__(self, path):
        self._path = path
        self._block = None

    def __enter__(self):
        if self._block is not None:
            raise RuntimeError("jax_gin.trace: this trace's block is already open; use another "
                               "jax_gin.trace(path) for a block inside it")
        block = _block(self._path)
        out = block.__enter__()
        self._block = block
        return out

    def __exit__(self, *exc):
        block, self._block = self._block, None
        return block.__exit__(*exc)

    def _recreate_cm(self):
        # as a decorator, a block of its own per call: a function that calls itself nests them
        return type(self)(self._path)

    @staticmethod
    def dump(path):
        """Write the calls that the flight recorder keeps now to `path`, as a block's trace:
        each rank's last JAX_GIN_RECORD_ENTRIES calls, of every communicator of this process
        (where they ran with the recorder on: JAX_GIN_RECORD=1, or inside a block), with an
        instant "N earlier calls not kept" before a rank's first kept call for the calls it
        made before that (a ring that wrapped, or calls made with the recorder off). For after
        a failure: it waits for no computation. Returns the number of calls written."""
        _check_writable(path, "jax_gin.trace.dump")
        events, _ = _write_calls(path, {})
        return sum(1 for e in events if e.get("ph") == "X" and "seq" in e.get("args", {}))


@contextlib.contextmanager
def _block(path):
    """Write every jax_gin call that this process's devices run inside the block to `path`
    as a Chrome/Perfetto trace (see the module docstring). The recorder is on while any
    block is open (blocks may nest, or overlap in threads); when the last one ends, the
    setting (jax_gin.runtime.settings.record) goes back to what the first one found.
    A block that ends without raising first waits for the computations behind this process's
    live arrays (jax.live_arrays()), so calls still queued at its end are in the file too;
    those whose results were dropped unread are not waited for. The recorder keeps
    the last JAX_GIN_RECORD_ENTRIES calls per rank: a longer block keeps only its last ones,
    and warns (RuntimeWarning) with the count of the others, as it does where
    jax_gin.runtime.reset() in the block destroyed the calls recorded before it, and where
    calls were still running at its end.
    A path that cannot be written raises on entry; if writing fails at exit while the block
    raised, the block's exception propagates and the failure is a warning."""
    from . import _runtime
    _check_writable(path, "jax_gin.trace")
    _open_block()  # first: every call numbered after the marks is recorded
    try:
        since = marks()
    except BaseException:
        _close_block()
        raise
    resets = _runtime.resets
    body_raised = False
    try:
        yield path
    except BaseException:
        body_raised = True
        raise
    finally:
        if not body_raised:
            # calls still queued (JAX dispatches asynchronously) are not yet in the recorder
            _runtime.wait_for_live_arrays()
        t1 = time.monotonic_ns()
        _close_block()
        try:
            events, lost = _write_calls(path, since, t1)
            for message in _block_warnings(path, events, lost, _runtime.resets != resets):
                warnings.warn(message, RuntimeWarning, stacklevel=4)
        except Exception as err:
            if not body_raised:
                raise
            # the block's own exception is the one to see; this one must not replace it
            warnings.warn(f"jax_gin.trace: {os.fspath(path)} not written: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=4)


class MergeError(ValueError):
    """An input or output that `merge` refuses; its message names the file and the problem."""


def _meta(doc) -> dict:
    """The trace's metadata.jax_gin, or {} where it has none (or not a dict)."""
    meta = doc.get("metadata")
    meta = meta.get("jax_gin") if isinstance(meta, dict) else None
    return meta if isinstance(meta, dict) else {}


def _label(v) -> bool:
    """Whether `v` can be a clock or a host in "sources": a JSON scalar (a set member)."""
    return v is None or isinstance(v, (str, int, float))


def _sources(p, doc) -> set:
    """(clock, host) of each process in `doc`: its own, or a merged file's "sources"."""
    meta = _meta(doc)
    if "sources" in meta:
        src = meta["sources"]
        if not isinstance(src, list) or not all(
                isinstance(x, list) and len(x) == 2 and all(map(_label, x)) for x in src):
            raise MergeError(f"{p}: metadata.jax_gin.sources is not a list of [clock, host]")
        return {tuple(x) for x in src}
    if isinstance(meta.get("clock"), list):  # merges before "sources" wrote their clocks so
        raise MergeError(f"{p}: merged by an older jax_gin; merge its inputs instead")
    pair = (meta.get("clock"), meta.get("host"))
    if not all(map(_label, pair)):
        raise MergeError(f"{p}: metadata.jax_gin's clock and host are not strings or numbers")
    return {pair}


def _parts(doc) -> list:
    """Digests of the per-process files whose events `doc` holds: its own events' (none for
    an empty block: such files may well be equal), or a merged file's "parts"."""
    meta = _meta(doc)
    if "merged" in meta:
        parts = meta.get("parts", [])
        return [x for x in parts if isinstance(x, str)] if isinstance(parts, list) else []
    ev = doc["traceEvents"]
    if not any("ts" in e for e in ev):
        return []
    return [hashlib.sha256(json.dumps(ev, sort_keys=True).encode()).hexdigest()]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read(p) -> dict:
    try:
        with open(p, "rb") as f:
            doc = json.loads(f.read())
    except OSError as err:
        raise MergeError(f"{p}: cannot read: {err.strerror or err}") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise MergeError(f"{p}: not JSON: {err}") from None
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise MergeError(f"{p}: not a trace (no traceEvents)")
    ev = doc["traceEvents"]
    if not isinstance(ev, list) or not all(isinstance(e, dict) for e in ev):
        raise MergeError(f"{p}: not a trace (traceEvents is not a list of events)")
    for key in ("ts", "dur"):  # finite: one NaN would make every merged time NaN
        if any(not _finite(e.get(key, 0)) for e in ev):
            raise MergeError(f"{p}: not a trace (an event's {key} is not a finite number)")
    if "merged" in _meta(doc) and not _finite(_meta(doc).get("origin_us", 0)):
        raise MergeError(f"{p}: metadata.jax_gin.origin_us is not a finite number")
    # a pid is an integer (Chrome's trace format), which merge renumbers
    if any(isinstance(e.get("pid", 0), bool) or not isinstance(e.get("pid", 0), int)
           for e in ev):
        raise MergeError(f"{p}: not a trace (an event's pid is not an integer)")
    return doc


def _check_paths(paths: list, out) -> None:
    """Refusals that need no input read: a file given twice, -o naming an input, an output
    that cannot be written, an input that does not exist."""
    seen = {}
    for p in paths:
        if not os.path.isfile(p):
            raise MergeError(f"{p}: " + ("is a directory" if os.path.isdir(p) else
                                         "no such file"))
        key = os.path.realpath(p)
        if key in seen:
            raise MergeError(f"{p}: given twice (as {seen[key]} too); its events would be "
                             "duplicated")
        seen[key] = p
    if os.path.realpath(out) in seen:
        raise MergeError(f"{out}: the output is one of the inputs; it would be overwritten")
    try:
        _check_writable(out, "jax_gin.trace merge")
    except OSError as err:
        raise MergeError(str(err).removeprefix("jax_gin.trace merge: ")) from None


def merge(paths: list, out) -> dict:
    """One trace from the per-process files `paths`: events of every file, on one time axis
    (the recorded clock, rebased to the earliest event), a file's pid kept unless another
    file used it already (then renumbered, its process_name naming the file). A merged file
    is an input like the others (its events back on its clock via its origin_us). Raises
    MergeError (naming the file) for an input that is no trace, a file given twice (by path
    or identical content, or inside a merged file), or an output that is an input or cannot
    be written."""
    paths = [os.fspath(p) for p in paths]
    _check_paths(paths, out)
    docs, docs_of = [], {}
    held: dict = {}  # digest of a per-process file's events -> the input that holds them
    parts: list = []
    for p in paths:
        doc = _read(p)
        for part in _parts(doc):
            if part in held:
                q = held[part]
                raise MergeError(
                    f"{p}: the same events as {q}; they would be duplicated" if
                    "merged" not in _meta(doc) and "merged" not in _meta(docs_of[q]) else
                    f"{p}: holds events that {q} holds too (a file merged into both); they "
                    "would be duplicated")
            held[part] = p
            parts.append(part)
        docs_of[p] = doc
        docs.append((p, doc, _sources(p, doc)))
    clocks = set().union(*(c for _, _, c in docs))
    if len(clocks) > 1:
        print("jax_gin.trace merge: the files come from different clocks or hosts "
              f"({sorted(map(str, clocks))}); their times are not aligned", file=sys.stderr)

    def origin(d):  # a merged file's times are rebased: back on the recorded clock
        meta = _meta(d)
        if "merged" not in meta:
            return 0.0
        o = meta.get("origin_us", 0.0)
        return o if isinstance(o, (int, float)) else 0.0

    stamps = [e["ts"] + origin(d) for _, d, _ in docs for e in d["traceEvents"] if "ts" in e]
    base = min(stamps) if stamps else 0.0
    used: set = set()
    events: list = []
    for p, d, _ in docs:
        shift = origin(d) - base
        pids = {e.get("pid") for e in d["traceEvents"] if "pid" in e}
        # kept where free; else the next free of +1000 steps, clear of this file's own pids
        remap = {q0: q0 for q0 in pids if q0 not in used}
        for q0 in sorted(pids - set(remap), key=str):
            q = q0
            while q in used or q in pids or q in remap.values():
                q = (q if isinstance(q, int) else 0) + 1000
            remap[q0] = q
        used |= set(remap.values())
        for e in d["traceEvents"]:
            e = dict(e)
            if "pid" in e:
                q0, e["pid"] = e["pid"], remap[e["pid"]]
                if e["pid"] != q0 and e.get("ph") == "M" and e.get("name") == "process_name":
                    # the track's number changed: its label says which file it came from
                    args = dict(e.get("args") or {})
                    args["name"] = f"{args.get('name', f'process {q0}')} [{os.path.basename(p)}]"
                    e["args"] = args
            if "ts" in e:
                e["ts"] = e["ts"] + shift
            events.append(e)
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0.0)))
    meta = {"sources": sorted(map(list, clocks), key=str), "origin_us": base,
            "merged": [os.path.abspath(p) for p in paths], "parts": parts}
    if len(clocks) == 1:
        (meta["clock"], meta["host"]), = clocks
    doc = {"traceEvents": events, "displayTimeUnit": "ns", "metadata": {"jax_gin": meta}}
    with open(out, "w") as f:
        json.dump(doc, f)
    return doc


def main(argv=None) -> int:
    from . import _runtime
    _runtime.refuse_invalid_variables("python -m jax_gin.trace")
    ap = argparse.ArgumentParser(prog="python -m jax_gin.trace",
                                 description="jax_gin trace files (Chrome/Perfetto JSON)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge per-process trace files into one")
    m.add_argument("files", nargs="+", metavar="FILE",
                   help="trace files that jax_gin.trace (or merge) wrote, one per process")
    m.add_argument("-o", "--output", required=True, metavar="PATH",
                   help="the merged trace: every file's events on one time axis, starting at "
                        "the earliest")
    args = ap.parse_args(argv)
    try:
        doc = merge(args.files, args.output)
    except MergeError as err:
        # as argparse reports a usage error: one line, status 2
        print(f"{m.prog}: error: {err}", file=sys.stderr)
        return 2
    n = sum(1 for e in doc["traceEvents"] if e.get("cat") == "jax_gin")
    print(f"{args.output}: {n} calls from {len(args.files)} files")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
