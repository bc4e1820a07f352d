"""Option parsing and validation for the ``chronomq`` data source (pure Python, no Spark, no sockets).

The read options follow Spark's Kafka source, which Spark users already know:

==========================  ==========================================================================
``namesrv`` / ``nameServer``  name server address(es), ``host:port[;host:port]`` (required)
``subscribe``                comma-separated topics                        } exactly one of
``subscribePattern``         a regular expression over topic names         } these three
``assign``                   JSON ``{"topic": {"brokerName": [queueIds]}}``  }
``startingOffsets``          ``earliest`` | ``latest`` | JSON ``{"topic": {"broker": {"qid": off}}}``
                             (-2 = earliest, -1 = latest); default earliest (batch) / latest (stream)
``endingOffsets``            batch only: ``latest`` (default) | ``earliest`` | JSON as above
``startingTimestamp``        epoch ms: start each queue at its first message stored at or after it
``maxOffsetsPerTrigger``     streaming only: at most this many messages per micro-batch, split over
                             the queues in proportion to their backlog
``failOnDataLoss``           ``true`` (default): fail when requested offsets were cleaned away;
                             ``false``: skip ahead to the oldest retained message and log it
``tagExpression``            server-side tag filter, ``*`` (default) or ``tagA || tagB``
``minPartitions``            split large queue ranges so there are at least this many Spark partitions
``pullBatchSize``            messages per pull request (default 256, 1..1024; brokers may cap it)
``requestTimeoutMs``         client request timeout (default 10000)
``mode``                     ``messages`` (default: the rows of topics, as above) or ``pending``
``accessKey`` / ``secretKey``  ACL credentials for a cluster with aclEnable (every mode, reads and writes)
==========================  ==========================================================================

``mode=pending`` (batch only) reads the brokers' timer stores instead: one row per message waiting for
its deliver time (PENDING_SCHEMA), with its own options ``topic``, ``key``, ``tag``, ``deliverFrom`` /
``deliverTo`` (epoch ms or ISO 8601; without an offset UTC; both inclusive), ``pageSize`` (1..1000,
default 1000) besides ``namesrv`` and ``requestTimeoutMs``. The queue options above do not apply there.

Write options: ``namesrv``, ``topic`` (overrides a ``topic`` column, like Kafka), ``producerGroup``,
``batchSize`` (messages per batched send, default 64), ``maxInFlight`` (concurrent batched sends per task,
default 8), ``writeId`` (a stable id for batch writes, part of each row's UNIQ_KEY), ``requestTimeoutMs``,
``dedup`` (``true`` by default: ask the broker to store each row's UNIQ_KEY once, so a retried task's
rows are not stored twice).

Keys are case-insensitive (Spark lower-cases them). Unknown keys are refused with the list of known ones
so that a typo (``startingOffset``) fails loudly instead of silently reading from the wrong place.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from chronomq.message import validate_topic

EARLIEST = -2
LATEST = -1


class OptionError(ValueError):
    """A data source option that cannot be used; the message names the option and what is expected."""


# Options Spark itself adds, or that belong to the engine, which the source accepts and ignores.
_ENGINE_KEYS = {"path", "checkpointlocation", "queryname"}

READ_KEYS = {
    "namesrv", "nameserver", "subscribe", "subscribepattern", "assign", "startingoffsets",
    "endingoffsets", "startingtimestamp", "maxoffsetspertrigger", "failondataloss", "tagexpression",
    "minpartitions", "pullbatchsize", "requesttimeoutms", "mode", "accesskey", "secretkey",
}
PENDING_KEYS = {"namesrv", "nameserver", "mode", "topic", "key", "tag", "deliverfrom", "deliverto",
                "pagesize", "requesttimeoutms", "accesskey", "secretkey"}
# read modes: the rows of topics (default) / the timer stores' pending index
MODE_MESSAGES = "messages"
MODE_PENDING = "pending"
READ_MODES = (MODE_MESSAGES, MODE_PENDING)
# the spelling users write, for error messages (Spark lower-cases option keys)
_SPELLING = {
    "namesrv": "namesrv", "nameserver": "nameServer", "subscribe": "subscribe",
    "subscribepattern": "subscribePattern", "assign": "assign", "startingoffsets": "startingOffsets",
    "endingoffsets": "endingOffsets", "startingtimestamp": "startingTimestamp",
    "maxoffsetspertrigger": "maxOffsetsPerTrigger", "failondataloss": "failOnDataLoss",
    "tagexpression": "tagExpression", "minpartitions": "minPartitions", "pullbatchsize": "pullBatchSize",
    "requesttimeoutms": "requestTimeoutMs", "mode": "mode", "topic": "topic", "key": "key", "tag": "tag",
    "deliverfrom": "deliverFrom", "deliverto": "deliverTo", "pagesize": "pageSize",
    "accesskey": "accessKey", "secretkey": "secretKey",
}
WRITE_KEYS = {"namesrv", "nameserver", "topic", "producergroup", "batchsize", "maxinflight", "writeid",
              "requesttimeoutms", "accesskey", "secretkey", "dedup"}

# Offsets per queue: {topic: {broker_name: {queue_id: offset}}} (queue ids as ints inside Python).
QueueOffsets = dict[str, dict[str, dict[int, int]]]


@dataclass(frozen=True)
class OffsetSpec:
    """``kind`` is "earliest", "latest" or "json"; for json, ``offsets`` holds the per-queue values where
    -2 means earliest and -1 latest."""

    kind: str
    offsets: QueueOffsets | None = None

    def for_queue(self, topic: str, broker: str, queue_id: int) -> int | None:
        """The requested offset for a queue (maybe -2/-1), or None when a JSON spec does not name it."""
        if self.kind == "earliest":
            return EARLIEST
        if self.kind == "latest":
            return LATEST
        assert self.offsets is not None
        return self.offsets.get(topic, {}).get(broker, {}).get(queue_id)


@dataclass(frozen=True)
class ReadOptions:
    namesrv: str
    subscribe: tuple[str, ...] | None
    subscribe_pattern: str | None
    assign: dict[str, dict[str, tuple[int, ...]]] | None
    starting: OffsetSpec
    ending: OffsetSpec
    starting_timestamp: int | None
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    tag_expression: str
    min_partitions: int | None
    pull_batch_size: int
    request_timeout_s: float
    streaming: bool
    credentials: tuple[str, str] | None = None

    def named_topics(self) -> list[str] | None:
        """Topics named by subscribe/assign (None for subscribePattern: resolved against the cluster)."""
        if self.subscribe is not None:
            return list(self.subscribe)
        if self.assign is not None:
            return sorted(self.assign)
        return None


@dataclass(frozen=True)
class WriteOptions:
    namesrv: str
    topic: str | None
    producer_group: str
    batch_size: int
    max_in_flight: int
    write_id: str | None
    request_timeout_s: float
    credentials: tuple[str, str] | None = None
    dedup: bool = True


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in options.items():
        out[str(k).lower()] = "" if v is None else str(v)
    return out


def _check_unknown(opts: dict[str, str], known: set[str], what: str) -> None:
    unknown = sorted(k for k in opts if k not in known and k not in _ENGINE_KEYS
                     and not k.startswith("spark."))
    if unknown:
        raise OptionError(
            f"unknown {what} option(s) {', '.join(repr(k) for k in unknown)} for format 'chronomq'; "
            f"known options: {', '.join(sorted(known))}")


def _namesrv(opts: dict[str, str]) -> str:
    a, b = opts.get("namesrv"), opts.get("nameserver")
    if a and b and a != b:
        raise OptionError("give the name server once: 'namesrv' and its alias 'nameServer' differ")
    value = (a or b or "").strip()
    if not value:
        raise OptionError("option 'namesrv' (alias 'nameServer') is required, e.g. .option('namesrv', "
                          "'127.0.0.1:9876')")
    for addr in value.split(";"):
        addr = addr.strip()
        if not addr:
            continue
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise OptionError(f"option 'namesrv': {addr!r} is not host:port")
    return value


def _credentials(opts: dict[str, str]) -> tuple[str, str] | None:
    ak, sk = (opts.get("accesskey") or "").strip(), (opts.get("secretkey") or "").strip()
    if not ak and not sk:
        return None
    if not ak or not sk:
        raise OptionError("options 'accessKey' and 'secretKey' go together: give both or neither")
    return ak, sk


def _int(opts: dict[str, str], key: str, name: str, *, minimum: int | None = None,
         maximum: int | None = None) -> int | None:
    raw = opts.get(key)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise OptionError(f"option '{name}': {raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise OptionError(f"option '{name}': {value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise OptionError(f"option '{name}': {value} must be <= {maximum}")
    return value


def _bool(opts: dict[str, str], key: str, name: str, default: bool) -> bool:
    raw = opts.get(key)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v == "true":
        return True
    if v == "false":
        return False
    raise OptionError(f"option '{name}': {raw!r} must be true or false")


def _topic(name: str, where: str) -> str:
    reason = validate_topic(name)
    if reason:
        raise OptionError(f"{where}: {reason}")
    return name


def _json_object(raw: str, name: str) -> dict:
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise OptionError(f"option '{name}': not valid JSON ({e}): {raw!r}") from None
    if not isinstance(data, dict) or not data:
        raise OptionError(f"option '{name}': expected a non-empty JSON object, got {raw!r}")
    return data


def parse_assign(raw: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """``{"topic": {"brokerName": [queueIds]}}`` -> validated dict."""
    data = _json_object(raw, "assign")
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for topic, brokers in data.items():
        _topic(topic, "option 'assign'")
        if not isinstance(brokers, dict) or not brokers:
            raise OptionError(f"option 'assign': topic {topic!r} must map to {{\"brokerName\": [queueIds]}}, "
                              f"got {brokers!r}")
        per: dict[str, tuple[int, ...]] = {}
        for broker, qids in brokers.items():
            if not isinstance(qids, list) or not qids or not all(
                    isinstance(q, int) and not isinstance(q, bool) and q >= 0 for q in qids):
                raise OptionError(f"option 'assign': {topic}/{broker} must be a non-empty list of queue ids "
                                  f"(ints >= 0), got {qids!r}")
            per[str(broker)] = tuple(sorted(set(qids)))
        out[topic] = per
    return out


def parse_offsets_json(raw: str, name: str) -> QueueOffsets:
    """``{"topic": {"brokerName": {"queueId": offset}}}`` with offset >= 0, -2 (earliest) or -1 (latest)."""
    data = _json_object(raw, name)
    out: QueueOffsets = {}
    for topic, brokers in data.items():
        _topic(topic, f"option '{name}'")
        if not isinstance(brokers, dict) or not brokers:
            raise OptionError(f"option '{name}': topic {topic!r} must map to "
                              f"{{\"brokerName\": {{\"queueId\": offset}}}}, got {brokers!r}")
        per_broker: dict[str, dict[int, int]] = {}
        for broker, queues in brokers.items():
            if not isinstance(queues, dict) or not queues:
                raise OptionError(f"option '{name}': {topic}/{broker} must map queue ids to offsets, "
                                  f"got {queues!r}")
            per_queue: dict[int, int] = {}
            for qid, off in queues.items():
                try:
                    q = int(qid)
                except (TypeError, ValueError):
                    raise OptionError(f"option '{name}': {topic}/{broker}: queue id {qid!r} is not an "
                                      "integer") from None
                if q < 0:
                    raise OptionError(f"option '{name}': {topic}/{broker}: queue id {q} is negative")
                if not isinstance(off, int) or isinstance(off, bool) or off < EARLIEST:
                    raise OptionError(f"option '{name}': {topic}/{broker}/{q}: offset {off!r} must be an "
                                      "integer >= 0, or -2 (earliest) / -1 (latest)")
                per_queue[q] = off
            per_broker[str(broker)] = per_queue
        out[topic] = per_broker
    return out


def _offset_spec(opts: dict[str, str], key: str, name: str, default: str) -> OffsetSpec:
    raw = opts.get(key, "").strip()
    if not raw:
        return OffsetSpec(default)
    low = raw.lower()
    if low in ("earliest", "latest"):
        return OffsetSpec(low)
    if raw.startswith("{"):
        return OffsetSpec("json", parse_offsets_json(raw, name))
    raise OptionError(f"option '{name}': {raw!r} must be 'earliest', 'latest' or a JSON object like "
                      '{"topic": {"broker-a": {"0": 42}}}')


def read_mode(options: Mapping[str, str]) -> str:
    """The ``mode`` option: ``messages`` (default, also when empty) or ``pending``."""
    raw = _lower(options).get("mode", "").strip().lower()
    if not raw:
        return MODE_MESSAGES
    if raw not in READ_MODES:
        raise OptionError(f"option 'mode': {raw!r} must be one of {', '.join(READ_MODES)} (default "
                          f"{MODE_MESSAGES}: the messages of topics; pending: the messages waiting in the "
                          "brokers' timer stores)")
    return raw


def _names(keys: set[str]) -> str:
    return ", ".join(sorted(_SPELLING.get(k, k) for k in keys))


def _check_mode_keys(opts: dict[str, str], mode: str) -> None:
    """Options of the other read mode get a message saying which mode they belong to."""
    known = READ_KEYS if mode == MODE_MESSAGES else PENDING_KEYS
    other = PENDING_KEYS if mode == MODE_MESSAGES else READ_KEYS
    misplaced = sorted(k for k in opts if k not in known and k in other)
    if misplaced:
        names = ", ".join(repr(_SPELLING.get(k, k)) for k in misplaced)
        if mode == MODE_PENDING:
            raise OptionError(f"option(s) {names} do not apply to mode 'pending' (it lists the messages "
                              "waiting in the brokers' timer stores, not the queues of topics); its options "
                              f"are {_names(PENDING_KEYS)}")
        raise OptionError(f"option(s) {names} apply to mode 'pending' only; set .option('mode', 'pending') "
                          "to list the messages waiting in the timer stores (the default mode reads topics "
                          "with subscribe / subscribePattern / assign)")
    _check_unknown(opts, known, "read" if mode == MODE_MESSAGES else "pending-mode")


def parse_read_options(options: Mapping[str, str], streaming: bool) -> ReadOptions:
    opts = _lower(options)
    if read_mode(opts) != MODE_MESSAGES:
        raise OptionError("mode 'pending' has its own options: use parse_pending_options")
    _check_mode_keys(opts, MODE_MESSAGES)
    namesrv = _namesrv(opts)
    given = [k for k in ("subscribe", "subscribepattern", "assign") if opts.get(k, "").strip()]
    if len(given) != 1:
        raise OptionError("give exactly one of 'subscribe' (comma-separated topics), 'subscribePattern' "
                          "(a regex) or 'assign' (JSON {\"topic\": {\"brokerName\": [queueIds]}})"
                          + (f"; got {', '.join(given)}" if given else ""))
    subscribe = pattern = assign = None
    if given[0] == "subscribe":
        topics = [t.strip() for t in opts["subscribe"].split(",") if t.strip()]
        if not topics:
            raise OptionError("option 'subscribe': no topic given")
        subscribe = tuple(dict.fromkeys(_topic(t, "option 'subscribe'") for t in topics))
    elif given[0] == "subscribepattern":
        try:
            re.compile(opts["subscribepattern"])
        except re.error as e:
            raise OptionError(f"option 'subscribePattern': {opts['subscribepattern']!r} is not a valid "
                              f"regular expression: {e}") from None
        pattern = opts["subscribepattern"]
    else:
        assign = parse_assign(opts["assign"])

    starting = _offset_spec(opts, "startingoffsets", "startingOffsets", "latest" if streaming else "earliest")
    if streaming and opts.get("endingoffsets", "").strip():
        raise OptionError("option 'endingOffsets' is for batch queries only (a stream has no end)")
    ending = _offset_spec(opts, "endingoffsets", "endingOffsets", "latest")
    if not streaming:
        if starting.kind == "latest":
            raise OptionError("option 'startingOffsets': 'latest' is not allowed in a batch query "
                              "(it would always read nothing)")
        if ending.kind == "earliest":
            raise OptionError("option 'endingOffsets': 'earliest' is not allowed in a batch query")
        if starting.kind == "json" and _any_value(starting.offsets, LATEST):
            raise OptionError("option 'startingOffsets': -1 (latest) is not allowed in a batch query")
        if ending.kind == "json" and _any_value(ending.offsets, EARLIEST):
            raise OptionError("option 'endingOffsets': -2 (earliest) is not allowed in a batch query")
    starting_ts = _int(opts, "startingtimestamp", "startingTimestamp", minimum=0)
    if starting_ts is not None and opts.get("startingoffsets", "").strip():
        raise OptionError("give either 'startingTimestamp' or 'startingOffsets', not both")
    for spec, name in ((starting, "startingOffsets"), (ending, "endingOffsets")):
        if spec.kind == "json" and assign is not None:
            _check_within_assign(spec.offsets or {}, assign, name)
        if spec.kind == "json" and subscribe is not None:
            extra = sorted(set(spec.offsets or {}) - set(subscribe))
            if extra:
                raise OptionError(f"option '{name}' names topic(s) {extra} that are not subscribed")
    max_per_trigger = _int(opts, "maxoffsetspertrigger", "maxOffsetsPerTrigger", minimum=1)
    if max_per_trigger is not None and not streaming:
        raise OptionError("option 'maxOffsetsPerTrigger' is for streaming queries only; bound a batch "
                          "read with 'endingOffsets'")
    tag_expr = opts.get("tagexpression", "").strip() or "*"
    if "\x01" in tag_expr or "\x02" in tag_expr:
        raise OptionError("option 'tagExpression' contains control characters")
    return ReadOptions(
        namesrv=namesrv,
        subscribe=subscribe,
        subscribe_pattern=pattern,
        assign=assign,
        starting=starting,
        ending=ending,
        starting_timestamp=starting_ts,
        max_offsets_per_trigger=max_per_trigger,
        fail_on_data_loss=_bool(opts, "failondataloss", "failOnDataLoss", True),
        tag_expression=tag_expr,
        min_partitions=_int(opts, "minpartitions", "minPartitions", minimum=1),
        pull_batch_size=_int(opts, "pullbatchsize", "pullBatchSize", minimum=1, maximum=1024) or 256,
        request_timeout_s=(_int(opts, "requesttimeoutms", "requestTimeoutMs", minimum=100) or 10_000) / 1000,
        streaming=streaming,
        credentials=_credentials(opts),
    )


def _any_value(offsets: QueueOffsets | None, value: int) -> bool:
    return any(off == value for b in (offsets or {}).values() for q in b.values() for off in q.values())


def _check_within_assign(offsets: QueueOffsets, assign: dict[str, dict[str, tuple[int, ...]]],
                         name: str) -> None:
    for topic, brokers in offsets.items():
        for broker, queues in brokers.items():
            allowed = set(assign.get(topic, {}).get(broker, ()))
            outside = sorted(q for q in queues if q not in allowed)
            if outside:
                raise OptionError(f"option '{name}': {topic}/{broker} queue(s) {outside} are not in 'assign'")


@dataclass(frozen=True)
class PendingOptions:
    """``mode=pending``: filters of the pending index (None = no filter; the window is inclusive)."""

    namesrv: str
    topic: str | None
    key: str | None
    tag: str | None
    deliver_from_ms: int | None
    deliver_to_ms: int | None
    page_size: int
    request_timeout_s: float
    credentials: tuple[str, str] | None = None


def parse_time_ms(raw: str, name: str) -> int:
    """Epoch milliseconds (digits) or an ISO 8601 timestamp (UTC when it carries no offset) -> epoch ms."""
    text = raw.strip()
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise OptionError(f"option '{name}': {raw!r} is neither epoch milliseconds nor an ISO 8601 timestamp "
                          "(e.g. 1767225600000 or 2026-01-01T00:00:00Z)") from None
    if dt.tzinfo is None or dt.utcoffset() is None:
        dt = dt.replace(tzinfo=UTC)
    ms = (dt - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
    if ms < 0:
        raise OptionError(f"option '{name}': {raw!r} is before 1970")
    return ms


def _filter_text(opts: dict[str, str], key: str, name: str) -> str | None:
    raw = opts.get(key)
    if raw is None or not raw.strip():
        return None
    value = raw.strip()
    if "\x01" in value or "\x02" in value:
        raise OptionError(f"option '{name}' contains control characters")
    return value


def parse_pending_options(options: Mapping[str, str], streaming: bool) -> PendingOptions:
    """Options of ``mode=pending`` (batch only)."""
    opts = _lower(options)
    if read_mode(opts) != MODE_PENDING:
        raise OptionError("parse_pending_options is for .option('mode', 'pending')")
    if streaming:
        raise OptionError("mode 'pending' is a batch read (spark.read): the pending index is a snapshot of "
                          "what waits in the timer stores, not a stream; use spark.read...load(), or stream "
                          "the delivered messages with the default mode (subscribe=...)")
    _check_mode_keys(opts, MODE_PENDING)
    topic = _filter_text(opts, "topic", "topic")
    if topic is not None:
        _topic(topic, "option 'topic'")
    start = end = None
    if (raw := opts.get("deliverfrom", "").strip()):
        start = parse_time_ms(raw, "deliverFrom")
    if (raw := opts.get("deliverto", "").strip()):
        end = parse_time_ms(raw, "deliverTo")
    if start is not None and end is not None and end < start:
        raise OptionError(f"option 'deliverTo' ({end}) is before 'deliverFrom' ({start})")
    return PendingOptions(
        namesrv=_namesrv(opts),
        topic=topic,
        key=_filter_text(opts, "key", "key"),
        tag=_filter_text(opts, "tag", "tag"),
        deliver_from_ms=start,
        deliver_to_ms=end,
        page_size=_int(opts, "pagesize", "pageSize", minimum=1, maximum=1000) or 1000,
        request_timeout_s=(_int(opts, "requesttimeoutms", "requestTimeoutMs", minimum=100) or 10_000) / 1000,
        credentials=_credentials(opts),
    )


def parse_write_options(options: Mapping[str, str]) -> WriteOptions:
    opts = _lower(options)
    _check_unknown(opts, WRITE_KEYS, "write")
    topic = opts.get("topic", "").strip() or None
    if topic is not None:
        _topic(topic, "option 'topic'")
    group = opts.get("producergroup", "").strip() or "chronomq_spark_producer"
    write_id = opts.get("writeid", "").strip() or None
    return WriteOptions(
        namesrv=_namesrv(opts),
        topic=topic,
        producer_group=group,
        batch_size=_int(opts, "batchsize", "batchSize", minimum=1, maximum=4096) or 64,
        max_in_flight=_int(opts, "maxinflight", "maxInFlight", minimum=1, maximum=1024) or 8,
        write_id=write_id,
        request_timeout_s=(_int(opts, "requesttimeoutms", "requestTimeoutMs", minimum=100) or 10_000) / 1000,
        credentials=_credentials(opts),
        dedup=_bool(opts, "dedup", "dedup", True),
    )
