"""Crash recovery: truncate or corrupt commit-log segment files at random byte positions after an
unclean stop; the restarted store must hold exactly the intact prefix of the log, every record readable
and CRC-valid, consume queues and index consistent with it, and keep working."""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import wait_for

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import decode_record
from chronomq.store import MessageStore
from chronomq.store.checkpoint import Checkpoint

SEG = 8 * 1024
HYP = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def cfg_for(root: str, **kw) -> BrokerConfig:
    base = dict(storePathRootDir=root, mappedFileSizeCommitLog=SEG, mappedFileSizeConsumeQueue=20 * 16,
                maxHashSlotNum=32, maxIndexNum=64)
    base.update(kw)
    return BrokerConfig(**base)


def fill(store: MessageStore, rng: random.Random, n: int) -> list[tuple[int, int, int, bytes, bytes]]:
    """Put n messages of random sizes over 3 queues; returns (phys, end, (topic, queue), body, record)."""
    from chronomq.message import MessageExt

    out = []
    for i in range(n):
        body = rng.randbytes(rng.randint(0, 900))
        q = rng.randrange(3)
        r = store.put_message(MessageExt(topic="Crash", body=body, queue_id=q,
                                         properties={"KEYS": f"k{i}", "UNIQ_KEY": f"U{i:06d}"}))
        assert r.ok
        a = r.append
        out.append((a.wrote_offset, a.wrote_offset + a.wrote_bytes, ("Crash", q), body, None))
    assert store.wait_dispatched(store.max_phy_offset, 10)
    return [(p, e, q, b, store.read_record(p)) for p, e, q, b, _ in out]


def check_store(store: MessageStore, expected: list[tuple[int, int, int, bytes, bytes]]) -> None:
    """The store holds exactly ``expected`` (in order), readable, CRC-valid, with consistent queues."""
    got = list(store.iter_messages(0))
    assert [(m.commit_log_offset, m.body) for m in got] == [(p, b) for p, _, _, b, _ in expected]
    for m in got:
        decode_record(store.read_record(m.commit_log_offset), check_crc=True)
    if expected:  # nothing but (at most) a blank segment filler after the last record
        assert expected[-1][1] <= store.max_phy_offset
        assert store.max_phy_offset == expected[-1][1] or store.max_phy_offset % SEG == 0
    for topic, q in {("Crash", 0), ("Crash", 1), ("Crash", 2)} | {e[2] for e in expected}:
        mine = [e for e in expected if e[2] == (topic, q)]
        # a queue starts at 0, except one invented by an undetectable queue-id bit flip (see below)
        lo = store.get_min_offset_in_queue(topic, q)
        assert lo == 0 or topic != "Crash" or q not in (0, 1, 2)
        assert store.get_max_offset_in_queue(topic, q) - lo == len(mine)
        units = store.get_cq_units(topic, q, 0, 10_000)
        assert [(u.queue_offset, u.commit_log_offset) for u in units] == [(lo + i, e[0]) for i, e in
                                                                          enumerate(mine)]
        g = store.get_message(topic, q, lo, 10_000, max_bytes=1 << 30)
        recs = [decode_record(b, check_crc=True) for b in g.messages]
        assert [(r.queue_offset, r.body) for r in recs] == [(lo + i, e[3]) for i, e in enumerate(mine)]


def restart(root: str, clock) -> MessageStore:
    s = MessageStore(cfg_for(root), clock)
    s.start()
    return s


def survivors_after_truncate(store_segs: list[int], msgs, seg_start: int, cut: int):
    """Records wholly before the cut survive; if the cut lies after the segment's last record, the blank
    filler's 8-byte header decides whether the following segments are still reachable."""
    t = seg_start + cut
    in_seg = [m for m in msgs if seg_start <= m[0] < seg_start + SEG]
    if in_seg and t < in_seg[-1][1]:
        return [m for m in msgs if m[1] <= t]
    last_end = in_seg[-1][1] if in_seg else seg_start
    has_next = any(m[0] >= seg_start + SEG for m in msgs)
    if has_next and t < last_end + 8:
        return [m for m in msgs if m[1] <= last_end]
    return list(msgs)


@HYP
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60))
def test_truncate_a_segment_at_a_random_byte(tmp_path_factory, seed, n):
    root = str(tmp_path_factory.mktemp("trunc"))
    rng = random.Random(seed)
    clock = VirtualClock()
    s = restart(root, clock)
    msgs = fill(s, rng, n)
    s._halt()
    cl_dir = os.path.join(root, "commitlog")
    names = sorted(os.listdir(cl_dir))
    name = rng.choice(names)
    seg_start = int(name)
    cut = rng.randrange(0, SEG)
    with open(os.path.join(cl_dir, name), "r+b") as f:
        f.truncate(cut)
    expected = survivors_after_truncate([int(x) for x in names], msgs, seg_start, cut)
    s2 = restart(root, clock)
    try:
        assert s2.recovered_abnormally
        check_store(s2, expected)
        for i in range(len(msgs)):
            hits = s2.query_message("Crash", f"U{i:06d}", 5, 0, 2**62)
            assert len(hits) == (1 if i < len(expected) else 0)
        more = fill(s2, rng, 5)  # the store keeps working after the cut
        check_store(s2, expected + more)
    finally:
        s2.shutdown()
    s3 = restart(root, clock)
    try:
        assert not s3.recovered_abnormally
        check_store(s3, expected + more)
    finally:
        s3.shutdown()


@HYP
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60))
def test_corrupt_a_random_byte(tmp_path_factory, seed, n):
    root = str(tmp_path_factory.mktemp("corrupt"))
    rng = random.Random(seed)
    clock = VirtualClock()
    s = restart(root, clock)
    msgs = fill(s, rng, n)
    s._halt()
    # flip one byte somewhere in the written part of the log
    pos = rng.randrange(0, msgs[-1][1])
    name = f"{pos // SEG * SEG:020d}"
    path = os.path.join(root, "commitlog", name)
    with open(path, "r+b") as f:
        f.seek(pos % SEG)
        old = f.read(1)[0]
        f.seek(pos % SEG)
        f.write(bytes([old ^ (1 << rng.randrange(8))]))
    hit = next((i for i, m in enumerate(msgs) if m[0] <= pos < m[1]), None)
    s2 = restart(root, clock)
    try:
        got = list(s2.iter_messages(0))
        k = len(got)
        # a prefix of the log survives: everything before the damaged record, byte for byte
        first_lost = hit if hit is not None else next(i for i, m in enumerate(msgs) if m[0] > pos)
        assert k >= first_lost
        for i, m in enumerate(got):
            assert m.commit_log_offset == msgs[i][0] and m.body == msgs[i][3]
            raw = s2.read_record(m.commit_log_offset)
            decode_record(raw, check_crc=True)
            if i != hit:
                assert raw == msgs[i][4]
        expected = list(msgs[:k])
        if hit is not None and hit < k:  # the damaged record survived: its CRC-covered body is intact,
            m = got[hit]  # a flipped header bit (flag, born time, queue id...) is not detectable
            expected[hit] = (m.commit_log_offset, m.commit_log_offset + m.store_size, (m.topic, m.queue_id),
                             m.body, None)
        check_store(s2, expected)
        more = fill(s2, rng, 3)
        check_store(s2, expected + more)
    finally:
        s2.shutdown()


def test_zero_length_tail_and_missing_segment(tmp_path):
    root = str(tmp_path)
    rng = random.Random(7)
    clock = VirtualClock()
    s = restart(root, clock)
    msgs = fill(s, rng, 80)
    s._halt()
    names = sorted(os.listdir(os.path.join(root, "commitlog")))
    assert len(names) >= 4
    os.unlink(os.path.join(root, "commitlog", names[2]))  # a lost middle segment cuts the log there
    s2 = restart(root, clock)
    try:
        check_store(s2, [m for m in msgs if m[1] <= int(names[2])])
    finally:
        s2.shutdown()



def wait_for_checkpoint(s: MessageStore, clock: VirtualClock, root: str, recover_from: int) -> None:
    """Drive the virtual clock until the flush threads have written a checkpoint whose recover-from
    offset is ``recover_from``. The dispatcher, the commit-log flush and the queue flush run in their
    own threads in any order, so one clock step may checkpoint less than everything; keep stepping."""
    s.wait_dispatched(recover_from, 10)
    ck_path = os.path.join(root, "checkpoint")

    def covered() -> bool:
        clock.advance_sync(250)
        c = Checkpoint.load(ck_path)
        return c is not None and c.recover_from == recover_from

    wait_for(covered, interval=0.02, message="a checkpoint covering the first batch")

def test_recovery_from_a_checkpoint_rebuilds_only_the_tail(tmp_path):
    root = str(tmp_path)
    rng = random.Random(3)
    clock = VirtualClock()
    cfg = cfg_for(root, flushIntervalConsumeQueue=1000, flushIntervalCommitLog=200)
    s = MessageStore(cfg, clock)
    s.start()
    first = fill(s, rng, 40)
    wait_for_checkpoint(s, clock, root, first[-1][1])
    second = fill(s, rng, 40)
    s._halt()
    s2 = MessageStore(cfg, clock)
    s2.start()
    try:
        assert s2.recovered_abnormally
        check_store(s2, first + second)
    finally:
        s2.shutdown()


def test_queue_files_lost_after_crash_are_rebuilt(tmp_path):
    import shutil

    root = str(tmp_path)
    rng = random.Random(11)
    clock = VirtualClock()
    s = restart(root, clock)
    msgs = fill(s, rng, 50)
    s._halt()
    shutil.rmtree(os.path.join(root, "consumequeue"))
    shutil.rmtree(os.path.join(root, "index"))
    s2 = restart(root, clock)
    try:
        check_store(s2, msgs)
        assert len(s2.query_message("Crash", "k10", 5, 0, 2**62)) == 1
    finally:
        s2.shutdown()


def test_lost_queue_files_behind_the_checkpoint_are_rebuilt_from_the_log(tmp_path):
    import shutil

    root = str(tmp_path)
    rng = random.Random(5)
    clock = VirtualClock()
    cfg = cfg_for(root, flushIntervalConsumeQueue=1000, flushIntervalCommitLog=200)
    s = MessageStore(cfg, clock)
    s.start()
    first = fill(s, rng, 40)
    wait_for_checkpoint(s, clock, root, first[-1][1])
    second = fill(s, rng, 20)
    s._halt()
    shutil.rmtree(os.path.join(root, "consumequeue", "Crash", "1"))
    s2 = MessageStore(cfg, clock)
    s2.start()
    try:
        check_store(s2, first + second)
    finally:
        s2.shutdown()
    s3 = MessageStore(cfg, clock)  # and the rebuilt files load back the same
    s3.start()
    try:
        assert not s3.recovered_abnormally
        check_store(s3, first + second)
    finally:
        s3.shutdown()


def _crash_with(root: str, props: list[dict[str, str]]) -> list[int]:
    """Put one message per properties dict after a checkpoint, stop as a crash does (the records are in
    the file, past the checkpoint: recovery re-verifies them); returns their offsets."""
    from chronomq.message import MessageExt

    s = restart(root, VirtualClock())
    s.flush()
    offs = []
    for i, p in enumerate(props):
        r = s.put_message(MessageExt(topic="Crash", body=b"b%d" % i, properties=p))
        assert r.ok
        offs.append(r.append.wrote_offset)
    s._halt()
    return offs


def test_a_nul_byte_in_a_property_value_survives_recovery(tmp_path):
    # The put path stores a NUL inside a property value; recovery used to take it for a torn write and
    # cut the log there, dropping that message and every acknowledged one after it.
    root = str(tmp_path)
    _crash_with(root, [{"A": "a\x00b"}, {"A": "ok"}])
    s = restart(root, VirtualClock())
    try:
        got = list(s.iter_messages(0))
        assert [(m.body, m.properties["A"]) for m in got] == [(b"b0", "a\x00b"), (b"b1", "ok")]
    finally:
        s.shutdown()


def test_overwritten_properties_at_the_tail_are_not_served(tmp_path, caplog):
    # The body CRC does not cover the properties: a tail overwritten with printable garbage used to pass
    # recovery and be served with damaged properties.
    root = str(tmp_path)
    offs = _crash_with(root, [{"UNIQ_KEY": "U1"}, {"UNIQ_KEY": "U2"}, {}])
    end = offs[2]  # the third record has no properties: the second one's end
    with open(os.path.join(root, "commitlog", f"{0:020d}"), "r+b") as f:
        f.seek(end - 3)
        f.write(b"xyz")
    with caplog.at_level("WARNING"):
        s = restart(root, VirtualClock())
    try:
        assert [m.body for m in s.iter_messages(0)] == [b"b0"]
        assert s.max_phy_offset == offs[1]
        assert any(f"offset {offs[1]}" in r.getMessage() for r in caplog.records)
    finally:
        s.shutdown()


def test_a_tail_damaged_after_a_clean_shutdown_is_cut(tmp_path, caplog):
    # A clean checkpoint used to be trusted without a look at the records before its end: a zeroed tail
    # was served as messages with zero bytes.
    root = str(tmp_path)
    rng = random.Random(9)
    s = restart(root, VirtualClock())
    msgs = fill(s, rng, 30)
    s.shutdown()
    cut = msgs[-5][0] + 30  # inside the fifth-last record
    name = f"{cut // SEG * SEG:020d}"
    with open(os.path.join(root, "commitlog", name), "r+b") as f:
        f.seek(cut % SEG)
        f.write(bytes(SEG - cut % SEG))
    with caplog.at_level("WARNING"):
        s = restart(root, VirtualClock())
    try:
        assert s.recovered_abnormally
        check_store(s, msgs[:-5])
        assert any("clean-shutdown end" in r.getMessage() for r in caplog.records)
    finally:
        s.shutdown()


def test_a_cut_segment_is_verified_from_its_start(tmp_path):
    # A segment found shorter than its size used to be verified only from the segment holding the
    # checkpoint, so a cut in an earlier one left queue entries pointing at zeros.
    root = str(tmp_path)
    rng = random.Random(10)
    s = restart(root, VirtualClock())
    msgs = fill(s, rng, 60)
    s.shutdown()
    names = sorted(os.listdir(os.path.join(root, "commitlog")))
    assert len(names) >= 3
    cut = int(names[0]) + SEG // 2
    os.truncate(os.path.join(root, "commitlog", names[0]), SEG // 2)
    for n in names[1:]:
        os.truncate(os.path.join(root, "commitlog", n), 0)
    s = restart(root, VirtualClock())
    try:
        check_store(s, [m for m in msgs if m[1] <= cut])
    finally:
        s.shutdown()


def _clean_store(root: str, seed: int, n: int = 30) -> list:
    s = restart(root, VirtualClock())
    msgs = fill(s, random.Random(seed), n)
    s.shutdown()
    return msgs


def _queue_file(root: str, q: int) -> tuple[str, int]:
    """The newest file of queue Crash/q and how many of its bytes hold entries."""
    d = os.path.join(root, "consumequeue", "Crash", str(q))
    path = os.path.join(d, sorted(os.listdir(d))[-1])
    with open(path, "rb") as f:
        return path, len(f.read().rstrip(b"\0"))


def test_garbage_at_a_queue_files_end_is_cut_and_the_queue_rebuilt(tmp_path, caplog):
    # Garbage units at a queue's end used to be served (or, after a crash, end the commit log where the
    # rebuild met the first record whose queue offset did not follow them).
    root = str(tmp_path)
    msgs = _clean_store(root, 12)
    path, used = _queue_file(root, 0)
    with open(path, "r+b") as f:
        f.seek(used - 30)
        f.write(random.Random(1).randbytes(70))
    with caplog.at_level("WARNING"):
        s = restart(root, VirtualClock())
    try:
        check_store(s, msgs)
        assert any("Crash/0" in r.getMessage() for r in caplog.records)
    finally:
        s.shutdown()


def test_a_zeroed_queue_tail_after_a_clean_shutdown_is_rebuilt(tmp_path):
    # A clean checkpoint used to be trusted for the queues too: their zeroed last entries stayed missing.
    root = str(tmp_path)
    msgs = _clean_store(root, 13)
    path, used = _queue_file(root, 1)
    with open(path, "r+b") as f:
        f.seek(used - 45)
        f.write(bytes(45))
    s = restart(root, VirtualClock())
    try:
        check_store(s, msgs)
    finally:
        s.shutdown()


def test_a_torn_index_tail_keeps_every_key_findable(tmp_path, caplog):
    # Entries at the end of the newest index file torn by a cut used to stay in the chains, which then
    # stopped there: older messages of the same slots were no longer found by key.
    root = str(tmp_path)
    msgs = _clean_store(root, 14, 60)
    d = os.path.join(root, "index")
    path = os.path.join(d, sorted(os.listdir(d))[-1])
    os.truncate(path, os.path.getsize(path) - 200)
    with caplog.at_level("WARNING"):
        s = restart(root, VirtualClock())
    try:
        for i in range(len(msgs)):
            assert [m.commit_log_offset for m in s.query_message("Crash", f"U{i:06d}", 5, 0, 2**62)] == \
                [msgs[i][0]]
        assert any("index file" in r.getMessage() for r in caplog.records)
    finally:
        s.shutdown()
