"""Every ```python example in docs/client.md, and README.md's "A first look", runs unchanged but for the
name-server address against a fresh `chronomq start` (fast delay levels so the retry example does not wait
10 s); docs/timer.md's runnable example runs as it is (it builds its own store in a temporary directory)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compat.harness import ChronomqProcess

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "client.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
FIRST_LOOK = re.search(r"## A first look.*?```python\n(.*?)```", (REPO / "README.md").read_text(),
                       flags=re.S)
TIMER_EXAMPLE = re.search(r"### Runnable example.*?```python\n(.*?)```",
                          (REPO / "docs" / "timer.md").read_text(), flags=re.S)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env,
                          cwd=REPO)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    p = ChronomqProcess(tmp_path_factory.mktemp("docs") / "data",
                        {"messageDelayLevel": "200ms 200ms 200ms 200ms 200ms 200ms"})
    p.start()
    try:
        yield p
    finally:
        p.stop()


def test_doc_has_examples() -> None:
    assert len(EXAMPLES) >= 7


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_doc_example_runs(server: ChronomqProcess, index: int) -> None:
    r = _run(EXAMPLES[index].replace("127.0.0.1:9876", server.namesrv_addr))
    assert r.returncode == 0, f"example {index} failed:\n{EXAMPLES[index]}\n--- stderr:\n{r.stderr[-3000:]}"


def test_readme_first_look_runs(server: ChronomqProcess) -> None:
    assert FIRST_LOOK is not None
    r = _run(FIRST_LOOK.group(1).replace("127.0.0.1:9876", server.namesrv_addr))
    assert r.returncode == 0, r.stderr[-3000:]
    ids, outcome = r.stdout.splitlines()
    assert len(ids.split()) == 3 and outcome == "CANCELLED"


def test_timer_doc_example_runs() -> None:
    assert TIMER_EXAMPLE is not None
    r = _run(TIMER_EXAMPLE.group(1))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[1:] == ["Outcome.CANCELLED", "1 pending", "b'pay reminder' True"], r.stdout
