"""MappedFile.allocate: never-written bytes get written zeros (no hole or unwritten extent is left for a
mapped store to fault on), bytes that may hold data are only fallocated (content kept), the recovered
tail of a segment counts as never written, and the store's allocator thread stays ahead of the writer."""

from __future__ import annotations

import os

import pytest
from test_store_basic import make_config, msg
from tests.conftest import wait_for

import chronomq.store.mapped as mapped
from chronomq.clock import VirtualClock
from chronomq.store import MessageStore
from chronomq.store.allocate import MIN_AHEAD
from chronomq.store.mapped import MappedFile


def _calls(monkeypatch) -> list[tuple[str, int, int]]:
    calls: list[tuple[str, int, int]] = []
    real_pwrite, real_fallocate = os.pwrite, os.posix_fallocate

    def pwrite(fd, data, off):  # type: ignore[no-untyped-def]
        calls.append(("zeros", off, len(data)))
        return real_pwrite(fd, data, off)

    def fallocate(fd, off, n):  # type: ignore[no-untyped-def]
        calls.append(("fallocate", off, n))
        return real_fallocate(fd, off, n)

    monkeypatch.setattr(mapped.os, "pwrite", pwrite)
    monkeypatch.setattr(mapped.os, "posix_fallocate", fallocate)
    return calls


def test_a_new_file_gets_zeros_written_in_chunks(tmp_path, monkeypatch) -> None:
    f = MappedFile(str(tmp_path / "00000000000000000000"), 0, 1 << 20)
    calls = _calls(monkeypatch)
    f.allocate(1, chunk=64 * 1024)
    assert f.allocated == 64 * 1024 and calls == [("zeros", 0, 64 * 1024)]
    f.allocate(100 * 1024, chunk=64 * 1024)
    assert f.allocated == 128 * 1024 and calls[1:] == [("zeros", 64 * 1024, 64 * 1024)]
    f.allocate(10 << 20)  # never past the file's end
    assert f.allocated == 1 << 20 and os.stat(f.path).st_blocks * 512 >= 1 << 20  # blocks really exist
    f.close()


def _reopened(tmp_path, content: bytes) -> MappedFile:
    """A 256 KiB file that holds ``content`` at its start, closed and opened again."""
    path = str(tmp_path / "00000000000000000000")
    f = MappedFile(path, 0, 256 * 1024)
    f.mm[0 : len(content)] = content
    f.close()
    return MappedFile(path, 0, 256 * 1024)


def test_a_reopened_file_keeps_its_content(tmp_path, monkeypatch) -> None:
    f = _reopened(tmp_path, b"hello")
    calls = _calls(monkeypatch)
    f.allocate(1)
    assert [c[0] for c in calls] == ["fallocate"] and f.mm[0:5] == b"hello"
    f.close()


def test_the_zeroed_tail_of_a_recovered_file_gets_zeros(tmp_path, monkeypatch) -> None:
    f = _reopened(tmp_path, b"keep")
    f.zero_tail(4096)
    calls = _calls(monkeypatch)
    f.allocate(8192, chunk=64 * 1024)
    assert calls == [("fallocate", 0, 4096), ("zeros", 4096, 60 * 1024)]
    assert f.mm[0:4] == b"keep"
    f.close()


def test_the_allocator_thread_stays_ahead_of_the_commit_log_writer(tmp_path) -> None:
    s = MessageStore(make_config(tmp_path, mappedFileSizeCommitLog=32 << 20), VirtualClock())
    s.start()
    try:
        assert s.put_message(msg(body=b"x" * 1000)).ok
        seg = s._cur_seg
        assert seg is not None
        # at least MIN_AHEAD past the write position, in the background (woken by the put); how far
        # follows the write rate: tests/unit/test_allocate_ahead.py
        wait_for(lambda: seg.allocated >= s.max_phy_offset + MIN_AHEAD,
                 message="the allocator thread ran ahead")
    finally:
        s.shutdown()


def test_staged_records_have_their_new_queue_file_made_ahead_by_the_allocator(tmp_path) -> None:
    s = MessageStore(make_config(tmp_path, mappedFileSizeCommitLog=1 << 20), VirtualClock())
    s.start()
    try:
        r = s.put_message(msg(topic="Source", body=b"x" * 100))
        raw = s.read_record(r.append.wrote_offset) if r.append is not None else None
        assert raw is not None
        entries = s.prepare_records("Fresh", 2, [(raw, 0, len(raw), {})])  # what the timer stages
        assert isinstance(entries, list)
        # made in the background, before anything was put to the queue
        wait_for(lambda: ("Fresh", 2) in s._queues and bool(s._queues[("Fresh", 2)].files),
                 message="the allocator made the staged queue's first file")
        cq = s._queues[("Fresh", 2)]
        made = cq.files[0]
        assert made.start == 0 and s.get_max_offset_in_queue("Fresh", 2) == 0
        put = s.put_prepared("Fresh", 2, entries)
        assert put.ok and s.wait_dispatched(put.append.wrote_offset, 5)
        got = s.get_message("Fresh", 2, 0, 32)
        assert got.next_begin_offset == 1 and len(got.messages) == 1 and cq.files == [made]
        # a queue that took records, or whose records were put (its units' place known), is left alone
        assert not s.prepare_queue("Fresh", 2) and not s.prepare_queue("Source", 0)
        s._queue_table[("Moved", 0)] = 5
        assert not s.prepare_queue("Moved", 0) and ("Moved", 0) not in s._queues
        s.prepare_records("Source", 0, [(raw, 0, len(raw), {})])  # has its queue: nothing asked
        assert not s._allocator._queues and not s._allocator._asked
    finally:
        s.shutdown()


def test_zeros_that_make_no_progress_are_an_error_not_a_loop(tmp_path, monkeypatch) -> None:
    f = MappedFile(str(tmp_path / "00000000000000000000"), 0, 1 << 20)
    monkeypatch.setattr(mapped.os, "pwrite", lambda fd, data, off: 0)
    try:
        with pytest.raises(OSError, match="wrote nothing"):
            f.allocate(1, chunk=64 * 1024)
        assert f.allocated == 0
    finally:
        monkeypatch.undo()
        f.close()
