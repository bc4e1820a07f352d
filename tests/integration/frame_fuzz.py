"""Hostile remoting traffic for a real broker or name server: frames that are well formed with hostile
values (random request codes with garbage header fields and bodies), frames whose header is garbage,
and streams broken on purpose (a bad length prefix, a frame cut short). ``flood`` sends them over many
connections, checks between rounds that a well-formed request is still answered, and reports what
happened. Deterministic for a seed; bounded in frames and time. Used by tests/integration and by
bench/fuzz_frames.py (the million-frame run)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from chronomq.remoting.codec import FrameDecoder, FrameError, RemotingCommand, encode

# request codes that read, or change only what any client may change (sends, offsets, heartbeats):
# the ones that create topics or groups, delete, reconfigure or promote are left out, so memory is
# compared with the same state before and after
CODES = (10, 11, 12, 14, 15, 21, 26, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 41, 42, 43, 45, 101, 103,
         104, 105, 106, 201, 202, 203, 204, 206, 208, 224, 300, 307, 310, 320, 9001, 9002, 9003, 9004,
         0, 1, 7, 99, 999, 65535, -1)
FIELDS = ("topic", "queueId", "queueOffset", "consumerGroup", "maxMsgNums", "sysFlag", "commitOffset",
          "suspendTimeoutMillis", "subscription", "properties", "bornTimestamp", "flag", "offset", "key",
          "maxNum", "beginTimestamp", "endTimestamp", "producerGroup", "tranStateTableOffset",
          "commitLogOffset", "commitOrRollback", "msgId", "id", "deliverMs", "byKey", "limit", "cursor",
          "group", "delayLevel", "originMsgId", "brokerName", "brokerAddr", "clusterName", "timestamp",
          "defaultTopic", "defaultTopicQueueNums", "batch", "a", "b", "b", "c", "d")
VALUES = ("", "0", "-1", "1", "2147483648", "-9223372036854775809", "99999999999999999999999", "NaN",
          "1e309", "%RETRY%x", "%DLQ%x", "SCHEDULE_TOPIC_XXXX", "TBW102", "a" * 300, "\x00", "\x01\x02",
          "名前", "\ud800", "true", "false", "null", "[]", "{}", "*", "||", "tag || other", "1.5",
          "0xFF", " 12 ", "FF" * 16, "7F000001000027110000000000000000")


_TRACEBACKS: list[str] = []  # answers whose remark carries a Python traceback (must stay empty)


@dataclass
class FloodStats:
    frames: int = 0
    structured: int = 0  # well-formed frames with hostile values
    connections: int = 0
    answered: int = 0
    closed_by_server: int = 0
    probes_ok: int = 0
    probes_failed: list[str] = field(default_factory=list)
    tracebacks: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _value(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.6:
        return rng.choice(VALUES)
    if r < 0.8:
        return str(rng.randint(-(1 << 70), 1 << 70))
    return "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(rng.randint(0, 40)))


def hostile_frame(rng: random.Random, opaque: int) -> bytes:
    """A well-formed frame with hostile values: a random request code, garbage header fields, a random
    body; one in ten is oneway (flag 2)."""
    ext = {rng.choice(FIELDS): _value(rng) for _ in range(rng.randint(0, 8))}
    body = rng.randbytes(rng.choice((0, 0, 1, 20, 300, 5000)))
    cmd = RemotingCommand(code=rng.choice(CODES), opaque=opaque, flag=2 if rng.random() < 0.1 else 0,
                          ext_fields=ext, body=body)
    try:
        return encode(cmd)
    except (ValueError, UnicodeEncodeError, OverflowError, struct.error):
        return hostile_frame(rng, opaque)


def garbage_frame(rng: random.Random) -> bytes:
    """A frame whose length is right and whose header is not: a JSON header of the wrong shape, or
    random bytes (header length and serialize type garbage too)."""
    if rng.random() < 0.6:
        header = json.dumps(rng.choice([[], 1, "x", {"code": "x"}, {"code": 10, "extFields": [1]},
                                        {"code": 10, "opaque": "q"}, {"code": 1 << 40},
                                        {"code": 10, "extFields": {"a": {"b": 1}}}])).encode()
        body = rng.randbytes(rng.randint(0, 64))
        return struct.pack(">ii", 4 + len(header) + len(body), len(header)) + header + body
    junk = rng.randbytes(rng.randint(4, 200))
    return struct.pack(">i", len(junk)) + junk


def breaking_stream(rng: random.Random) -> bytes:
    """Bytes that cannot be read as frames: the server must close the connection, nothing more."""
    return rng.choice([struct.pack(">i", -5), struct.pack(">i", 0x7FFFFFF0) + b"xx",
                       struct.pack(">i", 2) + b"ab", struct.pack(">ii", 40, 1 << 24) + b"x" * 36])


def _drain(sock: socket.socket, decoder: FrameDecoder, deadline: float, idle: float | None = None
           ) -> tuple[int, bool]:
    """Read what the server has sent until ``deadline``, or until nothing came for ``idle`` seconds;
    (frames read, connection closed)."""
    n = 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(min(left, idle) if idle is not None else left)
            data = sock.recv(1 << 16)
            if not data:
                return n, True
            for cmd in decoder.feed(data):
                n += 1
                if isinstance(cmd, RemotingCommand) and cmd.remark and "Traceback" in cmd.remark:
                    _TRACEBACKS.append(cmd.remark[:300])
    except (TimeoutError, BlockingIOError):
        pass
    except (ConnectionResetError, BrokenPipeError, FrameError):
        return n, True
    return n, False


def probe(addr: tuple[str, int], code: int, ext: dict[str, str] | None = None, timeout: float = 10.0,
          source: str | None = None) -> int:
    """A well-formed request on a fresh connection (from the address ``source``, default any): the
    response code (raises when none comes)."""
    with socket.create_connection(addr, timeout=timeout,
                                  source_address=(source, 0) if source else None) as s:
        s.sendall(encode(RemotingCommand(code=code, opaque=424242, ext_fields=ext or {})))
        decoder = FrameDecoder()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data = s.recv(1 << 16)
            if not data:
                raise ConnectionError(f"{addr} closed the connection without answering code {code}")
            for cmd in decoder.feed(data):
                if isinstance(cmd, RemotingCommand) and cmd.opaque == 424242:
                    return cmd.code
    raise TimeoutError(f"{addr} did not answer code {code} within {timeout} s")


def flood(addr: tuple[str, int], frames: int, connections: int, seed: int,
          probe_code: int, probe_ext: dict[str, str] | None = None, rounds: int = 10,
          max_seconds: float = 600.0) -> FloodStats:
    """Send ``frames`` hostile frames to ``addr`` over ``connections`` connections at a time, in
    ``rounds`` rounds; after each round a fresh connection must get a SUCCESS for ``probe_code``."""
    rng = random.Random(seed)
    stats = FloodStats()
    start = time.monotonic()
    per_round = max(1, frames // rounds)
    opaque = 1
    while stats.frames < frames and time.monotonic() - start < max_seconds:
        # four in five connections send well-formed hostile frames (each should be answered, but the
        # oneway ones); the others garbage, then a stream the server must give up on
        socks: list[tuple[socket.socket | None, FrameDecoder, bool]] = []
        for _ in range(connections):
            try:
                socks.append((socket.create_connection(addr, timeout=10), FrameDecoder(1 << 30),
                              rng.random() < 0.8))
                stats.connections += 1
            except OSError as e:
                stats.probes_failed.append(f"connect: {e}")
        budget = min(per_round, frames - stats.frames)
        for i in range(budget):
            k = i % len(socks)
            s, dec, structured = socks[k]
            if s is None:
                continue
            if structured:
                data = hostile_frame(rng, opaque)
                opaque += 1
                stats.structured += 1
            else:
                data = garbage_frame(rng) if rng.random() < 0.9 else breaking_stream(rng)
            try:
                s.sendall(data)
            except OSError:
                stats.closed_by_server += 1
                socks[k] = (None, dec, structured)
                continue
            stats.frames += 1
            if i % 64 == 63:  # read answers now and then, so neither side's buffers fill
                n, closed = _drain(s, dec, time.monotonic() + 0.001)
                stats.answered += n
                if closed:
                    stats.closed_by_server += 1
                    s.close()
                    socks[k] = (None, dec, structured)
        for s, dec, _structured in socks:
            if s is None:
                continue
            n, _closed = _drain(s, dec, time.monotonic() + 5.0, idle=0.05)
            stats.answered += n
            s.close()
        try:
            code = probe(addr, probe_code, probe_ext)
            if code == 0:
                stats.probes_ok += 1
            else:
                stats.probes_failed.append(f"probe answered code {code}")
        except (OSError, TimeoutError, ConnectionError) as e:
            stats.probes_failed.append(f"probe: {e}")
    stats.seconds = time.monotonic() - start
    stats.tracebacks = list(_TRACEBACKS)
    _TRACEBACKS.clear()
    return stats


@dataclass
class ConnectionFloodStats:
    opened: int = 0  # connections the flood opened (all of them accepted by the kernel)
    kept: int = 0  # of those, left open by the server
    probes_during: list[int | str] = field(default_factory=list)  # answer codes (or errors) in the flood
    probe_after: int | str = ""
    slow_closed: int = 0  # slow-loris connections the server closed
    slow: int = 0
    fds: tuple[int, int, int] = (0, 0, 0)  # the server's open files before, during, after
    # the server's descriptors that are its end of one of the flood's connections, during and after: the
    # kept ones are held (exactly ``kept``) and let go (0); unlike the open-file count, no file the server
    # opens or closes by itself meanwhile shows here
    held: tuple[int, int] = (0, 0)
    rss: tuple[int, int, int] = (0, 0, 0)
    seconds: float = 0.0


def _closed(sock: socket.socket) -> bool:
    """Whether the peer has closed ``sock``. What it sent is read and dropped: an answer sent before the
    close would otherwise hide the end of the stream from a peek (a name server answers, then closes)."""
    timeout = sock.gettimeout()
    sock.settimeout(0)  # with a timeout, recv would first wait for data to read
    try:
        while sock.recv(65536):
            pass
        return True
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _tcp_peers() -> dict[str, tuple[str, int]]:
    """Socket inode -> (remote address in /proc/net/tcp's hex, remote port) of every TCP socket of this
    network namespace (IPv4 and IPv6; an IPv4 peer of a dual-stack socket shows as ::ffff:a.b.c.d)."""
    out: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, _, port = f[2].partition(":")
            out[f[9]] = (addr, int(port, 16))
    return out


def held_connections(pid: int, peers: set[int]) -> int:
    """How many of ``pid``'s descriptors are its end of a loopback TCP connection whose other end is one of
    the local ``peers`` ports (the ports of this process's own client sockets)."""
    by_inode = _tcp_peers()
    n = 0
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            peer = by_inode.get(link[8:-1])
            n += peer is not None and peer[1] in peers
    return n


def connection_flood(addr: tuple[str, int], pid: int, connections: int, keep: int, probe_code: int,
                     slow: int = 0, slow_interval: float = 0.2, max_seconds: float = 120.0
                     ) -> ConnectionFloodStats:
    """``connections`` connections from 127.0.0.1 that send one well-formed request and then nothing (so
    that no frame timeout, only a connection limit, closes them), of which the server should keep
    ``keep`` (its serverMaxConnectionsPerIp); meanwhile well-formed requests from 127.0.0.2, and ``slow``
    slow-loris connections (a frame a byte every ``slow_interval`` s) that the server must close
    (serverFrameReadTimeoutMillis). Then the flood is closed and a request from 127.0.0.1 must be
    answered again. Counts the server's open files and RSS before, during and after, and the descriptors
    it holds for the flood's own connections during and after."""
    st = ConnectionFloodStats()
    start = time.monotonic()
    deadline = start + max_seconds
    st.fds, st.rss = (open_files(pid), 0, 0), (rss_bytes(pid), 0, 0)
    socks: list[socket.socket] = []
    ports: set[int] = set()  # the local ports of the flood's and the slow-loris' connections
    request = encode(RemotingCommand(code=probe_code, opaque=1))
    try:
        for _ in range(connections):
            s = socket.create_connection(addr, timeout=10, source_address=("127.0.0.1", 0))
            socks.append(s)
            with contextlib.suppress(OSError):  # refused already
                s.sendall(request)
        st.opened = len(socks)
        ports.update(s.getsockname()[1] for s in socks)
        while time.monotonic() < deadline:  # until the server has closed all it will not keep
            st.kept = sum(not _closed(s) for s in socks)
            if st.kept <= keep:
                break
            time.sleep(0.05)
        # the ones left open were accepted and are held (a closed one was accepted too, then closed)
        while time.monotonic() < deadline and held_connections(pid, ports) < st.kept:
            time.sleep(0.05)
        st.held = (held_connections(pid, ports), 0)
        st.fds = (st.fds[0], open_files(pid), 0)
        st.rss = (st.rss[0], rss_bytes(pid), 0)
        slow_socks = [socket.create_connection(addr, timeout=10, source_address=("127.0.0.2", 0))
                      for _ in range(slow)]
        sent = 0
        while time.monotonic() < deadline:
            for s in slow_socks:
                with contextlib.suppress(OSError):
                    s.send(request[sent % len(request) : sent % len(request) + 1])
            sent += 1
            try:
                st.probes_during.append(probe(addr, probe_code, source="127.0.0.2"))
            except (OSError, TimeoutError, ConnectionError) as e:
                st.probes_during.append(f"{type(e).__name__}: {e}")
            st.slow_closed = sum(_closed(s) for s in slow_socks)
            if st.slow_closed == slow and len(st.probes_during) >= 3:
                break
            time.sleep(slow_interval)
        st.slow = slow
        ports.update(s.getsockname()[1] for s in slow_socks)
        for s in slow_socks:
            s.close()
    finally:
        for s in socks:
            s.close()
    while time.monotonic() < deadline and held_connections(pid, ports) > 0:  # the server let them go
        time.sleep(0.05)
    st.held = (st.held[0], held_connections(pid, ports))
    try:
        st.probe_after = probe(addr, probe_code, source="127.0.0.1")
    except (OSError, TimeoutError, ConnectionError) as e:
        st.probe_after = f"{type(e).__name__}: {e}"
    st.fds = (st.fds[0], st.fds[1], open_files(pid))
    st.rss = (st.rss[0], st.rss[1], rss_bytes(pid))
    st.seconds = time.monotonic() - start
    return st


def rss_bytes(pid: int, kind: str = "VmRSS") -> int:
    """VmRSS (all), RssAnon (the heap) or RssFile (mapped files: the commit log's pages) of ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) * 1024
    return 0


def seed_from_env(default: int = 20261124) -> int:
    return int(os.environ.get("CHRONOMQ_FUZZ_SEED", default))
