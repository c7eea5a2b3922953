"""jax_gin.psum / pmax / pmin against lax, bit for bit, on inputs whose reductions are exact."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, mesh_2d, ndev, needs_devices
from helpers import DTYPES, OPS, assert_bitwise, exact_input, smap

SIZES = [1, 7, 1000, 4097]


def _run(op, algo, mesh, spec, x, axes, check_vma=True):
    ours, ref = OPS[op]
    f = smap(lambda v: (ours(v, axes, algorithm=algo), ref(v, axes)), mesh, spec,
             check_vma=check_vma)
    got, want = f(x)
    assert_bitwise(got, want)
    return got


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("size", SIZES)
def test_parity_1d(op, dtype, algo, size):
    mesh = mesh_1d()
    x = exact_input((size,), ndev(), dtype, seed=size)
    _run(op, algo, mesh, P("i"), x, "i")


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_parity_x64(dtype, algo):
    with jax.enable_x64(True):
        mesh = mesh_1d()
        x = exact_input((333,), ndev(), dtype)
        assert x.dtype == np.dtype(dtype)
        for op in OPS:
            _run(op, algo, mesh, P("i"), x, "i")


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
@pytest.mark.parametrize("dtype", ["int32", "uint32", "int64", "uint64"])
def test_integer_sums_wrap(dtype, algo):
    """Integer sums that overflow wrap, as XLA's do, whatever the order of the additions: the
    values cover the whole range, so most partial sums leave it. (uint64: summed as the int64
    of the same bits.)"""
    with jax.enable_x64(dtype in ("int64", "uint64")):
        mesh = mesh_1d()
        info = np.iinfo(dtype)
        rng = np.random.default_rng(5)
        x = rng.integers(info.min, info.max, size=(ndev() * 97,), dtype=dtype, endpoint=True)
        _run("psum", algo, mesh, P("i"), jnp.asarray(x), "i")


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
@pytest.mark.parametrize("axes", ["x", "y", ("x", "y"), ("y", "x")])
@pytest.mark.parametrize("op", list(OPS))
def test_parity_2d_mesh(op, axes, algo):
    mesh = mesh_2d()
    nx, ny = mesh.devices.shape
    x = exact_input((nx * 5, 3 * ny), 1, "float32")
    x = x.reshape(nx * 5, 3 * ny)
    _run(op, algo, mesh, P("x", "y"), x, axes)


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_large_chunked(algo):
    # Larger than the 1 MiB CPU workspace: pipelined through it in several rounds.
    n = 300_001
    mesh = mesh_1d()
    x = exact_input((n,), ndev(), "float32", seed=3)
    _run("psum", algo, mesh, P("i"), x, "i")


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_multidim_blocks(algo):
    mesh = mesh_1d()
    x = exact_input((3, 5, 7), ndev(), "bfloat16", seed=11)
    _run("psum", algo, mesh, P("i"), x, "i")


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_scalars(algo):
    mesh = mesh_1d()

    def f(v):
        s = v.sum()  # a scalar per device
        return (jax_gin.psum(s, "i", algorithm=algo)[None], lax.psum(s, "i")[None],
                jax_gin.pmax(s, "i", algorithm=algo)[None], lax.pmax(s, "i")[None])

    x = exact_input((4,), ndev(), "float32")
    a, b, c, d = smap(f, mesh, P("i"))(x)
    assert_bitwise(a, b)
    assert_bitwise(c, d)


def test_python_constants():
    # Constants are the same on every device: psum(1) is the axis size, pmax(2.0) is 2.0,
    # with lax's values and dtypes (lax.psum of a Python scalar gives a Python scalar).
    mesh = mesh_1d()

    def f(v):
        del v
        return tuple((jnp.asarray(ours(c, "i"))[None], jnp.asarray(ref(c, "i"))[None])
                     for c in (1, 2.0) for ours, ref in OPS.values())

    x = exact_input((4,), ndev(), "float32")
    for got, want in smap(f, mesh, P("i"), out_spec=P())(x):
        assert_bitwise(got, want)


@pytest.mark.parametrize("check_vma", [True, False])
def test_sums_of_constants_stay_constants(check_vma):
    """lax.psum (and pmean) of a constant is a constant: psum(1, axis) is the axis size as a
    Python int, which code uses as a static size (w.shape[0] // psum(1, 'i')). So are
    jax_gin's, under jit, with and without check_vma, each leaf as lax takes them."""
    mesh = mesh_1d()
    seen = []

    def f(v):
        for api in ("psum", "pmean"):
            for c in (1, 2.0, np.float32(3), np.arange(3, dtype=np.int32), True,
                      {"a": 1, "b": v}):
                got, want = getattr(jax_gin, api)(c, "i"), getattr(lax, api)(c, "i")
                for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                    seen.append((api, c))
                    assert type(g) is type(w), (api, c, type(g), type(w))
                    if not isinstance(w, jax.core.Tracer):
                        assert_bitwise(g, w)
                        assert jnp.result_type(g) == jnp.result_type(w)
        rows = v.shape[0] * ndev() // jax_gin.psum(1, "i")  # a static size
        return lax.dynamic_slice_in_dim(v, 0, rows)

    x = exact_input((4,), ndev(), "float32")
    jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                          check_vma=check_vma))(x)
    assert len(seen) == 2 * 7


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_signed_zeros(algo, dtype):
    """The one place exact sums differ from lax's on CPU devices (docs/api.md, Numbers): column 0
    holds -0.0 on every rank, and its sum is -0.0 (jax_gin adds the values themselves), where
    XLA's CPU all-reduce sums from +0 and gives +0.0; any +0.0 among them gives +0.0 in both."""
    n = ndev()
    x = jnp.zeros((n, 3), dtype).at[:, 0].set(-0.0).at[:, 1].set(-0.0).at[0, 1].set(0.0)
    got, want = smap(lambda v: (jax_gin.psum(v, "i", algorithm=algo), lax.psum(v, "i")),
                     mesh_1d(), P("i"))(x)
    got, want = np.asarray(got), np.asarray(want)  # (indexing a jax array may lose -0.0)
    assert_bitwise(got[:, 1:], want[:, 1:])
    assert np.signbit(np.asarray(got[:, 0], np.float32)).all()
    assert got.dtype == want.dtype


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("op", ["pmax", "pmin"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_signed_zero_ties(algo, op, dtype):
    """docs/api.md, Numbers: a pmax/pmin tie of +0.0 and -0.0 is lax's where one rank reduces every
    contribution (one_shot, two_shot, auto) -- lax keeps the lowest rank's zero -- and ring and
    tree may settle it otherwise, as a zero with the same bits on every rank. Each column holds
    its own pattern of signs over the ranks (the whole array is read back before it is
    indexed: indexing a sharded jax.Array here turned -0.0 into +0.0)."""
    n = ndev()
    signs = np.random.default_rng(3).integers(0, 2, size=(n, 64)).astype(bool)
    x = jnp.asarray(np.where(signs, -0.0, 0.0), dtype)
    got, want = smap(lambda v: (getattr(jax_gin, op)(v, "i", algorithm=algo),
                                getattr(lax, op)(v, "i")), mesh_1d(), P("i"))(x)
    got, want = np.asarray(got), np.asarray(want)
    on_cpu = jax.default_backend() == "cpu"  # (XLA's CPU all-reduce; NCCL's rule is not checked)
    if on_cpu:
        assert (np.signbit(want.astype(np.float32)) == signs[0]).all()
    if algo in ("one_shot", "two_shot", "auto"):  # every rank: rank 0's zero
        assert (np.signbit(got.astype(np.float32)) == signs[0]).all()
        if on_cpu:
            assert_bitwise(got, want)
    else:
        assert got.dtype == want.dtype and (got.astype(np.float32) == 0).all()
        for r in range(1, n):
            assert_bitwise(got[r], got[0])


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
def test_bfloat16_nan_payloads(algo):
    """docs/api.md, Numbers: a bfloat16 sum that meets a NaN rounds it to the quiet NaN of its
    sign, payload dropped, as XLA's CPU all-reduce does (psum and psum_scatter). Rank 0 holds
    NaNs with payloads of both signs, the other ranks ones; each NaN is the only one in its
    column, so the order of the additions does not matter. The CPU backend's rule: a GPU's
    kernels round as the GPU does, and a group of one (one GPU) returns its input."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU backend's rounding of a NaN")
    needs_devices(2)
    n = ndev()
    bits = np.full((n, 4), 0x3F80, np.uint16)  # 1.0
    bits[0] = [0x7FC1, 0x7F81, 0xFFC1, 0xFF85]
    x = lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)
    got, want = smap(lambda v: (jax_gin.psum(v, "i", algorithm=algo), lax.psum(v, "i")),
                     mesh_1d(), P("i"))(x)
    got = np.asarray(lax.bitcast_convert_type(got, jnp.uint16))
    assert (got == [0x7FC0, 0x7FC0, 0xFFC0, 0xFFC0]).all(), [hex(v) for v in got.reshape(-1)]
    assert_bitwise(got, lax.bitcast_convert_type(want, jnp.uint16))
    if algo in ("auto", "one_shot", "ring"):  # psum_scatter's algorithms
        got, want = smap(lambda v: (jax_gin.psum_scatter(v, "i", scatter_dimension=1,
                                                         tiled=True, algorithm=algo),
                                    lax.psum_scatter(v, "i", scatter_dimension=1, tiled=True)),
                         mesh_1d(), P("i"))(jnp.tile(x, (1, n)))
        got = np.asarray(lax.bitcast_convert_type(got, jnp.uint16))
        assert (got == [0x7FC0, 0x7FC0, 0xFFC0, 0xFFC0]).all(), [hex(v) for v in got.reshape(-1)]
        assert_bitwise(got, lax.bitcast_convert_type(want, jnp.uint16))


def test_bool_max_min_stay_bool():
    mesh = mesh_1d()
    f = smap(lambda v: (jax_gin.pmax(v > 0, "i"), lax.pmax(v > 0, "i"),
                        jax_gin.pmin(v > 0, "i"), lax.pmin(v > 0, "i")), mesh, P("i"))
    a, b, c, d = f(exact_input((9,), ndev(), "float32"))
    assert a.dtype == np.bool_
    assert_bitwise(a, b)
    assert_bitwise(c, d)


def test_bool_is_summed_as_int32():
    mesh = mesh_1d()
    f = smap(lambda v: (jax_gin.psum(v > 0, "i"), lax.psum(v > 0, "i")), mesh, P("i"))
    a, b = f(exact_input((9,), ndev(), "float32"))
    assert a.dtype == np.int32
    assert_bitwise(a, b)


@pytest.mark.parametrize("check_vma", [True, False])
def test_pytree(check_vma):
    mesh = mesh_1d()
    tree = {"w": exact_input((5, 3), ndev(), "float32"),
            "b": (exact_input((2,), ndev(), "bfloat16", seed=1),
                  exact_input((1,), ndev(), "int32", seed=2))}
    spec = {"w": P("i"), "b": (P("i"), P("i"))}
    f = smap(lambda t: (jax_gin.psum(t, "i"), lax.psum(t, "i")), mesh, spec,
             check_vma=check_vma, out_spec=(spec, spec))
    got, want = f(tree)
    jax.tree.map(assert_bitwise, got, want)


def test_results_identical_on_every_rank():
    # The reduction order is the same on all ranks: every rank holds the same bits, even for
    # inexact float inputs.
    mesh = mesh_1d()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(ndev() * 999).astype(np.float32))
    for algo in jax_gin.ALGORITHMS:
        out = smap(lambda v: jax_gin.psum(v, "i", algorithm=algo)[None], mesh, P("i"),
                   out_spec=P("i"))(x)
        out = np.asarray(out).reshape(ndev(), -1)
        for r in range(1, ndev()):
            assert_bitwise(out[r], out[0])
        np.testing.assert_allclose(out[0], np.asarray(x).reshape(ndev(), -1).sum(0), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("op", ["pmax", "pmin"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_nan_propagates(algo, op, dtype):
    """docs/api.md: pmax and pmin propagate NaN, as jnp.max does (XLA's CPU all-reduce drops it):
    column k holds NaN on rank k only, and every rank's result there is NaN; the other
    columns are lax's."""
    n = ndev()
    x = jnp.asarray(np.arange(n * (n + 1)).reshape(n, n + 1) % 7, dtype)
    x = x.at[np.arange(n), np.arange(n)].set(jnp.nan)
    got, want = smap(lambda v: (getattr(jax_gin, op)(v, "i", algorithm=algo),
                                getattr(lax, op)(v[:, n:], "i")), mesh_1d(), P("i"))(x)
    got, want = np.asarray(got), np.asarray(want)
    assert np.isnan(np.asarray(got[:, :n], np.float32)).all()
    assert_bitwise(got[:, n:], want)
