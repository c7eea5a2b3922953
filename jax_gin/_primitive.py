"""The all-reduce primitive and the public psum/pmax/pmin.

One primitive, `jax_gin_allreduce`, with one or more operands of one dtype (a bucket of a
pytree's leaves, reduced in one custom call and, on GPUs, one kernel launch) and params:
  axes       tuple of mesh axis names reduced over
  op         "sum" | "max" | "min"
  algorithm  "auto" or a name in ALGORITHMS (resolved at lowering, when the platform is known)
  invariant  True when traced under shard_map(check_vma=True): then, like lax.psum, the
             input must vary over `axes` and the output does not; the transpose of a sum is
             a pcast to varying. With check_vma=False the sum transposes to another sum.
             "unreduced": the input is an unreduced partial sum over `axes` (JAX's typing of
             pending sums); the output is no longer unreduced over them and the transpose
             marks the cotangent reduced, as lax's unreduced_psum does.
  overlap    True: lowered as an asynchronous start/done pair of custom calls (on GPUs the
             kernel runs on a side stream with few lanes); False: one synchronous call.

All of its rules are registered in one block at the bottom of this file.
"""
from __future__ import annotations

import contextlib
import itertools
import zlib

import numpy as np

import jax
import jax.numpy as jnp
from jax import tree_util
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from . import _compat, _native, _runtime, _select
from ._ops import (ALGORITHM_CODES, ALGORITHMS, OP_API_NAMES, OP_CODES, SUPPORTED_DTYPES,
                   check_dtype, reduced_dtype, refuse_keys, refuse_symbolic)

allreduce_p = Primitive("jax_gin_allreduce")
allreduce_p.multiple_results = True

# Most leaves one call takes (message.h's kMaxSegments: the GPU passes their table in the
# kernel's parameters).
MAX_OPERANDS = int(_native.cpu.MAX_SEGMENTS)


# ---------------------------------------------------------------------------------------
# Public API


def psum(x, axis_name, *, algorithm: str = "auto", bucket_bytes: int | None = None,
         overlap: bool = False, axis_index_groups=None):
    """All-reduce sum over mesh axis `axis_name` (a name or a tuple of names).

    A drop-in for ``jax.lax.psum`` inside ``shard_map``: same semantics for pytrees, scalars,
    tuples of axes and varying-manual-axes typing, computed by jax_gin's own collectives.
    `algorithm` is "auto" or one of jax_gin.ALGORITHMS.

    A pytree is reduced as few collectives: its leaves of one dtype go into buckets of at most
    `bucket_bytes` (default ``jax_gin.runtime.settings.bucket_bytes``, JAX_GIN_BUCKET_BYTES,
    64 MiB) and at most 64 leaves, in leaf order, and each bucket is one call. A leaf larger
    than `bucket_bytes` is a bucket of its own. The result is the same, bit for bit, as
    reducing every leaf on its own.

    With ``overlap=True`` each call is an asynchronous pair: on GPUs the kernel runs on a
    high-priority side stream with at most ``jax_gin.runtime.settings.overlap_lanes`` CTAs
    (JAX_GIN_OVERLAP_LANES, 32), forked from XLA's stream at the start and joined at the
    done, so that compute XLA places between them runs meanwhile. XLA's GPU scheduler (jax
    0.11.2) places the done right after the start, so nothing runs between them;
    ``jax_gin.psum_overlapping`` fixes the placement by data dependencies (docs/overlap.md).
    The numbers are the same as without it.

    lax's `axis_index_groups` is accepted as None only.
    """
    check_no_groups(axis_index_groups, "psum")
    return _allreduce(x, axis_name, "sum", algorithm, bucket_bytes, overlap)


def pmean(x, axis_name, *, algorithm: str = "auto", bucket_bytes: int | None = None,
          overlap: bool = False, axis_index_groups=None):
    """All-reduce mean over mesh axis `axis_name`; a drop-in for ``jax.lax.pmean``: jax_gin's
    psum, then each leaf divided by the number of devices reduced over, as lax divides (so
    integer leaves give floats). The keywords are psum's."""
    check_no_groups(axis_index_groups, "pmean")
    summed = _allreduce(x, axis_name, "sum", algorithm, bucket_bytes, overlap, api="pmean")
    n = 1
    for a in _normalize_axes(axis_name, "pmean"):
        n *= _compat.axis_size(a)
    return tree_util.tree_map(lambda v: v / n, summed)


def pmax(x, axis_name, *, algorithm: str = "auto", bucket_bytes: int | None = None,
         overlap: bool = False, axis_index_groups=None):
    """All-reduce max over mesh axis `axis_name`; a drop-in for ``jax.lax.pmax``."""
    check_no_groups(axis_index_groups, "pmax")
    return _allreduce(x, axis_name, "max", algorithm, bucket_bytes, overlap)


def pmin(x, axis_name, *, algorithm: str = "auto", bucket_bytes: int | None = None,
         overlap: bool = False, axis_index_groups=None):
    """All-reduce min over mesh axis `axis_name`; a drop-in for ``jax.lax.pmin``."""
    check_no_groups(axis_index_groups, "pmin")
    return _allreduce(x, axis_name, "min", algorithm, bucket_bytes, overlap)


def check_no_groups(axis_index_groups, api: str) -> None:
    """lax's `axis_index_groups` keyword, accepted for its signature: None only, since jax_gin
    reduces over whole mesh axes."""
    if axis_index_groups is not None:
        raise NotImplementedError(
            f"jax_gin.{api}: axis_index_groups is not supported (jax_gin's groups are whole mesh "
            f"axes); use a mesh axis for the groups, or jax.lax.{api}")


def _normalize_axes(axis_name, api: str) -> tuple:
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    for a in axes:
        if isinstance(a, (int, np.integer)):
            raise TypeError(f"jax_gin.{api}: positional (integer) axes are not supported: {axis_name!r}")
        try:
            hash(a)
        except TypeError:  # a set or a dict: no axis name, nor a sequence of them
            raise TypeError(f"jax_gin.{api}: axis_name must be an axis name (a string) or a "
                            f"tuple of them, got {axis_name!r}") from None
    if len(set(axes)) != len(axes):
        raise ValueError(f"jax_gin.{api}: repeated axis name in {axis_name!r}")
    for a in axes:
        if not _compat.axis_exists(a):
            # (a pmap without axis_name binds an axis of JAX's own name, which no user wrote)
            scope = [s for s in _compat.axes_in_scope() if s != "_internal_pmap_axis_name"]
            # The first sentence is lax's own for this mistake, word for word.
            raise NameError(
                f"jax_gin.{api}: Found an unbound axis name: {a}. To fix this, please call "
                f"{api} under `jax.shard_map`. Axes in scope: "
                f"{', '.join(repr(s) for s in scope) if scope else 'none'}.")
    return axes


def _check_bucket_bytes(bucket_bytes, api: str) -> int:
    if bucket_bytes is None:
        bucket_bytes = _runtime.settings.bucket_bytes
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1:
        raise ValueError(f"jax_gin.{api}: bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    return int(bucket_bytes)


def buckets(sizes, bucket_bytes: int, max_operands: int = MAX_OPERANDS) -> list:
    """Greedy buckets of consecutive items: lists of indices into `sizes` (bytes), each of at
    most `bucket_bytes` (an item larger than that alone) and `max_operands` items."""
    out, cur, cur_bytes = [], [], 0
    for i, b in enumerate(sizes):
        if cur and (cur_bytes + b > bucket_bytes or len(cur) == max_operands):
            out.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += b
    if cur:
        out.append(cur)
    return out


def _allreduce(x, axis_name, op: str, algorithm: str, bucket_bytes, overlap,
               api: str | None = None):
    api = api or OP_API_NAMES[op]  # the function called, which errors name
    algorithm = _select.validate(algorithm, api)
    if not isinstance(overlap, (bool, np.bool_)):
        raise TypeError(f"jax_gin.{api}: overlap must be True or False, got {overlap!r}")
    overlap = bool(overlap)
    bucket_bytes = _check_bucket_bytes(bucket_bytes, api)
    axes = _normalize_axes(axis_name, api)
    if not axes:
        return x
    leaves, treedef = tree_util.tree_flatten(x)
    if op == "sum":
        rest, merge = constants_apart(leaves, axes, api)
        if merge is not None:
            return tree_util.tree_unflatten(treedef, merge(
                _allreduce(rest, axes, op, algorithm, bucket_bytes, overlap, api)))
        leaves, restore = summed_as(leaves, api)
    leaves, out, by_dtype, was_bool = group_leaves(leaves, axes, op, api)
    for (dtype, mode), idx in by_dtype.items():
        sizes = [int(np.prod(np.shape(leaves[i]), dtype=np.int64)) * dtype.itemsize for i in idx]
        for bucket in buckets(sizes, bucket_bytes):
            members = [idx[j] for j in bucket]
            res = allreduce_p.bind(*[leaves[i] for i in members], axes=axes, op=op,
                                   algorithm=algorithm, invariant=mode, overlap=overlap)
            for i, r in zip(members, res):
                out[i] = r
    for i in was_bool:
        out[i] = out[i].astype(np.bool_)
    if op == "sum":
        out = restore(out)
    return tree_util.tree_unflatten(treedef, out)


def constants_apart(leaves, axes, api: str):
    """(the leaves that are not constants, merge), where merge(their sums) gives every leaf's
    sum in order; merge is None where no leaf is a constant. A constant (a Python scalar, a
    NumPy or concrete jax array) is the same on every device, and lax.psum gives its sum as a
    constant, without communicating: psum(1, axis), the axis size, is a Python int that code
    uses as a static size. jax_gin's sums of constants are lax's, each leaf on its own as lax
    takes them."""
    constants = {}
    for i, leaf in enumerate(leaves):
        if not _compat.is_tracer(leaf):
            if hasattr(leaf, "dtype"):
                refuse_keys(leaf.dtype, api)
            constants[i] = jax.lax.psum(leaf, axes)
    if not constants:
        return leaves, None

    def merge(sums):
        sums = iter(sums)
        return [constants[i] if i in constants else next(sums) for i in range(len(leaves))]

    return [leaf for i, leaf in enumerate(leaves) if i not in constants], merge


def summed_as(leaves, api: str):
    """The leaves a sum (jax_gin.`api`) runs on, and the function that turns their sums back
    into the leaves' own types: complex leaves as (real, imaginary) pairs, uint64 as int64."""
    for leaf in leaves:
        if hasattr(leaf, "dtype"):
            refuse_keys(leaf.dtype, api)
    leaves, was_complex = _complex_as_pairs(leaves)
    leaves, was_uint64 = _uint64_as_int64(leaves)

    def restore(out):
        out = list(out)
        for i in was_complex:
            out[i] = jax.lax.complex(out[i][..., 0], out[i][..., 1])
        for i in was_uint64:
            out[i] = jax.lax.bitcast_convert_type(out[i], np.uint64)
        return out
    return leaves, restore


def _complex_as_pairs(leaves):
    """A complex leaf is summed as its (real, imaginary) pairs, a trailing axis of 2 floats:
    each part of a complex sum is the sum of that part, as XLA's complex all-reduce adds.
    Returns the leaves and the indices of those that were complex."""
    out, was_complex = [], set()
    for i, leaf in enumerate(leaves):
        if hasattr(leaf, "dtype") and np.issubdtype(leaf.dtype, np.complexfloating) or \
                isinstance(leaf, complex):
            was_complex.add(i)
            with _constant_stays_constant(leaf):
                leaf = jnp.asarray(leaf)
                leaf = jnp.stack([jnp.real(leaf), jnp.imag(leaf)], axis=-1)
        out.append(leaf)
    return out, was_complex


def _constant_stays_constant(leaf):
    """A context in which jnp's operations on a constant leaf (a Python scalar, a NumPy or
    concrete jax array) give a concrete array, not a tracer of the jit being traced: so that
    group_leaves still sees a constant (no communication, and a Python scalar's weak type,
    as lax)."""
    return contextlib.nullcontext() if _compat.is_tracer(leaf) else jax.ensure_compile_time_eval()


def _uint64_as_int64(leaves):
    """A uint64 leaf (x64; jnp.sum of unsigned integers gives one) is summed as the int64 of the
    same bits: both sums wrap modulo 2**64, so the result's bits are lax.psum's. Returns the
    leaves and the indices of those that were uint64."""
    out, was_uint64 = [], set()
    for i, leaf in enumerate(leaves):
        if hasattr(leaf, "dtype") and np.dtype(leaf.dtype) == np.uint64:
            with _constant_stays_constant(leaf):
                leaf = jax.lax.bitcast_convert_type(leaf, np.int64)
            was_uint64.add(i)
        out.append(leaf)
    return out, was_uint64


def group_leaves(leaves, axes, op: str, api: str):
    """Prepare a pytree's leaves for reduction over `axes`: (leaves, out, by_dtype, was_bool).
    out[i] is already set for a constant leaf (the same on every device: no communication);
    by_dtype maps (dtype, typing mode) to the indices of the leaves that communicate, in
    order; was_bool holds the bool leaves of pmax/pmin, which are reduced as int32."""
    invariant = _compat.check_vma_enabled()
    leaves = list(leaves)
    out = [None] * len(leaves)
    by_dtype: dict = {}  # (dtype, typing) -> indices of the leaves that communicate, in order
    was_bool = set()  # max/min of bool leaves give bool, as lax.pmax/pmin do
    for i, leaf in enumerate(leaves):
        # A constant (a Python scalar, a NumPy or concrete jax array) is the same on every
        # device: no communication. Tested before jnp.asarray, which makes a tracer under jit.
        constant = not _compat.is_tracer(leaf)
        leaf = jnp.asarray(leaf) if not hasattr(leaf, "dtype") else leaf
        refuse_symbolic(np.shape(leaf), api)
        if constant and op != "sum" and np.issubdtype(leaf.dtype, np.complexfloating):
            check_dtype(leaf.dtype, api)  # no order, constant or not (lax fails at run time)
        if not constant or leaf.dtype == np.bool_:  # a constant takes any dtype, as in lax
            dtype, _ = reduced_dtype(leaf.dtype, api)  # (psum's complex leaves are pairs already)
            if dtype != leaf.dtype:  # bool, as int32
                leaf = leaf.astype(dtype)
                if op != "sum":
                    was_bool.add(i)
        if constant:
            leaf = jnp.asarray(leaf)
            if op == "sum":
                size = 1
                for a in axes:
                    size *= _compat.axis_size(a)
                # A Python scalar's sum stays weakly typed, as lax's does.
                weak = jax.typeof(leaf).weak_type
                leaf = leaf * (size if weak else jnp.asarray(size, leaf.dtype))
            elif not invariant:
                # lax.pmax/pmin without check_vma reduce a constant too: a strong type
                leaf = jnp.asarray(leaf, dtype=leaf.dtype)
            out[i] = leaf
            continue
        mode = invariant
        if invariant and set(axes) <= _compat.unreduced_axes(jax.typeof(leaf)):
            if op != "sum":
                raise ValueError(
                    f"jax_gin.{api}: the input is unreduced over {sorted(axes)} (a pending "
                    f"sum), whose {op} is not defined; sum it first (jax_gin.psum), as "
                    f"lax.{api} requires")
            check_sum_kind(jax.typeof(leaf), api)
            mode = "unreduced"
        elif invariant:
            leaf = vary_over(leaf, axes, api)
        leaves[i] = leaf
        by_dtype.setdefault((np.dtype(leaf.dtype), mode), []).append(i)
    return leaves, out, by_dtype, was_bool


def check_sum_kind(aval, api: str) -> None:
    """A ValueError for an unreduced value that is pending another reduction than a sum (JAX's
    unreduced_kind max or min): a sum of it would be wrong, and lax refuses it too."""
    kind = _compat.unreduced_kind(aval)
    if kind not in (None, "sum"):
        raise ValueError(f"jax_gin.{api}: the input is unreduced pending a {kind}, not a sum")


def vary_over(x, axes: tuple, api: str, reduces: bool = True):
    """x (under check_vma) marked as varying over the manual axes of `axes`, as lax's
    collectives take it: a value invariant over all of them is made varying first (every
    device holds it). A reduction (`reduces`) of a value that varies over some of the axes and
    not the others raises a ValueError, as lax's reductions do (which copies should count is
    the caller's to say); lax.all_gather takes such a value."""
    manual = _compat.manual_mesh_axes()
    vma = _compat.varying_axes(jax.typeof(x))
    mesh_axes = [a for a in axes if a in manual]
    missing = tuple(a for a in mesh_axes if a not in vma)
    if reduces and missing and len(missing) < len(mesh_axes):
        raise ValueError(
            f"jax_gin.{api}: with check_vma=True the input must vary over all of the axes "
            f"{axes} or over none of them, as lax's reductions require; it varies over "
            f"{sorted(a for a in mesh_axes if a in vma)} but not {sorted(missing)}. Mark it "
            f"varying over {tuple(missing)} first with jax.lax.pcast(x, {tuple(missing)!r}, "
            f"to='varying') if each device's copy should count")
    return _compat.pcast_varying(x, missing)


def _bind_like(xs, params, **override):
    p = dict(params)
    p.update(override)
    return allreduce_p.bind(*xs, **p)


# ---------------------------------------------------------------------------------------
# Rules


def _check_params(avals, op, algorithm) -> None:
    """What jax_gin's functions bind by construction, checked for a rule of the user's own
    that binds allreduce_p (the public primitive) itself: a TypeError or ValueError at trace
    time rather than at lowering or run time."""
    if op not in OP_API_NAMES:
        raise ValueError(f"jax_gin.allreduce_p: unknown op {op!r}; expected one of "
                         f"{', '.join(map(repr, OP_API_NAMES))}")
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"jax_gin.allreduce_p: unknown algorithm {algorithm!r}; expected "
                         f"'auto' or one of {', '.join(map(repr, ALGORITHMS))}")
    dtypes = [np.dtype(a.dtype) for a in avals]
    for i, dt in enumerate(dtypes):
        if dt not in SUPPORTED_DTYPES:
            raise TypeError(
                f"jax_gin.allreduce_p: operand {i} has dtype {dt}; the primitive takes "
                f"{', '.join(map(str, SUPPORTED_DTYPES))} (jax_gin's functions take bool, "
                "complex and uint64 as one of these)")
        if dt != dtypes[0]:
            raise TypeError(f"jax_gin.allreduce_p: the operands of one call share a dtype; "
                            f"operand 0 has {dtypes[0]}, operand {i} {dt}")


def _abstract_eval(*avals, axes, op, algorithm, invariant, overlap):
    _check_params(avals, op, algorithm)
    for a in axes:
        if not _compat.axis_exists(a):
            raise NameError(f"jax_gin.{OP_API_NAMES[op]}: unknown axis name {a!r}")
    outs = []
    for aval in avals:
        if invariant == "unreduced":
            if not set(axes) <= _compat.unreduced_axes(aval):
                raise ValueError(
                    f"jax_gin.{OP_API_NAMES[op]}: an unreduced psum needs an input unreduced over "
                    f"{axes}; it is unreduced over {sorted(_compat.unreduced_axes(aval))}")
            outs.append(_compat.without_unreduced(aval, axes))
        elif invariant:
            vma = _compat.varying_axes(aval)
            mesh_axes = set(axes) & _compat.manual_mesh_axes()
            if not mesh_axes <= vma:
                raise ValueError(
                    f"jax_gin.{OP_API_NAMES[op]}: with check_vma=True the input must vary over "
                    f"the reduced axes {axes}; it varies over {sorted(vma)}")
            outs.append(_compat.with_varying_axes(aval, vma - frozenset(axes)))
        else:
            # as lax without check_vma: a fresh array type, so a weak-typed input's sum is strong
            outs.append(aval.update(weak_type=False))
    return outs, {_compat.NamedAxisEffect(a) for a in axes}


def _jvp(primals, tangents, **params):
    outs = allreduce_p.bind(*primals, **params)
    tan_out = [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
    if params["op"] == "sum":
        # one call for every nonzero tangent
        nz = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
        if nz:
            for i, t in zip(nz, allreduce_p.bind(*[tangents[i] for i in nz], **params)):
                tan_out[i] = t
        return outs, tan_out
    # max/min: the tangent of the winning element(s); ties share it equally, as jnp.max does.
    nz = [i for i, (x, t) in enumerate(zip(primals, tangents))
          if type(t) is not ad.Zero and jnp.issubdtype(x.dtype, jnp.floating)]
    if not nz:
        return outs, tan_out
    axes = params["axes"]
    hits, weighted = [], []
    for i in nz:
        out_v = _compat.pcast_varying(outs[i], axes) if params["invariant"] else outs[i]
        hit = (primals[i] == out_v).astype(tangents[i].dtype)
        hits.append(hit)
        weighted.append(tangents[i] * hit)
    num = _bind_like(weighted, params, op="sum")
    cnt = _bind_like(hits, params, op="sum")
    for i, n, c in zip(nz, num, cnt):
        tan_out[i] = n / c
    return outs, tan_out


def _transpose(cts, *xs, axes, op, algorithm, invariant, overlap):
    if op != "sum":
        raise NotImplementedError(f"jax_gin.{OP_API_NAMES[op]} is not linear and has no transpose")
    assert all(ad.is_undefined_primal(x) for x in xs)
    res = [ad.Zero(x.aval) for x in xs]
    nz = [i for i, ct in enumerate(cts) if type(ct) is not ad.Zero]
    if not nz:
        return res
    if invariant == "unreduced":
        for i in nz:
            res[i] = _compat.preduced(cts[i], axes)
        return res
    if invariant:
        # psum under check_vma is varying -> invariant: its transpose only re-marks the
        # cotangent as varying, with no communication (lax.psum does the same).
        for i in nz:
            res[i] = _compat.pcast_varying(cts[i], axes)
        return res
    # check_vma=False: psum is psum followed by a broadcast, so it transposes to a psum.
    outs = allreduce_p.bind(*[cts[i] for i in nz], axes=axes, op=op, algorithm=algorithm,
                            invariant=invariant, overlap=overlap)
    for i, o in zip(nz, outs):
        res[i] = o
    return res


def _batch(axis_data, vals_in, dims_in, *, axes, op, algorithm, invariant, overlap):
    params = dict(axes=axes, op=op, algorithm=algorithm, invariant=invariant, overlap=overlap)
    if invariant == "unreduced":
        raise NotImplementedError("jax_gin.psum of an unreduced value under vmap (as in lax)")
    if axis_data.name not in axes:
        # vmap inside shard_map: the batch dimension is just more data to reduce elementwise.
        return allreduce_p.bind(*vals_in, **params), list(dims_in)
    # Reducing over the vmapped axis itself: reduce the batch dimension locally, then the
    # remaining (mesh) axes with jax_gin. The result is the same for every batch element.
    rest = tuple(a for a in axes if a != axis_data.name)
    local = []
    for x, d in zip(vals_in, dims_in):
        if d is None:
            local.append(x)
        elif x.shape[d] == 0 and op != "sum":
            # a batch of no elements (max and min have no identity to start from): the result
            # is broadcast to no batch element, so its values are never seen
            local.append(jnp.zeros(x.shape[:d] + x.shape[d + 1:], x.dtype))
        else:
            # lax's reductions, in the operand's dtype, as lax.psum's positional axes take them
            # (jnp.sum would add 16-bit floats in float32, which rounds differently)
            reduce = {"sum": jax.lax.reduce_sum, "max": jax.lax.reduce_max,
                      "min": jax.lax.reduce_min}[op]
            local.append(reduce(x, (d,)))
    outs = allreduce_p.bind(*local, **dict(params, axes=rest)) if rest else local
    outs = [o * jnp.asarray(axis_data.size, o.dtype) if (d is None and op == "sum") else o
            for o, d in zip(outs, dims_in)]
    return outs, [None] * len(outs)


def _lowering(ctx, *xs, axes, op, algorithm, invariant, overlap, platform):
    call = resolve_call(ctx, ctx.avals_in, axes, op, algorithm, platform)
    if call is None:
        return xla_allreduce(ctx, xs, op, axes)
    with call.named(OP_API_NAMES[op], platform, len(xs), overlap):
        return _lower_call(ctx, call, xs, op, overlap, platform)


def _lower_call(ctx, call, xs, op, overlap, platform):
    check_no_open_start(ctx, OP_API_NAMES[op])
    if call.partial:
        return _lower_partial(ctx, xs, platform, call.attrs)
    if not overlap:
        target = _native.CPU_TARGET if platform == "cpu" else _native.CUDA_TARGET
        order = order_aval(platform)
        tok, *outs = jax.ffi.ffi_lowering(target)(
            ctx.replace(avals_in=[TOKEN, order, *ctx.avals_in], avals_out=[order, *ctx.avals_out]),
            _compat.partition_id(), _chain_token(ctx, platform), *xs, **call.attrs)
        _set_chain_token(ctx, tok, platform)
        return outs
    # Asynchronous pair. The start launches and returns; the done joins. The next jax_gin call
    # chains on the done's token: calls of one communicator never run concurrently.
    # Where XLA places the done is its scheduler's choice: on 2 x H200 it placed it right after
    # the start (docs/overlap.md); jax_gin.psum_overlapping places it by data dependencies.
    slot = next(_async_slots(ctx)) % _native.ASYNC_SLOTS
    tok, outs = lower_start(ctx, xs, ctx.avals_in, ctx.avals_out, call, platform, slot,
                            _runtime.settings.overlap_lanes)
    return lower_done(ctx, tok, outs, ctx.avals_out, call, platform, slot)


TOKEN = jax.core.ShapedArray((), np.uint32)  # the order token's aval


class Call:
    """What a lowering of jax_gin's all-reduce resolved: the communicator and the custom
    call's attributes, and whether the shard_map leaves some mesh axes automatic."""

    def __init__(self, comm: int, attrs: dict, partial: bool, nranks: int = 1, nbytes: int = 0,
                 dtype: str = ""):
        self.comm, self.attrs, self.partial = comm, attrs, partial
        self.nranks, self.nbytes, self.dtype = nranks, nbytes, dtype

    def label(self, api: str, platform: str, nbuffers: int, overlap: bool) -> str:
        """What profilers show for this call: `jax_gin.psum[two_shot 4 MiB float32]`, with
        `async` and `copy-engine` where they apply. It names the custom calls' HLO
        instructions (`jax_gin_psum_two_shot_4_MiB_float32_.12`) and their op_name metadata,
        so that jax.profiler / Perfetto timelines tell jax_gin's calls apart."""
        code = int(self.attrs["algorithm"])
        algo = "hierarchical" if code == _runtime.HIERARCHICAL_CODE else ALGORITHMS[code]
        words = [algo, size_text(self.nbytes), self.dtype]
        if nbuffers > 1:
            words.append(f"{nbuffers} buffers")
        if overlap:
            words.append("async")
            if self.copy_engine(platform, nbuffers):
                words.append("copy-engine")
        return f"jax_gin.{api}[{' '.join(w for w in words if w)}]"

    def named(self, api: str, platform: str, nbuffers: int, overlap: bool):
        """A context in which the lowered custom calls carry label() as their location name."""
        ir = mlir.ir
        return ir.Location.name(self.label(api, platform, nbuffers, overlap),
                                childLoc=ir.Location.current)

    def copy_engine(self, platform: str, nbuffers: int) -> bool:
        """Whether an asynchronous start of this call moves its data with the GPU's copy
        engines (cuda/copy_engine.cu): one buffer of at least
        ``settings.overlap_copy_engine_bytes``, a group within one node, and an algorithm
        whose reduction gives the same bits (one_shot and two_shot reduce in rank order with
        one rounding; with 2 ranks a sum is the same in any order)."""
        threshold = _runtime.settings.overlap_copy_engine_bytes
        code = int(self.attrs["algorithm"])
        same_bits = code in (ALGORITHM_CODES["one_shot"], ALGORITHM_CODES["two_shot"]) or (
            self.nranks == 2 and int(self.attrs["op"]) == OP_CODES["sum"]
            and code != _runtime.HIERARCHICAL_CODE)
        return (platform != "cpu" and threshold > 0 and nbuffers == 1 and self.nranks > 1
                and self.nbytes >= threshold and same_bits)


def resolve_call(ctx, avals, axes, op, algorithm, platform, api: str | None = None) -> Call | None:
    """The communicator and algorithm of an all-reduce of `avals` over `axes`, or None where
    `auto` (or the caller) chose XLA's own all-reduce; errors name `api` (default the op's
    function)."""
    api = api or OP_API_NAMES[op]
    mesh, partial = lowering_mesh(ctx, api)
    layout = _runtime.group_layout(tuple(mesh.axis_names),
                                   tuple(int(mesh.shape[n]) for n in mesh.axis_names), axes)
    itemsize = np.dtype(avals[0].dtype).itemsize
    nbytes = sum(int(np.prod(a.shape, dtype=np.int64)) for a in avals) * itemsize
    if nbytes == 0:
        # No elements: nothing to exchange, so no call (xla_allreduce returns the operands).
        # A call would also let the group's rank 0 finish it, and start its next call, before
        # a peer has started this one: a call with data cannot end before every rank joins.
        return None
    requested = algorithm
    if algorithm == "auto":
        kind = _select.table_kind(mesh, platform)
        algorithm, _ = _select.choose(platform, nbytes, layout.nranks, kind, itemsize)
    if algorithm == _select.XLA_FALLBACK:
        return None
    check_cuda_module(platform, api)
    check_mesh_platform(mesh, platform, api)
    auto_from = _select.algorithms(_select.ALL_REDUCE) if requested == "auto" else ()
    _runtime.check_workspace(platform, algorithm, layout.nranks, itemsize, api, auto_from=auto_from)
    comm = _runtime.communicator(platform, mesh, axes)
    code = _runtime.algorithm_code(platform, comm, requested, algorithm, api)
    attrs = dict(comm=_runtime.comm_attribute(platform, comm), op=np.int32(OP_CODES[op]),
                 algorithm=np.int32(code), **site_attrs(ctx, platform))
    return Call(comm, attrs, partial, layout.nranks, nbytes, np.dtype(avals[0].dtype).name)


def site_attrs(ctx, platform: str) -> dict:
    """The custom call's "site" attribute on CPU devices: a number of its own in the module
    being lowered, so the same in every process that lowers the program. The CPU backend's
    ranks run a group's calls in the order its rank 0 runs them, and tell the calls apart by
    it: XLA's CPU runtime may hand a rank the calls of two independent blocks at once, in
    either order (csrc/cpu_backend.h: Turn). No attribute on GPUs, which run a device's calls
    in program order.

    Its low 16 bits count the module's calls from 1, in lowering order (the number that error
    messages give; after 65535 calls the count starts again at 1); the high bits are a hash of
    the module's name, so that a module lowered elsewhere and called from this one (a
    deserialized jax.export) numbers its calls apart from this module's own, unless the two
    share a name. Both parts depend only on the program, so JAX's persistent compilation cache
    finds its text again."""
    if platform != "cpu":
        return {}
    mc = ctx.module_context
    sites = mc.cached_primitive_lowerings.get(("jax_gin", "sites"))
    if sites is None:
        name = str(mc.module.operation.attributes["sym_name"])  # '"jit_step"'
        tag = zlib.crc32(name.encode()) & 0x7FFF  # the int32 attribute stays positive
        sites = mc.cached_primitive_lowerings[("jax_gin", "sites")] = (
            (tag << 16) | (n % 0xFFFF + 1) for n in itertools.count())
    return {"site": np.int32(next(sites))}


def one_device(ctx, axes) -> bool:
    """Whether mesh `axes` of the shard_map being lowered hold one device."""
    shape = ctx.module_context.axis_context.mesh.shape
    return all(int(shape[a]) == 1 for a in axes)


def xla_allreduce(ctx, xs, op: str, axes: tuple) -> list:
    """XLA's own all-reduce of `xs`, where `auto` chose it: over one device (a group of one
    rank) or of operands with no elements, the operands themselves, which is what it computes,
    and which also works inside a partially-manual shard_map, where XLA's partitioner rejects
    an all-reduce over a manual axis of size 1 (jax 0.11.2)."""
    if one_device(ctx, axes) or all(a.size == 0 for a in ctx.avals_in[-len(xs):]):
        return list(xs)
    return _compat.xla_allreduce_lowering(ctx, xs, op, axes)


def check_cuda_module(platform: str, api: str) -> None:
    if platform != "cpu" and _native.cuda is None:
        raise _native.no_cuda_error(f"jax_gin.{api}: a CUDA lowering was requested")


# Why a program that uses jax_gin is lowered for one platform, its mesh's devices' (the end of
# check_mesh_platform's and lowering_platform's refusals).
_OWN_PLATFORM_ONLY = ("jax_gin sets up its communicators on the mesh's devices while it lowers, "
                      "so a program that uses it is lowered for the platform of its own devices "
                      "only (a jax.export of it too, which also needs jax.export's check of "
                      "custom calls disabled: docs/debugging.md)")

# The platforms of jax.Device.platform that each lowering platform runs on.
_DEVICE_PLATFORMS = {"cpu": ("cpu",), "cuda": ("gpu", "cuda")}


def check_mesh_platform(mesh, platform: str, api: str) -> None:
    """A jax_gin call sets up its communicator on the mesh's devices while it is lowered, so a
    program is lowered for those devices' own platform: lowering for another one (jax.export
    or .lower(lowering_platforms=...) for GPUs on a machine of CPU devices) is refused here,
    before a communicator of the wrong kind is made."""
    kinds = sorted({d.platform for d in np.asarray(mesh.devices).flat})
    if any(k not in _DEVICE_PLATFORMS.get(platform, ()) for k in kinds):
        raise NotImplementedError(
            f"jax_gin.{api}: this program is lowered for {platform}, but its mesh's devices are "
            f"{', '.join(kinds)} devices; {_OWN_PLATFORM_ONLY}")


def lowering_mesh(ctx, api: str):
    """(mesh, partial) of the shard_map being lowered: its concrete Mesh, and whether some of
    its axes stay automatic (a partially-manual shard_map)."""
    axis_ctx = ctx.module_context.axis_context
    mesh = getattr(axis_ctx, "mesh", None)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        # A shard_map given no Mesh (e.g. one nested in another) lowers over the abstract
        # mesh of its context unless a concrete mesh is set; jax_gin needs the devices.
        raise ValueError(
            f"jax_gin.{api}: this shard_map has only an abstract mesh (axes "
            f"{dict(zip(mesh.axis_names, mesh.axis_sizes))}), and jax_gin needs its devices; "
            "run it under `with jax.set_mesh(mesh):` with the concrete Mesh")
    if mesh is None or not isinstance(mesh, jax.sharding.Mesh):
        raise NotImplementedError(
            f"jax_gin.{api} must be called inside jax.shard_map over a concrete Mesh "
            f"(got axis context {type(axis_ctx).__name__})")
    # A partially-manual shard_map (axis_names a subset of the mesh axes) is still
    # partitioned over its automatic axes after lowering: see _lower_partial.
    manual = frozenset(getattr(axis_ctx, "manual_axes", ()))
    # (An automatic axis is not bound in the body: _normalize_axes rejects it at trace time.)
    partial = bool(manual) and manual != frozenset(mesh.axis_names)
    return mesh, partial


def size_text(nbytes: int) -> str:
    """4096 -> '4 KiB', 1536 -> '1.5 KiB', 1049600 -> '1025 KiB', 100 -> '100 B',
    16388 -> '16388 B': exact, in the largest unit whose short figure (4 digits) gives the
    size, else in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            text = f"{nbytes / (1 << shift):.4g}"
            if float(text) * (1 << shift) == nbytes:
                return f"{text} {unit}"
    return f"{nbytes} B"


def lower_start(ctx, xs, avals_in, avals_out, call: Call, platform: str, slot: int,
                lanes: int):
    """The start of an asynchronous pair: (its order token, its results). It reduces in place
    (its results alias its inputs; every backend reads each element's sources before it
    writes its result), so XLA keeps the inputs alive and untouched until the done, which
    takes and returns those buffers, and the pair needs no buffer beyond its inputs. (XLA
    copies an input that is still needed afterwards, or that is a parameter of the program,
    before the start.) The order chain moves on to the start's token."""
    start_target, _ = _native.ASYNC_TARGETS[platform]
    k = len(xs)
    order = order_aval(platform)
    tok, *outs = jax.ffi.ffi_lowering(start_target,
                                      operand_output_aliases={2 + i: 1 + i for i in range(k)})(
        ctx.replace(avals_in=[TOKEN, order, *avals_in], avals_out=[order, *avals_out]),
        _compat.partition_id(), _chain_token(ctx, platform), *xs,
        max_lanes=np.int32(lanes), slot=np.int32(slot),
        copy_engine=np.int32(call.copy_engine(platform, k)), **call.attrs)
    _set_chain_token(ctx, tok, platform)
    return tok, outs


def lower_done(ctx, tok, bufs, avals, call: Call, platform: str, slot: int,
               has_side_effect: bool = False):
    """The done of an asynchronous pair: XLA's stream waits for the start's kernel. `bufs`
    are the start's results followed by any values the done must come after (they pass
    through, aliased). has_side_effect keeps XLA from removing a done whose results are
    unused while its start stays. `tok` is the start's order token (GPU); on CPU devices the
    done takes the order chain's, which the start moved on. The order chain moves on to the
    done's token."""
    _, done_target = _native.ASYNC_TARGETS[platform]
    k = len(bufs)
    order = order_aval(platform)
    if platform == "cpu":
        tok = _chain_token(ctx, platform)
    tok, *res = jax.ffi.ffi_lowering(done_target, has_side_effect=has_side_effect,
                                     operand_output_aliases={1 + i: 1 + i for i in range(k)})(
        ctx.replace(avals_in=[order, *avals], avals_out=[order, *avals]),
        tok, *bufs, comm=call.attrs["comm"], slot=np.int32(slot))
    _set_chain_token(ctx, tok, platform)
    return res


# Starts whose done is not lowered yet, in the module being lowered. No other jax_gin call may
# be lowered meanwhile: it would run on XLA's stream while the start's kernel runs on the side
# stream, and two calls of one communicator must never run at once.
def _open_starts(ctx) -> list:
    return ctx.module_context.cached_primitive_lowerings.setdefault(("jax_gin", "open_starts"), [])


def check_no_open_start(ctx, api: str, own: int = 0):
    """A ValueError where a start of psum_overlapping has a kernel in flight (not XLA's own
    all-reduce, nor a partially-manual shard_map's synchronous call); the last `own` starts
    are the caller's own (its earlier buckets)."""
    opened = _open_starts(ctx)
    if any(c is not None and not c.partial for c in opened[:len(opened) - own]):
        raise ValueError(
            f"jax_gin.{api} is called while an all-reduce of jax_gin.psum_overlapping is in "
            "flight (inside the function it runs beside the all-reduce); call it before or "
            "after psum_overlapping, or use jax.lax.psum there")


def _lower_partial(ctx, xs, platform: str, attrs: dict) -> list:
    """The lowering inside a partially-manual shard_map.

    XLA's partitioner still runs over the automatic axes after lowering, and it passes a custom
    call it knows nothing about the whole (all-gathered) operand. So each operand gets a call of
    its own to a target registered as batch partitionable (_native.PARTITIONED_TARGETS), with
    every dimension a batch dimension: the operand is reshaped to (*shape, 1), since the batch
    partitioner leaves the last dimension whole. It then hands the call each device's own
    shard, sharded as the operand is, and the device reduces its shard with the devices that
    share its automatic coordinates: the groups of a reduction over `axes` of the whole mesh,
    the same communicator as in a fully-manual shard_map. Shardy propagates shardings through
    the call by its sharding rule (elementwise on every dimension); GSPMD by the batch
    partitioner's own rule. The rank-0 operands (partition id, order token) and a rank-0
    operand (num_batch_dims 0) are replicated, which is all a scalar can be. (The batch
    partitioner takes its sharding from the operands in order; the scalars' replicated ones
    give way to the operand's: tests/test_partial_manual.py checks that nothing is gathered.)

    One call per operand: the batch partitioner gives all operands of a call one sharding of
    their leading dimensions, which operands of different shapes do not share. Synchronous
    only (overlap=True is ignored here): the batch partitioner rebuilds the call without its
    operand-output aliases, and a start/done pair needs them.
    """
    target = _native.PARTITIONED_TARGETS[platform]
    # uint32 order tokens on every platform: the batch partitioner takes no HLO tokens. These
    # calls chain per block (a partially-manual shard_map lowers all of its calls here).
    order = TOKEN
    pid = _partition_id(ctx)
    tok = _block_token(ctx, "u32")
    outs = []
    for x, a_in, a_out in zip(xs, ctx.avals_in, ctx.avals_out):
        rank = len(a_in.shape)
        b_in, b_out = a_in.update(shape=a_in.shape + (1,)), a_out.update(shape=a_out.shape + (1,))
        avals_in, avals_out = [TOKEN, order, b_in], [order, b_out]
        extra = {"mhlo.frontend_attributes": mlir.ir_attribute({"num_batch_dims": str(rank)})}
        if _compat.use_shardy():
            extra["sdy.sharding_rule"] = _compat.elementwise_sharding_rule(
                ctx, avals_in, avals_out, [(2, 1)])
        tok, out = jax.ffi.ffi_lowering(target, extra_attributes=extra)(
            ctx.replace(avals_in=avals_in, avals_out=avals_out),
            pid, tok, _compat.reshape(ctx, x, b_in), **attrs)
        outs.append(_compat.reshape(ctx, out, a_out))
    _set_block_token(ctx, tok, "u32")
    return outs


# The partition id (XLA's logical device id) as a uint32 scalar, where some mesh axes are
# automatic. There the partitioner rejects a bare PartitionId ("the meaning is ambiguous"), so
# it is computed in a nested shard_map that makes the remaining axes manual, as lax.axis_index
# does there; out_specs=P() with check_vma=False returns each device's own id unchanged.
_partition_id_p = Primitive("jax_gin_partition_id")
_partition_id_p.def_abstract_eval(lambda: jax.core.ShapedArray((), np.uint32))
mlir.register_lowering(_partition_id_p, lambda ctx: [_compat.partition_id()])


def _partition_id(ctx):
    inner = jax.shard_map(_partition_id_p.bind, in_specs=(), out_specs=jax.P(), check_vma=False)
    return mlir.lower_fun(lambda: [inner()], multiple_results=True)(
        ctx.replace(avals_in=[], avals_out=[jax.core.ShapedArray((), np.uint32)]))[0]


def _async_slots(ctx):
    """The event slots of the module's psum(overlap=True) pairs (_native.ASYNC_SLOTS per rank),
    counted in lowering order within the module, as sites are: every lowering of a program
    gives the same text, so JAX's persistent compilation cache finds it."""
    return ctx.module_context.cached_primitive_lowerings.setdefault(
        ("jax_gin", "async_slots"), itertools.count())


# Ordering. All jax_gin calls of one communicator must run in the same order on every rank,
# but XLA orders a custom call only by the values it takes. So every call takes an order token
# and returns the next one, which the next call in the same block takes.
# - On CPU devices the token is an HLO token. XLA's CPU runtime runs independent operations
#   concurrently, ordered by their buffers and by resources; an operation that takes or returns
#   a token uses a resource of the token's buffer, which kept the calls of jax.checkpoint's
#   recomputation and of a nested jit (functions of their own) in order, where uint32 tokens
#   let them run concurrently (jax 0.11.2; tests/test_order.py). Chains that nothing links (two
#   independent blocks) may still come to a rank at once: the CPU backend runs a group's calls
#   in its rank 0's order, by their site attribute (site_attrs).
# - On GPUs it is a uint32 scalar: XLA runs the calls on one stream in program order, and the
#   chain keeps a start/done pair and its neighbours in order within a block.
# - A partially-manual shard_map's calls (_lower_partial) chain uint32 tokens on every
#   platform: XLA's batch partitioner takes no HLO token operands.
def order_aval(platform: str):
    """The aval of a call's order token operand and result."""
    return _compat.TOKEN_AVAL if platform == "cpu" else TOKEN


def _chain(ctx, kind: str) -> list:
    """The (block, token) pairs of the module being lowered, for tokens of `kind` ("hlo" or
    "u32"). They are kept in a dict of its ModuleContext (which has __slots__), under a key of
    ours, so that they die with it."""
    return ctx.module_context.cached_primitive_lowerings.setdefault(
        ("jax_gin", "order_chain", kind), [])


def _block_token(ctx, kind: str):
    block = _compat.current_block()
    for b, tok in _chain(ctx, kind):
        if b == block:
            return tok
    return _compat.create_token() if kind == "hlo" else mlir.ir_constant(np.uint32(0))


def _set_block_token(ctx, tok, kind: str):
    block = _compat.current_block()
    chain = _chain(ctx, kind)
    chain[:] = [(b, t) for b, t in chain if b != block]
    chain.append((block, tok))


def _chain_token(ctx, platform: str):
    """The order token the next call in this block takes (order_aval(platform))."""
    return _block_token(ctx, "hlo" if platform == "cpu" else "u32")


def _set_chain_token(ctx, tok, platform: str):
    """`tok`, a call's order result, is what the next call in this block takes."""
    _set_block_token(ctx, tok, "hlo" if platform == "cpu" else "u32")


# ---------------------------------------------------------------------------------------
# Registration: every rule of the primitive, in one place.

PLATFORMS = ("cpu", "cuda")  # the platforms jax_gin lowers for


def lowering_platform(ctx, api: str) -> str:
    """The one platform (cpu or cuda) that a lowering of jax_gin.`api` is for, or a
    NotImplementedError: a program is lowered for its mesh's devices' platform only (see
    check_mesh_platform), so not for several at once (jax.export(..., platforms=[...]))."""
    platforms = tuple(getattr(ctx, "platforms", None) or ctx.module_context.platforms)
    if len(platforms) != 1:
        raise NotImplementedError(
            f"jax_gin.{api}: this program is lowered for several platforms at once "
            f"({', '.join(platforms)}); {_OWN_PLATFORM_ONLY}")
    if platforms[0] not in PLATFORMS:
        raise NotImplementedError(f"jax_gin.{api} has no lowering for platform {platforms[0]!r} "
                                  f"(only {' and '.join(PLATFORMS)})")
    return platforms[0]


# Every primitive whose lowering is a jax_gin call (register_lowering adds it): the calls that
# psum_overlapping's fn must not make (_overlap._refuse_calls_in).
COLLECTIVE_PRIMITIVES: set = set()


def register_lowering(prim, rule, api) -> None:
    """Registers `rule(ctx, *args, platform=..., **params)` as `prim`'s lowering: one rule for
    every platform, given the platform it lowers for (lowering_platform; `api`, the jax_gin
    function's name or a function of the params that gives it, names it in errors). Not a rule
    per platform: JAX (0.11.2) lowers a program for several platforms at once (jax.export's
    platforms=[...]) with a conditional over per-platform rules, which fails for an uncacheable
    primitive with a TypeError of its own ("can only concatenate list (not "tuple") to list")
    before any rule runs. Uncacheable: every call takes the previous call's order token
    (_chain)."""
    def lower(ctx, *args, **params):
        name = api(params) if callable(api) else api
        return rule(ctx, *args, platform=lowering_platform(ctx, name), **params)
    mlir.register_lowering(prim, lower, cacheable=False)
    COLLECTIVE_PRIMITIVES.add(prim)


def _impl(*xs, **params):
    raise NameError(
        f"jax_gin.{OP_API_NAMES[params['op']]} must be called inside jax.shard_map "
        f"(axes {params['axes']} are not bound here)")


allreduce_p.def_impl(_impl)
allreduce_p.def_effectful_abstract_eval(_abstract_eval)
ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_transposes[allreduce_p] = _transpose
_compat.batching.fancy_primitive_batchers[allreduce_p] = _batch
# Not cacheable: JAX would lower the first of several identical calls once and re-emit it for
# the others, with the first call's order token, which breaks the chain above.
register_lowering(allreduce_p, _lowering, lambda params: OP_API_NAMES[params["op"]])
