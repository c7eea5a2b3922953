"""A group of one rank (collectives over mesh axes of size 1): `auto` returns the input and
launches nothing, which is what XLA's collective of one device computes; an explicit algorithm
still runs jax_gin's kernel (a copy). Both equal lax bit for bit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_gin
from conftest import ndev
from helpers import OPS, assert_bitwise, exact_input


def _mesh():
    # "x" holds every device, "y" one: a collective over "y" is a group of one rank
    return Mesh(np.array(jax.devices()).reshape(ndev(), 1), ("x", "y"))


def _calls(f, *args) -> int:
    return f.lower(*args).compile().as_text().count('custom_call_target="jax_gin_')


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", ["auto", "ring"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_all_reduce(op, algo, check_vma):
    ours, ref = OPS[op]
    x = exact_input((5, 3), ndev(), "float32")

    def f(v):
        return ours(v, "y", algorithm=algo), ref(v, "y")

    g = jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=P("x"), out_specs=(P("x"), P("x")),
                              check_vma=check_vma))
    a, b = g(x)
    assert_bitwise(a, b)
    assert_bitwise(a, x)
    assert _calls(g, x) == (0 if algo == "auto" else 1)


@pytest.mark.parametrize("api", ["psum_scatter", "all_gather"])
def test_scatter_gather(api):
    x = exact_input((4,), ndev(), "float32")
    ours, ref = getattr(jax_gin, api), getattr(lax, api)

    def f(v):
        return ours(v, "y", tiled=True), ref(v, "y", tiled=True)

    g = jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=P("x"), out_specs=(P("x"), P("x")),
                              check_vma=False))
    a, b = g(x)
    assert_bitwise(a, b)
    assert _calls(g, x) == 0


def test_asynchronous_and_overlapping():
    x = exact_input((6,), ndev(), "float32")

    def f(v):
        s, y = jax_gin.psum_overlapping(v, "y", jnp.sin, v)
        return jax_gin.psum(v, "y", overlap=True), s, y, lax.psum(v, "y"), jnp.sin(v)

    g = jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=P("x"), out_specs=(P("x"),) * 5))
    a, s, y, want, sin = g(x)
    assert_bitwise(a, want)
    assert_bitwise(s, want)
    assert_bitwise(y, sin)
    assert _calls(g, x) == 0


def test_grad_matches_lax():
    x = exact_input((6,), ndev(), "float32")

    def f(v):
        return (jax.grad(lambda a: jnp.sum(jax_gin.psum(a * a, "y") ** 2))(v),
                jax.grad(lambda a: jnp.sum(lax.psum(a * a, "y") ** 2))(v))

    g = jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=P("x"), out_specs=(P("x"), P("x"))))
    assert_bitwise(*g(x))


def test_fused_norm():
    # auto: the unfused composition over one device; an explicit algorithm: the fused call
    x = exact_input((4, 16), ndev(), "bfloat16")
    r = exact_input((4, 16), ndev(), "bfloat16", seed=1)
    w = jnp.arange(16, dtype=jnp.bfloat16) % 3 + 1

    def f(a, b):
        auto = jax_gin.psum_add_rmsnorm(a, b, w, "y")
        fused = jax_gin.psum_add_rmsnorm(a, b, w, "y", algorithm="one_shot")
        want = b + lax.psum(a, "y")
        q = want.astype(jnp.float32)  # the norm, as the docstring defines it, in jnp
        want_normed = (q * lax.rsqrt(jnp.mean(q * q, -1, keepdims=True) + 1e-6)).astype(
            want.dtype) * w
        return auto, fused, want, want_normed

    g = jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=(P("x"), P("x")),
                              out_specs=((P("x"), P("x")),) * 2 + (P("x"), P("x"))))
    (normed, new_res), (normed1, new_res1), want_res, want_normed = g(x, r)
    assert _calls(g, x, r) == 1  # the explicit algorithm's (lax.psum over one device: none)
    assert_bitwise(new_res, want_res)
    assert_bitwise(new_res, new_res1)
    assert_bitwise(normed, want_normed)
    assert_bitwise(normed, normed1)
