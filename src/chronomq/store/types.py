"""Result types of the store's public API (the contract the broker and the delay service code against),
and the two records the put path hands on (an encoded record, a dispatch request).

The facade is ``chronomq.store.MessageStore`` (see its docstring). It is thread-safe and synchronous:
no asyncio in the store. Durability waits are ``concurrent.futures.Future`` objects, which asyncio code
awaits with ``asyncio.wrap_future``.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple


class PutStatus(Enum):
    PUT_OK = "PUT_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    MESSAGE_ILLEGAL = "MESSAGE_ILLEGAL"  # too large, bad topic, ...: nothing was written
    PROPERTIES_SIZE_EXCEEDED = "PROPERTIES_SIZE_EXCEEDED"
    SERVICE_NOT_AVAILABLE = "SERVICE_NOT_AVAILABLE"  # store shut down, read-only, disk full
    OS_PAGECACHE_BUSY = "OS_PAGECACHE_BUSY"
    UNKNOWN_ERROR = "UNKNOWN_ERROR"


@dataclass(slots=True)
class AppendResult:
    wrote_offset: int  # commit-log (physical) offset of the first record written
    wrote_bytes: int
    msg_id: str  # offset msgId(s); comma-joined for a batch
    queue_offset: int  # logical offset in the consume queue (of the first record for a batch)
    store_timestamp: int
    msg_count: int = 1


@dataclass(slots=True)
class PutResult:
    status: PutStatus
    append: AppendResult | None = None
    error: str | None = None  # human-readable reason when status is not PUT_OK
    # Under SYNC_FLUSH (and WAIT != "false"): resolves to True once the record is fsynced, False when
    # syncFlushTimeout passed first. None under ASYNC_FLUSH.
    flushed: concurrent.futures.Future[bool] | None = None

    @property
    def ok(self) -> bool:
        return self.status is PutStatus.PUT_OK


class GetStatus(Enum):
    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"  # entries existed but none passed the tag filter
    MESSAGE_WAS_REMOVING = "MESSAGE_WAS_REMOVING"  # commit log below the entry was cleaned
    OFFSET_FOUND_NULL = "OFFSET_FOUND_NULL"
    OFFSET_OVERFLOW_BADLY = "OFFSET_OVERFLOW_BADLY"  # offset > max offset
    OFFSET_OVERFLOW_ONE = "OFFSET_OVERFLOW_ONE"  # offset == max offset (nothing new)
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"  # offset < min offset
    NO_MATCHED_LOGIC_QUEUE = "NO_MATCHED_LOGIC_QUEUE"  # the queue does not exist
    NO_MESSAGE_IN_QUEUE = "NO_MESSAGE_IN_QUEUE"  # the queue exists and is empty


@dataclass(slots=True)
class GetResult:
    status: GetStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    messages: list[bytes] = field(default_factory=list)  # raw stored records, ready to ship

    @property
    def message_count(self) -> int:
        return len(self.messages)


@dataclass(slots=True, frozen=True)
class CQUnit:
    """One consume-queue entry."""

    queue_offset: int
    commit_log_offset: int
    size: int
    tags_code: int  # tag hash; for SCHEDULE_TOPIC_XXXX the deliver time (epoch ms)


class EncodedRecord(NamedTuple):
    """A record encoded for the append (MessageStore.prepare_records' entries), with what its dispatch
    request needs besides its place in the log."""

    record: bytes  # the V1 record; queue offset, physical offset and store time patched in
    tags_hash: int  # the TAGS hash: the queue entry's tagsCode unless the record is parked
    delay_ms: int | None  # a parked record's level delay: its tagsCode is its store time + this
    keys: list[str] | None  # the KEYS words, for the index
    uniq_key: str | None


class DispatchRequest(NamedTuple):
    """What the dispatcher writes for one record: its consume-queue entry and its index entries. The put
    path builds it under the commit-log lock, by position (append_run and its pure twin: a test in
    tests/unit/test_speedups.py holds both to the field names); recovery and a replica build it from a
    record read back (reput.request_of)."""

    phys: int  # commit-log offset
    size: int
    topic: str
    queue_id: int
    queue_offset: int
    tags_code: int
    store_timestamp: int
    keys: list[str] | None
    uniq_key: str | None


def records_put_of(store: Any) -> Any:
    """The store's ``put_records`` (re-put stored record bytes, see MessageStore.put_records), or None.
    Only a store whose class defines it counts: a wrapper that overrides put_message/put_messages and
    forwards the rest (``__getattr__``, as test fault injectors do) keeps getting its own puts."""
    return store.put_records if hasattr(type(store), "put_records") else None
