"""chronomq.web: the web console (``chronomq dashboard``, or ``chronomq start --dashboard``), a client of
the cluster like any other: it talks to the brokers only through ``chronomq.client``. Design and
security rules: docs/console.md."""

from chronomq.web.server import ConsoleConfig, ConsoleServer, is_loopback

__all__ = ["ConsoleConfig", "ConsoleServer", "is_loopback"]
