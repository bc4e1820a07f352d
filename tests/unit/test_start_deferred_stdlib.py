"""Standard modules ``chronomq start`` needs only on rare paths are not loaded before its ready line, on a
fresh store and on a restart after a crash (kill -9): uuid and platform, which it imports (the timer makes
a UNIQ_KEY for a timed message that came without one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port
from tests.unit.test_start_lazy_imports import _CHILD

DEFERRED = ("uuid", "platform")


def _loaded_at_ready(data_dir: Path) -> set[str]:
    argv = ["start", "--data-dir", str(data_dir), "--host", "127.0.0.1", "--namesrv-port", str(free_port()),
            "--broker-port", str(free_port())]
    for key, value in {"grpcListenPort": "-1", "metricsPort": "-1", "haListenPort": str(free_port())}.items():
        argv += ["--set", f"{key}={value}"]
    r = subprocess.run([sys.executable, "-c", _CHILD.format(optional=DEFERRED, argv=argv)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("loaded")]
    assert lines, r.stdout + r.stderr[-3000:]
    return set(lines[0].split()[1:])


def test_rarely_needed_standard_modules_are_not_loaded_by_a_start_or_a_crash_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert _loaded_at_ready(data) == set()  # the child ends with os._exit at its ready line: a crash
    assert (data / "abort").exists()
    assert _loaded_at_ready(data) == set()


def test_the_check_sees_a_module_the_start_does_load(tmp_path: Path) -> None:
    # the other side: the same child reports a module a start imports (json: the config files)
    argv = ["start", "--data-dir", str(tmp_path / "d"), "--host", "127.0.0.1", "--namesrv-port",
            str(free_port()), "--broker-port", str(free_port()), "--set", "grpcListenPort=-1", "--set",
            "metricsPort=-1", "--set", f"haListenPort={free_port()}"]
    r = subprocess.run([sys.executable, "-c", _CHILD.format(optional=("json",), argv=argv)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "loaded json" in r.stdout.splitlines(), r.stdout + r.stderr[-3000:]
