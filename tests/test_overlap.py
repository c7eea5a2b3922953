"""psum(..., overlap=True): the asynchronous start/done pair gives the same bits as lax, in
scan bodies, under grad, vmap and remat, mixed with synchronous calls."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, ndev
from helpers import OPS, assert_bitwise, exact_input, kernel_algorithm, smap


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("size", [1, 1000, 300_001])
def test_overlap_bitwise(op, algo, size):
    ours, ref = OPS[op]
    x = exact_input((size,), ndev(), "float32", seed=size)
    f = smap(lambda v: (ours(v, "i", algorithm=algo, overlap=True), ref(v, "i")), mesh_1d(), P("i"))
    got, want = f(x)
    assert_bitwise(got, want)


def test_lowered_as_start_done_pair():
    x = exact_input((8,), ndev(), "float32")
    tree = {"a": x, "b": x}
    spec = {"a": P("i"), "b": P("i")}
    f = jax.jit(jax.shard_map(lambda t: jax_gin.psum(t, "i", overlap=True, algorithm=kernel_algorithm()),
                              mesh=mesh_1d(), in_specs=(spec,), out_specs=spec))
    text = f.lower(tree).as_text()
    starts = [l for l in text.splitlines() if "jax_gin_all_reduce_start" in l]
    dones = [l for l in text.splitlines() if "jax_gin_all_reduce_done" in l]
    assert len(starts) == 1 and len(dones) == 1  # one pair for the bucket of both leaves
    assert "output_operand_aliases" in dones[0]  # the done returns the start's buffers


def test_every_lowering_gives_the_same_text():
    """A start/done pair's event slot is counted within its program, so lowering the same
    function again (a new jit, another program lowered in between) gives the same text: JAX's
    persistent compilation cache keys on it."""
    x = exact_input((8,), ndev(), "float32")

    def body(v):
        a = kernel_algorithm()  # a kernel's pair on a group of one too (auto copies there)
        return jax_gin.psum(jax_gin.psum(v, "i", overlap=True, algorithm=a) * 2, "i",
                            overlap=True, algorithm=a)
    first = smap(body, mesh_1d(), P("i")).lower(x).as_text()
    smap(lambda v: jax_gin.psum(v, "i", overlap=True), mesh_1d(), P("i")).lower(x)
    assert smap(body, mesh_1d(), P("i")).lower(x).as_text() == first
    assert "slot = 1 : i32" in first  # the program's two pairs keep slots of their own


def test_mixed_with_sync_calls_and_pytrees():
    x = exact_input((1001,), ndev(), "bfloat16", seed=2)

    def f(v):
        a = jax_gin.psum({"u": v, "w": v * 2}, "i", overlap=True)
        b = jax_gin.psum(a["u"], "i")
        c = jax_gin.pmax(b - a["w"], "i", overlap=True)
        return c, lax.pmax(lax.psum(v, "i") * ndev() - lax.psum(v * 2, "i"), "i")

    got, want = smap(f, mesh_1d(), P("i"))(x)
    assert_bitwise(got, want)


def test_in_scan_body():
    x = exact_input((64,), ndev(), "float32", seed=3)

    def body(c, _):
        return jax_gin.psum(c, "i", overlap=True) - c * (ndev() - 1), None

    def ref_body(c, _):
        return lax.psum(c, "i") - c * (ndev() - 1), None

    f = smap(lambda v: (lax.scan(body, v, None, length=5)[0], lax.scan(ref_body, v, None, length=5)[0]),
             mesh_1d(), P("i"))
    got, want = f(x)
    assert_bitwise(got, want)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("remat", [False, True])
def test_grad(check_vma, remat):
    x = exact_input((32,), ndev(), "float32", seed=4)

    def loss(fn, v):
        inner = (lambda u: fn(u * u, "i")) if not remat else jax.checkpoint(lambda u: fn(u * u, "i"))
        return jnp.sum(inner(v) * v)

    def f(v):
        return (jax.grad(lambda u: loss(lambda a, ax: jax_gin.psum(a, ax, overlap=True), u))(v),
                jax.grad(lambda u: loss(lax.psum, u))(v))

    got, want = smap(f, mesh_1d(), P("i"), check_vma=check_vma)(x)
    assert_bitwise(got, want)


def test_vmap():
    x = exact_input((4, 6), ndev(), "float32", seed=5)
    f = smap(lambda v: (jax.vmap(lambda u: jax_gin.psum(u, "i", overlap=True))(v),
                        jax.vmap(lambda u: lax.psum(u, "i"))(v)), mesh_1d(), P("i"))
    got, want = f(x)
    assert_bitwise(got, want)


def test_bad_overlap_argument():
    x = exact_input((4,), ndev(), "float32")
    with pytest.raises(TypeError, match="overlap"):
        smap(lambda v: jax_gin.psum(v, "i", overlap="yes"), mesh_1d(), P("i"))(x)


@pytest.mark.parametrize("reuse", [False, True], ids=["consumed", "read-after-done"])
def test_donated_input(reuse):
    # A donated argument reduced asynchronously: the start reduces in place into the buffer XLA
    # gives it and the done returns that buffer, so donation can neither free nor reuse it
    # between the two. Where the program reads the input again after the done, XLA must copy
    # it before the start; either way the result is lax's, and the argument is consumed.
    # host data: each device_put makes fresh buffers to donate (on one device, putting a
    # device array with its own sharding would return that array, which donation deletes)
    x = np.asarray(exact_input((1000,), ndev(), "float32", seed=6))
    sharding = jax.sharding.NamedSharding(mesh_1d(), P("i"))

    def program(fn):
        body = (lambda v: fn(v, "i") * 2 - v) if reuse else (lambda v: fn(v, "i"))
        return jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"),), out_specs=P("i")),
                       donate_argnums=0)

    want = program(lax.psum)(jax.device_put(x, sharding))
    arg = jax.device_put(x, sharding)
    got = program(lambda v, ax: jax_gin.psum(v, ax, overlap=True, algorithm=kernel_algorithm()))(arg)
    assert_bitwise(got, want)
    assert arg.is_deleted()


def test_dropped_result():
    # An asynchronous psum whose result nothing reads: its start and done stay a pair, kept or
    # removed together (jax 0.11.2 removes both), and the calls after it give lax's bits.
    x = exact_input((1000,), ndev(), "float32", seed=7)

    def f(v):
        jax_gin.psum(v * 3, "i", overlap=True, algorithm=kernel_algorithm())
        return jax_gin.psum(v, "i", overlap=True, algorithm=kernel_algorithm()), lax.psum(v, "i")

    g = smap(f, mesh_1d(), P("i"))
    text = g.lower(x).compile().as_text()
    starts = sum("jax_gin_all_reduce_start" in l for l in text.splitlines())
    dones = sum("jax_gin_all_reduce_done" in l for l in text.splitlines())
    assert starts == dones >= 1
    got, want = g(x)
    assert_bitwise(got, want)
