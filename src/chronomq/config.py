"""Configuration: RocketMQ's properties format and key names (``-c broker.conf``).

One flat ``BrokerConfig`` holds the broker and store keys (RocketMQ splits them into BrokerConfig and
MessageStoreConfig; the file format does not care). Attribute names are RocketMQ's key names so a
broker.conf written for Apache RocketMQ reads unchanged. Unknown keys are reported as warnings; bad
values raise ConfigError with the key, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_LEVEL_RE = re.compile(r"^(\d+)(ms|s|m|h|d)$")

ASYNC_FLUSH = "ASYNC_FLUSH"
SYNC_FLUSH = "SYNC_FLUSH"
ASYNC_MASTER = "ASYNC_MASTER"
SYNC_MASTER = "SYNC_MASTER"
SLAVE = "SLAVE"
BROKER_ROLES = (ASYNC_MASTER, SYNC_MASTER, SLAVE)

TLS_MODES = ("disabled", "permissive", "enforcing")
# RocketMQ's names for the TLS keys: its TlsSystemConfig system properties, and the proxy's
# tlsCertPath/tlsKeyPath, which are chronomq's own names
TLS_KEY_ALIASES = {
    "tls.server.mode": "tlsServerMode",
    "tls.test.mode.enable": "tlsTestModeEnable",
    "tls.server.certPath": "tlsCertPath",
    "tls.server.keyPath": "tlsKeyPath",
    "tls.server.need.client.auth": "tlsServerNeedClientAuth",
    "tls.server.trustCertPath": "tlsServerTrustCertPath",
    # the client side: the broker's own connections (name servers, a slave's master)
    "tls.enable": "tlsEnable",
    "tls.client.authServer": "tlsClientAuthServer",
    "tls.client.trustCertPath": "tlsClientTrustCertPath",
    "tls.client.certPath": "tlsClientCertPath",
    "tls.client.keyPath": "tlsClientKeyPath",
}
# chronomq's name of a TLS key -> its RocketMQ name, for error messages
_TLS_ROCKETMQ_NAMES = {v: k for k, v in TLS_KEY_ALIASES.items()}


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message says which key and why."""


def parse_delay_levels(text: str) -> list[int]:
    """'1s 5s 10s ...' -> [1000, 5000, 10000, ...] (ms). Units ms, s, m, h, d. Raises ConfigError."""
    levels = []
    for item in text.split():
        m = _LEVEL_RE.match(item.strip())
        if not m:
            raise ConfigError(f"messageDelayLevel: {item!r} is not a duration like 10s, 500ms, 5m, 2h or 1d")
        value = int(m.group(1)) * _UNIT_MS[m.group(2)]
        if value <= 0:
            raise ConfigError(f"messageDelayLevel: {item!r} must be positive")
        levels.append(value)
    if not levels:
        raise ConfigError("messageDelayLevel: at least one level is required")
    return levels


@dataclass
class BrokerConfig:
    # identity and network
    brokerClusterName: str = "DefaultCluster"
    brokerName: str = "broker-a"
    brokerId: int = 0
    brokerIP1: str = "127.0.0.1"
    listenPort: int = 10911
    namesrvAddr: str = "127.0.0.1:9876"
    # topics
    autoCreateTopicEnable: bool = True
    defaultTopicQueueNums: int = 4
    autoCreateSubscriptionGroup: bool = True
    # RocketMQ's topics named after the cluster (16 queues) and after this broker (1 queue): always
    # registered, so that a route lookup by cluster or broker name finds this broker (the Java admin's
    # createTopic(key=clusterName, ...)); these keys decide whether they can also be read and written
    clusterTopicEnable: bool = True
    brokerTopicEnable: bool = True
    # what RocketMQ's broker stamps on every message a producer sends (MSG_REGION, TRACE_ON; CLUSTER is
    # brokerClusterName) and answers in every SEND's header
    regionId: str = "DefaultRegion"
    traceOn: bool = True
    # request-reply: a reply (SEND_REPLY_MESSAGE) is stored under <brokerClusterName>_REPLY_TOPIC too,
    # besides being pushed to the requester
    storeReplyMessageEnable: bool = True
    # store
    storePathRootDir: str = "./data"
    mappedFileSizeCommitLog: int = 1024 * 1024 * 1024
    mappedFileSizeConsumeQueue: int = 300_000 * 20
    flushDiskType: str = ASYNC_FLUSH
    flushIntervalCommitLog: int = 500
    flushCommitLogTimed: bool = True
    flushIntervalConsumeQueue: int = 1000
    syncFlushTimeout: int = 5000
    fileReservedTime: int = 72  # hours
    deleteWhen: str = "04"
    diskMaxUsedSpaceRatio: int = 75  # % of the store's file system: past it, expired segments go now
    # past diskSpaceCleanForciblyRatio % the oldest segments go regardless of age (cleanFileForciblyEnable);
    # past diskSpaceWarningLevelRatio % the store is "disk full": sends are refused (SERVICE_NOT_AVAILABLE)
    # until use is back under diskSpaceCleanForciblyRatio (RocketMQ's system properties, 85 and 90)
    diskSpaceCleanForciblyRatio: int = 85
    diskSpaceWarningLevelRatio: int = 90
    # Linux: the store's background threads (flush, allocate, dispatch, clean, the timer's fsyncs) run under
    # SCHED_BATCH, so that waking one never preempts the event loop (chronomq.store.threads); process-wide
    backgroundThreadsBatch: bool = True
    cleanFileForciblyEnable: bool = True
    # a file holding a disk use in percent, read instead of the file system's (drills and tests)
    diskUsageProbeFile: str = ""
    cleanResourceInterval: int = 10_000
    maxMessageSize: int = 4 * 1024 * 1024
    maxHashSlotNum: int = 5_000_000
    maxIndexNum: int = 5_000_000 * 4
    messageIndexEnable: bool = True
    checkCRCOnRecover: bool = True
    # delay and retry
    messageDelayLevel: str = DEFAULT_DELAY_LEVELS
    flushDelayOffsetInterval: int = 10_000
    maxReconsumeTimes: int = 16
    # timer store (any deliver time; validated by chronomq.delay.timer.TimerConfig)
    timerMaxDelaySec: int = 40 * 86_400
    timerPrecisionMs: int = 1000  # wheel slot size; must divide a day
    timerFlushIntervalMs: int = 1000
    timerFlushEntries: int = 16_384  # also flush once this many entries were parked since the last one
    timerDataSegmentSize: int = 64 * 1024 * 1024
    timerRetentionIntervalMs: int = 60_000
    timerStageAheadMs: int = 50  # messages due this soon are read and encoded ahead (0: off)
    # at most this many staged at once, holding at most this many bytes of records (a burst's memory)
    timerStageLimit: int = 131_072
    timerStageBytes: int = 192 * 1024 * 1024
    # de-duplication of sends that ask for it (property CHRONOMQ_DEDUP=true, the Spark sink's default) by
    # (topic, UNIQ_KEY): a replay within the window is answered as the original and stored once; 0 = off
    dedupWindowSec: int = 86_400
    dedupRecentMax: int = 100_000  # keys kept in memory for the moments before the index has them
    # consumers
    flushConsumerOffsetInterval: int = 5000
    longPollingEnable: bool = True
    # one PULL_MESSAGE answer holds at most this many messages and, past its first message, this many
    # bytes, whatever maxMsgNums asks (RocketMQ's MessageStoreConfig keys and defaults, its in-memory ones)
    maxTransferCountOnMessageInMemory: int = 32
    maxTransferBytesOnMessageInMemory: int = 256 * 1024
    # the same caps for a pull that asks for bulk answers (extField chronomqBulkRead, which only chronomq's
    # readers send, the Spark source's among them): fewer, larger answers for a reader going through a backlog
    maxTransferCountOnBulkRead: int = 1024
    maxTransferBytesOnBulkRead: int = 1024 * 1024
    # SQL92 subscriptions (RocketMQ's key and default): off, they are refused as RocketMQ refuses them;
    # on, pulls and gRPC receives filter by message properties (docs/filter.md)
    enablePropertyFilter: bool = False
    clientChannelMaxIdleTimeSeconds: int = 120
    registerNameServerPeriod: int = 30_000
    # what a connection may hold, for the broker's port and the embedded name server's (RocketMQ's
    # NettyServerConfig names where it has the key; 0 turns a limit off)
    frameMaxLength: int = 16 * 1024 * 1024  # a longer length prefix closes the connection at once
    serverFrameReadTimeoutMillis: int = 30_000  # a started frame, or a new connection's first, must be whole
    serverChannelMaxIdleTimeSeconds: int = 120  # no byte either way and no request held: closed
    serverMaxConnections: int = 10_000  # beyond it, accepted and closed at once
    serverMaxConnectionsPerIp: int = 1_000
    serverMaxBufferedFrameBytes: int = 512 * 1024 * 1024  # unfinished frames over all connections
    writeBufferHighWaterMark: int = 64 * 1024  # unsent bytes above which a connection's reading pauses
    writeBufferLowWaterMark: int = 32 * 1024  # and below which it resumes
    # the Prometheus endpoint (/metrics): 0 = listenPort + 2, -1 = off
    metricsPort: int = 0
    # `chronomq start`: the embedded name server's /metrics: 0 = its port + 2, -1 = off (metricsPort -1 turns
    # both off)
    namesrvMetricsPort: int = 0
    # the RocketMQ 5.x gRPC endpoint (docs/grpc.md): -1 = off, 0 = any free port; `chronomq start` and
    # `chronomq broker` default it to 8081, the port of RocketMQ's proxy
    grpcListenPort: int = -1
    # 5.x consumer groups that consume in order (RocketMQ's group attribute "consume orderly"):
    # comma-separated names; a queue hands such a group nothing new while a message of it is in flight
    grpcFifoGroups: str = ""
    # what the endpoint checks, with RocketMQ proxy's names and defaults (docs/grpc.md, "Limits"): a sent
    # message's user properties (count; bytes of their names and values with its tag and keys together),
    # its message group's bytes; a receive's invisible duration (ms); how long a receive that names no
    # long_polling_timeout is held (ms, cut to the client's deadline)
    maxUserPropertySize: int = 16 * 1024
    userPropertyMaxNum: int = 128
    maxMessageGroupSize: int = 64
    minInvisibleTimeMillsForRecv: int = 10_000
    maxInvisibleTimeMills: int = 12 * 3_600_000
    grpcClientConsumerMinLongPollingTimeoutMillis: int = 5_000
    grpcClientConsumerMaxLongPollingTimeoutMillis: int = 20_000
    # TLS on the gRPC endpoint's port (docs/grpc.md, "TLS"). RocketMQ's names are accepted too: its
    # system properties tls.server.mode, tls.test.mode.enable, tls.server.certPath, tls.server.keyPath,
    # tls.server.need.client.auth, tls.server.trustCertPath (see TLS_KEY_ALIASES)
    tlsServerMode: str = "permissive"  # disabled (plaintext only) | permissive (both, one port) | enforcing
    tlsTestModeEnable: bool = True  # no tlsCertPath: serve a self-signed certificate kept in the data dir
    tlsCertPath: str = ""  # PEM certificate chain (the proxy's key name)
    tlsKeyPath: str = ""  # its PEM private key, unencrypted
    tlsServerNeedClientAuth: str = "none"  # none | require (mutual TLS: a client certificate is verified)
    tlsServerTrustCertPath: str = ""  # PEM certificates client certificates must chain to (with require)
    # TLS on the broker's own connections: its registrations with name servers and a slave's links to its
    # master (metadata over remoting, the HA link); RocketMQ's client keys (docs/tls.md, "Outgoing")
    tlsEnable: bool = False
    tlsClientAuthServer: bool = False  # verify the server's certificate (else any is taken, as RocketMQ)
    tlsClientTrustCertPath: str = ""  # PEM certificates to verify it with ("": the system's roots)
    tlsClientCertPath: str = ""  # a client certificate for mutual TLS (PEM chain)
    tlsClientKeyPath: str = ""  # its PEM private key, unencrypted
    # ACL 1.0: every request signed by an account of aclFile ("": <storePathRootDir>/conf/plain_acl.yml)
    aclEnable: bool = False
    aclFile: str = ""
    aclReplayWindowMs: int = 300_000  # a request signed with a Timestamp further away is refused
    aclRequireTimestamp: bool = False  # refuse requests without chronomq's Timestamp (RocketMQ's clients)
    # ACL 2.0 (RocketMQ 5.3's keys; docs/acl.md): users and ACLs kept in authConfigPath
    # ("": <storePathRootDir>/config/auth.json); the init user's JSON {"username","password"} is a Super user
    authenticationEnabled: bool = False
    authorizationEnabled: bool = False
    initAuthenticationUser: str = field(default="", repr=False)  # secret: never in a repr
    # {"accessKey","secretKey"}: also a Super user; secret: never in a repr
    innerClientAuthenticationCredentials: str = field(default="", repr=False)
    authConfigPath: str = ""
    # transactions (RocketMQ's keys and defaults)
    rejectTransactionMessage: bool = False
    transactionTimeOut: int = 6000  # a half message undecided this long (ms) is checked
    transactionCheckInterval: int = 60_000  # ms between check rounds
    transactionCheckMax: int = 15  # checks before a half message is given up (TRANS_CHECK_MAX_TIME_TOPIC)
    # HA
    brokerRole: str = "ASYNC_MASTER"  # ASYNC_MASTER | SYNC_MASTER | SLAVE
    haListenPort: int = 0  # 0: listenPort + 1, as RocketMQ's BrokerStartup sets it
    haMasterAddress: str = ""  # a slave's master HA address host:port ("": learnt from the name server)
    haSendHeartbeatInterval: int = 5000
    haHousekeepingInterval: int = 20_000  # a slave silent this long is dropped
    haTransferBatchSize: int = 32 * 1024
    haSlaveFallbehindMax: int = 256 * 1024 * 1024  # SYNC_MASTER: a slave further behind is not in sync
    # a slave promotes itself (as ASYNC_MASTER) once its master has sent nothing for this long and the
    # name server lists no master for its broker name; 0: only `chronomq admin promote` does
    slaveAutoPromoteAfterMs: int = 0
    # reads from a slave (RocketMQ's keys): with slaveReadEnable a master suggests its slave (brokerId 1)
    # to a consumer that is more than accessMessageInMemoryMaxRatio % of the machine's RAM behind
    slaveReadEnable: bool = False
    accessMessageInMemoryMaxRatio: int = 40
    # the timer's journal in the commit log, from which slaves rebuild it: "auto" (on for SYNC_MASTER),
    # "true" or "false"
    timerReplication: str = "auto"

    extra: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def delay_levels_ms(self) -> list[int]:
        return parse_delay_levels(self.messageDelayLevel)

    @property
    def sync_flush(self) -> bool:
        return self.flushDiskType == SYNC_FLUSH

    @property
    def fifo_groups(self) -> frozenset[str]:
        return frozenset(g.strip() for g in self.grpcFifoGroups.split(",") if g.strip())

    @property
    def ha_port(self) -> int:
        return self.haListenPort or self.listenPort + 1

    @property
    def metrics_port(self) -> int | None:
        return None if self.metricsPort < 0 else (self.metricsPort or self.listenPort + 2)

    @property
    def acl_path(self) -> Path:
        return Path(self.aclFile) if self.aclFile else Path(self.storePathRootDir) / "conf" / "plain_acl.yml"

    @property
    def auth_path(self) -> Path:
        return Path(self.authConfigPath) if self.authConfigPath else (
            Path(self.storePathRootDir) / "config" / "auth.json")

    @property
    def is_slave(self) -> bool:
        return self.brokerRole == SLAVE

    @property
    def timer_journal(self) -> bool:
        """Whether this broker, as a master, journals its timer for slaves (timerReplication)."""
        if self.timerReplication == "auto":
            return self.brokerRole == SYNC_MASTER
        return self.timerReplication == "true"

    def validate(self) -> None:
        if self.brokerRole not in BROKER_ROLES:
            raise ConfigError(f"brokerRole: {self.brokerRole!r} must be one of {', '.join(BROKER_ROLES)}")
        if (self.brokerRole == SLAVE) != (self.brokerId > 0):
            raise ConfigError(f"brokerId: {self.brokerId} with brokerRole {self.brokerRole}: a master has "
                              "brokerId 0, a slave a brokerId of 1 or more")
        if not -1 <= self.grpcListenPort < 65536 or self.grpcListenPort in (self.listenPort, self.ha_port):
            raise ConfigError(f"grpcListenPort: {self.grpcListenPort} must be -1 (off), 0 (any free port) "
                              "or a TCP port other than listenPort and the HA port")
        for name in ("metricsPort", "namesrvMetricsPort"):
            if not -1 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name}: {getattr(self, name)} must be -1 (off), 0 (its default port) "
                                  "or a TCP port")
        self._validate_tls()
        self._validate_tls_client()
        if not 0 <= self.haListenPort < 65536 or self.ha_port == self.listenPort or self.ha_port > 65535:
            raise ConfigError(f"haListenPort: {self.haListenPort} must be a TCP port other than listenPort")
        for name in ("haSendHeartbeatInterval", "haHousekeepingInterval", "haTransferBatchSize",
                     "haSlaveFallbehindMax", "transactionTimeOut", "transactionCheckInterval",
                     "transactionCheckMax"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive")
        for name in ("maxUserPropertySize", "userPropertyMaxNum", "maxMessageGroupSize",
                     "maxInvisibleTimeMills", "grpcClientConsumerMinLongPollingTimeoutMillis",
                     "maxTransferCountOnMessageInMemory", "maxTransferBytesOnMessageInMemory",
                     "maxTransferCountOnBulkRead", "maxTransferBytesOnBulkRead"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if not 0 <= self.minInvisibleTimeMillsForRecv <= self.maxInvisibleTimeMills:
            raise ConfigError(f"minInvisibleTimeMillsForRecv: {self.minInvisibleTimeMillsForRecv} must be "
                              f"within 0 and maxInvisibleTimeMills ({self.maxInvisibleTimeMills})")
        poll_min = self.grpcClientConsumerMinLongPollingTimeoutMillis
        if self.grpcClientConsumerMaxLongPollingTimeoutMillis < poll_min:
            raise ConfigError(f"grpcClientConsumerMaxLongPollingTimeoutMillis: must be at least "
                              f"grpcClientConsumerMinLongPollingTimeoutMillis ({poll_min})")
        if self.slaveAutoPromoteAfterMs < 0:
            raise ConfigError("slaveAutoPromoteAfterMs: must be 0 (off) or a positive number of ms")
        if not 0 < self.accessMessageInMemoryMaxRatio <= 100:
            raise ConfigError(f"accessMessageInMemoryMaxRatio: {self.accessMessageInMemoryMaxRatio} must be "
                              "1..100")
        if self.timerReplication not in ("auto", "true", "false"):
            raise ConfigError(f"timerReplication: {self.timerReplication!r} must be auto, true or false")
        if self.flushDiskType not in (ASYNC_FLUSH, SYNC_FLUSH):
            raise ConfigError(f"flushDiskType: {self.flushDiskType!r} must be ASYNC_FLUSH or SYNC_FLUSH")
        for name in ("mappedFileSizeCommitLog", "mappedFileSizeConsumeQueue", "maxMessageSize",
                     "defaultTopicQueueNums", "flushIntervalCommitLog", "flushIntervalConsumeQueue"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.mappedFileSizeConsumeQueue % 20:
            raise ConfigError("mappedFileSizeConsumeQueue: must be a multiple of 20 (the unit size)")
        if not 0 <= self.dedupWindowSec <= 30 * 86_400:
            raise ConfigError(f"dedupWindowSec: {self.dedupWindowSec} must be within 0 (off) and 2592000 "
                              "(30 days)")
        if self.dedupRecentMax < 1_000:
            raise ConfigError(f"dedupRecentMax: {self.dedupRecentMax} must be at least 1000")
        if not 10 <= self.diskMaxUsedSpaceRatio <= 95:
            raise ConfigError(f"diskMaxUsedSpaceRatio: {self.diskMaxUsedSpaceRatio} must be within 10..95")
        if not 10 <= self.diskSpaceCleanForciblyRatio <= self.diskSpaceWarningLevelRatio <= 100:
            raise ConfigError(f"diskSpaceCleanForciblyRatio ({self.diskSpaceCleanForciblyRatio}) and "
                              f"diskSpaceWarningLevelRatio ({self.diskSpaceWarningLevelRatio}) must satisfy "
                              "10 <= diskSpaceCleanForciblyRatio <= diskSpaceWarningLevelRatio <= 100")
        if self.cleanResourceInterval <= 0:
            raise ConfigError(f"cleanResourceInterval: must be positive, got {self.cleanResourceInterval}")
        self._validate_connection_limits()
        if not 0 < self.listenPort < 65536:
            raise ConfigError(f"listenPort: {self.listenPort} is not a TCP port")
        if self.maxReconsumeTimes < 0:
            raise ConfigError("maxReconsumeTimes: must be >= 0")
        hours = [h for h in self.deleteWhen.split(";") if h]
        if not hours or not all(h.isdigit() and 0 <= int(h) <= 23 for h in hours):
            raise ConfigError(f"deleteWhen: {self.deleteWhen!r} must be hours 00..23 separated by ';'")
        parse_delay_levels(self.messageDelayLevel)

    def _validate_tls(self) -> None:
        if self.tlsServerMode not in TLS_MODES:
            raise ConfigError(f"tlsServerMode (tls.server.mode): {self.tlsServerMode!r} must be one of "
                              f"{', '.join(TLS_MODES)}")
        if self.tlsServerNeedClientAuth not in ("none", "require"):
            raise ConfigError(f"tlsServerNeedClientAuth (tls.server.need.client.auth): "
                              f"{self.tlsServerNeedClientAuth!r} must be none or require (the gRPC endpoint "
                              "cannot ask for an optional client certificate)")
        if bool(self.tlsCertPath) != bool(self.tlsKeyPath):
            raise ConfigError("tlsCertPath and tlsKeyPath (tls.server.certPath, tls.server.keyPath): set "
                              "both or neither")
        if self.tlsServerMode != "disabled" and not self.tlsCertPath and not self.tlsTestModeEnable:
            raise ConfigError(f"tlsServerMode {self.tlsServerMode} needs tlsCertPath and tlsKeyPath, or "
                              "tlsTestModeEnable=true (a self-signed certificate)")
        if self.tlsServerNeedClientAuth == "require" and not self.tlsServerTrustCertPath:
            raise ConfigError("tlsServerNeedClientAuth=require needs tlsServerTrustCertPath "
                              "(tls.server.trustCertPath), the certificates client certificates must chain "
                              "to")
        if self.tlsServerNeedClientAuth == "require" and self.tlsServerMode != "enforcing":
            # permissive still serves plaintext, where no certificate is asked for (RocketMQ's proxy
            # asks for none in permissive mode either): the requirement would be a false promise
            raise ConfigError(f"tlsServerNeedClientAuth=require needs tlsServerMode=enforcing "
                              f"(tls.server.mode), not {self.tlsServerMode}: a {self.tlsServerMode} port "
                              "accepts clients without any certificate")

    def _validate_tls_client(self) -> None:
        """The client keys: certificate and key set together; with tlsEnable, each file the broker will use
        readable and usable (checked with the ssl module, so a mistake stops the start, not a connection)."""
        def name(key: str) -> str:
            return f"{key} ({_TLS_ROCKETMQ_NAMES[key]})"

        if bool(self.tlsClientCertPath) != bool(self.tlsClientKeyPath):
            raise ConfigError(f"{name('tlsClientCertPath')} and {name('tlsClientKeyPath')}: set both or "
                              "neither")
        if not self.tlsEnable:
            return  # not used
        used = ["tlsClientCertPath", "tlsClientKeyPath"]
        if self.tlsClientAuthServer:
            used.append("tlsClientTrustCertPath")
        pems: dict[str, bytes] = {}
        for key in used:
            path = getattr(self, key)
            if not path:
                continue
            try:
                pems[key] = Path(path).read_bytes()
            except OSError as e:
                raise ConfigError(f"{name(key)}: cannot read {path}: {e.strerror or e}") from None
        import ssl  # only for brokers whose outgoing connections use TLS

        check = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        trust = self.tlsClientTrustCertPath
        if "tlsClientTrustCertPath" in pems:
            try:
                check.load_verify_locations(cadata=pems["tlsClientTrustCertPath"].decode("ascii"))
            except (ssl.SSLError, ValueError, UnicodeDecodeError) as e:
                raise ConfigError(f"{name('tlsClientTrustCertPath')}: no usable PEM certificate in {trust}: "
                                  f"{e}") from None
        if "tlsClientKeyPath" in pems:
            cert, key = self.tlsClientCertPath, self.tlsClientKeyPath
            if b"ENCRYPTED" in pems["tlsClientKeyPath"]:
                raise ConfigError(f"{name('tlsClientKeyPath')}: the private key {key} is encrypted; chronomq "
                                  "needs it unencrypted (openssl pkey -in KEY -out PLAIN_KEY)")

            def no_password() -> bytes:
                raise ValueError("the private key is encrypted")

            try:
                check.load_cert_chain(cert, key, password=no_password)
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                raise ConfigError(f"{name('tlsClientCertPath')} {cert} and {name('tlsClientKeyPath')} {key} "
                                  f"cannot be used together: {e}") from None

    def _validate_connection_limits(self) -> None:
        least = self.maxMessageSize + 64 * 1024  # a message of the largest size and its header
        if not least <= self.frameMaxLength <= 1 << 30:
            raise ConfigError(f"frameMaxLength: {self.frameMaxLength} must be within {least} "
                              "(maxMessageSize and 64 KiB of header) and 1073741824 (1 GiB)")
        for name in ("serverFrameReadTimeoutMillis", "serverChannelMaxIdleTimeSeconds",
                     "serverMaxConnections", "serverMaxConnectionsPerIp"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: {getattr(self, name)} must be 0 (no limit) or positive")
        buffered = self.serverMaxBufferedFrameBytes
        if buffered and buffered < self.frameMaxLength:
            raise ConfigError(f"serverMaxBufferedFrameBytes: {buffered} must be 0 (no limit) or at least "
                              f"frameMaxLength ({self.frameMaxLength})")
        low, high = self.writeBufferLowWaterMark, self.writeBufferHighWaterMark
        if not 0 <= low < high:
            raise ConfigError(f"writeBufferLowWaterMark {low}, writeBufferHighWaterMark {high}: "
                              "need 0 <= low < high")

    # --- loading ------------------------------------------------------------------------------------
    def apply(self, values: dict[str, str]) -> list[str]:
        """Set keys from string values; returns warnings for unknown keys. Raises ConfigError."""
        warnings = []
        fields = {f.name: f for f in dataclasses.fields(self) if f.name != "extra"}
        for key, raw in values.items():
            key = TLS_KEY_ALIASES.get(key, key)
            f = fields.get(key)
            if f is None:
                self.extra[key] = raw
                warnings.append(f"unknown configuration key {key!r} ignored")
                continue
            setattr(self, key, _convert(key, raw, f.type))
        self.validate()
        return warnings

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, str] | None = None
             ) -> tuple[BrokerConfig, list[str]]:
        cfg = cls()
        values: dict[str, str] = {}
        if path is not None:
            try:
                values.update(parse_properties(Path(path).read_text(encoding="utf-8")))
            except OSError as e:
                raise ConfigError(f"cannot read configuration file {path}: {e.strerror}") from e
        values.update(overrides or {})
        warnings = cfg.apply(values)
        return cfg, warnings


def _convert(key: str, raw: str, typ: Any) -> Any:
    t = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    raw = raw.strip()
    if t == "bool":
        low = raw.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: {raw!r} is not a boolean (true/false)")
    if t == "int":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{key}: {raw!r} is not an integer") from None
    return raw


def parse_properties(text: str) -> dict[str, str]:
    """Java .properties, the subset broker.conf files use: key=value or key: value, # and ! comments,
    backslash line continuation."""
    out: dict[str, str] = {}
    logical = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not logical and (not stripped or stripped[0] in "#!"):
            continue
        if stripped.endswith("\\") and not stripped.endswith("\\\\"):
            logical += stripped[:-1]
            continue
        logical += stripped
        m = re.match(r"^([^=:\s]+)\s*[=:\s]\s*(.*)$", logical)
        if m:
            out[m.group(1)] = m.group(2).strip()
        elif logical:
            out[logical] = ""
        logical = ""
    return out
