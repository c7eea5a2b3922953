"""Every use of JAX internals (``jax._src``) lives here, behind a version guard.

jax_gin needs a few things JAX does not export: the check_vma flag, the varying-manual-axes
type of an aval, the axis environment, the named-axis effect, lax's collective lowering rules
and the jax.distributed client. If a JAX release moves one, this is the only file to touch.

The guard: importing this module with a jax outside the range that jax_gin's package metadata
requires (pyproject.toml's dependencies) warns, naming the installed version and the range.
It warns rather than raises so that a machine whose only jax is outside the range (the
offline path of scripts/setup.sh takes a system jax >= the lower bound) can still try it.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import operator
import re
import warnings

import jax

_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
            "==": operator.eq, "!=": operator.ne}


def _release(version: str) -> tuple:
    """The first three numbers of a version string, as integers (missing ones are 0)."""
    numbers = [int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


def _supported_jax() -> str | None:
    """The jax versions jax_gin's installed metadata requires (">=0.11.2,<0.13"), or None where
    jax_gin runs without installed metadata (a source tree on sys.path)."""
    try:
        requires = importlib.metadata.requires("jax_gin") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.fullmatch(r"jax\s*([^;]*)", req.strip())
        if m:  # lower bounds first
            clauses = [c.strip() for c in m.group(1).split(",")]
            return ",".join(sorted(clauses, key=lambda c: not c.startswith(">")))
    return None


def _jax_in_range(version: str, spec: str) -> bool:
    """Does `version` meet every comparison of `spec` (">=0.11.2,<0.13")? Release numbers only;
    a clause of another form (~=, a wildcard) is not checked."""
    for clause in spec.split(","):
        m = re.fullmatch(r"\s*(>=|<=|==|!=|>|<)\s*([\d.]+)\s*", clause)
        if m and not _COMPARE[m.group(1)](_release(version), _release(m.group(2))):
            return False
    return True


def _check_jax_version() -> None:
    spec = _supported_jax()
    if spec and not _jax_in_range(jax.__version__, spec):
        warnings.warn(f"jax_gin supports jax{spec}, but jax {jax.__version__} is installed: "
                      "jax_gin relies on JAX internals (jax_gin/_compat.py) that may differ "
                      "in it", RuntimeWarning)


_check_jax_version()

from jax._src import config as _config  # noqa: E402
from jax._src import core as _core  # noqa: E402
from jax._src.interpreters import batching as _batching  # noqa: E402


def partition_id():
    """The lowered program's partition id (an MLIR value): the device's logical id."""
    from jax._src.lib.mlir.dialects import hlo
    return hlo.partition_id()


def current_block():
    """The MLIR block that lowering is inserting into."""
    from jax._src.lib.mlir import ir
    return ir.InsertionPoint.current.block


def distributed_state():
    """jax.distributed's global state of this process, or None where JAX has none."""
    try:
        from jax._src import distributed as _d
    except ImportError:  # pragma: no cover - a JAX without it
        return None
    return getattr(_d, "global_state", None)


@contextlib.contextmanager
def replaced_distributed_client(address: str, process_id: int, init_timeout: int):
    """Within the block, jax.distributed's client is a new client of the coordinator at
    `address` (tests: one where no coordinator listens); the process's own client is put back
    at the end."""
    from jax._src.lib import _jax
    state = distributed_state()
    real = state.client
    state.client = _jax.get_distributed_runtime_client(address, process_id,
                                                        init_timeout=init_timeout)
    try:
        yield state.client
    finally:
        state.client = real

NamedAxisEffect = _core.NamedAxisEffect
batching = _batching


TOKEN_AVAL = _core.abstract_token


def create_token():
    """A fresh HLO token (after_all of nothing)."""
    from jax._src.lib.mlir.dialects import hlo
    return hlo.create_token()


def check_vma_enabled() -> bool:
    """Is shard_map tracing with check_vma=True (JAX's varying-manual-axes typing)?"""
    return bool(_config._check_vma.value)


# lax.all_gather's `to` under check_vma=False: jax 0.12 reads it only with check_vma on (off,
# "invarying" is a plain all-gather, whose transpose sums the cotangents over the devices);
# jax 0.11.2 keeps it (the transpose is this device's slice).
ALL_GATHER_TO_NEEDS_CHECK_VMA = _release(jax.__version__) >= (0, 12, 0)


def varying_axes(aval) -> frozenset:
    """The mesh axes a value varies over (``jax.typeof(x).vma``)."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def with_varying_axes(aval, varying: frozenset):
    if getattr(aval, "mat", None) is not None:
        return aval.update(manual_axis_type=aval.mat.update(varying=frozenset(varying)))
    return aval.update(vma=frozenset(varying))


def axis_exists(name) -> bool:
    return _core.get_axis_env().axis_exists(name)


def axis_size(name) -> int:
    return _core.get_axis_env().axis_size(name)


def axes_in_scope() -> tuple:
    env = _core.get_axis_env()
    sizes = getattr(env, "axis_sizes", None)
    if isinstance(sizes, dict):
        return tuple(sizes)
    return tuple(getattr(env, "axis_names", lambda: ())())


def manual_mesh_axes() -> frozenset:
    """Mesh axes that are manual here (shard_map); vmap axis names are not among them."""
    try:
        from jax.sharding import get_abstract_mesh
        return frozenset(get_abstract_mesh().manual_axes)
    except Exception:  # pragma: no cover - older JAX
        return frozenset()


def is_tracer(x) -> bool:
    return isinstance(x, _core.Tracer)


def concrete_int(v) -> int:
    """`v` as a Python int where it is an integer or a concrete integer array, as lax's and
    jnp's axis arguments take them; a TypeError for a bool, a traced value or anything else."""
    if isinstance(v, bool) or is_tracer(v):
        raise TypeError(f"not a concrete integer: {v!r}")
    return operator.index(v)


def unreduced_axes(aval) -> frozenset:
    """The mesh axes over which a value is an unreduced partial sum (JAX's `unreduced` type)."""
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "unreduced", frozenset())) if mat is not None else frozenset()


def unreduced_kind(aval) -> str | None:
    """How a value typed unreduced is to be reduced ("sum", "max", "min"; JAX's
    unreduced_kind), or None where it is not unreduced (or JAX has no kinds)."""
    mat = getattr(aval, "mat", None)
    kind = getattr(mat, "unreduced_kind", None) if mat is not None else None
    return getattr(kind, "name", None) if kind is not None else None


def without_unreduced(aval, axes: tuple):
    """The type of an all-reduce of an unreduced value over `axes`: those axes are no longer
    unreduced (lax's unreduced_psum types its result this way)."""
    out_u = frozenset(u for u in aval.mat.unreduced if u not in axes)
    kind = aval.mat.unreduced_kind if out_u else None
    return aval.update(manual_axis_type=aval.mat.update(unreduced=out_u, unreduced_kind=kind))


def collective_type(aval, axes: tuple, *, drop_varying: bool = False, add_varying: bool = False,
                    add_reduced: bool = False, drop_unreduced: bool = False):
    """aval re-typed over `axes` as lax's typed collectives type their results: no longer
    varying (all_gather to='invarying' or 'reduced'), varying (a reduce-scatter of an unreduced
    value), reduced (all_gather to='reduced'), no longer unreduced (a reduce-scatter of an
    unreduced value). Outside check_vma (no typing) aval as it is."""
    mat = getattr(aval, "mat", None)
    if mat is None or not check_vma_enabled():
        return aval
    varying, unreduced = frozenset(mat.varying), frozenset(mat.unreduced)
    if drop_varying:
        varying = frozenset(v for v in varying if v not in axes)
    if add_varying:
        varying |= frozenset(axes)
    update = dict(varying=varying)
    if add_reduced:
        update["reduced"] = frozenset(mat.reduced) | frozenset(axes)
    if drop_unreduced:
        unreduced = frozenset(u for u in unreduced if u not in axes)
        update.update(unreduced=unreduced,
                      unreduced_kind=mat.unreduced_kind if unreduced else None)
    return aval.update(manual_axis_type=mat.update(**update))


def reduced_axes(aval) -> frozenset:
    """The mesh axes over which a value is typed reduced (the cotangent type of unreduced)."""
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "reduced", frozenset())) if mat is not None else frozenset()


def preduced(x, axes: tuple):
    """lax's transpose of an unreduced psum: the cotangent marked reduced over `axes`."""
    from jax._src.lax import parallel as _parallel
    return _parallel.preduced(x, axis_name=tuple(axes))


def pcast_varying(x, axes: tuple):
    """Mark x as varying over `axes` (lax.pcast(..., to='varying'); pvary before it existed)."""
    if not axes:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, tuple(axes), to="varying")
    return jax.lax.pvary(x, tuple(axes))


def xla_allreduce_lowering(ctx, xs, op: str, axes: tuple):
    """Lower an all-reduce of the operands `xs` over mesh `axes` as XLA's own all-reduce: what
    lax.psum / pmax / pmin lower to (their registered lowering rule), for `auto`'s fallback."""
    from jax import lax
    from jax._src.lax import parallel as _parallel
    prim, reduce = {"sum": (lax.add_p, lax.reduce_sum), "max": (lax.max_p, lax.reduce_max),
                    "min": (lax.min_p, lax.reduce_min)}[op]
    outs = []  # lax's rule takes one operand: one all-reduce per operand
    for x, a_in, a_out in zip(xs, ctx.avals_in, ctx.avals_out):
        outs.extend(_parallel._all_reduce_lowering(
            prim, reduce, ctx.replace(avals_in=[a_in], avals_out=[a_out]), x, axes=tuple(axes),
            axis_index_groups=None))
    return outs


def xla_collective_lowering(ctx, x, api: str, axes: tuple, dim: int, tiled: bool):
    """Lower psum_scatter / all_gather of `x` over mesh `axes` as XLA's own reduce-scatter or
    all-gather: lax's registered lowering rules."""
    from jax import lax
    from jax._src.lax import parallel as _parallel
    size = 1
    for a in axes:
        size *= int(ctx.module_context.axis_context.mesh.shape[a])
    if api == "psum_scatter":
        return _parallel._reduce_scatter_lowering(
            lax.add_p, ctx, x, scatter_dimension=dim, axis_name=tuple(axes),
            axis_index_groups=None, axis_size=size, tiled=tiled)
    return _parallel._all_gather_lowering(
        ctx, x, all_gather_dimension=dim, axis_name=tuple(axes), axis_index_groups=None,
        axis_size=size, tiled=tiled)


def use_shardy() -> bool:
    """Is jit partitioning with Shardy (jax_use_shardy_partitioner), rather than GSPMD?"""
    return bool(_config.use_shardy_partitioner.value)


def elementwise_sharding_rule(ctx, avals_in, avals_out, pairs):
    """Shardy's sharding rule (an ``#sdy.op_sharding_rule`` attribute) for a custom call whose
    result ``j`` has the shape of operand ``i`` for each ``(i, j)`` in `pairs`, and is that
    operand's elementwise image: every dimension of the pair is one factor, so the
    partitioner may shard it any way it likes, the same way for both. The other operands
    and results (rank 0) have no factors."""
    from jax._src import custom_partitioning_sharding_rule as _rule
    from jax._src.interpreters import mlir as _mlir
    ins = [[] for _ in avals_in]
    outs = [[] for _ in avals_out]
    for i, j in pairs:
        dims = [f"f{i}_{d}" for d in range(len(avals_in[i].shape))]
        ins[i], outs[j] = dims, dims
    for k, a in enumerate(avals_in):
        assert ins[k] or not a.shape, (k, a)
    for k, a in enumerate(avals_out):
        assert outs[k] or not a.shape, (k, a)
    text = (", ".join(" ".join(d) for d in ins) + " -> " + ", ".join(" ".join(d) for d in outs))
    rule = _rule.str_to_sdy_sharding_rule(text)

    def types(avals):
        return [t for a in avals for t in _mlir.aval_to_ir_types(ctx.module_context, a)]
    return _rule.sdy_sharding_rule_to_mlir(rule, types(avals_in), types(avals_out))


def reshape(ctx, x, aval_out):
    """An MLIR reshape of `x` to `aval_out`'s shape."""
    from jax._src.interpreters import mlir as _mlir
    return _mlir.reshape(ctx, x, aval_out)


def gspmd_as_named(sharding, axis_names: tuple, axis_sizes: tuple):
    """A GSPMDSharding, which custom_partitioning gives its partition function where it knows
    no mesh (a jit whose arrays are all made inside it, under a context mesh), as a
    NamedSharding over a mesh of `axis_names` and `axis_sizes` on its devices in their order,
    as JAX's ShardingContext builds one from an abstract mesh; None where it cannot be read."""
    import math
    import numpy as np
    from jax._src import sharding_impls
    devices = getattr(sharding, "_device_assignment", None)
    hlo = getattr(sharding, "_hlo_sharding", None)
    if devices is None or hlo is None or len(devices) != math.prod(axis_sizes):
        return None
    mesh = jax.sharding.Mesh(np.array(devices).reshape(axis_sizes), axis_names)
    spec = sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0]
    return jax.sharding.NamedSharding(mesh, spec)


def has_kept_effects(effects) -> bool:
    """Whether `effects` hold one for which JAX's dead-code elimination keeps an equation (a
    debug print's, an io_callback's; not a named axis's)."""
    from jax._src.interpreters import partial_eval as pe
    return any(not pe.dceable_effects.contains(e) for e in effects)


def register_dce_rule(prim, rule) -> None:
    """`rule(used_outputs, eqn) -> (used_inputs, eqn or None)` for JAX's dead-code elimination
    of `prim`'s equations. (jax 0.12 passes the inputs' liveness between the two, which the
    rule does not need.)"""
    from jax._src.interpreters import partial_eval as pe
    pe.dce_rules[prim] = lambda used_outputs, *rest: rule(used_outputs, rest[-1])
