"""The copy-engine path of asynchronous calls (cuda/copy_engine.cu): which calls take it, and
that they give lax's bits -- over several rounds of a small workspace, in place, in a scan,
under grad, and interleaved with SM-driven calls, which share lane 0's flags and round
counter with it. On CPU devices the same programs run the algorithms' schedules (the setting
is a GPU transport), so the results are checked on every platform and the choice by unit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from jax_gin import _primitive
from jax_gin._ops import ALGORITHM_CODES, OP_CODES
from conftest import mesh_1d, ndev
from helpers import assert_bitwise, exact_input, jax_gin_calls

SMALL_WORKSPACE = 1 << 20  # 512 KiB per rank and round with 2 ranks: large inputs take rounds


@pytest.fixture
def copy_engine(monkeypatch):
    """Every asynchronous call that can take the copy-engine path takes it, through a
    communicator whose window is small enough for several rounds."""
    monkeypatch.setattr(jax_gin.runtime.settings, "overlap_copy_engine_bytes", 1)
    monkeypatch.setattr(jax_gin.runtime.settings, "gpu_workspace_bytes", SMALL_WORKSPACE)


def call(algorithm, nranks, nbytes, op="sum"):
    attrs = dict(algorithm=np.int32(ALGORITHM_CODES[algorithm]), op=np.int32(OP_CODES[op]))
    return _primitive.Call(0, attrs, False, nranks, nbytes)


def test_which_calls_take_it(monkeypatch):
    monkeypatch.setattr(jax_gin.runtime.settings, "overlap_copy_engine_bytes", 1 << 20)
    big, small = 1 << 20, (1 << 20) - 1
    for algo in ("one_shot", "two_shot"):
        for n in (2, 4, 8):
            assert call(algo, n, big).copy_engine("cuda", 1)
    # ring and tree reduce in another order: only where every order gives the same bits
    assert call("ring", 2, big).copy_engine("cuda", 1)
    assert call("tree", 2, big).copy_engine("cuda", 1)
    assert not call("ring", 2, big, op="max").copy_engine("cuda", 1)
    assert not call("ring", 4, big).copy_engine("cuda", 1)
    assert not call("tree", 8, big).copy_engine("cuda", 1)
    # below the threshold, several buffers, one rank, the CPU
    assert not call("two_shot", 2, small).copy_engine("cuda", 1)
    assert not call("two_shot", 2, big).copy_engine("cuda", 2)
    assert not call("two_shot", 1, big).copy_engine("cuda", 1)
    assert not call("two_shot", 2, big).copy_engine("cpu", 1)
    monkeypatch.setattr(jax_gin.runtime.settings, "overlap_copy_engine_bytes", 0)
    assert not call("two_shot", 2, big).copy_engine("cuda", 1)


def test_setting_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="JAX_GIN_OVERLAP_COPY_ENGINE_BYTES"):
        jax_gin.runtime.settings.overlap_copy_engine_bytes = -1
    monkeypatch.setenv("JAX_GIN_OVERLAP_COPY_ENGINE_BYTES", "2e6")
    assert jax_gin.runtime.Settings().overlap_copy_engine_bytes == 2_000_000


def shmap(f, out_specs=P()):
    return jax.jit(jax.shard_map(f, mesh=mesh_1d(), in_specs=P("i"), out_specs=out_specs))


# 3 * 2**17 + 5 float32 elements per device (1.5 MiB): three rounds and a short one with
# 2 ranks in a 1 MiB workspace; odd sizes leave a tail that is not a whole 16-byte vector.
@pytest.mark.parametrize("algo", ["two_shot", "one_shot", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("size", [1, 1001, 3 * 2**17 + 5])
def test_bitwise(copy_engine, size, dtype, algo):
    x = exact_input((size,), ndev(), dtype, seed=size)
    got = shmap(lambda v: jax_gin.psum(v, "i", algorithm=algo, overlap=True))(x)
    assert_bitwise(got, shmap(lambda v: lax.psum(v, "i"))(x))


@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_max_min(copy_engine, op):
    x = exact_input((3 * 2**17 + 5,), ndev(), "float32", seed=3)
    got = shmap(lambda v: getattr(jax_gin, op)(v, "i", algorithm="two_shot", overlap=True))(x)
    assert_bitwise(got, shmap(lambda v: getattr(lax, op)(v, "i"))(x))


def test_interleaved_with_sm_calls(copy_engine):
    """Copy-engine calls between SM-driven ones of every algorithm, run several times: the
    shared lane-0 flags and round counter stay in step."""
    x = exact_input((3 * 2**17 + 5,), ndev(), "int32", seed=7)

    def body(v, psum):
        outs = []
        for algo in jax_gin.ALGORITHMS:
            v = psum(v, algo) % 5
            outs.append(v)
            v = psum(v, "two_shot", True) % 7
            outs.append(v)
        return outs

    ours = shmap(lambda v: body(v, lambda y, a, o=False: jax_gin.psum(y, "i", algorithm=a, overlap=o)))
    ref = shmap(lambda v: body(v, lambda y, a, o=False: lax.psum(y, "i")))
    want = ref(x)
    for _ in range(3):
        jax.tree.map(assert_bitwise, ours(x), want)


def test_psum_overlapping_in_scan(copy_engine):
    # 1 MiB per device: an explicit algorithm, since `auto` may hand that size to XLA's
    # all-reduce (jax_gin/tuning/cpu_n8.json on 8 CPU devices)
    x = exact_input((2**18 + 3,), ndev(), "float32", seed=11)

    def body(v, psum):
        def step(c, _):
            s, m = psum(c)
            return s / ndev() + m, None
        return lax.scan(step, v, None, length=4)[0]

    mm = lambda c: jnp.tanh(c[:8] * 0.5)
    ours = shmap(lambda v: body(v, lambda c: (
        jax_gin.psum_overlapping(c, "i", mm, c, algorithm="two_shot")[0], jnp.zeros_like(c))), P("i"))
    ref = shmap(lambda v: body(v, lambda c: (lax.psum(c, "i"), jnp.zeros_like(c))), P("i"))
    assert jax_gin_calls(ours, x) == 2  # the scan body's start and done
    assert_bitwise(ours(x), ref(x))


def test_grad(copy_engine):
    x = exact_input((2**18 + 1,), ndev(), "float32", seed=5)

    def loss(v, psum):
        return jnp.sum(psum(v * v) * 0.25)

    g = lambda psum: shmap(jax.grad(lambda v: loss(v, psum)), P("i"))
    ours = g(lambda y: jax_gin.psum(y, "i", algorithm="two_shot", overlap=True))(x)
    assert_bitwise(ours, g(lambda y: lax.psum(y, "i"))(x))
