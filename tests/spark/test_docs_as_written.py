"""The Spark commands of the docs, run the way a user runs them: a fresh Python process with no
PYSPARK_PYTHON, PYSPARK_DRIVER_PYTHON or PYTHONPATH set (the suite's own session sets all three), so
Spark's workers start with whatever the data source chooses (chronomq.spark.worker_python). The code is
taken from the documents themselves; only the name server's address and the work paths are the test's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parents[2]
USER_ENV_DROPS = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A broker of this module's own, with the default delay levels, as a user's `chronomq start`: the
    documents' topics (orders, order_checks) are not shared with the suite's other tests."""
    from tests.compat.harness import ChronomqProcess

    p = ChronomqProcess(tmp_path_factory.mktemp("as_written") / "data")
    p.start(timeout=60)
    yield p
    p.stop(timeout=30)


def user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in USER_ENV_DROPS}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if Path(p).resolve() != Path(sys.executable).parent.resolve())
    return env  # `python3` on PATH is now not the project's interpreter, as in a user's shell


def python_blocks(md: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", md.read_text(encoding="utf-8"), flags=re.S)


def block_with(blocks: list[str], *needles: str) -> str:
    found = [b for b in blocks if all(n in b for n in needles)]
    assert found, f"no python block of the document has {needles}"
    return found[0]


def test_python3_on_the_users_path_lacks_chronomq() -> None:
    # the premise of this module: a worker started with PATH's python3 could not import chronomq
    out = subprocess.run(["python3", "-c", "import chronomq"], env=user_env(), capture_output=True, text=True,
                         timeout=60)
    if out.returncode == 0:
        pytest.skip("python3 on PATH has chronomq installed: the trap this module checks is not there")
    assert "No module named 'chronomq'" in out.stderr


def test_spark_md_setup_write_and_read_as_written(broker, tmp_path) -> None:
    blocks = python_blocks(REPO / "docs" / "spark.md")
    setup = block_with(blocks, "SparkSession.builder", "register(spark)")
    write = block_with(blocks, '.write.format("chronomq")', "delay_level")
    read = block_with(blocks, 'df = (spark.read.format("chronomq")', '.option("subscribe", "orders")')
    check = textwrap.dedent("""
        import time
        deadline = time.monotonic() + 90
        while True:  # the written rows are delayed by a level: poll with a deadline
            got = (spark.read.format("chronomq").option("namesrv", "127.0.0.1:9876")
                   .option("subscribe", "orders").load().selectExpr("CAST(value AS STRING) AS v").collect())
            if len(got) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        print("ROWS", sorted(r.v for r in got))
        spark.stop()
    """)
    code = "\n".join([setup, write, read, check]).replace("127.0.0.1:9876", broker.namesrv_addr)
    script = tmp_path / "as_written.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], env=user_env(), cwd=tmp_path, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.search(r"^ROWS (.*)$", out.stdout, flags=re.M)
    assert rows, out.stdout[-2000:]
    assert '"order_id":"o-1"' in rows.group(1) and '"order_id":"o-2"' in rows.group(1)


def test_order_timeout_readme_command_as_written(broker, tmp_path) -> None:
    readme = (REPO / "examples" / "order_timeout" / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^(\.venv/bin/python examples/order_timeout/pipeline\.py all .*?\\\n.*?)$", readme,
                  flags=re.M)
    assert m, "the README's `pipeline.py all` command is gone"
    command = m.group(1).replace("\\\n", " ")
    command = command.replace("127.0.0.1:9876", broker.namesrv_addr).replace("/tmp/order_timeout",
                                                                             str(tmp_path / "work"))
    if not (REPO / ".venv" / "bin" / "python").exists():  # a suite run outside the README's set-up
        command = command.replace(".venv/bin/python", sys.executable, 1)
    out = subprocess.run(command, shell=True, env=user_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cancellations"] == result["expected_cancellations"] > 0
