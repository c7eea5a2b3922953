"""The build's switches: CMake reads JAX_GIN_CUDA in any case, as pip passes it from the
environment, and refuses any other value by name (it was OFF in silence)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _configure(tmp_path, value):
    return subprocess.run(
        ["cmake", "-S", ROOT, "-B", str(tmp_path / value), f"-DJAX_GIN_CUDA={value}",
         f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake")
def test_jax_gin_cuda_values(tmp_path):
    done = _configure(tmp_path, "yes")
    assert done.returncode != 0
    assert "jax_gin: JAX_GIN_CUDA=yes: use AUTO, ON or OFF" in done.stderr, done.stderr
    done = _configure(tmp_path, "off")  # OFF: configures, with no CUDA step at all
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CUDA extension" not in done.stdout, done.stdout
