"""CheckpointManager in one process: exact round trips, the async fence, the commit protocol,
retention, and bad input. Multi-rank resharding is in test_reshard.py."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from trainee import Trainee

import resilient
from resilient import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    ConfigError,
    StorageError,
    TrainState,
    state_digest,
)
from resilient.checkpoint.manifest import step_dir
from resilient.checkpoint.state import Unpacked, _unpack, pack
from resilient.storage import RetryPolicy
from resilient.storage.checksum import checksum_of

pytestmark = pytest.mark.timeout(60)

Events = Callable[..., list[dict[str, Any]]]


# ------------------------------------------------------------------------------ helpers
def manager(root: Path, **kw: Any) -> CheckpointManager:
    kw.setdefault("async_save", False)
    return CheckpointManager(CheckpointConfig(url=str(root), **kw))


def draws() -> tuple[float, list[float], list[float]]:
    """The next values of the python, numpy and torch global generators."""
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under `root` with its mtime, and size and sha256 for files."""
    snap: dict[str, tuple[Any, ...]] = {".": ("dir", root.stat().st_mtime_ns)}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        rel = str(p.relative_to(root))
        if p.is_dir():
            snap[rel] = ("dir", st.st_mtime_ns)
        else:
            snap[rel] = (
                "file",
                st.st_mtime_ns,
                st.st_size,
                hashlib.sha256(p.read_bytes()).hexdigest(),
            )
    return snap


def data_file(d: Path) -> Path:
    (f,) = d.glob("*.distcp")
    return f


def committed_steps(root: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in root.glob("step_*/manifest.json"))


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_round_trip_is_bitwise_exact_with_scheduler_and_rng(
    tmp_path: Path, async_save: bool
) -> None:
    root = tmp_path / "ckpt"
    a = Trainee(0)
    a.train(3)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    mgr = manager(root, async_save=async_save)
    mgr.save(a.state(), step=3)
    mgr.wait()
    assert mgr.last_committed == 3
    mgr.close()
    want_digest, want_sched = a.digest(), a.sched.state_dict()
    want_draws = draws()  # what the uninterrupted process draws next

    files = sorted(p.name for p in (root / step_dir(3)).iterdir())
    assert files == [".metadata", "__0_0.distcp", "manifest.json"]
    manifest = json.loads((root / step_dir(3) / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp"]

    b = Trainee(1)  # other weights, an optimizer without state, another RNG position
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert b.digest() != want_digest
    mgr2 = manager(root)
    assert mgr2.load_latest(b.state()) == 3
    assert b.digest() == want_digest
    assert b.sched.state_dict() == want_sched
    assert b.opt.param_groups[0]["lr"] == a.opt.param_groups[0]["lr"]
    assert draws() == want_draws

    # Training on from the checkpoint gives the same bits as training on without one.
    a.train(3, seed=7)
    b.train(3, seed=7)
    assert b.digest() == a.digest()


def test_stock_dcp_reads_what_we_write(tmp_path: Path) -> None:
    """Our files are DCP's own format (torch.save records, their zip CRC left out): stock
    dcp.load with its default reader gets the same tensors."""
    import torch.distributed.checkpoint as dcp

    a = Trainee(0)
    a.train(2)
    mgr = manager(tmp_path)
    mgr.save(a.state(), step=2)
    mgr.close()
    want = a.state().to_state_dict(step=2, rank=0)
    got = Trainee(1).state().load_template(rank=0, has_rank_blob=True)
    dcp.load(got, checkpoint_id=str(tmp_path / step_dir(2)), no_dist=True)
    for key in ("model", "optim"):
        flat_want = dict(_flatten(want[key]))
        flat_got = dict(_flatten(got[key]))
        assert flat_want.keys() == flat_got.keys()
        for k, v in flat_want.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, flat_got[k]), k
    assert got["common"] == want["common"]


def _saved(t: Any, *, at: int, zip_crc: bool) -> tuple[Any, int]:
    """(buffer, length): `t` torch.saved at offset `at` of a buffer, as DCP places records."""
    import contextlib
    import io

    from resilient.checkpoint._torch_archive import no_zip_crc32_in_this_thread

    buf = io.BytesIO()
    buf.write(b"\0" * at)
    with contextlib.nullcontext() if zip_crc else no_zip_crc32_in_this_thread():
        torch.save(t, buf)
    return buf.getbuffer(), buf.tell() - at


@pytest.mark.parametrize("zip_crc", [True, False], ids=["zip-crc", "no-zip-crc"])
def test_a_tensor_record_read_in_place_is_what_torch_load_gives(zip_crc: bool) -> None:
    """A verified load copies each tensor from the bytes it checked, through a view of the
    torch.save archive where it lies: the same dtype, shape, strides and values as
    torch.load, for views, odd dtypes and scalars, with or without the zip CRC."""
    import io

    from resilient.checkpoint._torch_archive import tensor_in_record

    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    cases = [
        base,
        base.t(),
        base[2:, 3:7],
        base.to(torch.bfloat16),
        base > 30,
        base.to(torch.float16)[::2],
        torch.tensor(7, dtype=torch.int64),
    ]
    for t in cases:
        buf, length = _saved(t, at=13, zip_crc=zip_crc)
        want = torch.load(io.BytesIO(bytes(buf[13:])), weights_only=True)
        got = tensor_in_record(buf, 13, length)
        assert got is not None
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
        assert torch.equal(got, want)
        del got


def test_the_tensor_pickle_reader_agrees_with_torch_load_or_refuses() -> None:
    """A record's dtype, shape and strides come from our own reader of torch.save's tensor
    pickle (8x cheaper than a meta torch.load): the same layout as torch.load for every
    plain dtype, views and scalars; anything else (a Parameter, a dict, a pickle naming any
    other global) is refused without running it, and torch.load decides as before."""
    import io
    import pickle
    import zipfile

    from resilient.checkpoint import _torch_archive as tc

    assert tc.FAST_HEADER_UNAVAILABLE is None
    assert tc._STORAGE_DTYPES

    def read(record: Any) -> Any:
        with zipfile.ZipFile(io.BytesIO(bytes(record))) as archive:
            return tc._pickled_layout(memoryview(record), archive.infolist())

    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    cases = [base.to(dtype) for dtype in tc._STORAGE_DTYPES.values()]
    cases += [base.t(), base[2:, 3:7], base[::2, 1:], torch.tensor(7), torch.ones(0)]
    for t in cases:
        buf, _ = _saved(t, at=0, zip_crc=False)
        want = torch.load(io.BytesIO(bytes(buf)), map_location="meta", weights_only=True)
        got = read(buf)
        assert (got.dtype, got.shape, got.stride, got.storage_offset) == (
            want.dtype,
            tuple(want.shape),
            want.stride(),
            want.storage_offset(),
        )
        assert got.storage_numel * want.element_size() == want.untyped_storage().nbytes()

    for other in (torch.nn.Parameter(torch.ones(3)), {"a": torch.ones(2)}):
        buf, _ = _saved(other, at=0, zip_crc=False)
        with pytest.raises(pickle.UnpicklingError):
            read(buf)
    ran: list[str] = []

    class Evil:
        def __reduce__(self) -> Any:
            return (ran.append, ("ran",))

    with pytest.raises(pickle.UnpicklingError):
        tc._TensorPickle(io.BytesIO(pickle.dumps(Evil(), protocol=2))).layout()
    assert ran == []


def test_a_record_that_is_not_a_plain_tensor_archive_is_left_to_torch_load() -> None:
    from resilient.checkpoint._torch_archive import tensor_in_record

    buf, length = _saved(torch.ones(8), at=5, zip_crc=False)
    assert tensor_in_record(buf, 5, length - 40) is None  # cut short
    assert tensor_in_record(bytes(range(256)) * 4, 0, 1024) is None  # not an archive
    for other in ({"a": torch.ones(2)}, torch.ones(0), [1, 2]):
        buf, length = _saved(other, at=0, zip_crc=False)
        assert tensor_in_record(buf, 0, length) is None


def test_a_verified_load_copies_every_tensor_from_the_bytes_it_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from resilient.checkpoint import _dcp_read

    real = _dcp_read.tensor_in_record
    seen: list[bool] = []

    def counting(buffer: Any, offset: int, length: int) -> Any:
        got = real(buffer, offset, length)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(_dcp_read, "tensor_in_record", counting)
    a = Trainee(0)
    a.train(2)
    mgr = manager(tmp_path)
    mgr.save(a.state(), step=2)
    mgr.close()
    b = Trainee(1)
    assert manager(tmp_path).load_latest(b.state()) == 2
    assert b.digest() == a.digest()
    assert seen and all(seen)
    # past verify_buffer_mib the check streams, and DCP reads the files again itself
    seen.clear()
    c = Trainee(2)
    assert manager(tmp_path, verify_buffer_mib=0).load_latest(c.state()) == 2
    assert c.digest() == a.digest() and not seen


def test_the_check_of_a_ranks_own_files_starts_with_its_plan_and_still_refuses_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files a rank wrote and reads are checked in a thread of their own from the moment
    DCP has the local plan (overlapping the plan exchange); a flipped byte found there still
    refuses the checkpoint before any tensor is touched, and the load falls back."""
    import threading

    from resilient.checkpoint._dcp_read import Verifier

    real = Verifier._check_file
    where: dict[str, str] = {}

    def recording(self: Verifier, name: str, *, keep: bool) -> Any:
        where[f"{self.rel}/{name}"] = threading.current_thread().name
        return real(self, name, keep=keep)

    monkeypatch.setattr(Verifier, "_check_file", recording)
    a = Trainee(0)
    a.train(2)
    mgr = manager(tmp_path)
    mgr.save(a.state(), step=2)
    at_2 = a.digest()
    a.train(2)
    mgr.save(a.state(), step=4)
    mgr.close()
    b = Trainee(1)
    assert manager(tmp_path).load_latest(b.state()) == 4 and b.digest() == a.digest()
    assert where == {f"{step_dir(4)}/__0_0.distcp": "resilient-check"}, where
    target = tmp_path / step_dir(4) / "__0_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    where.clear()
    c = Trainee(2)
    assert manager(tmp_path).load_latest(c.state()) == 2  # step 4 refused, step 2 loaded
    assert c.digest() == at_2
    assert where[f"{step_dir(4)}/__0_0.distcp"] == "resilient-check"


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _flatten(v, f"{prefix}.{k}")]
    if isinstance(obj, list):
        return [kv for i, v in enumerate(obj) for kv in _flatten(v, f"{prefix}[{i}]")]
    return [(prefix, obj)]


def test_zip_crc_is_skipped_only_in_the_thread_that_asks() -> None:
    """torch.save's zip CRC is off inside our writer threads only: a user's torch.save in
    another thread at the same time keeps it (torch's own switch is process-wide)."""
    import io
    import threading
    import zipfile

    from resilient.checkpoint._torch_archive import no_zip_crc32_in_this_thread

    def crcs() -> list[int]:
        buf = io.BytesIO()
        torch.save(torch.arange(1000.0), buf)
        return [i.CRC for i in zipfile.ZipFile(buf).infolist() if i.file_size]

    inside = threading.Event()
    release = threading.Event()
    seen: list[list[int]] = []

    def writer() -> None:
        with no_zip_crc32_in_this_thread():
            seen.append(crcs())
            inside.set()
            release.wait(10)

    t = threading.Thread(target=writer)
    t.start()
    assert inside.wait(10)
    try:
        assert seen[0] and all(c == 0 for c in seen[0])
        assert all(c != 0 for c in crcs())  # this thread, while the other is inside
    finally:
        release.set()
        t.join()
    assert all(c != 0 for c in crcs())


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_a_fresh_optimizer_is_loaded_without_a_step_and_bitwise_as_stock(flat: bool) -> None:
    """TrainState.apply loads into a fresh optimizer without set_optimizer_state_dict's
    zero-gradient step first (checkpoint/_torch_compat.py, no_init_step): the same state as
    the stock load, bit for bit, and the optimizer's step hooks never see a step. `flat`: the
    per-parameter format pipeline stages save, whose loader takes the state names from the
    live optimizer (a hot-recovered stage once came back with an empty AdamW state)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        m[2].bias.requires_grad_(False)  # a parameter that never has state
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        return m, opt

    m, opt = build()
    for _ in range(3):
        m(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    sd = TrainState(model=m, optimizer=opt, pipeline=flat).to_state_dict(step=3, rank=0)

    ours_m, ours = build()
    steps: list[int] = []
    ours.register_step_post_hook(lambda *_: steps.append(1))
    TrainState(model=ours_m, optimizer=ours, pipeline=flat).apply(sd, rank=0)
    stock_m, stock = build()
    stock_m.load_state_dict(m.state_dict())
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    set_optimizer_state_dict(stock_m, stock, sd["optim"], options=options)

    assert not steps
    assert len(ours.state) == len(stock.state) == 3  # the frozen bias has none
    for p_ours, p_stock in zip(ours_m.parameters(), stock_m.parameters(), strict=True):
        assert torch.equal(p_ours, p_stock)
        assert p_ours.grad is None
        for k, v in stock.state.get(p_stock, {}).items():
            assert torch.equal(ours.state[p_ours][k], v), k
    saved = opt.param_groups[0]["params"]
    for p_saved, p_ours in zip(saved, ours.param_groups[0]["params"], strict=True):
        for k, v in opt.state[p_saved].items():  # and the saved run's state itself
            assert torch.equal(ours.state[p_ours][k], v), k
    if flat:
        return
    # a load that fails leaves the fresh optimizer as it was
    fresh_m, fresh = build()
    partial = {"state": {"0.weight": sd["optim"]["state"]["0.weight"]}, "param_groups": []}
    with pytest.raises(RuntimeError, match="Missing optimizer state"):
        TrainState(model=fresh_m, optimizer=fresh).apply({**sd, "optim": partial}, rank=0)
    assert not fresh.state


def test_a_format_1_manifest_with_crc32_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before CRC-32C (manifest format 1, zlib crc32) stay loadable, and
    their checksums are still checked."""
    import zlib

    a = Trainee(0)
    a.train(2)
    mgr = manager(tmp_path)
    mgr.save(a.state(), step=2)
    mgr.close()
    d = tmp_path / step_dir(2)
    m = json.loads((d / "manifest.json").read_text())
    assert m["format_version"] == 2 and m["checksum"] == "crc32c"
    m["format_version"], m["checksum"] = 1, "crc32"
    m["files"] = {
        n: {"size": e["size"], "crc32": zlib.crc32((d / n).read_bytes())}
        for n, e in m["files"].items()
    }
    (d / "manifest.json").write_text(json.dumps(m))
    b = Trainee(1)
    assert manager(tmp_path).load_latest(b.state()) == 2
    assert b.digest() == a.digest()
    m["files"]["__0_0.distcp"]["crc32"] ^= 1
    (d / "manifest.json").write_text(json.dumps(m))
    c = Trainee(1)
    before = c.digest()
    assert manager(tmp_path).load_latest(c.state()) is None
    assert c.digest() == before


def _wide_pair(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Two 2048-wide linear layers without bias or buffers and their AdamW: 32 MiB of
    parameters plus 64 MiB of moments once stepped, so an async save's copy takes a while."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


@pytest.mark.timeout(120)
def test_async_save_fence_keeps_pre_mutation_values(tmp_path: Path) -> None:
    """pytorch#144657: after an async save returns, mutating live tensors must not leak into
    the checkpoint. The manager fences its own saves: optimizer.step() waits for the copy,
    with no hook of the caller's, and close() takes the fence away."""
    model, opt = _wide_pair(seed=0)
    model(torch.randn(4, 2048)).sum().backward()
    opt.step()
    want = state_digest(model, opt)

    mgr = manager(tmp_path / "ckpt", async_save=True)
    try:
        mgr.save(TrainState(model=model, optimizer=opt, rng=False), step=1)
        opt.step()  # the grads are still there: params, moments and step all change in place
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        assert state_digest(model, opt) != want
        assert mgr.wait() == 1
        assert len(opt._optimizer_step_pre_hooks) == 1
    finally:
        mgr.close()
    assert not opt._optimizer_step_pre_hooks, "close() leaves no hook behind"

    model2, opt2 = _wide_pair(seed=1)
    assert manager(tmp_path / "ckpt").load_latest(TrainState(model=model2, optimizer=opt2)) == 1
    assert state_digest(model2, opt2) == want


@pytest.mark.timeout(120)
def test_an_optimizer_made_after_an_async_save_waits_for_its_copy(tmp_path: Path) -> None:
    """A loop that replaces its optimizer right after an async save: the new optimizer has no
    fence of its own yet, so the model's forward (fenced even without buffers) holds its first
    step until the copy is done, and the checkpoint keeps the parameters of the save."""
    model, opt = _wide_pair(seed=0)
    model(torch.randn(4, 2048)).sum().backward()
    opt.step()
    want = [p.detach().clone() for p in model.parameters()]

    mgr = manager(tmp_path / "ckpt", async_save=True)
    try:
        mgr.save(TrainState(model=model, optimizer=opt, rng=False), step=1)
        assert len(model._forward_pre_hooks) == 1, "a model without buffers is fenced too"
        fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
        model(torch.randn(4, 2048)).sum().backward()
        fresh.step()
        assert mgr.wait() == 1
    finally:
        mgr.close()
    assert not model._forward_pre_hooks, "close() leaves no hook behind"

    model2, opt2 = _wide_pair(seed=1)
    assert manager(tmp_path / "ckpt").load_latest(TrainState(model=model2, optimizer=opt2)) == 1
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), want, strict=True))


def test_captured_blobs_do_not_change_with_training() -> None:
    """An async save packs its blobs later, on its own thread: what is packed is the state
    at the save, whatever the loop does to the scheduler meanwhile."""
    t = Trainee(0)
    t.train(3)
    extra = {"seen": [1, 2]}

    class Live:  # hands out its live object, as a scheduler does its lists
        def state_dict(self) -> dict[str, Any]:
            return extra

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    state = TrainState(
        model=t.model, optimizer=t.opt, common={"scheduler": t.sched}, per_rank={"live": Live()}
    )
    want_sched = t.sched.state_dict()
    want_sched["base_lrs"] = list(want_sched["base_lrs"])
    captured = state.capture(step=3, rank=0)
    assert isinstance(captured["common"], Unpacked) and isinstance(captured["rank0"], Unpacked)
    t.train(2)  # the scheduler steps
    t.sched.base_lrs[0] = 99.0  # and a list it handed out changes in place
    extra["seen"].append(3)
    sd = pack(captured)
    assert list(sd) == ["model", "optim", "common", "rank0"]
    common, per_rank = _unpack(sd["common"]), _unpack(sd["rank0"])
    assert common["step"] == 3 and common["scheduler"] == want_sched
    assert per_rank["live"] == {"seen": [1, 2]} and "__rng__" in per_rank
    assert set(sd) == set(state.to_state_dict(step=3, rank=0))


# ------------------------------------------------------------------------------ commit protocol
@pytest.fixture
def two_checkpoints(tmp_path: Path) -> tuple[Path, dict[int, str]]:
    """Checkpoints of steps 1 and 2 under tmp_path/ckpt, with the digest of each."""
    root = tmp_path / "ckpt"
    t = Trainee(0)
    mgr = manager(root)
    digests = {}
    for step in (1, 2):
        t.train(1, seed=step)
        mgr.save(t.state(), step=step)
        digests[step] = t.digest()
    mgr.close()
    return root, digests


def load_digest(root: Path, expect_step: int | None) -> str:
    t = Trainee(5)
    assert manager(root).load_latest(t.state()) == expect_step
    return t.digest()


def test_step_dir_without_manifest_is_never_loaded(
    two_checkpoints: tuple[Path, dict[int, str]], events: Events
) -> None:
    root, digests = two_checkpoints
    # A complete copy of step 2's data as step 3, minus the manifest: a save that died just
    # before its commit. And a partial step 4: one data file of garbage.
    shutil.copytree(root / step_dir(2), root / step_dir(3))
    (root / step_dir(3) / "manifest.json").unlink()
    (root / step_dir(4)).mkdir()
    (root / step_dir(4) / "__0_0.distcp").write_bytes(os.urandom(100))
    assert [(i.step, i.committed) for i in manager(root).list()] == [
        (1, True),
        (2, True),
        (3, False),
        (4, False),
    ]
    assert load_digest(root, 2) == digests[2]

    (root / step_dir(2) / "manifest.json").unlink()  # now step 2 died before its commit too
    assert load_digest(root, 1) == digests[1]
    assert [e["step"] for e in events("ckpt.load")] == [2, 1]
    assert events("ckpt.fallback") == []  # uncommitted dirs are not candidates at all


def _malicious_pickle(marker: Path, *, dotted: bool) -> bytes:
    """A .metadata that runs `touch marker` when unpickled by plain pickle.

    `dotted` reaches os.system through a module our unpickler allows ("os.system" resolved
    attribute by attribute under protocol 4) instead of naming posix.system directly.
    """
    if not dotted:

        class Evil:
            def __reduce__(self) -> tuple[Any, ...]:
                return (os.system, (f"touch {marker}",))

        return pickle.dumps(Evil(), protocol=4)
    module = b"torch.distributed.checkpoint.filesystem"
    cmd = f"touch {marker}".encode()
    return (
        b"\x80\x04"  # PROTO 4
        + b"\x8c" + bytes([len(module)]) + module  # SHORT_BINUNICODE
        + b"\x8c\x09os.system"
        + b"\x93"  # STACK_GLOBAL
        + b"\x8c" + bytes([len(cmd)]) + cmd
        + b"\x85R."  # TUPLE1, REDUCE, STOP
    )  # fmt: skip


def _corrupt(step_path: Path, how: str, marker: Path) -> None:
    data = data_file(step_path)
    if how == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif how == "bit_flip":
        b = bytearray(data.read_bytes())
        b[len(b) // 2] ^= 0x10
        data.write_bytes(bytes(b))
    elif how == "deleted":
        data.unlink()
    elif how == "garbage_manifest":
        (step_path / "manifest.json").write_bytes(b'{"format_version": 1, "files": [tru')
    elif how.startswith("malicious_metadata"):
        evil = _malicious_pickle(marker, dotted=how.endswith("dotted"))
        (step_path / ".metadata").write_bytes(evil)
        # The manifest vouches for the evil file: the checksums alone cannot save us.
        mpath = step_path / "manifest.json"
        manifest = json.loads(mpath.read_text())
        algo = manifest["checksum"]
        with open(step_path / ".metadata", "rb") as f:
            value, size = checksum_of(f, algo)
        manifest["files"][".metadata"] = {"size": size, algo: value}
        mpath.write_text(json.dumps(manifest))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    ("how", "expect"),
    [
        ("truncated", ["__0_0.distcp", "truncated"]),
        ("bit_flip", ["__0_0.distcp", "crc32", "corrupt"]),
        ("deleted", ["__0_0.distcp", "missing"]),
        ("garbage_manifest", ["manifest.json", "unreadable manifest"]),
        ("malicious_metadata", [".metadata", "forbidden global"]),
        ("malicious_metadata_dotted", [".metadata", "forbidden global"]),
    ],
)
def test_corrupt_newest_falls_back_to_previous(
    two_checkpoints: tuple[Path, dict[int, str]],
    events: Events,
    tmp_path: Path,
    how: str,
    expect: list[str],
) -> None:
    root, digests = two_checkpoints
    marker = tmp_path / "pwned"
    _corrupt(root / step_dir(2), how, marker)

    assert load_digest(root, 1) == digests[1]
    assert not marker.exists(), "loading a checkpoint executed code from it"
    (fallback,) = events("ckpt.fallback")
    assert fallback["step"] == 2
    text = json.dumps(fallback)
    for word in expect:
        assert word in text, f"{word!r} not in {text}"
    (loaded,) = events("ckpt.load")
    assert loaded["step"] == 1


def test_all_checkpoints_corrupt_is_a_logged_fresh_start(
    two_checkpoints: tuple[Path, dict[int, str]], events: Events, tmp_path: Path
) -> None:
    root, _ = two_checkpoints
    for step in (1, 2):
        _corrupt(root / step_dir(step), "bit_flip", tmp_path / "unused")
    t = Trainee(5)
    before = t.digest()
    assert manager(root).load_latest(t.state()) is None
    assert t.digest() == before
    assert [e["step"] for e in events("ckpt.fallback")] == [2, 1]
    (fresh,) = events("ckpt.fresh_start")
    assert fresh["reason"] == "no valid checkpoint"


def test_a_fresh_start_after_failed_loads_keeps_the_optimizer_empty(
    two_checkpoints: tuple[Path, dict[int, str]], tmp_path: Path
) -> None:
    # A load attempt asks torch for the optimizer's state dict, which steps a fresh optimizer
    # once; a fresh start must not keep that step (Adam's bias correction would differ).
    root, _ = two_checkpoints
    for step in (1, 2):
        _corrupt(root / step_dir(step), "bit_flip", tmp_path / "unused")
    t = Trainee(5)
    assert not t.opt.state
    assert manager(root).load_latest(t.state()) is None
    assert not t.opt.state


# ------------------------------------------------------------------------------ retention
@pytest.mark.parametrize("keep_last", [1, 2])
def test_retention_keeps_newest_and_never_touches_foreign_entries(
    tmp_path: Path, keep_last: int
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    (root / "other_dir").mkdir()
    (root / "other_dir" / "data.bin").write_bytes(b"x")
    (root / "step_abc").mkdir()
    (root / "step_12").mkdir()  # not our zero-padded name
    (root / "step_000000001").mkdir()  # torn save, older than what comes next
    (root / "step_000000001" / "__0_0.distcp").write_bytes(b"torn")
    (root / "step_000000099").mkdir()  # newer than everything: may be a save in flight
    foreign = {"notes.txt", "other_dir", "step_abc", "step_12"}
    foreign_before = {k: v for k, v in snapshot(root).items() if k.split("/")[0] in foreign}

    t = Trainee(0)
    mgr = manager(root, keep_last=keep_last, async_save=True)
    for step in range(2, 7):
        t.train(1, seed=step)
        mgr.save(t.state(), step=step)
        assert mgr.wait() == step
        assert committed_steps(root) == list(range(max(2, step - keep_last + 1), step + 1))
        assert not (root / "step_000000001").exists()
    mgr.close()
    newest = t.digest()

    names = {p.name for p in root.iterdir()}
    kept = {step_dir(s) for s in range(7 - keep_last, 7)}
    assert names == foreign | kept | {"step_000000099"}
    assert {k: v for k, v in snapshot(root).items() if k.split("/")[0] in foreign} == foreign_before
    assert load_digest(root, 6) == newest


def test_retention_keeps_the_checkpoint_it_just_wrote(tmp_path: Path, events: Events) -> None:
    """A newer but corrupt checkpoint must not push the newest valid one out of keep_last."""
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    t = Trainee(0)
    t.train(4)
    manager(root, keep_last=1).save(t.state(), step=4)
    t4 = t.digest()
    t.train(2)
    manager(elsewhere, keep_last=1).save(t.state(), step=6)
    shutil.copytree(elsewhere / step_dir(6), root / step_dir(6))
    _corrupt(root / step_dir(6), "bit_flip", tmp_path / "unused")

    # The resumed run: falls back to 4, trains one step, saves 5 with keep_last=1.
    r = Trainee(3)
    mgr = manager(root, keep_last=1)
    assert mgr.load_latest(r.state()) == 4
    assert r.digest() == t4
    r.train(1, seed=5)
    mgr.save(r.state(), step=5)
    t5 = r.digest()
    assert load_digest(root, 5) == t5

    # Step 6 is known corrupt: saving it again replaces it instead of skipping it.
    r.train(1, seed=6)
    mgr.save(r.state(), step=6)
    mgr.wait()  # a blocking save's retention runs beside the loop
    assert load_digest(root, 6) == r.digest()
    assert committed_steps(root) == [6]
    assert events("ckpt.save.skipped") == []


def _one_checkpoint_with_keep_last_1(root: Path) -> tuple[Trainee, CheckpointManager]:
    t = Trainee(0)
    mgr = manager(root, keep_last=1)
    t.train(1, seed=1)
    mgr.save(t.state(), step=1)
    return t, mgr


def test_a_deletion_cut_short_leaves_no_committed_checkpoint_with_files_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, events: Events
) -> None:
    """Retention removes a checkpoint's manifest before its files: when the rest of the
    deletion fails (or the process dies there), what remains is an unfinished save that
    loads skip and the next retention removes, not a committed checkpoint that is torn."""
    root = tmp_path / "ckpt"
    t, mgr = _one_checkpoint_with_keep_last_1(root)
    real = mgr.storage.remove_tree

    def failing(rel: str) -> None:
        raise OSError(f"injected: cannot remove {rel}")

    monkeypatch.setattr(mgr.storage, "remove_tree", failing)
    t.train(1, seed=2)
    mgr.save(t.state(), step=2)
    mgr.wait()
    assert (root / step_dir(1)).is_dir() and not (root / step_dir(1) / "manifest.json").exists()
    assert any((root / step_dir(1)).iterdir())  # its data files are still there
    assert committed_steps(root) == [2]
    assert [i.committed for i in mgr.list()] == [False, True]
    assert len(events("ckpt.retention.failed")) == 1

    monkeypatch.setattr(mgr.storage, "remove_tree", real)
    t.train(1, seed=3)
    mgr.save(t.state(), step=3)
    mgr.wait()
    assert not (root / step_dir(1)).exists() and committed_steps(root) == [3]
    mgr.close()
    assert load_digest(root, 3) == t.digest()


def test_a_blocking_save_returns_at_its_commit_and_deletes_old_checkpoints_beside_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention after a blocking save runs on the manager's thread (at 4 GiB, deleting the
    old checkpoint took 0.7 s of the save here); the next save, a load and close() wait for
    it, so it never overlaps another save's writes."""
    import threading

    root = tmp_path / "ckpt"
    t, mgr = _one_checkpoint_with_keep_last_1(root)
    real = mgr.storage.remove_tree
    entered, release = threading.Event(), threading.Event()
    deleting: list[str] = []

    def slow(rel: str) -> None:
        deleting.append(threading.current_thread().name)
        entered.set()
        assert release.wait(30)
        real(rel)

    monkeypatch.setattr(mgr.storage, "remove_tree", slow)
    t.train(1, seed=2)
    mgr.save(t.state(), step=2, blocking=True)  # returns while step 1 is being deleted
    assert entered.wait(30) and not release.is_set()
    assert committed_steps(root) == [2]  # step 1's manifest went first
    assert deleting[0].startswith("resilient-ckpt")
    waiter = threading.Thread(target=mgr.wait)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # wait() (and so the next save, a load, close) waits for it
    release.set()
    waiter.join(30)
    assert not waiter.is_alive() and not (root / step_dir(1)).exists()
    mgr.close()
    assert load_digest(root, 2) == t.digest()


def _resident_fraction(path: Path) -> float:
    """The part of `path`'s pages that are in the page cache now (mincore; Linux)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int)
    libc.mmap.argtypes += (ctypes.c_int, ctypes.c_long)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with path.open("rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(addr, size)
    return sum(v & 1 for v in vec) / pages


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_a_local_save_drops_its_pages_behind_it_unless_told_to_keep_them(
    tmp_path: Path,
) -> None:
    """A local save hands each 64 MiB to the disk as it goes and lets the page cache drop the
    bytes before it (a 4 GiB blocking save 2.9 s instead of 4.1 on our VM); the bytes are the
    same and load bitwise. keep_in_page_cache=True leaves them all cached, as before."""

    def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)  # 8 x 16 MiB of weights, and AdamW's two moments of each
        model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 2048)).sum().backward()
        opt.step()
        return model, opt

    model, opt = trained(0)
    resident: dict[bool, float] = {}
    for keep in (False, True):
        root = tmp_path / f"keep{keep}"
        mgr = manager(root, keep_in_page_cache=keep)
        mgr.save(TrainState(model=model, optimizer=opt), step=1)
        mgr.close()
        (f,) = (root / step_dir(1)).glob("*.distcp")
        assert f.stat().st_size > 384 << 20  # six rounds
        resident[keep] = _resident_fraction(f)
        fresh, opt2 = trained(1)
        assert manager(root).load_latest(TrainState(model=fresh, optimizer=opt2)) == 1
        for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
            assert all(torch.equal(opt2.state[a][k], v) for k, v in opt.state[b].items())
    # dropped: all but the last round or two (whose writeback was still running); kept: all
    assert resident[False] < 0.75 and resident[True] > 0.95, resident


# ------------------------------------------------------------------------------ bad input
def test_missing_location_is_a_fresh_start_then_created_on_save(
    tmp_path: Path, events: Events
) -> None:
    root = tmp_path / "does" / "not" / "exist"
    t = Trainee(0)
    before = t.digest()
    mgr = manager(root)
    assert mgr.load_latest(t.state()) is None
    assert t.digest() == before
    (fresh,) = events("ckpt.fresh_start")
    assert fresh["reason"] == "no checkpoint"
    mgr.check_writable()
    mgr.save(t.state(), step=1)
    assert committed_steps(root) == [1]
    assert load_digest(root, 1) == before


def test_unwritable_location_fails_before_training(tmp_path: Path, events: Events) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    url = blocker / "ckpt"  # root can write anywhere, but not below a regular file
    with pytest.raises(StorageError, match=r"not writable.*checkpoint_dir"):
        manager(url).check_writable()
    t = Trainee(0)
    with pytest.raises(CheckpointError):
        manager(url).save(t.state(), step=1)

    rt = resilient.init(url, run_dir=str(tmp_path / "run"), console_level="CRITICAL")
    try:
        rt.track(model=t.model, optimizer=t.opt, scheduler=t.sched)
        ran = []
        with pytest.raises(StorageError, match=str(url)):
            for step in rt.steps(3):
                ran.append(step)
        assert ran == []
    finally:
        rt.close()  # its log configuration is undone by the events fixture
    assert blocker.read_text() == "not a directory"


def test_checkpoint_of_another_model_is_refused_untouched(
    two_checkpoints: tuple[Path, dict[int, str]],
) -> None:
    root, _ = two_checkpoints
    before = snapshot(root)
    other = Trainee(0, widths=(13, 9, 5, 2))  # "2.weight" differs in shape, "4.*" is new
    other_before = other.digest()
    with pytest.raises(CheckpointMismatchError) as err:
        manager(root).load_latest(other.state())
    msg = str(err.value)
    assert "missing keys ['4.bias', '4.weight']" in msg
    assert "shape mismatches" in msg and "2.weight" in msg
    assert snapshot(root) == before
    assert other.digest() == other_before

    renamed = Trainee(0)
    renamed.model = nn.Sequential()
    renamed.model.add_module("enc", nn.Linear(13, 7))
    renamed.opt = torch.optim.AdamW(renamed.model.parameters())
    with pytest.raises(CheckpointMismatchError) as err:
        manager(root).load_latest(TrainState(model=renamed.model, optimizer=renamed.opt))
    msg = str(err.value)
    assert "missing keys ['enc.bias', 'enc.weight']" in msg
    assert "unexpected keys ['0.bias', '0.weight', '2.bias', '2.weight']" in msg
    assert snapshot(root) == before


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_saving_a_committed_step_again_does_not_overwrite_it(
    two_checkpoints: tuple[Path, dict[int, str]], events: Events, async_save: bool
) -> None:
    root, digests = two_checkpoints
    before = snapshot(root)
    t = Trainee(8)
    mgr = manager(root, async_save=async_save)
    mgr.save(t.state(), step=2)
    assert mgr.wait() in (None, 2)
    mgr.close()
    assert snapshot(root) == before
    (skipped,) = events("ckpt.save.skipped")
    assert skipped["step"] == 2
    assert load_digest(root, 2) == digests[2]


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (lambda d: CheckpointConfig(url=d, keep_last=0), r"keep_last must be >= 1"),
        (lambda d: CheckpointConfig(url=d, write_threads=0), r"write_threads must be in \[1, 64\]"),
        (lambda d: CheckpointConfig(url=d, write_threads=65), r"\[1, 64\], got 65"),
        (lambda d: RetryPolicy(max_attempts=0), r"max_attempts must be >= 1"),
        (lambda d: RetryPolicy(budget_s=0), r"budget_s must be > 0"),
        (lambda d: resilient.init(d, save_every_steps=0), r"save_every_steps must be >= 1"),
        (lambda d: resilient.init(d, keep_lsat=2), r"unknown option.*keep_lsat.*keep_last"),
        (lambda d: CheckpointManager(CheckpointConfig(url="")), r"checkpoint location is empty"),
    ],
    ids=[
        "keep_last",
        "write_threads",
        "write_threads_high",
        "max_attempts",
        "budget",
        "save_every",
        "unknown",
        "empty_url",
    ],
)
def test_out_of_range_config_is_a_config_error(
    tmp_path: Path, make: Callable[[str], object], expect: str
) -> None:
    with pytest.raises(ConfigError, match=expect):
        make(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
