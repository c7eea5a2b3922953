"""psum and psum_scatter of an unreduced value (JAX's typing of pending partial sums) behave
as lax's: the same result types, numbers and gradients, through jax_gin's own calls."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P, AxisType

import jax_gin
from conftest import needs_devices
from helpers import assert_bitwise, jax_gin_calls


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


def test_unreduced_psum_scatter_fwd_and_grad():
    needs_devices(2)  # a mesh of 2 devices
    # psum_scatter of an unreduced partial sum is lax's unreduced_psum_scatter: the result
    # varies over "x"; its transpose gathers the cotangent typed reduced (all_gather
    # to="reduced"). Same types, numbers and gradients as lax's, jax_gin's calls both ways.
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    a = np.arange(8.0, dtype=np.float32).reshape(2, 4)
    b = np.arange(24.0, dtype=np.float32).reshape(4, 6)

    def make(psum_scatter, types):
        @jax.shard_map(in_specs=P(unreduced={"x"}), out_specs=P("x"))
        def rs(z):
            out = psum_scatter(z, "x", tiled=True)
            types.append((jax.typeof(z), jax.typeof(out)))
            return out

        def f(x, y):
            z = jnp.einsum("ab,bc->ac", x, y, out_sharding=P(unreduced={"x"}))
            return (rs(z) ** 2).sum()
        return f

    with jax.set_mesh(mesh):
        x = jax.device_put(a, P(None, "x"))
        y = jax.device_put(b, P("x", None))
        types_ours, types_ref = [], []
        ours = make(functools.partial(jax_gin.psum_scatter, algorithm="ring"), types_ours)
        ref = make(jax.lax.psum_scatter, types_ref)
        assert_bitwise(jax.jit(ours)(x, y), jax.jit(ref)(x, y))
        assert types_ours == types_ref and "U:x" in str(types_ours[0][0])
        grad = jax.jit(jax.grad(ours, argnums=(0, 1)))
        assert jax_gin_calls(grad, x, y) == 2  # the reduce-scatter, and its transpose
        for u, v in zip(grad(x, y), jax.jit(jax.grad(ref, argnums=(0, 1)))(x, y)):
            assert_bitwise(u, v)
            assert u.sharding == v.sharding


def test_unreduced_all_gather_refused():
    needs_devices(2)
    # a pending sum cannot be gathered (lax refuses it too): the error names it
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])

    @jax.shard_map(in_specs=P(unreduced={"x"}), out_specs=P())
    def ag(z):
        return jax_gin.all_gather(z, "x", tiled=True)

    with jax.set_mesh(mesh):
        x = jax.device_put(np.ones((2, 4), np.float32), P(None, "x"))
        y = jax.device_put(np.ones((4, 6), np.float32), P("x", None))
        f = jax.jit(lambda x, y: ag(jnp.einsum("ab,bc->ac", x, y, out_sharding=P(unreduced={"x"}))))
        with pytest.raises(ValueError, match=r"unreduced over \['x'\] \(a pending sum\); sum it"):
            f(x, y)


@pytest.mark.parametrize("api", ["pmax", "pmin"])
def test_unreduced_max_refused(api):
    needs_devices(2)
    # a max of a pending sum is not defined (lax refuses it too): the error says to sum first
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])

    @jax.shard_map(in_specs=P(unreduced={"x"}), out_specs=P())
    def reduce(z):
        return getattr(jax_gin, api)(z, "x")

    with jax.set_mesh(mesh):
        x = jax.device_put(np.ones((2, 4), np.float32), P(None, "x"))
        y = jax.device_put(np.ones((4, 6), np.float32), P("x", None))
        f = jax.jit(lambda x, y: reduce(jnp.einsum("ab,bc->ac", x, y, out_sharding=P(unreduced={"x"}))))
        with pytest.raises(ValueError, match=rf"jax_gin.{api}: the input is unreduced over "
                                             r"\['x'\] \(a pending sum\).*sum it first"):
            f(x, y)
