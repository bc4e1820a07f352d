"""SIGKILL a SYNC_FLUSH writer process mid-load (twice); after restart the store holds every message
whose put returned, each readable, CRC-valid and intact, no duplicates, and consistent queues."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.message import decode_record
from chronomq.store import MessageStore
from tests.integration.store_crash_writer import body_for

WRITER = Path(__file__).with_name("store_crash_writer.py")
REPO = Path(__file__).resolve().parents[2]


def run_and_kill(root: Path, run: int, acks_wanted: int) -> set[str]:
    proc = subprocess.Popen([sys.executable, str(WRITER), str(root), str(run), "16", "20000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    acked: set[str] = set()
    deadline = time.monotonic() + 90
    try:
        assert proc.stdout.readline().strip() == b"READY", proc.stderr.read().decode()
        while len(acked) < acks_wanted and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(b"A ") and line.endswith(b"\n"):
                acked.add(line[2:-1].decode())
        assert len(acked) >= acks_wanted, proc.stderr.read().decode()
        os.kill(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read()  # acks already written to the pipe before the kill count too
    finally:
        proc.kill()
        proc.wait(30)
    for line in rest.split(b"\n"):
        if line.startswith(b"A ") and line[2:]:
            acked.add(line[2:].decode())  # the last line may be cut: then the key is not complete
    assert proc.returncode == -signal.SIGKILL
    return {a for a in acked if a.count("-") == 2}


def verify(root: Path, acked: set[str]) -> int:
    cfg = BrokerConfig(storePathRootDir=str(root), mappedFileSizeCommitLog=1 << 20,
                       mappedFileSizeConsumeQueue=20 * 1000, maxHashSlotNum=1024, maxIndexNum=4096,
                       diskMaxUsedSpaceRatio=95)
    store = MessageStore(cfg, SystemClock())
    store.start()
    try:
        assert store.recovered_abnormally
        seen: dict[str, int] = {}
        per_queue: dict[int, list[int]] = {}
        for m in store.iter_messages(0):
            raw = store.read_record(m.commit_log_offset)
            decode_record(raw, check_crc=True)
            assert m.body == body_for(m.uniq_key), f"damaged body for {m.uniq_key}"
            assert m.uniq_key not in seen, f"duplicate {m.uniq_key}"
            seen[m.uniq_key] = m.commit_log_offset
            per_queue.setdefault(m.queue_id, []).append(m.commit_log_offset)
        missing = acked - seen.keys()
        assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:3]}"
        for q, offs in per_queue.items():
            assert store.get_min_offset_in_queue("CrashTopic", q) == 0
            assert store.get_max_offset_in_queue("CrashTopic", q) == len(offs)
            units = store.get_cq_units("CrashTopic", q, 0, len(offs) + 10)
            assert [u.commit_log_offset for u in units] == offs
        for uniq in sorted(acked)[:: max(1, len(acked) // 50)]:
            [hit] = store.query_message("CrashTopic", uniq, 5, 0, 2**62)
            assert hit.commit_log_offset == seen[uniq]
        return len(seen)
    finally:
        store.shutdown()


def test_sigkill_writer_mid_load_loses_no_acknowledged_message(tmp_path):
    root = tmp_path / "store"
    acked1 = run_and_kill(root, 1, 1500)
    n1 = verify(root, acked1)
    assert n1 >= len(acked1)
    acked2 = run_and_kill(root, 2, 1500)
    n2 = verify(root, acked1 | acked2)
    assert n2 >= n1 + len(acked2)
