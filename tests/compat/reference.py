"""The reference Apache RocketMQ, run from Maven Central jars, for differential tests.

- ``maven_classpath(pom, profile)``: the class path Maven resolves for a pom of this repository
  (``dependency:build-classpath``), kept in ``<repo>/.cache/maven/`` (git-ignored) keyed by the pom's
  hash, built once under a file lock; Maven's own repository (``~/.m2``) caches the jars, so a second
  run downloads nothing. No ``java`` or ``mvn``, or a repository that does not answer: the test is
  skipped with the exact reason (``CompatUnavailable`` outside pytest).
- ``RocketMQProcess``: a name server and a broker (and, for 5.x, the proxy serving gRPC clients) started
  the way the distribution's scripts start them (``NamesrvStartup``, ``BrokerStartup -c broker.conf``,
  ``ProxyStartup``) with ``rocketmq.home.dir`` and ``user.home`` under its work dir (logs go to
  ``<workdir>/home/logs/rocketmqlogs``), a heap that fits 2 cores, on free 127.0.0.1 ports; it waits
  until each one serves and stops them by PID.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from chronomq.remoting.codes import RequestCode
from tests.compat.harness import REPO, CompatUnavailable, RawClient, free_port
from tests.ports import bindable

REFERENCE_POM = REPO / "tests" / "reference" / "pom.xml"
MAVEN_CACHE = REPO / ".cache" / "maven"


@dataclass(frozen=True)
class Release:
    """One reference release: its Maven profile in tests/reference/pom.xml and what it can run."""

    name: str  # "rocketmq5" / "rocketmq4"
    version: str
    profile: str
    has_proxy: bool
    has_timer: bool  # the timer wheel (TIMER_DELIVER_MS, TIMER_DELAY_SEC)


ROCKETMQ5 = Release("rocketmq5", "5.3.3", "rocketmq5", has_proxy=True, has_timer=True)
ROCKETMQ4 = Release("rocketmq4", "4.9.7", "rocketmq4", has_proxy=False, has_timer=False)
RELEASES = {r.name: r for r in (ROCKETMQ5, ROCKETMQ4)}


def _skip(reason: str) -> CompatUnavailable:
    return CompatUnavailable(reason)


def skip_or_raise(e: CompatUnavailable) -> None:
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(str(e))
    raise e


def java_tools() -> tuple[str, str]:
    """``java`` and ``mvn`` (CompatUnavailable with the reason when either is missing)."""
    java, mvn = shutil.which("java"), shutil.which("mvn")
    if java is None:
        raise _skip("the reference RocketMQ and the Java clients need java (17) on PATH: not found")
    if mvn is None:
        raise _skip("the reference RocketMQ and the Java clients are resolved with Maven: mvn is not on PATH")
    return java, mvn


T = TypeVar("T")
K = TypeVar("K")


def once(cache: dict[K, T | CompatUnavailable], key: K, build: Callable[[], T]) -> T:
    """``build()`` once per ``key`` in this process: later calls get its result, or the same
    CompatUnavailable raised again (a missing tool is not looked for twice)."""
    cached = cache.get(key)
    if cached is None:
        try:
            cached = build()
        except CompatUnavailable as e:
            cached = e
        cache[key] = cached
    if isinstance(cached, CompatUnavailable):
        raise cached
    return cached


_classpaths: dict[tuple[Any, ...], str | CompatUnavailable] = {}


def maven_classpath(pom: Path, profile: str = "", timeout: float = 900, extra: Sequence[str] = ()) -> str:
    """The resolved class path of ``pom`` (with ``profile`` and ``extra`` Maven arguments such as
    ``-Dspark.version=4.2.0``), cached by the pom's content and the arguments."""
    return once(_classpaths, (pom, profile, *extra), lambda: _resolve(pom, profile, timeout, tuple(extra)))


def _resolve(pom: Path, profile: str, timeout: float, extra: tuple[str, ...] = ()) -> str:
    _, mvn = java_tools()
    digest = hashlib.sha1(pom.read_bytes() + profile.encode() + "\0".join(extra).encode()).hexdigest()[:16]
    out = MAVEN_CACHE / f"{pom.parent.name}-{profile or 'default'}-{digest}.classpath"
    MAVEN_CACHE.mkdir(parents=True, exist_ok=True)
    lock_path = Path(tempfile.gettempdir()) / f"chronomq-maven-{digest}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists() and all(Path(p).exists() for p in out.read_text().split(os.pathsep) if p):
            return out.read_text().strip()
        tmp = out.with_suffix(".tmp")
        cmd = [mvn, "-B", "-q", "-f", str(pom), "dependency:build-classpath",
               f"-Dmdep.outputFile={tmp}"]
        if profile:
            cmd.append(f"-P{profile}")
        cmd += extra
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise _skip(f"Maven did not resolve {pom.relative_to(REPO)} ({profile}) within {timeout:.0f}s"
                        " (no answer from the repository)") from None
        if r.returncode != 0 or not tmp.exists():
            lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "ERROR" in ln] or [r.stdout[-1500:]]
            raise _skip(f"Maven could not resolve {pom.relative_to(REPO)} ({profile}): "
                        + " ".join(lines)[:2000])
        tmp.replace(out)
        return out.read_text().strip()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _free_ports(n: int, neighbours: tuple[int, ...] = ()) -> list[int]:
    """``n`` distinct free ports; each port p also has p + d free for every d of ``neighbours`` (a broker
    listens on listenPort - 2 for its fast channel and, on 4.x, on listenPort + 1 for HA whatever
    haListenPort says)."""
    out: list[int] = []
    for _ in range(200):
        p = free_port()
        taken = {q for o in out for q in (o, *(o + d for d in neighbours))}
        near = [p + d for d in neighbours]
        if p in taken or any(q in taken or not 1024 <= q < 65536 for q in near):
            continue
        if not all(map(bindable, near)):
            continue
        out.append(p)
        if len(out) == n:
            return out
    raise RuntimeError("could not find free ports")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the process that started it dies (a test run killed or
    timed out must not leave a JVM holding 1 GiB and its ports; Linux's PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


_LOGBACK = """<?xml version="1.0" encoding="UTF-8"?>
<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>{file}</file>
    <encoder><pattern>%d{{yyy-MM-dd HH:mm:ss,SSS}} %p %t - %m%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="FILE"/></root>
</configuration>
"""


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class RocketMQProcess:
    """A reference RocketMQ (name server + one master broker, and the 5.x proxy when asked) in ``workdir``.

    ``broker_conf`` adds or overrides broker.conf keys. ``proxy=True`` (5.x only) also starts the proxy
    in cluster mode for gRPC clients; its endpoint is ``proxy_endpoint``."""

    workdir: Path
    release: Release = ROCKETMQ5
    broker_conf: dict[str, str] = field(default_factory=dict)
    proxy: bool = False
    heap: str = "512m"
    children: list[_Child] = field(default_factory=list)
    namesrv_port: int = 0
    broker_port: int = 0
    grpc_port: int = 0

    kind = "rocketmq"

    @property
    def name(self) -> str:
        return self.release.name

    @property
    def namesrv_addr(self) -> str:
        return f"127.0.0.1:{self.namesrv_port}"

    @property
    def broker_addr(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

    @property
    def proxy_endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def home(self) -> Path:
        return self.workdir / "home"

    def log_dir(self) -> Path:
        return self.home / "logs" / "rocketmqlogs"

    def _java(self, name: str, main: str, args: list[str], heap: str, ports: list[int],
              ready: str, timeout: float) -> None:
        java, _ = java_tools()
        cp = maven_classpath(REFERENCE_POM, self.release.profile)
        log = self.workdir / f"{name}.out"
        cmd = [java, "-server", f"-Xms{heap}", f"-Xmx{heap}", "-XX:+UseG1GC",
               "-XX:MaxDirectMemorySize=512m", "-XX:-UsePerfData", "-Djava.net.preferIPv4Stack=true",
               f"-Duser.home={self.home}", f"-Drocketmq.home.dir={self.home}",
               "-Drocketmq.client.logRoot=" + str(self.log_dir()),
               "-cp", cp, main, *args]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        child = _Child(name, proc, log)
        self.children.append(child)
        deadline = time.monotonic() + timeout
        while True:
            text = log.read_text(errors="replace") if log.exists() else ""
            if ready in text and all(_listening(p) for p in ports):
                return
            if proc.poll() is not None:
                raise RuntimeError(f"reference {name} exited with code {proc.returncode} before it served:\n"
                                   f"{text[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"reference {name} did not serve within {timeout}s:\n{text[-3000:]}")
            time.sleep(0.1)

    def start(self, timeout: float = 120) -> RocketMQProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.home / "conf").mkdir(parents=True, exist_ok=True)
        for server in ("namesrv", "broker"):  # 4.x reads them from rocketmq.home.dir/conf; 5.x ignores them
            (self.home / "conf" / f"logback_{server}.xml").write_text(_LOGBACK.format(
                file=self.log_dir() / f"{server}.log"))
        store = self.workdir / "store"
        self.broker_port, = _free_ports(1, neighbours=(-2, 1))
        self.namesrv_port, ha_port, self.grpc_port, remoting_proxy = _free_ports(4)
        while {self.broker_port - 2, self.broker_port, self.broker_port + 1} & {
                self.namesrv_port, ha_port, self.grpc_port, remoting_proxy}:
            self.namesrv_port, ha_port, self.grpc_port, remoting_proxy = _free_ports(4)
        ns_conf = self.workdir / "namesrv.conf"
        ns_conf.write_text(f"listenPort={self.namesrv_port}\nbindAddress=127.0.0.1\n")
        conf = {
            "brokerClusterName": "DefaultCluster", "brokerName": "broker-a", "brokerId": "0",
            "listenPort": str(self.broker_port), "haListenPort": str(ha_port), "brokerIP1": "127.0.0.1",
            "namesrvAddr": self.namesrv_addr, "storePathRootDir": str(store),
            "storePathCommitLog": str(store / "commitlog"), "mappedFileSizeCommitLog": str(64 << 20),
            "autoCreateTopicEnable": "true", "autoCreateSubscriptionGroup": "true",
            "flushDiskType": "ASYNC_FLUSH", "enablePropertyFilter": "true",
            "diskMaxUsedSpaceRatio": "95", "traceTopicEnable": "true",
            **({"timerWheelEnable": "true", "timerPrecisionMs": "100"} if self.release.has_timer else {}),
            **self.broker_conf,
        }
        broker_conf = self.workdir / "broker.conf"
        broker_conf.write_text("".join(f"{k}={v}\n" for k, v in conf.items()))
        try:
            self._java("namesrv", "org.apache.rocketmq.namesrv.NamesrvStartup", ["-c", str(ns_conf)],
                       "256m", [self.namesrv_port], "boot success", timeout)
            self._java("broker", "org.apache.rocketmq.broker.BrokerStartup", ["-c", str(broker_conf)],
                       self.heap, [self.broker_port], "boot success", timeout)
            # the proxy creates its system topics on the cluster at start: the broker must be routed first
            self._wait_registered(timeout)
            if self.proxy:
                if not self.release.has_proxy:
                    raise ValueError(f"{self.release.name} has no proxy")
                proxy_conf = self.workdir / "rmq-proxy.json"
                proxy_conf.write_text(json.dumps({
                    "rocketMQClusterName": "DefaultCluster", "namesrvAddr": self.namesrv_addr,
                    "grpcServerPort": self.grpc_port, "remotingListenPort": remoting_proxy,
                }))
                self._java("proxy", "org.apache.rocketmq.proxy.ProxyStartup",
                           ["-pc", str(proxy_conf), "-pm", "Cluster"], "256m", [self.grpc_port],
                           "", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_registered(self, timeout: float) -> None:
        """Until the name server routes the broker's cluster topic (the broker registered)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), RawClient(self.namesrv_addr, timeout=5) as c:
                if c.call(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": "TBW102"}).code == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"reference broker did not register with its name server within {timeout}s")

    def stop(self, timeout: float = 30) -> None:
        for child in reversed(self.children):
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGTERM)
                try:
                    child.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.proc.pid, signal.SIGKILL)
                    child.proc.wait(10)
        self.children.clear()

    def discard(self) -> None:
        """Kill every process at once: for a run whose store is thrown away, where an orderly shutdown (the
        broker's takes seconds) would only cost time."""
        for child in self.children:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
        for child in self.children:
            child.proc.wait(10)
        self.children.clear()

    def log_tail(self, limit: int = 4000) -> str:
        parts = []
        for path in [*(self.workdir.glob("*.out")), self.log_dir() / "broker.log"]:
            with contextlib.suppress(OSError):
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-limit:]}")
        return "\n".join(parts)

    def __enter__(self) -> RocketMQProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
