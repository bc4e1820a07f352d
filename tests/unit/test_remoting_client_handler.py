"""A request the server pushes to a client connection: the handler's answer is written back whether the
handler returns the command, None, or anything awaitable that gives one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator
from typing import Any, cast

import pytest

from chronomq.remoting.client import Connection
from chronomq.remoting.codec import FrameDecoder, RemotingCommand, encode
from chronomq.remoting.codes import RequestCode

PUSHED = RequestCode.GET_CONSUMER_RUNNING_INFO


class _Writer:
    """What Connection writes, kept."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


class _Later:
    """An awaitable that is neither a coroutine nor a future."""

    def __init__(self, cmd: RemotingCommand) -> None:
        self.cmd = cmd

    def __await__(self) -> Generator[Any, None, RemotingCommand]:
        yield from asyncio.sleep(0).__await__()
        return self.cmd


def _answers(kind: str) -> Callable[[str, RemotingCommand], Any]:
    def handler(addr: str, cmd: RemotingCommand) -> RemotingCommand | Awaitable[RemotingCommand] | None:
        answer = cmd.response(body=kind.encode())
        if kind == "command":
            return answer
        if kind == "none":
            return None
        if kind == "future":
            fut: asyncio.Future[RemotingCommand] = asyncio.get_running_loop().create_future()
            fut.set_result(answer)
            return fut
        if kind == "coroutine":
            async def later() -> RemotingCommand:
                return answer
            return later()
        return _Later(answer)
    return handler


async def _pushed_answer(kind: str) -> list[Any]:
    reader = asyncio.StreamReader()
    writer = _Writer()
    stream = cast(asyncio.StreamWriter, writer)  # Connection only writes and closes it
    conn = Connection("127.0.0.1:1", reader, stream, _answers(kind), lambda c: None)
    request = RemotingCommand.request(PUSHED)
    reader.feed_data(encode(request))
    for _ in range(50):
        await asyncio.sleep(0)
    conn.close()
    await conn.wait_closed()
    return [(f.opaque, f.body, f.is_response) for f in FrameDecoder().feed(bytes(writer.data))
            if isinstance(f, RemotingCommand)] + [request.opaque]


@pytest.mark.parametrize("kind", ["command", "future", "coroutine", "awaitable"])
async def test_the_handlers_answer_is_written_back(kind: str) -> None:
    *frames, opaque = await _pushed_answer(kind)
    assert frames == [(opaque, kind.encode(), True)]


async def test_no_answer_writes_nothing() -> None:
    *frames, _ = await _pushed_answer("none")
    assert frames == []
