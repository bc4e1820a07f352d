"""A thin asyncio TCP transport for the 4.x remoting protocol, on top of the sans-IO codec.

- one ``Connection`` per accepted socket; every request is handled in its own task, so a long-polled
  PULL never blocks later requests on the same connection (protocol.md 8.4);
- each response is encoded completely and written with one ``transport.write`` call, so writes from
  concurrent tasks never interleave (and a partial frame is never written);
- a broken length prefix or an oversized frame (> 16 MiB) closes the connection with one log line;
  a readable frame with a bad header is answered with SYSTEM_ERROR when its opaque is known, else the
  connection is closed; unknown request codes get REQUEST_CODE_NOT_SUPPORTED; a missing or ill-typed
  header field (HeaderError) and any handler exception get SYSTEM_ERROR with a one-line remark, never a
  traceback;
- responses from clients (flag bit 0) to server-initiated requests complete ``Connection.invoke``
  futures; oneway requests (flag bit 1) are not answered;
- close callbacks let the broker drop the clients registered through a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .codec import MAX_FRAME_SIZE, FrameDecoder, FrameError, HeaderError, RemotingCommand, encode
from .codes import ResponseCode

log = logging.getLogger("chronomq.remoting")

Handler = Callable[[RemotingCommand, "Connection"], Awaitable[RemotingCommand | None]]
SyncHandler = Callable[[RemotingCommand, "Connection"], RemotingCommand | None]

_conn_ids = itertools.count(1)

# A sync handler returns DEFERRED when it has arranged to answer later itself (Connection.reply).
DEFERRED = RemotingCommand(code=-1)


class UnsupportedCode(Exception):
    """Raised by a dispatcher for a request code it does not serve."""


class Connection(asyncio.Protocol):
    """One client connection. Created by ``RemotingServer``; handlers receive it with each request."""

    def __init__(self, server: RemotingServer) -> None:
        self.server = server
        self.id = next(_conn_ids)
        self.transport: asyncio.Transport | None = None
        self.remote: tuple[str, int] = ("0.0.0.0", 0)
        self.closed = False
        self.attrs: dict[str, Any] = {}  # free slot for users (e.g. client ids seen on it)
        self._decoder = FrameDecoder(server.max_frame_size)
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: dict[int, asyncio.Future[RemotingCommand]] = {}
        self._paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        # responses produced while one read is being processed are written with one syscall
        self._batching = False
        self._out: list[bytes] = []

    # --- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.remote = (str(peer[0]), int(peer[1]))
        self.server._connections[self.id] = self

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if self._batching:  # a flush is already scheduled: it writes these answers too
            self._process(data)
            return
        self._batching = True
        try:
            self._process(data)
        finally:
            self._batching = False
            self._flush()

    def _flush(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _process(self, data: bytes) -> None:
        try:
            items = self._decoder.feed(data)
        except FrameError as e:
            log.warning("closing connection from %s:%d: %s", *self.remote, e)
            self.close()
            return
        for item in items:
            if isinstance(item, FrameError):
                self._bad_frame(item)
                if self.closed:
                    return
                continue
            if item.is_response:
                fut = self._pending.pop(item.opaque, None)
                if fut is not None and not fut.done():
                    fut.set_result(item)
                continue
            self.server.requests += 1
            sync = self.server.sync_handler
            if sync is not None:
                # Fast path: a handler that can answer without waiting does so inline.
                try:
                    resp = sync(item, self)
                except Exception as e:
                    self._send_response(item, self.server.error_response(item, e))
                    continue
                if resp is DEFERRED:
                    continue
                if resp is not None:
                    self._send_response(item, resp)
                    continue
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
        self.closed = True
        self.server._connections.pop(self.id, None)
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

    def pause_writing(self) -> None:
        # a client that does not read its responses: stop reading its requests until it catches up,
        # so the transport buffer (and our memory) stays bounded
        self._paused = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()

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
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(cmd.opaque, None)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._flush()  # whole frames answered before the close still go out
            self.transport.close()
        self.closed = True

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
    """

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        name: str = "remoting",
        max_frame_size: int = MAX_FRAME_SIZE,
        sync_handler: SyncHandler | None = None,
    ) -> None:
        self.handler = handler
        self.sync_handler = sync_handler
        self.host = host
        self.port = port
        self.name = name
        self.max_frame_size = max_frame_size
        self.close_callbacks: list[Callable[[Connection], None]] = []
        self._connections: dict[int, Connection] = {}
        self._server: asyncio.Server | None = None
        self.requests = 0

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
        log.info("%s listening on %s:%d", self.name, self.host, self.port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def connections(self) -> list[Connection]:
        return list(self._connections.values())

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._connections.values()):
            c.abort_tasks()
            c.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
