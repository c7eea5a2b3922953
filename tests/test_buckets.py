"""A pytree is reduced as few collectives: one call per dtype and bucket, bit for bit equal to
lax and to reducing every leaf on its own."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from jax_gin._primitive import MAX_OPERANDS, buckets
from conftest import mesh_1d, mesh_2d, ndev
from helpers import OPS, assert_bitwise, exact_input, jax_gin_calls

# Leaves of odd sizes and shapes in several dtypes; the float32 ones (1000 + 4097 + 105 + 1 +
# 3 + 2 elements) straddle 16-byte boundaries everywhere. (No empty leaf: on 8 CPU devices,
# jax 0.11.2 crashes compiling any shard_map with an empty sharded input, lax.psum or none.)
LEAF_SHAPES = {"a": ((1000,), "float32"), "b": ((7,), "bfloat16"), "c": ((4097,), "float32"),
               "d": ((3, 5, 7), "float32"), "e": ((2,), "float32"), "f": ((1,), "float32"),
               "g": ((13,), "int32"), "h": ((3,), "float32"), "i": ((999,), "bfloat16")}


def _tree(seed=0, shapes=LEAF_SHAPES, ndevices=None):
    n = ndevices or ndev()
    return {k: exact_input(s, n, dt, seed=seed + j) for j, (k, (s, dt)) in enumerate(shapes.items())}


def test_bucket_partition():
    assert buckets([], 10) == []
    assert buckets([4, 4, 4], 8) == [[0, 1], [2]]
    assert buckets([20, 1, 1], 8) == [[0], [1, 2]]  # a leaf larger than a bucket: alone
    assert buckets([1] * 5, 100, max_operands=2) == [[0, 1], [2, 3], [4]]
    assert buckets([0, 0, 5], 5) == [[0, 1, 2]]


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("bucket_bytes", [1, 4096, None])
def test_pytree_bitwise(op, algo, bucket_bytes):
    mesh = mesh_1d()
    ours, ref = OPS[op]
    tree = _tree()
    spec = jax.tree.map(lambda _: P("i"), tree)

    def f(t):
        return (ours(t, "i", algorithm=algo, bucket_bytes=bucket_bytes), ref(t, "i"),
                ours(t, "i", algorithm=algo, bucket_bytes=1))

    sf = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,), out_specs=(spec,) * 3))
    got, want, per_leaf = sf(tree)
    jax.tree.map(assert_bitwise, got, want)
    jax.tree.map(assert_bitwise, got, per_leaf)


def test_one_call_per_dtype_and_bucket():
    mesh = mesh_1d()
    tree = _tree()
    spec = jax.tree.map(lambda _: P("i"), tree)
    for bucket_bytes, expected in [(1 << 30, 3), (1, 9)]:
        # an explicit algorithm: `auto` may hand a size to XLA's all-reduce (a tuning table)
        sf = jax.jit(jax.shard_map(lambda t: jax_gin.psum(t, "i", algorithm="two_shot",
                                                          bucket_bytes=bucket_bytes),
                                   mesh=mesh, in_specs=(spec,), out_specs=spec))
        # float32, bfloat16, int32: three calls; with 1-byte buckets, one call per leaf
        assert jax_gin_calls(sf, tree) == expected


def test_many_leaves_split_at_max_operands():
    mesh = mesh_1d()
    n = MAX_OPERANDS + 7
    tree = [exact_input((k % 5 + 1,), ndev(), "float32", seed=k) for k in range(n)]
    spec = [P("i")] * n
    sf = jax.jit(jax.shard_map(lambda t: (jax_gin.psum(t, "i"), lax.psum(t, "i")),
                               mesh=mesh, in_specs=(spec,), out_specs=(spec, spec)))
    got, want = sf(tree)
    jax.tree.map(assert_bitwise, got, want)
    # an explicit algorithm, so that a mesh of one device launches the kernels too
    assert jax_gin_calls(jax.jit(jax.shard_map(lambda t: jax_gin.psum(t, "i", algorithm="one_shot"),
                                               mesh=mesh, in_specs=(spec,), out_specs=spec)),
                         tree) == 2


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_bucket_larger_than_workspace(algo):
    # 2.4 MB per device: several rounds through the 1 MiB CPU workspace, whose boundaries
    # fall inside leaves and between them.
    mesh = mesh_1d()
    shapes = {"x": ((300_001,), "float32"), "y": ((5,), "float32"), "z": ((299_999,), "float32")}
    tree = _tree(seed=5, shapes=shapes)
    spec = jax.tree.map(lambda _: P("i"), tree)
    sf = jax.jit(jax.shard_map(lambda t: (jax_gin.psum(t, "i", algorithm=algo), lax.psum(t, "i")),
                               mesh=mesh, in_specs=(spec,), out_specs=(spec, spec)))
    got, want = sf(tree)
    jax.tree.map(assert_bitwise, got, want)


@pytest.mark.parametrize("axes", [("x", "y"), "y"])
def test_pytree_2d_mesh(axes):
    mesh = mesh_2d()
    nx, ny = mesh.devices.shape
    tree = {"w": exact_input((nx * 5, 3 * ny), 1, "float32").reshape(nx * 5, 3 * ny),
            "b": exact_input((nx * 2, ny * 9), 1, "bfloat16", seed=4).reshape(nx * 2, ny * 9)}
    spec = {"w": P("x", "y"), "b": P("x", "y")}
    sf = jax.jit(jax.shard_map(lambda t: (jax_gin.psum(t, axes), lax.psum(t, axes)),
                               mesh=mesh, in_specs=(spec,), out_specs=(spec, spec)))
    got, want = sf(tree)
    jax.tree.map(assert_bitwise, got, want)


@pytest.mark.parametrize("check_vma", [True, False])
def test_pytree_grad(check_vma):
    mesh = mesh_1d()
    tree = {"w": exact_input((6,), ndev(), "float32"), "v": exact_input((3, 2), ndev(), "float32", seed=2)}
    spec = jax.tree.map(lambda _: P("i"), tree)

    def loss(psum_fn, t):
        s = psum_fn(jax.tree.map(lambda a: a * a, t), "i")
        return sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(s), jax.tree.leaves(t)))

    def grads(t):
        return (jax.grad(lambda u: loss(jax_gin.psum, u))(t), jax.grad(lambda u: loss(lax.psum, u))(t))

    sf = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(spec,), out_specs=(spec, spec),
                               check_vma=check_vma))
    got, want = sf(tree)
    jax.tree.map(assert_bitwise, got, want)


def test_pytree_vmap():
    mesh = mesh_1d()
    tree = {"w": exact_input((4, 6), ndev(), "float32"), "b": exact_input((4, 5), ndev(), "bfloat16", seed=1)}
    spec = jax.tree.map(lambda _: P("i"), tree)

    def f(t):
        return (jax.vmap(lambda u: jax_gin.psum(u, "i"))(t), jax.vmap(lambda u: lax.psum(u, "i"))(t))

    sf = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,), out_specs=(spec, spec)))
    got, want = sf(tree)
    jax.tree.map(assert_bitwise, got, want)


def test_bad_bucket_bytes():
    mesh = mesh_1d()
    x = exact_input((4,), ndev(), "float32")
    for bad in (0, -5, 1.5, "64M"):
        with pytest.raises(ValueError, match="bucket_bytes"):
            jax.jit(jax.shard_map(lambda v: jax_gin.psum(v, "i", bucket_bytes=bad), mesh=mesh,
                                  in_specs=P("i"), out_specs=P("i")))(x)


def test_identical_calls_are_chained_in_program_order():
    # Calls of one communicator must run in program order on every rank; each takes the
    # previous call's order token. Identical calls (same shapes and params, as in a layer
    # repeated L times) are lowered one by one, not re-emitted from the first with its token.
    mesh = mesh_1d()
    x = exact_input((4,), ndev(), "float32")
    def two(v):  # an explicit algorithm: over one device `auto` launches nothing
        return jax_gin.psum(v, "i", algorithm="one_shot") + jax_gin.psum(v * 2, "i", algorithm="one_shot")

    f = jax.jit(jax.shard_map(two, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    calls = [l for l in f.lower(x).as_text().splitlines() if "jax_gin_all_reduce" in l]
    assert len(calls) == 2
    first = calls[0].split("=")[0].strip()  # "%N:2"
    token = first.split(":")[0] + "#0"
    assert token in calls[1], calls


# Each collective on an operand of no elements, then one with data, in one program: (ours,
# reference, jax_gin calls with data). The references: lax's collectives, and for the fused
# norm, whose float32 bits are its own (docs/design.md), the fused call of the data alone.
def _norm(x):
    return jax_gin.psum_add_rmsnorm(x.reshape(-1, 8), x.reshape(-1, 8), jnp.ones(8), "i",
                                    algorithm=_ALGO)


_ALGO = "one_shot"
EMPTY_THEN_DATA = {
    "psum": (lambda e, a: (jax_gin.psum(e, "i", algorithm=_ALGO),
                           jax_gin.psum(a, "i", algorithm=_ALGO)),
             lambda e, a: (lax.psum(e, "i"), lax.psum(a, "i")), 1),
    "pmax": (lambda e, a: (jax_gin.pmax(e, "i", algorithm=_ALGO),
                           jax_gin.pmax(a, "i", algorithm=_ALGO)),
             lambda e, a: (lax.pmax(e, "i"), lax.pmax(a, "i")), 1),
    "psum overlap": (lambda e, a: (jax_gin.psum(e, "i", algorithm=_ALGO, overlap=True),
                                   jax_gin.psum(a, "i", algorithm=_ALGO, overlap=True)),
                     lambda e, a: (lax.psum(e, "i"), lax.psum(a, "i")), 2),  # start, done
    "psum pytree": (lambda e, a: jax_gin.psum({"bias": e.astype(jnp.bfloat16), "w": a}, "i",
                                              algorithm=_ALGO),
                    lambda e, a: lax.psum({"bias": e.astype(jnp.bfloat16), "w": a}, "i"), 1),
    "psum_overlapping": (lambda e, a: jax_gin.psum_overlapping(
        [e.astype(jnp.bfloat16), a], "i", jnp.sin, a, algorithm=_ALGO),
        lambda e, a: ([lax.psum(e.astype(jnp.bfloat16), "i"), lax.psum(a, "i")], jnp.sin(a)),
        2),  # the start of the data's bucket and the done
    "psum_scatter": (lambda e, a: (
        jax_gin.psum_scatter(jnp.zeros((ndev(), 0)), "i", algorithm=_ALGO),
        jax_gin.psum_scatter(jnp.tile(a, ndev()), "i", tiled=True, algorithm=_ALGO)),
        lambda e, a: (lax.psum_scatter(jnp.zeros((ndev(), 0)), "i"),
                      lax.psum_scatter(jnp.tile(a, ndev()), "i", tiled=True)), 1),
    "all_gather": (lambda e, a: (jax_gin.all_gather(e, "i", algorithm=_ALGO),
                                 jax_gin.all_gather(a, "i", algorithm=_ALGO)),
                   lambda e, a: (lax.all_gather(e, "i"), lax.all_gather(a, "i")), 1),
    "psum_add_rmsnorm": (lambda e, a: (_norm(e), _norm(a)),
                         lambda e, a: ((e.reshape(0, 8),) * 2, _norm(a)), 1),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("case", list(EMPTY_THEN_DATA))
def test_operands_of_no_elements(case, check_vma):
    """An operand of no elements makes no call: it has nothing to exchange, and a call of it
    would end on the group's rank 0 before its peers start it, so that rank 0 would start the
    next call first. Its result is lax's (empty), and the call with data after it gives the
    reference's bits, in every one of several runs."""
    ours, ref, calls = EMPTY_THEN_DATA[case]
    mesh = mesh_1d()
    a = exact_input((8,), ndev(), "float32", seed=1)

    def run(f):
        # the empty operand is made inside the block: jax 0.11.2 crashes compiling a shard_map
        # with an empty sharded input (see LEAF_SHAPES)
        return jax.jit(jax.shard_map(lambda a: f(jnp.zeros((0,), jnp.float32), a), mesh=mesh,
                                     in_specs=P("i"), out_specs=P("i"), check_vma=check_vma))

    want = run(ref)(a)
    for _ in range(5):
        got = jax.block_until_ready(run(ours)(a))
        assert jax.tree.structure(got) == jax.tree.structure(want)
        jax.tree.map(assert_bitwise, got, want)
    if ndev() >= 2:  # (a group of one rank makes no call)
        assert jax_gin_calls(run(ours), a) == calls
