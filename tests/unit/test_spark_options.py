"""The Spark data source's option table: docs/spark.md's tables name the same options, and the known-keys
sets and the plain-value checks come from the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")  # chronomq.spark's package imports its Arrow schema

from chronomq.spark import options as o
from chronomq.spark.options import OptionError

DOC = Path(__file__).resolve().parents[2] / "docs" / "spark.md"
NS = {"namesrv": "127.0.0.1:9876"}


def doc_option_tables() -> list[list[tuple[list[str], str]]]:
    """Every table of docs/spark.md headed ``| option | meaning |``, in order: its rows as (the options
    the first cell names, the meaning)."""
    tables: list[list[tuple[list[str], str]]] = []
    rows: list[tuple[list[str], str]] | None = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.strip() == "| option | meaning |":
            rows = []
            tables.append(rows)
        elif rows is not None and line.startswith("|"):
            if line.startswith("|---"):
                continue
            first, meaning = line.strip("|").split("|", 1)
            rows.append((re.findall(r"`([A-Za-z]+)`", first), meaning))
        else:
            rows = None
    return tables


def test_the_doc_tables_name_the_options_of_the_table() -> None:
    reads, pending, writes = doc_option_tables()
    for rows, keys in ((reads, o.READ_KEYS), (pending, o.PENDING_KEYS), (writes, o.WRITE_KEYS)):
        assert {name.lower() for names, _ in rows for name in names} == keys


def test_the_doc_tables_give_the_integer_defaults() -> None:
    for rows in doc_option_tables():
        for names, meaning in rows:
            if len(names) == 1:
                option = next(opt for opt in o.OPTIONS if opt.name == names[0])
                if option.kind is int and option.default is not None:
                    assert f"default {option.default}" in meaning, option.name


def test_the_table_is_consistent() -> None:
    assert len({opt.key for opt in o.OPTIONS}) == len(o.OPTIONS)
    for opt in o.OPTIONS:
        assert opt.kind in (str, int, bool) and opt.meaning and opt.applies
        assert opt.applies <= {o.BATCH, o.STREAM, o.PENDING, o.WRITE}
        assert opt.default is None or isinstance(opt.default, opt.kind)
        if opt.minimum is not None or opt.maximum is not None:
            assert opt.kind is int


def test_known_keys_come_from_the_table() -> None:
    assert o.keys_for(o.WRITE) == {"namesrv", "nameserver", "topic", "producergroup", "batchsize",
                                   "maxinflight", "writeid", "requesttimeoutms", "accesskey", "secretkey",
                                   "dedup", "tls"}
    assert "maxoffsetspertrigger" in o.READ_KEYS and "endingoffsets" in o.READ_KEYS
    assert "deliverfrom" not in o.READ_KEYS and "subscribe" not in o.PENDING_KEYS
    with pytest.raises(OptionError, match=r"known options: accesskey, batchsize, dedup, maxinflight, "):
        o.parse_write_options({**NS, "topics": "t"})


def test_bounds_and_defaults_come_from_the_table() -> None:
    w = o.parse_write_options(NS)
    assert (w.batch_size, w.max_in_flight, w.producer_group, w.request_timeout_s, w.dedup) == (
        256, 8, "chronomq_spark_producer", 10.0, True)
    with pytest.raises(OptionError, match=r"option 'maxInFlight': 1025 must be <= 1024"):
        o.parse_write_options({**NS, "maxInFlight": "1025"})
    with pytest.raises(OptionError, match=r"option 'requestTimeoutMs': 99 must be >= 100"):
        o.parse_write_options({**NS, "requestTimeoutMs": "99"})
    with pytest.raises(OptionError, match=r"option 'dedup': 'yes' must be true or false"):
        o.parse_write_options({**NS, "dedup": "yes"})
    r = o.parse_read_options({**NS, "subscribe": "t", "pullBatchSize": "1024"}, False)
    assert (r.pull_batch_size, r.tag_expression, r.min_partitions, r.fail_on_data_loss) == (
        1024, "*", None, True)


def test_an_accessor_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match="'dedup' is of type bool, not int"):
        o._int({}, "dedup")
    with pytest.raises(TypeError, match="'minPartitions' has no default"):
        o._count({}, "minPartitions")
