"""The build's switches: CMake reads JAX_GIN_CUDA in any case, as pip passes it from the
environment (empty as AUTO), and refuses any other value by name (it was OFF in silence)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _configure(tmp_path, value):
    return subprocess.run(
        ["cmake", "-S", ROOT, "-B", str(tmp_path / (value or "empty")), f"-DJAX_GIN_CUDA={value}",
         f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, timeout=300)


def _version(text):
    return tuple(int(v) for v in re.findall(r"\d+", text)[:2])


def _configure_skip_reason():
    """Why CMake cannot configure jax_gin here: no cmake, one older than CMakeLists.txt asks,
    or no nanobind in this Python (an install built in pip's isolated environment)."""
    if shutil.which("cmake") is None:
        return "no cmake"
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        need = re.search(r"cmake_minimum_required\(VERSION ([\d.]+)\)", f.read())[1]
    found = subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout.split()[2]
    if _version(found) < _version(need):
        return f"cmake {found} is older than {need}"
    if subprocess.run([sys.executable, "-m", "nanobind", "--cmake_dir"],
                      capture_output=True).returncode != 0:
        return "no nanobind in this Python"
    return None


_SKIP_CONFIGURE = _configure_skip_reason()  # (two subprocesses: run once, at collection)


@pytest.mark.skipif(_SKIP_CONFIGURE is not None, reason=str(_SKIP_CONFIGURE))
def test_jax_gin_cuda_values(tmp_path):
    done = _configure(tmp_path, "yes")
    assert done.returncode != 0
    assert "jax_gin: JAX_GIN_CUDA=yes: use AUTO, ON or OFF" in done.stderr, done.stderr
    done = _configure(tmp_path, "off")  # OFF: configures, with no CUDA step at all
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CUDA extension" not in done.stdout, done.stdout
    done = _configure(tmp_path, "")  # empty (JAX_GIN_CUDA= in pip's environment): AUTO
    assert done.returncode == 0, done.stdout + done.stderr
    assert "jax_gin: not building the CUDA extension" in done.stdout or \
        "jax_gin: building the CUDA extension" in done.stdout, done.stdout


def test_unbuilt_source_tree_is_named(tmp_path):
    """A jax_gin folder without its built module, first on the path (Python run from the
    repository's root, over an installed jax_gin), says so; Python's own error blamed "most
    likely a circular import"."""
    shutil.copytree(os.path.join(ROOT, "jax_gin"), tmp_path / "jax_gin",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # an editable install's finder would find the real package first: take it out
    code = ("import sys; sys.meta_path = [f for f in sys.meta_path "
            "if 'editable' not in type(f).__module__]; import jax_gin")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 1
    assert (f"ImportError: jax_gin's CPU extension (_jax_gin) is not built in "
            f"{tmp_path / 'jax_gin'}: a source tree without a build") in done.stderr, done.stderr
