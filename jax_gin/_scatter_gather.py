"""psum_scatter and all_gather: drop-ins for lax's, run by jax_gin's device-initiated
reduce-scatter and all-gather (include/jax_gin/collectives.h).

Two primitives work on a flat layout: `jax_gin_psum_scatter` takes N blocks of m elements
(N*m,) and returns the sum of block `rank` (m,); `jax_gin_all_gather` takes (m,) and returns
every rank's block in rank order (N*m,). Ranks are lax.axis_index of the reduced axes (the
tuple's row-major index). Each is the other's transpose. The public functions move the
scattered or gathered dimension to the front, flatten, and pad a block to a multiple of 16
bytes (the kernels move 16-byte vectors) in ordinary JAX operations around the primitive, so
lax's semantics for any dimension, `tiled`, pytrees and complex values need nothing more of
the primitives, and grad, vmap and jit see plain JAX around them. A pytree's leaves of one
dtype share a call, bucket by bucket: their blocks side by side (psum_scatter: (N, mp) blocks
concatenated along their second axis) make one flat operand.
"""
from __future__ import annotations

import functools
import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax, tree_util
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from . import _compat, _native, _primitive, _runtime, _select
from ._ops import (ALGORITHM_CODES, SUPPORTED_DTYPE_NAMES, SUPPORTED_DTYPES, refuse_keys,
                   refuse_symbolic)

API_NAMES = ("psum_scatter", "all_gather")
# lax.all_gather's `to`: the type of its result over the gathered axes under check_vma
GATHER_TO = ("varying", "invarying", "reduced")
psum_scatter_p = Primitive("jax_gin_psum_scatter")
all_gather_p = Primitive("jax_gin_all_gather")
_PRIMS = {"psum_scatter": psum_scatter_p, "all_gather": all_gather_p}


# ---------------------------------------------------------------------------------------
# Public API


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False,
                 algorithm: str = "auto", bucket_bytes: int | None = None,
                 axis_index_groups=None):
    """Sum over mesh axis `axis_name` (a name or a tuple of names), keeping on each device
    only its part; a drop-in for ``jax.lax.psum_scatter`` inside ``shard_map``.

    Device i (``lax.axis_index(axis_name)``) gets the sum of everyone's i-th slice of `x`
    along `scatter_dimension`: untiled, that dimension must have the axis size and is removed;
    tiled, its size must be a multiple of the axis size and is divided by it. `algorithm` is
    "auto", "one_shot" (each rank sends each peer its slice directly, one step) or "ring"
    (N-1 steps to the next rank).

    A pytree is scattered as few collectives: its leaves of one dtype go into buckets of at
    most `bucket_bytes` of input (default ``jax_gin.runtime.settings.bucket_bytes``, 64 MiB),
    in leaf order, and each bucket is one call on the leaves' blocks laid side by side. A leaf
    larger than `bucket_bytes` is a bucket of its own. The result is the same, bit for bit,
    as leaf by leaf. lax's `axis_index_groups` is accepted as None only.

    A value typed unreduced over the axes (JAX's pending partial sums, under check_vma) is
    summed as lax sums it (its unreduced_psum_scatter): the result varies over the axes, and
    its transpose is ``all_gather(..., to="reduced")``.
    """
    _primitive.check_no_groups(axis_index_groups, "psum_scatter")
    return _apply("psum_scatter", x, axis_name, scatter_dimension, tiled, algorithm,
                  bucket_bytes)


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False, algorithm: str = "auto",
               bucket_bytes: int | None = None, axis_index_groups=None, to: str = "varying"):
    """Every device's `x`, over mesh axis `axis_name`, in axis-index order; a drop-in for
    ``jax.lax.all_gather`` inside ``shard_map``.

    Untiled, the blocks are stacked along a new dimension at `axis`; tiled, concatenated
    along the existing dimension `axis`. `algorithm` is "auto", "one_shot" or "ring", as for
    psum_scatter. A pytree is gathered in buckets of at most `bucket_bytes` of output, as
    psum_scatter scatters one. lax's `axis_index_groups` is accepted as None only.

    `to` types the result over the axes as lax's does under check_vma: "varying" (the
    default; the transpose is a psum_scatter), "invarying" (every device holds the same
    value, so it can leave shard_map with ``out_specs=P()``; the transpose takes this
    device's slice of the cotangent, with no communication, as lax.all_gather_invariant's) or
    "reduced" (the transpose is a psum_scatter of the unreduced cotangent; needs check_vma).
    """
    if to not in GATHER_TO:
        raise ValueError(f"jax_gin.all_gather: to must be one of {', '.join(map(repr, GATHER_TO))}"
                         f", got {to!r}")
    _primitive.check_no_groups(axis_index_groups, "all_gather")
    return _apply("all_gather", x, axis_name, axis, tiled, algorithm, bucket_bytes, to)


def _apply(api, x, axis_name, dim, tiled, algorithm, bucket_bytes, to="varying"):
    algorithm = _select.validate(algorithm, api, _select.COLLECTIVE_ALGORITHMS)
    try:
        dim = _compat.concrete_int(dim)
    except TypeError:
        name = "scatter_dimension" if api == "psum_scatter" else "axis"
        raise TypeError(f"jax_gin.{api}: {name} must be an integer, got {dim!r}") from None
    # lax takes None as False, and 0 or 1
    if not (tiled is None or isinstance(tiled, (bool, np.bool_))
            or _runtime._is_int(tiled) and tiled in (0, 1)):
        raise TypeError(f"jax_gin.{api}: tiled must be True or False, got {tiled!r}")
    bucket_bytes = _primitive._check_bucket_bytes(bucket_bytes, api)
    axes = _primitive._normalize_axes(axis_name, api)
    if not axes:  # no axis: the input, as lax's (and psum's) collective over ()
        return x
    nranks = math.prod(_compat.axis_size(a) for a in axes)
    if nranks == 0:  # a vmapped axis of no elements: nothing to move, only lax's shapes
        return tree_util.tree_map(
            lambda leaf: _over_no_ranks(api, leaf, axes, int(dim), bool(tiled)), x)
    plan = _scatter_plan if api == "psum_scatter" else _gather_plan
    leaves, treedef = tree_util.tree_flatten(x)
    modes = [_mode(api, leaf, axes, to) for leaf in leaves]
    out = [None] * len(leaves)
    # A leaf sharded over a mesh axis that the shard_map leaves free (an Explicit axis in its
    # type) cannot be flattened without resharding it: lax's collective, which is what the
    # lowering runs in a partially-manual shard_map anyway.
    for i, leaf in enumerate(leaves):
        if _sharded_over_free_axes(leaf, api):
            out[i] = (lax.psum_scatter(leaf, axes, scatter_dimension=int(dim), tiled=bool(tiled))
                      if api == "psum_scatter" else
                      lax.all_gather(leaf, axes, axis=int(dim), tiled=bool(tiled), to=modes[i]))
    kept = [i for i in range(len(leaves)) if out[i] is None]
    # each leaf's operand: (N, mp) blocks to scatter, or an (mp,) block to gather
    operands, finishes = {}, {}
    for i in kept:
        operands[i], finishes[i] = plan(leaves[i], axes, nranks, int(dim), bool(tiled), modes[i])
    # (dtype, weak type, the axes it varies over, mode) -> indices of its leaves, in order. A
    # weakly typed leaf (from a Python scalar) keeps its weak type only in a bucket of weak
    # leaves: concatenated with a strong one it would come back strong, where lax's stays weak.
    groups: dict = {}
    vma = _compat.check_vma_enabled()
    for i, op in operands.items():
        t = jax.typeof(op)
        key = (np.dtype(op.dtype), t.weak_type, _compat.varying_axes(t) if vma else None,
               modes[i])
        groups.setdefault(key, []).append(i)
    for (dtype, _, _, mode), idx in groups.items():
        # a bucket's size is its larger side: N blocks of every leaf in it
        sizes = [nranks * operands[i].shape[-1] * dtype.itemsize for i in idx]
        for bucket in _primitive.buckets(sizes, bucket_bytes, max_operands=len(idx)):
            members = [idx[j] for j in bucket]
            widths = [operands[i].shape[-1] for i in members]
            cuts = np.cumsum(widths)[:-1].tolist()
            if api == "psum_scatter":
                blocks = jnp.concatenate([operands[i] for i in members], axis=1) \
                    if len(members) > 1 else operands[members[0]]
                y = psum_scatter_p.bind(blocks.reshape(-1), axes=axes, nranks=nranks,
                                        algorithm=algorithm, mode=mode)
                parts = jnp.split(y, cuts) if cuts else [y]
            else:
                flat = jnp.concatenate([operands[i] for i in members]) \
                    if len(members) > 1 else operands[members[0]]
                y = all_gather_p.bind(flat, axes=axes, nranks=nranks, algorithm=algorithm,
                                      mode=mode)
                y = y.reshape(nranks, sum(widths))
                parts = jnp.split(y, cuts, axis=1) if cuts else [y]
            for i, part in zip(members, parts):
                out[i] = finishes[i](part)
    return tree_util.tree_unflatten(treedef, out)


def _sharded_over_free_axes(leaf, api) -> bool:
    """Whether the leaf's type shards it over a mesh axis (an Explicit one: Auto and manual
    axes are not in a type's spec)."""
    spec = getattr(jax.typeof(_as_array(leaf, api)).sharding, "spec", None)
    return spec is not None and any(entry is not None for entry in spec)


def _mode(api, leaf, axes, to) -> str:
    """The flat primitive's `mode` for one leaf: all_gather's `to`; psum_scatter's
    "unreduced" for a value typed unreduced over the axes, else "varying". A ValueError for
    what lax refuses as well: gathering a pending sum, a value unreduced over some of the
    axes only, and to="reduced" without check_vma (no types to mark)."""
    unreduced = _compat.unreduced_axes(jax.typeof(_as_array(leaf, api))) & set(axes)
    if api == "all_gather":
        if unreduced:
            raise ValueError(f"jax_gin.all_gather: the input is unreduced over "
                             f"{sorted(unreduced)} (a pending sum); sum it first (jax_gin.psum "
                             "or psum_scatter), as lax.all_gather requires")
        if to == "reduced" and not _compat.check_vma_enabled():
            raise ValueError("jax_gin.all_gather: to='reduced' types the result reduced over "
                             "the axes, which needs shard_map's check_vma=True (as lax's does)")
        if to == "reduced":  # lax's all_gather_reduced: Varying -> Reduced
            aval = jax.typeof(_as_array(leaf, api))
            vma, reduced = _compat.varying_axes(aval), _compat.reduced_axes(aval) & set(axes)
            if not vma & set(axes):
                raise ValueError(f"jax_gin.all_gather: to='reduced' gathers a value that varies "
                                 f"over the axes {axes} (as lax's does); it varies over "
                                 f"{sorted(vma)}")
            if reduced:
                raise ValueError(f"jax_gin.all_gather: to='reduced' takes no input reduced over "
                                 f"the axes (as lax's); it is reduced over {sorted(reduced)}")
        if (to == "invarying" and _compat.ALL_GATHER_TO_NEEDS_CHECK_VMA
                and not _compat.check_vma_enabled()):
            return "varying"  # as the installed lax.all_gather: _compat
        return to
    if not unreduced:
        return "varying"
    if unreduced != set(axes):
        raise ValueError(f"jax_gin.psum_scatter: the input is unreduced over {sorted(unreduced)}"
                         f" but not over {sorted(set(axes) - unreduced)}; as lax's, the axes "
                         "must all be unreduced or none")
    _primitive.check_sum_kind(jax.typeof(_as_array(leaf, api)), api)
    return "unreduced"


def _canonical_dim(dim: int, ndim: int, api: str, name: str, shape, stacked: bool = False) -> int:
    """`dim` in [0, ndim), or a ValueError naming it; `stacked`: ndim counts the dimension
    that an untiled all_gather adds to a value of `shape`."""
    if not -ndim <= dim < ndim:
        if ndim == 0:
            raise ValueError(f"jax_gin.{api}: {name}={dim}, but a scalar has no dimension to "
                             f"{'scatter' if api == 'psum_scatter' else 'gather'} along")
        where = (f", whose stacked result has {ndim} dimensions" if stacked else "")
        raise ValueError(f"jax_gin.{api}: {name}={dim} is out of range for a value of shape "
                         f"{tuple(shape)}{where} (valid: {-ndim} to {ndim - 1})")
    return dim % ndim


# Integer dtypes that all_gather moves as the 32-bit words their bytes fill, which needs no
# arithmetic: lax.all_gather takes them, and their gradients are float0. (Floats that jax_gin does
# not reduce, such as float8, stay refused: their gathers' transposes would need sums of them.)
_PACKED = tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.uint64))
_WORD = np.dtype(np.uint32)


def moved_dtype(dtype, api: str) -> tuple[np.dtype, float]:
    """The element type `api` moves a value of `dtype` as, and how many of them make one
    value: a complex value as its (real, imaginary) pair, all_gather's bool as int32,
    all_gather's small integers (_PACKED) as uint32 words (a fraction of a word, or two, a
    value), and psum_scatter's uint64 as the int64 of the same bits (both sums wrap modulo
    2**64). Any other dtype that jax_gin does not move raises a TypeError (all_gather's PRNG
    keys never come here: _prepare moves their key data)."""
    refuse_keys(dtype, api)
    dt = np.dtype(dtype)
    if np.issubdtype(dt, np.complexfloating):
        return np.dtype(np.finfo(dt).dtype), 2
    if api == "psum_scatter" and dt == np.uint64:
        return np.dtype(np.int64), 1
    if api == "all_gather" and dt == np.bool_:
        return np.dtype(np.int32), 1
    if api == "all_gather" and dt in _PACKED and dt not in SUPPORTED_DTYPES:
        return _WORD, dt.itemsize / _WORD.itemsize
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(
            f"jax_gin.{api}: unsupported dtype {dt}; supported dtypes are "
            f"{', '.join(SUPPORTED_DTYPE_NAMES)}, complex64, complex128"
            + (f", bool, {', '.join(str(d) for d in _PACKED)}" if api == "all_gather"
               else ", uint64"))
    return dt, 1


def _as_array(leaf, api):
    """The leaf as a JAX array, or a TypeError that names `api` (a string is no scalar)."""
    try:
        leaf = jnp.asarray(leaf)
    except TypeError as e:
        raise TypeError(f"jax_gin.{api}: {e}") from None
    refuse_symbolic(leaf.shape, api)
    return leaf


def _prepare(leaf, axes, api, mode):
    """The leaf (an array: _as_array) as an array of a supported dtype, or of a _PACKED one
    (packed into words by _gather_plan): (array, how to undo the dtype change)."""
    undo = None
    if api == "all_gather" and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        # a key array moves as its key data (trailing dimensions of uint32), as lax's does
        impl = jax.random.key_impl(leaf)
        leaf = jax.random.key_data(leaf)
        undo = lambda y: jax.random.wrap_key_data(y, impl=impl)  # noqa: E731
    moved, _ = moved_dtype(leaf.dtype, api)
    if np.issubdtype(leaf.dtype, np.complexfloating):
        # a complex value moves (and sums) as its real and imaginary parts: a trailing axis
        leaf = jnp.stack([jnp.real(leaf), jnp.imag(leaf)], axis=-1)
        undo = lambda y: jax.lax.complex(y[..., 0], y[..., 1])  # noqa: E731
    elif leaf.dtype == np.bool_:  # all_gather's, as int32 (moved_dtype refuses psum_scatter's)
        leaf, undo = leaf.astype(moved), (lambda y: y.astype(np.bool_))
    elif leaf.dtype == np.uint64 and api == "psum_scatter":  # as int64, the same bits
        leaf = jax.lax.bitcast_convert_type(leaf, moved)
        undo = lambda y: jax.lax.bitcast_convert_type(y, np.uint64)  # noqa: E731
    if _compat.check_vma_enabled() and mode != "unreduced":
        leaf = _primitive.vary_over(leaf, axes, api, reduces=api == "psum_scatter")
    return leaf, undo


def _to_words(flat):
    """A flat block of a _PACKED dtype, whole 16-byte pieces of it, as uint32 words."""
    s = flat.dtype.itemsize
    if s < _WORD.itemsize:
        return jax.lax.bitcast_convert_type(flat.reshape(-1, _WORD.itemsize // s), _WORD)
    return jax.lax.bitcast_convert_type(flat, _WORD).reshape(-1)


def _from_words(y, dtype):
    """(N, w) words back to (N, m) values of `dtype` (the inverse of _to_words, per row)."""
    n, s = y.shape[0], np.dtype(dtype).itemsize
    if s < _WORD.itemsize:
        return jax.lax.bitcast_convert_type(y, dtype).reshape(n, -1)
    return jax.lax.bitcast_convert_type(y.reshape(n, -1, s // _WORD.itemsize), dtype)


def _over_no_ranks(api, leaf, axes, dim, tiled):
    """`api`'s result for one leaf over axes of no elements (a vmap of an empty batch), which
    no element of the batch ever holds: lax's shape and dtype, as a slice or zeros. The leaf is
    checked as over any axis (_gather_dim; _canonical_dim, the dtype, _check_scatter_size)."""
    leaf = _as_array(leaf, api)
    if api == "all_gather":
        d = _gather_dim(leaf, dim, tiled)
        return jax.lax.slice_in_dim(leaf if tiled else jnp.expand_dims(leaf, d), 0, 0, axis=d)
    d = _canonical_dim(dim, leaf.ndim, api, "scatter_dimension", leaf.shape)
    moved_dtype(leaf.dtype, api)
    _check_scatter_size(d, leaf.shape[d], tiled, 0, axes)
    return jnp.zeros(leaf.shape[:d] + leaf.shape[d + 1:], leaf.dtype)


def _check_scatter_size(d: int, size: int, tiled: bool, nranks: int, axes) -> None:
    """psum_scatter's rule for its scatter dimension d of `size` over `nranks` ranks, as lax's:
    tiled, a multiple of nranks; untiled, nranks itself."""
    if tiled and nranks == 0:  # (lax's fails with a ZeroDivisionError there)
        raise ValueError(f"jax_gin.psum_scatter: tiled, the scatter dimension is divided by the "
                         f"size of axis {_axes_text(axes)}, which is 0")
    if tiled and size % nranks:
        raise ValueError(f"jax_gin.psum_scatter: tiled scatter dimension {d} of size {size} is "
                         f"not divisible by the size of axis {_axes_text(axes)} ({nranks})")
    if not tiled and size != nranks:
        raise ValueError(f"jax_gin.psum_scatter: scatter dimension {d} has size {size}; untiled "
                         f"it must equal the size of axis {_axes_text(axes)} ({nranks})")


def _gather_dim(leaf, dim: int, tiled: bool) -> int:
    """all_gather's `axis` for `leaf`, in [0, ndim) tiled, in [0, ndim] stacked."""
    ndim, shape = np.ndim(leaf), np.shape(leaf)
    if not tiled:
        return _canonical_dim(dim, ndim + 1, "all_gather", "axis", shape, stacked=True)
    if ndim == 0:
        raise ValueError("jax_gin.all_gather: tiled=True needs an array with a dimension "
                         "to concatenate along, got a scalar")
    return _canonical_dim(dim, ndim, "all_gather", "axis", shape)


def _pad_to(m: int, itemsize: int) -> int:
    al = _runtime.ALIGN_BYTES // itemsize
    return -(-m // al) * al


def _scatter_plan(leaf, axes, nranks, dim, tiled, mode):
    """A leaf to scatter as (N, mp) blocks (block q: the rows device q gets, padded to 16
    bytes), and the function that turns its block of the sum, (mp,), into the result."""
    # (a complex leaf's parts are a trailing axis: the leaf's own dimensions keep their index)
    leaf = _as_array(leaf, "psum_scatter")
    d = _canonical_dim(dim, np.ndim(leaf), "psum_scatter", "scatter_dimension", np.shape(leaf))
    x, undo = _prepare(leaf, axes, "psum_scatter", mode)
    size = x.shape[d]
    _check_scatter_size(d, size, tiled, nranks, axes)
    moved = jnp.moveaxis(x, d, 0)  # (N * k, ...): block q is rows q*k .. q*k + k - 1
    rest = moved.shape[1:]
    k = size // nranks
    m = k * math.prod(rest)
    mp = _pad_to(m, x.dtype.itemsize)
    blocks = moved.reshape(nranks, m)
    if mp != m:
        blocks = jnp.pad(blocks, ((0, 0), (0, mp - m)))

    def finish(y):
        y = y[:m]
        y = jnp.moveaxis(y.reshape((k,) + rest), 0, d) if tiled else y.reshape(rest)
        return undo(y) if undo else y
    return blocks, finish


def _gather_plan(leaf, axes, nranks, dim, tiled, mode):
    """A leaf to gather as its (mp,) block (padded to 16 bytes), and the function that turns
    every device's block, (N, mp), into the result."""
    leaf = _as_array(leaf, "all_gather")
    d = _gather_dim(leaf, dim, tiled)
    x, undo = _prepare(leaf, axes, "all_gather", mode)
    moved = jnp.moveaxis(x, d, 0) if tiled else x
    m = int(np.prod(moved.shape, dtype=np.int64))
    mp = _pad_to(m, x.dtype.itemsize)
    flat = moved.reshape(m)
    if mp != m:
        flat = jnp.pad(flat, (0, mp - m))
    packed = np.dtype(x.dtype) not in SUPPORTED_DTYPES  # a _PACKED dtype (moved_dtype)
    if packed:
        flat = _to_words(flat)

    def finish(y):
        if packed:
            y = _from_words(y, x.dtype)
        y = y[:, :m]
        if tiled:
            y = y.reshape((nranks * moved.shape[0],) + moved.shape[1:])
            y = jnp.moveaxis(y, 0, d)
        else:
            y = jnp.moveaxis(y.reshape((nranks,) + x.shape), 0, d)
        return undo(y) if undo else y
    return flat, finish


def _axes_text(axes) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


# ---------------------------------------------------------------------------------------
# Rules of the flat primitives (params: axes, nranks, algorithm, mode). `mode` is the typing
# over the axes, as lax's collectives of each kind type it: "varying" in and out (both);
# all_gather's "invarying" (out invariant) and "reduced" (out reduced); psum_scatter's
# "unreduced" (in unreduced, out varying). It changes types and transposes, not the call.

# each mode's transpose: the other primitive's mode (all_gather's "invarying" transposes to a
# slice of the cotangent, _transpose)
_TRANSPOSED_MODE = {"varying": "varying", "reduced": "unreduced", "unreduced": "reduced"}


def _abstract_eval(api, x, *, axes, nranks, algorithm, mode):
    del algorithm
    for a in axes:
        if not _compat.axis_exists(a):
            raise NameError(f"jax_gin.{api}: unknown axis name {a!r}")
    unreduced = _compat.unreduced_axes(x) & set(axes)
    if mode == "unreduced":
        assert unreduced == set(axes), (unreduced, axes)  # _mode, or all_gather's transpose
    elif unreduced:
        raise ValueError(f"jax_gin.{api}: the input is unreduced over {sorted(unreduced)} (a "
                         "pending sum), which only psum_scatter takes")
    (n,) = x.shape
    if api == "psum_scatter":
        assert n % nranks == 0, (n, nranks)
        shape = (n // nranks,)
    else:
        shape = (n * nranks,)
    if _compat.check_vma_enabled() and mode != "unreduced":
        vma = _compat.varying_axes(x)
        need = set(axes) & _compat.manual_mesh_axes()
        if not need <= vma:
            raise ValueError(f"jax_gin.{api}: with check_vma=True the input must vary over "
                             f"{axes}; it varies over {sorted(vma)}")
    out = x.update(shape=shape)
    if mode != "varying":
        out = _compat.collective_type(out, axes, drop_varying=mode in ("invarying", "reduced"),
                                      add_reduced=mode == "reduced",
                                      add_varying=mode == "unreduced",
                                      drop_unreduced=mode == "unreduced")
    return out, {_compat.NamedAxisEffect(a) for a in axes}


def _transpose(api, ct, x, *, axes, nranks, algorithm, mode):
    if mode == "invarying":
        # every device holds the whole gathered value: the cotangent of this device's block is
        # its block of the cotangent, with no communication (lax.all_gather_invariant's)
        m = ct.shape[0] // nranks
        start = jax.lax.axis_index(axes) * m
        return [jax.lax.dynamic_slice_in_dim(ct, start.astype(np.int32), m)]
    # a reduce-scatter's transpose is the all-gather of its cotangent, and the other way round
    other = all_gather_p if api == "psum_scatter" else psum_scatter_p
    return [other.bind(ct, axes=axes, nranks=nranks, algorithm=algorithm,
                       mode=_TRANSPOSED_MODE[mode])]


def _batch(api, axis_data, vals_in, dims_in, *, axes, nranks, algorithm, mode):
    (x,), (d,) = vals_in, dims_in
    if mode in ("reduced", "unreduced"):
        raise NotImplementedError(f"jax_gin.{api} of a value typed {mode} under vmap "
                                  "(lax's does not batch either)")
    params = dict(axes=axes, nranks=nranks, algorithm=algorithm, mode=mode)
    prim = _PRIMS[api]
    if axis_data.name not in axes:
        if d is None:
            return prim.bind(x, **params), None
        # B batch elements: each rank's blocks stay contiguous if the batch goes inside them
        x = jnp.moveaxis(x, d, 0)
        b = x.shape[0]
        if api == "psum_scatter":
            m = x.shape[1] // nranks
            y = prim.bind(x.reshape(b, nranks, m).transpose(1, 0, 2).reshape(-1), **params)
            return y.reshape(b, m), 0
        m = x.shape[1]
        y = prim.bind(x.reshape(-1), **params)
        return y.reshape(nranks, b, m).transpose(1, 0, 2).reshape(b, nranks * m), 0
    if axes != (axis_data.name,):
        raise NotImplementedError(
            f"jax_gin.{api} over vmapped axis {axis_data.name!r} together with other axes "
            f"{tuple(a for a in axes if a != axis_data.name)} (lax does not support it either)")
    # the vmapped axis is the whole group: compute locally
    if api == "psum_scatter":
        if d is None:
            return (x * jnp.asarray(nranks, x.dtype)).reshape(nranks, -1), 0
        x = jnp.moveaxis(x, d, 0)
        return jnp.sum(x, axis=0, dtype=x.dtype).reshape(nranks, -1), 0
    if d is None:
        return jnp.tile(x, nranks), None
    return jnp.moveaxis(x, d, 0).reshape(-1), None


def _lowering(api, ctx, x, *, axes, nranks, algorithm, mode, platform):
    del mode  # types only
    (aval,) = ctx.avals_in
    mesh, partial = _primitive.lowering_mesh(ctx, api)
    itemsize = np.dtype(aval.dtype).itemsize
    nbytes = int(max(aval.shape[0], ctx.avals_out[0].shape[0])) * itemsize
    if nbytes == 0:  # no elements: no call (as _primitive.resolve_call says why)
        return [mlir.ir_constant(np.zeros(ctx.avals_out[0].shape, ctx.avals_out[0].dtype))]
    requested = algorithm
    if algorithm == "auto":
        kind = _select.table_kind(mesh, platform)
        algorithm, _ = _select.choose_collective(platform, nbytes, nranks, kind, api=api,
                                                 itemsize=itemsize)
    comm = None
    if not partial and algorithm != _select.XLA_FALLBACK:
        _primitive.check_cuda_module(platform, api)
        _primitive.check_mesh_platform(mesh, platform, api)
        auto_from = _select.algorithms(api) if requested == "auto" else ()
        _runtime.check_workspace(platform, algorithm, nranks, itemsize, api, collective=True,
                                 auto_from=auto_from)
        comm = _runtime.communicator(platform, mesh, axes)
        if _runtime.ranks_per_node(platform, comm) > 0:
            if requested != "auto":
                raise ValueError(
                    f"jax_gin.{api}: algorithm={requested!r} needs load/store access to every "
                    "peer, but this group spans nodes; use algorithm='auto', which runs XLA's "
                    f"own {api} there")
            comm = None
    if comm is None:
        # a partially-manual shard_map, a group that spans nodes, or auto's choice (from a
        # tuning table, or for a group of one rank): XLA's own collective, which over one
        # device is the operand itself (of the result's shape: (n // 1,) or (n * 1,))
        if nranks == 1:
            return [x]
        return _compat.xla_collective_lowering(ctx, x, api, axes, 0, True)
    _primitive.check_no_open_start(ctx, api)
    attrs = dict(comm=_runtime.comm_attribute(platform, comm),
                 op=np.int32(_native.COLLECTIVE_OPS[api]),
                 algorithm=np.int32(ALGORITHM_CODES[algorithm]),
                 **_primitive.site_attrs(ctx, platform))
    call = _primitive.Call(comm, attrs, False, nranks, nbytes, np.dtype(aval.dtype).name)
    order = _primitive.order_aval(platform)
    with call.named(api, platform, 1, False):
        tok, y = jax.ffi.ffi_lowering(_native.COLLECTIVE_TARGETS[platform])(
            ctx.replace(avals_in=[_primitive.TOKEN, order, aval], avals_out=[order, ctx.avals_out[0]]),
            _compat.partition_id(), _primitive._chain_token(ctx, platform), x, **attrs)
    _primitive._set_chain_token(ctx, tok, platform)
    return [y]


# ---------------------------------------------------------------------------------------
# Registration: every rule of both primitives, in one place.

for _api, _prim in _PRIMS.items():
    def _impl(*xs, _api=_api, **params):
        raise NameError(f"jax_gin.{_api} must be called inside jax.shard_map "
                        f"(axes {params['axes']} are not bound here)")
    _prim.def_impl(_impl)
    _prim.def_effectful_abstract_eval(
        lambda x, _api=_api, **p: _abstract_eval(_api, x, **p))
    ad.deflinear2(_prim, lambda ct, x, _api=_api, **p: _transpose(_api, ct, x, **p))
    _compat.batching.fancy_primitive_batchers[_prim] = (
        lambda axis_data, vals, dims, _api=_api, **p: _batch(_api, axis_data, vals, dims, **p))
    # Not cacheable: each call must take the previous call's order token (_primitive._chain).
    _primitive.register_lowering(_prim, functools.partial(_lowering, _api), _api)
