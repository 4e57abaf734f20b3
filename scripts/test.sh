#!/usr/bin/env bash
# make test (and CI, .ci/run): lint, types, the suite on .venv's torch (2.13.0), then the
# compatibility subset on the range's floor (2.11) and on its newest release (2.15): three
# points of the tested range.
#
# Two things run beside the suite, which is mostly waiting (rendezvous rounds, heartbeat
# timeouts) and leaves a core idle about half the time: the floor's and the newest release's
# side environments are built in the background (scripts/torch_env.py --prefetch), and mypy
# (three minutes on a fresh clone) checks the types. Their results are read after the suite.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
SOURCES=(resilient chaos recipes scripts tests)

"$PY" scripts/torch_env.py floor --prefetch
"$PY" scripts/torch_env.py newest --prefetch
# etcd for the etcd-v2 rendezvous tests, where the machine allows (apt-get and root): a test
# skipped for a reason tests/skipcheck.py does not expect fails the suite
bash scripts/ensure_etcd.sh
"$PY" -m ruff check "${SOURCES[@]}" || exit 1
"$PY" -m ruff format --check "${SOURCES[@]}" || exit 1
.venv/bin/lint-imports || exit 1

types_log=$(mktemp)
trap 'rm -f "$types_log"' EXIT
"$PY" -m mypy >"$types_log" 2>&1 &
types=$!
echo "mypy: checking the types beside the suite (pid $types)"
# Two pytest workers, each test file on one of them (their module fixtures, the shared
# fault-free runs, stay with their tests); then the few tests marked `solo` alone. Three
# workers on two cores were no faster here and failed two retry-budget tests.
"$PY" -m pytest -q -n 2 --dist loadfile -m "not extended and not solo"
suite=$?
"$PY" -m pytest -q -m "solo and not extended" || suite=1
wait "$types"
types_rc=$?
echo "$PY -m mypy"
cat "$types_log"
if [ "$suite" -ne 0 ] || [ "$types_rc" -ne 0 ]; then
  echo "make test: the suite exited $suite, mypy $types_rc"
  exit 1
fi
# the floor and the newest release of the tested range: the compatibility subset on each (99
# tests on two workers: checkpoints, reshard, hot, numeric, supervisor, hang, export,
# pipelines, every private name's check, about 50 s), on the floor after a shortened demo (a
# kill and a bit-exact resume, about 40 s). The newest goes without the demo to keep CI in
# its budget: the subset's supervisor tests kill and resume there too.
"$PY" scripts/torch_env.py floor --subset --untested-if-unbuildable || exit 1
exec "$PY" scripts/torch_env.py newest --subset --no-demo --untested-if-unbuildable
