"""De-duplication of sends by (topic, UNIQ_KEY), for producers that ask for it with the property
CHRONOMQ_DEDUP=true (the Spark sink does, so a retried task's rows are stored once).

Rules: a send that asks, whose UNIQ_KEY this topic already stored within ``dedupWindowSec`` (put now,
parked under a delay level, or parked in the timer), is answered with the original's ids and not stored
again. What was stored is found in memory for the moments after the put (``dedupRecentMax`` keys), then
in the store's index (put now or under a level) and in the timer's key index (timed): both are on disk,
so the window survives a restart, as far back as the commit log and the timer keep the originals.
Plain RocketMQ traffic never carries the property and is never looked up.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count, repeat
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


@dataclass(slots=True)
class Plan:
    """One request's messages: their keys and what each repeats (SendDedup.split)."""

    dedup: SendDedup
    keys: list[tuple[str, str] | None]
    repeats: list[Original | int | None]

    def keep(self, items: list[T]) -> list[T]:
        """The items (one per message, in order) of the messages to store."""
        return [x for x, o in zip(items, self.repeats, strict=True) if o is None]

    def settle(self, stored: list[Original]) -> list[Original]:
        return self.dedup.settle(self.keys, self.repeats, stored)

    def settle_ids(self, ids: list[str], queue_id: int, first_offset: int) -> str:
        """``settle`` for a batch whose stored messages got ``ids`` (in order) at consecutive offsets of
        ``queue_id`` from ``first_offset``: every message's id, comma-joined, as the answer gives them."""
        return self.dedup.settle_ids(self.keys, self.repeats, ids, queue_id, first_offset)


def _original(hit: tuple[int, Original] | tuple[int, str, int, int]) -> Original:
    """The Original of a remembered send (SendDedup._recent's value)."""
    return hit[1] if len(hit) == 2 else Original(hit[1], hit[2], hit[3])


class SendDedup:
    def __init__(self, store: MessageStore, timer: TimerService, config: BrokerConfig, clock: Clock,
                 store_host: tuple[str, int]) -> None:
        self.store = store
        self.timer = timer
        self.window_ms = config.dedupWindowSec * 1000
        self.recent_max = config.dedupRecentMax
        self.clock = clock
        self.store_host = store_host
        # (topic, UNIQ_KEY) -> (when, its Original), or for a batch's message (when, offset msg id, queue id,
        # queue offset): a tuple of plain values, which the cycle collector stops tracking
        self._recent: OrderedDict[tuple[str, str], tuple[int, Original] | tuple[int, str, int, int]] = \
            OrderedDict()
        self.replays = 0  # sends answered as their original

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
        return self._find(topic, uniqs, None, kind)

    def _find(self, topic: str, uniqs: list[str], keys: list[tuple[str, str]] | None, kind: str
              ) -> list[Original | None]:
        """``find_many``; ``keys``, when given, are the (topic, UNIQ_KEY) of ``uniqs``."""
        now = self.clock.now_ms()
        out: list[Original | None] = [None] * len(uniqs)
        recent = self._recent
        if not recent or recent.keys().isdisjoint([(topic, u) for u in uniqs] if keys is None else keys):
            ask = dict(zip(uniqs, range(len(uniqs)), strict=True))  # none in memory: all asked (last place)
        else:
            ask = {}  # UNIQ_KEY -> its place, for the keys not found in memory
            for i, uniq in enumerate(uniqs):
                hit = recent.get((topic, uniq))
                if hit is not None:
                    if now - hit[0] <= self.window_ms:
                        out[i] = _original(hit)
                        continue
                    del recent[(topic, uniq)]
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
            for uniq, ms in self.store.query_messages(topic, list(ask), 4, begin, end).items():
                for m in ms:
                    if m.uniq_key == uniq:
                        out[ask[uniq]] = self._stored(m)
                        break
        return out

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
            if len(dict.fromkeys(uniqs)) == len(uniqs):  # the usual batch: every one asks, no key twice
                tkeys = [(topic, u) for u in uniqs]
                found = self._find(topic, uniqs, tkeys, kind)
                return Plan(self, cast(list[tuple[str, str] | None], tkeys),
                            cast(list[Original | int | None], found))
        keys = [None if u is None else (topic, u) for u in asks]
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
        return Plan(self, keys, repeats)

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
        if len(ids) == len(plan) and None not in keys and recent.keys().isdisjoint(keys):
            # the usual batch: every message asked, every one stored, none remembered before
            stored = cast(list[tuple[str, str]], keys)
            values = zip(repeat(now), ids, repeat(queue_id), count(first_offset), strict=False)
            recent.update(zip(stored, values, strict=True))
            out = ids
        else:
            for key, o in zip(keys, plan, strict=True):
                if o is None:
                    mid = ids[j]
                    if key is not None:
                        if key in recent:
                            recent.move_to_end(key)
                        recent[key] = (now, mid, queue_id, first_offset + j)
                    out.append(mid)
                    j += 1
                else:
                    out.append(out[o] if isinstance(o, int) else o.offset_msg_id)
                    self.replays += 1
        for _ in range(len(recent) - self.recent_max):
            recent.popitem(last=False)
        return ",".join(out)

    def remember(self, key: tuple[str, str], original: Original, now: int | None = None) -> None:
        recent = self._recent
        if key in recent:
            recent.move_to_end(key)
        recent[key] = (self.clock.now_ms() if now is None else now, original)
        if len(recent) > self.recent_max:
            recent.popitem(last=False)
