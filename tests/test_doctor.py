"""python -m jax_gin.doctor: its sections, verdict and exit code on the test devices, and in
subprocesses with an invalid setting and with NCCL_NVLS_ENABLE=1 on CPU."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import pytest

import jax_gin
from jax_gin import doctor
from jax_gin._select import COLLECTIVE_ALGORITHMS
from conftest import ndev
from helpers import join_fails

SECTIONS = {"versions", "devices", "nccl", "settings", "tuning", "self-test", "verdict"}


def _section(text: str, title: str) -> list:
    """The lines of the section whose title starts with `title`, up to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title))
    end = lines.index("", start)
    return lines[start + 1:end]


def _doctor_subprocess(**env) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", **env}
    return subprocess.run([sys.executable, "-m", "jax_gin.doctor", "--quick"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_pass(tmp_path, capsys):
    path = tmp_path / "doctor.json"
    rc = doctor.main(["--quick", "--json", str(path)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.rstrip().splitlines()[-1] == "PASS"
    rows = _section(text, "self-test")[1:]  # after the column header
    # every algorithm, auto, and auto with overlap=True, at one size; then psum_scatter and
    # all_gather with each of theirs
    psum_rows, coll_rows = rows[:len(jax_gin.ALGORITHMS) + 2], rows[len(jax_gin.ALGORITHMS) + 2:]
    for algo, row in zip(jax_gin.ALGORITHMS + ("auto", "auto"), psum_rows):
        assert row.split()[0] == algo and row.split()[-3] == "ok", row
    assert "overlap" in psum_rows[-1]
    assert [row.split()[:2] for row in coll_rows] == [
        [api, algo] for api in ("psum_scatter", "all_gather") for algo in COLLECTIVE_ALGORITHMS], text
    assert all(row.split()[-3] == "ok" for row in coll_rows), text
    settings = "\n".join(_section(text, "settings"))
    assert "timeout_s" in settings and "JAX_GIN_TIMEOUT_S" in settings

    data = json.loads(path.read_text())
    assert set(data) == SECTIONS
    assert data["verdict"] == {"result": "PASS", "problems": []}
    assert data["devices"]["count"] == ndev()
    assert data["settings"]["timeout_s"]["env"] == "JAX_GIN_TIMEOUT_S"
    assert all(row["ok"] for row in data["self-test"]["rows"])


def test_the_sample_in_debugging_md_is_the_output(monkeypatch, capsys):
    """docs/debugging.md shows `python -m jax_gin.doctor --quick` on 8 CPU devices: the same
    lines, but for the python, jax and jaxlib versions and the timings."""
    if ndev() != 8 or jax.devices()[0].platform != "cpu" or jax_gin.has_cuda() or \
            any(k.startswith("JAX_GIN_") for k in os.environ):
        pytest.skip("the sample is of 8 CPU devices, a build without CUDA, no JAX_GIN_* variable")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)  # unset in the sample
    doc = (Path(__file__).parents[1] / "docs" / "debugging.md").read_text()
    sample = doc.split("On 8 CPU devices (`--quick`: one size, one run):\n\n```\n", 1)[1]
    sample = sample.split("```", 1)[0]
    assert doctor.main(["--quick"]) == 0

    def shape(text):
        lines = []
        for line in text.rstrip().splitlines():
            words = line.split()
            if words[:1] in (["python"], ["jax"], ["jaxlib"]):
                line = words[0]
            elif len(words) > 3 and words[-3] == "ok":  # a self-test row: its two timings aside
                line = " ".join(words[:-2])
            lines.append(line)
        return lines
    assert shape(sample) == shape(capsys.readouterr().out)


def test_fail_names_each_problem(monkeypatch, capsys):
    # An invalid variable set after import, and a psum that is off by one: both are named.
    monkeypatch.setenv("JAX_GIN_RECORD", "2")
    monkeypatch.setattr(jax_gin, "psum", lambda x, axis, **kw: jax.lax.psum(x, axis) + 1)
    rc = doctor.main(["--quick", "--sizes", "4K"])
    text = capsys.readouterr().out
    assert rc == 1, text
    psum_rows = _section(text, "self-test")[1:len(jax_gin.ALGORITHMS) + 3]
    assert all(row.split()[-3] == "WRONG" for row in psum_rows), text
    verdict = text.rstrip().split("\n\n")[-1]
    assert "FAIL: a setting is invalid: JAX_GIN_RECORD='2'" in verdict
    assert "fix: correct or unset JAX_GIN_RECORD" in verdict
    assert "FAIL: psum with algorithm ring at 4K per device differs from lax.psum" in verdict
    assert "PASS" not in verdict


def test_one_device_says_so(capsys):
    doctor.check_devices(doctor.Report(), jax.devices()[:1], gpu=False)
    text = capsys.readouterr().out
    assert "collectives are trivial with one device" in text
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in text


def test_gpu_checks(monkeypatch, capsys):
    # The GPU-only checks, with a stand-in CUDA module and device: an NCCL loaded at run time
    # that differs from the headers, and NVLink multicast left on, each fail with their fix.
    monkeypatch.setattr(doctor._native, "cuda", types.SimpleNamespace(
        nccl_version=lambda: 22900, nccl_header_version=lambda: 22809))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    gpu = types.SimpleNamespace(client=types.SimpleNamespace(platform_version="cuda 13000"))
    r = doctor.Report()
    doctor.check_versions(r, gpu)
    doctor.check_nccl(r, gpu=True)
    assert "NCCL             2.29.0 loaded, 2.28.9 headers" in capsys.readouterr().out
    assert r.problems == [
        {"problem": "NCCL loaded 2.29.0 differs from the headers 2.28.9 jax_gin was built against",
         "fix": "rebuild jax_gin against the loaded NCCL"},
        {"problem": "NCCL_NVLS_ENABLE=1 on a GPU backend (NVLink multicast must stay off)",
         "fix": "set NCCL_NVLS_ENABLE=0 before importing jax"}]


def test_invalid_environment_fails():
    # `import jax_gin` fails on an invalid variable, naming it; `python -m jax_gin.doctor`
    # runs all the same (that setting at its default) and names each one in its verdict.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_GIN_TIMEOUT_S": "abc"}
    done = subprocess.run([sys.executable, "-c", "import jax_gin"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "ValueError: jax_gin: JAX_GIN_TIMEOUT_S='abc': must be" \
        in done.stderr, done.stderr
    done = _doctor_subprocess(JAX_GIN_TIMEOUT_S="abc", JAX_GIN_RECORD="yes please")
    assert done.returncode == 1, done.stdout + done.stderr
    verdict = done.stdout.rstrip().split("\n\n")[-1]
    assert "FAIL: a setting is invalid: JAX_GIN_TIMEOUT_S='abc': must be a positive finite " \
        "number of seconds" in verdict, done.stdout
    assert "fix: correct or unset JAX_GIN_RECORD" in verdict, done.stdout
    assert "timeout_s                  30.0" in done.stdout, done.stdout  # the default
    rows = _section(done.stdout, "self-test")[1:]
    assert rows and all(row.split()[-3] == "ok" for row in rows), done.stdout


def test_variables_no_setting_reads(monkeypatch, capsys):
    # a typo of a setting's variable is named with the setting meant; a build variable, or
    # one far from every setting, is named alone; neither fails the check
    monkeypatch.setenv("JAX_GIN_TIMEOUT", "5")
    monkeypatch.setenv("JAX_GIN_CUDA", "OFF")
    for name in [n for n in os.environ if n.startswith("JAX_GIN_")]:  # the test's own only
        if name not in ("JAX_GIN_TIMEOUT", "JAX_GIN_CUDA"):
            monkeypatch.delenv(name)
    assert doctor.unknown_variables() == {"JAX_GIN_CUDA": None,
                                          "JAX_GIN_TIMEOUT": "JAX_GIN_TIMEOUT_S"}
    r = doctor.Report()
    doctor.check_settings(r, {}, None)
    out = capsys.readouterr().out
    assert "JAX_GIN_TIMEOUT is set but is no setting, so nothing reads it at run time (did you " \
           "mean JAX_GIN_TIMEOUT_S?)" in out, out
    assert "JAX_GIN_CUDA is set but is no setting, so nothing reads it at run time\n" in out, out
    assert r.problems == []
    assert r.facts["settings"]["not_settings"] == {"JAX_GIN_CUDA": None,
                                                   "JAX_GIN_TIMEOUT": "JAX_GIN_TIMEOUT_S"}


def test_tuning_dir_that_is_no_directory(monkeypatch, capsys, tmp_path):
    # named, not a failure (python -m jax_gin.tune creates it)
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path / "tables"))
    r = doctor.Report()
    doctor.check_settings(r, {}, None)
    out = capsys.readouterr().out
    assert f"tuning_dir {str(tmp_path / 'tables')!r} is no directory, so auto reads no table " \
           "there" in out, out
    assert r.problems == []


def test_invalid_tuning_table_fails(monkeypatch, capsys, tmp_path):
    """A tuning table auto would read that is no valid one: the tuning section names it, the
    verdict fails with the file and its problem, and the self-test runs every named algorithm
    but not auto (whose calls would all raise that error)."""
    from jax_gin import tune
    if ndev() < 2:
        pytest.skip("a group of one rank reads no table")
    path = tmp_path / tune.table_name(jax.devices()[0].device_kind, ndev())
    path.write_text("[1, 2]")
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    rc = doctor.main(["--quick", "--sizes", "4K"])
    text = capsys.readouterr().out
    assert rc == 1, text
    assert f"  all_reduce    {path}: invalid" in _section(text, "tuning"), text
    assert f"FAIL: the tuning table {path} holds a JSON list, not an object" in text, text
    rows = _section(text, "self-test")
    assert "  auto: not run (its tuning table is invalid: tuning, above)" in rows, text
    algos = [row.split()[0] for row in rows[2:]]
    assert algos[:len(jax_gin.ALGORITHMS)] == list(jax_gin.ALGORITHMS) and "auto" not in algos
    assert text.count("FAIL:") == 1, text


def test_tuning_names_each_collectives_table(monkeypatch, capsys, tmp_path):
    """The table each collective's auto reads: JAX_GIN_TUNING_DIR's before jax_gin's own, with
    its date; none where no file exists."""
    import json
    from jax_gin import tune
    if ndev() < 2:
        pytest.skip("a group of one rank reads no table")
    kind, n = jax.devices()[0].device_kind, ndev()
    table = {"device_kind": kind, "nranks": n, "collective": "all_gather",
             "measured": "2026-12-05T10:00:00", "entries": [{"max_bytes": 1, "algorithm": "ring"}]}
    path = tmp_path / tune.table_name(kind, n, "all_gather")
    path.write_text(json.dumps(table))
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    r = doctor.Report()
    assert doctor.check_tuning(r, jax.devices()) == dict.fromkeys(
        ("all_reduce", "psum_scatter", "all_gather"), True)
    lines = capsys.readouterr().out.splitlines()
    assert f"  all_gather    {path}, measured 2026-12-05" in lines, lines
    assert f"  psum_scatter  none for {kind} x {n}: a rule of message sizes decides " \
           "(jax_gin.explain)" in lines
    assert r.facts["tuning"]["all_gather"] == {"path": str(path), "measured": table["measured"]}
    assert r.problems == []


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on GPUs NCCL_NVLS_ENABLE=1 fails")
def test_nvls_is_only_reported_on_cpu():
    done = _doctor_subprocess(NCCL_NVLS_ENABLE="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NCCL_NVLS_ENABLE 1 (reported only: CPU backend)" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == "PASS"


def test_two_processes_pass():
    """The self-test spans both processes of a job; each compares the shards it holds."""
    from multiproc import clean_env, free_port
    port = free_port()
    env = clean_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jax_gin.doctor", "--quick", "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for i, out in enumerate(outs):
        assert out.rstrip().splitlines()[-1] == "PASS", out
        assert "psum_scatter ring" in out and "all_gather one_shot" in out, out
        # the wait for the others is said before it starts (a peer that never comes: JAX
        # ends the process after bench.JOIN_TIMEOUT_S)
        assert (f"process {i} of 2: joining the job at 127.0.0.1:{port}; JAX ends this process "
                f"if the others have not joined within 60 s") in out, out


def test_two_processes_of_unlike_sizes_pass():
    """Processes that hold different numbers of devices (1 and 2): the self-test puts each
    process's shards and sums the wrong values through the key-value store (jax.device_put
    and JAX's process_allgather compare arrays shaped by the local device count)."""
    from multiproc import clean_env, free_port
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jax_gin.doctor", "--quick", "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i)],
        env=clean_env(JAX_PLATFORMS="cpu",
                      XLA_FLAGS=f"--xla_force_host_platform_device_count={i + 1}"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:
        assert out.rstrip().splitlines()[-1] == "PASS", out


def test_join_error_names_the_job(monkeypatch, capsys):
    """Where jax.distributed.initialize raises, the doctor's verdict is a FAIL that names the
    job and says how to start its processes."""
    with join_fails(monkeypatch):
        rc = doctor.main(["--quick", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
                          "--process-id", "1"])
    out = capsys.readouterr().out
    assert rc == 1
    assert ("FAIL: process 1 of 2 could not join the job at 127.0.0.1:1 (UNKNOWN: Failed to "
            "start RPC server)\n  fix: start every process with the same --coordinator") in out, out


def test_settings_that_differ_across_processes():
    """Two processes of one job (--coordinator), whose workspaces differ: the doctor fails in
    both, and each names the difference."""
    from multiproc import clean_env, free_port
    port = free_port()
    procs = []
    for i, ws in enumerate((1 << 20, 2 << 20)):
        env = clean_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                        JAX_GIN_WORKSPACE_BYTES=str(ws), JAX_GIN_TIMEOUT_S="3")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jax_gin.doctor", "--quick", "--coordinator",
             f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=150)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs
    assert "JAX_GIN_WORKSPACE_BYTES=2097152 here but 1048576 in process 0" in outs[1], outs[1]
    assert "JAX_GIN_WORKSPACE_BYTES=1048576 here but 2097152 in process 1" in outs[0], outs[0]
    assert "FAIL:" in outs[0] and "FAIL:" in outs[1]


def test_fix_fits_the_error(monkeypatch, capsys):
    """A FAIL row's fix follows its exception: jax_gin's ValueError its own remedy, a timeout
    the timeout's reading, a stopped communicator the first failure."""
    def psum(x, axis, **kw):
        raise ValueError("jax_gin.psum: workspace too small: 64 bytes per rank cannot hold "
                         "one round; raise JAX_GIN_WORKSPACE_BYTES or jax_gin.runtime.settings")
    monkeypatch.setattr(jax_gin, "psum", psum)
    rc = doctor.main(["--quick", "--sizes", "4K"])
    verdict = capsys.readouterr().out.rstrip().split("\n\n")[-1]
    assert rc == 1
    assert "fix: as the error says: raise JAX_GIN_WORKSPACE_BYTES or jax_gin.runtime.settings" \
        in verdict
    # the psum rows raised the same error: one problem that counts them
    n = len(jax_gin.ALGORITHMS) + 2  # each algorithm, auto, and auto with overlap=True
    assert verdict.count("FAIL: psum") == 1 and verdict.count("fix: as the error says") == 1
    assert (f"FAIL: psum with algorithm ring at 4K per device raised an error (self-test above), "
            f"and so did {n - 1} more self-test calls with the same error") in verdict
    assert "timed-out" not in verdict
    assert doctor._fix(RuntimeError("jax_gin psum (ring) on CPU: rank 1 timed out after 1 s "
                                    "waiting for peer 0")) == doctor.TIMEOUT_FIX
    assert "first failure above" in doctor._fix(RuntimeError(
        "jax_gin: this communicator stopped after an earlier failure and cannot be reused: "
        "... timed out ..."))
    assert "setting or argument" in doctor._fix(ValueError("jax_gin.psum: bad axis"))
    assert "report it" in doctor._fix(TypeError("something else"))
    assert doctor._fix(ValueError(  # _distributed.check_same_settings's
        "jax_gin: the CPU communicator ...: the processes of a group must use the same "
        "settings, and JAX_GIN_WORKSPACE_BYTES=1048576 here but 8388608 in process 0; "
        "JAX_GIN_RECORD_ENTRIES=64 here but 128 in process 0. Set them alike in every process "
        "(they decide ...).")) == ("set JAX_GIN_RECORD_ENTRIES, JAX_GIN_WORKSPACE_BYTES alike "
                                   "in every process")


def test_json_path_checked_first(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        doctor.main(["--quick", "--json", str(tmp_path / "nodir" / "d.json")])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert "nodir" in captured.err and "does not exist" in captured.err
    assert "self-test" not in captured.out  # refused before the run


@pytest.mark.parametrize("sizes", ["6,10", "2", "1K,3"])
def test_sizes_of_whole_float32_elements(sizes, capsys):
    """The self-test moves float32: a size that is not a multiple of 4 bytes is refused, not
    rounded down in silence."""
    with pytest.raises(SystemExit) as info:
        doctor.main(["--quick", "--sizes", sizes])
    assert info.value.code == 2
    assert "each a multiple of 4 bytes (whole float32 elements)" in capsys.readouterr().err


def test_invalid_table_of_another_collective_keeps_psums_auto(monkeypatch, capsys, tmp_path):
    """An invalid all_gather table fails the verdict, but the self-test's auto, psum's, reads
    the all-reduce's table and runs."""
    from jax_gin import tune
    if ndev() < 2:
        pytest.skip("a group of one rank reads no table")
    path = tmp_path / tune.table_name(jax.devices()[0].device_kind, ndev(), "all_gather")
    path.write_text("{}")
    monkeypatch.setattr(jax_gin.runtime.settings, "tuning_dir", str(tmp_path))
    rc = doctor.main(["--quick", "--sizes", "4K"])
    text = capsys.readouterr().out
    assert rc == 1 and f"FAIL: the tuning table {path} has device_kind None" in text, text
    algos = [row.split()[0] for row in _section(text, "self-test")[2:]]
    assert algos.count("auto") == 2, text  # auto, and auto with overlap=True
