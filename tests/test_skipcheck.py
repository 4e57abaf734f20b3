"""The suite fails on a skip nobody expected (tests/skipcheck.py), and scripts/ensure_etcd.sh
installs etcd where the machine allows. Each runs a small pytest or the script in a
subprocess, under a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ENSURE = TESTS.parent / "scripts" / "ensure_etcd.sh"

CASES = """
import pytest

def test_runs():
    pass

def test_needs_etcd():
    pytest.skip("no etcd binary (Debian: apt-get install etcd-server)")

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_gpu():
    pass
"""


def _pytest(tmp: Path, *select: str, expected: str = "") -> tuple[int, str]:
    (tmp / "test_cases.py").write_text(CASES)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "TEST_EXPECTED_SKIPS": expected}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "skipcheck", "-p", "no:cacheprovider"]
    cmd += ["-p", "no:xdist", "--rootdir", str(tmp), str(tmp / "test_cases.py"), *select]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=120)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.timeout(150)
def test_an_unexpected_skip_fails_the_session_naming_it(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path)
    assert rc == 1, out
    assert "unexpected skips: the session fails" in out
    assert "test_cases.py::test_needs_etcd: no etcd binary" in out
    assert "test_gpu" not in out.split("unexpected skips")[1]  # CUDA's skip is expected


@pytest.mark.timeout(150)
def test_expected_skips_pass_and_a_machine_may_name_its_own(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path, "-k", "runs or gpu")
    assert rc == 0 and "1 passed, 1 skipped" in out, out
    rc, out = _pytest(tmp_path, expected="no etcd binary")
    assert rc == 0 and "unexpected skips" not in out, out


TOOLS = ("id", "mktemp", "rm", "tail", "head", "chmod", "cat")
"""What scripts/ensure_etcd.sh and the fake apt-get run, linked into the fake bin: PATH holds
nothing else, so a real etcd or apt-get on this machine cannot answer."""


def _fake_bin(tmp: Path) -> Path:
    """A bin directory whose apt-get records its arguments and installs a fake etcd."""
    import shutil

    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    apt = bin_dir / "apt-get"
    apt.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp / "apt.log"}\n'
        'case "$*" in *install*) '
        f"printf '#!/bin/sh\\necho etcd Version: 3.4.23\\n' > {bin_dir / 'etcd'}; "
        f"chmod +x {bin_dir / 'etcd'};; esac\n"
    )
    apt.chmod(0o755)
    return bin_dir


@pytest.mark.timeout(60)
def test_ensure_etcd_installs_etcd_server_when_missing_and_allowed(tmp_path: Path) -> None:
    bin_dir = _fake_bin(tmp_path)
    env = {**os.environ, "PATH": str(bin_dir), "ETCD_APT_GET": "apt-get"}
    bash = "/bin/bash"
    done = subprocess.run([bash, str(ENSURE)], capture_output=True, text=True, env=env, timeout=30)
    said = done.stdout + done.stderr
    if os.geteuid() != 0:  # not allowed here: it says so and changes nothing
        assert done.returncode == 0 and "cannot install etcd" in said, said
        assert not (tmp_path / "apt.log").exists()
        return
    assert done.returncode == 0, said
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert any("install" in c and "etcd-server" in c for c in calls), calls
    assert (bin_dir / "etcd").exists() and "installed etcd" in said
    again = subprocess.run([bash, str(ENSURE)], capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "etcd is here" in again.stdout  # nothing to do
    assert len((tmp_path / "apt.log").read_text().splitlines()) == len(calls)
