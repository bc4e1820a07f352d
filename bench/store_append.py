"""Store append benchmark: in-process puts of 1 KiB messages into chronomq.store.MessageStore.

Prints msgs/s and MB/s for ASYNC_FLUSH (one writer; the dispatcher builds queue and index entries in its
own thread, and the figure counts until everything is dispatched) and SYNC_FLUSH with 1, 16 and 64
concurrent writer threads (each put waits for its group commit), next to raw rates of the same bytes
measured in the same run on the same disk:
  raw seq      sequential os.write of 64 KiB chunks, one fdatasync at the end (the ceiling for async)
  raw sync/W   W records written then one fdatasync, repeated (ideal group commit for W writers)
and a quick mmap-versus-pwrite comparison (the choice recorded in docs/store.md).

    .venv/bin/python bench/store_append.py            # default run, well under 2 minutes
    .venv/bin/python bench/store_append.py --long     # 5x the messages and longer sync phases
    .venv/bin/python bench/store_append.py --dir /path/on/another/disk
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.message import MessageExt
from chronomq.store import MessageStore

BODY = b"m" * 1024
TOPIC = "BenchTopic"


def message(i: int, qid: int) -> MessageExt:
    return MessageExt(topic=TOPIC, body=BODY, queue_id=qid,
                      properties={"TAGS": "TagA", "UNIQ_KEY": f"7F0000010000{i:020X}"},
                      born_timestamp=1_700_000_000_000, born_host=("127.0.0.1", 40000))


def record_size() -> int:
    from chronomq.message import encode_record

    return len(encode_record(message(0, 0)))


def fmt(name: str, msgs: float, rec: int, raw_mbs: float | None = None, extra: str = "") -> str:
    mbs = msgs * rec / 1e6
    ratio = f"  {mbs / raw_mbs * 100:6.1f}% of raw" if raw_mbs else ""
    return f"{name:<34} {msgs:>11,.0f} msgs/s {mbs:>9.1f} MB/s{ratio}{extra}"


# --- raw rates ----------------------------------------------------------------------------------------
def raw_seq(path: str, total: int) -> float:
    chunk = b"r" * (64 * 1024)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t = time.perf_counter()
    done = 0
    while done < total:
        done += os.write(fd, chunk)
    os.fdatasync(fd)
    dt = time.perf_counter() - t
    os.close(fd)
    os.unlink(path)
    return done / dt / 1e6


def raw_group_sync(path: str, rec: int, group: int, seconds: float) -> float:
    data = b"s" * (rec * group)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t = time.perf_counter()
    done = 0
    while time.perf_counter() - t < seconds:
        done += os.write(fd, data)
        os.fdatasync(fd)
    dt = time.perf_counter() - t
    os.close(fd)
    os.unlink(path)
    return done / dt / 1e6


def mmap_vs_pwrite(path: str, rec: int, n: int) -> list[str]:
    size = rec * n + 4096
    data = b"p" * rec
    out = []
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)  # as the store does (blocks allocated ahead)
    mm = mmap.mmap(fd, size)
    t = time.perf_counter()
    pos = 0
    for _ in range(n):
        mm[pos : pos + rec] = data
        pos += rec
    dt = time.perf_counter() - t
    out.append(f"  mmap slice copy per record      {n * rec / dt / 1e6:8.0f} MB/s  "
               f"{dt / n * 1e6:6.2f} us/record")
    mm.close()
    os.ftruncate(fd, 0)
    os.ftruncate(fd, size)
    t = time.perf_counter()
    pos = 0
    for _ in range(n):
        os.pwrite(fd, data, pos)
        pos += rec
    dt = time.perf_counter() - t
    out.append(f"  os.pwrite per record            {n * rec / dt / 1e6:8.0f} MB/s  "
               f"{dt / n * 1e6:6.2f} us/record")
    os.ftruncate(fd, 0)
    os.ftruncate(fd, size)
    t = time.perf_counter()
    pos = 0
    buf = bytearray()
    for _ in range(n):
        buf += data
        if len(buf) >= 64 * 1024:
            os.pwrite(fd, buf, pos)
            pos += len(buf)
            buf.clear()
    os.pwrite(fd, buf, pos)
    dt = time.perf_counter() - t
    out.append(f"  buffered pwrite, 64 KiB batches {n * rec / dt / 1e6:8.0f} MB/s  "
               f"{dt / n * 1e6:6.2f} us/record")
    os.close(fd)
    os.unlink(path)
    return out


# --- store runs -------------------------------------------------------------------------------------
def new_store(root: str, flush: str) -> MessageStore:
    shutil.rmtree(root, ignore_errors=True)
    cfg = BrokerConfig(storePathRootDir=root, flushDiskType=flush, mappedFileSizeCommitLog=1 << 30)
    s = MessageStore(cfg, SystemClock())
    s.start()
    return s


def run_async(root: str, n: int) -> tuple[float, float]:
    s = new_store(root, "ASYNC_FLUSH")
    try:
        msgs = [message(i, i & 3) for i in range(n)]  # built outside the timing
        put = s.put_message
        t = time.perf_counter()
        for m in msgs:
            put(m)
        t_put = time.perf_counter() - t
        assert s.wait_dispatched(s.max_phy_offset, 120), "dispatch did not finish"
        t_all = time.perf_counter() - t
        assert s.get_max_offset_in_queue(TOPIC, 0) == (n + 3) // 4
        return n / t_put, n / t_all
    finally:
        s.shutdown()


def run_sync(root: str, writers: int, seconds: float) -> float:
    s = new_store(root, "SYNC_FLUSH")
    counts = [0] * writers
    start = threading.Barrier(writers + 1)
    stop_at = [0.0]

    def writer(k: int) -> None:
        base = k * 10_000_000
        start.wait()
        i = 0
        while time.perf_counter() < stop_at[0] and i < 10_000_000:  # bounded
            r = s.put_message_and_wait(message(base + i, k & 3))
            if not r.ok:
                raise RuntimeError(r.error or r.status.value)
            i += 1
        counts[k] = i

    try:
        threads = [threading.Thread(target=writer, args=(k,)) for k in range(writers)]
        for t in threads:
            t.start()
        stop_at[0] = time.perf_counter() + seconds
        t0 = time.perf_counter()
        start.wait()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        return sum(counts) / dt
    finally:
        s.shutdown()


def calibration() -> str:
    """How fast this Python runs right now (a shared or loaded box makes every figure smaller)."""
    t = time.perf_counter()
    c = time.process_time()
    x = 0
    for i in range(5_000_000):
        x += i
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    try:
        load = "load avg " + " ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        load = "load avg unknown"
    return (f"calibration: 5M-iteration Python loop {wall:.2f} s wall, {cpu:.2f} s cpu "
            f"(~0.2 s on an idle modern core); {load}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", action="store_true", help="5x the messages, 20 s per sync phase")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--async-msgs", type=int, default=None)
    ap.add_argument("--sync-seconds", type=float, default=None)
    args = ap.parse_args()
    n_async = args.async_msgs or (1_000_000 if args.long else 200_000)
    sync_s = args.sync_seconds or (20.0 if args.long else 6.0)
    base = tempfile.mkdtemp(prefix="chronomq-bench-", dir=args.dir)
    try:
        rec = record_size()
        root = os.path.join(base, "store")
        raw = os.path.join(base, "raw")
        print(f"chronomq store append benchmark: {os.cpu_count()} cpus, python {sys.version.split()[0]}, "
              f"record {rec} bytes (1 KiB body + TAGS + UNIQ_KEY), dir {base}")
        print(calibration())
        print("mmap vs pwrite (same record, 50,000 times):")
        for line in mmap_vs_pwrite(raw, rec, 50_000):
            print(line)
        raw_mbs = raw_seq(raw, n_async * rec)
        print(fmt("raw seq write (+1 fdatasync)", raw_mbs * 1e6 / rec, rec))
        pr, pa = run_async(root, n_async)
        print(fmt(f"ASYNC_FLUSH put, 1 writer ({n_async:,})", pr, rec, raw_mbs))
        print(fmt("ASYNC_FLUSH put + dispatch", pa, rec, raw_mbs, "   (target >= 150,000)"))
        for w in (1, 16, 64):
            raw_w = raw_group_sync(raw, rec, w, min(3.0, sync_s / 2))
            print(fmt(f"raw {w} records + fdatasync", raw_w * 1e6 / rec, rec))
            rate = run_sync(root, w, sync_s)
            target = "   (target >= 40,000)" if w == 64 else ""
            print(fmt(f"SYNC_FLUSH, {w} writer threads", rate, rec, raw_mbs,
                      f"  {rate * rec / 1e6 / raw_w * 100:5.1f}% of raw {w}+fdatasync{target}"))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
