"""The one delivery path into the message store, shared by the level schedule service (``DeliveryPath``,
below) and the timer store (``TimerStore.deliver_many``).

A delivery turns a parked stored record back into a new message of its real topic and queue. Both
sources read their parked records their own way, then hand groups keyed by real (topic, queue id) to
``put_groups``, which owns the rules: one put per group (the store's ``put_records``, re-putting the
parked bytes with edited properties, else ``put_messages``, else ``put_message`` one by one), a group
refused for good is retried message by message to isolate the bad one, and after a transient failure
nothing more is tried (the caller keeps those entries pending).

Idempotency of the level service: every re-put carries ``PROPERTY_DELAY_SOURCE`` = "<level>:<queue
offset>:<parked commit-log offset>"; after a crash the commit log beyond the last persisted position is
scanned and entries whose re-put is already there are skipped.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from chronomq.message import (
    MAGIC_V1,
    POS_BODY,
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    RECORD_FIXED_SIZE,
    RECORD_HEAD,
    MessageExt,
    MessageFormatError,
    record_topic_and_properties,
    unpack_host_cached,
    validate_topic,
)
from chronomq.store.speedups import kernels, pure_twin
from chronomq.store.types import PutResult, PutStatus, records_put_of

if TYPE_CHECKING:
    from chronomq.clock import Clock
    from chronomq.store import MessageStore

log = logging.getLogger(__name__)

# Internal property on every level re-put (see the module docstring). Stripped from anything a client sends.
PROPERTY_DELAY_SOURCE = "__CHRONOMQ_DELAY_SRC"

# The marker's bytes in a stored record's properties: what a read answer looks for before it rewrites one
DELAY_SOURCE_MARK = (PROPERTY_DELAY_SOURCE + "\x01").encode()
_U16 = struct.Struct(">H")
_TOTAL = struct.Struct(">i")


def hide_delay_source(rec: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """The stored V1 record ``rec`` without the internal delay-source property (what clients are handed:
    RocketMQ has no such property), or ``rec`` itself when it has none. The marker stays in the commit
    log, where the level service's crash recovery reads it; the body and every other field are the
    stored ones. Callers look for DELAY_SOURCE_MARK in a whole answer first, so records of topics that
    never saw a re-put cost one search per answer, not a rewrite."""
    try:
        (body_len,) = _BODYLEN.unpack_from(rec, POS_BODY - 4)
        tpos = POS_BODY + body_len
        ppos = tpos + 1 + rec[tpos]
        (plen,) = _U16.unpack_from(rec, ppos)
    except (struct.error, IndexError):
        return rec
    props = bytes(rec[ppos + 2 : ppos + 2 + plen])
    start = props.find(DELAY_SOURCE_MARK)
    while start > 0 and props[start - 1] != 2:  # not at a property's start: inside another's value
        start = props.find(DELAY_SOURCE_MARK, start + 1)
    if start < 0:
        return rec
    end = props.find(b"\x02", start)
    kept = props[:start] + (props[end + 1 :] if end >= 0 else b"")
    out = bytearray(rec[:ppos])
    out += _U16.pack(len(kept))
    out += kept
    out += rec[ppos + 2 + plen :]
    _TOTAL.pack_into(out, 0, len(out))
    return bytes(out)  # a record, like the store's: the compiled kernels read records as bytes


def hide_delay_sources(records: list) -> list:
    """``records`` with hide_delay_source applied to those that carry the marker."""
    mark = DELAY_SOURCE_MARK
    return [hide_delay_source(r) if mark in r else r for r in records]


# Put failures after which retrying cannot help: the entry is dropped (logged and counted).
PERMANENT_FAILURES = frozenset({PutStatus.MESSAGE_ILLEGAL, PutStatus.PROPERTIES_SIZE_EXCEEDED})
# Statuses meaning the record was written (a flush timeout still wrote it).
WRITTEN = frozenset({PutStatus.PUT_OK, PutStatus.FLUSH_DISK_TIMEOUT})


def make_source(source: int, queue_offset: int, parked_phy: int) -> str:
    return f"{source}:{queue_offset}:{parked_phy}"


def parse_source(value: str | None) -> tuple[int, int, int] | None:
    if not value:
        return None
    parts = value.split(":")
    if len(parts) != 3:
        return None
    try:
        a, b, c = (int(p) for p in parts)
    except ValueError:
        return None
    return a, b, c


class UndeliverableError(ValueError):
    """A parked message whose real topic/queue cannot be restored (corrupt or forged properties)."""


# --- reading a parked record: what to put -----------------------------------------------------------------
_HEAD = RECORD_HEAD  # the V1 record head up to BODYLENGTH
_TMQ = struct.Struct(">ii4xi")  # TOTALSIZE, MAGICCODE, (BODYCRC skipped), QUEUEID
_BODYLEN = struct.Struct(">i")


def _check_record(size: int, total: int, magic: int) -> None:
    if magic != MAGIC_V1:
        raise MessageFormatError(f"bad magic code {magic & 0xFFFFFFFF:#x}")
    if total != size:
        raise MessageFormatError("record length does not match its envelope")


@pure_twin("record_to_put")
def record_to_put_py(buf: bytes, pos: int, size: int) -> tuple[str, int, dict[str, str]]:
    """The stored V1 record of ``size`` bytes at ``buf[pos:]``, checked as decode_to_put checks it: its
    topic, queue id and properties (the store's put_records copies the rest from the bytes). Raises
    MessageFormatError."""
    if size < RECORD_FIXED_SIZE or pos + size > len(buf):
        raise MessageFormatError("record truncated")
    total, magic, queue_id = _TMQ.unpack_from(buf, pos)
    _check_record(size, total, magic)
    (body_len,) = _BODYLEN.unpack_from(buf, pos + POS_BODY - 4)
    topic, props = record_topic_and_properties(buf, pos, size, body_len)
    return topic, queue_id, props


record_to_put = kernels.record_to_put  # compiled when built (chronomq.store.speedups chooses)


def decode_to_put(buf: bytes, pos: int, size: int, store_host: tuple[str, int]) -> MessageExt:
    """The stored V1 record of ``size`` bytes at ``buf[pos:]`` as a new message to put: what decode_record
    checks, without the fields the store assigns anew (offsets, store time). Raises MessageFormatError."""
    if size < RECORD_FIXED_SIZE or pos + size > len(buf):
        raise MessageFormatError("record truncated")
    (total, magic, crc, queue_id, flag, _qoff, _phys, sys_flag, born_ts, born_host, _sts, _shost,
     reconsume, _prep, body_len) = _HEAD.unpack_from(buf, pos)
    _check_record(size, total, magic)
    topic, props = record_topic_and_properties(buf, pos, size, body_len)
    body = buf[pos + POS_BODY : pos + POS_BODY + body_len]
    # positional (half the cost of keywords on this path), in MessageExt's field order: topic, body,
    # properties, flag, queue_id, sys_flag, born_timestamp, born_host, store_timestamp, store_host,
    # reconsume_times, prepared_transaction_offset, queue_offset, commit_log_offset, body_crc
    return MessageExt(topic, body, props, flag, queue_id, sys_flag, born_ts, unpack_host_cached(born_host), 0,
                      store_host, reconsume, 0, 0, 0, crc)


# --- the level service's restore: real topic and queue from REAL_TOPIC / REAL_QID ---------------------------
def _restored_properties(props: dict[str, str], source: str | None) -> None:
    """The real message's properties: the parked ones (DELAY, REAL_TOPIC and REAL_QID kept, as RocketMQ's
    ScheduleMessageService.messageTimeup stores them), the delay source recorded (or removed). The
    copy's DELAY parks nothing again: the store parks by topic only, and every path that re-puts a
    consumed message sets its own level (send-back: the retry level, or 0 for the DLQ)."""
    if source is not None:
        props[PROPERTY_DELAY_SOURCE] = source
    else:
        props.pop(PROPERTY_DELAY_SOURCE, None)


def restore_real(parked: MessageExt, source: str | None) -> MessageExt:
    """The message to put on the real topic: topic = REAL_TOPIC, queue = REAL_QID, properties kept
    (DELAY, REAL_TOPIC and REAL_QID stay, as in RocketMQ); body, flag, sysFlag, born timestamp/host and
    reconsume times copied. Raises UndeliverableError when REAL_TOPIC/REAL_QID are missing or invalid."""
    props = dict(parked.properties)
    real_topic = props.get(PROPERTY_REAL_TOPIC)
    if not real_topic or validate_topic(real_topic) is not None:
        raise UndeliverableError(f"parked message has no valid {PROPERTY_REAL_TOPIC}: {real_topic!r}")
    try:
        real_qid = int(props.get(PROPERTY_REAL_QUEUE_ID, ""))
    except ValueError:
        raise UndeliverableError(
            f"parked message has no valid {PROPERTY_REAL_QUEUE_ID}: {props.get(PROPERTY_REAL_QUEUE_ID)!r}"
        ) from None
    if real_qid < 0:
        raise UndeliverableError(f"parked message has a negative {PROPERTY_REAL_QUEUE_ID}")
    _restored_properties(props, source)
    return MessageExt(
        topic=real_topic,
        body=parked.body,
        properties=props,
        flag=parked.flag,
        queue_id=real_qid,
        sys_flag=parked.sys_flag,
        born_timestamp=parked.born_timestamp,
        born_host=parked.born_host,
        reconsume_times=parked.reconsume_times,
        body_crc=parked.body_crc,
    )


_VALID_TOPICS: set[str] = set()
_NO_HOST = ("127.0.0.1", 0)


def _restore_props(props: dict[str, str], source: str | None) -> tuple[str, int]:
    """The parked message's real topic and queue id (checked), and its properties edited in place for
    the copy: the delay source recorded (or dropped)."""
    real_topic = props.get(PROPERTY_REAL_TOPIC)
    if real_topic not in _VALID_TOPICS:
        if not real_topic or validate_topic(real_topic) is not None:
            raise UndeliverableError(f"parked message has no valid {PROPERTY_REAL_TOPIC}: {real_topic!r}")
        if len(_VALID_TOPICS) > 100_000:
            _VALID_TOPICS.clear()
        _VALID_TOPICS.add(real_topic)
    qid_raw = props.get(PROPERTY_REAL_QUEUE_ID, "")
    if not qid_raw.isdigit() or not qid_raw.isascii():
        raise UndeliverableError(f"parked message has no valid {PROPERTY_REAL_QUEUE_ID}: {qid_raw!r}")
    _restored_properties(props, source)
    return real_topic, int(qid_raw)


def restore_from_record(raw: bytes, source: str | None) -> MessageExt:
    """restore_real(decode_record(raw), source), without building the intermediate message. Raises
    UndeliverableError for a record that cannot be decoded or restored."""
    try:
        m = decode_to_put(raw, 0, len(raw), _NO_HOST)
    except (struct.error, IndexError, MessageFormatError) as e:
        raise UndeliverableError(f"the parked record cannot be decoded: {e}") from None
    m.topic, m.queue_id = _restore_props(m.properties, source)
    return m


def restore_props_from_record(raw: bytes, source: str | None) -> tuple[str, int, dict[str, str]]:
    """What restore_from_record decides, without building the message: (real topic, real queue id,
    properties of the copy), for MessageStore.put_records, which copies the rest of the record from
    ``raw``. Same checks; raises UndeliverableError for a record that cannot be decoded or restored."""
    try:
        _topic, _qid, props = record_to_put(raw, 0, len(raw))
    except (struct.error, IndexError, MessageFormatError) as e:
        raise UndeliverableError(f"the parked record cannot be decoded: {e}") from None
    real_topic, qid = _restore_props(props, source)
    return real_topic, qid, props


# --- putting groups: the rules both sources share ----------------------------------------------------------
# MessageStore.put_records: (topic, queue id, [(buffer, position, size, properties)]) -> PutResult
PutRaw = Callable[[str, int, list[tuple[bytes, int, int, dict[str, str]]]], PutResult]
G = TypeVar("G", bound=tuple)  # a group member: any tuple whose [1] is what to put


class StorePuts:
    """How one real queue's group goes into the store: ``put_raw`` (put_records: entries are
    ``(buffer, position, size, properties)``), else ``put_many`` (put_messages, one topic and queue per
    call) for several messages, else ``put`` (put_message) one message at a time. A put that raises
    counts as a transient failure (the store is the caller's; the messages are kept and tried again)."""

    __slots__ = ("batches", "put", "put_many", "put_raw")

    def __init__(self, put: Callable[[MessageExt], PutResult],
                 put_many: Callable[[list[MessageExt]], PutResult] | None = None,
                 put_raw: PutRaw | None = None) -> None:
        self.put = put
        self.put_many = put_many
        self.put_raw = put_raw
        self.batches = put_raw is not None or put_many is not None  # a group can go in one call

    @classmethod
    def of(cls, store: Any) -> StorePuts:
        return cls(store.put_message, getattr(store, "put_messages", None), records_put_of(store))

    def __call__(self, key: tuple[str, int], entries: list[Any]) -> PutResult:
        try:
            if self.put_raw is not None:
                return self.put_raw(key[0], key[1], entries)
            if self.put_many is not None and len(entries) > 1:
                return self.put_many(entries)
            return self.put(entries[0])
        except Exception:
            log.exception("delivery: putting into the store raised; will retry")
            return PutResult(PutStatus.UNKNOWN_ERROR, error="exception")


def put_groups(groups: dict[tuple[str, int], list[G]], puts: StorePuts,
               written: Callable[[list[G], PutResult], None], refused: Callable[[G, PutResult], None],
               busy: Callable[[list[G], PutResult], None]) -> bool:
    """Put each group (members in order; ``member[1]`` is the entry to put), groups in order. Calls
    ``written(members, result)`` for members the store took, ``refused(member, result)`` for one it
    refused for good, ``busy(members, result)`` for those hit by a transient failure, after which
    nothing more is tried: returns True then (members of later groups get no call at all)."""
    for key, group in groups.items():
        if len(group) == 1 or puts.batches:
            res = puts(key, [g[1] for g in group])
            status = res.status
            if status in WRITTEN:
                written(group, res)
                continue
            if status not in PERMANENT_FAILURES:
                busy(group, res)
                return True
            if len(group) == 1:
                refused(group[0], res)
                continue
        # one bad message (or the batch's size) refused the whole group, or the store takes one at a
        # time: message by message
        for g in group:
            res = puts(key, [g[1]])
            if res.status in WRITTEN:
                written([g], res)
            elif res.status in PERMANENT_FAILURES:
                refused(g, res)
            else:
                busy([g], res)
                return True
    return False


# --- the level service's batches ---------------------------------------------------------------------------
@dataclass(slots=True)
class Delivered:
    """Outcome of one delivery attempt."""

    written: bool  # the real-topic copy is in the store
    retry: bool  # transient failure: try the same entry again later
    store_timestamp: int = 0
    result: PutResult | None = None
    error: str | None = None


_NOT_TRIED = Delivered(False, True, error="not attempted after an earlier transient failure")


class DeliveryPath:
    """The level service's side of the delivery path: reads parked records from the commit log,
    restores their real topic and queue, and puts them through ``put_groups`` (synchronously: the
    store's put is an in-memory append plus, under SYNC_FLUSH, a flush future we do not wait for; the
    snapshot that makes deliveries permanent flushes first)."""

    def __init__(self, store: MessageStore, clock: Clock | None = None) -> None:
        self.store = store
        self.clock = clock

    def deliver(self, parked_phy: int, source: str | None) -> Delivered:
        return self.deliver_many([(parked_phy, source)])[0]

    def deliver_many(self, items: list[tuple[int, str | None]]) -> list[Delivered]:
        """Deliver a batch; returns one outcome per item, in order. Messages for the same real
        topic/queue are written with one put (their order kept). After a transient failure the
        remaining groups are not attempted (their outcome says retry)."""
        out: list[Delivered | None] = [None] * len(items)
        puts = StorePuts.of(self.store)
        groups = self._restore(items, out, puts.put_raw is not None)

        def written(members: list[tuple[int, Any]], res: PutResult) -> None:
            if res.append is not None:
                ts = res.append.store_timestamp
            else:  # a store that reports no append: it wrote it now
                ts = self.clock.now_ms() if self.clock is not None else 0
            d = Delivered(True, False, ts, res)  # shared by the group
            for i, _ in members:
                out[i] = d

        def refused(member: tuple[int, Any], res: PutResult) -> None:
            out[member[0]] = Delivered(False, False, result=res, error=f"{res.status.value}: {res.error}")

        def busy(members: list[tuple[int, Any]], res: PutResult) -> None:
            for i, _ in members:
                out[i] = Delivered(False, True, result=res, error=f"{res.status.value}: {res.error}")

        put_groups(groups, puts, written, refused, busy)
        return [d if d is not None else _NOT_TRIED for d in out]

    def _restore(self, items: list[tuple[int, str | None]], out: list[Delivered | None], as_records: bool
                 ) -> dict[tuple[str, int], list[tuple[int, Any]]]:
        """Read and restore the parked records, grouped by real (topic, queue) in ``items`` order; the
        outcome of those that cannot be goes into ``out``."""
        groups: dict[tuple[str, int], list[tuple[int, Any]]] = {}
        read = self.store.read_record
        for i, (phy, source) in enumerate(items):
            raw = read(phy)
            if raw is None:
                out[i] = Delivered(False, False, error=f"parked record at commit-log offset {phy} not found")
                continue
            try:
                if as_records:
                    topic, qid, props = restore_props_from_record(raw, source)
                    real: Any = (raw, 0, len(raw), props)
                    key = (topic, qid)
                else:
                    real = restore_from_record(raw, source)
                    key = (real.topic, real.queue_id)
            except UndeliverableError as e:
                out[i] = Delivered(False, False, error=str(e))
                continue
            g = groups.get(key)
            if g is None:
                groups[key] = [(i, real)]
            else:
                g.append((i, real))
        return groups
