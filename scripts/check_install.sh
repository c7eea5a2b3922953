#!/usr/bin/env bash
# Installs jax_gin the way pip does by default (isolated builds) into fresh virtual
# environments and checks that it imports and reduces, against the oldest and the newest jax
# that pyproject.toml's dependency range allows. CPU module only (JAX_GIN_CUDA=OFF).
#
#   1. `python -m build`: an sdist, then a wheel built from that sdist.
#   2. venv "oldest": the range's lower bounds of jax and jaxlib, then `pip install <repo>`.
#   3. venv "newest": `pip install <the wheel of 1>`; pip resolves jax and jaxlib to the
#      newest releases in the range.
# Each venv runs `import jax_gin` and a psum over 2 CPU devices, checked against the sum.
#
#   bash scripts/check_install.sh            # PYTHON=python3.13 picks the interpreter
#
# Uses pip's cache where the index allows it; every build is fresh (its own build folder).
# Work files go to a temporary folder, removed at exit unless KEEP=1. Prints each step's time.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export JAX_GIN_CUDA=OFF
export PIP_DISABLE_PIP_VERSION_CHECK=1
# No bytecode compilation on install, here and in the isolated build environments (which
# inherit the variable): half of each jax + jaxlib + scipy install.
export PIP_COMPILE=0

. "$REPO/scripts/find_python.sh"
PY=${PYTHON:-$(find_python)} || { echo "check_install: needs Python >= 3.12" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/jax_gin_check.XXXXXX")
if [ -z "${KEEP:-}" ]; then trap 'rm -rf "$WORK"' EXIT; else echo "work files: $WORK"; fi
cd "$WORK"  # not the repository, whose jax_gin/ would shadow the installed package
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { print b - a }'; }
T0=$(date +%s.%N)

# step NAME LOG COMMAND...: runs COMMAND with its output in $WORK/LOG; prints the time, and
# the log's tail on failure.
step() {
  local name=$1 log=$WORK/$2 t=$(date +%s.%N) rc=0
  shift 2
  "$@" >"$log" 2>&1 || rc=$?
  printf '%-58s %6.1f s\n' "$name" "$(since "$t")"
  if [ $rc -ne 0 ]; then
    echo "FAILED (exit $rc): $*" >&2; tail -n 40 "$log" >&2; exit $rc
  fi
}

# jax==X jaxlib==Y from the lower bounds of pyproject.toml's dependencies.
OLDEST=$($PY - "$REPO/pyproject.toml" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
pins = []
for name in ("jax", "jaxlib"):
    spec = next(d for d in deps if re.match(rf"{name}\s*[<>=!~]", d))
    pins.append(f"{name}=={re.search(r'>=\s*([0-9][^,\s]*)', spec).group(1)}")
print(" ".join(pins))
EOF
)

cat >"$WORK/psum_check.py" <<'EOF'
import os
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, jaxlib, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_gin
assert not jax_gin.has_cuda()
mesh = Mesh(np.array(jax.devices()), ("d",))
f = jax.jit(jax.shard_map(lambda x: jax_gin.psum(x, "d", algorithm="ring"),
                          mesh=mesh, in_specs=P("d"), out_specs=P()))
x = np.arange(8, dtype=np.float32)
got = np.asarray(f(x))
np.testing.assert_array_equal(got, x[:4] + x[4:])
print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}: import jax_gin and a psum on 2 CPU devices work")
EOF

echo "check_install: $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])'), JAX_GIN_CUDA=OFF"

# 1. sdist and wheel
step "build: venv with the build package" build-venv.log \
  bash -c "$PY -m venv '$WORK/buildvenv' && '$WORK/buildvenv/bin/pip' install build"
step "build: python -m build (sdist, then wheel from the sdist)" build.log \
  "$WORK/buildvenv/bin/python" -m build --outdir "$WORK/dist" "$REPO"
WHEEL=$(ls "$WORK"/dist/jax_gin-*.whl)
echo "  $(cd "$WORK/dist" && echo *)"

check_venv() {  # NAME: import jax_gin, then the psum
  step "$1: import jax_gin" "$1-import.log" "$WORK/$1/bin/python" -c "import jax_gin"
  step "$1: psum on 2 CPU devices" "$1-psum.log" "$WORK/$1/bin/python" "$WORK/psum_check.py"
  echo "  $(tail -n 1 "$WORK/$1-psum.log")"
}

# 2. oldest supported jax, pip install <repo> with build isolation
step "oldest: venv with $OLDEST" oldest-venv.log \
  bash -c "$PY -m venv '$WORK/oldest' && '$WORK/oldest/bin/pip' install $OLDEST"
step "oldest: pip install <repo> (isolated build)" oldest-install.log \
  "$WORK/oldest/bin/pip" install -C "build-dir=$WORK/build-oldest" "$REPO"
check_venv oldest

# 3. newest supported jax, the wheel of step 1
step "newest: venv" newest-venv.log $PY -m venv "$WORK/newest"
step "newest: pip install <wheel> (newest jax in range)" newest-install.log \
  "$WORK/newest/bin/pip" install "$WHEEL"
check_venv newest

printf 'check_install: both venvs checked in %.0f s\n' "$(since "$T0")"
echo "check_install: 2 passed, 0 failed"
