"""Names and codes shared with the native code: the lists in include/jax_gin/common.h, read
from the native module."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from ._native import cpu as _cpu

# The public algorithms, by code (enum class Algorithm in common.h).
ALGORITHMS = tuple(_cpu.algorithm_names())
# What `auto` may also pick: XLA's own all-reduce (the one lax.psum lowers to), from a tuning
# table in the sizes where it was measured faster than every jax_gin algorithm (as vLLM's
# custom all-reduce hands sizes it does not win back to NCCL), and for a group of one rank,
# where no call is needed. Not selectable by name.
XLA_FALLBACK = "xla"
ALGORITHM_CODES = {name: i for i, name in enumerate(ALGORITHMS)}

# Reduction ops by code, and the jax_gin function of each (JAX_GIN_REDOPS in common.h).
_OP_NAMES = tuple(tuple(pair) for pair in _cpu.op_names())
OPS = tuple(name for name, _ in _OP_NAMES)
OP_CODES = {name: i for i, name in enumerate(OPS)}
OP_API_NAMES = dict(_OP_NAMES)

# Supported element types, by code (JAX_GIN_DTYPES in common.h).
SUPPORTED_DTYPES = tuple(np.dtype(getattr(jnp, name)) for name in _cpu.dtype_names())
SUPPORTED_DTYPE_NAMES = tuple(str(d) for d in SUPPORTED_DTYPES)


def refuse_symbolic(shape, name: str) -> None:
    """Raise jax_gin.`name`'s ValueError for a shape with a symbolic dimension (jax.export's
    shape polymorphism): a call's buckets, rounds and workspace checks are sized at lowering,
    from the bytes it moves."""
    if not all(isinstance(d, (int, np.integer)) for d in shape):
        raise ValueError(
            f"jax_gin.{name}: shape {tuple(shape)} has a symbolic dimension; jax_gin's calls "
            "are sized when they are lowered, so they take concrete shapes only (export with "
            "concrete shapes)")


def refuse_keys(dtype, name: str) -> None:
    """Raise jax_gin.`name`'s TypeError for a PRNG key array, which has no arithmetic (only
    all_gather moves keys, as their key data)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(f"jax_gin.{name}: {dtype} is a PRNG key array, which has no "
                        "arithmetic to reduce with; jax_gin.all_gather moves keys")


def reduced_dtype(dtype, api: str) -> tuple[np.dtype, int]:
    """The element type an all-reduce (`api`: psum, pmax or pmin) of `dtype` runs on, and how
    many of them make one value: bool as int32 (lax.psum's result; pmax and pmin give bool
    back), a complex value of psum as its (real, imaginary) pair, psum's uint64 as the int64
    of the same bits (both sums wrap modulo 2**64). Any other dtype that jax_gin does not
    reduce raises the op's TypeError."""
    refuse_keys(dtype, api)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return np.dtype(np.int32), 1
    if np.issubdtype(dt, np.complexfloating) and api == "psum":
        return np.dtype(np.finfo(dt).dtype), 2
    if dt == np.uint64 and api == "psum":
        return np.dtype(np.int64), 1
    check_dtype(dt, api)
    return dt, 1


def check_dtype(dtype, api: str, name: str | None = None) -> None:
    """Raise the TypeError of all-reduce `api` (psum, pmax, pmin, or another caller's name:
    jax_gin's dtypes only) for a dtype it does not reduce; psum takes complex values too. The
    message names `name` (default `api`), the function the user called."""
    name = name or api
    refuse_keys(dtype, name)
    dt = np.dtype(dtype)
    if np.issubdtype(dt, np.complexfloating):
        if api in ("pmax", "pmin"):
            raise TypeError(f"jax_gin.{name}: complex values have no order ({dt}); sums take them")
        if api == "psum":
            return
    if dt == np.uint64 and api == "psum":
        return
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(
            f"jax_gin.{name}: unsupported dtype {dt}; supported dtypes are "
            f"{', '.join(SUPPORTED_DTYPE_NAMES)} (and complex64, complex128 and uint64 for sums)"
        )
