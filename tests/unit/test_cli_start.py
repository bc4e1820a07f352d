"""What ``chronomq --version`` and the start's first line say about the install: which hot-path kernels
run (compiled or pure Python) and which event loop, naming at INFO how to get an optional part that is
absent."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chronomq.cli.main import main
from chronomq.cli.run import runtime_line
from chronomq.store import speedups


def test_version_names_the_kernels_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    kind = "compiled" if speedups.native is not None else "pure Python"
    assert out.startswith("chronomq 0.") and f", hot-path kernels {kind}" in out, out


def test_start_line_names_loop_and_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHRONOMQ_LOOP", raising=False)
    assert runtime_line("uvloop") == f"event loop: uvloop; hot-path kernels: {speedups.describe()}"
    assert runtime_line("asyncio").startswith(
        "event loop: asyncio (uvloop is faster: pip install 'chronomq[fast]'); hot-path kernels: ")
    monkeypatch.setenv("CHRONOMQ_LOOP", "asyncio")
    assert runtime_line("asyncio").startswith("event loop: asyncio (CHRONOMQ_LOOP=asyncio); ")


def test_start_line_says_how_to_get_compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speedups, "native", None)
    monkeypatch.delenv(speedups.PURE_ENV, raising=False)
    assert runtime_line("uvloop").endswith(
        "hot-path kernels: pure Python (not built); pip builds the compiled ones where a C compiler and "
        "Python's headers are installed")
    monkeypatch.setenv(speedups.PURE_ENV, "1")
    assert runtime_line("uvloop").endswith("hot-path kernels: pure Python (CHRONOMQ_PURE_PYTHON set)")


def test_start_parses_its_line_without_importing_the_admin_verbs_or_the_client() -> None:
    # a restart after a crash pays for every import: the admin verbs (and the client they use) load only
    # when the command line names them
    code = ("import sys; from chronomq.cli.main import build_parser; "
            "a = build_parser({argv}).parse_args({argv}); "
            "print(a.command, 'chronomq.client' in sys.modules, 'chronomq.cli.admin' in sys.modules)")
    for argv, want in ((["start", "--data-dir", "d"], "start False False"),
                       (["admin", "topics", "-n", "127.0.0.1:9876"], "admin True True")):
        r = subprocess.run([sys.executable, "-c", code.format(argv=argv)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == want.split()
