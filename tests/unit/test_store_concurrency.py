"""Thread safety: writers (single and batch puts), pullers and an aggressive cleaner at the same time.
Every record a reader gets is whole and CRC-valid, in queue order, and the final state is consistent."""

from __future__ import annotations

import threading

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import MessageExt, decode_record
from chronomq.store import GetStatus, MessageStore


def test_puts_pulls_and_clean_concurrently(tmp_path):
    clock = VirtualClock()
    cfg = BrokerConfig(storePathRootDir=str(tmp_path), mappedFileSizeCommitLog=32 * 1024,
                       mappedFileSizeConsumeQueue=20 * 64, maxHashSlotNum=64, maxIndexNum=256,
                       diskSpaceWarningLevelRatio=100)  # a nearly full disk that still takes writes
    s = MessageStore(cfg, clock)
    s.start()
    s.disk_usage_ratio = lambda: 0.99  # the cleaner deletes every segment but the current one
    errors: list[BaseException] = []
    done = threading.Event()
    cleaned = threading.Event()  # a pass deleted a segment (the writers wait for one halfway)
    per_writer = 300

    def writer(k: int) -> None:
        try:
            for i in range(per_writer):
                if i == per_writer // 2:  # the cleaner has run beside the puts before they go on
                    assert cleaned.wait(60), "the cleaner never ran"
                body = f"{k}:{i}".encode() * 20
                if i % 10 == 0:
                    r = s.put_messages([MessageExt(topic="Conc", body=body, queue_id=k % 2)])
                else:
                    r = s.put_message(MessageExt(topic="Conc", body=body, queue_id=k % 2,
                                                 properties={"KEYS": f"w{k}"}))
                assert r.ok, r.error
        except BaseException as e:
            errors.append(e)

    def reader(q: int) -> None:
        off = 0
        last_seen: dict[int, int] = {}
        try:
            for _ in range(20_000):  # bounded
                g = s.get_message("Conc", q, off, 16)
                if g.status is GetStatus.FOUND:
                    for raw in g.messages:
                        m = decode_record(raw, check_crc=True)
                        unit = m.body[: len(m.body) // 20]
                        assert m.body == unit * 20  # whole, not mixed with another record
                        k, i = map(int, unit.split(b":"))
                        assert m.queue_id == q == k % 2 and m.topic == "Conc"
                        assert m.queue_offset >= off
                        assert i > last_seen.get(k, -1)  # each writer's messages in its order
                        last_seen[k] = i
                    off = g.next_begin_offset
                elif g.status in (GetStatus.OFFSET_TOO_SMALL, GetStatus.NO_MATCHED_MESSAGE,
                                  GetStatus.MESSAGE_WAS_REMOVING, GetStatus.OFFSET_FOUND_NULL):
                    off = max(off, g.next_begin_offset)
                elif done.is_set() and g.status is GetStatus.OFFSET_OVERFLOW_ONE:
                    return
        except BaseException as e:
            errors.append(e)

    def cleaner() -> None:
        try:
            while not done.is_set():
                s.run_clean_once()
                s.query_message("Conc", "w1", 10, 0, 2**62)
                list(s.iter_messages(s.min_phy_offset))
                if s.min_phy_offset > 0:
                    cleaned.set()
        except BaseException as e:
            errors.append(e)

    writers = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    others = [threading.Thread(target=reader, args=(q,)) for q in range(2)]
    others.append(threading.Thread(target=cleaner))
    for t in writers + others:
        t.start()
    for t in writers:
        t.join(60)
    assert s.wait_dispatched(s.max_phy_offset, 10)
    done.set()
    for t in others:
        t.join(60)
    try:
        assert not errors, errors
        assert s.min_phy_offset > 0  # the cleaner really ran
        total = sum(s.get_max_offset_in_queue("Conc", q) for q in range(2))
        assert total == 4 * per_writer
        for q in range(2):
            lo = s.get_min_offset_in_queue("Conc", q)
            units = s.get_cq_units("Conc", q, lo, 10_000)
            assert [u.queue_offset for u in units] == list(range(lo, s.get_max_offset_in_queue("Conc", q)))
            for u in units:
                m = s.look_message_by_offset(u.commit_log_offset)
                assert m is not None, (u, s.min_phy_offset)  # no queue entry points into a deleted segment
                assert m.queue_offset == u.queue_offset and m.queue_id == q
    finally:
        s.shutdown()
