"""The level schedule service against a real MessageStore on a virtual clock: exact due times, order
within a level, never early, restarts (clean and crash) without loss or duplicates, the backlog drain,
and the send-back ladder through the store."""

from __future__ import annotations

import asyncio
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.delay import PROPERTY_DELAY_SOURCE, DelayService
from chronomq.delay.offsets import OffsetFile
from chronomq.message import (
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_ORIGIN_MESSAGE_ID,
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    PROPERTY_RETRY_TOPIC,
    SCHEDULE_TOPIC,
    MessageExt,
    decode_record,
)
from chronomq.store import MessageStore, PutResult, PutStatus
from tests.conftest import async_wait_for

pytestmark = pytest.mark.timeout(120)

LEVELS_MS = [1000, 5000, 10000, 30000, 60000, 120000, 180000, 240000, 300000, 360000, 420000, 480000,
             540000, 600000, 1200000, 1800000, 3600000, 7200000]


def make_config(root: Path, **over: str) -> BrokerConfig:
    cfg, _ = BrokerConfig.load(overrides={
        "storePathRootDir": str(root),
        "mappedFileSizeCommitLog": str(32 * 1024 * 1024),
        "mappedFileSizeConsumeQueue": str(20 * 20_000),
        "flushDelayOffsetInterval": str(3_600_000),  # tests persist explicitly unless they say otherwise
        **over,
    })
    return cfg


class Env:
    """A store + delay service on one data dir, sharing a virtual clock across restarts."""

    def __init__(self, root: Path, clock: VirtualClock, **over: str) -> None:
        self.root = root
        self.clock = clock
        self.over = over
        self.cfg = make_config(root, **over)
        self.store: MessageStore | None = None
        self.svc: DelayService | None = None
        self.expected: dict[str, tuple[int, int]] = {}  # body -> (level, deliver time)
        self.order: dict[str, list[str]] = {}  # real topic -> bodies in put order
        self.phys: dict[str, int] = {}  # body -> commit-log offset of the parked copy

    async def start(self) -> None:
        self.store = MessageStore(self.cfg, self.clock)
        await asyncio.to_thread(self.store.start)
        self.svc = DelayService(self.store, self.cfg, self.clock)
        await self.svc.start()

    async def stop(self) -> None:
        await self.svc.shutdown()
        await asyncio.to_thread(self.store.shutdown)

    def put(self, body: str, level: int, topic: str | None = None, qid: int = 0) -> MessageExt:
        m = MessageExt(topic=topic or f"T{level}", body=body.encode(), queue_id=qid,
                       properties={PROPERTY_DELAY_TIME_LEVEL: str(level), "KEYS": body},
                       born_timestamp=self.clock.now_ms(), born_host=("127.0.0.1", 40000))
        self.svc.prepare_put(m)
        res = self.store.put_message(m)
        assert res.ok, res
        lv = min(level, len(self.cfg.delay_levels_ms))
        assert m.topic == SCHEDULE_TOPIC and m.queue_id == lv - 1
        self.expected[body] = (lv, res.append.store_timestamp + self.cfg.delay_levels_ms[lv - 1])
        self.order.setdefault(m.properties[PROPERTY_REAL_TOPIC], []).append(body)
        self.phys[body] = res.append.wrote_offset
        return m

    async def settle(self) -> None:
        assert await asyncio.to_thread(self.store.wait_dispatched, self.store.max_phy_offset, 10)
        await async_wait_for(self.svc.schedule.is_settled, timeout=30, message="delay service settled")

    async def run_until(self, target_ms: int) -> None:
        """Move the virtual clock to target_ms one deadline at a time, letting the service finish its
        work at each step, so a delivery due at T is made while now_ms() == T."""
        while True:
            await self.settle()
            due = [d for d in self.clock.pending_deadlines() if d <= target_ms]
            if not due:
                break
            await self.clock.advance_to(due[0])
        if target_ms > self.clock.now_ms():
            await self.clock.advance_to(target_ms)
        await self.settle()

    def delivered(self, topic: str, qid: int = 0) -> list[MessageExt]:
        out: list[MessageExt] = []
        offset = 0
        while True:
            r = self.store.get_message(topic, qid, offset, 512)
            if not r.messages:
                return out
            out.extend(decode_record(b) for b in r.messages)
            offset = r.next_begin_offset

    def all_delivered(self, topics: list[tuple[str, int]]) -> list[MessageExt]:
        return [m for t, q in topics for m in self.delivered(t, q)]


def check_deliveries(env: Env, msgs: list[MessageExt], expect_all: bool = True) -> None:
    counts = Counter(m.body.decode() for m in msgs)
    dups = {b: n for b, n in counts.items() if n > 1}
    assert not dups, f"duplicate deliveries: {list(dups.items())[:5]}"
    for m in msgs:
        body = m.body.decode()
        level, due = env.expected[body]
        assert m.store_timestamp == due, (body, level, m.store_timestamp - due)
        assert m.properties[PROPERTY_DELAY_TIME_LEVEL] == str(level)  # kept, as RocketMQ keeps it
        assert m.properties[PROPERTY_REAL_TOPIC] == m.topic
        assert m.properties[PROPERTY_REAL_QUEUE_ID] == str(m.queue_id)
        assert m.properties["KEYS"] == body
        assert m.born_host == ("127.0.0.1", 40000)
    if expect_all:
        missing = set(env.expected) - set(counts)
        assert not missing, f"{len(missing)} never delivered, e.g. {sorted(missing)[:5]}"


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


async def test_all_levels_exact_due_time_in_order(tmp_path: Path, clock: VirtualClock) -> None:
    env = Env(tmp_path, clock)
    await env.start()
    try:
        rng = random.Random(7)
        n = 0
        for _wave in range(25):
            for _ in range(rng.randint(100, 200)):
                env.put(f"m{n}", rng.randint(1, 18))
                n += 1
            env.put(f"m{n}", 25)  # above the table: clamped to level 18
            n += 1
            await env.run_until(clock.now_ms() + rng.randint(0, 400_000))
        assert n > 3000
        # nothing is ever early: every still-pending message is due after now
        delivered = env.all_delivered([(f"T{lv}", 0) for lv in range(1, 19)] + [("T25", 0)])
        check_deliveries(env, delivered, expect_all=False)
        pending = set(env.expected) - {m.body.decode() for m in delivered}
        assert pending and all(env.expected[b][1] > clock.now_ms() for b in pending)
        assert all(env.expected[m.body.decode()][1] <= clock.now_ms() for m in delivered)

        await env.run_until(max(d for _, d in env.expected.values()) + 1)
        delivered = env.all_delivered([(f"T{lv}", 0) for lv in range(1, 19)] + [("T25", 0)])
        check_deliveries(env, delivered)
        # in order within a level (one real topic per level; T25 is clamped to level 18)
        for topic, bodies in env.order.items():
            assert [m.body.decode() for m in env.delivered(topic)] == bodies, topic

        stats = env.svc.stats()
        assert stats["early_deliveries"] == 0
        assert sum(lv["delivered"] for lv in stats["levels"]) == n
        for lv in stats["levels"]:
            assert lv["pending"] == 0 and lv["oldest_pending_deliver_ms"] is None
            assert lv["delivered"] == sum(1 for x, _ in env.expected.values() if x == lv["level"])
            assert lv["lateness_ms"]["max"] == 0 and lv["lateness_ms"]["count"] == lv["delivered"]
            assert lv["delay_ms"] == LEVELS_MS[lv["level"] - 1]
        assert env.svc.min_needed_offset() is None
    finally:
        await env.stop()


async def test_stats_and_cleaning_guard_while_pending(tmp_path: Path, clock: VirtualClock) -> None:
    env = Env(tmp_path, clock)
    await env.start()
    try:
        env.put("a", 2)
        await clock.advance(300)
        env.put("b", 2)
        env.put("c", 4)
        await env.settle()
        assert env.svc.min_needed_offset() == env.phys["a"]
        stats = {lv["level"]: lv for lv in env.svc.stats()["levels"]}
        assert stats[2]["pending"] == 2 and stats[4]["pending"] == 1 and stats[1]["pending"] == 0
        assert stats[2]["oldest_pending_deliver_ms"] == env.expected["a"][1]
        assert stats[4]["oldest_pending_deliver_ms"] == env.expected["c"][1]
        await env.run_until(env.expected["a"][1])
        stats = {lv["level"]: lv for lv in env.svc.stats()["levels"]}
        assert stats[2]["pending"] == 1 and stats[2]["delivered"] == 1
        assert stats[2]["oldest_pending_deliver_ms"] == env.expected["b"][1]
        # one millisecond before "b" is due it is still parked
        await env.run_until(env.expected["b"][1] - 1)
        assert [m.body for m in env.delivered("T2")] == [b"a"]
        await env.run_until(env.expected["b"][1])
        assert [m.body for m in env.delivered("T2")] == [b"a", b"b"]
    finally:
        await env.stop()


async def test_clean_restart_keeps_pending_and_never_duplicates(tmp_path: Path, clock: VirtualClock) -> None:
    env = Env(tmp_path, clock)
    await env.start()
    rng = random.Random(11)
    for i in range(1500):
        env.put(f"r{i}", rng.randint(1, 8))
        if i % 100 == 99:
            await env.run_until(clock.now_ms() + rng.randint(100, 20_000))
    await env.run_until(clock.now_ms() + 60_000)
    topics = [(f"T{lv}", 0) for lv in range(1, 9)]
    before = len(env.all_delivered(topics))
    assert 0 < before < 1500
    await env.stop()
    assert (tmp_path / "config" / "delayOffset.json").exists()

    env2 = Env(tmp_path, clock)
    env2.expected, env2.order = env.expected, env.order
    await env2.start()
    try:
        await env2.settle()
        assert len(env2.all_delivered(topics)) == before  # nothing re-delivered on start
        await env2.run_until(max(d for _, d in env.expected.values()) + 1)
        check_deliveries(env2, env2.all_delivered(topics))
        assert env2.svc.stats()["recovered_skips"] == 0
    finally:
        await env2.stop()


def _flush_store(store: MessageStore) -> None:
    # the store's own flush thread may be writing its checkpoint at the same moment: try again
    for attempt in range(5):
        try:
            store.flush()
            return
        except OSError:
            if attempt == 4:
                raise


async def _crash_image(env: Env, dest: Path) -> None:
    """What a crash leaves behind: the data dir as it is on disk while running (abort file present)."""
    await env.settle()
    await asyncio.to_thread(_flush_store, env.store)
    shutil.copytree(env.root, dest, ignore=shutil.ignore_patterns("*.tmp"))


async def test_crash_after_stale_offsets_no_duplicates_no_loss(tmp_path: Path, clock: VirtualClock) -> None:
    live = tmp_path / "live"
    env = Env(live, clock)
    await env.start()
    rng = random.Random(5)
    for i in range(1200):
        env.put(f"c{i}", rng.randint(1, 6))
    await env.run_until(clock.now_ms() + 12_000)
    await env.svc.schedule.persist()  # the last persisted offsets ...
    persisted = {lv: st.offset for lv, st in env.svc.schedule.states.items()}
    for i in range(1200, 1500):
        env.put(f"c{i}", rng.randint(1, 6))
    await env.run_until(clock.now_ms() + 35_000)  # ... are older than these deliveries
    assert any(st.offset > persisted[lv] for lv, st in env.svc.schedule.states.items())
    topics = [(f"T{lv}", 0) for lv in range(1, 7)]
    delivered_before_crash = {m.body.decode() for m in env.all_delivered(topics)}
    crashed = tmp_path / "crashed"
    await _crash_image(env, crashed)
    now_at_crash = clock.now_ms()
    await env.stop()
    assert (crashed / "abort").exists()

    env2 = Env(crashed, clock)
    env2.expected, env2.order = env.expected, env.order
    await env2.start()
    try:
        await env2.settle()
        assert clock.now_ms() == now_at_crash
        after_start = {m.body.decode() for m in env2.all_delivered(topics)}
        assert after_start == delivered_before_crash  # nothing delivered twice on recovery
        assert env2.svc.stats()["recovered_skips"] > 0
        await env2.run_until(max(d for _, d in env.expected.values()) + 1)
        check_deliveries(env2, env2.all_delivered(topics))
    finally:
        await env2.stop()


async def test_crash_with_lost_log_tail_redelivers_lost_reputs(tmp_path: Path, clock: VirtualClock) -> None:
    """The commit log loses its unflushed tail (the last re-puts): those entries are delivered again
    after recovery, so nothing is lost; entries whose re-put survived are not duplicated."""
    live = tmp_path / "live"
    env = Env(live, clock)
    await env.start()
    for i in range(400):
        env.put(f"x{i}", 1 + i % 3)
    await env.svc.schedule.persist()  # offsets: nothing delivered yet
    await env.run_until(clock.now_ms() + 5_000)  # levels 1 and 2 delivered, level 3 (10 s) pending
    t1 = env.delivered("T1")
    t2 = env.delivered("T2")
    assert (len(t1), len(t2)) == (len(env.order["T1"]), len(env.order["T2"]))
    crashed = tmp_path / "crashed"
    await _crash_image(env, crashed)
    log_end = env.store.max_phy_offset
    await env.stop()
    # cut the log in the middle of the level-2 re-puts: the later ones are "lost in the crash"
    cut = t2[len(t2) // 2].commit_log_offset
    seg = sorted((crashed / "commitlog").iterdir())[0]
    assert int(seg.name) == 0
    with open(seg, "r+b") as f:
        f.seek(cut)
        f.write(b"\0" * (log_end - cut))

    env2 = Env(crashed, clock)
    env2.expected, env2.order = env.expected, env.order
    await env2.start()
    try:
        await env2.run_until(max(d for _, d in env.expected.values()) + 1)
        again1 = env2.delivered("T1")
        assert [m.body for m in again1] == [m.body for m in t1]  # survived re-puts not repeated
        again2 = env2.delivered("T2")
        assert [m.body.decode() for m in again2] == env.order["T2"]  # the lost half delivered again
        assert all(m.store_timestamp >= env.expected[m.body.decode()][1] for m in again2)
        assert [m.body.decode() for m in env2.delivered("T3")] == env.order["T3"]
        assert env2.svc.stats()["early_deliveries"] == 0
    finally:
        await env2.stop()


async def test_backlog_drains_in_one_go(tmp_path: Path, clock: VirtualClock) -> None:
    env = Env(tmp_path, clock, messageDelayLevel="1s 2s")
    await env.start()
    try:
        n = 20_000
        for i in range(n):
            env.put(f"b{i}", 1, topic="Backlog", qid=i % 4)
        due = env.expected["b0"][1]
        assert all(d == due for _, d in env.expected.values())
        await env.run_until(due)
        assert clock.now_ms() == due
        got = env.all_delivered([("Backlog", q) for q in range(4)])
        assert len(got) == n
        assert all(m.store_timestamp == due for m in got)
        for q in range(4):
            assert [m.body.decode() for m in env.delivered("Backlog", q)] == [
                f"b{i}" for i in range(q, n, 4)]
        s = env.svc.stats()["levels"][0]
        assert s["delivered"] == n and s["pending"] == 0 and s["lateness_ms"]["max"] == 0
    finally:
        await env.stop()


async def test_retry_ladder_and_dlq_through_the_store(tmp_path: Path, clock: VirtualClock) -> None:
    env = Env(tmp_path, clock, messageDelayLevel="1s 2s 3s 4s 5s", maxReconsumeTimes="3")
    await env.start()
    try:
        m = MessageExt(topic="Orders", body=b"order-1", properties={"UNIQ_KEY": "U-1"},
                       born_timestamp=clock.now_ms())
        res = env.store.put_message(env.svc.prepare_put(m))
        assert res.ok and m.topic == "Orders"
        consumed = env.store.look_message_by_offset(res.append.wrote_offset)
        origin = consumed.msg_id
        seen_delays = []
        for attempt in range(1, 4):
            back = env.svc.build_send_back(consumed, "CG", 0, None)
            sent_at = clock.now_ms()
            r = env.store.put_message(env.svc.prepare_put(back))
            assert r.ok and back.topic == SCHEDULE_TOPIC
            await env.run_until(sent_at + 10_000)
            retries = env.delivered("%RETRY%CG")
            assert len(retries) == attempt
            consumed = retries[-1]
            seen_delays.append(consumed.store_timestamp - sent_at)
            assert consumed.reconsume_times == attempt
            assert consumed.properties[PROPERTY_RETRY_TOPIC] == "Orders"
            assert consumed.properties[PROPERTY_ORIGIN_MESSAGE_ID] == origin
            assert consumed.properties["UNIQ_KEY"] == "U-1"
            assert PROPERTY_DELAY_SOURCE in consumed.properties
        assert seen_delays == [3000, 4000, 5000]  # levels 3, 4, 5 (the ladder: 3 + reconsume times)
        dead = env.svc.build_send_back(consumed, "CG", 0, None)
        r = env.store.put_message(env.svc.prepare_put(dead))
        assert r.ok and dead.topic == "%DLQ%CG"
        await env.settle()
        dlq = env.delivered("%DLQ%CG")
        assert len(dlq) == 1 and dlq[0].body == b"order-1" and dlq[0].reconsume_times == 4
        assert dlq[0].properties[PROPERTY_ORIGIN_MESSAGE_ID] == origin
        assert PROPERTY_DELAY_SOURCE not in dlq[0].properties
    finally:
        await env.stop()


class FlakyStore:
    """Fault injection around the real store: puts to ``topic`` fail (store busy) while ``failing``."""

    def __init__(self, store: MessageStore, topic: str) -> None:
        self._store = store
        self.topic = topic
        self.failing = True
        self.refused = 0

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def _refuse(self, msgs: list[MessageExt]) -> PutResult | None:
        if self.failing and any(m.topic == self.topic for m in msgs):
            self.refused += len(msgs)
            return PutResult(PutStatus.OS_PAGECACHE_BUSY, None, "injected: page cache busy")
        return None

    def put_message(self, msg: MessageExt) -> PutResult:
        return self._refuse([msg]) or self._store.put_message(msg)

    def put_messages(self, msgs: list[MessageExt]) -> PutResult:
        return self._refuse(msgs) or self._store.put_messages(msgs)


async def test_transient_put_failures_and_undeliverable_entries(tmp_path: Path, clock: VirtualClock) -> None:
    cfg = make_config(tmp_path, messageDelayLevel="1s 2s")
    store = MessageStore(cfg, clock)
    await asyncio.to_thread(store.start)
    flaky = FlakyStore(store, "B")
    svc = DelayService(flaky, cfg, clock)
    await svc.start()
    env = Env(tmp_path, clock)
    env.cfg, env.store, env.svc = cfg, store, svc
    try:
        for i in range(60):
            env.put(f"a{i}", 1, topic="B" if i % 3 == 2 else "A")
        # a parked record whose real topic cannot be restored (written around prepare_put)
        bad = MessageExt(topic=SCHEDULE_TOPIC, body=b"bad", queue_id=0,
                         properties={PROPERTY_DELAY_TIME_LEVEL: "1", PROPERTY_REAL_TOPIC: "bad topic!",
                                     PROPERTY_REAL_QUEUE_ID: "0"})
        assert store.put_message(bad).ok
        for i in range(60, 80):
            env.put(f"a{i}", 1, topic="A")
        due = env.expected["a0"][1]
        await env.run_until(due)
        a_first = env.delivered("A")
        # A's entries read with B's are delivered on time even though B's (before them) are refused
        assert len(a_first) > 30
        assert [m.body.decode() for m in a_first] == env.order["A"][:len(a_first)]
        assert all(m.store_timestamp == due for m in a_first)
        assert env.delivered("B") == [] and flaky.refused > 0
        st = svc.schedule.states[1]
        assert st.offset == 2 and st.ahead  # B's first entry (a2) holds the offset back
        # the offsets persisted now must not make a crash repeat A's deliveries
        await svc.schedule.persist()
        crashed = tmp_path.parent / (tmp_path.name + "-crashed")
        await _crash_image(env, crashed)
        flaky.failing = False
        await env.run_until(due + 1000)  # the backoff retry
        assert [m.body.decode() for m in env.delivered("B")] == env.order["B"]
        assert all(m.store_timestamp == due + 1000 for m in env.delivered("B"))
        a_all = env.delivered("A")
        assert [m.body.decode() for m in a_all] == env.order["A"]  # none repeated, none lost
        assert all(m.store_timestamp in (due, due + 1000) for m in a_all)
        s = svc.stats()["levels"][0]
        assert s["pending"] == 0 and s["dropped"] == 1 and s["delivered"] == 80
        assert st.offset == 81 and not st.ahead
    finally:
        await svc.shutdown()
        await asyncio.to_thread(store.shutdown)
    # a crash while A's entries were delivered ahead of the offset: none of them is repeated
    env2 = Env(crashed, clock, messageDelayLevel="1s 2s")
    env2.expected, env2.order = env.expected, env.order
    await env2.start()
    try:
        await env2.settle()
        assert [m.body.decode() for m in env2.delivered("A")] == [m.body.decode() for m in a_first]
        await env2.run_until(clock.now_ms() + 1)
        assert [m.body.decode() for m in env2.delivered("A")] == env.order["A"]
        assert [m.body.decode() for m in env2.delivered("B")] == env.order["B"]
    finally:
        await env2.stop()


async def test_offsets_persisted_every_interval(tmp_path: Path, clock: VirtualClock) -> None:
    env = Env(tmp_path, clock, flushDelayOffsetInterval="10000", messageDelayLevel="1s 2s")
    await env.start()
    path = tmp_path / "config" / "delayOffset.json"
    try:
        for i in range(10):
            env.put(f"p{i}", 1 + i % 2)
        await env.run_until(clock.now_ms() + 9_999)
        assert not path.exists()  # the first snapshot is due 10 s after start
        await env.run_until(clock.now_ms() + 1)
        snap = await async_wait_for(lambda: OffsetFile(tmp_path).load(), message="delayOffset.json")
        assert snap.offsets == {1: 5, 2: 5}
        assert snap.scan_from_phy == env.store.max_phy_offset
        # the file is written before the persister sleeps again: moving the clock before that sleep is set
        # would put its next snapshot 10 s after the new time, past the end of this test
        next_due = clock.now_ms() + 10_000
        await async_wait_for(lambda: next_due in clock.pending_deadlines(), message="the next snapshot set")
        for i in range(10, 13):
            env.put(f"p{i}", 1)
        await env.run_until(clock.now_ms() + 10_000)
        await async_wait_for(lambda: OffsetFile(tmp_path).load().offsets == {1: 8, 2: 5},
                             message="the second snapshot")
    finally:
        await env.stop()
    assert OffsetFile(tmp_path).load().offsets == {1: 8, 2: 5}


class ExplodingStore(FlakyStore):
    """get_cq_units raises ``bursts`` times (a store error in the middle of the level loop)."""

    def __init__(self, store: MessageStore, bursts: int) -> None:
        super().__init__(store, "-")
        self.bursts = bursts

    def get_cq_units(self, topic: str, queue_id: int, offset: int, max_count: int):
        if topic == SCHEDULE_TOPIC and offset > 0 and self.bursts > 0:
            self.bursts -= 1
            raise OSError("injected: consume queue read failed")
        return self._store.get_cq_units(topic, queue_id, offset, max_count)


async def test_level_survives_store_errors(tmp_path: Path, clock: VirtualClock) -> None:
    cfg = make_config(tmp_path, messageDelayLevel="1s")
    store = MessageStore(cfg, clock)
    await asyncio.to_thread(store.start)
    boom = ExplodingStore(store, bursts=2)
    svc = DelayService(boom, cfg, clock)
    await svc.start()
    env = Env(tmp_path, clock)
    env.cfg, env.store, env.svc = cfg, store, svc
    try:
        env.put("e0", 1)
        await env.run_until(env.expected["e0"][1])
        for i in range(1, 5):
            env.put(f"e{i}", 1)
        await env.run_until(clock.now_ms() + 5_000)
        assert boom.bursts == 0  # the errors happened ...
        assert [m.body.decode() for m in env.delivered("T1")] == [f"e{i}" for i in range(5)]  # ... and passed
        assert svc.schedule.states[1].state in ("idle", "sleeping")
    finally:
        await svc.shutdown()
        await asyncio.to_thread(store.shutdown)
