"""No silent hangs: an injected fault makes every wait time out with op, rank, peer and step."""
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from jax_gin import _native
from jax_gin._ops import ALGORITHM_CODES, OP_CODES
from conftest import mesh_1d, ndev, needs_devices
from helpers import assert_bitwise, exact_input, smap


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_fault_injection_times_out(monkeypatch, algo):
    needs_devices(2)  # a fault needs a peer to wait for
    if jax.default_backend() != "cpu":
        pytest.skip("the GPU fault test runs in the native harness (a trap kills the context)")
    # A communicator that timed out is never reused; a distinct timeout gives each case its own.
    timeout = 0.5 + 0.01 * jax_gin.ALGORITHMS.index(algo)
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", timeout)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", 1)  # rank 1 never signals
    x = exact_input((100,), ndev(), "float32")
    f = smap(lambda v: jax_gin.psum(v, "i", algorithm=algo), mesh_1d(), P("i"))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(f(x))
    msg = str(info.value)
    # Which device's error XLA reports first is arbitrary; each names op, rank, peer, step.
    assert re.search(rf"jax_gin psum \({algo}\) on CPU: rank \d+ of group 0 \(\d+ ranks\)", msg), msg
    # the wait that timed out first, as that rank's own error or repeated by one that gave up
    assert re.search(rf"timed out after {timeout:g} s waiting for peer \d+", msg.splitlines()[0]), msg
    # the broken communicator refuses later calls instead of running on corrupted state, and
    # says how to recover
    with pytest.raises(Exception, match=r"(?s)cannot be reused.*jax_gin\.runtime\.reset\(\)"):
        jax.block_until_ready(f(x))
    assert re.search(r"(at step \d+ of round \d+|\(credit\) before round \d+)", msg), msg


_OTHER_CALLS = {
    # name in the error -> the call (ring: a fault leaves every rank waiting on its neighbour)
    "pmax (ring)": lambda v: jax_gin.pmax(v, "i", algorithm="ring"),
    "pmin (two_shot)": lambda v: jax_gin.pmin(v, "i", algorithm="two_shot"),
    "psum (ring)#overlap": lambda v: jax_gin.psum(v, "i", algorithm="ring", overlap=True),
    "psum (one_shot)#overlapping": lambda v: jax_gin.psum_overlapping(
        v, "i", lambda u: u * 2, v, algorithm="one_shot")[0],
}


@pytest.mark.parametrize("name", list(_OTHER_CALLS))
def test_fault_injection_times_out_in_other_calls(monkeypatch, name):
    # max and min, the asynchronous start/done pairs: each wait times out and names its call,
    # and the communicator refuses the next call (the fused norms: the test below)
    needs_devices(2)
    if jax.default_backend() != "cpu":
        pytest.skip("the GPU fault test runs in the native harness (a trap kills the context)")
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", 0.5)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", 1)
    x = exact_input((100,), ndev(), "float32")
    f = smap(_OTHER_CALLS[name], mesh_1d(), P("i"))
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(f(x))
    msg = str(info.value)
    what = re.escape(name.split("#")[0])
    assert re.search(rf"jax_gin {what} on CPU: rank \d+ of group 0", msg), msg
    assert re.search(r"timed out after 0.5 s waiting for peer \d+", msg.splitlines()[0]), msg
    with pytest.raises(jax.errors.JaxRuntimeError, match="cannot be reused"):
        jax.block_until_ready(f(x))


def test_every_rank_names_the_first_failure(monkeypatch):
    """Whichever device's error the caller sees, its first line has the wait that timed out
    first: a rank that gave up after another failed names that rank and repeats its wait."""
    needs_devices(2)  # a fault needs a peer to wait for
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only: on a GPU each rank's wait times out on its own (harness)")
    timeout = 0.43
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", timeout)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", 1)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_mode", "absent")
    x = exact_input((1000,), ndev(), "float32")
    out = smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh_1d(), P("i"))(x)
    first_lines = {}
    for shard in out.addressable_shards:
        with pytest.raises(Exception) as info:
            if shard.device.id == 1:  # the absent rank returned at once: no error of its own
                raise RuntimeError("absent")
            shard.data.block_until_ready()
        first_lines[shard.device.id] = str(info.value).splitlines()[0]
    timed_out = {r for r, line in first_lines.items()
                 if re.search(rf"rank {r} of group 0 \(\d+ ranks\) timed out after {timeout:g} s "
                              r"waiting for peer \d+", line)}
    assert timed_out, first_lines
    for r, line in first_lines.items():
        if r == 1 or r in timed_out:
            continue
        m = re.search(rf"rank {r} of group 0 \(\d+ ranks\) gave up waiting for peer \d+ at step "
                      rf"\d+ of round \d+ \(flag \d+, expected \d+\), because rank (\d+) failed "
                      rf"first: it timed out after {timeout:g} s waiting for peer \d+ .*Set "
                      r"JAX_GIN_TIMEOUT_S to wait longer\.$", line)
        assert m and int(m.group(1)) in timed_out, (r, line)


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
@pytest.mark.parametrize("api", ["psum_add_rmsnorm", "psum_add_layernorm"])
def test_fused_norms_are_named_in_hang_reports(monkeypatch, api, algo):
    """Each algorithm's fused norm (one_shot and two_shot have schedules of their own, not the
    ring's or the tree's) times out naming its call, rank, peer and step, and leaves a
    communicator that refuses the next call."""
    needs_devices(2)  # a fault needs a peer to wait for
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only: the GPU fault test runs in the native harness")
    # each case gets a communicator of its own: the conftest fixture drops the faulty one
    timeout = 0.4
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", timeout)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", 1)
    x = exact_input((4, 64), ndev(), "float32")
    w = jax.numpy.ones((64,), "float32")
    fn = getattr(jax_gin, api)
    norm = (lambda v: fn(v, v, w, "i", algorithm=algo)) if api.endswith("rmsnorm") else \
        (lambda v: fn(v, v, w, w, "i", algorithm=algo))
    f = smap(lambda v: norm(v)[0], mesh_1d(), P("i"))
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(f(x))
    msg = str(info.value)
    assert re.search(rf"jax_gin {api} \({algo}\) on CPU: rank \d+ of group 0 \(\d+ ranks\)", msg), msg
    # the wait that timed out first (as that rank's own error or repeated by one that gave up),
    # with its peer and step
    assert re.search(rf"timed out after {timeout:g} s waiting for peer \d+ (at step \d+ of round "
                     r"\d+|to release its window \(credit\) before round \d+)",
                     msg.splitlines()[0]), msg
    assert re.search(rf"call #\d+ \({api}, {algo}\)", msg), msg
    # the refusal quotes the failed call
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=rf"cannot be reused: jax_gin {api} \({algo}\) on CPU"):
        jax.block_until_ready(f(x))


def test_recovery_after_a_failure(monkeypatch):
    """What the refusal says works: reset(), then a freshly jitted function."""
    needs_devices(2)  # a fault needs a peer to wait for
    if jax.default_backend() != "cpu":
        pytest.skip("on a GPU a timed-out kernel aborts the CUDA context (harness)")
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", 0.37)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", 1)
    x = exact_input((100,), ndev(), "float32")
    body = lambda v: jax_gin.psum(v, "i", algorithm="ring")
    with pytest.raises(Exception, match="waiting for peer"):
        jax.block_until_ready(smap(body, mesh_1d(), P("i"))(x))
    # With the same settings a freshly jitted function gets the cached, broken communicator.
    with pytest.raises(Exception, match="cannot be reused"):
        jax.block_until_ready(smap(lambda v: body(v) + 0, mesh_1d(), P("i"))(x))
    # reset() forgets it: the same settings now form a new communicator, which runs (and,
    # with the fault still injected, times out anew instead of being refused).
    jax_gin.runtime.reset()
    with pytest.raises(Exception, match="waiting for peer") as info:
        jax.block_until_ready(smap(lambda v: body(v) - 0, mesh_1d(), P("i"))(x))
    assert "cannot be reused" not in str(info.value)  # (a refusal quotes the first timeout)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", -1)
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", 60.0)  # a healthy call, on busy cores
    jax_gin.runtime.reset()
    out = smap(lambda v: body(v) * 1, mesh_1d(), P("i"))(x)
    assert_bitwise(out, smap(lambda v: lax.psum(v, "i"), mesh_1d(), P("i"))(x))


def test_report_names_the_groups_axes_and_devices(monkeypatch):
    """A report's ranks and call numbers are its group's: its last line names the group's
    mesh axes, the other axes' coordinates and its ranks' JAX device ids (a reversed 2-D
    mesh: ranks are not device ids)."""
    n = ndev()
    if jax.default_backend() != "cpu" or n < 4 or n % 2:
        pytest.skip("CPU; a 2-D mesh of an even number >= 4 of devices")
    from jax.sharding import Mesh
    devices = np.array(jax.devices())[::-1].reshape(2, n // 2)
    mesh = Mesh(devices, ("a", "b"))
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", 0.32)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", 1)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_mode", "absent")
    f = jax.jit(jax.shard_map(lambda v: jax_gin.psum(v, "b", algorithm="one_shot"), mesh=mesh,
                              in_specs=P(("a", "b")), out_specs=P("a")))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(f(exact_input((16,), n, "float32")))
    msg = str(info.value)
    g = int(re.search(r"rank \d+ of group (\d) ", msg).group(1))
    ids = ", ".join(str(d.id) for d in devices[g])
    assert msg.rstrip().splitlines()[-1] == (
        f"group {g} of the communicator over mesh axes ('b',), where a = {g}: its ranks "
        f"0-{n // 2 - 1} are devices {ids} (JAX device ids)"), msg


def test_report_names_where_a_rank_behind_is_held_in_another_communicator(monkeypatch):
    """Device 1 skips a psum over "b" (a cond); every device then sums over "a" what its psum
    over "b" gave. The psum over "a" of column b = 0 times out first (its communicator's
    timeout is the shorter): its rank 0, device 0, never entered it, held in the psum over
    "b" by device 1. The report says where device 0 is and what it waits for there."""
    n = ndev()
    if jax.default_backend() != "cpu" or n != 8:
        pytest.skip("CPU; a 2 x 4 mesh of 8 devices")
    from jax.sharding import Mesh
    from jax_gin import _runtime
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    create = _runtime.communicator

    def communicator(platform, mesh, axes):  # the psum over "b" waits the longer
        with monkeypatch.context() as m:
            m.setattr(_runtime.settings, "timeout_s", 2.0 if tuple(axes) == ("b",) else 0.5)
            return create(platform, mesh, axes)
    monkeypatch.setattr(_runtime, "communicator", communicator)

    def body(v):
        skip = (lax.axis_index("a") == 0) & (lax.axis_index("b") == 1)
        y = lax.cond(skip, lambda u: u, lambda u: jax_gin.psum(u, "b", algorithm="one_shot"), v)
        return jax_gin.psum(y, "a", algorithm="one_shot")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b")),
                              check_vma=False))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(f(exact_input((16,), n, "float32")))
    msg = str(info.value)
    # which column's error JAX raises varies: b = 0, 2 or 3 (column 1's sum completes)
    b = int(re.search(r"rank \d of group (\d) \(2 ranks\)", msg).group(1))
    assert b in (0, 2, 3), msg
    assert "diagnosis: rank 0 never entered call #1 (psum, one_shot)" in msg, msg
    assert (f"note: rank 0 (device {b}) is in another communicator's call #1 (psum, one_shot) "
            f"as its rank {b}, waiting for rank 1 at step 0 of round 1 (group 0 of the "
            "communicator over mesh axes ('b',), where a = 0: its ranks 0-3 are devices 0, 1, "
            "2, 3 (JAX device ids))") in msg, msg
    assert msg.rstrip().splitlines()[-1] == (
        f"group {b} of the communicator over mesh axes ('a',), where b = {b}: its ranks 0-1 "
        f"are devices {b}, {b + 4} (JAX device ids)"), msg


def test_report_notes_no_call_of_another_communicator_that_failed(monkeypatch):
    """A communicator that failed earlier keeps its ranks' failed waits: a later hang on
    another communicator of the same devices does not note them as calls its ranks are in."""
    needs_devices(2)
    if jax.default_backend() != "cpu":
        pytest.skip("CPU")
    from jax.sharding import Mesh
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", 0.35)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_mode", "absent")
    msgs = []
    for name, rank in (("j", 1), ("i", ndev() - 1)):
        mesh = Mesh(np.array(jax.devices()), (name,))
        monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", rank)
        f = jax.jit(jax.shard_map(lambda g: jax_gin.psum(g, name, algorithm="ring"),
                                  mesh=mesh, in_specs=P(name), out_specs=P()))
        with pytest.raises(Exception) as info:
            jax.block_until_ready(f(exact_input((64,), ndev(), "float32")))
        msgs.append(str(info.value))
    assert "never entered call #1 (psum, ring)" in msgs[1], msgs[1]
    assert "note: rank" not in msgs[1], msgs[1]


@pytest.mark.parametrize("extra", [1, -1])
def test_report_of_a_loop_that_runs_another_count_on_one_device(monkeypatch, extra):
    """Device 3's loop makes one call more (or fewer) than the others': the ranks that never
    entered the call are in none, and the diagnosis says that their programs have not come to
    it, or that the ranks in it make a call theirs do not."""
    needs_devices(4)
    if jax.default_backend() != "cpu":
        pytest.skip("CPU")
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", 0.34 + 0.01 * extra)

    def body(g):
        count = jnp.where(lax.axis_index("i") == 3, 3 + extra, 3)
        return lax.fori_loop(0, count, lambda k, g: jax_gin.psum(g, "i", algorithm="ring") / 8, g)
    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=P("i"), out_specs=P("i"),
                              check_vma=False))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(f(exact_input((64,), ndev(), "float32")))
    msg = str(info.value)
    if extra > 0:
        assert "none of them is in a call of this communicator: their programs have not come " \
               "to call #4 yet (it may be held in another communicator's call), or rank 3 " \
               "entered a call that theirs do not make (a loop or a cond that differs between " \
               "devices)" in msg, msg
    else:
        assert "diagnosis: rank 3 never entered call #3 (psum, ring)" in msg, msg
        assert "it is in no call of this communicator: its program has not come to call #3 " \
               "yet (it may be held in another communicator's call), or ranks " in msg, msg


def test_fault_only_affects_its_communicator(monkeypatch):
    needs_devices(2)  # a fault needs a peer to wait for
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only")
    x = exact_input((10,), ndev(), "float32")
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", 0.31)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", 0)
    f = smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh_1d(), P("i"))
    with pytest.raises(Exception, match=r"jax_gin psum \(ring\) on CPU: rank \d+ .*waiting for peer") as info:
        jax.block_until_ready(f(x))
    assert "cannot be reused" not in str(info.value)  # this call timed out, not an earlier one
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", -1)
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", 60.0)  # a healthy call, on busy cores
    g = smap(lambda v: jax_gin.psum(v, "i", algorithm="ring") + 0, mesh_1d(), P("i"))
    assert_bitwise(g(x), smap(lambda v: lax.psum(v, "i"), mesh_1d(), P("i"))(x))


def test_threads_harness_timeout():
    x = np.ones((4, 50), np.float32)
    with pytest.raises(RuntimeError, match=r"rank \d of group 0 \(4 ranks\) .*waiting for peer \d at step \d"):
        _native.cpu.threads_allreduce(x, OP_CODES["sum"], ALGORITHM_CODES["ring"], 4096,
                                      timeout_s=0.3, fault_rank=2)


# A shim for LD_PRELOAD: after probe_arm(n), pthread_create succeeds n more times, then fails
# with EAGAIN, as under a limit on threads (ulimit -u, a container's pids limit).
_THREAD_LIMIT_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
static int armed, left;
void probe_arm(int n) { armed = 1; left = n; }
int pthread_create(pthread_t* t, const pthread_attr_t* a, void* (*f)(void*), void* arg) {
  static int (*real)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  if (!real) real = (int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*))
      dlsym(RTLD_NEXT, "pthread_create");
  if (armed) { if (left <= 0) return EAGAIN; --left; }
  return real(t, a, f, arg);
}
"""

_THREAD_LIMIT_CHILD = r"""
import ctypes, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_gin
jax_gin.runtime.settings.timeout_s = 60
mesh = Mesh(np.array(jax.devices()), ("i",))
f = jax.jit(jax.shard_map(lambda v: jax_gin.psum(v, "i", algorithm="one_shot"), mesh=mesh,
                          in_specs=P("i"), out_specs=P()))
x = jnp.ones(len(jax.devices()) * 16, jnp.float32)
f.lower(x).compile()
jax.block_until_ready(jax.jit(lambda v: v + 1)(x))   # XLA's own threads are up
ctypes.CDLL(None).probe_arm(len(jax.devices()) - 1)  # every rank's worker starts but one
t = time.monotonic()
try:
    jax.block_until_ready(f(x))
    print("NO ERROR")
except Exception as e:
    print("ERROR", round(time.monotonic() - t, 1), str(e).replace("\n", " "))
"""


def test_worker_thread_that_cannot_start(tmp_path):
    """A rank whose worker thread cannot start (a limit on threads; each communicator runs one
    per device) fails its call at once and says why, and its peers give up at once repeating
    it, instead of peers that wait out the timeout and then blame a rank that "never entered
    the call", with no word of the thread."""
    needs_devices(2)
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler for the LD_PRELOAD shim")
    (tmp_path / "shim.c").write_text(_THREAD_LIMIT_SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "shim.c"), "-ldl"],
                   check=True, capture_output=True)
    (tmp_path / "child.py").write_text(_THREAD_LIMIT_CHILD)
    # after a preloaded sanitizer's runtime, which must come first (docs/debugging.md)
    preload = " ".join(p for p in (os.environ.get("LD_PRELOAD"), str(shim)) if p)
    env = dict(os.environ, LD_PRELOAD=preload, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={ndev()}")
    r = subprocess.run([sys.executable, str(tmp_path / "child.py")], env=env,
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("ERROR", "NO ERROR"))]
    assert r.returncode == 0 and lines, r.stdout + r.stderr[-3000:]
    assert lines[-1].startswith("ERROR"), lines[-1]
    seconds = float(lines[-1].split()[1])
    assert seconds < 30, lines[-1]  # not the 60 s timeout
    # the rank's own error, or a peer's that repeats it ("because rank 5 failed first: it
    # could not start ..."), whichever device's error JAX raises
    assert re.search(r"rank \d+ (of group 0 of communicator \d+|failed first: it) could not "
                     r"start its worker thread \(Resource temporarily unavailable\)",
                     lines[-1]), lines[-1]
