"""Per-level schedule offsets, persisted to ``<storePathRootDir>/config/delayOffset.json``.

Written atomically (tmp file + fsync + rename + fsync of the directory). The layout keeps RocketMQ's
``offsetTable`` (level -> next schedule-queue offset to deliver) and adds ``scanFromPhyOffset``: a
commit-log position at or below every re-put that happened after the snapshot, so that after a crash
the service can scan the commit log from there and skip entries it had already delivered.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from chronomq.store.atomicfile import read_with_backup, write_atomic

log = logging.getLogger(__name__)

FILE_NAME = "delayOffset.json"


@dataclass
class OffsetSnapshot:
    offsets: dict[int, int] = field(default_factory=dict)  # level -> next queue offset to deliver
    scan_from_phy: int = 0  # commit-log offset from which re-puts newer than the snapshot may exist
    saved_at_ms: int = 0

    def to_json(self) -> str:
        return json.dumps(
            {
                "offsetTable": {str(k): v for k, v in sorted(self.offsets.items())},
                "scanFromPhyOffset": self.scan_from_phy,
                "savedAtMs": self.saved_at_ms,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> OffsetSnapshot:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("offsetTable", {}), dict):
            raise ValueError("not a delay offset table")
        offsets = {}
        for k, v in data.get("offsetTable", {}).items():
            level, off = int(k), int(v)
            if level < 1 or off < 0:
                raise ValueError(f"bad entry {k}: {v}")
            offsets[level] = off
        return cls(offsets, int(data.get("scanFromPhyOffset", 0)), int(data.get("savedAtMs", 0)))


class OffsetFile:
    def __init__(self, store_root: str | Path) -> None:
        self.path = Path(store_root) / "config" / FILE_NAME

    def load(self) -> OffsetSnapshot | None:
        """The last persisted snapshot, or None when there is none. A damaged file falls back to the
        ``.bak`` copy of the previous snapshot (older, so never ahead of the truth); with both damaged
        the broker refuses to start (store/atomicfile.read_with_backup)."""
        got = read_with_backup(self.path, lambda raw: OffsetSnapshot.from_json(raw.decode()))
        return None if got is None else got[0]

    def save(self, snap: OffsetSnapshot) -> None:
        # the previous good snapshot stays as .bak: it is older, so never ahead of the truth
        write_atomic(self.path, snap.to_json().encode(), backup=True)
