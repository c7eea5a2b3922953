"""jax_gin collectives benchmark, in the language of nccl-tests.

    python -m jax_gin.bench -b 4K -e 64M -f 4 -d float32,bfloat16 -o sum -a auto,lax
    python -m jax_gin.bench -c psum_scatter,all_gather -b 4K -e 64M -a auto,one_shot,ring,lax

For every (size, dtype, op, algorithm) it measures, in one process and on the same inputs,
jax_gin's psum/pmax/pmin (`-a auto,ring,tree,one_shot,two_shot`) and jax.lax's (`-a lax`),
as docs/performance.md asks; with `-c psum_scatter` / `-c all_gather`, jax_gin's
psum_scatter / all_gather (`-a auto,one_shot,ring`) and lax's, tiled along dimension 0:

  per-op time  (T_K - T_1) / (K - 1), where T_K is the median wall time of one jit call of
               a chain of K dependent all-reduces and T_1 that of a chain of one; subtracting
               T_1 removes the dispatch and launch cost that every call pays once.
               K is 100 up to 4 MiB per device and 20 above (-k to set it): host jitter
               divides by K - 1, and a small op needs a long chain to rise above it.
  wall         T_1, the time a user sees for one jit call holding one all-reduce.
  algbw        bytes per device / per-op time;  busbw = algbw * 2(N-1)/N (nccl-tests).
               psum_scatter, all_gather: size is nccl-tests' too, the larger side per device
               (N blocks: psum_scatter's input, all_gather's output), -b/-e rounded down to
               N whole elements per block; algbw = size / per-op time, busbw = algbw (N-1)/N.
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
            pass over three buffers, which the per-op time includes.

`--chain-step` picks one; the JSON records the step of every row. Each chain's last
all-reduce is checked too, against the exact value the step gives.

psum_scatter and all_gather return another shape than they take, so their chain has one step:

  restore   y <- y with y[0] <- op(y)[0] - (result_i[0] - x_i[0])
            The next input is y (so x_i) again, with one element written in place from the
            result: values never grow, the next op depends on this one, and the per-op time is
            the op plus one tiny kernel (and, once per chain, a copy of x). Each device's
            result is checked bit for bit against numpy's exact one (the sum of its block, or
            every device's block), as lax's rows are.

main() returns 0, or 1 when any result was wrong or any configuration failed (the failure is
printed in its row and the sweep goes on). With one device on the reduced axis no
all-reduce reduces (auto and lax return the input, an explicit algorithm copies it): main()
exits with a message naming how to get 8 CPU devices, unless --one-device is given (then no
vs_lax ratios are computed).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import sys

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_gin
from jax_gin import workloads

from . import _distributed, _runtime, _select
from ._bench_inputs import (COLLECTIVE_OPS, RESTORE_STEP, SIZE_UNITS, chain_step_for,
                            f16_scale_exp, make_collective_inputs, make_inputs, put_global,
                            size_steps)
from ._bench_measure import (AXIS, LARGE_CHAIN, LAX_NAME, SMALL_CHAIN, SMALL_CHAIN_MAX_BYTES,
                             Record, auto_choice, chain_length, fill_vs_lax, measure_size)
from ._bench_report import (Progress, footer_lines, format_row, header_lines, metadata,
                            table_header, write_json, write_plot)
from ._ops import OPS
from ._select import ALL_REDUCE, algorithms
from ._trace import _check_writable
from .tune import COLLECTIVES

ALGO_CHOICES = ("auto",) + tuple(jax_gin.ALGORITHMS) + (LAX_NAME,)

# nccl-tests' type names, so that `-d float -d half` mean what they mean there.
DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16",
                 "int": "int32", "uint": "uint32", "f32": "float32", "f16": "float16",
                 "f64": "float64"}
DEFAULT_MAXBYTES = {"cpu": 1 << 20, "gpu": 64 << 20}


def algo_choices(collective: str) -> tuple:
    """What -a takes for `collective` (ALGO_CHOICES for the all-reduce)."""
    return ("auto",) + algorithms(collective) + (LAX_NAME,)


# ---------------------------------------------------------------------------------------
# Command line


def parse_size(text: str) -> int:
    """'4096', '4K', '64M', '1G' (also '4k', '4KB', '4KiB') -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)(?:i?[Bb])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; expected e.g. 4096, 4K, 64M, 1G")
    return int(m.group(1)) * SIZE_UNITS[m.group(2).upper()]


def _comma_list(choices: tuple, normalize=lambda s: s, keep_all: bool = False):
    """An argparse type: a comma-separated list whose items must be in `choices`; 'all' is
    every choice (keep_all: the list ['all'], resolved later)."""
    def parse(text: str) -> list:
        items = [normalize(s.strip()) for s in text.split(",") if s.strip()]
        if items == ["all"]:
            return ["all"] if keep_all else list(choices)
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{', '.join(bad) or 'empty list'}: expected a comma list of {', '.join(choices)}")
        return list(dict.fromkeys(items))  # drop repeats, keep order
    return parse


def _dtype_name(text: str) -> str:
    return DTYPE_ALIASES.get(text.lower(), text.lower())


def prog() -> str:
    """The command as the user typed it: the console script, or the module."""
    script = _runtime.BENCH_SCRIPT
    return script if os.path.basename(sys.argv[0]) == script else "python -m jax_gin.bench"


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog(), add_help=add_help,
        description="Benchmark jax_gin's all-reduce, psum_scatter and all_gather against "
                    "jax.lax (nccl-tests style).")
    p.add_argument("-c", "--collective", type=_comma_list(COLLECTIVES), default=[ALL_REDUCE],
                   help=f"comma list of {', '.join(COLLECTIVES)}, or all (default all_reduce): "
                        "all_reduce is psum/pmax/pmin (-o), psum_scatter and all_gather are "
                        "tiled along dimension 0 against lax.psum_scatter / lax.all_gather; "
                        "their size is the larger side per device (N blocks), as nccl-tests'")
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
                   help="comma list of sum, max, min, or all (default sum); all_reduce's only: "
                        "psum_scatter sums, all_gather has no op (its redop column: none)")
    p.add_argument("-a", "--algorithm", type=_comma_list(ALGO_CHOICES, keep_all=True),
                   default=["auto", LAX_NAME],
                   help=f"comma list of {', '.join(ALGO_CHOICES)}, or all (default auto,lax); "
                        "'lax' is jax.lax's own (psum/pmax/pmin, psum_scatter, all_gather). "
                        "psum_scatter and all_gather take only "
                        f"{', '.join(algo_choices('psum_scatter'))}; "
                        "'all' is each collective's own")
    p.add_argument("-k", "--chain", type=int, default=None,
                   help=f"chain length K of dependent ops for the per-op time: all-reduces, "
                        "psum_scatters or all_gathers, never a mix (default "
                        f"{SMALL_CHAIN} up to {SMALL_CHAIN_MAX_BYTES >> 20} MiB per device, "
                        f"{LARGE_CHAIN} above)")
    p.add_argument("--chain-step", choices=("auto", "slice", "subtract"), default="auto",
                   help="what runs between the chain's all-reduces: 'slice' (a one-element "
                        "in-place update), 'subtract' (an elementwise pass), or 'auto': slice "
                        "where its values stay exact, else subtract (default). all_reduce's "
                        f"only: psum_scatter and all_gather chains always take the "
                        f"'{RESTORE_STEP}' step (y[0] <- op(y)[0] - corr, which is x[0])")
    p.add_argument("--devices", type=int, default=None,
                   help="use the first N devices (default all)")
    p.add_argument("--one-device", action="store_true",
                   help="run even when the reduced axis has one device, where no all-reduce "
                        "reduces: no vs_lax ratios or geomean (refused without it)")
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
    add_process_arguments(g, "jax.distributed coordinator address; with --num-processes and "
                             "--process-id")
    g.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() with no arguments (SLURM, Open MPI, "
                        "or JAX_COORDINATOR_ADDRESS etc. in the environment)")
    return p


def add_process_arguments(parser, coordinator_help: str) -> None:
    """--coordinator, --num-processes and --process-id: one process of a multi-process job
    (this benchmark's and python -m jax_gin.doctor's); check_processes checks them."""
    parser.add_argument("--coordinator", metavar="HOST:PORT", help=coordinator_help)
    parser.add_argument("--num-processes", type=int, default=None, metavar="N",
                        help="processes of the job, at least 1")
    parser.add_argument("--process-id", type=int, default=None, metavar="I",
                        help="this process, from 0 to N-1")


def check_processes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """add_process_arguments' flags, before jax.distributed.initialize() sees them: all three
    or none, --coordinator as HOST:PORT, --num-processes at least 1, --process-id from 0 to
    --num-processes - 1."""
    given = [a is not None for a in (args.coordinator, args.num_processes, args.process_id)]
    if not any(given):
        return
    if not all(given):
        parser.error("--coordinator, --num-processes and --process-id go together")
    m = re.fullmatch(r"(.+):(\d+)", args.coordinator)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        parser.error(f"--coordinator {args.coordinator}: expected HOST:PORT, with a port from 1 "
                     "to 65535 (e.g. 127.0.0.1:1234)")
    if args.num_processes < 1:
        parser.error(f"--num-processes {args.num_processes}: must be at least 1")
    if not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id {args.process_id}: must be from 0 to "
                     f"{args.num_processes - 1} (--num-processes {args.num_processes})")


def check_size_range(parser: argparse.ArgumentParser, minbytes: int, maxbytes: int | None) -> None:
    """-b and -e as the benchmark takes them (also python -m jax_gin.tune's)."""
    if minbytes < 1:
        parser.error("-b/--minbytes must be at least 1 byte")
    if maxbytes is not None and maxbytes < minbytes:
        parser.error("-e/--maxbytes is smaller than -b/--minbytes")


def parse_args(argv) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_size_range(parser, args.minbytes, args.maxbytes)
    if args.stepfactor < 2:
        parser.error("-f/--stepfactor must be at least 2")
    if args.iters < 1 or args.warmup < 0:
        parser.error("-n/--iters must be >= 1 and -w/--warmup >= 0")
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices {args.devices}: must be at least 1")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            try:  # before the run that would fill it
                _check_writable(path, flag)
            except OSError as err:
                parser.error(str(err))
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"--plot {args.plot}: matplotlib is not installed (pip install matplotlib)")
    if args.chain is not None and args.chain < 2:
        parser.error("-k/--chain must be >= 2: the per-op time is (T_K - T_1) / (K - 1)")
    if ALL_REDUCE not in args.collective:
        if args.op != ["sum"]:
            parser.error("-o/--op is all_reduce's: psum_scatter sums and all_gather has no op")
        if args.chain_step != "auto":
            parser.error(f"--chain-step is all_reduce's: psum_scatter and all_gather chains "
                         f"take the {RESTORE_STEP} step")
    if args.algorithm == ["all"]:
        wanted = {a for c in args.collective for a in algo_choices(c)}
        args.algorithm = [a for a in ALGO_CHOICES if a in wanted]
    else:
        for c in args.collective:
            bad = [a for a in args.algorithm if a not in algo_choices(c)]
            if bad:
                parser.error(f"-a/--algorithm {','.join(bad)}: {c} takes only "
                             f"{', '.join(algo_choices(c))}")
    check_processes(parser, args)
    if args.coordinator is not None and args.distributed:
        parser.error("--distributed takes its settings from the environment: drop "
                     "--coordinator, --num-processes and --process-id")
    return args


# How long a process started with --coordinator waits for the others to join (JAX's own
# default: 300 s, without a word).
JOIN_TIMEOUT_S = 60


def join_job(coordinator: str, num_processes: int, process_id: int) -> None:
    """jax.distributed.initialize with add_process_arguments' flags, saying so on stderr first;
    JoinError where it raises. Where the others do not join within JOIN_TIMEOUT_S, JAX 0.11.2
    ends the process itself (abort, "the JAX distributed service detected fatal errors")."""
    print(f"process {process_id} of {num_processes}: joining the job at {coordinator}; JAX "
          f"ends this process if the others have not joined within {JOIN_TIMEOUT_S} s",
          file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=JOIN_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - jax.errors.JaxRuntimeError and the like
        first = (str(e).splitlines() or [type(e).__name__])[0][:300]
        raise JoinError(
            f"process {process_id} of {num_processes} could not join the job at {coordinator} "
            f"({first})",
            "start every process with the same --coordinator and --num-processes and its own "
            "--process-id, where all of them reach the coordinator's address; process 0 "
            "serves it, on a port that nothing else holds") from e


class JoinError(RuntimeError):
    """join_job's failure: `problem`, then its `fix`."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}: {fix}")
        self.problem, self.fix = problem, fix


def init_distributed(args) -> None:
    """jax.distributed.initialize() for a run over several processes (before any device use).
    On CPU, lax's cross-process collectives need gloo; the setting is ignored on GPUs."""
    if args.coordinator is None and not args.distributed:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.distributed:
        jax.distributed.initialize()
    else:
        join_job(args.coordinator, args.num_processes, args.process_id)


# ---------------------------------------------------------------------------------------
# Driver


# How to run on 8 CPU devices (the refusals of one device say it).
EIGHT_CPU_DEVICES = "JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8"
ONE_DEVICE_REFUSAL = (
    "jax_gin.bench: the reduced axis has one device, where no all-reduce reduces (auto and "
    "lax return the input, an explicit algorithm copies it), so the times and vs_lax ratios "
    f"say nothing about all-reduce. For 8 CPU devices run with {EIGHT_CPU_DEVICES}; "
    "pass --one-device to run on one device anyway (no vs_lax ratios).")


def select_devices(n: int | None) -> list:
    devices = jax.devices()
    if n is None:
        return devices
    if not 1 <= n <= len(devices):  # a usage error, as --devices 0 is (known only now)
        print(f"{prog()}: error: --devices {n}: between 1 and {len(devices)} devices are "
              "available", file=sys.stderr)
        raise SystemExit(2)
    return devices[:n]


def x64_scope(dtype: str):
    """64-bit dtypes need JAX's x64 mode; scoped so that main() leaves the config alone."""
    return jax.enable_x64(True) if jnp.dtype(dtype).itemsize == 8 else contextlib.nullcontext()


def collective_algorithms(args, collective: str) -> list:
    """The algorithms of -a that `collective` runs (all of them, unless -a was 'all')."""
    return [a for a in args.algorithm if a in algo_choices(collective)]


def collective_ops(args, collective: str) -> list:
    return args.op if collective == ALL_REDUCE else [COLLECTIVE_OPS[collective]]


def size_count(collective: str, size: int, nranks: int, itemsize: int) -> int:
    """Elements of one row of `size` bytes: `size` rounded down to whole elements (at least
    one), and for psum_scatter and all_gather to N blocks of whole elements (at least one)."""
    if collective != ALL_REDUCE:
        return nranks * max(1, size // (itemsize * nranks))
    return max(1, size // itemsize)


def row_sizes(collective: str, sizes: list, nranks: int, itemsize: int) -> list:
    """`sizes` less those that round to the same elements as an earlier one (small sizes over
    many devices), so that each row is measured once."""
    counts = [size_count(collective, size, nranks, itemsize) for size in sizes]
    return [size for i, size in enumerate(sizes) if counts[i] not in counts[:i]]


def size_inputs(collective: str, size: int, nranks: int, dtype: str, op: str, args):
    """(count, K, chain step, Inputs) of one row's size (size_count)."""
    itemsize = jnp.dtype(dtype).itemsize
    if collective != ALL_REDUCE:
        block = size_count(collective, size, nranks, itemsize) // nranks
        k = chain_length(args, nranks * block * itemsize)
        return (nranks * block, k, RESTORE_STEP,
                make_collective_inputs(collective, nranks, block, dtype, seed=nranks * block))
    count = size_count(collective, size, nranks, itemsize)
    k = chain_length(args, count * itemsize)
    step = chain_step_for(args.chain_step, nranks, k, dtype, op)
    scale = f16_scale_exp(nranks, k, op) if step == "slice" and \
        jnp.dtype(dtype) == jnp.float16 else 0
    return count, k, step, make_inputs(nranks, count, dtype, op, seed=count, scale_exp=scale)


def run_table(mesh, dtype: str, op: str, sizes: list, args, platform, progress, emit,
              collective: str = ALL_REDUCE) -> list:
    """Measure and print one table: every size x algorithm for one collective, dtype and op."""
    nranks = mesh.devices.size
    itemsize = jnp.dtype(dtype).itemsize
    kind = mesh.devices.flat[0].device_kind
    sharding = NamedSharding(mesh, P(AXIS))
    table_kind = _select.table_kind(mesh, platform)
    if "auto" in collective_algorithms(args, collective) and nranks > 1 and table_kind:
        try:  # auto's rows would all fail on a table that is no valid one
            _select.load_table(table_kind, nranks, collective)
        except ValueError as e:
            raise SystemExit(f"{prog()}: {e}") from None
    records = []
    emit("#")
    if args.collective != [ALL_REDUCE]:
        emit(f"# {collective}")
    emit(table_header())
    for size in row_sizes(collective, sizes, nranks, itemsize):
        count, k, step, inputs = size_inputs(collective, size, nranks, dtype, op, args)
        device_args = (put_global(inputs.x.reshape(-1), sharding),
                       put_global(inputs.corr.reshape(-1), sharding))
        at_size = [Record(size=count * itemsize, count=count, dtype=dtype, op=op, algorithm=algo,
                          nranks=nranks, chain=k, chain_step=step, collective=collective,
                          auto_choice=auto_choice(algo, count, dtype, nranks, platform,
                                                  collective, kind))
                   for algo in collective_algorithms(args, collective)]
        measure_size(mesh, inputs, at_size, args, device_args, progress)
        if nranks > 1:  # on one device neither side reduces: the ratio means nothing
            fill_vs_lax(at_size)
        for rec in at_size:
            emit(format_row(rec))
        records.extend(at_size)
    return records


def main(argv=None, say_written: bool = True) -> int:
    """Run the benchmark; returns 0, or 1 when any result was wrong or any run failed.
    say_written: print '# wrote PATH' for --json and --plot (python -m jax_gin.tune, whose
    --json file is a temporary one, passes False)."""
    _runtime.refuse_invalid_variables(prog())
    argv = sys.argv[1:] if argv is None else list(argv)
    # the sweep's own parser finds --workload (or its abbreviation), the workload's options
    # aside, so that both read the command line alike
    if build_parser(add_help=False).parse_known_args(argv)[0].workload is not None:
        return workloads.main(argv, prog=prog())
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (docs/multi-node.md)
    try:
        init_distributed(args)
    except JoinError as e:
        print(f"{prog()}: {e}", file=sys.stderr, flush=True)
        return 1
    # every process runs the same programs: the options that make them must agree
    _distributed.check_same_command(prog(), {k: v for k, v in vars(args).items() if k not in (
        "coordinator", "num_processes", "process_id", "distributed", "json", "plot", "quiet")})
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
    progress = Progress(sum(
        len(row_sizes(c, sizes, len(devices), jnp.dtype(d).itemsize))
        * len(collective_ops(args, c)) * len(collective_algorithms(args, c))
        for c in args.collective for d in args.dtype), enabled=not args.quiet)

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
        say("# note: one device (--one-device): no all-reduce reduces (auto and lax return the "
            "input, an explicit algorithm copies it); no vs_lax ratios")
    records = []
    try:
        for collective in args.collective:
            for dtype in args.dtype:
                with x64_scope(dtype):
                    for op in collective_ops(args, collective):
                        records += run_table(mesh, dtype, op, sizes, args, platform, progress,
                                             emit, collective)
    finally:
        progress.clear()
    emit("#")
    for line in footer_lines(records, args.check):
        emit(line)
    for r in records:
        if r.wrong_chain:
            what = "" if r.collective == ALL_REDUCE else f"{r.collective} "
            emit(f"# WARNING: {what}{r.dtype} {r.op} {r.algorithm} size {r.size}: "
                 f"{r.wrong_chain} wrong elements at the end of the chain of {r.chain}")
    if args.json:
        write_json(args.json, meta, records)
        if say_written:
            say(f"# wrote {args.json}")
    if args.plot and write_plot(args.plot, meta, records) and say_written:
        say(f"# wrote {args.plot}")
    return 1 if any(r.failed for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
