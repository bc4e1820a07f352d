"""De-duplication of sends by (topic, UNIQ_KEY) on a real broker (in process, loopback) through the client:
single and batched sends, in-request repeats, delay levels and timed messages, plain traffic untouched,
the window surviving a restart (the index and the timer's keys), and the window and memory bounds of the
service itself on a virtual clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import async_wait_for, free_port

from chronomq.broker.controller import BrokerController
from chronomq.broker.dedup import Original, SendDedup
from chronomq.client import Message, Producer
from chronomq.clock import SystemClock, VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import PROPERTY_DEDUP, PROPERTY_UNIQ_KEY, SCHEDULE_TOPIC, MessageExt
from chronomq.namesrv.server import NameServer

HOUR = 3_600_000


def _config(tmp_path: Path, ns: str, **extra: str) -> BrokerConfig:
    values = {"storePathRootDir": str(tmp_path), "listenPort": str(free_port()),
              "haListenPort": str(free_port()), "namesrvAddr": ns, "metricsPort": "-1",
              "messageDelayLevel": "1h 2h", **extra}
    config, _ = BrokerConfig.load(None, values)
    return config


async def _stored(b: BrokerController, topic: str) -> int:
    """Messages in the topic's queues, once the dispatcher has caught up with the commit log."""
    await async_wait_for(lambda: b.store.dispatched_offset >= b.store.max_phy_offset, 10,
                         message="the consume queues to catch up")
    return sum(b.store.get_max_offset_in_queue(topic, q) for q in b.store.queue_ids(topic))


async def test_replays_are_answered_as_the_original_and_stored_once(tmp_path: Path) -> None:
    ns = NameServer("127.0.0.1", free_port(), SystemClock())
    await ns.start()
    config = _config(tmp_path, ns.address)
    b = BrokerController(config, SystemClock())
    await b.start()
    later = SystemClock().now_ms() + HOUR
    try:
        async with Producer("PG_dedup", ns.address) as p:
            first = await p.send(Message("Dd", b"one", uniq_key="K1", dedup=True))
            again = await p.send(Message("Dd", b"one", uniq_key="K1", dedup=True))
            assert again.offset_msg_id == first.offset_msg_id and again.queue_offset == first.queue_offset
            # batches: a key stored before, a key twice in the same request, a new key
            await p.send_batch([Message("Dd", b"two", uniq_key="K2", dedup=True),
                                Message("Dd", b"three", uniq_key="K3", dedup=True)])
            r = await p.send_batch([Message("Dd", b"three", uniq_key="K3", dedup=True),
                                    Message("Dd", b"four", uniq_key="K4", dedup=True),
                                    Message("Dd", b"four", uniq_key="K4", dedup=True)])
            ids = r.offset_msg_id.split(",")
            assert len(ids) == 3 and ids[1] == ids[2] and ids[0] != ids[1]
            assert await _stored(b, "Dd") == 4  # K1..K4, once each
            # plain traffic (no dedup asked): stored every time, even with the same UNIQ_KEY
            await p.send(Message("Dd", b"plain", uniq_key="P1"))
            await p.send(Message("Dd", b"plain", uniq_key="P1"))
            assert await _stored(b, "Dd") == 6
            # a delay level: parked once
            lv1 = await p.send(Message("Dd", b"level", uniq_key="L1", delay_level=1, dedup=True))
            lv2 = await p.send(Message("Dd", b"level", uniq_key="L1", delay_level=1, dedup=True))
            assert lv1.offset_msg_id == lv2.offset_msg_id
            assert await _stored(b, SCHEDULE_TOPIC) == 1
            # timed: parked once, the replay answered with the first's handle and deliver time
            t1 = await p.send(Message("Dd", b"timed", uniq_key="T1", deliver_at=later, dedup=True))
            t2 = await p.send(Message("Dd", b"timed", uniq_key="T1", deliver_at=later + 5_000, dedup=True))
            assert t2.offset_msg_id == t1.offset_msg_id and t2.deliver_ms == t1.deliver_ms == later
            assert b.timer.stats()["pending"] == 1
            # the same key on another topic is another message
            await p.send(Message("Dd2", b"one", uniq_key="K1", dedup=True))
            assert await _stored(b, "Dd2") == 1
        assert b.services.dedup is not None and b.services.dedup.replays == 5  # K1, K3, K4's copy, L1, T1
        assert b.metrics_snapshot()["dedup_replays"] == 5
    finally:
        await b.shutdown()
    # after a restart the memory is empty: the index and the timer's key index still know them
    b = BrokerController(config, SystemClock())
    await b.start()
    try:
        assert b.services.dedup is not None and not b.services.dedup._recent
        async with Producer("PG_dedup", ns.address) as p:
            again = await p.send(Message("Dd", b"one", uniq_key="K1", dedup=True))
            assert again.offset_msg_id == first.offset_msg_id
            await p.send_batch([Message("Dd", b"two", uniq_key="K2", dedup=True),
                                Message("Dd", b"five", uniq_key="K5", dedup=True)])
            t3 = await p.send(Message("Dd", b"timed", uniq_key="T1", deliver_at=later, dedup=True))
            assert t3.offset_msg_id == t1.offset_msg_id
            lv3 = await p.send(Message("Dd", b"level", uniq_key="L1", delay_level=1, dedup=True))
            assert lv3.offset_msg_id == lv1.offset_msg_id
        assert await _stored(b, "Dd") == 7  # only K5 is new
        assert await _stored(b, SCHEDULE_TOPIC) == 1 and b.timer.stats()["pending"] == 1
    finally:
        await b.shutdown()
        await ns.stop()


async def test_a_window_of_zero_turns_it_off(tmp_path: Path) -> None:
    ns = NameServer("127.0.0.1", free_port(), SystemClock())
    await ns.start()
    b = BrokerController(_config(tmp_path, ns.address, dedupWindowSec="0"), SystemClock())
    await b.start()
    try:
        assert b.services.dedup is None
        async with Producer("PG_dedup0", ns.address) as p:
            for _ in range(2):
                await p.send(Message("D0", b"x", uniq_key="K", dedup=True))
        assert await _stored(b, "D0") == 2
    finally:
        await b.shutdown()
        await ns.stop()


class _Store:
    def __init__(self) -> None:
        self.indexed: list[MessageExt] = []

    def query_message(self, topic: str, key: str, max_num: int, begin_ts: int, end_ts: int
                      ) -> list[MessageExt]:
        return [m for m in self.indexed if m.topic == topic and m.uniq_key == key
                and begin_ts <= m.store_timestamp <= end_ts][:max_num]

    def query_messages(self, topic: str, keys: list[str], max_num: int, begin_ts: int, end_ts: int
                       ) -> dict[str, list[MessageExt]]:
        found = {k: self.query_message(topic, k, max_num, begin_ts, end_ts) for k in keys}
        return {k: ms for k, ms in found.items() if ms}


class _Timer:
    def records_of(self, uniq: str) -> list[Any]:
        return []


def _msg(uniq: str, dedup: bool = True) -> MessageExt:
    props = {PROPERTY_UNIQ_KEY: uniq}
    if dedup:
        props[PROPERTY_DEDUP] = "true"
    return MessageExt("T", b"x", props)


def test_the_window_and_the_memory_are_bounded(tmp_path: Path) -> None:
    clock = VirtualClock(1_000_000)
    config, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path), "dedupWindowSec": "60",
                                         "dedupRecentMax": "1000"})
    store = _Store()
    d = SendDedup(store, _Timer(), config, clock, ("127.0.0.1", 10911))  # type: ignore[arg-type]
    assert d.key_of(_msg("a", dedup=False), "T") is None
    key = d.key_of(_msg("a"), "T")
    assert key == ("T", "a")
    assert d.find(key) is None
    d.remember(key, Original("ID-A", 0, 7))
    assert d.find(key) == Original("ID-A", 0, 7)
    clock.advance_sync(60_001)  # out of the window: forgotten
    assert d.find(key) is None and key not in d._recent
    for i in range(1_500):  # memory holds at most dedupRecentMax keys, the newest
        d.remember(("T", f"k{i}"), Original(f"ID{i}", 0, i))
    assert len(d._recent) == 1_000 and ("T", "k0") not in d._recent and ("T", "k1499") in d._recent
    # once out of memory, the index answers (within the window)
    m = _msg("k0")
    m.store_timestamp, m.commit_log_offset, m.queue_offset = clock.now_ms() - 1_000, 4096, 3
    store.indexed.append(m)
    found = d.find(("T", "k0"))
    assert found is not None and found.queue_offset == 3
    # a request that repeats a key stores it once
    plan = d.split([("T", "n1"), ("T", "n1"), None])
    assert plan == [None, 0, None]
    answers = d.settle([("T", "n1"), ("T", "n1"), None], plan, [Original("N1", 1, 10), Original("P", 1, 11)])
    assert [a.offset_msg_id for a in answers] == ["N1", "N1", "P"]
    assert d.find(("T", "n1")) == Original("N1", 1, 10)
