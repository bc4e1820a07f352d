"""Atomic JSON files: write to a temp file, fsync it, keep the previous one as <name>.bak, rename over
the target, fsync the directory; read back with the fallback to the .bak (store/atomicfile.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chronomq.store.atomicfile import read_with_backup, write_atomic


def write_json_atomic(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode(), backup=True)


def read_json(path: Path) -> Any | None:
    """Read a JSON file written by write_json_atomic; a missing file is None. A damaged one (only after
    disk damage or manual edits: the writes are atomic) is read from its .bak; see read_with_backup
    for what happens when there is none."""
    got = read_with_backup(path, json.loads)
    return None if got is None else got[0]
