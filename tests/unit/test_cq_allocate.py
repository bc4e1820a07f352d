"""A consume-queue file gets its disk blocks ahead of its writes in growing steps: 16 KiB first, then as
much again as it has, up to 256 KiB at a time, so a queue that takes few messages holds little disk."""

from __future__ import annotations

import os

from chronomq.store.consumequeue import CQ_ALLOC_CHUNK, CQ_FIRST_CHUNK, UNIT, UNIT_SIZE, ConsumeQueue


def _units(first: int, n: int) -> bytes:
    return b"".join(UNIT.pack(1000 * (first + i), 100, 0) for i in range(n))


def test_a_queue_file_is_allocated_in_doubling_steps_up_to_the_largest(tmp_path) -> None:
    cq = ConsumeQueue(str(tmp_path), "T", 0, 300_000 * UNIT_SIZE)
    written, seen = 0, []
    try:
        for n in (1, 10, 800, 1, 2000, 5000, 20_000, 20_000):
            cq.append_units(written, _units(written, n), n)
            written += n
            f = cq.files[0]
            seen.append(f.allocated)
            assert f.allocated >= written * UNIT_SIZE
            # never more ahead than the step it took (its size, at most the largest)
            step = max(CQ_FIRST_CHUNK, min(CQ_ALLOC_CHUNK, f.allocated // 2))
            assert f.allocated - written * UNIT_SIZE <= step
            assert os.stat(f.path).st_blocks * 512 <= f.allocated + 4096
        assert seen[0] == CQ_FIRST_CHUNK  # one unit: 16 KiB, not 256
        assert seen == sorted(seen) and seen[-1] % CQ_ALLOC_CHUNK == 0
        units = cq.units(0, written)
        assert len(units) == written
        assert units[0] == (0, 100, 0) and units[-1] == (1000 * (written - 1), 100, 0)
    finally:
        cq.close()


def test_a_queue_file_made_ahead_takes_the_first_units_and_reads_back_empty_until_then(tmp_path) -> None:
    cq = ConsumeQueue(str(tmp_path), "T", 0, 1000 * UNIT_SIZE)
    try:
        assert cq.prepare_first_file() and not cq.prepare_first_file()  # once
        made = cq.files[0]
        assert made.start == 0 and made.allocated == CQ_FIRST_CHUNK
        assert (cq.min_offset, cq.max_offset) == (0, 0)
        cq.append_units(0, _units(0, 3), 3)
        assert cq.files == [made] and cq.units(0, 10) == [(0, 100, 0), (1000, 100, 0), (2000, 100, 0)]
    finally:
        cq.close()
    # a file made ahead and never written is an empty queue when the store opens again
    again = ConsumeQueue(str(tmp_path), "U", 0, 1000 * UNIT_SIZE)
    assert again.prepare_first_file()
    again.close()
    reopened = ConsumeQueue(str(tmp_path), "U", 0, 1000 * UNIT_SIZE)
    reopened.load()
    try:
        assert (reopened.min_offset, reopened.max_offset) == (0, 0) and len(reopened.files) == 1
        reopened.append_units(0, _units(0, 1), 1)
        assert reopened.units(0, 10) == [(0, 100, 0)]
    finally:
        reopened.close()


def test_a_queue_file_made_ahead_for_offset_0_gives_way_to_a_queue_that_starts_later(tmp_path) -> None:
    cq = ConsumeQueue(str(tmp_path), "T", 0, 1000 * UNIT_SIZE)
    try:
        assert cq.prepare_first_file()
        made = cq.files[0].path
        cq.append_units(2500, _units(2500, 2), 2)  # in the third file: the one made ahead is of no use
        assert [f.start for f in cq.files] == [2000 * UNIT_SIZE] and not os.path.exists(made)
        assert (cq.min_offset, cq.max_offset) == (2500, 2502)
        assert cq.units(2500, 10) == [(2_500_000, 100, 0), (2_501_000, 100, 0)]
        assert not cq.prepare_first_file()  # it has units: nothing is made ahead any more
    finally:
        cq.close()
