"""`resilient` as a new user meets it: a location it cannot use is one line, never a traceback.

The real command, each in a process of its own (a test's commands run side by side). Each
must exit 2 with exactly one line on stderr that names the location and the fix, and no
credential anywhere in its output. A command's start imports torch (seconds, and minutes
for all of them on a loaded machine): `python -m resilient.cli` is forked from the session's
fork server (chaos/forks/), which is not used if its own imports print anything;
`resilient --help` starts a fresh interpreter. S3 cases talk to moto's
server on 127.0.0.1 (tests/s3_fixtures.py): AWS_ENDPOINT_URL points there, the AWS config
files and the instance-metadata lookup are switched off.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from helpers import ForkedCli

from chaos.procs import fresh_interpreters

if TYPE_CHECKING:  # imported by pytest as a plugin (see tests/test_s3.py)
    from s3_fixtures import S3Env

pytest_plugins = ["s3_fixtures"]  # moto_endpoint, s3
pytestmark = pytest.mark.timeout(120)  # the first test waits for the forks' imports

CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
# in a URL only, never in the environment: only the URL's redaction can hide them
URL_KEY, URL_SECRET = "AKIDINTHEURLONLY9X3", "urlOnlySecret/Qp7Lm2Wv"
Done = subprocess.CompletedProcess[str]


@pytest.fixture
def cli(forked_cli: ForkedCli) -> ForkedCli:
    return forked_cli


def one_line(out: Done, *expected: str, secrets: tuple[str, ...] = ()) -> str:
    """The one stderr line of a command that refused its input; checks what it must say."""
    told = f"resilient {' '.join(out.args)}: rc={out.returncode}\nstdout:\n{out.stdout[-2000:]}"
    told += f"\nstderr:\n{out.stderr[-4000:]}"
    assert out.returncode == 2, told
    assert "Traceback" not in out.stderr, told
    lines = out.stderr.splitlines()
    assert len(lines) == 1, told
    line = lines[0]
    assert line.startswith("resilient"), told
    for text in expected:
        assert text in line, f"{text!r} missing from: {told}"
    for secret in (URL_KEY, URL_SECRET, *secrets):
        assert secret not in out.stderr and secret not in out.stdout, told
    return line


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint location with committed steps 4 and 8 and an unfinished 6, a directory
    that is not one, and a file."""
    root = tmp_path_factory.mktemp("cli")
    for step in (4, 8):
        (root / "ckpt" / f"step_{step:09d}").mkdir(parents=True)
        (root / "ckpt" / f"step_{step:09d}" / "manifest.json").write_text("{}")
    (root / "ckpt" / "step_000000006").mkdir()
    (root / "other").mkdir()
    (root / "other" / "notes.txt").write_text("not a checkpoint")
    return root


# ---------------------------------------------------------------------- S3
def test_no_credentials(s3: S3Env, tmp_path: Path, cli: ForkedCli) -> None:
    url = "s3://no-such-bucket/run"
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARS}
    dst = tmp_path / "out"
    for out in cli(["ls", url], ["verify", url], ["export", url, "--to", str(dst)], env=env):
        one_line(out, url, "No AWS credentials were found", "AWS_ACCESS_KEY_ID", "AWS_PROFILE")
    assert not dst.exists()


def test_missing_bucket_and_credentials_in_the_url(
    s3: S3Env, tmp_path: Path, cli: ForkedCli
) -> None:
    url = "s3://no-such-bucket-for-the-cli/run"
    missing, exported, in_url = cli(
        ["ls", url],
        ["export", url, "--to", str(tmp_path / "out")],
        ["ls", f"s3://{URL_KEY}:{URL_SECRET}@{s3.bucket}/run"],
    )
    for out in (missing, exported):
        one_line(
            out, url, "'no-such-bucket-for-the-cli' does not exist", "Create it", secrets=s3.secrets
        )
    assert not s3.fs.exists("no-such-bucket-for-the-cli")
    one_line(in_url, f"s3://***@{s3.bucket}/run", "never in the URL", secrets=s3.secrets)


def test_not_a_checkpoint_and_missing_step_on_s3(s3: S3Env, cli: ForkedCli) -> None:
    for n in (4, 8):
        s3.fs.pipe_file(f"{s3.bucket}/run/step_{n:09d}/manifest.json", b"{}")
    s3.fs.pipe_file(f"{s3.bucket}/other/notes.txt", b"not a checkpoint")
    no_step, other = cli(["verify", s3.url("run"), "--step", "7"], ["ls", s3.url("other")])
    one_line(no_step, s3.url("run"), "step 7", "[4, 8]", "--step", secrets=s3.secrets)
    one_line(other, s3.url("other"), "not a resilient checkpoint location", "checkpoint_dir")


# ---------------------------------------------------------------------- local
def test_not_a_checkpoint_location_or_nothing_there(local: Path, cli: ForkedCli) -> None:
    other, missing = str(local / "other"), str(local / "no-such-dir")
    ls, export, verify = cli(
        ["ls", other], ["export", other, "--to", str(local / "out")], ["verify", missing]
    )
    for out in (ls, export):
        one_line(out, other, "not a resilient checkpoint location", "checkpoint_dir")
    one_line(verify, missing, "nothing at this location", "checkpoint_dir")


def test_a_step_that_is_not_there(local: Path, cli: ForkedCli) -> None:
    where = str(local / "ckpt")
    verify, export, unfinished = cli(
        ["verify", where, "--step", "7"],
        ["export", where, "--step", "7", "--to", str(local / "out")],
        ["verify", where, "--step", "6"],
    )
    for out in (verify, export):
        one_line(out, where, "step 7", "[4, 8]", "--step")
    line = one_line(unfinished, where, "step 6", "[4, 8]")
    assert "did not finish" in line


def test_report_on_what_is_not_a_run_directory(local: Path, cli: ForkedCli) -> None:
    cases = {
        str(local / "ckpt"): "not a run directory",  # a checkpoint location: no logs/
        str(local / "no-such-run"): "no such run directory",
        "s3://bucket/run": "local run directory, not a URL",
    }
    for (where, expected), out in zip(
        cases.items(), cli(*(["report", w] for w in cases)), strict=True
    ):
        line = one_line(out, where, expected)
        assert "--run-dir" in line or "copy the run directory" in line


# ---------------------------------------------------------------------- --help
def test_every_help_exits_0(cli: ForkedCli) -> None:
    """`resilient --help` in a fresh interpreter (the entry point as a user starts it); each
    command's help forked (`run --help` alone imports torch: the launcher's parser)."""
    commands = ["", "run", "check-resume", "ls", "verify", "report", "export"]
    with fresh_interpreters():
        real = cli(["--help"])
    helps = [*real, *cli(*([c, "--help"] for c in commands[1:]))]
    for command, out in zip(commands, helps, strict=True):
        told = f"resilient {command} --help: rc={out.returncode}\n{out.stderr[-3000:]}"
        assert out.returncode == 0, told
        assert "Traceback" not in out.stderr, told
        assert out.stdout.startswith(f"usage: resilient {command}".rstrip()), out.stdout[:500]
