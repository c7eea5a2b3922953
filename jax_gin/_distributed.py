"""Several processes on CPU: workspaces in POSIX shared memory, bootstrapped through the
jax.distributed key-value store.

A group whose ranks run in several processes (of one host) keeps its whole state -- every
rank's window, flags and round counter -- in one shared-memory segment. Per communicator that
spans processes, every process involved does this (all of them lower the same programs in
the same order, so they all get here):

1. arrive: at the first generation of the communicator's set-ups that no process gave up
   on (SetUp), a key per process (its host, boot and /dev/shm: _host_identity), then a
   barrier of the processes involved. A process that never comes makes the others fail with
   the group and the ranks that are missing; processes that cannot share memory (other hosts,
   another /dev/shm) fail with a clear error.
   Nothing exists in /dev/shm yet, so a process that dies while the others wait leaves
   nothing behind.
2. create: the process that runs a group's rank 0 creates its segment
   /jax_gin.<job>.<communicator>.d<deadline>.g<group> (O_EXCL) and publishes the name under a
   key. Before that it sweeps /dev/shm (sweep_stale_segments).
3. attach: the other processes read the name (and the creator's settings, which they compare
   with their own) and map the segment.
4. compare: the creator reads the others' settings too, so that both sides name a difference.
5. join: each process marks its ranks in the segment's header and waits until every rank is
   marked, then every process unlinks the name (the first one wins). From then on the memory
   lives only as long as the mappings: a process that dies later leaves nothing in /dev/shm.
   If set-up fails half-way, the names this process knows are unlinked at once, and at exit.
6. settle: the processes agree, under a key of the key-value store that only its first writer
   sets, that every one of them set it up, or that all give it up (_Bootstrap.commit): each
   step waits with its own timeout, so one process could see a step done just as another
   gave up on it, and keep a communicator that the others never come to again.

<job> is a random token that the first process to need it publishes in the key-value store,
so that two jobs on one host never share a name; <communicator> is a hash of where the
communicator meets (platform, mesh devices, mesh axes and sizes, reduced axes: _runtime's
`meet`, without the settings, which the processes compare once they have met) and the
generation of this set-up of it (SetUp), which the processes agree on through the
key-value store; <deadline> is the wall-clock time (unix seconds, rounded up) when the
creator's set-up times out.

A name is needed only until that deadline: by then every process has mapped the segment (and
the name is unlinked) or the creator gives up (and unlinks it). A name still there well after
its deadline was left by a process that was killed (kill -9, or aborted by JAX when a peer
died) before it could unlink it, so the next set-up on the host removes it. Wall-clock time,
unlike process ids or the monotonic clock, means the same in every container that shares a
/dev/shm (one kernel), so a sweep never removes a name that a live set-up needs, whoever runs it.

The only JAX internal used here, the jax.distributed client, is reached through _compat.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import socket
import sys
import time

from . import _compat, _native

KV_PREFIX = "jax_gin"
_JOB_TOKEN_KEY = f"{KV_PREFIX}/job_token"
_job_tokens: dict = {}  # id(client) -> token


class BootstrapTimeoutError(TimeoutError):
    """A peer process did not take part in setting up a communicator in time."""


class KeyValueStoreError(ConnectionError):
    """The jax.distributed key-value store could not be reached (or refused a request)."""


# ---------------------------------------------------------------------------------------
# jax.distributed's client and coordinator (through _compat)


def distributed_client():
    """The jax.distributed client of this process, or None before initialize()."""
    return getattr(_compat.distributed_state(), "client", None)


def coordinator_address() -> str:
    return str(getattr(_compat.distributed_state(), "coordinator_address", None) or "?")


# ---------------------------------------------------------------------------------------
# Is this one process of a multi-process job that forgot jax.distributed.initialize()?

def _launcher_processes() -> tuple:
    """(variable, value) of the first launcher variable that says this process is one of
    several of a job, or None. These are the settings jax.distributed.initialize() reads."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return ("JAX_COORDINATOR_ADDRESS", env["JAX_COORDINATOR_ADDRESS"])
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        if var == "SLURM_NTASKS" and not env.get("SLURM_JOB_ID"):
            continue
        try:
            if int(env.get(var, "1")) > 1:
                return (var, env[var])
        except ValueError:
            continue
    return None


def check_initialized(mesh_processes: int) -> None:
    """Raise if jax_gin is used in a multi-process job before jax.distributed.initialize()."""
    if distributed_client() is not None:
        return
    howto = ("call jax.distributed.initialize() at the start of every process, before any "
             "other JAX call (and so before jax_gin)")
    if mesh_processes > 1:
        raise RuntimeError(
            f"jax_gin: the mesh spans {mesh_processes} processes but jax.distributed is not "
            f"initialized (or was shut down): {howto}")
    from . import _runtime
    if _runtime.settings.single_process:
        return
    launcher = _launcher_processes()
    if launcher is not None:
        var, val = launcher
        raise RuntimeError(
            f"jax_gin: this process looks like one of several of a job ({var}={val}) but "
            f"jax.distributed.initialize() has not been called, so each process would reduce "
            f"only over its own devices: {howto}. If the processes are meant to be "
            f"independent, set JAX_GIN_SINGLE_PROCESS=1")


# ---------------------------------------------------------------------------------------
# Key-value store calls with errors that say what failed


class _Deadline(Exception):
    """A key-value store wait timed out (the caller knows who is missing)."""


def _kv_error(exc: Exception, doing: str) -> Exception | None:
    """The error to raise for a failed key-value store call; None for a timeout."""
    text = str(exc)
    if text.startswith("DEADLINE_EXCEEDED"):
        return None
    first = text.splitlines()[0] if text else type(exc).__name__
    unreachable = text.startswith(("UNAVAILABLE", "CANCELLED", "ABORTED")) or \
        "failed to connect" in text.lower()
    if unreachable:
        return KeyValueStoreError(
            f"jax_gin: the jax.distributed key-value store (coordinator "
            f"{coordinator_address()}) is unreachable while {doing}: {first}")
    return KeyValueStoreError(
        f"jax_gin: the jax.distributed key-value store (coordinator {coordinator_address()}) "
        f"failed a request while {doing}: {first}")


def _kv(doing: str, fn, *args):
    """fn(*args), a key-value store call: a timeout raises _Deadline, any other failure a
    KeyValueStoreError that says what jax_gin was doing."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - jax.errors.JaxRuntimeError
        err = _kv_error(e, doing)
        if err is None:
            raise _Deadline(str(e)) from e
        raise err from e


_cli_checks = [0]  # check_same_command calls in this process: the same count in every process


def check_same_command(prog: str, options: dict, timeout_s: float = 60.0) -> None:
    """In a job of several processes, exit (status 2) naming the options of a command line
    tool (`prog`) that differ between this process and another: processes that run different
    commands run different programs, and lax's collectives across processes then abort
    without a word of why. A process that does not answer within timeout_s is not waited for
    longer (it fails in its own way). A job of one process checks nothing."""
    client = distributed_client()
    if client is None:
        return
    import jax
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return
    key = f"jax_gin/cli/{_cli_checks[0]}"
    _cli_checks[0] += 1
    doing = f"comparing {prog}'s options between processes"
    mine = json.loads(json.dumps(options, sort_keys=True, default=str))
    _kv(doing, client.key_value_set, f"{key}/p{me}", json.dumps(mine))
    deadline = time.monotonic() + timeout_s
    for q in range(n):
        if q == me:
            continue
        try:
            theirs = json.loads(_kv(doing, client.blocking_key_value_get, f"{key}/p{q}",
                                    _ms(deadline)))
        except _Deadline:
            continue
        diff = differences(mine, theirs, q)
        if diff:  # a usage error, as argparse's: status 2, the text on stderr
            sys.stderr.write(f"{prog}: error: the processes of the job run different commands: "
                             f"{'; '.join(diff)}. Run the same command in every process (they "
                             f"run one program together)\n")
            raise SystemExit(2)


def _ms(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))


def job_token(client, deadline: float) -> str:
    """A random token for this job, the same in every process: the first to ask sets it."""
    token = _job_tokens.get(id(client))
    if token is not None:
        return token
    doing = "agreeing on a job token for shared-memory names"
    try:
        client.key_value_set(_JOB_TOKEN_KEY, secrets.token_hex(8))
    except Exception as e:  # noqa: BLE001 - ALREADY_EXISTS: another process set it first
        if "ALREADY_EXISTS" not in str(e):
            raise (_kv_error(e, doing) or KeyValueStoreError(str(e))) from e
    try:
        token = _kv(doing, client.blocking_key_value_get, _JOB_TOKEN_KEY, _ms(deadline))
    except _Deadline:  # pragma: no cover - it was set just above, by us or another process
        raise KeyValueStoreError(f"jax_gin: the job token vanished from the key-value store "
                                 f"(coordinator {coordinator_address()})") from None
    _job_tokens[id(client)] = token
    return token


def _key_hash(key) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:12]


def communicator_tag(key, generation: int) -> str:
    """A name for a communicator that every process computes alike."""
    return f"{_key_hash(key)}.{generation}"


SHM_DIR = "/dev/shm"  # where Linux (glibc) keeps POSIX shared-memory names
# A name is removed once its deadline is this far in the past: room for the creator to unlink
# it itself, and for steps of the wall clock.
STALE_MARGIN_S = 60
_NEVER = 10**12 - 1  # a deadline (unix seconds, year 33658) that is never swept
# segment_name's names, as found in SHM_DIR: job token, communicator tag, deadline, group
_SEGMENT_RE = re.compile(r"jax_gin\.([0-9a-f]{16})\.([0-9a-f]{12}\.[0-9]+)\.d([0-9]{1,12})"
                         r"\.g([0-9]+)")


def segment_name(token: str, tag: str, group: int, deadline_unix: int) -> str:
    return f"/jax_gin.{token}.{tag}.d{deadline_unix}.g{group}"


def parse_segment_name(name: str):
    """(token, tag, group, deadline_unix) of a name that segment_name made (with or without
    its leading '/'), else None."""
    m = _SEGMENT_RE.fullmatch(name.removeprefix("/"))
    return None if m is None else (m[1], m[2], int(m[4]), int(m[3]))


def _unlink_segments(match) -> list:
    """Unlinks the names in SHM_DIR that parse as segment names and satisfy
    match(token, tag, group, deadline_unix); returns those it removed. Names it may not
    remove (another user's) or that vanish meanwhile are left alone."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for n in sorted(names):
        parsed = parse_segment_name(n)
        if parsed is not None and match(*parsed) and _native.cpu.shm_unlink("/" + n):
            removed.append(n)
    return removed


def sweep_stale_segments(now: float | None = None) -> list:
    """Removes the segment names whose deadline passed more than STALE_MARGIN_S ago (left by
    processes that were killed during a set-up, of any job); returns them."""
    now = time.time() if now is None else now
    return _unlink_segments(lambda token, tag, group, deadline: deadline + STALE_MARGIN_S < now)


def _wall_deadline(deadline: float) -> int:
    """A time.monotonic() deadline as unix seconds, rounded up."""
    return math.ceil(min(time.time() + max(0.0, deadline - time.monotonic()), _NEVER))


# ---------------------------------------------------------------------------------------
# Generations: which set-up of a communicator the processes meet at


_next_generation: dict = {}  # communicator key -> the generation this process tries next


def _abandoned_prefix(token: str, key) -> str:
    return f"{KV_PREFIX}/{token}/abandoned/{_key_hash(key)}/"


def _mark_abandoned(client, token: str, key, generation: int, me: int) -> None:
    """Record in the key-value store that process `me` gave up on `generation` of `key`."""
    try:
        client.key_value_set(f"{_abandoned_prefix(token, key)}{generation}", str(me))
    except Exception:  # noqa: BLE001 - best effort, while the set-up's own error is raised
        pass  # (ALREADY_EXISTS: another process marked it first)


class SetUp:
    """One attempt of this process to set up the communicator `key` with the other processes
    of its groups: a context manager around the whole set-up, from the key-value bootstrap
    to the native communicator.

    Every set-up of a communicator has a generation, part of its key-value keys and
    shared-memory names (communicator_tag), which the processes must agree on. Each process
    counts the set-ups it came to; a process that never came to one (it raised before it,
    say) while the others gave up on it would be a generation behind them from then on, and
    every later attempt would fail. So a process whose set-up fails once it has arrived at a
    generation marks that generation abandoned in the key-value store, and a process skips
    the abandoned generations before it arrives. A marker written just after a process looked
    shows at the arrival barrier instead (_Bootstrap.arrive), and the process moves on to the
    next generation there. Either way, when all of them try again, they meet.
    """

    def __init__(self, key):
        self.key = key
        self.generation = _next_generation.get(key, 0)
        self.late = False  # skipped a generation that the other processes gave up on
        self.arrived = False  # at self.generation, which is then used up for this process
        self._store = None  # (client, token, me), once the bootstrap has them

    def skip_abandoned(self, client, token: str, me: int, doing: str) -> None:
        self._store = (client, token, me)
        marked = {int(k.rsplit("/", 1)[1]) for k, _ in
                  _kv(doing, client.key_value_dir_get, _abandoned_prefix(token, self.key))}
        while self.generation in marked:
            self.generation += 1
            self.late = True

    def abandon(self) -> None:
        """Mark this generation abandoned and move on to the next."""
        client, token, me = self._store
        _mark_abandoned(client, token, self.key, self.generation, me)
        self.generation += 1
        self.arrived = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # A generation this process did not arrive at stays its next: the others may be
        # waiting there, and meet it when it tries again.
        if self.arrived:
            if exc_type is None:
                self.generation += 1
            else:
                self.abandon()
            _next_generation[self.key] = self.generation
        return False


# ---------------------------------------------------------------------------------------
# Workspaces of one communicator


def _host_identity() -> str:
    """Processes with the same identity see the same /dev/shm: one machine (boot) and one
    tmpfs instance there (containers may each have their own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:  # pragma: no cover - not Linux
        boot = "?"
    try:
        shm = f"{os.stat('/dev/shm').st_dev:x}"
    except OSError:  # pragma: no cover
        shm = "?"
    return f"{socket.gethostname()} (boot {boot}, /dev/shm {shm})"


def _ranks_text(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


def _missing_error(what, spanning, proc_of, nranks, participants, me, timeout_s, tag, token,
                   missing_procs, late=False) -> BootstrapTimeoutError:
    """The error for processes that did not come to set up a communicator: the groups and
    their missing ranks; (late) that this process came after the others gave up on it, and
    the ranks missing from the next set-up, where it waited for them."""
    parts = []
    for g in spanning:
        ranks = [r for r in range(nranks) if proc_of[g][r] in missing_procs]
        if ranks:
            procs_txt = ", ".join(str(p) for p in sorted({proc_of[g][r] for r in ranks}))
            parts.append(f"group {g} is missing ranks {_ranks_text(ranks)} (process "
                         f"{procs_txt})")
    if late:
        others = ", ".join(str(p) for p in participants if p != me)
        head = (f"jax_gin: process {me} came to set up {what} after the other processes "
                f"({others}) had stopped waiting for it (JAX_GIN_TIMEOUT_S={timeout_s:g})")
        if parts:
            head += (f", then timed out waiting for them to set it up again: "
                     f"{'; '.join(parts)}")
    else:
        head = (f"jax_gin: timed out after {timeout_s:g} s setting up {what}: "
                f"{'; '.join(parts)}")
    return BootstrapTimeoutError(
        f"{head}. Every process of the job must lower the same jax_gin programs in the "
        f"same order, with the same settings (a setting changed in one process after a set-up "
        f"makes it set up a communicator that the others, which keep theirs, never come to); "
        f"a peer may have failed, or may be slower: set JAX_GIN_TIMEOUT_S to wait longer. "
        f"(communicator {tag}, job {token})")


def _process_map(layout, procs: list) -> tuple:
    """proc_of[group][rank] (the process running each rank) and the groups that span
    processes."""
    proc_of = [[-1] * layout.nranks for _ in range(layout.ngroups)]
    for logical, p in enumerate(procs):
        proc_of[layout.group_of[logical]][layout.rank_of[logical]] = int(p)
    spanning = [g for g in range(layout.ngroups) if len(set(proc_of[g])) > 1]
    return proc_of, spanning


class _Bootstrap:
    """What the processes that share spanning groups agree on before setting them up: the
    participants, the deadline, the generation and the key-value prefix unique to the job,
    communicator and generation (known once arrived), and how to say who is missing."""

    def __init__(self, layout, proc_of, spanning, me, setup: SetUp, timeout_s, what):
        self.participants = sorted({p for g in spanning for p in proc_of[g]})
        self.client = distributed_client()
        if self.client is None:
            check_initialized(len(self.participants))
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.token = job_token(self.client, self.deadline)
        self.setup, self.me = setup, me
        self.tag = self.prefix = None
        self.doing = f"setting up {what}"
        self._error_args = (what, spanning, proc_of, layout.nranks, self.participants, me,
                            timeout_s)

    def missing_error(self, missing_procs, late=False) -> BootstrapTimeoutError:
        return _missing_error(*self._error_args, self.tag, self.token, missing_procs, late)

    def arrive(self, value: str) -> dict:
        """Step 1 of every set-up: at the first generation not given up on, a key per process
        (with `value`), then a barrier of the participants. Returns {process: value}; a
        process that does not come raises missing_error(missing processes, late=...)."""
        client, me, doing, setup = self.client, self.me, self.doing, self.setup
        setup.skip_abandoned(client, self.token, me, doing)
        while True:
            self.tag = communicator_tag(setup.key, setup.generation)
            self.prefix = f"{KV_PREFIX}/{self.token}/{self.tag}"
            setup.arrived = True
            try:
                _kv(doing, client.key_value_set, f"{self.prefix}/arrived/{me}", value)
                _kv(doing, client.wait_at_barrier, f"{self.prefix}/arrived", _ms(self.deadline),
                    self.participants)
                return self._arrived()
            except _Deadline:
                missing = [p for p in self.participants if p not in self._arrived()]
            # Every process came, yet the barrier failed before this process's deadline: it
            # had failed before this process got there, so the others gave up on this
            # generation (their markers may not be written yet) and will try the next.
            if not missing and time.monotonic() < self.deadline:
                self.abort()
                setup.abandon()
                setup.late = True
                continue
            raise self.missing_error(missing, late=setup.late or not missing)

    # The end of a set-up. Its steps wait each with its own timeout, so one process could see
    # a step done (every rank joined, say) just as another gave up on it: the first would keep
    # a communicator that the others abandoned, and never meet them again. So the processes
    # settle the outcome under one key of the key-value store, which only its first writer
    # sets: the lowest participant writes "commit" once every process says it is done; a
    # process whose set-up fails, or that waits too long for the outcome, writes "abort <it>".
    # Whatever a process reads there is what every process reads.

    def _settle(self, verdict: str) -> str:
        """Write `verdict` under the outcome's key unless one is there; the outcome."""
        key = f"{self.prefix}/outcome"
        try:
            self.client.key_value_set(key, verdict)
            return verdict
        except Exception as e:  # noqa: BLE001 - jax.errors.JaxRuntimeError
            if not str(e).startswith("ALREADY_EXISTS"):
                err = _kv_error(e, self.doing)
                raise err if err is not None else _Deadline(str(e)) from e
        return _kv(self.doing, self.client.blocking_key_value_get, key, 10_000)

    def abort(self) -> None:
        """This process's set-up failed: every process's fails (best effort: its own error,
        which the caller raises, says more). Its done key says so too, so that the lowest
        participant, which waits for the done keys, reads the outcome at once."""
        if self.prefix is not None:
            try:
                self._settle(f"abort {self.me}")
                self.client.key_value_set(f"{self.prefix}/done/{self.me}", "abort")
            except Exception:  # noqa: BLE001
                pass

    def commit(self) -> None:
        """This process's set-up went well: returns once every process's did; raises
        BootstrapTimeoutError where one failed, or a process did not say in time."""
        client, me, doing, prefix = self.client, self.me, self.doing, self.prefix
        _kv(doing, client.key_value_set, f"{prefix}/done/{me}", "1")
        if me == self.participants[0]:
            done = set()
            try:
                for p in self.participants:
                    if _kv(doing, client.blocking_key_value_get, f"{prefix}/done/{p}",
                           _ms(self.deadline)) != "1":
                        break  # p gave up (abort): the outcome names it
                    done.add(p)
                verdict = self._settle("commit" if len(done) == len(self.participants)
                                       else f"abort {me}")
            except _Deadline:
                verdict = self._settle(f"abort {me}")
                if verdict != "commit":
                    raise self.missing_error(
                        [p for p in self.participants if p not in done]) from None
        else:
            # The lowest participant decides by its own deadline, which is at most a timeout
            # after this one's (it came to the arrival barrier before this process left it).
            try:
                verdict = _kv(doing, client.blocking_key_value_get, f"{prefix}/outcome",
                              _ms(self.deadline + self.timeout_s))
            except _Deadline:
                verdict = self._settle(f"abort {me}")
                if verdict != "commit":
                    raise self.missing_error([self.participants[0]]) from None
        if verdict != "commit":
            p = int(verdict.split()[1])
            raise BootstrapTimeoutError(
                f"jax_gin: process {p} gave up setting up {self._error_args[0]}, which this "
                f"process had set up, so every process gives it up (JAX_GIN_TIMEOUT_S="
                f"{self.timeout_s:g}); its own error says why. Running the program again in "
                f"every process sets it up again. (communicator {self.tag}, job {self.token})")

    def _arrived(self) -> dict:
        return {int(k.rsplit("/", 1)[1]): v for k, v in
                _kv(self.doing, self.client.key_value_dir_get, f"{self.prefix}/arrived/")}


def group_workspaces(layout, procs: list, me: int, lane_bytes: int, setup: SetUp,
                     timeout_s: float, what: str, record_entries: int,
                     settings: dict | None = None) -> list:
    """One Workspace per group of `layout` (None where no rank runs in this process).

    procs[logical id] is the process that runs that device; `me` is this process. Groups that
    live in this process alone get private memory; groups that span processes get a shared
    segment, set up collectively with the other processes of those groups. Every process of
    a group must pass the same `lane_bytes` and `record_entries` (the segment's layout):
    `settings` ({variable: value}) names them; the segment's creator publishes it beside the
    segment's name, and the others compare and raise a ValueError naming the difference.
    `setup` (SetUp) is this attempt, which picks the generation.
    """
    ngroups, nranks = layout.ngroups, layout.nranks
    proc_of, spanning = _process_map(layout, procs)
    out: list = [None] * ngroups
    for g in range(ngroups):
        if g not in spanning and proc_of[g][0] == me:
            out[g] = _native.cpu.Workspace.private(nranks, lane_bytes, record_entries)
    mine = [g for g in spanning if me in proc_of[g]]
    if not mine:
        return out
    boot = _Bootstrap(layout, proc_of, spanning, me, setup, timeout_s, what)
    shared: dict = {}
    try:
        # 1. arrive, saying which /dev/shm this process sees
        hosts = boot.arrive(_host_identity())
        client, deadline, token, tag = boot.client, boot.deadline, boot.token, boot.tag
        prefix, doing, missing_error = boot.prefix, boot.doing, boot.missing_error
        for g in mine:
            where = {p: hosts.get(p) for p in sorted(set(proc_of[g]))}
            if len(set(where.values())) > 1:
                raise RuntimeError(
                    f"jax_gin: group {g} of {what} spans processes that do not share POSIX "
                    f"shared memory (on other hosts, or with another /dev/shm: "
                    f"{', '.join(f'process {p} on {h}' for p, h in where.items())}). On CPU, "
                    f"jax_gin supports several processes of one host only")
        # 2. create (and publish) the segments of the groups whose rank 0 runs here
        if any(proc_of[g][0] == me for g in mine):
            sweep_stale_segments()
        for g in mine:
            if proc_of[g][0] != me:
                continue
            name = segment_name(token, tag, g, _wall_deadline(deadline))
            shared[g] = _native.cpu.Workspace.create(name, nranks, lane_bytes, record_entries)
            shared[g].join([r for r in range(nranks) if proc_of[g][r] == me], me)
            # the settings first: a reader that has the name finds them
            _kv(doing, client.key_value_set, f"{prefix}/settings/g{g}", json.dumps(settings or {}))
            _kv(doing, client.key_value_set, f"{prefix}/g{g}", name)
        # 3. map the others' segments
        for g in mine:
            if proc_of[g][0] == me:
                continue
            try:
                name = _kv(doing, client.blocking_key_value_get, f"{prefix}/g{g}", _ms(deadline))
                theirs = json.loads(_kv(doing, client.blocking_key_value_get,
                                        f"{prefix}/settings/g{g}", _ms(deadline)))
            except _Deadline:
                # The creator may have died between creating and publishing: drop its name.
                _unlink_segments(lambda tk, tg, gg, _, g=g: (tk, tg, gg) == (token, tag, g))
                raise missing_error({proc_of[g][0]}) from None
            _publish_own_settings(client, prefix, g, me, settings, doing)
            check_same_settings(settings or {}, theirs, proc_of[g][0], what)
            parsed = parse_segment_name(name)
            if parsed is None or parsed[:3] != (token, tag, g):
                raise RuntimeError(f"jax_gin: process {proc_of[g][0]} published segment "
                                   f"{name!r} for group {g}, expected a name of job "
                                   f"{token}, communicator {tag}, group {g}")
            shared[g] = _native.cpu.Workspace.attach(name, nranks, lane_bytes, record_entries)
            shared[g].join([r for r in range(nranks) if proc_of[g][r] == me], me)
        # 4. the creator checks the others' settings too, so that both sides name a difference
        _check_peer_settings(client, prefix, proc_of, mine, me, settings, deadline, doing,
                             missing_error, what)
        # 5. join: wait until every rank of every group has mapped its segment
        for g in mine:
            missing = shared[g].wait_joined(max(0.0, deadline - time.monotonic()))
            if missing:
                raise missing_error({proc_of[g][r] for r in missing})
        # 6. every process's set-up went well, or all of them fail (_Bootstrap.commit)
        boot.commit()
    except BaseException:
        boot.abort()  # (where commit read another outcome than "commit", it is that already)
        raise
    finally:
        # Every process unlinks every name it knows (the first one wins): on success because
        # all have mapped it, on failure so that nothing stays in /dev/shm.
        for w in shared.values():
            w.unlink()
    for g in mine:
        out[g] = shared[g]
    return out


# ---------------------------------------------------------------------------------------
# Several processes on GPU: NCCL unique ids


def gpu_unique_ids(layout, procs: list, me: int, setup: SetUp, timeout_s: float,
                   what: str, new_id, launch_settings: dict | None = None) -> dict:
    """{group: ncclUniqueId bytes} for every group of `layout` with a rank in this process.

    procs[logical id] is the process that runs that device; `me` is this process; new_id()
    makes a fresh id (ncclGetUniqueId). A group inside this process gets a local id. For
    groups that span processes, every process involved arrives (a key and a barrier: a
    process that does not come within `timeout_s` fails the others with the group and its
    missing ranks), then the process that runs a group's rank 0 makes its id and publishes it
    under a key unique to the job, the communicator and its generation (`setup`), and the
    others read it. After this the caller runs ncclCommInitRank (NCCL's own bootstrap),
    within the same `setup`.

    `launch_settings` ({name: value}) must be equal in every process of a group: they decide
    the window layout, the lanes and the flag tags of every kernel, and a process that differs
    would read data before it arrived (wrong numbers, not a hang). The id's maker publishes
    them beside the id; the others compare and raise a ValueError naming the difference.
    """
    proc_of, spanning = _process_map(layout, procs)
    mine = [g for g in range(layout.ngroups) if me in proc_of[g]]
    out = {g: bytes(new_id()) for g in mine if g not in spanning}
    if not any(g in spanning for g in mine):
        return out
    boot = _Bootstrap(layout, proc_of, spanning, me, setup, timeout_s, what)
    boot.arrive(socket.gethostname())
    client, deadline, doing = boot.client, boot.deadline, boot.doing
    prefix, missing_error = boot.prefix, boot.missing_error
    for g in mine:  # ascending, in every process
        if g not in spanning:
            continue
        k = f"{prefix}/nccl_id/g{g}"
        ks = f"{prefix}/settings/g{g}"
        if proc_of[g][0] == me:
            out[g] = bytes(new_id())
            # the settings first: a reader that has the id finds them
            _kv(doing, client.key_value_set_bytes, ks, json.dumps(launch_settings or {}).encode())
            _kv(doing, client.key_value_set_bytes, k, out[g])
        else:
            try:
                out[g] = bytes(_kv(doing, client.blocking_key_value_get_bytes, k, _ms(deadline)))
                theirs = json.loads(bytes(_kv(doing, client.blocking_key_value_get_bytes, ks,
                                              _ms(deadline))).decode())
            except _Deadline:
                raise missing_error({proc_of[g][0]}) from None
            _publish_own_settings(client, prefix, g, me, launch_settings, doing)
            check_same_settings(launch_settings or {}, theirs, proc_of[g][0], what)
    _check_peer_settings(client, prefix, proc_of, [g for g in mine if g in spanning], me,
                         launch_settings, deadline, doing, missing_error, what)
    return out


def _publish_own_settings(client, prefix: str, g: int, me: int, settings, doing: str) -> None:
    """A process that is not group g's set-up maker publishes its settings for the maker to
    compare (_check_peer_settings), before it compares them itself."""
    _kv(doing, client.key_value_set, f"{prefix}/settings/g{g}/p{me}", json.dumps(settings or {}))


def _check_peer_settings(client, prefix: str, proc_of: list, mine: list, me: int, settings,
                         deadline: float, doing: str, missing_error, what: str) -> None:
    """For each group of `mine` whose set-up this process made: the settings each other
    process of it published; raises as check_same_settings does on a difference, so that the
    maker names it too instead of waiting for a peer that has given up."""
    for g in mine:
        if proc_of[g][0] != me:
            continue
        for p in sorted(set(proc_of[g]) - {me}):
            try:
                theirs = json.loads(_kv(doing, client.blocking_key_value_get,
                                        f"{prefix}/settings/g{g}/p{p}", _ms(deadline)))
            except _Deadline:
                raise missing_error({p}) from None
            check_same_settings(settings or {}, theirs, p, what)


def differences(mine: dict, theirs: dict, other_proc: int) -> list:
    """'k=mine here but theirs in process P' for each key whose values differ, in key order."""
    return [f"{k}={mine.get(k)!r} here but {theirs.get(k)!r} in process {other_proc}"
            for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]


def check_same_settings(mine: dict, theirs: dict, other_proc: int, what: str) -> None:
    """Raise if this process's launch settings differ from those of process `other_proc`."""
    diff = differences(mine, theirs, other_proc)
    if diff:
        raise ValueError(
            f"jax_gin: {what}: the processes of a group must use the same settings, and "
            f"{'; '.join(diff)}. Set them alike in every process (they decide the window "
            "layout, the lanes and the flag tags of the kernels, and how calls are cut and "
            "which algorithm `auto` picks).")
