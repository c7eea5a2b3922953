"""Several processes on GPU: the ncclCommInitRank bootstrap through jax.distributed.

Two kinds of tests, each launching this file as a script in 2 processes (the worker is at the
bottom), joined by jax.distributed on 127.0.0.1:
- test_bootstrap_*: run everywhere, on CPU. The workers ask jax_gin's runtime for GPU
  communicators of meshes that span both processes, with the CUDA module replaced by a fake
  that records what it is given. They check the real bootstrap through the key-value store:
  both processes get the same NCCL unique id for every group that spans them, each process
  passes its own ranks and local devices, the process of a group's rank 0 makes the id; a
  missing peer gives a timeout that names the group and the missing ranks; after a set-up
  that one process missed and the other gave up on, both meet when they ask again.
- test_gpu_*: 2 processes with one GPU each (CUDA_VISIBLE_DEVICES), on a machine with >= 2
  GPUs and the CUDA extension; skipped elsewhere (as in CI). Parity with lax bit for bit over
  every algorithm, op and dtype, on 1-D and 1x2 meshes, grad, repeated calls, and a clean
  reset in both processes (`bash scripts/gpu_run.sh test` runs this file). They passed on
  2 x H200 with all seven dtypes (float32, bfloat16, int32, float16, uint32, float64, int64)
  at commits 635bced and 9c4c7b9.
"""
import json
import os
import sys
import tempfile

import pytest

from multiproc import (assert_same_shards, check_grad, check_parity, clean_env, error_of,
                       free_port as _free_port, gpu_count as _gpu_count, global_input, launch,
                       reports as _reports, tail as _tail)

NPROC = 2
CPU_DEVICES = 4  # per process, in the bootstrap tests


def _has_cuda_extension() -> bool:
    import jax_gin
    return jax_gin.has_cuda()


def _launch(scenario: str, timeout: float, gpu: bool, env_extra=None):
    """Runs the worker as NPROC processes: one GPU each, or CPU_DEVICES CPU devices each."""
    if gpu:  # one GPU per process; never preallocate (the parent may hold GPU memory)
        envs = [clean_env(JAX_PLATFORMS="cuda", CUDA_VISIBLE_DEVICES=str(i),
                          XLA_PYTHON_CLIENT_PREALLOCATE="false", **(env_extra or {}))
                for i in range(NPROC)]
    else:
        envs = [clean_env(JAX_PLATFORMS="cpu",
                          XLA_FLAGS=f"--xla_force_host_platform_device_count={CPU_DEVICES}",
                          **(env_extra or {}))] * NPROC
    return launch(__file__, scenario, envs, timeout)


# ---------------------------------------------------------------------------------------
# Bootstrap (CPU, everywhere)


def test_bootstrap_two_processes():
    reports = _reports(_launch("bootstrap", timeout=120, gpu=False,
                               env_extra={"JAX_GIN_TIMEOUT_S": "3"}), "bootstrap")
    for i, (rc, rep, out) in enumerate(reports):
        assert rc == 0 and rep["ok"], f"process {i} rc {rc}:\n{_tail(out)}"
    (_, r0, _), (_, r1, _) = reports
    # cases: name -> [[group, nranks, id hex, ranks, devices], ...] as passed to the native call
    for name in ("1d", "1d_rev", "2d_x", "2d_y", "2d_xy"):
        c0, c1 = r0["cases"][name], r1["cases"][name]
        g0 = {s[0]: s for s in c0}
        g1 = {s[0]: s for s in c1}
        for g in set(g0) & set(g1):  # groups that span both processes: one id for both
            assert g0[g][2] == g1[g][2], (name, g)
            assert sorted(g0[g][3] + g1[g][3]) == list(range(g0[g][1])), (name, g0[g], g1[g])
        for spec in c0 + c1:
            assert len(bytes.fromhex(spec[2])) == 128, spec
            assert len(spec[3]) == len(spec[4]) and spec[3] == sorted(spec[3]), spec
            assert all(0 <= d < CPU_DEVICES for d in spec[4]), spec
    # 1-D mesh of 8: one group, ranks 0-3 in process 0 (which makes the id), 4-7 in process 1.
    assert [s[3] for s in r0["cases"]["1d"]] == [[0, 1, 2, 3]]
    assert [s[3] for s in r1["cases"]["1d"]] == [[4, 5, 6, 7]]
    assert r0["made"]["1d"] == 1 and r1["made"]["1d"] == 0
    # Reversed: rank 0 is in process 1, which makes the id.
    assert r0["made"]["1d_rev"] == 0 and r1["made"]["1d_rev"] == 1
    # 4x2 mesh over "y": 4 groups of 2, each inside one process (local ids, no key-value store).
    assert len(r0["cases"]["2d_y"]) == 2 and len(r1["cases"]["2d_y"]) == 2
    assert r0["made"]["2d_y"] == 2 and r1["made"]["2d_y"] == 2
    # Over "x": 2 groups of 4, each across both processes.
    assert [s[0] for s in r0["cases"]["2d_x"]] == [0, 1] == [s[0] for s in r1["cases"]["2d_x"]]
    # Each group's report line names its axes and global device ids, alike in both processes.
    ids = r0["mesh2_ids"]  # (4, 2): the JAX ids of process 1's devices are not 4-7
    assert r0["texts"]["2d_x"] == r1["texts"]["2d_x"] == [
        f"group {g} of the communicator over mesh axes ('x',), where y = {g}: its ranks 0-3 are "
        f"devices {', '.join(str(row[g]) for row in ids)} (JAX device ids)" for g in (0, 1)]
    # A second communicator of the same key (after reset) gets fresh ids.
    assert r0["cases"]["1d_again"][0][2] == r1["cases"]["1d_again"][0][2]
    assert r0["cases"]["1d_again"][0][2] != r0["cases"]["1d"][0][2]
    # A missing peer: a timeout that names the group and the missing ranks.
    assert r0["missing"].startswith("BootstrapTimeoutError"), r0
    assert "timed out after 3 s setting up the GPU communicator" in r0["missing"], r0
    assert "group 0 is missing ranks 4, 5, 6, 7 (process 1)" in r0["missing"], r0
    # A retry after a set-up that process 0 missed and process 1 gave up on: both meet.
    assert r1["missed"].startswith("BootstrapTimeoutError"), r1
    assert "group 0 is missing ranks 4, 5, 6, 7 (process 0)" in r1["missed"], r1
    assert r0["retry"] == r1["retry"] == "no error", (r0, r1)
    assert r0["cases"]["1d_rev_retry"][0][2] == r1["cases"]["1d_rev_retry"][0][2]
    assert r0["made"]["1d_rev_retry"] == 0 and r1["made"]["1d_rev_retry"] == 1
    # Settings that differ: both processes name the setting and both values (the id's maker
    # reads the other's settings before it waits for NCCL).
    assert r0["mismatch"].startswith("ValueError"), r0
    assert "JAX_GIN_CHUNK_BYTES=65536 here but 131072 in process 1" in r0["mismatch"], r0
    assert r1["mismatch"].startswith("ValueError"), r1
    assert "JAX_GIN_CHUNK_BYTES=131072 here but 65536 in process 0" in r1["mismatch"], r1
    assert "JAX_GIN_OVERLAP_LANES=16 here but 32 in process 1" in r0["overlap_mismatch"], r0
    assert "JAX_GIN_OVERLAP_LANES=32 here but 16 in process 0" in r1["overlap_mismatch"], r1
    for r in (r0, r1):
        assert r["tables"].startswith("ValueError"), r
        assert "JAX_GIN_TUNING_DIR (a digest of its tables)=" in r["tables"], r
    # An unreachable key-value store says so.
    for r in (r0, r1):
        assert r["unreachable"].startswith("KeyValueStoreError"), r
        assert "key-value store" in r["unreachable"] and "unreachable" in r["unreachable"], r


# ---------------------------------------------------------------------------------------
# GPU: 2 processes x 1 GPU (skipped without GPUs)

_GPU_SKIP = None
if _gpu_count() < NPROC:
    _GPU_SKIP = f"needs >= {NPROC} GPUs (nvidia-smi -L)"
elif not _has_cuda_extension():
    _GPU_SKIP = "needs jax_gin's CUDA extension"
needs_gpus = pytest.mark.skipif(_GPU_SKIP is not None, reason=_GPU_SKIP or "")


@needs_gpus
def test_gpu_two_processes_one_gpu_each():
    reports = _reports(_launch("gpu", timeout=540, gpu=True), "gpu")
    for i, (rc, rep, out) in enumerate(reports):
        assert rep["ok"], f"process {i} rc {rc}:\n{_tail(out)}"
        assert rep["checked"] > 100, rep
        assert rep["reset"], f"process {i}: reset did not finish:\n{_tail(out)}"
        assert rc == 0, f"process {i} rc {rc}:\n{_tail(out)}"


# ---------------------------------------------------------------------------------------
# The worker: one process of the job (run as `python test_gpu_multiprocess.py SCENARIO ID PORT`)


def _worker(scenario: str, pid: int, port: int) -> None:
    import jax
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=NPROC, process_id=pid,
                               coordinator_bind_address=f"127.0.0.1:{port}",
                               initialization_timeout=120)
    import numpy as np

    import jax_gin
    from jax_gin import _distributed, _native, _runtime

    report = {"ok": False, "checked": 0}
    devices = np.array(jax.devices())
    if scenario == "bootstrap":
        assert len(devices) == NPROC * CPU_DEVICES
        _bootstrap_worker(pid, devices, report, _distributed, _native, _runtime)
        print("REPORT " + json.dumps(report), flush=True)
        return
    if scenario != "gpu":
        raise SystemExit(f"unknown scenario {scenario}")
    assert jax.default_backend() == "gpu" and len(devices) == NPROC, devices
    _gpu_worker(pid, devices, report, jax_gin, _distributed)
    client = _distributed.distributed_client()
    print("REPORT " + json.dumps(report), flush=True)
    # Both processes free their communicators together, then leave.
    client.wait_at_barrier("test/reset", 120_000)
    jax_gin.runtime.reset()
    client.wait_at_barrier("test/reset_done", 120_000)
    report["reset"] = True
    print("REPORT " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)


def _bootstrap_worker(pid, devices, report, _distributed, _native, _runtime):
    """GPU communicators of CPU meshes, through a fake CUDA module: the key-value bootstrap
    and what reaches the native call, without a GPU."""
    from jax.sharding import Mesh

    class FakeCuda:
        def __init__(self):
            self.made = 0
            self.specs = None
            self.next = 100

        def unique_id(self):
            self.made += 1
            return os.urandom(128)

        def comm_create_ranks(self, specs, ws, timeout_s, fault_rank, **launch):
            self.specs = [[g, n, bytes(uid).hex(), list(r), list(d)] for g, n, uid, r, d in specs]
            self.next += 1
            return self.next

        def comm_set_fingerprint(self, comm, fingerprint):
            pass

        def comm_set_group_text(self, comm, texts):
            self.texts = list(texts)

        def comm_destroy(self, comm):
            pass

    fake = FakeCuda()
    _native.cuda = fake
    report["cases"], report["made"], report["texts"] = {}, {}, {}

    def case(name, mesh, axes):
        fake.made, fake.specs = 0, None
        _runtime.communicator("cuda", mesh, axes)
        report["cases"][name] = fake.specs
        report["made"][name] = fake.made
        report["texts"][name] = getattr(fake, "texts", None)

    mesh1 = Mesh(devices, ("i",))
    mesh1_rev = Mesh(devices[::-1].copy(), ("i",))
    mesh2 = Mesh(devices.reshape(4, 2), ("x", "y"))
    report["mesh2_ids"] = [[int(d.id) for d in row] for row in mesh2.devices]
    case("1d", mesh1, ("i",))
    case("1d_rev", mesh1_rev, ("i",))
    case("2d_x", mesh2, ("x",))
    case("2d_y", mesh2, ("y",))
    case("2d_xy", mesh2, ("x", "y"))
    _runtime.reset()
    case("1d_again", mesh1, ("i",))

    # A missing peer: process 0 sets up a communicator that process 1 never comes to.
    client = _distributed.distributed_client()
    client.wait_at_barrier("test/start_missing", 60_000)
    if pid == 0:
        _runtime.settings.timeout_s = 3.0 + 2e-6  # a communicator key not used above
        report["missing"] = error_of(lambda: _runtime.communicator("cuda", mesh2, ("x", "y")))
    client.wait_at_barrier("test/end_missing", 60_000)

    # A set-up that process 0 never comes to (as if it raised before it) while process 1 times
    # out there; then both ask again and get one id.
    _runtime.settings.timeout_s = 3.0 + 5e-6  # a new communicator key
    if pid == 1:
        report["missed"] = error_of(lambda: _runtime.communicator("cuda", mesh1_rev, ("i",)))
    client.wait_at_barrier("test/missed", 60_000)
    report["retry"] = error_of(lambda: case("1d_rev_retry", mesh1_rev, ("i",)))
    client.wait_at_barrier("test/retried", 60_000)

    # Launch settings that differ between the processes of a group: refused by name (they
    # would otherwise make the kernels read data before it arrived).
    _runtime.settings.chunk_bytes = 65536 * (pid + 1)
    _runtime.settings.timeout_s = 3.0 + 3e-6  # a new communicator key
    report["mismatch"] = error_of(lambda: _runtime.communicator("cuda", mesh1, ("i",)))
    _runtime.settings.chunk_bytes = None
    client.wait_at_barrier("test/end_mismatch", 60_000)
    # So do the asynchronous calls' lane cap and copy-engine size (fixed at lowering).
    _runtime.settings.overlap_lanes = 16 * (pid + 1)
    _runtime.settings.timeout_s = 3.0 + 6e-6  # a new communicator key
    report["overlap_mismatch"] = error_of(lambda: _runtime.communicator("cuda", mesh1, ("i",)))
    _runtime.settings.overlap_lanes = 32
    client.wait_at_barrier("test/end_overlap_mismatch", 60_000)
    # Tuning tables that differ (auto would pick different algorithms): refused by name too.
    tables = tempfile.mkdtemp()
    if pid == 1:
        with open(os.path.join(tables, "nvidia_h200_n8.json"), "w") as fh:
            fh.write('{"entries": []}')
    _runtime.settings.tuning_dir = tables
    _runtime.settings.timeout_s = 3.0 + 4e-6  # a new communicator key
    report["tables"] = error_of(lambda: _runtime.communicator("cuda", mesh1, ("i",)))
    _runtime.settings.tuning_dir = None
    client.wait_at_barrier("test/end_tables", 60_000)

    # An unreachable key-value store.
    from jax_gin import _compat
    with _compat.replaced_distributed_client(f"127.0.0.1:{_free_port()}", pid, init_timeout=1):
        _runtime.settings.timeout_s = 3.0 + 1e-6  # a new communicator key
        report["unreachable"] = error_of(lambda: _runtime.communicator("cuda", mesh1, ("i",)))
    report["ok"] = True


def _gpu_worker(pid, devices, report, jax_gin, _distributed):
    import jax
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P

    mesh1 = Mesh(devices, ("i",))
    mesh1_rev = Mesh(devices[::-1].copy(), ("i",))  # rank 0 in process 1: it makes the id
    mesh2 = Mesh(devices.reshape(1, 2), ("x", "y"))

    def same_bits(a, b, what):
        assert_same_shards(a, b, what)
        report["checked"] += 1

    def parity(mesh, axes, dtype, per_device, seed):
        check_parity(mesh, axes, dtype, per_device, seed, same_bits)

    for dtype in ("float32", "bfloat16", "int32"):
        for per_device in (1, 37, 4099, (1 << 20) + 3):
            parity(mesh1, "i", dtype, per_device, per_device)
    for dtype in ("float16", "uint32"):                 # the other 32/16-bit dtypes
        parity(mesh1, "i", dtype, 4099, 11)
    with jax.enable_x64(True):                          # and the 64-bit ones
        for dtype in ("float64", "int64"):
            parity(mesh1, "i", dtype, 4099, 12)
    parity(mesh1, "i", "float32", (16 << 20) + 5, 1)    # > one round of the 64 MiB workspace
    parity(mesh1_rev, "i", "float32", 4099, 2)
    parity(mesh2, "y", "float32", 4099, 3)              # 1x2 mesh: one group of 2
    parity(mesh2, ("x", "y"), "bfloat16", 4099, 4)
    parity(mesh2, ("y", "x"), "int32", 4099, 5)

    check_grad(mesh1, same_bits)  # check_vma on and off

    # Repeated calls: one communicator, a scan of 200 dependent all-reduces, 20 times.
    def scanned(v):
        def step(c, _):
            return c + (jax_gin.psum(c, "i") - lax.psum(c, "i")), None
        c, _ = lax.scan(step, v, None, length=200)
        return c, jax_gin.psum(v, "i"), lax.psum(v, "i")
    f = jax.jit(jax.shard_map(scanned, mesh=mesh1, in_specs=P("i"), out_specs=(P("i"),) * 3))
    x = global_input(mesh1, P("i"), 4099, "float32", 10)
    f(x)
    ncomm = jax_gin.runtime.num_communicators()
    for k in range(20):
        c, a, b = f(x + k)
        same_bits(c, x + k, f"scan of 200, call {k}")
        same_bits(a, b, f"repeated call {k}")
    assert jax_gin.runtime.num_communicators() == ncomm
    report["ok"] = True


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
