"""The inputs of the collectives benchmark (jax_gin.bench): the swept sizes, the exact values
every device reduces or gathers with their numpy reference, the chain steps that keep them
exact, and the check of a result against them. The method is described in jax_gin.bench's
module doc."""
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
    """A host array as a global jax.Array; in several processes each puts only its shards
    (jax.device_put would compare the array across processes, which fails where they hold
    different numbers of devices)."""
    if jax.process_count() == 1:
        return jax.device_put(a, sharding)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


# ---------------------------------------------------------------------------------------
# Inputs and reference


@dataclasses.dataclass
class Inputs:
    """Host arrays for one (count, dtype, op) on `nranks` devices."""

    x: np.ndarray      # (nranks, count): what each device reduces
    ref: np.ndarray    # (count,): the exact all-reduce of x (psum_scatter, all_gather:
    #                    (nranks, L) or (1, L), row i device i's exact result)
    corr: np.ndarray   # (nranks, count): ref - x, so that allreduce(x) - corr == x exactly
    #                    (psum_scatter, all_gather: (nranks, 1), device i's result[0] - x[i, 0])
    op: str = "sum"

    def chain_result(self, k: int, step: str) -> np.ndarray:
        """What the last op of a chain of k returns: ref for the subtract and restore steps;
        for the slice step ref * N^(k-1) (sums; exact by slice_is_exact), with element 0 =
        ref[0]."""
        if step in ("subtract", RESTORE_STEP) or self.op != "sum" or k == 1:
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


# The chain step of psum_scatter and all_gather, whose result does not have the input's
# shape: y[0] <- op(y)[0] - corr, which is x[0] again (see jax_gin.bench's module doc).
RESTORE_STEP = "restore"


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


# The redop column of psum_scatter and all_gather (the all-reduce's ops are -o's); nccl-tests
# prints "none" for an all-gather.
COLLECTIVE_OPS = {"psum_scatter": "sum", "all_gather": "none"}


def make_collective_inputs(collective: str, nranks: int, block: int, dtype,
                           seed: int = 0) -> Inputs:
    """psum_scatter: each device holds N blocks of `block` elements and device i's result is
    the sum of everyone's block i (ref row i); all_gather: each device holds one block and
    every device's result is all of them in rank order (ref's one row). The values are
    make_inputs' (exact); corr[i] = device i's result[0] - x[i, 0], for the restore step."""
    if collective == "psum_scatter":
        inp = make_inputs(nranks, nranks * block, dtype, "sum", seed)
        x, ref = inp.x, inp.ref.reshape(nranks, block)
    else:
        x = make_inputs(nranks, block, dtype, "sum", seed).x
        ref = x.reshape(1, -1)
    first = np.broadcast_to(ref[:, :1], (nranks, 1))
    corr = _cast(first.astype(np.float64) - x[:, :1].astype(np.float64), dtype)
    return Inputs(x=x, ref=ref, corr=corr, op=COLLECTIVE_OPS[collective])


def reference(vals: np.ndarray, op: str) -> np.ndarray:
    return {"sum": np.sum, "max": np.max, "min": np.min}[op](vals, axis=0)


def _cast(a: np.ndarray, dtype) -> np.ndarray:
    if jnp.issubdtype(dtype, jnp.integer):
        return a.astype(np.int64).astype(dtype)
    return a.astype(np.float64).astype(dtype)  # small integers: exact in every float type


def count_wrong(out, ref: np.ndarray, nranks: int) -> int:
    """Elements of the (nranks * L,) result that differ from ref on any device (each
    device's shard is its whole result): ref is (L,), every device's result, or (nranks, L),
    row i device i's, or (1, L). With several processes each checks its own devices'
    shards and the counts are summed over the processes."""
    want = np.broadcast_to(ref, (nranks, ref.shape[-1]))
    if getattr(out, "is_fully_addressable", True):
        got = np.asarray(out).reshape(nranks, -1)
        return int(np.count_nonzero(got != want))
    flat = want.reshape(-1)
    mine = sum(int(np.count_nonzero(np.asarray(sh.data) != flat[sh.index[0]]))
               for sh in out.addressable_shards)
    return _sum_over_processes(mine)


_sums = [0]  # _sum_over_processes calls in this process: the same count in every process


def _sum_over_processes(mine: int) -> int:
    """The sum of every process's `mine`, through the jax.distributed key-value store (JAX's
    multihost_utils.process_allgather fails where processes hold different numbers of
    devices)."""
    from . import _distributed
    client = _distributed.distributed_client()
    key = f"{_distributed.KV_PREFIX}/bench/sum{_sums[0]}"
    _sums[0] += 1
    client.key_value_set(f"{key}/{jax.process_index()}", str(mine))
    return sum(int(client.blocking_key_value_get(f"{key}/{p}", 600_000))
               for p in range(jax.process_count()))

