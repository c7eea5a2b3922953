"""jax_gin.psum_add_rmsnorm: against lax and the unfused jax_gin composition, bit for bit where
the math allows it, across ranks, under check_vma on and off, with grad, jvp and vmap, and its
errors at trace time.

The reference of normed is defined precisely (include/jax_gin/norm.h): per row, in float32,
v = sum(r * r) / d + eps, inv = float32(1 / sqrt(float64(v))) (a correctly rounded rsqrt),
normed = T(T(r * inv) * weight). On exact inputs (small integers; weights powers of two) the
sum of squares is exact, so a NumPy reference gives the very bits on every backend. XLA's own
rsqrt is approximate (up to 2 ulp of float32 on CPU), so a jnp composition with lax.rsqrt
agrees only to a tolerance: NORM_RTOL per dtype (4 ulp of float32; 1 ulp of the 16-bit types,
where the product may round the other way).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, mesh_2d, ndev, needs_devices
from helpers import assert_bitwise, auto_runs_kernel, kernel_algorithm

DTYPES = ["float32", "bfloat16", "float16"]
ALGOS = jax_gin.ALGORITHMS + ("auto",)
NORM_RTOL = {"float32": 4 * 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
EPS = 1e-6


def _exact(shape, dtype, seed, lo=-7, hi=8):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(lo, hi, size=shape).astype(np.float32)).astype(dtype)


def _weight(d, dtype, seed=3):
    rng = np.random.default_rng(seed)
    return jnp.asarray(2.0 ** rng.integers(-2, 3, size=(d,))).astype(dtype)


def _np_norm(new_res, weight, eps=EPS):
    """The norm as norm.h defines it, in NumPy, the sum of squares in element order in float64,
    rounded to float32 once (the CPU backend's; on inputs whose sums are exact, any order gives
    these bits)."""
    new_res, weight = np.asarray(new_res), np.asarray(weight)
    dt = new_res.dtype
    r = new_res.astype(np.float32)
    ss = np.cumsum(r * r, axis=-1, dtype=np.float64)[..., -1:].astype(np.float32)
    v = ss / np.float32(r.shape[-1]) + np.float32(eps)
    inv = (1.0 / np.sqrt(v.astype(np.float64))).astype(np.float32)
    n = (r * inv).astype(dt)
    return (n.astype(np.float32) * weight.astype(np.float32)).astype(dt)


def _jnp_norm(new_res, weight, eps=EPS):
    r = new_res.astype(jnp.float32)
    return (r * lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + eps)).astype(new_res.dtype) * weight


def _fused_and_refs(mesh, specs, axes, algo, check_vma, eps=EPS):
    def f(x, res, w):
        normed, new_res = jax_gin.psum_add_rmsnorm(x, res, w, axes, eps=eps, algorithm=algo)
        lax_res = res + lax.psum(x, axes)
        gin_res = res + jax_gin.psum(x, axes, algorithm=algo)
        return normed, new_res, lax_res, _jnp_norm(lax_res, w, eps), gin_res
    out = specs[0]
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=(out,) * 5,
                                 check_vma=check_vma))


def _kernel_runs(algo) -> bool:
    """Whether the op runs jax_gin's kernel over mesh_1d(): auto over one device is XLA's
    composition (test_group_of_one.py), whose rsqrt is XLA's, not norm.h's."""
    return algo != "auto" or auto_runs_kernel()


def _check(got, x, res, w, dtype, algo):
    normed, new_res, lax_res, jnp_normed, gin_res = got
    assert new_res.dtype == normed.dtype == np.dtype(dtype)
    assert_bitwise(new_res, lax_res)
    assert_bitwise(new_res, gin_res)
    if _kernel_runs(algo):
        assert_bitwise(normed, _np_norm(new_res, np.asarray(w)))
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(jnp_normed, np.float32),
                               rtol=NORM_RTOL[dtype], atol=0)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_1d(dtype, algo, check_vma):
    n = ndev()
    mesh = mesh_1d()
    # rows odd, d odd, a single row, a 3-D input, rows longer than a CTA on the GPU, and rows of
    # whole 16-byte chunks, several to an LL lane, with a partly filled last lane on the GPU
    for k, local in enumerate([(3, 5), (1, 127), (2, 3, 33), (3, 1031), (5, 1024)]):
        shape = (n * local[0],) + local[1:]
        x, res = _exact(shape, dtype, seed=k), _exact(shape, dtype, seed=10 + k)
        w = _weight(local[-1], dtype, seed=k)
        f = _fused_and_refs(mesh, (P("i"), P("i"), P()), "i", algo, check_vma)
        _check(f(x, res, w), x, res, w, dtype, algo)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axes", ["x", "y", ("x", "y")])
def test_bitwise_2d_mesh(axes, check_vma):
    """Residual and weight vary over other axes than x's remaining ones (the vma union)."""
    mesh = mesh_2d()
    nx, ny = mesh.devices.shape
    x = _exact((nx * ny * 3, 9), "bfloat16", seed=1)
    res = _exact((nx * 3, 9), "bfloat16", seed=2)
    w = jnp.concatenate([_weight(9, "bfloat16", seed=s) for s in range(ny)])
    # x: rows over both axes; residual: rows over x only; weight: one per y coordinate
    f = _fused_and_refs(mesh, (P(("x", "y")), P("x"), P("y")), axes, "one_shot", check_vma)
    if check_vma:
        got = f(x, res, w)
    else:
        # without vma typing every output is assumed to vary over both axes
        f = _fused_and_refs(mesh, (P(("x", "y")), P(("x", "y")), P()), axes, "one_shot", False)
        res = jnp.tile(res.reshape(nx, 1, 3, 9), (1, ny, 1, 1)).reshape(-1, 9)
        w = w[:9]
        got = f(x, res, w)
    normed, new_res, lax_res, jnp_normed, gin_res = got
    assert_bitwise(new_res, lax_res)
    assert_bitwise(new_res, gin_res)
    # norm.h's bits: each device's rows (x's rows over (x, y) in mesh order) with its y
    # coordinate's weight
    ws = np.asarray(w).reshape(-1, 9)
    rows = np.asarray(new_res).reshape(nx, ny, 3, 9)
    want = np.stack([_np_norm(rows[:, k], ws[k % len(ws)]) for k in range(ny)], axis=1)
    assert_bitwise(normed, want.reshape(-1, 9))
    # jnp's norm takes XLA's rsqrt (up to 2 ulp of float32 off), which may round the other way
    # to bfloat16: 1 ulp of bfloat16 apart at most
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(jnp_normed, np.float32),
                               rtol=NORM_RTOL["bfloat16"], atol=0)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ranks_bitwise_identical(dtype, algo):
    """Random (inexact) inputs: every rank's results are the same bits; new_residual is
    residual + jax_gin.psum(x) of the same algorithm bit for bit (the call all-reduces as psum
    does, then adds the residual rounding once), and on CPU devices normed is norm.h's, whose
    sums run in element order there."""
    needs_devices(2)
    n = ndev()
    mesh = mesh_1d()
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((n * 5, 257)), dtype)
    res = jnp.asarray(rng.standard_normal((5, 257)), dtype)
    w = jnp.asarray(rng.standard_normal((257,)), dtype)

    def body(x, r, w):
        normed, new_res = jax_gin.psum_add_rmsnorm(x, r, w, "i", eps=1e-5, algorithm=algo)
        return normed, new_res, r + jax_gin.psum(x, "i", algorithm=algo)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P(), P()),
                              out_specs=(P("i"),) * 3, check_vma=False))
    normed, new_res, gin_res = (np.asarray(o).reshape(n, 5, 257) for o in f(x, res, w))
    for k in range(1, n):
        assert_bitwise(normed[k], normed[0])
        assert_bitwise(new_res[k], new_res[0])
    assert_bitwise(new_res, gin_res)
    if jax.default_backend() == "cpu" and _kernel_runs(algo):
        assert_bitwise(normed[0], _np_norm(new_res[0], w, eps=1e-5))


def _unfused(x, res, w, axes, algo=None, eps=EPS):
    """The unfused composition: residual + the all-reduce (lax.psum; jax_gin.psum where `algo`
    names its algorithm), then the jnp RMSNorm."""
    s = lax.psum(x, axes) if algo is None else jax_gin.psum(x, axes, algorithm=algo)
    new_res = res + s
    return _jnp_norm(new_res, w, eps), new_res


def _check_grads(fused, unfused_gin, unfused_lax, check_vma):
    """The gradients are the unfused composition's (the JVP is jax_gin's psum of the tangent,
    then the norm's JVP in jnp): the same bits as with jax_gin.psum of the same algorithm, and
    lax's composition's bits, except x's cotangent without check_vma. There psum's transpose
    is a psum of cotangents that are not small integers (they hold the norm's rsqrt), which
    jax_gin's algorithm may add in another order than XLA's all-reduce (ring does on 8 CPU
    devices), so that one agrees to float32 rounding. (Under check_vma the
    transpose of a psum with an invariant result adds nothing up.) On GPUs XLA fuses the
    backward reductions of the two programs (the weight's cotangent sums over rows)
    differently, so there every cotangent agrees to float32 rounding (one H200, 2026-12-02:
    the weight's differs by 1 ulp in 2 of 17 elements)."""
    if jax.default_backend() != "cpu":
        for ref in (unfused_gin, unfused_lax):
            for a, b in zip(fused, ref, strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        return
    jax.tree.map(assert_bitwise, fused, unfused_gin)
    jax.tree.map(assert_bitwise, fused[1:], unfused_lax[1:])
    if check_vma:
        assert_bitwise(fused[0], unfused_lax[0])
    else:
        np.testing.assert_allclose(np.asarray(fused[0]), np.asarray(unfused_lax[0]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", ["one_shot", "ring"])
def test_grad_matches_unfused(algo, check_vma):
    n = ndev()
    mesh = mesh_1d()
    x, res, c1, c2 = (_exact((n * 3, 17), "float32", seed=s) for s in (11, 12, 13, 14))
    w = _weight(17, "float32", seed=15)

    def grads(fn):
        sm = jax.shard_map(fn, mesh=mesh, in_specs=(P("i"), P("i"), P()),
                           out_specs=(P("i"), P("i")), check_vma=check_vma)
        return jax.jit(jax.grad(lambda x, r, w: jnp.sum(sm(x, r, w)[0] * c1)
                                + jnp.sum(sm(x, r, w)[1] * c2), argnums=(0, 1, 2)))(x, res, w)

    _check_grads(grads(lambda x, r, w: jax_gin.psum_add_rmsnorm(x, r, w, "i", algorithm=algo)),
                 grads(lambda x, r, w: _unfused(x, r, w, "i", algo=algo)),
                 grads(lambda x, r, w: _unfused(x, r, w, "i")), check_vma)


def test_jvp_matches_unfused():
    """On exact inputs and tangents: the tangents are lax's composition's bits (new_residual's
    an exact sum; normed's jnp's JVP of the norm at the same point), new_residual too; normed
    is norm.h's (its correctly rounded rsqrt), within NORM_RTOL of the jnp composition's."""
    n = ndev()
    mesh = mesh_1d()
    args = [_exact((n * 2, 8), "float32", seed=1), _exact((n * 2, 8), "float32", seed=2),
            _weight(8, "float32")]
    tans = [_exact(a.shape, "float32", seed=10 + k) for k, a in enumerate(args)]

    def run(fn):
        sm = jax.shard_map(fn, mesh=mesh, in_specs=(P("i"), P("i"), P()),
                           out_specs=(P("i"), P("i")))
        return jax.jit(lambda a, t: jax.jvp(sm, a, t))(tuple(args), tuple(tans))

    (p1, t1) = run(lambda x, r, w: jax_gin.psum_add_rmsnorm(x, r, w, "i",
                                                            algorithm=kernel_algorithm()))
    (p2, t2) = run(lambda x, r, w: _unfused(x, r, w, "i"))
    jax.tree.map(assert_bitwise, t1, t2)
    assert_bitwise(p1[1], p2[1])
    assert_bitwise(p1[0], _np_norm(p1[1], args[2]))
    np.testing.assert_allclose(np.asarray(p1[0]), np.asarray(p2[0]), rtol=NORM_RTOL["float32"],
                               atol=0)


@pytest.mark.parametrize("weight_batched", [False, True])
def test_vmap(weight_batched):
    n = ndev()
    mesh = mesh_1d()
    B, d = 3, 11
    x = _exact((B, n * 2, d), "float32", seed=1)
    res = _exact((B, n * 2, d), "float32", seed=2)
    w = jnp.stack([_weight(d, "float32", seed=s) for s in range(B)])
    w_axis = 0 if weight_batched else None
    w_in = w if weight_batched else w[0]

    def body(fn):
        return jax.vmap(fn, in_axes=(0, 0, w_axis))

    def run(fn):
        return jax.jit(jax.shard_map(body(fn), mesh=mesh, in_specs=(P(None, "i"), P(None, "i"), P()),
                                     out_specs=(P(None, "i"), P(None, "i"))))(x, res, w_in)

    normed, new_res = run(lambda x, r, w: jax_gin.psum_add_rmsnorm(x, r, w, "i",
                                                                algorithm=kernel_algorithm()))
    _, want_res = run(lambda x, r, w: _unfused(x, r, w, "i"))
    assert_bitwise(new_res, want_res)
    ws = np.asarray(w) if weight_batched else np.broadcast_to(np.asarray(w[0]), w.shape)
    for b in range(B):
        assert_bitwise(normed[b], _np_norm(new_res[b], ws[b]))


def test_xla_fallback(cpu_table_with_xla):
    """Where `auto` picks XLA's all-reduce, the op lowers to the unfused composition."""
    if jax.default_backend() != "cpu":
        pytest.skip("the fixture's table is for CPU devices")
    n = ndev()
    mesh = mesh_1d()
    x, res = _exact((n * 4, 1000), "float32", 1), _exact((n * 4, 1000), "float32", 2)
    w = _weight(1000, "float32")
    f = _fused_and_refs(mesh, (P("i"), P("i"), P()), "i", "auto", True)
    text = f.lower(x, res, w).as_text()
    assert "jax_gin_add_rmsnorm" not in text and "all_reduce" in text
    normed, new_res, lax_res, jnp_normed, _ = f(x, res, w)
    assert_bitwise(new_res, lax_res)
    assert_bitwise(normed, jnp_normed)  # the same XLA math


def test_one_custom_call():
    mesh = mesh_1d()
    n = ndev()
    x = _exact((n * 2, 8), "bfloat16", 1)
    f = jax.jit(jax.shard_map(lambda x, r, w: jax_gin.psum_add_rmsnorm(x, r, w, "i", algorithm="one_shot"),
                              mesh=mesh, in_specs=(P("i"), P("i"), P()), out_specs=(P("i"), P("i"))))
    text = f.lower(x, x, _weight(8, "bfloat16")).as_text()
    assert text.count("custom_call") == 1 and "jax_gin_add_rmsnorm" in text
    assert "all_reduce" not in text


def test_no_axes_and_constant_x():
    mesh = mesh_1d()
    n = ndev()
    x, res, w = _exact((n, 4), "float32", 1), _exact((n, 4), "float32", 2), _weight(4, "float32")
    f = jax.jit(jax.shard_map(lambda x, r, w: jax_gin.psum_add_rmsnorm(x, r, w, ()),
                              mesh=mesh, in_specs=(P("i"), P("i"), P()), out_specs=(P("i"), P("i"))))
    normed, new_res = f(x, res, w)
    assert_bitwise(new_res, res + x)
    assert_bitwise(normed, _jnp_norm(new_res, w))  # no communication: the norm of jnp
    c = jnp.ones((1, 4), jnp.float32)
    g = jax.jit(jax.shard_map(lambda r, w: jax_gin.psum_add_rmsnorm(c, r, w, "i"),
                              mesh=mesh, in_specs=(P("i"), P()), out_specs=(P("i"), P("i"))))
    normed, new_res = g(res, w)
    assert_bitwise(new_res, res + n)
    assert_bitwise(normed, _jnp_norm(new_res, w))


# ---- errors at trace time ------------------------------------------------------------------

def _trace(x, res, w, axis="i", **kw):
    mesh = mesh_1d()
    specs = tuple(P("i") if np.ndim(a) >= 1 and np.shape(a)[0] % ndev() == 0 and np.ndim(a) > 1
                  else P() for a in (x, res, w))
    f = jax.shard_map(lambda x, r, w: jax_gin.psum_add_rmsnorm(x, r, w, axis, **kw), mesh=mesh,
                      in_specs=specs, out_specs=(P(), P()), check_vma=False)
    return jax.jit(f).lower(x, res, w)


def _good(d=8, dtype="float32"):
    n = ndev()
    return _exact((n * 2, d), dtype, 1), _exact((n * 2, d), dtype, 2), _weight(d, dtype)


@pytest.mark.parametrize("case, match", [
    ("residual_shape", r"ValueError: .*residual must have x's shape \(\d+, 8\), got \(\d+, 4\)"),
    ("residual_dtype", r"TypeError: .*residual must have x's dtype float32, got bfloat16 \(the "
                       r"call takes one dtype: cast it\)"),
    ("weight_size", r"ValueError: .*weight must be 1-D of size x.shape\[-1\] = 8, got shape \(7,\)"),
    ("weight_2d", r"ValueError: .*weight must be 1-D of size x.shape\[-1\] = 8"),
    ("weight_dtype", r"TypeError: .*weight must have x's dtype float32, got bfloat16"),
])
def test_bad_shapes(case, match):
    n = ndev()
    x, res, w = _good()
    if case == "residual_shape":
        res = _exact((n * 2, 4), "float32", 2)
    elif case == "residual_dtype":
        res = res.astype(jnp.bfloat16)
    elif case == "weight_size":
        w = _weight(7, "float32")
    elif case == "weight_2d":
        w = jnp.ones((1, 8), jnp.float32)
    elif case == "weight_dtype":
        w = w.astype(jnp.bfloat16)
    with pytest.raises((ValueError, TypeError)) as info:
        _trace(x, res, w)
    assert re.search(match, f"{info.type.__name__}: {info.value}"), info.value


@pytest.mark.parametrize("api, none", [("psum_add_rmsnorm", "weight"),
                                       ("psum_add_layernorm", "weight"),
                                       ("psum_add_layernorm", "bias")])
def test_none_for_an_array_is_named(api, none):
    x, res, w = _good()
    args = {"weight": w, "bias": jnp.zeros_like(w)} if api == "psum_add_layernorm" else {"weight": w}
    args[none] = None
    f = jax.shard_map(lambda x, r: getattr(jax_gin, api)(x, r, *args.values(), "i"),
                      mesh=mesh_1d(), in_specs=P("i"), out_specs=P("i"), check_vma=False)
    with pytest.raises(TypeError, match=f"jax_gin.{api}: {none} is None; pass an array"):
        jax.jit(f).trace(x, res)


@pytest.mark.parametrize("dtype, err, match", [
    ("int32", TypeError, "x must be a floating-point array"),
    ("float64", TypeError, "unsupported dtype float64; supported dtypes are float32, bfloat16, float16"),
])
def test_bad_dtype(dtype, err, match):
    with jax.enable_x64(True):
        x, res, w = (a.astype(dtype) for a in _good())
        with pytest.raises(err, match=match):
            _trace(x, res, w)


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf"), 1e40, True, "1e-6", None])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match="eps must be a number >= 0 that is finite in float32"):
        _trace(*_good(), eps=eps)


def test_unknown_axis():
    with pytest.raises(NameError, match="unbound axis name: j"):
        _trace(*_good(), axis="j")


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="psum_add_rmsnorm"):
        _trace(*_good(), algorithm="bogus")


def test_scalar_x():
    with pytest.raises(ValueError, match="at least one dimension"):
        _trace(jnp.float32(1), jnp.float32(1), jnp.ones((1,), jnp.float32))


def test_outside_shard_map():
    x, res, w = _good()
    with pytest.raises(NameError, match=r"jax_gin.psum_add_rmsnorm: Found an unbound axis name: i"):
        jax.jit(lambda x, r, w: jax_gin.psum_add_rmsnorm(x, r, w, "i"))(x, res, w)


def test_partially_manual_shard_map():
    """axis_names= one mesh axis, the other automatic: the unfused composition, sharded."""
    if ndev() < 8:
        pytest.skip("needs 8 devices")
    from jax.sharding import Mesh, NamedSharding
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    x = jax.device_put(_exact((8, 6), "float32", 1), NamedSharding(mesh, P("x", None)))
    res = jax.device_put(_exact((8, 6), "float32", 2), NamedSharding(mesh, P("x", None)))
    w = _weight(6, "float32")

    def f(x, r, w):
        normed, new_res = jax_gin.psum_add_rmsnorm(x, r, w, "x", algorithm="one_shot")
        want = r + lax.psum(x, "x")
        return normed, new_res, want, _jnp_norm(want, w)
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x"), P()),
                              out_specs=(P("x"),) * 4, axis_names={"x"}))
    normed, new_res, want, want_normed = g(x, res, w)
    assert_bitwise(new_res, want)
    assert_bitwise(normed, want_normed)  # the unfused composition: the same XLA math


# ---- psum_add_layernorm: the same kernel with a mean and a bias --------------------------

LN_EPS = 1e-5


def _small(shape, dtype, seed, lo, hi):
    return _exact(shape, dtype, seed, lo=lo, hi=hi)


def _np_layernorm(new_res, weight, bias, eps=LN_EPS):
    """LayerNorm as norm.h defines it, in NumPy, every sum in element order in float64, rounded
    to float32 once (the CPU backend's; on inputs whose sums are exact, any order gives these
    bits)."""
    new_res, weight, bias = (np.asarray(v) for v in (new_res, weight, bias))
    dt = new_res.dtype
    r = new_res.astype(np.float32)
    d = np.float32(r.shape[-1])
    mean = np.cumsum(r, axis=-1, dtype=np.float64)[..., -1:].astype(np.float32) / d
    c = r - mean
    ss = np.cumsum(c * c, axis=-1, dtype=np.float64)[..., -1:].astype(np.float32)
    inv = (1.0 / np.sqrt((ss / d + np.float32(eps)).astype(np.float64))).astype(np.float32)
    n = (c * inv).astype(dt).astype(np.float32)
    out = (n * weight.astype(np.float32)).astype(dt).astype(np.float32)
    return (out + bias.astype(np.float32)).astype(dt)


def _jnp_layernorm(new_res, weight, bias, eps=LN_EPS):
    """LayerNorm as psum_add_layernorm documents it, in jnp (XLA's rsqrt): with r the new
    residual in float32 and m = mean(r, -1), ((r - m) * rsqrt(mean((r - m)**2, -1) + eps))
    rounded to the dtype, times weight, plus bias, each rounding to the dtype."""
    r = new_res.astype(jnp.float32)
    c = r - jnp.mean(r, axis=-1, keepdims=True)
    normed = (c * lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps)).astype(new_res.dtype)
    return normed * weight + bias


def _layer_refs(mesh, specs, axes, algo, check_vma, eps=LN_EPS):
    def f(x, res, w, b):
        normed, new_res = jax_gin.psum_add_layernorm(x, res, w, b, axes, eps=eps, algorithm=algo)
        lax_res = res + lax.psum(x, axes)
        return normed, new_res, lax_res, _jnp_layernorm(lax_res, w, b, eps=eps)
    out = specs[0]
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=(out,) * 4,
                                 check_vma=check_vma))


def _ln_inputs(local, dtype, seed):
    n = ndev()
    shape = (n * local[0],) + local[1:]
    d = local[-1]
    return (_small(shape, dtype, seed, -1, 2), _small(shape, dtype, seed + 1, -2, 3),
            _weight(d, dtype, seed + 2), _small((d,), dtype, seed + 3, -2, 3))


def _ln_close(got, want, dtype, exact_sums):
    """Against jnp's LayerNorm (XLA's approximate rsqrt; and, where the sums of the centered
    squares round, XLA's pairwise order against the CPU backend's element order)."""
    ulp = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}[dtype]
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if exact_sums:
        rtol, atol = NORM_RTOL[dtype], 8 * ulp
    else:  # relative to the row's largest terms: the bias add may cancel them
        rtol = max(NORM_RTOL[dtype], 1e-4)
        atol = rtol * float(np.max(np.abs(want)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_bitwise_1d(dtype, algo, check_vma):
    """Rows of 8, 16 and 32 of small integers: every sum of the norm is exact, so NumPy's
    reference gives the very bits on every backend; a row of 1031 is compared on CPU devices,
    whose sums run in element order as the reference's do, and to jnp's LayerNorm anywhere."""
    mesh = mesh_1d()
    f = _layer_refs(mesh, (P("i"), P("i"), P(), P()), "i", algo, check_vma)
    for k, local in enumerate([(3, 8), (1, 16), (2, 3, 32), (3, 1031)]):
        x, res, w, b = _ln_inputs(local, dtype, 10 * k)
        normed, new_res, lax_res, jnp_normed = f(x, res, w, b)
        assert normed.dtype == new_res.dtype == np.dtype(dtype)
        assert_bitwise(new_res, lax_res)
        if _kernel_runs(algo) and (local[-1] <= 32 or jax.default_backend() == "cpu"):
            assert_bitwise(normed, _np_layernorm(new_res, w, b))
        _ln_close(normed, jnp_normed, dtype, exact_sums=local[-1] <= 32)


def test_layernorm_of_long_rows_with_a_mean():
    """Rows of d = 16384 whose mean is far from zero (24, as a residual stream's may be): the
    mean and the centered sum of squares stay accurate, normed within jnp's distance of the
    float64 value (a float32 sum in element order was more than 10x further)."""
    needs_devices(2)
    n, d = ndev(), 16384
    rng = np.random.default_rng(23)
    x = jnp.asarray(3.0 + rng.standard_normal((n * 2, d)) * 0.1, jnp.float32)
    res = jnp.asarray(rng.standard_normal((2, d)), jnp.float32)
    w, b = jnp.ones((d,), jnp.float32), jnp.zeros((d,), jnp.float32)

    def body(x, r):
        normed, new_res = jax_gin.psum_add_layernorm(x, r, w, b, "i", algorithm="one_shot")
        return normed, new_res, _jnp_layernorm(new_res, w, b)
    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"), P()),
                              out_specs=(P(), P(), P()), check_vma=False))
    normed, r, jnp_normed = (np.asarray(o, np.float64) for o in f(x, res))
    c = r - r.mean(-1, keepdims=True)  # in float64, from the call's own new_residual
    exact = c / np.sqrt((c * c).mean(-1, keepdims=True) + LN_EPS)
    ours, theirs = np.max(np.abs(normed - exact)), np.max(np.abs(jnp_normed - exact))
    assert ours <= 2 * theirs + 2e-7, (ours, theirs)


@pytest.mark.parametrize("algo", ["one_shot", "ring"])
def test_layernorm_ranks_bitwise_identical(algo):
    """As test_ranks_bitwise_identical, for LayerNorm."""
    needs_devices(2)
    n = ndev()
    rng = np.random.default_rng(17)
    x = jnp.asarray(rng.standard_normal((n * 5, 257)), jnp.bfloat16)
    res, w, b = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((5, 257), (257,), (257,)))

    def body(x, r, w, b):
        normed, new_res = jax_gin.psum_add_layernorm(x, r, w, b, "i", algorithm=algo)
        return normed, new_res, r + jax_gin.psum(x, "i", algorithm=algo)
    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"), P(), P(), P()),
                              out_specs=(P("i"),) * 3, check_vma=False))
    normed, new_res, gin_res = (np.asarray(o).reshape(n, 5, 257) for o in f(x, res, w, b))
    for k in range(1, n):
        assert_bitwise(normed[k], normed[0])
        assert_bitwise(new_res[k], new_res[0])
    assert_bitwise(new_res, gin_res)
    if jax.default_backend() == "cpu":
        assert_bitwise(normed[0], _np_layernorm(new_res[0], w, b))


def _ln_unfused(x, res, w, b, axes, algo=None):
    """As _unfused, with the jnp LayerNorm."""
    s = lax.psum(x, axes) if algo is None else jax_gin.psum(x, axes, algorithm=algo)
    new_res = res + s
    return _jnp_layernorm(new_res, w, b), new_res


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", ["one_shot", "ring"])
def test_layernorm_grad_matches_unfused(algo, check_vma):
    n = ndev()
    x, res, w, b = _ln_inputs((3, 17), "float32", 21)
    c1, c2 = (_exact((n * 3, 17), "float32", seed=s) for s in (25, 26))

    def grads(fn):
        sm = jax.shard_map(fn, mesh=mesh_1d(), in_specs=(P("i"), P("i"), P(), P()),
                           out_specs=(P("i"), P("i")), check_vma=check_vma)
        return jax.jit(jax.grad(lambda *a: jnp.sum(sm(*a)[0] * c1) + jnp.sum(sm(*a)[1] * c2),
                                argnums=(0, 1, 2, 3)))(x, res, w, b)

    _check_grads(grads(lambda x, r, w, b: jax_gin.psum_add_layernorm(x, r, w, b, "i",
                                                                     algorithm=algo)),
                 grads(lambda x, r, w, b: _ln_unfused(x, r, w, b, "i", algo=algo)),
                 grads(lambda x, r, w, b: _ln_unfused(x, r, w, b, "i")), check_vma)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", ["psum_add_rmsnorm", "psum_add_layernorm"])
def test_jacfwd_matches_unfused(op, check_vma):
    """jacfwd (vmap of the JVP, whose primal call has no batched operand) and a Hessian: the
    unfused composition's bits. Before, the batching rule batched that call's results."""
    n = ndev()
    x, res, w, b = _ln_inputs((2, 5), "float32", 31)
    if op == "psum_add_rmsnorm":
        fused = lambda x, r, w, b: jax_gin.psum_add_rmsnorm(x, r, w, "i", algorithm="one_shot")  # noqa: E731
        unfused = lambda x, r, w, b: _unfused(x, r, w, "i", algo="one_shot")  # noqa: E731
    else:
        fused = lambda x, r, w, b: jax_gin.psum_add_layernorm(x, r, w, b, "i", algorithm="one_shot")  # noqa: E731
        unfused = lambda x, r, w, b: _ln_unfused(x, r, w, b, "i", algo="one_shot")  # noqa: E731

    def derivs(fn):
        sm = jax.shard_map(fn, mesh=mesh_1d(), in_specs=(P("i"), P("i"), P(), P()),
                           out_specs=(P("i"), P("i")), check_vma=check_vma)
        jac = jax.jacfwd(lambda *a: sm(*a)[0], argnums=(0, 1, 2, 3))
        hess = jax.hessian(lambda *a: jnp.sum(jnp.sin(sm(*a)[0])), argnums=2)
        # one program each, each waited for: in one program, nothing orders the jacobian's
        # calls against the Hessian's (test_order.py::test_independent_blocks_of_one_program)
        return tuple(jax.block_until_ready(jax.jit(d)(x, res, w, b)) for d in (jac, hess))

    got, want = derivs(fused), derivs(unfused)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(assert_bitwise, got[0], want[0])
    # the Hessian's reverse pass sums cotangents that are not small integers: float32 rounding
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
    assert got[0][0].shape == (n * 2, 5, n * 2, 5)


@pytest.mark.parametrize("batched", ["none", "weight", "bias", "both"])
def test_layernorm_vmap(batched):
    n = ndev()
    B, d = 3, 16
    x = _small((B, n * 2, d), "float32", 1, -1, 2)
    res = _small((B, n * 2, d), "float32", 2, -2, 3)
    w = jnp.stack([_weight(d, "float32", seed=s) for s in range(B)])
    b = _small((B, d), "float32", 3, -2, 3).at[:, 0].set(-0.0)  # -0.0: the bias's sign counts
    w_axis = 0 if batched in ("weight", "both") else None
    b_axis = 0 if batched in ("bias", "both") else None
    w_in, b_in = (w if w_axis == 0 else w[0]), (b if b_axis == 0 else b[0])

    def run(fn):
        return jax.jit(jax.shard_map(jax.vmap(fn, in_axes=(0, 0, w_axis, b_axis)), mesh=mesh_1d(),
                                     in_specs=(P(None, "i"), P(None, "i"), P(), P()),
                                     out_specs=(P(None, "i"), P(None, "i"))))(x, res, w_in, b_in)

    normed, new_res = run(lambda x, r, w, b: jax_gin.psum_add_layernorm(
        x, r, w, b, "i", algorithm=kernel_algorithm()))
    _, want_res = run(lambda x, r, w, b: _ln_unfused(x, r, w, b, "i"))
    assert_bitwise(new_res, want_res)
    for k in range(B):
        wk = w[k] if w_axis == 0 else w[0]
        bk = b[k] if b_axis == 0 else b[0]
        assert_bitwise(normed[k], _np_layernorm(new_res[k], wk, bk))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layernorm_vmap_of_a_batched_weight_rounds_as_the_call(dtype):
    """A weight and bias per batch element, on inexact rows: the batched call's normed equals,
    bit for bit, the call made for each element on its own, whose product with the weight is
    rounded before the bias is added (XLA had contracted the two into one multiply-add, in
    float32; bfloat16 gave the same bits either way)."""
    n, B, d = ndev(), 3, 65
    rng = np.random.default_rng(0)
    x, res = (jnp.asarray(rng.normal(size=(B, n * 2, d)), dtype) for _ in range(2))
    w, b = (jnp.asarray(rng.normal(size=(B, d)), dtype) for _ in range(2))

    def op(x, r, w, b):
        return jax_gin.psum_add_layernorm(x, r, w, b, "i", algorithm=kernel_algorithm())

    def run(body):
        return jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P(None, "i"),) * 2 + (P(),) * 2,
                                     out_specs=(P(None, "i"),) * 2))(x, res, w, b)
    batched = run(jax.vmap(op))
    one_by_one = run(lambda x, r, w, b: tuple(jnp.stack(v) for v in zip(
        *(op(x[k], r[k], w[k], b[k]) for k in range(B)))))
    for got, want in zip(batched, one_by_one):
        assert_bitwise(got, want)


def test_layernorm_one_custom_call_and_fallback(cpu_table_with_xla):
    x, res, w, b = _ln_inputs((2, 8), "bfloat16", 1)
    f = jax.jit(jax.shard_map(
        lambda x, r, w, b: jax_gin.psum_add_layernorm(x, r, w, b, "i", algorithm="one_shot"),
        mesh=mesh_1d(), in_specs=(P("i"), P("i"), P(), P()), out_specs=(P("i"), P("i"))))
    text = f.lower(x, res, w, b).as_text()
    assert text.count("custom_call") == 1 and "jax_gin_add_layernorm" in text
    if jax.default_backend() == "cpu":
        # where `auto` picks XLA's all-reduce (the fixture's table), the unfused composition
        x, res, w, b = _ln_inputs((4, 1000), "float32", 2)
        g = _layer_refs(mesh_1d(), (P("i"), P("i"), P(), P()), "i", "auto", True)
        text = g.lower(x, res, w, b).as_text()
        assert "jax_gin_add_layernorm" not in text and "all_reduce" in text
        normed, new_res, lax_res, jnp_normed = g(x, res, w, b)
        assert_bitwise(new_res, lax_res)
        assert_bitwise(normed, jnp_normed)  # the same XLA math


@pytest.mark.parametrize("case, match", [
    ("bias_size", r"ValueError: .*bias must be 1-D of size x.shape\[-1\] = 8"),
    ("bias_dtype", r"TypeError: .*bias must have x's dtype float32, got bfloat16"),
    ("weight_size", r"ValueError: .*weight must be 1-D of size x.shape\[-1\] = 8"),
])
def test_layernorm_bad_shapes(case, match):
    x, res, w = _good()
    b = jnp.zeros((8,), jnp.float32)
    if case == "bias_size":
        b = jnp.zeros((7,), jnp.float32)
    elif case == "bias_dtype":
        b = b.astype(jnp.bfloat16)
    elif case == "weight_size":
        w = _weight(7, "float32")
    f = jax.shard_map(lambda x, r, w, b: jax_gin.psum_add_layernorm(x, r, w, b, "i"),
                      mesh=mesh_1d(), in_specs=(P("i"), P("i"), P(), P()), out_specs=(P(), P()),
                      check_vma=False)
    with pytest.raises((ValueError, TypeError)) as info:
        jax.jit(f).lower(x, res, w, b)
    assert re.search(match, f"{info.type.__name__}: {info.value}"), info.value


@pytest.mark.parametrize("op,eps", [("psum_add_rmsnorm", 1e-6), ("psum_add_layernorm", 1e-5)])
def test_default_eps(op, eps):
    # The documented defaults (README, docs/api.md): eps=1e-6 (RMSNorm) and 1e-5 (LayerNorm). Rows of values near
    # 1e-3, so that mean(r**2) is near eps and another eps changes the result.
    mesh = mesh_1d()
    n = ndev()
    x = jnp.asarray(np.arange(n * 3 * 16).reshape(n * 3, 16) % 5 - 2, jnp.float32) * 1e-3
    res, w = jnp.zeros_like(x), jnp.ones((16,), jnp.float32)
    bias = () if op == "psum_add_rmsnorm" else (jnp.zeros((16,), jnp.float32),)

    def f(x, res):
        call = getattr(jax_gin, op)
        return (call(x, res, w, *bias, "i")[0], call(x, res, w, *bias, "i", eps=eps)[0],
                call(x, res, w, *bias, "i", eps=10 * eps)[0])
    default, explicit, other = jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=(P("i"),) * 3))(x, res)
    assert_bitwise(default, explicit)
    assert not np.array_equal(np.asarray(default), np.asarray(other))
