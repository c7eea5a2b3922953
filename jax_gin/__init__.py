"""jax_gin: GPU-initiated collectives for JAX.

Drop-in replacements for ``jax.lax.psum``, ``pmax``, ``pmin``, ``pmean``, ``psum_scatter`` and
``all_gather`` inside ``jax.shard_map``, computed by jax_gin's own device-initiated ring, tree,
one-shot and two-shot algorithms (one-shot and ring for psum_scatter and all_gather):
CUDA kernels over NCCL's device API on GPUs, and a host-memory implementation of the same
schedules on CPU devices.
"""
from . import _native  # registers the FFI targets
from . import _runtime as runtime
from ._ops import ALGORITHMS, SUPPORTED_DTYPE_NAMES as SUPPORTED_DTYPES
from ._primitive import allreduce_p, pmax, pmean, pmin, psum
from ._overlap import psum_overlapping
from ._fused import psum_add_layernorm, psum_add_rmsnorm
from ._scatter_gather import all_gather, psum_scatter
from ._explain import explain
from ._trace import trace
from .global_ops import einsum, matmul, max, mean, min, sum  # global view (jit/pjit)

__version__ = "0.1.0"

has_cuda = _native.has_cuda

__all__ = ["psum", "pmax", "pmin", "pmean", "psum_scatter", "all_gather", "psum_overlapping",
           "psum_add_rmsnorm", "psum_add_layernorm", "ALGORITHMS",
           "SUPPORTED_DTYPES", "explain", "trace", "runtime",
           "has_cuda", "allreduce_p", "__version__"]
__all__ += ["einsum", "matmul", "sum", "mean", "max", "min"]
