"""PushConsumer's pulls of a backlog, against a real `chronomq start`. Whose answers are capped small, bulk
reads too (5 messages, 4 KiB, as a broker that caps every answer): a backlog is drained with ranges sent
together, every message handed on once and in queue order, also when answers hold fewer than the cap
(large messages: the ranges do not tile and the rest is pulled again), and the offsets committed reach the
end of the queue. Whose bulk reads keep their default caps: the backlog comes in bulk answers, larger
than the in-memory cap an official client gets, with no ranges needed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from chronomq.client import Admin, Message, Producer, PushConsumer, ReceivedMessage
from tests.compat.harness import ChronomqProcess
from tests.conftest import async_wait_for

IN_MEMORY = {"maxTransferCountOnMessageInMemory": "5", "maxTransferBytesOnMessageInMemory": "4096"}
CAPS = {**IN_MEMORY, "maxTransferCountOnBulkRead": "5", "maxTransferBytesOnBulkRead": "4096"}
OPTS = dict(rebalance_interval=0.5, offset_commit_interval=0.5, long_poll_timeout=2.0)


def _server(tmp_path_factory: pytest.TempPathFactory, caps: dict[str, str]) -> Iterator[ChronomqProcess]:
    p = ChronomqProcess(tmp_path_factory.mktemp("pipeline") / "data", caps)
    p.start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    yield from _server(tmp_path_factory, CAPS)


async def _drain(server: ChronomqProcess, topic: str, bodies: list[bytes],
                 answers: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Send ``bodies`` to one queue of ``topic``, consume them from the start; returns the queue offsets
    handed to the listener in order and how many pulls each pipelined round sent (``answers``: the size of
    each single pull's answer, appended)."""
    ns = server.namesrv_addr
    async with Admin(ns) as a:
        await a.create_topic(topic, 1)
    async with Producer(f"P_{topic}", ns) as p:
        for start in range(0, len(bodies), 50):
            await p.send_batch([Message(topic, b) for b in bodies[start:start + 50]])
    offsets: list[int] = []
    seen: dict[bytes, int] = {}
    rounds: list[int] = []

    async def listener(msg: ReceivedMessage) -> None:
        offsets.append(msg.queue_offset)
        seen[msg.body] = seen.get(msg.body, 0) + 1

    c = PushConsumer(f"C_{topic}", {topic: "*"}, listener, ns, consume_from="first", concurrency=1,
                     pull_batch_size=32, **OPTS)
    real = c._pull_ranges

    async def counting(pq, step, total, commit):  # type: ignore[no-untyped-def]
        answers = await real(pq, step, total, commit)
        if pq.mq.topic == topic:
            rounds.append(len(answers))
        return answers

    single = c._pull

    async def sized(pq, count, commit, bulk=False):  # type: ignore[no-untyped-def]
        res = await single(pq, count, commit, bulk)
        if answers is not None and pq.mq.topic == topic and res.messages:
            answers.append(len(res.messages))
        return res

    c._pull_ranges = counting  # type: ignore[method-assign]
    c._pull = sized  # type: ignore[method-assign]
    async with c:
        await async_wait_for(lambda: len(seen) == len(bodies), timeout=60,
                             message=f"{len(bodies)} distinct messages")
        async with Admin(ns) as a:

            async def committed() -> bool:
                await c.commit_offsets()
                rows = await a.group_progress(f"C_{topic}", topic)
                return sum(r.consumer_offset for r in rows if r.queue.topic == topic) == len(bodies)

            await async_wait_for(committed, timeout=20, message="the offset committed at the queue's end")
    assert set(seen) == set(bodies) and set(seen.values()) == {1}
    return offsets, rounds


async def test_a_backlog_is_pulled_in_ranges_sent_together(server: ChronomqProcess) -> None:
    bodies = [f"m{i}".encode() for i in range(600)]
    offsets, rounds = await _drain(server, "PipeEven", bodies)
    assert offsets == list(range(600))  # one listener at a time: handed on in queue order
    assert rounds and max(rounds) > 1  # several ranges in flight at once


async def test_answers_shorter_than_the_cap_leave_no_gap(server: ChronomqProcess) -> None:
    # 3 KiB messages every 7th: an answer holds 1 to 5 (the 4 KiB limit), so ranges of 5 do not tile
    bodies = [(f"b{i}|".encode() + (b"x" * 3000 if i % 7 == 3 else b"")) for i in range(400)]
    offsets, rounds = await _drain(server, "PipeUneven", bodies)
    assert offsets == list(range(400))
    assert rounds


def test_a_backlog_comes_in_bulk_answers_from_chronomq(tmp_path_factory: pytest.TempPathFactory) -> None:
    bodies = [f"m{i}".encode() for i in range(600)]
    sizes: list[int] = []
    for bulk_server in _server(tmp_path_factory, IN_MEMORY):
        offsets, rounds = asyncio.run(_drain(bulk_server, "PipeBulk", bodies, sizes))
        assert offsets == list(range(600))
    assert max(sizes) > 5 and not rounds  # answers past the in-memory cap: no ranges were needed
