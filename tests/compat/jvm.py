"""The official RocketMQ Java clients as compatibility drivers (tests/compat/java/).

``java_driver(client)`` resolves the client's class path with Maven (``tests/compat/java/pom.xml``,
profile ``client4`` = rocketmq-client 4.9.x, ``client53`` = rocketmq-client 5.3.x), compiles the driver
sources with ``javac`` into ``<repo>/.cache/java/`` (git-ignored, keyed by the sources' and the pom's hash,
under a file lock) and returns the ``java`` command that runs it. The 5.3.x client moved the protocol
classes from ``org.apache.rocketmq.common.protocol`` to ``org.apache.rocketmq.remoting.protocol``: the
driver is written against 4.9.x and compiled for 5.3.x with that package renamed and createTopic's last
argument (a sys flag in 4.x, topic attributes in 5.x) replaced, nothing else.
Run through the harness as ``run_driver("java4:produce", args)`` / ``"java53:..."``.

``"java5"`` is the 5.x gRPC client (rocketmq-client-java, ``tests/compat/java5/``: its own pom, no profile,
``chronomq.compat5.Driver5``), built the same way; its shaded logback writes to ``.cache/java/logs5`` at
WARN and nothing to the console (``mq.consoleAppender.enabled`` is off by default).

``java_server(client)`` is the command of a driver's serve mode (one JVM answering requests from stdin, side
by side; the harness keeps one per client and pytest worker): the same JVM with a larger heap cap.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import tempfile
from pathlib import Path

from tests.compat.harness import REPO, CompatUnavailable
from tests.compat.reference import java_tools, maven_classpath, once

JAVA_DIR = REPO / "tests" / "compat" / "java"
JAVA_CACHE = REPO / ".cache" / "java"
CLIENTS = {"java4": "client4", "java53": "client53"}
MAIN = "chronomq.compat.Driver"
JAVA5_DIR = REPO / "tests" / "compat" / "java5"
MAIN5 = "chronomq.compat5.Driver5"
# client -> (sources dir with its pom, Maven profile, main class, JVM flags quieting the client's logging)
_LOG4 = ["-Drocketmq.client.logLevel=WARN", "-Drocketmq.client.logUseSlf4j=false"]
_LOG5 = ["-Drocketmq.log.level=warn", f"-Drocketmq.log.root={JAVA_CACHE / 'logs5'}",
         "-Dmq.consoleAppender.enabled=false"]
_DRIVERS = {"java4": (JAVA_DIR, "client4", MAIN, _LOG4), "java53": (JAVA_DIR, "client53", MAIN, _LOG4),
            "java5": (JAVA5_DIR, "", MAIN5, _LOG5)}
_RENAMED = {"client53": [("org.apache.rocketmq.common.protocol.", "org.apache.rocketmq.remoting.protocol."),
                         # MQAdmin.createTopic's last argument: 4.x a topic sys flag, 5.x topic attributes
                         ("/*ATTRIBUTES*/ 0", "new java.util.HashMap<String, String>()")]}

# One op per JVM (the one-shot mode) is capped at 256 MB. A serve-mode JVM runs up to one op per broker of a
# differential test at once (three), each holding a client or two and at most a few 4 MiB bodies (with
# their compressed copies): twice the one-shot cap, under the 3 x 256 MB three one-shot JVMs could take.
# Measured over the two Java differential modules: the 4.x server's heap peaked at 246 MB old generation
# + 100 MB eden (garbage included, before a collection), the 5.3 and 5.x servers' far lower.
ONE_SHOT_HEAP = "-Xmx256m"
SERVER_HEAP = "-Xmx512m"

_built: dict[str, list[str] | CompatUnavailable] = {}


def _sources(root: Path = JAVA_DIR) -> list[Path]:
    return sorted((root / "src" / "main" / "java").rglob("*.java"))


def java_driver(client: str) -> list[str]:
    """The command prefix (``java -cp ... Driver``) of the driver built for ``client`` (java4/53/5)."""
    return once(_built, client, lambda: _build(*_DRIVERS[client]))


def java_server(client: str) -> list[str]:
    """The command of the driver's serve mode for ``client`` (``java ... Driver serve``)."""
    return [SERVER_HEAP if arg == ONE_SHOT_HEAP else arg for arg in java_driver(client)] + ["serve"]


def _build(root: Path, profile: str, main: str, log_flags: list[str]) -> list[str]:
    java, _ = java_tools()
    javac = Path(java).resolve().with_name("javac")
    if not javac.exists():
        raise CompatUnavailable(f"the Java drivers are compiled with javac, not found beside {java}")
    cp = maven_classpath(root / "pom.xml", profile)
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in [root / "pom.xml", *_sources(root)])
                          + profile.encode()).hexdigest()[:16]
    classes = JAVA_CACHE / f"{profile or root.name}-{digest}"
    lock_path = Path(tempfile.gettempdir()) / f"chronomq-javac-{digest}.lock"
    JAVA_CACHE.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (classes / ".built").exists():
            src = classes / "src"
            src.mkdir(parents=True, exist_ok=True)
            files = []
            for path in _sources(root):
                text = path.read_text()
                for old, new in _RENAMED.get(profile, []):
                    text = text.replace(old, new)
                out = src / path.relative_to(root / "src" / "main" / "java")
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(text)
                files.append(str(out))
            r = subprocess.run([str(javac), "-nowarn", "-encoding", "UTF-8", "--release", "11", "-cp", cp,
                                "-d", str(classes), *files], capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"javac failed for {profile or root.name}:\n{r.stderr[-4000:]}")
            (classes / ".built").write_text((profile or root.name) + "\n")
    return [java, ONE_SHOT_HEAP, "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xshare:auto",
            *log_flags, "-cp", f"{classes}:{cp}", main]
