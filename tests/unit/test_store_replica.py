"""Commit-log replication at the store level: a slave store fed the master's bytes in chunks of any size
holds the same log, queues and index; a chunk may end inside a record; wrong offsets and corrupt bytes
are refused; a slave restarted after a torn chunk resumes from its last whole record."""

from __future__ import annotations

import random

import pytest

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import SCHEDULE_TOPIC, MessageExt
from chronomq.store import MessageStore, PutStatus
from chronomq.store.replica import ReplicaError

SEG = 16 * 1024


def config(root, **kw) -> BrokerConfig:
    base = dict(storePathRootDir=str(root), mappedFileSizeCommitLog=SEG, mappedFileSizeConsumeQueue=20 * 32,
                maxHashSlotNum=64, maxIndexNum=256, messageDelayLevel="1s 5s 10s")
    base.update(kw)
    return BrokerConfig(**base)


def open_store(root, clock) -> MessageStore:
    s = MessageStore(config(root), clock, ("10.0.0.7", 10911))
    s.start()
    return s



class Stores:
    """The stores a test opens, on one virtual clock; every one still running is shut down after it."""

    def __init__(self, root) -> None:
        self.root, self.clock, self.opened = root, VirtualClock(), []

    def open(self, name: str) -> MessageStore:
        s = open_store(self.root / name, self.clock)
        self.opened.append(s)
        return s


@pytest.fixture
def stores(tmp_path):
    st = Stores(tmp_path)
    yield st
    for s in st.opened:
        if s._running:
            s.shutdown()

def fill(store: MessageStore, rng: random.Random, n: int) -> None:
    for i in range(n):
        topic = SCHEDULE_TOPIC if i % 9 == 0 else f"T{i % 3}"
        props = {"KEYS": f"k{i}", "UNIQ_KEY": f"U{i:06d}", "TAGS": f"tag{i % 4}"}
        if topic == SCHEDULE_TOPIC:
            props.update(DELAY="2", REAL_TOPIC="T0", REAL_QID="0")
        m = MessageExt(topic=topic, body=rng.randbytes(rng.randint(1, 1500)), queue_id=i % 2,
                       properties=props, born_timestamp=1, born_host=("10.0.0.1", 1))
        assert store.put_message(m).status is PutStatus.PUT_OK


def stream(master: MessageStore, slave: MessageStore, rng: random.Random, upto: int | None = None) -> None:
    end = master.max_phy_offset if upto is None else upto
    while slave.max_phy_offset < end:
        off = slave.max_phy_offset
        chunk = master.replication_chunk(off, min(rng.choice([1, 7, 100, 4096, 32 * 1024]), end - off))
        assert chunk, off
        assert slave.append_replicated(off, chunk) == off + len(chunk)


def log_bytes(store: MessageStore) -> bytes:
    cl = store._cl
    return b"".join(bytes(s.mm[: min(s.file_size, cl.wrote - s.start)]) for s in cl.segments)


def queues(store: MessageStore) -> dict:
    out = {}
    for topic in ("T0", "T1", "T2", SCHEDULE_TOPIC):
        for qid in range(2):
            units = store.get_cq_units(topic, qid, 0, 1000)
            out[(topic, qid)] = [(u.commit_log_offset, u.size, u.tags_code) for u in units]
    return out


def test_a_slave_fed_chunks_of_any_size_holds_the_same_log_queues_and_index(stores):
    rng = random.Random(5)
    master, slave = stores.open("m"), stores.open("s")
    fill(master, rng, 120)  # several 16 KiB segments: blank fillers cross over too
    assert len(master._cl.segments) >= 4
    stream(master, slave, rng)
    assert slave.max_phy_offset == master.max_phy_offset
    assert log_bytes(slave) == log_bytes(master)
    master.wait_dispatched(master.max_phy_offset, 5)
    slave.wait_dispatched(slave.max_phy_offset, 5)
    assert queues(slave) == queues(master)
    assert [m.body for m in slave.query_message("T1", "k7", 5, 0, 2**62)] == \
        [m.body for m in master.query_message("T1", "k7", 5, 0, 2**62)]
    assert master.replication_chunk(master.max_phy_offset, 100) == b""


def test_wrong_offsets_and_corrupt_bytes_are_refused(stores):
    rng = random.Random(6)
    master, slave = stores.open("m"), stores.open("s")
    fill(master, rng, 5)
    with pytest.raises(ReplicaError, match="write position"):
        slave.append_replicated(10, b"x")
    with pytest.raises(ReplicaError, match="ahead"):
        master.replication_chunk(master.max_phy_offset + 1, 10)
    first = master.replication_chunk(0, 10_000)
    bad = bytearray(first)
    bad[200] ^= 0xFF  # inside the first record's body: its CRC no longer matches
    with pytest.raises(ReplicaError, match="corrupt"):
        slave.append_replicated(0, bytes(bad))


def test_a_slave_restarted_after_a_torn_chunk_resumes_from_its_last_whole_record(stores):
    rng = random.Random(7)
    master, slave = stores.open("m"), stores.open("s")
    fill(master, rng, 40)
    master.wait_dispatched(master.max_phy_offset, 5)
    record = master.get_cq_units("T1", 0, 3, 1)[0]
    torn = record.commit_log_offset + record.size // 2
    stream(master, slave, rng, upto=torn)  # ends inside a record
    whole = slave._replica.parsed
    assert whole == record.commit_log_offset
    slave._halt()  # a kill: no clean shutdown
    slave = stores.open("s")
    assert slave.max_phy_offset == whole
    stream(master, slave, rng)
    assert log_bytes(slave) == log_bytes(master)
    slave.wait_dispatched(slave.max_phy_offset, 5)
    master.wait_dispatched(master.max_phy_offset, 5)
    assert queues(slave) == queues(master)


@pytest.mark.parametrize("where", ["inside a segment", "at the start of a new segment"])
def test_ending_replication_drops_a_torn_record_and_puts_follow_the_last_whole_one(stores, where):
    rng = random.Random(11)
    master, slave = stores.open("m"), stores.open("s")
    fill(master, rng, 60)  # several 16 KiB segments
    master.wait_dispatched(master.max_phy_offset, 5)
    starts = [s.start for s in master._cl.segments[1:]]
    units = [u for t in ("T0", "T1", "T2") for q in range(2) for u in master.get_cq_units(t, q, 0, 1000)]
    if where == "inside a segment":
        record = next(u for u in units if u.commit_log_offset % SEG > 200)
    else:
        record = next(u for u in units if u.commit_log_offset in starts)
    stream(master, slave, rng, upto=record.commit_log_offset + 5)  # 5 bytes of the next record
    assert slave.end_replication() == 5
    assert slave.max_phy_offset == record.commit_log_offset
    assert slave.end_replication() == 0  # once is enough
    m = MessageExt(topic="T9", body=b"after the promotion", queue_id=0, properties={"UNIQ_KEY": "P1"},
                   born_timestamp=1, born_host=("10.0.0.1", 1))
    put = slave.put_message(m)
    assert put.status is PutStatus.PUT_OK and put.append.wrote_offset == record.commit_log_offset
    slave.wait_dispatched(slave.max_phy_offset, 5)
    assert slave.get_message("T9", 0, 0, 1).messages
    slave.shutdown()
    slave = stores.open("s")  # the log recovers whole, with the new record last
    assert slave.max_phy_offset == record.commit_log_offset + put.append.wrote_bytes
    assert slave.look_message_by_offset(record.commit_log_offset).body == b"after the promotion"


def test_an_empty_slave_may_start_only_at_a_segment_boundary(stores):
    rng = random.Random(3)
    master, slave = stores.open("m"), stores.open("s")
    fill(master, rng, 40)
    start = master._cl.segments[1].start  # as if the first segment had been cleaned
    with pytest.raises(ReplicaError):
        slave.append_replicated(start + 1, master.replication_chunk(start + 1, 100))
    assert slave.max_phy_offset == 0
    off = start
    while off < master.max_phy_offset:
        chunk = master.replication_chunk(off, 3000)
        off = slave.append_replicated(off, chunk)
    assert slave.min_phy_offset == start and slave.max_phy_offset == master.max_phy_offset
    assert log_bytes(slave) == log_bytes(master)[start:]
    with pytest.raises(ReplicaError):  # no longer empty: only its own end is accepted
        slave.append_replicated(start, master.replication_chunk(start, 100))
