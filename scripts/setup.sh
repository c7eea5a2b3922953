#!/usr/bin/env bash
# One-step set-up on a fresh machine: a Python >= 3.12 virtual environment in .venv with
# the jax that pyproject.toml builds against and the build tools, then jax_gin built and
# installed (editable) into it.
# The CUDA extension is built too where nvcc exists (against the nvidia-nccl-cu13 wheel), unless
# JAX_GIN_CUDA=OFF (kept in the venv for later runs).
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${JAX_GIN_VENV:-.venv}

. scripts/find_python.sh

# Where no package index is reachable but a system Python already has a jax at least as new as
# pyproject.toml's pin and the build tools (as on a GPU machine with a CUDA-enabled jax), the
# venv is made on top of that Python's site-packages and nothing is downloaded.
system_jax_python() {
  for cand in python3 python3.13 python3.12; do
    command -v "$cand" >/dev/null 2>&1 && "$cand" - <<'PY' 2>/dev/null && { echo "$cand"; return 0; }
import os, re, sys, jax, jaxlib, nanobind, scikit_build_core  # noqa: F401
def version(text):
    return tuple(int(re.match(r"\d+", x)[0]) for x in text.split(".")[:3])
sys.exit(0 if sys.version_info >= (3, 12) and
         version(jax.__version__) >= version(os.environ["JAX_VERSION"]) else 1)
PY
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || { echo "jax_gin needs Python >= 3.12; none found" >&2; exit 1; }
  echo "== creating $VENV with $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  $PY -m venv "$VENV"
fi
P="$VENV/bin/python"
# The versions that pyproject.toml pins, written there once: jax and jaxlib (the build's, the
# oldest supported), the build tools, cmake, and the NCCL of the `cuda` extra.
PINS=$("$P" - <<'PY'
import re, tomllib
t = tomllib.load(open("pyproject.toml", "rb"))
req = {re.match(r"[\w-]+", r)[0]: r for r in t["build-system"]["requires"]}
print(f"export JAX_VERSION={req['jax'].split('==')[1]}")
print(f"BUILD_REQS='{req['scikit-build-core']} {req['nanobind']}'")
print(f"CMAKE_REQ='cmake{t['tool']['scikit-build']['cmake']['version']}'")
print(f"NCCL_REQ='{' '.join(t['project']['optional-dependencies']['cuda'])}'")
PY
)  # (apart from the eval, so that set -e stops at a failure to read them)
eval "$PINS"
# JAX_GIN_CUDA (AUTO, ON or OFF) is kept in the venv: a later run without it (`make test` after
# `JAX_GIN_CUDA=OFF make demo`) builds as the last one did, not the CUDA kernels anew.
if [ -z "${JAX_GIN_CUDA:-}" ] && [ -f "$VENV/jax_gin_cuda" ]; then
  JAX_GIN_CUDA=$(cat "$VENV/jax_gin_cuda")
fi
JAX_GIN_CUDA=$(echo "${JAX_GIN_CUDA:-AUTO}" | tr '[:lower:]' '[:upper:]')  # CMake's own values
export JAX_GIN_CUDA
# With an NVIDIA GPU, JAX's CUDA 13 plugin too, so that the demo and the benchmark run on the GPUs.
JAX_REQ="jax==$JAX_VERSION"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  JAX_REQ="jax[cuda13]==$JAX_VERSION"
fi
# One quick query first, so that a machine without a package index does not wait out pip's
# retries (pip's own index settings apply).
ONLINE=1
"$P" -m pip index versions pip --timeout 5 --retries 0 >/dev/null 2>&1 || ONLINE=
[ -n "$ONLINE" ] && echo "== installing $JAX_REQ and the build tools into $VENV"
if [ -z "$ONLINE" ] || ! { "$P" -m pip install -q --upgrade pip &&
       "$P" -m pip install -q "$JAX_REQ" "jaxlib==$JAX_VERSION" numpy $BUILD_REQS \
         pytest ninja matplotlib; }; then
  SYS=$(system_jax_python) || { echo "pip could not install jax, and no system Python has jax >= $JAX_VERSION with nanobind and scikit-build-core" >&2; exit 1; }
  echo "== no package index: using $SYS's jax $($SYS -c 'import jax; print(jax.__version__)') through a venv with system site-packages"
  rm -rf "$VENV"
  $SYS -m venv --system-site-packages "$VENV"
  # That Python may itself be a venv, whose packages a --system-site-packages venv does not
  # see: a .pth file adds its site directories.
  "$SYS" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
    > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_jax_gin_system_site.pth"
  OFFLINE=1
fi
echo "$JAX_GIN_CUDA" > "$VENV/jax_gin_cuda"  # (after the venv above is final)
if [ -z "${OFFLINE:-}" ]; then
  command -v cmake >/dev/null 2>&1 || "$P" -m pip install -q "$CMAKE_REQ"
  if [ "$JAX_GIN_CUDA" != OFF ] && command -v nvcc >/dev/null 2>&1; then
    # The headers (and library) of the NCCL that JAX's CUDA plugin loads on the GPU machine.
    "$P" -m pip install -q $NCCL_REQ
  fi
fi
# JAX_GIN_SANITIZE (address, thread, undefined): the CPU module under that sanitizer, built in a
# folder of its own so that the default build's objects stay, with debug information and not
# stripped (nanobind strips Release builds), so that reports name functions and lines
# (docs/debugging.md, Sanitizers).
BUILD_DIR=()
[ -n "${JAX_GIN_SANITIZE:-}" ] && BUILD_DIR=(-C "build-dir=build/sanitize-$JAX_GIN_SANITIZE" -C install.strip=false -C cmake.build-type=RelWithDebInfo)
echo "== building jax_gin (JAX_GIN_CUDA=$JAX_GIN_CUDA${JAX_GIN_SANITIZE:+, JAX_GIN_SANITIZE=$JAX_GIN_SANITIZE}; the CUDA kernels take minutes on few cores: JAX_GIN_CUDA=OFF skips them)"
"$P" -m pip install -v ${OFFLINE:+--no-index} --no-build-isolation --no-deps "${BUILD_DIR[@]}" -e . \
  2>&1 | grep -E --line-buffered '^ *\[[0-9]+/[0-9]+\]|rror' || true
# A sanitizer's runtime must be loaded first into the (uninstrumented) Python that imports it.
PRELOAD=
if [ -n "${JAX_GIN_SANITIZE:-}" ]; then
  lib=$(${CXX:-c++} -print-file-name="lib$(echo "$JAX_GIN_SANITIZE" | sed 's/address/asan/;s/thread/tsan/;s/undefined/ubsan/').so")
  # AddressSanitizer's __cxa_throw interceptor finds the real one only if libstdc++ is loaded
  # before the extensions that throw (jaxlib's)
  [ "$JAX_GIN_SANITIZE" = address ] && lib="$lib $(${CXX:-c++} -print-file-name=libstdc++.so)"
  PRELOAD="LD_PRELOAD=$lib"
  echo "== run it with $PRELOAD (docs/debugging.md, Sanitizers)"
fi
env ${PRELOAD:+"$PRELOAD"} ASAN_OPTIONS=detect_leaks=0 "$P" -c "import jax_gin; print('jax_gin', jax_gin.__version__, '| CUDA extension:', jax_gin.has_cuda())"
