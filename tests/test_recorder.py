"""The flight recorder (include/jax_gin/recorder.h) on CPU: entries, jax_gin.trace, the merge
tool and the hang report that names the laggard."""
import itertools
import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_gin
from jax_gin import _native, _runtime
from jax_gin._ops import ALGORITHM_CODES, OP_CODES
from jax_gin._select import COLLECTIVE_ALGORITHMS
from conftest import mesh_1d, ndev, needs_devices
from helpers import OPS, exact_input, smap

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU recorder")
C = _native.cpu
_timeouts = itertools.count()


@pytest.fixture
def fresh(monkeypatch):
    """A timeout of its own, so that the test gets communicators of its own."""
    monkeypatch.setattr(_runtime.settings, "timeout_s", 20.0 + 0.001 * next(_timeouts))


def _new_comms(before):
    return [c for c in _runtime.comm_devices if c not in before]


def _fn(api, algo, k=0):
    return smap(lambda v: getattr(jax_gin, api)(v, "i", algorithm=algo) + k, mesh_1d(), P("i"))


def test_record_off_by_default(fresh):
    assert os.environ.get("JAX_GIN_RECORD", "") in ("", "0")
    assert _runtime.settings.record is False and C.recording() is False
    before = set(_runtime.comm_devices)
    jax.block_until_ready(_fn("psum", "ring")(exact_input((64,), ndev(), "float32")))
    (comm,) = _new_comms(before)
    assert C.cpu_recorder_entries(comm) == []


def test_settings_checked(monkeypatch):
    s = _runtime.settings
    for bad in (("record", 2), ("record_entries", 0), ("record_entries", 1 << 20),
                ("record_entries", -4), ("record_entries", 1 << 70),
                ("record_entries", 3), ("record_entries", 100),
                ("fault_mode", "sometimes")):
        with pytest.raises(ValueError):
            setattr(s, *bad)
    monkeypatch.setenv("JAX_GIN_RECORD", "1")
    monkeypatch.setenv("JAX_GIN_RECORD_ENTRIES", "8")
    fromenv = _runtime.Settings()
    assert fromenv.record is True and fromenv.record_entries == 8
    # only the process's settings (jax_gin.runtime.settings) switch the recorder
    assert _runtime.settings.record is False and C.recording() is False


def test_entries_content_and_order(fresh, monkeypatch):
    needs_devices(2)  # a group of one rank runs no rounds
    if ndev() > 8:  # an entry keeps kRecEvents (40) events: every phase of these calls up to 8
        pytest.skip("over more than 8 ranks these calls have more events than an entry keeps")
    monkeypatch.setattr(_runtime.settings, "record", True)
    x = exact_input((1000,), ndev(), "float32")
    before = set(_runtime.comm_devices)
    calls = [("psum", "one_shot"), ("pmax", "ring"), ("pmin", "two_shot"), ("psum", "tree")]
    for api, algo in calls:
        jax.block_until_ready(_fn(api, algo)(x))
    (comm,) = _new_comms(before)
    entries = C.cpu_recorder_entries(comm)
    assert len(entries) == ndev() * len(calls)
    by_rank = {}
    for e in entries:
        by_rank.setdefault(e["rank"], []).append(e)
    assert sorted(by_rank) == list(range(ndev()))
    for rank, es in by_rank.items():
        assert [e["seq"] for e in es] == [1, 2, 3, 4]
        assert [(e["op"], e["algorithm"]) for e in es] == calls
        prev_end, next_round = 0, 1
        for e in es:
            assert e["dtype"] == "float32" and e["bytes"] == 4000 and e["status"] == "done"
            assert e["comm"] == comm and e["group"] == 0 and e["dropped"] == 0
            assert prev_end <= e["t_start"] <= e["t_end"]
            assert e["round0"] == next_round and e["rounds"] == 1
            prev_end, next_round = e["t_end"], e["round0"] + e["rounds"]
            kinds = {ev[0] for ev in e["events"]}
            assert {"send", "wait", "credit"} <= kinds, e["events"]
            if e["seq"] > 1:
                assert "credit_wait" in kinds or e["algorithm"] == "tree"
            for kind, step, peer, rnd, first, last, count in e["events"]:
                assert e["t_start"] <= first <= last <= e["t_end"]
                assert 0 <= peer < ndev() and peer != rank and count >= 1 and rnd == 0
                assert step == -1 if kind.startswith("credit") else step >= 0
        # one_shot: every peer's step-0 data, coalesced into one run per kind
        sends = [ev for ev in es[0]["events"] if ev[0] == "send"]
        assert len(sends) == 1 and sends[0][1] == 0 and sends[0][6] == ndev() - 1
        # ring: 2(N-1) steps, each sent (but the last) and awaited, in order
        waits = [ev[1] for ev in es[1]["events"] if ev[0] == "wait"]
        assert waits == list(range(2 * (ndev() - 1)))


def test_ring_keeps_the_last_calls(fresh, monkeypatch):
    monkeypatch.setattr(_runtime.settings, "record", True)
    monkeypatch.setattr(_runtime.settings, "record_entries", 4)
    before = set(_runtime.comm_devices)
    f = _fn("psum", "one_shot")
    for _ in range(7):
        jax.block_until_ready(f(exact_input((8,), ndev(), "float32")))
    (comm,) = _new_comms(before)
    seqs = [e["seq"] for e in C.cpu_recorder_entries(comm) if e["rank"] == 0]
    assert seqs == [4, 5, 6, 7]


def _spans(doc):
    return [e for e in doc["traceEvents"] if e.get("cat") == "jax_gin"]


def test_trace_json(fresh, tmp_path):
    needs_devices(2)  # over one device auto launches nothing to trace
    path = tmp_path / "t.json"
    x = exact_input((300,), ndev(), "float32")
    calls = [(api, algo) for api in OPS for algo in jax_gin.ALGORITHMS]
    fns = [_fn(api, algo) for api, algo in calls]
    jax.block_until_ready(fns[0](x))  # compiled, and run once before the block
    with jax_gin.trace(path):
        assert C.recording()
        for f in fns:
            jax.block_until_ready(f(x))
    assert not C.recording() and _runtime.settings.record is False
    doc = json.loads(path.read_text())
    assert doc["metadata"]["jax_gin"]["clock"] == "CLOCK_MONOTONIC"
    events = doc["traceEvents"]
    devices = sorted(int(d.id) for d in jax.devices())
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names) == devices
    assert any(e["name"] == "process_name" and e["pid"] == 0 for e in events)
    spans = _spans(doc)
    assert len(spans) == len(calls) * ndev()
    for tid in devices:
        mine = sorted((s for s in spans if s["tid"] == tid), key=lambda s: s["ts"])
        assert [s["name"] for s in mine] == [f"{api} {algo}" for api, algo in calls]
        assert [s["args"]["seq"] for s in mine] == list(range(2, 2 + len(calls)))
        for s in mine:
            assert s["ph"] == "X" and s["pid"] == 0 and s["dur"] >= 0
            assert s["args"]["bytes"] == 1200 and s["args"]["dtype"] == "float32"
            assert s["args"]["round"] >= 1 and s["args"]["status"] == "done"
    phases = [e for e in events if e.get("cat") == "jax_gin.phase"]
    assert phases and {p["args"]["kind"] for p in phases} >= {"send", "wait", "credit"}
    for p in phases:
        assert p["ph"] in ("X", "i")
        inside = [s for s in spans if s["tid"] == p["tid"] and
                  s["ts"] <= p["ts"] and p["ts"] + p.get("dur", 0) <= s["ts"] + s["dur"] + 1e-3]
        assert len(inside) == 1, p
        assert re.fullmatch(r"(send|wait) step \d+|credit|credit wait", p["name"]), p["name"]


def test_trace_keeps_calls_that_failed_waiting_for_rank_0(monkeypatch, tmp_path):
    """Rank 0 never starts the call (a branch that skips it), so the other ranks fail waiting
    for its turn word, before their calls begin: the trace still has those calls, failed."""
    needs_devices(2)
    monkeypatch.setattr(_runtime.settings, "timeout_s", 2.0 + 0.001 * next(_timeouts))
    f = jax.jit(jax.shard_map(
        lambda v: jax.lax.cond(jax.lax.axis_index("i") == 0, lambda u: u,
                               lambda u: jax_gin.psum(u, "i", algorithm="one_shot"), v),
        mesh=mesh_1d(), in_specs=P("i"), out_specs=P("i"), check_vma=False))
    x = exact_input((16,), ndev(), "float32")
    path = tmp_path / "t.json"
    with pytest.raises(Exception, match=r"waiting for peer 0 to start call #1"):
        with jax_gin.trace(path):
            jax.block_until_ready(f(x))
    spans = _spans(json.loads(path.read_text()))
    others = sorted(int(d.id) for d in jax.devices())[1:]
    assert sorted(s["tid"] for s in spans) == others
    for s in spans:
        assert s["name"] == "psum one_shot" and s["args"]["status"] == "failed", s
        assert s["args"]["seq"] == 1 and s["dur"] > 0


def test_merge(fresh, tmp_path):
    f = _fn("psum", "ring")
    x = exact_input((64,), ndev(), "float32")
    jax.block_until_ready(f(x))
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for p in paths:
        with jax_gin.trace(p):
            jax.block_until_ready(f(x))
    out = tmp_path / "all.json"
    r = subprocess.run([sys.executable, "-m", "jax_gin.trace", "merge", *map(str, paths), "-o", str(out)],
                       capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr
    assert f"{2 * ndev()} calls from 2 files" in r.stdout
    doc = json.loads(out.read_text())
    parts = [json.loads(p.read_text()) for p in paths]
    assert len(doc["traceEvents"]) == sum(len(d["traceEvents"]) for d in parts)
    spans = _spans(doc)
    assert len({s["pid"] for s in spans}) == 2  # the same pid in both files: kept apart
    assert min(e["ts"] for e in doc["traceEvents"] if "ts" in e) == 0
    # on one clock: the second file's calls come after the first's
    a_end = max(s["ts"] + s["dur"] for s in _spans(parts[0]))
    base = doc["metadata"]["jax_gin"]["origin_us"]
    second = [s for s in spans if s["pid"] != 0]
    assert min(s["ts"] for s in second) + base >= a_end


def _fault(monkeypatch, algo, mode, timeout, rank=1, size=256, api="psum"):
    needs_devices(2)  # a fault needs a peer to wait for
    monkeypatch.setattr(_runtime.settings, "timeout_s", timeout)
    monkeypatch.setattr(_runtime.settings, "fault_rank", rank)
    monkeypatch.setattr(_runtime.settings, "fault_mode", mode)
    f = _fn(api, algo) if api == "psum" else smap(
        lambda v: getattr(jax_gin, api)(v, "i", algorithm=algo, tiled=True), mesh_1d(), P("i"))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(f(exact_input((size,), ndev(), "float32")))
    return str(info.value)


def _all_but_rank_1(n):
    """(who, verb): the ranks other than rank 1 of n as a diagnosis names them (laggard.h's
    rank_list: runs of three or more as a range), and its verb."""
    rest = [0] + list(range(2, n))
    who = ", ".join(map(str, rest)) if n <= 4 else f"0, 2-{n - 1}"
    return ("rank " if len(rest) == 1 else "ranks ") + who, "s" if len(rest) == 1 else ""


def test_laggard_never_entered(monkeypatch):
    msg = _fault(monkeypatch, "one_shot", "absent", 0.41)
    who, s = _all_but_rank_1(ndev())
    assert re.search(rf"diagnosis: rank 1 never entered call #1 \(psum, one_shot\); {who} "
                     rf"wait{s} for it at step 0; it made no call on this communicator\.", msg), msg
    assert "rank 1: none" in msg
    assert re.search(r"rank 0: #1 psum/one_shot, (failed )?waiting for rank 1 at step 0 of round 1", msg), msg


def test_laggard_ring_chain(monkeypatch):
    needs_devices(3)  # a chain: rank 2 waits for rank 1, the others for the rank before them
    msg = _fault(monkeypatch, "ring", "absent", 0.42)
    # ranks 3 .. n-1 and 0 each wait for the rank before them (rank 0 alone over 3 ranks)
    tail = "rank 0 waits in that call at step 1" if ndev() == 3 else "ranks .* wait in that call at steps"
    assert re.search(r"diagnosis: rank 1 never entered call #1 \(psum, ring\); rank 2 waits for it "
                     r"at step 0, and " + tail, msg), msg


def test_laggard_signals_lost(monkeypatch):
    # recorder off: the state block behind the report is kept all the same
    assert _runtime.settings.record is False
    msg = _fault(monkeypatch, "one_shot", "drop", 0.43)
    who, s = _all_but_rank_1(ndev())
    assert re.search(rf"diagnosis: rank 1 finished call #1 \(psum, one_shot\), but {who} "
                     rf"still wait{s} for it at step 0: its signals did not arrive", msg), msg
    assert "rank 1: #1 psum/one_shot, done" in msg


@pytest.mark.parametrize("threads, mode, timeout, noted", [
    ("2", "absent", 0.44, True), ("64", "absent", 0.45, False), ("2", "drop", 0.46, False)])
def test_note_on_xla_cpu_threads(monkeypatch, threads, mode, timeout, noted):
    """A rank that never entered the call, where XLA's CPU threads (PJRT_NPROC as the first
    communicator found it, which the test sets) are fewer than 2 a device: the report ends
    with a note naming the setting. None with enough threads, or where every rank entered."""
    monkeypatch.setattr(_runtime, "_pool_threads", (int(threads), f"PJRT_NPROC={threads}"))
    msg = _fault(monkeypatch, "one_shot", mode, timeout)
    note = (f"note: XLA's CPU client runs the programs of this process's {ndev()} CPU devices "
            f"on 2 threads (PJRT_NPROC=2); with fewer than 2 a device it can hold one device's "
            f"program back while its peers' programs wait for it in their collectives. Set "
            f"PJRT_NPROC={2 * ndev()} (or more) before JAX starts (docs/debugging.md)")
    assert (note in msg) == noted and ("note: XLA" in msg) == noted, msg


def test_destroyed_while_running(fresh, monkeypatch):
    """A communicator destroyed (as reset() destroys it) while a program waits in it: its
    waiting ranks give up at once and say so, where they named another rank's failure."""
    needs_devices(2)
    monkeypatch.setattr(_runtime.settings, "fault_rank", 1)
    monkeypatch.setattr(_runtime.settings, "fault_mode", "absent")
    before = set(_runtime.comm_devices)
    out = _fn("psum", "one_shot")(exact_input((64,), ndev(), "float32"))  # waits for rank 1
    [comm] = _new_comms(before)
    # until every rank but rank 1 has entered the call (its waits are in it then)
    deadline = time.monotonic() + 10
    while sum(n for _, rank, n in C.cpu_call_counts(comm) if rank != 1) < ndev() - 1:
        assert time.monotonic() < deadline, C.cpu_call_counts(comm)
        time.sleep(0.01)
    time.sleep(0.05)
    t = time.monotonic()
    C.cpu_comm_destroy(comm)
    try:
        with pytest.raises(Exception) as info:
            jax.block_until_ready(out)
    finally:
        _runtime.reset()  # the cache still names the destroyed communicator
    assert time.monotonic() - t < 5
    msg = str(info.value)
    assert "because jax_gin.runtime.reset() destroyed this communicator while a program ran on " \
           "it" in msg, msg


def test_laggard_threads_harness():
    x = np.ones((4, 50), np.float32)
    with pytest.raises(RuntimeError) as info:
        C.threads_allreduce(x, OP_CODES["sum"], ALGORITHM_CODES["ring"], 4096, timeout_s=0.3,
                            fault_rank=2, fault_mode=1)
    assert re.search(r"diagnosis: rank 2 never entered call #1 \(psum, ring\); rank 3 waits for it at "
                     r"step 0", str(info.value)), str(info.value)


def test_laggard_threads_harness_rank_0_absent():
    """The others wait for rank 0, which sets the order of the group's calls, before the call
    starts (cpu_backend.h: Turn): the report names rank 0 and that wait."""
    x = np.ones((4, 50), np.float32)
    with pytest.raises(RuntimeError) as info:
        C.threads_allreduce(x, OP_CODES["sum"], ALGORITHM_CODES["ring"], 4096, timeout_s=0.3,
                            fault_rank=0, fault_mode=1)
    msg = str(info.value)
    # rank 1's error: its own timeout, or that of the rank that timed out first
    assert re.search(r"timed out after 0.3 s waiting for peer 0 to start call #1 \(it has "
                     r"started no call of the group\)", msg), msg
    assert re.search(r"diagnosis: rank 0 never entered call #1 \(psum, ring\); ranks 1-3 wait for "
                     r"it before the call starts; it made no call on this communicator", msg), msg


def test_laggard_signals_lost_ring(monkeypatch):
    """Rank 1 of a ring loses its signals: it goes on to later steps, while its successor
    still waits for it at step 0. Where the error JAX raises is rank 1's own (it gave up once
    another rank failed), its state says failed."""
    msg = _fault(monkeypatch, "ring", "drop", 0.44)
    nxt = 2 % ndev()
    assert re.search(rf"diagnosis: rank 1 is further on in call #1 \(psum, ring\), waiting for "
                     rf"rank 0 at step [1-9]\d* of round 1( \(failed\))?, but rank {nxt} still waits for it at "
                     rf"step 0: its signals did not arrive\.", msg), msg


def test_laggard_signals_lost_tree(monkeypatch):
    """Rank 1 of a tree loses its signals: it is named, though it may wait at the same step as
    those waiting for it (a later chunk, or the second tree of the double tree)."""
    msg = _fault(monkeypatch, "tree", "drop", 0.45)
    assert re.search(r"diagnosis: rank 1 is further on in call #1 \(psum, tree\), waiting for rank "
                     r"\d+ at step \d of round 1( \(((a later chunk|its second tree)(; failed)?|"
                     r"failed)\))?, but ranks? [\d, -]+ still waits? for it at steps? [\d, ]+: its "
                     r"signals did not arrive\.", msg), msg


@pytest.mark.parametrize("algo", ["one_shot", "two_shot", "ring", "tree"])
def test_laggard_names_every_rank_that_loses_signals(monkeypatch, algo):
    """Whichever rank loses its signals, over several chunks a step, the diagnosis names it:
    it finished the call, or it waits further on (a later step, chunk or tree) than those
    that wait for it."""
    for rank in range(ndev()):
        # 256 KiB a device: a ring's step is 2 chunks of the CPU's 16 KiB over 8 devices
        msg = _fault(monkeypatch, algo, "drop", 0.3 + 0.001 * next(_timeouts), rank, 1 << 16)
        assert re.search(rf"diagnosis: rank {rank} (finished|is further on in) call #1 "
                         rf"\(psum, {algo}\).*: its signals did not arrive\.", msg), msg


@pytest.mark.parametrize("algo", COLLECTIVE_ALGORITHMS)
@pytest.mark.parametrize("api", ["psum_scatter", "all_gather"])
def test_laggard_names_every_rank_that_loses_signals_in_collectives(monkeypatch, api, algo):
    """As for psum: psum_scatter's and all_gather's schedules (one block of several chunks)."""
    for rank in range(ndev()):
        msg = _fault(monkeypatch, algo, "drop", 0.3 + 0.001 * next(_timeouts), rank,
                     ndev() * 8192, api)  # blocks of 32 KiB: 2 chunks
        assert re.search(rf"diagnosis: rank {rank} (finished|is further on in) call #1 "
                         rf"\({api}, {algo}\).*: its signals did not arrive\.", msg), msg


def _diagnose(algorithm: str, waits: list, self: int) -> str:
    """laggard_text of ranks that are all in call #1 (psum, `algorithm`), each waiting in round
    1 as waits[rank] = (peer, step, failed[, place, kind]) says (place: data_tag's step
    argument, the chunk of a pipelined step; kind: 0 for kData, 2 for a double tree's kDataB),
    as rank `self` of group 0 reports it."""
    psum, algo = OP_CODES["sum"], ALGORITHM_CODES[algorithm]
    # a state: (seq, done, wait seq, wait round, wait peer, wait step, op, algorithm, failed,
    # wait place, wait kind)
    states = []
    for peer, step, failed, *rest in waits:
        place, kind = rest or (step, 0)
        states.append([1, 0, 1, 1, peer, step, psum, algo, int(failed), place, kind])
    return _native.cpu.laggard_text(states, 0, self)


def test_laggard_text_ahead():
    """The states one H200's harness read through the windows when rank 1 of a two_shot psum
    over 4 ranks lost its signals: every rank waits, in a cycle, but rank 1 waits at step 1 for
    a peer while the others wait for it at step 0, which it has passed."""
    # rank 0 failed waiting for rank 1 at step 0; rank 1 waits for rank 2 at step 1
    text = _diagnose("two_shot", [(1, 0, True), (2, 1, False), (1, 0, False), (1, 0, False)], 0)
    assert text.startswith("diagnosis: rank 1 is further on in call #1 (psum, two_shot), waiting "
                           "for rank 2 at step 1 of round 1, but ranks 0, 2, 3 still wait for it "
                           "at step 0: its signals did not arrive."), text
    assert "rank 1: #1 psum/two_shot, waiting for rank 2 at step 1 of round 1" in text, text
    # a rank that timed out shows so, with the wait it failed in
    assert "rank 0: #1 psum/two_shot, failed waiting for rank 1 at step 0 of round 1" in text, text


def test_laggard_text_later_chunk_and_tree():
    """Waits at one step are ordered by chunk, then by tree (the first tree's flags before the
    second's): the rank that waits later at the same step is further on."""
    # rank 1 waits at chunk 3 of step 0; ranks 0 and 2 wait for it at chunk 2
    text = _diagnose("one_shot", [(1, 0, True, 2, 0), (0, 0, False, 3, 0), (1, 0, False, 2, 0)], 0)
    assert text.startswith("diagnosis: rank 1 is further on in call #1 (psum, one_shot), waiting "
                           "for rank 0 at step 0 of round 1 (a later chunk), but ranks 0, 2 still "
                           "wait for it at step 0: its signals did not arrive."), text
    # rank 2 waits in its second tree for rank 0, which waits for it in the first, same chunk;
    # both timed out
    text = _diagnose("tree", [(2, 0, True, 0, 0), (0, 1, False, 4, 0), (0, 0, True, 0, 2)], 0)
    assert text.startswith("diagnosis: rank 2 is further on in call #1 (psum, tree), waiting for "
                           "rank 0 at step 0 of round 1 (its second tree; failed), but rank 0 "
                           "still waits for it at step 0: its signals did not arrive."), text
    # the same waits without the tree: a cycle, as no rank is further on
    text = _diagnose("tree", [(2, 0, True, 0, 0), (0, 1, False, 4, 0), (0, 0, False, 0, 0)], 0)
    assert "wait for each other in a cycle (2 waits for 0 waits for 2)" in text, text


def test_laggard_text_of_a_rank_gone_on_to_its_next_call():
    """The states one H200's harness read when rank 1 of a ring over 2 ranks lost its signals
    and went on to its next call: rank 0 still waits for it in call #1, while rank 1 waits
    for rank 0's credit in call #2. From either rank, rank 1 finished the call."""
    psum, ring = OP_CODES["sum"], ALGORITHM_CODES["ring"]
    # (seq, done, wait seq, wait round, wait peer, wait step, op, algorithm, failed, place, kind)
    rank0 = [1, 0, 1, 1, 1, 0, psum, ring, 1, 0, 0]
    rank1 = [2, 1, 2, 2, 0, -1, psum, ring, 0, 0, 1]
    text = _native.cpu.laggard_text([rank0, rank1], 0, 0)
    assert text.startswith("diagnosis: rank 1 finished call #1 (psum, ring), but rank 0 still "
                           "waits for it at step 0: its signals did not arrive."), text
    rank1[8] = 1  # it timed out too, and reports
    text = _native.cpu.laggard_text([rank0, rank1], 0, 1)
    assert text.startswith("diagnosis: rank 0 never entered call #2 (psum, ring); rank 1 waits "
                           "for it for its credit; it is still in its call #1 (psum, ring), "
                           "waiting for rank 1 at step 0 of round 1; rank 1 has finished that "
                           "call: its signals did not arrive."), text


def test_laggard_text_of_a_rank_that_failed_outside_a_wait():
    """A rank that failed in the call without waiting (a CPU rank whose turn check failed) is
    named as failed, not as busy."""
    psum, one_shot = OP_CODES["sum"], ALGORITHM_CODES["one_shot"]
    # (seq, done, wait seq, wait round, wait peer, wait step, op, algorithm, failed, place, kind)
    rank0 = [2, 1, 2, 2, 1, 0, psum, one_shot, 1, 0, 0]
    rank1 = [2, 1, 0, 0, -1, 0, psum, one_shot, 1, 0, 0]
    text = _native.cpu.laggard_text([rank0, rank1], 0, 0)
    assert text.startswith("diagnosis: rank 1 failed in call #2 (psum, one_shot), not in a wait "
                           "(its own error says how); rank 0 waits for it at step 0."), text
    rank1[8] = 0  # the same rank, not failed: busy or stopped
    assert "rank 1 is in call #2 (psum, one_shot) but not waiting (busy or stopped)" in \
        _native.cpu.laggard_text([rank0, rank1], 0, 0)


def test_laggard_text_of_a_mismatch_before_some_ranks_entered():
    """The states of a ring over 8 ranks in two processes that ran different programs: ranks
    4-5 (process 1) failed the turn check, having started call #1 as a pmax where rank 0
    started a psum, and ranks 6-7 had not entered the call when the group failed. The
    diagnosis names the failed rank, with its own op, not the ranks that never entered."""
    psum, pmax, ring = OP_CODES["sum"], OP_CODES["max"], ALGORITHM_CODES["ring"]
    # (seq, done, wait seq, wait round, wait peer, wait step, op, algorithm, failed, place, kind)
    waiting = [[1, 0, 1, 1, (r - 1) % 8, r, psum, ring, int(r == 2), 0, 0] for r in range(4)]
    failed = [[1, 1, 0, 0, -1, 0, pmax, ring, 1, 0, 0] for _ in range(2)]
    absent = [[0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0] for _ in range(2)]
    text = _native.cpu.laggard_text(waiting + failed + absent, 0, 2)
    assert text.startswith("diagnosis: rank 4 failed in call #1 (pmax, ring), not in a wait "
                           "(its own error says how); ranks 0-3 wait in that call at steps 0, "
                           "1, 2, 3; ranks 6, 7 had not entered it."), text
    assert "never entered" not in text, text


def test_laggard_text_of_gpu_states_with_a_cleared_wait():
    """GPU states (no turn checks): rank 1 timed out, but another lane's end of a wait with
    the same fields cleared its published wait, so it shows failed and not waiting. Rank 3,
    which never entered the call, is still the one named."""
    psum, one_shot = OP_CODES["sum"], ALGORITHM_CODES["one_shot"]
    # (seq, done, wait seq, wait round, wait peer, wait step, op, algorithm, failed, place, kind)
    waiting = [1, 0, 1, 1, 3, 0, psum, one_shot, 0, 0, 0]
    cleared = [1, 0, 0, 1, 3, 0, psum, one_shot, 1, 0, 0]
    absent = [0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0]
    states = [waiting, cleared, list(waiting), absent]
    text = _native.cpu.laggard_text(states, 0, 0, turn_checked=False)
    assert text.startswith("diagnosis: rank 3 never entered call #1 (psum, one_shot)"), text
    # the same states from a CPU group: a failed rank without a wait failed its turn check
    assert _native.cpu.laggard_text(states, 0, 0).startswith(
        "diagnosis: rank 1 failed in call #1 (psum, one_shot), not in a wait")


def test_laggard_text_of_a_late_signal():
    """A rank whose awaited signal is there when it reads its flag again, after the states:
    the signal came late (its peer entered about a timeout after it), and the states, which
    show the peer done, must not make the diagnosis say that its signals did not arrive."""
    psum, one_shot = OP_CODES["sum"], ALGORITHM_CODES["one_shot"]
    # (seq, done, wait seq, wait round, wait peer, wait step, op, algorithm, failed, place, kind)
    rank0 = [1, 0, 1, 1, 1, 0, psum, one_shot, 1, 0, 0]
    rank1 = [1, 1, 0, 0, -1, 0, psum, one_shot, 0, 0, 0]
    assert "its signals did not arrive" in _native.cpu.laggard_text([rank0, rank1], 0, 0)
    text = _native.cpu.laggard_text([rank0, rank1], 0, 0, late_peer=1)
    assert text.startswith("diagnosis: the signal that rank 0 waited for in call #1 (psum, "
                           "one_shot) arrived just after its wait timed out: nothing was lost, "
                           "but rank 1, or a rank that it waited for, was late by about the "
                           "timeout.\nlast calls of group 0: rank 0: #1 psum/one_shot, failed "
                           "waiting for rank 1 at step 0 of round 1; rank 1: #1 psum/one_shot, "
                           "done"), text


def test_laggard_text_of_a_chain_to_a_rank_gone_on():
    """Rank 3 of a tree over 4 ranks lost its signals partway through call #2 and went on to
    call #3, where it waits for a credit; rank 0 waits in call #2 for rank 2, which waits for
    rank 3. Reported by rank 3, the diagnosis follows rank 0's waits to rank 3; reported by
    the others, rank 3 finished the call."""
    psum, tree = OP_CODES["sum"], ALGORITHM_CODES["tree"]
    # (seq, done, wait seq, wait round, wait peer, wait step, op, algorithm, failed, place, kind)
    states = [[2, 1, 2, 2, 2, 1, psum, tree, 0, 1, 0], [2, 1, 2, 2, 3, 1, psum, tree, 0, 1, 0],
              [2, 1, 2, 2, 3, 1, psum, tree, 0, 1, 0], [3, 2, 3, 3, 1, -1, psum, tree, 0, 0, 1]]
    text = _native.cpu.laggard_text(states, 0, 3)
    assert text.startswith("diagnosis: rank 0 never entered call #3 (psum, tree); rank 3 waits "
                           "in that call for its credit; it is still in its call #2 (psum, "
                           "tree), waiting for rank 2 at step 1 of round 2; it waits, through "
                           "rank 2, for rank 3, which has finished that call: its signals did "
                           "not arrive; ranks 1, 2 never entered call #3 either."), text
    text = _native.cpu.laggard_text(states, 0, 0)
    assert text.startswith("diagnosis: rank 3 finished call #2 (psum, tree), but ranks 1, 2 "
                           "still wait for it at step 1: its signals did not arrive."), text


def test_laggard_text_of_a_rank_whose_lane_0_returned():
    """On GPUs lane 0 marks a call returned while the rank's other lanes may still wait: a rank
    whose state says returned but whose published wait is in that call is still in it."""
    psum, ring = OP_CODES["sum"], ALGORITHM_CODES["ring"]
    # (seq, done, wait seq, wait round, wait peer, wait step, op, algorithm, failed, place, kind)
    rank0 = [1, 0, 1, 1, 1, 0, psum, ring, 1, 0, 0]
    rank1 = [1, 1, 1, 1, 0, 1, psum, ring, 0, 1, 0]  # lane 0 returned; a lane waits at step 1
    text = _native.cpu.laggard_text([rank0, rank1], 0, 0)
    assert text.startswith("diagnosis: rank 1 is further on in call #1 (psum, ring), waiting "
                           "for rank 0 at step 1 of round 1, but rank 0 still waits for it at "
                           "step 0: its signals did not arrive."), text
    assert "rank 1: #1 psum/ring, waiting for rank 0 at step 1 of round 1" in text, text
    rank1[2] = 0  # no wait published: the call returned
    text = _native.cpu.laggard_text([rank0, rank1], 0, 0)
    assert text.startswith("diagnosis: rank 1 finished call #1 (psum, ring), but rank 0 still "
                           "waits for it at step 0: its signals did not arrive."), text


def test_laggard_text_of_a_cycle():
    """Waits at one step that close a cycle: the cycle is given, from where the walk from the
    reporting rank enters it."""
    text = _diagnose("ring", [(1, 0, False), (2, 0, False), (0, 0, True), (0, 0, False)], 3)
    assert text.startswith("diagnosis: the ranks of call #1 (psum, ring) wait for each other in "
                           "a cycle (0 waits for 1 waits for 2 waits for 0): one of them sent "
                           "signals that did not arrive."), text


# RecEventKind (include/jax_gin/recorder.h), by the names entry_dict gives them
_KINDS = {1: "send", 2: "wait", 3: "credit", 4: "credit_wait"}


def _note_round(kind, step, value):
    """The round, relative to round0 = 1, that a note of this flag value records (common.h)."""
    rd = value if kind == 3 else value + 1 if step < 0 else (value - 1) >> 16
    return min(max(rd - 1, 0), 0xFFFF)


def _runs_reference(notes):
    """An entry's runs after these notes, as the recorder defines them: a note extends the run
    of the same kind, step and round among the last 4 runs, else starts a run, or counts as
    dropped when the entry holds RECORD_EVENTS runs."""
    runs, dropped = [], 0
    for kind, step, peer, value, t in notes:
        rnd = _note_round(kind, step, value)
        for run in reversed(runs[-4:]):
            if (run[0], run[1], run[3]) == (_KINDS[kind], step, rnd):
                run[2], run[5], run[6] = peer, t, min(run[6] + 1, 255)
                break
        else:
            if len(runs) < C.RECORD_EVENTS:
                runs.append([_KINDS[kind], step, peer, rnd, t, t, 1])
            else:
                dropped += 1
    return [tuple(r) for r in runs], dropped


def _tag(round_, step):
    return (round_ << 16) + step + 1


@pytest.mark.parametrize("raw", [True, False], ids=["gpu_raw", "cpu_runs"])
@pytest.mark.parametrize("seed", range(12))
def test_notes_coalesce_into_runs(seed, raw):
    """What an entry reads as (entry_dict) holds the runs of the definition, whatever the order
    and number of notes (beyond the entry's room, beyond 255 a run), whether the notes were
    stored raw and folded by the reader (rec_mark, lane 0's thread 0 on a GPU) or folded as
    they came (rec_note, every rank on the CPU). A note's place in the entry is an
    implementation's choice; what the entry reads as is what this pins down."""
    rng = np.random.default_rng(seed)
    n = [3, 39, 40, 41, 80, 600][seed % 6]
    notes, t = [], 1000
    for _ in range(n):
        kind = int(rng.integers(1, 5))
        step = -1 if kind >= 3 else int(rng.integers(0, 3 if seed < 6 else 40))
        round_ = int(rng.integers(1, 3))
        value = round_ if kind == 3 else round_ - 1 if kind == 4 else _tag(round_, step)
        t += int(rng.integers(0, 50))
        notes.append((kind, step, int(rng.integers(0, 8)), value, t))
    e = C.rec_notes(notes, raw)
    runs, dropped = _runs_reference(notes)
    assert [tuple(r) for r in e["events"]] == runs and e["dropped"] == dropped
    assert sum(r[6] for r in runs) + dropped <= len(notes)


@pytest.mark.parametrize("raw", [True, False], ids=["gpu_raw", "cpu_runs"])
def test_notes_of_chunked_steps(raw):
    """A step sent and awaited in 300 chunks, for 60 steps: one send and one wait run per step
    while the entry has room (counts saturate at 255), and the rest dropped."""
    notes, t = [], 0
    for step in range(60):
        for _ in range(300):
            t += 1
            notes.append((1, step, 1, _tag(1, step), t))
            notes.append((2, step, 1, _tag(1, step), t))
    e = C.rec_notes(notes, raw)
    runs, dropped = _runs_reference(notes)
    assert [tuple(r) for r in e["events"]] == runs and e["dropped"] == dropped
    assert len(runs) == C.RECORD_EVENTS and runs[0][6] == 255 and runs[0][:4] == ("send", 0, 1, 0)
    assert dropped == (60 - C.RECORD_EVENTS // 2) * 600
