"""The ``chronomq`` command.

- ``chronomq start``: name server + broker in one process (the README's run command);
- ``chronomq namesrv`` and ``chronomq broker -n HOST:PORT`` for separate processes;
- ``chronomq dashboard``: the web console (``chronomq start --dashboard`` embeds it);
- ``chronomq admin <verb>``: delay-stats, cluster, topics, route, update-topic, broker-status,
  consumer-progress, reset-offset, and for the timer store cancel, reschedule, pending (cli/admin_timer.py).

The event loop is uvloop when installed (the ``fast`` extra) unless CHRONOMQ_LOOP=asyncio (docs/latency.md,
"The event loop", has the measurement behind that default). ``--version`` and the start's first line say
which hot-path kernels run (compiled, or pure Python: chronomq/store/speedups.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from chronomq.config import BrokerConfig, ConfigError, parse_properties

from .dashboard import add_console_args
from .dashboard import add_parser as add_dashboard_parser
from .run import choose_loop, collector_paused, kernels_text, run_until_signal, runtime_line

log = logging.getLogger("chronomq")


def _parse_sets(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", metavar="FILE", help="broker.conf (RocketMQ properties format)")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="override a configuration key (repeatable)",
    )


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given the arguments about to be parsed, the admin verbs (which import the
    client) only when they name ``admin``: a broker's start, and its restart after a crash, skip them."""
    parser = argparse.ArgumentParser(prog="chronomq", description="chronomq delayed-delivery message broker")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("CHRONOMQ_LOG_LEVEL", "INFO"),
        help="logging level (default INFO)",
    )
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("start", help="name server + broker in one process")
    p.add_argument("--data-dir", help="data directory (default ./data, or storePathRootDir from -c)")
    p.add_argument("--host", help="address to listen on and to advertise (default 127.0.0.1)")
    p.add_argument("--namesrv-port", type=int, help="name server port (default 9876)")
    p.add_argument("--broker-port", type=int, help="broker port (default 10911, or listenPort from -c)")
    p.add_argument("--dashboard", action="store_true", help="also serve the web console (see `dashboard`)")
    add_console_args(p, "dashboard-")
    p.add_argument("--access-key", help="ACL access key of the console (or CHRONOMQ_ACCESS_KEY)")
    p.add_argument("--secret-key", help="ACL secret key of the console (better: CHRONOMQ_SECRET_KEY)")
    _add_config_args(p)

    p = sub.add_parser("namesrv", help="a stand-alone name server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9876)
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics of this name server (0: --port + 2, -1: off)")
    p.add_argument("--acl-file", metavar="PATH",
                   help="check every request against these plain_acl.yml accounts (like aclEnable)")
    p.add_argument("-c", "--config", metavar="FILE",
                   help="properties file; a name server reads only its connection keys (frameMaxLength, "
                        "serverChannelMaxIdleTimeSeconds, serverMaxConnections, ...)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                   help="override a connection key (repeatable)")

    p = sub.add_parser("broker", help="a stand-alone broker registering with name server(s)")
    p.add_argument("-n", "--namesrv", metavar="HOST:PORT[;HOST:PORT]", help="name server address(es)")
    p.add_argument("--data-dir", help="data directory (storePathRootDir)")
    p.add_argument("--host", help="address to listen on and to advertise (brokerIP1)")
    p.add_argument("--broker-port", type=int, help="broker port (listenPort)")
    _add_config_args(p)

    add_dashboard_parser(sub)

    p = sub.add_parser("admin", help="administration commands")
    if argv is None or "admin" in argv:
        from .admin import add_admin_parsers

        add_admin_parsers(p)
    return parser


WILDCARDS = ("0.0.0.0", "::", "")


def primary_ip() -> str:
    """The address of the interface that routes outwards (no packet is sent), else 127.0.0.1."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects a route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


DEFAULT_GRPC_PORT = 8081  # RocketMQ proxy's gRPC port


def load_config(args: argparse.Namespace, namesrv_addr: str | None = None) -> BrokerConfig:
    overrides = _parse_sets(getattr(args, "set", None))
    if getattr(args, "data_dir", None):
        overrides["storePathRootDir"] = args.data_dir
    host = getattr(args, "host", None)
    if host and host not in WILDCARDS:
        overrides["brokerIP1"] = host
    elif host and "brokerIP1" not in overrides:
        # listening on every interface: advertise (storeHost, route) an address clients can reach,
        # unless brokerIP1 comes from -c/--set
        file_values = parse_properties(Path(args.config).read_text()) if getattr(args, "config", None) else {}
        if "brokerIP1" not in file_values:
            overrides["brokerIP1"] = primary_ip()
    if getattr(args, "broker_port", None) is not None:
        overrides["listenPort"] = str(args.broker_port)
    if namesrv_addr:
        overrides["namesrvAddr"] = namesrv_addr
    if "grpcListenPort" not in overrides:  # the commands serve 5.x clients on RocketMQ's proxy port
        try:
            file_values = parse_properties(Path(args.config).read_text()) if getattr(args, "config", None) \
                else {}
        except OSError:
            file_values = {}  # BrokerConfig.load says what is wrong with the file
        if "grpcListenPort" not in file_values:
            overrides["grpcListenPort"] = str(DEFAULT_GRPC_PORT)
    config, warnings = BrokerConfig.load(args.config, overrides)
    for w in warnings:
        log.warning("%s", w)
    return config


def _namesrv_metrics(ns: Any, host: str, port: int, ns_port: int, config: BrokerConfig) -> None:
    """The name server's /metrics on ``port`` (0: its own port + 2, -1: none), HTTP and HTTPS as its port
    serves plaintext and TLS (``config``'s tlsServerMode and certificate); a port that cannot be bound is
    logged, not fatal. Called on the name server's event loop."""
    if port < 0:
        return
    from chronomq.metrics import MetricsServer, namesrv_families
    from chronomq.remoting.tls import ServerTls

    try:
        server = MetricsServer(ns.metrics_snapshot, host, port or ns_port + 2, namesrv_families,
                               tls=ServerTls.from_config(config, "namesrv metrics"),
                               loop=asyncio.get_running_loop(), monotonic=ns.clock.monotonic,
                               name="namesrv metrics")
        log.info("name server metrics on %s (%s)", server.url(), server.scheme)
    except OSError as e:
        log.error("name server metrics: cannot listen on %s:%d (%s)", host, port or ns_port + 2, e)


def cmd_start(args: argparse.Namespace) -> int:
    host = args.host or "127.0.0.1"
    ns_port = args.namesrv_port if args.namesrv_port is not None else 9876
    config = load_config(args, f"{host}:{ns_port}")
    if host in WILDCARDS:
        config.namesrvAddr = f"{config.brokerIP1}:{ns_port}"
    loop_name = choose_loop()
    console = None
    if args.dashboard:
        from .dashboard import console_config, make_console

        # its own name server and broker serving TLS only: the console connects over TLS unless told
        console = make_console(console_config(args, config.namesrvAddr,
                                              True if config.tlsServerMode == "enforcing" else None))

    from chronomq.broker.controller import BrokerController, connection_limits
    from chronomq.clock import SystemClock
    from chronomq.namesrv import NameServer
    from chronomq.remoting.server import raise_open_file_limit
    from chronomq.remoting.tls import ServerTls

    raise_open_file_limit()

    async def main() -> None:
        log.info("%s", runtime_line(loop_name))  # the start's first line: what runs
        clock = SystemClock()
        ns = NameServer(host, ns_port, clock, limits=connection_limits(config),
                        tls=ServerTls.from_config(config, "namesrv"))
        # metricsPort -1: neither has one
        _namesrv_metrics(ns, host, config.namesrvMetricsPort if config.metricsPort >= 0 else -1, ns_port,
                         config)
        broker = BrokerController(config, clock, bind_host=host, local_register=ns.routes.register_broker)
        if broker.processor.acl is not None:  # the embedded name server checks the same accounts
            from chronomq.acl import refusal

            acl = broker.processor.acl
            ns.request_check = lambda req, addr: refusal(acl, req, addr)

        async def start() -> None:
            await ns.start()
            await broker.start()
            if console is not None:
                await console.start()

        async def stop() -> None:
            if console is not None:
                await console.stop()
            await broker.shutdown()
            await ns.stop()

        def ready() -> str:  # the advertised addresses (= the listening ones unless --host is a wildcard)
            line = f"chronomq ready namesrv={config.namesrvAddr} broker={broker.broker_addr}"
            if broker.grpc is not None:
                line += f" grpc={broker.grpc_addr}"
            return line + (f" console={console.url}" if console is not None else "")

        await run_until_signal(start, stop, ready)

    asyncio.run(main())
    return 0


def cmd_namesrv(args: argparse.Namespace) -> int:
    config, warnings = BrokerConfig.load(args.config, _parse_sets(args.set))
    for w in warnings:
        log.warning("%s", w)
    choose_loop()
    from chronomq.broker.controller import connection_limits
    from chronomq.namesrv import NameServer
    from chronomq.remoting.server import raise_open_file_limit
    from chronomq.remoting.tls import ServerTls

    raise_open_file_limit()

    acl = None
    if args.acl_file:
        from chronomq.acl import AclConfigError, AclValidator
        from chronomq.clock import SystemClock

        try:
            acl = AclValidator(args.acl_file, SystemClock().now_ms)
        except AclConfigError as e:
            raise ConfigError(f"--acl-file: {e}") from None

    async def main() -> None:
        ns = NameServer(args.host, args.port, limits=connection_limits(config),
                        tls=ServerTls.from_config(config, "namesrv"))
        _namesrv_metrics(ns, args.host, args.metrics_port, args.port, config)
        if acl is not None:
            from chronomq.acl import refusal

            ns.request_check = lambda req, addr: refusal(acl, req, addr)
        await run_until_signal(ns.start, ns.stop, lambda: f"chronomq namesrv ready {ns.address}")

    asyncio.run(main())
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    config = load_config(args, args.namesrv)
    log.info("%s", runtime_line(choose_loop()))
    from chronomq.broker.controller import BrokerController
    from chronomq.remoting.server import raise_open_file_limit

    raise_open_file_limit()

    async def main() -> None:
        broker = BrokerController(config, bind_host=args.host or config.brokerIP1)
        await run_until_signal(
            broker.start,
            broker.shutdown,
            lambda: f"chronomq broker ready {broker.server.address} namesrv={config.namesrvAddr}",
        )

    asyncio.run(main())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.version or not args.command:
        from chronomq import __version__

        print(f"chronomq {__version__}, hot-path kernels {kernels_text()}")
        return 0
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "start":
            with collector_paused():  # until the start is done (run_until_signal)
                return cmd_start(args)
        if args.command == "namesrv":
            return cmd_namesrv(args)
        if args.command == "broker":
            with collector_paused():
                return cmd_broker(args)
        if args.command == "admin":
            from .admin import run_admin

            return run_admin(args)
        if args.command == "dashboard":
            from .dashboard import cmd_dashboard

            return cmd_dashboard(args)
    except ConfigError as e:
        print(f"chronomq: configuration error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"chronomq: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
