"""jax_gin.explain: which algorithm `auto` runs for a value, and why."""
from __future__ import annotations

import math

import numpy as np

import jax

from . import _select


def explain(x, axis_name=None, *, nranks: int | None = None, platform: str | None = None,
            device_kind: str | None = None) -> str:
    """Say which algorithm ``algorithm="auto"`` picks for reducing `x`, and why.

    Call it inside shard_map with `axis_name`, or anywhere with `nranks` (the group size).
    `x` may be an array, a ShapeDtypeStruct or anything with shape and dtype.
    """
    if nranks is None:
        if axis_name is None:
            raise TypeError("jax_gin.explain needs axis_name (inside shard_map) or nranks")
        from . import _compat
        axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
        nranks = math.prod(_compat.axis_size(a) for a in axes)
    if platform is None:
        platform = jax.default_backend()
        device_kind = device_kind or jax.devices()[0].device_kind
    nbytes = int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
    algo, why = _select.choose(platform, nbytes, nranks, device_kind)
    return f"{algo}: {why} (platform {platform}, {nranks} ranks, {nbytes} bytes per device)"
