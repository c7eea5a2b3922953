"""Shared helpers: the lists the tests parametrize over, exact inputs, shard_map wrappers,
bitwise comparison, the count of jax_gin's custom calls, the examples as modules and a job
that cannot be joined."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jax_gin
from jax_gin._ops import OP_API_NAMES, SUPPORTED_DTYPE_NAMES

# The all-reduces, by API name, each with lax's function of that name (jax_gin's op list).
OPS = {api: (getattr(jax_gin, api), getattr(lax, api)) for api in OP_API_NAMES.values()}
# The supported element types that need no jax.enable_x64, and those that do.
DTYPES = tuple(d for d in SUPPORTED_DTYPE_NAMES if np.dtype(jnp.dtype(d)).itemsize <= 4)
X64_DTYPES = tuple(d for d in SUPPORTED_DTYPE_NAMES if d not in DTYPES)


def exact_input(shape_per_device, ndevices, dtype, seed=0):
    """Global input (ndevices * shape_per_device[0], ...) of small integers: every sum, max
    and min over <= 16 ranks is exact in every supported dtype, bfloat16 included."""
    rng = np.random.default_rng(seed)
    shape = (ndevices * shape_per_device[0],) + tuple(shape_per_device[1:])
    lo = 0 if np.dtype(dtype) == np.uint32 else -7
    vals = rng.integers(lo, 8, size=shape)
    return jnp.asarray(vals.astype(np.float64)).astype(dtype)


def auto_runs_kernel() -> bool:
    """Whether `auto` runs jax_gin's kernel over the 1-D mesh of every device on a small input:
    where the mesh holds two or more devices; over one device auto returns the input and
    launches nothing (a group of one rank). Small: at most 32 KiB per device, which every
    shipped tuning table gives to a kernel (jax_gin/tuning/cpu_n8.json, the table of 8 CPU
    devices, hands larger all-reduces to XLA's own)."""
    return len(jax.devices()) > 1


def kernel_algorithm() -> str:
    """The algorithm for a test that must run jax_gin's kernel over that mesh on a small input
    (auto_runs_kernel): `auto` where it does, else an explicit one. A larger input needs an
    explicit algorithm."""
    return "auto" if auto_runs_kernel() else "one_shot"


def smap(f, mesh, spec, check_vma=True, out_spec=None):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,), out_specs=out_spec or spec,
                                 check_vma=check_vma))


def assert_bitwise(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    # contiguous for the byte view (a reference made by np.broadcast_to may have stride 0)
    a, b = (np.ascontiguousarray(v.reshape(-1)) for v in (a, b))
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def jax_gin_calls(f, *args) -> int:
    """How many of jax_gin's custom calls the jitted `f` lowers to on `args` (StableHLO text;
    an asynchronous call counts twice, its start and its done)."""
    return f.lower(*args).as_text().count("stablehlo.custom_call @jax_gin_")


def load_example(name: str):
    """examples/<name>.py as a module (the examples are scripts, not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What jax.distributed.initialize raises in process 0 where its port is taken.
JOIN_ERROR = "UNKNOWN: Failed to start RPC server"


@contextlib.contextmanager
def join_fails(monkeypatch):
    """jax.distributed.initialize raising JOIN_ERROR at once, for the tools' --coordinator;
    the CPU collectives setting, which the tools set for their job, is restored after."""
    def initialize(*args, **kw):
        raise RuntimeError(JOIN_ERROR)
    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    gloo = jax.config.jax_cpu_collectives_implementation
    try:
        yield
    finally:
        jax.config.update("jax_cpu_collectives_implementation", gloo)
