"""The 4.x delay-level table (``messageDelayLevel``): level n (1-based) waits ``delays_ms[n - 1]``."""

from __future__ import annotations

from chronomq.config import parse_delay_levels


class DelayLevels:
    """Level 0 (or anything not a positive integer) means "not delayed"; a level above the highest is
    clamped to the highest. Schedule-topic queue id = level - 1."""

    __slots__ = ("delays_ms",)

    def __init__(self, levels_ms: list[int]) -> None:
        if not levels_ms:
            raise ValueError("at least one delay level is required")
        self.delays_ms: tuple[int, ...] = tuple(levels_ms)

    @classmethod
    def parse(cls, text: str) -> DelayLevels:
        return cls(parse_delay_levels(text))

    def __len__(self) -> int:
        return len(self.delays_ms)

    @property
    def max_level(self) -> int:
        return len(self.delays_ms)

    def clamp(self, level: int) -> int:
        """0 for "not delayed" (level <= 0), else level capped at the highest."""
        if level <= 0:
            return 0
        return min(level, len(self.delays_ms))

    def delay_ms(self, level: int) -> int:
        """The delay of a (clamped) level >= 1."""
        return self.delays_ms[self.clamp(level) - 1] if level > 0 else 0

    @staticmethod
    def queue_id(level: int) -> int:
        return level - 1

    @staticmethod
    def level_of_queue(queue_id: int) -> int:
        return queue_id + 1


def parse_level(raw: str | None) -> int:
    """The DELAY property as an int; 0 when absent or not an integer."""
    if not raw:
        return 0
    try:
        return int(raw.strip())
    except ValueError:
        return 0
