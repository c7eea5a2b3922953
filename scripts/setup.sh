#!/usr/bin/env bash
# One-step set-up on a fresh machine: a Python >= 3.12 virtual environment in .venv with
# jax 0.11.2 and the build tools, then jax_gin built and installed (editable) into it.
# The CUDA extension is built too where nvcc exists (against the nvidia-nccl-cu13 wheel).
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${JAX_GIN_VENV:-.venv}

find_python() {
  for cand in python3.13 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  # pyenv keeps 3.12 beside an older default on the CPU machines (findings.md).
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -V -r); do
      echo "env PYENV_VERSION=$v python${v%.*}"; return 0
    done
  fi
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || { echo "jax_gin needs Python >= 3.12 (jax 0.11.2); none found" >&2; exit 1; }
  echo "== creating $VENV with $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  $PY -m venv "$VENV"
fi
P="$VENV/bin/python"
"$P" -m pip install -q --upgrade pip
# With an NVIDIA GPU, JAX's CUDA 13 plugin too, so that the demo and the benchmark run on the GPUs.
JAX_REQ="jax==0.11.2"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  JAX_REQ="jax[cuda13]==0.11.2"
fi
"$P" -m pip install -q "$JAX_REQ" "jaxlib==0.11.2" numpy nanobind "scikit-build-core>=0.10" \
  pytest ninja matplotlib
command -v cmake >/dev/null 2>&1 || "$P" -m pip install -q "cmake>=3.24"
if command -v nvcc >/dev/null 2>&1; then
  # The headers (and library) of the NCCL that JAX's CUDA plugin loads on the GPU machine.
  "$P" -m pip install -q "nvidia-nccl-cu13==2.28.9"
fi
echo "== building jax_gin (JAX_GIN_CUDA=${JAX_GIN_CUDA:-AUTO})"
"$P" -m pip install -q --no-build-isolation --no-deps -e .
"$P" -c "import jax_gin; print('jax_gin', jax_gin.__version__, '| CUDA extension:', jax_gin.has_cuda())"
