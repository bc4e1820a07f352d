"""The process's open-file budget for network connections, shared by every listener: the remoting servers
and the gRPC endpoint's port front (stdlib only, so both may import it).

The budget counts descriptors: the soft open-file limit (RLIMIT_NOFILE) less a quarter of it (at least
256), kept for the store's files. A listener asks ``room(n, budget)`` before it admits a connection, then
``take(n)``, and ``give(n)`` when the connection is gone. A remoting connection holds 1 descriptor; a gRPC
connection the front relays holds 3 (the client's socket, the front's connection to grpc's internal port,
and grpc's end of it).
"""

from __future__ import annotations

_held = 0  # descriptors held by connections in this process, over every listener


def connection_budget() -> int | None:
    """How many descriptors this process's connections may hold at once so that its open-file limit keeps
    room for the store's files (at least 16); None where there is no such limit."""
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(16, soft - max(256, soft // 4))


def held() -> int:
    return _held


def room(n: int, budget: int | None) -> bool:
    """Whether a connection holding ``n`` descriptors fits in ``budget`` (None: no limit)."""
    return budget is None or _held + n <= budget


def refusal(open_now: int, max_open: int | None, ip: str, from_ip: int, max_per_ip: int | None, n: int,
            budget: int | None) -> str | None:
    """Why a listener with ``open_now`` connections (``from_ip`` of them from ``ip``) must refuse one more
    holding ``n`` descriptors, or None when it may take it (a limit of 0: none)."""
    if max_open and open_now >= max_open:
        return f"{open_now} connections open (serverMaxConnections={max_open})"
    if max_per_ip and from_ip >= max_per_ip:
        return f"{from_ip} connections open from {ip} (serverMaxConnectionsPerIp={max_per_ip})"
    if not room(n, budget):
        return f"connections in this process hold {_held} descriptors: its open-file limit allows no more"
    return None


def take(n: int) -> None:
    global _held
    _held += n


def give(n: int) -> None:
    global _held
    _held -= n
