"""Crash-safe replacement of small files (checkpoint, topics.json, consumerOffset.json, delayOffset.json).

Write a temp file, fsync it, rename it over the target, fsync the directory: a reader (or a restart after
a crash) sees the old content or the new, never a mix. Writers of one path inside a process are
serialised, so two threads saving the same file (a periodic persist and a shutdown persist) cannot race
on the shared temp file. A failed write (ENOSPC) removes the temp file and raises; the target is kept.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from . import faults

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(path: Path) -> threading.Lock:
    key = str(path.absolute())
    with _locks_guard:
        lock = _locks.get(key)
        if lock is None:
            lock = _locks[key] = threading.Lock()
        return lock


def write_atomic(path: str | os.PathLike[str], data: bytes, *, backup: bool = False) -> None:
    """Replace ``path`` with ``data`` atomically and durably. With ``backup`` the previous content is
    kept as ``<name>.bak`` (a fallback when the newest file is unreadable)."""
    p = Path(path)
    with _lock_for(p):
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            fd = -1
            tmp.unlink(missing_ok=True)  # a full disk: give its blocks back; the old file is untouched
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        faults.point("atomic." + p.name)
        if backup and p.exists():
            try:
                os.replace(p, p.with_name(p.name + ".bak"))
            except OSError:
                pass
        os.replace(tmp, p)
        try:
            dfd = os.open(p.parent, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dfd)  # the rename itself
        finally:
            os.close(dfd)
