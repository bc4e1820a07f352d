"""The sink's batched sends with large rows: a send ends at ``batchSize`` rows or once its bodies reach
1 MiB, and a batch whose properties still make it larger than the broker's message limit is halved, so
rows of any size the broker takes are written (``write_rows`` on an executor's Arrow batches, no JVM)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("pyarrow")

import pyarrow as pa

from chronomq.client import Admin
from chronomq.spark import io
from chronomq.spark.options import parse_write_options

pytestmark = pytest.mark.spark


def stored(broker, topic: str) -> int:  # type: ignore[no-untyped-def]
    with Admin(broker.namesrv_addr) as admin:
        return sum(p.broker_offset for p in admin.group_progress("size_check", topic))


def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows of each batched send ``write_rows`` makes."""
    made: list[int] = []
    orig = io.Producer.send_encoded_batch

    async def counted(self, topic, data, ids, **kw):  # type: ignore[no-untyped-def]
        made.append(len(ids))
        return await orig(self, topic, data, ids, **kw)

    monkeypatch.setattr(io.Producer, "send_encoded_batch", counted)
    return made


@pytest.mark.parametrize("rows, size, expect", [(40, 200 * 1024, [5] * 8), (200, 1024, [64, 64, 64, 8])])
def test_large_rows_go_in_sends_under_the_broker_limit(broker, monkeypatch, rows, size, expect) -> None:
    topic = f"WriteSizes{rows}"
    with Admin(broker.namesrv_addr) as admin:
        admin.create_topic(topic, 1)
    made = sends(monkeypatch)
    values = [bytes([i % 251]) * size for i in range(rows)]  # 40 x 200 KiB: 8 MiB in 64-row sends before
    batch = pa.RecordBatch.from_pydict({"value": values}, schema=pa.schema([("value", pa.binary())]))
    opts = parse_write_options({"namesrv": broker.namesrv_addr, "topic": topic, "batchSize": "64"})
    stats = io.write_rows(opts, iter([batch]), "sizes", 0, 0)
    assert stats.rows == rows
    assert made == expect
    assert stored(broker, topic) == rows


def test_a_send_whose_properties_pass_the_limit_is_halved(broker, monkeypatch) -> None:
    topic = "WriteSizesProps"
    with Admin(broker.namesrv_addr) as admin:
        admin.create_topic(topic, 1)
    made = sends(monkeypatch)
    n = 160  # 160 x 30 KiB of properties: 4.7 MiB in one send of small bodies
    props = pa.array([[("note", "p" * 30_000)]] * n, type=pa.map_(pa.string(), pa.string()))
    batch = pa.RecordBatch.from_arrays([pa.array([b"v"] * n, pa.binary()), props],
                                       names=["value", "properties"])
    opts = parse_write_options({"namesrv": broker.namesrv_addr, "topic": topic, "batchSize": "4096"})
    assert io.write_rows(opts, iter([batch]), "props", 0, 0).rows == n
    assert made == [80, 80]
    assert stored(broker, topic) == n


def test_undelayed_rows_of_a_batch_with_deliver_times_are_cut_the_same_way(broker, monkeypatch) -> None:
    topic = "WriteSizesMixed"
    with Admin(broker.namesrv_addr) as admin:
        admin.create_topic(topic, 1)
    made: list[int] = []
    orig = io.Producer.send_batch

    async def counted(self, messages, **kw):  # type: ignore[no-untyped-def]
        made.append(len(messages))
        return await orig(self, messages, **kw)

    monkeypatch.setattr(io.Producer, "send_batch", counted)
    n = 31  # the first row delayed (sent alone), the other 30 x 200 KiB batched: 6 MiB
    batch = pa.RecordBatch.from_pydict(
        {"value": [bytes([i]) * (200 * 1024) for i in range(n)], "delay_ms": [500] + [None] * (n - 1)},
        schema=pa.schema([("value", pa.binary()), ("delay_ms", pa.int64())]))
    opts = parse_write_options({"namesrv": broker.namesrv_addr, "topic": topic, "batchSize": "64"})
    assert io.write_rows(opts, iter([batch]), "mixed", 0, 0).rows == n
    assert made == [5] * 6
    deadline = time.monotonic() + 30
    while stored(broker, topic) < n and time.monotonic() < deadline:  # the delayed row after its 0.5 s
        time.sleep(0.1)
    assert stored(broker, topic) == n
