"""How an admin verb reaches the cluster: one ``chronomq.client.Admin`` through its blocking facade, and
the brokers a verb asks (``-b HOST:PORT``, else every master broker the name server ``-n`` knows).

Rules: the verbs send no request of their own; every request goes through the client Admin. Its errors
(ClientError, ValueError for bad arguments) are left to ``run_admin``, which prints them on one line.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from chronomq.client import Admin, NoRouteError

from .output import AdminError

REQUEST_TIMEOUT = 5.0  # seconds, per request


def check_addr(addr: str, option: str) -> str:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise AdminError(f"{option}: bad address {addr!r}: expected HOST:PORT")
    return addr


def credentials(args: argparse.Namespace) -> tuple[str, str] | None:
    """ACL credentials: --access-key / --secret-key, else CHRONOMQ_ACCESS_KEY / CHRONOMQ_SECRET_KEY (the
    environment keeps the secret out of the process list); None when neither gives an access key."""
    ak = getattr(args, "access_key", None) or os.environ.get("CHRONOMQ_ACCESS_KEY")
    sk = getattr(args, "secret_key", None) or os.environ.get("CHRONOMQ_SECRET_KEY")
    if not ak:
        return None
    if not sk:
        raise AdminError("an access key needs its secret key: --secret-key or CHRONOMQ_SECRET_KEY")
    return ak, sk


@contextmanager
def open_admin(args: argparse.Namespace) -> Iterator[Any]:
    """The blocking facade of an Admin on ``args.namesrv`` (closed on leaving)."""
    if getattr(args, "broker", None):
        check_addr(args.broker, "-b")
    try:
        client = Admin(check_addr(args.namesrv, "-n"), request_timeout=REQUEST_TIMEOUT,
                       credentials=credentials(args), tls=getattr(args, "tls", None))
    except ValueError as e:  # --tls CAFILE that holds no usable certificate
        raise AdminError(f"--tls: {e}") from None
    with client as admin:
        yield admin


def targets(admin: Any, args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, address) of the brokers to ask: ``-b``'s (named by its address) or every master."""
    broker = getattr(args, "broker", None) or None
    try:
        masters: list[tuple[str, str]] = admin.masters(broker)
    except NoRouteError:
        raise AdminError(f"no broker is registered with the name server {args.namesrv}") from None
    return masters
