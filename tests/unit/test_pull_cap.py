"""One PULL_MESSAGE answer is capped as RocketMQ's store caps it (maxTransferCountOnMessageInMemory,
maxTransferBytesOnMessageInMemory), whatever maxMsgNums asks; the rest comes from nextBeginOffset. A bulk
read (chronomq's readers) has caps of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.integration.rawclient import pull_ext
from tests.unit.test_broker_processors import Env, _dispatched

from chronomq.config import BrokerConfig, ConfigError
from chronomq.message import decode_records
from chronomq.remoting.codes import RequestCode
from chronomq.remoting.codes import ResponseCode as C


async def test_an_answer_holds_at_most_32_messages_and_the_rest_follows(tmp_path: Path) -> None:
    env = Env(tmp_path)
    await env.broker.start()
    try:
        c = await env.client()
        for i in range(50):
            assert (await c.send_message("Cap", f"m{i}".encode(), 0)).code == C.SUCCESS
        await _dispatched(env)
        first = await c.pull("G", "Cap", 0, 0, max_msgs=50)  # the e2e suite's PullParamTest asks 50
        assert len(decode_records(first.body)) == 32 and first.ext_fields["nextBeginOffset"] == "32"
        rest = await c.pull("G", "Cap", 0, 32, max_msgs=50)
        assert [m.body for m in decode_records(rest.body)] == [f"m{i}".encode() for i in range(32, 50)]
    finally:
        await env.close()


async def test_the_caps_are_config_keys_and_the_byte_cap_passes_the_first_message(tmp_path: Path) -> None:
    caps = {"maxTransferCountOnMessageInMemory": "5", "maxTransferBytesOnMessageInMemory": "4096"}
    env = Env(tmp_path, caps)
    await env.broker.start()
    try:
        c = await env.client()
        for topic, body, n in (("Cap", b"s" * 100, 8), ("Mid", b"m" * 1500, 3), ("Big", b"b" * 10_000, 2)):
            for _ in range(n):
                assert (await c.send_message(topic, body, 0)).code == C.SUCCESS
        await _dispatched(env)

        async def count(topic: str) -> tuple[int, str]:
            r = await c.pull("G", topic, 0, 0, max_msgs=100)
            return len(decode_records(r.body)), r.ext_fields["nextBeginOffset"]

        assert await count("Cap") == (5, "5")  # the count cap
        assert await count("Mid") == (2, "2")  # a third 1.5 KiB record would pass 4 KiB
        assert await count("Big") == (1, "1")  # over the byte cap alone: answered all the same, one by one
    finally:
        await env.close()


async def test_a_bulk_read_takes_the_bulk_caps_and_other_pulls_keep_rocketmqs(tmp_path: Path) -> None:
    """chronomq's readers ask for bulk answers (extField chronomqBulkRead=true): capped by
    maxTransferCountOnBulkRead and maxTransferBytesOnBulkRead; a pull without it, or with another value,
    keeps the in-memory caps an official client gets."""
    caps = {"maxTransferCountOnBulkRead": "40", "maxTransferBytesOnBulkRead": "8192"}
    env = Env(tmp_path, caps)
    await env.broker.start()
    try:
        c = await env.client()
        for i in range(100):
            assert (await c.send_message("Bulk", f"m{i}".encode(), 0)).code == C.SUCCESS
        for _ in range(10):
            assert (await c.send_message("BulkBig", b"b" * 1500, 0)).code == C.SUCCESS
        await _dispatched(env)

        async def count(topic: str, offset: int, max_msgs: int, **ext: str) -> tuple[int, str]:
            fields = {**pull_ext("G", topic, 0, offset, max_msgs=max_msgs), **ext}
            r = await c.request(RequestCode.PULL_MESSAGE, fields)
            return len(decode_records(r.body)), r.ext_fields["nextBeginOffset"]

        assert await count("Bulk", 0, 100) == (32, "32")  # an official client's pull
        assert await count("Bulk", 0, 100, chronomqBulkRead="false") == (32, "32")
        assert await count("Bulk", 0, 100, chronomqBulkRead="true") == (40, "40")  # the bulk count cap
        assert await count("Bulk", 40, 25, chronomqBulkRead="true") == (25, "65")  # what it asks, if fewer
        # records of about 1.6 KiB: a fifth would pass 8 KiB (RocketMQ would stop at 256 KiB)
        assert await count("BulkBig", 0, 100, chronomqBulkRead="true") == (4, "4")
        assert await count("BulkBig", 0, 100) == (10, "10")
    finally:
        await env.close()


def test_the_bulk_caps_must_be_positive() -> None:
    for key in ("maxTransferCountOnBulkRead", "maxTransferBytesOnBulkRead"):
        with pytest.raises(ConfigError, match=f"{key}: must be positive"):
            BrokerConfig(**{key: 0}).validate()
