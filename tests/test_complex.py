"""psum of complex values, summed as their (real, imaginary) pairs: bit for bit as lax.psum on
exact data, in pytrees beside real leaves, under grad and vmap, with check_vma on and off;
pmax and pmin refuse them (complex values have no order)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, ndev
from helpers import assert_bitwise


def cinput(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(-7, 8, (ndev() * n,)) + 1j * rng.integers(-7, 8, (ndev() * n,))
            ).astype(np.complex64)


def shmap(f, out_specs=P(), check_vma=True):
    return jax.jit(jax.shard_map(f, mesh=mesh_1d(), in_specs=P("i"), out_specs=out_specs,
                                 check_vma=check_vma))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("n", [1, 33, 4099])
def test_bitwise(n, algo, check_vma):
    z = cinput(n, seed=n)
    got = shmap(lambda v: jax_gin.psum(v, "i", algorithm=algo), check_vma=check_vma)(z)
    want = shmap(lambda v: lax.psum(v, "i"), check_vma=check_vma)(z)
    assert got.dtype == np.complex64
    assert_bitwise(got, want)


def test_pytree_with_real_leaves():
    z = cinput(10, seed=1)
    body = lambda psum: lambda v: psum({"z": v, "r": jnp.real(v) * 2, "c": 1 + 2j}, "i")
    got, want = shmap(body(jax_gin.psum))(z), shmap(body(lax.psum))(z)
    jax.tree.map(assert_bitwise, got, want)


def test_grad_and_vmap():
    z = cinput(12, seed=2)
    grad = lambda psum: shmap(jax.grad(lambda v: jnp.sum(jnp.abs(psum(v, "i")) ** 2)), P("i"))
    assert_bitwise(grad(jax_gin.psum)(z), grad(lax.psum)(z))
    zz = z.reshape(-1, 3)
    # vmap over rows: each device holds rows of 3; the psum of every row over the devices
    got = jax.jit(jax.shard_map(jax.vmap(lambda v: jax_gin.psum(v, "i")), mesh=mesh_1d(),
                                in_specs=P("i"), out_specs=P("i")))(zz)
    want = jax.jit(jax.shard_map(jax.vmap(lambda v: lax.psum(v, "i")), mesh=mesh_1d(),
                                 in_specs=P("i"), out_specs=P("i")))(zz)
    assert_bitwise(got, want)


@pytest.mark.parametrize("api", ["pmax", "pmin"])
def test_order_ops_refuse_complex(api):
    with pytest.raises(TypeError, match=rf"jax_gin\.{api}: complex values have no order"):
        shmap(lambda v: getattr(jax_gin, api)(v, "i"))(cinput(2))
    # a complex constant too, in a pytree beside a real leaf (lax fails at run time there)
    for constant in (1 + 2j, np.ones(3, np.complex64)):
        with pytest.raises(TypeError, match=rf"jax_gin\.{api}: complex values have no order"):
            shmap(lambda v: getattr(jax_gin, api)((v.real, constant), "i")[0])(cinput(2))
