"""Where weights come from: what a source location is, and its tensors by plain name.

Three kinds of source, told apart by what is there:
- a resilient checkpoint location (local or any fsspec URL), or one `step_*` directory of
  it for that step: loaded through DCP, verified against its manifest, resharded
  (resilient/checkpoint/loading.py);
- a Hugging Face safetensors directory (`model.safetensors.index.json` and its shards, or
  `*.safetensors` files), or one `.safetensors` file: read a tensor at a time;
- a `torch.save` file of a state dict, or of a dict with the state dict under "model" (what
  `resilient export --format torch` writes without `--model-only`): read with
  `weights_only=True` and memory-mapped, so nothing in it runs and pages load on use.
Safetensors and torch files are read by every rank from a local path (a shared filesystem on
several nodes); a remote one is downloaded first by the user.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from resilient.checkpoint.manifest import parse_step_dir
from resilient.errors import CheckpointError, ConfigError
from resilient.weights.names import plain_name

__all__ = ["FileWeights", "Source", "identify", "step_location"]

_STEP_DIR = re.compile(r"^(?P<root>.*?)/+(?P<name>step_\d+)/*$")
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class Source:
    kind: str
    """"resilient", "safetensors" or "torch"."""
    url: str
    """The checkpoint location (resilient), the directory or the file."""
    step: int | None = None
    """resilient: the step to load (None: the newest committed)."""


def step_location(text: str, step: int | None = None) -> tuple[str, int] | None:
    """A location written down to one of its checkpoints, `<root>/step_000001200`: (root,
    1200); None for any other text. ConfigError when `step` names another step."""
    m = _STEP_DIR.match(text)
    named = parse_step_dir(m.group("name")) if m else None
    if m is None or named is None:
        return None
    if step is not None and step != named:
        raise ConfigError(f"{text} is step {named}, but step {step} was asked for")
    return m.group("root"), named


def identify(src: str | os.PathLike[str], *, step: int | None = None) -> Source:
    """What `src` is. ConfigError, naming the path and what was expected, when it is none."""
    text = os.fspath(src)
    named = step_location(text, step)
    if named is not None:
        return Source("resilient", *named)
    if "://" in text and not text.startswith("file://"):
        return Source("resilient", text, step)  # remote: only resilient checkpoints
    path = Path(text.removeprefix("file://"))
    if not path.exists():
        raise ConfigError(f"{text} does not exist: give a checkpoint location, a safetensors "
                          "directory or a torch.save file")  # fmt: skip
    if path.is_file():
        kind = "safetensors" if path.suffix == ".safetensors" else "torch"
        return _no_step(Source(kind, str(path)), step)
    if (path / _INDEX).is_file() or any(path.glob("*.safetensors")):
        return _no_step(Source("safetensors", str(path)), step)
    if any(parse_step_dir(p.name) is not None for p in path.iterdir()):
        return Source("resilient", str(path), step)
    raise ConfigError(
        f"{text} is not a checkpoint: expected step_*/manifest.json (a resilient checkpoint "
        f"location), {_INDEX} or *.safetensors (Hugging Face), or a torch.save file"
    )


def _no_step(source: Source, step: int | None) -> Source:
    if step is not None:
        raise ConfigError(f"{source.url} is a {source.kind} file, not a run's checkpoints: it "
                          "has no steps to choose from (leave step out)")  # fmt: skip
    return source


class FileWeights:
    """The tensors of a safetensors or torch.save source, by plain name, read on demand."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._where: dict[str, tuple[str, str]] = {}  # plain name -> (file, saved name)
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._state: dict[str, torch.Tensor] | None = None
        if source.kind == "safetensors":
            self._index_safetensors(Path(source.url))
        else:
            self._state = _torch_state(source.url)
            for key, value in self._state.items():
                self._add(plain_name(key), source.url, key, tuple(value.shape), value.dtype)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._shapes)

    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for `names`, a file open at a time."""
        if self._state is not None:
            for name in names:
                yield name, self._state[self._where[name][1]]
            return
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self._where[name][0], []).append(name)
        for file, group in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in group:
                    yield name, f.get_tensor(self._where[name][1])

    def _index_safetensors(self, path: Path) -> None:
        from safetensors import safe_open

        if path.is_file():
            files = [path]
        elif (path / _INDEX).is_file():
            try:
                weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{path / _INDEX}: not a safetensors index ({e})") from e
            files = [path / f for f in sorted(set(weight_map.values()))]
        else:
            files = sorted(path.glob("*.safetensors"))
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: listed in {_INDEX} but missing")
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                        sl = f.get_slice(key)
                        dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                        if dtype is None:
                            raise CheckpointError(f"{file}: {key} has dtype {sl.get_dtype()}")
                        self._add(plain_name(key), str(file), key, tuple(sl.get_shape()), dtype)
            except CheckpointError:
                raise
            except Exception as e:  # a header that does not parse, a truncated file
                raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e

    def _add(
        self, name: str, file: str, key: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        if name in self._where:
            raise CheckpointError(
                f"{self.source.url}: keys {self._where[name][1]!r} and {key!r} are both "
                f"{name!r} once wrapper prefixes are taken off"
            )
        self._where[name] = (file, key)
        self._shapes[name] = (shape, dtype)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _torch_state(path: str) -> dict[str, torch.Tensor]:
    try:  # weights_only: nothing in the file runs; mmap: pages load as tensors are used
        obj: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(
            f"{path}: not a torch.save file of tensors that loads with weights_only=True ({e})"
        ) from e
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]  # resilient export --format torch without --model-only
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a model state dict")
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise CheckpointError(f"{path}: a dict without tensors, not a model state dict")
    return tensors
