"""Standard modules ``chronomq start`` needs only on rare paths are not loaded before its ready line, on a
fresh store and on a restart after a crash (kill -9): uuid and platform, which it imports (the timer makes
a UNIQ_KEY for a timed message that came without one)."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_start_lazy_imports import _loaded_at_ready

DEFERRED = ("uuid", "platform")


def test_rarely_needed_standard_modules_are_not_loaded_by_a_start_or_a_crash_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # the child ends with os._exit at its ready line: to the store, a crash
    assert _loaded_at_ready(data, DEFERRED, metricsPort="-1") == set()
    assert (data / "abort").exists()
    assert _loaded_at_ready(data, DEFERRED, metricsPort="-1") == set()


def test_the_check_sees_a_module_the_start_does_load(tmp_path: Path) -> None:
    # the other side: the same child reports a module a start imports (json: the config files)
    assert _loaded_at_ready(tmp_path / "d", ("json",), metricsPort="-1") == {"json"}
