"""Whole steps (jax_gin.workloads) and `python -m jax_gin.bench --workload`, at tiny sizes.

float32 steps: on 2 devices each all-reduce sums 2 values, and a + b == b + a, so lax and
jax_gin give the same bits. On 8 devices the order of the sums may differ, so they are only
close. bfloat16 steps are only close even on 2 CPU devices: XLA's CPU backend computes lax's
bfloat16 all-reduce and the ops around it in float32 and drops roundings to bfloat16 that the
jax_gin program keeps. overlap all-reduces small integers: exact, so bitwise equal on any mesh.
"""
import dataclasses
import json

import jax
import numpy as np
import pytest

from jax_gin import bench, workloads
from conftest import ndev

NAMES = workloads.NAMES
STEPS = tuple(name for name in NAMES if workloads.WORKLOADS[name].variants == workloads.REDUCES)


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
    # an explicit algorithm: `auto` may hand a size to XLA's all-reduce (a tuning table)
    r = workloads.measure(workload, mesh_of(workload, n), cfg, algorithm="two_shot", rounds=1,
                          warmup=0)
    v = r["variants"]
    assert list(v) == ["none", "lax", "jax_gin"]
    # lax: XLA all-reduces only; jax_gin: jax_gin custom calls only; none: neither
    assert v["lax"]["all_reduce"] >= 1 and v["lax"]["jax_gin_calls"] == 0
    assert v["jax_gin"]["jax_gin_calls"] >= 1 and v["jax_gin"]["all_reduce"] == 0
    assert v["none"]["all_reduce"] == 0 and v["none"]["jax_gin_calls"] == 0
    if workload != "dp-train":  # one custom call per psum; dp-train's pytree is bucketed
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


def test_errors():
    with pytest.raises(ValueError, match="reduce must be"):
        workloads.reducer("nccl")
    with pytest.raises(ValueError, match="multiples of 3"):
        workloads.check_config("tp-train", tiny("tp-train"), 3)


# Explicit tiny sizes: the CLI's defaults on GPUs are the full ones.
CLI_SIZES = ["--layers", "1", "--d-model", "64", "--heads", "8", "--ffn", "256", "--seq", "16",
             "--batch", "2"]


@pytest.mark.parametrize("workload", STEPS)
def test_cli(workload, tmp_path, capsys):
    path = tmp_path / "w.json"
    extra = ["--vocab", "128"] if workload == "dp-train" else []
    rc = bench.main(["--workload", workload, "--rounds", "2", "--warmup", "1", "--json", str(path),
                     "--algorithm", "two_shot"]
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
    assert v["jax_gin"]["jax_gin_calls"] >= 1 and v["jax_gin"]["all_reduce"] == 0
    assert data["lax_vs_jax_gin"]["max_abs_diff"] <= 0.0625  # a few bfloat16 ulps of values < 4
    assert data["ratio_lax_over_jax_gin"]["step"] > 0
    for key in ("# XLA_FLAGS", "# date", "# platform", "step(ms)", "exposed(ms)",
                "# lax / jax_gin"):
        assert key in text
    rows = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert [row.split()[0] for row in rows] == ["none", "lax", "jax_gin"]


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
