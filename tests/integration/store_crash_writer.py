"""Subprocess writer for test_store_crash.py: puts messages under SYNC_FLUSH from several threads and
prints "A <uniq key>" for every put that returned flushed; the test SIGKILLs it mid-load.

usage: store_crash_writer.py ROOT RUN_ID THREADS MAX_PER_THREAD
"""

from __future__ import annotations

import hashlib
import sys
import threading

from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.message import MessageExt
from chronomq.store import MessageStore


def body_for(uniq: str) -> bytes:
    seed = hashlib.sha256(uniq.encode()).digest()
    return seed * (1 + seed[0] % 90)  # 32 .. 2880 bytes, derived from the key alone


def main() -> None:
    root, run, threads, per_thread = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = BrokerConfig(storePathRootDir=root, flushDiskType="SYNC_FLUSH", mappedFileSizeCommitLog=1 << 20,
                       mappedFileSizeConsumeQueue=20 * 1000, maxHashSlotNum=1024, maxIndexNum=4096,
                       diskMaxUsedSpaceRatio=95)
    store = MessageStore(cfg, SystemClock())
    store.start()
    out_lock = threading.Lock()
    print("READY", flush=True)

    def writer(k: int) -> None:
        for i in range(per_thread):
            uniq = f"R{run}-{k}-{i}"
            m = MessageExt(topic="CrashTopic", body=body_for(uniq), queue_id=(k + i) % 4,
                           properties={"UNIQ_KEY": uniq, "KEYS": f"w{k}"})
            r = store.put_message_and_wait(m)
            if r.ok:
                with out_lock:
                    sys.stdout.write(f"A {uniq}\n")
                    sys.stdout.flush()

    ts = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print("DONE", flush=True)
    store.shutdown()


if __name__ == "__main__":
    main()
