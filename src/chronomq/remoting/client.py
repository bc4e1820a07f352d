"""A thin asyncio transport for the client side of the 4.x remoting protocol (docs/protocol.md#frames).

One TCP connection per address, every request on it multiplexed by ``opaque`` (responses may arrive
in any order). A request that times out closes its connection (as the official clients do) so the next
request opens a fresh one; a connection that fails fails every request waiting on it at once.
Requests the server pushes to us (NOTIFY_CONSUMER_IDS_CHANGED, ...) go to ``request_handler``; when it
returns a command that command is written back as the response. With an ``ssl.SSLContext`` every
connection is TLS (asyncio's; the server's host is not sent as SNI when it is an IP address).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable

from .codec import FLAG_RESPONSE, FrameDecoder, FrameError, RemotingCommand, encode
from .codes import ResponseCode

log = logging.getLogger(__name__)

# Frames from this size on are written at once rather than kept for the end of the loop iteration: a
# syscall is small next to their bytes, and the broker can start on them while the next ones are built.
WRITE_NOW_BYTES = 16 * 1024

RequestHandler = Callable[[str, RemotingCommand], Awaitable[RemotingCommand | None] | RemotingCommand | None]


class RemotingError(Exception):
    """Base of the transport errors."""

    def __init__(self, message: str, addr: str | None = None) -> None:
        super().__init__(message)
        self.addr = addr


class RemotingConnectError(RemotingError):
    """The address could not be reached, or the connection broke while a request was waiting."""


class RemotingTimeoutError(RemotingError):
    """No response within the request's timeout (the connection has been closed)."""


class RemotingClosedError(RemotingError):
    """The client was closed."""


class _Expired(Exception):
    """Internal: a request's timer fired."""


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address {addr!r} is not host:port")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"address {addr!r} has a non-numeric port") from None
    if not 0 < p < 65536:
        raise ValueError(f"address {addr!r} has a port outside 1..65535")
    return host, p


class Connection:
    """One TCP connection. Use via RemotingClient."""

    def __init__(self, addr: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 handler: RequestHandler | None, on_close: Callable[[Connection], None]) -> None:
        self.addr = addr
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._on_close = on_close
        self._pending: dict[int, asyncio.Future[RemotingCommand]] = {}
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        # small frames written in one event-loop iteration go out in one send() (syscalls are the cost
        # that matters with many small requests in flight)
        self._wbuf: list[bytes] = []
        self._wbuf_bytes = 0
        self._loop = asyncio.get_running_loop()
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop(),
                                                                 name=f"chronomq-conn-{addr}")

    @property
    def closed(self) -> bool:
        return self._closed

    async def _read_loop(self) -> None:
        decoder = FrameDecoder()
        reason = "connection closed by peer"
        try:
            while True:
                data = await self._reader.read(256 * 1024)
                if not data:
                    break
                for item in decoder.feed(data):
                    if isinstance(item, FrameError):
                        log.warning("%s: undecodable frame: %s", self.addr, item)
                        if item.opaque is not None:
                            self._fail_one(item.opaque, RemotingError(f"undecodable response: {item}",
                                                                      self.addr))
                        continue
                    if item.is_response:
                        fut = self._pending.pop(item.opaque, None)
                        if fut is not None and not fut.done():
                            fut.set_result(item)
                    else:
                        self._dispatch_request(item)
        except FrameError as e:
            reason = f"broken stream: {e}"
            log.warning("%s: %s", self.addr, reason)
        except (ConnectionError, OSError) as e:
            reason = f"connection error: {e}"
        except asyncio.CancelledError:
            reason = "connection closed"
        finally:
            self._shutdown(reason)

    def _dispatch_request(self, cmd: RemotingCommand) -> None:
        if self._handler is None:
            if not cmd.is_oneway:
                self._write(cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                                         remark=f"request code {cmd.code} not supported by this client"))
            return
        task = asyncio.get_running_loop().create_task(self._handle(cmd), name="chronomq-server-request")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, cmd: RemotingCommand) -> None:
        assert self._handler is not None
        resp: RemotingCommand | None
        try:
            answer = self._handler(self.addr, cmd)
            resp = answer if answer is None or isinstance(answer, RemotingCommand) else await answer
        except Exception as e:  # a handler bug must not kill the connection
            log.exception("handler for server request %s failed", cmd.code)
            resp = cmd.response(ResponseCode.SYSTEM_ERROR, remark=f"client handler failed: {e}")
        if resp is not None and not cmd.is_oneway:
            resp.opaque = cmd.opaque
            resp.flag |= FLAG_RESPONSE
            self._write(resp)

    def _fail_one(self, opaque: int, exc: Exception) -> None:
        fut = self._pending.pop(opaque, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def _write(self, cmd: RemotingCommand) -> None:
        if self._closed:
            raise RemotingConnectError(f"connection to {self.addr} is closed", self.addr)
        data = encode(cmd)
        if not self._wbuf:
            # nothing else in flight (no company to wait for), or a frame big enough to go alone
            if len(self._pending) <= 1 or len(data) >= WRITE_NOW_BYTES:
                self._writer.write(data)
                return
            self._loop.call_soon(self._flush)
        self._wbuf.append(data)
        self._wbuf_bytes += len(data)
        if self._wbuf_bytes >= WRITE_NOW_BYTES:
            self._flush()  # in order, after what was kept; the scheduled flush then finds nothing

    def _flush(self) -> None:
        buf, self._wbuf = self._wbuf, []
        self._wbuf_bytes = 0
        if buf and not self._closed:
            self._writer.write(buf[0] if len(buf) == 1 else b"".join(buf))

    async def request(self, cmd: RemotingCommand, timeout: float) -> RemotingCommand:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RemotingCommand] = loop.create_future()
        opaque = cmd.opaque
        self._pending[opaque] = fut
        timer = loop.call_later(timeout, self._expire, opaque, fut)
        try:
            self._write(cmd)
            if self._writer.transport.get_write_buffer_size() > 4 * 1024 * 1024:
                await self._writer.drain()
            return await fut
        except _Expired:
            self.close(f"request code {cmd.code} timed out after {timeout:.1f}s")
            raise RemotingTimeoutError(
                f"no response from {self.addr} to request code {cmd.code} within {timeout:.1f}s",
                self.addr) from None
        except (ConnectionError, OSError) as e:
            self.close(str(e))
            raise RemotingConnectError(f"connection to {self.addr} failed: {e}", self.addr) from None
        finally:
            timer.cancel()
            self._pending.pop(opaque, None)

    def _expire(self, opaque: int, fut: asyncio.Future[RemotingCommand]) -> None:
        if self._pending.get(opaque) is fut and not fut.done():
            fut.set_exception(_Expired())

    async def send_oneway(self, cmd: RemotingCommand) -> None:
        try:
            self._write(cmd)
            self._flush()
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            self.close(str(e))
            raise RemotingConnectError(f"connection to {self.addr} failed: {e}", self.addr) from None

    def close(self, reason: str = "closed") -> None:
        if not self._closed:
            self._read_task.cancel()
            self._shutdown(reason)

    def _shutdown(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._writer.close()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(RemotingConnectError(f"{self.addr}: {reason}", self.addr))
        for t in list(self._tasks):
            t.cancel()
        self._on_close(self)

    async def wait_closed(self) -> None:
        with contextlib.suppress(BaseException):
            await self._read_task
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        tasks = list(self._tasks)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class RemotingClient:
    """Connections by address, opened lazily and re-opened after a failure or timeout."""

    def __init__(self, request_handler: RequestHandler | None = None, connect_timeout: float = 3.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._handler = request_handler
        self._connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Future[Connection]] = {}
        self._closing: set[Connection] = set()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def connected_addresses(self) -> list[str]:
        return [a for a, c in self._conns.items() if not c.closed]

    async def _get(self, addr: str) -> Connection:
        if self._closed:
            raise RemotingClosedError("the remoting client is closed", addr)
        conn = self._conns.get(addr)
        if conn is not None and not conn.closed:
            return conn
        pending = self._connecting.get(addr)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._connecting[addr] = fut
        try:
            try:
                host, port = _split_addr(addr)
            except ValueError as e:
                raise RemotingConnectError(str(e), addr) from None
            try:
                opened = (asyncio.open_connection(host, port) if self._ssl is None else
                          asyncio.open_connection(host, port, ssl=self._ssl,
                                                  ssl_handshake_timeout=self._connect_timeout))
                async with asyncio.timeout(self._connect_timeout):
                    reader, writer = await opened
            except TimeoutError:
                raise RemotingConnectError(f"connecting to {addr} timed out after "
                                           f"{self._connect_timeout:.1f}s", addr) from None
            except ssl.SSLError as e:  # before OSError, its base: the TLS handshake failed
                raise RemotingConnectError(f"TLS handshake with {addr} failed: {e.reason or e}",
                                           addr) from None
            except (OSError, OverflowError) as e:
                raise RemotingConnectError(f"cannot connect to {addr}: {getattr(e, 'strerror', None) or e}",
                                           addr) from None
            conn = Connection(addr, reader, writer, self._handler, self._forget)
            if self._closed:
                conn.close()
                raise RemotingClosedError("the remoting client is closed", addr)
            self._conns[addr] = conn
            fut.set_result(conn)
            return conn
        except BaseException as e:
            if not fut.done():
                fut.set_exception(e if isinstance(e, Exception) else RemotingClosedError("cancelled"))
                fut.exception()  # mark retrieved
            raise
        finally:
            self._connecting.pop(addr, None)

    def _forget(self, conn: Connection) -> None:
        if self._conns.get(conn.addr) is conn:
            del self._conns[conn.addr]
        self._closing.add(conn)
        # reap the connection's tasks in the background; close() awaits whatever is left
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._reap(conn), name="chronomq-reap")

    async def _reap(self, conn: Connection) -> None:
        await conn.wait_closed()
        self._closing.discard(conn)

    async def invoke(self, addr: str, cmd: RemotingCommand, timeout: float = 3.0) -> RemotingCommand:
        conn = await self._get(addr)
        return await conn.request(cmd, timeout)

    async def invoke_oneway(self, addr: str, cmd: RemotingCommand) -> None:
        conn = await self._get(addr)
        await conn.send_oneway(cmd)

    def close_connection(self, addr: str) -> None:
        conn = self._conns.get(addr)
        if conn is not None:
            conn.close("closed by client")

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._conns.values()):
            conn.close("client closed")
        for conn in list(self._closing):
            await conn.wait_closed()
        self._closing.clear()
        # let reaper tasks finish
        await asyncio.sleep(0)
