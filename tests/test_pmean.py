"""jax_gin.pmean against lax.pmean, bit for bit: jax_gin's psum, then lax's division by the
number of devices (integer and bool leaves give floats, as lax's do)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, mesh_2d, ndev
from helpers import DTYPES, assert_bitwise, exact_input, smap


def _both(mesh, spec, axes, algo="auto", check_vma=True):
    return smap(lambda v: (jax_gin.pmean(v, axes, algorithm=algo), lax.pmean(v, axes)), mesh,
                spec, check_vma=check_vma)


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("dtype", DTYPES + ("bool",))
@pytest.mark.parametrize("size", [1, 7, 1001])
def test_pmean_1d(dtype, algo, size):
    x = exact_input((size,), ndev(), dtype, seed=size)
    got, want = _both(mesh_1d(), P("i"), "i", algo)(x)
    assert got.dtype == want.dtype
    assert_bitwise(got, want)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axes", ["x", ("x", "y"), ("y", "x")])
def test_pmean_2d_mesh(axes, check_vma):
    x = exact_input((6, 5), ndev(), "float32", seed=3)
    got, want = _both(mesh_2d(), P(("x", "y")), axes, check_vma=check_vma)(x)
    assert_bitwise(got, want)


def test_pmean_x64():
    with jax.enable_x64(True):
        for dtype in ("float64", "int64"):
            x = exact_input((333,), ndev(), dtype)
            got, want = _both(mesh_1d(), P("i"), "i")(x)
            assert got.dtype == want.dtype == np.float64
            assert_bitwise(got, want)


@pytest.mark.parametrize("check_vma", [True, False])
def test_pmean_pytree_and_constants(check_vma):
    x = exact_input((13,), ndev(), "float32")

    def body(v):
        tree = {"a": v, "b": v.astype(jnp.bfloat16), "c": (v.astype(jnp.int32), 2.5), "d": 3}
        return jax_gin.pmean(tree, "i"), lax.pmean(tree, "i")
    got, want = smap(body, mesh_1d(), P("i"), check_vma=check_vma,
                     out_spec=({"a": P("i"), "b": P("i"), "c": (P("i"), P()), "d": P()},) * 2)(x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_bitwise(g, w)


@pytest.mark.parametrize("check_vma", [True, False])
def test_pmean_grad(check_vma):
    x = exact_input((40,), ndev(), "float32", seed=1)
    w = jnp.arange(40 * ndev(), dtype=jnp.float32) % 5

    def loss(mean, v, u):
        return jnp.sum(mean(v * u, "i") * u)

    def body(v, u):
        return (jax.grad(loss, argnums=(1, 2))(jax_gin.pmean, v, u),
                jax.grad(loss, argnums=(1, 2))(lax.pmean, v, u))
    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"), P("i")),
                              out_specs=P("i"), check_vma=check_vma))
    got, want = f(x, w)
    for g, r in zip(got, want):
        assert_bitwise(g, r)


def test_pmean_vmap_and_named_vmap_axis():
    x = exact_input((3, 8), ndev(), "float32", seed=2)

    def mean_of(mean):
        def body(v):
            batched = jax.vmap(lambda r: mean(r, "i"))(v)
            named = jax.vmap(lambda r: mean(r, ("v", "i")), axis_name="v")(v)
            return batched, named
        return body
    f = smap(lambda v: (mean_of(jax_gin.pmean)(v), mean_of(lax.pmean)(v)), mesh_1d(), P("i"),
             check_vma=False)
    got, want = f(x)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_bitwise(g, r)


def test_pmean_under_pmap():
    x = exact_input((17,), ndev(), "float32").reshape(ndev(), 17)
    got = jax.pmap(lambda v: jax_gin.pmean(v, "p"), axis_name="p")(x)
    want = jax.pmap(lambda v: lax.pmean(v, "p"), axis_name="p")(x)
    assert_bitwise(got, want)


def test_pmean_errors_name_it():
    x = exact_input((4,), ndev(), "float32")
    with pytest.raises(NameError, match=r"jax_gin\.pmean: Found an unbound axis name: j"):
        smap(lambda v: jax_gin.pmean(v, "j"), mesh_1d(), P("i")).trace(x)
    with pytest.raises(NotImplementedError, match=r"jax_gin\.pmean: axis_index_groups"):
        smap(lambda v: jax_gin.pmean(v, "i", axis_index_groups=[[0]]), mesh_1d(), P("i")).trace(x)
    with pytest.raises(ValueError, match=r"jax_gin\.pmean: .*algorithm"):
        smap(lambda v: jax_gin.pmean(v, "i", algorithm="nccl"), mesh_1d(), P("i")).trace(x)
