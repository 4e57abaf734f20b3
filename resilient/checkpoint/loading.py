"""Loading one checkpoint: check it against its manifest and the tracked model, then load it.

CheckpointManager decides which checkpoints to try, newest first, and records what came of
each; a Loader tries one. Every rank checks its share of the files from the bytes it loads
(resilient/checkpoint/_dcp_read.py), and all ranks land on the same outcome: a checkpoint that
fails on one rank is given up on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from resilient.checkpoint._dcp_errors import verification_problems, why
from resilient.checkpoint._dcp_read import (
    SafeLoadPlanner,
    VerificationFailed,
    Verifier,
    make_reader,
)
from resilient.checkpoint.collectives import Collectives
from resilient.checkpoint.config import CheckpointConfig
from resilient.checkpoint.manifest import Manifest, read_manifest, step_dir
from resilient.checkpoint.state import TrainState
from resilient.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ConfigError,
)
from resilient.storage import Storage

__all__ = ["Loader", "flat_optim", "keys_said", "misfit"]


class Loader:
    """Loads checkpoints of `storage` over the process group of `collectives`."""

    def __init__(
        self, storage: Storage, collectives: Collectives, config: CheckpointConfig, log: Any
    ) -> None:
        self.storage = storage
        self.collectives = collectives
        self.config = config
        self.rank = collectives.rank
        self.world_size = collectives.world_size
        self._log = log

    def try_load(self, state: TrainState, step: int) -> Manifest | None:
        """Verify checkpoint `step` against its manifest and load it into `state`; its manifest.

        None, logged as ckpt.fallback, when it fails verification or loading on any rank (all
        ranks agree). Raises CheckpointMismatchError when it does not fit the tracked state.
        """
        try:
            manifest = self.collectives.agree(lambda: read_manifest(self.storage, step))
        except CheckpointCorruptError as e:
            self._log.error("ckpt.fallback", step=step, reason=str(e))
            return None
        problems: list[str] = []
        error: str | None = None
        try:
            self._load(state, step, manifest)
        except (CheckpointMismatchError, ConfigError):
            raise
        except VerificationFailed as e:
            problems = e.problems
        except (Exception, CheckpointException) as e:
            found = verification_problems(e)
            if found:
                problems = found
            else:
                error = self.storage.redact(f"rank {self.rank}: {why(e)}")
        # all ranks must land on the same checkpoint, even if only one failed to load it
        outcomes = self.collectives.gather_all((problems, error))
        problems = sorted({p for ps, _ in outcomes for p in ps})
        errors = [err for _, err in outcomes if err]
        if problems:
            self._log.error(
                "ckpt.fallback", step=step, reason="verification failed", problems=problems
            )
            return None
        if errors:
            self._log.error("ckpt.fallback", step=step, reason="; ".join(errors))
            return None
        return manifest

    def verify(self, step: int, manifest: Manifest) -> list[str]:
        """This rank's share of a full read of checkpoint `step`'s files against `manifest`
        (`resilient verify`); the problems found, [] when its files are valid."""
        problems = []
        names = sorted(manifest.files)
        for i, name in enumerate(names):
            if i % self.world_size != self.rank:
                continue
            want = manifest.files[name]
            rel = f"{step_dir(step)}/{name}"
            algo = manifest.checksum
            try:
                value, size = self.storage.checksum(rel, algorithm=algo)
            except FileNotFoundError:
                problems.append(f"{name}: missing (expected {want.size} bytes)")
                continue
            if size != want.size:
                problems.append(f"{name}: size {size} != expected {want.size} (truncated or torn)")
            elif value != want.checksum:
                problems.append(
                    f"{name}: {algo} {value:08x} != expected {want.checksum:08x} (corrupt)"
                )
        return problems

    def _open(self, step: int, manifest: Manifest) -> tuple[Any, Verifier, Any]:
        """A verifying reader of checkpoint `step` and its DCP metadata, checked and agreed
        by every rank before it is unpickled."""
        verifier = Verifier(
            storage=self.storage,
            rel=step_dir(step),
            manifest=manifest,
            rank=self.rank,
            world_size=self.world_size,
            gather=self.collectives.gather_all,
            buffer_bytes=self.config.verify_buffer_mib << 20,
        )
        reader = make_reader(self.storage, step_dir(step), verifier=verifier)
        # Every rank checks .metadata before unpickling it; all agree before going on.
        problems: list[str] = []
        failed: Exception | None = None
        md = None
        try:
            md = reader.read_metadata()
        except VerificationFailed as e:
            problems = e.problems
        except Exception as e:  # refused by the restricted unpickler, unreadable, ...
            failed = e
        mine = None if failed is None else self.storage.redact(f"rank {self.rank}: {why(failed)}")
        outcomes = self.collectives.gather_all((problems, mine))
        problems = sorted({p for ps, _ in outcomes for p in ps})
        if problems:
            raise VerificationFailed(problems)
        if failed is not None:
            raise failed
        others = [err for _, err in outcomes if err]
        if others:
            raise CheckpointError("; ".join(others))
        return reader, verifier, md

    def load_weights(
        self,
        model: torch.nn.Module,
        step: int,
        *,
        strict: bool = True,
        exclude: Callable[[str], bool] | None = None,
    ) -> list[str]:
        """Load only the model's weights of checkpoint `step`, verified, into `model` (plain,
        DDP or FSDP2, resharded onto this world size); the keys loaded.

        `exclude(name)` keeps a key at its current value. `strict`: a key of the model that
        the checkpoint lacks, or one of the checkpoint that the model lacks, raises
        CheckpointMismatchError naming them; otherwise only the keys both have are loaded.
        A shape that differs always raises. Every rank of the collectives' group calls it; a
        checkpoint that fails verification raises VerificationFailed on every rank.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        manifest = self.collectives.agree(lambda: read_manifest(self.storage, step))
        reader, verifier, md = self._open(step, manifest)
        live = get_model_state_dict(model)
        skip = exclude or (lambda _name: False)
        want = {k: v for k, v in live.items() if isinstance(v, torch.Tensor) and not skip(k)}
        have = {
            k[len("model.") :]: tuple(getattr(v, "size", ()))
            for k, v in md.state_dict_metadata.items()
            if k.startswith("model.") and not skip(k[len("model.") :])
        }
        where = f"{self.storage.url}/{step_dir(step)}"
        missing, unexpected, shapes = misfit({k: tuple(t.shape) for k, t in want.items()}, have)
        if shapes or (strict and (missing or unexpected)):
            raise CheckpointMismatchError(
                f"checkpoint {where} does not fit the model: "
                + keys_said(missing, unexpected, shapes)
                + ". Exclude the keys that differ (init_exclude, or strict=False to load the "
                "keys both have)."
            )
        names = sorted(set(want) & set(have))
        template: dict[str, Any] = {"model": {k: want[k] for k in names}}
        try:
            self._dcp_load(template, reader)
        except CheckpointException as e:  # what a rank raised inside DCP, said plainly
            found = verification_problems(e)
            if found:
                raise VerificationFailed(found) from None
            raise CheckpointError(f"{where}: {self.storage.redact(why(e))}") from None
        finally:
            verifier.drop_ahead()
        set_model_state_dict(model, template["model"], options=StateDictOptions(strict=False))
        return names

    def _load(self, state: TrainState, step: int, manifest: Manifest) -> None:
        reader, verifier, md = self._open(step, manifest)
        saved = md.state_dict_metadata
        self._check_fits(state, saved, step)
        same_world = manifest.world_size == self.world_size and manifest.layout == state.layout
        if not same_world:
            self._log.warning(
                "ckpt.load.reshard",
                step=step,
                saved_world_size=manifest.world_size,
                world_size=self.world_size,
                **(
                    {"saved_mesh": manifest.layout, "mesh": state.layout}
                    if manifest.layout or state.layout
                    else {}
                ),
                note="per-rank state (RNG, dataloader position) is not restored",
                bitwise=False,
                reason="another world size or mesh layout: float reductions run in another "
                "order, so the bits differ from this step on (the samples stay exact)",
            )
        flat = flat_optim(saved)
        blob = same_world and f"rank{self.rank}" in saved
        template = state.load_template(rank=self.rank, has_rank_blob=blob, flat_optim=flat)
        try:
            self._dcp_load(template, reader)
        finally:
            verifier.drop_ahead()  # a load that failed before its check
        state.apply(template, rank=self.rank, flat_optim=flat)

    def _dcp_load(self, template: dict[str, Any], reader: Any) -> None:
        """DCP's load of `template` in place, restricted (SafeLoadPlanner), on this group."""
        dcp.load(
            template,
            storage_reader=reader,
            planner=SafeLoadPlanner(),
            process_group=self.collectives.group,
            no_dist=not self.collectives.distributed,
        )

    def _check_fits(self, state: TrainState, saved: dict[str, Any], step: int) -> None:
        """Each rank's model against the checkpoint, agreed by every rank: a key a rank's
        model holds that the checkpoint lacks, or holds in another shape, and a key of the
        checkpoint that no rank's model holds (pipeline stages each hold only their own
        layers; together they must cover the checkpoint). CheckpointMismatchError on every
        rank, naming the keys and the ranks."""
        have = {
            k[len("model.") :]: tuple(getattr(v, "size", ()))
            for k, v in saved.items()
            if k.startswith("model.")
        }
        mine: tuple[list[str], list[str], list[str]] | None = None
        if state.model is not None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            want = {
                k: tuple(v.shape)
                for k, v in get_model_state_dict(state.model).items()
                if isinstance(v, torch.Tensor)
            }
            mine = misfit(want, have)
        every = self.collectives.gather_all(mine)
        held = [m for m in every if m is not None]
        if not held:
            return
        missing = sorted({k for m in held for k in m[0]})
        shapes = sorted({k for m in held for k in m[2]})
        unexpected = sorted(set.intersection(*(set(m[1]) for m in held)))  # held by no rank
        if not (missing or unexpected or shapes):
            return
        ranks = [r for r, m in enumerate(every) if m is not None and (m[0] or m[2])]
        where = f"{self.storage.url}/{step_dir(step)}"
        staged = len(held) > 1 and any(m[1] for m in held) and not unexpected
        raise CheckpointMismatchError(
            f"checkpoint {where} does not match the tracked model: "
            + keys_said(missing, unexpected, shapes)
            + (f" (on rank(s) {ranks[:8]})" if ranks and len(held) > 1 else "")
            + (". The keys no rank's model holds are layers this model lacks" if unexpected else "")
            + (". Each rank's model holds only part of it (pipeline stages)" if staged else "")
            + ". Build the model the checkpoint was saved from (every layer, under the same "
            "names), point the checkpoint location at this model's checkpoints, or use a new one"
            + " (docs/checkpoints.md#global-names)."
        )


Shapes = dict[str, tuple[int, ...]]


def misfit(
    want: Shapes, have: Shapes, *, source: str = "checkpoint"
) -> tuple[list[str], list[str], list[str]]:
    """What a model's keys and shapes (`want`) and a source's (`have`) disagree on: the keys
    missing from the source, those it has beyond the model, and "key: <source> (shape) vs
    model (shape)" for each shape that differs."""
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    shapes = sorted(
        f"{k}: {source} {have[k]} vs model {want[k]}"
        for k in set(want) & set(have)
        if have[k] != want[k]
    )
    return missing, unexpected, shapes


def keys_said(missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    """`misfit`'s findings in words, the first ten of each kind, the empty kinds left out."""

    def some(keys: list[str]) -> str:
        return f"{keys[:10]}{'...' if len(keys) > 10 else ''}"

    parts = []
    if missing:
        parts.append(f"missing keys {some(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {some(unexpected)}")
    if shapes:
        parts.append(f"shape mismatches {some(shapes)}")
    return ", ".join(parts)


def flat_optim(saved: dict[str, Any]) -> bool:
    """Whether a checkpoint's optimizer state is keyed per parameter (DCP's
    flatten_optimizer_state_dict, as pipeline stages save it): its param_groups entries are
    `optim.param_groups.<parameter name>.<option>`, not `optim.param_groups.<index>.<option>`."""
    for key in saved:
        if key.startswith("optim.param_groups."):
            name = key[len("optim.param_groups.") :].rpartition(".")[0]
            return f"model.{name}" in saved
    return False
