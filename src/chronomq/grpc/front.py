"""The gRPC endpoint's public port: TLS and plaintext on one port, as RocketMQ's proxy serves them.

grpcio serves one kind of connection per port, so the grpc server listens on 127.0.0.1 only, on a
plaintext port and a TLS port (grpc's own TLS: its handshake, ALPN h2, client certificates), and this
front owns the public port. It reads the first bytes of each connection:

- a TLS record header of a handshake (0x16 0x03 0x00..0x04): a TLS client;
- the HTTP/2 client preface (``PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n``): a plaintext gRPC client;
- anything else, or nothing within ``first_bytes_timeout``: closed.

A connection the mode admits is connected to the matching internal port and its bytes are relayed both
ways unchanged (no decryption here); one the mode refuses (plaintext when enforcing, TLS when disabled)
is closed. Refusals and junk are logged at DEBUG, one line per connection.

The relay is two asyncio Protocols writing into each other's transports: what one side reads is written to
the other as it comes, a side whose peer's write buffer is full stops reading until it drains, an EOF is
passed on as a half-close (TCP shutdown of writing), and when either side is gone both are closed.

grpc sees every relayed connection coming from 127.0.0.1; ``client_of`` maps the internal connection's
address (grpc's ``peer()``) back to the client's, for what the endpoint records about clients.
Connections are counted and limited per server and per client address (the broker's
serverMaxConnections / serverMaxConnectionsPerIp; 0 = no limit), and against the process's open-file
budget, which the remoting servers share (``chronomq.netbudget``): a relayed connection holds 3
descriptors. Times (how often a refusal is logged) are read from the clock the front is given.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import cast

from chronomq import netbudget
from chronomq.clock import Clock, SystemClock

from .tls import DISABLED, ENFORCING

log = logging.getLogger("chronomq.grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
WRITE_HIGH_WATER = 1024 * 1024  # bytes queued for one side before the other stops reading
LIMIT_LOG_INTERVAL = 60.0  # s between two warnings about refused connections
# descriptors a relayed connection holds: the client's socket, the front's connection to the internal
# port, and grpc's end of that connection
RELAY_DESCRIPTORS = 3


class Greeting(enum.StrEnum):
    """What a connection's first bytes say it is."""

    TLS = "tls"
    PLAINTEXT = "plaintext"  # the HTTP/2 client preface
    JUNK = "junk"  # neither


class _State(enum.Enum):
    """A client connection's life: sniff -> connecting -> relay -> closed."""

    SNIFF = enum.auto()
    CONNECTING = enum.auto()
    RELAY = enum.auto()
    CLOSED = enum.auto()


def classify(head: bytes) -> Greeting | None:
    """What the first bytes are, or None when more bytes are needed to tell."""
    if not head:
        return None
    if head[0] == 0x16:  # TLS record: handshake
        if len(head) < 3:
            return None
        return Greeting.TLS if head[1] == 0x03 and head[2] <= 0x04 else Greeting.JUNK
    n = min(len(head), len(PREFACE))
    if head[:n] != PREFACE[:n]:
        return Greeting.JUNK
    return Greeting.PLAINTEXT if n == len(PREFACE) else None


def grpc_peer(addr: tuple) -> str:
    """A socket address as grpc's ``peer()`` writes it: ipv4:1.2.3.4:5 or ipv6:[::1]:5."""
    host, port = addr[0], addr[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


@dataclass
class FrontStats:
    accepted: int = 0
    tls: int = 0
    plaintext: int = 0
    refused_mode: int = 0  # plaintext when enforcing, TLS when disabled
    refused_limit: int = 0
    junk: int = 0  # neither TLS nor HTTP/2, or nothing in time, or closed before saying
    upstream_failed: int = 0


class PortFront:
    """``await start()`` listens on ``host:port`` (0: any free port; ``port`` is the bound one afterwards);
    ``await stop()`` closes the listener and every relayed connection."""

    def __init__(self, host: str, port: int, mode: str, *, plaintext_port: int | None, tls_port: int | None,
                 max_connections: int = 0, max_connections_per_ip: int = 0,
                 first_bytes_timeout: float = 30.0, clock: Clock | None = None) -> None:
        self.host = host
        self.port = port
        self.mode = mode
        self.plaintext_port = plaintext_port
        self.tls_port = tls_port
        self.max_connections = max_connections
        self.max_connections_per_ip = max_connections_per_ip
        self.first_bytes_timeout = first_bytes_timeout
        self.clock: Clock = clock or SystemClock()
        self.budget = netbudget.connection_budget()  # descriptors, shared with every listener here
        self.stats = FrontStats()
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Client] = set()
        self._per_ip: dict[str, int] = {}
        self._clients: dict[int, str] = {}  # local port of an internal connection -> the client's peer()
        self._limit_logged_at = float("-inf")
        self._limit_unlogged = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Client(self), self.host, self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for c in list(self._conns):
            c.abort()
        if server is not None:
            await server.wait_closed()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def client_of(self, peer: str) -> str:
        """grpc's ``peer()`` of a relayed connection -> the client's address in the same form (anything
        else unchanged)."""
        if peer.startswith("ipv4:127.0.0.1:"):
            port = peer.rpartition(":")[2]
            if port.isdigit():
                return self._clients.get(int(port), peer)
        return peer

    # --- bookkeeping for _Client ---------------------------------------------------------------------------
    def _admit(self, conn: _Client) -> bool:
        self.stats.accepted += 1
        ip = conn.peer[0]
        why = netbudget.refusal(len(self._conns), self.max_connections, ip, self._per_ip.get(ip, 0),
                                self.max_connections_per_ip, RELAY_DESCRIPTORS, self.budget)
        if why is not None:
            self.stats.refused_limit += 1
            now = self.clock.monotonic()
            if now - self._limit_logged_at >= LIMIT_LOG_INTERVAL:
                more = self._limit_unlogged
                log.warning("gRPC endpoint: connection from %s refused: %s%s", grpc_peer(conn.peer), why,
                            f" ({more} more refused since the last warning)" if more else "")
                self._limit_logged_at, self._limit_unlogged = now, 0
            else:
                self._limit_unlogged += 1
            return False
        self._conns.add(conn)
        self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        netbudget.take(RELAY_DESCRIPTORS)
        return True

    def _forget(self, conn: _Client) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        netbudget.give(RELAY_DESCRIPTORS)
        ip = conn.peer[0]
        left = self._per_ip.get(ip, 0) - 1
        if left > 0:
            self._per_ip[ip] = left
        else:
            self._per_ip.pop(ip, None)
        if conn.internal_port is not None and self._clients.get(conn.internal_port) == grpc_peer(conn.peer):
            del self._clients[conn.internal_port]


def _write(t: asyncio.Transport | None, data: bytes) -> None:
    if t is not None and not t.is_closing():  # closing: its connection_lost closes the other side
        t.write(data)


def _pause(t: asyncio.Transport | None) -> None:
    if t is not None and not t.is_closing():
        t.pause_reading()


def _resume(t: asyncio.Transport | None) -> None:
    if t is not None and not t.is_closing():
        t.resume_reading()


class _Client(asyncio.Protocol):
    """One client connection: sniffing its first bytes, then relaying to an internal port."""

    def __init__(self, front: PortFront) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.peer: tuple = ("?", 0)
        self.head = bytearray()
        self.state = _State.SNIFF
        self.upstream: _Upstream | None = None
        self.internal_port: int | None = None
        self.eof_from_client = False
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    # --- the client's side -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport instances
        self.peer = transport.get_extra_info("peername") or ("?", 0)
        if not self.front._admit(self):
            self.state = _State.CLOSED
            self.transport.abort()
            return
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        if self.front.first_bytes_timeout > 0:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.front.first_bytes_timeout, self._first_bytes_late)

    def data_received(self, data: bytes) -> None:
        if self.state is _State.RELAY:
            assert self.upstream is not None and self.upstream.transport is not None
            _write(self.upstream.transport, data)
            return
        if self.state is not _State.SNIFF:
            self.head += data  # not expected while connecting (reading is paused), kept for the relay
            return
        self.head += data
        kind = classify(bytes(self.head[:len(PREFACE)]))
        if kind is None:
            return
        self._cancel_timer()
        if kind is Greeting.JUNK:
            self._refuse(f"neither TLS nor HTTP/2 (first bytes {bytes(self.head[:8])!r})")
            return
        mode = self.front.mode
        if kind is Greeting.TLS and mode == DISABLED:
            self._refuse("TLS refused: tls.server.mode is disabled (plaintext only)", by_mode=True)
            return
        if kind is Greeting.PLAINTEXT and mode == ENFORCING:
            self._refuse("plaintext refused: tls.server.mode is enforcing (TLS only)", by_mode=True)
            return
        port = self.front.tls_port if kind is Greeting.TLS else self.front.plaintext_port
        assert port is not None
        if kind is Greeting.TLS:
            self.front.stats.tls += 1
        else:
            self.front.stats.plaintext += 1
        self.state = _State.CONNECTING
        assert self.transport is not None
        self.transport.pause_reading()
        self._task = asyncio.get_running_loop().create_task(self._connect(port))  # a reference keeps it

    def eof_received(self) -> bool | None:
        if self.state is not _State.RELAY:
            if self.state is _State.SNIFF:
                self._refuse(f"closed after {len(self.head)} bytes, before it was TLS or HTTP/2")
                return None
            self.eof_from_client = True  # connecting: passed on once connected
            return True
        self.eof_from_client = True
        up = self.upstream
        assert up is not None and up.transport is not None
        if up.eof_from_upstream:
            self._close_both()
            return None
        if up.transport.can_write_eof() and not up.transport.is_closing():
            up.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _State.CLOSED
        self._cancel_timer()
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()  # what the client sent before is flushed first
        self.front._forget(self)

    def pause_writing(self) -> None:  # the client reads slower than grpc writes
        if self.upstream is not None:
            _pause(self.upstream.transport)

    def resume_writing(self) -> None:
        if self.upstream is not None:
            _resume(self.upstream.transport)

    # --- helpers ------------------------------------------------------------------------------------------
    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _first_bytes_late(self) -> None:
        self._timer = None
        if self.state is _State.SNIFF:
            self._refuse(f"{len(self.head)} bytes in {self.front.first_bytes_timeout:g} s, not yet "
                                 "TLS or HTTP/2")

    def _refuse(self, text: str, *, by_mode: bool = False) -> None:
        """Closed: junk, or (``by_mode``) a kind of connection the TLS mode refuses."""
        if by_mode:
            self.front.stats.refused_mode += 1
        else:
            self.front.stats.junk += 1
        log.debug("gRPC endpoint: connection from %s closed: %s", grpc_peer(self.peer), text)
        self.state = _State.CLOSED
        if self.transport is not None:
            self.transport.abort()  # nothing to flush; no lingering half-open socket

    def abort(self) -> None:
        self.state = _State.CLOSED
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.abort()
        if self.transport is not None:
            self.transport.abort()

    def _close_both(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.close()
        if self.transport is not None:
            self.transport.close()

    async def _connect(self, port: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_connection(lambda: _Upstream(self), "127.0.0.1", port)
        except OSError as e:
            self.front.stats.upstream_failed += 1
            log.warning("gRPC endpoint: cannot reach the internal port 127.0.0.1:%d for %s: %s", port,
                        grpc_peer(self.peer), e)
            if self.transport is not None:
                self.transport.abort()
            return
        if self.state is not _State.CONNECTING:  # the client went away meanwhile
            transport.abort()
            return
        self.internal_port = transport.get_extra_info("sockname")[1]
        self.front._clients[self.internal_port] = grpc_peer(self.peer)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.state = _State.RELAY
        if self.head:
            transport.write(bytes(self.head))
            self.head = bytearray()
        assert self.transport is not None
        if self.eof_from_client:
            if transport.can_write_eof():
                transport.write_eof()
        else:
            self.transport.resume_reading()


class _Upstream(asyncio.Protocol):
    """The internal connection to grpc for one client."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.eof_from_upstream = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.client.upstream = self

    def data_received(self, data: bytes) -> None:
        _write(self.client.transport, data)

    def eof_received(self) -> bool | None:
        self.eof_from_upstream = True
        t = self.client.transport
        if self.client.eof_from_client or t is None or t.is_closing():
            self.client._close_both()
            return None
        if t.can_write_eof():
            t.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        t = self.client.transport
        if t is not None:
            t.close()  # what grpc sent before is flushed first

    def pause_writing(self) -> None:  # grpc reads slower than the client writes
        _pause(self.client.transport)

    def resume_writing(self) -> None:
        _resume(self.client.transport)
