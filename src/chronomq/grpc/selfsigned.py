"""The broker's self-signed TLS certificate, under its first name: the code is
``chronomq.remoting.selfsigned`` (the remoting ports and the gRPC endpoint serve the same file)."""

from chronomq.remoting.selfsigned import ensure, generate, not_after

__all__ = ["ensure", "generate", "not_after"]
