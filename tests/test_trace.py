"""jax_gin.trace on every platform: on CPU devices and on GPUs (JAX_PLATFORMS=cuda), a valid
Chrome/Perfetto trace with one track per device for psum, pmax and pmin of every algorithm,
each call a span with its phases inside it (on GPUs, lane 0's)."""
import itertools
import json
import os
import re
import subprocess
import sys
import warnings

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jax_gin
from jax_gin import _runtime
from jax_gin._select import COLLECTIVE_ALGORITHMS
from conftest import mesh_1d, ndev, needs_devices
from helpers import OPS, exact_input, smap

_timeouts = itertools.count()


def _own_communicators(monkeypatch):
    """A timeout of the test's own, so that it gets communicators of its own."""
    monkeypatch.setattr(_runtime.settings, "timeout_s", 25.0 + 0.001 * next(_timeouts))


def _psum(algo):
    return smap(lambda v: jax_gin.psum(v, "i", algorithm=algo), mesh_1d(), P("i"))


@pytest.mark.parametrize("size", [300, 70_001])  # one_shot's LL path on GPUs; flags everywhere
def test_trace_every_algorithm(monkeypatch, tmp_path, size):
    _own_communicators(monkeypatch)
    needs_devices(2)  # a group of one rank only copies: no phases to trace
    gpu = jax.default_backend() != "cpu"
    x = exact_input((size,), ndev(), "float32")
    calls = [(api, algo) for api in OPS for algo in jax_gin.ALGORITHMS]
    fns = [smap(lambda v, api=api, algo=algo: getattr(jax_gin, api)(v, "i", algorithm=algo),
                mesh_1d(), P("i")) for api, algo in calls]
    for f in fns:
        jax.block_until_ready(f(x))  # compiled and run once before the block
    path = tmp_path / "t.json"
    with jax_gin.trace(path):
        for f in fns:
            jax.block_until_ready(f(x))
    assert _runtime.settings.record is False
    doc = json.loads(path.read_text())
    assert doc["metadata"]["jax_gin"]["clock"] == ("%globaltimer" if gpu else "CLOCK_MONOTONIC")
    events = doc["traceEvents"]
    devices = sorted(int(d.id) for d in jax.devices())
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names) == devices
    spans = [e for e in events if e.get("cat") == "jax_gin"]
    assert len(spans) == len(calls) * ndev()
    for tid in devices:
        mine = sorted((s for s in spans if s["tid"] == tid), key=lambda s: s["ts"])
        assert [s["name"] for s in mine] == [f"{api} {algo}" for api, algo in calls]
        seqs = [s["args"]["seq"] for s in mine]
        assert seqs == list(range(seqs[0], seqs[0] + len(calls)))
        for s in mine:
            assert s["ph"] == "X" and s["dur"] >= 0 and s["args"]["status"] == "done"
            assert s["args"]["bytes"] == 4 * size and s["args"]["dtype"] == "float32"
    phases = [e for e in events if e.get("cat") == "jax_gin.phase"]
    assert {p["args"]["kind"] for p in phases} >= {"send", "wait"}
    for p in phases:
        inside = [s for s in spans if s["tid"] == p["tid"] and
                  s["ts"] <= p["ts"] and p["ts"] + p.get("dur", 0) <= s["ts"] + s["dur"] + 1e-3]
        assert len(inside) == 1, p
        assert re.fullmatch(r"(send|wait) step \d+|credit|credit wait", p["name"]), p["name"]
    # every call of every algorithm but GPU one_shot over LL (no flags) has phases
    with_phases = {(s["tid"], s["ts"]) for s in spans for p in phases
                   if p["tid"] == s["tid"] and s["ts"] <= p["ts"] <= s["ts"] + s["dur"]}
    for s in spans:
        if not (gpu and size == 300 and s["name"].endswith("one_shot")):
            assert (s["tid"], s["ts"]) in with_phases, s


def test_trace_names_psum_scatter_and_all_gather(monkeypatch, tmp_path):
    """The recorder names the collectives' calls, with the larger side's bytes."""
    monkeypatch.setattr(_runtime.settings, "timeout_s", 26.5)  # a communicator of its own
    needs_devices(2)  # a group of one rank only copies: no phases to trace
    n = ndev()
    x = exact_input((64 * n,), n, "float32")
    calls = [(api, algo) for api in ("psum_scatter", "all_gather") for algo in COLLECTIVE_ALGORITHMS]
    fns = [smap(lambda v, api=api, algo=algo: getattr(jax_gin, api)(v, "i", tiled=True,
                                                                     algorithm=algo),
                mesh_1d(), P("i")) for api, algo in calls]
    for f in fns:
        jax.block_until_ready(f(x))
    path = tmp_path / "t.json"
    with jax_gin.trace(path):
        for f in fns:
            jax.block_until_ready(f(x))
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "jax_gin"]
    assert len(spans) == len(calls) * n
    for tid in {s["tid"] for s in spans}:
        mine = sorted((s for s in spans if s["tid"] == tid), key=lambda s: s["ts"])
        assert [s["name"] for s in mine] == [f"{api} {algo}" for api, algo in calls]
        # nccl-tests' size, the larger side: psum_scatter's input (64 n floats), all_gather's
        # output (n times its input of 64 n)
        assert [s["args"]["bytes"] for s in mine[:2]] == [4 * 64 * n] * 2
        assert [s["args"]["bytes"] for s in mine[2:]] == [4 * 64 * n * n] * 2


@pytest.mark.parametrize("algo", ["one_shot", "ring"])
def test_trace_has_psum_add_rmsnorm(monkeypatch, tmp_path, algo):
    """psum_add_rmsnorm is recorded under its own name, with the algorithm and bytes of its
    all-reduce of x; on GPUs one_shot runs it in one kernel over LL, which records it too."""
    monkeypatch.setattr(_runtime.settings, "timeout_s", 27.5 + 0.001 * next(_timeouts))
    needs_devices(2)  # a group of one rank only copies: no phases to trace
    n = ndev()
    x = exact_input((8, 64), n, "float32")
    w = exact_input((64,), 1, "float32", 1)
    f = jax.jit(jax.shard_map(
        lambda v, r, wv: jax_gin.psum_add_rmsnorm(v, r, wv, "i", algorithm=algo),
        mesh=mesh_1d(), in_specs=(P("i"), P("i"), P()), out_specs=(P("i"), P("i"))))
    jax.block_until_ready(f(x, x, w))
    path = tmp_path / "t.json"
    with jax_gin.trace(path):
        jax.block_until_ready(f(x, x, w))
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "jax_gin"]
    assert sorted(s["tid"] for s in spans) == sorted(int(d.id) for d in jax.devices())
    for s in spans:
        assert s["name"] == f"psum_add_rmsnorm {algo}" and s["args"]["status"] == "done"
        assert s["args"]["bytes"] == 4 * 8 * 64 and s["args"]["dtype"] == "float32"


def test_trace_object_opens_a_block_at_a_time(tmp_path):
    """A trace object opens one block at a time: used again after its block ends, it writes
    the file anew; entered again while open, it says so."""
    needs_devices(2)  # over one device a psum launches nothing
    f = _psum("one_shot")
    x = exact_input((8,), ndev(), "float32")
    path = tmp_path / "t.json"
    record = _runtime.settings.record
    tr = jax_gin.trace(path)
    for calls in (1, 2):
        with tr:
            for _ in range(calls):
                jax.block_until_ready(f(x))
        events = json.loads(path.read_text())["traceEvents"]
        assert len([e for e in events if e.get("cat") == "jax_gin"]) == calls * ndev()
    with tr:
        with pytest.raises(RuntimeError, match="this trace's block is already open"):
            with tr:
                pass
    assert _runtime.settings.record == record


def test_trace_as_a_decorator(tmp_path):
    """A trace object decorates a function: each call is a block of its own."""
    needs_devices(2)  # over one device a psum launches nothing
    f = _psum("one_shot")
    x = exact_input((8,), ndev(), "float32")
    path = tmp_path / "t.json"

    @jax_gin.trace(path)
    def step(n):
        for _ in range(n):
            jax.block_until_ready(f(x))

    for calls in (2, 1):
        step(calls)
        events = json.loads(path.read_text())["traceEvents"]
        assert len([e for e in events if e.get("cat") == "jax_gin"]) == calls * ndev()


def test_trace_as_a_decorator_of_a_function_that_calls_itself(tmp_path):
    """Each call of the decorated function is a block of its own, nested in its caller's."""
    needs_devices(2)
    f = _psum("one_shot")
    x = exact_input((8,), ndev(), "float32")
    path = tmp_path / "t.json"

    @jax_gin.trace(path)
    def step(n):
        jax.block_until_ready(f(x))
        if n > 1:
            step(n - 1)

    step(3)  # the outermost block ends last: its file has every call
    events = json.loads(path.read_text())["traceEvents"]
    assert len([e for e in events if e.get("cat") == "jax_gin"]) == 3 * ndev()


def test_dump_writes_what_the_recorder_kept_after_a_failure(tmp_path, monkeypatch):
    """With the recorder on and no block open, a call that fails: dump writes every rank's
    kept calls, the failed one among them, and counts them."""
    needs_devices(2)
    if jax.default_backend() != "cpu":
        pytest.skip("the GPU fault test runs in the native harness (a trap kills the context)")
    monkeypatch.setattr(_runtime.settings, "record", True)
    monkeypatch.setattr(_runtime.settings, "timeout_s", 0.33)
    x = exact_input((8,), ndev(), "float32")
    jax.block_until_ready(_psum("ring")(x))
    monkeypatch.setattr(_runtime.settings, "fault_rank", 1)
    with pytest.raises(Exception, match="jax_gin psum"):
        jax.block_until_ready(_psum("one_shot")(x))
    path = tmp_path / "kept.json"
    n = jax_gin.trace.dump(path)
    calls = [e for e in json.loads(path.read_text())["traceEvents"]
             if e.get("ph") == "X" and "seq" in e.get("args", {})]
    assert n == len(calls) >= 2 * ndev()
    status = {(e["name"], e["args"]["status"]) for e in calls}
    assert ("psum ring", "done") in status and ("psum one_shot", "failed") in status, status
    with pytest.raises(OSError):
        jax_gin.trace.dump(tmp_path / "nodir" / "kept.json")


def test_trace_path_where_no_file_can_be_created(tmp_path, monkeypatch):
    """A directory that access() calls writable, where no file can be created (a read-only
    filesystem, /proc): the error says so, with the system's reason."""
    import errno
    import tempfile

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    path = tmp_path / "x.json"
    with pytest.raises(PermissionError, match=rf"cannot write {re.escape(str(path))}: no file "
                                              rf"can be created in {re.escape(str(tmp_path))} "
                                              r"\(Read-only file system\)"):
        with jax_gin.trace(path):
            pass


@pytest.mark.parametrize("on_before", [False, True], ids=["recorder_off", "recorder_on"])
def test_trace_blocks_that_overlap(tmp_path, monkeypatch, on_before):
    """Blocks whose lifetimes overlap without nesting (two threads, or blocks closed out of
    order): each holds every call made while it was open, and the recorder setting goes back
    to what it was once the last one closes."""
    needs_devices(2)  # over one device a psum launches nothing
    _own_communicators(monkeypatch)
    monkeypatch.setattr(_runtime.settings, "record", on_before)
    f = _psum("one_shot")
    x = exact_input((8,), ndev(), "float32")
    jax.block_until_ready(f(x))
    a, b = jax_gin.trace(tmp_path / "a.json"), jax_gin.trace(tmp_path / "b.json")
    a.__enter__()
    jax.block_until_ready(f(x))
    b.__enter__()
    jax.block_until_ready(f(x))
    a.__exit__(None, None, None)
    assert _runtime.settings.record  # b is still open
    for _ in range(2):
        jax.block_until_ready(f(x))
    b.__exit__(None, None, None)
    assert _runtime.settings.record == on_before
    for name, calls in (("a.json", 2), ("b.json", 3)):
        events = json.loads((tmp_path / name).read_text())["traceEvents"]
        spans = [e for e in events if e.get("cat") == "jax_gin"]
        assert len(spans) == calls * ndev(), (name, len(spans))


@pytest.mark.parametrize("on_before", [False, True], ids=["recorder_off", "recorder_on"])
def test_trace_counts_the_calls_not_kept(tmp_path, monkeypatch, on_before):
    """A block of more calls than the ring holds keeps the last ones, marks the others on each
    track and warns with their count, whether or not the recorder was on before the block."""
    needs_devices(2)  # over one device a psum launches nothing
    _own_communicators(monkeypatch)
    monkeypatch.setattr(_runtime.settings, "record_entries", 4)
    monkeypatch.setattr(_runtime.settings, "record", on_before)
    f = _psum("one_shot")
    x = exact_input((8,), ndev(), "float32")
    for _ in range(3):  # calls before the block: numbered, not in the trace
        jax.block_until_ready(f(x))
    path = tmp_path / "t.json"
    # counted per device: each device lost 3 (not the 3 * ndev() of all devices)
    with pytest.warns(RuntimeWarning, match=rf"jax_gin.trace: the first 3 calls that each of "
                      rf"devices 0-{ndev() - 1} ran in the block are not in .*t.json: the "
                      rf"recorder keeps the last JAX_GIN_RECORD_ENTRIES calls of each rank "
                      rf"\(4 in these programs' communicators\); raise it .* before the "
                      rf"programs are first lowered, or call jax_gin.runtime.reset\(\)"):
        with jax_gin.trace(path):
            for _ in range(7):
                jax.block_until_ready(f(x))
    events = json.loads(path.read_text())["traceEvents"]
    for tid in range(ndev()):
        mine = [e for e in events if e.get("tid") == tid and e.get("cat") == "jax_gin"]
        seqs = [s["args"]["seq"] for s in sorted(mine, key=lambda s: s["ts"])]
        # the block's last 4 calls (GPUs number only recorded calls; CPUs every call)
        assert seqs == list(range(seqs[0], seqs[0] + 4)), seqs
        (gap,) = [e for e in events if e.get("tid") == tid and e.get("cat") == "jax_gin.lost"]
        assert gap["name"] == "3 earlier calls not kept" and gap["ph"] == "i"
        assert gap["args"]["calls"] == 3 and gap["args"]["kept"] == 4 and gap["args"]["ring"] == 4
        assert gap["ts"] == min(s["ts"] for s in mine)


def test_calls_not_kept_are_counted_per_device():
    from jax_gin._trace import _block_warnings
    (one,) = _block_warnings("t.json", [], {3: 6}, False)
    assert one.startswith("jax_gin.trace: the first 6 calls that device 3 ran in the block are "
                          "not in t.json: the recorder keeps")
    (differ,) = _block_warnings("t.json", [], {0: 6, 1: 5, 2: 5, 5: 1}, False)
    assert differ.startswith("jax_gin.trace: the first calls that devices 0, 1, 2, 5 ran in the "
                             "block are not in t.json (6 of device 0, 5 of devices 1-2, 1 of "
                             "device 5): the recorder keeps")


def test_trace_of_a_ring_that_did_not_wrap_warns_nothing(tmp_path, monkeypatch):
    needs_devices(2)  # over one device a psum launches nothing
    _own_communicators(monkeypatch)
    monkeypatch.setattr(_runtime.settings, "record_entries", 4)
    f = _psum("ring")
    x = exact_input((8,), ndev(), "float32")
    jax.block_until_ready(f(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax_gin.trace(tmp_path / "t.json"):
            for _ in range(4):
                jax.block_until_ready(f(x))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert len([e for e in events if e.get("cat") == "jax_gin"]) == 4 * ndev()
    assert not [e for e in events if e.get("cat") == "jax_gin.lost"]


def test_trace_warns_of_a_reset_in_the_block(tmp_path, monkeypatch):
    needs_devices(2)  # over one device a psum launches nothing
    _own_communicators(monkeypatch)
    f = _psum("ring")
    x = exact_input((8,), ndev(), "float32")
    with pytest.warns(RuntimeWarning, match=r"reset\(\) ran in the block; the calls before it "
                      r"are not in"):
        with jax_gin.trace(tmp_path / "t.json"):
            jax.block_until_ready(f(x))
            _runtime.reset()
            jax.block_until_ready(f(x))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("cat") == "jax_gin"]
    assert len(spans) == ndev() and {s["args"]["seq"] for s in spans} == {1}


def test_importing_the_subpackage_keeps_the_context_manager(tmp_path):
    # `import jax_gin.trace` (the module of `python -m jax_gin.trace`) replaces the package's
    # attribute: the module is callable as the context manager
    out = tmp_path / "t.json"
    code = ("import jax_gin.trace, jax_gin\n"
            f"with jax_gin.trace({str(out)!r}):\n    pass\n"
            "print(type(jax_gin.trace).__name__, jax_gin.trace.dump.__qualname__)")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    # the attribute is the module, called, and its dump the context manager's
    assert r.stdout.strip() == "_CallableModule trace.dump"
    assert "traceEvents" in json.loads(out.read_text())  # and the block wrote its file


def test_trace_unwritable_path_fails_on_entry(tmp_path):
    ran = []
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nodir" / "t.json"))):
        with jax_gin.trace(tmp_path / "nodir" / "t.json"):
            ran.append(1)
    assert ran == [] and _runtime.settings.record is False
    with pytest.raises(IsADirectoryError):
        with jax_gin.trace(tmp_path):
            pass
    with pytest.raises(FileNotFoundError, match="jax_gin.trace: cannot write '': the path is empty"):
        with jax_gin.trace(""):
            ran.append(1)
    assert ran == []


def test_trace_write_failure_does_not_mask_the_block(tmp_path):
    d = tmp_path / "gone"
    d.mkdir()
    with pytest.warns(RuntimeWarning, match="not written"):
        with pytest.raises(KeyError, match="the real error"):
            with jax_gin.trace(d / "t.json"):
                d.rmdir()  # the directory vanishes during the block: the write fails at exit
                raise KeyError("the real error")
    assert _runtime.settings.record is False
    d.mkdir()
    with pytest.raises(FileNotFoundError):  # a block that did not raise sees the failure
        with jax_gin.trace(d / "t.json"):
            d.rmdir()


def test_trace_warns_of_calls_still_running(tmp_path, monkeypatch):
    from jax_gin import _trace
    span = {"name": "psum ring", "cat": "jax_gin", "ph": "X", "pid": 0, "tid": 0, "ts": 1.0,
            "dur": 0.0, "args": {"status": "running", "seq": 1}}
    monkeypatch.setattr(_trace, "collect", lambda since, t_end_ns=None: ([span], {}))
    with pytest.warns(RuntimeWarning, match=r"1 call still running when the block ended; "
                      r"their spans in .*t.json have no end"):
        with jax_gin.trace(tmp_path / "t.json"):
            pass
    span["args"]["status"] = "done"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax_gin.trace(tmp_path / "t.json"):
            pass


def test_trace_waits_for_calls_still_queued(tmp_path, monkeypatch):
    """A block that dispatches calls and ends without waiting for them (JAX dispatches
    asynchronously) still has every call in its file, ended, and warns of nothing."""
    _own_communicators(monkeypatch)
    needs_devices(2)
    calls = 10
    f = _psum("ring")
    x = exact_input((ndev() * 1_000_000,), ndev(), "float32")  # 4 MB a device: ~ms a call
    want = jax.block_until_ready(f(x))
    path = tmp_path / "t.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jax_gin.trace(path):
            outs = [f(x) for _ in range(calls)]
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "jax_gin"]
    assert len(spans) == calls * ndev()
    assert {s["args"]["status"] for s in spans} == {"done"}
    for out in outs:
        assert (out == want).all()


def _fake_trace(path, pid, t0, host="h"):
    """A file as jax_gin.trace writes it: one process, one device, two calls."""
    events = [{"name": "process_name", "ph": "M", "pid": pid,
               "args": {"name": f"process {pid} ({host})"}},
              {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0,
               "args": {"name": "device 0"}}]
    events += [{"name": "psum ring", "cat": "jax_gin", "ph": "X", "pid": pid, "tid": 0,
                "ts": t0 + 10.0 * i, "dur": 5.0, "args": {"seq": i}} for i in range(2)]
    path.write_text(json.dumps({"traceEvents": events, "metadata": {"jax_gin": {
        "clock": "CLOCK_MONOTONIC", "host": host, "process": pid}}}))
    return str(path)


def _merge(capsys, *argv):
    from jax_gin._trace import main
    rc = main(["merge", *map(str, argv)])
    return rc, capsys.readouterr()


def _canon(doc):
    return sorted(json.dumps(e, sort_keys=True) for e in doc["traceEvents"])


def test_merge_of_a_merged_file(tmp_path, capsys):
    """A merged file merges again, its events back on their clock: merging (a+b)+c gives
    what a+b+c gives, and a renumbered process's track names its file."""
    a, b, c = (_fake_trace(tmp_path / f"{n}.json", pid, t0)
               for n, pid, t0 in (("a", 0, 1000.0), ("b", 1, 1003.0), ("c", 0, 1100.0)))
    assert _merge(capsys, a, b, "-o", tmp_path / "ab.json")[0] == 0
    assert _merge(capsys, tmp_path / "ab.json", c, "-o", tmp_path / "abc2.json")[0] == 0
    rc, out = _merge(capsys, a, b, c, "-o", tmp_path / "abc.json")
    assert rc == 0 and "6 calls from 3 files" in out.out
    once, twice = (json.loads((tmp_path / f).read_text()) for f in ("abc.json", "abc2.json"))
    assert _canon(once) == _canon(twice)
    meta = once["metadata"]["jax_gin"]
    assert meta["origin_us"] == 1000.0 and meta["clock"] == "CLOCK_MONOTONIC"
    assert min(e["ts"] for e in once["traceEvents"] if "ts" in e) == 0
    names = {e["pid"]: e["args"]["name"] for e in once["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {0: "process 0 (h)", 1: "process 1 (h)", 1000: "process 0 (h) [c.json]"}


def test_merge_refusals(tmp_path, capsys):
    """Each refusal: status 2, one line naming the file, nothing written."""
    a = _fake_trace(tmp_path / "a.json", 0, 1000.0)
    b = _fake_trace(tmp_path / "b.json", 1, 1000.0)
    (tmp_path / "copy.json").write_text((tmp_path / "a.json").read_text())
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "oops.json").write_text('{"traceEvents": "oops"}')
    (tmp_path / "pid.json").write_text('{"traceEvents": [{"name": "a", "ph": "X", "ts": 1, '
                                       '"pid": [0]}]}')
    for name, ts in (("nan", "NaN"), ("inf", "Infinity"), ("true", "true")):
        (tmp_path / f"{name}.json").write_text('{"traceEvents": [{"name": "a", "ph": "X", '
                                               f'"ts": {ts}, "pid": 0}}]}}')
    (tmp_path / "dur.json").write_text('{"traceEvents": [{"name": "a", "ph": "X", "ts": 1, '
                                       '"dur": NaN, "pid": 0}]}')
    (tmp_path / "src.json").write_text(json.dumps({"traceEvents": [], "metadata": {
        "jax_gin": {"sources": [[["a"], "h"]], "merged": []}}}))
    (tmp_path / "clock.json").write_text(json.dumps({"traceEvents": [], "metadata": {
        "jax_gin": {"clock": {"a": 1}, "host": "h"}}}))
    (tmp_path / "origin.json").write_text('{"traceEvents": [], "metadata": {"jax_gin": '
                                          '{"sources": [], "merged": [], "origin_us": NaN}}}')
    (tmp_path / "old.json").write_text(json.dumps({"traceEvents": [], "metadata": {
        "jax_gin": {"clock": ["('CLOCK_MONOTONIC', 'h')"], "origin_us": 0, "merged": []}}}))
    out = tmp_path / "out.json"
    cases = [((a, a), "a.json: given twice"),
             ((a, tmp_path / "copy.json"), "copy.json: the same events as"),
             ((tmp_path / "missing.json", a), "missing.json: no such file"),
             ((tmp_path / "bad.json",), "bad.json: not JSON"),
             ((tmp_path / "oops.json",), "oops.json: not a trace"),
             ((tmp_path / "pid.json",), "pid.json: not a trace (an event's pid is not an "
                                        "integer)"),
             ((tmp_path / "old.json",), "old.json: merged by an older jax_gin")]
    # a time that is no finite number (one NaN would make every merged time NaN), and sources
    # that are no [clock, host] pairs
    cases += [((tmp_path / f"{n}.json", a), f"{n}.json: not a trace (an event's ts is not a "
                                            "finite number)") for n in ("nan", "inf", "true")]
    cases += [((a, tmp_path / "dur.json"), "dur.json: not a trace (an event's dur is not a "
                                           "finite number)"),
              ((tmp_path / "src.json",), "src.json: metadata.jax_gin.sources is not a list of "
                                         "[clock, host]"),
              ((tmp_path / "clock.json",), "clock.json: metadata.jax_gin's clock and host are "
                                           "not strings or numbers"),
              ((a, tmp_path / "origin.json"), "origin.json: metadata.jax_gin.origin_us is not "
                                              "a finite number")]
    for files, msg in cases:
        rc, got = _merge(capsys, *files, "-o", out)
        assert rc == 2 and msg in got.err and got.err.count("\n") == 1, (files, got.err)
        assert not out.exists()
    assert _merge(capsys, a, b, "-o", tmp_path / "ab.json")[0] == 0
    for files in ((tmp_path / "ab.json", a), (a, tmp_path / "ab.json"),
                  (tmp_path / "ab.json", tmp_path / "ab.json")):
        rc, got = _merge(capsys, *files, "-o", out)
        assert rc == 2 and "would be duplicated" in got.err and not out.exists(), got.err
    before = (tmp_path / "b.json").read_text()
    rc, got = _merge(capsys, a, b, "-o", b)
    assert rc == 2 and "the output is one of the inputs" in got.err
    assert (tmp_path / "b.json").read_text() == before
    rc, got = _merge(capsys, a, "-o", tmp_path / "nodir" / "m.json")
    assert rc == 2 and "nodir" in got.err and "does not exist" in got.err


def test_merge_renumbers_clear_of_the_files_own_pids(tmp_path, capsys):
    a = _fake_trace(tmp_path / "a.json", 0, 1000.0)
    b = _fake_trace(tmp_path / "b.json", 0, 1050.0)
    c = _fake_trace(tmp_path / "c.json", 0, 1100.0)
    assert _merge(capsys, b, c, "-o", tmp_path / "bc.json")[0] == 0  # pids 0 and 1000
    assert _merge(capsys, a, tmp_path / "bc.json", "-o", tmp_path / "all.json")[0] == 0
    doc = json.loads((tmp_path / "all.json").read_text())
    by_pid = {}
    for e in doc["traceEvents"]:
        if e.get("cat") == "jax_gin":
            by_pid.setdefault(e["pid"], []).append(e["ts"])
    assert sorted(len(v) for v in by_pid.values()) == [2, 2, 2]
