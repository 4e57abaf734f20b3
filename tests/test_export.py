"""`resilient export` (issue 28, item 1): checkpoints out as safetensors or torch files.

Real checkpoints, written once for the module by real processes on gloo
(tests/workers/export_worker.py): a plain process, FSDP2 and DDP on 2 ranks, FSDP2 on 4.
Each export is compared bit for bit with the full state dicts the workers took at save time
(get_model_state_dict / get_optimizer_state_dict with full_state_dict=True). Then what must
never happen: a corrupt or truncated checkpoint exporting anything, an export overwriting
without --force, an interrupted export leaving a file under a final name. One source is on
S3 (moto on loopback).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import crc32c
import pytest
import torch
from conftest import Result
from safetensors import safe_open
from torch import nn

from resilient.checkpoint import CheckpointConfig, CheckpointManager, TrainState
from resilient.checkpoint._dcp_read import read_metadata_safely
from resilient.errors import CheckpointCorruptError, CheckpointError, ConfigError
from resilient.version import __version__
from resilient.weights.checkpoint_reader import buffer_bytes, open_checkpoint
from resilient.weights.export import INDEX_NAME, add_parser, export, main
from resilient.weights.names import load_key_map, matches_any, plain_name
from resilient.weights.progress import Progress, parse_size
from resilient.weights.safetensors_out import SafetensorsWriter

if TYPE_CHECKING:
    from s3_fixtures import S3Env

pytest_plugins = ["s3_fixtures"]  # moto_endpoint, s3
pytestmark = pytest.mark.timeout(300)

WORKER = "export_worker.py"
SAVES = {  # checkpoint name -> (launcher, ranks, op): one launch per launcher and world size
    "plain1": ("python", 1, "plain"),
    "fsdp2": ("torchrun", 2, "fsdp"),
    "ddp2": ("torchrun", 2, "ddp"),
    "fsdp4": ("torchrun", 4, "fsdp"),
}


# ---------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def ckpts(
    tmp_path_factory: pytest.TempPathFactory,
    torchrun: Callable[..., Result],
    python_proc: Callable[..., Result],
) -> dict[str, Path]:
    """name -> a checkpoint location with steps 1 and 2, and `<location>.expected.pt`."""
    base = tmp_path_factory.mktemp("export_ckpts")
    launches: dict[tuple[str, int], list[str]] = {}
    for name, (how, ranks, op) in SAVES.items():
        launches.setdefault((how, ranks), []).append(f"{op}:{base / name}")
    for (how, ranks), ops in launches.items():
        args = ["--run-dir", str(base / f"run_{how}{ranks}"), *ops]
        if how == "python":
            rc, out, err = python_proc(WORKER, *args, timeout=120)
        else:
            rc, out, err = torchrun(ranks, WORKER, *args, timeout=180)
        assert rc == 0, f"{how} x{ranks} failed (rc={rc})\n{out[-2000:]}\n{err[-6000:]}"
    return {name: base / name for name in SAVES}


def expected(ckpt: Path, step: int = 2) -> dict[str, Any]:
    return torch.load(f"{ckpt}.expected.pt", weights_only=True)[step]


def read_export(dst: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, str]]]:
    """Every tensor of a safetensors export (through its index when it has one), and each
    file's __metadata__; asserts each tensor is in exactly one file, the one the index says."""
    index = dst / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["model.safetensors"]
    assert sorted(p.name for p in dst.glob("*.safetensors")) == files
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, dict[str, str]] = {}
    for file in files:
        with safe_open(str(dst / file), framework="pt") as f:
            metadata[file] = f.metadata()
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                assert key not in tensors, f"{key} in two shards"
                tensors[key] = f.get_tensor(key)
                if weight_map is not None:
                    assert weight_map[key] == file, key
    if weight_map is not None:
        assert set(weight_map) == set(tensors)
    return tensors, metadata


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), key


def no_leftovers(dst: Path) -> None:
    """Nothing under the final name, and no partial or old directory beside it."""
    assert not dst.exists()
    assert not list(dst.parent.glob(f"{dst.name}.*")), list(dst.parent.iterdir())


# ---------------------------------------------------------------------- small parts
def test_plain_name_strips_wrappers_anywhere() -> None:
    assert plain_name("module.layers.0.weight") == "layers.0.weight"
    assert plain_name("_orig_mod.module.head.bias") == "head.bias"
    assert (
        plain_name("_fsdp_wrapped_module.layers.3._fsdp_wrapped_module."
                   "_checkpoint_wrapped_module.mlp.up.weight")
        == "layers.3.mlp.up.weight"
    )  # fmt: skip
    assert plain_name("encoder._orig_mod.proj.weight") == "encoder.proj.weight"
    assert plain_name("model.embed.weight") == "model.embed.weight"  # not a wrapper
    assert plain_name("modules.x") == "modules.x"
    assert matches_any("lm_head.weight", ["lm_head.*"])
    assert matches_any("layers.1.bias", ["*.weight", "*.bias"])
    assert not matches_any("lm_head.weight", ["*.bias", "head.*"])
    assert not matches_any("x", [])


def test_key_map_files(tmp_path: Path) -> None:
    good = tmp_path / "m.py"
    good.write_text("def rename(name):\n    return None if name == 'drop' else 'x.' + name\n")
    rename = load_key_map(good)
    assert rename("a.b") == "x.a.b"
    assert rename("drop") is None
    with pytest.raises(ConfigError, match=r"no such file"):
        load_key_map(tmp_path / "absent.py")
    (tmp_path / "none.py").write_text("def other(name):\n    return name\n")
    with pytest.raises(ConfigError, match=r"defines no function `rename`"):
        load_key_map(tmp_path / "none.py")
    (tmp_path / "bad.py").write_text("def rename(name):\n    return 3\n")
    with pytest.raises(ConfigError, match=r"returned 3"):
        load_key_map(tmp_path / "bad.py")("a")
    (tmp_path / "boom.py").write_text("raise RuntimeError('nope')\n")
    with pytest.raises(ConfigError, match=r"running it failed \(RuntimeError: nope\)"):
        load_key_map(tmp_path / "boom.py")


def test_the_command_line_entry_points_load_no_torch() -> None:
    """`resilient` builds its parser from resilient.weights.export: `resilient report` and
    `--help` must not pay for importing torch."""
    code = "import sys, resilient.weights.export; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_sizes_and_progress() -> None:
    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("500MB") == 500_000_000
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1.5gb") == 1_500_000_000
    assert parse_size("1048576") == 1048576
    for bad in ("5XB", "", "GB", "-1", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"5GB, 500MB, 2GiB|at least"):
            parse_size(bad)
    parser = argparse.ArgumentParser(prog="resilient")
    add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "src", "--to", "d", "--max-shard-size", "lots"])
    args = parser.parse_args(["export", "src", "--to", "d", "--max-shard-size", "2GiB"])
    assert (args.max_shard_bytes, args.fmt, args.fn) == (2 << 30, "safetensors", main)

    class Sink:
        text = ""

        def write(self, s: str) -> None:
            self.text += s

        def flush(self) -> None:
            pass

    off, on = Sink(), Sink()
    Progress(100, enabled=False, stream=off).add(50)  # type: ignore[arg-type]
    meter = Progress(2_000_000, enabled=True, stream=on, interval=0)  # type: ignore[arg-type]
    meter.add(1_000_000)
    meter.finish()
    assert off.text == ""
    assert "export: 1/2 MB (50%)" in on.text and "MB/s" in on.text and on.text.endswith("\n")


def test_safetensors_writer_streams_what_safe_open_reads(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.f32": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.i64": torch.arange(6).reshape(2, 3),
        "d.bool": torch.tensor([True, False, True]),
        "e.f16": torch.randn(2, 2, generator=g).half(),
        "f.scalar": torch.tensor(3.5, dtype=torch.float64),
        "g.empty": torch.zeros(0, 4),
        "h.u8": torch.arange(5, dtype=torch.uint8),
        "i.f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "j.strided": torch.randn(4, 6, generator=g).t(),
    }
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    writer = SafetensorsWriter(tmp_path / "x.safetensors", entries, {"format": "pt", "k": "v"})
    with pytest.raises(ValueError, match=r"next tensor is"):
        writer.write("no.such", torch.zeros(1))
    assert [tensors[n].dtype.itemsize for n in writer.names] == sorted(
        (v.dtype.itemsize for v in tensors.values()), reverse=True
    )  # larger elements first: every tensor aligned
    for name in writer.names:
        writer.write(name, tensors[name])
    writer.close()
    raw = (tmp_path / "x.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0 and raw[8 + n - 1 : 8 + n] in (b"}", b" ")
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}
        assert set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape, k
            raw_got = got.reshape(-1).view(torch.uint8)
            assert torch.equal(raw_got, v.contiguous().reshape(-1).view(torch.uint8)), k

    short = SafetensorsWriter(tmp_path / "y.safetensors", entries, {})
    with pytest.raises(ValueError, match=r"never written"):
        short.close()


def test_wrapper_prefixes_in_saved_keys_come_off(tmp_path: Path) -> None:
    """A model whose own keys hold wrapper parts (a hand-made `module` wrapper, a compiled
    submodule's `_orig_mod`): the export has the plain names; two that collide are refused."""

    class Wrap(nn.Module):
        def __init__(self, inner: nn.Module, attr: str) -> None:
            super().__init__()
            setattr(self, attr, inner)

    torch.manual_seed(0)
    model = nn.Sequential(Wrap(nn.Linear(3, 2), "module"), Wrap(nn.Linear(2, 2), "_orig_mod"))
    mgr = CheckpointManager(CheckpointConfig(url=str(tmp_path / "c"), async_save=False))
    mgr.save(TrainState(model=model), 5)
    mgr.close()
    export(tmp_path / "c", tmp_path / "out")
    got, _ = read_export(tmp_path / "out")
    sd = model.state_dict()
    want = {plain_name(k): v for k, v in sd.items()}
    assert sorted(want) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert_same(got, want)

    clash = nn.ModuleDict({"a": Wrap(nn.Linear(2, 2), "module")})
    clash.add_module("module", nn.ModuleDict({"a": nn.Linear(2, 2)}))  # module.a.* -> a.*
    mgr = CheckpointManager(CheckpointConfig(url=str(tmp_path / "c2"), async_save=False))
    mgr.save(TrainState(model=clash), 1)
    mgr.close()
    with pytest.raises(CheckpointError, match=r"'model\.a\.module\.weight' and 'model\.module"):
        export(tmp_path / "c2", tmp_path / "out2")
    no_leftovers(tmp_path / "out2")


@pytest.mark.slow
def test_hugging_face_from_pretrained_reads_an_export(tmp_path: Path) -> None:
    """transformers loads the export (it refuses files without "format": "pt")."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    mgr = CheckpointManager(CheckpointConfig(url=str(tmp_path / "c"), async_save=False))
    mgr.save(TrainState(model=model), 1)
    mgr.close()
    result = export(tmp_path / "c", tmp_path / "hf", max_shard_bytes=20_000)
    assert len(result.files) > 2 and INDEX_NAME in result.files
    config.save_pretrained(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert_same(dict(loaded.state_dict()), dict(model.state_dict()))


# ---------------------------------------------------------------------- real checkpoints
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAVES))
def test_export_equals_the_full_state_dict(
    ckpts: dict[str, Path], name: str, tmp_path: Path
) -> None:
    dst = tmp_path / "out"
    result = export(ckpts[name], dst, progress=False)
    want = expected(ckpts[name])["model"]
    got, metadata = read_export(dst)
    assert_same(got, want)
    assert "seen" in got and got["seen"].dtype == torch.int64 and int(got["seen"]) == 2
    assert not [k for k in got if k.startswith(("module.", "model.", "_orig_mod."))]
    assert (result.step, result.tensors, result.files) == (2, len(want), ["model.safetensors"])
    assert result.bytes == sum(v.numel() * v.element_size() for v in want.values())
    (meta,) = metadata.values()
    assert meta == {
        "format": "pt",
        "step": "2",
        "source": f"{ckpts[name]}/step_000000002",
        "resilient_version": __version__,
        "torch_version": torch.__version__,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain1", "fsdp4"])
def test_reader_reads_and_views_the_saved_tensors(ckpts: dict[str, Path], name: str) -> None:
    """The reader alone: specs from the metadata, a subset read by dcp.load (into a reused
    buffer too), and the zero-copy views an export writes from (FSDP2: one per rank's rows)."""
    want = expected(ckpts[name])["model"]
    with open_checkpoint(ckpts[name]) as ckpt:
        assert list(ckpt.specs) == list(want)
        assert ckpt.specs["emb.weight"] == (torch.float32, (11, 8), "model.emb.weight")
        ckpt.verify()
        got = ckpt.read(["head.weight", "seen"])
        assert_same(got, {k: want[k] for k in ("head.weight", "seen")})
        names = ["emb.weight", "body.2.bias"]
        buf = torch.empty(buffer_bytes(ckpt.specs[n] for n in names), dtype=torch.uint8)
        assert_same(ckpt.read(names, into=buf), {k: want[k] for k in names})
        for key, value in want.items():
            pieces = ckpt.pieces(key)
            assert pieces is not None, key
            flat = torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.empty(0)
            assert torch.equal(flat.view(value.shape), value), key
            if name == "fsdp4" and key == "body.0.weight":
                assert len(pieces) == 4  # rows 2/2/2/1


@pytest.mark.slow
def test_dtype_step_and_step_directory(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts["fsdp2"]
    export(src, tmp_path / "bf16", dtype="bf16")
    got, _ = read_export(tmp_path / "bf16")
    want = expected(src)["model"]
    assert got["seen"].dtype == torch.int64  # integers are kept
    assert_same(got, {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                      for k, v in want.items()})  # fmt: skip

    export(src, tmp_path / "s1", step=1)
    export(src / "step_000000001", tmp_path / "s1dir")
    first = expected(src, step=1)["model"]
    assert not torch.equal(first["head.weight"], want["head.weight"])
    assert_same(read_export(tmp_path / "s1")[0], first)
    assert_same(read_export(tmp_path / "s1dir")[0], first)
    with pytest.raises(ConfigError, match=r"is step 1, but step 2"):
        export(src / "step_000000001", tmp_path / "x", step=2)


@pytest.mark.slow
def test_shards_and_index(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts["fsdp4"]
    want = expected(src)["model"]
    cap = 160  # bytes: most tensors share a shard, the larger ones get one each
    result = export(src, tmp_path / "out", max_shard_bytes=cap)
    n = len(result.files) - 1
    assert n > 3 and result.files[-1] == INDEX_NAME
    assert result.files[:-1] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    got, _ = read_export(tmp_path / "out")
    assert_same(got, want)
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    nbytes = {k: v.numel() * v.element_size() for k, v in want.items()}
    assert index["metadata"]["total_size"] == sum(nbytes.values())
    assert index["metadata"]["format"] == "pt" and index["metadata"]["step"] == "2"
    assert list(index["weight_map"]) == list(want)  # in the model's order
    per_file: dict[str, list[str]] = {}
    for key, file in index["weight_map"].items():
        per_file.setdefault(file, []).append(key)
    keys = list(want)
    for file, members in per_file.items():
        size = sum(nbytes[k] for k in members)
        assert size <= cap or len(members) == 1, (file, members)
        start = keys.index(members[0])  # a shard is a run of keys in order
        assert members == keys[start : start + len(members)]


@pytest.mark.slow
def test_torch_format_model_only_and_with_optimizer(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts["ddp2"]
    want = expected(src)
    export(src, tmp_path / "m", fmt="torch", model_only=True)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["model.pt"]
    model = torch.load(tmp_path / "m" / "model.pt", weights_only=True)
    assert_same(model, want["model"])

    src = ckpts["fsdp4"]
    want = expected(src)
    export(src, tmp_path / "full", fmt="torch", dtype="fp16")
    full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    assert sorted(full) == ["model", "optimizer", "step"] and full["step"] == 2
    assert_same(full["model"], {k: v.half() if v.is_floating_point() else v
                                for k, v in want["model"].items()})  # fmt: skip
    osd, wosd = full["optimizer"], want["optim"]
    assert osd["param_groups"] == wosd["param_groups"]
    assert osd["state"].keys() == wosd["state"].keys()
    for param, state in wosd["state"].items():
        assert_same(osd["state"][param], state)  # fp32: --dtype is the model's alone


@pytest.mark.slow
def test_map_renames_drops_and_refuses_collisions(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts["fsdp2"]
    want = expected(src)
    mapping = tmp_path / "map.py"
    mapping.write_text(
        "def rename(name):\n"
        "    if name == 'seen':\n"
        "        return None\n"
        "    return 'model.' + name.replace('body.', 'layers.')\n"
    )
    parser = argparse.ArgumentParser(prog="resilient")
    add_parser(parser.add_subparsers(dest="command"))
    argv = ["export", str(src), "--to", str(tmp_path / "out"), "--map", str(mapping)]
    assert main(parser.parse_args(argv)) == 0
    got, _ = read_export(tmp_path / "out")
    renamed = {"model." + k.replace("body.", "layers."): v for k, v in want["model"].items()}
    del renamed["model.seen"]
    assert_same(got, renamed)

    argv = [*argv[:3], str(tmp_path / "full"), "--map", str(mapping), "--format", "torch"]
    assert main(parser.parse_args(argv)) == 0
    full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    assert_same(full["model"], renamed)
    assert set(full["optimizer"]["state"]) == set(renamed)
    params = full["optimizer"]["param_groups"][0]["params"]
    assert params == ["model." + p.replace("body.", "layers.")
                      for p in want["optim"]["param_groups"][0]["params"]]  # fmt: skip

    clash = tmp_path / "collide.py"
    clash.write_text("def rename(name):\n    return name.split('.')[-1]\n")
    with pytest.raises(ConfigError, match=r"'model\.emb\.weight' and 'model\.body\.0\.weight'"):
        export(src, tmp_path / "clash", key_map=clash)
    no_leftovers(tmp_path / "clash")


@pytest.mark.slow
def test_never_overwrites_without_force(
    ckpts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = ckpts["plain1"], tmp_path / "out"
    dst.mkdir()  # an empty directory is fine
    export(src, dst, step=1)
    (dst / "old-marker").write_text("old")
    before = sorted(p.name for p in dst.iterdir())
    with pytest.raises(ConfigError, match=r"exists and is not empty.*--force"):
        export(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == before

    parser = argparse.ArgumentParser(prog="resilient")
    add_parser(parser.add_subparsers(dest="command"))
    assert main(parser.parse_args(["export", str(src), "--to", str(dst)])) == 2
    assert "--force" in capsys.readouterr().err

    assert main(parser.parse_args(["export", str(src), "--to", str(dst), "--force"])) == 0
    assert f"exported step 2: {len(expected(src)['model'])} tensors" in capsys.readouterr().out
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]  # old content gone
    assert_same(read_export(dst)[0], expected(src)["model"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing moved aside left


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst / "step_000000002"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate", "metadata"])
def test_a_damaged_checkpoint_exports_nothing(
    ckpts: dict[str, Path], tmp_path: Path, damage: str
) -> None:
    bad = _copy(ckpts["fsdp2"], tmp_path / "bad")
    if damage == "metadata":
        victim = bad / ".metadata"
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        victim.write_bytes(bytes(raw))
        match = r"\.metadata: .* != expected .* \(truncated or corrupt\)"
    else:
        victim = bad / "__1_0.distcp"
        raw = bytearray(victim.read_bytes())
        if damage == "flip":
            raw[len(raw) // 2] ^= 0x01
            match = r"__1_0\.distcp: crc32c [0-9a-f]{8} != expected [0-9a-f]{8} \(corrupt\)"
        else:
            raw = raw[: len(raw) - 100]
            match = r"__1_0\.distcp: size \d+ != expected \d+ \(truncated or torn\)"
        victim.write_bytes(bytes(raw))
    dst = tmp_path / "out"
    with pytest.raises(CheckpointCorruptError, match=match) as info:
        export(tmp_path / "bad", dst)
    assert "step_000000002" in str(info.value) and "--step" in str(info.value)
    no_leftovers(dst)
    parser = argparse.ArgumentParser(prog="resilient")
    add_parser(parser.add_subparsers(dest="command"))
    assert main(parser.parse_args(["export", str(tmp_path / "bad"), "--to", str(dst)])) == 1
    no_leftovers(dst)


@pytest.mark.slow
def test_a_failure_while_writing_leaves_nothing_and_keeps_the_old_export(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """A record that verifies (its manifest entry rewritten to match) but does not load:
    the export fails after some shards were written, and nothing appears under the final
    name; with --force, the old export stays in place."""
    bad = _copy(ckpts["plain1"], tmp_path / "bad")
    md = read_metadata_safely(open(bad / ".metadata", "rb"))  # noqa: SIM115
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.head.weight")
    data = bad / str(info.relative_path)
    raw = bytearray(data.read_bytes())
    raw[info.offset : info.offset + 4] = b"XXXX"  # the record's zip signature
    data.write_bytes(bytes(raw))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"][data.name]["crc32c"] = crc32c.crc32c(bytes(raw))
    (bad / "manifest.json").write_text(json.dumps(manifest))

    dst = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"reading failed"):
        export(tmp_path / "bad", dst, max_shard_bytes=64)  # head.weight is in a later shard
    no_leftovers(dst)
    export(ckpts["plain1"], dst, step=1)
    with pytest.raises(CheckpointError, match=r"reading failed"):
        export(tmp_path / "bad", dst, max_shard_bytes=64, force=True)
    assert_same(read_export(dst)[0], expected(ckpts["plain1"], step=1)["model"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "out"]


@pytest.mark.slow
def test_what_is_not_a_checkpoint_is_one_clear_error(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"does not exist"):
        export(tmp_path / "absent", dst)
    (tmp_path / "a.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"is a file, not a checkpoint location"):
        export(tmp_path / "a.safetensors", dst)
    (tmp_path / "plain_dir").mkdir()
    (tmp_path / "plain_dir" / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match=r"is not a resilient checkpoint location: no "):
        export(tmp_path / "plain_dir", dst)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(ckpts["plain1"], unfinished)
    for step_dir in unfinished.iterdir():
        (step_dir / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no committed checkpoint .* never finished"):
        export(unfinished, dst)
    with pytest.raises(CheckpointError, match=r"no committed checkpoint at step 7 .* \[1, 2\]"):
        export(ckpts["plain1"], dst, step=7)
    broken = tmp_path / "broken"
    shutil.copytree(ckpts["plain1"], broken)
    (broken / "step_000000002" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match=r"unreadable manifest.*--step \(it has \[1\]"):
        export(broken, dst)
    with pytest.raises(ConfigError, match=r"local directory only"):
        export(ckpts["plain1"], "s3://bucket/out")
    with pytest.raises(ConfigError, match=r"format 'onnx'"):
        export(ckpts["plain1"], dst, fmt="onnx")
    with pytest.raises(ConfigError, match=r"dtype 'int8'"):
        export(ckpts["plain1"], dst, dtype="int8")
    no_leftovers(dst)


@pytest.mark.slow
def test_export_from_s3(ckpts: dict[str, Path], s3: S3Env, tmp_path: Path) -> None:
    """From s3://: verified as it streams (the records kept in a local copy beside the
    destination, deleted after), the same tensors and optimizer state, no credentials in
    what is written; a flipped byte exports nothing."""
    s3.fs.put(str(ckpts["fsdp2"]), f"{s3.bucket}/ckpt", recursive=True)
    assert "ckpt/step_000000002/.metadata" in s3.objects("ckpt")
    opts = {"default_block_size": 5 << 20}
    want = expected(ckpts["fsdp2"])
    result = export(s3.url(), tmp_path / "out", storage_options=opts, max_shard_bytes=300)
    assert len(result.files) > 2
    got, metadata = read_export(tmp_path / "out")
    assert_same(got, want["model"])
    for meta in metadata.values():
        assert meta["source"] == f"{s3.url()}/step_000000002"
    text = json.dumps(metadata) + (tmp_path / "out" / INDEX_NAME).read_text()
    assert not any(secret in text for secret in s3.secrets)

    export(s3.url(), tmp_path / "full", fmt="torch", storage_options=opts)
    full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    assert_same(full["model"], want["model"])
    assert full["optimizer"]["param_groups"] == want["optim"]["param_groups"]
    for param, state in want["optim"]["state"].items():
        assert_same(full["optimizer"]["state"][param], state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "out"]  # copies deleted

    key = f"{s3.bucket}/ckpt/step_000000002/__0_0.distcp"
    raw = bytearray(s3.fs.cat_file(key))
    raw[len(raw) // 3] ^= 0x10
    s3.fs.pipe_file(key, bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: crc32c .* \(corrupt\)"):
        export(s3.url(), tmp_path / "bad", storage_options=opts)
    no_leftovers(tmp_path / "bad")
