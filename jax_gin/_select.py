"""Algorithm choice: which algorithm `algorithm="auto"` runs, and why."""
from __future__ import annotations

from ._ops import ALGORITHMS

# Model-based rule (performance.md): one_shot moves (N-1)*S per rank in one synchronization
# step, two_shot 2(N-1)/N*S in two, ring the same bytes in 2(N-1) steps, tree log2(N) steps.
# Small messages are latency-bound -> one_shot; large ones bandwidth-bound -> two_shot for
# small groups, ring for large ones (two_shot's all-to-all traffic does not scale).
SMALL_BYTES = {"cpu": 64 << 10, "cuda": 512 << 10}
RING_MIN_RANKS = 16


def choose(platform: str, nbytes: int, nranks: int) -> tuple[str, str]:
    """Returns (algorithm, reason)."""
    plat = "cpu" if platform == "cpu" else "cuda"
    if nranks <= 1:
        return "one_shot", "a group of one rank only copies"
    small = SMALL_BYTES[plat]
    if nbytes <= small:
        return "one_shot", f"{nbytes} B <= {small} B: latency-bound, one synchronization step"
    if nranks >= RING_MIN_RANKS:
        return "ring", f"{nranks} ranks >= {RING_MIN_RANKS}: nearest-neighbour traffic only"
    return "two_shot", f"{nbytes} B > {small} B with {nranks} ranks: moves 2(N-1)/N of the data"


def validate(algorithm, api: str) -> str:
    if algorithm == "auto" or algorithm in ALGORITHMS:
        return algorithm
    raise ValueError(
        f"jax_gin.{api}: unknown algorithm {algorithm!r}; expected 'auto' or one of "
        f"{', '.join(repr(a) for a in ALGORITHMS)}")
