"""The inputs of the all-reduce benchmark (jax_gin.bench): the swept sizes, the exact values
every device reduces with their numpy reference, the chain steps that keep them exact, and the
check of a result against them. The method is described in jax_gin.bench's module doc."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

# ---------------------------------------------------------------------------------------
# Sizes


SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def format_size(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= SIZE_UNITS[unit] and nbytes % SIZE_UNITS[unit] == 0:
            return f"{nbytes // SIZE_UNITS[unit]}{unit}"
    return str(nbytes)


def size_steps(minbytes: int, maxbytes: int, factor: int) -> list:
    sizes, s = [], minbytes
    while s <= maxbytes:
        sizes.append(s)
        s *= factor
    return sizes


def put_global(a: np.ndarray, sharding: NamedSharding):
    """A host array as a global jax.Array; in several processes each puts only its shards."""
    if jax.process_count() == 1:
        return jax.device_put(a, sharding)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


# ---------------------------------------------------------------------------------------
# Inputs and reference


@dataclasses.dataclass
class Inputs:
    """Host arrays for one (count, dtype, op) on `nranks` devices."""

    x: np.ndarray      # (nranks, count): what each device reduces
    ref: np.ndarray    # (count,): the exact all-reduce of x
    corr: np.ndarray   # (nranks, count): ref - x, so that allreduce(x) - corr == x exactly
    op: str = "sum"

    def chain_result(self, k: int, step: str) -> np.ndarray:
        """What the last all-reduce of a chain of k returns: ref for the subtract step; for
        the slice step ref * N^(k-1) (sums; exact by slice_is_exact), with element 0 = ref[0]."""
        if step == "subtract" or self.op != "sum" or k == 1:
            return self.ref
        n = self.x.shape[0]
        out = (self.ref.astype(np.float64) * float(n) ** (k - 1)).astype(self.ref.dtype) \
            if not np.issubdtype(self.ref.dtype, np.integer) else self.ref * self.ref.dtype.type(n ** (k - 1))
        out[0] = self.ref[0]
        return out


def _growth_bits(nranks: int, k: int, op: str):
    """Bits a slice chain of k ops grows the values by; None: not exact (N not a power of two)."""
    if op != "sum" or nranks == 1:
        return 0
    if nranks & (nranks - 1):
        return None
    return (k - 1) * (nranks.bit_length() - 1)


def f16_scale_exp(nranks: int, k: int, op: str) -> int:
    """float16 inputs are scaled by 2^-s so that a slice chain stays below 2^15 (max 65504):
    s is the growth beyond 15 bits, and at most 22 so that 3 * 2^-s stays exact."""
    g = _growth_bits(nranks, k, op) or 0
    top = g + math.log2(3 * nranks)  # bits of the largest value at the end of the chain
    return max(0, math.ceil(top - 15 + 1))


def slice_is_exact(nranks: int, k: int, dtype, op: str) -> bool:
    """Whether the slice chain step gives exact values (see the module doc)."""
    g = _growth_bits(nranks, k, op)
    if g is None:
        return False
    dtype = jnp.dtype(dtype)
    top = g + math.log2(3 * nranks) + 1
    if jnp.issubdtype(dtype, jnp.integer):
        return top < jnp.iinfo(dtype).bits - 1
    if dtype == jnp.float16:
        return f16_scale_exp(nranks, k, op) <= 22
    return top < jnp.finfo(dtype).maxexp - 2  # float32, bfloat16, float64: exponent range


def chain_step_for(requested: str, nranks: int, k: int, dtype, op: str) -> str:
    if requested == "subtract" or (requested == "auto" and not slice_is_exact(nranks, k, dtype, op)):
        return "subtract"
    return "slice"


def make_inputs(nranks: int, count: int, dtype, op: str, seed: int = 0, scale_exp: int = 0) -> Inputs:
    """Small nonzero integers (|v| <= 3; 1..3 for unsigned types), times 2^-scale_exp (floats
    only): never zeros, and every sum over up to ~80 ranks is exact even in bfloat16 (8
    significant bits)."""
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(seed)
    mag = rng.integers(1, 4, size=(nranks, count), dtype=np.int64)
    unsigned = jnp.issubdtype(dtype, jnp.unsignedinteger)
    vals = mag if unsigned else mag * rng.choice(np.array([-1, 1]), size=mag.shape)
    ref = reference(vals, op)
    if scale_exp and not jnp.issubdtype(dtype, jnp.integer):
        scale = 2.0 ** -scale_exp  # exact: a power of two
        return Inputs(x=_cast(vals * scale, dtype), ref=_cast(ref * scale, dtype),
                      corr=_cast((ref[None, :] - vals) * scale, dtype), op=op)
    # Integers of any width are computed in int64 and cast: an unsigned negative correction
    # wraps around, and the wrapped subtraction on the device still gives x back exactly.
    return Inputs(x=_cast(vals, dtype), ref=_cast(ref, dtype),
                  corr=_cast(ref[None, :] - vals, dtype), op=op)


def reference(vals: np.ndarray, op: str) -> np.ndarray:
    return {"sum": np.sum, "max": np.max, "min": np.min}[op](vals, axis=0)


def _cast(a: np.ndarray, dtype) -> np.ndarray:
    if jnp.issubdtype(dtype, jnp.integer):
        return a.astype(np.int64).astype(dtype)
    return a.astype(np.float64).astype(dtype)  # small integers: exact in every float type


def count_wrong(out, ref: np.ndarray, nranks: int) -> int:
    """Elements of the (nranks * count,) result that differ from ref on any device (each
    device's shard is its whole result). With several processes each checks its own devices'
    shards and the counts are summed over the processes."""
    if getattr(out, "is_fully_addressable", True):
        got = np.asarray(out).reshape(nranks, -1)
        return int(np.count_nonzero(got != ref[None, :]))
    from jax.experimental import multihost_utils
    mine = sum(int(np.count_nonzero(np.asarray(sh.data) != ref)) for sh in out.addressable_shards)
    return int(np.sum(multihost_utils.process_allgather(np.array([mine], np.int64))))

