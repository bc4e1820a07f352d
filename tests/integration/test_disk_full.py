"""A broker whose data directory fills up: sends (single, batch, timed) are refused with
SERVICE_NOT_AVAILABLE and RocketMQ's remark, the process stays up, pulls keep working, delayed messages
that come due meanwhile are delivered once space returns (never early, never lost), sends resume by
themselves, and a restart finds every acknowledged message intact.

Two paths: as root, the data directory is an 8 MiB tmpfs filled for real (the "disk full" flag is set
to 100% so that only a real ENOSPC refuses; a 1 MiB filler file written first is what an operator
deletes to give space back); where mounting is refused, the disk use is read from
``diskUsageProbeFile`` and pushed past diskSpaceWarningLevelRatio.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
import warnings
from pathlib import Path

from chronomq.message import decode_records
from chronomq.remoting.codec import BatchItem, encode_batch_body
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C
from tests.compat.harness import ChronomqProcess
from tests.conftest import wait_for
from tests.integration.rawclient import RawClient, send_ext
from tests.integration.test_broker_process import _pull_everything

REMARK = ("service not available now. It may be caused by one of the following reasons: the broker's disk "
          "is full [CL: ")
QUEUES = 4
BIG = 30_000


def _now() -> int:
    return int(time.time() * 1000)


def _mount_tmpfs(mnt: Path) -> str | None:
    """Mount an 8 MiB tmpfs at ``mnt``; None when done, else why not."""
    if os.geteuid() != 0:
        return "not root"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def _max_offsets(b: RawClient, topic: str) -> int:
    return sum(int(b.request(R.GET_MAX_OFFSET, {"topic": topic, "queueId": q}).ext_fields["offset"])
               for q in range(QUEUES))


def _send(b: RawClient, acked: dict, body: bytes, queue: int):
    r = b.send_message("FullT", body, queue)
    if r.code == C.SUCCESS:
        acked[(queue, int(r.ext_fields["queueOffset"]))] = hashlib.sha1(body).hexdigest()
    return r


def _assert_intact(b: RawClient, acked: dict) -> None:
    got = {(m.queue_id, m.queue_offset): hashlib.sha1(m.body).hexdigest()
           for m in _pull_everything(b, "FullT", QUEUES)}
    assert {k: got.get(k) for k in acked} == acked


def _delivered(b: RawClient, topic: str) -> list:
    return [m for q in range(QUEUES) for m in decode_records(b.pull("G", topic, q, 0).body or b"")]


def test_full_disk_refuses_sends_keeps_reads_and_resumes(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    why_not = _mount_tmpfs(mnt)
    real = why_not is None
    probe = tmp_path / "disk-use"
    overrides = {"mappedFileSizeCommitLog": str(1 << 20), "mappedFileSizeConsumeQueue": "20000",
                 "maxHashSlotNum": "1000", "maxIndexNum": "4000", "timerDataSegmentSize": str(256 * 1024),
                 "cleanResourceInterval": "100", "cleanFileForciblyEnable": "false",
                 "messageDelayLevel": "1s 3s 10s"}
    if real:
        print(f"disk-full test: real 8 MiB tmpfs at {mnt}")
        overrides.update(diskSpaceWarningLevelRatio="100", diskSpaceCleanForciblyRatio="95")
        data = mnt  # the broker's log goes next to it, off the full file system
    else:
        warnings.warn(f"disk-full test: cannot mount a tmpfs ({why_not}); diskUsageProbeFile pressure "
                      "instead of a full file system", stacklevel=1)
        probe.write_text("10")
        overrides["diskUsageProbeFile"] = str(probe)
        data = tmp_path / "data"
    server = ChronomqProcess(data, overrides)
    server.env = {"PYTHONFAULTHANDLER": "1"}  # a SIGBUS shows where, in the log the failure quotes
    filler = data / "filler"
    acked: dict[tuple[int, int], str] = {}
    try:
        server.start()
        if real:
            filler.write_bytes(bytes(1 << 20))
        with RawClient(server.broker_addr) as b:
            # parked before the fill; they come due while the disk is full
            t_level = _now()
            assert b.send_message("FullDelayT", b"d" * 1000, 0, {"DELAY": "2"}).code == C.SUCCESS  # 3 s
            due = _now() + 3000
            r = b.send_message("FullTimerT", b"t" * 1000, 0, {"TIMER_DELIVER_MS": str(due)})
            assert r.code == C.SUCCESS, r.remark

            # fill: acknowledged sends until the broker refuses one
            refused = None
            if real:
                for size in (BIG, 2000, 200):  # the last ones leave the segment less than a re-put needs
                    for i in range(1000):
                        r = _send(b, acked, os.urandom(size), i % QUEUES)
                        if r.code != C.SUCCESS:
                            refused = refused or r
                            break
                    else:
                        raise AssertionError("an 8 MiB file system took 1000 more messages")
                wait_for(lambda: _max_offsets(b, "FullT") == len(acked), message="dispatch")
                st = os.statvfs(data)
                assert st.f_bavail * st.f_frsize < 64 * 1024, "the file system is not full"
            else:
                for i in range(20):
                    assert _send(b, acked, os.urandom(BIG), i % QUEUES).code == C.SUCCESS
                probe.write_text("95")
                refused = wait_for(lambda: (lambda r: r if r.code != C.SUCCESS else None)(
                    _send(b, acked, os.urandom(BIG), 0)), message="a refused send")
            assert refused.code == C.SERVICE_NOT_AVAILABLE and refused.remark.startswith(REMARK), \
                refused.remark
            n_acked = len(acked)

            # while full: every kind of send is refused cleanly (as far as space allows: these do not
            # fit what is left), the broker stays up, reads work
            r = _send(b, acked, b"s" * 2000, 1)
            assert r.code == C.SERVICE_NOT_AVAILABLE and r.remark.startswith(REMARK), r.remark
            items = [BatchItem(body=b"b" * 2000, properties={}) for _ in range(3)]
            r = b.request(R.SEND_BATCH_MESSAGE, send_ext("FullT", 2, batch=True), encode_batch_body(items))
            assert r.code == C.SERVICE_NOT_AVAILABLE and r.remark.startswith(REMARK), r.remark
            r = b.send_message("FullTimerT", b"l" * 2000, 0, {"TIMER_DELAY_SEC": "2"})
            assert r.code == C.SERVICE_NOT_AVAILABLE and r.remark.startswith(REMARK), r.remark
            assert len(acked) == n_acked
            _assert_intact(b, acked)
            wait_for(lambda: _now() > due + 1500, timeout=20, message="the delayed messages' due time")
            if real:  # no room for their re-puts: they wait, they are not lost
                assert _delivered(b, "FullDelayT") == [] and _delivered(b, "FullTimerT") == []
            assert server.running

        if real:  # a crash while the disk is full: it starts again on the full disk and serves reads
            server.stop(kill=True)
            server.start()
        with RawClient(server.broker_addr) as b:
            _assert_intact(b, acked)
            r = _send(b, acked, b"s" * 2000, 1)
            assert r.code == C.SERVICE_NOT_AVAILABLE and r.remark.startswith(REMARK), r.remark

            # space returns: sends resume without a restart, the delayed messages are delivered once
            if real:
                filler.unlink()
            else:
                probe.write_text("50")
            wait_for(lambda: _send(b, acked, b"after", 3).code == C.SUCCESS, timeout=15, interval=0.05,
                     message="sends to resume")
            (lv,) = wait_for(lambda: _delivered(b, "FullDelayT"), timeout=15, message="the level delivery")
            (tm,) = wait_for(lambda: _delivered(b, "FullTimerT"), timeout=15, message="the timer delivery")
            assert lv.body == b"d" * 1000 and lv.store_timestamp >= t_level + 3000
            assert tm.body == b"t" * 1000 and tm.store_timestamp >= due
        print(f"disk-full figures: path={'tmpfs 8 MiB' if real else 'probe'} acked_before_full={n_acked} "
              f"refused_first={refused.remark[len(REMARK) - 5:][:120]!r} "
              f"acked_total={len(acked)}")

        # restart on the same data: every acknowledged message intact, each delayed one delivered once
        assert server.stop() == 0
        server.start()
        with RawClient(server.broker_addr) as b:
            _assert_intact(b, acked)
            assert len(_delivered(b, "FullDelayT")) == 1 and len(_delivered(b, "FullTimerT")) == 1
            assert _send(b, acked, b"after restart", 0).code == C.SUCCESS
    finally:
        server.stop()
        if real:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
