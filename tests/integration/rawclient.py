"""A tiny raw-codec RocketMQ remoting client for broker tests: a blocking one (``RawClient``) for
tests against a broker process and an asyncio one (``AsyncRawClient``) for in-process brokers.

Both speak exactly what the official C++ client sends (docs/protocol.md#send): long field names, JSON
headers, and let a test send arbitrary bytes for malformed-input cases.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

from chronomq.message import MessageExt, decode_records, encode_properties
from chronomq.remoting.codec import FrameDecoder, FrameError, RemotingCommand, encode
from chronomq.remoting.codes import RequestCode


def send_ext(
    topic: str,
    queue_id: int,
    props: dict[str, str] | None = None,
    *,
    group: str = "PG_test",
    sys_flag: int = 0,
    batch: bool = False,
    reconsume: int = 0,
) -> dict[str, Any]:
    # the C++ client's mix of numbers and strings
    return {
        "producerGroup": group,
        "topic": topic,
        "defaultTopic": "TBW102",
        "defaultTopicQueueNums": 4,
        "queueId": queue_id,
        "sysFlag": sys_flag,
        "bornTimestamp": str(int(time.time() * 1000)),
        "flag": 0,
        "properties": encode_properties(props or {}),
        "reconsumeTimes": str(reconsume),
        "unitMode": "0",
        "batch": "1" if batch else "0",
    }


def pull_ext(
    group: str,
    topic: str,
    queue_id: int,
    offset: int,
    *,
    max_msgs: int = 32,
    suspend_ms: int = 0,
    subscription: str = "*",
    commit_offset: int | None = None,
) -> dict[str, Any]:
    flag = 4 | (2 if suspend_ms else 0) | (1 if commit_offset is not None else 0)
    return {
        "consumerGroup": group,
        "topic": topic,
        "queueId": queue_id,
        "queueOffset": str(offset),
        "maxMsgNums": max_msgs,
        "sysFlag": flag,
        "commitOffset": str(commit_offset or 0),
        "suspendTimeoutMillis": str(suspend_ms),
        "subscription": subscription,
        "subVersion": "0",
    }


def heartbeat_body(client_id: str, group: str, topics: list[str], clustering: bool = True) -> bytes:
    subs = [{"subString": "*", "subVersion": "1", "topic": t} for t in topics]
    return (
        json.dumps(
            {
                "clientID": client_id,
                "consumerDataSet": [
                    {
                        "consumeFromWhere": 0,
                        "consumeType": 1,
                        "groupName": group,
                        "messageModel": 1 if clustering else 0,
                        "subscriptionDataSet": subs,
                    }
                ],
            }
        )
        + "\n"
    ).encode()


def records(resp: RemotingCommand) -> list[MessageExt]:
    return decode_records(resp.body)


class RawClient:
    """Blocking client over one TCP connection. Responses are matched by opaque; frames that arrive for
    other opaques (or server requests) are kept in ``others``."""

    def __init__(self, addr: str, timeout: float = 10.0) -> None:
        host, _, port = addr.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.timeout = timeout
        self.decoder = FrameDecoder()
        self.others: dict[int, RemotingCommand] = {}
        self.server_requests: list[RemotingCommand] = []

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, cmd: RemotingCommand) -> int:
        self.sock.sendall(encode(cmd))
        return cmd.opaque

    def _read_some(self, deadline: float) -> bool:
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return True
        if not data:
            return False
        for item in self.decoder.feed(data):
            if isinstance(item, FrameError):
                raise item
            if item.is_response:
                self.others[item.opaque] = item
            else:
                self.server_requests.append(item)
        return True

    def recv(self, opaque: int, timeout: float | None = None) -> RemotingCommand:
        deadline = time.monotonic() + (timeout or self.timeout)
        while opaque not in self.others:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no response for opaque {opaque}")
            if not self._read_some(deadline):
                raise ConnectionError("connection closed by the server")
        return self.others.pop(opaque)

    def request(
        self, code: int, ext: dict[str, Any] | None = None, body: bytes = b"", timeout: float | None = None
    ) -> RemotingCommand:
        return self.recv(self.send(RemotingCommand.request(code, ext, body)), timeout)

    def is_closed_by_peer(self, timeout: float = 5.0) -> bool:
        """True when the server closes the connection within timeout (reading and dropping frames)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return True
            if not data:
                return True
        return False

    # --- conveniences ---------------------------------------------------------------------------------------
    def send_message(
        self, topic: str, body: bytes, queue_id: int = 0, props: dict[str, str] | None = None, **kw: Any
    ) -> RemotingCommand:
        return self.request(RequestCode.SEND_MESSAGE, send_ext(topic, queue_id, props, **kw), body)

    def pull(
        self, group: str, topic: str, queue_id: int, offset: int, timeout: float | None = None, **kw: Any
    ) -> RemotingCommand:
        return self.request(
            RequestCode.PULL_MESSAGE, pull_ext(group, topic, queue_id, offset, **kw), timeout=timeout
        )


class AsyncRawClient:
    """asyncio client for in-process brokers (the broker runs on the same loop)."""

    def __init__(self) -> None:
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.decoder = FrameDecoder()
        self.pending: dict[int, asyncio.Future[RemotingCommand]] = {}
        self.server_requests: list[RemotingCommand] = []
        self.closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, addr: str) -> AsyncRawClient:
        self = cls()
        host, _, port = addr.rpartition(":")
        self.reader, self.writer = await asyncio.open_connection(host, int(port))
        self._task = asyncio.create_task(self._read_loop())
        return self

    async def _read_loop(self) -> None:
        assert self.reader is not None
        try:
            while True:
                data = await self.reader.read(1 << 20)
                if not data:
                    break
                for item in self.decoder.feed(data):
                    if isinstance(item, FrameError):
                        continue
                    if item.is_response:
                        fut = self.pending.pop(item.opaque, None)
                        if fut is not None and not fut.done():
                            fut.set_result(item)
                    else:
                        self.server_requests.append(item)
        except (OSError, FrameError):
            pass
        finally:
            self.closed.set()
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("closed"))

    def send_raw(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)

    def start(
        self, code: int, ext: dict[str, Any] | None = None, body: bytes = b""
    ) -> asyncio.Future[RemotingCommand]:
        cmd = RemotingCommand.request(code, ext, body)
        fut: asyncio.Future[RemotingCommand] = asyncio.get_running_loop().create_future()
        self.pending[cmd.opaque] = fut
        self.send_raw(encode(cmd))
        return fut

    async def request(
        self, code: int, ext: dict[str, Any] | None = None, body: bytes = b"", timeout: float = 10.0
    ) -> RemotingCommand:
        return await asyncio.wait_for(self.start(code, ext, body), timeout)

    async def send_message(
        self, topic: str, body: bytes, queue_id: int = 0, props: dict[str, str] | None = None, **kw: Any
    ) -> RemotingCommand:
        return await self.request(RequestCode.SEND_MESSAGE, send_ext(topic, queue_id, props, **kw), body)

    async def pull(self, group: str, topic: str, queue_id: int, offset: int, **kw: Any) -> RemotingCommand:
        return await self.request(RequestCode.PULL_MESSAGE, pull_ext(group, topic, queue_id, offset, **kw))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
