"""Loads the native modules and registers their FFI targets with XLA.

The CPU module (_jax_gin) is always built. The CUDA module (_jax_gin_cuda) exists only where
the package was built with nvcc and NCCL's headers; without it, CPU use is unaffected and a
CUDA lowering raises a NotImplementedError (no_cuda_error).
"""
from __future__ import annotations

import importlib.util
import os

import jax

try:
    from . import _jax_gin as cpu  # noqa: F401
except ImportError:
    # A package folder without the module is a source tree that was never built, found first
    # on the path (Python run from the repository's root shadows an installed jax_gin);
    # Python's own error blames "most likely a circular import".
    if importlib.util.find_spec(f"{__package__}._jax_gin") is not None:
        raise
    raise ImportError(
        f"jax_gin's CPU extension (_jax_gin) is not built in {os.path.dirname(__file__)}: a "
        "source tree without a build, which also hides an installed jax_gin where Python runs "
        "from the repository's root; run from another directory, or build it in place (bash "
        "scripts/setup.sh, or pip install --no-build-isolation -e .)") from None

CPU_TARGET = "jax_gin_all_reduce_cpu"
CUDA_TARGET = "jax_gin_all_reduce_cuda"
# The asynchronous pair (psum(..., overlap=True)): "start" and "done" per platform.
ASYNC_TARGETS = {"cpu": ("jax_gin_all_reduce_start_cpu", "jax_gin_all_reduce_done_cpu"),
                 "cuda": ("jax_gin_all_reduce_start_cuda", "jax_gin_all_reduce_done_cuda")}
# The synchronous targets once more under these names, registered with XLA as batch
# partitionable: a partially-manual shard_map lowers to them (_primitive._lower_partial), so
# that XLA's partitioner hands each device its own shard. The names of their own keep every
# other call away from that partitioner.
PARTITIONED_TARGETS = {"cpu": CPU_TARGET + "_partitioned", "cuda": CUDA_TARGET + "_partitioned"}
# psum_scatter and all_gather (include/jax_gin/collectives.h): one target per platform, the
# collective named by the call's `op` attribute (COLLECTIVE_OPS).
COLLECTIVE_TARGETS = {"cpu": "jax_gin_collective_cpu", "cuda": "jax_gin_collective_cuda"}
COLLECTIVE_OPS = dict(cpu.collective_ops())  # {"psum_scatter": code, "all_gather": code}
# Event slots per rank of start/done pairs (include/jax_gin/common.h kAsyncSlots).
ASYNC_SLOTS = int(cpu.ASYNC_SLOTS)


def _register(registrations: dict, platform: str, sync_target: str, partitioned: str) -> None:
    for name, capsule in registrations.items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
    # The CPU module has a handler of its own for it (a uint32 order token, where the
    # synchronous target takes an HLO token); the CUDA target is the synchronous one.
    if partitioned not in registrations:
        jax.ffi.register_ffi_target(partitioned, registrations[sync_target], platform=platform)
    jax.ffi.register_ffi_target_as_batch_partitionable(partitioned)


_register(cpu.registrations(), "cpu", CPU_TARGET, PARTITIONED_TARGETS["cpu"])

try:  # the CUDA module may be absent
    from . import _jax_gin_cuda as cuda  # type: ignore[attr-defined]
except ImportError as _e:  # pragma: no cover - depends on the build
    cuda = None
    # Why it did not load, where the module is there (a library it needs is missing, say).
    # Where it is not (a build without CUDA), None: Python's ImportError for a name missing
    # from a package still being imported blames "most likely a circular import".
    CUDA_IMPORT_ERROR = str(_e) if importlib.util.find_spec(
        f"{__package__}._jax_gin_cuda") is not None else None
else:  # pragma: no cover - needs the CUDA build
    CUDA_IMPORT_ERROR = None
    _register(cuda.registrations(), "CUDA", CUDA_TARGET, PARTITIONED_TARGETS["cuda"])


def cuda_missing() -> str:
    """Why the CUDA extension is not loaded (where has_cuda() is False)."""
    if CUDA_IMPORT_ERROR is None:
        return "jax_gin was built without CUDA support (it has no _jax_gin_cuda module)"
    return f"jax_gin's CUDA extension (_jax_gin_cuda) failed to load: {CUDA_IMPORT_ERROR}"


def no_cuda_error(what: str) -> NotImplementedError:
    """The error for `what` (a CUDA lowering, a GPU communicator) where has_cuda() is False."""
    return NotImplementedError(f"{what}, but {cuda_missing()}; rebuild jax_gin with nvcc and "
                               "the nvidia-nccl-cu13 wheel installed (JAX_GIN_CUDA=ON)")


def has_cuda() -> bool:
    """Whether jax_gin's CUDA extension is loaded, so that its collectives lower for GPUs.
    Without it, jax_gin runs on CPU devices only: a CUDA lowering raises NotImplementedError."""
    return cuda is not None
