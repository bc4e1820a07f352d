from __future__ import annotations

import threading

from chronomq.store.atomicfile import write_atomic


def test_replaces_content_and_keeps_backup(tmp_path) -> None:
    p = tmp_path / "sub" / "state.json"
    write_atomic(p, b"one")
    assert p.read_bytes() == b"one"
    write_atomic(p, b"two", backup=True)
    assert p.read_bytes() == b"two"
    assert (tmp_path / "sub" / "state.json.bak").read_bytes() == b"one"
    assert not (tmp_path / "sub" / "state.json.tmp").exists()


def test_concurrent_writers_of_one_path_never_race(tmp_path) -> None:
    # Two threads saving the same file used to collide on the shared temp file (FileNotFoundError on
    # the rename); the per-path lock serialises them.
    p = tmp_path / "delayOffset.json"
    errors: list[BaseException] = []

    def writer(tag: bytes) -> None:
        try:
            for i in range(200):
                write_atomic(p, tag + str(i).encode(), backup=True)
        except BaseException as e:  # pragma: no cover - the failure being tested for
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in (b"a", b"b", b"c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert p.read_bytes() in {b"a199", b"b199", b"c199"}


def test_a_damaged_file_is_read_from_its_backup_and_both_damaged_refuse(tmp_path, caplog) -> None:
    # A damaged consumerOffset.json used to be set aside and the broker started with no offsets at all
    # (it kept no backup to fall back to); a damaged timer checkpoint refused to open, topics.json of
    # the timer raised a bare ValueError.
    import json

    import pytest

    from chronomq.broker.offsets import ConsumerOffsetManager
    from chronomq.config import ConfigError
    from chronomq.delay.timer import TimerStore

    o = ConsumerOffsetManager(tmp_path)
    for v in (5, 6):
        o.commit("g", "t", 0, v)
        o.persist()
    (tmp_path / "consumerOffset.json").write_bytes(b'{"offsetTable": {"t@g": {"0": 6')
    with caplog.at_level("WARNING"):
        assert ConsumerOffsetManager(tmp_path).query("g", "t", 0) == 5
    assert any("consumerOffset.json.bak" in r.getMessage() for r in caplog.records)
    (tmp_path / "consumerOffset.json.bak").write_bytes(b"\0\0")
    with pytest.raises(ConfigError, match=r"consumerOffset\.json\.bak"):
        ConsumerOffsetManager(tmp_path)

    from chronomq.clock import VirtualClock

    root = tmp_path / "timer"
    t = TimerStore(root, VirtualClock())
    t.open()
    t.flush()
    t.close()
    good = json.loads((root / "checkpoint.json").read_text())
    (root / "checkpoint.json").write_bytes(b'{"seq": 3, "wat')
    t = TimerStore(root, VirtualClock())
    t.open()  # from checkpoint.json.bak, as after a crash
    assert not t.recovered_clean and good["seq"] > 0
    t.close()
    (root / "checkpoint.json").write_bytes(b"")
    (root / "checkpoint.json.bak").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"checkpoint\.json"):
        TimerStore(root, VirtualClock()).open()
