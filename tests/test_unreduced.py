"""psum of an unreduced value (JAX's typing of pending partial sums) behaves as lax's:
the same result types, numbers and gradients, through jax_gin's own call."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P, AxisType

import jax_gin
from conftest import needs_devices
from helpers import assert_bitwise


def test_unreduced_psum_fwd_and_grad():
    needs_devices(2)  # a mesh of 2 devices
    # An einsum whose contraction is sharded over "x" leaves an unreduced partial sum; psum
    # of it behaves as lax's unreduced psum: same types, numbers and gradients, jax_gin's call.
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    a = np.arange(8.0, dtype=np.float32).reshape(2, 4)
    b = np.arange(24.0, dtype=np.float32).reshape(4, 6)

    def make(psum):
        @jax.shard_map(in_specs=P(unreduced={"x"}), out_specs=P())
        def ar(z):
            out = psum(z, "x")
            assert out.aval.mat.unreduced == frozenset()
            return out

        def f(x, y):
            z = jnp.einsum("ab,bc->ac", x, y, out_sharding=P(unreduced={"x"}))
            return ar(z).sum()
        return f

    with jax.set_mesh(mesh):
        x = jax.device_put(a, P(None, "x"))
        y = jax.device_put(b, P("x", None))
        ours, ref = make(jax_gin.psum), make(jax.lax.psum)
        assert "jax_gin_all_reduce" in jax.jit(ours).lower(x, y).as_text()
        assert_bitwise(jax.jit(ours)(x, y), jax.jit(ref)(x, y))
        g_ours = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, y)
        g_ref = jax.jit(jax.grad(ref, argnums=(0, 1)))(x, y)
        for u, v in zip(g_ours, g_ref):
            assert_bitwise(u, v)
            assert u.sharding == v.sharding
