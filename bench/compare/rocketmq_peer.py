"""Apache RocketMQ itself as a peer: the 5.3.3 broker with its timer wheel (``TIMER_DELIVER_MS``) and the
4.9.7 broker (delay levels only), from Maven Central jars, started by the compat harness's
``RocketMQProcess`` (tests/compat/reference.py: a name server and a broker as the distribution's scripts
start them, on free 127.0.0.1 ports, in a work dir of their own).

The driver is the one chronomq gets: chronomq's asyncio client speaks the 4.x remoting protocol to both
brokers, so the broker is the only difference. What differs is what the broker honours, and the bench
asks it (``ChronomqPeer._probe_timer``): RocketMQ 5 honours ``TIMER_DELIVER_MS`` on a single message and
ignores it in a batch (it stores a batch as it comes and delivers it at once), so timed messages go one
per request (64 in flight); RocketMQ 4.9.7 has no timer, so it gets the bench's delay levels, as
chronomq would without its timer.

kill -9 (workload 6) kills the broker's JVM; the name server, a separate stateless process in any
RocketMQ deployment, keeps running, and the broker is started again on the same ports and store."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .base import Consumer, PayloadFn, Producer, Sink
from .chronomq_peer import LEVELS, REPO, ChronomqPeer, _levels_ms
from .procs import PeerUnavailable

T = TypeVar("T")

BROKER_HEAP = "1g"  # -Xms/-Xmx of the broker JVM (the distribution's script asks for 8g; a 2-core box here)
NAMESRV_HEAP = "256m"   # what RocketMQProcess gives the name server
TIMER_PRECISION_MS = 100  # timerPrecisionMs: the finest the 5.x timer wheel supports
JVM_FLAGS = "-XX:+UseG1GC -XX:MaxDirectMemorySize=512m"  # RocketMQProcess's flags besides the heap
# 4.9.7's store unmaps files through DirectByteBuffer internals by reflection (on recovery after a crash
# too), which Java 17 refuses unless the packages are opened; its scripts target Java 8. Passed in the
# launcher's own environment variable, to its JVMs only.
OPENS_4 = ("--add-opens=java.base/java.nio=ALL-UNNAMED --add-opens=java.base/jdk.internal.ref=ALL-UNNAMED "
           "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED")


def _reference() -> Any:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        import tests.compat.reference as reference
    except ImportError as e:
        raise PeerUnavailable(f"tests/compat/reference.py (RocketMQProcess) is not importable: {e}") from e
    return reference


class RocketMQPeer(ChronomqPeer):
    """Apache RocketMQ ``release`` ("rocketmq5" or "rocketmq4") with ``flush`` (ASYNC_FLUSH/SYNC_FLUSH)."""

    def __init__(self, workdir: Path, release: str = "rocketmq5", flush: str = "ASYNC_FLUSH",
                 heap: str = BROKER_HEAP) -> None:
        super().__init__(workdir, flush)
        if release not in ("rocketmq5", "rocketmq4"):
            raise ValueError(f"release must be rocketmq5 or rocketmq4, not {release!r}")
        self.release_name = release
        self.heap = heap
        mode = "sync" if flush == "SYNC_FLUSH" else "async"
        version = "5.3.3" if release == "rocketmq5" else "4.9.7"
        self.timer = release == "rocketmq5"
        # RocketMQ 5 runs in both flush modes, as chronomq does; 4.9.7 (delay levels only) in ASYNC_FLUSH
        self.name = f"{release}_{mode}" if self.timer else release
        self.label = f"RocketMQ {version} {mode.upper()}" if self.timer else f"RocketMQ {version}"
        conf = [f"flushDiskType={flush}"]
        if self.timer:
            conf += ["timerWheelEnable=true", f"timerPrecisionMs={TIMER_PRECISION_MS}"]
        else:
            conf.append("delay levels only (messageDelayLevel)")
        flags = JVM_FLAGS if self.timer else f"{JVM_FLAGS} {OPENS_4}"
        self.durability = ", ".join([*conf, f"broker heap -Xms{heap} -Xmx{heap}, name server "
                                     f"-Xms{NAMESRV_HEAP} -Xmx{NAMESRV_HEAP} ({flags})"])
        self.client = "chronomq.client (asyncio Producer, PushConsumer), the 4.x remoting protocol"
        self.route_retries = 0  # clients made again because the name server had no route (after restarts)

    def check(self) -> None:
        reference = _reference()
        try:
            reference.java_tools()
            reference.maven_classpath(reference.REFERENCE_POM, reference.RELEASES[self.release_name].profile)
        except reference.CompatUnavailable as e:
            raise PeerUnavailable(str(e)) from e
        super().check()

    def version(self) -> str:
        version = "5.3.3" if self.timer else "4.9.7"
        java = ""
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30)
            java = out.stderr.splitlines()[0] if out.stderr else ""
        return f"Apache RocketMQ {version} (Maven Central jars); {java}".rstrip("; ")

    def start(self) -> None:
        reference = _reference()
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = {"flushDiskType": self.flush, "messageDelayLevel": LEVELS}
        if self.timer:
            conf.update(timerWheelEnable="true", timerPrecisionMs=str(TIMER_PRECISION_MS))
        release = reference.RELEASES[self.release_name]
        self.proc = reference.RocketMQProcess(self.workdir / "rocketmq", release, broker_conf=conf,
                                              heap=self.heap)
        self.data_dir = self.proc.workdir / "store"  # disk figures: the store, not the JVMs' logs
        with self._jvm_env():
            self.proc.start(timeout=300)
        self.levels_ms = _levels_ms()

    def after_start(self) -> None:
        if self.timer:
            super().after_start()
        else:  # 4.9.7 has no timer: the level mode, not asked
            self.timer_probe = {"skipped": "RocketMQ 4.9.7 has no timer (TIMER_DELIVER_MS): delay levels"}

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(heap={"broker": f"-Xms{self.heap} -Xmx{self.heap}",
                       "namesrv": f"-Xms{NAMESRV_HEAP} -Xmx{NAMESRV_HEAP}",
                       "flags": JVM_FLAGS if self.timer else f"{JVM_FLAGS} {OPENS_4}"},
                 timer_precision_ms=TIMER_PRECISION_MS if self.timer else None, release=self.release_name,
                 route_retries=self.route_retries)
        if not self.timer:
            d["client"] = "chronomq.client (asyncio Producer.send: one delay-level message per request; " \
                          "PushConsumer), the 4.x remoting protocol"
        return d

    def _broker(self) -> Any:
        return next((c for c in self.proc.children if c.name == "broker"), None)

    def kill9(self) -> None:
        """SIGKILL the broker's JVM (its process group); the name server keeps running."""
        import os
        import signal

        child = self._broker()
        if child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(30)
        self.proc.children.remove(child)

    def restart(self) -> None:
        """Start the broker again with its broker.conf (same ports and store) until it says "boot success"
        and listens, as RocketMQProcess started it, and the name server routes its topics again (the name
        server dropped them when the killed broker's connection closed; clients need them)."""
        if self._broker() is not None:
            return
        with self._jvm_env():
            self.proc._java("broker", "org.apache.rocketmq.broker.BrokerStartup",
                            ["-c", str(self.proc.workdir / "broker.conf")], self.heap,
                            [self.proc.broker_port], "boot success", 300)
        self.proc._wait_registered(120)

    @contextlib.contextmanager
    def _jvm_env(self) -> Iterator[None]:
        """JDK_JAVA_OPTIONS for the JVMs started meanwhile (4.9.7 only: OPENS_4)."""
        if self.timer:
            yield
            return
        old = os.environ.get("JDK_JAVA_OPTIONS")
        os.environ["JDK_JAVA_OPTIONS"] = f"{old} {OPENS_4}" if old else OPENS_4
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("JDK_JAVA_OPTIONS", None)
            else:
                os.environ["JDK_JAVA_OPTIONS"] = old

    def producer(self, dest: str, payload: PayloadFn) -> Producer:
        return self._routed(lambda: super(RocketMQPeer, self).producer(dest, payload))

    def consumer(self, dest: str, sink: Sink) -> Consumer:
        return self._routed(lambda: super(RocketMQPeer, self).consumer(dest, sink))

    def _routed(self, make: Callable[[], T], timeout_s: float = 60.0) -> T:
        """``make()``, retried for up to ``timeout_s`` while the name server has no route: after a broker
        restart, RocketMQ 5's name server drops the old broker's routes in a batch of its own, which
        under load can land after the new broker registered; the broker registers again within 30 s."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return make()
            except Exception as e:
                if "no route" not in str(e).lower() or time.monotonic() > deadline:
                    raise
                self.route_retries += 1
                time.sleep(1.0)

    def server_pids(self) -> list[int]:
        if self.proc is None:
            return []
        return [c.proc.pid for c in self.proc.children if c.proc.poll() is None]

    def broker_pids(self) -> list[int]:
        child = self._broker() if self.proc is not None else None
        return [child.proc.pid] if child is not None and child.proc.poll() is None else []
