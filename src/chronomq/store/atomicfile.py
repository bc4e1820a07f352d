"""Crash-safe replacement of small files (checkpoint, topics.json, consumerOffset.json, delayOffset.json),
and reading them back with RocketMQ's fallback to the ``.bak`` copy.

Write a temp file, fsync it, rename it over the target, fsync the directory: a reader (or a restart after
a crash) sees the old content or the new, never a mix. Writers of one path inside a process are
serialised, so two threads saving the same file (a periodic persist and a shutdown persist) cannot race
on the shared temp file. A failed write (ENOSPC) removes the temp file and raises; the target is kept.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from chronomq.config import ConfigError

from . import faults

log = logging.getLogger("chronomq.store")
T = TypeVar("T")

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


def read_with_backup(path: str | os.PathLike[str], parse: Callable[[bytes], T], *, strict: bool = False
                     ) -> tuple[T, bool] | None:
    """The newest readable copy of a file written with ``write_atomic(backup=True)``: (``parse`` of
    ``path``, False), else (``parse`` of ``<name>.bak``, True), as RocketMQ's ConfigManager falls back to
    its .bak (logged at WARNING). None when neither exists. ``parse`` raises ValueError (or KeyError,
    TypeError) for content it cannot use. With no readable copy: ConfigError (the broker refuses to
    start, as RocketMQ does) when a backup existed or ``strict``; else, a damaged file without a backup
    (never written twice) is logged at ERROR, kept as ``<name>.corrupt`` and treated as missing."""
    p = Path(path)
    bak = p.with_name(p.name + ".bak")
    errors: dict[Path, str] = {}
    for candidate in (p, bak):
        try:
            value = parse(candidate.read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as e:
            errors[candidate] = f"{type(e).__name__}: {e}"
            continue
        if candidate is bak:
            log.warning("%s is %s; using its backup %s (the state saved before the last write)", p,
                        f"unreadable ({errors[p]})" if p in errors else "missing", bak.name)
        return value, candidate is bak
    if not errors:
        return None
    if bak in errors or strict:
        said = "; ".join(f"{k.name}: {v}" for k, v in errors.items())
        raise ConfigError(f"{p}: no readable copy ({said}). Restore it from a backup, or move "
                          f"{p.name} and {bak.name} aside to start without them")
    aside = p.with_name(p.name + ".corrupt")
    try:
        os.replace(p, aside)
    except OSError:
        aside = p
    log.error("cannot read %s (%s) and it has no backup; starting without it (kept as %s)", p, errors[p],
              aside.name)
    return None
