"""Checkpoints on s3:// over real HTTP: moto's server on 127.0.0.1, with and without faults."""

from __future__ import annotations

import json
import logging
import shutil
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trainee
from conftest import free_port, read_events

import resilient
from resilient import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    StorageError,
)
from resilient.checkpoint.tiers import TieredCheckpointManager
from resilient.storage import RetryPolicy, is_retryable
from resilient.storage import transfer as _transfer

if TYPE_CHECKING:  # imported by pytest as a plugin; importing it here first would skip
    from s3_fixtures import S3Env  # its assertion rewriting

pytest_plugins = ["s3_fixtures"]  # moto_endpoint, s3, s3proxy
pytestmark = pytest.mark.timeout(60)


class Trainee(trainee.Trainee):
    """A model of `width`^2 * 2 parameters (1024: about 25 MB with AdamW)."""

    def __init__(self, seed: int, width: int = 64) -> None:
        super().__init__(seed, widths=(width, width, 3))


FAST = RetryPolicy(initial_wait_s=0.01, max_wait_s=0.05, jitter_s=0.01, budget_s=20)


def s3_manager(url: str, **kw: Any) -> CheckpointManager:
    kw.setdefault("async_save", False)
    kw.setdefault("retry", FAST)
    return CheckpointManager(CheckpointConfig(url=url, **kw))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_round_trip_multipart(s3: S3Env, async_save: bool) -> None:
    t = Trainee(0, width=1024)  # ~25 MB with AdamW: several 5 MiB parts
    t.train(2)
    opts = {"default_block_size": 5 << 20, "max_concurrency": 4}
    mgr = s3_manager(s3.url(), async_save=async_save, storage_options=opts)
    mgr.check_writable()
    mgr.save(t.state(), step=2)
    mgr.wait()
    mgr.close()
    keys = s3.objects("ckpt")
    assert "ckpt/step_000000002/manifest.json" in keys, keys
    assert not [k for k in keys if k.endswith(".tmp") or "probe" in k], keys
    manifest = json.loads(s3.fs.cat_file(f"{s3.bucket}/ckpt/step_000000002/manifest.json"))
    assert {f"ckpt/step_000000002/{n}" for n in manifest["files"]} | {
        "ckpt/step_000000002/manifest.json"
    } == set(keys)
    assert s3.open_uploads() == []

    u = Trainee(1, width=1024)
    assert u.digest() != t.digest()
    mgr2 = s3_manager(s3.url(), storage_options=opts)
    assert mgr2.load_latest(u.state()) == 2
    assert u.digest() == t.digest()
    assert u.sched.state_dict() == t.sched.state_dict()


def test_transient_faults_are_retried(s3: S3Env, s3proxy: Any, events: Any) -> None:
    t = Trainee(0, width=1024)
    t.train(1)
    opts = {
        "default_block_size": 5 << 20,
        "max_concurrency": 4,
        "config_kwargs": {"read_timeout": 1, "connect_timeout": 1},
    }
    p = s3proxy
    save_faults = [
        p.add("slowdown", method="PUT", path=r"partNumber=1$", times=2),
        p.add("reset", method="PUT", path=r"partNumber=2$", times=2),
        p.add("reset_after", method="PUT", path=r"partNumber=3$", times=1),
        p.add("internal", method="POST", path=r"uploadId=", times=1),
        p.add("reset_after", method="POST", path=r"uploadId=", times=1),
        p.add("slowdown", method="HEAD", times=2),
        p.add("internal", method="GET", path=r"list-type", times=1),
        p.add("reset_after", method="PUT", path=r"manifest\.json", times=1),
    ]
    mgr = s3_manager(s3.url(), storage_options=opts)
    mgr.save(t.state(), step=1)
    assert [f.fired for f in save_faults] == [f.times for f in save_faults]

    load_faults = [
        p.add("delay", method="GET", path=r"\.distcp", times=1, delay_s=2.5),
        p.add("reset", method="GET", path=r"\.distcp", times=2),
        p.add("slowdown", method="GET", path=r"manifest", times=1),
    ]
    u = Trainee(1, width=1024)
    assert s3_manager(s3.url(), storage_options=opts).load_latest(u.state()) == 1
    assert u.digest() == t.digest()
    assert [f.fired for f in load_faults] == [f.times for f in load_faults]

    errors = " ".join(e["error"] for e in events("storage.retry"))
    for symptom in ("reduce your request rate", "internal error", "ReadTimeoutError"):
        assert symptom in errors
    assert "EndpointConnectionError" in errors or "ConnectionClosedError" in errors
    assert events("ckpt.fallback") == []
    assert s3.open_uploads() == []


# ------------------------------------------------------------------------------ two tiers
def tiered(s3: S3Env, local: Path, **kw: Any) -> TieredCheckpointManager:
    kw.setdefault("async_save", False)
    kw.setdefault("retry", FAST)
    kw.setdefault("keep_last", 10)
    return TieredCheckpointManager(
        CheckpointConfig(url=s3.url(), local_url=str(local), remote_every=3, **kw)
    )


def train_and_save(mgr: TieredCheckpointManager, steps: int) -> dict[int, str]:
    """One training step and one save per step; the digest after each."""
    t = Trainee(0)
    digests = {}
    for step in range(1, steps + 1):
        t.train(1)
        mgr.save(t.state(), step)
        digests[step] = t.digest()
    return digests


def steps_in(keys: list[str]) -> list[int]:
    return sorted({int(k.split("step_")[1][:9]) for k in keys if k.endswith("manifest.json")})


def local_steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in root.glob("step_*/manifest.json"))


def test_tiers_route_saves_and_load_the_newest_across_both(
    s3: S3Env, tmp_path: Path, events: Any
) -> None:
    local = tmp_path / "local"
    mgr = tiered(s3, local, async_save=True)
    mgr.check_writable()
    digests = train_and_save(mgr, 7)
    t = Trainee(0)
    t.train(8)
    mgr.save(t.state(), 8, blocking=True)  # an explicit blocking save goes to the durable tier
    digests[8] = t.digest()
    mgr.close()
    assert steps_in(s3.objects()) == [3, 6, 8]
    assert local_steps(local) == [1, 2, 4, 5, 7]
    assert [e["tier"] for e in events("ckpt.tier")] == ["local", "local", "remote"] * 2 + [
        "local",
        "remote",
    ]

    u = Trainee(1)
    assert tiered(s3, local).load_latest(u.state()) == 8
    assert u.digest() == digests[8]
    assert events("ckpt.tier.loaded")[-1]["tier"] == "remote"

    # the newest is local: taken from there
    shutil.rmtree(local / "step_000000008", ignore_errors=True)
    s3.fs.rm(f"{s3.bucket}/ckpt/step_000000008", recursive=True)
    assert tiered(s3, local).load_latest(u.state()) == 7
    assert u.digest() == digests[7]
    assert events("ckpt.tier.loaded")[-1]["tier"] == "local"


def test_tiers_node_lost_resumes_from_s3(s3: S3Env, tmp_path: Path, events: Any) -> None:
    local = tmp_path / "local"
    digests = train_and_save(tiered(s3, local), 5)
    assert local_steps(local) == [1, 2, 4, 5] and steps_in(s3.objects()) == [3]
    shutil.rmtree(local)  # the node and its disk are gone
    u = Trainee(1)
    mgr = tiered(s3, local)
    mgr.check_writable()  # a new, empty local directory
    assert mgr.load_latest(u.state()) == 3
    assert u.digest() == digests[3]
    assert events("ckpt.fallback") == []


def test_tiers_verify_local_checkpoints_before_use(s3: S3Env, tmp_path: Path, events: Any) -> None:
    local = tmp_path / "local"
    digests = train_and_save(tiered(s3, local), 5)
    (data,) = (local / "step_000000005").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a bit flip in local step 5
    data.write_bytes(bytes(raw))
    (local / "step_000000004" / "manifest.json").unlink()  # step 4: a torn local save
    u = Trainee(1)
    assert tiered(s3, local).load_latest(u.state()) == 3  # from S3
    assert u.digest() == digests[3]
    (fallback,) = events("ckpt.fallback")
    assert fallback["step"] == 5 and "crc32" in " ".join(fallback["problems"])


# ------------------------------------------------------------------------------ the budget
def exhausting_policy(save_budget_s: float) -> RetryPolicy:
    """Retries only the save budget can stop (the per-call limits are far away)."""
    return RetryPolicy(
        initial_wait_s=0.05,
        max_wait_s=0.2,
        jitter_s=0.05,
        max_attempts=10_000,
        budget_s=600,
        save_budget_s=save_budget_s,
    )


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_exhausted_budget_fails_loudly_and_keeps_the_previous_checkpoint(
    s3: S3Env, s3proxy: Any, events: Any, async_save: bool
) -> None:
    opts = {"default_block_size": 5 << 20, "max_concurrency": 4}
    # the budget counts from the save's start: 1 s was once spent before the first upload
    # (the full suite beside it), which then failed at its first attempt, with no retry
    mgr = s3_manager(
        s3.url(), retry=exhausting_policy(3.0), storage_options=opts, async_save=async_save
    )
    t = Trainee(0, width=1024)
    t.train(1)
    mgr.save(t.state(), 1)
    mgr.wait()
    first = t.digest()

    throttle = s3proxy.add("slowdown", method="PUT", path=r"\.distcp", times=None)
    t.train(1)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"save_budget_s"):
        mgr.save(t.state(), 2)
        mgr.wait()
    elapsed = time.monotonic() - start
    assert throttle.fired > 3  # it retried, with backoff, until the budget ran out
    assert elapsed < 30, elapsed  # a hang guard: the budget is 3 s, the per-call one 600 s
    (failed,) = events("ckpt.save.failed")
    assert failed["step"] == 2 and failed["newest_valid"] == 1
    assert s3.open_uploads() == []  # the multipart upload was aborted

    # the previous checkpoint is still the newest valid one; no part of step 2 is visible
    assert [(i.step, i.committed) for i in mgr.list()] == [(1, True)]
    assert not [k for k in s3.objects() if "step_000000002" in k]
    u = Trainee(1, width=1024)
    assert s3_manager(s3.url(), storage_options=opts).load_latest(u.state()) == 1
    assert u.digest() == first

    # storage recovers: the same step saves, over its torn leftovers
    s3proxy.clear()
    mgr.save(t.state(), 2)
    assert mgr.wait() in (2, None)
    assert [(i.step, i.committed) for i in mgr.list()] == [(1, True), (2, True)]
    mgr.close()


def test_on_save_error_continue_keeps_training(s3: S3Env, s3proxy: Any, events: Any) -> None:
    mgr = s3_manager(s3.url(), retry=exhausting_policy(1.0), on_save_error="continue")
    t = Trainee(0)
    mgr.save(t.state(), 1)
    s3proxy.add("internal", method="PUT", path=r"\.distcp", times=None)
    mgr.save(t.state(), 2)  # fails, is logged, does not raise
    assert events("ckpt.save.failed")[0]["action"] == "continue"
    s3proxy.clear()
    mgr.save(t.state(), 3)
    assert [i.step for i in mgr.list() if i.committed] == [1, 3]


def test_permanent_errors_are_not_retried(s3: S3Env, s3proxy: Any, events: Any) -> None:
    denied = s3proxy.add("forbidden", method="PUT", path=r"\.distcp", times=None)
    mgr = s3_manager(s3.url())
    with pytest.raises(CheckpointError, match="Access Denied"):
        mgr.save(Trainee(0).state(), 1)
    assert denied.fired == 1
    assert events("storage.retry") == []


# ------------------------------------------------------------------------------ bad input
def run_steps(url: str, tmp_path: Path, **options: Any) -> list[int]:
    """resilient.init on `url`, then its step loop; the steps that ran before it raised."""
    rt = resilient.init(url, run_dir=str(tmp_path / "run"), console_level="CRITICAL", **options)
    ran: list[int] = []
    try:
        rt.track(model=Trainee(0).model)
        for step in rt.steps(3):
            ran.append(step)
    finally:
        rt.close()
    return ran


def test_missing_bucket_is_one_clear_error_before_training(
    s3: S3Env, tmp_path: Path, events: Any
) -> None:
    url = "s3://no-such-bucket-for-resilient/ckpt"
    with pytest.raises(StorageError) as err:
        s3_manager(url).check_writable()
    message = str(err.value)
    assert url in message
    assert "Bucket 'no-such-bucket-for-resilient' does not exist" in message
    assert "Create it" in message and "never creates buckets" in message
    with pytest.raises(StorageError, match="does not exist"):
        run_steps(url, tmp_path, retry=FAST)
    assert not s3.fs.exists("no-such-bucket-for-resilient")  # and nothing created it


def test_wrong_credentials_are_one_clear_error(
    s3: S3Env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, events: Any
) -> None:
    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks keys
    with pytest.raises(StorageError) as err:
        s3_manager(s3.url()).check_writable()
    message = str(err.value)
    assert s3.url() in message and "The S3 credentials were refused (InvalidAccessKeyId)" in message
    assert "AWS_ACCESS_KEY_ID" in message and "storage_options" in message
    assert events("storage.retry") == []  # a 403 is permanent
    with pytest.raises(StorageError, match="credentials were refused"):
        run_steps(s3.url(), tmp_path, retry=FAST)


def test_refused_connection_is_one_clear_error(
    s3: S3Env, monkeypatch: pytest.MonkeyPatch, events: Any
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    retry = RetryPolicy(initial_wait_s=0.01, max_wait_s=0.02, jitter_s=0.01, max_attempts=3)
    with pytest.raises(StorageError) as err:
        s3_manager(s3.url(), retry=retry).check_writable()
    message = str(err.value)
    assert s3.url() in message and f"Cannot reach the S3 endpoint at {dead}" in message
    assert "AWS_ENDPOINT_URL" in message and "max_attempts=3" in message
    assert len(events("storage.retry")) == 2  # connection errors are retried


def test_storage_options_win_over_the_environment(
    s3: S3Env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # dead
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var)
    opts = {"endpoint_url": s3.endpoint, "key": "explicit-key", "secret": "explicit-secret"}
    t = Trainee(0)
    mgr = s3_manager(s3.url(), storage_options=opts)
    mgr.check_writable()
    mgr.save(t.state(), 1)
    assert s3.objects("ckpt")[-1] == "ckpt/step_000000001/manifest.json"

    # credentials from the shared credentials file, endpoint from the environment
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = file-key\naws_secret_access_key = file-s\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    u = Trainee(1)
    assert s3_manager(s3.url()).load_latest(u.state()) == 1
    assert u.digest() == t.digest()


def test_credentials_never_appear_in_logs_events_or_errors(
    s3: S3Env,
    s3proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
    events: Any,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    import moto.settings

    caplog.set_level(logging.INFO)
    explicit = {"key": "AKIDEXPLICITRESILIENT9", "secret": "explicitResilientSecret/77Qq"}
    secrets = [*s3.secrets, *explicit.values()]
    failures: list[BaseException] = []

    def expect_failure(fn: Any) -> None:
        with pytest.raises((StorageError, CheckpointError)) as err:
            fn()
        failures.append(err.value)

    t = Trainee(0)
    # an exhausted retry budget, credentials from the environment (4 s: on a loaded machine
    # the save's planning can take 2 s of it before the first PUT, leaving no retry to log)
    s3proxy.add("slowdown", method="PUT", times=None)
    expect_failure(lambda: s3_manager(s3.url(), retry=exhausting_policy(4.0)).save(t.state(), 1))
    # a permanent error
    s3proxy.clear()
    s3proxy.add("forbidden", method="PUT", times=None)
    expect_failure(lambda: s3_manager(s3.url()).save(t.state(), 1))
    s3proxy.clear()
    # a missing bucket, explicit credentials
    expect_failure(
        lambda: s3_manager("s3://no-such-bucket-x/c", storage_options=explicit).check_writable()
    )
    # refused credentials, explicit and from the environment, through resilient.init
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    expect_failure(lambda: s3_manager(s3.url(), storage_options=explicit).check_writable())
    expect_failure(lambda: run_steps(s3.url(), tmp_path, retry=FAST, storage_options=explicit))
    expect_failure(lambda: s3_manager(s3.url()).save(t.state(), 1))

    out, err = capsys.readouterr()
    shown = [
        *("".join(traceback.format_exception(e)) for e in failures),
        *(repr(e) for e in failures),
        json.dumps(events()),
        caplog.text,
        out,
        err,
        repr(CheckpointConfig(url=s3.url(), storage_options=explicit)),
    ]
    assert len(failures) == 6 and events("storage.retry") and events("ckpt.save.failed")
    for secret in secrets:
        for text in shown:
            assert secret not in text


# ------------------------------------------------------------------------------ layout
def test_foreign_objects_are_ignored_and_never_deleted(s3: S3Env, events: Any) -> None:
    foreign = [
        "ckpt/notes.txt",
        "ckpt/step_abc/x",
        "ckpt/other/y.bin",
        "ckpt/step_000000001.bak/z",
        "ckpt-old/step_000000001/manifest.json",  # a sibling prefix sharing our prefix's name
    ]
    for key in foreign:
        s3.fs.pipe_file(f"{s3.bucket}/{key}", b"not ours")
    mgr = s3_manager(s3.url(), keep_last=2)
    t = Trainee(0)
    for step in range(1, 5):
        t.train(1)
        mgr.save(t.state(), step)
    mgr.wait()  # a blocking save's retention runs beside the loop
    assert [i.step for i in mgr.list()] == [3, 4]
    assert [e["step"] for e in events("ckpt.retention.delete")] == [1, 2]
    assert set(foreign) <= set(s3.objects())
    assert s3_manager(s3.url()).load_latest(Trainee(1).state()) == 4


def test_a_save_without_manifest_is_never_loaded_and_later_cleaned(s3: S3Env, events: Any) -> None:
    mgr = s3_manager(s3.url())
    t = Trainee(0)
    t.train(1)
    mgr.save(t.state(), 1)
    one = t.digest()
    # A save that died before its commit: every data file and DCP's .metadata, no manifest.
    for name in ("__0_0.distcp", ".metadata"):
        s3.fs.copy(
            f"{s3.bucket}/ckpt/step_000000001/{name}", f"{s3.bucket}/ckpt/step_000000002/{name}"
        )
    assert [(i.step, i.committed) for i in mgr.list()] == [(1, True), (2, False)]
    u = Trainee(1)
    assert s3_manager(s3.url()).load_latest(u.state()) == 1 and u.digest() == one
    t.train(2)
    mgr.save(t.state(), 3)
    mgr.wait()
    assert [(i.step, i.committed) for i in mgr.list()] == [(1, True), (3, True)]
    (deleted,) = events("ckpt.retention.delete")
    assert deleted["step"] == 2 and "unfinished" in deleted["reason"]


# ------------------------------------------------------------------------------ the policy
class FakeTime:
    """A clock that only `sleep` advances: the policy's limits without waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def policy(ft: FakeTime, **kw: Any) -> RetryPolicy:
    kw.setdefault("max_attempts", 1000)
    return RetryPolicy(clock=lambda: ft.now, sleep=ft.sleep, **kw)


def always(exc: BaseException) -> Any:
    def fn() -> None:
        raise exc

    return fn


def test_policy_stops_before_the_save_deadline() -> None:
    ft = FakeTime()
    with pytest.raises(StorageError, match=r"save_budget_s\) is spent: ConnectionResetError"):
        policy(ft, budget_s=1000).call(
            "put x", always(ConnectionResetError("reset")), deadline=10.0
        )
    assert 0 < ft.now < 10.0 and len(ft.slept) > 3
    # exponential backoff: the i-th wait is 0.2 * 2**i plus up to 0.5 s of jitter (so two
    # neighbours may come in either order; each must lie in its own band)
    p = RetryPolicy()
    for i, waited in enumerate(ft.slept[:-1]):  # the last may be cut to the deadline
        base = p.initial_wait_s * 2**i
        assert base <= waited <= min(p.max_wait_s, base + p.jitter_s), (i, ft.slept)


def test_policy_per_call_budget_and_attempts() -> None:
    ft = FakeTime()
    with pytest.raises(StorageError, match=r"per-call budget of 5 s"):
        policy(ft, budget_s=5).call("get x", always(TimeoutError("slow")))
    assert ft.now < 5
    ft = FakeTime()
    with pytest.raises(StorageError, match=r"failed after 3 attempt\(s\).*max_attempts=3"):
        policy(ft, max_attempts=3).call("get x", always(TimeoutError("slow")))
    assert len(ft.slept) == 2


def test_policy_raises_permanent_errors_at_once() -> None:
    ft = FakeTime()
    calls = []

    def fn() -> None:
        calls.append(1)
        raise PermissionError("Access Denied")

    with pytest.raises(PermissionError):
        policy(ft).call("put x", fn, deadline=100)
    assert calls == [1] and ft.slept == []


def client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    cause = ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )
    translated = OSError(5, code)  # what s3fs raises, with the ClientError as its cause
    translated.__cause__ = cause
    return translated


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (client_error("SlowDown", 503), True),
        (client_error("ServiceUnavailable", 503), True),
        (client_error("InternalError", 500), True),
        (client_error("RequestTimeout", 400), True),
        (client_error("503", 503), True),  # a HEAD: no body, only the status
        (client_error("AccessDenied", 403), False),
        (client_error("InvalidAccessKeyId", 403), False),
        (client_error("SignatureDoesNotMatch", 403), False),
        (client_error("NoSuchBucket", 404), False),
        (client_error("NoSuchKey", 404), False),
        (FileNotFoundError("gone"), False),
        (ConnectionResetError("reset"), True),
        (TimeoutError("slow"), True),
    ],
    ids=lambda v: v if isinstance(v, bool) else f"{type(v).__name__}:{v}",
)
def test_what_is_retried(exc: BaseException, retry: bool) -> None:
    assert is_retryable(exc) is retry


def test_botocore_connection_errors_are_retried() -> None:
    from botocore.exceptions import (
        ConnectionClosedError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    url = "http://127.0.0.1:1/b/k"
    for exc in (
        EndpointConnectionError(endpoint_url=url),
        ConnectionClosedError(endpoint_url=url),
        ReadTimeoutError(endpoint_url=url),
    ):
        assert is_retryable(exc), exc


# ------------------------------------------------------------------------------ multi-rank
def launch(run: Any, base: Path, name: str, nproc: int, ops: list[str]) -> dict[str, Any]:
    """One reshard_worker launch; its records by op ("save:fsdp:<url>"), checked alike on
    every rank (state_digest is of the full state)."""
    out = base / f"out_{name}"
    rc, stdout, stderr = run(["--out", str(out), "--run-dir", str(base / f"run_{name}"), *ops])
    assert rc == 0, f"launch {name} failed (rc={rc})\n{stdout[-2000:]}\n{stderr[-6000:]}"
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    for recs in per_rank:
        assert [x["digest"] for x in recs] == [x["digest"] for x in per_rank[0]]
    return {rec["op"]: rec for rec in per_rank[0]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_and_fsdp2_save_to_s3_and_load_on_another_world_size(
    s3: S3Env, torchrun: Any, python_proc: Any, tmp_path: Path
) -> None:
    """2 ranks save (FSDP2, DDP) to S3; one process loads both: bitwise. (Several ranks
    loading from S3 at once: test_two_tiers_under_fsdp2_and_node_loss.)"""
    fsdp, ddp = s3.url("fsdp2"), s3.url("ddp2")
    saved = launch(
        lambda a: torchrun(2, "reshard_worker.py", *a, timeout=180),
        tmp_path,
        "save",
        2,
        [f"save:fsdp:{fsdp}", f"save:ddp:{ddp}"],
    )
    source = {f"load:plain:{fsdp}": f"save:fsdp:{fsdp}", f"load:plain:{ddp}": f"save:ddp:{ddp}"}
    loaded = launch(
        lambda a: python_proc("reshard_worker.py", *a, timeout=120),
        tmp_path,
        "load",
        1,
        list(source),
    )
    for op, rec in loaded.items():
        src = saved[source[op]]
        assert (src["world_size"], rec["world_size"]) == (2, 1)
        assert rec["step"] == src["step"] == 3, op
        assert rec["digest_before"] != src["digest"]
        assert rec["digest"] == src["digest"], op
        assert rec["scheduler"] == src["scheduler"]
    for url in (fsdp, ddp):
        prefix = url.split("/", 3)[3]
        manifest = json.loads(s3.fs.cat_file(f"{s3.bucket}/{prefix}/step_000000003/manifest.json"))
        assert manifest["world_size"] == 2
        assert sum(n.endswith(".distcp") for n in manifest["files"]) == 2
    assert s3.open_uploads() == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_tiers_under_fsdp2_and_node_loss(s3: S3Env, torchrun: Any, tmp_path: Path) -> None:
    """2 ranks: saves 1, 2, 4 local and 3 on S3; load local 4; wipe local; load S3's 3."""
    out, local = tmp_path / "out", tmp_path / "local"
    rc, stdout, stderr = torchrun(
        2,
        "tier_worker.py",
        *("--url", s3.url(), "--tier-dir", str(local), "--run-dir", str(tmp_path / "run")),
        *("--out", str(out)),
        timeout=150,
    )
    assert rc == 0, f"rc={rc}\n{stdout[-2000:]}\n{stderr[-6000:]}"
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert records[0] == records[1]
    saved, loaded = records[0]["saved"], records[0]["loaded"]
    assert loaded == [[4, saved["4"]], [3, saved["3"]]]
    assert steps_in(s3.objects()) == [3]
    assert not local.exists() or local_steps(local) == []
    tiers = read_events(tmp_path / "run" / "logs" / "rank0.jsonl", "ckpt.tier.loaded")
    assert [(e["step"], e["tier"]) for e in tiers] == [(4, "local"), (3, "remote")]


class RecordingSink:
    """Keeps what an UploadStream sends: the logic of parts, without a server."""

    multipart = True

    def __init__(self) -> None:
        self.parts: dict[int, bytes] = {}
        self.completed: list[int] | None = None

    def put(self, data: bytes) -> None:
        self.parts[1] = data
        self.completed = [1]

    def start(self) -> str:
        return "upload-1"

    def part(self, upload_id: str, number: int, data: bytes | bytearray) -> dict[str, Any]:
        self.parts[number] = bytes(data)
        return {"PartNumber": number, "ETag": f"e{number}"}

    def complete(self, upload_id: str, parts: list[dict[str, Any]]) -> None:
        self.completed = [p["PartNumber"] for p in parts]

    def abort(self, upload_id: str) -> None:
        raise AssertionError("not aborted in this test")


def test_upload_parts_grow_to_stay_within_s3s_part_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 takes at most 10,000 parts; a stream's size is unknown, so parts grow as it goes."""
    monkeypatch.setattr(_transfer, "GROW_EVERY", 2)
    sink = RecordingSink()
    stream = _transfer.UploadStream(sink, part_size=_transfer.MIN_PART, concurrency=3, name="x")
    data = bytes(range(256)) * (50 << 12)  # 50 MiB in writes of odd sizes
    for i in range(0, len(data), 3_000_001):
        stream.write(data[i : i + 3_000_001])
    stream.close()
    mib = [len(sink.parts[n]) >> 20 for n in sorted(sink.parts)]
    assert mib == [5, 5, 10, 10, 20]  # the last part holds the rest
    assert sink.completed == [1, 2, 3, 4, 5]
    assert b"".join(sink.parts[n] for n in sorted(sink.parts)) == data
