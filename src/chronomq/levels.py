"""The delay-level rule of a parked message and the tagsCode of its consume-queue entry (RocketMQ's).

A record stored under SCHEDULE_TOPIC_XXXX waits the delay of its DELAY level, the level clamped to
1..len(levels) (absent or not an integer: level 1), and its queue entry's tagsCode is its store time plus
that delay: the deliver time the level service reads. Any other record's tagsCode is the hash of its TAGS
(0 without). The store's put path and its read-back of stored records follow this module (the append
kernel, chronomq.store._speedups.append_run, is held to it by tests); it imports only message.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from chronomq.message import PROPERTY_DELAY_TIME_LEVEL, PROPERTY_TAGS, SCHEDULE_TOPIC, tags_code


def level_delay_ms(levels: Sequence[int], level_text: str | None) -> int:
    """The delay (ms) of the level written ``level_text`` (a DELAY property), clamped to 1..len(levels);
    absent or not an integer counts as level 1."""
    try:
        level = int(level_text) if level_text else 1
    except ValueError:
        level = 1
    return levels[min(max(level, 1), len(levels)) - 1]


def parked_delay_ms(topic: str, properties: Mapping[str, str] | None, levels: Sequence[int]) -> int | None:
    """How long a record stored under ``topic`` with ``properties`` waits: its level's delay under
    SCHEDULE_TOPIC_XXXX, None under any other topic (its tagsCode is its tags' hash)."""
    if topic != SCHEDULE_TOPIC:
        return None
    return level_delay_ms(levels, properties.get(PROPERTY_DELAY_TIME_LEVEL) if properties else None)


def queue_tags_code(tags_hash: int, delay_ms: int | None, store_ts: int) -> int:
    """The tagsCode of a record's queue entry: ``store_ts + delay_ms`` for a parked record (``delay_ms``
    from parked_delay_ms), else ``tags_hash``."""
    return tags_hash if delay_ms is None else store_ts + delay_ms


def stored_tags_code(topic: str, properties: Mapping[str, str], levels: Sequence[int], store_ts: int) -> int:
    """The whole rule for a record whose store time is known (one read back from the commit log)."""
    delay = parked_delay_ms(topic, properties, levels)
    return queue_tags_code(tags_code(properties.get(PROPERTY_TAGS)) if delay is None else 0, delay, store_ts)
