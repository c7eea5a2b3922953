"""jax.pmap with jax_gin's collectives: the same bits as lax's, with grad and pytrees."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jax_gin
from conftest import ndev
from helpers import OPS, assert_bitwise, exact_input


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_pmap_bitwise(op, algo, dtype):
    ours, ref = OPS[op]
    x = exact_input((1, 1001), ndev(), dtype, seed=11).reshape(ndev(), 1001)
    got = jax.pmap(lambda v: ours(v, "i", algorithm=algo), axis_name="i")(x)
    want = jax.pmap(lambda v: ref(v, "i"), axis_name="i")(x)
    assert_bitwise(got, want)


def test_pmap_grad_and_pytree():
    x = exact_input((1, 37), ndev(), "float32", seed=12).reshape(ndev(), 37)
    g = lambda psum: jax.pmap(jax.grad(lambda u: jnp.sum(psum(u * u, "i") * u)), axis_name="i")(x)
    assert_bitwise(g(jax_gin.psum), g(lax.psum))
    tree = lambda v: {"a": v, "b": v[:5].astype(jnp.bfloat16)}
    got = jax.pmap(lambda v: jax_gin.psum(tree(v), "i"), axis_name="i")(x)
    want = jax.pmap(lambda v: lax.psum(tree(v), "i"), axis_name="i")(x)
    jax.tree.map(assert_bitwise, got, want)


def test_unbound_axis_under_a_pmap_without_axis_name():
    """A pmap given no axis_name binds an axis of JAX's internal name: the NameError lists no
    axis in scope rather than that name."""
    x = exact_input((4,), ndev(), "float32").reshape(ndev(), 4)
    with pytest.raises(NameError, match="Found an unbound axis name: i.*Axes in scope: none"):
        jax.pmap(lambda v: jax_gin.psum(v, "i"))(x)
