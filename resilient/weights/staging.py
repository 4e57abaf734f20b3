"""Where an export goes: a local directory that appears whole, at once, or not at all.

Everything is written into a sibling `<DST>.partial-<pid>`, fsynced, and renamed to DST at
the end. A destination that exists and is not empty is refused unless `force`; with it, the
old one is moved aside only once the new one is complete, and deleted after. An exception
(Ctrl-C included) removes the partial directory; a kill leaves it, never a file under a
final name.

Local only: the rename is what makes an export appear at once, and object stores have no
rename of a directory (a remote export would need a commit protocol of its own).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import TracebackType

from resilient.errors import ConfigError
from resilient.storage import fsync_dir

__all__ = ["Staging", "check_destination", "local_destination"]


def local_destination(dst: str | os.PathLike[str]) -> Path:
    """`dst` as an absolute local path; ConfigError for a remote URL."""
    text = os.fspath(dst)
    if not text:
        raise ConfigError("the destination is empty: give a local directory (--to DIR)")
    if "://" in text and not text.startswith("file://"):
        raise ConfigError(
            f"{text}: export writes to a local directory only (its result appears at once by "
            "a rename, which object stores lack); export locally, then upload the directory"
        )
    return Path(text.removeprefix("file://")).absolute()


def check_destination(target: Path, *, force: bool) -> bool:
    """Whether `target` holds something that `force` replaces; ConfigError without it."""
    if not target.exists() and not target.is_symlink():
        return False
    if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        return False  # an empty directory: the rename takes its place
    if not force:
        raise ConfigError(
            f"{target} exists and is not empty: export never overwrites; pass --force "
            "(force=True) to replace it once the new export is complete"
        )
    return True


class Staging:
    """The temporary sibling directory an export is written into, and its commit: fsync,
    then a rename into place (the old destination moved aside first, deleted after)."""

    def __init__(self, target: Path, *, replace: bool) -> None:
        self.target = target
        self.replace = replace
        self.tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")

    def __enter__(self) -> Path:
        if self.tmp.exists():  # this pid's own leftover (an earlier process of the same pid)
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            self._commit()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _commit(self) -> None:
        fsync_dir(str(self.tmp))
        parent = self.target.parent
        if not self.replace:
            os.replace(self.tmp, self.target)  # onto nothing, or an empty directory
            fsync_dir(str(parent))
            return
        old = self.target.with_name(f"{self.target.name}.old-{os.getpid()}")
        os.rename(self.target, old)
        try:
            os.rename(self.tmp, self.target)
        except BaseException:
            os.rename(old, self.target)
            raise
        fsync_dir(str(parent))
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
