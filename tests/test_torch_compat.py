"""The compat modules: every private torch name is checked at import, and a missing one is a
clear error naming the torch version and the feature."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from resilient._torch_check import (
    TorchCompatError,
    require_attrs,
    require_import,
    require_params,
    require_self_attrs,
)


@pytest.mark.parametrize(
    "module", ["resilient.supervisor._torch_compat", "resilient.runtime._torch_compat"]
)
def test_the_installed_torch_has_what_the_compat_modules_need(module: str) -> None:
    importlib.import_module(module)


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
    from resilient.runtime._torch_compat import barrier_missing_ranks, is_peer_loss_message

    assert is_peer_loss_message("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert not is_peer_loss_message("CUDA error: device-side assert triggered")
    assert barrier_missing_ranks("Ranks 1, 3 failed to pass monitoredBarrier in 3000 ms") == [1, 3]
    assert barrier_missing_ranks("Rank 2 failed to pass monitoredBarrier in 3000 ms") == [2]
    assert barrier_missing_ranks("something else") is None
