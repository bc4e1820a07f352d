"""bench/kafka_peer.py: the single-node Kafka broker the Spark bench measures against starts in KRaft mode
on a free loopback port, answers Kafka's own protocol there, and is gone after ``stop()``; Spark's Kafka
connector resolves without the jars Spark ships itself. Skipped, with the reason, without Java or Maven."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest
from bench.kafka_peer import KafkaBroker, KafkaUnavailable, connector_jars

pytestmark = pytest.mark.timeout(300)


def _api_versions(bootstrap: str) -> tuple[int, int]:
    """(correlation id, error code) of Kafka's ApiVersions v0 answer: the broker speaks Kafka's protocol."""
    host, port = bootstrap.rsplit(":", 1)
    client = b"chronomq-test"
    body = struct.pack(">hhih", 18, 0, 4242, len(client)) + client  # ApiVersions, v0, correlation id
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(struct.pack(">i", len(body)) + body)
        head = b""
        while len(head) < 10:
            chunk = s.recv(10 - len(head))
            assert chunk, "the broker closed the connection"
            head += chunk
    _size, correlation, error = struct.unpack(">iih", head)
    return correlation, error


def test_a_kraft_broker_starts_answers_and_stops(tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path / "kafka", heap="256m")
    try:
        broker.start()
    except KafkaUnavailable as e:
        pytest.skip(str(e))
    try:
        assert _api_versions(broker.bootstrap) == (4242, 0)
        proc = broker.proc
        assert proc is not None and proc.poll() is None
    finally:
        broker.stop()
    assert proc.poll() is not None
    assert (tmp_path / "kafka" / "kafka-logs" / "meta.properties").exists()


def test_the_connector_comes_without_the_jars_spark_ships() -> None:
    try:
        version, jars, note = connector_jars("4.2.0")
    except KafkaUnavailable as e:
        pytest.skip(str(e))
    names = [Path(j).name for j in jars]
    assert version == "4.2.0" and not note
    assert any(n.startswith("spark-sql-kafka-0-10_2.13-4.2.0") for n in names), names
    assert any(n.startswith("kafka-clients-") for n in names), names
    assert not [n for n in names if n.startswith(("scala-library-", "spark-tags_", "hadoop-client-"))], names
