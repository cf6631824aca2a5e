"""Atomic file writes: write a temp file beside the target, flush it, then rename over it.

A crash or an exception mid-write never leaves a half-written file at ``path``: the old file (if
any) stays, and the temp file is removed.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

FILE_MODE = 0o644  # mkstemp creates 0600; our files are committed and shared


def _fsync(path: Path, directory: bool = False) -> None:
    """Flush a file (or a directory entry) to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, copy_existing: bool = False) -> Iterator[Path]:
    """Yield a temp path in ``path``'s directory; on success it replaces ``path``.

    Args:
        path: the file to (re)write.
        copy_existing: start the temp file as a copy of ``path`` (for appending a group).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{path.name}.tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        if copy_existing and path.exists():
            tmp.write_bytes(path.read_bytes())
        else:
            tmp.unlink()  # writers (h5py, netCDF) create the file themselves
        yield tmp
        os.chmod(tmp, FILE_MODE)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent, directory=True)
