"""Partially-manual shard_map (axis_names= a subset of the mesh axes, the rest automatic).

jax_gin reduces over the manual axes while the operand stays sharded over the automatic ones:
each device reduces its own shard with the devices that share its automatic coordinates.
Everything is compared bit for bit with lax on exact inputs.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_gin
from conftest import ndev
from helpers import DTYPES, OPS, assert_bitwise, exact_input


def _mesh(shape, names, order=None):
    n = int(np.prod(shape))
    if ndev() < n:
        pytest.skip(f"needs {n} devices, have {ndev()}")
    devices = np.array(jax.devices()[:n])
    if order is not None:
        devices = devices[order]
    return Mesh(devices.reshape(shape), names)


def _global(shape, mesh, spec, dtype="float32", seed=0):
    x = exact_input(shape, 1, dtype, seed=seed)
    return jax.device_put(x, NamedSharding(mesh, spec))


def _partial(f, mesh, manual, in_spec, out_spec, check_vma=True):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(in_spec,), out_specs=out_spec,
                                 axis_names=set(manual), check_vma=check_vma))


def _compiled(f, *args) -> str:
    return f.lower(*args).compile().as_text()


# (mesh shape, names, manual axes, reduced axes, the operand's sharding, the shard_map's
# in_spec over the manual axes). The operand's sharding over the automatic axes is free.
CASES = {
    # one automatic axis, sharding the second dimension
    "2d-auto-y-dim1": ((4, 2), ("x", "y"), {"x"}, "x", P("x", "y"), P("x")),
    # one automatic axis, sharding the first dimension inside the manual one
    "2d-auto-y-dim0": ((4, 2), ("x", "y"), {"x"}, "x", P(("x", "y")), P("x")),
    # the automatic axis first in the mesh
    "2d-auto-x": ((2, 4), ("x", "y"), {"y"}, "y", P("x", "y"), P(None, "y")),
    # two automatic axes, one on each dimension
    "3d-auto-bc": ((2, 2, 2), ("a", "b", "c"), {"a"}, "a", P(("a", "b"), "c"), P("a")),
    # two automatic axes on one dimension
    "3d-auto-bc-dim1": ((2, 2, 2), ("a", "b", "c"), {"a"}, "a", P("a", ("c", "b")), P("a")),
    # two manual axes reduced together, one automatic
    "3d-manual-ab": ((2, 2, 2), ("a", "b", "c"), {"a", "b"}, ("b", "a"), P("c", ("a", "b")),
                     P(None, ("a", "b"))),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("case", list(CASES))
def test_parity(case, op, algo, check_vma):
    shape, names, manual, axes, spec, in_spec = CASES[case]
    mesh = _mesh(shape, names)
    x = _global((8, 12), mesh, spec, seed=len(case))
    ours, ref = OPS[op]
    f = _partial(lambda v: ours(v, axes, algorithm=algo), mesh, manual, in_spec, P(), check_vma)
    g = _partial(lambda v: ref(v, axes), mesh, manual, in_spec, P(), check_vma)
    got, want = f(x), g(x)
    assert_bitwise(got, want)
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    # The call gets each device's shard: nothing is gathered over the automatic axes.
    if jax.config.jax_use_shardy_partitioner:
        assert "all-gather" not in _compiled(f, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_and_pytree(dtype):
    # Leaves of several shapes, a scalar and a Python constant, against lax's call of the same
    # pytree. In bfloat16 lax's runs in a fully manual shard_map on the same mesh, which
    # reduces the same blocks: in a partially-manual one any lax reduction of bfloat16 aborts
    # XLA's CPU compiler ("Invalid binary instruction opcode copy", jax 0.11.2).
    mesh = _mesh((4, 2), ("x", "y"))
    tree = {"a": _global((8, 6), mesh, P("x", "y"), dtype, seed=1),
            "b": _global((4, 4, 2), mesh, P("x", None, "y"), dtype, seed=2),
            "c": _global((4,), mesh, P("x"), dtype, seed=3)}
    spec = {"a": P("x"), "b": P("x"), "c": P("x")}
    nx = mesh.shape["x"]

    def body(red):
        return lambda t: red({"a": t["a"], "b": t["b"], "c": t["c"][0], "k": 3}, "x")

    for name, (ours, ref) in OPS.items():
        f = jax.jit(jax.shard_map(body(ours), mesh=mesh, in_specs=(spec,), out_specs=P(),
                                  axis_names={"x"}))
        if dtype != "bfloat16":
            g = jax.jit(jax.shard_map(body(ref), mesh=mesh, in_specs=(spec,), out_specs=P(),
                                      axis_names={"x"}))
        else:
            g = jax.jit(jax.shard_map(
                body(ref), mesh=mesh,
                in_specs=({"a": P("x", "y"), "b": P("x", None, "y"), "c": P("x")},),
                out_specs={"a": P(None, "y"), "b": P(None, None, "y"), "c": P(), "k": P()}))
        got, want = f(tree), g(tree)
        for k in ("a", "b", "c"):
            assert got[k].dtype == np.dtype(dtype)
            assert_bitwise(got[k], want[k])
        assert got["k"] == want["k"] == (3 * nx if name == "psum" else 3)


def test_device_order_is_the_logical_order():
    # The partition id is the index into the mesh's devices (the program's device assignment),
    # whatever device ids they hold: a permuted mesh groups the same way as lax.
    mesh = _mesh((4, 2), ("x", "y"), order=[5, 2, 7, 0, 3, 6, 1, 4])
    x = _global((8, 12), mesh, P("x", "y"), seed=9)
    for ours, ref in OPS.values():
        f = _partial(lambda v: ours(v, "x"), mesh, {"x"}, P("x"), P())
        g = _partial(lambda v: ref(v, "x"), mesh, {"x"}, P("x"), P())
        assert_bitwise(f(x), g(x))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_grad(algo, check_vma):
    # psum's transpose: a pcast to varying (check_vma=True) or another psum (False), here with
    # the operand sharded over two automatic axes. (lax.pmax/pmin have no derivative.)
    mesh = _mesh((2, 2, 2), ("a", "b", "c"))
    x = _global((8, 12), mesh, P(("a", "b"), "c"), seed=4)

    def grad(red, **kw):
        def body(v):
            return red(jnp.sum(red(v * v, "a", **kw) * (v + 1.0)), "a", **kw)
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("a"),), out_specs=P(),
                          axis_names={"a"}, check_vma=check_vma)
        return jax.jit(jax.grad(f))

    assert_bitwise(grad(jax_gin.psum, algorithm=algo)(x), grad(lax.psum)(x))


def test_overlap_runs_synchronously():
    # overlap=True gives the same bits; in a partially-manual shard_map the call is synchronous.
    mesh = _mesh((4, 2), ("x", "y"))
    x = _global((8, 12), mesh, P("x", "y"), seed=5)
    f = _partial(lambda v: jax_gin.psum(v, "x", overlap=True), mesh, {"x"}, P("x"), P())
    g = _partial(lambda v: lax.psum(v, "x"), mesh, {"x"}, P("x"), P())
    assert_bitwise(f(x), g(x))
    text = f.lower(x).as_text()
    assert "jax_gin_all_reduce_start" not in text and "_partitioned" in text


def test_xla_fallback(cpu_table_with_xla):
    # auto's fallback to XLA's all-reduce (a tuning table's "xla") in a partially-manual body
    mesh = _mesh((4, 2), ("x", "y"))
    x = _global((8, 4096), mesh, P("x", "y"), seed=6)
    f = _partial(lambda v: jax_gin.psum(v, "x"), mesh, {"x"}, P("x"), P())
    g = _partial(lambda v: lax.psum(v, "x"), mesh, {"x"}, P("x"), P())
    assert_bitwise(f(x), g(x))
    assert "custom_call" not in f.lower(x).as_text()


def test_vmap_over_explicit_axis():
    # vmap of a shard_map over an array sharded on an Explicit axis leaves that axis
    # automatic in the shard_map: the psum over the other axis runs partially manual.
    if len(jax.devices()) < 8:
        pytest.skip("a (2, 4) mesh needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("p", "q"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        arr = jax.device_put(exact_input((2, 12), 1, "float32", seed=7), P("p", "q"))
        for ours, ref in OPS.values():
            f = jax.shard_map(lambda v: ours(v, "q"), in_specs=P("q"), out_specs=P(None))
            g = jax.shard_map(lambda v: ref(v, "q"), in_specs=P("q"), out_specs=P(None))
            for wrap in (lambda h: jax.vmap(h), lambda h: jax.jit(jax.vmap(h))):
                got, want = wrap(f)(arr), wrap(g)(arr)
                assert_bitwise(got, want)
                assert got.sharding == want.sharding == NamedSharding(mesh, P("p", None))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("kind", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_gather_of_a_block_sharded_over_a_free_axis(kind, check_vma):
    """FSDP over x beside tensor parallelism over y: the shard_map is manual over x only, and
    the block stays sharded over y (in its type, where y is Explicit). all_gather over x
    keeps it so, as lax's does; leaves not sharded so take jax_gin's path in one pytree."""
    mesh = _mesh((2, 4), ("x", "y"))
    mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(kind,) * 2)
    with jax.set_mesh(mesh):
        x = _global((8, 8), mesh, P("x", "y"), seed=3)
        b = _global((6, 3), mesh, P("x"), seed=4)
        for tiled, to in ((True, "varying"), (False, "varying"), (True, "invarying")):
            def run(mod):
                kw = {"to": to} if to != "varying" else {}
                return jax.jit(jax.shard_map(
                    lambda a, c: mod.all_gather((a, c), "x", tiled=tiled, **kw),
                    in_specs=(P("x"), P("x")), out_specs=P() if to == "invarying" else P("x"),
                    axis_names={"x"},
                    check_vma=check_vma))(x, b)
            got, want = run(jax_gin), run(lax)
            for g, w in zip(got, want):
                assert_bitwise(g, w)
                assert jax.typeof(g) == jax.typeof(w)
        # psum_scatter of such a leaf is lax's too: its result, or its error
        scatter = lambda mod: jax.jit(jax.shard_map(  # noqa: E731
            lambda a: mod.psum_scatter(a, "x", tiled=True), in_specs=P("x"), out_specs=P("x"),
            axis_names={"x"}, check_vma=check_vma))(x)
        try:
            want = scatter(lax)
        except ValueError as e:
            with pytest.raises(ValueError, match=re.escape(str(e).splitlines()[0][:60])):
                scatter(jax_gin)
        else:
            assert_bitwise(scatter(jax_gin), want)
        grad = lambda mod: jax.grad(lambda a: jnp.sum(jax.shard_map(  # noqa: E731
            lambda v: mod.all_gather(v, "x", tiled=True), in_specs=P("x"), out_specs=P("x"),
            axis_names={"x"}, check_vma=check_vma)(a) ** 2))(x)
        try:
            want = grad(lax)
        except ValueError as e:  # JAX's transpose, with Explicit axes or check_vma=False
            with pytest.raises(ValueError, match=re.escape(str(e).splitlines()[0])):
                grad(jax_gin)
        else:
            assert_bitwise(grad(jax_gin), want)


@pytest.fixture
def gspmd():
    prev = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    yield
    jax.config.update("jax_use_shardy_partitioner", prev)


@pytest.mark.parametrize("op", list(OPS))
def test_gspmd_partitioner(gspmd, op):
    # The same numbers with GSPMD (which, for lax too, gathers the automatic axes at the
    # shard_map boundary).
    mesh = _mesh((2, 2, 2), ("a", "b", "c"))
    x = _global((8, 12), mesh, P(("a", "b"), "c"), seed=8)
    ours, ref = OPS[op]
    f = _partial(lambda v: ours(v, "a"), mesh, {"a"}, P("a"), P())
    g = _partial(lambda v: ref(v, "a"), mesh, {"a"}, P("a"), P())
    assert_bitwise(f(x), g(x))


@pytest.mark.parametrize("layout", ["reduce-n", "shard-n"])
@pytest.mark.parametrize("op", list(OPS))
def test_any_device_count(op, layout):
    # On the devices present (2 GPUs, say): mesh (n, 1) reduces over n devices, the automatic
    # axis of size 1; mesh (1, n) shards the operand n ways over the automatic axis. The
    # reference is lax's; for (1, n) in a fully manual shard_map on the same mesh (lax's over
    # the manual axis of size 1 fails in XLA's partitioner: "Cross-partition allreduce must be
    # in (partial) manual partitioning mode", jax 0.11.2).
    n = ndev()
    shape = (n, 1) if layout == "reduce-n" else (1, n)
    mesh = _mesh(shape, ("x", "y"))
    x = _global((4 * n, 3 * n), mesh, P("x", "y"), seed=n)
    ours, ref = OPS[op]
    f = _partial(lambda v: ours(v, "x"), mesh, {"x"}, P("x"), P())
    if layout == "reduce-n":
        g = _partial(lambda v: ref(v, "x"), mesh, {"x"}, P("x"), P())
    else:
        g = jax.jit(jax.shard_map(lambda v: ref(v, "x"), mesh=mesh, in_specs=(P("x", "y"),),
                                  out_specs=P(None, "y")))
    assert_bitwise(f(x), g(x))
    # a group of n > 1 devices runs jax_gin's partitioned call; over one, auto returns the input
    assert ("_partitioned" in f.lower(x).as_text()) == (shape[0] > 1)


@pytest.mark.parametrize("algo", ["one_shot", "ring"])
def test_two_independent_blocks(algo):
    # Two partially-manual shard_maps in one program that take nothing from each other, on one
    # communicator (the 'x' groups of one mesh). Their calls chain uint32 tokens within each
    # block only, so XLA may hand a device the second block's call without waiting for the
    # first's: on the CPU the rank's worker queues it and runs the calls in the order of the
    # group's rank 0 (csrc/cpu_backend.h: Turn). Three runs, bit for bit lax's.
    mesh = _mesh((4, 2), ("x", "y"))

    def program(psum, **kw):
        def block(k):
            def f(v):
                for j in range(3):
                    v = psum(v * k + j, "x", **kw) % 17
                return v
            return jax.shard_map(f, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"),
                                 axis_names={"x"})
        return jax.jit(lambda a, b: (block(2)(a), block(3)(b)))

    a = _global((64, 64), mesh, P("x", "y"), seed=1)
    b = _global((64, 64), mesh, P("x", "y"), seed=2)
    ours, want = program(jax_gin.psum, algorithm=algo), program(lax.psum)(a, b)
    for _ in range(3):
        jax.tree.map(assert_bitwise, jax.block_until_ready(ours(a, b)), want)


def test_independent_fully_and_partially_manual_blocks():
    # A fully-manual shard_map (HLO order tokens) and a partially-manual one (uint32 tokens)
    # over the same mesh axis, on one communicator, independent or with the partially-manual
    # block taking a value of the other's result. Nothing orders the independent blocks' calls
    # against each other; on the CPU both kinds queue on the rank's worker, which runs them in
    # the group's order. Bit for bit lax's either way.
    mesh = _mesh((4, 2), ("x", "y"))

    def program(psum, ordered, **kw):
        def body(k):
            def f(v):
                for j in range(3):
                    v = psum(v * k + j, "x", **kw) % 17
                return v
            return f
        partial = jax.shard_map(body(2), mesh=mesh, in_specs=(P("x"),), out_specs=P("x"),
                                axis_names={"x"})
        full = jax.shard_map(body(3), mesh=mesh, in_specs=(P("x", "y"),),
                             out_specs=P("x", "y"))

        def f(a, b):
            fb = full(b)
            return partial(a + 0 * fb[0, 0] if ordered else a), fb
        return jax.jit(f)

    a = _global((128, 128), mesh, P("x", "y"), seed=3)
    b = _global((128, 128), mesh, P("x", "y"), seed=4)
    for ordered in (False, True):
        want = program(lax.psum, ordered)(a, b)
        ours = program(jax_gin.psum, ordered, algorithm="ring")
        for _ in range(3):
            jax.tree.map(assert_bitwise, jax.block_until_ready(ours(a, b)), want)


def test_beside_an_independent_lax_collective():
    # A partially-manual block's jax_gin psum beside a lax psum that takes nothing from it: on
    # the CPU the call waits for its peers on the rank's worker, so the device's XLA thread
    # goes on to XLA's rendezvous (a call that held that thread could deadlock against it).
    mesh = _mesh((4, 2), ("x", "y"))

    def program(psum, **kw):
        def f(v):
            return psum(v * 2, "x", **kw) % 17 + lax.psum(v + 1, "x") % 13
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),), out_specs=P("x"),
                                     axis_names={"x"}))

    a = _global((128, 128), mesh, P("x", "y"), seed=5)
    want = program(lax.psum)(a)
    ours = program(jax_gin.psum, algorithm="ring")
    for _ in range(3):
        assert_bitwise(jax.block_until_ready(ours(a)), want)
