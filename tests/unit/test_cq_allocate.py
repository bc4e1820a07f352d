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
