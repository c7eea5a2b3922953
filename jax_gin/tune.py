"""Measure every algorithm on this machine and write a tuning table for `algorithm="auto"`.

    python -m jax_gin.tune                       # measure here, write <dir>/<gpu>_n<N>.json
    python -m jax_gin.tune -c psum_scatter       # ... <gpu>_n<N>_psum_scatter.json (also all_gather)
    python -m jax_gin.tune --from-json a.json b.json   # build the table from benchmark results

A table is keyed by collective, device kind and group size, and lists, for growing message
sizes, the algorithm that was fastest there (median per-op time over the runs given, as
`python -m jax_gin.bench` measures it), or "xla" where lax's own collective (lax.psum,
lax.psum_scatter, lax.all_gather) beat every jax_gin algorithm by more than 3%. psum, pmax and
pmin share the all_reduce table (measured with sum); psum_scatter and all_gather have one each,
whose sizes are nccl-tests' (the larger side per device, N blocks). `auto`
uses the table of its machine when one ships with jax_gin (or JAX_GIN_TUNING_DIR holds one),
and falls back to the model-based rule of _select.py otherwise. <dir> is JAX_GIN_TUNING_DIR
where it is set (so that `auto` reads the table there first), else jax_gin/tuning/ of a source
tree (an editable install); an installed copy refuses that default (a file written into an
installed package outlives `pip uninstall`, and goes on steering `auto` after upgrades, or is
overwritten by one where it replaces a shipped table).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

from . import _runtime
from ._bench_measure import LAX_NAME
from ._ops import XLA_FALLBACK
from ._scatter_gather import API_NAMES
from ._select import ALL_REDUCE, algorithms
from ._trace import _check_writable

# What a table can be for, as `python -m jax_gin.bench -c` names them.
COLLECTIVES = (ALL_REDUCE,) + API_NAMES

TABLE_DIR = os.path.join(os.path.dirname(__file__), "tuning")


def in_source_tree(table_dir: str) -> bool:
    """Whether `table_dir` (jax_gin/tuning/) lies in a source tree, as an editable install's
    does (jax_gin's pyproject.toml beside the package), rather than in an installed copy
    (site-packages, a --target or --prefix directory)."""
    return os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        table_dir))), "pyproject.toml"))


def table_name(device_kind: str, nranks: int, collective: str = ALL_REDUCE) -> str:
    """<kind>_n<N>.json for the all-reduce, <kind>_n<N>_<collective>.json for the others."""
    kind = "".join(c if c.isalnum() else "_" for c in device_kind.lower()).strip("_")
    return f"{kind}_n{nranks}" + ("" if collective == ALL_REDUCE else f"_{collective}") + ".json"


# `lax` must beat the best jax_gin algorithm by this fraction (of the median per-op times)
# before a size goes to XLA's own collective: below it, run-to-run noise decides.
XLA_MARGIN = 0.03


def build_table(results: list, meta: dict, dtype: str = "float32", op: str | None = None,
                xla_margin: float = XLA_MARGIN, collective: str = ALL_REDUCE) -> dict:
    """Fastest algorithm per size from the benchmark records of `collective` (records without
    a collective, from older benchmarks, are all-reduces): the median per-op time over every
    run given, per size and algorithm. Where `lax` was measured too and its median beats the
    best jax_gin algorithm by more than `xla_margin`, the size goes to XLA's own collective
    ("xla"). Adjacent sizes with the same winner merge into one entry. `op`: the records' op;
    default "sum" for the all-reduce, and for the others whatever their one op is."""
    if op is None and collective == ALL_REDUCE:
        op = "sum"
    allowed = algorithms(collective) + (XLA_FALLBACK,)
    times: dict = {}
    for r in results:
        algo = r.get("algorithm")
        algo = XLA_FALLBACK if algo == LAX_NAME else algo
        if (r.get("collective", ALL_REDUCE) != collective or r.get("dtype") != dtype
                or (op is not None and r.get("op") != op) or algo not in allowed):
            continue
        op = op if op is not None else r.get("op")
        if r.get("error") or r.get("wrong") or not r.get("time_us") or r["time_us"] <= 0:
            continue
        times.setdefault(r["size"], {}).setdefault(algo, []).append(r["time_us"])
    entries = []
    for size in sorted(times):
        med = {a: statistics.median(ts) for a, ts in times[size].items()}
        gin = {a: t for a, t in med.items() if a != XLA_FALLBACK}
        if not gin:
            continue
        algo = min(gin, key=gin.get)
        if XLA_FALLBACK in med and med[XLA_FALLBACK] < gin[algo] * (1 - xla_margin):
            algo = XLA_FALLBACK
        if entries and entries[-1]["algorithm"] == algo:
            entries[-1]["max_bytes"] = size
        else:
            # time_us and runs: the medians at the entry's first size (`at_bytes`)
            entries.append({"max_bytes": size, "algorithm": algo, "at_bytes": size,
                            "time_us": {a: round(t, 2) for a, t in med.items()},
                            "runs": max(len(ts) for ts in times[size].values())})
    return {
        "collective": collective,
        "device_kind": meta.get("device_kind"),
        "nranks": meta.get("nranks", meta.get("ndevices")),
        "platform": meta.get("platform"),
        "dtype": dtype, "op": op,
        "jax": meta.get("jax"),
        "measured": meta.get("date"),
        "source": meta.get("source", "python -m jax_gin.tune"),
        # sizes up to max_bytes (inclusive, and between two entries: the later one) use
        # algorithm; "xla" is XLA's own collective (lax's), where it was faster
        "entries": entries,
    }


def _load_results(paths: list) -> tuple[list, dict]:
    results, meta = [], {}
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
        except OSError as e:
            raise SystemExit(f"jax_gin.tune: cannot read {p}: {e.strerror}")
        except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
            raise SystemExit(f"jax_gin.tune: {p} is not JSON ({e})")
        if not isinstance(d, dict) or not isinstance(d.get("results"), list):
            raise SystemExit(f"jax_gin.tune: {p} is not the JSON of an op sweep "
                             "(`python -m jax_gin.bench --json`, not --workload): it has no "
                             "list of results")
        m = d.get("meta")
        kind = m.get("device_kind") if isinstance(m, dict) else None
        n = m.get("nranks", m.get("ndevices")) if isinstance(m, dict) else None
        if not isinstance(kind, str) or not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise SystemExit(f"jax_gin.tune: {p} names no device kind and group size (its "
                             "meta's device_kind and ndevices, as the benchmark writes them), "
                             "which a table is for")
        if meta and (kind, n) != (meta["device_kind"], meta["nranks"]):
            raise SystemExit(f"jax_gin.tune: {p} was measured on {kind} x {n}, but {paths[0]} "
                             f"on {meta['device_kind']} x {meta['nranks']}; a table is of one "
                             "device kind and group size")
        results += d["results"]
        meta = meta or {**m, "nranks": n}
    return results, meta


def _describe(path: str) -> str:
    """A table file's date of measurement and the sizes it covers (the line that replaces it
    says them)."""
    try:
        with open(path) as f:
            old = json.load(f)
        sizes = [e["max_bytes"] for e in old["entries"]]
        return f"measured {str(old.get('measured', '?'))[:10]}, up to {max(sizes)} B"
    except (OSError, ValueError, KeyError, TypeError):
        return "not a table jax_gin reads"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_gin.tune", description=__doc__.splitlines()[0])
    _runtime.refuse_invalid_variables(ap.prog)
    ap.add_argument("--from-json", nargs="+", metavar="BENCH_JSON",
                    help="build the table from `python -m jax_gin.bench --json` files")
    ap.add_argument("-c", "--collective", choices=COLLECTIVES, default=ALL_REDUCE,
                    help="the collective to tune: all_reduce (psum, pmax and pmin; the default), "
                         "psum_scatter or all_gather, between its algorithms and XLA's own; "
                         "with --from-json, the collective whose records make the table")
    ap.add_argument("--out", help="where to write the table (default: <kind>_n<N>.json, "
                                  "<kind>_n<N>_<collective>.json for psum_scatter and "
                                  "all_gather, in JAX_GIN_TUNING_DIR where it is set, else in "
                                  "jax_gin/tuning/ of a source tree, replacing the table "
                                  "shipped there)")
    from . import bench
    from ._bench_inputs import format_size
    maxbytes = bench.DEFAULT_MAXBYTES
    ap.add_argument("-b", "--minbytes", type=bench.parse_size, default=None,
                    help="smallest size per device, as the benchmark's -b (default 4K)")
    ap.add_argument("-e", "--maxbytes", type=bench.parse_size, default=None,
                    help="largest size per device, as the benchmark's -e (default "
                         f"{format_size(maxbytes['gpu'])} on GPUs, "
                         f"{format_size(maxbytes['cpu'])} on CPU devices)")
    ap.add_argument("-n", "--iters", type=int, default=None,
                    help="timed repeats per size, whose median decides (default 30)")
    args = ap.parse_args(argv)
    measuring = [o for o, v in (("-b", args.minbytes), ("-e", args.maxbytes), ("-n", args.iters))
                 if v is not None]
    if args.from_json and measuring:
        ap.error(f"--from-json builds the table from the files' sizes and runs; "
                 f"{', '.join(measuring)} (what tune measures) cannot be given with it")
    args.minbytes = 4096 if args.minbytes is None else args.minbytes
    args.iters = 30 if args.iters is None else args.iters
    bench.check_size_range(ap, args.minbytes, args.maxbytes)
    if args.iters < 1:
        ap.error("-n/--iters must be at least 1")
    # where the table goes, checked before the measurement that fills it: --out's directory
    # must exist, as the benchmark's --json's; the default's file name needs the measurement,
    # so its directory is made where missing and checked
    out_dir = _runtime.settings.tuning_dir or TABLE_DIR
    if not (args.out or _runtime.settings.tuning_dir or in_source_tree(TABLE_DIR)):
        ap.error(f"{TABLE_DIR} is in an installed jax_gin, not a source tree: a table written "
                 "there outlives `pip uninstall` and is not the package's to keep; set "
                 "JAX_GIN_TUNING_DIR to a directory of yours (auto reads it first), or give "
                 "--out")
    try:
        if args.out:
            _check_writable(args.out, "--out")
        elif os.path.exists(out_dir) and not os.path.isdir(out_dir):
            ap.error(f"cannot write a table into {out_dir}: it is no directory; give --out, or "
                     "set JAX_GIN_TUNING_DIR to a directory")
        else:
            os.makedirs(out_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=out_dir):
                pass
    except OSError as err:
        ap.error(str(err) if args.out else f"cannot write a table into {out_dir}: "
                 f"{err.strerror or err}; give --out, or set JAX_GIN_TUNING_DIR")
    if args.from_json:
        results, meta = _load_results(args.from_json)
        meta["source"] = "built from " + ", ".join(
            os.path.join(os.path.basename(os.path.dirname(os.path.abspath(p))), os.path.basename(p))
            for p in args.from_json)
    else:
        import jax
        if len(jax.devices()) == 1:
            print("jax_gin.tune: there is one device, where no collective moves data (auto "
                  "returns the input), so there is nothing to tune. For 8 CPU devices run with "
                  f"{bench.EIGHT_CPU_DEVICES}.",
                  file=sys.stderr)
            return 1
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "bench.json")
            argv_b = ["-c", args.collective, "-b", str(args.minbytes), "-f", "2",
                      "-n", str(args.iters), "-d", "float32",
                      "-a", ",".join(algorithms(args.collective) + (LAX_NAME,)), "--json", path]
            if args.maxbytes:
                argv_b += ["-e", str(args.maxbytes)]
            rc = bench.main(argv_b, say_written=False)  # `path` is gone when tune ends
            if rc != 0:
                print("jax_gin.tune: the benchmark reported failures; no table written", file=sys.stderr)
                return rc
            results, meta = _load_results([path])
    meta.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat())
    table = build_table(results, meta, collective=args.collective)
    if not table["entries"]:
        print(f"jax_gin.tune: no usable measurements of {args.collective}: a table is built "
              f"from float32 records{' of op sum' if args.collective == ALL_REDUCE else ''} "
              f"of its algorithms ({', '.join(algorithms(args.collective))}), without "
              "errors or wrong results", file=sys.stderr)
        return 1
    out = args.out or os.path.join(out_dir, table_name(table["device_kind"], table["nranks"],
                                                       args.collective))
    replaced = _describe(out) if os.path.exists(out) else None
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"jax_gin.tune: wrote {out}" + (f", replacing the table there ({replaced})"
                                          if replaced else ""))
    for e in table["entries"]:
        print(f"  <= {e['max_bytes']:>12} B: {e['algorithm']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
