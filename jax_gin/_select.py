"""Algorithm choice: which algorithm `algorithm="auto"` runs, and why.

0. A group of one rank: no call (XLA's, which returns the input; ONE_RANK).
1. A tuning table (which may also send a size range to XLA's own collective, "xla", where
   that was measured faster than every jax_gin algorithm) measured on this kind of machine and group size (jax_gin/tuning/*.json,
   written by `python -m jax_gin.tune`; JAX_GIN_TUNING_DIR adds a folder searched first).
   psum, pmax and pmin read the all-reduce table; psum_scatter and all_gather each their own.
Where one round of the choice does not fit the workspace (a small JAX_GIN_WORKSPACE_BYTES),
choose and choose_collective, given the element size, take the first of the collective's
algorithms whose round does (fit_workspace).
2. Otherwise a model-based rule (choose and choose_collective below): one_shot moves
   (N-1)*S per rank in one synchronization step, two_shot 2(N-1)/N*S in two, ring the same
   bytes in 2(N-1) steps, tree log2(N) steps. Small messages are latency-bound -> one_shot; large ones
   bandwidth-bound -> two_shot for small groups, ring for large ones (two_shot's all-to-all
   traffic does not scale).
"""
from __future__ import annotations

import functools
import json
import os

import numpy as np

from . import _runtime
from ._ops import ALGORITHMS, XLA_FALLBACK

SMALL_BYTES = {"cpu": 64 << 10, "cuda": 512 << 10}
# Why auto hands a group of one rank to XLA: its collective of one device is the identity,
# which costs nothing, while a jax_gin kernel would copy (2.7 us a call on an H200;
# 2026-12-01, 8010f57).
ONE_RANK = "a group of one rank: its result is its input, and no kernel runs"
RING_MIN_RANKS = 16


# The tables' name for what psum, pmax and pmin run (one table for the three).
ALL_REDUCE = "all_reduce"
# psum_scatter and all_gather run these (include/jax_gin/collectives.h).
COLLECTIVE_ALGORITHMS = ("one_shot", "ring")


def algorithms(collective: str) -> tuple:
    """The algorithms jax_gin runs for `collective`: ALL_REDUCE, "psum_scatter" or
    "all_gather"."""
    return ALGORITHMS if collective == ALL_REDUCE else COLLECTIVE_ALGORITHMS


def table_path(device_kind: str, nranks: int, collective: str = ALL_REDUCE) -> str | None:
    """The file of `collective`'s tuning table for this device kind and group size that `auto`
    reads: JAX_GIN_TUNING_DIR's where it holds one, else jax_gin's own; None where neither
    does."""
    from .tune import TABLE_DIR, table_name
    name = table_name(device_kind, nranks, collective)
    for d in (_runtime.settings.tuning_dir, TABLE_DIR):
        if d and os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    return None


def load_table(device_kind: str, nranks: int, collective: str = ALL_REDUCE):
    """The tuning table of `collective` for this device kind and group size, or None where
    there is none; a ValueError naming the file where it is no valid table for them. A file
    is read again when it changes (python -m jax_gin.tune rewrites it)."""
    path = table_path(device_kind, nranks, collective)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError as e:
        raise _table_error(path, f"cannot be read ({e.strerror})") from None
    return _read_table(path, st.st_mtime_ns, st.st_size, device_kind, nranks, collective)


def _table_error(path: str, problem: str) -> ValueError:
    return ValueError(f"jax_gin: the tuning table {path} {problem}; correct or remove it "
                      "(python -m jax_gin.tune writes tables; JAX_GIN_TUNING_DIR names the "
                      "folder searched first)")


def _is_size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@functools.lru_cache(maxsize=None)
def _read_table(path: str, mtime_ns: int, size: int, device_kind: str, nranks: int,
                collective: str) -> dict:
    """The checked table in `path` (mtime_ns and size: the file's version, part of the cache
    key)."""
    try:
        with open(path) as f:
            table = json.load(f)
    except OSError as e:
        raise _table_error(path, f"cannot be read ({e.strerror})") from None
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise _table_error(path, f"is not JSON ({e})") from None
    if not isinstance(table, dict):
        raise _table_error(path, f"holds a JSON {type(table).__name__}, not an object")
    # the file's name says whose table it is; its fields must say the same
    expected = {"device_kind": device_kind, "nranks": nranks}
    if "collective" in table:  # tables without one (older) are the all-reduce's
        expected["collective"] = collective
    for key, want in expected.items():
        if table.get(key) != want or (key == "nranks" and isinstance(table.get(key), bool)):
            raise _table_error(path, f"has {key} {table.get(key)!r}, but is read for "
                                     f"{key} {want!r}")
    entries = table.get("entries")
    if not isinstance(entries, list) or not entries:
        raise _table_error(path, "has no entries (a non-empty list)")
    allowed = algorithms(collective) + (XLA_FALLBACK,)
    last = 0
    for k, e in enumerate(entries):
        where = f"entry {k}"
        if not isinstance(e, dict):
            raise _table_error(path, f"has {where} {e!r}, not an object")
        if e.get("algorithm") not in allowed:
            raise _table_error(path, f"has {where}'s algorithm {e.get('algorithm')!r}; "
                                     f"expected one of {', '.join(map(repr, allowed))}")
        hi = e.get("max_bytes")
        if not _is_size(hi) or hi <= last:
            raise _table_error(path, f"has {where}'s max_bytes {hi!r}; expected an integer "
                                     f"above {last} (the entries' max_bytes grow)")
        lo = e.get("at_bytes", hi)
        if not _is_size(lo) or lo > hi:
            raise _table_error(path, f"has {where}'s at_bytes {lo!r}; expected an integer "
                                     f"from 1 to its max_bytes {hi}")
        last = hi
    return table


load_table.cache_clear = _read_table.cache_clear  # type: ignore[attr-defined]


def _from_table(table: dict, nbytes: int, xla_text: str) -> tuple[str, str]:
    entries = table["entries"]
    i = next((k for k, e in enumerate(entries) if nbytes <= e["max_bytes"]), None)
    pick = entries[-1] if i is None else entries[i]
    hi = pick["max_bytes"]
    lo = pick.get("at_bytes", hi)  # the entry's sizes measured: lo to hi
    if i is None:
        span = f"at its largest size, {hi} B ({nbytes} B is above every size measured)"
    elif i == 0 and nbytes < lo:
        span = f"at its smallest size, {lo} B ({nbytes} B is below every size measured)"
    else:
        span = f"at {lo} B" if lo == hi else f"at {lo} - {hi} B"
    where = (f"{span} in the tuning table for {table['device_kind']} x {table['nranks']} "
             f"({str(table.get('measured', '?'))[:10]})")
    if pick["algorithm"] == XLA_FALLBACK:
        return XLA_FALLBACK, f"{xla_text} was faster than every jax_gin algorithm {where}"
    return pick["algorithm"], f"fastest measured {where}"


def table_kind(mesh, platform: str) -> str | None:
    """The device kind whose tuning tables `auto` reads for a call over `mesh`, or None (the
    model). The CPU tables are measured in one process, where XLA's own collectives run in
    shared memory; over several processes they run through gloo over TCP, which no table
    measured, so there the model decides."""
    devices = list(np.asarray(mesh.devices).flat)
    if platform == "cpu" and len({d.process_index for d in devices}) > 1:
        return None
    return devices[0].device_kind


def choose(platform: str, nbytes: int, nranks: int, device_kind: str | None = None,
           itemsize: int | None = None) -> tuple[str, str]:
    """Returns (algorithm, reason); given the element size, one whose round fits the
    workspace (fit_workspace)."""
    choice = _choose(platform, nbytes, nranks, device_kind)
    return choice if itemsize is None else fit_workspace(choice, platform, nranks, itemsize)


def _choose(platform: str, nbytes: int, nranks: int, device_kind: str | None) -> tuple[str, str]:
    plat = "cpu" if platform == "cpu" else "cuda"
    if nranks <= 1:
        return XLA_FALLBACK, ONE_RANK
    table = load_table(device_kind, nranks) if device_kind else None
    if table is not None:
        return _from_table(table, nbytes, "XLA's own all-reduce (what lax.psum runs)")
    small = SMALL_BYTES[plat]
    if nbytes <= small:
        return "one_shot", f"{nbytes} B <= {small} B: latency-bound, one synchronization step"
    if nranks >= RING_MIN_RANKS:
        return "ring", f"{nranks} ranks >= {RING_MIN_RANKS}: nearest-neighbour traffic only"
    return "two_shot", f"{nbytes} B > {small} B with {nranks} ranks: moves 2(N-1)/N of the data"


def choose_collective(platform: str, nbytes: int, nranks: int, device_kind: str | None = None,
                      *, api: str, itemsize: int | None = None) -> tuple[str, str]:
    """(algorithm, reason) for `api`, "psum_scatter" or "all_gather"; `nbytes` is the larger
    side per device. Its tuning table decides where there is one (XLA_FALLBACK: XLA's own
    collective). Otherwise: both schedules move the same (N-1)/N of it per rank: one_shot to
    all peers at once in one step, ring to one neighbour in N-1 steps. Within an
    NVLink/NVSwitch node, or on the CPU, every peer is one hop away and one step is cheapest;
    ring suits large groups, whose all-to-all traffic does not scale."""
    choice = _choose_collective(platform, nbytes, nranks, device_kind, api)
    return choice if itemsize is None else fit_workspace(choice, platform, nranks, itemsize, api)


def _choose_collective(platform: str, nbytes: int, nranks: int, device_kind: str | None,
                       api: str) -> tuple[str, str]:
    if nranks <= 1:
        return XLA_FALLBACK, ONE_RANK
    table = load_table(device_kind, nranks, api) if device_kind else None
    if table is not None:
        return _from_table(table, nbytes, f"XLA's own {api} (what lax.{api} runs)")
    small = SMALL_BYTES["cpu" if platform == "cpu" else "cuda"]
    if nranks >= RING_MIN_RANKS and nbytes > small:
        return "ring", f"{nranks} ranks >= {RING_MIN_RANKS}: nearest-neighbour traffic only"
    return "one_shot", (f"{nranks} ranks: every peer is one hop away, so one step moves the "
                        f"(N-1)/N share of the {nbytes} B per rank that any schedule moves")


def fit_workspace(choice: tuple, platform: str, nranks: int, itemsize: int,
                  collective: str = ALL_REDUCE) -> tuple[str, str]:
    """auto's (algorithm, reason) `choice` for elements of `itemsize` bytes, or where one round
    of that algorithm does not fit in the workspace (a small JAX_GIN_WORKSPACE_BYTES) the first
    of the collective's algorithms whose round does, so that auto runs wherever one fits;
    unchanged where none does (the lowering's error then names the workspace)."""
    algo, why = choice
    if algo == XLA_FALLBACK:
        return choice
    coll = collective != ALL_REDUCE
    if _runtime.workspace_fits(platform, algo, nranks, itemsize, coll):
        return choice
    for other in algorithms(collective):
        if _runtime.workspace_fits(platform, other, nranks, itemsize, coll):
            lane = _runtime._lane_bytes(platform)
            return other, (f"{algo} ({why}) does not fit one round in the workspace of {lane} "
                           f"bytes per rank, and {other} is the first that does")
    return choice


def validate(algorithm, api: str, choices: tuple = ALGORITHMS) -> str:
    """`algorithm` if it is "auto" or one of `choices` (the all-reduces' by default;
    COLLECTIVE_ALGORITHMS for psum_scatter and all_gather), else a ValueError naming them."""
    if algorithm == "auto" or algorithm in choices:
        return algorithm
    raise ValueError(
        f"jax_gin.{api}: unknown algorithm {algorithm!r}; expected 'auto' or one of "
        f"{', '.join(repr(a) for a in choices)}")
