"""jax_gin.psum_scatter and jax_gin.all_gather against lax, bit for bit, on exact inputs."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from jax_gin import _native, _primitive
from jax_gin._ops import ALGORITHM_CODES
from jax_gin._select import COLLECTIVE_ALGORITHMS
from conftest import mesh_1d, mesh_2d, ndev, needs_devices
from helpers import DTYPES, assert_bitwise, exact_input, jax_gin_calls, kernel_algorithm, smap

OPS = {"psum_scatter": (jax_gin.psum_scatter, lax.psum_scatter),
       "all_gather": (jax_gin.all_gather, lax.all_gather)}
ALGOS = COLLECTIVE_ALGORITHMS + ("auto",)


def _dim_kw(op, dim):
    return {"scatter_dimension": dim} if op == "psum_scatter" else {"axis": dim}


def _compare(op, x, axes, mesh, spec, *, dim=0, tiled=False, algo="auto", check_vma=True):
    """Runs jax_gin's and lax's op side by side; every device's result (stacked along a new
    leading axis) must be the same bits."""
    ours, ref = OPS[op]
    kw = _dim_kw(op, dim)

    def body(v):
        a = ours(v, axes, tiled=tiled, algorithm=algo, **kw)
        b = ref(v, axes, tiled=tiled, **kw)
        return a[None], b[None]

    names = mesh.axis_names
    out = P(tuple(names))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=(out, out),
                              check_vma=check_vma))
    got, want = f(x)
    assert_bitwise(got, want)
    return got


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("per_device", [(1,), (7,), (1000,), (4097,)])
def test_parity_tiled(op, dtype, algo, per_device):
    n = ndev()
    if op == "psum_scatter":
        per_device = (per_device[0] * n,)
    x = exact_input(per_device, n, dtype, seed=per_device[0])
    _compare(op, x, "i", mesh_1d(), P("i"), tiled=True, algo=algo)


_UNTILED = [((3, 5), 0), ((3, 5), 1), ((3, 5), -1), ((2, 3, 5), 2), ((1,), 0), ((), 0)]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("op,shape,dim", [(op, shape, dim) for op in OPS for shape, dim in _UNTILED
                                          # a scalar has no dimension to scatter
                                          if shape or op == "all_gather"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_parity_untiled_dims(op, algo, shape, dim, check_vma):
    n = ndev()
    if op == "psum_scatter":
        # the scattered dimension has the axis size
        shape = shape[:dim % len(shape)] + (n,) + shape[dim % len(shape) + 1:]
    x = exact_input((1,) + shape, n, "float32", seed=len(shape) + dim)
    x = x.reshape((n,) + shape)
    spec = P("i")
    ours, ref = OPS[op]
    kw = _dim_kw(op, dim)
    body = lambda v: (ours(v[0], "i", algorithm=algo, **kw)[None],
                      ref(v[0], "i", **kw)[None])
    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(spec,), out_specs=(spec, spec),
                              check_vma=check_vma))
    got, want = f(x)
    assert_bitwise(got, want)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_parity_tiled_inner_dims(op, dim):
    n = ndev()
    shape = [2, 3, 5]
    if op == "psum_scatter":
        shape[dim] *= n
    x = exact_input((n * shape[0],) + tuple(shape[1:]), 1, "bfloat16", seed=dim)
    x = x.reshape((n,) + tuple(shape))
    body = lambda v, impl: impl(v[0], "i", tiled=True, **_dim_kw(op, dim))[None]
    ours, ref = OPS[op]
    f = jax.jit(jax.shard_map(lambda v: (body(v, ours), body(v, ref)), mesh=mesh_1d(),
                              in_specs=(P("i"),), out_specs=(P("i"), P("i"))))
    got, want = f(x)
    assert_bitwise(got, want)


@pytest.mark.parametrize("algo", COLLECTIVE_ALGORITHMS)
@pytest.mark.parametrize("axes", ["x", "y", ("x", "y"), ("y", "x")])
@pytest.mark.parametrize("op", list(OPS))
def test_parity_2d_mesh(op, axes, algo):
    mesh = mesh_2d()
    nx, ny = mesh.devices.shape
    group = nx * ny if isinstance(axes, tuple) else mesh.shape[axes]
    rows = 3 * group if op == "psum_scatter" else 3
    x = exact_input((nx * rows, 7 * ny), 1, "float32", seed=rows)
    x = x.reshape(nx * rows, 7 * ny)
    _compare(op, x, axes, mesh, P("x", "y"), tiled=True, algo=algo)


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("op", list(OPS))
def test_no_axis_returns_the_input(op, tiled):
    # over the empty tuple of axes, lax's collectives (and psum) return the input unchanged
    n = ndev()
    x = exact_input((2, 3), n, "float32")
    got = _compare(op, x, (), mesh_1d(), P("i"), tiled=tiled)
    assert got.shape == (n, 2, 3)


@pytest.mark.parametrize("algo", COLLECTIVE_ALGORITHMS)
@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_parity_x64(dtype, algo):
    with jax.enable_x64(True):
        n = ndev()
        for op in OPS:
            per = (333 * n,) if op == "psum_scatter" else (333,)
            x = exact_input(per, n, dtype)
            assert x.dtype == np.dtype(dtype)
            _compare(op, x, "i", mesh_1d(), P("i"), tiled=True, algo=algo)


@pytest.mark.parametrize("algo", COLLECTIVE_ALGORITHMS)
def test_psum_scatter_of_uint64_wraps(algo):
    """psum_scatter sums uint64 as the int64 of the same bits: over the whole range, where
    most sums wrap, every block is lax's bit for bit."""
    n = ndev()
    rng = np.random.default_rng(11)
    x = rng.integers(0, np.iinfo(np.uint64).max, size=(n * n * 5,), dtype=np.uint64, endpoint=True)
    with jax.enable_x64(True):
        got = _compare("psum_scatter", jnp.asarray(x), "i", mesh_1d(), P("i"), tiled=True, algo=algo)
        assert got.dtype == np.uint64


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint64"])
@pytest.mark.parametrize("shape,dim,tiled", [((5,), 0, True), ((3, 7), 1, False), ((1,), 0, False),
                                             ((2, 3), 1, True), ((4097,), 0, True)])
def test_all_gather_packs_small_integers(dtype, algo, shape, dim, tiled):
    # integers jax_gin does not reduce move as the uint32 words their bytes fill: lax's bits,
    # every value (negative, and above the 32-bit range for uint64) in place
    with jax.enable_x64(dtype == "uint64"):
        n = ndev()
        info = np.iinfo(dtype)
        rng = np.random.default_rng(len(shape) + dim)
        vals = rng.integers(info.min, info.max, size=(n * shape[0],) + shape[1:], dtype=dtype,
                            endpoint=True)
        x = jnp.asarray(vals)
        assert x.dtype == np.dtype(dtype)
        got = _compare("all_gather", x, "i", mesh_1d(), P("i"), dim=dim, tiled=tiled, algo=algo)
        assert got.dtype == np.dtype(dtype)
        if algo != "auto":
            text = jax.jit(jax.shard_map(
                lambda v: jax_gin.all_gather(v, "i", axis=dim, tiled=tiled, algorithm=algo)[None],
                mesh=mesh_1d(), in_specs=P("i"), out_specs=P("i"))).lower(x).as_text()
            assert "jax_gin_collective" in text and "bitcast_convert" in text


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("dim,tiled", [(0, True), (0, False), (1, False)])
def test_all_gather_of_prng_keys(impl, algo, dim, tiled):
    # a key array moves as its key data, as lax.all_gather's does: every device holds every
    # device's keys, in place (lax's own fails to lower the stacked form at dim 1)
    n = ndev()
    keys = jax.random.split(jax.random.key(7, impl=impl), n * 3)
    got = jax.jit(jax.shard_map(
        lambda k: jax_gin.all_gather(k, "i", axis=dim, tiled=tiled, algorithm=algo)[None],
        mesh=mesh_1d(), in_specs=P("i"), out_specs=P("i"), check_vma=False))(keys)
    assert got.dtype == keys.dtype
    data = np.asarray(jax.random.key_data(keys))  # (n * 3, w)
    blocks = data.reshape(n, 3, -1)
    want = (data if tiled else blocks if dim == 0 else blocks.transpose(1, 0, 2))
    for d in range(n):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(got[d])), want)
    # explain sizes the call by the key data it moves (3 keys a device, padded to 16 bytes)
    nbytes = -(-3 * data.shape[-1] * 4 // 16) * 16 * n
    assert f"all_gather of {nbytes} bytes per device" in jax_gin.explain(
        keys[:3], nranks=n, collective="all_gather")


def test_small_integers_psum_scatter_and_float8_refused():
    n = ndev()
    x = jnp.zeros((n * n,), jnp.int8)
    with pytest.raises(TypeError, match=r"jax_gin.psum_scatter: unsupported dtype int8"):
        smap(lambda v: jax_gin.psum_scatter(v, "i", tiled=True), mesh_1d(), P("i")).lower(x)
    x = jnp.zeros((n,), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"jax_gin.all_gather: unsupported dtype float8_e4m3fn"):
        smap(lambda v: jax_gin.all_gather(v, "i")[None], mesh_1d(), P("i")).lower(x)


@pytest.mark.parametrize("algo", COLLECTIVE_ALGORITHMS)
def test_several_rounds(algo, monkeypatch):
    # 64 KiB windows: a block of ~400 KiB per rank takes several rounds through them
    monkeypatch.setattr(jax_gin.runtime.settings, "cpu_workspace_bytes", 64 << 10)
    n = ndev()
    for op in OPS:
        per = (100_003 * n,) if op == "psum_scatter" else (100_003,)
        x = exact_input(per, n, "float32", seed=5)
        _compare(op, x, "i", mesh_1d(), P("i"), tiled=True, algo=algo)


def test_complex_and_bool():
    n = ndev()
    re_, im = exact_input((4 * n,), n, "float32", 1), exact_input((4 * n,), n, "float32", 2)
    z = lax.complex(re_, im)
    _compare("psum_scatter", z, "i", mesh_1d(), P("i"), tiled=True)
    _compare("all_gather", z, "i", mesh_1d(), P("i"), tiled=True)
    b = exact_input((5,), n, "int32", 3) > 0
    _compare("all_gather", b, "i", mesh_1d(), P("i"), tiled=False)


def test_pytree_and_tuple_axes():
    mesh = mesh_2d()
    nx, ny = mesh.devices.shape
    x = exact_input((nx * 2 * nx * ny, 4 * ny), 1, "float32", 7).reshape(nx * 2 * nx * ny, 4 * ny)
    y = exact_input((nx * 3, ny * 2), 1, "int32", 8).reshape(nx * 3, ny * 2)

    def body(a, b):
        tree = {"a": a, "b": (b,)}
        ours = jax_gin.psum_scatter({"a": a}, ("x", "y"), tiled=True), \
            jax_gin.all_gather(tree, ("y", "x"), axis=1, tiled=True)
        refs = lax.psum_scatter({"a": a}, ("x", "y"), tiled=True), \
            lax.all_gather(tree, ("y", "x"), axis=1, tiled=True)
        return jax.tree.map(lambda t: t[None], (ours, refs))

    spec = P("x", "y")
    out = P(("x", "y"))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=out))
    got, want = f(x, y)
    jax.tree.map(assert_bitwise, got, want)


def _tree(n, seed):
    """Global inputs of a pytree whose leaves differ in dtype and size (odd sizes too); each
    leaf's first dimension is n * (a multiple of n), so every leaf scatters tiled and untiled."""
    shapes = {"w": ((n * n, 5), "float32"), "b": ((n * n,), "float32"),
              "odd": ((n * n * 3, 7), "float32"), "h": ((n * n, 9), "bfloat16"),
              "i": ((n * n, 3), "int32"), "u": ((n * 2 * n, 4), "float32")}
    return {k: exact_input(shape, 1, dt, seed + j).reshape(shape)
            for j, (k, (shape, dt)) in enumerate(shapes.items())}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("op", list(OPS))
def test_pytree_buckets(op, tiled, check_vma):
    """A pytree is one call per dtype (and bucket), bit for bit as lax and as leaf by leaf."""
    n = ndev()
    tree = _tree(n, 20)
    if op == "all_gather":
        tree["flag"] = exact_input((n, 2), 1, "int32", 30).reshape(n, 2) > 0  # gathered as int32
        tree["z"] = lax.complex(tree["b"], tree["b"] * 2)
    ours, ref = OPS[op]
    algo = kernel_algorithm()  # the calls are counted below

    def body(bucket_bytes):
        def f(t):
            if op == "psum_scatter" and not tiled:
                t = jax.tree.map(lambda v: v.reshape((n, -1) + v.shape[1:]), t)
            a = ours(t, "i", tiled=tiled, bucket_bytes=bucket_bytes, algorithm=algo)
            b = ref(t, "i", tiled=tiled)
            return jax.tree.map(lambda v: v[None], (a, b))
        return jax.jit(jax.shard_map(f, mesh=mesh_1d(), in_specs=(P("i"),), out_specs=P("i"),
                                     check_vma=check_vma))

    whole, per_leaf = body(None), body(1)
    got, want = whole(tree)
    jax.tree.map(assert_bitwise, got, want)
    jax.tree.map(assert_bitwise, per_leaf(tree)[0], got)
    groups = {np.dtype(v.dtype) if v.dtype != np.bool_ else np.dtype(np.int32)
              for v in jax.tree.leaves(tree)}
    groups = {np.dtype(np.float32) if np.issubdtype(g, np.complexfloating) else g for g in groups}
    assert jax_gin_calls(whole, tree) == len(groups)
    assert jax_gin_calls(per_leaf, tree) == len(jax.tree.leaves(tree))
    # buckets the size of the largest float32 leaf's larger side (unpadded): that leaf goes
    # alone, the others share a call, and the result is still the same
    larger = [v.size // n * 4 * (n if op == "all_gather" else 1)
              for v in jax.tree.leaves(tree) if v.dtype == np.float32]
    bucketed = body(max(larger))
    jax.tree.map(assert_bitwise, bucketed(tree)[0], got)
    assert len(groups) < jax_gin_calls(bucketed, tree) < len(jax.tree.leaves(tree))


def test_pytree_buckets_keep_each_leafs_typing():
    """Under check_vma, leaves that vary over different axes go to different calls."""
    mesh = mesh_2d()
    nx, ny = mesh.devices.shape
    a = exact_input((nx * nx * 4, ny * 3), 1, "float32", 40).reshape(nx * nx * 4, ny * 3)
    b = exact_input((nx * nx * 2,), 1, "float32", 41).reshape(nx * nx * 2)

    def body(u, v):
        t = {"u": u, "v": v}  # u varies over x and y, v over x only
        return jax.tree.map(lambda z: z[None], (
            jax_gin.psum_scatter(t, "x", tiled=True), lax.psum_scatter(t, "x", tiled=True),
            jax_gin.all_gather(t, "x", tiled=True), lax.all_gather(t, "x", tiled=True)))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x", "y"), P("x")),
                              out_specs=P(("x", "y"))))
    rs, rs_ref, ag, ag_ref = f(a, b)
    jax.tree.map(assert_bitwise, (rs, ag), (rs_ref, ag_ref))
    assert jax_gin_calls(f, a, b) == 4


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", list(OPS))
def test_pytree_buckets_keep_weak_types(op, check_vma):
    """A weakly typed leaf (from a Python scalar) beside a strong leaf of its dtype stays weak,
    as lax's does (so it promotes alike): weak and strong leaves go to different calls."""
    n = ndev()
    x = exact_input((n,), n, "float32", 42).reshape(n, n)
    types = []

    def body(v):
        v = v[0]
        t = [jnp.full((n,), 3) * 1, v.astype(jnp.int32), 2.0 + 0 * lax.axis_index("i"), v]
        if op == "psum_scatter":
            t = [jnp.broadcast_to(leaf, (n,)) for leaf in t]
        outs = (OPS[op][0](t, "i", algorithm=kernel_algorithm()), OPS[op][1](t, "i"))
        for o in outs:
            types.append([(jax.typeof(leaf).dtype, jax.typeof(leaf).weak_type) for leaf in o])
        return jax.tree.map(lambda leaf: jnp.asarray(leaf)[None], outs)

    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"),), out_specs=P("i"),
                              check_vma=check_vma))
    got, want = f(x)
    jax.tree.map(assert_bitwise, got, want)
    assert types[0] == types[1]
    assert [w for _, w in types[0]] == [True, False, True, False]
    assert jax_gin_calls(f, x) == 4
    # explain counts the calls the collective makes
    S = jax.ShapeDtypeStruct
    tree = [3, S((n,), jnp.int32), S((n,), jnp.float32, weak_type=True), S((n,), jnp.float32)]
    if op == "psum_scatter":
        tree[0] = S((n,), jnp.int32, weak_type=True)
    assert jax_gin.explain(tree, nranks=n, collective=op).startswith("4 calls")


def test_pytree_partially_manual():
    """axis_names= one mesh axis, the other automatic: XLA's own collectives on the bucket,
    the same as lax's."""
    if ndev() < 8:
        pytest.skip("needs 8 devices")
    from jax.sharding import Mesh, NamedSharding
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    t = {"a": exact_input((8, 6), 4, "float32", 60).reshape(32, 6),
         "b": exact_input((8,), 4, "float32", 61)}
    t = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(mesh, P("x"))), t)

    def f(u):
        return (jax_gin.psum_scatter(u, "x", tiled=True), lax.psum_scatter(u, "x", tiled=True),
                jax_gin.all_gather(u, "x", tiled=True), lax.all_gather(u, "x", tiled=True))
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"),
                              axis_names={"x"}))
    assert jax_gin_calls(g, t) == 0
    rs, rs_ref, ag, ag_ref = g(t)
    jax.tree.map(assert_bitwise, (rs, ag), (rs_ref, ag_ref))


def test_pytree_buckets_grad_matches_lax():
    n = ndev()
    tree = {k: v for k, v in _tree(n, 50).items() if v.dtype == np.float32}

    def loss(rs, ag, t):
        s = rs(t, "i", tiled=True)
        g = ag(jax.tree.map(lambda v: v * 3.0, s), "i", tiled=True)
        return sum(jnp.sum(v * v) for v in jax.tree.leaves(g))

    def body(t):
        return (jax.grad(lambda u: loss(jax_gin.psum_scatter, jax_gin.all_gather, u))(t),
                jax.grad(lambda u: loss(lax.psum_scatter, lax.all_gather, u))(t))

    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"),), out_specs=P("i")))
    got, want = f(tree)
    jax.tree.map(assert_bitwise, got, want)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("tiled", [True, False])
def test_grad_matches_lax(check_vma, tiled):
    """The transpose of psum_scatter is all_gather and the other way round, as in lax."""
    n = ndev()
    x = exact_input((n, 6), n, "float32", 4).reshape(n, n, 6)
    w = exact_input((1, 6), n, "float32", 5).reshape(n, 6)

    def loss(impls, v, wv):
        rs, ag = impls
        s = rs(v[0], "i", tiled=tiled)           # (6,) per device
        g = ag(s * wv[0], "i", tiled=tiled)      # (n, 6), or (n * 6,) tiled
        return jnp.sum(g * g)

    def body(v, wv):
        ours = jax.grad(lambda a, b: loss((jax_gin.psum_scatter, jax_gin.all_gather), a, b),
                        argnums=(0, 1))(v, wv)
        refs = jax.grad(lambda a, b: loss((lax.psum_scatter, lax.all_gather), a, b),
                        argnums=(0, 1))(v, wv)
        return ours, refs

    if tiled:
        x = x.reshape(n, n * 6)
    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"), P("i")),
                              out_specs=P("i"), check_vma=check_vma))
    got, want = f(x, w)
    # Zeros are compared without their sign: the cotangents hold -0.0 (0 times a negative
    # weight), and XLA's CPU reduce-scatter sums from a +0.0 identity (-0 + -0 gives +0 there),
    # where jax_gin, like NCCL, adds the contributions themselves (-0 + -0 = -0).
    jax.tree.map(lambda a, b: assert_bitwise(a + 0.0, b + 0.0), got, want)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("to", ["varying", "invarying"])
def test_all_gather_to(to, tiled, check_vma):
    """all_gather's `to`, as lax's: "invarying" types the result invariant (so it can leave
    shard_map with out_specs=P()) and transposes to this device's slice of the cotangent,
    with no sum; the values, types and gradients are lax's."""
    n = ndev()
    x = exact_input((1, 6), n, "float32", 2)  # (1, 6) a device
    w = exact_input((n, 6), 1, "float32", 3)  # a weight for each gathered element

    def run(ag):
        types = []  # (input, result) types, recorded as the body is traced

        def gathered(v):
            g = ag(v, "i", tiled=tiled, to=to)
            return g if tiled else g.reshape(n, 6)

        def body(v, wv):
            g = gathered(v)
            types.append((jax.typeof(v), jax.typeof(g)))
            grad = jax.grad(lambda a: jnp.sum(gathered(a) * wv))(v)
            return (g if to == "invarying" else g[None]), grad

        out = P() if to == "invarying" else P("i")
        f = jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"), P()), out_specs=(out, P("i")),
                          check_vma=check_vma)
        return jax.jit(f)(x, w), types

    (got, got_types), (want, want_types) = run(jax_gin.all_gather), run(lax.all_gather)
    assert got_types == want_types
    jax.tree.map(assert_bitwise, got, want)


@pytest.mark.parametrize("dim", [jnp.int32(-1), np.int64(0)])
def test_dimension_as_a_concrete_integer_array(dim):
    """scatter_dimension and axis take a concrete integer array, as lax's do; a bool, a
    float or a traced value is refused by name."""
    n = ndev()
    x = exact_input((n, 2 * n), n, "float32")
    run = lambda mod: smap(lambda v: (mod.psum_scatter(v, "i", scatter_dimension=dim, tiled=True),
                                      mod.all_gather(v, "i", axis=dim, tiled=True)),
                           mesh_1d(), P("i"))(x)
    jax.tree.map(assert_bitwise, run(jax_gin), run(lax))
    for bad in (True, 0.0, jnp.float32(0)):
        with pytest.raises(TypeError, match="jax_gin.all_gather: axis must be an integer"):
            smap(lambda v: jax_gin.all_gather(v, "i", axis=bad), mesh_1d(), P("i"))(x)
    with pytest.raises(TypeError, match="jax_gin.psum_scatter: scatter_dimension must be an "
                                        "integer, got .*Tracer"):
        jax.jit(lambda d: smap(lambda v: jax_gin.psum_scatter(v, "i", scatter_dimension=d),
                               mesh_1d(), P("i"))(x))(0)


def test_all_gather_to_refusals():
    """A `to` that lax does not know, and to="reduced" without check_vma (no type to mark,
    which lax refuses too), are named at trace time."""
    def run(to, check_vma=True):
        smap(lambda v: jax_gin.all_gather(v, "i", tiled=True, to=to), mesh_1d(), P("i"),
             check_vma)(jnp.ones((ndev() * 2,)))
    with pytest.raises(ValueError, match="to must be one of 'varying', 'invarying', 'reduced'"):
        run("invariant")
    with pytest.raises(ValueError, match="to='reduced' .* needs shard_map's check_vma=True"):
        run("reduced", check_vma=False)


@pytest.mark.parametrize("spec,axes", [(P(), "x"), (P("x"), "y"), (P("x"), ("x", "y"))])
def test_all_gather_to_reduced_takes_what_lax_takes(spec, axes):
    """to="reduced" is Varying -> Reduced: like lax's, it refuses an input that varies over
    none of the gathered axes (invariant, or varying over another axis), and takes one that
    varies over some of them, with lax's type (its numbers: test_unreduced)."""
    mesh = mesh_2d()
    x = exact_input((8,), mesh.size, "float32")

    def run(mod):
        types = []

        def body(v):
            types.append(jax.typeof(mod.all_gather(v, axes, tiled=True, to="reduced")))
            return v
        f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
        jax.jit(f).trace(x)
        return types

    try:
        want_types = run(lax)
    except ValueError as e:
        assert "all_gather_reduced" in str(e), e
        with pytest.raises(ValueError, match=r"jax_gin.all_gather: to='reduced' gathers a value "
                                             r"that varies over the axes .* \(as lax's does\)"):
            run(jax_gin)
    else:
        assert run(jax_gin) == want_types


def test_all_gather_to_reduced_refuses_a_reduced_input():
    """An input varying over one of the gathered axes but typed reduced over another: lax's
    all_gather_reduced refuses it, and so does jax_gin's."""
    mesh = mesh_2d()

    def body(v):
        r = lax.pcast(v, ("x",), to="reduced")  # varying over y, reduced over x
        with pytest.raises(ValueError, match="all_gather_reduced's input cannot be reduced"):
            lax.all_gather(r, ("x", "y"), tiled=True, to="reduced")
        with pytest.raises(ValueError, match=r"jax_gin.all_gather: to='reduced' takes no input "
                                             r"reduced over the axes \(as lax's\); it is "
                                             r"reduced over \['x'\]"):
            jax_gin.all_gather(r, ("x", "y"), tiled=True, to="reduced")
        return v
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("y"), out_specs=P("y"))).trace(
        jnp.ones(8))


def test_vmap_inside_shard_map():
    n = ndev()
    x = exact_input((5, 3, 2 * n), n, "float32", 9).reshape(n, 5, 3, 2 * n)

    def body(v):
        out = []
        for impl, ref in OPS.values():
            f = lambda a, impl=impl: impl(a, "i", scatter_dimension=1, tiled=True) \
                if impl in (jax_gin.psum_scatter, lax.psum_scatter) else impl(a, "i", axis=1)
            g = lambda a, ref=ref: ref(a, "i", scatter_dimension=1, tiled=True) \
                if ref is lax.psum_scatter else ref(a, "i", axis=1)
            out.append((jax.vmap(f)(v[0])[None], jax.vmap(g)(v[0])[None]))
        return out

    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"),), out_specs=P("i")))
    for got, want in f(x):
        assert_bitwise(got, want)


def test_vmap_over_the_named_axis():
    """vmap with axis_name: the vmapped axis is the group (computed locally, as lax does)."""
    n = 4
    x = jnp.arange(n * n * 3, dtype=jnp.float32).reshape(n, n * 3)
    for op, (ours, ref) in OPS.items():
        got = jax.vmap(lambda v: ours(v, "v", tiled=True), axis_name="v")(x)
        want = jax.vmap(lambda v: ref(v, "v", tiled=True), axis_name="v")(x)
        assert_bitwise(got, want)


def test_label_and_order_with_psum():
    """The custom call is named for profilers, and chains with psum in program order."""
    # With one device, shard_map lowers its body inline and the call keeps only JAX's own
    # location name (jax 0.11.2).
    needs_devices(2)
    n = ndev()
    x = exact_input((8 * n,), n, "float32", 6)

    def body(v):
        s = jax_gin.psum_scatter(v, "i", tiled=True, algorithm="ring")
        t = jax_gin.psum(s, "i")
        return jax_gin.all_gather(t, "i", tiled=True, algorithm="one_shot")

    f = smap(body, mesh_1d(), P("i"))
    text = f.lower(x).as_text(debug_info=True)
    size = _primitive.size_text(8 * n * 4)  # the larger side per device
    labels = re.findall(r'loc\("(jax_gin\.[a-z_]+\[[^\]]*\])', text)
    assert f"jax_gin.psum_scatter[ring {size} float32]" in labels, labels
    assert f"jax_gin.all_gather[one_shot {size} float32]" in labels, labels
    ref = smap(lambda v: lax.all_gather(lax.psum(lax.psum_scatter(v, "i", tiled=True), "i"),
                                        "i", tiled=True), mesh_1d(), P("i"))
    assert_bitwise(f(x), ref(x))


def test_errors_at_trace_time():
    n = ndev()
    mesh = mesh_1d()

    def run(body, shape=(n * 4, 6)):
        return smap(body, mesh, P("i"))(jnp.zeros(shape, jnp.float32))

    with pytest.raises(ValueError, match=r"scatter dimension 0 has size 4; untiled it must equal "
                                         rf"the size of axis 'i' \({n}\)"):
        run(lambda v: jax_gin.psum_scatter(v, "i")[None])
    if n > 1:  # (every size divides 1)
        with pytest.raises(ValueError, match=rf"tiled scatter dimension 1 of size {n + 1} is "
                                             rf"not divisible by the size of axis 'i' \({n}\)"):
            run(lambda v: jax_gin.psum_scatter(v, "i", scatter_dimension=1, tiled=True),
                (n * 4, n + 1))
    with pytest.raises(ValueError, match=r"scatter_dimension=2 is out of range"):
        run(lambda v: jax_gin.psum_scatter(v, "i", scatter_dimension=2, tiled=True))
    with pytest.raises(ValueError, match=r"axis=3 is out of range for a value of shape \(4, 6\), "
                                         r"whose stacked result has 3 dimensions \(valid: -3 to 2\)"):
        run(lambda v: jax_gin.all_gather(v, "i", axis=3)[0])
    with pytest.raises(ValueError, match=r"tiled=True needs an array"):
        run(lambda v: jax_gin.all_gather(v[0, 0], "i", tiled=True)[None])
    with pytest.raises(NameError, match=r"unbound axis name: j"):
        run(lambda v: jax_gin.all_gather(v, "j", tiled=True))
    with pytest.raises(ValueError, match=r"unknown algorithm 'two_shot'; expected 'auto' or one "
                                         r"of 'one_shot', 'ring'"):
        run(lambda v: jax_gin.all_gather(v, "i", tiled=True, algorithm="two_shot"))
    with pytest.raises(TypeError, match=r"psum_scatter: unsupported dtype int8; supported dtypes "
                                        r"are .*, complex64, complex128, uint64\n"):
        run(lambda v: jax_gin.psum_scatter(v.astype(jnp.int8), "i", tiled=True).astype(jnp.float32))
    with pytest.raises(ValueError, match=r"psum_scatter: scatter_dimension=0, but a scalar has no "
                                         r"dimension to scatter along"):
        run(lambda v: jax_gin.psum_scatter(v[0, 0], "i") + v)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"all_gather: bucket_bytes must be a positive "
                                             rf"integer, got {bad!r}"):
            run(lambda v: jax_gin.all_gather(v, "i", tiled=True, bucket_bytes=bad))


@pytest.mark.parametrize("tiled", [True, False])
@pytest.mark.parametrize("op", list(OPS))
def test_non_array_leaf_is_named(op, tiled):
    """A leaf that is no array (a string) is named as such, not taken for a scalar."""
    ours = OPS[op][0]
    f = smap(lambda v: (ours("abc", "i", tiled=tiled), v)[1], mesh_1d(), P("i"))
    with pytest.raises(TypeError, match=rf"^jax_gin.{op}: .*'abc'.* is not a valid JAX array type"):
        f(jnp.zeros((ndev(),), jnp.float32))


def test_threads_harness_group_sizes():
    """The schedules over group sizes and windows no mesh here has: several rounds (small
    windows) and chunks, odd rank counts, against numpy."""
    ops = _native.COLLECTIVE_OPS
    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 7, 16):
        for algo in COLLECTIVE_ALGORITHMS:
            code = ALGORITHM_CODES[algo]
            for block in (4, 36, 1000):
                x = rng.integers(-50, 50, size=(n, n * block)).astype(np.float32)
                y = _native.cpu.threads_collective(x, ops["psum_scatter"], code, 4096,
                                                   repeats=2, chunk_bytes=64)
                assert_bitwise(y, x.reshape(n, n, block).sum(0))
                z = rng.integers(-50, 50, size=(n, block)).astype(np.int32)
                g = _native.cpu.threads_collective(z, ops["all_gather"], code, 4096,
                                                   repeats=2, chunk_bytes=64)
                np.testing.assert_array_equal(g, np.tile(z.reshape(1, -1), (n, 1)))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("algo", COLLECTIVE_ALGORITHMS)
def test_fault_injection_names_the_collective(monkeypatch, op, algo):
    needs_devices(2)  # rank 1 is the faulty one
    if jax.default_backend() != "cpu":
        pytest.skip("the GPU fault test runs in the native harness (a trap kills the context)")
    timeout = 0.4 + 0.01 * list(OPS).index(op) + 0.02 * COLLECTIVE_ALGORITHMS.index(algo)
    monkeypatch.setattr(jax_gin.runtime.settings, "timeout_s", timeout)
    monkeypatch.setattr(jax_gin.runtime.settings, "fault_rank", 1)
    n = ndev()
    x = exact_input((16 * n,), n, "float32")
    ours = OPS[op][0]
    f = smap(lambda v: ours(v, "i", tiled=True, algorithm=algo), mesh_1d(), P("i"))
    with pytest.raises(Exception) as info:
        jax.block_until_ready(f(x))
    msg = str(info.value)
    assert re.search(rf"jax_gin {op} \({algo}\) on CPU: rank \d+ of group 0", msg), msg
    assert re.search(r"waiting for peer \d+", msg), msg


@pytest.mark.parametrize("dtype", ["float32", "int32", "complex64"])
@pytest.mark.parametrize("api,kw,shape", [
    ("psum_scatter", {}, (0, 0, 3)),
    ("psum_scatter", {"scatter_dimension": 1}, (0, 2, 0)),
    ("all_gather", {}, (0, 5, 3)),
    ("all_gather", {"axis": 2}, (0, 5, 3)),
    ("all_gather", {"axis": 1, "tiled": True}, (0, 5, 3)),
])
def test_vmap_axis_of_no_elements(api, kw, shape, dtype):
    # Over a vmapped axis of an empty batch there is nothing to move: lax's (empty) results
    x = jnp.zeros(shape, dtype)
    ours = jax.vmap(lambda v: getattr(jax_gin, api)(v, "b", **kw), axis_name="b")(x)
    ref = jax.vmap(lambda v: getattr(lax, api)(v, "b", **kw), axis_name="b")(x)
    assert_bitwise(ours, ref)


def test_vmap_axis_of_no_elements_tiled_scatter():
    # (lax's tiled psum_scatter fails there with a ZeroDivisionError)
    with pytest.raises(ValueError, match=r"tiled, the scatter dimension is divided by the size "
                                         r"of axis 'b', which is 0"):
        jax.vmap(lambda v: jax_gin.psum_scatter(v, "b", tiled=True), axis_name="b")(
            jnp.zeros((0, 4, 3)))
