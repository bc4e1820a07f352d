"""The asyncio remoting server: dispatch, concurrency on one connection, and every malformed-input case
(the server answers or closes that one connection with one log line, and keeps serving the others)."""

from __future__ import annotations

import asyncio
import json
import logging
import struct

import pytest
from tests.conftest import async_wait_for
from tests.integration.rawclient import AsyncRawClient

from chronomq.remoting.codec import (
    SERIALIZE_ROCKETMQ,
    FrameDecoder,
    HeaderError,
    RemotingCommand,
    encode,
)
from chronomq.remoting.codes import ResponseCode
from chronomq.remoting.server import DEFERRED, Connection, RemotingServer, UnsupportedCode

ECHO, SLOW, FAIL, BADHDR, DEFER, INLINE = 1000, 1001, 1002, 1003, 1004, 1005


class App:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.closed: list[Connection] = []

    async def handle(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        if req.code == ECHO:
            return req.response(ext_fields={"echo": req.ext_str("v", ""), "n": 7}, body=req.body)
        if req.code == SLOW:
            await self.release.wait()
            return req.response(ext_fields={"slow": "done"})
        if req.code == FAIL:
            raise RuntimeError("boom\nTraceback (most recent call last): secret")
        if req.code == BADHDR:
            req.ext_int("needed")
        raise UnsupportedCode(req.code)

    def handle_sync(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        if req.code == INLINE:
            return req.response(ext_fields={"inline": "yes"})
        if req.code == DEFER:
            asyncio.get_running_loop().call_soon(conn.reply, req, req.response(ext_fields={"deferred": "1"}))
            return DEFERRED
        return None


@pytest.fixture
async def server():
    app = App()
    srv = RemotingServer(app.handle, "127.0.0.1", 0, name="test", sync_handler=app.handle_sync)
    srv.close_callbacks.append(app.closed.append)
    await srv.start()
    srv.app = app  # type: ignore[attr-defined]
    yield srv
    app.release.set()
    await srv.stop()


async def _raw_exchange(addr: str, data: bytes, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Send raw bytes; return (everything received, closed_by_server)."""
    host, _, port = addr.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    got = b""
    closed = False
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                closed = True
                break
            got += chunk
            if FrameDecoder().feed(got):
                break
    except TimeoutError:
        pass
    writer.close()
    return got, closed


async def test_response_echoes_opaque_sets_flag_and_string_ext_values(server: RemotingServer) -> None:
    c = await AsyncRawClient.connect(server.address)
    fut = c.start(ECHO, {"v": 5}, b"body")
    resp = await asyncio.wait_for(fut, 5)
    assert resp.code == 0 and resp.is_response and resp.body == b"body"
    assert resp.ext_fields == {"echo": "5", "n": "7"}  # strings on the wire
    await c.close()


async def test_header_word_high_byte_is_zero_and_ext_values_are_json_strings(server: RemotingServer) -> None:
    req = RemotingCommand.request(ECHO, {"v": 1})
    got, _ = await _raw_exchange(server.address, encode(req))
    (total, word) = struct.unpack(">iI", got[:8])
    assert word >> 24 == 0
    header = json.loads(got[8 : 8 + (word & 0xFFFFFF)])
    assert header["flag"] & 1 and header["opaque"] == req.opaque
    assert all(isinstance(v, str) for v in header["extFields"].values())
    assert total == len(got) - 4


async def test_unknown_code_is_request_code_not_supported(server: RemotingServer) -> None:
    c = await AsyncRawClient.connect(server.address)
    resp = await c.request(4242)
    assert resp.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED and "4242" in (resp.remark or "")
    await c.close()


async def test_handler_exception_is_system_error_without_traceback(server: RemotingServer) -> None:
    c = await AsyncRawClient.connect(server.address)
    resp = await c.request(FAIL)
    assert resp.code == ResponseCode.SYSTEM_ERROR
    assert "boom" in resp.remark and "Traceback" not in resp.remark and "secret" not in resp.remark
    # the connection still serves
    assert (await c.request(ECHO, {"v": "x"})).ext_fields["echo"] == "x"
    await c.close()


async def test_missing_header_field_is_answered_with_an_error(server: RemotingServer) -> None:
    c = await AsyncRawClient.connect(server.address)
    resp = await c.request(BADHDR, {"other": "1"})
    assert resp.code == ResponseCode.SYSTEM_ERROR and "needed" in resp.remark
    resp = await c.request(BADHDR, {"needed": "abc"})
    assert resp.code == ResponseCode.SYSTEM_ERROR and "not an integer" in resp.remark
    await c.close()


async def test_a_held_request_does_not_block_later_requests_on_the_same_connection(
    server: RemotingServer,
) -> None:
    c = await AsyncRawClient.connect(server.address)
    slow = c.start(SLOW)
    fast = await c.request(ECHO, {"v": "later"})
    assert fast.ext_fields["echo"] == "later" and not slow.done()
    server.app.release.set()  # type: ignore[attr-defined]
    assert (await asyncio.wait_for(slow, 5)).ext_fields == {"slow": "done"}
    await c.close()


async def test_inline_and_deferred_sync_handlers(server: RemotingServer) -> None:
    c = await AsyncRawClient.connect(server.address)
    assert (await c.request(INLINE)).ext_fields == {"inline": "yes"}
    assert (await c.request(DEFER)).ext_fields == {"deferred": "1"}
    await c.close()


async def test_oneway_request_gets_no_answer(server: RemotingServer) -> None:
    c = await AsyncRawClient.connect(server.address)
    cmd = RemotingCommand.request(ECHO, {"v": "1"}, oneway=True)
    c.send_raw(encode(cmd))
    # a later normal request is answered; the oneway one never was
    assert (await c.request(ECHO, {"v": "2"})).ext_fields["echo"] == "2"
    assert cmd.opaque not in {r.opaque for r in c.server_requests}
    assert server.requests >= 2
    await c.close()


async def test_frames_split_into_single_bytes_and_pipelined(server: RemotingServer) -> None:
    c = await AsyncRawClient.connect(server.address)
    cmds = [RemotingCommand.request(ECHO, {"v": str(i)}) for i in range(5)]
    futs = []
    loop = asyncio.get_running_loop()
    for cmd in cmds:
        f = loop.create_future()
        c.pending[cmd.opaque] = f
        futs.append(f)
    data = b"".join(encode(cmd) for cmd in cmds)
    assert c.writer is not None
    for i in range(len(data)):
        c.writer.write(data[i : i + 1])
        if i % 50 == 0:
            await c.writer.drain()
    got = await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert [r.ext_fields["echo"] for r in got] == [str(i) for i in range(5)]
    await c.close()


async def test_binary_serialize_type_is_answered_in_kind(server: RemotingServer) -> None:
    req = RemotingCommand.request(ECHO, {"v": "bin"})
    req.serialize_type = SERIALIZE_ROCKETMQ
    got, _ = await _raw_exchange(server.address, encode(req))
    (word,) = struct.unpack(">I", got[4:8])
    assert word >> 24 == SERIALIZE_ROCKETMQ
    resp = FrameDecoder().feed(got)[0]
    assert isinstance(resp, RemotingCommand) and resp.ext_fields["echo"] == "bin"


# --- malformed input -------------------------------------------------------------------------------------
def _frame(header: bytes, body: bytes = b"", stype: int = 0) -> bytes:
    return struct.pack(">iI", 4 + len(header) + len(body), (stype << 24) | len(header)) + header + body


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(_frame(b"{not json"), id="invalid-json"),
        pytest.param(_frame(b"[1,2]"), id="json-not-object"),
        pytest.param(_frame(b"\xff\xfe\x00"), id="not-utf8"),
        pytest.param(struct.pack(">i", 2) + b"\x00\x00", id="length-too-small"),
        pytest.param(struct.pack(">i", -5), id="negative-length"),
        pytest.param(struct.pack(">iI", 20, 999) + b"x" * 16, id="header-longer-than-frame"),
        pytest.param(_frame(b"{}", stype=7), id="unknown-serialize-type"),
        pytest.param(struct.pack(">i", 16 * 1024 * 1024 + 1) + b"\x00" * 64, id="oversized"),
    ],
)
async def test_unanswerable_frames_close_only_that_connection(
    server: RemotingServer, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    other = await AsyncRawClient.connect(server.address)
    with caplog.at_level(logging.WARNING, logger="chronomq.remoting"):
        got, closed = await _raw_exchange(server.address, data)
    assert closed and got == b""  # nothing (and certainly no partial frame) was written
    assert any("closing connection" in r.getMessage() for r in caplog.records)
    assert (await other.request(ECHO, {"v": "alive"})).ext_fields["echo"] == "alive"
    await other.close()


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(b'{"opaque": 77, "flag": 0}', id="missing-code"),
        pytest.param(b'{"code": "abc", "opaque": 77}', id="code-not-int"),
        pytest.param(b'{"code": 1000, "opaque": 77, "extFields": [1]}', id="extfields-not-object"),
    ],
)
async def test_bad_header_with_known_opaque_is_answered(server: RemotingServer, header: bytes) -> None:
    got, _ = await _raw_exchange(server.address, _frame(header))
    resp = FrameDecoder().feed(got)[0]
    assert isinstance(resp, RemotingCommand)
    assert resp.opaque == 77 and resp.code == ResponseCode.SYSTEM_ERROR and resp.is_response
    assert "malformed" in resp.remark


async def test_bad_binary_header_closes_connection(server: RemotingServer) -> None:
    got, closed = await _raw_exchange(server.address, _frame(b"\x00\x01", stype=1))
    assert closed and got == b""


async def test_close_callback_runs_when_a_client_disconnects(server: RemotingServer) -> None:
    c = await AsyncRawClient.connect(server.address)
    await c.request(ECHO)
    n = len(server.app.closed)  # type: ignore[attr-defined]
    await c.close()
    await async_wait_for(lambda: len(server.app.closed) == n + 1, message="close callback")  # type: ignore[attr-defined]


async def test_server_to_client_invoke_matches_the_clients_response(server: RemotingServer) -> None:
    c = await AsyncRawClient.connect(server.address)
    await c.request(ECHO)
    conn = server.connections()[0]

    async def answer() -> None:
        await async_wait_for(lambda: c.server_requests, message="server request")
        req = c.server_requests[0]
        c.send_raw(encode(req.response(ext_fields={"ok": "1"})))

    task = asyncio.create_task(answer())
    resp = await conn.invoke(RemotingCommand.request(40, {"consumerGroup": "g"}), timeout=5)
    await task
    assert resp.ext_fields == {"ok": "1"}
    await c.close()


def test_header_error_is_a_value_error() -> None:
    assert issubclass(HeaderError, ValueError)


async def test_a_client_that_does_not_read_is_throttled_not_buffered_without_bound(
    server: RemotingServer,
) -> None:
    c = await AsyncRawClient.connect(server.address)
    assert c.reader is not None
    c._task.cancel()  # type: ignore[union-attr]  # stop reading responses for now
    body = b"y" * 65536
    cmds = [RemotingCommand.request(ECHO, {"v": str(i)}, body) for i in range(400)]  # ~26 MB of answers
    for cmd in cmds:
        c.send_raw(encode(cmd))
    await async_wait_for(lambda: server.connections() and server.connections()[0]._paused, message="paused")
    conn = server.connections()[0]
    assert conn.transport is not None
    await asyncio.sleep(0.2)
    assert conn.transport.get_write_buffer_size() < 8 * 1024 * 1024
    # reading again drains everything: all 400 answers arrive
    dec = FrameDecoder()
    got = 0
    while got < 400:
        got += len(dec.feed(await asyncio.wait_for(c.reader.read(1 << 20), 10)))
    assert c.writer is not None
    c.writer.close()
