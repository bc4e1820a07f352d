"""The HA link's frames, sans-IO (RocketMQ 4.x HAConnection/HAClient framing).

master -> slave: phyOffset int64 + bodySize int32 + body (commit-log bytes from phyOffset); a frame
with an empty body is a heartbeat that carries the master's next offset for this slave.
slave -> master: its max commit-log offset, int64 (the ack and the "send me from here").
Big-endian, as Java's ByteBuffer. A body larger than the decoder's limit is a protocol error.
"""

from __future__ import annotations

import struct

TRANSFER_HEADER = struct.Struct(">qi")
REPORT = struct.Struct(">q")


class HAProtocolError(Exception):
    pass


def encode_transfer(offset: int, body: bytes | memoryview = b"") -> bytes:
    return TRANSFER_HEADER.pack(offset, len(body)) + bytes(body)


def encode_report(offset: int) -> bytes:
    return REPORT.pack(offset)


class TransferDecoder:
    """Bytes from the master in, (offset, body) frames out."""

    def __init__(self, max_body: int) -> None:
        self._buf = bytearray()
        self._max = max_body

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        out: list[tuple[int, bytes]] = []
        pos = 0
        hs = TRANSFER_HEADER.size
        while len(buf) - pos >= hs:
            offset, size = TRANSFER_HEADER.unpack_from(buf, pos)
            if size < 0 or size > self._max or offset < 0:
                raise HAProtocolError(f"bad transfer header: offset {offset}, body size {size}")
            if len(buf) - pos - hs < size:
                break
            out.append((offset, bytes(buf[pos + hs : pos + hs + size])))
            pos += hs + size
        del buf[:pos]
        return out


class ReportDecoder:
    """Bytes from the slave in, reported offsets out."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[int]:
        buf = self._buf
        buf += data
        n = len(buf) // REPORT.size
        out = [REPORT.unpack_from(buf, i * REPORT.size)[0] for i in range(n)]
        del buf[: n * REPORT.size]
        for off in out:
            if off < 0:
                raise HAProtocolError(f"bad offset report {off}")
        return out
