"""Names and codes shared with the native code (include/jax_gin/common.h)."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

# The order matches enum class Algorithm in common.h.
ALGORITHMS = ("ring", "tree", "one_shot", "two_shot")
# What `auto` may also pick, from a tuning table only: XLA's own all-reduce (the one lax.psum
# lowers to), in the sizes where it was measured faster than every jax_gin algorithm, as vLLM's
# custom all-reduce hands sizes it does not win back to NCCL. Not selectable by name.
XLA_FALLBACK = "xla"
ALGORITHM_CODES = {name: i for i, name in enumerate(ALGORITHMS)}

# The order matches enum class RedOp in common.h.
OPS = ("sum", "max", "min")
OP_CODES = {name: i for i, name in enumerate(OPS)}
OP_API_NAMES = {"sum": "psum", "max": "pmax", "min": "pmin"}

# Supported element types (enum class DType in common.h).
SUPPORTED_DTYPES = tuple(
    np.dtype(d)
    for d in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int64, jnp.uint32)
)
SUPPORTED_DTYPE_NAMES = tuple(str(d) for d in SUPPORTED_DTYPES)


def check_dtype(dtype, api: str) -> None:
    dt = np.dtype(dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(
            f"jax_gin.{api}: unsupported dtype {dt}; supported dtypes are "
            f"{', '.join(SUPPORTED_DTYPE_NAMES)}"
        )
