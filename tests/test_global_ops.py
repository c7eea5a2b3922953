"""Global-view (jit/pjit) operations: parity with jnp, gradients, and the compiled HLO.

Each operation runs under jax.jit on globally sharded arrays, and is compared bit for bit
with the plain jnp expression under the same shardings. The inputs are small integers in
float32, so every sum is exact whatever the reduction order; the tests in bfloat16, float16
and int32 keep the sums small enough to be exact in those too (assert_exact). The structure
tests check that the compiled program holds jax_gin's custom call, and no XLA all-reduce,
wherever the jnp program all-reduces.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_gin
from conftest import ndev, needs_devices
from helpers import assert_bitwise as _assert_bitwise, load_example

AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit


def make_mesh(shape, names, kind):
    if ndev() & (ndev() - 1):
        pytest.skip(f"the test shapes divide by a power-of-two device count, have {ndev()}")
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(kind,) * len(names))


def mesh_dt(kind=AUTO):
    """data x tensor: 2 x (n/2) -- 2 x 4 on 8 CPU devices, 1 x 2 on 2 GPUs."""
    n = ndev()
    return make_mesh((2, n // 2) if n >= 4 else (1, n), ("data", "tensor"), kind)


def mesh_1d(kind=AUTO):
    return make_mesh((ndev(),), ("i",), kind)


def ints(shape, seed=0, lo=-3, hi=4):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(lo, hi, size=shape).astype(np.float32))


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def run_hlo(f, *args):
    """jit(f)(*args) and its compiled HLO text, from one compilation."""
    compiled = jax.jit(f).lower(*args).compile()
    return compiled(*args), compiled.as_text()


def counts(text):
    """(jax_gin custom calls, XLA all-reduces) in compiled HLO text."""
    ours = text.count('custom_call_target="jax_gin_all_reduce')
    xla = sum(1 for line in text.splitlines()
              if " all-reduce(" in line or " all-reduce-start(" in line)
    return ours, xla


def assert_bitwise(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    _assert_bitwise(a.reshape(-1), b.reshape(-1))  # reshaped: 0-d arrays cannot be viewed


def assert_all_bitwise(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_bitwise(a, b)


# The dtype and odd-size tests: the 16-bit floats and int32 (float32, the other tests' dtype,
# takes the same paths). jnp.sum and jnp.mean sum the 16-bit floats in float32, but a
# contraction (its all-reduce too) and the tie count of a max/min gradient sum in the
# operand's own dtype.
ODD_DTYPES = ["bfloat16", "float16", "int32"]


def odd_sizes(mesh, operands, odd):
    """Global sizes for the dimension letters of `operands` ((letters, spec) pairs) such that
    every device's block is `odd[letter]` long: each size times the mesh axes that shard that
    letter in any operand."""
    axes = {c: set() for c in odd}
    for letters, spec in operands:
        for c, entry in zip(letters, tuple(spec) + (None,) * len(letters)):
            axes[c].update(() if entry is None else (entry,) if isinstance(entry, str) else entry)
    return {c: n * int(np.prod([mesh.shape[a] for a in axes[c]])) for c, n in odd.items()}


def assert_exact(bound, dtype):
    """Every partial sum of integer terms, split and ordered in any way, is an integer no
    larger than the sum of the terms' magnitudes. `bound` holds that sum for each result: where
    it is within the integers `dtype` holds exactly, the sum is exact in every order and every
    intermediate rounding, and a bitwise comparison is fair."""
    if jnp.issubdtype(dtype, jnp.integer):
        limit = int(jnp.iinfo(dtype).max)
    else:
        limit = 2 ** (jnp.finfo(dtype).nmant + 1)
    assert np.max(bound) <= limit, f"inputs too large to sum exactly in {dtype}: {np.max(bound)}"


# ---------------------------------------------------------------------------------------
# matmul: forward and gradients, 1-D and 2-D meshes, Auto and Explicit axes

# (x spec, w spec): row-parallel (k sharded), column-parallel, k over both axes, only one
# operand sharded on k, data-parallel batch, replicated.
MATMUL_2D = [
    (P("data", "tensor"), P("tensor", None)),
    (P(None, "tensor"), P("tensor", None)),
    (P("data", None), P(None, "tensor")),
    (P(None, ("data", "tensor")), P(("data", "tensor"), None)),
    (P("data", "tensor"), P(None, None)),
    (P(None, None), P(None, None)),
]
MATMUL_1D = [(P(None, "i"), P("i", None)), (P("i", None), P(None, None)),
             (P(None, None), P(None, "i"))]


def _matmul_case(mesh, sx, sw, x, w):
    xs, ws = put(x, mesh, sx), put(w, mesh, sw)

    def ours(a, b):
        loss = lambda a, b: jnp.sum(jax_gin.matmul(a, b) ** 2)  # noqa: E731
        return jax_gin.matmul(a, b), jax.grad(loss, argnums=(0, 1))(a, b)

    with jax.set_mesh(mesh):
        got = jax.jit(ours)(xs, ws)
        explicit = AxisType.Explicit in mesh.axis_types
        out_spec = got[0].sharding.spec if explicit else None

        def ref(a, b):
            # Under Explicit axes jnp needs the result sharding of a sharded contraction.
            mm = lambda a, b: jnp.matmul(a, b, out_sharding=out_spec)  # noqa: E731
            loss = lambda a, b: jnp.sum(mm(a, b) ** 2)  # noqa: E731
            return mm(a, b), jax.grad(loss, argnums=(0, 1))(a, b)

        want = jax.jit(ref)(xs, ws)
    assert_all_bitwise(got, want)
    assert_bitwise(got[0], np.asarray(x) @ np.asarray(w))
    return got


@pytest.mark.parametrize("kind", [AUTO, EXPLICIT], ids=["auto", "explicit"])
@pytest.mark.parametrize("sx,sw", MATMUL_2D, ids=[f"{a}x{b}" for a, b in MATMUL_2D])
def test_matmul_2d(kind, sx, sw):
    _matmul_case(mesh_dt(kind), sx, sw, ints((16, 32)), ints((32, 8), seed=1))


@pytest.mark.parametrize("sx,sw", MATMUL_1D, ids=[f"{a}x{b}" for a, b in MATMUL_1D])
def test_matmul_1d(sx, sw):
    _matmul_case(mesh_1d(), sx, sw, ints((16, 32)), ints((32, 16), seed=1))


def test_matmul_3d_activations():
    # (batch, seq, d) @ (d, f): batch over data, d over tensor -- a row-parallel layer.
    mesh = mesh_dt()
    x, w = ints((4, 6, 16)), ints((16, 8), seed=1)
    _matmul_case(mesh, P("data", None, "tensor"), P("tensor", None), x, w)


def test_einsum_batched_and_dot():
    mesh = mesh_dt()
    a, b = ints((4, 6, 16)), ints((4, 16, 8), seed=1)
    f = jax.jit(lambda a, b: jax_gin.einsum("bij,bjk->bik", a, b))
    got = f(put(a, mesh, P("data", None, "tensor")), put(b, mesh, P("data", "tensor", None)))
    assert_bitwise(got, jnp.einsum("bij,bjk->bik", a, b))
    u, v = ints((32,)), ints((32,), seed=1)
    dot = jax.jit(lambda u, v: jax_gin.einsum("i,i->", u, v))
    assert_bitwise(dot(put(u, mesh, P(("data", "tensor"))), v), jnp.dot(u, v))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int32"])
def test_einsum_dtypes_and_odd_sizes(dtype):
    # a contraction over a sharded dimension of odd per-device length (3), with odd outer sizes
    mesh = mesh_1d()
    k = 3 * ndev()
    a, b = ints((5, 7, k)).astype(dtype), ints((k, 9), seed=1).astype(dtype)
    f = lambda a, b: jax_gin.einsum("bsd,df->bsf", a, b)  # noqa: E731
    args = put(a, mesh, P(None, None, "i")), put(b, mesh, P("i", None))
    got = jax.jit(f)(*args)
    assert got.dtype == np.dtype(dtype)
    assert_bitwise(got, jnp.einsum("bsd,df->bsf", a, b))
    # jax_gin's all-reduce, no XLA one (over one device nothing to all-reduce)
    assert counts(hlo(f, *args)) == (1 if ndev() > 1 else 0, 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int32"])
def test_matmul_dtypes(dtype):
    mesh = mesh_1d()
    x, w = ints((8, 16)).astype(dtype), ints((16, 8), seed=1).astype(dtype)
    got = jax.jit(jax_gin.matmul)(put(x, mesh, P(None, "i")), put(w, mesh, P("i", None)))
    assert_bitwise(got, jnp.matmul(x, w))


MESHES = {"1d": mesh_1d, "2d": mesh_dt, "2d-explicit": lambda: mesh_dt(EXPLICIT)}
# (mesh, x spec, w spec, dtype): every dtype with four of the cases above, between them
# all-reducing the forward over one and two axes (row-parallel, k over both axes) and each
# backward contraction (dw over a data-parallel batch, dx over a column-parallel n; not for
# int32, which has no gradients), and bfloat16 under Explicit axes. Fewer than every
# pairing: each case compiles two programs.
MATMUL_ODD = [(mesh, sx, sw, dtype) for dtype in ODD_DTYPES
              for mesh, (sx, sw) in [("1d", MATMUL_1D[0]), ("2d", MATMUL_2D[0]),
                                     ("2d", MATMUL_2D[2]), ("2d", MATMUL_2D[3])]
              if dtype != "int32" or (sx, sw) != MATMUL_2D[2]]
MATMUL_ODD += [("2d-explicit", sx, sw, "bfloat16") for sx, sw in (MATMUL_2D[0], MATMUL_2D[2])]


@pytest.mark.parametrize("mesh_name,sx,sw,dtype", MATMUL_ODD,
                         ids=[f"{m}-{a}x{b}-{d}" for m, a, b, d in MATMUL_ODD])
def test_matmul_dtypes_odd_sizes(mesh_name, sx, sw, dtype):
    # x (m, k) @ w (k, n) with 3, 7 and 5 per device on every sharded dimension, and the
    # gradients for an integer cotangent (int32 has none). Values in -2..2 keep the product
    # and both gradients exact in bfloat16 (checked), so jnp's bits and numpy's agree.
    mesh = MESHES[mesh_name]()
    sizes = odd_sizes(mesh, [("mk", sx), ("kn", sw)], {"m": 3, "k": 7, "n": 5})
    m, k, n = sizes["m"], sizes["k"], sizes["n"]
    x, w, ct = ints((m, k), lo=-2, hi=3), ints((k, n), seed=1, lo=-2, hi=3), \
        ints((m, n), seed=2, lo=-2, hi=3)
    x64, w64, ct64 = (np.asarray(v, np.int64) for v in (x, w, ct))
    assert_exact(np.abs(x64) @ np.abs(w64), dtype)  # y = x @ w
    assert_exact(np.abs(ct64) @ np.abs(w64).T, dtype)  # dx = ct @ w.T
    assert_exact(np.abs(x64).T @ np.abs(ct64), dtype)  # dw = x.T @ ct
    x, w, ct = x.astype(dtype), w.astype(dtype), ct.astype(dtype)
    xs, ws = put(x, mesh, sx), put(w, mesh, sw)
    grads = jnp.issubdtype(dtype, jnp.floating)

    def case(mm):
        def f(a, b, c):
            loss = lambda a, b: jnp.sum(mm(a, b) * c)  # noqa: E731  (dy = c)
            return mm(a, b), (jax.grad(loss, argnums=(0, 1))(a, b) if grads else ())
        return run_hlo(f, xs, ws, ct)

    with jax.set_mesh(mesh):
        got, text = case(jax_gin.matmul)
        # Under Explicit axes jnp needs the result sharding of a sharded contraction.
        out_spec = got[0].sharding.spec if mesh_name == "2d-explicit" else None
        want, _ = case(lambda a, b: jnp.matmul(a, b, out_sharding=out_spec))
    ours, xla = counts(text)  # the all-reduces in this dtype are jax_gin's
    assert ours >= (1 if ndev() > 1 else 0) and xla == 0, (ours, xla)
    assert_all_bitwise(got, want)
    assert got[0].sharding.spec == want[0].sharding.spec
    exact = (x64 @ w64, *((ct64 @ w64.T, x64.T @ ct64) if grads else ()))
    for a, b in zip(jax.tree.leaves(got), exact, strict=True):
        assert_bitwise(a, np.asarray(b).astype(dtype))


def test_matmul_preferred_element_type_and_precision():
    mesh = mesh_1d()
    x, w = ints((8, 16)).astype(jnp.bfloat16), ints((16, 8), seed=1).astype(jnp.bfloat16)
    kw = dict(preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    xs, ws = put(x, mesh, P(None, "i")), put(w, mesh, P("i", None))

    # a float32 cotangent that bfloat16 cannot hold (a multiple of 2**-9 near 1): the backward
    # contractions take it as it is, and round their results to bfloat16, as lax's transpose
    c = 1 + ints((8, 8), seed=2).astype(jnp.float32) * 2.0 ** -9

    def f(mm):
        loss = lambda a, b: jnp.sum(mm(a, b, **kw) * c)  # noqa: E731
        return jax.jit(lambda a, b: (mm(a, b, **kw), jax.grad(loss, argnums=(0, 1))(a, b)))

    got, want = f(jax_gin.matmul)(xs, ws), f(jnp.matmul)(xs, ws)
    assert got[0].dtype == np.float32 and got[1][0].dtype == jnp.bfloat16
    assert_all_bitwise(got, want)


# ---------------------------------------------------------------------------------------
# sum, mean, max, min

REDUCTIONS = ["sum", "mean", "max", "min"]
# (axis, keepdims) for an x of shape (8, 12, 4) sharded P("data", "tensor"): over every
# dimension, over the tensor-sharded one, over data plus a replicated one (keepdims), and
# over the replicated one only (no collective).
AXES = [(None, False), (1, False), ((0, 2), True), (-1, False)]


def _reduce_case(mesh, spec, name, axis, keepdims, x):
    xs = put(x, mesh, spec)
    ours_f = getattr(jax_gin, name)
    ref_f = getattr(jnp, name)

    def ours(v):
        loss = lambda v: jnp.sum(ours_f(v, axis, keepdims=keepdims) * 3)  # noqa: E731
        return ours_f(v, axis, keepdims=keepdims), jax.grad(loss)(v)

    def ref(v):
        loss = lambda v: jnp.sum(ref_f(v, axis, keepdims=keepdims) * 3)  # noqa: E731
        return ref_f(v, axis, keepdims=keepdims), jax.grad(loss)(v)

    with jax.set_mesh(mesh):
        got, want = jax.jit(ours)(xs), jax.jit(ref)(xs)
    assert_all_bitwise(got, want)
    assert got[0].sharding.spec == want[0].sharding.spec
    return got


@pytest.mark.parametrize("kind", [AUTO, EXPLICIT], ids=["auto", "explicit"])
@pytest.mark.parametrize("axis,keepdims", AXES, ids=[str(a) for a in AXES])
@pytest.mark.parametrize("name", REDUCTIONS)
def test_reduction_2d(name, axis, keepdims, kind):
    # values in -3..3 over 12 elements: max and min have many ties, which share the gradient
    _reduce_case(mesh_dt(kind), P("data", "tensor"), name, axis, keepdims, ints((8, 12, 4)))


@pytest.mark.parametrize("spec", [P(("data", "tensor")), P(None, None, "tensor")],
                         ids=["both-axes-on-dim0", "tensor-on-dim2"])
@pytest.mark.parametrize("name", REDUCTIONS)
def test_reduction_2d_other_shardings(name, spec):
    _reduce_case(mesh_dt(), spec, name, (0, 2), False, ints((8, 12, 4), seed=3))


@pytest.mark.parametrize("name", REDUCTIONS)
def test_reduction_1d(name):
    _reduce_case(mesh_1d(), P("i"), name, 0, False, ints((16, 5), seed=2))


@pytest.mark.parametrize("name", REDUCTIONS)
def test_reduction_grad_of_grad(name):
    """Reverse over reverse (grad of grad, jacrev of jacrev) through a sharded reduction, as
    jnp's; the second pass differentiates the first's reduction too."""
    mesh = mesh_1d()
    x = ints((16,), seed=4) + jnp.arange(16.0) / 8  # distinct values: no ties for max and min
    xs = put(x, mesh, P("i"))

    def second(f):
        first = jax.grad(lambda v: f(v ** 3, 0))
        g = jax.grad(lambda v: jnp.sum(first(v) ** 2))
        h = jax.jacrev(jax.jacrev(lambda v: f(v ** 3, 0)))
        return jax.jit(lambda v: (g(v), h(v)))

    assert_all_bitwise(second(getattr(jax_gin, name))(xs), second(getattr(jnp, name))(xs))


@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("keepdims", [False, True])
def test_reduction_over_no_axis_takes_out_sharding(name, keepdims):
    """axis=() reduces nothing and makes no call; out_sharding still places the result."""
    mesh = mesh_dt()
    xs = put(ints((8, 12)), mesh, P("data", "tensor"))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda v: getattr(jax_gin, name)(v, (), keepdims=keepdims,
                                                     out_sharding=P("tensor", "data")))(xs)
    # equivalent, not equal: JAX drops or keeps mesh axes of size 1 (1 x 2 on 2 GPUs)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("tensor", "data")), y.ndim), \
        y.sharding
    assert_bitwise(y, getattr(jnp, name)(np.asarray(xs), ()))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int32", "bool"])
def test_reduction_dtypes(dtype):
    mesh = mesh_1d()
    x = ints((4, 16)) > 0 if dtype == "bool" else ints((4, 16)).astype(dtype)
    xs = put(x, mesh, P(None, "i"))
    for name in ("sum", "mean") + (() if dtype == "bool" else ("max",)):
        got = jax.jit(lambda v: getattr(jax_gin, name)(v, 1))(xs)
        assert_bitwise(got, getattr(jnp, name)(x, 1))


# (mesh, x spec, x's block on each device, (axis, keepdims) cases): rows sharded over a 1-D
# mesh, and two dimensions over data x tensor, every block of odd size. The reductions run
# over one sharded dimension, over all of them, and over a sharded one with a replicated one
# (keepdims). At most 8 * 7 * 3 = 168 terms in -2..2: exact sums in bfloat16 (checked).
REDUCE_ODD = {
    "1d": (P("i"), (7, 3), [(0, False), (None, False)]),
    "2d": (P("data", "tensor"), (3, 7, 3), [(1, False), ((0, 1), False), ((0, 2), True)]),
}
REDUCE_ODD["2d-explicit"] = REDUCE_ODD["2d"]
# (name, dtype, mesh): every dtype on both meshes, and bfloat16 under Explicit axes
REDUCE_ODD_CASES = [(name, dtype, mesh) for name in REDUCTIONS for dtype in ODD_DTYPES
                    for mesh in ("1d", "2d")]
REDUCE_ODD_CASES += [(name, "bfloat16", "2d-explicit") for name in REDUCTIONS]
# The exact results for sum, max and min. Not mean: XLA's CPU backend divides by the count
# as a multiplication by its float32 reciprocal, which can differ from the correctly rounded
# quotient in the last bit (int32's float32 mean of 56 values here: 2 of 12 do), in jnp's
# program as in jax_gin's. There jnp's bits are the reference.
NP_REDUCTIONS = {"sum": np.sum, "max": np.max, "min": np.min}


@pytest.mark.parametrize("name,dtype,mesh_name", REDUCE_ODD_CASES,
                         ids=["-".join(c) for c in REDUCE_ODD_CASES])
def test_reduction_dtypes_odd_sizes(name, dtype, mesh_name):
    spec, block, cases = REDUCE_ODD[mesh_name]
    mesh = MESHES[mesh_name]()
    sizes = odd_sizes(mesh, [("abc"[: len(block)], spec)], dict(zip("abc", block)))
    x = ints(tuple(sizes.values()), seed=4, lo=-2, hi=3)
    x64 = np.asarray(x, np.int64)
    for axis, _ in cases:  # the sums, and the tie counts of the max/min gradients
        assert_exact(np.maximum(np.abs(x64).sum(axis), x64.size // np.sum(x64, axis).size), dtype)
    xs = put(x.astype(dtype), mesh, spec)
    grads = jnp.issubdtype(dtype, jnp.floating)

    def run(f):
        # every case in one program: one compilation per side
        def one(v, axis, keepdims):
            loss = lambda v: jnp.sum(f(v, axis, keepdims=keepdims) * 3)  # noqa: E731
            return f(v, axis, keepdims=keepdims), (jax.grad(loss)(v) if grads else ())
        return run_hlo(lambda v: [one(v, a, k) for a, k in cases], xs)

    with jax.set_mesh(mesh):
        (got, text), (want, _) = run(getattr(jax_gin, name)), run(getattr(jnp, name))
    ours, xla = counts(text)  # the all-reduces in this dtype are jax_gin's
    assert ours >= (1 if ndev() > 1 else 0) and xla == 0, (ours, xla)
    assert_all_bitwise(got, want)
    for (axis, keepdims), (g, w) in zip(cases, zip(got, want)):
        assert g[0].sharding.spec == w[0].sharding.spec, (axis, keepdims)
        if name in NP_REDUCTIONS:
            exact = NP_REDUCTIONS[name](x64, axis, keepdims=keepdims)
            assert_bitwise(g[0], np.asarray(exact).astype(g[0].dtype))


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64"])
def test_unsigned_sums_under_x64(dtype):
    """Under x64 jnp.sum widens unsigned integers to uint64; jax_gin sums them as int64, the
    same bits, including sums that wrap past 2**64."""
    mesh = mesh_1d()
    rng = np.random.default_rng(3)
    info = np.iinfo(dtype)
    x = rng.integers(0, int(info.max), size=(2 * ndev(), 6), dtype=np.uint64, endpoint=True)
    x = x.astype(dtype)
    with jax.enable_x64(True):
        xs = put(jnp.asarray(x), mesh, P("i"))
        for axis in (0, None):
            got = jax.jit(lambda v: jax_gin.sum(v, axis, algorithm="ring"))(xs)
            assert got.dtype == np.uint64
            assert_bitwise(got, jnp.sum(jnp.asarray(x), axis))
        # mean sums in a float type: exact (so order-free) only for small values
        small = jnp.asarray(x % 16)
        mean = jax.jit(lambda v: jax_gin.mean(v, 0))(put(small, mesh, P("i")))
        assert_bitwise(mean, jnp.mean(small, 0))


@pytest.mark.parametrize("spec,axis", [(P("data", None), None), (P("data", None), -1),
                                       (P(None, "tensor"), 0)])
def test_mean_of_nothing(spec, axis):
    """A mean over no elements is jnp's NaN, sign bit clear (a 0 / 0 computed at run time
    on x86 has it set)."""
    mesh = mesh_dt()
    shape = (4, 0) if spec == P("data", None) else (0, 2 * ndev())
    x = put(jnp.zeros(shape, jnp.float32), mesh, spec)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda v: jax_gin.mean(v, axis))(x)
        want = jax.jit(lambda v: jnp.mean(v, axis))(x)
    assert got.size and np.isnan(np.asarray(got)).all()
    assert_bitwise(got, want)


# ---------------------------------------------------------------------------------------
# Structure: jax_gin's custom call in place of XLA's all-reduce


def test_hlo_matmul_row_parallel():
    needs_devices(2)  # one device: nothing to all-reduce
    mesh = mesh_dt()
    xs = put(ints((16, 32)), mesh, P("data", "tensor"))
    ws = put(ints((32, 8)), mesh, P("tensor", None))
    assert counts(hlo(jnp.matmul, xs, ws))[1] >= 1  # jnp all-reduces here...
    assert counts(hlo(jax_gin.matmul, xs, ws)) == (1, 0)  # ...and jax_gin replaces it
    # Gradients: dw contracts the data-sharded batch (a jax_gin all-reduce over data).
    def loss(a, b):
        return jax_gin.sum(jax_gin.matmul(a, b) ** 2)
    ours, xla = counts(hlo(jax.grad(loss, argnums=(0, 1)), xs, ws))
    assert ours >= 1 and xla == 0


def test_hlo_column_parallel_backward():
    needs_devices(2)  # one device: nothing to all-reduce
    # Column-parallel: the forward needs no collective; dx contracts the sharded n.
    mesh = mesh_dt()
    xs = put(ints((16, 32)), mesh, P("data", None))
    ws = put(ints((32, 8)), mesh, P(None, "tensor"))
    assert counts(hlo(jax_gin.matmul, xs, ws)) == (0, 0)
    dx = jax.grad(lambda a, b: jax_gin.sum(jax_gin.matmul(a, b)))
    assert counts(hlo(dx, xs, ws)) == (1, 0)


@pytest.mark.parametrize("name", REDUCTIONS)
def test_hlo_reductions(name):
    needs_devices(2)  # one device: nothing to all-reduce
    mesh = mesh_dt()
    xs = put(ints((8, 12, 4)), mesh, P("data", "tensor"))
    f = getattr(jax_gin, name)
    assert counts(hlo(lambda v: getattr(jnp, name)(v, 1), xs))[1] >= 1
    assert counts(hlo(lambda v: f(v, 1), xs)) == (1, 0)
    ours, xla = counts(hlo(jax.grad(lambda v: jax_gin.sum(f(v, 1))), xs))
    # sum/mean: the backward only broadcasts. max/min: the forward pmax/pmin, and the count
    # of ties (a jax_gin sum over the sharded axis).
    assert xla == 0 and ours == (0 if name in ("sum", "mean") else 2)
    # Unsharded reduced dimension: correct, and no collective at all.
    assert counts(hlo(lambda v: f(v, 2), xs)) == (0, 0)


def test_hlo_explicit_axes():
    needs_devices(2)  # one device: nothing to all-reduce
    mesh = mesh_dt(EXPLICIT)
    xs = put(ints((16, 32)), mesh, P("data", "tensor"))
    ws = put(ints((32, 8)), mesh, P("tensor", None))
    with jax.set_mesh(mesh):
        assert counts(hlo(jax_gin.matmul, xs, ws)) == (1, 0)
        y = jax.jit(jax_gin.matmul)(xs, ws)
    assert jax.typeof(y).sharding.spec == P("data", None)


# ---------------------------------------------------------------------------------------
# Other contexts and errors


def test_out_sharding():
    mesh = mesh_dt()
    x, w = ints((16, 32)), ints((32, 8), seed=1)
    f = jax.jit(lambda a, b: jax_gin.matmul(a, b, out_sharding=NamedSharding(mesh, P("data", "tensor"))))
    y = f(put(x, mesh, P("data", "tensor")), put(w, mesh, P("tensor", None)))
    assert y.sharding.spec == P("data", "tensor")
    assert_bitwise(y, x @ w)


def test_single_device_and_eager():
    x, w = ints((8, 16)), ints((16, 4), seed=1)
    assert_bitwise(jax_gin.matmul(x, w), x @ w)
    assert_bitwise(jax.jit(jax_gin.sum)(x), jnp.sum(x))
    mesh = mesh_1d()
    xs = put(x, mesh, P(None, "i"))
    assert_bitwise(jax_gin.max(xs, 1), jnp.max(x, 1))  # eager on sharded inputs


def test_inside_shard_map_is_local():
    # Every axis manual: the ops see the local block, as jnp does; psum is for this case.
    mesh = mesh_1d()
    x = ints((ndev() * 2, 3))
    f = jax.jit(jax.shard_map(lambda v: (jax_gin.sum(v, 0), jnp.sum(v, 0)), mesh=mesh,
                              in_specs=P("i"), out_specs=P("i")))
    got, want = f(put(x, mesh, P("i")))
    assert_bitwise(got, want)
    # gradients are jnp's, with an operand invariant over the manual axis (a weight)
    w = ints((3, 2), seed=2)
    grads = [jax.jit(jax.grad(lambda a, w, mm=mm: jnp.sum(jax.shard_map(
        lambda v, u: mm(v, u), mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))(a, w) ** 2),
        argnums=(0, 1)))(put(x, mesh, P("i")), w) for mm in (jax_gin.matmul, jnp.matmul)]
    jax.tree.map(assert_bitwise, *grads)


@pytest.mark.parametrize("kind", [AUTO, EXPLICIT])
def test_inside_partially_manual_shard_map(kind):
    """A shard_map manual over one axis and free over the other: the ops are jnp's there, and
    XLA partitions them over the free axis, as jax_gin's collectives run XLA's own there."""
    mesh = mesh_dt(kind)
    x, w = ints((8, 16)), ints((16, 4), seed=1)
    with jax.set_mesh(mesh):
        xs = put(x, mesh, P("data", "tensor"))
        for ours, ref in ((lambda a: jax_gin.sum(a, axis=1), lambda a: jnp.sum(a, axis=1)),
                          (lambda a: jax_gin.mean(a, axis=1), lambda a: jnp.mean(a, axis=1)),
                          (lambda a: jax_gin.max(a, axis=1), lambda a: jnp.max(a, axis=1)),
                          (lambda a: jax_gin.matmul(a, w), lambda a: a @ w)):
            f, g = (jax.jit(jax.shard_map(h, in_specs=P("data"), out_specs=P("data"),
                                          axis_names={"data"})) for h in (ours, ref))
            got, want = f(xs), g(xs)
            assert_bitwise(got, want)
            assert jax.typeof(got) == jax.typeof(want)
            # gradients too, with w closed over (invariant over the manual axis)
            dg, dw = (jax.jit(jax.grad(lambda a, h=h: jnp.sum(h(a) ** 2))) for h in (f, g))
            assert_bitwise(dg(xs), dw(xs))


@pytest.mark.parametrize("kind", [AUTO, EXPLICIT])
def test_arrays_made_inside_the_jit(kind):
    """A jit with no array arguments (an init function) under a context mesh: the partitioner
    knows no mesh there and gives GSPMD shardings, read over the context mesh."""
    mesh = mesh_dt(kind)
    with jax.set_mesh(mesh):
        place = jax.sharding.reshard if kind == EXPLICIT else jax.lax.with_sharding_constraint

        def make():
            a = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) % 7
            return (place(a, NamedSharding(mesh, P("data", "tensor"))),
                    place(jnp.ones((16, 4), jnp.float32) * 3, NamedSharding(mesh, P("tensor", None))))
        for ours, ref in ((lambda: jax_gin.sum(make()[0], axis=1), lambda: jnp.sum(make()[0], axis=1)),
                          (lambda: jax_gin.matmul(*make()),
                           # under Explicit axes jnp needs the sharding of a sharded contraction
                           lambda: jnp.matmul(*make(), out_sharding=P("data", None)
                                              if kind == EXPLICIT else None))):
            f = jax.jit(ours)
            got, want = f(), jax.jit(ref)()
            assert_bitwise(got, want)
            if mesh.shape["tensor"] > 1:  # the reduced dimension is sharded: jax_gin's call
                assert "jax_gin" in f.lower().compile().as_text()


def test_errors():
    x = ints((4, 4))
    with pytest.raises(ValueError, match="name every dimension"):
        jax_gin.einsum("ij,jk", x, x)
    with pytest.raises(ValueError, match="one operand only"):
        jax_gin.einsum("ij,kl->il", x, x)
    with pytest.raises(ValueError, match="subscripts are letters \\(a-z, A-Z\\); '1' is none"):
        jax_gin.einsum("i1,1n->in", x, x)
    with pytest.raises(ValueError, match="need distinct letters \\(no traces or diagonals\\)"):
        jax_gin.einsum("ii,ij->ij", x, x)
    with pytest.raises(ValueError, match="w \\(k, n\\)"):
        jax_gin.matmul(x, x[0])
    with pytest.raises(TypeError, match="unsupported dtype int8"):
        jax_gin.max(x.astype(jnp.int8))
    with pytest.raises(ValueError, match="unknown algorithm"):
        jax_gin.sum(x, algorithm="fastest")
    with pytest.raises(ValueError, match="out of bounds"):
        jax_gin.mean(x, axis=2)
    # each names itself, not the function it calls
    with pytest.raises(ValueError, match="jax_gin.mean: unknown algorithm"):
        jax_gin.mean(x, algorithm="fastest")
    with pytest.raises(ValueError, match="jax_gin.matmul: unknown algorithm"):
        jax_gin.matmul(x, x, algorithm="fastest")
    with pytest.raises(TypeError, match="jax_gin.matmul: unsupported dtype int8"):
        jax_gin.matmul(x.astype(jnp.int8), x.astype(jnp.int8))


@pytest.mark.parametrize("subscripts,xshape,wshape,wspec", [
    ("bij,bjk->bik", (1, 2, 3), (None, 3, 5), P("i")),  # a batch letter of size 1 in x
    ("bij,bjk->bik", (None, 2, 3), (1, 3, 5), P()),     # ... in w, x sharded on it
    ("bij,bjk->bik", (1, 2, 3), (None, 3, None), P(None, None, "i")),
])
def test_einsum_broadcasts_size_one_letters(subscripts, xshape, wshape, wspec):
    """A letter the output keeps, of size 1 in one operand, broadcasts to its size in the
    other, as in jnp.einsum, also where the other operand shards it: jnp's values and
    gradients."""
    n = ndev()
    mesh = mesh_1d()
    xshape = tuple(n * 2 if d is None else d for d in xshape)
    wshape = tuple(n * 2 if d is None else d for d in wshape)
    # positive values: no sum is a zero, whose sign the order of the sum decides
    x, w = ints(xshape, seed=1, lo=1), ints(wshape, seed=2, lo=1)
    xspec = P("i") if wspec == P() else P()
    xs, ws = put(x, mesh, xspec), put(w, mesh, wspec)

    def run(einsum):
        loss = lambda a, b: jnp.sum(einsum(subscripts, a, b) ** 2)  # noqa: E731
        return jax.jit(lambda a, b: (einsum(subscripts, a, b), jax.grad(loss, (0, 1))(a, b)))(xs, ws)
    jax.tree.map(assert_bitwise, run(jax_gin.einsum), run(jnp.einsum))


def test_einsum_size_zero_and_inside_shard_map_as_jnp():
    """A kept letter of size 1 broadcasts to size 0 as in jnp; inside shard_map the call is
    jnp.einsum's as it is, a contracted letter of size 1 included (jnp sums the other operand
    over it first: its bits on inexact values)."""
    x, w = jnp.ones((1, 2, 3)), jnp.ones((0, 3, 4))
    assert_bitwise(jax.jit(lambda a, b: jax_gin.einsum("bij,bjk->bik", a, b))(x, w),
                   jnp.einsum("bij,bjk->bik", x, w))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 1)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
    run = lambda e: jax.jit(jax.shard_map(lambda a, b: e("ij,jk->ik", a, b), mesh=mesh_1d(),
                                          in_specs=(P(), P()), out_specs=P(),
                                          check_vma=False))(x, w)
    assert_bitwise(run(jax_gin.einsum), run(jnp.einsum))


def test_einsum_refuses_sizes_that_do_not_broadcast():
    """Sizes that differ and are not 1, an operand's rank that its subscripts do not give,
    and a contracted letter of size 1 in one operand only (jnp.einsum sums the other operand
    over it first, whose order of additions a contraction would not keep)."""
    with pytest.raises(ValueError, match="contracted letter 'j' has sizes 1 and 8 in "
                                         "'ij,jk->ik'; sum the larger operand over it first"):
        jax_gin.einsum("ij,jk->ik", ints((2, 1)), ints((8, 2)))
    with pytest.raises(ValueError, match="letter 'j' has sizes 3 and 4 in 'ij,jk->ik' \\(only "
                                         "a size of 1 broadcasts\\)"):
        jax_gin.einsum("ij,jk->ik", ints((2, 3)), ints((4, 2)))
    with pytest.raises(ValueError, match="subscripts 'ijk' give x 3 dimensions, but it has "
                                         "shape \\(2, 3\\)"):
        jax_gin.einsum("ijk,jk->i", ints((2, 3)), ints((3, 2)))


@pytest.mark.parametrize("name", ["sum", "mean", "max", "min"])
def test_reductions_take_keepdims_by_keyword(name):
    """jnp's third positional argument is dtype (sum, mean) or out (max, min): jax_gin's
    keepdims is keyword-only, so a call written for jnp fails instead of reading its dtype
    as keepdims."""
    x = ints((4, 6))
    with pytest.raises(TypeError, match="positional argument"):
        getattr(jax_gin, name)(x, 0, jnp.float32)
    assert_bitwise(getattr(jax_gin, name)(x, 0, keepdims=True),
                   getattr(jnp, name)(x, 0, keepdims=True))


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_algorithms(algo):
    mesh = mesh_dt()
    x, w = ints((16, 32)), ints((32, 8), seed=1)
    y = jax.jit(lambda a, b: jax_gin.matmul(a, b, algorithm=algo))(
        put(x, mesh, P("data", "tensor")), put(w, mesh, P("tensor", None)))
    assert_bitwise(y, x @ w)


def test_example_tp_mlp():
    # examples/tp_mlp.py: a tensor-parallel MLP training step in global view, jax_gin vs jnp.
    if ndev() & (ndev() - 1):
        pytest.skip(f"the example's shapes divide by a power-of-two device count, have {ndev()}")
    tp_mlp = load_example("tp_mlp")
    results, loss_diff, grad_diff, bitwise = tp_mlp.run(steps=3, iters=0)
    assert loss_diff <= 1e-5 and grad_diff <= 1e-5
    if jax.default_backend() == "cpu":
        assert bitwise
    ours, xla = results["jax_gin"]["collectives"]
    assert xla == 0 and ours >= (1 if ndev() > 1 else 0)


def test_matmul_with_auto_xla_fallback(tmp_path, monkeypatch):
    """A tuning table that sends every size to XLA's all-reduce ("xla"): the global-view ops
    lower to it (no jax_gin custom call) and keep jnp's bits."""
    needs_devices(2)  # a tuning table decides for groups of 2 or more
    import json
    from jax_gin import _select, tune

    kind = jax.devices()[0].device_kind
    for n in range(2, ndev() + 1):
        table = {"device_kind": kind, "nranks": n, "measured": "2026-11-30",
                 "entries": [{"max_bytes": 1 << 40, "algorithm": "xla"}]}
        (tmp_path / tune.table_name(kind, n)).write_text(json.dumps(table))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    _select.load_table.cache_clear()
    try:
        mesh = mesh_1d()
        xs = put(ints((16, 32)), mesh, P(None, "i"))
        ws = put(ints((32, 16), seed=1), mesh, P("i", None))
        with jax.set_mesh(mesh):
            assert counts(hlo(jax_gin.matmul, xs, ws)) == (0, 1)
        _matmul_case(mesh, P(None, "i"), P("i", None), ints((16, 32)), ints((32, 16), seed=1))
    finally:
        _select.load_table.cache_clear()


def test_complex_sums_and_contractions():
    """sum, mean and matmul of complex values, sharded over the reduced dimension: jnp's bits
    and dtype, with jax_gin's custom call in the program (psum sums the real and imaginary
    parts). max refuses them, as jax_gin.pmax does."""
    needs_devices(2)
    mesh = mesh_1d()
    x = (ints((ndev() * 2, 3)) + 1j * ints((ndev() * 2, 3), seed=1)).astype(jnp.complex64)
    xs = put(x, mesh, P("i", None))
    cases = [(lambda v: jax_gin.sum(v, axis=0), lambda v: jnp.sum(v, axis=0)),
             (lambda v: jax_gin.mean(v, axis=0), lambda v: jnp.mean(v, axis=0)),
             (lambda v: jax_gin.matmul(v.T, v), lambda v: v.T @ v)]
    for ours, ref in cases:
        _assert_bitwise(jax.jit(ours)(xs), jax.jit(ref)(xs))
        assert counts(hlo(ours, xs)) == (1, 0)
    with pytest.raises(TypeError, match=r"jax_gin.max: complex values have no order"):
        jax_gin.max(xs)


@pytest.mark.parametrize("axis", [1.0, 1.7, True, "0", (0, 1.0), jnp.float32(1)])
def test_axis_must_be_integers(axis):
    x = ints((4, 4))
    for fn in (jax_gin.sum, jax_gin.mean, jax_gin.max):
        with pytest.raises(TypeError, match=r"axis must be an integer or a tuple of integers"):
            fn(x, axis=axis)


def test_axis_as_a_concrete_integer_array():
    """As jnp's reductions: an axis given as a concrete integer array, 0-d or 1-D (a traced
    one is refused by name)."""
    x = ints((4, 6))
    for name in ("sum", "mean", "max", "min"):
        for axis in (jnp.int32(1), (np.int64(0), jnp.int32(-1)), jnp.array([0, 1]),
                     np.array([1])):
            _assert_bitwise(getattr(jax_gin, name)(x, axis=axis), getattr(jnp, name)(x, axis=axis))
    with pytest.raises(TypeError, match=r"jax_gin.sum: axis must be an integer"):
        jax.jit(lambda v, a: jax_gin.sum(v, axis=a))(x, 1)


# vmap and jacrev: each op on a (8, 12) block whose 12 (contracted or reduced) is sharded over
# "tensor", so every call all-reduces. The references run unsharded on one device; the inputs
# are small integers, so every sum is exact and the bits must agree.
VMAP_OPS = {
    "matmul": (lambda v, w: jax_gin.matmul(v, w), lambda v, w: v @ w),
    "einsum": (lambda v, w: jax_gin.einsum("mk,kn->mn", v, w),
               lambda v, w: jnp.einsum("mk,kn->mn", v, w)),
    **{name: (lambda v, w, name=name: getattr(jax_gin, name)(v, 1) * w[0, 0],
              lambda v, w, name=name: getattr(jnp, name)(v, 1) * w[0, 0])
       for name in REDUCTIONS},
}


@pytest.mark.parametrize("kind", [AUTO, EXPLICIT], ids=["auto", "explicit"])
@pytest.mark.parametrize("api", list(VMAP_OPS))
def test_vmap_and_jacrev(api, kind):
    """vmap of a batched operand (the batch becomes one more dimension of the same
    partitioned op), vmap of vmap, per-example gradients, and jax.jacrev, which batches the
    backward pass: jnp's bits, with jax_gin's call in place of XLA's all-reduce."""
    ours, ref = VMAP_OPS[api]
    mesh = mesh_dt(kind)
    x, w = ints((3, 8, 12)), ints((12, 4), seed=1)
    xs = put(x, mesh, P(None, "data", "tensor"))
    wb = ints((3, 12, 4), seed=2)  # a batch of weights
    loss = lambda f: lambda v, w: jnp.sum(f(v, w) ** 2)  # noqa: E731
    cases = [
        ("vmap", lambda f: jax.vmap(f, in_axes=(0, None)), x, w, None),
        ("vmap of vmap", lambda f: jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(0, None)),
         jnp.stack([x, -x]), w, P(None, None, "data", "tensor")),
        ("vmap over dim 1", lambda f: jax.vmap(f, in_axes=(1, None), out_axes=1),
         x.transpose(1, 0, 2), w, P("data", None, "tensor")),
        ("per-example grad", lambda f: jax.vmap(jax.grad(loss(f), argnums=(0, 1)),
                                                in_axes=(0, None)), x, w, None),
        ("jacrev", lambda f: jax.jacrev(f, argnums=(0, 1)), x[0], w, P("data", "tensor")),
        ("both batched", lambda f: jax.vmap(f), x, wb, None),
        ("weights batched", lambda f: jax.vmap(f, in_axes=(None, 0)), x[0], wb,
         P("data", "tensor")),
    ]
    with jax.set_mesh(mesh):
        for name, transform, v, u, spec in cases:
            vs = xs if spec is None else put(v, mesh, spec)
            got = jax.jit(transform(ours))(vs, u)
            want = jax.jit(transform(ref))(v, u)  # unsharded, on one device
            assert jax.tree.structure(got) == jax.tree.structure(want), name
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert_bitwise(a, b)
        if ndev() >= 2:  # "tensor" has 2 or more devices: the vmapped op all-reduces
            assert counts(hlo(jax.vmap(ours, in_axes=(0, None)), xs, w)) == (1, 0)


def test_vmap_with_out_sharding():
    """An op's out_sharding names the unbatched result; under vmap the batch dimension is
    left to the partitioner, and the named sharding holds for the others."""
    mesh = mesh_dt()
    x, w = ints((3, 16, 32)), ints((32, 8), seed=1)
    out = NamedSharding(mesh, P("data", "tensor"))
    f = jax.jit(jax.vmap(lambda v: jax_gin.matmul(v, w, out_sharding=out)))
    y = f(put(x, mesh, P(None, "data", "tensor")))
    assert y.sharding.spec[1:] == ("data", "tensor")
    assert_bitwise(y, x @ w)


def test_grad_of_a_plain_array_on_explicit_axes():
    """Under an Explicit mesh, the gradient of an operand that is not placed on the mesh (a
    plain array, replicated) is jnp's."""
    mesh = mesh_dt(EXPLICIT)
    x, w = ints((8, 12)), ints((12, 4), seed=1)
    xs = put(x, mesh, P("data", "tensor"))
    with jax.set_mesh(mesh):
        got = jax.jit(jax.grad(lambda a, b: jnp.sum(jax_gin.matmul(a, b) ** 2), argnums=1))(xs, w)
    want = jax.grad(lambda a, b: jnp.sum((a @ b) ** 2), argnums=1)(x, w)
    assert_bitwise(got, want)


def test_constant_operands():
    """Operands that are constants of the program (closed over, so the partitioner gives them
    a replicated sharding that names no mesh axis) are replicated operands: jax.jacrev of a
    linear function, whose program holds nothing but constants, and a product of two
    constants, under jax.set_mesh."""
    mesh = mesh_dt()
    x, w = ints((16, 32)), ints((32, 8), seed=1)
    xs, ws = put(x, mesh, P("data", "tensor")), put(w, mesh, P("tensor", None))
    with jax.set_mesh(mesh):
        got = jax.jit(jax.jacrev(lambda b: jax_gin.matmul(xs, b).sum(0)))(ws)
        both = jax.jit(lambda: jax_gin.matmul(xs, ws))()
    want = jax.jacrev(lambda b: (x @ b).sum(0))(w)
    assert_bitwise(got, want)
    assert_bitwise(both, x @ w)
