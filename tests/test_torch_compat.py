"""The compat modules: every private torch name is checked at import, and a missing one is a
clear error naming the torch version and the feature."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from resilient._torch_check import (
    TESTED_RANGE,
    TESTED_RELEASES,
    TORCH_FLOOR,
    TORCH_NEWEST,
    TorchCompatError,
    check_release,
    require_attrs,
    require_import,
    require_params,
    require_self_attrs,
)


@pytest.mark.parametrize(
    "module",
    [
        "resilient.supervisor._torch_compat",
        "resilient.groups._torch_compat",
        "resilient.numeric._torch_compat",
    ],
)
def test_the_installed_torch_has_what_the_compat_modules_need(module: str) -> None:
    importlib.import_module(module)


def test_the_installed_torch_is_a_tested_release() -> None:
    check_release(str(torch.__version__))  # what every compat module runs at import


def test_an_untested_release_fails_naming_the_range_unless_allowed() -> None:
    below = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1] - 1}.0"
    nightly = ".".join(map(str, TORCH_NEWEST)) + "a0+git1234567"
    for version in (below, below + "+cu130", nightly, "not a version"):
        with pytest.raises(TorchCompatError) as err:
            check_release(version)
        assert version in str(err.value) and TESTED_RANGE in str(err.value)
        assert "RESILIENT_UNTESTED_TORCH=1" in str(err.value)
        with pytest.warns(RuntimeWarning, match="Running anyway"):
            check_release(version, allow_untested=True)


def test_every_patch_of_a_tested_minor_is_accepted_silently() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for version in TESTED_RELEASES:
            major, minor, _ = version.split(".")
            for patch in (0, 1, 2, 9):
                check_release(f"{major}.{minor}.{patch}")
                check_release(f"{major}.{minor}.{patch}+cu130")


def test_a_newer_minor_warns_and_is_not_refused() -> None:
    above = f"{TORCH_NEWEST[0]}.{TORCH_NEWEST[1] + 1}"
    for version in (above + ".0", above + ".2+cu130", f"{TORCH_NEWEST[0] + 1}.0.0"):
        with pytest.warns(RuntimeWarning, match="newer minor release than the newest tested") as w:
            check_release(version)
        assert ".".join(map(str, TORCH_NEWEST)) in str(w[0].message)


def test_torch_env_reads_the_newest_tested_release_from_the_one_place() -> None:
    import sys
    from pathlib import Path

    scripts = str(Path(__file__).parents[1] / "scripts")
    sys.path.insert(0, scripts)
    try:
        import torch_env
    finally:
        sys.path.remove(scripts)
    assert torch_env.declared("newest") == ".".join(map(str, TORCH_NEWEST))
    assert torch_env.declared("floor") == ".".join(map(str, TORCH_FLOOR))


def test_pyproject_declares_the_tested_range() -> None:
    """pip's reading of pyproject.toml's torch requirement and check_release agree on every
    tested release, the next patch releases and the one below the floor; the next minor is
    outside pip's bound and only warned about by check_release."""
    from pathlib import Path

    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    requirements = [Requirement(d) for d in pyproject["project"]["dependencies"]]
    (torch_req,) = [r for r in requirements if r.name == "torch"]
    assert str(torch_req.specifier) == str(Requirement(TESTED_RANGE).specifier)
    major, minor, patch = TORCH_NEWEST
    newest = f"{major}.{minor}.{patch}"
    assert TESTED_RELEASES[-1] == newest
    assert TESTED_RELEASES[0] == ".".join(map(str, TORCH_FLOOR))
    patches = [f"{major}.{minor}.{patch + 1}", f"{major}.{minor}.{patch + 1}+cu130"]
    below = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1] - 1}.0"
    for version in [*TESTED_RELEASES, newest + "+cu130", *patches, below]:
        pip_says = torch_req.specifier.contains(version)
        try:
            check_release(version)
            we_say = True
        except TorchCompatError:
            we_say = False
        assert pip_says == we_say == (version != below), version
    assert not torch_req.specifier.contains(f"{major}.{minor + 1}.0")
    assert not torch_req.specifier.contains(f"{major}.{minor + 1}.0rc1")


@pytest.mark.parametrize(
    "module",
    [
        "resilient.checkpoint._torch_compat",
        "resilient.checkpoint._torch_archive",
        "resilient.groups._torch_compat",
        "resilient.numeric._torch_compat",
        "resilient.supervisor._torch_compat",
    ],
)
def test_every_compat_fence_records_the_releases_it_was_checked_on(module: str) -> None:
    compat = importlib.import_module(module)
    doc = " ".join((compat.__doc__ or "").split())
    assert f"Checked on torch {', '.join(TESTED_RELEASES)}" in doc, module


def test_a_missing_name_names_the_torch_version_and_the_feature() -> None:
    checks = [
        lambda: require_attrs(dist.Reducer, ["_gone"], feature="the feature"),
        lambda: require_import("torch.distributed.run", "gone", feature="the feature"),
        lambda: require_self_attrs(DistributedDataParallel, ["_gone"], feature="the feature"),
        lambda: require_params(DistributedDataParallel.forward, ["gone"], feature="the feature"),
    ]
    for check in checks:
        with pytest.raises(TorchCompatError) as err:
            check()
        assert torch.__version__ in str(err.value)
        assert "the feature" in str(err.value) and "gone" in str(err.value)


def test_peer_loss_texts() -> None:
    from resilient.groups._torch_compat import barrier_missing_ranks, is_peer_loss_message

    assert is_peer_loss_message("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert not is_peer_loss_message("CUDA error: device-side assert triggered")
    assert barrier_missing_ranks("Ranks 1, 3 failed to pass monitoredBarrier in 3000 ms") == [1, 3]
    assert barrier_missing_ranks("Rank 2 failed to pass monitoredBarrier in 3000 ms") == [2]
    assert barrier_missing_ranks("something else") is None


def test_an_older_torchs_uneven_micro_batch_refusal_is_read_as_the_runtimes() -> None:
    """torch < 2.13 refuses a pipeline micro-batch of another shape before the stage's own
    check runs: its text gives the sizes, and the worker's exit is the runtime's refusal
    (ConfigError, exit MISMATCH), not a crash that restarts (tests/test_pipeline.py runs it
    for real on the floor)."""
    from resilient.groups._torch_compat import micro_batch_sizes
    from resilient.runtime.errorfile import _mismatch

    class PipeliningShapeError(RuntimeError):  # torch's name; its class is private
        pass

    text = (
        "Stage 0 forward inputs: value 0 has a shape mismatch: expected torch.Size([3, 16]) "
        "actual torch.Size([2, 16])"
    )
    assert micro_batch_sizes(PipeliningShapeError(text)) == (3, 2)
    assert micro_batch_sizes(RuntimeError(text)) is None  # another error with the same words
    assert micro_batch_sizes(PipeliningShapeError(text.replace("[2, 16]", "[3, 8]"))) is None
    wrapped = RuntimeError("Failed to run stage forward")
    wrapped.__cause__ = PipeliningShapeError(text)
    refusal = _mismatch(wrapped, lambda: 0)
    assert "micro-batches of step 0 differ in size ([3, 2] samples)" in str(refusal)


def test_the_async_save_stages_more_than_once() -> None:
    """The stager fence (checkpoint/_torch_compat.py): three stages through one stager give
    three equal copies, on every tested torch (2.11 and 2.12 empty the copier table after
    the first without it)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from resilient.checkpoint._torch_compat import keep_stager_usable

    stager = keep_stager_usable(
        DefaultStager(StagingOptions(False, False, True, False))  # as the manager on CPU
    )
    try:
        for i in range(3):
            sd = {"w": torch.full((4,), float(i)), "meta": {"step": i, "kind": type(i)}}
            staged = stager.stage(sd)
            got = staged.result() if hasattr(staged, "result") else staged
            assert torch.equal(got["w"], sd["w"]) and got["meta"] == sd["meta"]
    finally:
        stager.close()


def _sockets() -> int:
    import contextlib
    import os

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return n


def _lazy_worker(rank: int, port: int, out: str) -> None:
    import json
    from datetime import timedelta
    from pathlib import Path

    from resilient.groups._torch_compat import lazy_gloo_connections

    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    counts = {}
    for mode in ("eager", "lazy"):
        dist.barrier()
        before = _sockets()
        if mode == "lazy":
            with lazy_gloo_connections():
                group = dist.new_group(backend="gloo")
        else:
            group = dist.new_group(backend="gloo")
        counts[mode] = _sockets() - before  # its listener, and the pairs connected so far
        # A peer's first collective on a lazy group connects to this rank's listener: wait
        # for every rank to count (on the world group, whose pairs exist) before any reduces.
        dist.barrier()
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        counts[f"{mode}_sum"] = int(t.item())
    Path(out, f"rank{rank}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_this_torch_connects_side_groups_lazily(tmp_path) -> None:
    """TORCH_GLOO_LAZY_INIT (lazy_gloo_connections) is honoured: on 3 ranks a group made
    inside opens only its listener, one made outside opens a connection to both peers too;
    both reduce correctly, and the variable is put back."""
    import json
    import os

    import torch.multiprocessing as mp
    from helpers import free_port

    from resilient.groups._torch_compat import GLOO_LAZY_INIT

    args = (free_port(), str(tmp_path))
    mp.start_processes(_lazy_worker, args=args, nprocs=3, start_method="spawn")
    for r in range(3):
        counts = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert counts["lazy"] < counts["eager"] and counts["eager"] >= 3, counts
        assert counts["lazy_sum"] == counts["eager_sum"] == 3
    assert GLOO_LAZY_INIT not in os.environ
