"""Whole steps (jax_gin.workloads) and `python -m jax_gin.bench --workload`, at tiny sizes.

float32 steps: on 2 devices each all-reduce (fsdp: reduce-scatter) sums 2 values, and
a + b == b + a, so lax and jax_gin give the same bits. On 8 devices the order of the sums may
differ, so they are only close. bfloat16 steps are only close even on 2 CPU devices: XLA's CPU
backend computes lax's bfloat16 all-reduce and the ops around it in float32 and drops roundings
to bfloat16 that the jax_gin program keeps. overlap all-reduces small integers: exact, so
bitwise equal on any mesh.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_gin import _native, bench, workloads
from conftest import ndev, needs_devices

NAMES = workloads.NAMES
STEPS = tuple(name for name in NAMES if workloads.WORKLOADS[name].variants == workloads.REDUCES)


def algorithm(workload):
    """An explicit algorithm: `auto` may hand an all-reduce's size to XLA (a tuning table).
    fsdp's all_gather and psum_scatter take one_shot or ring."""
    return "one_shot" if workload == "fsdp" else "two_shot"


def xla_collectives(variant):
    return variant["all_reduce"] + variant["all_gather"] + variant["reduce_scatter"]


def tiny(workload, **overrides):
    return workloads.default_config(workload, "cpu", **overrides)


def mesh_of(workload, n):
    if ndev() < n:
        pytest.skip(f"needs {n} devices, have {ndev()}")
    return workloads.make_mesh(workload, jax.devices()[:n])


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("workload", STEPS)
def test_variants_compile_run_and_agree(workload, n):
    cfg = tiny(workload, dtype="float32")
    r = workloads.measure(workload, mesh_of(workload, n), cfg, algorithm=algorithm(workload),
                          rounds=1, warmup=0)
    v = r["variants"]
    assert list(v) == ["none", "lax", "jax_gin"]
    # lax: XLA collectives only; jax_gin: jax_gin custom calls only; none: neither
    assert xla_collectives(v["lax"]) >= 1 and v["lax"]["jax_gin_calls"] == 0
    assert v["jax_gin"]["jax_gin_calls"] >= 1 and xla_collectives(v["jax_gin"]) == 0
    assert xla_collectives(v["none"]) == 0 and v["none"]["jax_gin_calls"] == 0
    if workload != "dp-train":  # one custom call per collective; dp-train's pytree is bucketed
        assert v["jax_gin"]["jax_gin_calls"] == r["psums"]["calls"]
    for x in v.values():
        assert x["step_ms"] > 0 and len(x["times_ms"]) == 1
    assert v["lax"]["exposed_ms"] == pytest.approx(v["lax"]["step_ms"] - v["none"]["step_ms"])
    cmp = r["lax_vs_jax_gin"]
    if n == 2:
        assert cmp["bitwise_equal"], cmp
    else:
        assert cmp["max_abs_diff"] <= 1e-5, cmp


@pytest.mark.parametrize("workload", ["dp-train", "tp-train"])
def test_sharded_step_updates_like_one_device(workload):
    # The gradients, summed over 2 devices (dp) or split over them (tp, each psum transposed
    # into a psum), update the parameters as the same step on one device does.
    cfg = dataclasses.replace(tiny(workload, dtype="float32"), lr=1.0)
    whole = dataclasses.replace(cfg, batch=2 * cfg.batch) if workload == "dp-train" else cfg
    w = workloads.WORKLOADS[workload]
    one, two = mesh_of(workload, 1), mesh_of(workload, 2)
    args = w.inputs(one, whole)
    before = jax.tree.leaves(jax.device_get(args[0]))
    ref = jax.tree.leaves(jax.device_get(w.step(one, whole, "lax")(*args)[0]))
    got = jax.tree.leaves(jax.device_get(w.step(two, cfg, "jax_gin")(*w.inputs(two, cfg))[0]))
    update = max(float(np.max(np.abs(a - b))) for a, b in zip(ref, before))
    error = max(float(np.max(np.abs(a - b))) for a, b in zip(got, ref))
    assert update > 1e-3
    assert error <= 1e-3 * update, (error, update)


def test_errors(capsys):
    with pytest.raises(ValueError, match="reduce must be"):
        workloads.reducer("nccl")
    with pytest.raises(ValueError, match="multiples of 3"):
        workloads.check_config("tp-train", tiny("tp-train"), 3)
    # heads derived from d_model keep the default head size (8 on CPU devices) where tensor
    # parallelism splits them, so check_config's hint (d_model a multiple of 8 n) holds
    with pytest.raises(ValueError, match=r"d_model 7 is not a multiple of 8, the default head "
                                         r"size \(heads = d_model // 8 unless --heads"):
        tiny("tp-decode", d_model=7)
    with pytest.raises(ValueError, match=r"with heads of size 8: d_model a multiple of 64"):
        workloads.check_config("tp-decode", tiny("tp-decode", d_model=56), 8)
    assert tiny("dp-train", d_model=12).heads == 1  # data parallel: one head of 12 (default 16)
    with pytest.raises(ValueError, match=r"d_model 100 is not a multiple of heads 6, which are d_model // 16 "):
        tiny("dp-train", d_model=100)
    # sizes below 1 are refused before they reach XLA (a cached context of 0 crashed its
    # compiler) or a division
    for name in ("layers", "d_model", "heads", "ffn", "seq", "batch"):
        with pytest.raises(ValueError, match=f"tp-decode needs sizes of at least 1: got "
                                             f"{name.replace('_', '-')} 0"):
            workloads.check_config("tp-decode", tiny("tp-decode", **{name: 0}), 2)
    with pytest.raises(SystemExit, match="dp-train needs sizes of at least 1: got batch 0"):
        bench.main(["--workload", "dp-train", "--batch", "0"])
    # usage errors (status 2), their text on stderr
    for argv, text in ((["--workload", "dp-train", "--rounds", "0"], "--rounds must be at least 1"),
                       (["--workload", "dp-train", "--devices", "0"],
                        "--devices 0: must be at least 1"),
                       # an option that the step does not read is refused, not ignored
                       (["--workload", "dp-train", "--rows", "5"],
                        "--rows: not read by --workload dp-train, which reads --layers, "),
                       (["--workload", "tp-decode", "--vocab", "9", "--mib", "1"],
                        "--vocab, --mib: not read by --workload tp-decode"),
                       (["--workload", "overlap", "--heads", "4"],
                        "--heads: not read by --workload overlap, which reads --layers, "
                        "--d-model, --rows, --mib, --dtype")):
        with pytest.raises(SystemExit) as info:
            bench.main(argv)
        assert info.value.code == 2
        assert text in capsys.readouterr().err, argv


@pytest.mark.parametrize("workload", [n for n in NAMES if workloads.WORKLOADS[n].attention])
def test_float16_attention_is_refused_on_cpu_devices(workload, capsys):
    # XLA's CPU dot_general cannot compile dot_product_attention's float16 x float16 -> float32
    # einsum: a one-line usage error (status 2) instead of XLA's traceback
    workloads.check_dtype(workload, "float16", "gpu")
    workloads.check_dtype(workload, "bfloat16", "cpu")
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the refusal is for CPU devices")
    with pytest.raises(SystemExit) as info:
        bench.main(["--workload", workload, "--dtype", "float16"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err == (f"python -m jax_gin.bench: error: {workload}: --dtype float16 does not run "
                   "on cpu devices (XLA's CPU dot_general has no float16 x float16 -> float32 "
                   "precision, which its attention needs); use bfloat16 or float32 there, "
                   "float16 on GPUs\n")


def test_overlap_runs_float16_on_cpu_devices():
    workloads.check_dtype("overlap", "float16", "cpu")  # no attention: no refusal


def test_one_device_gives_no_lax_ratio():
    """On one device lax.psum is no operation: the report gives times but no ratio to lax."""
    mesh = workloads.make_mesh("tp-decode", jax.devices()[:1])
    result = workloads.measure("tp-decode", mesh, tiny("tp-decode"), rounds=1, warmup=0)
    assert result["nranks"] == 1 and result["ratio_lax_over_jax_gin"] is None
    assert all(v["vs_lax"] is None and v["step_ms"] > 0 for v in result["variants"].values())
    lines = workloads.format_report(result)
    assert any(line.startswith("# one device: lax.psum is no operation") for line in lines)
    assert not any("vs_lax =" in line for line in lines), lines  # no legend for no ratio


def test_step_examples_take_the_workloads_variants(monkeypatch):
    """The step examples' --reduce offers each workload's variants (tp_decode: the fused
    psum_add_rmsnorm too), and 'all' times them all."""
    import sys

    from helpers import load_example

    common = load_example("_common")
    for name, w in workloads.WORKLOADS.items():
        if name == "overlap":  # no step example: python -m jax_gin.bench --workload overlap
            continue
        parser = common.workload_parser(name, name)
        action = next(a for a in parser._actions if a.dest == "reduce")
        assert tuple(action.choices) == ("all",) + w.variants, name
    monkeypatch.setattr(sys, "argv", ["tp_decode.py", "--reduce", "jax_gin_fused"])
    assert common.workload_parser("tp-decode", "").parse_args().reduce == "jax_gin_fused"
    # what report_step_times times: every variant for 'all', else the one with compute only
    timed = []

    def measure(workload, mesh, cfg, *, reduces, **kw):
        timed.append(reduces)
        raise StopIteration  # the variants are all this test needs

    monkeypatch.setattr(workloads, "measure", measure)
    for reduce in ("all", "jax_gin_fused"):
        args = common.workload_parser("tp-decode", "").parse_args(["--reduce", reduce])
        with pytest.raises(StopIteration):
            common.report_step_times("tp-decode", None, None, args)
    assert timed == [workloads.WORKLOADS["tp-decode"].variants, ("none", "jax_gin_fused")]


def test_report_notes_jax_gin_rows_that_auto_gave_to_xla():
    """A jax_gin row whose program has no jax_gin call (auto chose XLA's all-reduce for each of
    its sizes) says so under the table; a row with calls does not."""
    needs_devices(2)
    mesh = mesh_of("overlap", 2)
    result = workloads.measure("overlap", mesh, tiny("overlap"), rounds=1, warmup=0)
    gin = {r: v for r, v in result["variants"].items() if r.startswith("jax_gin")}
    for calls in (0, 1):
        for v in gin.values():
            v["jax_gin_calls"], v["all_reduce"] = calls, 1 - calls
        report = workloads.format_report(result)
        notes = [line for line in report if "no jax_gin call; auto chose" in line]
        assert notes == ([f"# {', '.join(gin)}: no jax_gin call; auto chose XLA's all-reduce "
                          "for every size in those programs"] if calls == 0 else []), notes
        # the step ratio then is between two XLA programs, and says so
        assert any("made no jax_gin call, so both are XLA's" in line
                   for line in report) == (calls == 0), report
    gin["jax_gin"]["jax_gin_calls"], gin["jax_gin"]["all_reduce"] = 0, 1
    assert "# jax_gin: no jax_gin call; auto chose XLA's all-reduce for every size in that " \
        "program" in workloads.format_report(result)


def test_why_different_names_the_cause():
    """The note on a difference from lax names its cause: ring's and tree's roundings at each
    hop in 16-bit floats, whatever the platform, else on CPU XLA's float32 for lax's
    collectives (named as the step has them), and none for float32 on CPU; for the fused
    variant the fused call's own arithmetic where XLA's float32 is not the cause."""
    why = workloads._why_different
    for platform in ("cpu", "gpu"):
        assert why("jax_gin", platform, "bfloat16", "ring", ("all_gather", "reduce_scatter")) \
            .startswith("ring passes bfloat16 partial sums between ranks, each hop rounding once")
        assert why("jax_gin", platform, "float16", "tree").startswith("tree passes float16")
    assert "lax's bfloat16 all-gather and reduce-scatter" in why(
        "jax_gin", "cpu", "bfloat16", "one_shot", ("all_gather", "reduce_scatter"))
    assert "lax's bfloat16 all-reduce" in why("jax_gin", "cpu", "bfloat16", "auto")
    assert why("jax_gin", "cpu", "float32", "ring") is None
    # the fused variant: on CPU in bfloat16 XLA's float32 for lax's ops, which made up the
    # whole difference in tp-decode; elsewhere the fused call's own rsqrt and sum of squares
    assert "lax's bfloat16 all-reduce" in why(workloads.FUSED, "cpu", "bfloat16", "auto")
    for platform, dtype in (("cpu", "float32"), ("gpu", "bfloat16"), (None, None)):
        assert why(workloads.FUSED, platform, dtype, "auto").startswith("the fused call computes")


def test_report_ratios_that_mean_nothing():
    """No ratio of exposed times where one is within the steps' spread, and a step ratio
    between two XLA programs (auto chose XLA's collective) says so."""
    ratios = workloads.lax_over_jax_gin
    assert ratios({"step_ms": 10.0, "exposed_ms": 2.0}, {"step_ms": 8.0, "exposed_ms": 1.0}) == \
        {"step": 1.25, "exposed": 2.0}
    # lax's exposed time is 1% of the step (EXPOSED_FLOOR: 2%), within the spread
    assert ratios({"step_ms": 10.0, "exposed_ms": 0.1}, {"step_ms": 10.0, "exposed_ms": 1.0}) == \
        {"step": 1.0, "exposed": None}
    mesh = workloads.make_mesh("dp-train", jax.devices()[:1])
    result = workloads.measure("dp-train", mesh, tiny("dp-train"), rounds=1, warmup=0)
    result["variants"]["jax_gin"].update(jax_gin_calls=0, all_reduce=1)
    result["ratio_lax_over_jax_gin"] = {"step": 1.0, "exposed": None}
    line = [x for x in workloads.format_report(result) if x.startswith("# lax / jax_gin")]
    assert line == ["# lax / jax_gin: step 1.000, exposed communication -; the jax_gin program "
                    "made no jax_gin call, so both are XLA's and the ratio is their run-to-run "
                    "spread"], line


def test_report_says_why_a_gpu_step_may_differ_in_the_last_bits():
    """On GPUs each variant is its own program with its own autotuned matmuls: a step whose
    results differ from lax's says so; one whose results are equal, or a CPU run of float32
    steps, does not."""
    mesh = workloads.make_mesh("tp-decode", jax.devices()[:1])
    result = workloads.measure("tp-decode", mesh, tiny("tp-decode"), rounds=1, warmup=0)
    meta = {"jax_gin": "x", "jax_gin_cuda": True, "jax": "x", "jaxlib": "x", "python": "x",
            "host": "x", "ndevices": 1, "device_kind": "x", "ndevices_total": 1,
            "xla_flags": "", "nccl_nvls_enable": "0", "date": "x", "sizes": "x"}

    def note(platform, equal):
        result["lax_vs_jax_gin"] = {"bitwise_equal": equal, "max_abs_diff": 0.0 if equal else 0.05}
        # the examples print the report without the header (meta): the same notes
        notes = [[line for line in workloads.format_report(dict(result, platform=platform), m)
                  if "autotunes" in line] for m in (dict(meta, platform=platform), None)]
        assert notes[0] == notes[1]
        return notes[0]

    assert len(note("gpu", False)) == 1 and "--xla_gpu_autotune_level=0" in note("gpu", False)[0]
    assert note("gpu", True) == [] and note("cpu", False) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_report_says_why_the_fused_norm_may_differ(dtype):
    """tp-decode's fused variant against lax: a difference is explained (on CPU devices in
    bfloat16 by XLA's float32 for lax's ops, else by the fused call's own rsqrt and sum of
    squares); equal results need no note."""
    note = ("lax's bfloat16 all-reduce and the ops around it in float32"
            if dtype == "bfloat16" and jax.devices()[0].platform == "cpu"
            else "its sum of squares its own way")
    mesh = workloads.make_mesh("tp-decode", jax.devices()[:1])
    result = workloads.measure("tp-decode", mesh, tiny("tp-decode", dtype=dtype), rounds=1,
                               warmup=0)
    for equal in (False, True):
        result["lax_vs_jax_gin_fused"] = {"bitwise_equal": equal,
                                          "max_abs_diff": 0.0 if equal else 0.0156}
        notes = [line for line in workloads.format_report(result) if note in line]
        assert len(notes) == (0 if equal else 1), notes


# Explicit tiny sizes: the CLI's defaults on GPUs are the full ones. Tensor parallelism splits
# heads and ffn over the devices, so over a count that does not divide 8 they are multiples of it.
_HEADS = 8 if 8 % ndev() == 0 else 2 * ndev()
CLI_SIZES = ["--layers", "1", "--d-model", str(8 * _HEADS), "--heads", str(_HEADS),
             "--ffn", str(256 if 256 % ndev() == 0 else 64 * ndev()), "--seq", "16", "--batch", "2"]


@pytest.mark.parametrize("workload", STEPS)
def test_cli(workload, tmp_path, capsys):
    path = tmp_path / "w.json"
    extra = ["--vocab", "128"] if workload in ("dp-train", "fsdp") else []
    rc = bench.main(["--workload", workload, "--rounds", "2", "--warmup", "1", "--json", str(path),
                     "--algorithm", algorithm(workload)]
                    + CLI_SIZES + extra)
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(path.read_text())
    meta = data["meta"]
    assert meta["ndevices"] == ndev() and meta["jax"] == jax.__version__
    assert meta["sizes"].startswith("CPU defaults" if meta["platform"] == "cpu" else "GPU defaults")
    assert data["workload"] == workload and data["nranks"] == ndev()
    assert data["config"]["layers"] == 1 and data["config"]["dtype"] == "bfloat16"
    v = data["variants"]
    assert set(v) == {"none", "lax", "jax_gin"}
    for x in v.values():
        assert len(x["times_ms"]) == 2 and x["step_ms"] > 0
    assert v["jax_gin"]["jax_gin_calls"] >= 1 and xla_collectives(v["jax_gin"]) == 0
    assert data["lax_vs_jax_gin"]["max_abs_diff"] <= 0.0625  # a few bfloat16 ulps of values < 4
    if ndev() > 1:
        assert data["ratio_lax_over_jax_gin"]["step"] > 0
    else:  # lax.psum over one device is no operation: no ratio (test_one_device_gives_...)
        assert data["ratio_lax_over_jax_gin"] is None
    for key in ("# XLA_FLAGS", "# date", "# platform", "step(ms)", "exposed(ms)",
                "# lax / jax_gin" if ndev() > 1 else "# one device: lax.psum is no operation"):
        assert key in text
    rows = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert [row.split()[0] for row in rows] == ["none", "lax", "jax_gin"]


@pytest.mark.parametrize("n", [2, 8])
def test_fsdp_lowers_to_the_collectives(n):
    # lax: XLA all-gathers and reduce-scatters; jax_gin: its collective custom calls; one of
    # each per block and one for the embeddings, the reduce-scatters from grad's transposes
    mesh, cfg = mesh_of("fsdp", n), tiny("fsdp")
    args = workloads.fsdp_inputs(mesh, cfg)
    calls = cfg.layers + 1
    want = {"lax": {"all_reduce": 0, "all_gather": calls, "reduce_scatter": calls,
                    "jax_gin_calls": 0},
            "jax_gin": {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0,
                        "jax_gin_calls": 2 * calls},
            "none": {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "jax_gin_calls": 0}}
    for reduce, counts in want.items():
        step = workloads.fsdp_train_step(mesh, cfg, reduce, "one_shot")
        text = step.lower(*args).compile().as_text()
        assert workloads.count_collectives(text) == counts, reduce
        target = _native.COLLECTIVE_TARGETS["cpu" if jax.default_backend() == "cpu" else "cuda"]
        assert text.count(f'custom_call_target="{target}"') == counts["jax_gin_calls"], reduce
    assert workloads.fsdp_train_psums(cfg, n)["calls"] == 2 * calls


@pytest.mark.parametrize("n", [2, 8])
def test_fsdp_updates_like_dp_train(n):
    # The same model, inputs and update: only where the parameters live and how the
    # gradients are summed differ (all-reduce vs all-gather's transpose, a reduce-scatter).
    mesh = mesh_of("fsdp", n)
    # d_model 40: the flat vectors are padded (to a multiple of 16 n elements)
    cfg = dataclasses.replace(tiny("fsdp", d_model=40, dtype="float32"), lr=1.0)
    params, tokens = workloads.dp_train_inputs(mesh, cfg)
    shards, _ = workloads.fsdp_inputs(mesh, cfg)   # the same tokens
    before = jax.device_get(params)
    assert jax.tree.all(jax.tree.map(np.array_equal, jax.device_get(
        workloads.fsdp_params(shards, cfg)), before))
    size = workloads.fsdp_size(workloads.fsdp_groups(cfg)[1], n)
    assert shards["layers"][0].shape == (size,) and size % (16 * n) == 0
    assert shards["layers"][0].sharding.spec == P("data")
    ref, ref_loss = workloads.dp_train_step(mesh, cfg, "lax")(params, tokens)
    new, loss = workloads.fsdp_train_step(mesh, cfg, "jax_gin", "one_shot")(shards, tokens)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-6)
    ref, got = jax.device_get(ref), jax.device_get(workloads.fsdp_params(new, cfg))
    update = max(float(np.max(np.abs(a - b))) for a, b in
                 zip(jax.tree.leaves(ref), jax.tree.leaves(before)))
    error = max(float(np.max(np.abs(a - b))) for a, b in
                zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    assert update > 1e-3
    assert error <= 1e-5 * update, (error, update)
    # the padding of each flat vector has no gradient: it stays zero
    used = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(workloads.fsdp_groups(cfg)[1]))
    assert used < size and not np.any(np.asarray(new["layers"][0])[used:])


def test_fsdp_none_gathers_locally():
    # The compute-only stand-in: n copies forward; backward, the cotangent's block at this
    # device's index (what a reduce-scatter leaves there, without the sum).
    n = min(ndev(), 4)
    mesh = mesh_of("fsdp", n)
    gather = workloads.gatherer("none")
    x = jnp.arange(2.0 * n).reshape(n, 2)
    w = jnp.arange(2.0 * n * n).reshape(n, 2 * n) + 1

    def f(x, w):
        y, g = jax.value_and_grad(lambda x: jnp.sum(gather(x, "data") * w[0]))(x[0])
        return y[None], g[None]

    y, g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()),
                                 out_specs=(P("data"), P("data")), check_vma=False))(x, w)
    for i in range(n):
        assert float(y[i]) == float(jnp.sum(jnp.tile(x[i], n) * w[0]))
        np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(w[0, 2 * i:2 * i + 2]))
    with pytest.raises(ValueError, match="reduce must be"):
        workloads.gatherer("nccl")


def test_fsdp_errors():
    with pytest.raises(ValueError, match="fsdp needs vocab"):
        workloads.check_config("fsdp", tiny("fsdp", vocab=0), 2)
    with pytest.raises(SystemExit, match="auto, one_shot, ring"):
        bench.main(["--workload", "fsdp", "--algorithm", "two_shot"] + CLI_SIZES)
    with pytest.raises(SystemExit, match="fsdp: --overlap .* fsdp's step has no psum"):
        bench.main(["--workload", "fsdp", "--overlap"] + CLI_SIZES)


def test_overlap_sum_is_exact():
    mesh = mesh_of("overlap", ndev())
    cfg = tiny("overlap", rows=2, d_model=32, mib=1 / 64)
    x, w, g = workloads.overlap_inputs(mesh, cfg)
    want = np.asarray(g, np.float32).reshape(ndev(), -1).sum(0)
    assert np.all(np.abs(want) <= 4 * ndev()) and np.any(want != 0)
    for r in ("lax_alone", "jax_gin_alone"):
        out = workloads.overlap_step(mesh, cfg, r)(x, w, g)
        assert set(out) == {"sum"}
        np.testing.assert_array_equal(np.asarray(out["sum"], np.float32), want)
    assert set(workloads.overlap_step(mesh, cfg, "compute")(x, w, g)) == {"y"}
    with pytest.raises(ValueError, match="overlap's variants"):
        workloads.overlap_step(mesh, cfg, "none")


def test_cli_overlap(tmp_path, capsys):
    needs_devices(2)  # the workloads refuse a group of one device
    path = tmp_path / "o.json"
    rc = bench.main(["--workload", "overlap", "--algorithm", "two_shot", "--rounds", "2",
                     "--warmup", "1", "--layers", "2",
                     "--d-model", "32", "--rows", "4", "--mib", "0.0625", "--json", str(path)])
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(path.read_text())
    assert data["workload"] == "overlap" and data["nranks"] == ndev()
    cfg = data["config"]
    assert (cfg["layers"], cfg["d_model"], cfg["rows"], cfg["mib"], cfg["dtype"]) == \
        (2, 32, 4, 0.0625, "bfloat16")
    assert data["psums"]["bytes"] == 2**16
    v = data["variants"]
    assert list(v) == list(workloads.OVERLAP_VARIANTS)
    for x in v.values():
        assert len(x["times_ms"]) == 2 and x["step_ms"] > 0
    counts = {r: (x["all_reduce"], x["jax_gin_calls"]) for r, x in v.items()}
    assert counts == {"compute": (0, 0), "lax_alone": (1, 0), "jax_gin_alone": (0, 1),
                      "lax": (1, 0), "jax_gin": (0, 1)}
    assert v["lax"]["exposed_ms"] == pytest.approx(v["lax"]["step_ms"] - v["compute"]["step_ms"])
    assert v["lax_alone"]["exposed_ms"] is None
    for key in ("lax_vs_jax_gin", "lax_alone_vs_jax_gin_alone"):
        assert data[key] == {"bitwise_equal": True, "max_abs_diff": 0.0}, key
    o = data["overlap"]
    assert set(o) == {"lax", "jax_gin", "target"} and o["target"] == 1.1
    for r in ("lax", "jax_gin"):
        alone = max(v["compute"]["step_ms"], v[f"{r}_alone"]["step_ms"])
        assert o[r] == pytest.approx(v[r]["step_ms"] / alone)
    assert "# overlap = together / max(compute alone, all-reduce alone)" in text
    rows = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert [row.split()[0] for row in rows] == list(workloads.OVERLAP_VARIANTS)
