"""De-duplication of sends by (topic, UNIQ_KEY), for producers that ask for it with the property
CHRONOMQ_DEDUP=true (the Spark sink does, so a retried task's rows are stored once).

Rules: a send that asks, whose UNIQ_KEY this topic already stored within ``dedupWindowSec`` (put now,
parked under a delay level, or parked in the timer), is answered with the original's ids and not stored
again. What was stored is found in memory for the moments after the put (``dedupRecentMax`` keys, the
oldest forgotten first: ``RecentKeys``), then in the store's index (put now or under a level) and in the
timer's key index (timed): both are on disk, so the window survives a restart, as far back as the commit
log and the timer keep the originals. Plain RocketMQ traffic never carries the property and is never
looked up.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice, repeat
from typing import TYPE_CHECKING, TypeVar, cast

from chronomq.delay.timer import TimerError
from chronomq.message import (
    PROPERTY_DEDUP,
    PROPERTY_REAL_TOPIC,
    PROPERTY_UNIQ_KEY,
    SCHEDULE_TOPIC,
    MessageExt,
    create_offset_msg_id,
)

if TYPE_CHECKING:
    from chronomq.clock import Clock
    from chronomq.config import BrokerConfig
    from chronomq.delay.timer import TimerService
    from chronomq.store import MessageStore


T = TypeVar("T")
NOW, LEVEL, TIMED = "now", "level", "timed"  # how a send is kept until delivered (SendDedup.find)


@dataclass(slots=True)
class Original:
    """How the first send of a key was answered: its offset message id (a timer handle for a timed
    one), queue and queue offset, and for a timed one its deliver time."""

    offset_msg_id: str
    queue_id: int
    queue_offset: int
    deliver_ms: int | None = None
    uniq_key: str = ""


class Kept:
    """Sends of one topic remembered together (a batch put's, or one send's): their UNIQ_KEYs, each
    once, when they were stored, and their answers: ``original``, or the i-th key's message id ``ids[i]``
    (``ids`` a list, or the put's answer text, comma-joined) at ``offsets[i]`` of ``queue_id``."""

    __slots__ = ("ids", "offsets", "original", "queue_id", "topic", "uniqs", "when")

    def __init__(self, topic: str, uniqs: Sequence[str], when: int, ids: Sequence[str] | str = (),
                 queue_id: int = 0, offsets: Sequence[int] = (), original: Original | None = None) -> None:
        self.topic = topic
        self.uniqs = uniqs
        self.when = when
        self.ids = ids
        self.queue_id = queue_id
        self.offsets = offsets
        self.original = original

    def original_of(self, uniq: str) -> Original:
        if self.original is not None:
            return self.original
        i = self.uniqs.index(uniq)
        ids = self.ids.split(",") if isinstance(self.ids, str) else self.ids
        return Original(ids[i], self.queue_id, self.offsets[i])


class RecentKeys:
    """The keys remembered last, at most ``limit``: ``(topic, UNIQ_KEY)`` -> the Kept that holds it,
    iterated oldest first, the oldest dropped first (an OrderedDict's order: a key remembered again
    moves to the end).

    Each topic's keys are a plain dict (UNIQ_KEY -> Kept); the order is a deque of the Kept as they were
    remembered, whose first one has lost its first ``_front`` keys already. A key remembered again
    belongs to its newest Kept, and a key forgotten to none: its place in an older Kept is stale (there
    are ``_stale`` such places), which dropping skips, and which are compacted away once there are more
    of them than keys held (and ``compact_at``). A whole batch is remembered with one dict update and no
    object per key."""

    __slots__ = ("_front", "_n", "_order", "_stale", "_topics", "compact_at", "limit")

    def __init__(self, limit: int, compact_at: int = 1024) -> None:
        self.limit = limit
        self.compact_at = compact_at
        self._topics: dict[str, dict[str, Kept]] = {}
        self._order: deque[Kept] = deque()
        self._front = 0
        self._n = 0
        self._stale = 0

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        held = self._topics.get(key[0])
        return held is not None and key[1] in held

    def __iter__(self) -> Iterator[tuple[str, str]]:
        front = self._front
        for kept in self._order:
            held = self._topics.get(kept.topic)
            if held is not None:
                for uniq in islice(kept.uniqs, front, None):
                    if held.get(uniq) is kept:
                        yield kept.topic, uniq
            front = 0

    def of_topic(self, topic: str) -> dict[str, Kept] | None:
        """UNIQ_KEY -> its Kept for ``topic`` (read only), or None when none is held."""
        return self._topics.get(topic)

    def forget(self, topic: str, uniq: str) -> None:
        del self._topics[topic][uniq]
        self._n -= 1
        self._stale += 1
        if self._stale > max(self._n, self.compact_at):
            self._compact()

    def add(self, kept: Kept) -> None:
        """Remember ``kept``'s keys (each once in it) as the newest, then drop the oldest beyond ``limit``."""
        held = self._topics.get(kept.topic)
        if held is None:
            held = self._topics[kept.topic] = {}
        before = len(held)
        held.update(zip(kept.uniqs, repeat(kept)))
        added = len(held) - before
        self._n += added
        self._stale += len(kept.uniqs) - added  # remembered before: their older places are stale
        self._order.append(kept)
        if self._n > self.limit:
            self._drop(self._n - self.limit)
        if self._stale > max(self._n, self.compact_at):
            self._compact()

    def _drop(self, count: int) -> None:
        order, topics = self._order, self._topics
        while count > 0 and order:
            kept = order[0]
            uniqs = kept.uniqs
            start, end = self._front, len(uniqs)
            held = topics.get(kept.topic)
            if not self._stale and held is not None:  # every place is its key's: no look before deleting
                stop = min(end, start + count)
                deque(map(held.__delitem__, islice(uniqs, start, stop)), 0)
                count -= stop - start
                self._n -= stop - start
            else:
                stop = start
                while stop < end and count > 0:
                    uniq = uniqs[stop]
                    stop += 1
                    if held is not None and held.get(uniq) is kept:
                        del held[uniq]
                        count -= 1
                        self._n -= 1
                    else:
                        self._stale -= 1
            if stop == end:
                order.popleft()
                self._front = 0
                if held is not None and not held:
                    del topics[kept.topic]
            else:
                self._front = stop

    def _compact(self) -> None:
        """Every Kept again with its live keys only, in the same order (no stale place left)."""
        order: deque[Kept] = deque()
        front = self._front
        for kept in self._order:
            held = self._topics.get(kept.topic)
            places = [] if held is None else \
                [i for i in range(front, len(kept.uniqs)) if held.get(kept.uniqs[i]) is kept]
            front = 0
            if not places or held is None:
                continue
            if kept.original is not None or len(places) == len(kept.uniqs):
                new = kept
            else:
                ids = kept.ids.split(",") if isinstance(kept.ids, str) else kept.ids
                new = Kept(kept.topic, [kept.uniqs[i] for i in places], kept.when, [ids[i] for i in places],
                           kept.queue_id, [kept.offsets[i] for i in places])
                held.update(zip(new.uniqs, repeat(new)))
            order.append(new)
        self._order = order
        self._front = 0
        self._stale = 0


class Plan:
    """One request's messages: their keys and what each repeats (SendDedup.split). A batch planned from
    its UNIQ_KEYs (``plan_uniqs``) holds ``topic`` and ``asks`` and makes ``keys`` only when asked;
    ``fresh`` when every message asked, each key once."""

    __slots__ = ("_keys", "asks", "dedup", "fresh", "repeats", "topic")

    def __init__(self, dedup: SendDedup, keys: list[tuple[str, str] | None] | None,
                 repeats: list[Original | int | None], topic: str = "",
                 asks: list[str | None] | None = None, fresh: bool = False) -> None:
        self.dedup = dedup
        self._keys = keys
        self.repeats = repeats
        self.topic = topic
        self.asks = asks
        self.fresh = fresh

    @property
    def keys(self) -> list[tuple[str, str] | None]:
        if self._keys is None:
            topic = self.topic
            self._keys = [None if u is None else (topic, u) for u in self.asks or ()]
        return self._keys

    def keep(self, items: list[T]) -> list[T]:
        """The items (one per message, in order) of the messages to store."""
        repeats = self.repeats
        if repeats.count(None) == len(repeats):
            return items  # none repeats: all of them
        return [x for x, o in zip(items, repeats, strict=True) if o is None]

    def settle(self, stored: list[Original]) -> list[Original]:
        return self.dedup.settle(self.keys, self.repeats, stored)

    def settle_ids(self, ids: list[str], queue_id: int, first_offset: int) -> str:
        """``settle`` for a batch whose stored messages got ``ids`` (in order) at consecutive offsets of
        ``queue_id`` from ``first_offset``: every message's id, comma-joined, as the answer gives them."""
        if self.fresh and len(ids) == len(self.repeats):
            self.dedup.remember_batch(self.topic, cast(list[str], self.asks), ids, queue_id, first_offset)
            return ",".join(ids)
        return self.dedup.settle_ids(self.keys, self.repeats, ids, queue_id, first_offset)

    def settle_text(self, ids: str, count: int, queue_id: int, first_offset: int) -> str:
        """``settle_ids`` for a put's answer: ``ids`` its ``count`` message ids, comma-joined. The usual
        batch (every message asked and was stored) is answered with ``ids`` as they are, never split."""
        if self.fresh and count == len(self.repeats):
            self.dedup.remember_batch(self.topic, cast(list[str], self.asks), ids, queue_id, first_offset)
            return ids
        return self.settle_ids(ids.split(",") if count else [], queue_id, first_offset)


class SendDedup:
    def __init__(self, store: MessageStore, timer: TimerService, config: BrokerConfig, clock: Clock,
                 store_host: tuple[str, int]) -> None:
        self.store = store
        self.timer = timer
        self.window_ms = config.dedupWindowSec * 1000
        self.clock = clock
        self.store_host = store_host
        self._recent = RecentKeys(config.dedupRecentMax)
        self.replays = 0  # sends answered as their original

    @property
    def recent_max(self) -> int:
        """The most keys held in memory (``dedupRecentMax``)."""
        return self._recent.limit

    @recent_max.setter
    def recent_max(self, n: int) -> None:
        self._recent.limit = n

    def key_of(self, msg: MessageExt, topic: str) -> tuple[str, str] | None:
        """(topic, UNIQ_KEY) when ``msg`` asks to be stored once and de-duplication is on."""
        if not self.window_ms or msg.properties.get(PROPERTY_DEDUP) != "true":
            return None
        uniq = msg.properties.get(PROPERTY_UNIQ_KEY)
        return (topic, uniq) if uniq else None

    def find(self, key: tuple[str, str], kind: str = NOW) -> Original | None:
        """The original send of ``key`` within the window, or None. ``kind`` says where a first send like
        this one was kept (a replay repeats the original's way in): NOW in the topic's queues, LEVEL
        parked under SCHEDULE_TOPIC until its level is due, TIMED in the timer; both of the latter end in
        the topic's queues once delivered."""
        return self.find_many(key[0], [key[1]], kind)[0]

    def find_many(self, topic: str, uniqs: list[str], kind: str = NOW) -> list[Original | None]:
        """``find`` for several keys of one topic, the store's index asked once for all of them."""
        now = self.clock.now_ms()
        out: list[Original | None] = [None] * len(uniqs)
        if not uniqs:
            return out
        held = self._recent.of_topic(topic)
        if held is None or held.keys().isdisjoint(uniqs):
            if kind == NOW:  # none in memory: the index asked for all of them
                found = self.store.query_messages(topic, uniqs, 4, now - self.window_ms, now + 60_000)
                if found:
                    self._take(topic, dict(zip(uniqs, range(len(uniqs)), strict=True)), found, out)
                return out
            ask = dict(zip(uniqs, range(len(uniqs)), strict=True))  # UNIQ_KEY -> its (last) place
        else:
            ask = {}  # UNIQ_KEY -> its place, for the keys not found in memory
            for i, uniq in enumerate(uniqs):
                kept = held.get(uniq)
                if kept is not None:
                    if now - kept.when <= self.window_ms:
                        out[i] = kept.original_of(uniq)
                        continue
                    self._recent.forget(topic, uniq)
                ask[uniq] = i
            if not ask:
                return out
        begin, end = now - self.window_ms, now + 60_000
        if kind == TIMED:
            for uniq in list(ask):
                try:
                    parked = self.timer.records_of(uniq)
                except TimerError:  # the timer is closing: nothing more to find there
                    parked = []
                for info in parked:
                    if info.topic == topic and info.created_ms >= begin:
                        o = Original(info.offset_msg_id, info.queue_id, 0, info.deliver_ms, uniq)
                        out[ask.pop(uniq)] = o
                        break
        elif kind == LEVEL:
            for uniq, ms in self.store.query_messages(SCHEDULE_TOPIC, list(ask), 4, begin, end).items():
                for m in ms:
                    if m.uniq_key == uniq and m.properties.get(PROPERTY_REAL_TOPIC) == topic:
                        out[ask.pop(uniq)] = self._stored(m)
                        break
        if ask:
            self._take(topic, ask, self.store.query_messages(topic, list(ask), 4, begin, end), out)
        return out

    def _take(self, topic: str, ask: dict[str, int], found: dict[str, list[MessageExt]],
              out: list[Original | None]) -> None:
        """Into ``out`` at the places ``ask`` gives: the stored message of each key the index ``found``."""
        for uniq, ms in found.items():
            for m in ms:
                if m.uniq_key == uniq:
                    out[ask[uniq]] = self._stored(m)
                    break

    def _stored(self, m: MessageExt) -> Original:
        msg_id = create_offset_msg_id(self.store_host, m.commit_log_offset)
        return Original(msg_id, m.queue_id, m.queue_offset)

    def plan(self, msgs: list[MessageExt], topic: str, kind: str) -> Plan | None:
        """What to do with the messages of one send request to ``topic``: None when none asks for
        de-duplication, else the Plan (``keep`` the ones to store, then ``settle`` with what was stored)."""
        if not self.window_ms or not any(PROPERTY_DEDUP in m.properties for m in msgs):
            return None  # the usual request: nobody asks
        keys = [self.key_of(m, topic) for m in msgs]
        return Plan(self, keys, self.split(keys, kind)) if any(keys) else None

    def plan_uniqs(self, topic: str, asks: list[str | None], kind: str = NOW) -> Plan | None:
        """``plan`` for a batch to ``topic`` whose keys are known: ``asks[i]`` is the UNIQ_KEY of a message
        that asks for de-duplication, None for one that does not."""
        if not self.window_ms:
            return None
        if None not in asks:
            uniqs = cast(list[str], asks)
            if len(set(uniqs)) == len(uniqs):  # the usual batch: every one asks, no key twice
                found = self.find_many(topic, uniqs, kind)
                return Plan(self, None, cast(list[Original | int | None], found), topic, asks, True)
        repeats: list[Original | int | None] = [None] * len(asks)
        first: dict[str, int] = {}
        setdefault = first.setdefault
        for i, u in enumerate(asks):
            if u is not None:
                j = setdefault(u, i)
                if j != i:
                    repeats[i] = j  # a key twice in the request: stored once
        if first:
            uniqs = list(first)
            for u, o in zip(uniqs, self.find_many(topic, uniqs, kind), strict=True):
                if o is not None:
                    repeats[first[u]] = o
        return Plan(self, None, repeats, topic, asks)

    def split(self, keys: list[tuple[str, str] | None], kind: str = NOW) -> list[Original | int | None]:
        """For each message of one request (its key, or None when it does not ask): the Original it
        repeats, None to store it, or the index of an earlier message of the same request with the same
        key (stored once: this one repeats it)."""
        out: list[Original | int | None] = []
        first: dict[tuple[str, str], int] = {}
        ask: dict[str, list[tuple[int, str]]] = {}  # topic -> (place, UNIQ_KEY) of the first sends of a key
        for i, key in enumerate(keys):
            if key is None:
                out.append(None)
            elif key in first:
                out.append(first[key])
            else:
                first[key] = i
                out.append(None)
                ask.setdefault(key[0], []).append((i, key[1]))
        for topic, places in ask.items():
            for (i, _), o in zip(places, self.find_many(topic, [u for _, u in places], kind), strict=True):
                out[i] = o
        return out

    def settle(self, keys: list[tuple[str, str] | None], plan: list[Original | int | None],
               stored: list[Original]) -> list[Original]:
        """Every message's answer, in request order, once the ones to store (``plan[i] is None``) were
        stored as ``stored`` (in order); remembers the new keys and counts the replays."""
        it = iter(stored)
        out: list[Original] = []
        now = self.clock.now_ms()
        for key, o in zip(keys, plan, strict=True):
            if o is None:
                new = next(it)
                if key is not None:
                    self.remember(key, new, now)
                out.append(new)
            else:
                out.append(out[o] if isinstance(o, int) else o)
                self.replays += 1
        return out

    def settle_ids(self, keys: list[tuple[str, str] | None], plan: list[Original | int | None],
                   ids: list[str], queue_id: int, first_offset: int) -> str:
        """``settle`` for a batch put: the stored messages (``plan[i] is None``) got ``ids`` in order at
        consecutive offsets of ``queue_id`` from ``first_offset``; returns every message's id, comma-joined
        in request order, and remembers the new keys (without an Original each)."""
        now = self.clock.now_ms()
        recent = self._recent
        out: list[str] = []
        j = 0
        for key, o in zip(keys, plan, strict=True):
            if o is None:
                mid = ids[j]
                if key is not None:
                    recent.add(Kept(key[0], (key[1],), now, (mid,), queue_id, (first_offset + j,)))
                out.append(mid)
                j += 1
            else:
                out.append(out[o] if isinstance(o, int) else o.offset_msg_id)
                self.replays += 1
        return ",".join(out)

    def remember_batch(self, topic: str, uniqs: list[str], ids: list[str] | str, queue_id: int,
                       first_offset: int) -> None:
        """Remember a batch whose every message asked, each key once, and was stored: the i-th with the
        id ``ids[i]`` (``ids`` a list, or the answer's text) at ``first_offset + i`` of ``queue_id``."""
        self._recent.add(Kept(topic, uniqs, self.clock.now_ms(), ids, queue_id,
                              range(first_offset, first_offset + len(uniqs))))

    def remember(self, key: tuple[str, str], original: Original, now: int | None = None) -> None:
        self._recent.add(Kept(key[0], (key[1],), self.clock.now_ms() if now is None else now,
                              original=original))
