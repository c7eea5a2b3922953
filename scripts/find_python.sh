# Sourced by setup.sh and check_install.sh: find_python prints a command that runs a
# Python >= 3.12 (jax 0.11.2 needs it), or fails.
find_python() {
  for cand in python3.13 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  # pyenv may keep 3.12 beside an older default python3
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -V -r); do
      echo "env PYENV_VERSION=$v python${v%.*}"; return 0
    done
  fi
  return 1
}
