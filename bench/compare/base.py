"""What the runner needs from each system: a server it starts and stops by PID, a producer that schedules
a batch of messages at given due times and returns once the server acknowledged them durably (as durable
as that system's configuration makes them), and a consumer that hands every received body to a sink."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .procs import PeerUnavailable

PayloadFn = Callable[[int, int], bytes]   # (seq, due_ms) -> body
Sink = Callable[[bytes, int], None]       # (body, recv_ms)

PIP_EXTRA = "pip install redis pika rich matplotlib   (the 'bench' extra)"


def need_module(name: str, what: str) -> Any:
    """Import an optional dependency lazily, with a clear message when it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise PeerUnavailable(f"the Python package {name!r} ({what}) is not installed: {PIP_EXTRA}") from e


class Producer(ABC):
    @abstractmethod
    def schedule(self, items: Sequence[tuple[int, int]]) -> list[int]:
        """Schedule (seq, intended due ms) items; block until all are acknowledged; return the due time
        each message really got (equal to the intended one unless the system quantizes delays)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        pass


class Consumer(ABC):
    @abstractmethod
    def close(self) -> None:
        """Stop consuming and release the connection (bounded in time)."""


class Peer(ABC):
    name: str = "peer"          # short key used in JSON
    label: str = "peer"         # column title
    durability: str = ""        # how it is configured, stated in the table and the JSON
    client: str = ""            # the Python client used
    levels_ms: list[int] | None = None  # fixed delay levels (None: any delay in ms)
    speaks_remoting: bool = False  # a RocketMQ 4.x remoting broker (the official Java client can drive it)

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.data_dir = workdir / "data"

    @abstractmethod
    def check(self) -> None:
        """Raise PeerUnavailable when binaries or client packages are missing."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None:
        """Clean shutdown of everything this peer started, by PID."""

    @abstractmethod
    def kill9(self) -> None:
        """SIGKILL the server (the data dir stays)."""

    @abstractmethod
    def restart(self) -> None:
        """Start the server again on the same ports and data dir (after kill9)."""

    @abstractmethod
    def server_pids(self) -> list[int]: ...

    @abstractmethod
    def producer(self, dest: str, payload: PayloadFn) -> Producer: ...

    @abstractmethod
    def consumer(self, dest: str, sink: Sink) -> Consumer:
        """Start consuming ``dest`` in the background; every received body goes to ``sink``."""

    def after_start(self) -> None:  # noqa: B027 (optional hook)
        """Checks after the start-up figures were taken (the first acknowledged send, the idle RSS):
        their time is not part of the start-up."""

    def version(self) -> str:
        return ""

    def settle(self, timeout_s: float) -> dict[str, Any]:
        """Before memory and disk are read (workload 5): wait, bounded by ``timeout_s``, until the server
        has no background job that would distort them (e.g. a forked rewrite child). Returns what it did."""
        return {}

    def backlog(self, dest: str) -> dict[str, Any] | None:
        """What the server still holds for ``dest`` (diagnostics for messages not received), if it can
        say cheaply."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "durability": self.durability, "client": self.client,
                "version": self.version(), "levels_ms": self.levels_ms}
