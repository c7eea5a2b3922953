"""jax_gin.explain: which algorithm `auto` runs for a value, and why."""
from __future__ import annotations

import math

import numpy as np

import jax

from . import _native, _select

MAX_RANKS = int(_native.cpu.MAX_RANKS)  # the largest group jax_gin runs (common.h kMaxRanks)
PLATFORMS = ("cpu", "cuda", "gpu")  # 'gpu': jax.default_backend() and Device.platform on CUDA


def explain(x, axis_name=None, *, nranks: int | None = None, platform: str | None = None,
            device_kind: str | None = None) -> str:
    """Say which algorithm ``algorithm="auto"`` picks for reducing `x`, and why.

    Call it inside shard_map with `axis_name`, or anywhere with `nranks` (the group size,
    1 to 128). `x` may be an array, a ShapeDtypeStruct or anything with shape and dtype.
    `platform`: 'cpu', or 'cuda' (also 'gpu', the name JAX gives CUDA devices); default the
    default backend's.
    """
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
    nbytes = int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
    algo, why = _select.choose(platform, nbytes, nranks, device_kind)
    return f"{algo}: {why} (platform {platform}, {nranks} ranks, {nbytes} bytes per device)"
