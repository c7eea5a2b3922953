"""jax_gin's calls run in one order on every device, wherever JAX puts them: in jax.checkpoint's
recomputation, a nested jit, a scan, beside independent calls (the order tokens of
_primitive.py)."""
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_gin
from jax_gin import _native
from jax_gin._ops import ALGORITHM_CODES, OP_CODES
from conftest import mesh_1d, ndev, needs_devices
from helpers import assert_bitwise, exact_input

POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def _run_both(make, x, repeats=3, check_vma=False):
    """make(psum, all_gather) -> body; jax_gin's and lax's, bit for bit, `repeats` times (a
    race shows up as an error or a difference on some run, not necessarily the first)."""
    mesh = mesh_1d()
    ours = jax.jit(jax.shard_map(make(jax_gin.psum, jax_gin.all_gather), mesh=mesh,
                                 in_specs=P("i"), out_specs=P("i"), check_vma=check_vma))
    ref = jax.jit(jax.shard_map(make(lax.psum, lax.all_gather), mesh=mesh, in_specs=P("i"),
                                out_specs=P("i"), check_vma=check_vma))
    want = ref(x)
    for _ in range(repeats):
        jax.tree.map(assert_bitwise, jax.block_until_ready(ours(x)), want)


def _fsdp_like(psum, all_gather):
    """Layers under jax.checkpoint whose weights are all-gathered inside: under grad, JAX lowers
    the recomputation as a function of its own, beside the backward's psum_scatters."""
    @functools.partial(jax.checkpoint, policy=POLICY)
    def layer(h, shard):
        w = all_gather(shard, "i", tiled=True)
        return jnp.tanh(h * w[: h.shape[0]]) + psum(h, "i") * 0.5

    def loss(shards, h):
        for s in shards:
            h = layer(h, s)
        return jnp.sum(h * h)

    def body(v):
        shards = [v * (k + 1) for k in range(4)]
        return jax.grad(loss)(shards, v[: v.shape[0]])[1]
    return body


def test_checkpointed_layers_under_grad():
    # over one device jax_gin's and lax's collectives are identities placed at different
    # stages of compilation, and XLA may then fuse the inexact tanh layers differently
    needs_devices(2)
    # buffers of 4 KiB: XLA's CPU runtime runs independent operations concurrently once a
    # program has more than a few of them and a buffer exceeds 512 bytes
    n = ndev()
    x = exact_input((1024,), n, "float32", seed=1) / 8
    _run_both(_fsdp_like, x)


def test_checkpointed_fsdp_blocks():
    """The fsdp workload's step with each block under jax.checkpoint (what FSDP users write to
    gather the weights again in the backward pass), against lax's."""
    from jax_gin import workloads as w
    mesh = w.make_mesh("fsdp")
    cfg = w.default_config("fsdp", "cpu", dtype="float32")
    top, block = w.fsdp_groups(cfg)

    def grads(gather):
        @functools.partial(jax.checkpoint, policy=POLICY)
        def layer(x, s):
            return w.gpt_block(x, w.fsdp_unpack(gather(s, "data"), block), cfg.heads)

        def loss(sh, tok):
            t = w.fsdp_unpack(gather(sh["top"], "data"), top)
            x = w.gpt_embed(t, tok)
            for s in sh["layers"]:
                x = layer(x, s)
            return w.gpt_head(x, t, tok)
        return jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P("data"), P("data")),
                                     out_specs=P("data"), check_vma=False))

    args = w.fsdp_inputs(mesh, cfg)
    want = grads(w.gatherer("lax"))(*args)
    ours = grads(w.gatherer("jax_gin", "one_shot"))
    # The model's arithmetic is not exact: on GPUs XLA may fuse the two programs differently
    # around the collectives, so there they agree to float32 rounding, on CPU bit for bit.
    same = assert_bitwise if jax.default_backend() == "cpu" else (
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                                atol=1e-7))
    for _ in range(3):
        jax.tree.map(same, jax.block_until_ready(ours(*args)), want)


def test_nested_jit_beside_independent_calls():
    n = ndev()
    x = exact_input((1024,), n, "float32", seed=2)

    def make(psum, all_gather):
        @jax.jit
        def inner(a):
            return psum(a * 2, "i"), all_gather(a, "i", tiled=True)

        def body(v):
            s1, g1 = inner(v)
            s2 = psum(v + 1, "i")            # independent of inner's calls
            s3, g2 = inner(v - 1)
            return s1 + s2 + s3 + g1[: v.shape[0]] + g2[-v.shape[0]:]
        return body

    _run_both(make, x)


def test_scan_and_cond():
    n = ndev()
    x = exact_input((1024,), n, "int32", seed=3)

    def make(psum, all_gather):
        def body(v):
            def step(c, k):
                c = lax.cond(k % 2 == 0, lambda t: psum(t, "i") % 97, lambda t: t + 1, c)
                return c, all_gather(c[:4], "i", tiled=True)
            c, gs = lax.scan(step, v, jnp.arange(4))
            return c + psum(gs.sum(), "i")
        return body

    _run_both(make, x)


def test_hlo_order_tokens_on_cpu():
    """On CPU devices every call takes and returns an HLO token, which XLA's CPU runtime orders
    across functions (uint32 tokens let the recomputation's calls run concurrently)."""
    if jax.default_backend() != "cpu":
        pytest.skip("HLO order tokens are the CPU backend's (GPUs run calls in stream order)")
    needs_devices(2)  # over one device auto makes no calls
    n = ndev()
    x = exact_input((16,), n, "float32", seed=1) / 8
    f = jax.jit(jax.shard_map(_fsdp_like(jax_gin.psum, jax_gin.all_gather), mesh=mesh_1d(),
                              in_specs=P("i"), out_specs=P("i"), check_vma=False))
    calls = [line for line in f.lower(x).as_text().splitlines()
             if "stablehlo.custom_call @jax_gin" in line]
    assert len(calls) >= 6, calls
    for line in calls:
        operand_types, result_types = line.rsplit(": (", 1)[1].split(") -> (")
        assert operand_types.split(", ")[1] == "!stablehlo.token", line
        assert result_types.startswith("!stablehlo.token"), line


def test_psum_overlapping_in_checkpointed_layers():
    """psum_overlapping's start/done pair inside jax.checkpoint, under grad: the forward pair,
    its recomputation and the backward pair, in order (exact arithmetic beside it: lax's bits)."""
    n = ndev()
    x = exact_input((1024,), n, "float32", seed=5) / 8

    def make(overlapping):
        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
        def layer(h):
            s, y = overlapping(h * 2, jnp.negative, h)
            return y + s * 0.25

        def loss(h):
            for _ in range(3):
                h = layer(h)
            return jnp.sum(h * h)
        return jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh_1d(), in_specs=P("i"),
                                     out_specs=P("i"), check_vma=False))

    ours = make(lambda v, fn, *args: jax_gin.psum_overlapping(v, "i", fn, *args))
    ref = make(lambda v, fn, *args: (lax.psum(v, "i"), fn(*args)))
    want = ref(x)
    for _ in range(3):
        assert_bitwise(jax.block_until_ready(ours(x)), want)


_UNLINKED_CHILD = r"""
import os, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_gin
mesh = Mesh(np.array(jax.devices()), ("i",))

def block(psum):
    def fn(x, r, w):
        nr = r + psum(x, "i")
        return nr * w, nr
    return jax.shard_map(fn, mesh=mesh, in_specs=(P("i"), P("i"), P()), out_specs=(P("i"), P("i")))

# f as jax.export gives it to another program: a module lowered apart, whose calls number
# their sites from 1 as this program's do
def exported(f, *args):
    names = set(re.findall(r"custom_call @(jax_gin_\w+)", f.lower(*args).as_text()))
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in names]
    return jax.export.export(f, disabled_checks=checks)(*args).call

def program(psum, mode, args):
    sm = block(psum)
    # the block beside the jacobian: this program's own, or a jitted copy exported apart
    model = exported(jax.jit(sm), *args) if mode == "exported" else sm
    def f(x, r, w):
        jac = jax.jacfwd(lambda *a: sm(*a)[0], argnums=(0, 1, 2))(x, r, w)
        if mode == "linked":  # the block takes a value of the jacobian's result: one order
            x = x + 0 * jac[0][0, 0, 0, 0]
        return jac, model(x, r, w)
    return jax.jit(f)

n = len(jax.devices())
x = jnp.asarray(np.arange(n * 2 * 5).reshape(n * 2, 5) % 7, jnp.float32)
args = (x, x + 1, jnp.ones(5))
want = program(jax.lax.psum, sys.argv[1], args)(*args)
ours = program(lambda v, a: jax_gin.psum(v, a, algorithm="one_shot"), sys.argv[1], args)
try:
    same = True
    for _ in range(5):  # the two blocks' calls come to a rank in either order, or at once
        got = jax.block_until_ready(ours(*args))
        same = same and all(np.array_equal(np.asarray(a), np.asarray(b))
                            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print("RESULT", "lax" if same else "DIFFERENT", flush=True)
except Exception as e:
    print("ERROR", str(e).replace("\n", " "), flush=True)
# at once: the ranks that did not fail wait in XLA's rendezvous of the jacobian's permutes,
# and XLA's CPU runtime ends the process after 40 s
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["unlinked", "linked", "exported"])
def test_independent_blocks_of_one_program(tmp_path, mode):
    """A jax.jacfwd of a shard_map block beside the block itself, in one program and on one
    communicator: nothing orders the two blocks' calls, and XLA's CPU runtime hands a rank
    both at once, in either order. Each rank runs them in the order of its group's rank 0:
    lax's numbers, as with the block taking a value of the jacobian's result, which orders
    them, and with the block exported by jax.export (a module lowered apart, whose sites
    count from 1 too, but under its own name). (A subprocess: a failed run leaves ranks in
    XLA's rendezvous, and XLA ends the process.)"""
    if jax.default_backend() != "cpu":
        pytest.skip("XLA's CPU runtime: GPUs run a device's calls on one stream in order")
    needs_devices(2)
    (tmp_path / "child.py").write_text(_UNLINKED_CHILD)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_GIN_TIMEOUT_S="20",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={ndev()}")
    r = subprocess.run([sys.executable, str(tmp_path / "child.py"), mode], env=env,
                       capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("RESULT", "ERROR"))]
    assert r.returncode == 0 and len(lines) == 1, r.stdout + r.stderr[-3000:]
    assert lines[0] == "RESULT lax", lines[0]


def test_ranks_that_start_different_calls_fail():
    """Ranks whose calls would pair different calls (rank 1 starts call site 2 where rank 0
    starts site 1) fail, naming both sites, and the group with them; never wrong numbers."""
    x = np.ones((4, 64), np.float32)
    with pytest.raises(RuntimeError) as info:
        _native.cpu.threads_allreduce(x, OP_CODES["sum"], ALGORITHM_CODES["ring"], 4096,
                                      timeout_s=5, sites=[1, 2, 1, 1])
    msg = str(info.value)
    # the harness raises rank 0's error: it gave up after rank 1 failed
    assert re.search(r"rank 0 of group 0 \(4 ranks\) gave up waiting for peer \d .*because rank 1 "
                     r"failed first: it started call #1 as the program's jax_gin call 2, but rank "
                     r"0 started call #1 as its call 1\.", msg), msg


def _worker_calls(sites, algo="one_shot", timeout_s=20.0, count=300):
    """Rank r queues its calls on its worker at once, in the order sites[r] lists their sites
    (as XLA hands a rank the calls of two independent blocks); each sums rank-and-site values.
    Returns the results and, for each rank and call, the sum that the call's site should give."""
    n = len(sites)
    x = np.array([[np.arange(count) % 5 + 16 * r + site for site in row]
                  for r, row in enumerate(sites)], np.float32)
    out = _native.cpu.worker_allreduce(x, sites, ALGORITHM_CODES[algo], 1 << 16,
                                       timeout_s=timeout_s)
    want = np.array([[sum(x[q][list(sites[q]).index(site)] for q in range(n)) for site in row]
                     for row in sites])
    return out, want


@pytest.mark.parametrize("algo", ["one_shot", "ring"])
@pytest.mark.parametrize("sites", [[[1, 2, 3], [3, 2, 1], [2, 3, 1], [1, 3, 2]],
                                   [[0, 5], [5, 0]]], ids=["four_ranks", "site_0"])
def test_worker_runs_calls_in_rank_0s_order(algo, sites):
    """Ranks handed the same calls in different orders each run them in rank 0's: every call
    sums its own site's values, bit for bit (site 0, no number, too)."""
    for _ in range(3):
        out, want = _worker_calls(sites, algo)
        assert_bitwise(out, want.astype(np.float32))


def test_worker_refuses_twin_calls():
    """Two queued calls of one site (copies of one function's call) cannot be told apart:
    the rank fails, naming the site, rather than risk pairing them crosswise."""
    with pytest.raises(RuntimeError, match=r"had two calls of the program's jax_gin call 1 at "
                                           r"once: copies of one function's call"):
        _worker_calls([[1, 1], [1, 1]])


def test_worker_names_another_modules_call():
    """A site's low 16 bits count its module's calls, its high bits hash the module's name
    (_primitive.site_attrs): a message gives the number, and says where rank 0's call is of
    another module (a function exported apart) than this rank's."""
    with pytest.raises(RuntimeError) as info:
        _worker_calls([[1, 2], [1, (7 << 16) | 2]], timeout_s=2.0)
    assert re.search(r"started call #2 as the program's jax_gin call 2, but rank 0 started "
                     r"call #2 as another module's call 2\.", str(info.value)), str(info.value)


def test_worker_gives_up_on_a_call_that_never_comes():
    """Rank 0 starts a call that rank 1 never makes: after half the timeout, rank 1 runs its
    own, which fails, naming both sites, before rank 0's wait for it times out."""
    with pytest.raises(RuntimeError) as info:
        _worker_calls([[1, 2], [1, 3]], timeout_s=2.0)
    msg = str(info.value)
    # rank 0, which gave up waiting for it, names it too
    assert re.search(r"rank 0 call 1: .*\ndiagnosis: rank 1 failed in call #2 \(psum, "
                     r"one_shot\), not in a wait", msg), msg
    assert re.search(r"rank 1 call 1: .*rank 1 of group 0 \(2 ranks\) started call #2 as the "
                     r"program's jax_gin call 3, but rank 0 started call #2 as its call 2\. .*This "
                     r"rank waited 1 s for rank 0's call, and it did not come", msg), msg
