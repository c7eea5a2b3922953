"""The measurement of the collectives benchmark (jax_gin.bench): the chains of dependent
all-reduces (psum_scatters, all_gathers) that are timed, one call's wall time, and the turns in
which every algorithm's chains of 1 and of K are timed side by side. The method is described
in jax_gin.bench's module doc."""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
from jax.sharding import Mesh, PartitionSpec as P

import jax_gin

from ._bench_inputs import RESTORE_STEP, Inputs, count_wrong, format_size
from ._select import ALL_REDUCE

AXIS = "i"
LAX_NAME = "lax"
LAX_OPS = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}
GIN_OPS = {"sum": jax_gin.psum, "max": jax_gin.pmax, "min": jax_gin.pmin}


# Default chain lengths. The per-op time is a difference of two wall times divided by K - 1,
# and host jitter of tens of microseconds does not shrink with the op: on 2 x H200 with K = 20,
# two rows running the same kernel at 4 KiB - 4 MiB differed by up to 40%; with K = 100 the
# difference of the two wall times is ~1 ms and such rows agree far better.
SMALL_CHAIN, LARGE_CHAIN, SMALL_CHAIN_MAX_BYTES = 100, 20, 4 << 20


def chain_length(args, size: int) -> int:
    if args.chain is not None:
        return args.chain
    return SMALL_CHAIN if size <= SMALL_CHAIN_MAX_BYTES else LARGE_CHAIN


# ---------------------------------------------------------------------------------------
# The programs timed


def reduce_fn(op: str, algorithm: str):
    """(value, axis) -> all-reduced value: jax.lax for 'lax', else jax_gin with `algorithm`."""
    if algorithm == LAX_NAME:
        return LAX_OPS[op]
    gin = GIN_OPS[op]
    return lambda v, axis: gin(v, axis, algorithm=algorithm)


def collective_fn(collective: str, op: str, algorithm: str):
    """(value, axis) -> result of `collective`: jax.lax's for 'lax', else jax_gin's with
    `algorithm`; psum_scatter and all_gather tiled, along dimension 0."""
    if collective == ALL_REDUCE:
        return reduce_fn(op, algorithm)
    if algorithm == LAX_NAME:
        ref = getattr(jax.lax, collective)
        return lambda v, axis: ref(v, axis, tiled=True)
    gin = getattr(jax_gin, collective)
    return lambda v, axis: gin(v, axis, tiled=True, algorithm=algorithm)


def bus_factor(collective: str, nranks: int) -> float:
    """busbw / algbw (nccl-tests): an all-reduce moves 2(N-1)/N of its size per rank, a
    reduce-scatter or an all-gather (N-1)/N of its larger side."""
    return (2 if collective == ALL_REDUCE else 1) * (nranks - 1) / nranks


def build_chain(mesh: Mesh, reduce, k: int, step: str = "subtract"):
    """jit(shard_map) of k dependent all-reduces (psum_scatters, all_gathers: step
    RESTORE_STEP) with the chain `step` between them."""
    def chain(x, corr):
        y = x
        for _ in range(k - 1):
            if step == RESTORE_STEP:
                # The result has another shape than y, so the next input is y again with one
                # element written in place from the result: result[0] - corr is x[0], which
                # keeps the values exact and makes the next op depend on this one.
                y = y.at[0].set(reduce(y, AXIS)[0] - corr[0])
            elif step == "slice":
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
    size: int                 # bytes per device (psum_scatter, all_gather: of the larger side)
    count: int                # elements per device (of the larger side)
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
    collective: str = ALL_REDUCE      # all_reduce, psum_scatter or all_gather

    @property
    def failed(self) -> bool:
        return self.error is not None or bool(self.wrong) or bool(self.wrong_chain)


def auto_choice(algorithm: str, count: int, dtype, nranks: int, platform: str,
                collective: str = ALL_REDUCE, device_kind: str | None = None) -> str | None:
    """What algorithm="auto" runs for a row of `count` elements per device (the larger side):
    its device kind's tuning table decides where there is one."""
    if algorithm != "auto":
        return None
    if collective == ALL_REDUCE:
        spec, kw = jax.ShapeDtypeStruct((count,), dtype), {}
    else:  # explain takes the input: an all_gather's is one block
        per_input = count if collective == "psum_scatter" else count // nranks
        spec, kw = jax.ShapeDtypeStruct((per_input,), dtype), {"collective": collective}
    return jax_gin.explain(spec, nranks=nranks, platform=platform, device_kind=device_kind,
                           **kw).split(":", 1)[0]


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
            reduce = collective_fn(rec.collective, rec.op, rec.algorithm)
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
            rec.busbw = rec.algbw * bus_factor(rec.collective, rec.nranks)
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
