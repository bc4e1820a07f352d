"""The broker: wires its services (built whole by ``services.build_services``: the store, the delay
service, the managers), the request processors and the remoting server, and runs the periodic services
(offset persistence, client housekeeping, name-server registration)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chronomq import __version__
from chronomq.clock import Clock, SystemClock
from chronomq.config import ASYNC_MASTER, SYNC_MASTER, BrokerConfig, ConfigError
from chronomq.delay.background import in_background
from chronomq.delay.histogram import Histogram
from chronomq.delay.timer.journal import JOURNAL_TOPIC, TimerFollower, TimerJournal
from chronomq.ha import HAClient, HAService
from chronomq.metrics import LATENESS_BUCKETS_MS
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode
from chronomq.remoting.server import Connection, ConnectionLimits, RemotingServer
from chronomq.remoting.tls import ServerTls, StreamAcceptor, outgoing_context
from chronomq.store.atomicfile import write_atomic

from .processor import BrokerProcessor
from .services import PromoteError, build_services
from .timer_processor import TimerProcessor
from .topics import TopicConfig

if TYPE_CHECKING:  # each loaded where the broker first needs it: a master's start does without them
    from chronomq.metrics import MetricsServer
    from chronomq.remoting.client import RemotingClient

    from .nsclient import NamesrvClient
    from .slave_sync import SlaveSynchronize

log = logging.getLogger("chronomq.broker")

HOUSEKEEPING_INTERVAL_MS = 10_000
# The key index entries of dispatched messages are written this much later, on the loop: the answers to
# the pulls their arrival woke go out first (in a burst, all of them; while the timer delivers one, later
# still: reput.INDEX_MAX_WAIT_S). A key query drains it first.
INDEX_DEFER_S = 0.02

# (cluster, name, addr, id, ha addr, topic configs, data version, now_ms, conn id) -> result
RegisterFn = Callable[..., dict[str, str]]


ROLE_FILE = "role.json"


def connection_limits(config: BrokerConfig) -> ConnectionLimits:
    """The limits of the configuration's connection keys, for the broker's port and a name server's."""
    return ConnectionLimits(
        frame_max_length=config.frameMaxLength,
        frame_read_timeout=config.serverFrameReadTimeoutMillis / 1000,
        max_idle=config.serverChannelMaxIdleTimeSeconds,
        max_connections=config.serverMaxConnections,
        max_connections_per_ip=config.serverMaxConnectionsPerIp,
        max_buffered_frame_bytes=config.serverMaxBufferedFrameBytes,
        write_high=config.writeBufferHighWaterMark,
        write_low=config.writeBufferLowWaterMark,
    )


class BrokerController:
    """``BrokerController(config, clock)``; ``await start()`` / ``await shutdown()``.

    ``local_register``: in ``chronomq start`` the broker shares the process with the name server and
    registers by a direct call (``NameServer.routes.register_broker``); otherwise it registers over TCP
    with every address in ``config.namesrvAddr`` (';'-separated).
    """

    def __init__(
        self,
        config: BrokerConfig,
        clock: Clock | None = None,
        *,
        bind_host: str | None = None,
        local_register: RegisterFn | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.bind_host = bind_host or config.brokerIP1
        self.store_host = (config.brokerIP1, config.listenPort)
        self.root = Path(config.storePathRootDir)
        self._apply_promotion()
        self.services = build_services(
            config, self.clock, self.store_host,
            notify_consumer_ids_changed=self.notify_consumer_ids_changed,
            runtime_info=self.runtime_info,
            promote=self.promote,
        )
        services = self.services
        self.store = services.store
        self.delay = services.delay
        self.timer = services.timer
        self.topics = services.topics
        self.offsets = services.offsets
        self.consumers = services.consumers
        self.producers = services.producers
        self.locks = services.locks
        self.hold = services.hold
        self.transactions = services.transactions
        self.timers = TimerProcessor(self.services)
        self.processor = BrokerProcessor(self.services, self.timers)
        if config.aclEnable:  # the accounts' code loads only when they are on (as metrics, gRPC, filters)
            from chronomq.acl import AclConfigError, AclValidator

            try:
                self.processor.acl = AclValidator(config.acl_path, self.clock.now_ms,
                                                  config.aclReplayWindowMs, config.aclRequireTimestamp)
            except AclConfigError as e:
                raise ConfigError(f"aclEnable: {e}") from None
        if config.authenticationEnabled or config.authorizationEnabled:  # ACL 2.0, beside or instead of 1.0
            from chronomq.acl import AclConfigError
            from chronomq.acl.setup import acl2_validator

            try:
                self.processor.acl = acl2_validator(config, self.processor.auth.auth_store, self.clock.now_ms,
                                                    self.processor.acl)
            except (AclConfigError, ValueError) as e:  # the init users' JSON, an unreadable auth.json
                raise ConfigError(f"ACL 2.0: {e}") from None
        self.server = RemotingServer(
            self.processor.handle,
            self.bind_host,
            config.listenPort,
            name="broker",
            sync_handler=self.processor.handle_sync,
            limits=connection_limits(config),  # on the real clock: peers live in real time
            tls=ServerTls.from_config(config, "broker"),  # TLS and plaintext on one port (docs/tls.md)
        )
        self.server.close_callbacks.append(self._on_connection_closed)
        self.local_register = local_register
        self.ns_client: NamesrvClient | None = None
        self.ha: HAService | None = None  # a master's end of the slaves' link
        self.ha_client: HAClient | None = None  # a slave's end
        self.slave_sync: SlaveSynchronize | None = None  # a slave's copy of the master's metadata
        self.timer_follower: TimerFollower | None = None  # a slave's copy of the master's timer
        self._journal_queued = False
        self.metrics: MetricsServer | None = None
        self.grpc: Any = None  # the 5.x endpoint (chronomq.grpc.GrpcServer) when grpcListenPort >= 0
        self._sync_client: RemotingClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.started_at = 0
        self._dispatch_queued = False
        self._loop_thread = 0
        self.topics.on_change.append(self._topic_changed)

    @property
    def broker_addr(self) -> str:
        return f"{self.config.brokerIP1}:{self.config.listenPort}"

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the broker runs on (None before ``start``)."""
        return self.services.loop

    @property
    def stopping(self) -> bool:
        return self.services.stopping

    # --- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.services.bind_loop(loop)
        slave = self.config.is_slave
        self.hold.bind(loop)
        self.started_at = self.clock.now_ms()
        self.store.start()
        self.store.add_arrival_listener(self.hold.on_arrival)
        self._loop_thread = threading.get_ident()
        self.store.set_dispatch_hook(self._dispatch_soon)
        self.store.set_index_later(self._index_later, busy=lambda: self.timer.delivering)
        self.store.set_min_offset_guard(self.delay.min_needed_offset)
        if not slave:  # a slave delivers no delayed message (RocketMQ runs the schedule service on masters)
            await self._start_delivery()
        else:  # the slave's timer parks what its master journals, and delivers nothing
            self.timer.open()
            self.timer_follower = TimerFollower(self.store, self.timer, self.root)
            self.store.add_arrival_listener(self._journal_arrival)
            self.timer_follower.apply_available()
        await self.server.start()
        client_tls = outgoing_context(self.config)  # the broker's own connections: TLS with tlsEnable
        if slave:
            from chronomq.remoting.client import RemotingClient

            from .slave_sync import SlaveSynchronize

            self.ha_client = HAClient(self.config, self.store, self.clock, ssl_context=client_tls)
            self.ha_client.start()
            self._sync_client = RemotingClient(ssl_context=client_tls)
            self.slave_sync = SlaveSynchronize(self.topics, self.offsets, str(self.root),
                                               self._sync_client.invoke)
        else:
            await self._start_ha_service()
        self._start_metrics()
        await self._start_grpc()
        self._register_event = asyncio.Event()
        if self.local_register is None:
            from .nsclient import NamesrvClient

            self.ns_client = NamesrvClient([a for a in self.config.namesrvAddr.split(";") if a.strip()],
                                           ssl_context=client_tls)
        self._tasks = [
            asyncio.create_task(self._persist_loop(), name="offset-persist"),
            asyncio.create_task(self._housekeeping_loop(), name="housekeeping"),
            asyncio.create_task(self._register_loop(), name="register"),
        ]
        if self.slave_sync is not None:
            self._tasks.append(asyncio.create_task(self.slave_sync.run(self.clock.sleep), name="slave-sync"))
        if self.timer_follower is not None:
            self._tasks.append(asyncio.create_task(self._slave_timer_loop(), name="slave-timer"))
        if not slave:
            self._tasks.append(asyncio.create_task(self._transaction_check_loop(), name="transaction-check"))
        if slave and self.config.slaveAutoPromoteAfterMs > 0:
            self._tasks.append(asyncio.create_task(self._auto_promote_loop(), name="auto-promote"))
        await self.register_all()
        log.info(
            "broker %s (%s) serving on %s, store %s, %s",
            self.config.brokerName,
            self.config.brokerClusterName,
            self.server.address,
            self.root,
            self.config.flushDiskType,
        )

    async def _start_delivery(self) -> None:
        """A master's delivery of delayed messages: the level schedule service and the timer's loop
        (journaled for slaves when timerReplication says so)."""
        await self.delay.start()
        if self.config.timer_journal:
            self.timer.enable_journal(TimerJournal(self.store, self.clock, self.store_host))
        await self.timer.start()

    async def _start_ha_service(self) -> None:
        """A master's end of the slaves' link; a port that cannot be bound is logged, not fatal."""
        # the HA port serves TLS and plaintext by the first byte, as the broker's port (tlsServerMode)
        accept = StreamAcceptor(ServerTls.from_config(self.config, "HA"), "HA", self.clock)
        self.ha = HAService(self.config, self.store, self.clock, accept=accept)
        self.services.set_ha(self.ha)
        try:
            await self.ha.start(self.bind_host)
        except OSError as e:
            log.error("HA: cannot listen on %s:%d (%s); no slave can connect, and SYNC_MASTER sends "
                      "answer SLAVE_NOT_AVAILABLE", self.bind_host, self.config.ha_port, e)

    async def _start_grpc(self) -> None:
        """The 5.x endpoint on grpcListenPort; off at -1 or without grpcio/protobuf. With an ACL on, every
        call is checked against the same accounts (grpc/auth.py). A port that cannot be bound is logged,
        not fatal."""
        port = self.config.grpcListenPort
        if port < 0:
            return
        try:
            from chronomq.grpc import GrpcServer, MessagingService
        except ImportError as e:
            log.error("gRPC endpoint: off, its packages (dependencies of chronomq) cannot be imported; "
                      "reinstall chronomq, or set grpcListenPort=-1: %s", e)
            return
        from .inproc import LocalCalls

        svc = MessagingService(self.services, LocalCalls(self.processor), (self.config.brokerIP1, port))
        if self.processor.acl is not None:
            from chronomq.grpc.auth import Guard

            svc.guard = Guard(self.processor.acl, self.clock.now_ms,
                              require_date_time=self.config.aclRequireTimestamp,
                              window_ms=self.config.aclReplayWindowMs)
        server = GrpcServer(svc, self.bind_host, port)
        try:
            await server.start()
        except OSError as e:
            log.error("gRPC endpoint: %s; 5.x clients cannot connect (set grpcListenPort to a free port, "
                      "or -1)", e)
            return
        svc.address = (self.config.brokerIP1, server.port)
        self.grpc = server
        log.info("gRPC endpoint (RocketMQ 5.x clients) on %s", self.grpc_addr)

    @property
    def grpc_addr(self) -> str:
        """The advertised host:port of the 5.x endpoint ("" when it is off)."""
        return f"{self.config.brokerIP1}:{self.grpc.port}" if self.grpc is not None else ""

    def _dispatch_soon(self) -> None:
        """The store's dispatch hook: consume-queue entries of the puts made during this event-loop
        turn are written later in the same turn, on the loop, and their held pulls are answered in the
        turn after (no hand-off to the dispatcher thread, no wait for the GIL)."""
        if self._dispatch_queued:
            return
        self._dispatch_queued = True
        assert self.loop is not None
        if threading.get_ident() == self._loop_thread:
            self.loop.call_soon(self._dispatch_run)
        else:
            self.loop.call_soon_threadsafe(self._dispatch_run)

    def _index_later(self, fn: Callable[[], None]) -> None:
        """The store's index deferral (see INDEX_DEFER_S), from the loop or the dispatcher thread."""
        loop = self.loop
        assert loop is not None
        if threading.get_ident() == self._loop_thread:
            loop.call_later(INDEX_DEFER_S, fn)
        else:
            loop.call_soon_threadsafe(loop.call_later, INDEX_DEFER_S, fn)

    # --- promotion ---------------------------------------------------------------------------------------
    @property
    def _role_file(self) -> Path:
        return self.root / "config" / ROLE_FILE

    def _apply_promotion(self) -> None:
        """A slave promoted before stays its broker name's master across restarts (config/role.json,
        written by promote; delete it to run this data directory as a slave again)."""
        try:
            saved = json.loads(self._role_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self._role_file}: unreadable ({e}); fix or delete it") from None
        role = saved.get("brokerRole") if isinstance(saved, dict) else None
        if role not in (ASYNC_MASTER, SYNC_MASTER):
            raise ConfigError(f"{self._role_file}: brokerRole {role!r} is not a master role; "
                              "fix or delete it")
        if self.config.brokerRole != role or self.config.brokerId != 0:
            log.warning("this data directory was promoted to %s (%s): running as brokerId 0, %s, not as "
                        "configured (%s, brokerId %d)", role, self._role_file, role, self.config.brokerRole,
                        self.config.brokerId)
            self.config.brokerRole, self.config.brokerId = role, 0

    async def promote(self, role: str = ASYNC_MASTER) -> None:
        """Turn this slave into the master of its broker name, for good (config/role.json): stop taking
        from the old master, apply the whole timer journal it received, start the delay-level schedule
        service (from the copied delayOffset.json, skipping what the old master re-put, which it finds in
        the replicated log) and the timer's delivery, listen for slaves, and register as brokerId 0.
        Raises PromoteError when this broker is not a slave or ``role`` is not a master role."""
        if not self.config.is_slave:
            raise PromoteError(f"this broker is already a master ({self.config.brokerRole})")
        if role not in (ASYNC_MASTER, SYNC_MASTER):
            raise PromoteError(f"brokerRole {role!r}: a promoted slave becomes ASYNC_MASTER or SYNC_MASTER")
        log.warning("promotion: this slave (%s, brokerId %d) becomes the master of %s as %s",
                    self.broker_addr, self.config.brokerId, self.config.brokerName, role)
        if self.ha_client is not None:
            await self.ha_client.stop()
            self.ha_client = None
        self.store.end_replication()
        for t in [t for t in self._tasks if t.get_name() in ("slave-sync", "slave-timer")]:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
            self._tasks.remove(t)
        self.slave_sync = None
        if self._sync_client is not None:
            await self._sync_client.close()
            self._sync_client = None
        if self.timer_follower is not None:
            applied = self.timer_follower.apply_available(limit=1 << 62)
            self.timer_follower.save()
            log.info("promotion: %d timer journal records applied last", applied)
            self.timer_follower = None
        saved = {"brokerRole": role, "promotedAtMs": self.clock.now_ms()}
        await asyncio.to_thread(write_atomic, self._role_file, json.dumps(saved).encode())
        old_id = self.config.brokerId
        self.config.brokerRole, self.config.brokerId = role, 0
        await self._start_delivery()
        await self._start_ha_service()
        self._tasks.append(asyncio.create_task(self._transaction_check_loop(), name="transaction-check"))
        await self.register_all()  # the name server moves this address to id 0
        log.warning("promotion done: %s is the master of %s (was brokerId %d)", self.broker_addr,
                    self.config.brokerName, old_id)

    async def _transaction_check_loop(self) -> None:
        """A master's check of undecided half messages, every transactionCheckInterval (RocketMQ's
        TransactionalMessageCheckService; the first round after one interval)."""
        while True:
            await self.clock.sleep(self.config.transactionCheckInterval / 1000)
            try:
                counts = self.transactions.check_once()
                if counts["checked"] or counts["given_up"]:
                    log.info("transactions: %d half messages checked, %d given up", counts["checked"],
                             counts["given_up"])
            except Exception:
                log.exception("transactions: the check round failed; trying again next interval")

    async def _auto_promote_loop(self) -> None:
        """slaveAutoPromoteAfterMs: promote this slave once its master has sent nothing for that long
        and the name server, asked again, lists no master for this broker name (the name server is the
        witness: a master that lost only its link to this slave keeps its role)."""
        after = self.config.slaveAutoPromoteAfterMs
        while self.config.is_slave and not self.stopping:
            await self.clock.sleep(min(1.0, after / 1000))
            c = self.ha_client
            if c is None:
                return
            silent = self.clock.now_ms() - (c.last_receive_ms or self.started_at)
            if c.connected or silent < after:
                continue
            await self.register_all()  # the name server's answer names the master it has, if any
            if self.slave_sync is not None and self.slave_sync.master_addr:
                continue
            log.warning("auto promotion: no word from the master for %d ms and the name server lists none "
                        "for %s", silent, self.config.brokerName)
            try:
                await self.promote(ASYNC_MASTER)
            except Exception:
                log.exception("auto promotion failed; still a slave, trying again")
                continue
            return

    async def _slave_timer_loop(self) -> None:
        """A slave's timer delivers nothing, so its flush and retention (the delivery loop's periodic
        work on a master) run here, off the event loop, with the follower's position saved after each
        flush."""
        timer = self.timer.timer
        next_retention = self.clock.now_ms() + timer.cfg.retention_interval_ms
        while True:
            await self.clock.sleep(timer.cfg.flush_interval_ms / 1000)
            try:
                if timer.dirty:
                    follower = self.timer_follower
                    applied = follower.offset if follower is not None else 0  # all of it is in the files
                    await in_background(timer.flush)
                    if follower is not None:
                        await in_background(follower.save, applied)
                now = self.clock.now_ms()
                if now >= next_retention:
                    await in_background(timer.run_retention, now)
                    next_retention = now + timer.cfg.retention_interval_ms
            except OSError as e:
                log.error("slave timer: flush or retention failed (retried next time): %s", e)

    def _journal_arrival(self, topic: str, queue_id: int, max_offset: int, store_ts: int) -> None:
        """The store's arrival listener on a slave: new journal records are applied on the loop."""
        if topic != JOURNAL_TOPIC or self._journal_queued or self.loop is None:
            return
        self._journal_queued = True
        self.loop.call_soon_threadsafe(self._journal_run)

    def _journal_run(self) -> None:
        self._journal_queued = False
        if self.timer_follower is not None and not self.stopping:
            self.timer_follower.apply_available()

    def _dispatch_run(self) -> None:
        self._dispatch_queued = False
        self.store.dispatch_now()
        if self.ha is not None:
            self.ha.wake()

    async def shutdown(self) -> None:
        if self.stopping:
            return
        self.services.mark_stopping()
        self.hold.wake_all()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.unregister_all()
        if self.ns_client is not None:
            await self.ns_client.close()
        # let answered pulls go out, then close the listener and every connection
        for _ in range(5):
            await asyncio.sleep(0)
        await self.server.stop()
        if self.grpc is not None:
            try:
                await self.grpc.stop()
            except Exception:
                log.exception("gRPC endpoint shutdown failed")
            self.grpc = None
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)
            self.metrics = None
        if self.ha is not None:
            await self.ha.stop()
        if self.ha_client is not None:
            await self.ha_client.stop()
        if self._sync_client is not None:
            await self._sync_client.close()
        try:
            await self.delay.shutdown()
        except Exception:
            log.exception("delay service shutdown failed")
        try:
            await self.timer.shutdown()  # its files closed and synced, then the follower's position
            if self.timer_follower is not None:
                self.timer_follower.save()
        except Exception:
            log.exception("timer service shutdown failed")
        self._persist(force=True)
        self.store.shutdown()
        log.info("broker %s stopped", self.config.brokerName)

    # --- periodic services --------------------------------------------------------------------------------
    def _persist(self, force: bool = False) -> None:
        try:
            self.offsets.persist(force)
        except OSError as e:
            log.error("cannot persist consumer offsets: %s", e)
        try:
            if force:
                self.topics.persist()
        except OSError as e:
            log.error("cannot persist topics: %s", e)

    async def _persist_loop(self) -> None:
        while True:
            await self.clock.sleep(self.config.flushConsumerOffsetInterval / 1000)
            await asyncio.to_thread(self._persist)  # fsync off the event loop

    async def _housekeeping_loop(self) -> None:
        while True:
            await self.clock.sleep(HOUSEKEEPING_INTERVAL_MS / 1000)
            self.housekeeping()

    def housekeeping(self) -> None:
        now = self.clock.now_ms()
        for group in self.consumers.expire(now):
            log.info(
                "consumer group %s: client(s) dropped after %d s without heartbeat",
                group,
                self.consumers.expire_ms // 1000,
            )
            self.notify_consumer_ids_changed(group)
        self.producers.expire(now)

    async def _register_loop(self) -> None:
        period = max(1000, self.config.registerNameServerPeriod) / 1000
        while True:
            sleeper = asyncio.ensure_future(self.clock.sleep(period))
            waiter = asyncio.ensure_future(self._register_event.wait())
            try:
                await asyncio.wait((sleeper, waiter), return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                waiter.cancel()
            self._register_event.clear()
            await self.register_all()

    def _topic_changed(self, topic_config: TopicConfig) -> None:
        # a new topic must be routable at once (the producer that auto-created it asks again soon)
        if self.local_register is not None:
            self._register_local()
        elif self.loop is not None and hasattr(self, "_register_event"):
            self._register_event.set()

    def _register_body(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.topics.snapshot(), dict(self.topics.data_version)

    def _register_local(self) -> dict[str, Any] | None:
        assert self.local_register is not None
        topics, version = self._register_body()
        return self.local_register(
            self.config.brokerClusterName,
            self.config.brokerName,
            self.broker_addr,
            self.config.brokerId,
            f"{self.config.brokerIP1}:{self.config.ha_port}",
            topics,
            version,
            self.clock.now_ms(),
            None,
        )

    async def register_all(self) -> None:
        if self.local_register is not None:
            result = self._register_local()
        elif self.ns_client is not None:
            topics, version = self._register_body()
            result = await self.ns_client.register_broker(self.config, self.broker_addr, topics, version)
        else:
            return
        if self.ha_client is not None and result:
            self.ha_client.set_master(str(result.get("haServerAddr") or ""))
        if self.slave_sync is not None and result:
            self.slave_sync.master_addr = str(result.get("masterAddr") or "")

    async def unregister_all(self) -> None:
        if self.ns_client is not None:
            await self.ns_client.unregister_broker(self.config, self.broker_addr)

    # --- clients -------------------------------------------------------------------------------------------
    def _on_connection_closed(self, conn: Connection) -> None:
        for group in self.consumers.drop_connection(conn):
            log.info("consumer group %s: a client left (connection %s closed)", group, conn.remote_addr)
            self.notify_consumer_ids_changed(group)
        self.producers.drop_connection(conn)

    def notify_consumer_ids_changed(self, group: str) -> None:
        if self.stopping:
            return
        for conn in self.consumers.connections(group):
            cmd = RemotingCommand.request(
                RequestCode.NOTIFY_CONSUMER_IDS_CHANGED, {"consumerGroup": group}, oneway=True
            )
            cmd.language = "JAVA"
            conn.send_oneway(cmd)

    # --- metrics -------------------------------------------------------------------------------------------
    def _start_metrics(self) -> None:
        port = self.config.metrics_port
        if port is None:
            return
        from chronomq.metrics import MetricsServer

        loop = self.loop
        assert loop is not None

        def snapshot() -> dict[str, Any]:  # a scrape, in the endpoint's thread: read on the loop
            async def on_loop() -> dict[str, Any]:
                return self.metrics_snapshot()

            return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(10)

        try:
            # HTTPS too, by the first byte, with the broker port's mode and certificate (docs/metrics.md)
            tls = ServerTls.from_config(self.config, "metrics")
            self.metrics = MetricsServer(snapshot, self.bind_host, port, tls=tls, loop=loop,
                                         monotonic=self.clock.monotonic)
            log.info("metrics on %s (%s)", self.metrics.url(), self.metrics.scheme)
        except OSError as e:
            log.error("metrics: cannot listen on %s:%d (%s); set metricsPort to a free port, or -1",
                      self.bind_host, port, e)

    def metrics_snapshot(self) -> dict[str, Any]:
        """The figures of metrics.families (on the loop)."""
        store = self.store
        topics = {t: sum(store.get_max_offset_in_queue(t, q) for q in store.queue_ids(t))
                  for t in store.topics()}
        groups = []
        for key, queues in list(self.offsets.table.items()):
            topic, _, group = key.partition("@")
            diff = sum(max(0, store.get_max_offset_in_queue(topic, q) - off) for q, off in queues.items())
            groups.append({"topic": topic, "group": group, "offset": sum(queues.values()), "diff": diff})
        levels = {st.level: self.delay.schedule.level_stats(st)["pending"]
                  for st in self.delay.schedule.states.values()}
        t = self.timer.timer
        stats = self.timer.stats()
        lat = Histogram.merged(t.hist.values())
        traffic = self.services.traffic
        pull_lat = traffic.pull_lateness
        flush = store.flush_times
        rep = None
        if self.ha is not None and self.ha.links:
            lag_bytes, lag_ms = self.ha.lag()
            rep = {"lag_bytes": lag_bytes, "lag_ms": lag_ms}
        return {
            "cluster": self.config.brokerClusterName, "broker": self.config.brokerName,
            "role": self.config.brokerRole, "put_messages": self.services.put_stats.count,
            "put_failures": self.services.put_stats.failures, "topics": topics, "groups": groups,
            "dedup_replays": self.services.dedup.replays if self.services.dedup is not None else 0,
            "commitlog": {"max": store.max_phy_offset, "min": store.min_phy_offset}, "delay_levels": levels,
            "timer": {"pending": dict(stats.get("pending_by_topic") or {}), "delivered": stats["delivered"],
                      "cancelled": stats["cancelled"], "rescheduled": stats["rescheduled"],
                      "early": stats["early_deliveries"],
                      "lateness": {"buckets": lat.cumulative(LATENESS_BUCKETS_MS), "count": lat.count,
                                   "sum": lat.total}},
            "traffic": {"in": [(t, k, v[0], v[1]) for (t, k), v in list(traffic.produced.items())],
                        "out": [(t, g, v[0], v[1]) for (t, g), v in list(traffic.consumed.items())],
                        "pull_lateness": {"buckets": pull_lat.cumulative(LATENESS_BUCKETS_MS),
                                          "count": pull_lat.count, "sum": pull_lat.total}},
            "storage": {"disk_ratio": store.disk_usage_ratio(),
                        "flush": {"buckets": flush.cumulative(), "count": flush.count, "sum": flush.total_ms},
                        "flush_behind": max(0, store.max_phy_offset - store.flushed_offset),
                        "dispatch_behind": max(0, store.max_phy_offset - store.dispatched_offset)},
            "replication": rep,
        }

    # --- stats ---------------------------------------------------------------------------------------------
    def runtime_info(self) -> dict[str, Any]:
        tx = {"transaction" + k[0].upper() + k[1:]: v for k, v in self.transactions.stats().items()}
        return {**self._ha_info(), **self._base_info(), **tx}

    def _ha_info(self) -> dict[str, Any]:
        """Role and replication: on a master the best slave's lag (-1 with none connected); on a slave
        what its master told it last, and the metadata copy's last round."""
        info: dict[str, Any] = {"brokerRole": self.config.brokerRole}
        if self.ha is not None:
            lag_bytes, lag_ms = self.ha.lag()
            info.update(haSlaves=len(self.ha.links), haSlaveAckOffset=self.ha.push_to_slave_max,
                        haLagBytes=lag_bytes, haLagMs=lag_ms)
            recent = sorted(self.ha.replication_ms)  # append -> a slave's ack, the last 4,096 appends
            if recent:
                info.update(haReplicationP50Ms=recent[len(recent) // 2],
                            haReplicationP99Ms=recent[min(len(recent) - 1, len(recent) * 99 // 100)],
                            haReplicationMaxMs=recent[-1])
        if self.ha_client is not None:
            c = self.ha_client
            known = c.master_offset >= 0
            info.update(haMasterAddr=c.master_addr or "", haConnected=c.connected,
                        haMasterOffset=c.master_offset,
                        haLagBytes=max(0, c.master_offset - self.store.max_phy_offset) if known else -1,
                        haLastReceiveAgoMs=(self.clock.now_ms() - c.last_receive_ms
                                            if c.last_receive_ms else -1))
        if self.slave_sync is not None:
            last = self.slave_sync.last
            info.update(masterAddr=self.slave_sync.master_addr, slaveSyncRounds=self.slave_sync.rounds,
                        slaveSyncErrors=",".join(last.errors) if last and last.errors else "")
        return info

    def _base_info(self) -> dict[str, Any]:
        return {
            "brokerName": self.config.brokerName,
            "brokerAddr": self.broker_addr,
            "clusterName": self.config.brokerClusterName,
            "brokerId": self.config.brokerId,
            "bootTimestamp": self.started_at,
            "putMessageTimesTotal": self.services.put_stats.count,
            "putMessageFailedTimes": self.services.put_stats.failures,
            "requestsTotal": self.server.requests,
            "commitLogMaxOffset": self.store.max_phy_offset,
            "commitLogMinOffset": self.store.min_phy_offset,
            "heldPulls": self.hold.held,
            "connections": len(self.server.connections()),
            "topics": len(self.topics.table),
            "consumerGroups": len(self.consumers.groups),
            "flushDiskType": self.config.flushDiskType,
            "brokerVersionDesc": f"chronomq {__version__}",
            "commitLogDiskRatio": round(self.store.disk_usage_ratio(), 4),
            "uptimeSeconds": (self.clock.now_ms() - self.started_at) // 1000,
        }
