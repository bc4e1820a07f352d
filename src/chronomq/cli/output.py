"""What ``chronomq admin`` prints and reads: right-aligned tables, durations and epoch times (formatting and
parsing; ``--epoch-ms``), and AdminError.

Rules: nothing here talks to a server; a bad value a user typed raises AdminError with a message naming
the option, which the verb prints as one line on stderr (exit 1).
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any


class AdminError(Exception):
    """A failure of an admin verb, reported as one line on stderr (exit 1)."""


def table(rows: list[list[str]], header: list[str]) -> str:
    """Columns right-aligned to their widest cell, two spaces apart, header first."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def fmt_ms(v: Any) -> str:
    """A duration in ms as its largest whole unit (1h, 5m, 10s, 250ms); "-" for none."""
    if v is None or v == -1 or v == "":
        return "-"
    try:
        ms = int(v)
    except (TypeError, ValueError):
        return str(v)
    if ms % 3_600_000 == 0 and ms:
        return f"{ms // 3_600_000}h"
    if ms % 60_000 == 0 and ms:
        return f"{ms // 60_000}m"
    if ms % 1000 == 0 and ms:
        return f"{ms // 1000}s"
    return f"{ms}ms"


def fmt_epoch_ms(ms: Any, epoch_ms: bool = False) -> str:
    """A time given in epoch ms, as every admin verb prints it: ISO-8601 UTC with milliseconds
    (2026-11-27T14:04:50.292Z, which --at, --from and --to read back), or with ``epoch_ms`` (the
    --epoch-ms flag) the number itself; "-" for none."""
    if isinstance(ms, str) and ms.isdigit():
        ms = int(ms)
    if not isinstance(ms, int) or isinstance(ms, bool) or ms < 0:
        return "-"
    if epoch_ms:
        return str(ms)
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def time_name(name: str, epoch_ms: bool = False) -> str:
    """The name of a time column or field: ``name``, or ``name_ms`` where it holds epoch ms."""
    return f"{name}_ms" if epoch_ms else name


def add_epoch_ms_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epoch-ms", action="store_true",
                   help="print times as epoch milliseconds (for scripts) instead of ISO-8601 UTC")


def parse_time_ms(text: str, what: str = "time") -> int:
    """Epoch milliseconds from an integer (epoch ms; below 10**11 read as epoch seconds, like the broker)
    or an ISO-8601 date-time (a naive one is UTC). Raises AdminError with a clear message."""
    s = text.strip()
    if not s:
        raise AdminError(f"{what}: empty value")
    if s.lstrip("-").isdigit():
        v = int(s)
        if v < 0:
            raise AdminError(f"{what}: {text!r} is negative")
        return v * 1000 if 0 < v < 10**11 else v
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
    except ValueError:
        raise AdminError(f"{what}: {text!r} is neither epoch milliseconds nor an ISO-8601 time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def parse_in_seconds(text: str) -> int:
    """A relative delay in (possibly fractional) seconds -> milliseconds."""
    try:
        v = float(text)
    except ValueError:
        raise AdminError(f"--in: {text!r} is not a number of seconds") from None
    if v != v or v < 0 or v == float("inf"):
        raise AdminError(f"--in: {text!r} must be a finite, non-negative number of seconds")
    return round(v * 1000)
