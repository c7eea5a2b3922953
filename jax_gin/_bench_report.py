"""The report of the collectives benchmark (jax_gin.bench): the nccl-tests style table with its
header and footer, the run's metadata, the progress bar, the JSON file and the plot."""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform as _platform
import statistics
import sys

import jax

import jax_gin

from ._bench_inputs import RESTORE_STEP, format_size
from ._bench_measure import LARGE_CHAIN, LAX_NAME, SMALL_CHAIN, SMALL_CHAIN_MAX_BYTES, Record
from ._ops import XLA_FALLBACK
from ._select import ALL_REDUCE

# Column layout of the results table: (header, width).
COLUMNS = (("size", 12), ("count", 12), ("type", 9), ("redop", 6), ("algo", 9), ("|", 1),
           ("time(us)", 10), ("algbw(GB/s)", 12), ("busbw(GB/s)", 12), ("#wrong", 7), ("|", 1),
           ("wall(us)", 10), ("vs_lax", 7))


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


def environment(devices, platform: str) -> dict:
    """Versions, host, devices, XLA_FLAGS, NCCL_NVLS_ENABLE and the date: what every benchmark
    report (the op sweep, the workloads) records about where it ran."""
    import jaxlib
    return {
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
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def collective_title(collective: str) -> str:
    """'all-reduce', or the jax_gin function's name."""
    return "all-reduce" if collective == ALL_REDUCE else collective


def metadata(args, devices, platform: str) -> dict:
    env = environment(devices, platform)
    method = ("per-op time = (T_K - T_1)/(K - 1), medians of wall times of jit calls; "
              "chain step slice: y <- allreduce(y); y[0] <- x[0], or subtract: "
              "y <- allreduce(y) - (ref - x) (each row's chain_step)")
    if args.collective != [ALL_REDUCE]:
        method += (f"; psum_scatter and all_gather (tiled, dimension 0): chain step "
                   f"{RESTORE_STEP}: y[0] <- op(y)[0] - corr (= x[0]); size = the larger side "
                   "per device, busbw = algbw (N-1)/N")
    return {
        "benchmark": ", ".join(collective_title(c) for c in args.collective),
        "collectives": args.collective,
        **env,
        "processes": jax.process_count(),
        "command_buffer_flags": command_buffer_flags(env["xla_flags"]),
        "minbytes": args.minbytes, "maxbytes": args.maxbytes, "stepfactor": args.stepfactor,
        "iters": args.iters, "warmup": args.warmup, "check": args.check,
        "chain": args.chain if args.chain is not None else
        f"{SMALL_CHAIN} up to {format_size(SMALL_CHAIN_MAX_BYTES)}, {LARGE_CHAIN} above",
        "dtypes": args.dtype, "ops": args.op, "algorithms": args.algorithm,
        "chain_step": args.chain_step,
        "method": method,
    }


def header_lines(meta: dict) -> list:
    if meta["platform"] == "cpu":
        graphs = "n/a on CPU"
    elif meta["command_buffer_flags"]:
        graphs = " ".join(meta["command_buffer_flags"])
    else:
        graphs = "XLA default (no command-buffer flag in XLA_FLAGS)"
    collectives = meta.get("collectives", [ALL_REDUCE])
    steps = ([meta.get("chain_step", "subtract")] if ALL_REDUCE in collectives else []) + \
        ([RESTORE_STEP] if collectives != [ALL_REDUCE] else [])
    lines = [
        f"# jax_gin {meta['jax_gin']} {meta['benchmark']} benchmark (CUDA extension: "
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
        f"chain K={meta['chain']}  step {', '.join(steps)}  "
        f"check {'on' if meta['check'] else 'off'}",
        "# time = per-op (T_K - T_1)/(K - 1); wall = T_1 (one jit call); "
        "vs_lax = lax time / this time",
    ]
    if ALL_REDUCE in collectives:
        lines.append("# chain step: slice = y <- allreduce(y); y[0] <- x[0] (in place); subtract = "
                     "y <- allreduce(y) - (ref - x) (rows marked *)")
    if collectives != [ALL_REDUCE]:
        lines += [
            "# psum_scatter, all_gather: jax_gin's and lax's, tiled along dimension 0; size = the "
            "larger side per device (N blocks), algbw = size / time, busbw = algbw (N-1)/N",
            f"# chain step {RESTORE_STEP}: y[0] <- op(y)[0] - (result[0] - x[0]) (in place; "
            "y stays x)",
        ]
    return lines


def footer_lines(records: list, check: bool) -> list:
    lines = []
    if check:
        wrong = sum((r.wrong or 0) + (r.wrong_chain or 0) for r in records)
        lines.append(f"# Wrong values        : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    errors = sum(r.error is not None for r in records)
    if errors:
        lines.append(f"# Errors              : {errors} FAILED")
    unmeasured = sum(r.time_us is not None and r.time_us <= 0 for r in records)
    if unmeasured:
        lines.append(f"# Time <= 0           : {unmeasured} row{'s' if unmeasured > 1 else ''} "
                     "(the chain of K calls took no longer than one call: noise larger than "
                     "the op, on a busy machine; no bandwidth or vs_lax there)")
    for key in dict.fromkeys((r.collective, r.algorithm) for r in records):
        mine = [r for r in records if (r.collective, r.algorithm) == key]
        bus = [r.busbw for r in mine if r.busbw is not None]
        avg = f"{statistics.fmean(bus):.4f} GB/s" if bus else "N/A"
        lines.append(f"# Avg bus bandwidth   : {avg}  ({_label(*key)})")
    for key in dict.fromkeys((r.collective, r.algorithm) for r in records
                             if r.algorithm != LAX_NAME):
        ratios = [r.vs_lax for r in records if (r.collective, r.algorithm) == key and r.vs_lax]
        if ratios:
            geo = math.exp(statistics.fmean(math.log(v) for v in ratios))
            lines.append(f"# Geomean vs_lax      : {geo:.2f}  ({_label(*key)})")
    # auto's rows where its choice was XLA's own collective: their vs_lax compares XLA with XLA
    to_xla: dict = {}
    for r in records:
        if r.algorithm == "auto" and r.auto_choice == XLA_FALLBACK:
            to_xla.setdefault((r.collective, r.dtype), []).append(format_size(r.size))
    for (collective, dtype), sizes in to_xla.items():
        lines.append(f"# auto ran XLA's own  : {_label(collective, 'auto')} {dtype} at "
                     f"{', '.join(sizes)} (no jax_gin call: vs_lax there is XLA against XLA)")
    return lines


def _label(collective: str, algorithm: str) -> str:
    return algorithm if collective == ALL_REDUCE else f"{collective} {algorithm}"


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
    tables = list(dict.fromkeys((r.collective, r.dtype, r.op) for r in records))
    fig, axes = plt.subplots(len(tables), 2, figsize=(12, 4.2 * len(tables)), squeeze=False)
    for key, (ax_t, ax_b) in zip(tables, axes):
        collective, dtype, op = key
        _plot_table([r for r in records if (r.collective, r.dtype, r.op) == key], ax_t, ax_b)
        title = collective_title(collective)
        what = f"{dtype} {op}" if collective == ALL_REDUCE else dtype
        ax_t.set_title(f"time per {title} ({what})")
        ax_b.set_title(f"bus bandwidth ({what})" if collective == ALL_REDUCE else
                       f"bus bandwidth ({title}, {what})")
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
