#!/usr/bin/env bash
# Create .venv in the checkout and install resilient with its dev extra.
# On machines without CUDA, torch is pinned to the CPU build through constraints-cpu.txt.
# Idempotent: a second run with an unchanged pyproject.toml is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
stamp="$VENV/.installed-$(cat pyproject.toml constraints-cpu.txt | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
constraints=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraints=(-c constraints-cpu.txt)
  echo "setup: no CUDA found, installing the CPU build of torch (constraints-cpu.txt)"
fi
# grep drops this machine's pip-config noise about absent local mirrors; pip's status is kept.
# pip compiles what it installs to bytecode on one core while the other idles; --no-compile, then
# compileall on every core (below) does the same work: a fresh set-up in 166 s instead of 197 s.
pip_install() {
  PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install -q --no-compile "$@" -e ".[dev]" 2>&1 \
    | { grep -v -e "is ignored: it is neither" || true; }
  return "${PIPESTATUS[0]}"
}
if ! pip_install "${constraints[@]}"; then
  [ ${#constraints[@]} -gt 0 ] || exit 1
  # no CPU build on this machine's indexes: PyPI's build of the same release runs on CPU too
  cpu=$(grep -v '^#' constraints-cpu.txt)
  echo "setup: no CPU build ($cpu) found; installing PyPI's ${cpu%+cpu} with its CUDA" \
    "libraries (about 5 GB). For the CPU build: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make setup"
  pip_install -c <(echo "${cpu%+cpu}")
fi
# -qq: a few packages ship files of another Python's syntax (left uncompiled, as pip leaves them)
"$VENV/bin/python" -m compileall -qq -j 0 "$("$VENV/bin/python" -c \
  'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "setup: ready ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
