"""A standalone Spark cluster on 127.0.0.1 started from the installed PySpark: a master and N workers, each a
JVM of its own (``spark-class``), in a process group of its own so that it is stopped by its PID.

Shared by tests/spark/test_spark_cluster.py and bench/spark_io.py ``--cluster``. Every wait is bounded; the
logs (and the workers' work and scratch directories) stay under ``workdir``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from tests.compat.harness import free_port


def pyspark_home() -> Path:
    """SPARK_HOME of the installed PySpark (its jars, ``bin/spark-class`` and ``bin/spark-submit``)."""
    import pyspark

    return Path(pyspark.__file__).parent


class StandaloneCluster:
    def __init__(self, home: Path, workdir: Path, workers: int = 2, cores: int = 1,
                 memory: str = "1g") -> None:
        self.home = home
        self.workdir = workdir
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def env(self) -> dict[str, str]:
        """The environment of the master, the workers (and so their executors) and of drivers started for
        the cluster: this process's, without the PYSPARK_* interpreter choice (a driver names it with
        ``spark.pyspark.python``), and with Spark's scratch space under ``workdir``."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
        env.update(SPARK_HOME=str(self.home), SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
                   SPARK_WORKER_OPTS="-Dspark.worker.cleanup.enabled=false", SPARK_LOG_DIR=str(self.workdir),
                   SPARK_LOCAL_DIRS=str(self.workdir / "local"))
        return env

    def _start(self, name: str, args: list[str]) -> Path:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            self.procs.append(subprocess.Popen([str(self.home / "bin" / "spark-class"), *args], stdout=out,
                                               stderr=subprocess.STDOUT, env=self.env(), cwd=self.workdir,
                                               start_new_session=True))
        self.logs.append(log)
        return log

    def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [(p.pid, p.returncode) for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"waiting for {what}: Spark process(es) exited {dead}; "
                                   f"logs in {self.workdir}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}; logs in {self.workdir}")
            time.sleep(0.2)

    def start(self, timeout: float = 90) -> StandaloneCluster:
        (self.workdir / "local").mkdir(parents=True, exist_ok=True)
        master = self._start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                        "--port", str(self.port), "--webui-port", str(free_port())])
        self._wait(lambda: "Starting Spark master" in master.read_text(errors="replace"), timeout,
                   "the Spark master")
        for i in range(1, self.workers + 1):
            (self.workdir / f"w{i}").mkdir()
            self._start(f"worker{i}", ["org.apache.spark.deploy.worker.Worker", self.url,
                                       "--host", "127.0.0.1", "--cores", str(self.cores),
                                       "--memory", self.memory,
                                       "--webui-port", str(free_port()),
                                       "--work-dir", str(self.workdir / f"w{i}")])
        self._wait(lambda: master.read_text(errors="replace").count("Registering worker") >= self.workers,
                   timeout, f"{self.workers} workers registered")
        return self

    def stop(self) -> None:
        """SIGTERM to each process group, SIGKILL to those still there after 30 s."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    def __enter__(self) -> StandaloneCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
