"""Deliberate crash points, for the kill loop (bench/chaos.py) and crash tests.

``CHRONOMQ_FAULTS="name=n[,name=n...]"`` in the environment makes the process SIGKILL itself the n-th time
it reaches ``point(name)``. Unset (as in production) a point is one truth test of an empty dict. Names:
``commitlog.roll`` (a segment rolled: its tail is blank and the next file exists, nothing written in it),
``timer.retention`` (a retention pass has deleted index segments and wheel files, not yet data segments),
``atomic.<file name>`` (the new content is durable in ``<file>.tmp``, not yet renamed over the file).
"""

from __future__ import annotations

import os
import signal

ENV = "CHRONOMQ_FAULTS"


def parse(spec: str) -> dict[str, int]:
    """``"a=3,b=1"`` -> {"a": 3, "b": 1}; a malformed spec raises ValueError (a typo must not pass)."""
    armed: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, eq, n = item.partition("=")
        if not eq or not name or not n.isdigit() or int(n) < 1:
            raise ValueError(f"{ENV}: {item!r} is not name=count (count >= 1)")
        armed[name] = int(n)
    return armed


_armed: dict[str, int] = parse(os.environ.get(ENV, ""))


def point(name: str) -> None:
    """Die here (SIGKILL, no clean-up of any kind) if this point is armed and its count is reached."""
    if _armed and name in _armed:
        _armed[name] -= 1
        if _armed[name] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
