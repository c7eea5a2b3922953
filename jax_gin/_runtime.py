"""Communicators and symmetric workspaces, created before execution and cached.

A communicator serves every group that one reduction (a tuple of mesh axes) forms on one
mesh: reducing a 4x2 mesh over 'x' forms 2 groups of 4 ranks. It is created the first time a
program that needs it is lowered -- before that program ever runs -- and reused by every
later call and every later compilation with the same mesh, axes and settings. The FFI call
names it by an integer attribute; the handler only looks it up.

In a multi-process job (jax.distributed) on CPU, a group whose devices live in several
processes keeps its workspace in POSIX shared memory, set up by all of them together when they
lower the program (_distributed.py). On GPU, such groups get NCCL communicators through
ncclCommInitRank, with unique ids shared through the same key-value store (run on 2 x H200
as 2 processes x 1 GPU). Every process must therefore lower the same jax_gin programs in the
same order, as SPMD programs do anyway.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import math
import os
import sys
import threading

import jax
import numpy as np

from . import _distributed, _native
from ._ops import ALGORITHM_CODES

# Defaults that native code needs too are read from it: the CPU backend's window bytes per rank
# (cpu_backend.h CommConfig), the seconds any wait may spin (common.h kDefaultTimeoutS) and the
# calls the flight recorder keeps per rank (recorder.h kRecDefaultEntries).
_DEFAULT_CPU_WORKSPACE = int(_native.cpu.CPU_DEFAULT_LANE_BYTES)
_DEFAULT_TIMEOUT_S = float(_native.cpu.DEFAULT_TIMEOUT_S)
_DEFAULT_RECORD_ENTRIES = int(_native.cpu.REC_DEFAULT_ENTRIES)
_DEFAULT_GPU_WORKSPACE = 64 << 20  # bytes per rank, split among the kernel's lanes
_DEFAULT_BUCKET_BYTES = 64 << 20  # bytes of one pytree call (Settings.bucket_bytes)
_DEFAULT_OVERLAP_LANES = 32  # CTAs of an asynchronous call on a GPU (Settings.overlap_lanes)
# Asynchronous calls from this size move their data with the copy engines
# (Settings.overlap_copy_engine_bytes). A default, not a measured crossover: beside compute on
# 2 x H200 the copy engines beat the SM path at 256 MiB; where they start to is not measured.
_DEFAULT_OVERLAP_COPY_ENGINE_BYTES = 32 << 20

# Segment and block boundaries are multiples of this many bytes (common.h kAlignBytes): the
# kernels move 16-byte vectors.
ALIGN_BYTES = int(_native.cpu.ALIGN_BYTES)
MAX_LANES = int(_native.cpu.MAX_LANES)  # the most lanes of one call (common.h kMaxLanes)
# The most calls a flight-recorder ring keeps (recorder.h kRecMaxEntries); a ring's count is a
# power of two, so that the kernels find a call's slot with a mask.
REC_MAX_ENTRIES = int(_native.cpu.REC_MAX_ENTRIES)
# The CUDA kernels hold the timeout in uint64 nanoseconds; 1e9 s (~31 years) stays well inside.
_MAX_TIMEOUT_S = 1e9
# Integer settings reach native code as int64 or size_t: every one is below 2**63.
_MAX_INT = 1 << 63

_BYTES = "a positive integer number of bytes, below 2**63"
# Words a boolean variable may take, as JAX's own boolean flags (any case).
_TRUE_WORDS = ("1", "true", "t", "yes", "y", "on")
_FALSE_WORDS = ("0", "false", "f", "no", "n", "off")
_BOOL = ("True or False (in the environment: " + ", ".join(_TRUE_WORDS) + "; or "
         + ", ".join(_FALSE_WORDS) + ")")
# Settings field -> (environment variable, what a valid value is).
_RULES = {
    "cpu_workspace_bytes": ("JAX_GIN_WORKSPACE_BYTES", _BYTES),
    "gpu_workspace_bytes": ("JAX_GIN_WORKSPACE_BYTES", _BYTES),
    "timeout_s": ("JAX_GIN_TIMEOUT_S",
                  "a positive finite number of seconds, at most 1e9 (there is no 'no timeout' value)"),
    "bucket_bytes": ("JAX_GIN_BUCKET_BYTES", _BYTES),
    "overlap_lanes": ("JAX_GIN_OVERLAP_LANES", f"an integer from 1 to {MAX_LANES}"),
    "overlap_copy_engine_bytes": ("JAX_GIN_OVERLAP_COPY_ENGINE_BYTES",
                                  "an integer number of bytes from 0 (never) to below 2**63"),
    # GPU launch settings (gpu_launch_settings); None: the kernels' default (cuda/kernels.h).
    "max_lanes": ("JAX_GIN_MAX_LANES", f"an integer from 1 to {MAX_LANES}"),
    "lane_grain_bytes": ("JAX_GIN_LANE_GRAIN_BYTES", _BYTES),
    "chunk_bytes": ("JAX_GIN_CHUNK_BYTES",
                    "an integer number of bytes from 0 (no chunks) to below 2**63"),
    "one_shot_chunk_bytes": ("JAX_GIN_ONE_SHOT_CHUNK_BYTES",
                             "an integer number of bytes from 0 (no chunks) to below 2**63"),
    "ll_max_bytes": ("JAX_GIN_LL_MAX_BYTES",
                     "an integer number of bytes from 0 (no LL) to below 2**63"),
    "experimental_gin": ("JAX_GIN_EXPERIMENTAL_GIN", _BOOL),
    "record": ("JAX_GIN_RECORD", _BOOL),
    "record_entries": ("JAX_GIN_RECORD_ENTRIES", f"a power of two from 1 to {REC_MAX_ENTRIES}"),
    "tuning_dir": ("JAX_GIN_TUNING_DIR", "a directory path, or None"),
    "single_process": ("JAX_GIN_SINGLE_PROCESS", _BOOL),
}
# Fields that may be None: the kernels' default (GPU launch settings); tuning_dir: no
# directory of tables but the ones jax_gin ships.
_OPTIONAL = ("max_lanes", "lane_grain_bytes", "chunk_bytes", "one_shot_chunk_bytes", "ll_max_bytes",
             "tuning_dir")
# Fields that may be 0.
_ZERO_OK = ("chunk_bytes", "one_shot_chunk_bytes", "ll_max_bytes", "overlap_copy_engine_bytes")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _valid(field: str, value):
    """`value` as the type `field` holds, or None when it breaks the field's rule (None itself,
    the default of the _OPTIONAL fields, is let through by Settings.__setattr__)."""
    if field == "timeout_s":
        if not (_is_int(value) or isinstance(value, (float, np.floating))):
            return None
        value = float(value)
        return value if math.isfinite(value) and 0 < value <= _MAX_TIMEOUT_S else None
    if field in ("experimental_gin", "record", "single_process"):
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        return bool(value) if _is_int(value) and value in (0, 1) else None
    if field == "tuning_dir":
        return value if isinstance(value, (str, os.PathLike)) else None
    if not _is_int(value) or not value < _MAX_INT:
        return None
    value = int(value)
    if field in ("overlap_lanes", "max_lanes"):
        return value if 1 <= value <= MAX_LANES else None
    if field == "record_entries":  # the backends' own rule (recorder.h rec_entries_ok)
        return value if abs(value) < 1 << 63 and _native.cpu.rec_entries_ok(value) else None
    return value if value >= (0 if field in _ZERO_OK else 1) else None


def _bad(field: str, shown: str) -> ValueError:
    return ValueError(f"jax_gin: {shown}: must be {_RULES[field][1]}")


def _parse(field: str, text: str):
    """The value `text` stands for (numbers: integers may be written as 64e6), or None."""
    if field == "tuning_dir":
        return text
    if field in ("single_process", "experimental_gin", "record"):
        word = text.strip().lower()
        return True if word in _TRUE_WORDS else False if word in _FALSE_WORDS else None
    try:
        return float(text) if field == "timeout_s" else int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if field != "timeout_s" and value.is_integer() else None


def _env_text(field: str) -> str | None:
    """The text of `field`'s environment variable, or None where it is unset or empty. The only
    reader of JAX_GIN_* variables."""
    return os.environ.get(_RULES[field][0]) or None


def in_environment(field: str) -> bool:
    """Is `field`'s environment variable set (not empty)?"""
    return _env_text(field) is not None


def _from_env(field: str, default):
    """The value of `field` from its environment variable (unset or empty: `default`)."""
    env = _RULES[field][0]
    text = _env_text(field)
    if text is None:
        return default
    checked = _valid(field, _parse(field, text))
    if checked is None:
        raise _bad(field, f"{env}={text!r}")
    return checked


@dataclasses.dataclass
class Settings:
    """Runtime settings, read from the environment when jax_gin is imported. Native code reads
    no environment variable of its own: it gets these values from here.

    A program takes the values in force when it is lowered (a jitted function: at its first
    call), and keeps them; only `record` also switches programs already compiled. To give new
    values to a function compiled before, call jax_gin.runtime.reset(): its next call lowers
    it again.

    cpu_workspace_bytes, gpu_workspace_bytes: symmetric workspace per rank on CPU devices
        (default 1 MiB) and on GPUs (default 64 MiB), both set by JAX_GIN_WORKSPACE_BYTES (a
        positive integer); messages larger than one round's capacity are pipelined through it in
        chunks. `auto` runs an algorithm one round of which fits the workspace; a named
        algorithm whose round does not fit raises a ValueError when the program is lowered,
        naming the bytes it needs.
    timeout_s: how long any wait may spin before the call fails (JAX_GIN_TIMEOUT_S, seconds,
        positive and finite).
    bucket_bytes: a pytree's leaves of one dtype are reduced (scattered, gathered) together,
        in one call per bucket of at most this many bytes (JAX_GIN_BUCKET_BYTES, a positive
        integer; psum_scatter and all_gather count the larger side; a leaf larger than that
        is a bucket of its own), as XLA's collective combiners and PyTorch DDP's buckets do.
    overlap_lanes: the most lanes (CTAs) an asynchronous call (overlap=True) uses on a GPU
        (JAX_GIN_OVERLAP_LANES, 1 to 128), so that the compute it overlaps keeps the other SMs.
    overlap_copy_engine_bytes: an asynchronous call of one buffer of at least this many bytes,
        in a GPU group within one node, moves its data with the copy engines, and its SMs only
        reduce and synchronize (JAX_GIN_OVERLAP_COPY_ENGINE_BYTES, 0: never; default 32 MiB;
        cuda/copy_engine.cu). Same results, bit for bit.
    fault_rank: testing only -- this rank drops all its signals, so its peers time out.
    fault_mode: testing only -- "drop" (fault_rank's signals are lost) or "absent" (on CPU,
        fault_rank returns from every call at once, as if it never reached it).
    record: the flight recorder keeps each rank's last calls with per-phase timestamps
        (JAX_GIN_RECORD=1; jax_gin.trace turns it on for its block; on GPUs, lane 0's phases).
        Off by default; on CPU the state block that hang reports read (which call, which
        wait) is kept either way.
    record_entries: calls the recorder keeps per rank, a power of two (JAX_GIN_RECORD_ENTRIES,
        default 64), fixed when a communicator is created; the processes of a group must agree.

    GPU launch settings, fixed when a communicator is created; None is the kernels' default
    (cuda/kernels.h). The processes of a group must agree on them (gpu_launch_settings).
    max_lanes: the most lanes (CTAs) one all-reduce uses (JAX_GIN_MAX_LANES, 1 to 128;
        default: the GPU's SM count, at most 128).
    lane_grain_bytes: one lane per this many bytes of message (JAX_GIN_LANE_GRAIN_BYTES;
        default 16 KiB).
    chunk_bytes: ring, tree and two_shot signal each step in chunks of this size
        (JAX_GIN_CHUNK_BYTES, 0: whole steps; default 512 KiB).
    one_shot_chunk_bytes: one_shot stores chunk c+1 to its peers before it reduces chunk c
        (JAX_GIN_ONE_SHOT_CHUNK_BYTES, 0: one chunk; default 32 KiB).
    ll_max_bytes: one_shot uses the LL protocol up to this size (JAX_GIN_LL_MAX_BYTES, 0: never;
        default 256 KiB; a larger value acts as 256 KiB, the LL area's size).
    experimental_gin: groups that span nodes may run over NCCL's GIN (JAX_GIN_EXPERIMENTAL_GIN=1;
        built, never run on two nodes: docs/multi-node.md).

    tuning_dir: a directory searched for `auto`'s tuning tables before the ones jax_gin ships
        (JAX_GIN_TUNING_DIR; None: only those).
    single_process: this process is on its own even where a launcher's variables say it is one
        of several (JAX_GIN_SINGLE_PROCESS=1; see _distributed.check_initialized).

    Values are checked when read from the environment and when assigned: a bad one raises a
    ValueError that names the variable and the value, and a name that is not a setting an
    AttributeError.
    """

    cpu_workspace_bytes: int = dataclasses.field(
        default_factory=lambda: _from_env("cpu_workspace_bytes", _DEFAULT_CPU_WORKSPACE))
    gpu_workspace_bytes: int = dataclasses.field(
        default_factory=lambda: _from_env("gpu_workspace_bytes", _DEFAULT_GPU_WORKSPACE))
    timeout_s: float = dataclasses.field(
        default_factory=lambda: _from_env("timeout_s", _DEFAULT_TIMEOUT_S))
    bucket_bytes: int = dataclasses.field(
        default_factory=lambda: _from_env("bucket_bytes", _DEFAULT_BUCKET_BYTES))
    overlap_lanes: int = dataclasses.field(
        default_factory=lambda: _from_env("overlap_lanes", _DEFAULT_OVERLAP_LANES))
    overlap_copy_engine_bytes: int = dataclasses.field(
        default_factory=lambda: _from_env("overlap_copy_engine_bytes",
                                          _DEFAULT_OVERLAP_COPY_ENGINE_BYTES))
    fault_rank: int = -1
    fault_mode: str = "drop"
    record: bool = dataclasses.field(default_factory=lambda: _from_env("record", False))
    record_entries: int = dataclasses.field(
        default_factory=lambda: _from_env("record_entries", _DEFAULT_RECORD_ENTRIES))
    max_lanes: int | None = dataclasses.field(default_factory=lambda: _from_env("max_lanes", None))
    lane_grain_bytes: int | None = dataclasses.field(
        default_factory=lambda: _from_env("lane_grain_bytes", None))
    chunk_bytes: int | None = dataclasses.field(default_factory=lambda: _from_env("chunk_bytes", None))
    one_shot_chunk_bytes: int | None = dataclasses.field(
        default_factory=lambda: _from_env("one_shot_chunk_bytes", None))
    ll_max_bytes: int | None = dataclasses.field(
        default_factory=lambda: _from_env("ll_max_bytes", None))
    experimental_gin: bool = dataclasses.field(
        default_factory=lambda: _from_env("experimental_gin", False))
    tuning_dir: str | None = dataclasses.field(
        default_factory=lambda: _from_env("tuning_dir", None))
    single_process: bool = dataclasses.field(
        default_factory=lambda: _from_env("single_process", False))

    def __setattr__(self, name: str, value) -> None:
        fields = [f.name for f in dataclasses.fields(self)]
        if name not in fields:
            hint = (" (JAX_GIN_WORKSPACE_BYTES sets cpu_workspace_bytes and gpu_workspace_bytes)"
                    if name == "workspace_bytes" else "")
            raise AttributeError(f"jax_gin.runtime.settings has no setting {name!r}{hint}; the "
                                 f"settings are {', '.join(fields)}")
        if name == "fault_rank" and not (_is_int(value) and value >= -1):
            raise ValueError(f"jax_gin.runtime.settings.fault_rank = {value!r}: must be a rank, "
                             "or -1 for none (testing only)")
        if name in _RULES and not (value is None and name in _OPTIONAL):
            checked = _valid(name, value)
            if checked is None:
                raise _bad(name, f"jax_gin.runtime.settings.{name} = {value!r} ({_RULES[name][0]})")
            value = checked
        if name == "fault_mode" and value not in _FAULT_MODES:
            raise ValueError(f"jax_gin.runtime.settings.fault_mode = {value!r}: must be one of "
                             f"{tuple(_FAULT_MODES)}")
        super().__setattr__(name, value)
        if globals().get("settings") is not self:
            return  # another Settings (read from the environment again) drives nothing
        if name == "record":
            _set_native_record(bool(value))


def _set_native_record(on: bool) -> None:
    """The backends' process-wide recorder switch (settings.record)."""
    _native.cpu.set_record(on)
    if hasattr(_native.cuda, "set_record"):
        _native.cuda.set_record(on)


# The command-line tools that name an invalid JAX_GIN_* variable themselves, so that
# `import jax_gin` under them does not fail on one: the doctor in its verdict, the others in
# a usage error (refuse_invalid_variables).
COMMANDS = ("jax_gin.doctor", "jax_gin.bench", "jax_gin.tune", "jax_gin.workloads",
            "jax_gin.trace")
BENCH_SCRIPT = "jax-gin-bench"  # jax_gin.bench's console script (pyproject.toml)


def _running_command() -> str | None:
    """The module of COMMANDS that this process runs (`python -m jax_gin.bench`, as Python got
    the command line, or the jax-gin-bench script), or None."""
    argv = getattr(sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1:argv.index("-m") + 2] if "-m" in argv else []
    if module and module[0] in COMMANDS:
        return module[0]
    if sys.argv and os.path.basename(sys.argv[0]) == BENCH_SCRIPT:
        return "jax_gin.bench"
    return None


def invalid_variables() -> dict:
    """Each JAX_GIN_* variable of the environment whose value breaks its rule (_RULES): its
    message ("JAX_GIN_TIMEOUT_S='abc': must be ...")."""
    messages = {}
    for field, (env, _) in _RULES.items():
        try:
            _from_env(field, None)
        except ValueError as e:
            messages[env] = str(e).removeprefix("jax_gin: ")
    return messages


def refuse_invalid_variables(prog: str) -> None:
    """Exit with status 2 and one line, a usage error of `prog`, naming every invalid
    JAX_GIN_* variable (the tools of COMMANDS but the doctor: under them `import jax_gin` gave
    those settings their defaults, which they do not run with)."""
    invalid = invalid_variables()
    if invalid:
        print(f"{prog}: error: {'; '.join(invalid.values())}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def _settings_at_import() -> Settings:
    """The settings of the environment: an invalid JAX_GIN_* variable raises, so that
    `import jax_gin` fails naming it. Under the tools of COMMANDS the fields of invalid
    variables take their defaults instead, so that the doctor runs and names every invalid
    variable in its verdict, and the others refuse to run, naming them
    (refuse_invalid_variables reads them again)."""
    try:
        return Settings()
    except ValueError:
        if _running_command() is None:
            raise
    invalid = {env: os.environ.pop(env) for env in invalid_variables()}
    try:
        return Settings()
    finally:
        os.environ.update(invalid)


_FAULT_MODES = {"drop": 0, "absent": 1}  # CommConfig::fault_mode (csrc/cpu_backend.h)
settings = _settings_at_import()
_set_native_record(settings.record)  # as read from the environment


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """How one reduction splits a mesh into groups: group and rank of each logical device id."""

    nranks: int
    ngroups: int
    group_of: tuple
    rank_of: tuple


def group_layout(axis_names: tuple, axis_sizes: tuple, axes: tuple) -> GroupLayout:
    """Groups of a reduction over `axes` of a mesh, in XLA's logical-id numbering.

    Logical (partition) ids are np.arange(size).reshape(mesh shape). The rank within a group
    is the row-major index over the reduced axes in the order given (as lax.axis_index of the
    tuple); the group is the row-major index over the other axes.
    """
    ids = np.arange(math.prod(axis_sizes)).reshape(axis_sizes)
    red = [axis_names.index(a) for a in axes]
    other = [i for i in range(len(axis_names)) if i not in red]
    nranks = math.prod(axis_sizes[i] for i in red)
    table = ids.transpose(other + red).reshape(-1, nranks)
    group_of = np.empty(ids.size, np.int32)
    rank_of = np.empty(ids.size, np.int32)
    for g, row in enumerate(table):
        group_of[row] = g
        rank_of[row] = np.arange(nranks)
    return GroupLayout(nranks, table.shape[0], tuple(group_of.tolist()), tuple(rank_of.tolist()))


_lock = threading.Lock()
_cache: dict = {}
# CPU communicator id -> (device id by logical id, GroupLayout): who runs each rank (trace).
comm_devices: dict = {}
gpu_comm_devices: dict = {}  # the same for GPU communicators (their ids are kept apart)
# (is_cpu, communicator id) -> its fingerprint (comm_attribute)
_fingerprints: dict = {}


def workspace_bytes(platform: str) -> int:
    return settings.cpu_workspace_bytes if platform == "cpu" else settings.gpu_workspace_bytes


def _lane_bytes(platform: str) -> int:
    lane = workspace_bytes(platform)
    if platform != "cpu" and _native.cuda is not None:
        lane = _native.cuda.lane_bytes(lane)
    return lane


def workspace_fits(platform: str, algorithm: str, nranks: int, itemsize: int,
                   collective: bool = False) -> bool:
    """Whether one round of `algorithm` fits in the workspace: a round of the all-reduce
    (schedule.h), or with `collective` one of psum_scatter or all_gather (collectives.h)."""
    if nranks <= 1:
        return True
    schedule = _native.cpu.schedule
    slot_elems = schedule.coll_slot_elems if collective else schedule.slot_elems
    return slot_elems(ALGORITHM_CODES[algorithm], nranks, _lane_bytes(platform), itemsize) != 0


def check_workspace(platform: str, algorithm: str, nranks: int, itemsize: int, api: str,
                    collective: bool = False, auto_from: tuple = ()) -> None:
    """Raise (at lowering) if one round of `algorithm` cannot fit in the workspace
    (workspace_fits). auto_from: the algorithms `auto` chose among, where it chose (none of
    which fits when this raises: _select.fit_workspace), named by the smallest round's."""
    if not workspace_fits(platform, algorithm, nranks, itemsize, collective):
        lane = _lane_bytes(platform)
        schedule = _native.cpu.schedule
        slots = schedule.coll_slots if collective else schedule.num_slots
        need, smallest = min((slots(ALGORITHM_CODES[a], nranks) * ALIGN_BYTES, a)
                             for a in (auto_from or (algorithm,)))
        what = (f"of any algorithm auto chooses among over {nranks} ranks (the smallest round, "
                f"{smallest}'s, needs at least {need} bytes)" if auto_from else
                f"of {algorithm} over {nranks} ranks (needs at least {need} bytes)")
        raise ValueError(
            f"jax_gin.{api}: workspace too small: {lane} bytes per rank cannot hold one round "
            f"{what}; raise JAX_GIN_WORKSPACE_BYTES or jax_gin.runtime.settings")


# The id of Algorithm::kHierarchical (common.h): internal, not in ALGORITHMS.
HIERARCHICAL_CODE = int(_native.cpu.ALGORITHM_HIERARCHICAL)


def ranks_per_node(platform: str, comm: int) -> int:
    """The ranks per node of communicator `comm`'s groups where they span nodes (GPU groups set
    up with JAX_GIN_EXPERIMENTAL_GIN=1), else 0."""
    native = getattr(_native.cuda, "comm_ranks_per_node", None) if platform != "cpu" else None
    return 0 if native is None else max(int(native(comm)), 0)


def algorithm_code(platform: str, comm: int, requested: str, chosen: str, api: str) -> int:
    """The algorithm id the FFI handler gets. GPU groups that span nodes (NCCL's LSA team is
    smaller than the group; set up only with JAX_GIN_EXPERIMENTAL_GIN=1, docs/multi-node.md)
    run only the internal hierarchical algorithm (LSA within a node, GIN between nodes):
    "auto" picks it there, and an explicit algorithm, which needs load/store access to every
    peer, is refused."""
    per_node = ranks_per_node(platform, comm)
    if per_node == 0:
        return ALGORITHM_CODES[chosen]
    if requested != "auto":
        raise ValueError(
            f"jax_gin.{api}: algorithm={requested!r} needs load/store access to every peer, but "
            f"this reduction's groups span nodes ({per_node} ranks per node); use "
            "algorithm='auto', which runs the hierarchical all-reduce there (LSA within a node, "
            "GIN between nodes)")
    return HIERARCHICAL_CODE


def communicator(platform: str, mesh, axes: tuple) -> int:
    """The id of the communicator for reducing `mesh` over `axes`, created on first use."""
    names = tuple(mesh.axis_names)
    sizes = tuple(int(mesh.shape[n]) for n in names)
    devices = list(np.asarray(mesh.devices).flat)
    device_ids = tuple(int(d.id) for d in devices)
    ws = workspace_bytes(platform)
    key = (platform, device_ids, names, sizes, tuple(axes), ws, settings.timeout_s,
           settings.fault_rank)  # (tests/conftest.py reads fault_rank at index 7)
    if platform == "cpu":
        key += (settings.fault_mode, settings.record_entries)
    # The settings select the cached communicator, but stay out of `meet`, which names the
    # communicator's set-up across processes (_distributed.communicator_tag): the processes of
    # a group meet there and then compare the settings that must agree, naming any difference.
    meet = (platform, device_ids, names, sizes, tuple(axes))
    launch = () if platform == "cpu" else tuple(gpu_launch_kwargs().items())
    cache_key = key if platform == "cpu" else key + (launch,)
    _distributed.check_initialized(len({d.process_index for d in devices}))
    with _lock:
        comm = _cache.get(cache_key)
        if comm is not None:
            return comm
        layout = group_layout(names, sizes, tuple(axes))
        # what a program's text names of it (_free_id)
        fingerprint = _fingerprint((meet, ws, settings.record_entries, launch, resets))
        comm_id = _free_id(fingerprint, platform == "cpu")
        comm = None
        try:
            if platform == "cpu":
                comm = _create_cpu_comm(mesh, devices, layout, ws, meet, comm_id)
                _native.cpu.cpu_comm_set_fingerprint(comm, fingerprint)
            else:
                comm = _create_cuda_comm(mesh, layout, ws, meet, comm_id)
                _native.cuda.comm_set_fingerprint(comm, fingerprint)
                _native.cuda.comm_set_group_text(comm, group_texts(mesh, tuple(axes), devices,
                                                                   layout))
                gpu_comm_devices[comm] = (tuple(int(d.id) for d in devices), layout)
        except BaseException:
            # A communicator not in the cache would hold its memory and its id, which the next
            # lowering takes again, until the process ends. An interrupt (Ctrl-C) during the
            # native set-up is raised as it returns, before `comm` is assigned: the id, fixed
            # before, names it (destroying an id that names none does nothing).
            _destroy(platform, comm if comm is not None else comm_id)
            raise
        _fingerprints[(platform == "cpu", comm)] = fingerprint
        _cache[cache_key] = comm
        return comm


def _fingerprint(named) -> int:
    """31 bits of a digest of what a program's text names of its communicator (communicator()):
    the same in every process that sets it up alike."""
    digest = hashlib.sha256(repr(named).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _free_id(fingerprint: int, is_cpu: bool) -> int:
    """The id of a new communicator, given its fingerprint: the fingerprint itself, or, where
    another communicator of this process has that id, the next free one. Called under _lock.

    The one statement of the scheme. A custom call names its communicator by id and
    fingerprint (comm_attribute; the handlers check both, csrc/ffi_common.h). The fingerprint
    (communicator()) digests where the communicator meets, the settings its processes share
    (checked at set-up: the workspace, the recorder's ring, on GPUs the launch settings), and
    this process's count of reset() calls; not this process's own timeout or fault injection.
    So a program's text is the same in every process that set up alike and reset as often,
    whatever order its communicators were set up in, and JAX's persistent compilation cache
    finds it; a program dropped before a reset never finds the new communicators. Ids depend
    on the order of set-up only among communicators whose fingerprints are alike (they differ
    only in the timeout or fault injection, or a digest collision)."""
    taken = {c for cpu, c in _fingerprints if cpu == is_cpu}
    comm = fingerprint or 1
    while comm in taken:
        comm = comm % 0x7FFFFFFF + 1
    return comm


def comm_attribute(platform: str, comm: int) -> np.int64:
    """The "comm" attribute of a custom call on communicator `comm`: its id (_free_id) and, in
    the high 32 bits, its fingerprint. The handlers check both (csrc/ffi_common.h), so a
    program run in a process that did not lower it (a serialized executable, an exported
    module) runs where that process has set up the same communicator, and elsewhere fails
    with an error instead of reducing over whatever communicator has that id there."""
    with _lock:
        fingerprint = _fingerprints.get((platform == "cpu", comm))
    if fingerprint is None:  # reset() ran on another thread since communicator() gave `comm`
        raise RuntimeError(f"jax_gin: communicator {comm} was destroyed by "
                           "jax_gin.runtime.reset() while a program that uses it was lowering; "
                           "call the function again to lower it with new communicators")
    return np.int64((fingerprint << 32) | comm)


def _tables_digest() -> str | None:
    """A digest of the tuning tables in settings.tuning_dir (None where it is unset): equal
    in processes whose directories hold the same tables, wherever they are."""
    if settings.tuning_dir is None:
        return None
    h = hashlib.sha256()
    try:
        names = sorted(n for n in os.listdir(settings.tuning_dir) if n.endswith(".json"))
    except OSError:
        return "no such directory"
    for name in names:
        with open(os.path.join(settings.tuning_dir, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def trace_settings(tables: bool) -> dict:
    """What decides each process's calls at trace time, so it must be equal in every process
    of a group too (checked at bootstrap with the backend's own): the bucket size cuts a
    pytree into calls, and one that differs gives calls of different sizes on the ranks of one
    call (on GPUs wrong sums, with no error; on CPU a call that fails where the sizes met
    differ); `tables`: the tuning tables, where they decide `auto`'s
    algorithm (not for CPU groups that span processes: _select.table_kind)."""
    out = {_RULES["bucket_bytes"][0]: int(settings.bucket_bytes)}
    if tables:
        out[f"{_RULES['tuning_dir'][0]} (a digest of its tables)"] = _tables_digest()
    return out


def cpu_group_settings(workspace_bytes: int) -> dict:
    """What must be equal in every process of a CPU group (checked at bootstrap): the shared
    workspace's layout, and trace_settings()."""
    return {_RULES["cpu_workspace_bytes"][0]: int(workspace_bytes),
            _RULES["record_entries"][0]: int(settings.record_entries),
            **trace_settings(tables=False)}


# XLA's CPU client runs the launch of each device's part of a program, and then the part
# itself, on one pool of threads: PJRT_NPROC of them, else NPROC, else as many as the CPUs the
# process may run on. A launch waits there for its device's in-flight programs to drop below a
# limit while the peers' parts, already running, hold the other threads waiting in their
# collective for it; with fewer than 2 threads a device, a loop that dispatches collective
# programs ahead stopped so, lax's and jax_gin's alike (docs/debugging.md).
XLA_CPU_THREADS_PER_DEVICE = 2
_XLA_CPU_THREAD_VARIABLES = ("PJRT_NPROC", "NPROC")  # in the order XLA reads them


def xla_cpu_threads() -> tuple[int, str]:
    """The threads of XLA's CPU client pool in this process, and what sets the number."""
    for name in _XLA_CPU_THREAD_VARIABLES:
        try:
            return max(0, int(os.environ[name])), f"{name}={os.environ[name]}"
        except (KeyError, ValueError):
            continue
    return len(os.sched_getaffinity(0)), "the CPUs this process may run on"


def provide_xla_cpu_threads(devices: int) -> None:
    """For a program that forces `devices` CPU devices (the tests and the examples): sets
    PJRT_NPROC to enough threads for them, where no variable sets the number and the CPUs are
    fewer. Must run before JAX creates its CPU client."""
    threads, _ = xla_cpu_threads()
    if not any(n in os.environ for n in _XLA_CPU_THREAD_VARIABLES) and \
            threads < XLA_CPU_THREADS_PER_DEVICE * devices:
        os.environ["PJRT_NPROC"] = str(XLA_CPU_THREADS_PER_DEVICE * devices)


# xla_cpu_threads() as the first CPU communicator found it: XLA read the variables once, when
# it created its CPU client, before any communicator (a later change does not resize its pool).
_pool_threads: tuple[int, str] | None = None


def _xla_cpu_threads_note() -> str:
    """A hang report's note where XLA's CPU threads are too few for this process's CPU
    devices, or empty."""
    global _pool_threads
    if _pool_threads is None:
        _pool_threads = xla_cpu_threads()
    devices = len(jax.local_devices(backend="cpu"))
    threads, source = _pool_threads
    need = XLA_CPU_THREADS_PER_DEVICE * devices
    if threads >= need:
        return ""
    return (f"note: XLA's CPU client runs the programs of this process's {devices} CPU devices "
            f"on {threads} threads ({source}); with fewer than {XLA_CPU_THREADS_PER_DEVICE} a "
            f"device it can hold one device's program back while its peers' programs wait for it "
            f"in their collectives. Set PJRT_NPROC={need} (or more) before JAX starts "
            f"(docs/debugging.md)")


def group_texts(mesh, axes: tuple, devices: list, layout: GroupLayout) -> list:
    """Per group, the last line of a hang report from its ranks (CPU and GPU), whose ranks and
    call numbers are the group's own: "group 1 of the communicator over mesh axes ('b',),
    where a = 1: its ranks 0-3 are devices 4, 5, 6, 7 (JAX device ids)"."""
    names = tuple(mesh.axis_names)
    shape = tuple(int(mesh.shape[n]) for n in names)
    others = [n for n in names if n not in axes]
    members: list = [[None] * layout.nranks for _ in range(layout.ngroups)]
    coords: list = [None] * layout.ngroups
    for logical, d in enumerate(devices):  # logical ids: the mesh's devices in row-major order
        g = layout.group_of[logical]
        members[g][layout.rank_of[logical]] = int(d.id)
        at = np.unravel_index(logical, shape)
        coords[g] = ", ".join(f"{n} = {int(at[names.index(n)])}" for n in others)
    return [f"group {g} of the communicator over mesh axes {tuple(axes)!r}"
            + (f", where {coords[g]}" if coords[g] else "")
            + f": its ranks 0-{layout.nranks - 1} are devices "
            + ", ".join(map(str, members[g])) + " (JAX device ids)"
            for g in range(layout.ngroups)]


def _create_cpu_comm(mesh, devices, layout: GroupLayout, ws: int, key, comm_id: int = 0) -> int:
    procs = [int(d.process_index) for d in devices]
    workspaces = None  # every group in private memory: all devices run in this process
    if any(p != procs[0] for p in procs):
        shape = ", ".join(f"{n!r}: {mesh.shape[n]}" for n in mesh.axis_names)
        what = (f"the CPU communicator for axes {key[4]} of the mesh {{{shape}}} "
                f"({len(set(procs))} processes)")
        with _distributed.SetUp(key) as setup:
            workspaces = _distributed.group_workspaces(
                layout, procs, jax.process_index(), ws, setup, settings.timeout_s, what,
                settings.record_entries, cpu_group_settings(ws))
    ids = [int(d.id) for d in devices]
    comm = _native.cpu.cpu_comm_create(
        layout.nranks, list(layout.group_of), list(layout.rank_of), ws, settings.timeout_s,
        settings.fault_rank, workspaces, _FAULT_MODES[settings.fault_mode], settings.record_entries,
        _xla_cpu_threads_note(), comm_id, group_texts(mesh, key[4], devices, layout), ids)
    comm_devices[comm] = (tuple(ids), layout)
    return comm


def _create_cuda_comm(mesh, layout: GroupLayout, ws: int, key=None, comm_id: int = 0) -> int:
    if _native.cuda is None:
        raise _native.no_cuda_error("jax_gin: a communicator of GPUs was requested")
    devices = list(np.asarray(mesh.devices).flat)
    if any(d.process_index != devices[0].process_index for d in devices):
        return _create_cuda_comm_processes(mesh, devices, layout, ws, key, comm_id)
    groups = [[None] * layout.nranks for _ in range(layout.ngroups)]
    for logical, d in enumerate(devices):
        groups[layout.group_of[logical]][layout.rank_of[logical]] = int(d.local_hardware_id)
    return _native.cuda.comm_create(groups, ws, settings.timeout_s, settings.fault_rank,
                                    **gpu_launch_kwargs(), id=comm_id)


# The settings that shape every kernel launch of a GPU group, passed to the native
# communicator creation (cuda/nccl_runtime.h, LaunchSettings): they must agree over the
# processes of a group.
_GPU_LAUNCH_FIELDS = ("max_lanes", "lane_grain_bytes", "chunk_bytes", "one_shot_chunk_bytes",
                      "ll_max_bytes", "experimental_gin", "record_entries")


# The settings of asynchronous calls on GPUs (overlap=True, psum_overlapping), read at lowering:
# they must agree over the processes of a group too.
_GPU_ASYNC_FIELDS = ("overlap_lanes", "overlap_copy_engine_bytes")


def gpu_launch_kwargs() -> dict:
    """The GPU launch settings, as the native comm_create and comm_create_ranks take them."""
    return {f: getattr(settings, f) for f in _GPU_LAUNCH_FIELDS}


def gpu_launch_settings(workspace_bytes: int, default_max_lanes: int | None = None) -> dict:
    """What must be equal in every process of a GPU group (checked at bootstrap), by the
    environment variable that sets it: the launch settings and trace_settings().

    default_max_lanes: the smallest default lane cap (SM count, at most 128) of this process's
    devices in the group; it decides the lanes unless max_lanes (JAX_GIN_MAX_LANES) is set."""
    out = {"workspace_bytes": int(workspace_bytes), **trace_settings(tables=True)}
    out.update({_RULES[f][0]: v for f, v in gpu_launch_kwargs().items()})
    # An asynchronous call's lanes and its copy-engine choice are fixed at lowering
    # (lower_start's attributes); ranks that split a message otherwise wait for data that
    # never comes, or sum the wrong pieces.
    out.update({_RULES[f][0]: int(getattr(settings, f)) for f in _GPU_ASYNC_FIELDS})
    if default_max_lanes is not None and settings.max_lanes is None:
        out["default max lanes (SM count; set JAX_GIN_MAX_LANES alike to override)"] = \
            int(default_max_lanes)
    return out


def _create_cuda_comm_processes(mesh, devices, layout: GroupLayout, ws: int, key,
                                comm_id: int = 0) -> int:
    """A GPU communicator whose groups span processes (jax.distributed): one NCCL unique id
    per group, shared through the key-value store, then ncclCommInitRank in every process for
    its own devices (_distributed.gpu_unique_ids, comm_create_ranks). Run on 2 x H200 as 2
    processes x 1 GPU: see docs/multi-node.md."""
    procs = [int(d.process_index) for d in devices]
    me = jax.process_index()
    shape = ", ".join(f"{n!r}: {mesh.shape[n]}" for n in mesh.axis_names)
    what = (f"the GPU communicator for axes {key[4]} of the mesh {{{shape}}} "
            f"({len(set(procs))} processes)")
    mine = [int(d.local_hardware_id) for d, p in zip(devices, procs) if p == me]
    # (the CPU bootstrap tests stand a fake CUDA module in, without default_max_lanes)
    lanes = min((_native.cuda.default_max_lanes(o) for o in mine), default=None) \
        if hasattr(_native.cuda, "default_max_lanes") else None
    local: dict = {}  # group -> [(rank, local CUDA ordinal)]
    for logical, d in enumerate(devices):
        if procs[logical] == me:
            local.setdefault(layout.group_of[logical], []).append(
                (layout.rank_of[logical], int(d.local_hardware_id)))
    # NCCL's initialization is the set-up's last step: a failure there abandons the generation too
    with _distributed.SetUp(key) as setup:
        ids = _distributed.gpu_unique_ids(layout, procs, me, setup, settings.timeout_s, what,
                                          _native.cuda.unique_id, gpu_launch_settings(ws, lanes))
        specs = []
        for g in sorted(local):
            pairs = sorted(local[g])
            specs.append((g, layout.nranks, ids[g], [r for r, _ in pairs],
                          [d for _, d in pairs]))
        return _comm_create_ranks(specs, ws, what, comm_id)


def _comm_create_ranks(specs: list, ws: int, what: str, comm_id: int = 0) -> int:
    """The native comm_create_ranks. Its TimeoutError (the group's other processes did not
    join NCCL's communicator, or stopped taking part in its set-up, within JAX_GIN_TIMEOUT_S;
    the communicators are aborted) becomes BootstrapTimeoutError, like a missing peer in the
    key-value bootstrap before it."""
    try:
        return _native.cuda.comm_create_ranks(specs, ws, settings.timeout_s, settings.fault_rank,
                                              **gpu_launch_kwargs(), id=comm_id)
    except _distributed.BootstrapTimeoutError:
        raise
    except TimeoutError as e:
        raise _distributed.BootstrapTimeoutError(f"{e} (setting up {what})") from None


def num_communicators() -> int:
    return len(_cache)


# How many times reset() ran (jax_gin.trace tells a block that reset from one that did not).
resets = 0


def wait_for_live_arrays() -> None:
    """Wait until the programs that made this process's live arrays have run (JAX dispatches
    them asynchronously); those whose results were dropped are not waited for. A failed
    program's error belongs to whoever reads its results: here it only means it ended."""
    arrays = jax.live_arrays()
    try:
        jax.block_until_ready(arrays)  # all at once; one failed program stops it
    except Exception:  # noqa: BLE001
        for a in arrays:
            try:
                a.block_until_ready()
            except Exception:  # noqa: BLE001
                pass


def reset() -> None:
    """Forget every cached communicator, and JAX's compiled programs with them
    (jax.clear_caches()): a jitted function is lowered again at its next call, with new
    communicators. It first waits for the programs still running whose results are alive;
    on CPU devices the calls of one whose results were dropped give up at once. Programs
    compiled ahead of time (`.lower(...).compile()`) before the reset can no longer run: the
    new communicators have other ids (communicator() counts the resets into them), and on
    CPU devices they fail saying so; on GPUs, where XLA's command buffers may replay their
    kernels without the check, they must not be run again.

    A call stuck on a peer whose results are still referenced (by a variable, or by the
    traceback of a KeyboardInterrupt) is waited for until its timeout fails it. Interrupted
    in that wait, reset() has changed nothing, and may be called again. Call it between calls,
    not while other threads dispatch programs: on CPU devices theirs may then fail with the
    "does not exist in this process" or "reset() destroyed this communicator" error; on GPUs
    a call launched beside it may use a communicator it frees."""
    global resets
    # so that no communicator is destroyed under a call that is running or about to start;
    # first, so that an interrupt here leaves the count (in every program's fingerprint), the
    # communicators and JAX's caches as they were
    wait_for_live_arrays()
    resets += 1
    # Without clear_caches, a function jitted again (jax.jit(f) of the same f) would get its
    # old executable back from JAX's caches, which names a destroyed communicator.
    jax.clear_caches()
    with _lock:
        for key, comm in list(_cache.items()):
            _destroy(key[0], comm)
        _cache.clear()
        _fingerprints.clear()


def _destroy(platform: str, comm: int) -> None:
    """Destroy communicator `comm` of `platform`, and forget its devices."""
    if platform == "cpu":
        _native.cpu.cpu_comm_destroy(comm)
        comm_devices.pop(comm, None)
    elif _native.cuda is not None:
        _native.cuda.comm_destroy(comm)
        gpu_comm_devices.pop(comm, None)


def _shutdown() -> None:  # pragma: no cover - interpreter exit
    try:
        # Calls still running (a program dispatched and never waited for) give up at once:
        # JAX's shutdown waits for the programs in flight, and one whose call waits for a peer
        # that never comes would hold the exit for the whole timeout.
        _native.cpu.cpu_shutdown()
    except Exception:
        pass
    try:
        # Names of shared-memory segments whose set-up did not finish (normally none).
        _native.cpu.cpu_unlink_all_workspaces()
    except Exception:
        pass
    try:
        if _native.cuda is not None:
            _native.cuda.shutdown()
    except Exception:
        pass


atexit.register(_shutdown)
