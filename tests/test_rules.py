"""Transformations: grad (check_vma on and off), vmap, scan, interleaving with lax, jvp."""
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_gin
from conftest import mesh_1d, mesh_2d, ndev, needs_devices, table_group_sizes
from helpers import OPS, assert_bitwise, exact_input, jax_gin_calls, smap


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("algo", ["auto", "ring", "two_shot"])
def test_grad_matches_lax(check_vma, algo):
    mesh = mesh_1d()
    x = exact_input((6,), ndev(), "float32")
    w = exact_input((6,), ndev(), "float32", seed=5)

    def loss(psum_fn, x, w):
        return jnp.sum(psum_fn(x * w, "i") ** 2)

    def f(x, w):
        ours = jax.grad(lambda a, b: loss(lambda v, n: jax_gin.psum(v, n, algorithm=algo), a, b),
                        argnums=(0, 1))(x, w)
        ref = jax.grad(lambda a, b: loss(lax.psum, a, b), argnums=(0, 1))(x, w)
        return ours, ref

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("i"), P("i")),
                              out_specs=((P("i"), P("i")), (P("i"), P("i"))), check_vma=check_vma))
    ours, ref = g(x, w)
    jax.tree.map(assert_bitwise, ours, ref)


@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_of_invariant_input(check_vma):
    # psum of a value that does not vary over the axis (jax inserts a pcast under check_vma).
    mesh = mesh_1d()

    def f(x):
        w = jnp.float32(3.0)
        g1 = jax.grad(lambda w: jnp.sum(jax_gin.psum(x * w, "i")))(w)
        g2 = jax.grad(lambda w: jnp.sum(lax.psum(x * w, "i")))(w)
        return g1[None], g2[None]

    x = exact_input((4,), ndev(), "float32")
    a, b = smap(f, mesh, P("i"), check_vma=check_vma, out_spec=(P("i"), P("i")))(x)
    assert_bitwise(a, b)


@pytest.mark.parametrize("check_vma", [True, False])
def test_jvp_and_linearity(check_vma):
    mesh = mesh_1d()

    def f(x, t):
        y, ty = jax.jvp(lambda v: jax_gin.psum(v, "i"), (x,), (t,))
        y2, ty2 = jax.jvp(lambda v: lax.psum(v, "i"), (x,), (t,))
        return y, ty, y2, ty2

    x = exact_input((5,), ndev(), "float32")
    t = exact_input((5,), ndev(), "float32", seed=9)
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P("i"),
                              check_vma=check_vma))
    y, ty, y2, ty2 = g(x, t)
    assert_bitwise(y, y2)
    assert_bitwise(ty, ty2)


_TYPED_OPS = {
    "psum": lambda L, v: L.psum(v, "i"),
    "pmax": lambda L, v: L.pmax(v, "i"),
    "pmin": lambda L, v: L.pmin(v, "i"),
    "all_gather": lambda L, v: L.all_gather(v, "i", tiled=True),
    "psum_scatter": lambda L, v: L.psum_scatter(v, "i", tiled=True),
}


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op", list(_TYPED_OPS))
def test_result_type_matches_lax(check_vma, op):
    # weak-typed inputs (from Python scalars): the result's weak type, and so
    # the dtype it promotes to beside a bfloat16 or int8 value, are lax's
    mesh = mesh_1d()
    n = ndev()

    def f(x):
        del x
        outs = []
        fin, iin = jnp.broadcast_to(lax.axis_index("i") * 1.0, (n,)), jnp.full((n,), 3)
        assert jax.typeof(fin).weak_type and jax.typeof(iin).weak_type
        for L in (jax_gin, lax):
            fv, iv = _TYPED_OPS[op](L, fin), _TYPED_OPS[op](L, iin)
            outs.append((jax.typeof(fv).weak_type, jax.typeof(iv).weak_type,
                         fv + jnp.ones((), jnp.bfloat16), iv + jnp.int8(1)))
        return outs

    captured = []

    def body(x):
        captured.append(f(x))
        return x

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                          check_vma=check_vma)).lower(jnp.zeros(n * n))
    ours, ref = captured[0]
    assert ours[:2] == ref[:2]
    assert (ours[2].dtype, ours[3].dtype) == (ref[2].dtype, ref[3].dtype)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("api", ["psum", "pmax", "pmin", "psum_overlapping"])
@pytest.mark.parametrize("const", [2.0, 3, np.float32(1.5), np.int8(2), True, 1 + 2j,
                                   np.complex64(3 - 1j), "uint64"])
def test_constant_matches_lax(const, api, check_vma):
    # A constant is the same on every device: the result (lax's value, dtype and weak type,
    # so what it promotes to beside bfloat16 and int8) needs no communication, in any dtype
    # (complex values and uint64, which sums take as other types, too).
    if isinstance(const, str):
        with jax.enable_x64(True):
            return test_constant_matches_lax(np.uint64(2**64 - 3), api, check_vma)
    if np.iscomplexobj(const) and api in ("pmax", "pmin"):
        return  # refused: test_complex.py
    n = ndev()
    ref_op = "psum" if api == "psum_overlapping" else api
    ours_fn = ((lambda c: jax_gin.psum_overlapping(c, "i", lambda: 0)[0])
               if api == "psum_overlapping" else lambda c: getattr(jax_gin, api)(c, "i"))
    f = jax.jit(jax.shard_map(lambda x: ours_fn(const), mesh=mesh_1d(), in_specs=P("i"),
                              out_specs=P(), check_vma=check_vma))
    assert jax_gin_calls(f, jnp.zeros(n)) == 0
    types = []

    def body(x):
        outs = []
        for fn in (ours_fn, lambda c: getattr(lax, ref_op)(c, "i")):
            r = jnp.asarray(fn(const))
            types.append((jax.typeof(r).weak_type, (r + jnp.ones((), jnp.bfloat16)).dtype,
                          (r + jnp.int8(1)).dtype))
            outs.append(r)
        return tuple(outs)

    ours, ref = jax.jit(jax.shard_map(body, mesh=mesh_1d(), in_specs=P("i"),
                                      out_specs=(P(), P()), check_vma=check_vma))(jnp.zeros(n))
    if isinstance(const, bool) and api in ("psum", "psum_overlapping"):
        # lax.psum of a Python True gives 1 (True * True); jax_gin counts it on every device,
        # as lax.psum of a traced bool does: n
        assert (int(ours), ours.dtype) == (n, np.int32)
        return
    assert types[0] == types[1]
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("api", ["psum", "pmax", "psum_scatter", "psum_add_rmsnorm"])
def test_partly_varying_input_is_refused_as_lax_does(api):
    # check_vma=True: a reduction over ('x', 'y') of a value that varies over 'x' only would
    # count 'y's copies; lax refuses it, and so does jax_gin, naming the axes
    mesh = mesh_2d()
    d = 2 * mesh.shape["y"]

    def body(x):
        u = jnp.ones((d,)) * lax.axis_index("x")
        if api == "psum_scatter":
            return jax_gin.psum_scatter(u, ("x", "y"), tiled=True)
        if api == "psum_add_rmsnorm":
            return jax_gin.psum_add_rmsnorm(u, jnp.zeros((d,)), jnp.ones((d,)), ("x", "y"))[1]
        return getattr(jax_gin, api)(u, ("x", "y"))

    with pytest.raises(ValueError, match=r"jax_gin\.%s: with check_vma=True the input must vary "
                       r"over all of the axes \('x', 'y'\) or over none of them.*varies over "
                       r"\['x'\] but not \['y'\]" % api):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())).lower(
            jnp.zeros((mesh.shape["x"],)))


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS + ("auto",))
@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_pmax_pmin_gradient(op, algo):
    # lax.pmax has no derivative rule; jax_gin's matches jnp.max's: the winners share it.
    mesh = mesh_1d()
    n = ndev()
    fn = getattr(jax_gin, op)
    x = jnp.asarray(np.arange(n * 3, dtype=np.float32) % 5)

    def f(x):
        return jax.grad(lambda v: jnp.sum(fn(v, "i", algorithm=algo)))(x)

    got = np.asarray(smap(f, mesh, P("i"))(x)).reshape(n, 3)
    xs = np.asarray(x).reshape(n, 3)
    red = xs.max(0) if op == "pmax" else xs.min(0)
    hits = (xs == red).astype(np.float32)
    np.testing.assert_allclose(got, hits / hits.sum(0), rtol=0, atol=1e-7)


@pytest.mark.parametrize("check_vma", [True, False])
def test_vmap_inside_shard_map(check_vma):
    mesh = mesh_1d()
    x = exact_input((4, 9), ndev(), "float32")

    def f(v):
        return (jax.vmap(lambda r: jax_gin.psum(r, "i"))(v),
                jax.vmap(lambda r: lax.psum(r, "i"))(v))

    a, b = smap(f, mesh, P("i"), check_vma=check_vma, out_spec=(P("i"), P("i")))(x)
    assert_bitwise(a, b)


@pytest.mark.parametrize("dtype", ["float32", "int32", "bool"])
@pytest.mark.parametrize("batch", [4, 1, 0])
@pytest.mark.parametrize("op", list(OPS))
def test_vmap_named_axis(op, batch, dtype):
    # Reducing over the vmapped axis itself (no mesh at all), also of one element or none
    # (max and min of no elements have no identity; lax's result is empty then)
    x = jnp.asarray(np.arange(batch * 3).reshape(batch, 3) % 5).astype(dtype)
    ours = jax.vmap(lambda v: OPS[op][0](v, "b"), axis_name="b")(x)
    ref = jax.vmap(lambda v: OPS[op][1](v, "b"), axis_name="b")(x)
    assert_bitwise(ours, ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_vmap_named_axis_rounds_as_lax(dtype):
    """A sum over the vmapped axis of 16-bit floats whose sums are not exact: the batch is
    reduced in its own dtype, as lax reduces positional axes, so the bits are lax's. Over
    ("i", "b") only device 0 holds nonzeros, so the mesh's sum adds zeros and is exact, and
    what is compared is the batch's reduction."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((64, 37)), dtype)
    ours = jax.vmap(lambda v: jax_gin.psum(v, "b"), axis_name="b")(x)
    ref = jax.vmap(lambda v: lax.psum(v, "b"), axis_name="b")(x)
    assert_bitwise(ours, ref)
    mesh = mesh_1d()
    n = ndev()
    y = jnp.zeros((n * 64, 37), dtype).at[:64].set(x)

    def f(v):
        return (jax.vmap(lambda r: jax_gin.psum(r, ("i", "b"), algorithm="one_shot"),
                         axis_name="b")(v),
                jax.vmap(lambda r: lax.psum(r, ("i", "b")), axis_name="b")(v))

    a, b = smap(f, mesh, P("i"), check_vma=False, out_spec=(P("i"), P("i")))(y)
    assert_bitwise(a, b)


def test_vmap_named_axis_and_mesh_axis():
    mesh = mesh_1d()
    x = exact_input((4, 3), ndev(), "float32")

    def f(v):
        # (lax.psum rejects this mix of a mesh axis and a vmap axis under check_vma, so the
        # reference sums the batch locally, then over the mesh.)
        ours = jax.vmap(lambda r: jax_gin.psum(r, ("i", "b")), axis_name="b")(v)
        ref = jnp.broadcast_to(lax.psum(v.sum(0), "i"), v.shape)
        return ours, ref

    a, b = smap(f, mesh, P("i"), out_spec=(P("i"), P("i")))(x)
    assert_bitwise(a, b)


def test_grad_2d_mesh_two_axes():
    mesh = mesh_2d()
    x = exact_input((mesh.shape["x"] * 2, mesh.shape["y"] * 3), 1, "float32")

    def f(v):
        g1 = jax.grad(lambda u: jnp.sum(jax_gin.psum(u, ("x", "y")) * u))(v)
        g2 = jax.grad(lambda u: jnp.sum(lax.psum(u, ("x", "y")) * u))(v)
        return g1, g2

    a, b = smap(f, mesh, P("x", "y"), out_spec=(P("x", "y"), P("x", "y")))(x)
    assert_bitwise(a, b)


def test_scan_200_steps():
    mesh = mesh_1d()
    n = ndev()

    def f(x):
        def body(c, _):
            ours = jax_gin.psum(c, "i", algorithm="ring")
            ref = lax.psum(c, "i")
            # the next step depends on this one's result, and values stay exact and bounded
            return c + (ours - ref), (ours, ref)
        return lax.scan(body, x, None, length=200)

    x = exact_input((33,), n, "float32")
    c, (ours, ref) = smap(f, mesh, P("i"), out_spec=(P("i"), (P(None, "i"), P(None, "i"))))(x)
    assert_bitwise(ours, ref)  # every step, every rank
    assert_bitwise(c, x)  # so every step's carry was the input


def test_interleaved_with_lax():
    mesh = mesh_1d()

    def f(x):
        a = jax_gin.psum(x, "i", algorithm="one_shot")
        b = lax.psum(a, "i")
        c = jax_gin.pmax(b - x, "i", algorithm="tree")
        d = lax.pmin(c, "i")
        e = jax_gin.psum(d, "i", algorithm="two_shot")
        ref = lax.psum(lax.pmin(lax.pmax(lax.psum(lax.psum(x, "i"), "i") - x, "i"), "i"), "i")
        return e, ref

    x = exact_input((257,), ndev(), "int32")
    a, b = smap(f, mesh, P("i"), out_spec=(P("i"), P("i")))(x)
    assert_bitwise(a, b)


def test_communicator_reused_across_calls_and_compilations():
    mesh = mesh_1d()
    x = exact_input((8,), ndev(), "float32")
    smap(lambda v: jax_gin.psum(v, "i", algorithm="ring"), mesh, P("i"))(x)
    before = jax_gin.runtime.num_communicators()
    for k in range(3):  # new shapes: new compilations, same communicator
        y = exact_input((8 + k,), ndev(), "float32")
        smap(lambda v: jax_gin.psum(v, "i", algorithm="ring") * 2, mesh, P("i"))(y)
    assert jax_gin.runtime.num_communicators() == before


def test_explain():
    # the model-based rule: a device kind that has no tuning table (on this machine's platform
    # the default is its own device kind, whose table, if shipped, decides)
    kw = dict(nranks=8, platform="cpu", device_kind="a device with no table")
    s = jax_gin.explain(jax.ShapeDtypeStruct((1024,), jnp.float32), **kw)
    assert s.startswith("one_shot")
    s = jax_gin.explain(jax.ShapeDtypeStruct((1 << 22,), jnp.float32), **kw)
    assert s.startswith("two_shot")


@pytest.mark.parametrize("collective", ["psum", "pmax", "psum_scatter", "all_gather"])
def test_explain_counts_the_calls_the_collective_makes(collective):
    """explain says as many calls, of the bytes of the leaves that communicate, as the
    collective lowers to: the all-reduces take a Python scalar, and inside shard_map a NumPy
    array, as a constant, which they reduce without a call (lax's way); psum_scatter and
    all_gather move them. Outside shard_map an array stands for one device's input."""
    needs_devices(2)
    n = ndev()
    mesh = mesh_1d()
    fn = getattr(jax_gin, collective)
    kw = {"tiled": True} if collective in ("psum_scatter", "all_gather") else {}
    scatter_gather = collective in ("psum_scatter", "all_gather")
    for const in ((2.0,) if not scatter_gather else ()) + (np.arange(n * 2, dtype=np.float32),):
        said = []

        def body(v, const=const):
            said.append(jax_gin.explain([const, v], "i", collective=collective))
            return fn([const, v], "i", **kw)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P(),
                                  check_vma=False))
        calls = jax_gin_calls(f, jnp.zeros(n * 64, jnp.float32))
        lines = said[0].splitlines()
        assert calls == 1 and len(said[0].splitlines()) == 1, (const, said)
        # the all-reduces: v alone (64 float32); psum_scatter and all_gather: both leaves
        # in one call, as nccl-tests' size (psum_scatter's input, all_gather's output)
        # (N blocks of each leaf, each padded to 16 bytes)
        pad = lambda b: -(-b // 16) * 16
        block = {"psum_scatter": lambda k: pad(k // n * 4), "all_gather": lambda k: pad(k * 4)}
        nbytes = 64 * 4 if not scatter_gather else n * sum(
            block[collective](k) for k in (64, const.size))
        assert f"{nbytes} bytes per device" in said[0], said
    assert jax_gin.explain(3.0, nranks=8, platform="cpu").startswith(
        "no call: every leaf is a constant, which psum reduces without communication")
    assert jax_gin.explain(np.ones(3, np.float32), nranks=8, platform="cpu").endswith(
        "12 bytes per device)")


def test_auto_uses_the_tuning_table(tmp_path, monkeypatch):
    import json
    from jax_gin import _select, tune

    table = {"device_kind": "Fake GPU", "nranks": 8, "measured": "2026-11-30", "entries": [
        {"max_bytes": 1024, "algorithm": "tree"}, {"max_bytes": 1 << 20, "algorithm": "ring"}]}
    (tmp_path / tune.table_name("Fake GPU", 8)).write_text(json.dumps(table))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    _select.load_table.cache_clear()
    try:
        assert _select.choose("cuda", 512, 8, "Fake GPU")[0] == "tree"
        assert _select.choose("cuda", 4096, 8, "Fake GPU")[0] == "ring"
        assert _select.choose("cuda", 1 << 30, 8, "Fake GPU")[0] == "ring"  # past the table: last entry
        assert _select.choose("cuda", 512, 4, "Fake GPU")[0] == "one_shot"  # no table: model rule
        s = jax_gin.explain(jax.ShapeDtypeStruct((100,), jnp.float32), nranks=8, platform="cuda",
                            device_kind="Fake GPU")
        assert s.startswith("tree") and "tuning table" in s
    finally:
        _select.load_table.cache_clear()


def test_shipped_h200_table():
    from jax_gin import _select
    t = _select.load_table("NVIDIA H200", 2)
    assert t is not None and t["nranks"] == 2
    # the table's sweep (2 x H200): jax_gin was faster than lax at every size, one_shot up
    # to 4 MiB, ring or two_shot above
    for size in (4096, 256 << 10, 1 << 20, 4 << 20):
        assert _select.choose("cuda", size, 2, "NVIDIA H200")[0] == "one_shot"
    for size in (16 << 20, 64 << 20, 256 << 20, 1 << 30):
        assert _select.choose("cuda", size, 2, "NVIDIA H200")[0] in ("ring", "two_shot")


def test_shipped_cpu_table():
    """docs/api.md: on 8 CPU devices (jax_gin/tuning/cpu_n8.json) `auto` runs a kernel up to 32 KiB
    per device and hands every larger size to XLA's all-reduce: the program has no jax_gin
    call there, and gives lax's bits."""
    from jax_gin import _select
    assert _select.choose("cpu", 32 << 10, 8, "cpu")[0] in jax_gin.ALGORITHMS
    for size in ((32 << 10) + 1, 64 << 10, 64 << 20, 1 << 30):
        assert _select.choose("cpu", size, 8, "cpu")[0] == "xla"
    if jax.default_backend() != "cpu":
        pytest.skip("runs the table on 8 CPU devices")
    needs_devices(8)
    mesh = Mesh(np.array(jax.devices()[:8]), ("i",))
    for per_device, calls in ((8 << 10, 1), ((8 << 10) + 1, 0)):  # float32: 32 KiB, and 4 B more
        x = exact_input((per_device,), 8, "float32")
        f = smap(lambda v: (jax_gin.psum(v, "i"), lax.psum(v, "i")), mesh, P("i"))
        assert jax_gin_calls(f, x) == calls
        assert_bitwise(*f(x))


def test_tune_builds_a_table_from_benchmark_json(tmp_path):
    needs_devices(2)  # the benchmark runs on 2 or more devices
    import json
    from jax_gin import bench, tune

    path = tmp_path / "b.json"
    assert bench.main(["-b", "1K", "-e", "4K", "-n", "2", "-w", "1", "-k", "3", "-a",
                       ",".join(jax_gin.ALGORITHMS), "--json", str(path), "--quiet"]) == 0
    out = tmp_path / "t.json"
    assert tune.main(["--from-json", str(path), "--out", str(out)]) == 0
    t = json.loads(out.read_text())
    assert t["nranks"] == ndev() and t["entries"]
    assert all(e["algorithm"] in jax_gin.ALGORITHMS for e in t["entries"])


def test_tune_names_no_temporary_file(tmp_path, capsys):
    # the benchmark's JSON that tune measures into is deleted when tune ends: not announced
    needs_devices(2)
    import json
    from jax_gin import tune

    out = tmp_path / "t.json"
    assert tune.main(["-b", "4K", "-e", "4K", "-n", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "# wrote" not in captured.err + captured.out
    assert f"jax_gin.tune: wrote {out}\n" in captured.out
    table = json.loads(out.read_text())
    assert table["entries"]
    # written again, it says what it replaced
    assert tune.main(["-b", "4K", "-e", "4K", "-n", "1", "--out", str(out)]) == 0
    assert (f"jax_gin.tune: wrote {out}, replacing the table there (measured "
            f"{table['measured'][:10]}, up to 4096 B)") in capsys.readouterr().out


def test_table_reason_names_the_sizes_measured():
    """explain's reason gives the entry's measured sizes, and says when a size lies outside."""
    from jax_gin import _select

    table = {"device_kind": "cpu", "nranks": 8, "measured": "2026-11-30T00:00",
             "entries": [{"max_bytes": 16384, "algorithm": "one_shot", "at_bytes": 4096},
                         {"max_bytes": 1 << 20, "algorithm": "xla", "at_bytes": 65536}]}
    xla = "XLA's own"
    assert _select._from_table(table, 8192, xla) == (
        "one_shot", "fastest measured at 4096 - 16384 B in the tuning table for cpu x 8 (2026-11-30)")
    assert "at its smallest size, 4096 B (1024 B is below every size measured)" in \
        _select._from_table(table, 1024, xla)[1]
    algo, why = _select._from_table(table, 32768, xla)  # between entries: the later one
    assert algo == "xla" and why.startswith("XLA's own was faster than every jax_gin algorithm "
                                            "at 65536 - 1048576 B")
    assert "at its largest size, 1048576 B (4194304 B is above every size measured)" in \
        _select._from_table(table, 4 << 20, xla)[1]


def test_tune_writes_into_the_tuning_dir(tmp_path, monkeypatch):
    """Without --out, a table goes where `auto` looks first: JAX_GIN_TUNING_DIR where set."""
    import json
    from jax_gin import tune

    rows = [{"size": 4096, "dtype": "float32", "op": "sum", "algorithm": a, "time_us": t}
            for a, t in (("one_shot", 3.0), ("ring", 5.0))]
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"meta": {"device_kind": "Kind X", "nranks": 4}, "results": rows}))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path / "tables"))
    assert tune.main(["--from-json", str(path)]) == 0
    t = json.loads((tmp_path / "tables" / "kind_x_n4.json").read_text())
    assert [e["algorithm"] for e in t["entries"]] == ["one_shot"]


def test_tune_refuses_to_write_into_an_installed_copy(tmp_path, monkeypatch, capsys):
    """Without --out or JAX_GIN_TUNING_DIR, a table would go into jax_gin/tuning/: outside a
    source tree (an installed copy) tune refuses, since the file would outlive `pip uninstall`
    (leaving a namespace package behind) and steer `auto` after upgrades."""
    from jax_gin import tune

    assert tune.in_source_tree(tune.TABLE_DIR) == os.path.isfile(
        os.path.join(os.path.dirname(os.path.dirname(jax_gin.__file__)), "pyproject.toml"))
    installed = tmp_path / "site-packages" / "jax_gin" / "tuning"  # no pyproject.toml above
    source = tmp_path / "src" / "jax_gin" / "tuning"
    (tmp_path / "src" / "pyproject.toml").parent.mkdir()
    (tmp_path / "src" / "pyproject.toml").write_text("")
    assert not tune.in_source_tree(str(installed)) and tune.in_source_tree(str(source))
    monkeypatch.setattr(tune, "TABLE_DIR", str(installed))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", None)
    with pytest.raises(SystemExit):
        tune.main(["-b", "4K", "-e", "4K", "-n", "1"])
    out, err = capsys.readouterr()
    assert f"{installed} is in an installed jax_gin, not a source tree" in err, err
    assert "set JAX_GIN_TUNING_DIR" in err
    assert out == "" and not installed.exists()  # refused before it measured or wrote


def test_tune_refuses_bad_input(tmp_path, capsys, monkeypatch):
    from jax_gin import tune

    # where the table would go: a directory of the test's (an installed copy refuses its own)
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path / "tables"))

    for argv, message in ((["-b", "64K", "-e", "4K"], "-e/--maxbytes is smaller"),
                          (["-n", "0"], "-n/--iters must be at least 1"),
                          (["-b", "4Q"], "bad size")):
        with pytest.raises(SystemExit):
            tune.main(argv)
        err = capsys.readouterr().err
        assert "python -m jax_gin.tune: error" in err and message in err, err
    path = tmp_path / "w.json"
    path.write_text('{"meta": {}, "workload": "dp-train"}')  # a --workload file
    with pytest.raises(SystemExit, match="not the JSON of an op sweep"):
        tune.main(["--from-json", str(path)])
    bad = tmp_path / "log.txt"
    bad.write_text("not json\n")
    with pytest.raises(SystemExit, match=r"log\.txt is not JSON \(Expecting value"):
        tune.main(["--from-json", str(bad)])
    with pytest.raises(SystemExit, match=r"cannot read .*missing\.json: No such file"):
        tune.main(["--from-json", str(tmp_path / "missing.json")])


def test_tune_from_json_refuses_files_of_no_or_unlike_machines(tmp_path, capsys, monkeypatch):
    """A table is of one device kind and group size: --from-json refuses files that name none
    (which would make a table no machine reads) or unlike ones (whose medians would mix
    machines), and the measurement's own options; and a tuning dir that is a file."""
    import json
    from jax_gin import tune

    rows = [{"size": 4096, "dtype": "float32", "op": "sum", "algorithm": "ring", "time_us": 3.0}]
    def sweep(name, meta):
        path = tmp_path / name
        path.write_text(json.dumps({"results": rows, **({"meta": meta} if meta else {})}))
        return str(path)
    a = sweep("a.json", {"device_kind": "Kind X", "ndevices": 2})
    b = sweep("b.json", {"device_kind": "Kind X", "ndevices": 8})
    c = sweep("c.json", {"device_kind": "Kind Y", "ndevices": 2})
    none = sweep("none.json", None)
    out = str(tmp_path / "t.json")
    with pytest.raises(SystemExit, match=f"{b} was measured on Kind X x 8, but {a} on Kind X x 2; "
                                         "a table is of one device kind and group size"):
        tune.main(["--from-json", a, b, "--out", out])
    with pytest.raises(SystemExit, match=f"{c} was measured on Kind Y x 2, but {a} on Kind X x 2"):
        tune.main(["--from-json", a, c, "--out", out])
    with pytest.raises(SystemExit, match=f"{none} names no device kind and group size"):
        tune.main(["--from-json", none, "--out", out])
    assert tune.main(["--from-json", a, a, "--out", out]) == 0  # two runs of one machine
    assert json.loads(open(out).read())["nranks"] == 2
    for extra in (["-b", "1K"], ["-n", "3", "-e", "1M"]):
        with pytest.raises(SystemExit):
            tune.main(["--from-json", a, "--out", out] + extra)
        assert "cannot be given with it" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(afile))
    with pytest.raises(SystemExit):
        tune.main(["--from-json", a])
    assert f"cannot write a table into {afile}: it is no directory" in capsys.readouterr().err


@pytest.mark.parametrize("algo", jax_gin.ALGORITHMS)
def test_many_independent_calls_are_ordered(algo):
    # XLA's CPU runtime runs independent ops concurrently (more than 8 ops, buffers over 512
    # bytes); jax_gin chains its calls so that every rank runs them in the same order. Twelve
    # calls of about 4 KiB: one per leaf (bucket_bytes=1), with an explicit algorithm, so that
    # each runs jax_gin's kernel whatever `auto` would choose.
    mesh = mesh_1d()
    grads = {f"w{k}": exact_input((1024 + k,), ndev(), "float32", seed=k) for k in range(12)}
    f = smap(lambda g: (jax_gin.psum(g, "i", algorithm=algo, bucket_bytes=1), lax.psum(g, "i")),
             mesh, P("i"), out_spec=(P("i"), P("i")))
    assert jax_gin_calls(f, grads) == len(grads)
    for _ in range(5):
        got, want = f(grads)
        jax.tree.map(assert_bitwise, got, want)


# ---------------------------------------------------------------------------------------
# auto's fallback to XLA's own all-reduce ("xla" in a tuning table)


# (the cpu_table_with_xla fixture is in conftest.py)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_auto_xla_fallback_parity(cpu_table_with_xla, check_vma, dtype):
    mesh = mesh_1d()
    small = exact_input((7,), ndev(), dtype)            # 28 B or less: one_shot
    big = exact_input((4099,), ndev(), dtype, seed=3)    # > 1 KiB: XLA's all-reduce
    for op, ref in ((jax_gin.psum, lax.psum), (jax_gin.pmax, lax.pmax), (jax_gin.pmin, lax.pmin)):
        f = smap(lambda v: op(v, "i"), mesh, P("i"), check_vma=check_vma)
        g = smap(lambda v: ref(v, "i"), mesh, P("i"), check_vma=check_vma)
        for x in (small, big):
            assert_bitwise(f(x), g(x))
    hlo = smap(lambda v: jax_gin.psum(v, "i"), mesh, P("i"), check_vma=check_vma).lower(big).as_text()
    assert "stablehlo.all_reduce" in hlo and "custom_call" not in hlo
    hlo_small = smap(lambda v: jax_gin.psum(v, "i"), mesh, P("i"), check_vma=check_vma).lower(small).as_text()
    assert "custom_call" in hlo_small and "stablehlo.all_reduce" not in hlo_small
    s = jax_gin.explain(big, nranks=ndev(), platform="cpu", device_kind=cpu_table_with_xla)
    assert s.startswith("xla:") and "lax.psum" in s


def test_auto_xla_fallback_grad_2d_tuple_axes(cpu_table_with_xla):
    mesh = mesh_2d()
    x = exact_input((4099,), ndev(), "float32", seed=1)
    spec = P(("x", "y"))

    def loss(psum):
        def f(v):
            return jnp.sum(psum(v * v, ("y", "x")) * 0.5)
        return lambda v: jax.grad(f)(v)

    got = smap(loss(jax_gin.psum), mesh, spec)(x)
    want = smap(loss(lax.psum), mesh, spec)(x)
    assert_bitwise(got, want)


def test_tune_sends_sizes_where_lax_wins_to_xla():
    from jax_gin import tune
    meta = {"device_kind": "Fake GPU", "nranks": 2}
    rows = []
    for size, t in ((4096, {"one_shot": 8, "lax": 16}), (1 << 20, {"one_shot": 22, "lax": 20}),
                    (1 << 22, {"one_shot": 32, "lax": 31.5})):  # 31.5 vs 32: within the margin
        for algo, us in t.items():
            for run in range(3):
                rows.append({"dtype": "float32", "op": "sum", "algorithm": algo, "size": size,
                             "time_us": us + (run - 1) * 0.1})
    t = tune.build_table(rows, meta)
    assert [(e["max_bytes"], e["algorithm"]) for e in t["entries"]] == [
        (4096, "one_shot"), (1 << 20, "xla"), (1 << 22, "one_shot")]


# ---------------------------------------------------------------------------------------
# psum_scatter and all_gather: explain, tuning tables, and their "xla" entries


def test_explain_collectives():
    S = jax.ShapeDtypeStruct
    n = max(ndev(), 2)  # a group of one rank is XLA's (test_group_of_one.py)
    # the size auto decides on: the larger side per device, N blocks padded to 16 bytes
    s = jax_gin.explain(S((n * 1024,), jnp.float32), nranks=n, platform="cpu",
                        collective="psum_scatter")
    assert s.startswith("one_shot:") and f"psum_scatter of {n * 4096} bytes per device" in s
    s = jax_gin.explain(S((1001,), jnp.float32), nranks=n, platform="cpu", collective="all_gather")
    assert f"all_gather of {n * 1004 * 4} bytes per device on the larger side" in s
    s = jax_gin.explain(S((3, 4), jnp.complex64), nranks=n, platform="cpu", collective="all_gather")
    assert f"all_gather of {n * 24 * 4} bytes" in s  # (real, imaginary) float32 pairs
    s = jax_gin.explain(S((5,), jnp.bool_), nranks=n, platform="cpu", collective="all_gather")
    assert f"all_gather of {n * 8 * 4} bytes" in s  # bool moves as int32
    # the model: one step within a node; ring for large groups and large messages
    assert jax_gin.explain(S((1 << 20,), jnp.float32), nranks=32, platform="cuda",
                           collective="all_gather").startswith("ring:")
    assert jax_gin.explain(S((1 << 20,), jnp.float32), nranks=8, platform="cuda",
                           collective="psum_scatter").startswith("one_shot:")
    # psum (the default), pmax and pmin choose alike
    x = S((1 << 22,), jnp.float32)
    assert jax_gin.explain(x, nranks=8, platform="cpu", collective="pmax") == \
        jax_gin.explain(x, nranks=8, platform="cpu")
    # inside shard_map, with the axis name
    mesh = mesh_1d()
    seen = []

    def body(v):
        seen.append(jax_gin.explain(v, "i", platform="cpu", collective="all_gather"))
        return v

    smap(body, mesh, P("i"))(jnp.zeros((ndev() * 8,), jnp.float32))
    ranks = f"{ndev()} rank{'s' if ndev() > 1 else ''}"
    assert f"{ranks}, all_gather of {ndev() * 32} bytes" in seen[0], seen[0]


def test_explain_takes_the_dtypes_and_pytrees_the_collective_takes():
    S = jax.ShapeDtypeStruct
    kw = dict(nranks=8, platform="cuda", device_kind="none")  # the model, not a table
    # bool is summed as int32; float64 is float32 without x64; a Python scalar is a constant
    # (no call); complex as its (real, imaginary) parts
    assert "4096 bytes per device" in jax_gin.explain(S((1024,), jnp.bool_), **kw)
    if not jax.config.jax_enable_x64:
        assert "4096 bytes per device" in jax_gin.explain(np.ones(1024), **kw)
    assert jax_gin.explain(2.0, **kw).startswith("no call: every leaf is a constant")
    assert "8 bytes per device" in jax_gin.explain(S((1,), jnp.complex64), **kw)
    # a pytree: a call per dtype and bucket, as psum makes them, the line of each
    tree = {"a": S((1000,), jnp.float32), "b": S((3,), jnp.bfloat16), "c": S((70000,), jnp.float32)}
    s = jax_gin.explain(tree, bucket_bytes=1 << 18, **kw)
    lines = s.splitlines()
    assert lines[0] == "3 calls (a call per dtype and bucket of at most 262144 bytes):"
    assert lines[1].startswith("call 1, float32, leaves 0: ") and "4000 bytes" in lines[1]
    assert lines[2].startswith("call 2, float32, leaves 2: ") and "280000 bytes" in lines[2]
    assert lines[3].startswith("call 3, bfloat16, leaves 1: ") and "6 bytes" in lines[3]
    s = jax_gin.explain(tree, **kw)  # one bucket of float32 (64 MiB), one of bfloat16
    assert s.splitlines()[1].startswith("call 1, float32, leaves 0, 2: ")
    assert "284000 bytes" in s
    # a pytree of one leaf is the leaf's answer
    assert jax_gin.explain([S((1000,), jnp.float32)], **kw) == \
        jax_gin.explain(S((1000,), jnp.float32), **kw)
    # all_gather: leaves of one dtype laid side by side, each block padded to 16 bytes
    s = jax_gin.explain((S((5,), jnp.float32), S((3,), jnp.float32)), collective="all_gather", **kw)
    assert f"all_gather of {8 * (8 + 4) * 4} bytes per device" in s


def test_tune_table_names():
    from jax_gin import tune
    assert tune.table_name("NVIDIA H200", 2) == "nvidia_h200_n2.json"  # tables already shipped
    assert tune.table_name("NVIDIA H200", 2, "all_reduce") == "nvidia_h200_n2.json"
    assert tune.table_name("cpu", 8, "psum_scatter") == "cpu_n8_psum_scatter.json"
    assert tune.table_name("cpu", 8, "all_gather") == "cpu_n8_all_gather.json"
    assert tune.COLLECTIVES == ("all_reduce", "psum_scatter", "all_gather")


def test_tune_builds_collective_tables():
    from jax_gin import tune
    meta = {"device_kind": "Fake GPU", "nranks": 8}
    rows = [  # an old all-reduce record (no collective) and one of psum_scatter's own
        {"dtype": "float32", "op": "sum", "algorithm": "tree", "size": 4096, "time_us": 1.0},
        {"collective": "all_gather", "dtype": "float32", "op": "none", "algorithm": "one_shot",
         "size": 4096, "time_us": 1.0}]
    for size, t in ((4096, {"one_shot": 8, "ring": 9, "lax": 16}),
                    (1 << 20, {"one_shot": 30, "ring": 22, "lax": 25}),
                    (1 << 22, {"one_shot": 40, "ring": 45, "lax": 30})):
        for algo, us in t.items():
            rows.append({"collective": "psum_scatter", "dtype": "float32", "op": "sum",
                         "algorithm": algo, "size": size, "time_us": us})
    t = tune.build_table(rows, meta, collective="psum_scatter")
    assert t["collective"] == "psum_scatter" and t["op"] == "sum"
    assert [(e["max_bytes"], e["algorithm"]) for e in t["entries"]] == [
        (4096, "one_shot"), (1 << 20, "ring"), (1 << 22, "xla")]
    g = tune.build_table(rows, meta, collective="all_gather")
    assert g["op"] == "none" and [e["algorithm"] for e in g["entries"]] == ["one_shot"]
    a = tune.build_table(rows, meta)  # the all-reduce's: only the record without a collective
    assert a["collective"] == "all_reduce" and [e["algorithm"] for e in a["entries"]] == ["tree"]


def test_tune_from_collective_benchmark_json(tmp_path):
    needs_devices(2)  # the benchmark runs on 2 or more devices
    import json
    from jax_gin import _select, bench, tune

    path = tmp_path / "b.json"
    assert bench.main(["-b", "1K", "-e", "4K", "-n", "2", "-w", "1", "-k", "3", "-c", "all",
                       "-a", "all", "--json", str(path), "--quiet"]) == 0
    rows = json.loads(path.read_text())["results"]
    for collective in tune.COLLECTIVES:
        out = tmp_path / tune.table_name("x", ndev(), collective)
        assert tune.main(["--from-json", str(path), "-c", collective, "--out", str(out)]) == 0
        t = json.loads(out.read_text())
        assert t["collective"] == collective and t["nranks"] == ndev()
        # the sizes measured: 1 and 4 KiB, rounded down to N whole blocks for psum_scatter
        # and all_gather (1020 and 4092 bytes of float32 over 3 devices)
        sizes = {r["size"] for r in rows if r["collective"] == collective}
        assert len(sizes) == 2 and max(sizes) <= 4096 and min(sizes) > 1024 - 4 * ndev()
        assert {e["max_bytes"] for e in t["entries"]} <= sizes and t["entries"]
        allowed = jax_gin.ALGORITHMS if collective == "all_reduce" else _select.COLLECTIVE_ALGORITHMS
        assert all(e["algorithm"] in allowed + ("xla",) for e in t["entries"])
        # (a row whose T_K - T_1 came out <= 0 on a busy machine is left out)
        assert set(t["entries"][0]["time_us"]) <= set(allowed) | {"xla"}


@pytest.fixture
def cpu_collective_tables(tmp_path, monkeypatch):
    """psum_scatter and all_gather tables for this CPU mesh: ring up to 1 KiB (the larger
    side), XLA's own collective above; an all-reduce table sends everything to one_shot."""
    needs_devices(2)  # a table decides only for groups of 2 or more
    import json
    from jax_gin import _select, tune

    kind = jax.devices()[0].device_kind
    for n in table_group_sizes():
        for collective in ("psum_scatter", "all_gather"):
            table = {"collective": collective, "device_kind": kind, "nranks": n,
                     "measured": "2026-12-01", "entries": [
                         {"max_bytes": 1024, "algorithm": "ring"},
                         {"max_bytes": 1 << 40, "algorithm": "xla"}]}
            (tmp_path / tune.table_name(kind, n, collective)).write_text(json.dumps(table))
        table = {"device_kind": kind, "nranks": n, "entries": [
            {"max_bytes": 1 << 40, "algorithm": "one_shot"}]}
        (tmp_path / tune.table_name(kind, n)).write_text(json.dumps(table))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    _select.load_table.cache_clear()
    yield kind
    _select.load_table.cache_clear()


def test_collective_table_is_consulted(cpu_collective_tables):
    from jax_gin import _select
    kind, n = cpu_collective_tables, ndev()
    for api in ("psum_scatter", "all_gather"):
        assert _select.choose_collective("cpu", 1024, n, kind, api=api)[0] == "ring"
        algo, why = _select.choose_collective("cpu", 4096, n, kind, api=api)
        assert algo == _select.XLA_FALLBACK and f"lax.{api}" in why and "tuning table" in why
        # no table for this group size, or no device kind: the model
        absent = next(k for k in range(3, 16) if k not in table_group_sizes())
        assert _select.choose_collective("cpu", 1024, absent, kind, api=api)[0] == "one_shot"
        assert _select.choose_collective("cpu", 4096, n, api=api)[0] == "one_shot"
    assert _select.choose("cpu", 1 << 30, n, kind)[0] == "one_shot"  # the all-reduce's own table
    s = jax_gin.explain(jax.ShapeDtypeStruct((n * 1024,), jnp.float32), nranks=n, platform="cpu",
                        device_kind=kind, collective="psum_scatter")
    assert s.startswith("xla:") and "XLA's own psum_scatter (what lax.psum_scatter runs)" in s


_FAKE_TABLE = {"device_kind": "Fake GPU", "nranks": 8, "measured": "2026-12-05",
               "entries": [{"max_bytes": 1024, "algorithm": "tree"},
                           {"max_bytes": 1 << 40, "algorithm": "ring"}]}


def _broken(**changes):
    import copy
    t = copy.deepcopy(_FAKE_TABLE)
    for k, v in changes.items():
        if v is None:
            del t[k]
        else:
            t[k] = v
    return t


@pytest.mark.parametrize("text,problem", [
    ("{", "is not JSON"),
    ("[]", "holds a JSON list"),
    (_broken(device_kind=None), "has device_kind None, but is read for device_kind 'Fake GPU'"),
    (_broken(device_kind="NVIDIA H200"), "has device_kind 'NVIDIA H200'"),
    (_broken(nranks=2), "has nranks 2, but is read for nranks 8"),
    (_broken(collective="psum_scatter"), "has collective 'psum_scatter'"),
    (_broken(entries=[]), "has no entries"),
    (_broken(entries={"max_bytes": 1}), "has no entries"),
    (_broken(entries=[{"max_bytes": 1024}]), "has entry 0's algorithm None"),
    (_broken(entries=[{"max_bytes": 1024, "algorithm": "Ring"}]), "has entry 0's algorithm 'Ring'"),
    (_broken(entries=[{"max_bytes": 1024, "algorithm": "auto"}]), "has entry 0's algorithm 'auto'"),
    (_broken(entries=[{"algorithm": "ring"}]), "has entry 0's max_bytes None"),
    (_broken(entries=[{"max_bytes": "1K", "algorithm": "ring"}]), "has entry 0's max_bytes '1K'"),
    (_broken(entries=[{"max_bytes": 1 << 30, "algorithm": "tree"},
                      {"max_bytes": 1024, "algorithm": "ring"}]), "has entry 1's max_bytes 1024"),
    (_broken(entries=[{"max_bytes": 1024, "at_bytes": 4096, "algorithm": "ring"}]),
     "has entry 0's at_bytes 4096"),
    (_broken(entries=["ring"]), "has entry 0 'ring', not an object"),
])
def test_invalid_tuning_table_is_refused_naming_the_file(tmp_path, monkeypatch, text, problem):
    """A table auto would read that is no valid table for its device kind and group size:
    explain and a psum's lowering both raise a ValueError that names the file and the problem
    (not a KeyError or TypeError from inside, and not the shipped table instead)."""
    import json
    from jax_gin import _select, tune

    path = tmp_path / tune.table_name("Fake GPU", 8)
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    with pytest.raises(ValueError) as e:
        jax_gin.explain(jax.ShapeDtypeStruct((100,), jnp.float32), nranks=8, platform="cuda",
                        device_kind="Fake GPU")
    assert f"the tuning table {path} {problem}" in str(e.value), str(e.value)
    assert "correct or remove it" in str(e.value)


def test_invalid_tuning_table_fails_the_lowering(tmp_path, monkeypatch):
    """On CPU devices: auto's lowering raises the table's error; a named algorithm, which
    reads no table, runs."""
    from jax_gin import tune

    needs_devices(2)
    n = ndev()
    path = tmp_path / tune.table_name(jax.devices()[0].device_kind, n)
    path.write_text('{"entries": []}')
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    mesh = mesh_1d()
    x = exact_input((8,), n, jnp.float32)
    f = lambda algo: jax.jit(jax.shard_map(lambda v: jax_gin.psum(v, "i", algorithm=algo),
                                           mesh=mesh, in_specs=P("i"), out_specs=P()))
    with pytest.raises(ValueError, match=f"the tuning table {path} has device_kind None"):
        f("auto")(x)
    assert_bitwise(f("one_shot")(x), jax.jit(jax.shard_map(
        lambda v: lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()))(x))


def test_rewritten_tuning_table_is_read_again(tmp_path, monkeypatch):
    """A table rewritten in place (as python -m jax_gin.tune does) decides the next choice:
    the cache is keyed by the file's version."""
    import json, os
    from jax_gin import _select, tune

    path = tmp_path / tune.table_name("Fake GPU", 8)
    path.write_text(json.dumps(_FAKE_TABLE))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    assert _select.choose("cuda", 512, 8, "Fake GPU")[0] == "tree"
    path.write_text(json.dumps(_broken(entries=[{"max_bytes": 1 << 40, "algorithm": "two_shot"}])))
    os.utime(path, ns=(1, 1))  # a new version even where the clock's grain would hide it
    assert _select.choose("cuda", 512, 8, "Fake GPU")[0] == "two_shot"


def test_collective_table_with_a_wrong_algorithm_is_refused(tmp_path, monkeypatch):
    import json
    from jax_gin import _select, tune

    table = {"device_kind": "Fake GPU", "nranks": 8, "entries": [
        {"max_bytes": 1 << 40, "algorithm": "two_shot"}]}  # an all-reduce algorithm
    (tmp_path / tune.table_name("Fake GPU", 8, "all_gather")).write_text(json.dumps(table))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    with pytest.raises(ValueError, match="entry 0's algorithm 'two_shot'; expected one of "
                                         "'one_shot', 'ring', 'xla'"):
        _select.choose_collective("cuda", 4096, 8, "Fake GPU", api="all_gather")


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_collective_xla_fallback_lowers_to_xla(cpu_collective_tables, check_vma, dtype):
    """Where the table says "xla", auto lowers psum_scatter / all_gather to XLA's own
    reduce-scatter / all-gather (no jax_gin custom call) and keeps lax's bits; below it,
    jax_gin's ring runs."""
    mesh, n = mesh_1d(), ndev()
    cases = (  # (api, per-device elements: over 1 KiB on the larger side, then under)
        ("psum_scatter", 512 * n, 4 * n, "reduce_scatter", "reduce-scatter("),
        ("all_gather", 512, 4, "all_gather", "all-gather("))
    for api, big, small, stablehlo, hlo_op in cases:
        ours = smap(lambda v: getattr(jax_gin, api)(v, "i", tiled=True), mesh, P("i"),
                    check_vma=check_vma)
        ref = smap(lambda v: getattr(lax, api)(v, "i", tiled=True), mesh, P("i"),
                   check_vma=check_vma)
        for per in (big, small):
            x = exact_input((per,), n, dtype, seed=per)
            assert_bitwise(ours(x), ref(x))
        xb, xs = exact_input((big,), n, dtype), exact_input((small,), n, dtype)
        text = ours.lower(xb).as_text()
        assert f"stablehlo.{stablehlo}" in text and "custom_call" not in text, text
        compiled = ours.lower(xb).compile().as_text()
        assert hlo_op in compiled and "custom-call(" not in compiled
        text = ours.lower(xs).as_text()
        assert "custom_call" in text and f"stablehlo.{stablehlo}" not in text
        assert "[ring " in ours.lower(xs).compile().as_text()


def test_collective_xla_fallback_grad(cpu_collective_tables):
    """The transposes (all_gather of psum_scatter's cotangent and the other way round) ask
    the table too: XLA's collectives all the way, lax's gradients."""
    mesh, n = mesh_1d(), ndev()
    x = exact_input((512 * n,), n, "float32", seed=2)  # over 1 KiB on the larger side

    def loss(rs, ag):
        return lambda v: jax.grad(lambda a: jnp.sum(ag(rs(a * a, "i", tiled=True), "i",
                                                       tiled=True) * 0.5))(v)

    ours = smap(loss(jax_gin.psum_scatter, jax_gin.all_gather), mesh, P("i"))
    assert_bitwise(ours(x), smap(loss(lax.psum_scatter, lax.all_gather), mesh, P("i"))(x))
    assert "custom_call" not in ours.lower(x).as_text()


def test_public_algorithms_and_dtypes():
    """docs/api.md's list: ALGORITHMS and SUPPORTED_DTYPES, which the native library lists
    (and the tests parametrize over, so a name lost there would shrink them unseen)."""
    assert jax_gin.ALGORITHMS == ("ring", "tree", "one_shot", "two_shot")
    assert jax_gin.SUPPORTED_DTYPES == (
        "float32", "float64", "bfloat16", "float16", "int32", "int64", "uint32")


def test_profiler_names():
    """The custom calls carry readable names (op, algorithm, bytes, dtype) in the compiled HLO:
    its instruction names and op_name metadata, which jax.profiler timelines show."""
    # With one device, shard_map lowers its body inline and the calls keep only JAX's own
    # location names (jax 0.11.2).
    needs_devices(2)
    import re
    mesh = mesh_1d()
    x = jnp.ones((ndev() * 1024,), jnp.float32)
    cases = [
        (lambda v: jax_gin.psum(v, "i", algorithm="two_shot"), "jax_gin.psum[two_shot 4 KiB float32]"),
        (lambda v: jax_gin.pmax(v, "i", algorithm="ring"), "jax_gin.pmax[ring 4 KiB float32]"),
        (lambda v: jax_gin.psum(v, "i", algorithm="one_shot", overlap=True),
         "jax_gin.psum[one_shot 4 KiB float32 async]"),
        (lambda v: jax_gin.psum_overlapping(v, "i", jnp.sin, v, algorithm="tree")[0],
         "jax_gin.psum_overlapping[tree 4 KiB float32 async]"),
    ]
    for body, label in cases:
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()))
        hlo = f.lower(x).compile().as_text()
        calls = [l for l in hlo.splitlines() if "custom-call(" in l and "jax_gin" in l]
        assert calls, hlo
        for line in calls:
            assert f"/{label}\"" in line, line
            assert re.search(r"%jax_gin_p\w+\.\d+ = ", line), line


@pytest.mark.parametrize("api", ["psum", "all_gather"])
def test_one_function_on_meshes_of_one_shape(api):
    # docs/api.md: a jitted function run on several meshes of one shape (other devices, or another
    # order) gives its shard_map the mesh= it runs on; each mesh then lowers with its own
    # communicators, and each result equals lax's on that mesh.
    needs_devices(4)
    jax_gin.runtime.reset()  # so that the communicators below are this test's
    devs = np.array(jax.devices())
    half = len(devs) // 2
    meshes = [jax.sharding.Mesh(devs[:half], ("x",)),
              jax.sharding.Mesh(devs[:half][::-1], ("x",)),
              jax.sharding.Mesh(devs[half:2 * half][::-1], ("x",))]
    kw = {"tiled": True} if api == "all_gather" else {}

    @jax.jit(static_argnums=(1, 2))
    def f(v, mesh, lib):
        return jax.shard_map(lambda u: getattr(lib, api)(u, "x", **kw), mesh=mesh,
                             in_specs=P("x"), out_specs=P("x"))(v)

    x = exact_input((3,), half, "float32")
    for mesh in meshes:
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("x")))
        assert_bitwise(f(xs, mesh, jax_gin), f(xs, mesh, lax))
    groups = {devices for devices, _ in jax_gin._runtime.comm_devices.values()}
    assert groups == {tuple(d.id for d in mesh.devices.flat) for mesh in meshes}


def test_independent_jax_gin_and_lax_collectives():
    """jax_gin calls and lax collectives that take nothing from each other, in one program.
    XLA's CPU runtime runs independent operations in whatever order they become ready, which
    can differ between devices; a handler that held the device's XLA thread while its peers
    sat in the rendezvous of a lax collective would deadlock (debugging.md). The CPU handlers
    return a future and wait on the rank's worker thread. Whether a run meets the orders that
    would deadlock depends on timing, so this guards the results of such a program, bit for
    bit lax's, over three runs."""
    mesh = mesh_1d()
    n = ndev()

    def make(gin):
        def f(x):
            outs = []
            for k in range(24):
                y = x + k
                if k % 3 == 0:
                    outs.append((gin or lax).psum(y, "i"))
                elif k % 3 == 1:
                    outs.append((gin or lax).psum_scatter(y, "i", tiled=True))
                else:
                    outs.append((gin or lax).all_gather(y[: y.shape[0] // n], "i", tiled=True))
                if k % 3 == 2:  # a lax collective beside every third call
                    outs.append(lax.psum_scatter(y * 3, "i", tiled=True))
            return [o.sum(keepdims=True) for o in outs]
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                                     check_vma=False))

    x = exact_input((1024,), n, "int32", seed=7)
    want = make(None)(x)
    ours = make(jax_gin)
    for _ in range(3):
        jax.tree.map(assert_bitwise, jax.block_until_ready(ours(x)), want)


def _thread_names():
    """The names of this process's threads (as top shows them)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def test_worker_threads_are_named():
    """On CPU devices each rank's calls run on a worker thread named after its communicator
    (counted from 1 in the process) and device ("jax_gin:<n>/<device>", within the kernel's 15
    characters), so that gdb and top tell them apart from XLA's threads."""
    if jax.default_backend() != "cpu":
        pytest.skip("CPU devices only")
    needs_devices(2)  # a group of one makes no call
    jax_gin.runtime.reset()  # the workers of earlier communicators end
    mesh = mesh_1d()
    x = exact_input((64,), ndev(), "float32", seed=3)
    f = jax.jit(jax.shard_map(lambda v: jax_gin.psum(v, "i"), mesh=mesh, in_specs=P("i"),
                              out_specs=P("i")))
    jax.block_until_ready(f(x))
    names = set(_thread_names())
    workers = sorted(name for name in names if name.startswith("jax_gin:"))
    comm = workers[0].split(":")[1].split("/")[0] if workers else "?"
    assert workers == sorted(f"jax_gin:{comm}/{d}" for d in range(ndev())), names


def test_idle_worker_threads_end():
    """A rank's worker thread ends by itself after about a second without a call
    (cpu_backend.cc: kWorkerIdle), and the rank's next call starts a fresh one: communicators
    that are no longer called hold no threads (60 of them on 8 devices held ~500 threads until
    reset()). Each device order of a mesh is a communicator of its own."""
    if jax.default_backend() != "cpu":
        pytest.skip("CPU devices only")
    needs_devices(2)  # a group of one makes no call
    jax_gin.runtime.reset()  # the workers of earlier communicators end
    devs = list(jax.devices())
    n = len(devs)
    orders = [devs[k:] + devs[:k] for k in range(n)]
    meshes = [Mesh(np.array(o), ("i",)) for o in orders + [o[::-1] for o in orders]]

    def make(mesh, lib):
        return jax.jit(jax.shard_map(lambda v: lib.psum(v, "i") + lib.all_gather(
            v[:2], "i", tiled=True).sum(), mesh=mesh, in_specs=P("i"), out_specs=P("i")))

    x = exact_input((8,), n, "float32", seed=11)
    inputs = [jax.device_put(x, jax.sharding.NamedSharding(m, P("i"))) for m in meshes]
    ours = [make(m, jax_gin).lower(xs).compile() for m, xs in zip(meshes, inputs)]
    want = [make(m, lax)(xs) for m, xs in zip(meshes, inputs)]
    assert len({c for c in jax_gin._runtime.comm_devices}) == len(meshes)

    def run_all():
        outs = [f(xs) for f, xs in zip(ours, inputs)]  # back to back
        jax.block_until_ready(outs)
        busy = [name for name in _thread_names() if name.startswith("jax_gin:")]
        for got, ref in zip(outs, want):
            assert_bitwise(got, ref)
        return busy

    def workers_when_idle():
        deadline = time.monotonic() + 60
        while True:
            workers = [name for name in _thread_names() if name.startswith("jax_gin:")]
            if not workers or time.monotonic() > deadline:
                return workers
            time.sleep(0.05)

    assert run_all()  # the threads of the last calls at least (a second has not passed)
    assert workers_when_idle() == []
    assert run_all()  # fresh threads, the same numbers
    assert workers_when_idle() == []


_EXIT_CHILD = r"""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_gin
mode = sys.argv[1]
mesh = Mesh(np.array(jax.devices()), ("i",))

def body(v):
    return jax.lax.fori_loop(0, 200, lambda k, u: u * 0.5 + jax_gin.psum(u, "i"), v)

f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
x = jnp.ones(len(jax.devices()) * 4096, jnp.float32)
jax.block_until_ready(f(x))  # compiled, and every rank's worker has run a call
if mode == "hung":  # a call whose peers wait for rank 0's signals, which are lost
    jax_gin.runtime.settings.timeout_s = 60
    jax_gin.runtime.settings.fault_rank = 0
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
if mode != "idle":
    out = f(x)  # dispatched, never waited for
print("EXITING", time.monotonic(), flush=True)
"""


@pytest.mark.parametrize("mode", ["idle", "busy", "hung"])
def test_exit_with_workers(tmp_path, mode):
    """The interpreter exits cleanly (status 0, at once) with jax_gin's workers idle, with a
    program's calls running on them, and with a call whose peers never come: the registry of
    communicators is never destroyed (its destructor would join the workers while the process
    is torn down), and jax_gin's atexit hook makes the calls in flight give up, so that JAX's
    shutdown, which waits for them, does not wait out the 60 s timeout."""
    if jax.default_backend() != "cpu":
        pytest.skip("CPU devices only")
    needs_devices(2)
    (tmp_path / "child.py").write_text(_EXIT_CHILD)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={ndev()}")
    r = subprocess.run([sys.executable, str(tmp_path / "child.py"), mode], env=env,
                       capture_output=True, text=True, timeout=120)
    end = time.monotonic()
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("EXITING")]
    assert r.returncode == 0 and lines, r.stdout + r.stderr[-3000:]
    assert end - float(lines[-1].split()[1]) < 30, r.stderr[-3000:]  # not the timeout


def test_call_labels_give_exact_sizes():
    """Profilers' labels (jax_gin.psum[one_shot 4 KiB float32]) give a call's size exactly:
    in the largest unit whose short figure gives it, else in bytes."""
    from jax_gin._primitive import size_text
    sizes = (100, 1024, 1536, 16388, 1025 << 10, 1537 << 20, 3 << 29, 1000000)
    assert [size_text(b) for b in sizes] == [
        "100 B", "1 KiB", "1.5 KiB", "16388 B", "1025 KiB", "1537 MiB", "1.5 GiB", "1000000 B"]
