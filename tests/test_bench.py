"""The benchmark command (jax_gin.bench): a tiny sweep on the test devices, end to end."""
import importlib.util
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jax_gin import _bench_inputs, _bench_measure, _ops, _select, bench
from conftest import mesh_1d, ndev, needs_devices
import helpers

SIZES = [1024, 4096]
DTYPES = ["float32", "int32"]
OPS = ["sum", "max"]
ALGOS = ["auto", "lax", "ring"]
TINY = ["-b", "1K", "-e", "4K", "-n", "2", "-w", "1", "-k", "3", "--quiet"]
PLOT = importlib.util.find_spec("matplotlib") is not None  # --plot needs it


def test_tiny_sweep(tmp_path, capsys):
    needs_devices(2)  # the sweep refuses a group of one device
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = bench.main(TINY + ["-a", ",".join(ALGOS), "-d", ",".join(DTYPES), "-o", ",".join(OPS),
                            "--json", str(out_json)] + (["--plot", str(out_png)] if PLOT else []))
    text, err = capsys.readouterr()
    assert rc == 0, text

    data = json.loads(out_json.read_text())
    assert data["meta"]["ndevices"] == ndev()
    assert data["meta"]["chain"] == 3
    rows = data["results"]
    got = {(r["size"], r["dtype"], r["op"], r["algorithm"]) for r in rows}
    assert got == {(s, d, o, a) for s in SIZES for d in DTYPES for o in OPS for a in ALGOS}
    assert len(rows) == len(got)
    for r in rows:
        assert r["error"] is None, r
        assert r["wrong"] == 0 and r["wrong_chain"] == 0, r
        assert r["count"] * jnp.dtype(r["dtype"]).itemsize == r["size"]
        assert r["wall_us"] > 0 and r["chain_us"] > 0 and r["time_us"] is not None
        assert r["nranks"] == ndev()
        assert (r["auto_choice"] in bench.jax_gin.ALGORITHMS) == (r["algorithm"] == "auto")
        if r["algorithm"] == "lax" and r["time_us"] > 0:
            assert r["vs_lax"] == pytest.approx(1.0)

    for col in ("size", "count", "type", "redop", "algo", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)", "#wrong", "wall(us)", "vs_lax"):
        assert col in text
    assert text.count("# Avg bus bandwidth") == len(ALGOS)
    assert "# Wrong values        : 0 OK" in text
    data_lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(data_lines) == len(rows)

    if PLOT:  # (without matplotlib, --plot is refused: test_plot_without_matplotlib)
        assert out_png.stat().st_size > 0


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    """--plot without matplotlib is refused before the sweep (status 2), not after it with a
    message and status 0."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(SystemExit) as info:
        bench.main(TINY + ["--plot", str(tmp_path / "p.png")])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "matplotlib is not installed (pip install matplotlib)" in err, err


def test_wrong_results_fail(monkeypatch, capsys):
    needs_devices(2)  # the sweep refuses a group of one device
    # A reference off by one: every element is reported wrong and main() fails.
    true_reference = _bench_inputs.reference
    monkeypatch.setattr(_bench_inputs, "reference", lambda v, op: true_reference(v, op) + 1)
    rc = bench.main(TINY + ["-e", "1K", "-a", "ring"])
    text = capsys.readouterr().out
    assert rc == 1
    count = 1024 // 4
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("1024"))
    assert str(count * ndev()) in row.split("|")[1].split()
    assert "FAILED" in text


@pytest.mark.parametrize("dtype", helpers.DTYPES)
@pytest.mark.parametrize("op", _ops.OPS)
def test_inputs_are_exact_and_nonzero(dtype, op):
    inp = bench.make_inputs(8, 100, dtype, op, seed=1)
    assert np.all(inp.x != 0)
    want = _bench_inputs.reference(inp.x.astype(np.int64), op)
    np.testing.assert_array_equal(inp.ref.astype(np.int64), want)
    # One chain step on the device: allreduce(x) - corr must give x back exactly.
    step = jnp.asarray(np.broadcast_to(inp.ref, inp.x.shape)) - jnp.asarray(inp.corr)
    np.testing.assert_array_equal(np.asarray(step), inp.x)


@pytest.mark.parametrize("dtype", helpers.DTYPES + helpers.X64_DTYPES)
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_slice_chain_is_exact_where_chosen(dtype, op, nranks):
    """The slice chain step (y <- allreduce(y); y[0] <- x[0]) is chosen only where its values
    stay exact; there, a float64 simulation of the chain matches chain_result()."""
    k = 20
    step = bench.chain_step_for("auto", nranks, k, dtype, op)
    if op == "max":
        assert step == "slice"  # max never grows
    if op == "sum" and nranks == 3:
        assert step == "subtract"  # 3^19 times the values is not exact
    if step == "subtract":
        return
    scale = bench.f16_scale_exp(nranks, k, op) if dtype == "float16" else 0
    inp = bench.make_inputs(nranks, 50, dtype, op, seed=3, scale_exp=scale)
    red = {"sum": np.sum, "max": np.max}[op]
    y = inp.x.astype(np.float64)
    for _ in range(k - 1):
        y = np.broadcast_to(red(y, axis=0), y.shape).copy()
        y[:, 0] = inp.x[:, 0]
    last = red(y, axis=0)
    want = inp.chain_result(k, "slice")
    assert np.all(np.isfinite(want.astype(np.float64)))
    # the dtype holds every value of the chain exactly
    np.testing.assert_array_equal(last.astype(inp.ref.dtype).astype(np.float64), last)
    np.testing.assert_array_equal(want.astype(np.float64), last)


def test_bench_chain_steps_agree(capsys):
    """Both chain steps run and check clean on the CPU devices; rows that fell back to the
    subtract step are marked."""
    needs_devices(2)  # the sweep refuses a group of one device
    for step in ("slice", "subtract"):
        rc = bench.main(TINY + ["-e", "1K", "-a", "ring,lax", "-d", "float32,float16",
                                "--chain-step", step])
        text = capsys.readouterr().out
        assert rc == 0, text
        assert f"step {step}" in text
        rows = [ln for ln in text.splitlines() if ln.strip() and ln.strip()[0].isdigit()]
        assert rows and all(ln.endswith(" *") == (step == "subtract") for ln in rows)


def test_default_chain_length():
    """Long chains where the op is short (host jitter divides by K - 1), short ones above."""
    args = bench.parse_args([])
    assert args.chain is None
    assert bench.chain_length(args, 4 << 10) == bench.chain_length(args, 4 << 20) == 100
    assert bench.chain_length(args, 16 << 20) == 20
    assert bench.chain_length(bench.parse_args(["-k", "7"]), 4 << 10) == 7


def test_sizes_and_flags():
    assert [bench.parse_size(s) for s in ("4096", "4K", "4k", "64M", "1G", "2KiB")] == \
        [4096, 4096, 4096, 64 << 20, 1 << 30, 2048]
    assert bench.size_steps(4 << 10, 1 << 20, 4) == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    args = bench.parse_args(["-d", "float,half,bf16", "-o", "all", "-a", "one_shot,lax"])
    assert args.dtype == ["float32", "float16", "bfloat16"]
    assert args.op == ["sum", "max", "min"]
    assert args.algorithm == ["one_shot", "lax"]
    assert args.check and args.maxbytes is None
    for bad in (["-a", "butterfly"], ["-d", "int8"], ["-k", "1"], ["-b", "3X"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    # sizes that round to the same elements are measured once: over 8 devices 4, 8 and 16
    # bytes of float32 are all one block of 1 element each (32 bytes)
    assert bench.row_sizes("psum_scatter", [4, 8, 16, 32, 64], 8, 4) == [4, 64]
    assert bench.row_sizes("all_reduce", [1, 2, 4, 8], 8, 4) == [1, 8]


@pytest.mark.parametrize("cli", ["bench", "doctor"])
@pytest.mark.parametrize("argv,message", [
    (["--coordinator", "x", "--num-processes", "2", "--process-id", "0"],
     "--coordinator x: expected HOST:PORT"),
    (["--coordinator", "localhost:0", "--num-processes", "2", "--process-id", "0"],
     "--coordinator localhost:0: expected HOST:PORT"),
    (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "5"],
     "--process-id 5: must be from 0 to 1 (--num-processes 2)"),
    (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "-1"],
     "--process-id -1: must be from 0 to 1"),
    (["--coordinator", "localhost:1", "--num-processes", "0", "--process-id", "0"],
     "--num-processes 0: must be at least 1"),
    (["--num-processes", "2"], "--coordinator, --num-processes and --process-id go together"),
    (["--coordinator", "localhost:1"], "--coordinator, --num-processes and --process-id go together"),
])
def test_process_flags_are_checked_before_jax_distributed(cli, argv, message, capsys):
    # both CLIs check them alike (bench.check_processes) and refuse as argparse does (status 2),
    # instead of jax.distributed.initialize's IndexError or ValueError, or (the doctor with
    # --num-processes alone) a run of one process
    from jax_gin import doctor
    main = {"bench": bench.main, "doctor": doctor.main}[cli]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["python -m jax_gin.bench", "python -m jax_gin.tune",
                                     "python -m jax_gin.workloads", "python -m jax_gin.trace",
                                     "jax-gin-bench"])
def test_invalid_variable_is_a_usage_error(command, monkeypatch, capsys):
    # `import jax_gin` under these tools takes an invalid JAX_GIN_* variable's default (as
    # under the doctor) instead of failing with a traceback; their main() then refuses to
    # run, naming it in one line (status 2)
    import sys

    from jax_gin import _runtime, _trace, tune, workloads
    monkeypatch.setenv("JAX_GIN_TIMEOUT_S", "abc")
    script = command == "jax-gin-bench"
    argv = [sys.executable] + ([f"/venv/bin/{command}"] if script else command.split()[1:])
    monkeypatch.setattr(sys, "orig_argv", argv)
    monkeypatch.setattr(sys, "argv", [argv[1] if script else "-m"])
    assert _runtime._settings_at_import().timeout_s == _runtime._DEFAULT_TIMEOUT_S
    main = {"tune": tune.main, "workloads": workloads.main, "trace": _trace.main}.get(
        command.rsplit(".", 1)[-1], bench.main)
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"{command}: error: JAX_GIN_TIMEOUT_S='abc': must be a positive finite number of "
        "seconds, at most 1e9 (there is no 'no timeout' value)\n")
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-c", "import jax_gin"])
    monkeypatch.setattr(sys, "argv", ["-c"])
    with pytest.raises(ValueError, match="JAX_GIN_TIMEOUT_S='abc'"):  # elsewhere, import fails
        _runtime._settings_at_import()


def test_output_paths_are_checked_before_the_run(tmp_path, capsys):
    # a path that cannot be written is refused at once (status 2), not after the measurement
    from jax_gin import doctor, tune
    bad = tmp_path / "nodir" / "x.json"
    for main, argv in ((bench.main, ["--json", bad]), (bench.main, ["--plot", bad]),
                       (bench.main, ["--workload", "dp-train", "--json", bad]),
                       (doctor.main, ["--json", bad]),
                       (tune.main, ["--out", tmp_path]), (tune.main, ["--out", bad])):
        with pytest.raises(SystemExit) as info:
            main([str(a) for a in argv])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "cannot write" in err and str(tmp_path) in err, err
    assert not (tmp_path / "nodir").exists()  # a missing directory is refused, not made


def test_join_error_is_a_message(monkeypatch, capsys):
    """Where jax.distributed.initialize raises (process 0's port taken), the benchmark says
    which job it could not join and returns 1, without a traceback."""
    with helpers.join_fails(monkeypatch):
        rc = bench.main(["--coordinator", "127.0.0.1:1", "--num-processes", "2",
                         "--process-id", "0"])
    err = capsys.readouterr().err
    assert rc == 1
    assert ("python -m jax_gin.bench: process 0 of 2 could not join the job at 127.0.0.1:1 "
            "(UNKNOWN: Failed to start RPC server): start every process") in err, err


def test_workload_flag_abbreviated_runs_the_workload(monkeypatch):
    # the sweep's parser resolves --worklo as --workload: the workload runs, not the sweep
    monkeypatch.setattr(bench.workloads, "main", lambda argv, prog: ("workload", argv, prog))
    assert bench.main(["--worklo", "dp-train"]) == \
        ("workload", ["--worklo", "dp-train"], "python -m jax_gin.bench")


@pytest.mark.parametrize("tool,common,differ,named", [
    ("bench", ["-n", "2", "-w", "1", "-b", "4K"], (["-e", "4K"], ["-e", "8K"]),
     ("maxbytes", "4096", "8192")),
    ("doctor", ["--quick"], (["--sizes", "4K"], ["--sizes", "8K"]),
     ("sizes", "[4096]", "[8192]")),
])
def test_processes_that_run_different_commands(tool, common, differ, named):
    """Processes of one job that run the benchmark or the doctor with different options would
    run different programs, and lax's collectives across processes abort without a word:
    each process names the difference, as a usage error (status 2), before any is run."""
    from multiproc import tail

    results = _two_processes_run(
        lambda i: [f"jax_gin.{tool}"] + common + ["--process-id", str(i)] + differ[i], 120)
    key, values = named[0], named[1:]
    for i, (rc, o) in enumerate(results):
        assert rc == 2, f"process {i}:\n{tail(o)}"
        mine, theirs = values if i == 0 else values[::-1]
        assert (f"python -m jax_gin.{tool}: error: the processes of the job run different "
                f"commands: {key}={mine} here but {theirs} in process {1 - i}. Run the same "
                f"command in every process") in o, tail(o)


def _two_processes_run(args_of, timeout: float) -> list:
    """Runs `python -m <args_of(i)>` as process i of a jax.distributed job of 2 processes x 4
    CPU devices on 127.0.0.1 (one mesh of 8); returns [(returncode, output)] of both."""
    import sys

    from multiproc import clean_env, launch_commands

    env = clean_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    return launch_commands(
        lambda i, port: [sys.executable, "-m"] + args_of(i) + [
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"],
        [env, env], timeout, args_of(0)[0])


def _two_processes(tmp_path, args):
    """Runs the benchmark with `args` over jax.distributed (_two_processes_run); returns both
    outputs and process 0's JSON records."""
    from multiproc import tail

    out = tmp_path / "bench.json"
    results = _two_processes_run(
        lambda i: ["jax_gin.bench", "-n", "2", "-w", "1", "-k", "3", "--quiet"] + args
        + ["--process-id", str(i)] + (["--json", str(out)] if i == 0 else []), 240)
    outs = [o for _, o in results]
    for i, (rc, o) in enumerate(results):
        assert rc == 0, f"process {i}:\n{tail(o)}"
    assert "8 x cpu (of 8 devices, 2 processes)" in outs[0], tail(outs[0])
    return outs, json.loads(out.read_text())["results"]


def test_bench_two_processes(tmp_path):
    """The benchmark over jax.distributed, jax_gin and lax side by side; process 0 prints and
    writes the JSON."""
    outs, recs = _two_processes(tmp_path, ["-b", "4K", "-e", "64K", "-f", "16",
                                           "-a", "auto,one_shot,ring,lax"])
    assert "Avg bus bandwidth" in outs[0]
    assert "all-reduce benchmark" not in outs[1]  # only process 0 prints the table
    assert {r["algorithm"] for r in recs} == {"auto", "one_shot", "ring", "lax"}
    assert {r["size"] for r in recs} == {4 << 10, 64 << 10}
    for r in recs:
        assert r["nranks"] == 8 and r["error"] is None, r
        assert r["wrong"] == 0 and r["wrong_chain"] == 0, r
        assert r["time_us"] is not None


def test_one_device_is_refused(capsys):
    """One device on the reduced axis: no all-reduce reduces, so the sweep refuses and
    names how to get 8 CPU devices; --one-device runs it without vs_lax ratios or geomean."""
    with pytest.raises(SystemExit) as info:
        bench.main(TINY + ["-e", "1K", "--devices", "1"])
    msg = str(info.value.code)
    assert "one device" in msg and "--one-device" in msg
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in msg
    rc = bench.main(TINY + ["-e", "1K", "-a", "auto,lax", "--devices", "1", "--one-device"])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = [ln for ln in text.splitlines() if ln.strip() and ln.strip()[0].isdigit()]
    assert len(rows) == 2 and all(ln.split()[-1] == "-" for ln in rows), text
    assert "Geomean" not in text


# ---------------------------------------------------------------------------------------
# psum_scatter and all_gather (-c)

COLLECTIVES = ["psum_scatter", "all_gather"]
COLL_ALGOS = ["auto"] + list(_select.COLLECTIVE_ALGORITHMS) + ["lax"]


def test_collectives_sweep(tmp_path, capsys):
    """-c psum_scatter,all_gather: every algorithm and lax on exact inputs, results checked,
    nccl-tests' size (the larger side, N whole blocks; -b 1000 rounds down to blocks that
    the kernels pad) and busbw = algbw (N-1)/N, the collective in the JSON rows."""
    needs_devices(2)  # the sweep refuses a group of one device
    n = ndev()
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = bench.main(["-b", "1000", "-e", "4000", "-n", "2", "-w", "1", "-k", "3", "--quiet",
                     "-c", ",".join(COLLECTIVES), "-a", "all", "-d", "float32,bfloat16,uint32",
                     "--json", str(out_json)] + (["--plot", str(out_png)] if PLOT else []))
    text, err = capsys.readouterr()
    assert rc == 0, text
    data = json.loads(out_json.read_text())
    assert data["meta"]["collectives"] == COLLECTIVES
    assert data["meta"]["benchmark"] == "psum_scatter, all_gather"
    rows = data["results"]
    dtypes = ("float32", "bfloat16", "uint32")
    got = {(r["collective"], r["dtype"], r["algorithm"], r["op"]) for r in rows}
    assert got == {(c, d, a, "sum" if c == "psum_scatter" else "none")
                   for c in COLLECTIVES for d in dtypes for a in COLL_ALGOS}
    assert len(rows) == len(got) * 2  # two sizes
    for r in rows:
        item = jnp.dtype(r["dtype"]).itemsize
        assert r["error"] is None, r
        assert r["wrong"] == 0 and r["wrong_chain"] == 0, r
        assert r["chain_step"] == "restore" and r["nranks"] == n
        assert r["count"] % n == 0 and r["size"] == r["count"] * item
        block = r["count"] // n
        assert block in (1000 // (item * n), 4000 // (item * n)), r
        assert (r["auto_choice"] is not None) == (r["algorithm"] == "auto")
        if r["algorithm"] == "auto":
            assert r["auto_choice"] in _select.COLLECTIVE_ALGORITHMS + (_select.XLA_FALLBACK,)
        if r["time_us"] > 0:
            algbw = r["size"] / (r["time_us"] * 1e-6) / 1e9
            assert r["algbw"] == pytest.approx(algbw)
            assert r["busbw"] == pytest.approx(algbw * (n - 1) / n)

    # the text: nccl-tests' columns, one labelled table per (collective, dtype)
    for col in ("size", "count", "type", "redop", "algo", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)", "#wrong", "wall(us)", "vs_lax"):
        assert col in text
    assert "psum_scatter, all_gather benchmark" in text
    assert "busbw = algbw (N-1)/N" in text and "step restore" in text
    assert text.count("# psum_scatter\n") == text.count("# all_gather\n") == len(dtypes)
    assert "# Wrong values        : 0 OK" in text
    avg = [ln for ln in text.splitlines() if ln.startswith("# Avg bus bandwidth")]
    assert sorted(ln.split("(")[-1] for ln in avg) == sorted(f"{c} {a})" for c in COLLECTIVES
                                                             for a in COLL_ALGOS)
    data_lines = [ln.split() for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(data_lines) == len(rows)
    # a row as printed: size count type redop algo | time algbw busbw #wrong | wall vs_lax
    for cells, r in zip(data_lines, rows):
        assert cells[:5] == [str(r["size"]), str(r["count"]), r["dtype"], r["op"], r["algorithm"]]
        assert cells[9] == "0"
        if r["time_us"] > 0:
            assert cells[7:9] == [f"{r['algbw']:.2f}", f"{r['busbw']:.2f}"]
    if PLOT:
        assert out_png.stat().st_size > 0


def test_collectives_with_all_reduce(capsys):
    """-c all: the all-reduce tables keep -o's ops and chain step; psum_scatter sums and
    all_gather has no op; the footer names the collective of every other row."""
    needs_devices(2)  # the sweep refuses a group of one device
    rc = bench.main(TINY + ["-e", "1K", "-c", "all", "-o", "sum,max", "-a", "auto,lax"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "all-reduce, psum_scatter, all_gather benchmark" in text
    assert "step auto, restore" in text
    rows = [ln.split() for ln in text.splitlines() if ln.strip() and ln.strip()[0].isdigit()]
    assert [(r[3], r[4]) for r in rows] == [("sum", "auto"), ("sum", "lax"), ("max", "auto"),
                                            ("max", "lax"), ("sum", "auto"), ("sum", "lax"),
                                            ("none", "auto"), ("none", "lax")]
    avg = {ln.split("(")[-1] for ln in text.splitlines() if ln.startswith("# Avg bus bandwidth")}
    assert avg == {f"{c}{a})" for c in ("", "psum_scatter ", "all_gather ")
                   for a in ("auto", "lax")}
    assert "(all_reduce" not in text


def test_collective_wrong_results_fail(monkeypatch, capsys):
    needs_devices(2)  # the sweep refuses a group of one device
    # psum_scatter's reference off by one: every element of every device is reported wrong
    true_reference = _bench_inputs.reference
    monkeypatch.setattr(_bench_inputs, "reference", lambda v, op: true_reference(v, op) + 1)
    rc = bench.main(TINY + ["-e", "1K", "-c", "psum_scatter", "-a", "ring"])
    text = capsys.readouterr().out
    assert rc == 1
    size = 1024 // (4 * ndev()) * 4 * ndev()  # N whole blocks of float32 (1020 bytes over 3)
    row = next(ln for ln in text.splitlines() if ln.split() and ln.split()[0] == str(size))
    assert row.split("|")[1].split()[3] == str(size // 4)  # every element wrong
    assert "FAILED" in text


def test_collective_flags(capsys):
    args = bench.parse_args(["-c", "psum_scatter", "-a", "all"])
    assert args.collective == ["psum_scatter"]
    assert args.algorithm == ["auto", "ring", "one_shot", "lax"]
    args = bench.parse_args(["-c", "all", "-a", "all"])
    assert args.collective == ["all_reduce", "psum_scatter", "all_gather"]
    assert args.algorithm == list(bench.ALGO_CHOICES)
    assert bench.collective_algorithms(args, "all_gather") == ["auto", "ring", "one_shot", "lax"]
    assert bench.parse_args([]).collective == ["all_reduce"]
    assert bench.parse_args(["-c", "all_gather", "-a", "one_shot,ring"]).algorithm == \
        ["one_shot", "ring"]
    for bad, msg in (
            (["-c", "psum_scatter", "-a", "auto,tree"],
             "-a/--algorithm tree: psum_scatter takes only auto, one_shot, ring, lax"),
            (["-c", "all_reduce,all_gather", "-a", "two_shot"],
             "-a/--algorithm two_shot: all_gather takes only auto, one_shot, ring, lax"),
            (["-c", "all_gather", "-a", "butterfly"], "butterfly: expected a comma list"),
            (["-c", "reduce_scatter"], "reduce_scatter: expected a comma list of all_reduce, "
                                       "psum_scatter, all_gather"),
            (["-c", "psum_scatter", "-o", "max"], "-o/--op is all_reduce's"),
            (["-c", "all_gather", "--chain-step", "slice"], "--chain-step is all_reduce's")):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert msg in capsys.readouterr().err, bad


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("algorithm", ["lax", "ring"])
def test_collective_chain_runs_every_op_at_full_size(collective, algorithm):
    """The chain of K times the op compiles to K ops of the full size, each on the previous
    one's result (XLA neither drops nor narrows one whose result feeds only element 0)."""
    needs_devices(2)  # XLA drops a collective over one device
    n, k, block = ndev(), 4, 256
    mesh = mesh_1d()
    chain = _bench_measure.build_chain(
        mesh, _bench_measure.collective_fn(collective, "sum", algorithm), k, "restore")
    inp = _bench_inputs.make_collective_inputs(collective, n, block, "float32", seed=1)
    x, corr = jnp.asarray(inp.x.reshape(-1)), jnp.asarray(inp.corr.reshape(-1))
    hlo = chain.lower(x, corr).compile().as_text()
    small = block if collective == "psum_scatter" else n * block
    if algorithm == "lax":
        op = "reduce-scatter(" if collective == "psum_scatter" else "all-gather("
        calls = [ln for ln in hlo.splitlines() if op in ln]
    else:
        calls = [ln for ln in hlo.splitlines() if "custom-call(" in ln and "jax_gin" in ln]
    assert len(calls) == k, hlo
    assert all(f"f32[{small}]" in ln for ln in calls), calls
    out = np.asarray(chain(x, corr)).reshape(n, -1)
    np.testing.assert_array_equal(out, np.broadcast_to(inp.ref, out.shape))


def test_collectives_two_processes(tmp_path):
    """psum_scatter and all_gather over 2 processes: each process checks its own devices'
    results (device i's block of the sum; every block)."""
    _, recs = _two_processes(tmp_path, ["-b", "4K", "-e", "4K", "-c", "psum_scatter,all_gather",
                                        "-a", "auto,ring,lax"])
    assert {(r["collective"], r["algorithm"]) for r in recs} == {
        (c, a) for c in COLLECTIVES for a in ("auto", "ring", "lax")}
    for r in recs:
        assert r["nranks"] == 8 and r["error"] is None and r["size"] == 4 << 10, r
        assert r["wrong"] == 0 and r["wrong_chain"] == 0, r


def test_footer_flags_rows_whose_time_is_not_positive():
    """A row whose chain of K calls took no longer than one call (noise larger than the op)
    has no bandwidth or ratio; the footer counts such rows, and says nothing where none is."""
    from jax_gin._bench_measure import Record
    from jax_gin._bench_report import footer_lines

    def rec(t):
        return Record(size=4, count=1, dtype="float32", op="sum", algorithm="ring", nranks=8,
                      chain=10, time_us=t)

    for times, want in (([1.0, 2.0], None), ([1.0, -3.0, 0.0], "# Time <= 0           : 2 rows")):
        flagged = [line for line in footer_lines([rec(t) for t in times], check=False)
                   if line.startswith("# Time <= 0")]
        assert (flagged[0].startswith(want) if want else flagged == []), flagged


def test_footer_names_the_sizes_where_auto_ran_xla():
    """auto's rows whose choice was XLA's own collective (its tuning table) are named under the
    table: their vs_lax is XLA against XLA."""
    from jax_gin._bench_measure import Record
    from jax_gin._bench_report import footer_lines

    def rec(size, choice, collective="all_reduce"):
        return Record(size=size, count=size // 4, dtype="float32", op="sum", algorithm="auto",
                      nranks=8, chain=10, time_us=1.0, auto_choice=choice, collective=collective)

    records = [rec(4096, "one_shot"), rec(65536, "xla"), rec(262144, "xla"),
               rec(65536, "xla", "all_gather")]
    named = [line for line in footer_lines(records, check=False) if "auto ran XLA" in line]
    assert named == ["# auto ran XLA's own  : auto float32 at 64K, 256K (no jax_gin call: vs_lax "
                     "there is XLA against XLA)",
                     "# auto ran XLA's own  : all_gather auto float32 at 64K (no jax_gin call: "
                     "vs_lax there is XLA against XLA)"], named
    assert not [line for line in footer_lines(records[:1], check=False) if "auto ran" in line]


@pytest.mark.parametrize("count", ["0", "-2"])
def test_devices_below_one_is_a_usage_error(count, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--devices", count])
    assert info.value.code == 2
    assert f"error: --devices {count}: must be at least 1" in capsys.readouterr().err


def test_invalid_tuning_table_stops_the_sweep(tmp_path, monkeypatch, capsys):
    """A sweep with auto over a group whose tuning table is no valid one stops before any
    measurement, with the file and its problem (auto's rows would all fail)."""
    import jax
    import jax_gin
    from jax_gin import tune
    needs_devices(2)
    path = tmp_path / tune.table_name(jax.devices()[0].device_kind, ndev())
    path.write_text('{"device_kind": "cpu"')
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + ["-e", "1K", "-a", "auto,lax"])
    assert str(e.value).startswith(f"python -m jax_gin.bench: jax_gin: the tuning table {path} "
                                   "is not JSON"), str(e.value)
    assert bench.main(TINY + ["-e", "1K", "-a", "one_shot,lax"]) == 0  # no auto: no table read


@pytest.mark.parametrize("devices", ["0", "9999"])
def test_devices_out_of_range_is_a_usage_error(devices, capsys):
    """--devices below 1 or above the devices present: exit status 2 and the command's name,
    as argparse's usage errors (known only once JAX has its devices, for the second)."""
    with pytest.raises(SystemExit) as info:
        bench.main(TINY + ["--devices", devices])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"python -m jax_gin.bench: error: --devices {devices}:" in err, err
