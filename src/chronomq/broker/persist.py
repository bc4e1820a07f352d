"""Atomic JSON files: write to a temp file, fsync it, rename over the target, fsync the directory."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from chronomq.store.atomicfile import write_atomic

log = logging.getLogger("chronomq.broker")


def write_json_atomic(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_json(path: Path) -> Any | None:
    """Read a JSON file written by write_json_atomic; a missing file is None. A corrupt one (only after
    manual edits or disk damage: the writes are atomic) is logged, kept aside as <name>.corrupt for a
    human to look at, and treated as missing."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        aside = path.with_name(path.name + ".corrupt")
        try:
            os.replace(path, aside)
        except OSError:
            aside = path
        log.error("cannot read %s (%s); starting without it (kept as %s)", path, e, aside.name)
        return None
