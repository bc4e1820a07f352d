"""The example pipelines end to end on a small data set: examples/order_timeout and
examples/delay_report, against a real ``chronomq start`` with short delay levels (1s 2s 3s 4s)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import wait_for
from tests.spark.conftest import process_all

pytestmark = pytest.mark.spark
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(rel: str) -> ModuleType:
    name = "example_" + rel.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / rel)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_order_timeout_pipeline(spark, broker, tmp_path) -> None:
    pipeline = load("order_timeout/pipeline.py")
    ns = broker.namesrv_addr
    work = tmp_path / "orders"
    work.mkdir()
    n, paid = pipeline.generate(spark, work, 60)
    assert 0 < paid < n
    def start():  # type: ignore[no-untyped-def]
        return pipeline.start_cancellations(spark, ns, work, "order_checks")

    qs = [process_all(start)]
    try:
        assert pipeline.submit_checks(spark, ns, work, "order_checks", 2) == n  # level 2 = 2 s here

        def done() -> bool:
            qs[0] = process_all(start, qs[0])
            return pipeline.count_parquet(spark, work / "cancellations") >= n - paid

        wait_for(done, timeout=90, interval=0.2, message="every unpaid order cancelled")
    finally:
        qs[0].stop()
    cancelled = spark.read.parquet(str(work / "cancellations"))
    payments = spark.read.parquet(str(work / "payments.parquet"))
    orders = spark.read.parquet(str(work / "orders.parquet"))
    got = sorted(r.order_id for r in cancelled.select("order_id").collect())
    want = sorted(r.order_id for r in orders.join(payments, "order_id", "left_anti").collect())
    assert got == want and len(got) == n - paid  # exactly the unpaid ones, each once
    # the checks were delivered no earlier than their delay after the orders were written
    rows = cancelled.select("created_ms", "checked_at", "reason").collect()
    assert all(r.reason == "payment timeout" for r in rows)
    assert all(r.checked_at.timestamp() * 1000 >= r.created_ms + 2000 for r in rows)


def test_delay_report(spark, broker, tmp_path) -> None:
    from chronomq.client import Message, Producer, SimpleConsumer

    report = load("delay_report/report.py")
    ns = broker.namesrv_addr
    with Producer("report_pg", ns) as p:
        for i in range(12):
            p.send(Message("ReportT", f"r{i}".encode(), delay_level=1 + i % 2))
    with SimpleConsumer("report_cg", ns) as c:
        wait_for(lambda: sum(c.max_offset(q) for q in c.queues("ReportT", refresh=True)) == 12, timeout=30,
                 message="12 delayed messages delivered")
    out = tmp_path / "report"
    rows = report.run(spark, ns, "ReportT", out)
    by_level = {r["level"]: r for r in rows}
    assert set(by_level) == {1, 2}
    assert by_level[1]["count"] == 6 and by_level[2]["count"] == 6
    assert by_level[1]["delay_ms"] == 1000.0 and by_level[2]["delay_ms"] == 2000.0
    assert all(r["early"] == 0 and r["p50_ms"] >= 0 and r["max_ms"] < 10_000 for r in rows)
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "report.csv").read_text().startswith("level,delay_ms,count")


def test_delay_report_builtin_png_renderer(tmp_path) -> None:
    """The chart fallback used when matplotlib is not installed: a valid RGB PNG with bars drawn."""
    import struct
    import zlib

    report = load("delay_report/report.py")
    rows = [{"level": 1, "p50_ms": 3.0, "p99_ms": 12.0}, {"level": 2, "p50_ms": 5.0, "p99_ms": 40.0}]
    path = tmp_path / "chart.png"
    report._png_builtin(rows, path, width=200, height=100)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (200, 100)
    idat = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[idat - 4:idat])
    raw = zlib.decompress(data[idat + 4:idat + 4 + length])
    assert len(raw) == height * (1 + 3 * width)
    dark_bar = bytes((20, 60, 140))
    assert raw.count(dark_bar) > 50  # the p99 bars are there
