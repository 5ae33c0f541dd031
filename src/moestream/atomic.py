"""Files and directories the user asked for appear whole or not at all, and survive a crash once written.

A file is written to a temporary name beside its target, flushed, fsynced and renamed over the target;
then the directory is fsynced so the rename itself is on disk. A directory (a checkpoint, a packed
store) is filled under a temporary name beside its target, every file in it fsynced, and renamed into
place; an existing target is moved aside only once the new one is complete, and removed after the new
one is in place. On any failure the temporary file or directory is removed and the target is as it was.

A directory written from a source (pack SRC DST) names that source as protected: a target that is the
source, lies inside it or contains it is refused, so replacing the target can never delete the source."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from .errors import InputError


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# mkstemp and mkdtemp make private files; what is written gets the mode open() and mkdir() would give
_UMASK = _umask()
FILE_MODE = 0o666 & ~_UMASK
DIR_MODE = 0o777 & ~_UMASK


def fsync_dir(path: Path) -> None:
    """Makes the entries of directory `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsyncs every regular file under root, then every directory, deepest first."""
    for here, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = os.path.join(here, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(here))


@contextmanager
def atomic_write(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """A file object to write `path` through: the target is replaced only when the block ends without
    an exception, with the data on disk."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _real(path: Path) -> Path:
    """path with every symlink resolved (the part that does not exist yet taken as written)."""
    return Path(os.path.realpath(path))


def overlap(a: Path, b: Path) -> bool:
    """a and b are the same path, or one lies inside the other, once symlinks are resolved."""
    ra, rb = _real(a), _real(b)
    return ra == rb or ra in rb.parents or rb in ra.parents


def refuse_overlap(target: Path, protect: Iterable[Path], what: str) -> None:
    """InputError if writing (and so replacing) target could touch any protected path."""
    for src in protect:
        if overlap(target, src):
            raise InputError(
                f"{what}: the destination {target} is, contains or lies inside the source {src}; "
                "choose a destination outside it"
            )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _put_in_place(tmp: Path, target: Path) -> None:
    """Renames the complete tmp to target; an existing target is moved aside first and removed only after
    tmp is in its place (or moved back if that fails)."""
    if not (target.exists() or target.is_symlink()):
        os.replace(tmp, target)
        return
    aside = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:12]}")
    os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(aside, target)
        raise
    _remove(aside)


@contextmanager
def atomic_dir(target: Path, protect: Iterable[Path] = (), what: str = "write") -> Iterator[Path]:
    """A temporary directory beside target to fill; when the block ends without an exception its files
    are fsynced and it becomes target (replacing an existing one). `protect`: source paths target must
    not overlap (checked before anything is written and again before anything is replaced); `what`
    names the command in the error."""
    target = Path(target)
    protect = [Path(p) for p in protect]
    refuse_overlap(target, protect, what)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        tmp.chmod(DIR_MODE)
        refuse_overlap(target, protect, what)  # a symlink may have changed while the block ran
        _put_in_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)
