"""``chronomq dashboard``: the web console (chronomq.web) as a process of its own, and
``--hash-password`` to make a users-file entry. ``chronomq start --dashboard`` embeds the same server."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
from typing import Any

from chronomq.config import ConfigError

DASHBOARD_PORT = 8082  # chronomq.web.server.DEFAULT_PORT (not imported: the web extras load lazily)


def add_console_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The console's options; ``prefix`` ("dashboard-") when they sit beside a broker's."""
    p.add_argument(f"--{prefix}port" if prefix else "--port", type=int, default=DASHBOARD_PORT,
                   dest="dashboard_port", help=f"console port (default {DASHBOARD_PORT})")
    p.add_argument(f"--{prefix}host" if prefix else "--host", default="127.0.0.1", dest="dashboard_host",
                   help="console address (default 127.0.0.1; any other needs --users)")
    p.add_argument(f"--{prefix}users" if prefix else "--users", metavar="FILE", dest="dashboard_users",
                   help="YAML users file (users: [{name, password_hash}]): a login on every page")
    p.add_argument(f"--{prefix}tls-cert", metavar="FILE", dest="dashboard_tls_cert",
                   help="serve the console over HTTPS with this PEM certificate chain (with --"
                        f"{prefix}tls-key)")
    p.add_argument(f"--{prefix}tls-key", metavar="FILE", dest="dashboard_tls_key",
                   help="the certificate's PEM private key, unencrypted")
    p.add_argument(f"--{prefix}broker-tls", nargs="?", const=True, default=None, metavar="CAFILE",
                   dest="dashboard_broker_tls",
                   help="connect to the name server and brokers over TLS; with CAFILE, verify their "
                        "certificates against it (docs/tls.md)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("dashboard", help="the web console for a running cluster")
    p.add_argument("-n", "--namesrv", default="127.0.0.1:9876", help="name server HOST:PORT")
    add_console_args(p)
    p.add_argument("--access-key", help="ACL access key (or CHRONOMQ_ACCESS_KEY)")
    p.add_argument("--secret-key", help="ACL secret key (better: CHRONOMQ_SECRET_KEY)")
    p.add_argument("--hash-password", action="store_true",
                   help="read a password (prompt, or one line on stdin) and print its users-file hash")


def _web() -> Any:
    try:
        import chronomq.web as web
    except ImportError as e:
        raise ConfigError(f"the console needs the web extra ({e.name} is missing): "
                          "pip install 'chronomq[web]'") from None
    return web


def console_config(args: argparse.Namespace, namesrv: str, broker_tls: bool | str | None = None) -> Any:
    """The console's settings from its options; ``broker_tls``: the Admin's ``tls=`` when the command line
    does not say (``chronomq start`` gives True when its own ports serve TLS only)."""
    ConsoleConfig = _web().ConsoleConfig

    from .admin_session import credentials

    creds = credentials(args)
    given = args.dashboard_broker_tls
    return ConsoleConfig(namesrv=namesrv, host=args.dashboard_host, port=args.dashboard_port,
                         users_file=args.dashboard_users, access_key=creds[0] if creds else None,
                         secret_key=creds[1] if creds else None, tls_cert=args.dashboard_tls_cert,
                         tls_key=args.dashboard_tls_key, broker_tls=broker_tls if given is None else given)


def make_console(cfg: Any) -> Any:
    ConsoleServer = _web().ConsoleServer
    from chronomq.web.auth import UsersFileError

    try:
        return ConsoleServer(cfg)
    except (UsersFileError, ValueError) as e:
        raise ConfigError(f"console: {e}") from None


def cmd_dashboard(args: argparse.Namespace) -> int:
    if args.hash_password:
        hash_password = _web().auth.hash_password

        pw = getpass.getpass("password: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
        if not pw:
            print("chronomq: the password is empty", file=sys.stderr)
            return 2
        print(hash_password(pw))
        return 0
    from .run import choose_loop, run_until_signal

    choose_loop()
    console = make_console(console_config(args, args.namesrv))

    async def main() -> None:
        await run_until_signal(console.start, console.stop, lambda: f"chronomq console ready {console.url}")

    asyncio.run(main())
    return 0
