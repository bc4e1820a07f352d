"""The checkpoint file: how far the commit log is known flushed and from where an abnormal recovery must
re-verify the log and rebuild queues. Written atomically (tmp + fsync + rename), CRC-protected; a
missing or damaged checkpoint means "recover from the first segment"."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from .atomicfile import write_atomic

_FMT = struct.Struct(">iqqqq")
_MAGIC = 0x43514B50  # "CQKP"
_CRC = struct.Struct(">I")


@dataclass
class Checkpoint:
    commit_log_flushed: int = 0  # every byte below is on disk
    recover_from: int = 0  # record boundary: commit log, queues and index are durable below it
    commit_log_end: int = 0  # exact end of the log at a clean shutdown (0 when unknown)
    timestamp: int = 0

    def save(self, path: str) -> None:
        data = _FMT.pack(_MAGIC, self.commit_log_flushed, self.recover_from, self.commit_log_end,
                         self.timestamp)
        data += _CRC.pack(zlib.crc32(data))
        write_atomic(path, data)

    @classmethod
    def load(cls, path: str) -> Checkpoint | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if len(data) != _FMT.size + 4 or zlib.crc32(data[:-4]) != _CRC.unpack(data[-4:])[0]:
            return None
        magic, flushed, recover_from, end, ts = _FMT.unpack(data[:-4])
        if magic != _MAGIC:
            return None
        return cls(flushed, recover_from, end, ts)
