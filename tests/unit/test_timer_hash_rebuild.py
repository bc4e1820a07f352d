"""The timer key hash's recovery after a crash: cut back to the checkpoint's extent and the bucket heads
moved back along the dropped entries' links, or recomputed from the entries kept when those links cannot
be followed, held to a per-bucket model of the rule (every bucket's head is the last kept entry of that
bucket, or 0), including heads in pages that have no disk block yet."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from chronomq.delay.timer.files import HASH_ENTRY, _HashGeneration

BUCKETS = 5_000  # not a multiple of a page's 512 heads: the last page is short


def _model(gen: _HashGeneration) -> dict[int, int]:
    """Bucket -> head, recomputed one entry at a time from the entry file."""
    raw = Path(gen.entry_path).read_bytes()[: gen.count * HASH_ENTRY.size]
    heads: dict[int, int] = {}
    for i, (h, _pos, _prev) in enumerate(HASH_ENTRY.iter_unpack(raw)):
        heads[h % gen.buckets] = i + 1
    return heads


def _stored(gen: _HashGeneration) -> dict[int, int]:
    return {b: v for b in range(gen.buckets) if (v := gen._head(b * 8))}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cut_back_recomputes_every_head_from_the_entries_kept(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    gen = _HashGeneration(tmp_path, 0, BUCKETS, 1 << 20)
    kept = rnd.randrange(100, 2_000)
    gen.add_many([(rnd.getrandbits(31), pos) for pos in range(kept)])
    gen.add_many([(rnd.getrandbits(31), pos) for pos in range(kept, kept + 3_000)])  # lost in the crash
    # heads of buckets that no kept entry names (a page synced ahead of the entries)
    for b in rnd.sample(range(BUCKETS), 50):
        gen.bmap[b * 8:b * 8 + 8] = (kept + 10_000).to_bytes(8, "little")
    before = _stored(gen)
    changed = gen.cut_back(kept)
    assert gen.count == kept
    want = _model(gen)
    assert _stored(gen) == want
    assert changed == sum(1 for b in before.keys() | want.keys() if before.get(b, 0) != want.get(b, 0))
    for h_b, head in want.items():  # the chains walk from the recomputed heads
        assert head <= kept and h_b < BUCKETS


def test_cut_back_leaves_a_table_that_names_only_kept_entries_as_it_is(tmp_path: Path) -> None:
    rnd = random.Random(7)
    gen = _HashGeneration(tmp_path, 0, BUCKETS, 1 << 20)
    gen.add_many([(rnd.getrandbits(31), pos) for pos in range(1_000)])
    before = _stored(gen)
    assert gen.cut_back(1_000) == 0
    assert _stored(gen) == before == _model(gen)


def test_rebuild_clears_heads_whose_entries_are_all_gone(tmp_path: Path) -> None:
    gen = _HashGeneration(tmp_path, 0, BUCKETS, 1 << 20)
    gen.add_many([(12_345, 0), (BUCKETS * 3 + 7, 1)])
    gen.cut_back(0)
    assert _stored(gen) == {}
    assert gen.lookup(12_345) == []


def _crashed(tmp_path: Path, seed: int) -> tuple[_HashGeneration, int]:
    """A generation with ``kept`` entries synced and 3,000 more written after them (entries and heads)."""
    rnd = random.Random(seed)
    gen = _HashGeneration(tmp_path, 0, BUCKETS, 1 << 20)
    kept = rnd.randrange(100, 2_000)
    gen.add_many([(rnd.getrandbits(31), pos) for pos in range(kept)])
    for start in range(kept, kept + 3_000, 500):  # in several runs, as the flushes write them
        gen.add_many([(rnd.getrandbits(31), pos) for pos in range(start, start + 500)])
    return gen, kept


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_cut_back_moves_heads_back_along_the_dropped_entries_without_a_rebuild(
        tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen, kept = _crashed(tmp_path, seed)
    before = _stored(gen)
    monkeypatch.setattr(gen, "rebuild_buckets", lambda: pytest.fail("rebuilt every head"))
    changed = gen.cut_back(kept)
    want = _model(gen)
    assert _stored(gen) == want
    assert changed == sum(1 for b in before.keys() | want.keys() if before.get(b, 0) != want.get(b, 0)) > 0


@pytest.mark.parametrize("lost", ["an entry zeroed", "the entry file cut short"])
def test_cut_back_rebuilds_when_a_dropped_link_did_not_reach_the_disk(tmp_path: Path, lost: str) -> None:
    gen, kept = _crashed(tmp_path, 7)
    size = HASH_ENTRY.size
    with open(gen.entry_path, "r+b") as f:
        if lost == "an entry zeroed":  # a page of the entry file lost, the bucket table's kept
            f.seek((kept + 1_500) * size)
            f.write(bytes(size * 40))
        else:
            f.truncate((kept + 1_000) * size)
    gen.count = min(gen.count, Path(gen.entry_path).stat().st_size // size)
    gen.cut_back(kept)
    assert _stored(gen) == _model(gen)
