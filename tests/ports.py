"""Free loopback ports for the servers tests start, without the races of "bind port 0, close, reuse".

A port the kernel hands out for ``bind(0)`` comes from its ephemeral range, the same range every outgoing
connection takes its source port from, so between ``free_port`` closing the probe and a server binding it,
a client connection anywhere on the machine (or another pytest worker's probe) could take it. So:
- ports come from a band just below the ephemeral range (``ip_local_port_range``), which outgoing
  connections never use;
- each pytest-xdist worker (and a process outside xdist) has its own slice of that band, so two workers
  never hand out the same port;
- within a slice a process hands out blocks of ``BLOCK`` ports in turn from a random start, the port in the
  middle of each (a broker also listens on its port - 2 and + 1), each checked bindable with its block.
Where the ephemeral range leaves no room below it, ``bind(0)`` is the fallback.
"""

from __future__ import annotations

import functools
import os
import random
import socket
import threading

BLOCK = 5  # ports per allocation: p - 2 .. p + 2
SLICES = 16  # slices of the band: workers gw0..gw14, and one for processes outside xdist
SLICE = 700  # ports a slice
_lock = threading.Lock()
_cursor: int | None = None


@functools.cache
def _band_top() -> int:
    """The first port of the ephemeral range (0: unknown), read once."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _slice() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        return int(worker[2:]) % (SLICES - 1)
    return SLICES - 1


def bindable(port: int) -> bool:
    """Whether a server could bind ``port`` on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _any_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port() -> int:
    """A loopback port no server holds now, that no other worker of this run hands out and no outgoing
    connection takes; its neighbours p - 2 .. p + 2 are free too."""
    global _cursor
    top = _band_top()
    base = top - SLICES * SLICE + _slice() * SLICE
    if base < 10_000:
        return _any_port()
    blocks = SLICE // BLOCK
    with _lock:
        if _cursor is None:
            _cursor = random.randrange(blocks)
        for _ in range(blocks):
            _cursor = (_cursor + 1) % blocks
            first = base + _cursor * BLOCK
            if all(bindable(p) for p in range(first, first + BLOCK)):
                return first + 2
    return _any_port()
