"""Whole steps (jax_gin.workloads) and `python -m jax_gin.bench --workload`, at tiny sizes.

float32 steps: on 2 devices each all-reduce sums 2 values, and a + b == b + a, so lax and
jax_gin give the same bits. On 8 devices the order of the sums may differ, so they are only
close. bfloat16 steps are only close even on 2 CPU devices: XLA's CPU backend computes lax's
bfloat16 all-reduce and the ops around it in float32 and drops roundings to bfloat16 that the
jax_gin program keeps.
"""
import dataclasses
import json

import jax
import numpy as np
import pytest

from jax_gin import bench, workloads
from conftest import ndev

NAMES = workloads.NAMES


def tiny(workload, **overrides):
    return workloads.default_config(workload, "cpu", **overrides)


def mesh_of(workload, n):
    if ndev() < n:
        pytest.skip(f"needs {n} devices, have {ndev()}")
    return workloads.make_mesh(workload, jax.devices()[:n])


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("workload", NAMES)
def test_variants_compile_run_and_agree(workload, n):
    cfg = tiny(workload, dtype="float32")
    r = workloads.measure(workload, mesh_of(workload, n), cfg, rounds=1, warmup=0)
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


@pytest.mark.parametrize("workload", NAMES)
def test_cli(workload, tmp_path, capsys):
    path = tmp_path / "w.json"
    extra = ["--vocab", "128"] if workload == "dp-train" else []
    rc = bench.main(["--workload", workload, "--rounds", "2", "--warmup", "1", "--json", str(path)]
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
