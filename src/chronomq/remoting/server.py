"""A thin asyncio TCP transport for the 4.x remoting protocol, on top of the sans-IO codec.

- one ``Connection`` per accepted socket; a request that has to wait is handled in its own task (most are
  answered inline by ``sync_handler``), so a long-polled PULL never blocks later requests on the same
  connection (docs/protocol.md#connections-and-concurrency);
- each response is encoded completely and written with one ``transport.write`` call, so writes from
  concurrent tasks never interleave (and a partial frame is never written);
- a broken length prefix or an oversized frame (> ``ConnectionLimits.frame_max_length``) closes the
  connection with one log line, before any of that frame is buffered;
  a readable frame with a bad header is answered with SYSTEM_ERROR when its opaque is known, else the
  connection is closed; unknown request codes get REQUEST_CODE_NOT_SUPPORTED; a missing or ill-typed
  header field (HeaderError) and any handler exception get SYSTEM_ERROR with a one-line remark, never a
  traceback;
- responses from clients (flag bit 0) to server-initiated requests complete ``Connection.invoke``
  futures; oneway requests (flag bit 1) are not answered;
- close callbacks let the broker drop the clients registered through a connection;
- ``ConnectionLimits`` bound what a hostile peer can hold: connections (per server, per address, and
  what the process's open-file limit allows), a frame's time to arrive, idle time, partial-frame
  bytes over all connections, and the write buffer (reading pauses above its high-water mark). Its
  times are read from the server's clock (the real one unless a test gives another);
- with ``tls`` (a ``ServerTls``), TLS and plaintext on one port, as RocketMQ's servers serve them: the
  first byte of a connection's first read tells (0x16, a TLS handshake record, else the remoting protocol
  in plaintext), the mode may refuse either (closed, logged as the limits' refusals are), and a TLS
  connection's bytes go through a sans-IO TLS layer (``tls.TlsSession``) both ways, under the same
  frame decoding and one-write batching (docs/tls.md). A plaintext connection pays one check, at its
  first read.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from chronomq import netbudget
from chronomq.clock import Clock, SystemClock

from .codec import MAX_FRAME_SIZE, FrameDecoder, FrameError, HeaderError, RemotingCommand, encode
from .codes import ResponseCode
from .tls import HANDSHAKE, ServerTls, TlsSession

log = logging.getLogger("chronomq.remoting")

Handler = Callable[[RemotingCommand, "Connection"], Awaitable[RemotingCommand | None]]
SyncHandler = Callable[[RemotingCommand, "Connection"], RemotingCommand | None]

_conn_ids = itertools.count(1)

# A sync handler returns DEFERRED when it has arranged to answer later itself (Connection.reply).
DEFERRED = RemotingCommand(code=-1)


class UnsupportedCode(Exception):
    """Raised by a dispatcher for a request code it does not serve."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What a server grants its peers; 0 turns a limit off. The configuration keys are in parentheses."""

    frame_max_length: int = MAX_FRAME_SIZE  # a longer length prefix closes the connection (frameMaxLength)
    # seconds a started frame, or a new connection's first frame, has to arrive whole
    # (serverFrameReadTimeoutMillis / 1000)
    frame_read_timeout: float = 30.0
    # seconds without a byte either way and with no request in progress (serverChannelMaxIdleTimeSeconds)
    max_idle: float = 120.0
    max_connections: int = 10_000  # per server (serverMaxConnections)
    max_connections_per_ip: int = 1_000  # per remote address (serverMaxConnectionsPerIp)
    # bytes of unfinished frames over all connections; above it the largest holders are closed
    # (serverMaxBufferedFrameBytes)
    max_buffered_frame_bytes: int = 512 * 1024 * 1024
    write_high: int = 64 * 1024  # reading pauses above this many unsent bytes (writeBufferHighWaterMark)
    write_low: int = 32 * 1024  # and resumes below this many (writeBufferLowWaterMark)


def raise_open_file_limit() -> int | None:
    """Raise this process's soft open-file limit to its hard limit (as the JVM does for RocketMQ's
    servers); returns the soft limit now in force (None where there is none)."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return None if soft == resource.RLIM_INFINITY else soft


class _TlsTransport(asyncio.Transport):
    """What a TLS connection's ``Connection`` writes to in place of the socket's transport: each write is
    encrypted into records written to the socket with one call; ``receive`` decrypts. The rest is the
    socket transport's. (Nothing is written before the handshake has finished: the first write answers
    the first request, which comes after it.)"""

    def __init__(self, raw: asyncio.Transport, session: TlsSession) -> None:
        super().__init__()
        self.raw = raw
        self.session = session

    def receive(self, data: bytes) -> bytes:
        """The plaintext ``data`` completes; what the TLS layer answers (handshake, alerts) is written.
        Raises ssl.SSLError."""
        session = self.session
        try:
            plain = session.receive(data)
        finally:
            out = session.take()
            if out and not self.raw.is_closing():
                self.raw.write(out)
        return plain

    def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            records = self.session.send(bytes(data))
        except ssl.SSLError as e:  # the layer failed on a read before: nothing more can be sent
            log.debug("TLS: dropping %d bytes written after the connection's TLS failed: %s", len(data), e)
            self.raw.abort()
            return
        self.raw.write(records)

    def close(self) -> None:
        raw = self.raw
        if raw.is_closing():
            return
        if self.session.handshaken:
            bye = self.session.close_notify()
            if bye:
                raw.write(bye)
        raw.close()

    def abort(self) -> None:
        self.raw.abort()

    def is_closing(self) -> bool:
        return self.raw.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.session.extra_info(self.raw, name, default)

    def get_write_buffer_size(self) -> int:
        return self.raw.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.raw.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self.raw.pause_reading()

    def resume_reading(self) -> None:
        self.raw.resume_reading()

    def is_reading(self) -> bool:
        return self.raw.is_reading()


def _tls_reason(e: ssl.SSLError) -> str:
    """One line for a TLS failure: OpenSSL's reason (or the certificate check's message)."""
    return (getattr(e, "verify_message", None) or e.reason or str(e)).lower().replace("_", " ")


class Connection(asyncio.Protocol):
    """One client connection. Created by ``RemotingServer``; handlers receive it with each request."""

    def __init__(self, server: RemotingServer) -> None:
        self.server = server
        self.id = next(_conn_ids)
        self.transport: asyncio.Transport | None = None
        self.remote: tuple[str, int] = ("0.0.0.0", 0)
        self.closed = False
        self.attrs: dict[str, Any] = {}  # free slot for users (e.g. client ids seen on it)
        self._decoder = FrameDecoder(server.limits.frame_max_length)
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: dict[int, asyncio.Future[RemotingCommand]] = {}
        self._paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        # responses produced while one read is being processed are written with one syscall
        self._batching = False
        self._out: list[bytes] = []
        self._out_bytes = 0
        # decoded requests not handled yet because the peer is not reading its answers
        self._backlog: deque[RemotingCommand | FrameError] = deque()
        self._refused = False  # accepted and closed at once: over a connection limit
        self._registered = False
        # for the limits: when bytes last came in and last went out, since when a frame is unfinished
        # (None: none is), the unfinished bytes counted in the server's total, the unsent bytes last seen
        self._last_in = self._last_out = 0.0
        self._frame_since: float | None = None
        self._buffered = 0
        self._unsent_seen = 0
        # how a read is taken before the plaintext path: None (plaintext), the first-byte check, or the TLS
        # layer. An attribute read by data_received, not a rebound data_received: uvloop takes the bound
        # method when the transport is made, before connection_made, and never looks again.
        self._reader: Callable[[bytes], None] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # a TCP server's transports are stream transports
        self.transport = stream
        self._loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.remote = (str(peer[0]), int(peer[1]))
        if not self.server._admit(self):
            self._refused = self.closed = True
            transport.close()
            return
        self._registered = True
        lim = self.server.limits
        with contextlib.suppress(AttributeError, NotImplementedError):
            stream.set_write_buffer_limits(high=lim.write_high, low=lim.write_low)
        # a new connection's first frame is on the clock from the moment it is accepted
        self._last_in = self._last_out = self._frame_since = self.server.clock.monotonic()
        if self.server.tls is not None:  # the first read decides: TLS or plaintext
            self._reader = self._greeting

    def _greeting(self, data: bytes) -> None:
        """A connection's first read on a port with TLS settings (``RemotingServer.tls``): a TLS handshake
        record (0x16) goes through a TLS layer from now on, anything else is the remoting protocol in
        plaintext; the mode may refuse either."""
        self._reader = None  # the plaintext path from now on, unless this is a TLS handshake
        tls = self.server.tls
        if self.closed or tls is None:
            return
        if data[0] != HANDSHAKE:
            if tls.serves_plaintext:
                self._received(data)
            else:
                self._refuse_by_mode("plaintext refused: tlsServerMode is enforcing (TLS only)")
            return
        if not tls.serves_tls:
            self._refuse_by_mode("TLS refused: tlsServerMode is disabled (plaintext only)")
            return
        assert self.transport is not None
        try:
            context = tls.context()
        except OSError as e:  # the self-signed certificate, made at the first TLS connection
            log.error("%s: cannot serve TLS to %s: %s", self.server.name, self.remote_addr, e)
            self.close()
            return
        self.transport = _TlsTransport(self.transport, TlsSession(context))
        self.server.tls_connections += 1
        self._reader = self._tls_received
        self._tls_received(data)

    def _refuse_by_mode(self, why: str) -> None:
        self.server.refused_by_tls_mode += 1
        self.server._note_refusal(self, why)
        self.close()

    def _tls_received(self, data: bytes) -> None:
        """A TLS connection's read: decrypted, then on the plaintext path."""
        if self.closed:
            return
        t = cast(_TlsTransport, self.transport)
        try:
            plain = t.receive(data)
        except ssl.SSLError as e:
            self.server.tls_failures += 1
            log.info("%s: TLS %s with %s failed: %s", self.server.name,
                     "handshake" if not t.session.handshaken else "stream", self.remote_addr, _tls_reason(e))
            self.close()
            return
        if plain:
            self._received(plain)
        else:
            self._last_in = self.server.clock.monotonic()
        if t.session.eof and not self.closed:  # close_notify: the peer is done
            self.close()

    def _received(self, data: bytes) -> None:
        if self.closed:
            return
        self._last_in = self.server.clock.monotonic()
        if self._batching:  # a flush is already scheduled: it writes these answers too
            self._process(data)
            return
        self._batching = True
        try:
            self._process(data)
        finally:
            self._batching = False
            self._flush()

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        if reader is None:  # plaintext (a TLS connection's decrypted bytes take _received too)
            self._received(data)
        else:
            reader(data)

    def _flush(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, []
        self._out_bytes = 0
        t = self.transport
        if t is not None and not t.is_closing():
            if not t.get_write_buffer_size():  # everything written before has left: the peer reads
                self._last_out = self.server.clock.monotonic()
            t.write(out[0] if len(out) == 1 else b"".join(out))

    def _process(self, data: bytes) -> None:
        try:
            items = self._decoder.feed(data)
        except FrameError as e:
            log.warning("closing connection from %s:%d: %s", *self.remote, e)
            self.close()
            return
        self._count_unfinished(bool(items))
        if self.closed:
            return
        if self._backlog:  # the backlog goes first, in order
            self._backlog.extend(items)
            return
        self._dispatch(items)

    def _count_unfinished(self, frame_done: bool) -> None:
        """Track the unfinished frame after a read: since when (for the read timeout), and its bytes in
        the server's total (which may close the largest holders, this connection among them)."""
        n = self._decoder.buffered
        if not n:
            self._frame_since = None
        elif frame_done or self._frame_since is None:
            self._frame_since = self._last_in
        if n != self._buffered:
            srv = self.server
            srv._buffered_total += n - self._buffered
            self._buffered = n
            cap = srv.limits.max_buffered_frame_bytes
            if cap and n and srv._buffered_total > cap:
                srv._shed()

    def _dispatch(self, items: list[RemotingCommand | FrameError] | deque[RemotingCommand | FrameError]
                  ) -> None:
        high = self.server.limits.write_high
        for i, item in enumerate(items):
            if self._out_bytes > high:
                self._flush()  # may pause us (pause_writing)
            if self._paused:  # the peer is not reading: the rest waits for resume_writing
                self._backlog.extend(itertools.islice(items, i, None))
                return
            if self.closed:
                return
            self._handle_item(item)

    def _handle_item(self, item: RemotingCommand | FrameError) -> None:
        if isinstance(item, FrameError):
            self._bad_frame(item)
            return
        if item.is_response:
            fut = self._pending.pop(item.opaque, None)
            if fut is not None and not fut.done():
                fut.set_result(item)
            return
        self.server.requests += 1
        sync = self.server.sync_handler
        if sync is not None:
            # Fast path: a handler that can answer without waiting does so inline.
            try:
                resp = sync(item, self)
            except Exception as e:
                self._send_response(item, self.server.error_response(item, e))
                return
            if resp is DEFERRED:
                return
            if resp is not None:
                self._send_response(item, resp)
                return
        task = asyncio.ensure_future(self._handle(item))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _bad_frame(self, err: FrameError) -> None:
        if err.opaque is None:
            log.warning("closing connection from %s:%d: %s", *self.remote, err)
            self.close()
            return
        log.warning("bad request from %s:%d (opaque %d): %s", *self.remote, err.opaque, err)
        resp = RemotingCommand(
            code=ResponseCode.SYSTEM_ERROR,
            opaque=err.opaque,
            flag=1,
            remark=f"malformed request: {err}",
            language="JAVA",
        )
        self.write(resp)

    def connection_lost(self, exc: Exception | None) -> None:
        t = self.transport
        if not self.closed and isinstance(t, _TlsTransport) and not t.session.handshaken:
            log.debug("%s: %s closed its connection during the TLS handshake", self.server.name,
                      self.remote_addr)
        self.__dict__.pop("data_received", None)  # the TLS path's bound method: no cycle left behind
        self.closed = True
        if self._refused:
            return
        self._release()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("connection closed"))
        self._pending.clear()
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()
        self.abort_tasks()  # e.g. held pulls: nobody is left to answer
        for cb in list(self.server.close_callbacks):
            try:
                cb(self)
            except Exception:
                log.exception("connection close callback failed")

    def _release(self) -> None:
        """Give back what this connection counts against the server's limits (once)."""
        if self._registered:
            self._registered = False
            self.server._forget(self)
        self.server._buffered_total -= self._buffered
        self._buffered = 0
        self._backlog.clear()

    def pause_writing(self) -> None:
        # a client that does not read its responses: stop reading its requests (and handling the ones
        # already read) until it catches up, so the transport buffer (and our memory) stays bounded
        self._paused = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()
        self._loop.call_soon(self._resume)

    def _resume(self) -> None:
        if self._paused or self.closed:
            return
        if self._backlog:
            backlog, self._backlog = self._backlog, deque()
            batching, self._batching = self._batching, True
            try:
                self._dispatch(backlog)
            finally:
                self._batching = batching
                if not batching:
                    self._flush()
            if self._paused or self.closed:
                return
        if self._frame_since is not None:  # the time reading was paused is ours, not the peer's
            self._frame_since = self.server.clock.monotonic()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _overdue(self, now: float) -> str | None:
        """Why this connection must be closed now (a limit of time it has passed), or None."""
        t = self.transport
        if t is None or self.closed:
            return None
        lim = self.server.limits
        unsent = t.get_write_buffer_size()
        if unsent < self._unsent_seen:  # the peer took some since the last look
            self._last_out = now
        self._unsent_seen = unsent
        if (lim.frame_read_timeout and self._frame_since is not None and not self._paused
                and now - self._frame_since > lim.frame_read_timeout):
            what = "a frame" if self._decoder.buffered else "its first frame"
            return (f"{what} not received whole within {lim.frame_read_timeout:g} s "
                    f"({self._decoder.buffered} bytes of it so far)")
        if lim.max_idle and not self._tasks and now - max(self._last_in, self._last_out) > lim.max_idle:
            unread = f" with {unsent} bytes unread" if unsent else ""
            return f"idle for more than {lim.max_idle:g} s{unread}"
        return None

    # --- request handling -----------------------------------------------------------------------------
    async def _handle(self, req: RemotingCommand) -> None:
        try:
            resp = await self.server.handler(req, self)
        except asyncio.CancelledError:
            return
        except UnsupportedCode:
            resp = req.response(
                ResponseCode.REQUEST_CODE_NOT_SUPPORTED, remark=f"request code {req.code} is not supported"
            )
        except Exception as e:
            resp = self.server.error_response(req, e)
        if resp is not None and resp is not DEFERRED:
            self._send_response(req, resp)

    def reply(self, req: RemotingCommand, resp: RemotingCommand) -> None:
        """Answer ``req`` (for handlers that returned DEFERRED). Safe after the connection closed."""
        self._send_response(req, resp)

    def _send_response(self, req: RemotingCommand, resp: RemotingCommand) -> None:
        if req.is_oneway:
            return
        resp.opaque = req.opaque
        resp.flag |= 1
        resp.serialize_type = req.serialize_type
        self.write(resp)

    def write(self, cmd: RemotingCommand) -> bool:
        """Encode and write one whole frame (never partial). Returns False if the connection is gone."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        try:
            data = encode(cmd)
        except Exception as e:
            log.error("cannot encode a response (code %s): %s", cmd.code, e)
            data = encode(
                RemotingCommand(
                    code=ResponseCode.SYSTEM_ERROR,
                    opaque=cmd.opaque,
                    flag=cmd.flag,
                    remark="internal error: response could not be encoded",
                    language="JAVA",
                )
            )
        self._out.append(data)
        self._out_bytes += len(data)
        if not self._batching:
            # answers produced by tasks/callbacks in the same loop iteration share one syscall
            self._batching = True
            self._loop.call_soon(self._flush_later)
        return True

    def _flush_later(self) -> None:
        self._batching = False
        self._flush()

    async def drain(self) -> None:
        if not self._paused or self.closed:
            return
        fut = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(fut)
        await fut

    # --- server -> client requests ------------------------------------------------------------------------
    def send_oneway(self, cmd: RemotingCommand) -> bool:
        cmd.flag |= 2
        return self.write(cmd)

    async def invoke(self, cmd: RemotingCommand, timeout: float = 3.0) -> RemotingCommand:
        fut: asyncio.Future[RemotingCommand] = asyncio.get_running_loop().create_future()
        self._pending[cmd.opaque] = fut
        if not self.write(cmd):
            self._pending.pop(cmd.opaque, None)
            raise ConnectionError("connection closed")
        try:
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            self._pending.pop(cmd.opaque, None)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._flush()  # whole frames answered before the close still go out
            self.transport.close()
        self.closed = True
        if not self._refused:
            self._release()

    def abort_tasks(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    @property
    def remote_addr(self) -> str:
        return f"{self.remote[0]}:{self.remote[1]}"

    def __repr__(self) -> str:
        return f"<Connection #{self.id} {self.remote_addr}>"


class RemotingServer:
    """Listens on host:port and dispatches every request to ``handler(request, connection)``.

    ``sync_handler`` (optional) is tried first, inline in ``data_received``: it returns a response for
    requests it can answer at once, or None to hand the request to the async ``handler`` in its own task.
    ``limits`` bound what each peer can hold; their times are read from ``clock``. ``tls``: TLS and
    plaintext on this port in its mode (None: plaintext only, no first-byte check at all).
    """

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "remoting",
        sync_handler: SyncHandler | None = None,
        limits: ConnectionLimits | None = None,
        clock: Clock | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self.handler = handler
        self.tls = tls
        self.sync_handler = sync_handler
        self.host = host
        self.port = port
        self.name = name
        self.limits = limits or ConnectionLimits()
        self.clock: Clock = clock or SystemClock()
        self.close_callbacks: list[Callable[[Connection], None]] = []
        self._connections: dict[int, Connection] = {}
        self._per_ip: dict[str, int] = {}
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._budget = netbudget.connection_budget()
        self._buffered_total = 0  # bytes of unfinished frames over all connections
        self.requests = 0
        # what the limits did: connections refused, and closed by the sweep or the byte budget
        self.refused = 0
        self.closed_overdue = 0
        self.closed_shed = 0
        # TLS: connections served with it, failed handshakes and streams, connections the mode refused
        self.tls_connections = 0
        self.tls_failures = 0
        self.refused_by_tls_mode = 0
        self._refused_unlogged = 0
        self._refusal_logged_at: float | None = None
        self._last_refusal = ""

    # --- the limits -------------------------------------------------------------------------------------
    def _admit(self, conn: Connection) -> bool:
        lim = self.limits
        ip = conn.remote[0]
        why = netbudget.refusal(len(self._connections), lim.max_connections, ip, self._per_ip.get(ip, 0),
                                lim.max_connections_per_ip, 1, self._budget)
        if why is not None:
            self._note_refusal(conn, why)
            return False
        self._connections[conn.id] = conn
        self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        netbudget.take(1)
        return True

    def _forget(self, conn: Connection) -> None:
        if self._connections.pop(conn.id, None) is None:
            return
        netbudget.give(1)
        ip = conn.remote[0]
        left = self._per_ip.get(ip, 0) - 1
        if left > 0:
            self._per_ip[ip] = left
        else:
            self._per_ip.pop(ip, None)

    def _note_refusal(self, conn: Connection, why: str) -> None:
        self.refused += 1
        self._refused_unlogged += 1
        self._last_refusal = f"the last from {conn.remote_addr}: {why}"
        self._log_refusals(self.clock.monotonic())

    def _log_refusals(self, now: float) -> None:
        """One WARNING at the first refusal, then at most one every 10 s with the count since."""
        last = self._refusal_logged_at
        if not self._refused_unlogged or (last is not None and now - last < 10.0):
            return
        log.warning("%s: refused %d connection(s)%s, %s", self.name, self._refused_unlogged,
                    "" if last is None else f" in {now - last:.0f} s", self._last_refusal)
        self._refused_unlogged = 0
        self._refusal_logged_at = now

    def _shed(self) -> None:
        """Unfinished frames hold more bytes than ``max_buffered_frame_bytes``: close the connections
        holding the most until the total is within the limit."""
        cap = self.limits.max_buffered_frame_bytes
        for c in sorted(self._connections.values(), key=lambda c: c._buffered, reverse=True):
            if self._buffered_total <= cap or not c._buffered:
                break
            log.warning("%s: closing connection from %s: %d bytes of an unfinished frame while unfinished "
                        "frames hold %d bytes (serverMaxBufferedFrameBytes=%d)", self.name, c.remote_addr,
                        c._buffered, self._buffered_total, cap)
            self.closed_shed += 1
            c.close()

    def sweep(self) -> int:
        """Close the connections past a time limit (idle, a frame too slow); returns how many."""
        now = self.clock.monotonic()
        n = 0
        for c in list(self._connections.values()):
            why = c._overdue(now)
            if why is not None:
                if n < 5:
                    log.info("%s: closing connection from %s: %s", self.name, c.remote_addr, why)
                c.close()
                n += 1
        if n > 5:
            log.info("%s: closed %d more connections past a time limit", self.name, n - 5)
        self.closed_overdue += n
        self._log_refusals(now)
        return n

    async def _sweep_loop(self) -> None:
        lim = self.limits
        periods = [t for t in (lim.frame_read_timeout, lim.max_idle) if t > 0]
        if not periods:
            return
        # a quarter of the shorter limit, at most 1 s: a limit is enforced at most that much late
        interval = min(1.0, max(0.01, min(periods) / 4))
        while True:
            await self.clock.sleep(interval)
            try:
                self.sweep()
            except Exception:  # never let a bug here end the limits for good
                log.exception("%s: connection sweep failed", self.name)

    def error_response(self, req: RemotingCommand, e: Exception) -> RemotingCommand:
        if isinstance(e, HeaderError):
            log.info("%s: request code %d rejected: %s", self.name, req.code, e)
            return req.response(ResponseCode.SYSTEM_ERROR, remark=f"bad request header: {e}")
        if isinstance(e, UnsupportedCode):
            return req.response(
                ResponseCode.REQUEST_CODE_NOT_SUPPORTED, remark=f"request code {req.code} is not supported"
            )
        log.error(
            "%s: request code %d failed: %s: %s",
            self.name,
            req.code,
            type(e).__name__,
            e,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
        text = str(e).splitlines()[0] if str(e) else ""
        return req.response(ResponseCode.SYSTEM_ERROR, remark=f"{type(e).__name__}: {text}"[:500])

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self), self.host, self.port, reuse_address=True, backlog=1024
        )
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]
        log.info("%s listening on %s:%d%s", self.name, self.host, self.port,
                 f" (TLS {self.tls.mode})" if self.tls is not None else "")
        if self._budget is not None and self._budget < (self.limits.max_connections or 1 << 62):
            log.warning("%s: the open-file limit leaves room for %d connections in this process, fewer than "
                        "serverMaxConnections=%d (raise `ulimit -n`)", self.name, self._budget,
                        self.limits.max_connections)
        self._sweeper = asyncio.create_task(self._sweep_loop(), name=f"{self.name}-sweep")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def connections(self) -> list[Connection]:
        return list(self._connections.values())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._server is not None:
            self._server.close()
        for c in list(self._connections.values()):
            c.abort_tasks()
            c.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()
            self._server = None
