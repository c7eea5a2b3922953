"""jax_gin.explain: which algorithm `auto` runs for a value, and why."""
from __future__ import annotations

import math

import numpy as np

import jax

from . import _native, _scatter_gather, _select
from ._ops import OP_API_NAMES

MAX_RANKS = int(_native.cpu.MAX_RANKS)  # the largest group jax_gin runs (common.h kMaxRanks)
PLATFORMS = ("cpu", "cuda", "gpu")  # 'gpu': jax.default_backend() and Device.platform on CUDA
# The functions whose `auto` explain tells: the all-reduces (one rule for the three), then
# psum_scatter and all_gather.
COLLECTIVES = tuple(dict.fromkeys(OP_API_NAMES.values())) + _scatter_gather.API_NAMES


def explain(x, axis_name=None, *, nranks: int | None = None, platform: str | None = None,
            device_kind: str | None = None, collective: str = "psum") -> str:
    """Say which algorithm ``algorithm="auto"`` picks for `x`, and why.

    Call it inside shard_map with `axis_name`, or anywhere with `nranks` (the group size,
    1 to 128). `x` may be an array, a ShapeDtypeStruct or anything with shape and dtype.
    `platform`: 'cpu', or 'cuda' (also 'gpu', the name JAX gives CUDA devices); default the
    default backend's, and then `device_kind` defaults to the first device's (its tuning
    table, if any, decides).
    `collective`: 'psum' (default; pmax and pmin choose alike), 'pmax', 'pmin',
    'psum_scatter' or 'all_gather'. `x` is one device's input, and the size reported is
    the one `auto` decides on: for psum/pmax/pmin the bytes of `x`; for psum_scatter and
    all_gather the larger side per device, as nccl-tests' `size`: psum_scatter's input,
    all_gather's output (N times `x`), with each of the N blocks padded to 16 bytes as
    jax_gin lays them out.
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
    if nranks is None:
        if axis_name is None:
            raise TypeError("jax_gin.explain needs axis_name (inside shard_map) or nranks")
        from . import _compat
        axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
        nranks = math.prod(_compat.axis_size(a) for a in axes)
        if nranks > MAX_RANKS:
            raise ValueError(f"jax_gin.explain: axis {axis_name!r} has {nranks} devices; "
                             f"jax_gin runs groups of at most {MAX_RANKS}")
    if platform is None:
        platform = jax.default_backend()
        device_kind = device_kind or jax.devices()[0].device_kind
    nranks = int(nranks)
    if collective in _scatter_gather.API_NAMES:
        nbytes = _larger_side_bytes(x, collective, nranks)
        algo, why = _select.choose_collective(platform, nbytes, nranks, device_kind,
                                              api=collective)
        return (f"{algo}: {why} (platform {platform}, {nranks} ranks, {collective} of "
                f"{nbytes} bytes per device on the larger side)")
    nbytes = int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
    algo, why = _select.choose(platform, nbytes, nranks, device_kind)
    return f"{algo}: {why} (platform {platform}, {nranks} ranks, {nbytes} bytes per device)"


def _larger_side_bytes(x, api: str, nranks: int) -> int:
    """N blocks of the flat layout _scatter_gather lowers `x` to: complex values move as
    (real, imaginary) pairs, all_gather's bool as int32, and a block is padded to 16 bytes."""
    dtype = np.dtype(x.dtype)
    count = int(np.prod(np.shape(x), dtype=np.int64))
    if np.issubdtype(dtype, np.complexfloating):
        dtype, count = np.dtype(np.finfo(dtype).dtype), 2 * count
    elif dtype == np.bool_:
        dtype = np.dtype(np.int32)
    if api == "psum_scatter" and count % nranks:
        raise ValueError(f"jax_gin.explain: psum_scatter of {count} elements over {nranks} "
                         f"ranks: its input holds N equal blocks, so a multiple of {nranks}")
    block = count // nranks if api == "psum_scatter" else count
    return nranks * _scatter_gather._pad_to(block, dtype.itemsize) * dtype.itemsize
