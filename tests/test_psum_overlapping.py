"""jax_gin.psum_overlapping(x, axes, fn, *args) == (lax.psum(x, axes), fn(*args)) bit for bit,
with the all-reduce's start before fn's first operation and its done after fn's last, under
jit, grad, vmap and scan; and its errors."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_gin
from conftest import mesh_1d, mesh_2d, ndev, needs_devices
from helpers import assert_bitwise, exact_input, kernel_algorithm


def chain(m, w):
    """A few dependent matmuls: the computation the all-reduce runs beside."""
    for _ in range(3):
        m = jnp.tanh(m @ w)
    return m


def inputs(size, dtype, seed=0):
    g = exact_input((size,), ndev(), dtype, seed=seed)
    m = jnp.asarray(np.random.default_rng(seed).integers(-3, 4, (ndev() * 4, 8)), jnp.float32)
    w = jnp.eye(8, dtype=jnp.float32) / 2
    return g, m, w


def run(ours, ref, args, check_vma=True, mesh=None, specs=None, out_specs=None):
    mesh = mesh or mesh_1d()
    specs = specs or (P("i"), P("i"), P())
    out_specs = out_specs or (P(), P("i"))
    f = lambda body: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs,
                                           check_vma=check_vma))
    got, want = f(ours)(*args), f(ref)(*args)
    jax.tree.map(assert_bitwise, got, want)
    return f(ours)


def assert_tree_bitwise(got, want):
    jax.tree.map(assert_bitwise, got, want)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("size", [1, 1001, 65_537])
def test_bitwise(size, dtype, algo, check_vma):
    args = inputs(size, dtype, seed=size)
    run(lambda g, m, w: jax_gin.psum_overlapping(g, "i", chain, m, w, algorithm=algo),
        lambda g, m, w: (lax.psum(g, "i"), chain(m, w)), args, check_vma)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype", ["complex64", "uint64"])
def test_sums_what_psum_sums(dtype, check_vma):
    # complex as (real, imaginary) pairs, uint64 (x64) as the int64 of the same bits: the
    # results are psum's, bit for bit, over the whole uint64 range (sums that wrap)
    with jax.enable_x64(dtype == "uint64"):
        _, m, w = inputs(1, "float32")
        rng = np.random.default_rng(3)
        n = ndev() * 257
        if dtype == "uint64":
            g = rng.integers(0, np.iinfo(np.uint64).max, size=(n,), dtype=np.uint64, endpoint=True)
        else:
            g = (rng.integers(-7, 8, n) + 1j * rng.integers(-7, 8, n)).astype(np.complex64)
        f = run(lambda g, m, w: jax_gin.psum_overlapping(g, "i", chain, m, w),
                lambda g, m, w: (lax.psum(g, "i"), chain(m, w)), (jnp.asarray(g), m, w),
                check_vma)
        assert f(jnp.asarray(g), m, w)[0].dtype == dtype


def test_pytree_of_several_buckets_and_dtypes():
    g, m, w = inputs(3001, "float32", seed=1)

    def ours(g, m, w):
        tree = {"a": g, "b": g[:77].astype(jnp.bfloat16), "c": g[5:] * 2, "d": 3.0}
        return jax_gin.psum_overlapping(tree, "i", chain, m, w, bucket_bytes=4096,
                                        algorithm=kernel_algorithm())

    def ref(g, m, w):
        tree = {"a": g, "b": g[:77].astype(jnp.bfloat16), "c": g[5:] * 2, "d": 3.0}
        return jax.tree.map(lambda v: lax.psum(v, "i"), tree), chain(m, w)

    out_specs = ({"a": P(), "b": P(), "c": P(), "d": P()}, P("i"))
    f = run(ours, ref, (g, m, w), out_specs=out_specs)
    text = f.lower(g, m, w).as_text()
    assert len(re.findall(r"jax_gin_all_reduce_start", text)) >= 3  # buckets of 4 KiB


@pytest.mark.parametrize("check_vma", [True, False])
def test_start_before_fn_and_done_after_it(check_vma):
    """In the compiled program every start precedes fn's matmuls and every done follows
    them, whatever XLA's scheduler prefers."""
    g, m, w = inputs(1000, "float32")
    f = run(lambda g, m, w: jax_gin.psum_overlapping(g, "i", chain, m, w,
                                                     algorithm=kernel_algorithm()),
            lambda g, m, w: (lax.psum(g, "i"), chain(m, w)), (g, m, w), check_vma)
    text = f.lower(g, m, w).compile().as_text()
    entry = text[text.index("ENTRY"):]
    order = []
    for line in entry.splitlines():
        if "jax_gin_all_reduce_start" in line:
            order.append("S")
        elif "jax_gin_all_reduce_done" in line:
            order.append("D")
        elif re.search(r"\bdot\(|custom-call.*(gemm|matmul)|fusion.*(dot|tanh)", line):
            order.append("G")
    seq = "".join(order)
    assert "S" in seq and "D" in seq and "G" in seq, seq
    assert seq.index("D") > seq.rindex("G") and seq.rindex("S") < seq.index("G"), seq


@pytest.mark.parametrize("closes_over_w", [False, True], ids=["args", "closure"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_grad(check_vma, closes_over_w):
    """Gradients with respect to x and fn's inputs are lax's, bit for bit. fn may close over
    traced values (a layer's weights) rather than take them in *args (JAX refuses to
    differentiate a custom_vjp with respect to a closed-over value; the call converts fn's
    closure)."""
    g, m, w = inputs(257, "float32", seed=2)

    def loss(body):
        def f(g, m, w):
            s, y = body(g, m, w)
            return jnp.sum(s * g) + jnp.sum(y * y)
        return f

    # body(x, m, w): fn closes over w and takes m only
    closure = (lambda call: lambda x, m, w: call(x, lambda a: chain(a, w), m)) \
        if closes_over_w else None
    # the backward all-reduce is an overlapped pair too
    _check_grad(loss, check_vma, (g, m, w), starts=2, body=closure)


def _check_grad(loss, check_vma, gmw, starts, body=None):
    """The gradients of loss(body) with respect to (g, m, w), with body psum_overlapping(x,
    "i", chain, m, w) or lax.psum(x) beside chain(m, w): lax's bits; without check_vma, the
    program has `starts` overlapped starts. `body(call)`: another way to call them, given
    call(x, fn, *args)."""
    body = body or (lambda call: lambda x, m, w: call(x, chain, m, w))
    ours = loss(body(lambda x, fn, *a: jax_gin.psum_overlapping(x, "i", fn, *a,
                                                              algorithm=kernel_algorithm())))
    ref = loss(body(lambda x, fn, *a: (lax.psum(x, "i"), fn(*a))))
    grads = lambda f: lambda g, m, w: jax.grad(f, argnums=(0, 1, 2))(g, m, w)
    specs = (P("i"), P("i"), P())
    out = (P("i"), P("i"), P()) if check_vma else (P("i"), P("i"), P("i"))
    f = lambda body: jax.jit(jax.shard_map(grads(body), mesh=mesh_1d(), in_specs=specs,
                                           out_specs=out, check_vma=check_vma))
    assert_tree_bitwise(f(ours)(*gmw), f(ref)(*gmw))
    if not check_vma:
        text = f(ours).lower(*gmw).as_text()
        assert len(re.findall(r"jax_gin_all_reduce_start", text)) == starts


@pytest.mark.parametrize("only_integers", [False, True])
@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_with_integer_leaves(check_vma, only_integers):
    """Integer leaves (a count beside the gradients) have float0 cotangents, which nothing
    sums: the gradient is lax's, bit for bit, and the backward all-reduce sums the float
    leaves alone, or is left out where all are integers."""
    g, m, w = inputs(257, "float32", seed=4)

    def loss(body):
        def f(g, m, w):
            count = (g > 0).astype(jnp.int32)
            x = (count,) if only_integers else (g, count)
            s, y = body(x, m, w)
            return jnp.sum(y * y) + (0.0 if only_integers else jnp.sum(s[0] * g))
        return f

    # a start a dtype forward, and the float32 one backward
    _check_grad(loss, check_vma, (g, m, w), starts=1 if only_integers else 3)


@pytest.mark.parametrize("check_vma", [True, False])
def test_second_order_reverse(check_vma):
    """grad of a function of grad (reverse over reverse, as a Hessian-vector product through
    jacrev is): lax's bits, the forward pass being differentiated too. Forward mode (jvp,
    jacfwd, jax.hessian) is refused by JAX, as for any custom_vjp."""
    g, m, w = inputs(257, "float32", seed=3)

    def second(body):
        def loss(g, m):
            s, y = body(g, m, w)
            return jnp.sum(jnp.tanh(s) * g) + jnp.sum(y * y)

        def f(g, m):
            gg, gm = jax.grad(loss, argnums=(0, 1))(g, m)
            return jnp.sum(gg * gg) + jnp.sum(gm * gm)
        return lambda g, m, w: jax.grad(f, argnums=(0, 1))(g, m)

    ours = second(lambda g, m, w: jax_gin.psum_overlapping(g, "i", chain, m, w,
                                                           algorithm=kernel_algorithm()))
    ref = second(lambda g, m, w: (lax.psum(g, "i"), chain(m, w)))
    run(ours, ref, (g, m, w), check_vma, out_specs=(P("i"), P("i")))
    with pytest.raises(TypeError, match="forward-mode"):
        run(lambda g, m, w: jax.jvp(lambda g: ours(g, m, w)[0], (g,), (g,)),
            lambda g, m, w: g, (g, m, w), check_vma, out_specs=P("i"))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("how", ["grad of grad", "jacrev of jacrev"])
def test_second_order_around_a_jitted_step(how, check_vma):
    """A jitted shard_map step, differentiated twice outside the jit (each pass traces the
    step's pair again): jax_gin.psum's bits. (Not lax's here: this Hessian sums zeros of
    both signs, whose sum's sign differs from XLA's CPU all-reduce, see docs/api.md.)"""
    g, m, w = inputs(8, "float32", seed=6)
    g = g / 8

    def step(body):
        sm = jax.jit(jax.shard_map(lambda g, m: body(g, m), mesh=mesh_1d(),
                                   in_specs=(P("i"), P("i")), out_specs=(P("i"), P("i")),
                                   check_vma=check_vma))
        def loss(g):
            s, y = sm(g ** 3, m)
            return jnp.sum(jnp.sin(s)) + jnp.sum(y)
        if how == "grad of grad":
            return jax.grad(lambda g: jnp.sum(jax.grad(loss)(g) ** 2))(g)
        return jax.jacrev(jax.jacrev(loss))(g)

    algo = kernel_algorithm()
    ours = step(lambda g, m: jax_gin.psum_overlapping(g, "i", chain, m, w, algorithm=algo))
    ref = step(lambda g, m: (jax_gin.psum(g, "i", algorithm=algo), chain(m, w)))
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("check_vma", [True, False])
def test_eager_shard_map(check_vma):
    """Without jit, shard_map runs each primitive as a program of its own; the pair and fn
    still run as one: the values and gradients are lax's."""
    g, m, w = inputs(33, "float32", seed=7)

    def step(body):
        sm = jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"), P("i")),
                           out_specs=(P("i"), P("i")), check_vma=check_vma)
        loss = lambda g, m: jnp.sum(sm(g, m)[0] * g) + jnp.sum(sm(g, m)[1])  # noqa: E731
        return sm(g, m), jax.grad(loss, argnums=(0, 1))(g, m)

    ours = step(lambda g, m: jax_gin.psum_overlapping(g, "i", chain, m, w,
                                                      algorithm=kernel_algorithm()))
    ref = step(lambda g, m: (lax.psum(g, "i"), chain(m, w)))
    assert_tree_bitwise(ours, ref)


def test_vmap_over_another_axis():
    g = exact_input((3, 40), ndev(), "float32", seed=3)
    m = jnp.ones((ndev() * 4, 8), jnp.float32)
    w = jnp.eye(8, dtype=jnp.float32)
    ours = lambda g, m, w: jax.vmap(lambda v: jax_gin.psum_overlapping(v, "i", chain, m, w))(g)
    ref = lambda g, m, w: jax.vmap(lambda v: (lax.psum(v, "i"), chain(m, w)))(g)
    run(ours, ref, (g, m, w), out_specs=(P(), P(None, "i")))


def test_in_scan_body():
    g, m, w = inputs(64, "float32", seed=4)

    def body(c, _):
        s, y = jax_gin.psum_overlapping(c, "i", chain, c[:32].reshape(4, 8), w)
        return s - c * (ndev() - 1) + 0 * jnp.sum(y), None

    def ref_body(c, _):
        s, y = lax.psum(c, "i"), chain(c[:32].reshape(4, 8), w)
        return s - c * (ndev() - 1) + 0 * jnp.sum(y), None

    run(lambda g, m, w: (lax.scan(body, g, None, length=3)[0], m),
        lambda g, m, w: (lax.scan(ref_body, g, None, length=3)[0], m), (g, m, w),
        out_specs=(P("i"), P("i")))


def test_two_axes_of_a_2d_mesh():
    mesh = mesh_2d()
    g = exact_input((10, 6), mesh.devices.size, "float32", seed=5).reshape(
        mesh.shape["x"] * 10, mesh.shape["y"] * 6 * 1)
    m = jnp.ones((mesh.shape["x"] * 4, 8), jnp.float32)
    w = jnp.eye(8, dtype=jnp.float32)
    run(lambda g, m, w: jax_gin.psum_overlapping(g, ("x", "y"), chain, m, w),
        lambda g, m, w: (lax.psum(g, ("x", "y")), chain(m, w)), (g, m, w), mesh=mesh,
        specs=(P("x", "y"), P("x"), P()), out_specs=(P(), P("x")))


def test_results_unused_still_correct():
    """Dropping the sum (or fn's result) keeps the program correct: the done stays."""
    g, m, w = inputs(1000, "float32", seed=6)
    run(lambda g, m, w: (g, jax_gin.psum_overlapping(g, "i", chain, m, w)[1]),
        lambda g, m, w: (g, chain(m, w)), (g, m, w), out_specs=(P("i"), P("i")))
    run(lambda g, m, w: (jax_gin.psum_overlapping(g, "i", chain, m, w)[0], m),
        lambda g, m, w: (lax.psum(g, "i"), m), (g, m, w))


def test_fn_traced_once_and_calls_that_launch_nothing():
    """fn is traced once (the check of its calls reads the pair's own trace): a function that
    keeps state across its calls, as a layer with running statistics does, runs as with lax.
    A jax_gin call inside fn over mesh axes of one device launches nothing, and is let
    through."""
    mesh = Mesh(np.array(jax.devices()).reshape(ndev(), 1), ("i", "t"))
    g, m, w = inputs(64, "float32", seed=7)
    traced = []

    class Layer:
        mean = None

        def __call__(self, m, w):
            traced.append(1)
            y = jax_gin.psum(chain(m, w), "t")  # over one device: no call
            self.mean = jnp.mean(y) if self.mean is None else (self.mean + jnp.mean(y)) / 2
            return y - self.mean

    def body(g, m, w):
        return jax_gin.psum_overlapping(g, "i", Layer(), m, w, algorithm=kernel_algorithm())

    def ref(g, m, w):
        return lax.psum(g, "i"), Layer()(m, w)

    f = lambda b: jax.jit(jax.shard_map(b, mesh=mesh, in_specs=(P("i"), P("i"), P()),  # noqa: E731
                                        out_specs=(P(), P("i")), check_vma=False))
    got = f(body)(g, m, w)
    assert len(traced) == 1
    jax.tree.map(assert_bitwise, got, f(ref)(g, m, w))
    # a psum_overlapping inside fn over the axis of one device launches nothing either
    inner = lambda m, w: jax_gin.psum_overlapping(m, "t", chain, m, w)  # noqa: E731
    body = lambda g, m, w: jax_gin.psum_overlapping(  # noqa: E731
        g, "i", lambda m, w: sum(inner(m, w)), m, w, algorithm=kernel_algorithm())
    jax.tree.map(assert_bitwise, f(body)(g, m, w),
                 f(lambda g, m, w: (lax.psum(g, "i"), m + chain(m, w)))(g, m, w))


def _call_on(g, m, w):
    """call(body): jit(shard_map(body)) over (g, m, w), sum replicated and y per device."""
    return lambda body: jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"), P("i"), P()),
                                              out_specs=(P(), P("i"))))(g, m, w)


def test_collectives_inside_fn_are_refused():
    """fn's jax_gin calls, which would run beside the start's kernel, are refused by name.
    (Over an axis of one device, a call runs no kernel and is let through.)"""
    needs_devices(2)
    g, m, w = inputs(16, "float32")
    call = _call_on(g, m, w)
    algo = kernel_algorithm()  # a start in flight: one that launched a kernel
    with pytest.raises(ValueError, match="in flight"):
        call(lambda g, m, w: jax_gin.psum_overlapping(
            g, "i", lambda m, w: jax_gin.psum(chain(m, w), "i", algorithm=algo), m, w,
            algorithm=algo))
    with pytest.raises(ValueError, match="in flight"):
        call(lambda g, m, w: jax_gin.psum_overlapping(
            g, "i", lambda m, w: jax_gin.psum_overlapping(m, "i", chain, m, w, algorithm=algo)[1],
            m, w, algorithm=algo))
    # A jitted function that the program called before is not lowered again inside fn: its
    # call is found in fn's jaxpr.
    def before_and_inside(inner):
        def body(g, m, w):
            before = inner(m, w)
            s, y = jax_gin.psum_overlapping(g, "i", inner, m, w, algorithm=algo)
            return s, y + before
        return body

    layer = jax.jit(lambda m, w: jax_gin.psum(chain(m, w), "i", algorithm=algo))
    with pytest.raises(ValueError, match="calls a jax_gin collective .* in flight"):
        call(before_and_inside(layer))
    # the fused norms are collectives too
    d = m.shape[-1]
    norm = jax.jit(lambda m, w: jax_gin.psum_add_rmsnorm(chain(m, w), m, jnp.ones((d,)), "i",
                                                         algorithm=algo)[0])
    with pytest.raises(ValueError, match="primitive jax_gin_psum_add_rmsnorm"):
        call(before_and_inside(norm))


def test_unused_results_of_an_fn_with_effects_keep_the_done():
    """fn with a debug print keeps the starts alive where no result of the pair is used; the
    done stays too (a start without its done would leave its kernel unjoined on a GPU), and a
    jax_gin call after it runs."""
    needs_devices(2)
    g, m, w = inputs(64, "float32", seed=8)
    algo = kernel_algorithm()
    printed = lambda m, w: jax.debug.print("fn ran: {s}", s=chain(m, w).sum())  # noqa: E731

    def body(g, m, w):
        jax_gin.psum_overlapping(g, "i", printed, m, w, algorithm=algo)  # results unused
        return jax_gin.psum(g * 2, "i", algorithm=algo), m

    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"), P("i"), P()),
                              out_specs=(P(), P("i"))))
    text = f.lower(g, m, w).as_text()
    starts = text.count("custom_call @jax_gin_all_reduce_start")
    assert starts == 1 and text.count("custom_call @jax_gin_all_reduce_done") == starts
    assert_bitwise(f(g, m, w)[0], jax.jit(jax.shard_map(
        lambda g: lax.psum(g * 2, "i"), mesh=mesh_1d(), in_specs=P("i"), out_specs=P()))(g))
    # with a pure fn, unused results take the whole pair away
    pure = lambda g, m, w: (jax_gin.psum_overlapping(g, "i", chain, m, w, algorithm=algo),  # noqa: E731
                            m)[1]
    text = jax.jit(jax.shard_map(pure, mesh=mesh_1d(), in_specs=(P("i"), P("i"), P()),
                                 out_specs=P("i"))).lower(g, m, w).as_text()
    assert "jax_gin_all_reduce_start" not in text and "jax_gin_all_reduce_done" not in text


def test_collectives_in_fns_backward_are_refused():
    """With check_vma=False the backward pass is a pair too, beside fn's backward: a jax_gin
    call there (a Megatron-style identity whose backward all-reduces) is refused by name, also
    where its jitted function was lowered before and is not lowered again."""
    needs_devices(2)
    g, m, w = inputs(16, "float32")
    algo = kernel_algorithm()
    reduce_back = jax.jit(lambda c: jax_gin.psum(c, "i", algorithm=algo))

    @jax.custom_vjp
    def copy_to_tp(x):
        return x

    copy_to_tp.defvjp(lambda x: (x, None), lambda _, c: (reduce_back(c),))

    def loss(g, m, w):
        before = reduce_back(m)  # lowered before the pair
        s, y = jax_gin.psum_overlapping(g, "i", lambda m, w: chain(copy_to_tp(m), w), m, w,
                                        algorithm=algo)
        return jnp.sum(s) + jnp.sum(y) + jnp.sum(before)

    f = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh_1d(),
                              in_specs=(P("i"), P("i"), P()), out_specs=(P("i"), P("i")),
                              check_vma=False))
    with pytest.raises(ValueError, match="the backward pass of the function it runs beside the "
                                         "all-reduce calls a jax_gin collective"):
        f(g, m, w)


def test_unused_backward_pair_with_effects_keeps_its_done():
    """The backward pair (check_vma=False) beside an fn whose backward alone has an effect (a
    custom_vjp that prints): with the gradient unused, its done stays with its start."""
    needs_devices(2)
    g, m, w = inputs(64, "float32", seed=9)
    algo = kernel_algorithm()

    @jax.custom_vjp
    def ident(x):
        return x

    ident.defvjp(lambda x: (x, None), lambda _, c: (jax.debug.print("bwd {s}", s=c.sum()) or c,))

    def loss(g, m, w):
        s, y = jax_gin.psum_overlapping(g, "i", lambda m, w: chain(ident(m), w), m, w,
                                        algorithm=algo)
        return jnp.sum(s) + jnp.sum(y)

    def body(g, m, w):
        jax.grad(loss, argnums=(0, 1))(g, m, w)  # unused
        return jax_gin.psum(g * 2, "i", algorithm=algo)

    f = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=(P("i"), P("i"), P()),
                              out_specs=P(), check_vma=False))
    text = f.lower(g, m, w).as_text()
    starts = text.count("custom_call @jax_gin_all_reduce_start")
    assert starts >= 1 and text.count("custom_call @jax_gin_all_reduce_done") == starts
    assert_bitwise(f(g, m, w), jax.jit(jax.shard_map(
        lambda g: lax.psum(g * 2, "i"), mesh=mesh_1d(), in_specs=P("i"), out_specs=P(),
        check_vma=False))(g))


def test_a_pair_of_constants_only_is_fn_alone():
    """x of constants only (or no leaves) makes no pair: fn runs alone, and so such a call may
    sit inside another pair's fn over an axis of one device."""
    needs_devices(2)
    mesh = Mesh(np.array(jax.devices()).reshape(ndev(), 1), ("i", "t"))
    g, m, w = inputs(64, "float32", seed=10)
    inner = lambda m, w: jax_gin.psum_overlapping(1.0, "t", chain, m, w)[1]  # noqa: E731
    body = lambda g, m, w: jax_gin.psum_overlapping(g, "i", inner, m, w,  # noqa: E731
                                                   algorithm=kernel_algorithm())
    f = lambda b: jax.jit(jax.shard_map(b, mesh=mesh, in_specs=(P("i"), P("i"), P()),  # noqa: E731
                                        out_specs=(P(), P("i")), check_vma=False))
    jax.tree.map(assert_bitwise, f(body)(g, m, w),
                 f(lambda g, m, w: (lax.psum(g, "i"), chain(m, w)))(g, m, w))
    empty = lambda g, m, w: (g.sum(), jax_gin.psum_overlapping({}, "i", chain, m, w)[1])  # noqa: E731
    f(empty)(g, m, w)


def test_constants_are_lax_constants():
    """A constant leaf's sum is lax's constant, as jax_gin.psum's: psum_overlapping(1, axis)
    is the axis size as a Python int; the other leaves are summed beside fn."""
    g, m, w = inputs(16, "float32")

    def body(g, m, w):
        (n, s), y = jax_gin.psum_overlapping((1, g), "i", chain, m, w)
        assert type(n) is int and n == ndev()
        return s, y

    run(body, lambda g, m, w: (lax.psum(g, "i"), chain(m, w)), (g, m, w))


def test_errors():
    g, m, w = inputs(16, "float32")
    call = _call_on(g, m, w)
    with pytest.raises(TypeError, match="callable"):
        call(lambda g, m, w: jax_gin.psum_overlapping(g, "i", 3, m, w))
    with pytest.raises(ValueError, match="lanes"):
        call(lambda g, m, w: jax_gin.psum_overlapping(g, "i", chain, m, w, lanes=0))
    with pytest.raises(ValueError, match="70 buckets .* split the pytree over several calls"):
        call(lambda g, m, w: (jax_gin.psum_overlapping([g] * 70, "i", chain, m, w,
                                                       bucket_bytes=1)[0][0], chain(m, w)))
    with pytest.raises(NameError, match="unbound axis"):
        call(lambda g, m, w: jax_gin.psum_overlapping(g, "nope", chain, m, w))
    # lax's collectives inside fn are fine
    f = lambda g, m, w: jax_gin.psum_overlapping(g, "i", lambda m, w: lax.pmax(chain(m, w), "i"), m, w)
    r = lambda g, m, w: (lax.psum(g, "i"), lax.pmax(chain(m, w), "i"))
    run(f, r, (g, m, w))
