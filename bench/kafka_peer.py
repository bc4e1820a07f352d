"""A single-node Apache Kafka broker in KRaft mode (no ZooKeeper) for the benches, and Spark's own Kafka
connector for a Spark session, both resolved from Maven Central by coordinates (bench/kafka/pom.xml;
nothing is built, the jars are cached under .cache/maven like the reference RocketMQ's).

``KafkaBroker(workdir)`` formats a log dir under ``workdir``, starts ``kafka.Kafka`` (broker and controller
in one JVM) on two free loopback ports, waits until it answers, and ``stop()`` stops it by PID (SIGTERM,
then SIGKILL). ``connector_jars()`` is the class path to hand to Spark with ``spark.jars``. A missing Java
or Maven, or an artifact the repository does not serve, raises ``KafkaUnavailable`` with the exact reason
(the bench then skips Kafka and says why).
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from tests.compat.harness import CompatUnavailable, free_port
from tests.compat.reference import java_tools, maven_classpath

POM = Path(__file__).resolve().parent / "kafka" / "pom.xml"
KAFKA_VERSION = "4.1.1"  # bench/kafka/pom.xml's kafka.version
HEAP = "1g"
PARTITIONS = 4  # a new topic's partitions: chronomq's default queues per topic (defaultTopicQueueNums)
# jars the connector's class path names that Spark's own distribution already has
_SPARK_HAS = ("scala-library-", "scala-parallel-collections_", "spark-tags_", "hadoop-client-", "slf4j-api-",
              "jsr305-", "lz4-java-", "snappy-java-")


class KafkaUnavailable(RuntimeError):
    """Kafka or its connector cannot be had on this machine; the message says why."""


def _classpath(profile: str, **props: str) -> str:
    try:
        return maven_classpath(POM, profile, extra=[f"-D{k}={v}" for k, v in props.items()])
    except CompatUnavailable as e:
        raise KafkaUnavailable(str(e)) from None


FALLBACK_CONNECTOR = "4.2.0"  # bench/kafka/pom.xml's spark.version: the newest one the repository served


def connector_jars(spark_version: str) -> tuple[str, list[str], str]:
    """(version, jars, note): the jars of ``org.apache.spark:spark-sql-kafka-0-10_2.13`` at the installed
    Spark's version and its dependencies that Spark does not ship itself; when the repository does not
    serve that version, FALLBACK_CONNECTOR's, and the note says so."""
    note = ""
    try:
        version, cp = spark_version, _classpath("spark", **{"spark.version": spark_version})
    except KafkaUnavailable as e:
        if spark_version == FALLBACK_CONNECTOR:
            raise
        version, cp = FALLBACK_CONNECTOR, _classpath("spark", **{"spark.version": FALLBACK_CONNECTOR})
        note = (f"Spark's Kafka connector {spark_version} could not be resolved ({str(e)[:300]}); "
                f"its {FALLBACK_CONNECTOR} runs on Spark {spark_version}")
    return version, [p for p in cp.split(os.pathsep) if p and not Path(p).name.startswith(_SPARK_HAS)], note


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class KafkaBroker:
    """One KRaft node (process.roles=broker,controller) on 127.0.0.1, ``acks=all`` meaningful with one
    replica (min.insync.replicas=1), its log dir under ``workdir``."""

    def __init__(self, workdir: Path, heap: str = HEAP, partitions: int = PARTITIONS) -> None:
        self.workdir = workdir
        self.heap = heap
        self.partitions = partitions
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "kafka.log"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def describe(self) -> str:
        return (f"Apache Kafka {KAFKA_VERSION} (Maven Central jars), one KRaft node, {self.partitions} "
                f"partitions a topic, replication 1, JVM -Xms{self.heap} -Xmx{self.heap} G1")

    def start(self, timeout: float = 120) -> KafkaBroker:
        try:
            java, _ = java_tools()
        except CompatUnavailable as e:
            raise KafkaUnavailable(str(e)) from None
        cp = _classpath("broker")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port, cport = free_port(), free_port()
        while cport == self.port:
            cport = free_port()
        logs = self.workdir / "kafka-logs"
        props = self.workdir / "server.properties"
        props.write_text("\n".join([
            "process.roles=broker,controller", "node.id=1",
            f"controller.quorum.bootstrap.servers=127.0.0.1:{cport}",
            f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{cport}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names=CONTROLLER", "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            f"log.dirs={logs}", f"num.partitions={self.partitions}", "auto.create.topics.enable=true",
            "offsets.topic.replication.factor=1", "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1", "min.insync.replicas=1", "default.replication.factor=1",
            "group.initial.rebalance.delay.ms=0", ""]))
        base = [java, f"-Xms{self.heap}", f"-Xmx{self.heap}", "-XX:+UseG1GC", "-XX:-UsePerfData",
                "-Djava.awt.headless=true", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", cp]
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        fmt = subprocess.run([*base, "kafka.tools.StorageTool", "format", "--standalone",
                              f"--cluster-id={cluster_id}", "-c", str(props)],
                             capture_output=True, text=True, timeout=timeout)
        if fmt.returncode != 0:
            raise KafkaUnavailable(f"kafka-storage format failed (exit {fmt.returncode}): "
                                   f"{(fmt.stderr or fmt.stdout)[-1500:]}")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen([*base, "kafka.Kafka", str(props)], cwd=self.workdir, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _answers(self.port):
            if self.proc.poll() is not None:
                raise KafkaUnavailable(f"Kafka exited with {self.proc.returncode} before it listened: "
                                       f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise KafkaUnavailable(f"Kafka did not listen on {self.bootstrap} within {timeout:.0f} s: "
                                       f"{self.log_tail()}")
            time.sleep(0.1)  # polling a port another process opens: nothing to wait on instead
        return self

    def log_tail(self, limit: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
