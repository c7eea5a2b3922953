"""python -m jax_gin.doctor: whether jax_gin runs correctly on this machine, and if not, why.

    python -m jax_gin.doctor [--quick] [--sizes 1K,1M] [--json PATH]
                             [--coordinator HOST:PORT --num-processes N --process-id I]

With --coordinator, run it in every process of a job: it joins them (jax.distributed) and
the self-test runs over every process's devices, so that settings that differ between the
processes, or a process that cannot reach the others, fail the check.

It prints six sections, then the verdict:
  versions    python, jax, jaxlib, jax_gin; on GPUs the NCCL loaded at run time and the NCCL
              headers jax_gin was built against (NCCL's device API is not ABI-stable: they must
              be equal), the CUDA platform and driver versions.
  devices     JAX's backend, the local devices' count and kind; on GPUs the P2P/NVLink
              topology (nvidia-smi topo -m).
  nccl        NCCL_NVLS_ENABLE, which must be 0 on GPUs (NVLink multicast stays off), other
              NCCL_* variables, and GIN (it needs a network; one node never uses it).
  settings    every field of jax_gin.runtime.settings with its value and environment
              variable; '*' marks a variable set in the environment. A JAX_GIN_* variable
              that no setting reads (a typo, or a build variable) is named, with the
              setting it may have meant.
  tuning      the tuning table auto reads for each collective over a group of all the
              devices, and the date of its measurement, or that none exists (then a rule of
              message sizes decides, which jax_gin.explain states).
  self-test   jax_gin.psum with each algorithm and "auto", and one overlap=True call, over a
              mesh of all local devices on exact float32 inputs: ok when bit for bit equal to
              lax.psum, WRONG otherwise; median microseconds of both. At the first size also
              psum_scatter and all_gather (tiled) with each of their algorithms, against lax's.

The verdict is the last lines: PASS (exit code 0), or one 'FAIL: <problem>' line per problem,
each followed by the fix (exit code 1). It fails on a GPU backend whose NCCL_NVLS_ENABLE is not
0 (then the self-test is skipped; on CPU the variable is only reported), on loaded and
built-against NCCL versions that differ, on an invalid JAX_GIN_* variable, on a tuning table
that is invalid (then the self-test runs without "auto"), and on any wrong
result or error in the self-test. A call that fails stops the mesh's communicator, so the rows
after it repeat that first error. An invalid JAX_GIN_* variable stops `import jax_gin` with a
ValueError naming it, except under `python -m jax_gin.doctor`: there its setting keeps its
default for the self-test, and the verdict names the variable (the other tools, `python -m
jax_gin.bench`, `tune`, `workloads` and `trace`, exit with status 2 and a line naming it).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import platform
import re
import statistics
import subprocess
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_gin

from . import _distributed, _native, _runtime, _scatter_gather, _select
from ._bench_inputs import format_size, put_global
from ._trace import _check_writable
from .tune import TABLE_DIR
from .bench import JoinError, add_process_arguments, check_processes, join_job, parse_size

DEFAULT_SIZES = (1 << 10, 1 << 20)  # bytes per device
RUNS = 5  # timed calls per measurement (the median is printed); --quick: 1
GIN = "needs a network (IB/RoCE); not used within one node"
CPU_DEVICES_HINT = ("one CPU device: for 8, run with JAX_PLATFORMS=cpu "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")


class Report:
    """The printed lines, the facts by section (--json) and the problems found."""

    def __init__(self):
        self.facts: dict = {}
        self.problems: list = []  # {"problem", "fix"}
        # a self-test error's text -> its entry in problems, that entry's first problem text,
        # and how many more calls raised it
        self.errors: dict = {}

    def section(self, name: str, title: str | None = None) -> dict:
        print(("\n" if self.facts else "") + (title or name), flush=True)
        return self.facts.setdefault(name, {})

    def line(self, text: str) -> None:
        print("  " + text.replace("\n", "\n      "), flush=True)

    def fail(self, problem: str, fix: str) -> None:
        self.problems.append({"problem": problem, "fix": fix})


def _command(args: list, timeout: float = 10.0) -> str | None:
    """stdout of a command, or None where it is missing, fails or takes longer than `timeout`."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # nvidia-smi underlines its header with terminal escape codes even into a pipe
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout).strip() if done.returncode == 0 else None


def _nccl_version(code: int) -> str:
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def check_versions(r: Report, gpu_device) -> None:
    """gpu_device: the first local GPU, or None."""
    import jaxlib
    f = r.section("versions")
    f.update(python=platform.python_version(), jax=jax.__version__, jaxlib=jaxlib.__version__,
             jax_gin=jax_gin.__version__, cuda_extension=_native.cuda is not None)
    for key in ("python", "jax", "jaxlib"):
        r.line(f"{key:<16} {f[key]}")
    r.line(f"{'jax_gin':<16} {f['jax_gin']} (CUDA extension: "
           f"{'yes' if f['cuda_extension'] else 'no'})")
    if gpu_device is None:
        return
    if _native.cuda is None:
        r.line(f"{'CUDA extension':<16} not loaded: {_native.cuda_missing()}")
        r.fail(f"jax_gin's CUDA extension is not loaded: {_native.cuda_missing()}",
               "rebuild jax_gin with nvcc and the nvidia-nccl-cu13 wheel of the NCCL JAX loads "
               "(pip install --no-build-isolation -e .)")
    else:
        f.update(nccl_loaded=_nccl_version(_native.cuda.nccl_version()),
                 nccl_headers=_nccl_version(_native.cuda.nccl_header_version()))
        r.line(f"{'NCCL':<16} {f['nccl_loaded']} loaded, {f['nccl_headers']} headers")
        if f["nccl_loaded"] != f["nccl_headers"]:
            r.fail(f"NCCL loaded {f['nccl_loaded']} differs from the headers "
                   f"{f['nccl_headers']} jax_gin was built against",
                   "rebuild jax_gin against the loaded NCCL")
    f.update(platform_version=gpu_device.client.platform_version,
             driver=_command(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"]))
    r.line(f"{'CUDA platform':<16} {f['platform_version']}")
    r.line(f"{'driver':<16} {(f['driver'] or 'nvidia-smi not available').splitlines()[0]}")


def check_devices(r: Report, devices: list, gpu: bool) -> None:
    f = r.section("devices")
    f.update(backend=jax.default_backend(), count=len(devices), kind=devices[0].device_kind)
    r.line(f"{f['backend']}: {f['count']} x {f['kind']}")
    if len(devices) == 1:
        r.line("collectives are trivial with one device (an all-reduce returns its input)")
        if not gpu:
            r.line(CPU_DEVICES_HINT)
    if gpu:
        f["topology"] = _command(["nvidia-smi", "topo", "-m"])
        r.line("topology (nvidia-smi topo -m):" if f["topology"] else
               "topology: nvidia-smi not available")
        for text in (f["topology"] or "").splitlines():
            r.line("  " + text)


def check_nccl(r: Report, gpu: bool) -> None:
    f = r.section("nccl", "NCCL environment")
    nvls = os.environ.get("NCCL_NVLS_ENABLE")
    # NCCL_VERSION is a container image's label of its system NCCL, not a setting NCCL reads:
    # the NCCL jax_gin loads is in the versions section
    f.update(NCCL_NVLS_ENABLE=nvls, gin=GIN,
             other={k: v for k, v in sorted(os.environ.items())
                    if k.startswith("NCCL_") and k not in ("NCCL_NVLS_ENABLE", "NCCL_VERSION")})
    r.line(f"NCCL_NVLS_ENABLE {'(unset)' if nvls is None else nvls}"
           + ("" if gpu else " (reported only: CPU backend)"))
    if gpu and nvls != "0":
        r.fail(f"NCCL_NVLS_ENABLE={'(unset)' if nvls is None else nvls} on a GPU backend "
               "(NVLink multicast must stay off)", "set NCCL_NVLS_ENABLE=0 before importing jax")
    for k, v in f["other"].items():
        r.line(f"{k} {v}")
    r.line(f"GIN {GIN}")


def check_settings(r: Report, invalid: dict, gpu_device) -> None:
    """gpu_device: the first local GPU (its SM count is the default max_lanes), or None."""
    f = r.section("settings", "settings (jax_gin.runtime.settings; * set in the environment; "
                              "None: the kernels' default, in parentheses)")
    kernel_defaults = _native.cuda.default_launch() if _native.cuda is not None else {}
    if gpu_device is not None and kernel_defaults:  # the SM count, at most 128
        kernel_defaults["max_lanes"] = _native.cuda.default_max_lanes(gpu_device.local_hardware_id)
    for field in dataclasses.fields(_runtime.settings):
        value = getattr(_runtime.settings, field.name)
        env = _runtime._RULES.get(field.name, (None,))[0]
        from_env = bool(env) and _runtime.in_environment(field.name)
        shown = repr(value)
        if value is None and field.name in kernel_defaults:
            shown += f" ({kernel_defaults[field.name]})"
        f[field.name] = {"value": value, "env": env, "from_env": from_env}
        r.line(f"{field.name:<26} {shown:<15} {'*' if from_env else ' '} {env or '(testing only)'}")
    for env, message in invalid.items():
        r.line(f"invalid: {message}")
        r.fail(f"a setting is invalid: {message}", f"correct or unset {env}")
    d = _runtime.settings.tuning_dir
    if d is not None and not os.path.isdir(d):
        # not a failure: python -m jax_gin.tune creates it
        r.line(f"tuning_dir {os.fspath(d)!r} is no directory, so auto reads no table there "
               "(python -m jax_gin.tune writes tables into it)")
    f["not_settings"] = unknown = unknown_variables()
    for env, near in unknown.items():
        r.line(f"{env} is set but is no setting, so nothing reads it at run time"
               + (f" (did you mean {near}?)" if near else ""))


def check_tuning(r: Report, devices: list) -> dict:
    """The tuning tables `auto` reads for a group of `devices`, each collective's: whether
    each is valid or absent, by collective (and a FAIL for each that is no valid table)."""
    f = r.section("tuning", "tuning tables (what auto reads for a group of these devices)")
    n = len(devices)
    kind = _select.table_kind(Mesh(np.array(devices), ("i",)), devices[0].platform)
    ok = {}
    for collective in (_select.ALL_REDUCE,) + _scatter_gather.API_NAMES:
        ok[collective] = True
        path = _select.table_path(kind, n, collective) if kind and n > 1 else None
        if path is None:
            f[collective] = None
            why = "a group of one rank" if n <= 1 else f"none for {kind} x {n}" if kind else \
                "none for CPU devices of several processes"
            r.line(f"{collective:<13} {why}: a rule of message sizes decides (jax_gin.explain)")
            continue
        try:
            table = _select.load_table(kind, n, collective)
        except ValueError as e:
            ok[collective] = False
            f[collective] = {"path": path, "error": str(e)}
            r.line(f"{collective:<13} {path}: invalid")
            r.fail(str(e).removeprefix("jax_gin: "),
                   "correct or remove the file (auto fails until then), or unset "
                   "JAX_GIN_TUNING_DIR where it is there")
            continue
        f[collective] = {"path": path, "measured": table.get("measured")}
        shown = path if os.path.dirname(path) != TABLE_DIR else \
            f"jax_gin/tuning/{os.path.basename(path)} (shipped)"
        r.line(f"{collective:<13} {shown}, measured {str(table.get('measured', '?'))[:10]}")
    return ok


def unknown_variables() -> dict:
    """Each JAX_GIN_* variable of the environment that no setting reads (a typo, or a build
    variable such as JAX_GIN_CUDA, which pyproject.toml hands to CMake when jax_gin is built):
    the closest setting's variable, or None."""
    known = sorted({env for env, _ in _runtime._RULES.values()})
    return {name: next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.8)), None)
            for name in sorted(os.environ) if name.startswith("JAX_GIN_") and name not in known}


def _local(out) -> np.ndarray:
    """The values of `out` that this process holds: all of them in one process, or where
    replicated; else its shards in device order (lax's result and jax_gin's share it)."""
    if out.is_fully_addressable or out.is_fully_replicated:
        return np.asarray(out)
    shards = sorted(out.addressable_shards, key=lambda s: s.device.id)
    return np.concatenate([np.asarray(s.data).reshape(-1) for s in shards])


def _timed(fn, x, runs: int):
    """fn(x) (compiled by its first call), as far as this process holds it, and the median
    microseconds of `runs` more calls."""
    out = _local(fn(x).block_until_ready())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append((time.perf_counter() - start) * 1e6)
    return out, statistics.median(times)


def _error(e: Exception) -> str:
    """The exception's message, with what GPU kernels recorded of a timed-out wait."""
    found = _native.cuda.diagnostics() if _native.cuda is not None else []
    return "; ".join([f"{type(e).__name__}: {str(e).strip()}"] + list(found))


TIMEOUT_FIX = ("read the error: a timed-out wait names the op, rank, peer and step it waited at "
               "(JAX_GIN_TIMEOUT_S: how long)")


def _fix(e: Exception) -> str:
    """The fix line for a self-test call that raised `e`: what its kind of error calls for."""
    text = str(e)
    if "Set them alike in every process" in text:  # _distributed.check_same_settings
        names = sorted(set(re.findall(r"\b(JAX_GIN_[A-Z_]+)\b", text)))
        return f"set {', '.join(names) or 'the settings it names'} alike in every process"
    if "cannot be reused" in text:  # the communicator stopped at an earlier row's failure
        return "fix the first failure above: a failed call stops the mesh's communicator"
    if "timed out" in text:
        return TIMEOUT_FIX
    if isinstance(e, ValueError) and "jax_gin" in text:
        # jax_gin's ValueErrors end with their remedy ("...; raise JAX_GIN_WORKSPACE_BYTES")
        advice = text.rsplit("; ", 1)[1].strip().rstrip(".") if "; " in text else ""
        return (f"as the error says: {advice}" if advice else
                "read the error: it names the setting or argument to change")
    return "read the error; unless a setting or input of yours causes it, report it with this output"


def _exact_input(mesh, per_device: int):
    """float32 small integers, `per_device` on each device of `mesh`: every sum is exact, so
    every algorithm must equal lax bit for bit."""
    n = mesh.size
    return put_global((np.arange(n * per_device) % 13 - 6).astype(np.float32),
                      NamedSharding(mesh, P("i")))


def _reference(r: Report, name: str, kind: str, fn, x, runs: int, shown: str):
    """(result, median µs) of lax's `fn` on x, or None after reporting that it failed (the
    self-test reports every failure and goes on)."""
    try:
        return _timed(fn, x, runs)
    except Exception as e:
        r.line(f"{name:<24} {shown:>5}  ERROR  {_error(e)}")
        r.fail(f"{name} at {shown} per device raised an error (self-test above)",
               f"JAX's own {kind} fails here: check the jax install")
        return None


def _case(r: Report, row: dict, label: str, shown: str, fn, x, runs: int, want, *, what: str,
          ref: str, avoid: str) -> None:
    """One self-test row: fn(x) timed and compared bit for bit with `want` (ref's result);
    the row gets jax_gin_us and ok (or error), the report a line, and a failure names `what`."""
    try:
        got, row["jax_gin_us"] = _timed(fn, x, runs)
    except Exception as e:
        row["ok"], row["error"] = False, _error(e)
        r.line(f"{label:<24} {shown:>5}  ERROR  {row['error']}")
        problem = f"{what} at {shown} per device raised an error (self-test above)"
        same = r.errors.get(row["error"])
        if same is None:
            r.fail(problem, _fix(e))
            r.errors[row["error"]] = {"entry": r.problems[-1], "problem": problem, "more": 0}
        else:  # one problem for the calls that raised the same error
            same["more"] += 1
            k = same["more"]
            same["entry"]["problem"] = (f"{same['problem']}, and so did {k} more self-test "
                                        f"call{'s' if k > 1 else ''} with the same error")
        return
    row["ok"] = bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))
    r.line(f"{label:<24} {shown:>5}  {'ok' if row['ok'] else 'WRONG':<6} "
           f"{row['jax_gin_us']:>10.1f} {row['lax_us']:>9.1f}")
    if not row["ok"]:
        r.fail(f"{what} at {shown} per device differs from {ref}",
               f"report it with this output; meanwhile avoid {avoid}")


def self_test(r: Report, devices: list, sizes: list, runs: int, auto: bool = True) -> None:
    """auto: whether to run psum's algorithm="auto" too (not where the all-reduce's tuning
    table is invalid)."""
    timed = f"median of {runs} calls" if runs > 1 else "one call"
    rows = r.section("self-test", "self-test (float32; size per device, psum_scatter's output "
                     f"and all_gather's input; µs: {timed})").setdefault("rows", [])
    mesh = Mesh(np.array(devices), ("i",))
    n = len(devices)
    def shard(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P()))

    lax_psum = shard(lambda v: jax.lax.psum(v, "i"))
    r.line(f"{'algorithm':<24} {'size':>5}  {'result':<6} {'jax_gin µs':>10} {'lax µs':>9}")
    for size in sizes:
        count = max(1, size // 4)
        shown = format_size(count * 4)
        x = _exact_input(mesh, count)
        ref = _reference(r, "lax.psum", "all-reduce", lax_psum, x, runs, shown)
        if ref is None:
            continue
        want, lax_us = ref
        cases = [(a, False) for a in jax_gin.ALGORITHMS]
        if auto:
            chosen = jax_gin.explain(jax.ShapeDtypeStruct((count,), jnp.float32), nranks=n)
            cases += [("auto", False)] + ([("auto", True)] if size == sizes[0] else [])
        elif size == sizes[0]:
            r.line("auto: not run (its tuning table is invalid: tuning, above)")
        for algo, overlap in cases:
            label = algo + (f" ({chosen.split(':')[0]})" if algo == "auto" else "") + \
                (" overlap" if overlap else "")
            row = {"algorithm": algo, "overlap": overlap, "bytes": count * 4, "lax_us": lax_us}
            rows.append(row)
            _case(r, row, label, shown, shard(lambda v: jax_gin.psum(
                v, "i", algorithm=algo, overlap=overlap)), x, runs, want,
                what=f"psum with algorithm {label}", ref="lax.psum",
                avoid=f"algorithm={algo!r}")
        if size == sizes[0]:
            _collectives_test(r, rows, mesh, count, shown, runs)


def _collectives_test(r: Report, rows: list, mesh, count: int, shown: str, runs: int) -> None:
    """psum_scatter and all_gather (tiled) with each of their algorithms against lax's: `count`
    elements per device on the smaller side, exact float32."""
    n = mesh.size

    def shard(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i")))

    for api in _scatter_gather.API_NAMES:
        per_device = count * n if api == "psum_scatter" else count
        x = _exact_input(mesh, per_device)
        ref = _reference(r, f"lax.{api}", "collective",
                         shard(lambda v: getattr(jax.lax, api)(v, "i", tiled=True)), x, runs, shown)
        if ref is None:
            continue
        want, lax_us = ref
        for algo in _select.COLLECTIVE_ALGORITHMS:
            label = f"{api} {algo}"
            row = {"collective": api, "algorithm": algo, "overlap": False, "bytes": count * 4,
                   "lax_us": lax_us}
            rows.append(row)
            _case(r, row, label, shown, shard(lambda v: getattr(jax_gin, api)(
                v, "i", tiled=True, algorithm=algo)), x, runs, want,
                what=f"{api} with algorithm {algo}", ref=f"lax.{api}",
                avoid=f"algorithm={algo!r} for {api}")


def _sizes(text: str) -> list:
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < 4 or any(s % 4 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of sizes per device, "
                                         "each a multiple of 4 bytes (whole float32 elements), "
                                         "e.g. 1K,1M")
    return sizes


def main(argv=None) -> int:
    """Run every check; returns 0 on PASS, 1 on FAIL."""
    p = argparse.ArgumentParser(prog="python -m jax_gin.doctor",
                                description="Check that jax_gin runs correctly on this machine.")
    p.add_argument("--sizes", type=_sizes, default=list(DEFAULT_SIZES),
                   help="comma list of bytes per device for the self-test (default 1K,1M)")
    p.add_argument("--quick", action="store_true",
                   help="the self-test at the first size only, one timed call each")
    p.add_argument("--json", metavar="PATH", help="also write the facts and verdict as JSON")
    add_process_arguments(p, "one process of a multi-process job: jax.distributed.initialize "
                             "with this coordinator, --num-processes and --process-id; the "
                             "self-test then runs over every process's devices (run the doctor "
                             "in every process)")
    args = p.parse_args(argv)
    check_processes(p, args)
    if args.json:
        try:  # before the run, which the report would otherwise be lost after
            _check_writable(args.json, "--json")
        except OSError as e:
            p.error(str(e))
    invalid = _runtime.invalid_variables()  # before anything reads the settings
    r = Report()
    joined = True  # the job of --coordinator, where one is given
    if args.coordinator:
        if jax.config.jax_platforms in (None, "", "cpu") and not os.environ.get("JAX_PLATFORMS", "").startswith("cuda"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")  # lax.psum across processes
        try:
            join_job(args.coordinator, args.num_processes, args.process_id)
        except JoinError as e:
            r.fail(e.problem, e.fix)
            joined = False
        else:
            # the self-test's programs are run by every process together: they must agree
            _distributed.check_same_command(p.prog, {"sizes": args.sizes, "quick": args.quick})
    try:
        # (no devices to check where the process could not join its job)
        devices = [] if not joined else jax.devices() if args.coordinator else jax.local_devices()
    except RuntimeError as e:
        devices = []
        r.fail(f"JAX found no devices: {e}", "check JAX_PLATFORMS and the jax install")
    gpu = bool(devices) and devices[0].platform != "cpu"
    check_versions(r, devices[0] if gpu else None)
    if devices:
        check_devices(r, devices, gpu)
    check_nccl(r, gpu)
    check_settings(r, invalid, devices[0] if gpu else None)
    # the self-test's auto is psum's, which reads the all-reduce's table
    auto_ok = check_tuning(r, devices)[_select.ALL_REDUCE] if devices else True
    if gpu and os.environ.get("NCCL_NVLS_ENABLE") != "0":
        r.section("self-test").update(skipped="NCCL_NVLS_ENABLE is not 0")
        r.line("skipped: NCCL_NVLS_ENABLE must be 0 first")
    elif devices:
        self_test(r, devices, args.sizes[:1] if args.quick else args.sizes,
                  1 if args.quick else RUNS, auto=auto_ok)
    print(flush=True)
    for item in r.problems:
        print(f"FAIL: {item['problem']}\n  fix: {item['fix']}", flush=True)
    if not r.problems:
        print("PASS", flush=True)
    r.facts["verdict"] = {"result": "FAIL" if r.problems else "PASS", "problems": r.problems}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(r.facts, out, indent=1, default=str)
    return 1 if r.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
