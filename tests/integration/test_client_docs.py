"""Every ```python example in docs/client.md runs, unchanged but for the name-server address, against a
fresh `chronomq start` (fast delay levels so the retry example does not wait 10 s)."""

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
    code = EXAMPLES[index].replace("127.0.0.1:9876", server.namesrv_addr)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env,
                       cwd=REPO)
    assert r.returncode == 0, f"example {index} failed:\n{EXAMPLES[index]}\n--- stderr:\n{r.stderr[-3000:]}"
