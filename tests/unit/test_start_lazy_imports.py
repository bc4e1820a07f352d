"""What ``chronomq start`` loads: a feature that is off costs its start nothing, not even its import (a
restart after a crash pays for every module loaded before the ready line). Each case runs the real start
in a fresh interpreter and lists, at its ready line, which of the optional parts are in sys.modules, and
whether the garbage collector (off while the start runs) is on again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port

# the parts a broker loads only when its configuration or a request asks for them (chronomq.metrics itself
# is only the lateness buckets: its endpoint is chronomq.metrics.prometheus)
OPTIONAL = ("chronomq.acl", "chronomq.metrics.prometheus", "prometheus_client", "chronomq.filter",
            "chronomq.filter.sql92", "chronomq.grpc", "chronomq.client", "chronomq.cli.admin", "chronomq.web")

_CHILD = """
import gc, os, sys
from chronomq.cli.main import main
write = sys.stdout.write
def at_ready(text):
    if text.startswith("chronomq ready"):
        write(f"collector {{gc.isenabled()}} {{gc.get_freeze_count() > 0}}\\n")
        write("loaded " + " ".join(m for m in {optional!r} if m in sys.modules) + "\\n")
        sys.stdout.flush()
        os._exit(0)
    return write(text)
sys.stdout.write = at_ready
sys.exit(main({argv!r}))
"""


def _loaded_at_ready(data_dir: Path, optional: tuple[str, ...] = OPTIONAL, **settings: str) -> set[str]:
    """Which of ``optional`` a real start on ``data_dir`` has loaded when it prints its ready line (the
    child then ends at once, with os._exit: to the store, a crash)."""
    argv = ["start", "--data-dir", str(data_dir), "--host", "127.0.0.1", "--namesrv-port", str(free_port()),
            "--broker-port", str(free_port())]
    for key, value in {"grpcListenPort": "-1", "haListenPort": str(free_port()), **settings}.items():
        argv += ["--set", f"{key}={value}"]
    r = subprocess.run([sys.executable, "-c", _CHILD.format(optional=optional, argv=argv)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("loaded")]
    assert lines, r.stdout + r.stderr[-3000:]
    # the collector is on again at the ready line, what the start made frozen out of its reach
    assert "collector True True" in r.stdout.splitlines(), r.stdout
    return set(lines[0].split()[1:])


def test_a_start_with_acl_metrics_grpc_and_filters_off_loads_none_of_them(tmp_path: Path) -> None:
    assert _loaded_at_ready(tmp_path / "data", metricsPort="-1") == set()


def test_a_start_with_metrics_on_loads_them_and_nothing_else(tmp_path: Path) -> None:
    # the other side of the check above: what a start does use is seen loaded
    assert _loaded_at_ready(tmp_path / "data", metricsPort=str(free_port())) == {
        "chronomq.metrics.prometheus", "prometheus_client"}
