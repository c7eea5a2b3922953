"""Programs that run where they were not lowered: after jax_gin.runtime.reset(), in another
process (a serialized executable), and from JAX's persistent compilation cache. A jax_gin
custom call names its communicator by an id derived from where the communicator meets, the
settings its processes share and the resets so far, with a fingerprint of the same beside it:
a program runs where this process has set up that communicator, in whatever order, and where
it lacks it fails with an error that says so, never reducing over another communicator."""
import os
import subprocess
import sys
import textwrap
import time

import jax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, ndev, needs_devices
from helpers import assert_bitwise, exact_input, smap

MISSING = "does not exist in this process"


def test_reset_then_the_same_functions_run_again():
    """reset() clears JAX's compiled programs too: the same jitted function, and a new jit of
    the same function, are lowered again with a new communicator. A program compiled ahead of
    time before the reset names the destroyed communicator and says so, also once the new
    one is set up (the resets count into the ids)."""
    needs_devices(2)
    mesh = mesh_1d()
    x = exact_input((64,), ndev(), "float32")
    step = jax.shard_map(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh=mesh,
                         in_specs=P("i"), out_specs=P("i"))
    want = smap(lambda v: lax.psum(v, "i"), mesh, P("i"))(x)
    train_step = jax.jit(step)
    compiled = train_step.lower(x).compile()
    assert_bitwise(train_step(x), want)
    jax_gin.runtime.reset()
    assert_bitwise(train_step(x), want)
    assert_bitwise(jax.jit(step)(x), want)
    with pytest.raises(Exception, match=MISSING):
        jax.block_until_ready(compiled(x))


def test_reset_waits_for_programs_still_running():
    """reset() right after dispatch (JAX runs programs asynchronously): the calls in flight
    finish on their communicators before those are destroyed, with lax's bits."""
    needs_devices(2)
    mesh = mesh_1d()
    x = exact_input((1 << 16,), ndev(), "float32")
    want = smap(lambda v: lax.psum(v, "i"), mesh, P("i"))(x)
    for _ in range(5):
        f = smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh, P("i"))
        ys = [f(x) for _ in range(4)]  # dispatched, not awaited
        jax_gin.runtime.reset()
        for y in ys:
            assert_bitwise(y, want)


def test_reset_interrupted_in_its_wait_changes_nothing(monkeypatch):
    """An interrupt (Ctrl-C) while reset() waits for a program still running leaves the
    communicators, JAX's caches and the count of resets (in every program's fingerprint) as
    they were: the functions compiled before still run on their communicators."""
    needs_devices(2)
    from jax_gin import _runtime
    mesh = mesh_1d()
    x = exact_input((1 << 10,), ndev(), "float32")
    want = smap(lambda v: lax.psum(v, "i"), mesh, P("i"))(x)
    f = smap(lambda v: jax_gin.psum(v, "i", algorithm="one_shot"), mesh, P("i"))
    assert_bitwise(f(x), want)
    before = (_runtime.resets, _runtime.num_communicators())

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(_runtime, "wait_for_live_arrays", interrupted)
    with pytest.raises(KeyboardInterrupt):
        jax_gin.runtime.reset()
    assert (_runtime.resets, _runtime.num_communicators()) == before
    assert_bitwise(f(x), want)


def test_interrupt_while_a_communicator_is_set_up(monkeypatch):
    """An interrupt (Ctrl-C) during or after the native set-up, before the communicator is
    cached, destroys it: the next call sets it up again under the same id (it failed with
    "communicator id N is taken" while the first one leaked)."""
    needs_devices(2)
    from jax_gin import _native
    mesh = mesh_1d()
    x = exact_input((1 << 10,), ndev(), "float32")
    want = smap(lambda v: lax.psum(v, "i"), mesh, P("i"))(x)
    jax_gin.runtime.reset()
    set_fingerprint = _native.cpu.cpu_comm_set_fingerprint

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(_native.cpu, "cpu_comm_set_fingerprint", interrupted)
    f = smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh, P("i"))
    with pytest.raises(KeyboardInterrupt):
        f(x)
    monkeypatch.setattr(_native.cpu, "cpu_comm_set_fingerprint", set_fingerprint)
    assert_bitwise(smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh, P("i"))(x), want)
    # an interrupt during the native set-up, raised as it returns (before its result is kept)
    jax_gin.runtime.reset()
    create = _native.cpu.cpu_comm_create

    def created_then_interrupted(*args, **kwargs):
        create(*args, **kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(_native.cpu, "cpu_comm_create", created_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh, P("i"))(x)
    monkeypatch.setattr(_native.cpu, "cpu_comm_create", create)
    assert_bitwise(smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh, P("i"))(x), want)


def test_reset_under_a_dropped_program(monkeypatch):
    """reset() right after dispatching a program whose results are dropped: reset() does not
    wait for it, so its ranks that come to a call after the reset no longer find the
    communicator, and those already in a call give up at once rather than wait out the
    timeout. The next program runs with lax's bits, long before one timeout."""
    needs_devices(2)
    timeout = 20.0
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", timeout)
    mesh = mesh_1d()
    x = exact_input((1 << 12,), ndev(), "float32")
    want = smap(lambda v: lax.psum(v, "i"), mesh, P("i"))(x)

    def chain(v):
        for _ in range(30):
            v = jax_gin.psum(v, "i", algorithm="one_shot") * 0.125
        return v
    start = time.monotonic()
    for _ in range(3):
        f = smap(chain, mesh, P("i"))
        f(x)  # dispatched, its results dropped
        jax_gin.runtime.reset()
        g = smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh, P("i"))
        assert_bitwise(g(x), want)
    assert time.monotonic() - start < timeout / 2
    # Its last communicator is cached under this test's timeout: leave it to no other test.
    jax_gin.runtime.reset()


_WORKER = textwrap.dedent("""
    import pickle, sys
    import jax, numpy as np
    from jax import lax
    from jax.experimental import serialize_executable
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_gin
    sys.path.insert(0, ".")  # the tests' folder, this process's working directory
    from helpers import assert_bitwise

    mode, path = sys.argv[1], sys.argv[2]
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("x",))
    x = jax.device_put(np.arange(8 * 16, dtype=np.float32) % 7, jax.NamedSharding(mesh, P("x")))
    def smap(body, m, spec):
        return jax.jit(jax.shard_map(body, mesh=m, in_specs=spec, out_specs=spec))
    f = smap(lambda v: jax_gin.psum(v, "x", algorithm="one_shot"), mesh, P("x"))
    want = np.asarray(smap(lambda v: lax.psum(v, "x"), mesh, P("x"))(x))
    if mode == "save":
        compiled = f.lower(x).compile()
        with open(path, "wb") as fh:
            pickle.dump(serialize_executable.serialize(compiled), fh)
        got = compiled(x)
    else:
        if mode in ("other", "later"):  # a communicator over "b" of a 2 x 4 mesh first
            m2 = Mesh(devices.reshape(2, 4), ("a", "b"))
            smap(lambda v: jax_gin.psum(v, "b", algorithm="one_shot"), m2, P(("a", "b")))(x)
        if mode in ("same", "later"):  # this process lowers the same program (its communicator)
            f(x)
        with open(path, "rb") as fh:
            got = serialize_executable.deserialize_and_load(*pickle.load(fh))(x)
    try:
        assert_bitwise(got, want)
        print("RESULT equal")
    except AssertionError:
        print("RESULT wrong")
""")


def _run(mode: str, path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(os.path.dirname(path), "worker.py")
    with open(script, "w") as fh:
        fh.write(_WORKER)
    return subprocess.run([sys.executable, script, mode, path], env=env, cwd=here,
                          capture_output=True, text=True, timeout=300)


def test_serialized_executable_in_another_process(tmp_path):
    """A serialized executable loaded in another process: where that process has set up the
    same communicator (after another one, too) it runs and is right; where it has only
    another, the call fails and says the program was lowered elsewhere."""
    if jax.default_backend() != "cpu":
        pytest.skip("the worker processes run on 8 CPU devices")
    path = str(tmp_path / "program.pkl")
    r = _run("save", path)
    assert "RESULT equal" in r.stdout, r.stdout + r.stderr
    for mode in ("same", "later"):
        r = _run(mode, path)
        assert "RESULT equal" in r.stdout, r.stdout + r.stderr
    r = _run("other", path)
    assert r.returncode != 0 and "RESULT" not in r.stdout, r.stdout + r.stderr
    assert MISSING in r.stderr and "lowered in another process" in r.stderr, r.stderr


_CACHE_WORKER = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_gin

    cache, mode = sys.argv[1], sys.argv[2]
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    devices = np.array(jax.devices())
    x = np.arange(8 * 16, dtype=np.float32) % 7
    def smap(body, m, spec):
        return jax.jit(jax.shard_map(body, mesh=m, in_specs=spec, out_specs=spec))
    if mode == "other_first":  # another communicator is set up first
        m2 = Mesh(devices.reshape(2, 4), ("a", "b"))
        smap(lambda v: jax_gin.psum(v, "b", algorithm="one_shot"), m2, P(("a", "b")))(x)
    mesh = Mesh(devices, ("x",))
    f = smap(lambda v: jax_gin.psum(jax_gin.psum(v, "x", algorithm="ring"), "x", overlap=True),
             mesh, P("x"))
    want = np.tile(x.reshape(8, 16).sum(0) * 8, 8)
    print("RESULT", "equal" if np.array_equal(np.asarray(f(x)), want) else "wrong")
""")


def test_persistent_cache_across_processes(tmp_path):
    """JAX's persistent compilation cache keys on a program's text: a second process finds
    the first's program (a psum and an asynchronous pair) although it set up another
    communicator before it, so it adds only the other program's entry."""
    if jax.default_backend() != "cpu":
        pytest.skip("the worker processes run on 8 CPU devices")
    script, cache = tmp_path / "cache_worker.py", tmp_path / "cache"
    script.write_text(_CACHE_WORKER)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    entries = []
    for mode in ("first", "other_first"):
        r = subprocess.run([sys.executable, str(script), str(cache), mode], env=env,
                           capture_output=True, text=True, timeout=300)
        assert "RESULT equal" in r.stdout, r.stdout + r.stderr
        entries.append({p.name for p in cache.iterdir() if p.name.startswith("jit_")})
    assert len(entries[0]) == 1 and entries[0] < entries[1] and len(entries[1]) == 2, entries


def test_ids_of_fingerprints_alike(monkeypatch):
    """A communicator's id is its fingerprint; where another communicator of the process has
    that id, the next free one. The native registries refuse a taken id."""
    from jax_gin import _native, _runtime
    monkeypatch.setattr(_runtime, "_fingerprints", {(True, 5): 5, (True, 6): 99})
    assert _runtime._free_id(5, True) == 7
    assert _runtime._free_id(5, False) == 5  # GPU ids are counted apart
    assert _runtime._free_id(0, True) == 1
    monkeypatch.setattr(_runtime, "_fingerprints", {(True, 0x7FFFFFFF): 1})
    assert _runtime._free_id(0x7FFFFFFF, True) == 1
    monkeypatch.undo()
    x = exact_input((8,), ndev(), "float32")
    smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh_1d(), P("i"))(x)
    cpu = jax.devices()[0].platform == "cpu"
    taken = next(c for (on_cpu, c) in _runtime._fingerprints if on_cpu == cpu)
    with pytest.raises(ValueError, match=rf"communicator id {taken} is taken"):
        if cpu:
            _native.cpu.cpu_comm_create(1, [0], [0], 4096, 1.0, id=taken)
        else:  # refused before any device work
            _native.cuda.comm_create([[0]], 4096, 1.0, id=taken)
