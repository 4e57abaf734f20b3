#!/usr/bin/env bash
# make test (scripts/test.sh) and CI: etcd for tests/test_rdzv_store.py's etcd-v2 tests.
# Installs Debian's etcd-server (3.4: it still serves the v2 API torch's backend speaks) when
# `etcd` is missing and the machine allows it: apt-get there and root. Otherwise it says why
# and changes nothing; the tests then skip, and tests/skipcheck.py fails the suite for it,
# unless the machine names the skip in TEST_EXPECTED_SKIPS. Never fails by itself.
set -uo pipefail
APT_GET=${ETCD_APT_GET:-apt-get}
if command -v etcd >/dev/null 2>&1; then
  echo "ensure-etcd: etcd is here ($(command -v etcd))"
  exit 0
fi
if ! command -v "$APT_GET" >/dev/null 2>&1 || [ "$(id -u)" -ne 0 ]; then
  echo "ensure-etcd: no etcd, and I cannot install etcd here (needs apt-get and root): its" \
    "tests will skip and fail the suite; install etcd 3.4 or 3.5, or run with" \
    "TEST_EXPECTED_SKIPS='no etcd binary'"
  exit 0
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
# the package lists may be stale or absent on a fresh image: update once if the install fails
if "$APT_GET" install -y -q --no-install-recommends etcd-server >"$log" 2>&1 ||
  { "$APT_GET" update -q >>"$log" 2>&1 &&
    "$APT_GET" install -y -q --no-install-recommends etcd-server >>"$log" 2>&1; }; then
  if command -v etcd >/dev/null 2>&1; then
    echo "ensure-etcd: installed etcd ($(etcd --version 2>/dev/null | head -n1))"
    exit 0
  fi
fi
echo "ensure-etcd: installing etcd-server failed; its tests will skip and fail the suite:"
tail -n 5 "$log"
exit 0
