"""The timer's key hash is sized to its store: a new hash starts with a first generation
FIRST_GENERATION_SHRINK times smaller than the configured one (a store holding few keys keeps a small
bucket table on disk), the generations after it have the configured size, and each generation keeps the
size its file has across restarts and crashes."""

from __future__ import annotations

from pathlib import Path

from test_timer_store import DAY, msg, small_config

from chronomq.clock import VirtualClock
from chronomq.delay.timer import TimerStore
from chronomq.delay.timer.files import FIRST_GENERATION_SHRINK, HashIndex, _HashGeneration, key_hash


def _items(keys: range) -> list[tuple[int, int]]:
    return [(key_hash(f"k{i}"), i * 100) for i in keys]


def test_a_new_hash_starts_small_and_grows_to_the_configured_generations(tmp_path: Path) -> None:
    h = HashIndex(tmp_path / "hash", 1 << 16, 1 << 10)
    first = h.gens[0]
    assert (first.buckets, first.capacity) == (1 << 16 >> 4, 1 << 10 >> 4) == (4096, 64)
    assert (tmp_path / "hash" / "00000000.buckets").stat().st_size == 4096 * 8
    h.add_many(_items(range(200)))
    assert [(g.buckets, g.count) for g in h.gens] == [(4096, 64), (1 << 16, 136)]
    assert all(h.lookup(f"k{i}") == [i * 100] for i in range(200))
    h.sync()
    h.close()
    # reopened: every generation keeps the size of its file, whatever the configuration says now
    h = HashIndex(tmp_path / "hash", 1 << 18, 1 << 12)
    assert [(g.buckets, g.capacity) for g in h.gens] == [(4096, 64), (1 << 16, 1 << 10)]
    assert all(h.lookup(f"k{i}") == [i * 100] for i in range(200))
    h.add_many(_items(range(200, 1300)))  # the second generation fills at its own capacity
    assert [g.count for g in h.gens] == [64, 1 << 10, 1300 - 64 - (1 << 10)]
    assert h.gens[-1].buckets == 1 << 18 and all(h.lookup(f"k{i}") == [i * 100] for i in range(0, 1300, 7))
    h.close()


def test_small_configurations_and_older_full_size_first_generations_keep_their_size(tmp_path: Path) -> None:
    h = HashIndex(tmp_path / "small", 4096, 1000)  # 4096 / 16 is below the least: the configured size
    assert (h.gens[0].buckets, h.gens[0].capacity) == (4096, 1000)
    h.close()
    # a store written before the first generation was made small: its table stays as it is
    (tmp_path / "old").mkdir()
    g = _HashGeneration(tmp_path / "old", 0, 1 << 16, 1 << 10)
    g.add_many(_items(range(10)))
    g.close()
    h = HashIndex(tmp_path / "old", 1 << 16, 1 << 10)
    assert (h.gens[0].buckets, h.gens[0].capacity, h.gens[0].count) == (1 << 16, 1 << 10, 10)
    assert h.lookup("k3") == [300]
    h.close()


def test_a_timer_store_with_the_default_hash_holds_a_small_table_after_a_crash_too(tmp_path: Path) -> None:
    clock = VirtualClock()
    path = tmp_path / "timer"
    cfg = small_config(hash_buckets=1 << 20, hash_generation_entries=8 << 20)  # the defaults
    t = TimerStore(path, clock, cfg)
    t.open()
    later = clock.now_ms() + DAY
    t.schedule_batch([(msg(f"a{i}", keys=f"ka{i}"), later) for i in range(2000)])
    t.flush()
    t.schedule_batch([(msg(f"b{i}", keys=f"kb{i}"), later) for i in range(2000)])
    t.abandon()  # a crash: the second batch's keys are past the checkpoint
    table = (1 << 20) // FIRST_GENERATION_SHRINK * 8
    assert (path / "hash" / "00000000.buckets").stat().st_size == table  # 512 KiB, not 8 MiB
    t = TimerStore(path, clock, cfg)
    t.open()
    try:
        assert t.hash.gens[0].buckets == (1 << 20) // FIRST_GENERATION_SHRINK
        for prefix in "ab":
            for i in range(0, 2000, 37):
                assert [r.msg_id for r in t.query(key=f"k{prefix}{i}").items] == [f"{prefix}{i}"]
        hash_disk = sum(p.stat().st_blocks * 512 for p in (path / "hash").iterdir())
        assert hash_disk <= table + 4000 * 20 * 2 + 64 * 1024
    finally:
        t.close()
