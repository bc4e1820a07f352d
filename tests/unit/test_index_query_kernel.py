"""The index lookup of many keys at once: the compiled index_query against its pure twin (index_query_py)
on real index files (tiny slot tables, so chains share slots; full files read with pread, the active one
from memory; empty files; any time window and limit) and on damaged bytes, and the twin against what a
chain must yield: every entry of the key's hash in the window, newest first, at most the limit."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronomq.store import index, speedups
from chronomq.store.index import ENTRY, ENTRY_SIZE, IndexFile, IndexService, IndexView, key_hash
from chronomq.store.index import index_query_py as twin
from chronomq.store.types import DispatchRequest

native = speedups.native
needs_native = pytest.mark.skipif(native is None, reason="chronomq.store._speedups not in use")

WORDS = [f"w{i}" for i in range(12)] + ["", "é", "长键"]
word = st.sampled_from(WORDS)
topic = st.sampled_from(["T", "U"])
request = st.tuples(topic, st.one_of(st.none(), word), st.one_of(st.none(), st.lists(word, max_size=3)),
                    st.integers(-3_000, 9_000))  # topic, UNIQ_KEY, KEYS, store time after the last one


Request = tuple[str, str | None, list[str] | None, int]


def _build(tmp: Path, slot_num: int, index_num: int, reqs: list[Request], flush_every: int,
           empty_at: int | None) -> tuple[IndexService, list[IndexView]]:
    """An index of ``reqs`` (flushed every ``flush_every`` requests: full files give up their tables), and
    the views of its files newest first, with an empty file's at ``empty_at``."""
    svc = IndexService(str(tmp), slot_num, index_num)
    ts = 1_000_000
    for p, (t, uniq, keys, step) in enumerate(reqs):
        ts += step
        svc.put_batch([DispatchRequest(p * 100, 100, t, 0, p, 0, ts, keys, uniq)])
        if (p + 1) % flush_every == 0:
            svc.flush()
    views = [f.view() for f in reversed(svc.files)]
    if empty_at is not None:
        os.makedirs(tmp / "empty")
        empty = IndexFile(str(tmp / "empty" / f"{0:020d}"), slot_num, index_num)
        assert empty.count == 1  # a file made for an entry that never came
        svc.files.append(empty)  # closed with the service
        views.insert(min(empty_at, len(views)), empty.view())
    return svc, views


def _expected(t: str, keys: list[str], views: list[IndexView], limit: int, begin: int, end: int
              ) -> dict[str, list[int]]:
    """Every entry of the key's hash (in its file's time window, as the chain walk widens it), newest
    entry first, newest file first, at most ``limit``: what walking a chain yields when store times never
    go back (then the first entry older than the window ends the chain's candidates)."""
    out: dict[str, list[int]] = {}
    for k in keys:
        h = key_hash(f"{t}#{k}")
        found: list[int] = []
        for mm, _, _, _, entries_at, count, f_begin in views:
            lo, hi = (begin - f_begin) // 1000 - 1, (end - f_begin) // 1000 + 1
            for n in range(count - 1, 0, -1):
                eh, phys, tdiff, _ = ENTRY.unpack_from(mm, entries_at + n * ENTRY_SIZE)
                if eh == h and lo <= tdiff <= hi:
                    found.append(phys)
        if found[:limit]:
            out[k] = found[:limit]
    return out


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 7), st.integers(2, 12), st.lists(request, max_size=40), st.integers(1, 6),
       st.one_of(st.none(), st.integers(0, 5)), topic, st.lists(word, max_size=8),
       st.sampled_from([0, 1, 2, 3, 1000]), st.integers(995_000, 1_100_000), st.integers(0, 60_000),
       st.booleans())
def test_index_query_matches_its_twin_on_real_files(tmp_path_factory, slot_num, index_num, reqs, flush_every,
                                                    empty_at, t, keys, limit, begin, span, forward):
    if forward:  # store times never go back: the twin finds exactly what the chains hold
        reqs = [(a, b, c, abs(step)) for a, b, c, step in reqs]
    svc, views = _build(tmp_path_factory.mktemp("idx"), slot_num, index_num, reqs, flush_every, empty_at)
    try:
        pure = twin(t, keys, views, limit, begin, begin + span)
        if forward:
            assert pure == _expected(t, keys, views, limit, begin, begin + span)
        if native is not None:
            assert native.index_query(t, keys, views, limit, begin, begin + span) == pure
    finally:
        svc.close()


def test_full_files_are_read_from_disk_and_every_key_is_found(tmp_path):
    """Several files, the full ones without a table in memory (pread), chains sharing the few slots."""
    svc = IndexService(str(tmp_path), 3, 8)
    reqs = [DispatchRequest(p * 100, 100, "T", 0, p, 0, 1_000_000 + p * 10, [f"k{p % 4}"], f"U{p}")
            for p in range(30)]
    svc.put_batch(reqs)
    svc.flush()
    files = [f.view() for f in reversed(svc.files)]
    assert sum(v[2] is None for v in files) >= 5 and files[0][2] is not None
    keys = [f"U{p}" for p in range(32)] + ["k1", "k9"]
    for fn in (twin, native.index_query) if native is not None else (twin,):
        got = fn("T", keys, files, 100, 0, 2**62)
        assert got == {**{f"U{p}": [p * 100] for p in range(30)},
                       "k1": [p * 100 for p in range(29, -1, -1) if p % 4 == 1]}
        assert fn("T", ["k1"], files, 3, 0, 2**62) == {"k1": [2900, 2500, 2100]}
        assert fn("T", keys, files, 100, 2**61, 2**62) == {}
        assert fn("U", keys, files, 100, 0, 2**62) == {}
    assert svc.query_many("T", keys, 100, 0, 2**62) == twin("T", keys, files, 100, 0, 2**62)
    svc.close()


def test_the_window_is_widened_by_a_second_each_way(tmp_path):
    """Entries are kept by whole seconds since the file's begin: a chain yields what lies within a second
    of the window (the caller checks each record's own store time), and stops at the first older one."""
    svc = IndexService(str(tmp_path), 2, 1000)
    svc.put_batch([DispatchRequest(p, 100, "T", 0, p, 0, 1_000_000 + p * 250, None, "U") for p in range(40)])
    views = [f.view() for f in svc.files]
    fns = [twin] + ([native.index_query] if native is not None else [])
    for begin in range(998_000, 1_012_000, 125):
        for span in (0, 999, 1000, 3000):
            lo, hi = (begin - 1_000_000) // 1000 - 1, (begin + span - 1_000_000) // 1000 + 1
            want = [p for p in range(39, -1, -1) if lo <= p * 250 // 1000 <= hi]
            for fn in fns:
                assert fn("T", ["U"], views, 100, begin, begin + span) == ({"U": want} if want else {}), \
                    (fn, begin, span)
    svc.close()


def _random_view(rnd: random.Random, tmp: Path, i: int) -> IndexView:
    slot_num = rnd.randint(1, 6)
    entries_at = 40 + slot_num * 4
    size = entries_at + ENTRY_SIZE * rnd.randint(0, 8) + rnd.randint(0, 19)
    data = bytearray(rnd.randbytes(size))
    for n in range(1, 9):  # chains that link back now and then, with small hashes and times
        at = entries_at + n * ENTRY_SIZE
        if at + ENTRY_SIZE <= size and rnd.random() < 0.7:
            ENTRY.pack_into(data, at, rnd.choice([key_hash(f"T#{w}") for w in WORDS[:3]] + [7]),
                            rnd.randint(-5, 1 << 40), rnd.randint(-3, 3), rnd.randint(-1, 9))
    slots = bytearray(rnd.randbytes(slot_num * 4))
    for s in range(slot_num):
        if rnd.random() < 0.8:
            slots[s * 4:s * 4 + 4] = rnd.randint(-1, 9).to_bytes(4, "big", signed=True)
    fd = -1
    if rnd.random() < 0.5:  # the table is read from the file (which may end within it: zeros)
        path = tmp / f"f{i}"
        path.write_bytes(bytes(40) + slots[:rnd.randint(0, len(slots))])
        fd = os.open(path, os.O_RDONLY)
        table: bytearray | None = None
    else:
        table = slots
    return data, fd, table, slot_num, entries_at, rnd.randint(-1, 12), rnd.randint(-5_000, 5_000)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1 << 32), st.integers(1, 4), st.lists(st.sampled_from(WORDS[:4]), max_size=5),
       st.integers(0, 5), st.integers(-10_000, 10_000), st.integers(0, 10_000))
def test_index_query_matches_its_twin_on_damaged_files(tmp_path_factory, seed, nfiles, keys, limit, begin,
                                                       span):
    """Links that point anywhere, counts past the mapping, a table the file holds only part of: the
    same candidates, and never a read past an entry that is not there."""
    rnd = random.Random(seed)
    tmp = tmp_path_factory.mktemp("bad")
    views = [_random_view(rnd, tmp, i) for i in range(nfiles)]
    try:
        assert native.index_query("T", keys, views, limit, begin, begin + span) == \
            twin("T", keys, views, limit, begin, begin + span)
    finally:
        for v in views:
            if v[1] >= 0:
                os.close(v[1])


def test_a_closed_file_is_passed_over_and_a_short_table_refused(tmp_path):
    svc = IndexService(str(tmp_path), 4, 6)
    svc.put_batch([DispatchRequest(p * 100, 100, "T", 0, p, 0, 1_000_000, None, f"U{p}") for p in range(8)])
    svc.flush()
    views = [f.view() for f in reversed(svc.files)]
    assert views[1][2] is None  # the full file: its table on disk
    closed = mmap.mmap(-1, 4096)
    closed.close()
    gone = (closed, 1 << 20, None, *views[1][3:])  # deleted meanwhile: mapping and descriptor closed
    fns = [twin] + ([native.index_query] if native is not None else [])
    keys = [f"U{p}" for p in range(8)]
    for fn in fns:
        assert fn("T", keys, [views[0], gone], 10, 0, 2**62) == fn("T", keys, views[:1], 10, 0, 2**62)
        assert fn("T", keys, [(closed, *views[0][1:])], 10, 0, 2**62) == {}
        with pytest.raises(ValueError):
            fn("T", keys, [(views[0][0], -1, bytearray(12), *views[0][3:])], 10, 0, 2**62)
        with pytest.raises(ValueError):
            fn("T", keys, [(views[0][0], -1, None, 0, *views[0][4:])], 10, 0, 2**62)
        assert fn("T", [], views, 10, 0, 2**62) == {} and fn("T", keys, [], 10, 0, 2**62) == {}
    svc.close()


def test_the_index_query_kernel_is_in_use_when_built():
    want = twin if native is None else native.index_query
    assert index.index_query is want
