"""A full disk, file by file: the store's disk-full ladder (RocketMQ's ratios), allocation that uses what
space is left, the timer's mapped files (never a store or load into a hole), atomic JSON writes and the
store's shutdown. The whole broker on a real full file system: tests/integration/test_disk_full.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from tests.unit.test_timer_store import FakeStore, drive, msg, small_config

import chronomq.store.atomicfile as atomicfile
import chronomq.store.mapped as mapped
from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig, ConfigError
from chronomq.delay.timer import TimerStore, TimerUnavailable
from chronomq.message import MessageExt, decode_record
from chronomq.store import MessageStore
from chronomq.store.mapped import BackedPages, MappedFile
from chronomq.store.types import PutStatus


def _enospc(*_a: object) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def store(tmp_path: Path):
    cfg = BrokerConfig(storePathRootDir=str(tmp_path / "s"), mappedFileSizeCommitLog=64 * 1024,
                       mappedFileSizeConsumeQueue=20 * 64, maxHashSlotNum=64, maxIndexNum=256)
    s = MessageStore(cfg, VirtualClock())
    s.start()
    yield s
    s.shutdown()


def _m(body: bytes = b"x") -> MessageExt:
    return MessageExt(topic="DiskT", body=body, queue_id=0)


def test_config_ratios_are_validated() -> None:
    cfg = BrokerConfig()
    assert (cfg.diskSpaceCleanForciblyRatio, cfg.diskSpaceWarningLevelRatio, cfg.cleanFileForciblyEnable) == \
        (85, 90, True)
    for bad in ({"diskSpaceWarningLevelRatio": "80"}, {"diskSpaceWarningLevelRatio": "101"},
                {"diskSpaceCleanForciblyRatio": "5"}, {"cleanResourceInterval": "0"}):
        with pytest.raises(ConfigError):
            BrokerConfig().apply(bad)
    ok = {"diskSpaceWarningLevelRatio": "100", "diskSpaceCleanForciblyRatio": "95"}
    assert BrokerConfig().apply(ok) == []


def test_sends_are_refused_past_the_warning_level_and_resume_under_the_clean_forcibly_level(store) -> None:
    use = [0.50]
    store.disk_usage_ratio = lambda: use[0]
    assert store.check_disk() is None and store.put_message(_m()).ok
    assert store.wait_dispatched(store.max_phy_offset, 10)
    use[0] = 0.91
    assert "diskSpaceWarningLevelRatio=90" in store.check_disk()
    for r in (store.put_message(_m()), store.put_messages([_m(), _m()])):
        assert r.status is PutStatus.SERVICE_NOT_AVAILABLE and "the disk is full: 91.0% used" in r.error
    # a delayed message coming due is a delivery: it goes on as far as space allows
    rec = store.get_message("DiskT", 0, 0, 1).messages[0]
    assert store.put_records("DiskT", 1, [(rec, 0, len(rec), {})]).ok
    use[0] = 0.87  # between the two levels: still full (RocketMQ's hysteresis)
    assert store.check_disk() is not None and not store.put_message(_m()).ok
    use[0] = 0.85
    assert store.check_disk() is None and store.put_message(_m()).ok


def test_only_a_forcible_clean_deletes_unexpired_segments(tmp_path: Path) -> None:
    clock = VirtualClock()
    for forcibly, ratio, deleted in ((True, 0.80, False), (True, 0.86, True), (False, 0.99, False)):
        cfg = BrokerConfig(storePathRootDir=str(tmp_path / f"{forcibly}{ratio}"),
                           mappedFileSizeCommitLog=8192, mappedFileSizeConsumeQueue=160, maxHashSlotNum=16,
                           maxIndexNum=16, cleanFileForciblyEnable=forcibly, deleteWhen="04")
        s = MessageStore(cfg, clock)
        s.start()
        try:
            s.disk_usage_ratio = lambda r=ratio: r
            for _ in range(20):
                assert s.put_message(_m(b"c" * 1000)).ok
            assert s.wait_dispatched(s.max_phy_offset, 10)
            # past diskMaxUsedSpaceRatio (75) a pass runs now, but only for expired segments
            assert (s.run_clean_once() > 0) is deleted, (forcibly, ratio)
        finally:
            s.shutdown()


def test_allocation_keeps_what_a_nearly_full_disk_gave(tmp_path: Path, monkeypatch) -> None:
    f = MappedFile(str(tmp_path / "seg"), 0, 4 << 20)
    real = os.pwrite
    room = [2 << 20]

    def pwrite(fd: int, data, off: int) -> int:
        if room[0] <= 0:
            _enospc()
        n = real(fd, data[: room[0]], off)
        room[0] -= n
        return n

    monkeypatch.setattr(mapped.os, "pwrite", pwrite)
    f.allocate(1000)  # fits in the 2 MiB the disk had, though the 4 MiB chunk does not
    assert f.allocated == 2 << 20
    with pytest.raises(OSError):
        f.allocate((2 << 20) + 1)
    f.close()


def test_backed_pages_know_the_holes_of_an_existing_file(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, 64 * 1024)
        os.pwrite(fd, b"x", 5 * 4096 + 10)
        b = BackedPages(fd, 64 * 1024)
        assert b.has(5 * 4096) and not b.has(0) and not b.has(6 * 4096)
        b.ensure([0, 8])
        assert b.has(0) and os.fstat(fd).st_blocks * 512 >= 2 * 4096
    finally:
        os.close(fd)


def test_backing_the_last_page_never_grows_a_file_that_is_not_whole_pages(tmp_path: Path) -> None:
    size = 691_200  # a day of 1-second wheel slots: 168.75 pages
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, size)
        b = BackedPages(fd, size)
        b.ensure([size - 8, 0])
        assert os.fstat(fd).st_size == size and b.has(size - 8) and b.has(0)
    finally:
        os.close(fd)


def test_a_wheel_slot_in_the_last_page_of_a_day_does_not_make_a_restart_rebuild_the_wheel(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = VirtualClock()
    day = 86_400_000
    last_slot_of_today = clock.now_ms() - clock.now_ms() % day + day - 1_000  # the day file's last page
    t = TimerStore(tmp_path, clock, small_config())
    t.open()
    t.schedule(msg("late"), last_slot_of_today)
    t.close()
    t = TimerStore(tmp_path, clock, small_config())
    with caplog.at_level("WARNING", logger="chronomq.delay.timer"):
        t.open()
    try:
        assert t.wheel.cut == [] and not caplog.records, [r.getMessage() for r in caplog.records]
        assert t.count() == 1
    finally:
        t.close()


def test_timer_schedule_on_a_full_disk_is_refused_cleanly_and_parks_after(tmp_path: Path,
                                                                          monkeypatch) -> None:
    clock = VirtualClock()
    fstore = FakeStore(clock)
    t = TimerStore(tmp_path / "timer", clock, small_config())
    t.open()
    now = clock.now_ms()
    t.schedule(msg("before"), now + 5000)
    # new wheel and hash-bucket pages cannot get blocks: refused before anything is stored into them
    monkeypatch.setattr(mapped.os, "posix_fallocate", _enospc)
    with pytest.raises(TimerUnavailable, match="No space left"):
        t.schedule(msg("refused", keys="k1"), now + 40 * 3_600_000)
    monkeypatch.undo()
    t.schedule(msg("after", keys="k1"), now + 40 * 3_600_000)
    assert [p.msg_id for p in t.query(key="k1").items] == ["after"]
    drive(t, clock, fstore)
    assert [u for u, _, _ in fstore.puts] == ["before", "after"]
    t.close()


def test_a_timer_topic_id_is_not_used_when_its_file_cannot_be_written(tmp_path: Path, monkeypatch) -> None:
    clock = VirtualClock()
    t = TimerStore(tmp_path / "timer", clock, small_config())
    t.open()
    monkeypatch.setattr(atomicfile.os, "write", _enospc)
    with pytest.raises(TimerUnavailable):
        t.schedule(msg("a", topic="NewTopic"), clock.now_ms() + 5000)
    monkeypatch.undo()
    assert "NewTopic" not in t.topics
    t.schedule(msg("b", topic="NewTopic"), clock.now_ms() + 5000)
    t.close()
    t2 = TimerStore(tmp_path / "timer", clock, small_config())
    t2.open()
    assert t2.stats()["pending_by_topic"] == {"NewTopic": 1}
    t2.close()


def test_atomic_write_on_a_full_disk_keeps_the_old_file_and_no_temp(tmp_path: Path, monkeypatch) -> None:
    p = tmp_path / "offsets.json"
    atomicfile.write_atomic(p, b'{"old": 1}')
    monkeypatch.setattr(atomicfile.os, "write", _enospc)
    with pytest.raises(OSError):
        atomicfile.write_atomic(p, b'{"new": 2}')
    assert p.read_bytes() == b'{"old": 1}' and sorted(x.name for x in tmp_path.iterdir()) == ["offsets.json"]


def test_store_shutdown_on_a_full_disk_leaves_a_crash_recovery_not_an_exception(tmp_path: Path,
                                                                                monkeypatch) -> None:
    cfg = BrokerConfig(storePathRootDir=str(tmp_path), mappedFileSizeCommitLog=64 * 1024,
                       mappedFileSizeConsumeQueue=20 * 64, maxHashSlotNum=64, maxIndexNum=256)
    s = MessageStore(cfg, VirtualClock())
    s.start()
    assert s.put_message(_m(b"kept")).ok
    monkeypatch.setattr(atomicfile.os, "write", _enospc)
    s.shutdown()
    monkeypatch.undo()
    assert (tmp_path / "abort").exists()
    s2 = MessageStore(cfg, VirtualClock())
    s2.start()
    try:
        assert s2.recovered_abnormally
        assert [decode_record(r).body for r in s2.get_message("DiskT", 0, 0, 10).messages] == [b"kept"]
    finally:
        s2.shutdown()
