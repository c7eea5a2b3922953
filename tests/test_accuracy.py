"""jax_gin on random data: the error against the exact sum, next to lax's.

16-bit floats are accumulated in float32 and rounded once wherever one rank reduces every
contribution (one_shot, two_shot), as lax's reduction does; ring and tree pass 16-bit
partial sums between ranks, each hop rounding once (at most N - 1 roundings). The bitwise
tests (test_parity.py) use exact data; test_error_against_exact_sum uses standard normal
data, and test_sixteen_bit_roundings values whose float32 sum is exact but whose 16-bit sum
rounds, to hold those roundings bit for bit.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, ndev, needs_devices
from helpers import assert_bitwise, smap

ROUND_ONCE = ("one_shot", "two_shot", "auto")


def _mean_error(x, algo):
    n = ndev()
    exact = np.asarray(x.astype(jnp.float32)).astype(np.float64).reshape(n, -1).sum(0)
    if algo == "lax":
        f = smap(lambda v: lax.psum(v, "i"), mesh_1d(), P("i"))
    else:
        f = smap(lambda v: jax_gin.psum(v, "i", algorithm=algo), mesh_1d(), P("i"))
    out = np.asarray(f(x)).reshape(n, -1)
    for r in range(1, n):  # every rank holds the same bits
        assert_bitwise(out[r], out[0])
    y = out.astype(np.float32).astype(np.float64)
    return np.abs(y[0] - exact).mean()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
def test_error_against_exact_sum(dtype, algo):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal(ndev() * 4099).astype(np.float32)).astype(dtype)
    ours, lax_err = _mean_error(x, algo), _mean_error(x, "lax")
    if algo in ROUND_ONCE or dtype == "float32":
        # rounded once, like lax (float32: same summation precision, another order)
        assert ours <= lax_err * 1.05 + 1e-12, (ours, lax_err)
    else:
        # up to N - 1 roundings of 16-bit partials; within 3x of lax's error on this data
        assert ours <= lax_err * 3, (ours, lax_err)



def _sum_inputs(nranks, dtype, width=4096):
    """(nranks, width) values of dtype with full significands (1 to 2, either sign): every
    sum over <= 16 ranks is exact in float32, and most sums need rounding in dtype."""
    rng = np.random.default_rng(11)
    p = jnp.finfo(dtype).nmant + 1
    m = rng.integers(1 << (p - 1), 1 << p, size=(nranks, width)) * rng.choice([-1, 1], (nranks, width))
    return jnp.asarray((m * 2.0 ** (1 - p)).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto", "lax"))
@pytest.mark.parametrize("nranks", sorted({2, ndev()}))
def test_sixteen_bit_roundings(nranks, algo, dtype):
    """docs/api.md, Numbers, bit for bit: one_shot, two_shot (and auto where it picks them) give the
    float32 sum rounded once to the 16-bit dtype; ring and tree at most N - 1 roundings of
    16-bit partials; over 2 ranks every scheme rounds once; lax on CPUs sums bfloat16 in
    float32 and rounds once, float16 in float16 in rank order (a rounding per addition)."""
    if nranks < 2:
        pytest.skip("a sum over one rank rounds nothing")
    needs_devices(nranks)
    mesh = Mesh(np.array(jax.devices()[:nranks]), ("i",))
    x = _sum_inputs(nranks, dtype)
    if algo == "lax":
        f = smap(lambda v: lax.psum(v, "i"), mesh, P("i"))
    else:
        f = smap(lambda v: jax_gin.psum(v, "i", algorithm=algo), mesh, P("i"))
    got = np.asarray(f(x))
    xs = np.asarray(x, np.float32)
    once = np.asarray(jnp.asarray(xs.sum(0)).astype(dtype))  # exact in float32: one rounding
    for r in range(1, nranks):  # every rank holds the same bits
        assert_bitwise(got[r], got[0])
    if algo == "auto":
        algo = jax_gin.explain(jax.ShapeDtypeStruct(x.shape[1:], dtype), nranks=nranks).split(":")[0]
    if algo == "lax" and nranks > 2 and jax.default_backend() != "cpu":
        pytest.skip("lax's roundings over more than 2 ranks are the CPU backend's here")
    if algo == "lax" and dtype == "float16" and nranks > 2:
        fold = x[0]
        for r in range(1, nranks):
            fold = (fold.astype(jnp.float32) + xs[r]).astype(dtype)
        assert_bitwise(got[0], np.asarray(fold))
    elif algo in ("ring", "tree") and nranks > 2:
        # each of <= N - 1 roundings is at most half an ulp of a partial sum, which is at most
        # the sum of the magnitudes
        ulp = 2.0 ** (np.floor(np.log2(np.abs(xs).sum(0))) - jnp.finfo(dtype).nmant)
        assert (np.abs(got[0].astype(np.float64) - xs.sum(0)) <= (nranks - 1) * ulp / 2).all()
    else:  # one_shot, two_shot, lax's bfloat16, and every scheme over 2 ranks
        assert_bitwise(got[0], once)
