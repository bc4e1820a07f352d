"""Option parsing and validation for the ``chronomq`` data source (pure Python, no Spark, no sockets).

``OPTIONS`` is the one table of the options: how users spell each one, where it applies (a batch or a
streaming read of topics, a read of the pending index, a write), how its value reads and its default.
The known-keys sets and the checks of plain values (integers in range, booleans) come from it; the
parsers below check what the table cannot say (exactly one of subscribe / subscribePattern / assign,
offsets JSON, time windows). docs/spark.md explains each option; tests/unit/test_spark_options.py holds
its tables and this one to the same keys.

Keys are case-insensitive (Spark lower-cases them). Unknown keys are refused with the list of known ones
so that a typo (``startingOffset``) fails loudly instead of silently reading from the wrong place.
"""

from __future__ import annotations

import json
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from chronomq.message import validate_topic

EARLIEST = -2
LATEST = -1


class OptionError(ValueError):
    """A data source option that cannot be used; the message names the option and what is expected."""


# where an option applies: a batch read of topics, a streaming read of topics, mode=pending, a write
BATCH, STREAM, PENDING, WRITE = "batch", "stream", "pending", "write"
_READ = frozenset({BATCH, STREAM})
_EVERYWHERE = frozenset({BATCH, STREAM, PENDING, WRITE})


@dataclass(frozen=True)
class Option:
    """One option: its spelling, where it applies, its value's type (str, int or bool), its default
    (None: no value), an integer's bounds, and what it means in a line."""

    name: str
    applies: frozenset[str]
    meaning: str
    kind: type = str
    default: str | int | None = None
    minimum: int | None = None
    maximum: int | None = None

    @property
    def key(self) -> str:
        """The key as Spark hands it over: lower-cased."""
        return self.name.lower()


OPTIONS: tuple[Option, ...] = (
    Option("namesrv", _EVERYWHERE, "name server address(es), host:port[;host:port]; required"),
    Option("nameServer", _EVERYWHERE, "alias of namesrv"),
    Option("subscribe", _READ, "comma-separated topics (one of subscribe, subscribePattern, assign)"),
    Option("subscribePattern", _READ, "a regular expression over topic names"),
    Option("assign", _READ, 'JSON {"topic": {"brokerName": [queueIds]}}'),
    Option("startingOffsets", _READ, "earliest (batch default) | latest (stream default) | JSON per queue"),
    Option("endingOffsets", frozenset({BATCH}), "latest (default) | JSON per queue"),
    Option("startingTimestamp", _READ, "epoch ms: each queue starts at its first message stored since",
           int, minimum=0),
    Option("maxOffsetsPerTrigger", frozenset({STREAM}), "at most this many messages per micro-batch",
           int, minimum=1),
    Option("failOnDataLoss", _READ, "fail (true) or skip ahead (false) when offsets were cleaned away",
           bool, True),
    Option("tagExpression", _READ, "server-side tag filter: * or tagA || tagB", str, "*"),
    Option("minPartitions", _READ, "split queue ranges into at least this many Spark partitions",
           int, minimum=1),
    Option("pullBatchSize", _READ, "messages per pull request", int, 256, 1, 1024),
    Option("requestTimeoutMs", _EVERYWHERE, "client request timeout", int, 10_000, 100),
    Option("mode", _READ | {PENDING}, "messages (default: the rows of topics) or pending (the timer stores)"),
    Option("accessKey", _EVERYWHERE, "ACL access key (with secretKey)"),
    Option("secretKey", _EVERYWHERE, "ACL secret key (with accessKey)"),
    Option("tls", _EVERYWHERE, "TLS to the name servers and brokers: true (not verifying them), false "
           "(default), or a PEM CA file to verify them with"),
    Option("topic", frozenset({PENDING, WRITE}),
           "pending: only messages for this topic; write: the topic, over a topic column"),
    Option("key", frozenset({PENDING}), "only messages with this key or message id"),
    Option("tag", frozenset({PENDING}), "only messages with this tag"),
    Option("deliverFrom", frozenset({PENDING}), "deliver times from (inclusive): epoch ms or ISO 8601"),
    Option("deliverTo", frozenset({PENDING}), "deliver times up to (inclusive): epoch ms or ISO 8601"),
    Option("pageSize", frozenset({PENDING}), "items per request to a broker", int, 1000, 1, 1000),
    Option("producerGroup", frozenset({WRITE}), "the producer group", str, "chronomq_spark_producer"),
    Option("batchSize", frozenset({WRITE}),
           "messages per batched send (a send also ends once its bodies reach 1 MiB)", int, 256, 1, 4096),
    Option("maxInFlight", frozenset({WRITE}), "concurrent batched sends per task", int, 8, 1, 1024),
    Option("writeId", frozenset({WRITE}), "a stable id for batch writes, part of each row's UNIQ_KEY"),
    Option("dedup", frozenset({WRITE}), "ask the broker to store each row's UNIQ_KEY once", bool, True),
)
_BY_NAME = {o.name: o for o in OPTIONS}
_SPELLING = {o.key: o.name for o in OPTIONS}  # for error messages


def keys_for(*where: str) -> frozenset[str]:
    """The (lower-case) keys of the options that apply to any of ``where``."""
    return frozenset(o.key for o in OPTIONS if o.applies.intersection(where))


# Options Spark itself adds, or that belong to the engine, which the source accepts and ignores.
_ENGINE_KEYS = {"path", "checkpointlocation", "queryname"}

READ_KEYS = keys_for(BATCH, STREAM)
PENDING_KEYS = keys_for(PENDING)
WRITE_KEYS = keys_for(WRITE)
# read modes: the rows of topics (default) / the timer stores' pending index
MODE_MESSAGES = "messages"
MODE_PENDING = "pending"
READ_MODES = (MODE_MESSAGES, MODE_PENDING)

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
    credentials: tuple[str, str] | None = field(default=None, repr=False)  # never in a repr
    tls: bool | str | None = None

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
    credentials: tuple[str, str] | None = field(default=None, repr=False)  # never in a repr
    dedup: bool = True
    tls: bool | str | None = None


def _lower(options: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in options.items():
        out[str(k).lower()] = "" if v is None else str(v)
    return out


def _check_unknown(opts: dict[str, str], known: frozenset[str], what: str) -> None:
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
    ak, sk = _text(opts, "accessKey"), _text(opts, "secretKey")
    if not ak and not sk:
        return None
    if not ak or not sk:
        raise OptionError("options 'accessKey' and 'secretKey' go together: give both or neither")
    return ak, sk


def _tls(opts: dict[str, str]) -> bool | str | None:
    """The ``tls`` option as chronomq's clients take it (``tls=``): None (plaintext) for false or nothing,
    True for true, else the path of a PEM CA file, read here so that a wrong one fails on the driver with
    its reason (executors read the same path)."""
    raw = _text(opts, "tls")
    if not raw or raw.lower() == "false":
        return None
    if raw.lower() == "true":
        return True
    try:
        ssl.create_default_context(cafile=raw)
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise OptionError(f"option 'tls': {raw!r} must be true, false or the path of a PEM CA file to "
                          f"verify the servers with; that file cannot be used: {why}") from None
    return raw


def _option(name: str, kind: type) -> Option:
    option = _BY_NAME[name]
    if option.kind is not kind:
        raise TypeError(f"option {name!r} is of type {option.kind.__name__}, not {kind.__name__}")
    return option


def _int(opts: dict[str, str], name: str) -> int | None:
    """An integer option: the value given, checked against its bounds, else its default (maybe None)."""
    option = _option(name, int)
    raw = opts.get(option.key)
    if raw is None or raw.strip() == "":
        return None if option.default is None else int(option.default)
    try:
        value = int(raw.strip())
    except ValueError:
        raise OptionError(f"option '{name}': {raw!r} is not an integer") from None
    if option.minimum is not None and value < option.minimum:
        raise OptionError(f"option '{name}': {value} must be >= {option.minimum}")
    if option.maximum is not None and value > option.maximum:
        raise OptionError(f"option '{name}': {value} must be <= {option.maximum}")
    return value


def _count(opts: dict[str, str], name: str) -> int:
    """An integer option that has a default."""
    value = _int(opts, name)
    if value is None:
        raise TypeError(f"option {name!r} has no default")
    return value


def _timeout_s(opts: dict[str, str]) -> float:
    return _count(opts, "requestTimeoutMs") / 1000


def _bool(opts: dict[str, str], name: str) -> bool:
    option = _option(name, bool)
    raw = opts.get(option.key)
    if raw is None or raw.strip() == "":
        return bool(option.default)
    v = raw.strip().lower()
    if v == "true":
        return True
    if v == "false":
        return False
    raise OptionError(f"option '{name}': {raw!r} must be true or false")


def _text(opts: dict[str, str], name: str) -> str:
    """A text option, stripped: the value given, else its default ("" when it has none)."""
    option = _option(name, str)
    return opts.get(option.key, "").strip() or str(option.default or "")


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


def _offset_spec(opts: dict[str, str], name: str, default: str) -> OffsetSpec:
    raw = _text(opts, name)
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


def _names(keys: frozenset[str]) -> str:
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

    starting = _offset_spec(opts, "startingOffsets", "latest" if streaming else "earliest")
    if streaming and _text(opts, "endingOffsets"):
        raise OptionError("option 'endingOffsets' is for batch queries only (a stream has no end)")
    ending = _offset_spec(opts, "endingOffsets", "latest")
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
    starting_ts = _int(opts, "startingTimestamp")
    if starting_ts is not None and _text(opts, "startingOffsets"):
        raise OptionError("give either 'startingTimestamp' or 'startingOffsets', not both")
    for spec, name in ((starting, "startingOffsets"), (ending, "endingOffsets")):
        if spec.kind == "json" and assign is not None:
            _check_within_assign(spec.offsets or {}, assign, name)
        if spec.kind == "json" and subscribe is not None:
            extra = sorted(set(spec.offsets or {}) - set(subscribe))
            if extra:
                raise OptionError(f"option '{name}' names topic(s) {extra} that are not subscribed")
    max_per_trigger = _int(opts, "maxOffsetsPerTrigger")
    if max_per_trigger is not None and not streaming:
        raise OptionError("option 'maxOffsetsPerTrigger' is for streaming queries only; bound a batch "
                          "read with 'endingOffsets'")
    tag_expr = _text(opts, "tagExpression")
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
        fail_on_data_loss=_bool(opts, "failOnDataLoss"),
        tag_expression=tag_expr,
        min_partitions=_int(opts, "minPartitions"),
        pull_batch_size=_count(opts, "pullBatchSize"),
        request_timeout_s=_timeout_s(opts),
        streaming=streaming,
        credentials=_credentials(opts),
        tls=_tls(opts),
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
    credentials: tuple[str, str] | None = field(default=None, repr=False)  # never in a repr
    tls: bool | str | None = None


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


def _filter_text(opts: dict[str, str], name: str) -> str | None:
    value = _text(opts, name)
    if "\x01" in value or "\x02" in value:
        raise OptionError(f"option '{name}' contains control characters")
    return value or None


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
    topic = _filter_text(opts, "topic")
    if topic is not None:
        _topic(topic, "option 'topic'")
    start = end = None
    if (raw := _text(opts, "deliverFrom")):
        start = parse_time_ms(raw, "deliverFrom")
    if (raw := _text(opts, "deliverTo")):
        end = parse_time_ms(raw, "deliverTo")
    if start is not None and end is not None and end < start:
        raise OptionError(f"option 'deliverTo' ({end}) is before 'deliverFrom' ({start})")
    return PendingOptions(
        namesrv=_namesrv(opts),
        topic=topic,
        key=_filter_text(opts, "key"),
        tag=_filter_text(opts, "tag"),
        deliver_from_ms=start,
        deliver_to_ms=end,
        page_size=_count(opts, "pageSize"),
        request_timeout_s=_timeout_s(opts),
        credentials=_credentials(opts),
        tls=_tls(opts),
    )


def parse_write_options(options: Mapping[str, str]) -> WriteOptions:
    opts = _lower(options)
    _check_unknown(opts, WRITE_KEYS, "write")
    topic = _text(opts, "topic") or None
    if topic is not None:
        _topic(topic, "option 'topic'")
    group = _text(opts, "producerGroup")
    write_id = _text(opts, "writeId") or None
    return WriteOptions(
        namesrv=_namesrv(opts),
        topic=topic,
        producer_group=group,
        batch_size=_count(opts, "batchSize"),
        max_in_flight=_count(opts, "maxInFlight"),
        write_id=write_id,
        request_timeout_s=_timeout_s(opts),
        credentials=_credentials(opts),
        dedup=_bool(opts, "dedup"),
        tls=_tls(opts),
    )
