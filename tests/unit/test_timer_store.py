"""TimerStore driven by hand on a virtual clock: exact delivery, cancel/reschedule answers, query,
maximum delay, retention, put failures and the memory bound."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from chronomq.clock import VirtualClock
from chronomq.delay.timer import (
    Outcome,
    TimerConfig,
    TimerError,
    TimerRefused,
    TimerStore,
)
from chronomq.message import MessageExt, decode_record, decode_records
from chronomq.store.types import PutResult, PutStatus, records_put_of

DAY = 86_400_000


class FakeStore:
    """Records every put with the virtual time it happened at; can refuse puts on demand."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.puts: list[tuple[str, int, MessageExt]] = []
        self.fail_next = 0
        self.fail_status = PutStatus.SERVICE_NOT_AVAILABLE

    def put_message(self, msg: MessageExt) -> PutResult:
        if self.fail_next > 0:
            self.fail_next -= 1
            return PutResult(self.fail_status, error="refused by the test")
        self.puts.append((msg.properties["UNIQ_KEY"], self.clock.now_ms(), msg))
        return PutResult(PutStatus.PUT_OK)

    def delivered(self) -> dict[str, list[int]]:
        """UNIQ_KEY -> the times it was put, in order (more than one: delivered again)."""
        out: dict[str, list[int]] = {}
        for uid, at, _ in self.puts:
            out.setdefault(uid, []).append(at)
        return out


def small_config(**kw: int) -> TimerConfig:
    cfg = TimerConfig(data_segment_bytes=256 * 1024, index_segment_entries=4096, hash_buckets=4096,
                      hash_generation_entries=20_000, preload_step=512)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def msg(uid: str, topic: str = "T", keys: str | None = None, tags: str | None = None, size: int = 32,
        queue_id: int = 0) -> MessageExt:
    props = {"UNIQ_KEY": uid}
    if keys:
        props["KEYS"] = keys
    if tags:
        props["TAGS"] = tags
    return MessageExt(topic=topic, body=uid.encode().ljust(size, b"."), properties=props, queue_id=queue_id)


def drive(t: TimerStore, clock: VirtualClock, store: FakeStore, until: int | None = None,
          max_steps: int = 10_000_000) -> None:
    """Deliver everything due, jumping the clock to each wake time, up to ``until`` (or the end)."""
    for _ in range(max_steps):
        items, wake = t.poll(clock.now_ms())
        if items:
            for it in items:
                t.deliver(it, store.put_message)
            continue
        if wake is None:
            if until is not None and until > clock.now_ms():
                clock.advance_sync(until - clock.now_ms())
            return
        if until is not None and wake > until:
            clock.advance_sync(until - clock.now_ms())
            return
        if wake > clock.now_ms():
            clock.advance_sync(wake - clock.now_ms())
    raise AssertionError("drive did not finish")


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def fstore(clock: VirtualClock) -> FakeStore:
    return FakeStore(clock)


def open_store(path: Path, clock: VirtualClock, **kw: int) -> TimerStore:
    t = TimerStore(path, clock, small_config(**kw))
    t.open()
    return t


def test_exact_time_and_oldest_first(tmp_path: Path, clock: VirtualClock, fstore: FakeStore) -> None:
    t = open_store(tmp_path, clock)
    rnd = random.Random(7)
    now = clock.now_ms()
    expected = {}
    for i in range(3000):
        # many share a millisecond, many share a slot, a few are in the past
        dm = now + rnd.choice([rnd.randint(0, 40 * DAY), rnd.randint(0, 3000), 1500, rnd.randint(-5000, 0)])
        t.schedule(msg(f"m{i}"), dm)
        expected[f"m{i}"] = dm
    drive(t, clock, fstore)
    got = {u: at for u, at, _ in fstore.puts}
    assert len(fstore.puts) == len(expected) == len(got)
    for u, at in got.items():
        assert at == max(expected[u], now), u
    order = [max(expected[u], now) for u, _, _ in fstore.puts]
    assert order == sorted(order)  # released oldest-due-first
    s = t.stats()
    assert s["pending"] == 0 and s["delivered"] == 3000 and s["early_deliveries"] == 0
    assert s["lateness_ms"] == {"count": 3000, "p50": 0, "p99": 0, "max": 0}  # past-due ones: not late
    t.close()


def test_delivered_copy_is_the_real_message(tmp_path: Path, clock: VirtualClock, fstore: FakeStore) -> None:
    t = open_store(tmp_path, clock)
    m = msg("u1", topic="Orders", keys="k1 k2", tags="TagA", queue_id=3)
    m.properties.update({"TIMER_DELAY_SEC": "5", "user": "v"})
    m.flag = 7
    m.born_timestamp = 123
    r = t.schedule(m, clock.now_ms() + 5000)
    assert r.msg_id == "u1" and len(r.offset_msg_id) == 32
    drive(t, clock, fstore)
    (_, at, out), = fstore.puts
    assert (out.topic, out.queue_id, out.flag, out.born_timestamp) == ("Orders", 3, 7, 123)
    assert out.body == m.body
    assert out.properties["TIMER_DELIVER_MS"] == str(at)
    assert "TIMER_DELAY_SEC" not in out.properties and out.properties["user"] == "v"
    assert out.properties["KEYS"] == "k1 k2" and out.properties["TAGS"] == "TagA"


def test_uniq_key_generated_when_missing(tmp_path: Path, clock: VirtualClock, fstore: FakeStore) -> None:
    t = open_store(tmp_path, clock)
    m = MessageExt(topic="T", body=b"x")
    r = t.schedule(m, clock.now_ms() + 10)
    assert len(r.msg_id) == 32
    assert t.cancel(r.msg_id)[0].outcome is Outcome.CANCELLED


def test_cancel_and_reschedule_answers(tmp_path: Path, clock: VirtualClock, fstore: FakeStore) -> None:
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    t.schedule(msg("a", keys="order-1"), now + 1000)
    rb = t.schedule(msg("b", keys="order-1 x"), now + 2000)
    t.schedule(msg("c"), now + 3000)
    t.schedule(msg("d"), now + 4000)

    (r,) = t.cancel("c")
    assert (r.outcome, r.msg_id, r.deliver_ms, r.topic) == (Outcome.CANCELLED, "c", now + 3000, "T")
    assert t.cancel("c")[0].outcome is Outcome.ALREADY_CANCELLED
    assert t.reschedule("c", now + 10)[0].outcome is Outcome.ALREADY_CANCELLED
    assert t.cancel("nope")[0].outcome is Outcome.UNKNOWN
    assert t.reschedule("nope", now + 5)[0].outcome is Outcome.UNKNOWN
    # by the offset msgId handle
    (r,) = t.reschedule(rb.offset_msg_id, now + 500)
    assert (r.outcome, r.msg_id, r.deliver_ms) == (Outcome.RESCHEDULED, "b", now + 500)
    # reschedule back and forth: only the latest time counts, and only once
    t.reschedule("d", now + 100)
    t.reschedule("d", now + 4000)
    t.reschedule("d", now + 100)
    drive(t, clock, fstore, until=now + 1000)
    assert [(u, at - now) for u, at, _ in fstore.puts] == [("d", 100), ("b", 500), ("a", 1000)]
    (r,) = t.cancel("a")
    assert (r.outcome, r.deliver_ms) == (Outcome.ALREADY_DELIVERED, now + 1000)
    (r,) = t.reschedule("b", now + 9000)
    assert (r.outcome, r.deliver_ms) == (Outcome.ALREADY_DELIVERED, now + 500)
    # by key: every message carrying the key
    res = sorted((x.msg_id, x.outcome) for x in t.cancel("order-1", by_key=True))
    assert res == [("a", Outcome.ALREADY_DELIVERED), ("b", Outcome.ALREADY_DELIVERED)]
    t.schedule(msg("e", keys="grp"), now + 50_000)
    t.schedule(msg("f", keys="grp"), now + 60_000)
    res = sorted((x.msg_id, x.outcome, x.deliver_ms) for x in t.reschedule("grp", now + 20_000, by_key=True))
    assert res == [("e", Outcome.RESCHEDULED, now + 20_000), ("f", Outcome.RESCHEDULED, now + 20_000)]
    assert t.cancel("grp", by_key=False)[0].outcome is Outcome.UNKNOWN  # a key is not an id
    drive(t, clock, fstore)
    assert [(u, at - now) for u, at, _ in fstore.puts][3:] == [("e", 20_000), ("f", 20_000)]
    assert t.stats()["pending"] == 0


def test_maximum_delay(tmp_path: Path, clock: VirtualClock) -> None:
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    t.schedule(msg("ok"), now + 40 * DAY)
    with pytest.raises(TimerRefused, match="maximum delay is 40 days"):
        t.schedule(msg("far"), now + 40 * DAY + 1)
    with pytest.raises(TimerRefused):
        t.reschedule("ok", now + 41 * DAY)
    with pytest.raises(TimerError, match="not a non-negative integer"):
        t.schedule(msg("neg"), -1)
    with pytest.raises(TimerError, match="topic"):
        t.schedule(msg("bad", topic="bad topic!"), now + 5)
    assert t.count() == 1
    t2 = TimerStore(tmp_path / "other", clock, small_config(max_delay_ms=DAY))
    t2.open()
    with pytest.raises(TimerRefused, match="maximum delay is 1 days"):
        t2.schedule(msg("x"), now + DAY + 1)


def test_query_paged_and_filtered(tmp_path: Path, clock: VirtualClock, fstore: FakeStore) -> None:
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    rnd = random.Random(3)
    rows = []
    for i in range(700):
        dm = now + rnd.randint(1, 3 * DAY)
        topic = rnd.choice(["A", "B"])
        tag = rnd.choice(["x", "y", None])
        t.schedule(msg(f"q{i}", topic=topic, tags=tag, keys=f"kk{i % 7}"), dm)
        rows.append((dm, f"q{i}", topic, tag, f"kk{i % 7}"))
    t.cancel("q5")
    t.reschedule("q6", now + 10)
    q6 = (now + 10, "q6", rows[6][2], rows[6][3], rows[6][4])
    rows = [r for r in rows if r[1] not in ("q5", "q6")] + [q6]

    def collect(**kw: object) -> list[tuple[int, str]]:
        out, cursor = [], None
        for _ in range(1000):
            page = t.query(limit=37, cursor=cursor, **kw)  # type: ignore[arg-type]
            assert len(page.items) <= 37
            out += [(p.deliver_ms, p.msg_id) for p in page.items]
            cursor = page.next_cursor
            if cursor is None:
                return out
        raise AssertionError("pages never ended")

    def expect(pred) -> list[tuple[int, str]]:  # type: ignore[no-untyped-def]
        return sorted(((r[0], r[1]) for r in rows if pred(r)), key=lambda x: x[0])

    def same(a: list[tuple[int, str]], b: list[tuple[int, str]]) -> None:
        assert sorted(a) == sorted(b)
        assert [x[0] for x in a] == sorted(x[0] for x in a)

    same(collect(), expect(lambda r: True))
    same(collect(topic="A"), expect(lambda r: r[2] == "A"))
    same(collect(topic="B", tag="x"), expect(lambda r: r[2] == "B" and r[3] == "x"))
    lo, hi = now + DAY, now + 2 * DAY
    same(collect(start_ms=lo, end_ms=hi), expect(lambda r: lo <= r[0] <= hi))
    same(collect(key="kk3"), expect(lambda r: r[4] == "kk3"))
    same(collect(key="q9"), expect(lambda r: r[1] == "q9"))
    assert t.count() == len(rows)
    assert t.count(topic="A") == len(expect(lambda r: r[2] == "A"))
    assert t.count(tag="y") == len(expect(lambda r: r[3] == "y"))
    info = t.query(key="q9").items[0]
    assert (info.topic, info.keys, info.msg_id) == (rows[8][2], ["kk2"], "q9")
    drive(t, clock, fstore, until=now + DAY)
    assert t.count() == len(expect(lambda r: r[0] > now + DAY))
    same(collect(), expect(lambda r: r[0] > now + DAY))
    with pytest.raises(TimerError, match="cursor"):
        t.query(cursor="s:bad")


def test_put_failures_are_retried_and_illegal_ones_fail(tmp_path: Path, clock: VirtualClock,
                                                         fstore: FakeStore) -> None:
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    t.schedule(msg("r1"), now + 100)
    t.schedule(msg("r2"), now + 100)
    fstore.fail_next = 3
    clock.advance_sync(100)
    outcomes = []
    for _ in range(10):
        items, _ = t.poll(clock.now_ms())
        outcomes += [t.deliver(it, fstore.put_message) for it in items]
        if not items:
            break
    assert outcomes.count("retry") == 3 and outcomes.count("delivered") == 2
    assert sorted(u for u, _, _ in fstore.puts) == ["r1", "r2"]
    t.schedule(msg("bad"), now + 200)
    fstore.fail_next, fstore.fail_status = 1, PutStatus.MESSAGE_ILLEGAL
    drive(t, clock, fstore)
    s = t.stats()
    assert s["failed"] == 1 and s["pending"] == 0 and s["put_retries"] == 3
    assert t.cancel("bad")[0].outcome is Outcome.FAILED


def test_due_gauge_and_lateness_per_topic(tmp_path: Path, clock: VirtualClock, fstore: FakeStore) -> None:
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    for i in range(10):
        t.schedule(msg(f"g{i}", topic="A" if i < 6 else "B"), now + 1000)
    clock.advance_sync(1003)
    items, _ = t.poll(clock.now_ms(), max_items=1)  # loads the slot, takes one
    t.deliver(items[0], fstore.put_message)
    assert t.stats()["due_undelivered"] == {"A": 5, "B": 4}
    drive(t, clock, fstore)
    s = t.stats()
    assert s["due_undelivered"] == {}
    assert s["lateness_ms_by_topic"]["A"]["count"] == 6
    assert s["lateness_ms_by_topic"]["B"]["p99"] == 3


@pytest.mark.parametrize("chunk", [4 << 20, 4096, 1000, 97, 64])
def test_retention_scan_reads_records_across_chunk_edges(tmp_path: Path, clock: VirtualClock,
                                                          fstore: FakeStore, chunk: int) -> None:
    """The scan reads a segment in chunks: record headers and bodies straddling a chunk edge (and whole
    chunks inside one body) must give the same answer as one big read."""
    from chronomq.delay.timer.store import _pos_of

    t = open_store(tmp_path, clock, data_segment_bytes=64 * 1024)
    t._retention.scan_chunk = chunk
    now = clock.now_ms()
    sizes = [10, 3000, 1, 700, 9000, 50, 2000]
    latest: dict[int, int] = {}  # segment -> latest deliver time in it
    for i in range(120):
        due = now + 1000 + (i * 37) % 500
        r = t.schedule(msg(f"r{i}", size=sizes[i % len(sizes)]), due)
        seg = t.data.seg_start(_pos_of(r.offset_msg_id))
        latest[seg] = max(latest.get(seg, 0), due)
    late_seg = t.data.seg_start(_pos_of(t.schedule(msg("late", size=5000), now + 7 * DAY).offset_msg_id))
    latest[late_seg] = now + 7 * DAY
    assert len(latest) >= 4
    assert {seg: t._retention.scan_data_segment(seg).max_pending for seg in latest} == latest
    drive(t, clock, fstore, until=now + 2_000)
    t.flush()
    assert {seg: t._retention.scan_data_segment(seg).max_pending for seg in latest} == {
        seg: (now + 7 * DAY if seg == late_seg else None) for seg in latest}


def test_retention_frees_data_and_long_delay_pins_only_its_segment(tmp_path: Path, clock: VirtualClock,
                                                                   fstore: FakeStore) -> None:
    t = open_store(tmp_path, clock, data_segment_bytes=64 * 1024)
    now = clock.now_ms()
    t.schedule(msg("long", size=1000), now + 30 * DAY)  # first record of the first segment
    for i in range(600):
        t.schedule(msg(f"s{i}", size=1000), now + 1000 + i)
    segs_before = len(t.data.starts)
    assert segs_before >= 9
    drive(t, clock, fstore, until=now + 10_000)
    t.flush()
    deleted = t.run_retention()
    assert deleted["data_segments"] == segs_before - 2  # the pinned first one and the active one stay
    assert t.data.starts[0] == 0
    assert t.cancel("s5")[0].outcome is Outcome.ALREADY_DELIVERED  # in the pinned segment
    assert t.cancel("s500")[0].outcome is Outcome.UNKNOWN  # its bytes are gone, and it says so
    drive(t, clock, fstore)
    t.flush()
    t.run_retention()
    assert [u for u, _, _ in fstore.puts][-1] == "long"
    assert t.data.starts == [t.data.seg_start(t.data_end)]
    assert t.wheel.files <= 1


def test_memory_does_not_grow_with_pending(tmp_path: Path, clock: VirtualClock) -> None:
    """The in-memory structures stay the same size whether 1,000 or 20,000 messages are pending."""
    sizes = []
    for n in (1_000, 20_000):
        c = VirtualClock()
        t = TimerStore(tmp_path / str(n), c, small_config(data_segment_bytes=16 << 20,
                                                          hash_generation_entries=1 << 20))
        t.open()
        now = c.now_ms()
        rnd = random.Random(n)
        t.schedule_batch([(msg(f"n{i}", keys=f"k{i}"), now + 10_000 + rnd.randint(0, 7 * DAY))
                          for i in range(n)])
        t.poll(c.now_ms())
        c.advance_sync(DAY)  # a day of deliveries later, the window still holds at most two slots
        fs = FakeStore(c)
        for _ in range(50):
            items, _ = t.poll(c.now_ms())
            for it in items:
                t.deliver(it, fs.put_message)
        fp = t.footprint()
        sizes.append(fp)
        t.close()
    small, big = sizes
    assert big["window_entries"] <= 60  # two one-second slots of a 7-day spread
    for k in ("topics", "pending_counters", "wheel_files", "hash_generations"):
        assert big[k] <= small[k] + 1, (k, small, big)
    assert big["histogram_buckets"] < 1000


def test_write_failure_is_a_clear_error_and_leaves_nothing_pending(tmp_path: Path, clock: VirtualClock,
                                                                   fstore: FakeStore,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    t.schedule(msg("before"), now + 100)

    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(t.index, "write", full)
    with pytest.raises(TimerError, match="No space left"):
        t.schedule_batch([(msg("x1"), now + 50), (msg("x2"), now + 60)])
    monkeypatch.undo()
    assert t.count() == 1
    assert [p.msg_id for p in t.query().items] == ["before"]
    t.schedule(msg("after"), now + 200)
    drive(t, clock, fstore)
    assert [u for u, _, _ in fstore.puts] == ["before", "after"]
    t.flush()
    clock.advance_sync(1000)
    assert t.stats()["pending"] == 0


def test_delivery_marks_survive_a_crash_through_the_done_log(tmp_path: Path, clock: VirtualClock,
                                                             fstore: FakeStore) -> None:
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    for i in range(300):
        t.schedule(msg(f"d{i}"), now + 10 + i)
    t.flush()
    drive(t, clock, fstore, until=now + 200)  # ~190 delivered, marks only in memory and done logs
    delivered = {u for u, _, _ in fstore.puts}
    assert t.footprint()["unapplied_marks"] == len(delivered) > 100
    assert t.cancel("d5")[0].outcome is Outcome.ALREADY_DELIVERED  # the overlay answers
    t.abandon()  # crash: the records themselves still say PENDING
    t = open_store(tmp_path, clock)
    assert t.cancel("d5")[0].outcome is Outcome.ALREADY_DELIVERED
    drive(t, clock, fstore)
    uids = [u for u, _, _ in fstore.puts]
    assert len(uids) == len(set(uids)) == 300  # nothing delivered twice
    assert t.count() == 0
    t.flush()  # marks written into the records, logs emptied
    assert t.footprint()["unapplied_marks"] == 0
    assert all((tmp_path / f"done.{k}.log").stat().st_size == 0 for k in (0, 1))
    t.close()
    t = open_store(tmp_path, clock)
    assert t.cancel("d299")[0].outcome is Outcome.ALREADY_DELIVERED


def test_uniq_key_shaped_like_a_handle_and_foreign_handles(tmp_path: Path, clock: VirtualClock) -> None:
    """A UNIQ_KEY has the 32-hex shape of a handle: one whose "offset" has bit 62 set must still be found
    by the key index; a handle naming another broker's host is not read as a position in this store."""
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    uid = "7F000001ABCD12344000000000000123"  # bits 63..62 of the offset part = 01
    t.schedule(msg(uid), now + 1000)
    mine = t.schedule(msg("plain"), now + 2000)
    foreign = "0A0000010000270F" + mine.offset_msg_id[16:]  # same position, host 10.0.0.1:9999
    assert t.cancel(foreign)[0].outcome is Outcome.UNKNOWN
    (r,) = t.cancel(uid)
    assert (r.outcome, r.msg_id) == (Outcome.CANCELLED, uid)
    assert t.cancel(mine.offset_msg_id)[0].outcome is Outcome.CANCELLED


def test_near_due_schedules_are_handed_out_at_their_time(tmp_path: Path, clock: VirtualClock,
                                                          fstore: FakeStore) -> None:
    """Head-of-line shape: a long delay holds the window, then messages due 1 s after they are sent,
    every 37 ms: they land in the slot being delivered, the next one and beyond the preloaded one, and
    each must come out at its own time, not a slot, a promotion or a preload step later."""
    t = open_store(tmp_path, clock)
    start = clock.now_ms()
    t.schedule(msg("long"), start + 60_000)
    drive(t, clock, fstore, until=start + 1)  # the long one's slot is preloaded
    due: dict[str, int] = {}
    for k in range(80):
        now = clock.now_ms()
        t.schedule(msg(f"s{k}"), now + 1000)
        due[f"s{k}"] = now + 1000
        drive(t, clock, fstore, until=now + 37)
    drive(t, clock, fstore, until=start + 61_000)
    got = {u: at for u, at, _ in fstore.puts}
    assert {u: got.get(u) for u in due} == due
    assert got["long"] == start + 60_000 and len(fstore.puts) == 81


class BatchStore(FakeStore):
    """FakeStore plus put_messages (one topic and queue per call), which can refuse on demand."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(clock)
        self.batches: list[list[str]] = []
        self.fail_batches = 0
        self.batch_status = PutStatus.SERVICE_NOT_AVAILABLE

    def put_messages(self, msgs: list[MessageExt]) -> PutResult:
        assert len({(m.topic, m.queue_id) for m in msgs}) == 1
        if self.fail_batches > 0:
            self.fail_batches -= 1
            return PutResult(self.batch_status, error="refused by the test")
        self.batches.append([m.properties["UNIQ_KEY"] for m in msgs])
        for m in msgs:
            self.puts.append((m.properties["UNIQ_KEY"], self.clock.now_ms(), m))
        return PutResult(PutStatus.PUT_OK)


def _deliver_all(t: TimerStore, clock: VirtualClock, store: BatchStore) -> list[str]:
    items, _ = t.poll(clock.now_ms())
    return t.deliver_many(items, store.put_message, store.put_messages, put_raw=records_put_of(store))


def test_batch_delivery_groups_by_real_queue_in_deliver_order(tmp_path: Path, clock: VirtualClock) -> None:
    bs = BatchStore(clock)
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    for i in range(12):
        t.schedule(msg(f"b{i:02d}", topic="A" if i % 3 else "B", queue_id=i % 2), now + 500 + i // 4)
    clock.advance_sync(600)
    assert _deliver_all(t, clock, bs) == ["delivered"] * 12
    assert sorted(bs.batches) == sorted([[f"b{i:02d}" for i in range(12) if (i % 3 != 0, i % 2) == key]
                                         for key in ((True, 0), (True, 1), (False, 0), (False, 1))])
    for _u, _at, m in bs.puts:
        assert m.properties["TIMER_DELIVER_MS"] in {str(now + 500 + k) for k in range(3)}
    s = t.stats()
    assert s["pending"] == 0 and s["delivered"] == 12 and s["lateness_ms"]["count"] == 12
    assert t.cancel("b05")[0].outcome is Outcome.ALREADY_DELIVERED


def test_batch_transient_failure_keeps_every_untried_item_pending(tmp_path: Path,
                                                                  clock: VirtualClock) -> None:
    bs = BatchStore(clock)
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    for i in range(8):
        t.schedule(msg(f"f{i}", topic="A" if i < 4 else "B"), now + 100)
    clock.advance_sync(100)
    bs.fail_batches = 1  # the first group is refused: neither it nor the second group is stored
    assert _deliver_all(t, clock, bs) == ["retry"] * 8
    assert bs.puts == [] and t.count() == 8 and t.stats()["put_retries"] == 4
    assert t.cancel("f6")[0].outcome is Outcome.CANCELLED  # still pending, not marked delivered
    clock.advance_sync(100)
    out = _deliver_all(t, clock, bs)
    assert out.count("delivered") == 7 and out.count("skipped") == 1
    assert sorted(u for u, _, _ in bs.puts) == [f"f{i}" for i in range(8) if i != 6]
    assert t.count() == 0 and _deliver_all(t, clock, bs) == []


def _four_due(tmp_path: Path, clock: VirtualClock, prefix: str) -> TimerStore:
    """A timer store holding four messages (uids ``<prefix>0..3``) that have just fallen due."""
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    for i in range(4):
        t.schedule(msg(f"{prefix}{i}"), now + 100)
    clock.advance_sync(100)
    return t


def test_batch_refused_for_good_is_isolated_message_by_message(tmp_path: Path, clock: VirtualClock) -> None:
    bs = BatchStore(clock)
    t = _four_due(tmp_path, clock, "i")
    bs.fail_batches, bs.batch_status = 1, PutStatus.MESSAGE_ILLEGAL
    bs.fail_next, bs.fail_status = 1, PutStatus.MESSAGE_ILLEGAL  # the first single put: the bad one
    assert _deliver_all(t, clock, bs) == ["failed", "delivered", "delivered", "delivered"]
    assert [u for u, _, _ in bs.puts] == ["i1", "i2", "i3"]
    assert t.cancel("i0")[0].outcome is Outcome.FAILED and t.count() == 0


def test_batch_into_a_store_without_put_messages_puts_every_message(tmp_path: Path,
                                                                     clock: VirtualClock) -> None:
    fs = FakeStore(clock)
    t = _four_due(tmp_path, clock, "o")
    items, _ = t.poll(clock.now_ms())
    assert t.deliver_many(items, fs.put_message) == ["delivered"] * 4  # one real queue, one at a time
    assert [u for u, _, _ in fs.puts] == ["o0", "o1", "o2", "o3"] and t.count() == 0


def test_a_put_that_raises_keeps_the_batch_pending(tmp_path: Path, clock: VirtualClock) -> None:
    t = _four_due(tmp_path, clock, "x")

    def boom(_msgs: list[MessageExt]) -> PutResult:
        raise RuntimeError("injected")

    items, _ = t.poll(clock.now_ms())
    assert t.deliver_many(items, FakeStore(clock).put_message, boom) == ["retry"] * 4
    assert t.count() == 4 and t.stats()["put_retries"] == 4


class RecordStore(BatchStore):
    """BatchStore plus put_records (the parked bytes and the properties of the copy); the copies are
    decoded from the bytes, so a test sees what the store would keep."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(clock)
        self.record_batches: list[list[str]] = []

    def put_records(self, topic: str, queue_id: int, records: list) -> PutResult:
        if self.fail_batches > 0:
            self.fail_batches -= 1
            return PutResult(self.batch_status, error="refused by the test")
        if self.fail_next > 0 and len(records) == 1:
            self.fail_next -= 1
            return PutResult(self.fail_status, error="refused by the test")
        msgs = []
        for buf, pos, size, props in records:
            m = decode_record(buf[pos:pos + size])
            m.topic, m.queue_id, m.properties = topic, queue_id, dict(props)
            msgs.append(m)
        self.record_batches.append([m.properties["UNIQ_KEY"] for m in msgs])
        for m in msgs:
            self.puts.append((m.properties["UNIQ_KEY"], self.clock.now_ms(), m))
        return PutResult(PutStatus.PUT_OK)


def test_batch_delivery_uses_put_records_when_the_store_has_it(tmp_path: Path, clock: VirtualClock) -> None:
    rs = RecordStore(clock)
    t = open_store(tmp_path, clock)
    now = clock.now_ms()
    for i in range(6):
        m = msg(f"r{i}", topic="A" if i % 2 else "B", keys="k", tags="tg", queue_id=i % 2)
        m.properties.update({"DELAY": "3", "TIMER_DELAY_SEC": "9", "user": "v"})
        t.schedule(m, now + 200 + i)
    clock.advance_sync(300)
    assert _deliver_all(t, clock, rs) == ["delivered"] * 6
    assert rs.batches == [] and sorted(rs.record_batches) == [["r0", "r2", "r4"], ["r1", "r3", "r5"]]
    by_uid = {u: m for u, _, m in rs.puts}
    for i in range(6):
        m = by_uid[f"r{i}"]
        assert (m.topic, m.queue_id) == ("A" if i % 2 else "B", i % 2)
        assert m.body == f"r{i}".encode().ljust(32, b".")
        assert m.properties == {"UNIQ_KEY": f"r{i}", "KEYS": "k", "TAGS": "tg", "user": "v",
                                "TIMER_DELIVER_MS": str(now + 200 + i)}
    assert t.stats()["delivered"] == 6 and t.count() == 0
    # without put_many (single deliver) the message path is used
    t.schedule(msg("single"), clock.now_ms() + 10)
    clock.advance_sync(10)
    items, _ = t.poll(clock.now_ms())
    assert [t.deliver(it, rs.put_message) for it in items] == ["delivered"]
    assert len(rs.record_batches) == 2 and rs.puts[-1][0] == "single"


def test_put_records_failures_isolate_and_keep_pending(tmp_path: Path, clock: VirtualClock) -> None:
    rs = RecordStore(clock)
    t = _four_due(tmp_path, clock, "p")
    rs.fail_batches = 1  # transient: nothing stored, everything stays pending
    assert _deliver_all(t, clock, rs) == ["retry"] * 4 and t.count() == 4
    clock.advance_sync(100)
    rs.fail_batches, rs.batch_status = 1, PutStatus.MESSAGE_ILLEGAL
    rs.fail_next, rs.fail_status = 1, PutStatus.MESSAGE_ILLEGAL  # the first single re-put: the bad one
    assert _deliver_all(t, clock, rs) == ["failed", "delivered", "delivered", "delivered"]
    assert rs.record_batches == [["p1"], ["p2"], ["p3"]] and t.count() == 0
    assert t.cancel("p0")[0].outcome is Outcome.FAILED


def test_put_records_and_put_messages_store_the_same_bytes(tmp_path: Path, clock: VirtualClock) -> None:
    """The same due batch delivered into two real stores, once as decoded messages through
    put_messages and once through put_records: identical commit logs."""
    from chronomq.config import BrokerConfig
    from chronomq.store import MessageStore

    stores = []
    for name in ("messages", "records"):
        s = MessageStore(BrokerConfig(storePathRootDir=str(tmp_path / name), mappedFileSizeCommitLog=1 << 20),
                         clock, ("10.0.0.9", 10911))
        s.start()
        stores.append(s)
    try:
        timers = [open_store(tmp_path / f"timer-{k}", clock) for k in range(2)]
        now = clock.now_ms()
        for i in range(40):
            m = msg(f"e{i}", topic=f"T{i % 3}", keys=f"a{i} b", tags="x" if i % 2 else None, size=i * 7,
                    queue_id=i % 2)
            m.properties["DELAY"] = "2"
            m.flag, m.sys_flag, m.born_timestamp, m.reconsume_times = i, i % 2, now - i, i % 4
            m.born_host = (f"192.168.7.{i}", 1000 + i)
            fields = ("topic", "body", "flag", "queue_id", "sys_flag", "born_timestamp", "born_host",
                      "reconsume_times")
            for t in timers:
                copy = MessageExt(**{f: getattr(m, f) for f in fields}, properties=dict(m.properties))
                t.schedule(copy, now + 50 + i % 5)
        clock.advance_sync(100)
        s_msg, s_rec = stores
        t_msg, t_rec = timers
        items, _ = t_msg.poll(clock.now_ms())
        assert t_msg.deliver_many(items, s_msg.put_message, lambda ms: s_msg.put_messages(ms)) == [
            "delivered"] * 40
        items, _ = t_rec.poll(clock.now_ms())
        assert t_rec.deliver_many(items, s_rec.put_message, s_rec.put_messages,
                                  put_raw=records_put_of(s_rec)) == ["delivered"] * 40
        assert s_msg.max_phy_offset == s_rec.max_phy_offset > 0
        a = s_msg._cl.read(0, s_msg.max_phy_offset)
        b = s_rec._cl.read(0, s_rec.max_phy_offset)
        assert a == b and len(decode_records(a)) == 40
        for t in timers:
            t.close()
    finally:
        for s in stores:
            s.shutdown()


RETENTION_SCAN_PEAK = """
import sys, tracemalloc
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_timer_store import VirtualClock, msg, open_store
clock = VirtualClock()
t = open_store(Path(sys.argv[1]), clock, data_segment_bytes=1 << 20)
t._retention.scan_chunk = 256 * 1024
now = clock.now_ms()
for i in range(900):
    t.schedule(msg(f"b{i}", size=1500), now + 1000 + i)
first = t.data.starts[0]
assert t._retention.scan_data_segment(first).max_pending is not None  # the buffer is made here
tracemalloc.start()
for _ in range(3):
    assert t._retention.scan_data_segment(first).max_pending is not None
print(tracemalloc.get_traced_memory()[1])
"""


def test_retention_scans_reuse_one_buffer(tmp_path: Path) -> None:
    """A scan allocates no buffer of a chunk's size once the store has its own: fresh multi-MiB buffers
    in worker threads stayed in glibc's per-thread arenas, and the heap grew at every segment scanned.
    Measured in a fresh interpreter: tracemalloc's peak counts every thread of the process, and threads
    that earlier tests left running here (a shared client loop, a session's broker) allocate too."""
    import subprocess
    import sys

    here = str(Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", RETENTION_SCAN_PEAK, str(tmp_path), here],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    peak = int(out.stdout.split()[-1])
    assert peak < 64 * 1024, peak
