"""chronomq.client's bulk reads (the PULL_MESSAGE extField chronomqBulkRead, which the Spark source and the
push consumer send while they catch up) against the reference Apache RocketMQ: an ordinary pull there, not
refused and answered with at most its in-memory cap (32), so both readers work unchanged against it;
chronomq answers the same pull in full."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from chronomq.client import Admin, Message, Producer, SimpleConsumer
from chronomq.client.model import record_columns
from tests.compat.harness import ChronomqProcess
from tests.compat.observe import uniq
from tests.compat.reference import RocketMQProcess
from tests.conftest import async_wait_for

pytestmark = pytest.mark.compat


@pytest.fixture
def brokers(chronomq_factory: Callable[..., ChronomqProcess], rocketmq5: RocketMQProcess,
            request: pytest.FixtureRequest) -> dict[str, Any]:
    """chronomq and the reference brokers this machine can run (4.9.x is optional: its absence is noted)."""
    out: dict[str, Any] = {"chronomq": chronomq_factory(), "rocketmq5": rocketmq5}
    try:
        out["rocketmq4"] = request.getfixturevalue("rocketmq4")
    except pytest.skip.Exception as e:
        print(f"rocketmq4 reference not run: {e}")
    return out


async def _bulk_answer(namesrv: str, n: int) -> tuple[int, int]:
    """``n`` messages sent to one queue of a new topic, then one bulk pull of them all: how many the answer
    holds, and where the next pull starts."""
    topic = uniq("BulkRead")
    async with Admin(namesrv) as a:
        await a.create_topic(topic, 1)
    async with Producer(uniq("PG"), namesrv) as p:
        await p.send_batch([Message(topic, f"m{i}".encode()) for i in range(n)])
    async with SimpleConsumer(uniq("SC"), namesrv) as c:
        [q] = await c.queues(topic, refresh=True)

        async def stored() -> bool:
            return await c.max_offset(q) == n

        await async_wait_for(stored, timeout=30, message=f"{n} messages in the queue")
        res = await c.pull(q, 0, n, raw="bytes", bulk=True)
        assert res.body is not None, res
        got = record_columns(res.body)
        assert [bytes(b) for b in got.bodies] == [f"m{i}".encode() for i in range(len(got.bodies))]
        return len(got.bodies), res.next_offset


async def test_a_bulk_pull_is_an_ordinary_pull_to_apache_rocketmq(brokers: dict[str, Any]) -> None:
    answers = {name: await _bulk_answer(b.namesrv_addr, 100) for name, b in brokers.items()}
    assert answers.pop("chronomq") == (100, 100)
    assert answers and set(answers.values()) == {(32, 32)}, answers
