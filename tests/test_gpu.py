"""GPU-only checks: sizes up to 1 GiB per device, 100,000 repeated calls, command buffers,
and a group of one GPU.

Run with JAX_PLATFORMS=cuda and the CUDA extension: test_one_gpu_group on one GPU or more,
the others on two or more; skipped on CPU. (The timeout fault on GPU traps the CUDA context, so it is tested in the native harness,
cuda/harness.cu --fault-rank, which scripts/gpu_run.sh runs.)
"""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, ndev
from helpers import assert_bitwise, smap

_cuda = jax.default_backend() == "gpu" and jax_gin.has_cuda()
one_gpu = pytest.mark.skipif(not _cuda, reason="needs a CUDA device and the CUDA extension")
two_gpus = pytest.mark.skipif(not _cuda or len(jax.devices()) < 2,
                              reason="needs >= 2 CUDA devices and the CUDA extension")


def _exact_device_input(count, dtype):
    # Built on the devices (no 1 GiB host transfer): small integers, different per device.
    mesh = mesh_1d()

    def make(_):
        i = lax.axis_index("i")
        v = (jnp.arange(count, dtype=jnp.int32) * 7 + i * 3) % 11 - 5
        return v.astype(dtype)

    return smap(make, mesh, P("i"))(jnp.zeros((ndev(),), jnp.int32))


def _same_bits(a, b):
    """Whether a and b hold the same bits (a device-side assert_bitwise: a 1 GiB result per
    device stays on the device). The dtypes and shapes are checked at trace time."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    as_uint = jnp.dtype(f"uint{8 * a.dtype.itemsize}")
    return jnp.all(lax.bitcast_convert_type(a, as_uint) == lax.bitcast_convert_type(b, as_uint))


@two_gpus
@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sizes_1_to_1gib(algo, dtype):
    itemsize = np.dtype(dtype).itemsize
    mesh = mesh_1d()
    f = smap(lambda v: _same_bits(jax_gin.psum(v, "i", algorithm=algo), lax.psum(v, "i"))[None],
             mesh, P("i"))
    for nbytes in [itemsize, 3 * itemsize, 4 << 10, 1 << 20, (16 << 20) + 6, 256 << 20, 1 << 30]:
        x = _exact_device_input(nbytes // itemsize, dtype)
        ok = np.asarray(f(x))
        assert ok.all(), (algo, dtype, nbytes)
        del x


@two_gpus
@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_100k_repeated_calls(algo):
    # 100 jit calls of a scan of 1000 dependent all-reduces = 100,000 calls, every one checked.
    mesh = mesh_1d()

    def f(x):
        def body(c, _):
            y = jax_gin.psum(c, "i", algorithm=algo)
            ok = _same_bits(y, lax.psum(c, "i"))
            return c + (y - lax.psum(c, "i")), ok
        c, ok = lax.scan(body, x, None, length=1000)
        return jnp.all(ok)[None]

    g = smap(f, mesh, P("i"))
    x = _exact_device_input(4099, "float32")
    oks = [g(x) for _ in range(100)]
    assert all(bool(np.asarray(o).all()) for o in oks)


@two_gpus
def test_cuda_graphs_subprocess():
    # With XLA command buffers forced on for custom calls, jax_gin's execute-only handler is
    # captured into CUDA graphs and still gives lax's bits.
    code = textwrap.dedent("""
        import os, numpy as np, jax, jax.numpy as jnp
        from jax import lax
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_gin
        mesh = Mesh(np.array(jax.devices()), ("i",))
        def f(x):
            for _ in range(8):
                x = jax_gin.psum(x, "i") - lax.psum(x, "i") + x
            return jnp.all(jax_gin.psum(x, "i") == lax.psum(x, "i"))[None]
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        x = jnp.arange(len(jax.devices()) * 1000, dtype=jnp.float32) % 7
        for _ in range(50):
            assert bool(np.asarray(g(x)).all())
        print("OK")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
               "--xla_gpu_graph_min_graph_size=1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@one_gpu
@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_one_gpu_group(algo):
    """A group of one GPU with an explicit algorithm still goes through the whole CUDA path
    (communicator, window, FFI handler, the ordering token, the kernel's copy; `auto` returns
    the input: test_group_of_one.py): runs on a 1-GPU machine too. Twelve independent calls in
    one jit, some of them larger than one round of the workspace."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("i",))

    def f(*xs):
        return (tuple(jax_gin.psum(x, "i", algorithm=algo) for x in xs),
                tuple(lax.psum(x, "i") for x in xs))

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P()))
    xs = [jnp.arange(n, dtype=dt) % 13
          for n in (1, 7, 4097, 300_001, 20 << 20) for dt in (jnp.float32, jnp.bfloat16)]
    xs += [jnp.arange(1000, dtype=jnp.int32), jnp.arange(33, dtype=jnp.float16)]
    for _ in range(3):
        got, want = g(*xs)
        jax.tree.map(assert_bitwise, got, want)
