"""Checks of the harness and the drivers' argument handling (no broker needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compat.harness import ChronomqProcess, DriverError, run_driver

pytestmark = pytest.mark.compat


def test_official_client_loads(official_client: str) -> None:
    import subprocess

    code = "import rocketmq.client, rocketmq.ffi; print(rocketmq.ffi._DYLIB_PATH)"
    r = subprocess.run([official_client, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("librocketmq.so")


@pytest.mark.parametrize(("name", "args", "error"), [
    ("produce", {"mode": "sync"}, "missing arguments: namesrv"),
    ("produce", {"namesrv": "127.0.0.1:1", "mode": "sideways", "messages": []}, "mode must be one of"),
    ("produce", {"namesrv": "127.0.0.1:1"}, "give messages or generate"),
    ("produce", {"namesrv": "127.0.0.1:1", "batch_size": 0, "messages": []}, "batch_size must be >= 1"),
    ("push_consume", {"namesrv": "127.0.0.1:1", "group": "g"}, "missing arguments: topic"),
    ("push_consume", {"namesrv": "127.0.0.1:1", "group": "g", "topic": "t", "fail": {"mode": "explode"}},
     "fail.mode must be"),
    ("pull_consume", {"namesrv": "127.0.0.1:1", "group": "g", "topic": "t", "max_num": 0},
     "max_num must be in"),
    ("no_such_driver", {}, "no driver named"),
])
def test_driver_rejects_bad_arguments(official_client: str, name: str, args: dict, error: str) -> None:
    with pytest.raises(DriverError, match=error):
        run_driver(name, args, timeout=30)


def test_process_reports_early_exit(tmp_path: Path) -> None:
    # a config override that no broker accepts must fail start() with the log, not hang
    p = ChronomqProcess(tmp_path / "data", {"flushDiskType": "SOMETIMES"})
    try:
        with pytest.raises(RuntimeError, match=r"exited with code .* before it was ready(.|\n)*flushDisk"):
            p.start(timeout=20)
        assert not p.running
    finally:
        p.stop(kill=True)


def test_a_client_crash_in_shutdown_keeps_only_a_flagged_result() -> None:
    from tests.compat.harness import _accept_shutdown_crash

    out = 'noise\n{"acked": 3, "before_shutdown": true}\n'
    kept = _accept_shutdown_crash("produce", out, "terminate called ... thread_interrupted", -6)
    assert kept is not None and kept["acked"] == 3 and "signal 6" in kept["client_shutdown_crash"]
    assert _accept_shutdown_crash("produce", '{"acked": 3}\n', "", -6) is None  # not flagged
    assert _accept_shutdown_crash("produce", out, "", 1) is None  # an ordinary failure stays a failure
    assert _accept_shutdown_crash("produce", "", "", -6) is None  # no result at all
