"""Committed consumer offsets per (group, topic, queue), persisted to config/consumerOffset.json
(RocketMQ's layout: {"offsetTable": {"topic@group": {"0": 17, ...}}}) atomically, every
flushConsumerOffsetInterval and at shutdown."""

from __future__ import annotations

import threading
from pathlib import Path

from .persist import read_json, write_json_atomic


class ConsumerOffsetManager:
    def __init__(self, config_dir: Path) -> None:
        self.path = config_dir / "consumerOffset.json"
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()
        self.table: dict[str, dict[int, int]] = {}
        self._version = 0
        self._persisted_version = 0
        obj = read_json(self.path) or {}
        for key, queues in (obj.get("offsetTable") or {}).items():
            if isinstance(queues, dict):
                self.table[key] = {int(q): int(o) for q, o in queues.items()}

    @staticmethod
    def key(group: str, topic: str) -> str:
        return f"{topic}@{group}"

    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        with self._lock:
            queues = self.table.setdefault(self.key(group, topic), {})
            if queues.get(queue_id) != offset:
                queues[queue_id] = offset
                self._version += 1

    def take(self, table: dict[str, dict[int, int]]) -> int:
        """A slave takes its master's offsets (slave_sync.py): each topic@group of ``table`` replaces the
        slave's entry for it, others stay, as RocketMQ's putAll. Returns how many entries changed."""
        changed = 0
        with self._lock:
            for key, queues in table.items():
                if self.table.get(key) != queues:
                    self.table[key] = dict(queues)
                    changed += 1
            if changed:
                self._version += 1
        return changed

    def query(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 when the group never committed one for this queue."""
        queues = self.table.get(self.key(group, topic))
        if queues is None:
            return -1
        return queues.get(queue_id, -1)

    def groups_of_topic(self, topic: str) -> list[str]:
        return sorted(k.split("@", 1)[1] for k in self.table if k.split("@", 1)[0] == topic)

    def offsets_of(self, group: str, topic: str) -> dict[int, int]:
        return dict(self.table.get(self.key(group, topic), {}))

    def remove_group(self, group: str) -> None:
        with self._lock:
            for k in [k for k in self.table if k.split("@", 1)[1] == group]:
                del self.table[k]
            self._version += 1

    def persist(self, force: bool = False) -> bool:
        with self._file_lock:  # one writer of the file at a time (periodic thread vs shutdown)
            with self._lock:
                if not force and self._version == self._persisted_version:
                    return False
                version = self._version
                snapshot = {
                    "offsetTable": {
                        k: {str(q): o for q, o in sorted(v.items())} for k, v in self.table.items()
                    }
                }
            write_json_atomic(self.path, snapshot)
            self._persisted_version = version
            return True
