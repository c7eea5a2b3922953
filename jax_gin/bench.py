"""jax_gin all-reduce benchmark, in the language of nccl-tests.

    python -m jax_gin.bench -b 4K -e 64M -f 4 -d float32,bfloat16 -o sum -a auto,lax

For every (size, dtype, op, algorithm) it measures, in one process and on the same inputs,
jax_gin's psum/pmax/pmin (`-a auto,ring,tree,one_shot,two_shot`) and jax.lax's (`-a lax`),
as docs/performance.md asks:

  per-op time  (T_K - T_1) / (K - 1), where T_K is the median wall time of one jit call of
               a chain of K dependent all-reduces and T_1 that of a chain of one; subtracting
               T_1 removes the dispatch and launch cost that every call pays once.
               K is 100 up to 4 MiB per device and 20 above (-k to set it): host jitter
               divides by K - 1, and a small op needs a long chain to rise above it.
  wall         T_1, the time a user sees for one jit call holding one all-reduce.
  algbw        bytes per device / per-op time;  busbw = algbw * 2(N-1)/N (nccl-tests).
  #wrong       elements of the single-call result that differ from a numpy reference.
  vs_lax       lax per-op time / this per-op time at the same size (> 1: faster than lax).

The chain. Every device holds x_i, small nonzero integers (times a power of two for float16),
so every result is exact in every dtype; each all-reduce's input varies over the devices, so
XLA cannot prove it replicated and turn lax's all-reduce into a multiply. Two chain steps:

  slice     y <- allreduce(y); y[0] <- x_i[0]   (the default where it is exact)
            The one-element update makes the next input vary over the devices again and is
            done in place, so the per-op time is the all-reduce plus one tiny kernel at every
            size. Sums grow by N per op: exact when N is a power of two and N^(K-1) times the
            values fits the dtype; max and min do not grow.
  subtract  y <- allreduce(y) - (ref - x_i)     (wherever slice would not be exact)
            Gives back exactly x_i, so values never grow, but every op pays an elementwise
            pass over three buffers: on 2 x H200 ~0.65 ms at 1 GiB per device, 15% of lax's
            time there (findings.md's 329 GB/s at 1 GiB was measured without it).

`--chain-step` picks one; the JSON records the step of every row. Each chain's last
all-reduce is checked too, against the exact value the step gives.

main() returns 0, or 1 when any result was wrong or any configuration failed (the failure is
printed in its row and the sweep goes on). With one device on the reduced axis every
all-reduce is a copy: main() exits with a message naming how to get 8 CPU devices, unless
--one-device is given (then no vs_lax ratios are computed).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform as _platform
import re
import statistics
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_gin
from jax_gin import workloads

AXIS = "i"
LAX_NAME = "lax"
ALGO_CHOICES = ("auto",) + tuple(jax_gin.ALGORITHMS) + (LAX_NAME,)
OPS = ("sum", "max", "min")
LAX_OPS = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}
GIN_OPS = {"sum": jax_gin.psum, "max": jax_gin.pmax, "min": jax_gin.pmin}

# nccl-tests' type names, so that `-d float -d half` mean what they mean there.
DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16",
                 "int": "int32", "uint": "uint32", "f32": "float32", "f16": "float16",
                 "f64": "float64"}
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DEFAULT_MAXBYTES = {"cpu": 1 << 20, "gpu": 64 << 20}

# Column layout of the results table: (header, width).
COLUMNS = (("size", 12), ("count", 12), ("type", 9), ("redop", 6), ("algo", 9), ("|", 1),
           ("time(us)", 10), ("algbw(GB/s)", 12), ("busbw(GB/s)", 12), ("#wrong", 7), ("|", 1),
           ("wall(us)", 10), ("vs_lax", 7))


# ---------------------------------------------------------------------------------------
# Command line


# Default chain lengths. The per-op time is a difference of two wall times divided by K - 1,
# and host jitter of tens of microseconds does not shrink with the op: on 2 x H200 with K = 20,
# two rows running the same kernel at 4 KiB - 4 MiB differed by up to 40%; with K = 100 the
# difference of the two wall times is ~1 ms and such rows agree far better.
SMALL_CHAIN, LARGE_CHAIN, SMALL_CHAIN_MAX_BYTES = 100, 20, 4 << 20


def chain_length(args, size: int) -> int:
    if args.chain is not None:
        return args.chain
    return SMALL_CHAIN if size <= SMALL_CHAIN_MAX_BYTES else LARGE_CHAIN


def parse_size(text: str) -> int:
    """'4096', '4K', '64M', '1G' (also '4k', '4KB', '4KiB') -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)(?:i?[Bb])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; expected e.g. 4096, 4K, 64M, 1G")
    return int(m.group(1)) * SIZE_UNITS[m.group(2).upper()]


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= SIZE_UNITS[unit] and nbytes % SIZE_UNITS[unit] == 0:
            return f"{nbytes // SIZE_UNITS[unit]}{unit}"
    return str(nbytes)


def _comma_list(choices: tuple, normalize=lambda s: s):
    """An argparse type: a comma-separated list whose items must be in `choices`."""
    def parse(text: str) -> list:
        items = [normalize(s.strip()) for s in text.split(",") if s.strip()]
        if items == ["all"]:
            return list(choices)
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{', '.join(bad) or 'empty list'}: expected a comma list of {', '.join(choices)}")
        return list(dict.fromkeys(items))  # drop repeats, keep order
    return parse


def _dtype_name(text: str) -> str:
    return DTYPE_ALIASES.get(text.lower(), text.lower())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_gin.bench",
        description="Benchmark jax_gin's all-reduce against jax.lax (nccl-tests style).")
    p.add_argument("-b", "--minbytes", type=parse_size, default=4 << 10,
                   help="smallest size per device (default 4K)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=None,
                   help="largest size per device (default 64M on GPU, 1M on CPU)")
    p.add_argument("-f", "--stepfactor", type=int, default=4,
                   help="multiply the size by this between steps (default 4)")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help="timed repeats; the median is reported (default 20)")
    p.add_argument("-w", "--warmup", type=int, default=3, help="untimed repeats (default 3)")
    p.add_argument("-d", "--dtype", type=_comma_list(jax_gin.SUPPORTED_DTYPES, _dtype_name),
                   default=["float32"],
                   help=f"comma list of {', '.join(jax_gin.SUPPORTED_DTYPES)} (default float32)")
    p.add_argument("-o", "--op", type=_comma_list(OPS), default=["sum"],
                   help="comma list of sum, max, min, or all (default sum)")
    p.add_argument("-a", "--algorithm", type=_comma_list(ALGO_CHOICES),
                   default=["auto", LAX_NAME],
                   help=f"comma list of {', '.join(ALGO_CHOICES)}, or all (default auto,lax); "
                        "'lax' is jax.lax.psum/pmax/pmin")
    p.add_argument("-k", "--chain", type=int, default=None,
                   help=f"chain length K of dependent all-reduces for the per-op time (default "
                        f"{SMALL_CHAIN} up to {SMALL_CHAIN_MAX_BYTES >> 20} MiB per device, "
                        f"{LARGE_CHAIN} above)")
    p.add_argument("--chain-step", choices=("auto", "slice", "subtract"), default="auto",
                   help="what runs between the chain's all-reduces: 'slice' (a one-element "
                        "in-place update), 'subtract' (an elementwise pass), or 'auto': slice "
                        "where its values stay exact, else subtract (default)")
    p.add_argument("--devices", type=int, default=None,
                   help="use the first N devices (default all)")
    p.add_argument("--one-device", action="store_true",
                   help="run even when the reduced axis has one device, where every "
                        "all-reduce is a copy: no vs_lax ratios or geomean (refused without it)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of time and busbw (needs matplotlib)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="check every result against a numpy reference (default on)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar or notes on stderr (the table still goes to stdout)")
    p.add_argument("--workload", choices=workloads.NAMES,
                   help="instead of the sweep, time a whole step with lax, jax_gin and no "
                        "all-reduce (jax_gin.workloads; its options: --workload W --help)")
    g = p.add_argument_group(
        "several processes (jax.distributed; run the same command in every process, "
        "process 0 prints)")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="jax.distributed coordinator address; with --num-processes and "
                        "--process-id")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() with no arguments (SLURM, Open MPI, "
                        "or JAX_COORDINATOR_ADDRESS etc. in the environment)")
    return p


def parse_args(argv) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.minbytes < 1:
        parser.error("-b/--minbytes must be at least 1 byte")
    if args.stepfactor < 2:
        parser.error("-f/--stepfactor must be at least 2")
    if args.iters < 1 or args.warmup < 0:
        parser.error("-n/--iters must be >= 1 and -w/--warmup >= 0")
    if args.chain is not None and args.chain < 2:
        parser.error("-k/--chain must be >= 2: the per-op time is (T_K - T_1) / (K - 1)")
    if args.maxbytes is not None and args.maxbytes < args.minbytes:
        parser.error("-e/--maxbytes is smaller than -b/--minbytes")
    given = [a is not None for a in (args.coordinator, args.num_processes, args.process_id)]
    if any(given) and not all(given):
        parser.error("--coordinator, --num-processes and --process-id go together")
    if all(given) and args.distributed:
        parser.error("--distributed takes its settings from the environment: drop "
                     "--coordinator, --num-processes and --process-id")
    return args


def init_distributed(args) -> None:
    """jax.distributed.initialize() for a run over several processes (before any device use).
    On CPU, lax's cross-process collectives need gloo; the setting is ignored on GPUs."""
    if args.coordinator is None and not args.distributed:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.distributed:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)


def put_global(a: np.ndarray, sharding: NamedSharding):
    """A host array as a global jax.Array; in several processes each puts only its shards."""
    if jax.process_count() == 1:
        return jax.device_put(a, sharding)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def size_steps(minbytes: int, maxbytes: int, factor: int) -> list:
    sizes, s = [], minbytes
    while s <= maxbytes:
        sizes.append(s)
        s *= factor
    return sizes


# ---------------------------------------------------------------------------------------
# Inputs and reference


@dataclasses.dataclass
class Inputs:
    """Host arrays for one (count, dtype, op) on `nranks` devices."""

    x: np.ndarray      # (nranks, count): what each device reduces
    ref: np.ndarray    # (count,): the exact all-reduce of x
    corr: np.ndarray   # (nranks, count): ref - x, so that allreduce(x) - corr == x exactly
    op: str = "sum"

    def chain_result(self, k: int, step: str) -> np.ndarray:
        """What the last all-reduce of a chain of k returns: ref for the subtract step; for
        the slice step ref * N^(k-1) (sums; exact by slice_is_exact), with element 0 = ref[0]."""
        if step == "subtract" or self.op != "sum" or k == 1:
            return self.ref
        n = self.x.shape[0]
        out = (self.ref.astype(np.float64) * float(n) ** (k - 1)).astype(self.ref.dtype) \
            if not np.issubdtype(self.ref.dtype, np.integer) else self.ref * self.ref.dtype.type(n ** (k - 1))
        out[0] = self.ref[0]
        return out


def _growth_bits(nranks: int, k: int, op: str):
    """Bits a slice chain of k ops grows the values by; None: not exact (N not a power of two)."""
    if op != "sum" or nranks == 1:
        return 0
    if nranks & (nranks - 1):
        return None
    return (k - 1) * (nranks.bit_length() - 1)


def f16_scale_exp(nranks: int, k: int, op: str) -> int:
    """float16 inputs are scaled by 2^-s so that a slice chain stays below 2^15 (max 65504):
    s is the growth beyond 15 bits, and at most 22 so that 3 * 2^-s stays exact."""
    g = _growth_bits(nranks, k, op) or 0
    top = g + math.log2(3 * nranks)  # bits of the largest value at the end of the chain
    return max(0, math.ceil(top - 15 + 1))


def slice_is_exact(nranks: int, k: int, dtype, op: str) -> bool:
    """Whether the slice chain step gives exact values (see the module doc)."""
    g = _growth_bits(nranks, k, op)
    if g is None:
        return False
    dtype = jnp.dtype(dtype)
    top = g + math.log2(3 * nranks) + 1
    if jnp.issubdtype(dtype, jnp.integer):
        return top < jnp.iinfo(dtype).bits - 1
    if dtype == jnp.float16:
        return f16_scale_exp(nranks, k, op) <= 22
    return top < jnp.finfo(dtype).maxexp - 2  # float32, bfloat16, float64: exponent range


def chain_step_for(requested: str, nranks: int, k: int, dtype, op: str) -> str:
    if requested == "subtract" or (requested == "auto" and not slice_is_exact(nranks, k, dtype, op)):
        return "subtract"
    return "slice"


def make_inputs(nranks: int, count: int, dtype, op: str, seed: int = 0, scale_exp: int = 0) -> Inputs:
    """Small nonzero integers (|v| <= 3; 1..3 for unsigned types), times 2^-scale_exp (floats
    only): never zeros, and every sum over up to ~80 ranks is exact even in bfloat16 (8
    significant bits)."""
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    mag = rng.integers(1, 4, size=(nranks, count), dtype=np.int64)
    unsigned = jnp.issubdtype(dtype, jnp.unsignedinteger)
    vals = mag if unsigned else mag * rng.choice(np.array([-1, 1]), size=mag.shape)
    ref = reference(vals, op)
    if scale_exp and not jnp.issubdtype(dtype, jnp.integer):
        scale = 2.0 ** -scale_exp  # exact: a power of two
        return Inputs(x=_cast(vals * scale, dtype), ref=_cast(ref * scale, dtype),
                      corr=_cast((ref[None, :] - vals) * scale, dtype), op=op)
    # Integers of any width are computed in int64 and cast: an unsigned negative correction
    # wraps around, and the wrapped subtraction on the device still gives x back exactly.
    return Inputs(x=_cast(vals, dtype), ref=_cast(ref, dtype),
                  corr=_cast(ref[None, :] - vals, dtype), op=op)


def reference(vals: np.ndarray, op: str) -> np.ndarray:
    return {"sum": np.sum, "max": np.max, "min": np.min}[op](vals, axis=0)


def _cast(a: np.ndarray, dtype) -> np.ndarray:
    if jnp.issubdtype(dtype, jnp.integer):
        return a.astype(np.int64).astype(dtype)
    return a.astype(np.float64).astype(dtype)  # small integers: exact in every float type


def count_wrong(out, ref: np.ndarray, nranks: int) -> int:
    """Elements of the (nranks * count,) result that differ from ref on any device (each
    device's shard is its whole result). With several processes each checks its own devices'
    shards and the counts are summed over the processes."""
    if getattr(out, "is_fully_addressable", True):
        got = np.asarray(out).reshape(nranks, -1)
        return int(np.count_nonzero(got != ref[None, :]))
    from jax.experimental import multihost_utils
    mine = sum(int(np.count_nonzero(np.asarray(sh.data) != ref)) for sh in out.addressable_shards)
    return int(np.sum(multihost_utils.process_allgather(np.array([mine], np.int64))))


# ---------------------------------------------------------------------------------------
# The programs timed


def reduce_fn(op: str, algorithm: str):
    """(value, axis) -> all-reduced value: jax.lax for 'lax', else jax_gin with `algorithm`."""
    if algorithm == LAX_NAME:
        return LAX_OPS[op]
    gin = GIN_OPS[op]
    return lambda v, axis: gin(v, axis, algorithm=algorithm)


def build_chain(mesh: Mesh, reduce, k: int, step: str = "subtract"):
    """jit(shard_map) of k dependent all-reduces with the chain `step` between them."""
    def chain(x, corr):
        y = x
        for _ in range(k - 1):
            if step == "slice":
                # One element from this device's x: the next input varies over the devices
                # again (so XLA cannot treat it as replicated); an in-place one-element update.
                y = reduce(y, AXIS).at[0].set(x[0])
            else:
                # reduce(y) == ref on every device; subtracting the per-device corr gives x
                # back and makes the next input vary over the devices again.
                y = reduce(y, AXIS) - corr
        return reduce(y, AXIS)

    spec = P(AXIS)
    return jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(spec, spec), out_specs=spec))


def time_call(f, args) -> tuple:
    """(seconds, output) of one call, measured the way a user sees it."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    return time.perf_counter() - t0, out


# ---------------------------------------------------------------------------------------
# One measurement


@dataclasses.dataclass
class Record:
    size: int                 # bytes per device
    count: int                # elements per device
    dtype: str
    op: str
    algorithm: str
    nranks: int
    chain: int
    time_us: float | None = None      # per-op time
    algbw: float | None = None        # GB/s
    busbw: float | None = None        # GB/s
    wrong: int | None = None          # wrong elements of the single-call result
    wrong_chain: int | None = None    # wrong elements of the chain's (uncorrected) last result
    chain_step: str = "subtract"      # slice or subtract (see the module doc)
    wall_us: float | None = None      # T_1
    chain_us: float | None = None     # T_K
    vs_lax: float | None = None
    auto_choice: str | None = None    # what algorithm="auto" ran
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or bool(self.wrong) or bool(self.wrong_chain)


def auto_choice(algorithm: str, count: int, dtype, nranks: int, platform: str) -> str | None:
    if algorithm != "auto":
        return None
    spec = jax.ShapeDtypeStruct((count,), dtype)
    return jax_gin.explain(spec, nranks=nranks, platform=platform).split(":", 1)[0]


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def measure_size(mesh: Mesh, inputs: Inputs, recs: list, args, device_args, progress) -> list:
    """Fill the records of one (size, dtype, op), one per algorithm, side by side.

    Every algorithm's chains of 1 and of K are compiled and called once (never timed), then
    warmed up and timed in turns: each repeat calls f1 and fK of every algorithm in a row, so
    that slow drifts of the machine (clocks, other processes) hit every algorithm's medians
    alike. The per-op time is (median T_K - median T_1) / (K - 1).

    A failing algorithm is reported in its row and the others go on. With several processes
    a failure ends the run instead: the others would wait in the next collective.
    """
    live = []
    for rec in recs:
        progress.step(f"{rec.dtype} {rec.op} {format_size(rec.size)} {rec.algorithm}")
        try:
            reduce = reduce_fn(rec.op, rec.algorithm)
            f1 = build_chain(mesh, reduce, 1, rec.chain_step)
            fk = build_chain(mesh, reduce, rec.chain, rec.chain_step)
            time_call(f1, device_args)  # first calls compile
            time_call(fk, device_args)
            live.append((rec, f1, fk, [], [], [None, None]))
        except Exception as e:  # noqa: BLE001 - any failure belongs in the report
            if jax.process_count() > 1:
                raise
            rec.error = _error_text(e)
    for it in range(args.warmup + args.iters):
        for entry in list(live):
            rec, f1, fk, t1s, tks, outs = entry
            try:
                t1, outs[0] = time_call(f1, device_args)
                tk, outs[1] = time_call(fk, device_args)
            except Exception as e:  # noqa: BLE001
                if jax.process_count() > 1:
                    raise
                rec.error = _error_text(e)
                live.remove(entry)
                continue
            if it >= args.warmup:
                t1s.append(t1)
                tks.append(tk)
    for rec, _, _, t1s, tks, (out1, outk) in live:
        t1, tk = statistics.median(t1s), statistics.median(tks)
        rec.wall_us, rec.chain_us = t1 * 1e6, tk * 1e6
        rec.time_us = (tk - t1) / (rec.chain - 1) * 1e6
        if rec.time_us > 0:  # noise can make T_K - T_1 <= 0 for tiny ops on a busy machine
            rec.algbw = rec.size / (rec.time_us * 1e-6) / 1e9
            rec.busbw = rec.algbw * 2 * (rec.nranks - 1) / rec.nranks
        if args.check:
            rec.wrong = count_wrong(out1, inputs.ref, rec.nranks)
            rec.wrong_chain = count_wrong(outk, inputs.chain_result(rec.chain, rec.chain_step),
                                          rec.nranks)
    return recs


def fill_vs_lax(records: list) -> None:
    """vs_lax for the records of one (size, dtype, op), when lax was measured with them."""
    lax = next((r for r in records if r.algorithm == LAX_NAME), None)
    if lax is None or not lax.time_us or lax.time_us <= 0:
        return
    for r in records:
        if r.time_us and r.time_us > 0:
            r.vs_lax = lax.time_us / r.time_us


# ---------------------------------------------------------------------------------------
# Text output


def _fmt(v, spec: str = ".2f", na: str = "N/A") -> str:
    return na if v is None else format(v, spec)


def table_header() -> str:
    cells = [name.rjust(w) for name, w in COLUMNS]
    return "#" + " ".join(cells)[1:]


def format_row(r: Record) -> str:
    if r.error is not None:
        lead = [str(r.size).rjust(12), str(r.count).rjust(12), r.dtype.rjust(9),
                r.op.rjust(6), r.algorithm.rjust(9)]
        return " ".join(lead) + f" | error: {r.error}"
    values = [str(r.size), str(r.count), r.dtype, r.op, r.algorithm, "|",
              _fmt(r.time_us), _fmt(r.algbw), _fmt(r.busbw), _fmt(r.wrong, "d"), "|",
              _fmt(r.wall_us), _fmt(r.vs_lax, ".2f", "-")]
    row = " ".join(v.rjust(w) for v, (_, w) in zip(values, COLUMNS))
    return row + (" *" if r.chain_step == "subtract" else "")


def command_buffer_flags(xla_flags: str) -> list:
    """The XLA flags that decide CUDA-graph capture (command buffers)."""
    return [f for f in xla_flags.split() if "command_buffer" in f or "graph" in f]


def metadata(args, devices, platform: str) -> dict:
    xla_flags = os.environ.get("XLA_FLAGS", "")
    import jaxlib
    return {
        "benchmark": "all-reduce",
        "jax_gin": jax_gin.__version__,
        "jax_gin_cuda": bool(jax_gin.has_cuda()),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": _platform.python_version(),
        "host": _platform.node(),
        "platform": platform,
        "device_kind": devices[0].device_kind,
        "ndevices": len(devices),
        "ndevices_total": len(jax.devices()),
        "processes": jax.process_count(),
        "xla_flags": xla_flags,
        "command_buffer_flags": command_buffer_flags(xla_flags),
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "minbytes": args.minbytes, "maxbytes": args.maxbytes, "stepfactor": args.stepfactor,
        "iters": args.iters, "warmup": args.warmup, "check": args.check,
        "chain": args.chain if args.chain is not None else
        f"{SMALL_CHAIN} up to {format_size(SMALL_CHAIN_MAX_BYTES)}, {LARGE_CHAIN} above",
        "dtypes": args.dtype, "ops": args.op, "algorithms": args.algorithm,
        "chain_step": args.chain_step,
        "method": "per-op time = (T_K - T_1)/(K - 1), medians of wall times of jit calls; "
                  "chain step slice: y <- allreduce(y); y[0] <- x[0], or subtract: "
                  "y <- allreduce(y) - (ref - x) (each row's chain_step)",
    }


def header_lines(meta: dict) -> list:
    if meta["platform"] == "cpu":
        graphs = "n/a on CPU"
    elif meta["command_buffer_flags"]:
        graphs = " ".join(meta["command_buffer_flags"])
    else:
        graphs = "XLA default (no command-buffer flag in XLA_FLAGS)"
    return [
        f"# jax_gin {meta['jax_gin']} all-reduce benchmark (CUDA extension: "
        f"{'yes' if meta['jax_gin_cuda'] else 'no'})",
        f"# jax {meta['jax']}  jaxlib {meta['jaxlib']}  python {meta['python']}  host {meta['host']}",
        f"# platform {meta['platform']}: {meta['ndevices']} x {meta['device_kind']} "
        f"(of {meta['ndevices_total']} devices"
        + (f", {meta['processes']} processes)" if meta.get("processes", 1) > 1 else ")"),
        f"# XLA_FLAGS: {meta['xla_flags'] or '(none)'}",
        f"# command buffers (CUDA graphs): {graphs}",
        f"# NCCL_NVLS_ENABLE: {meta['nccl_nvls_enable']}",
        f"# date {meta['date']}",
        f"# sizes {format_size(meta['minbytes'])}..{format_size(meta['maxbytes'])} "
        f"x{meta['stepfactor']}  iters {meta['iters']}  warmup {meta['warmup']}  "
        f"chain K={meta['chain']}  step {meta.get('chain_step', 'subtract')}  "
        f"check {'on' if meta['check'] else 'off'}",
        "# time = per-op (T_K - T_1)/(K - 1); wall = T_1 (one jit call); "
        "vs_lax = lax time / this time",
        "# chain step: slice = y <- allreduce(y); y[0] <- x[0] (in place); subtract = "
        "y <- allreduce(y) - (ref - x) (rows marked *)",
    ]


def footer_lines(records: list, check: bool) -> list:
    lines = []
    if check:
        wrong = sum((r.wrong or 0) + (r.wrong_chain or 0) for r in records)
        lines.append(f"# Wrong values        : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    errors = sum(r.error is not None for r in records)
    if errors:
        lines.append(f"# Errors              : {errors} FAILED")
    for algo in dict.fromkeys(r.algorithm for r in records):
        mine = [r for r in records if r.algorithm == algo]
        bus = [r.busbw for r in mine if r.busbw is not None]
        avg = f"{statistics.fmean(bus):.4f} GB/s" if bus else "N/A"
        lines.append(f"# Avg bus bandwidth   : {avg}  ({algo})")
    for algo in dict.fromkeys(r.algorithm for r in records if r.algorithm != LAX_NAME):
        ratios = [r.vs_lax for r in records if r.algorithm == algo and r.vs_lax]
        if ratios:
            geo = math.exp(statistics.fmean(math.log(v) for v in ratios))
            lines.append(f"# Geomean vs_lax      : {geo:.2f}  ({algo})")
    return lines


class Progress:
    """A one-line text progress bar on stderr, only when stderr is a terminal."""

    WIDTH = 30

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.shown = False

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = self.WIDTH * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label}\x1b[K")
        sys.stderr.flush()
        self.shown = True

    def clear(self) -> None:
        """Erase the bar, so that a table row printed on the same terminal starts clean."""
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


# ---------------------------------------------------------------------------------------
# JSON and plot


def _json_safe(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def write_json(path: str, meta: dict, records: list) -> None:
    rows = [{k: _json_safe(v) for k, v in dataclasses.asdict(r).items()} for r in records]
    with open(path, "w") as fh:
        json.dump({"meta": meta, "results": rows}, fh, indent=1)
        fh.write("\n")


def write_plot(path: str, meta: dict, records: list) -> bool:
    """Per-op time (log-log) and busbw against size, one line per algorithm; one row of the
    two panels per (dtype, op). Returns False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        # Said even with --quiet: an output that was asked for is missing.
        print(f"# --plot {path}: matplotlib is not installed; no plot written "
              "(pip install matplotlib)", file=sys.stderr)
        return False
    tables = list(dict.fromkeys((r.dtype, r.op) for r in records))
    fig, axes = plt.subplots(len(tables), 2, figsize=(12, 4.2 * len(tables)), squeeze=False)
    for (dtype, op), (ax_t, ax_b) in zip(tables, axes):
        _plot_table([r for r in records if (r.dtype, r.op) == (dtype, op)], ax_t, ax_b)
        ax_t.set_title(f"time per all-reduce ({dtype} {op})")
        ax_b.set_title(f"bus bandwidth ({dtype} {op})")
    fig.suptitle(f"jax_gin {meta['jax_gin']} vs lax: {meta['ndevices']} x {meta['device_kind']}, "
                 f"jax {meta['jax']}, {meta['date'][:10]}", fontsize="medium")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # room for the title
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_table(records: list, ax_t, ax_b) -> None:
    for algo in dict.fromkeys(r.algorithm for r in records):
        rows = [r for r in records if r.algorithm == algo and r.busbw is not None]
        if not rows:
            continue
        style = "--" if algo == LAX_NAME else "-"  # the reference stands out
        sizes = [r.size for r in rows]
        ax_t.loglog(sizes, [r.time_us for r in rows], style, marker="o", label=algo)
        ax_b.semilogx(sizes, [r.busbw for r in rows], style, marker="o", label=algo)
    ax_t.set(xlabel="bytes per device", ylabel="per-op time (us)")
    ax_b.set(xlabel="bytes per device", ylabel="busbw (GB/s)")
    for ax in (ax_t, ax_b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")


# ---------------------------------------------------------------------------------------
# Driver


ONE_DEVICE_REFUSAL = (
    "jax_gin.bench: the reduced axis has one device, where every all-reduce (jax_gin's and "
    "lax's) is a copy, so the times and vs_lax ratios say nothing about all-reduce. For 8 CPU "
    "devices run with JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8; "
    "pass --one-device to run on one device anyway (no vs_lax ratios).")


def select_devices(n: int | None) -> list:
    devices = jax.devices()
    if n is None:
        return devices
    if not 1 <= n <= len(devices):
        raise SystemExit(f"--devices {n}: between 1 and {len(devices)} devices are available")
    return devices[:n]


def x64_scope(dtype: str):
    """64-bit dtypes need JAX's x64 mode; scoped so that main() leaves the config alone."""
    return jax.enable_x64(True) if jnp.dtype(dtype).itemsize == 8 else contextlib.nullcontext()


def run_table(mesh, dtype: str, op: str, sizes: list, args, platform, progress, emit) -> list:
    """Measure and print one table: every size x algorithm for one dtype and op."""
    nranks = mesh.devices.size
    itemsize = jnp.dtype(dtype).itemsize
    sharding = NamedSharding(mesh, P(AXIS))
    records = []
    emit("#")
    emit(table_header())
    for size in sizes:
        count = max(1, size // itemsize)
        k = chain_length(args, count * itemsize)
        step = chain_step_for(args.chain_step, nranks, k, dtype, op)
        scale = f16_scale_exp(nranks, k, op) if step == "slice" and \
            jnp.dtype(dtype) == jnp.float16 else 0
        inputs = make_inputs(nranks, count, dtype, op, seed=count, scale_exp=scale)
        device_args = (put_global(inputs.x.reshape(-1), sharding),
                       put_global(inputs.corr.reshape(-1), sharding))
        at_size = [Record(size=count * itemsize, count=count, dtype=dtype, op=op, algorithm=algo,
                          nranks=nranks, chain=k, chain_step=step,
                          auto_choice=auto_choice(algo, count, dtype, nranks, platform))
                   for algo in args.algorithm]
        measure_size(mesh, inputs, at_size, args, device_args, progress)
        if nranks > 1:  # on one device both sides only copy: the ratio means nothing
            fill_vs_lax(at_size)
        for rec in at_size:
            emit(format_row(rec))
        records.extend(at_size)
    return records


def main(argv=None) -> int:
    """Run the benchmark; returns 0, or 1 when any result was wrong or any run failed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    workload = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    workload.add_argument("--workload")
    if workload.parse_known_args(argv)[0].workload is not None:
        return workloads.main(argv)
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast must stay off (findings.md)
    init_distributed(args)
    main_process = jax.process_index() == 0  # prints and writes; every process measures
    if not main_process:
        args.quiet, args.json, args.plot = True, None, None
    devices = select_devices(args.devices)
    if len(devices) == 1 and not args.one_device:
        raise SystemExit(ONE_DEVICE_REFUSAL)
    platform = devices[0].platform
    if args.maxbytes is None:
        args.maxbytes = max(args.minbytes, DEFAULT_MAXBYTES.get(platform, DEFAULT_MAXBYTES["gpu"]))
    mesh = Mesh(np.array(devices), (AXIS,))
    sizes = size_steps(args.minbytes, args.maxbytes, args.stepfactor)
    meta = metadata(args, devices, platform)
    progress = Progress(len(sizes) * len(args.dtype) * len(args.op) * len(args.algorithm),
                        enabled=not args.quiet)

    def emit(line: str) -> None:
        if not main_process:
            return
        progress.clear()
        print(line, flush=True)

    def say(line: str) -> None:
        if not args.quiet:
            progress.clear()
            print(line, file=sys.stderr, flush=True)

    for line in header_lines(meta):
        emit(line)
    if len(devices) == 1:
        say("# note: one device (--one-device): every all-reduce is a copy; no vs_lax ratios")
    records = []
    try:
        for dtype in args.dtype:
            with x64_scope(dtype):
                for op in args.op:
                    records += run_table(mesh, dtype, op, sizes, args, platform, progress, emit)
    finally:
        progress.clear()
    emit("#")
    for line in footer_lines(records, args.check):
        emit(line)
    for r in records:
        if r.wrong_chain:
            emit(f"# WARNING: {r.dtype} {r.op} {r.algorithm} size {r.size}: "
                 f"{r.wrong_chain} wrong elements at the end of the chain of {r.chain}")
    if args.json:
        write_json(args.json, meta, records)
        say(f"# wrote {args.json}")
    if args.plot and write_plot(args.plot, meta, records):
        say(f"# wrote {args.plot}")
    return 1 if any(r.failed for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
