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


# The README is for users: what jax_gin is, the set-up, use, a short API table, settings,
# errors and the results of record. The full API is docs/api.md; design and method live in
# docs/ too. Its lines stay readable (a table row included).
README_MAX_LINES = 175
README_MAX_LINE_CHARS = 300


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    long = [(i + 1, len(s)) for i, s in enumerate(lines) if len(s) > README_MAX_LINE_CHARS]
    assert not long, f"README.md lines over {README_MAX_LINE_CHARS} characters (line, length): {long}"


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


def test_api_tables_name_every_public_name():
    """The README's API table and docs/api.md name every name of `jax_gin.__all__`, as
    `jax_gin.name` or as `name` in a row that starts with another jax_gin name."""
    import jax_gin
    for doc in ("README.md", "docs/api.md"):
        text = (ROOT / doc).read_text()
        missing = [n for n in jax_gin.__all__
                   if f"`jax_gin.{n}" not in text and f"`{n}`" not in text]
        assert not missing, f"{doc} does not name {missing}"


def test_public_names_are_the_api_and_submodules():
    """dir(jax_gin) shows no name without an underscore beyond __all__ and submodules (not,
    say, `annotations` of a `from __future__ import annotations`)."""
    import types

    import jax_gin
    extra = [n for n in dir(jax_gin) if not n.startswith("_") and n not in jax_gin.__all__
             and not isinstance(getattr(jax_gin, n), types.ModuleType)]
    assert not extra, extra


def test_public_functions_have_docstrings():
    import inspect

    import jax_gin
    bare = [n for n in jax_gin.__all__ if inspect.isfunction(getattr(jax_gin, n))
            and not inspect.getdoc(getattr(jax_gin, n))]
    assert not bare, bare


def test_tp_mlp_help_describes_every_option(capsys):
    from helpers import load_example

    tp_mlp = load_example("tp_mlp")
    with pytest.raises(SystemExit) as info:
        tp_mlp.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option, default in (("--batch", 32), ("--d-model", 64), ("--hidden", 256),
                            ("--steps", 5), ("--iters", 20)):
        described = text.split(f"{option} {option.lstrip('-').upper().replace('-', '_')} ")[1]
        assert described.split(" --")[0].endswith(f"(default {default})"), (option, text)
