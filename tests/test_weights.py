"""Weights in from anywhere: `resilient.load_model` and `init_from` (issue 28, items 2-4).

In one process: each kind of source (a checkpoint location, one of its step directories, a
torch.save file with wrapper prefixes, safetensors files and directories), `exclude`,
`strict`, and bad input. In real gloo processes: loads into FSDP2 and DDP across world sizes,
and the Hugging Face round trip: a transformers Llama trained under `resilient run` with
FSDP2 on 2 ranks, exported, loaded by `from_pretrained` with the trained logits bit for bit,
then the start of a new run from the export with `init_from`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import Result
from helpers import Launcher, run_cmd, run_events
from safetensors.torch import load_file, save_file
from torch import nn

from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
from resilient.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
)
from resilient.weights.load import load_model

pytestmark = pytest.mark.timeout(240)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[nn.Module, Path]:
    model = _model(0)
    mgr = CheckpointManager(CheckpointConfig(url=str(tmp_path / "ckpt"), async_save=False))
    mgr.save(TrainState(model=model), 3)
    model.at3 = model[0].weight.detach().clone()  # type: ignore[assignment]
    with torch.no_grad():
        model[0].weight.add_(1.0)  # step 7 differs from step 3
    mgr.save(TrainState(model=model), 7)
    mgr.close()
    return model, tmp_path / "ckpt"


def test_each_kind_of_source_loads_the_same_weights(
    saved: tuple[nn.Module, Path], tmp_path: Path
) -> None:
    model, ckpt = saved
    m = _model(1)
    got = load_model(ckpt, m)
    assert (got.kind, got.step, got.keys) == ("resilient", 7, 4) and _same(m, model)

    at3 = load_model(ckpt / "step_000000003", _model(1))  # a step directory names its step
    assert at3.step == 3
    m3 = _model(1)
    load_model(ckpt, m3, step=3)
    assert not torch.equal(m3[0].weight, model[0].weight)
    assert torch.equal(m3[0].weight, model.at3)

    wrapped = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    torch.save(wrapped, tmp_path / "ddp_compiled.pt")  # as saved from DDP(torch.compile(m))
    m = _model(1)
    assert load_model(tmp_path / "ddp_compiled.pt", m).kind == "torch" and _same(m, model)
    torch.save({"model": model.state_dict(), "step": 7}, tmp_path / "full.pt")
    m = _model(1)
    load_model(tmp_path / "full.pt", m)
    assert _same(m, model)

    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, tmp_path / "one.safetensors", metadata={"format": "pt"})
    m = _model(1)
    assert load_model(tmp_path / "one.safetensors", m).kind == "safetensors" and _same(m, model)
    hf = tmp_path / "hf"
    hf.mkdir()
    names = sorted(sd)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, hf / file, metadata={"format": "pt"})
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    m = _model(1)
    assert load_model(hf, m).keys == 4 and _same(m, model)


def test_exclude_and_strict(saved: tuple[nn.Module, Path]) -> None:
    model, ckpt = saved
    m, before = _model(1), _model(1)
    got = load_model(ckpt, m, exclude=["2.*"])  # a new head keeps its initialization
    assert (got.keys, got.excluded) == (2, 2)
    assert torch.equal(m[0].weight, model[0].weight)
    assert torch.equal(m[2].weight, before[2].weight)

    bigger = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 2))
    with pytest.raises(CheckpointMismatchError, match=r"missing keys \['3.bias', '3.weight'\]"):
        load_model(ckpt, bigger)
    assert load_model(ckpt, bigger, strict=False).keys == 4
    assert torch.equal(bigger[2].weight, model[2].weight)
    narrower = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    with pytest.raises(CheckpointMismatchError, match="shape mismatches"):
        load_model(ckpt, narrower, strict=False)  # never loaded, strict or not


def test_bad_sources_say_what_to_fix(saved: tuple[nn.Module, Path], tmp_path: Path) -> None:
    _, ckpt = saved
    with pytest.raises(ConfigError, match="does not exist"):
        load_model(tmp_path / "nope", _model(1))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a checkpoint"):
        load_model(tmp_path / "empty", _model(1))
    with pytest.raises(CheckpointError, match=r"no committed checkpoint at step 5 .* \[3, 7\]"):
        load_model(ckpt, _model(1), step=5)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="weights_only"):
        load_model(tmp_path / "junk.pt", _model(1))

    data = sorted((ckpt / "step_000000007").glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    m, before = _model(1), _model(1)
    with pytest.raises(CheckpointCorruptError, match=data.name):
        load_model(ckpt, m)  # no fallback to step 3: the source asked for is the one loaded
    assert _same(m, before)  # nothing was copied into the model


# ------------------------------------------------------------------ real processes
WORKER = "reshard_worker.py"


@pytest.mark.slow
def test_fsdp_and_ddp_load_weights_from_any_world_size(
    tmp_path: Path,
    torchrun: Callable[..., Result],
    python_proc: Callable[..., Result],
) -> None:
    """A checkpoint of 2 FSDP2 ranks into FSDP2 and DDP on 2 and a plain process on 1; one
    of a plain process into FSDP2 on 2; a safetensors directory into FSDP2 on 2."""
    c2, c1, st = tmp_path / "c2", tmp_path / "c1", tmp_path / "st"

    def records(rc_out_err: Result, out: Path, nproc: int) -> dict[str, dict[str, object]]:
        rc, stdout, stderr = rc_out_err
        assert rc == 0, f"{stdout[-2000:]}\n{stderr[-6000:]}"
        per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
        assert all(
            [x["model_digest"] for x in recs] == [x["model_digest"] for x in per_rank[0]]
            for recs in per_rank
        )
        return {rec["op"]: rec for rec in per_rank[0]}

    ops = [f"save:fsdp:{c2}", f"weights:fsdp:{c2}", f"weights:ddp:{c2}"]
    a = records(torchrun(2, WORKER, "--out", str(tmp_path / "a"), "--run-dir",
                         str(tmp_path / "ra"), *ops, timeout=180), tmp_path / "a", 2)  # fmt: skip
    saved2 = a[f"save:fsdp:{c2}"]["model_digest"]
    assert a[f"weights:fsdp:{c2}"]["model_digest"] == saved2
    assert a[f"weights:ddp:{c2}"]["model_digest"] == saved2

    ops = [f"save:plain:{c1}", f"weights:plain:{c2}"]
    b_run = python_proc(WORKER, "--out", str(tmp_path / "b"), "--run-dir", str(tmp_path / "rb"),
                        *ops, timeout=120)  # fmt: skip
    b = records(b_run, tmp_path / "b", 1)
    assert b[f"weights:plain:{c2}"]["model_digest"] == saved2
    saved1 = b[f"save:plain:{c1}"]["model_digest"]

    # the plain process's checkpoint as a safetensors directory, written by the library
    plain = nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    load_model(c1, plain)
    st.mkdir()
    save_file(
        {k: v.contiguous() for k, v in plain.state_dict().items()},
        st / "model.safetensors",
        metadata={"format": "pt"},
    )
    ops = [f"weights:fsdp:{c1}", f"weights:fsdp:{st}"]
    c = records(torchrun(2, WORKER, "--out", str(tmp_path / "c"), "--run-dir",
                         str(tmp_path / "rc"), *ops, timeout=180), tmp_path / "c", 2)  # fmt: skip
    assert c[f"weights:fsdp:{c1}"]["model_digest"] == saved1
    assert c[f"weights:fsdp:{st}"]["model_digest"] == saved1


HF_WORKER = "tests/workers/hf_train.py"


def _train(launcher: Launcher, base: Path, name: str, *args: str, steps: int = 4) -> Path:
    out = base / name
    cmd = run_cmd(
        "--nproc-per-node=2",
        f"--run-dir={base / f'run_{name}'}",
        "--max-restarts=0",
        HF_WORKER,
        "--ckpt-dir", str(base / f"ckpt_{name}"),
        "--run-dir", str(base / f"run_{name}"),
        "--out", str(out),
        "--steps", str(steps),
        *args,
    )  # fmt: skip
    code, stdout, stderr = launcher.run(cmd, timeout=200)
    assert code == 0, f"{stdout[-2000:]}\n{stderr[-6000:]}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hugging_face_round_trip(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from resilient.weights.export import export

    launcher = Launcher()
    try:
        trained = _train(launcher, tmp_path, "train")
        dst = tmp_path / "hf"
        export(str(tmp_path / "ckpt_train"), str(dst))
        for f in (trained / "config").iterdir():
            shutil.copy(f, dst / f.name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            dst, dtype=torch.float32, attn_implementation="eager"
        )
        hf.eval()
        want = torch.load(trained / "logits.pt")
        with torch.no_grad():
            logits = hf(input_ids=want["tokens"]).logits
        assert torch.equal(logits, want["logits"])  # bit for bit, fp32

        exported: dict[str, torch.Tensor] = {}
        for shard in sorted(dst.glob("*.safetensors")):
            exported.update(load_file(shard))
        final = torch.load(trained / "final.pt")
        assert exported.keys() == final.keys()
        assert all(torch.equal(exported[k], final[k]) for k in final)

        # a new run starts from the export, all but a new head
        second = _train(
            launcher, tmp_path, "second", "--init-from", str(dst),
            "--init-exclude", "lm_head.*", steps=3,
        )  # fmt: skip
        first = torch.load(second / "first.pt")
        fresh = torch.load(trained / "first.pt")  # the same seed's initialization
        for k in final:
            assert torch.equal(first[k], fresh[k] if k.startswith("lm_head.") else final[k]), k
        inits = run_events(tmp_path / "run_second", "init.from")
        assert {e["rank"] for e in inits} == {0, 1}
        assert all(e["kind"] == "safetensors" for e in inits)

        # its own checkpoint wins from then on: with the source gone, it resumes
        shutil.rmtree(dst)
        _train(launcher, tmp_path, "second", "--init-from", str(dst), steps=4)
        assert len(run_events(tmp_path / "run_second", "init.from")) == 2  # none more
        resumes = run_events(tmp_path / "run_second", "runtime.resume")
        assert [e["step"] for e in resumes if e["rank"] == 0] == [0, 3]
    finally:
        launcher.close()


def test_init_with_takes_more_of_a_checkpoint_only_when_asked(tmp_path: Path) -> None:
    from trainee import Trainee

    from resilient.checkpoint import state_digest
    from resilient.runtime.config import build_config
    from resilient.runtime.wiring import init_weights

    src = Trainee(0)
    src.train(3)
    mgr = CheckpointManager(CheckpointConfig(url=str(tmp_path / "src"), async_save=False))
    mgr.save(src.state(), 3)
    mgr.close()

    def start(**options: object) -> Trainee:
        new = Trainee(1)
        init_weights(build_config(tmp_path / "own", options), new.state(), None)
        return new

    only_model = start(init_from=str(tmp_path / "src"))
    assert state_digest(only_model.model) == state_digest(src.model)
    assert not only_model.opt.state  # an empty optimizer, as a fresh run has
    assert only_model.sched.state_dict()["last_epoch"] == 0
    full = start(init_from=str(tmp_path / "src"), init_with=("model", "optimizer", "scheduler"))
    assert state_digest(full.model, full.opt) == state_digest(src.model, src.opt)
    assert full.sched.state_dict()["last_epoch"] == 3

    torch.save(src.model.state_dict(), tmp_path / "w.pt")
    with pytest.raises(ConfigError, match="needs a resilient checkpoint"):
        start(init_from=str(tmp_path / "w.pt"), init_with=("model", "optimizer"))
    for bad, match in (
        ({"init_with": ("model", "momentum")}, "init_with must hold 'model'"),
        ({"init_exclude": ("head.*",)}, "need init_from"),
        ({"init_from": "x", "init_with": ("model", "optimizer"), "init_exclude": ("a",)}, "per "),
    ):
        with pytest.raises(ConfigError, match=match):
            build_config(tmp_path / "own", bad)
