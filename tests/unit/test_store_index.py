"""IndexService: the active file's slot table lives in memory and is written back by flush; lookups agree
before and after the write-back, across a roll to a new file, after a failed write, after a reopen, and a
crash before the write-back loses only entries that re-dispatch puts back."""

from __future__ import annotations

import os

import pytest

from chronomq.store import index as index_mod
from chronomq.store.index import HEADER_SIZE, IndexService
from chronomq.store.types import DispatchRequest

SLOTS, ENTRIES = 64, 40  # tiny files: several rolls, many chains sharing a slot


def items(start: int, n: int, ts: int = 1_000_000) -> list[DispatchRequest]:
    return [DispatchRequest(p * 100, 100, "T", 0, p, 0, ts + p, [f"k{p % 5}"], f"U{p}")
            for p in range(start, start + n)]


def uniq_hits(svc: IndexService, p: int) -> list[int]:
    return svc.query("T", f"U{p}", 10, 0, 2**62)


def key_hits(svc: IndexService, k: int) -> list[int]:
    return sorted(svc.query("T", f"k{k}", 1000, 0, 2**62))


def test_lookups_are_the_same_before_and_after_write_back_and_across_rolls(tmp_path):
    svc = IndexService(str(tmp_path), SLOTS, ENTRIES)
    svc.put_batch(items(0, 45))  # 2 entries a message: several files
    assert len(svc.files) >= 3
    before = {k: key_hits(svc, k) for k in range(5)}
    assert before[2] == [p * 100 for p in range(45) if p % 5 == 2]
    assert all(uniq_hits(svc, p) == [p * 100] for p in range(45))
    svc.flush()
    assert all(f.slots is None for f in svc.files[:-1]), "full files give up their in-memory table"
    assert svc.files[-1].slots is not None
    assert {k: key_hits(svc, k) for k in range(5)} == before
    assert all(uniq_hits(svc, p) == [p * 100] for p in range(45))
    svc.close()


def test_the_file_holds_the_table_after_flush_and_a_reopen_finds_everything(tmp_path):
    svc = IndexService(str(tmp_path), SLOTS, 1000)
    svc.put_batch(items(0, 30))
    f = svc.files[-1]
    assert f.dirty_pages
    svc.flush()
    assert not f.dirty_pages
    assert bytes(f.mm[HEADER_SIZE:f.entries_at]) == bytes(f.slots)
    svc.put_batch(items(30, 10))
    svc.close()
    again = IndexService(str(tmp_path), SLOTS, 1000)
    again.load()
    assert all(uniq_hits(again, p) == [p * 100] for p in range(40))
    again.put_batch(items(40, 5))  # the reopened, not full file takes entries again
    assert key_hits(again, 0) == [p * 100 for p in range(45) if p % 5 == 0]
    again.close()


def test_a_failed_write_back_is_retried_by_the_next_flush(tmp_path, monkeypatch):
    svc = IndexService(str(tmp_path), 4096, 1000)  # 4 pages of slots: several runs
    svc.put_batch(items(0, 200))
    f = svc.files[-1]
    pages = set(f.dirty_pages)
    real = index_mod.pwrite_all
    calls = []

    def failing(fd, data, off):
        calls.append(off)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        real(fd, data, off)

    monkeypatch.setattr(index_mod, "pwrite_all", failing)
    svc.flush()
    assert f.dirty_pages == pages  # nothing was lost: every page waits for the next flush
    svc.flush()
    assert not f.dirty_pages
    assert bytes(f.mm[HEADER_SIZE:f.entries_at]) == bytes(f.slots)
    svc.close()


def test_a_crash_before_write_back_loses_only_what_redispatch_puts_back(tmp_path):
    svc = IndexService(str(tmp_path), SLOTS, 1000)
    svc.put_batch(items(0, 20))
    svc.flush()  # the checkpoint would say: dispatched up to message 20
    svc.put_batch(items(20, 10))  # then the process dies: these slots never reach the file
    crashed = IndexService(str(tmp_path), SLOTS, 1000)  # same page cache, as after a kill -9
    crashed.load()
    assert all(uniq_hits(crashed, p) == [p * 100] for p in range(20))
    assert all(p * 100 not in uniq_hits(crashed, p) for p in range(20, 30))
    crashed.put_batch(items(20, 10))  # recovery re-dispatches from the checkpoint
    assert all(uniq_hits(crashed, p) == [p * 100] for p in range(30))
    assert key_hits(crashed, 1) == [p * 100 for p in range(30) if p % 5 == 1]
    crashed.close()
    svc.close()


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_batches_of_any_size_give_the_same_index(tmp_path, batch):
    one = IndexService(str(tmp_path / "one"), SLOTS, ENTRIES)
    one.put_batch(items(0, 64))
    many = IndexService(str(tmp_path / "many"), SLOTS, ENTRIES)
    for s in range(0, 64, batch):
        many.put_batch(items(s, min(batch, 64 - s)))
        if s % 3 == 0:
            many.flush()
    for k in range(5):
        assert key_hits(one, k) == key_hits(many, k)
    one.close()
    many.close()


def test_a_query_of_many_keys_finds_what_each_query_finds(tmp_path):
    svc = IndexService(str(tmp_path), SLOTS, ENTRIES)
    svc.put_batch(items(0, 45))  # several files, chains sharing slots
    keys = [f"U{p}" for p in range(0, 50)] + [f"k{k}" for k in range(6)] + ["", "missing"]
    many = svc.query_many("T", keys, 1000, 0, 2**62)
    assert many == {k: svc.query("T", k, 1000, 0, 2**62) for k in keys if svc.query("T", k, 1000, 0, 2**62)}
    assert set(many) == {f"U{p}" for p in range(45)} | {f"k{k}" for k in range(5)}
    assert svc.query_many("Other", keys, 1000, 0, 2**62) == {}
    assert svc.query_many("T", keys, 1000, 2**61, 2**62) == {}  # outside every file's time range
    svc.close()


def test_a_new_file_leaves_its_slot_table_a_hole_until_slots_are_written(tmp_path):
    """The slot table is written with pwrite and read with pread only: a new file's table takes no disk,
    a flush backs just the pages that hold slots, and full files (read from disk) and a reopen still find
    every key, the table's holes reading as zero."""
    slots = 1 << 20  # a 4 MiB table: 1,024 pages
    svc = IndexService(str(tmp_path), slots, 100)
    svc.put_batch(items(0, 40))  # 80 entries: one file
    f = svc.files[-1]
    assert os.fstat(f.mf.fd).st_blocks * 512 < 1 << 20, "a new file's slot table is not written out as zeros"
    svc.flush()
    held = os.fstat(f.mf.fd).st_blocks * 512
    assert held < 2 * 80 * 8192 + (1 << 20), "only the pages holding slots get disk blocks"
    svc.put_batch(items(40, 20))  # the first file fills: its lookups read the file's own table
    svc.flush()
    assert svc.files[0].slots is None
    assert all(uniq_hits(svc, p) == [p * 100] for p in range(60))
    assert key_hits(svc, 3) == [p * 100 for p in range(60) if p % 5 == 3]
    svc.close()
    again = IndexService(str(tmp_path), slots, 100)
    again.load()
    assert all(uniq_hits(again, p) == [p * 100] for p in range(60))
    again.put_batch(items(60, 5))  # the reopened active file reads its table (holes and all) into memory
    assert key_hits(again, 0) == [p * 100 for p in range(65) if p % 5 == 0]
    again.close()


def test_truncating_entries_rewrites_the_table_without_filling_its_holes(tmp_path):
    slots = 1 << 20
    svc = IndexService(str(tmp_path), slots, 1000)
    svc.put_batch(items(0, 30))
    svc.flush()
    f = svc.files[-1]
    f.truncate_entries(20, 1_000_000 + 9)  # entries 1..20: messages 0..9 (two entries each)
    assert os.fstat(f.mf.fd).st_blocks * 512 < 2 * 60 * 8192 + (1 << 20)
    assert f.slots_used == len({index_mod.key_hash(f"T#{w}") % slots
                                for p in range(10) for w in (f"U{p}", f"k{p % 5}")})
    assert all(uniq_hits(svc, p) == [p * 100] for p in range(10))
    assert all(uniq_hits(svc, p) == [] for p in range(10, 30))
    svc.close()


def test_a_new_index_starts_with_a_small_file_and_a_reopen_reads_each_files_geometry(tmp_path):
    shrink = index_mod.FIRST_FILE_SHRINK
    slots, entries = shrink * index_mod.FIRST_FILE_MIN_SLOTS, shrink * 8
    svc = IndexService(str(tmp_path), slots, entries)
    svc.put_batch(items(0, 40))  # 80 entries: the small first file (7) rolls to a full one
    first, second = svc.files[0], svc.files[1]
    assert (first.slot_num, first.index_num) == (index_mod.FIRST_FILE_MIN_SLOTS, 8)
    assert (second.slot_num, second.index_num) == (slots, entries)
    assert os.path.getsize(first.mf.path) == HEADER_SIZE + first.slot_num * 4 + 8 * index_mod.ENTRY_SIZE
    assert os.path.getsize(second.mf.path) == HEADER_SIZE + slots * 4 + entries * index_mod.ENTRY_SIZE
    svc.close()
    again = IndexService(str(tmp_path), slots, entries)
    again.load()
    assert [(f.slot_num, f.index_num) for f in again.files] == [(index_mod.FIRST_FILE_MIN_SLOTS, 8),
                                                                (slots, entries)]
    assert all(uniq_hits(again, p) == [p * 100] for p in range(40))
    assert key_hits(again, 3) == [p * 100 for p in range(40) if p % 5 == 3]
    again.close()


def test_too_few_slots_to_shrink_keep_the_configured_size_and_files_of_full_size_stay_full(tmp_path):
    small = IndexService(str(tmp_path / "small"), index_mod.FIRST_FILE_MIN_SLOTS * 8, 64)
    small.put_batch(items(0, 3))
    assert (small.files[0].slot_num, small.files[0].index_num) == (index_mod.FIRST_FILE_MIN_SLOTS * 8, 64)
    small.close()
    # a store written before the small first file: its first file has the configured size, and keeps it
    slots, entries = index_mod.FIRST_FILE_SHRINK * index_mod.FIRST_FILE_MIN_SLOTS, 64
    old = tmp_path / "old"
    old.mkdir()
    index_mod.IndexFile(str(old / f"{0:020d}"), slots, entries).mf.close()
    svc = IndexService(str(old), slots, entries)
    svc.load()
    svc.put_batch(items(0, 5))
    assert [(f.slot_num, f.index_num) for f in svc.files] == [(slots, entries)]
    assert all(uniq_hits(svc, p) == [p * 100] for p in range(5))
    svc.close()


def test_the_small_first_file_takes_one_entry_a_slot_and_an_earlier_versions_is_read_as_it_is(tmp_path):
    """Chains one entry long on average when the first file is full (a key query walks them), where a
    configured file's are index_num / slot_num; a first file with FIRST_FILE_SHRINK times fewer entries,
    as an earlier version wrote it, keeps its geometry when opened again."""
    shrink, min_slots = index_mod.FIRST_FILE_SHRINK, index_mod.FIRST_FILE_MIN_SLOTS
    slots, entries = shrink * min_slots, 4 * shrink * min_slots  # 4 entries a slot, as by default
    assert index_mod.first_file_geometry(slots, entries) == (min_slots, min_slots)
    new = tmp_path / "new"
    svc = IndexService(str(new), slots, entries)
    svc.put_batch(items(0, 3))
    assert (svc.files[0].slot_num, svc.files[0].index_num) == (min_slots, min_slots)
    svc.close()
    again = IndexService(str(new), slots, entries)
    again.load()
    assert [(f.slot_num, f.index_num) for f in again.files] == [(min_slots, min_slots)]
    again.close()
    old = tmp_path / "old"
    old.mkdir()
    index_mod.IndexFile(str(old / f"{0:020d}"), min_slots, entries // shrink).mf.close()
    svc = IndexService(str(old), slots, entries)
    svc.load()
    svc.put_batch(items(0, 5))
    assert [(f.slot_num, f.index_num) for f in svc.files] == [(min_slots, entries // shrink)]
    assert all(uniq_hits(svc, p) == [p * 100] for p in range(5))
    svc.close()
