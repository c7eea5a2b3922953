"""The documentation's Python snippets run as written, the README stays short, and the demo
runs.

Every ```python fenced block of README.md and docs/*.md runs alone in a fresh interpreter,
with cwd the repository root, JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=8, and must exit with status 0.

Marker: a block that is a fragment and cannot run alone (for example one that needs a
jax.distributed coordinator and several processes) starts with the line

    # not run: <why>

and is reported as skipped with that reason. Every other python block is run.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ("README.md",) + tuple(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))
NOT_RUN = re.compile(r"#\s*not run:\s*(\S.*)")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
TIMEOUT_S = 120


def python_blocks(doc: str) -> list:
    """(doc:line, code) of every ```python block of `doc`; line is the fence's, 1-based."""
    text = (ROOT / doc).read_text()
    return [(f"{doc}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1))
            for m in FENCE.finditer(text)]


BLOCKS = [b for doc in DOCS for b in python_blocks(doc)]


README_MAX_LINES = 200  # the README is for users; design and method live in docs/


def test_readme_stays_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"


def test_every_python_fence_is_a_block():
    # the README has snippets, and no ```python fence of a doc escapes FENCE (say, one left
    # unclosed), which would leave its code untested
    assert python_blocks("README.md")
    for doc in DOCS:
        opened = len(re.findall(r"^```python", (ROOT / doc).read_text(), re.M))
        assert len(python_blocks(doc)) == opened, f"{doc}: {opened} ```python fences"


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_snippet_runs(where, code):
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    marker = NOT_RUN.fullmatch(first.strip())
    if marker:
        pytest.skip(f"{where}: not run: {marker.group(1)}")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{where}: still running after {TIMEOUT_S} s\n--- stderr ---\n{e.stderr}")
    assert proc.returncode == 0, (
        f"{where}: exit status {proc.returncode}\n--- code ---\n{code}"
        f"--- stderr ---\n{proc.stderr[-6000:]}")


def test_demo_runs():
    """`make demo`'s script, on the platform the suite runs on (8 CPU devices, or the GPUs
    under JAX_PLATFORMS=cuda): exit status 0, and it says the two all-reduces agree."""
    try:
        proc = subprocess.run([sys.executable, "examples/demo.py"], cwd=ROOT, env=dict(os.environ),
                              capture_output=True, text=True, timeout=2 * TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"examples/demo.py still running after {2 * TIMEOUT_S} s\n{e.stderr}")
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert "all-reduced, bitwise equal: True" in proc.stdout, proc.stdout
