"""Shared by the multi-process tests: launch a test file as N worker processes on 127.0.0.1,
bounded by a timeout, and read the JSON report each worker prints last; count the GPUs."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

# Variables a launcher or an outer JAX run may have set, which must not leak into workers.
_INHERITED_PREFIXES = ("JAX_", "XLA_", "SLURM_", "OMPI_", "PMI_", "CUDA_VISIBLE")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    """GPUs on this machine, without initializing JAX's CUDA backend in this process."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for ln in r.stdout.splitlines() if ln.startswith("GPU "))


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_INHERITED_PREFIXES)}
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    env.update(extra)
    return env


def launch(script: str, scenario: str, envs: list, timeout: float) -> list:
    """Runs `script scenario <process id> <port>` once per env in `envs`, concurrently;
    returns [(returncode, output)]. Kills them all and fails if they outlive `timeout`."""
    return launch_commands(lambda i, port: [sys.executable, os.path.abspath(script), scenario,
                                            str(i), str(port)], envs, timeout, scenario)


def launch_commands(argv_of, envs: list, timeout: float, what: str) -> list:
    """Runs argv_of(i, port) for process i, once per env in `envs`, concurrently: the
    processes of one job, `port` their coordinator's. Returns [(returncode, output)]; kills
    them all and fails, naming `what`, if they outlive `timeout`."""
    port = free_port()
    procs = [subprocess.Popen(argv_of(i, port), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i, env in enumerate(envs)]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        raise AssertionError(f"{what}: processes still running after {timeout} s:\n" +
                             "\n".join(f"--- process {i}\n{tail(o)}" for i, o in enumerate(outs)))
    return results


def tail(out: str, n: int = 60) -> str:
    """The last lines of a worker's output, without XLA's and gloo's log noise."""
    lines = [ln for ln in (out or "").splitlines()
             if not ln.startswith(("W0000", "I0000", "[Gloo]"))]
    return "\n".join(lines[-n:])


def reports(results, scenario) -> list:
    """[(returncode, the JSON report the worker printed last, output)]."""
    found = []
    for i, (rc, out) in enumerate(results):
        lines = [ln[len("REPORT "):] for ln in out.splitlines() if ln.startswith("REPORT ")]
        assert lines, f"{scenario}: process {i} (rc {rc}) printed no report:\n{tail(out)}"
        found.append((rc, json.loads(lines[-1]), out))
    return found


# ---------------------------------------------------------------------------------------
# Worker side: global inputs and bitwise checks of the shards this process holds.


def error_of(fn) -> str:
    """'Type: message' of what fn() raised, for a worker's report; 'no error' if nothing."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any failure belongs in the report
        return f"{type(e).__name__}: {e}"
    return "no error"


def global_input(mesh, spec, per_device, dtype, seed):
    """A global (mesh.size * per_device,) array of exact small integers, each process putting
    only its own shards (every process computes the same values from `seed`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    n = mesh.size * per_device
    vals = np.random.default_rng(seed).integers(-7, 8, size=n).astype(np.float64)
    full = np.asarray(jnp.asarray(vals).astype(dtype))  # exact small integers
    return jax.make_array_from_callback((n,), NamedSharding(mesh, spec), lambda idx: full[idx])


def check_parity(mesh, axes, dtype, per_device, seed, same_bits):
    """Every algorithm x op of jax_gin against lax's, over `axes`, bit for bit (`same_bits`
    compares two global arrays), all in one program: XLA:CPU runs its independent operations
    concurrently, and the order tokens keep jax_gin's calls one at a time, in one order on
    every rank."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P
    import jax_gin
    algos = ("auto",) + tuple(jax_gin.ALGORITHMS)
    ops = (("psum", jax_gin.psum, lax.psum), ("pmax", jax_gin.pmax, lax.pmax),
           ("pmin", jax_gin.pmin, lax.pmin))
    spec = P(tuple(mesh.axis_names))
    x = global_input(mesh, spec, per_device, dtype, seed)
    cases = [(a, j) for a in algos for j in range(len(ops))]

    def body(v):
        return (tuple(ops[j][1](v, axes, algorithm=a) for a, j in cases) +
                tuple(ops[j][2](v, axes) for _, j in cases))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,),
                              out_specs=(spec,) * (2 * len(cases))))
    outs = f(x)
    for k, (a, j) in enumerate(cases):
        same_bits(outs[k], outs[len(cases) + k],
                  f"{ops[j][0]} {a} {dtype} x{per_device} over {axes} of {mesh.shape}")


def check_scatter_gather(mesh, axes, dtype, per_device, seed, same_bits):
    """jax_gin.psum_scatter and jax_gin.all_gather (tiled, one_shot and ring) against lax's
    over `axes`, bit for bit, each case a program of its own; then the gradient through an
    all-gather (its transpose, a psum_scatter)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P
    import jax_gin
    from jax_gin._select import COLLECTIVE_ALGORITHMS
    spec = P(tuple(mesh.axis_names))
    n = 1
    for a in (axes if isinstance(axes, tuple) else (axes,)):
        n *= mesh.shape[a]
    x = global_input(mesh, spec, per_device * n, dtype, seed)
    for algo in COLLECTIVE_ALGORITHMS:
        for api in ("psum_scatter", "all_gather"):
            ours, ref = getattr(jax_gin, api), getattr(lax, api)
            f = jax.jit(jax.shard_map(
                lambda v, ours=ours, ref=ref, algo=algo: (ours(v, axes, tiled=True, algorithm=algo),
                                                          ref(v, axes, tiled=True)),
                mesh=mesh, in_specs=(spec,), out_specs=(spec, spec)))
            a, b = f(x)
            same_bits(a, b, f"{api} {algo} {dtype} x{per_device} over {axes} of {mesh.shape}")

    def grad(gather):
        g = jax.shard_map(lambda v: gather(v * v, axes, tiled=True), mesh=mesh, in_specs=spec,
                          out_specs=spec)
        return jax.jit(jax.grad(lambda v: jnp.sum(g(v) * 3)))
    x32 = global_input(mesh, spec, per_device, "float32", seed + 1)
    same_bits(grad(jax_gin.all_gather)(x32), grad(lax.all_gather)(x32),
              f"grad of all_gather over {axes}")


def check_grad(mesh, same_bits):
    """grad of a loss through jax_gin.psum and through lax.psum over axis "i" of `mesh`, with
    check_vma on and off, bit for bit (small integers: every value is exact)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P
    import jax_gin
    for check_vma in (True, False):
        def loss(red):
            g = jax.shard_map(lambda v: red(v * v, "i"), mesh=mesh, in_specs=P("i"),
                              out_specs=P(), check_vma=check_vma)
            return jax.jit(jax.grad(lambda v: jnp.sum(g(v) ** 2)))
        x = global_input(mesh, P("i"), 64, "float32", 9)
        same_bits(loss(jax_gin.psum)(x), loss(lax.psum)(x), f"grad check_vma={check_vma}")


def local_shards(a) -> list:
    """This process's shards of a global array, in device order."""
    import numpy as np
    return [np.asarray(s.data) for s in sorted(a.addressable_shards, key=lambda s: s.device.id)]


def assert_same_shards(a, b, what: str) -> None:
    """This process's shards of `a` and `b` are equal bit for bit."""
    import numpy as np
    for s, (u, v) in enumerate(zip(local_shards(a), local_shards(b))):
        assert u.dtype == v.dtype and u.shape == v.shape, (what, u.dtype, v.dtype)
        if not np.array_equal(u.view(np.uint8), v.view(np.uint8)):
            bad = np.flatnonzero(u != v)[:5]
            raise AssertionError(f"{what}: shard {s} differs at {bad}: {u[bad]} vs {v[bad]}")
