"""jax_gin.explain: which algorithm `auto` runs for a value, and why."""
from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import tree_util

from . import _compat, _native, _primitive, _runtime, _scatter_gather, _select
from ._ops import OP_API_NAMES, reduced_dtype, refuse_keys, refuse_symbolic

MAX_RANKS = int(_native.cpu.MAX_RANKS)  # the largest group jax_gin runs (common.h kMaxRanks)
PLATFORMS = ("cpu", "cuda", "gpu")  # 'gpu': jax.default_backend() and Device.platform on CUDA
# The functions whose `auto` explain tells: the all-reduces (one rule for the three), then
# psum_scatter and all_gather.
COLLECTIVES = tuple(dict.fromkeys(OP_API_NAMES.values())) + _scatter_gather.API_NAMES


def explain(x, axis_name=None, *, nranks: int | None = None, platform: str | None = None,
            device_kind: str | None = None, collective: str = "psum",
            bucket_bytes: int | None = None) -> str:
    """Say which algorithm ``algorithm="auto"`` picks for `x`, and why.

    Call it inside shard_map with `axis_name`, or anywhere with `nranks` (the group size,
    1 to 128); given both, they must agree. `x` is one device's input, as the collective
    takes it: an array, a ShapeDtypeStruct, a scalar, or a pytree of them, whose dtypes are
    taken as the collective takes them (under JAX's dtype rules, bool as int32 for the
    all-reduces, complex as its parts).
    `platform`: 'cpu', or 'cuda' (also 'gpu', the name JAX gives CUDA devices); default the
    default backend's. `device_kind` defaults to that of this machine's first device of
    `platform`, where it has one (its tuning table, if any, decides); else to none (the
    model-based rule). CPU devices of a job of several processes default to none too: over a
    CPU mesh that spans processes `auto` reads no table; pass ``device_kind="cpu"`` for a mesh
    whose devices are all in this process.
    `collective`: 'psum' (default; pmax and pmin choose alike), 'pmax', 'pmin',
    'psum_scatter' or 'all_gather'. The size reported is the one `auto` decides on: for
    psum/pmax/pmin the bytes of `x`; for psum_scatter and all_gather the larger side per
    device, as nccl-tests' `size`: psum_scatter's input, all_gather's output (N times `x`),
    with each of the N blocks padded to 16 bytes as jax_gin lays them out.
    A pytree is one call per dtype and bucket of at most `bucket_bytes` (as the collective
    takes it), and the answer has a line per call. psum, pmax and pmin reduce a constant
    without a call, as lax does, so its leaves make none: a Python scalar, and inside
    shard_map also a NumPy or concrete jax array (outside, an array stands for one device's
    input).
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"jax_gin.explain: unknown collective {collective!r}; expected one of "
                         f"{', '.join(repr(c) for c in COLLECTIVES)}")
    if nranks is not None and (isinstance(nranks, bool) or
                               not isinstance(nranks, (int, np.integer))
                               or not 1 <= nranks <= MAX_RANKS):
        raise ValueError(f"jax_gin.explain: nranks={nranks!r}: expected an integer from 1 to "
                         f"{MAX_RANKS} (the group sizes jax_gin runs)")
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"jax_gin.explain: unknown platform {platform!r}; expected one of "
                         f"{', '.join(repr(p) for p in PLATFORMS)}")
    if device_kind is not None and not isinstance(device_kind, str):
        raise TypeError(f"jax_gin.explain: device_kind must be a string (a Device.device_kind, "
                        f"such as 'NVIDIA H200'), got {device_kind!r}")
    if axis_name is not None:
        try:
            axes = _primitive._normalize_axes(axis_name, "explain")
        except NameError as err:
            if nranks is None or _compat.axes_in_scope():  # (inside shard_map: a misspelling)
                raise
            raise NameError(f"{str(err).rstrip('.')}. Outside shard_map, pass nranks alone "
                            "(no axis_name)") from None
        size = math.prod(_compat.axis_size(a) for a in axes)
        if nranks is not None and nranks != size:
            raise ValueError(f"jax_gin.explain: nranks={nranks} disagrees with axis "
                             f"{axis_name!r}, which has {size} devices")
        if size > MAX_RANKS:
            raise ValueError(f"jax_gin.explain: axis {axis_name!r} has {size} devices; "
                             f"jax_gin runs groups of at most {MAX_RANKS}")
        nranks = size
    elif nranks is None:
        raise TypeError("jax_gin.explain needs axis_name (inside shard_map) or nranks")
    bucket_bytes = _primitive._check_bucket_bytes(bucket_bytes, "explain")
    if platform is None:
        platform = jax.default_backend()
    if device_kind is None:
        device_kind = _local_device_kind(platform)
    nranks = int(nranks)
    try:
        calls = _calls(x, collective, nranks, bucket_bytes, traced=axis_name is not None)
    except TypeError as err:  # the collective's own refusal (a dtype it does not take)
        text = str(err)
        raise TypeError(text if text.startswith("jax_gin.explain") else
                        f"jax_gin.explain: {text}") from None
    if not calls:
        return (f"no call: every leaf is a constant, which {collective} reduces without "
                f"communication, as lax does (platform {platform}, {_ranks(nranks)})")
    lines = []
    for dtype, leaves, nbytes in calls:
        if nbytes == 0:
            line = (f"no call: 0 bytes per device, which need no communication (platform "
                    f"{platform}, {_ranks(nranks)})")
        else:
            scatter_gather = collective in _scatter_gather.API_NAMES
            what = (f"{collective} of {nbytes} bytes per device on the larger side"
                    if scatter_gather else f"{nbytes} bytes per device")
            if nranks == 1:  # auto lowers it to its operands (_select.ONE_RANK)
                algo, why = "no call", "a group of one rank, whose result is its input"
            elif scatter_gather:
                algo, why = _select.choose_collective(platform, nbytes, nranks, device_kind,
                                                      api=collective,
                                                      itemsize=np.dtype(dtype).itemsize)
            else:
                algo, why = _select.choose(platform, nbytes, nranks, device_kind,
                                           np.dtype(dtype).itemsize)
            line = f"{algo}: {why} (platform {platform}, {_ranks(nranks)}, {what})"
        lines.append(line if len(calls) == 1 else
                     f"call {len(lines) + 1}, {dtype}, leaves {_ranges(leaves)}: {line}")
    if len(calls) == 1:
        return lines[0]
    return "\n".join([f"{len(calls)} calls (a call per dtype and bucket of at most "
                      f"{bucket_bytes} bytes):"] + lines)


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _local_device_kind(platform: str) -> str | None:
    """The device kind of this machine's first device of `platform`, or None without one, or
    for CPU devices in a job of several processes (_select.table_kind reads no table for a CPU
    mesh that spans processes, which explain, given no mesh, takes it to be)."""
    if platform == "cpu" and jax.process_count() > 1:
        return None
    try:
        return jax.devices("gpu" if platform == "cuda" else platform)[0].device_kind
    except RuntimeError:  # no backend of that platform here
        return None


def _is_constant(leaf, collective: str, traced: bool) -> bool:
    """Whether the all-reduces take `leaf` as a constant, which they reduce without a call
    (_primitive.constants_apart): a Python scalar always; inside shard_map (`traced`) also a
    NumPy or concrete jax array, as there. Outside, an array stands for one device's input."""
    if collective in _scatter_gather.API_NAMES:
        return False  # psum_scatter and all_gather move constants too
    if isinstance(leaf, (bool, int, float, complex)):
        return True
    return traced and not isinstance(leaf, jax.ShapeDtypeStruct) and not _compat.is_tracer(leaf)


def _calls(x, collective: str, nranks: int, bucket_bytes: int, traced: bool = False) -> list:
    """The calls the collective makes for pytree `x`: (dtype moved, leaf indices, the bytes
    `auto` decides on), in the order the collective groups and buckets the leaves; none for
    the leaves the all-reduces take as constants."""
    leaves = tree_util.tree_leaves(x)
    if not leaves:
        raise ValueError("jax_gin.explain: the value has no leaves, so no call to explain")
    groups: dict = {}  # (dtype moved, weak) -> [(leaf index, bytes)]
    for i, leaf in enumerate(leaves):
        shape, dtype = _shape_dtype(leaf, collective)
        refuse_symbolic(shape, "explain")
        if _is_constant(leaf, collective, traced):
            continue
        count = int(np.prod(shape, dtype=np.int64))
        weak = False
        if collective in _scatter_gather.API_NAMES:
            moved, per_value = _scatter_gather.moved_dtype(dtype, collective)
            nbytes = _larger_side_bytes(count * per_value, moved, collective, nranks)
            # weakly typed leaves (Python scalars) are bucketed apart, as the collective does
            weak = bool(getattr(leaf, "weak_type", False)) or (
                isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool))
        else:
            moved, per_value = reduced_dtype(dtype, collective)
            nbytes = count * per_value * moved.itemsize
        groups.setdefault((moved, weak), []).append((i, nbytes))
    calls = []
    for (dtype, _), members in groups.items():
        sizes = [b for _, b in members]
        limit = (_primitive.MAX_OPERANDS if collective not in _scatter_gather.API_NAMES
                 else len(members))
        for bucket in _primitive.buckets(sizes, bucket_bytes, max_operands=limit):
            calls.append((dtype, [members[j][0] for j in bucket], sum(sizes[j] for j in bucket)))
    return calls


def _shape_dtype(leaf, collective: str):
    """A leaf's shape and dtype as the collective takes it (JAX's dtype rules: float64 is
    float32 without x64, a Python scalar is its default type; all_gather's PRNG keys are their
    key data)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            if collective != "all_gather":
                refuse_keys(leaf.dtype, collective)
            spec = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            return tuple(spec.shape), np.dtype(spec.dtype)
        return tuple(leaf.shape), np.dtype(jax.dtypes.canonicalize_dtype(leaf.dtype))
    try:
        spec = jax.eval_shape(jnp.asarray, leaf)
    except TypeError as e:
        raise TypeError(f"jax_gin.explain: {leaf!r} is not an array, a ShapeDtypeStruct or a "
                        f"scalar") from e
    return tuple(spec.shape), np.dtype(spec.dtype)


def _ranges(indices) -> str:
    """Leaf indices as a range where they are consecutive, else listed."""
    if len(indices) > 1 and indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}"
    return ", ".join(map(str, indices))


def _larger_side_bytes(count, moved, api: str, nranks: int) -> int:
    """N blocks of the flat layout _scatter_gather lowers a leaf of `count` elements of
    `moved` to (moved_dtype's; packed words: a fraction), each block padded to 16 bytes."""
    if api == "psum_scatter" and count % nranks:
        raise ValueError(f"jax_gin.explain: psum_scatter of {count} elements over {nranks} "
                         f"ranks: its input holds N equal blocks, so a multiple of {nranks}")
    block_bytes = int((count // nranks if api == "psum_scatter" else count) * moved.itemsize)
    return nranks * -(-block_bytes // _runtime.ALIGN_BYTES) * _runtime.ALIGN_BYTES
