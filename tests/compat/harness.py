"""Harness for the official-client compatibility suite (contract C).

- ``ChronomqProcess``: a ``chronomq start`` child process on free loopback ports; waits for the
  ready line, can be stopped cleanly (SIGTERM), killed (SIGKILL) and restarted on the same ports and
  data directory.
- ``official_python()``: the interpreter of a private venv holding PyPI ``rocketmq==0.4.4`` (the ctypes
  wrapper around rocketmq-client-cpp 1.2.x). Created once in ``<repo>/.venv-compat``, guarded by a file
  lock so concurrent pytest processes share it. If it cannot be built or its bundled ``librocketmq.so``
  does not load here, tests are *skipped with the exact reason* (never silently passed); outside pytest
  ``CompatUnavailable`` is raised.
- ``grpc5_python()``: the same for the official 5.x Python client (PyPI rocketmq-python-client, gRPC), in
  ``<repo>/.venv-grpc5``: drivers named ``v5_*`` run there.
- ``grpc5_node()``: node, with the official 5.x Node.js client (npm rocketmq-client-nodejs) installed in
  ``<repo>/.node-grpc5`` the same way; drivers named ``*.mjs`` run under it.
- ``run_driver(name, args)``: runs ``tests/compat/drivers/<name>.py`` in that venv (or ``<name>`` when it
  ends in ``.mjs``, under node) with ``args`` as JSON on argv[1] and returns the JSON object the driver
  prints as its last stdout line. The official Java clients (``java4:``/``java53:``/``java5:<op>``) are
  asked instead through ``DriverServer``: one JVM per client and process, running requests side by side.
- ``start_driver(name, args)``: the same as a background process (long-running consumers/producers).
- ``RawClient``: a tiny blocking RocketMQ remoting client on the project's own sans-IO codec, for
  requests the official wrapper does not expose (VIEW_MESSAGE_BY_ID, QUERY_CONSUMER_OFFSET, raw pulls).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chronomq.message import MessageExt, decode_records
from chronomq.remoting.codec import FrameDecoder, FrameError, RemotingCommand, encode
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DRIVERS = Path(__file__).resolve().parent / "drivers"
COMPAT_VENV = REPO / ".venv-compat"
OFFICIAL_PACKAGE = "rocketmq==0.4.4"
READY_PREFIX = "chronomq ready "


class CompatUnavailable(RuntimeError):
    """The official client cannot run on this machine (the message says exactly why)."""


class DriverError(RuntimeError):
    """A driver script failed, timed out, or printed no JSON result."""


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode(errors="replace")


# --- the broker under test -------------------------------------------------------------------------------
class ChronomqProcess:
    """``chronomq start`` as a child process, on free loopback ports chosen once (kept across restarts)."""

    def __init__(self, data_dir: Path, overrides: dict[str, str] | None = None) -> None:
        self.data_dir = Path(data_dir)
        # no /metrics and no gRPC endpoint unless asked: their default ports (+ 2, 8081) are not ones
        # free_port reserved; the HA port on one it did (its default, the broker port + 1, may be taken)
        self.overrides = {"metricsPort": "-1", "grpcListenPort": "-1", "haListenPort": str(free_port()),
                          **(overrides or {})}
        if self.overrides["metricsPort"] != "-1":  # the embedded name server's too, not at its port + 2
            self.overrides.setdefault("namesrvMetricsPort", str(free_port()))
        self.env: dict[str, str] = {}  # extra environment of the next start (e.g. CHRONOMQ_FAULTS)
        self.host = "127.0.0.1"
        self.namesrv_port = free_port()
        self.broker_port = free_port()
        while self.broker_port == self.namesrv_port:
            self.broker_port = free_port()
        self.namesrv_addr = f"{self.host}:{self.namesrv_port}"
        self.broker_addr = f"{self.host}:{self.broker_port}"
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.chronomq.log"
        self._proc: subprocess.Popen[str] | None = None
        self._stdout_lines: list[str] = []
        self._ready = threading.Event()
        self.starts = 0

    # -- properties
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def broker_host_port(self) -> tuple[str, int]:
        return self.host, self.broker_port

    def command(self) -> list[str]:
        # CHRONOMQ_COMPAT_START (shell words) replaces `python -m chronomq.cli.main`, to run the suite
        # against another build of the server that takes the same `start` flags.
        prefix = shlex.split(os.environ.get("CHRONOMQ_COMPAT_START", "")) or [sys.executable, "-m",
                                                                              "chronomq.cli.main"]
        cmd = [*prefix, "start", "--data-dir", str(self.data_dir),
               "--host", self.host, "--namesrv-port", str(self.namesrv_port),
               "--broker-port", str(self.broker_port)]
        for k, v in self.overrides.items():
            cmd += ["--set", f"{k}={v}"]
        return cmd

    # -- lifecycle
    def start(self, timeout: float = 30) -> ChronomqProcess:
        if self.running:
            raise RuntimeError("chronomq is already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        self.starts += 1
        log = open(self.log_path, "a", encoding="utf-8")  # noqa: SIM115 (the child owns it)
        log.write(f"--- start #{self.starts}: {' '.join(self.command())}\n")
        log.flush()
        self._ready.clear()
        self._stdout_lines = []
        try:
            self._proc = subprocess.Popen(self.command(), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        finally:
            log.close()
        proc = self._proc
        threading.Thread(target=self._pump_stdout, args=(proc,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if proc.poll() is not None:
                raise RuntimeError(f"chronomq exited with code {proc.returncode} before it was ready;"
                                   f" log {self.log_path}:\n{_tail(self.log_path)}")
            if time.monotonic() > deadline:
                self._terminate(proc, kill=True, timeout=10)
                raise RuntimeError(f"chronomq did not print its ready line within {timeout}s;"
                                   f" log {self.log_path}:\n{_tail(self.log_path)}")
        return self

    def _pump_stdout(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            self._stdout_lines.append(line)
            if line.startswith(READY_PREFIX):
                fields = dict(p.split("=", 1) for p in line[len(READY_PREFIX):].split() if "=" in p)
                self.namesrv_addr = fields.get("namesrv", self.namesrv_addr)
                self.broker_addr = fields.get("broker", self.broker_addr)
                self._ready.set()
        proc.stdout.close()

    @staticmethod
    def _terminate(proc: subprocess.Popen[str], kill: bool, timeout: float) -> int:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise RuntimeError(f"chronomq (pid {proc.pid}) did not exit within {timeout}s of "
                               f"{'SIGKILL' if kill else 'SIGTERM'}; killed") from None

    def stop(self, kill: bool = False, timeout: float = 30) -> int | None:
        """SIGTERM (or SIGKILL with kill=True) and wait. Returns the exit code (None if not running)."""
        proc = self._proc
        if proc is None:
            return None
        code = self._terminate(proc, kill=kill, timeout=timeout)
        self._proc = None
        return code

    def restart(self, timeout: float = 30) -> ChronomqProcess:
        self.stop()
        return self.start(timeout=timeout)

    @property
    def stdout_lines(self) -> list[str]:
        return list(self._stdout_lines)

    def log_tail(self, limit: int = 4000) -> str:
        return _tail(self.log_path, limit)

    def __enter__(self) -> ChronomqProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(RuntimeError):
            self.stop()



class CliProcess:
    """One ``chronomq <args>`` child process (``namesrv`` or ``broker``, whose first stdout line says it is
    ready); its stderr is appended to ``log``."""

    def __init__(self, log: Path, *args: str) -> None:
        self.args, self.log = list(args), Path(log)
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 60) -> CliProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
        with open(self.log, "a", encoding="utf-8") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "chronomq.cli.main", *self.args], cwd=REPO,
                                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=err, text=True)
        ready = threading.Event()
        first: list[str] = []

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            first.append(self.proc.stdout.readline())  # the ready line, or "" when it died first
            ready.set()
            for _ in self.proc.stdout:  # keep the pipe drained
                pass

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or "ready" not in first[0]:
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"chronomq {self.args[0]} did not start; log {self.log}:\n{_tail(self.log)}")
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def tail(self) -> str:
        return _tail(self.log)

# --- the official clients' venvs -----------------------------------------------------------------------
GRPC5_VENV = REPO / ".venv-grpc5"
GRPC5_PACKAGE = "rocketmq-python-client==5.1.2"  # the official 5.x Python client (import name: rocketmq)


def _unavailable(reason: str, package: str = OFFICIAL_PACKAGE) -> CompatUnavailable:
    return CompatUnavailable(f"official RocketMQ client {package} unavailable: {reason}")


def _check_4x(py: str) -> None:
    # The wheel bundles librocketmq.so; importing the wrapper loads it (ctypes.cdll.LoadLibrary).
    r = subprocess.run([py, "-c", "import rocketmq.client"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        lib = f"{COMPAT_VENV}/lib/python*/site-packages/rocketmq/librocketmq.so"
        ldd = subprocess.run(["sh", "-c", f"ldd {lib} | grep 'not found'"], capture_output=True, text=True)
        raise _unavailable(f"the bundled librocketmq.so does not load: {r.stderr.strip()[-1500:]}"
                           f" {ldd.stdout.strip()}")


def _check_5x(py: str) -> None:
    r = subprocess.run([py, "-c", "from rocketmq import Producer, SimpleConsumer"], capture_output=True,
                       text=True, timeout=120)
    if r.returncode != 0:
        raise _unavailable(f"it does not import: {r.stderr.strip()[-1500:]}", GRPC5_PACKAGE)


def _build_venv(venv: Path = COMPAT_VENV, package: str = OFFICIAL_PACKAGE, check: Any = _check_4x) -> str:
    """Create ``venv`` and pip-install ``package`` into it unless a previous build finished."""
    py = venv / "bin" / "python"
    stamp = venv / ".compat-ready"
    if stamp.exists() and py.exists():
        return str(py)
    if venv.exists():
        subprocess.run(["rm", "-rf", str(venv)], check=False)
    r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        raise _unavailable(f"python -m venv failed: {r.stderr.strip()[-2000:]}", package)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        package], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise _unavailable(f"pip install {package} failed: {r.stderr.strip()[-2000:]}", package)
    check(str(py))
    stamp.write_text(package + "\n")
    return str(py)


_venv_lock = threading.Lock()
_venv_results: dict[Path, str | CompatUnavailable] = {}


def _venv_python(venv: Path, package: str, check: Any, build: Any = _build_venv) -> str:
    """The python of a private venv holding ``package``, built once by ``build`` (a file lock makes
    concurrent pytest processes share it); CompatUnavailable with the reason when it cannot be built
    here."""
    with _venv_lock:
        result = _venv_results.get(venv)
        if result is None:
            venv.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha1(str(venv).encode()).hexdigest()[:12]
            lock_path = Path(tempfile.gettempdir()) / f"chronomq-{venv.name.lstrip('.')}-{digest}.lock"
            with open(lock_path, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    result = build(venv, package, check)
                except CompatUnavailable as e:
                    result = e
                except (OSError, subprocess.SubprocessError) as e:
                    result = _unavailable(f"{type(e).__name__}: {e}", package)
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            _venv_results[venv] = result
    if isinstance(result, CompatUnavailable):
        raise result
    return result


def _skip_or_raise(venv: Path, package: str, check: Any, build: Any = _build_venv) -> str:
    try:
        return _venv_python(venv, package, check, build)
    except CompatUnavailable as e:
        if "pytest" in sys.modules:
            import pytest

            pytest.skip(str(e))
        raise


def official_python() -> str:
    """Path of the python in the venv with the official 4.x client. Under pytest a missing client skips
    the test with the exact reason; elsewhere CompatUnavailable is raised."""
    return _skip_or_raise(COMPAT_VENV, OFFICIAL_PACKAGE, _check_4x)


def grpc5_python() -> str:
    """Path of the python in ``<repo>/.venv-grpc5`` with the official 5.x Python client (its own venv: it
    is imported as ``rocketmq`` too). Skips or raises like ``official_python``."""
    return _skip_or_raise(GRPC5_VENV, GRPC5_PACKAGE, _check_5x)


# --- the official 5.x Node.js client ---------------------------------------------------------------------
NODE5_DIR = REPO / ".node-grpc5"
NODE5_PACKAGE = "rocketmq-client-nodejs@1.0.8"  # apache/rocketmq-clients' nodejs client, from npm
NODE5_MIN_VERSION = (16, 19)  # the package's "engines"


def _node_tools(package: str) -> tuple[str, str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise _unavailable(f"{'node' if node is None else 'npm'} is not on PATH", package)
    r = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    m = re.match(r"v(\d+)\.(\d+)", r.stdout.strip())
    if r.returncode != 0 or m is None:
        raise _unavailable(f"`node --version` answered {r.stdout.strip()!r} {r.stderr.strip()[-500:]}",
                           package)
    if (int(m[1]), int(m[2])) < NODE5_MIN_VERSION:
        raise _unavailable(f"node {r.stdout.strip()} is older than the package's minimum"
                           f" {'.'.join(map(str, NODE5_MIN_VERSION))}", package)
    return node, npm


def _check_node5(node: str, env_dir: Path, package: str) -> None:
    # a bare require in `node -e` resolves from the working directory's node_modules
    code = ("const c = require('rocketmq-client-nodejs');"
            " if (!c.Producer || !c.SimpleConsumer) { console.error(Object.keys(c)); process.exit(3); }")
    r = subprocess.run([node, "-e", code], capture_output=True, text=True, timeout=120, cwd=env_dir)
    if r.returncode != 0:
        raise _unavailable(f"it does not load: {r.stderr.strip()[-1500:]}", package)


def _build_node_env(env_dir: Path, package: str, check: Any) -> str:
    """``npm install`` ``package`` into ``env_dir`` (install scripts off) unless a previous install
    finished; returns the node binary."""
    node, npm = _node_tools(package)
    stamp = env_dir / ".compat-ready"
    installed = env_dir / "node_modules" / package.rsplit("@", 1)[0] / "package.json"
    if stamp.exists() and stamp.read_text().strip() == package and installed.exists():
        return node
    shutil.rmtree(env_dir, ignore_errors=True)
    env_dir.mkdir(parents=True)
    (env_dir / "package.json").write_text(json.dumps({"name": "chronomq-node-grpc5", "private": True}) + "\n")
    env = dict(os.environ, npm_config_update_notifier="false")
    # bounded retries and fetch timeouts, so no network means a quick failure (and a skip), not a hang
    r = subprocess.run([npm, "install", "--ignore-scripts", "--no-audit", "--no-fund", "--save-exact",
                        "--loglevel=error", "--fetch-retries=1", "--fetch-timeout=60000",
                        "--fetch-retry-maxtimeout=10000", package],
                       cwd=env_dir, env=env, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise _unavailable(f"npm install {package} failed: {(r.stderr or r.stdout).strip()[-2000:]}", package)
    check(node, env_dir, package)
    stamp.write_text(package + "\n")
    return node


def grpc5_node() -> str:
    """Path of node, with the official 5.x Node.js client installed in ``<repo>/.node-grpc5`` (built
    once under a file lock like the venvs). Skips or raises like ``official_python``."""
    return _skip_or_raise(NODE5_DIR, NODE5_PACKAGE, _check_node5, _build_node_env)


# --- drivers ----------------------------------------------------------------------------------------------
def _driver_env(name: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # rocketmq-client-cpp writes its logs (and broadcasting offsets) under $HOME/logs/rocketmq-cpp;
    # the Node.js client's default logger under $HOME/logs/rocketmq; the Go client its local files.
    if name.startswith("go:"):
        from tests.compat.golang import GO_DRIVER_HOME as home

        env["ROCKETMQ_GO_LOG_LEVEL"] = "warn"
    else:
        home = (NODE5_DIR if name.endswith(".mjs") else COMPAT_VENV) / "home"
    home.mkdir(parents=True, exist_ok=True)
    env["HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    env["CHRONOMQ_NODE5_DIR"] = str(NODE5_DIR)
    return env


def _driver_cmd(name: str, args: dict[str, Any]) -> list[str]:
    client, _, op = name.partition(":")
    if client in ("java4", "java53", "java5"):  # the official Java clients (tests/compat/jvm.py)
        from tests.compat.jvm import java_driver

        return [*java_driver(client), json.dumps({**args, "op": op})]
    if name.startswith("go:"):  # the Go client: one binary, the op named after the colon
        from tests.compat.golang import go_driver

        return [str(go_driver()), json.dumps({**args, "op": name[3:]})]
    if name.endswith(".mjs"):  # the 5.x Node.js client
        script = DRIVERS / name
        if not script.exists():
            raise DriverError(f"no driver named {name!r} ({script})")
        return [grpc5_node(), str(script), json.dumps(args)]
    script = DRIVERS / f"{name}.py"
    if not script.exists():
        raise DriverError(f"no driver named {name!r} ({script})")
    # drivers named v5_* run the 5.x client, the others the 4.x one
    py = grpc5_python() if name.startswith("v5_") else official_python()
    return [py, str(script), json.dumps(args)]


def _parse_result(name: str, stdout: str, stderr: str, code: int | None) -> dict[str, Any]:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise DriverError(f"driver {name} printed no result (exit {code}); stderr:\n{stderr[-4000:]}")
    try:
        result = json.loads(lines[-1])
    except ValueError:
        raise DriverError(f"driver {name}: last stdout line is not JSON: {lines[-1][:500]!r} (exit {code});"
                          f" stderr:\n{stderr[-4000:]}") from None
    if not isinstance(result, dict):
        raise DriverError(f"driver {name}: result is not a JSON object: {lines[-1][:500]!r}")
    return result


def _accept_shutdown_crash(name: str, stdout: str, stderr: str, code: int) -> dict[str, Any] | None:
    """A driver killed by a signal (e.g. SIGABRT from the C++ client's shutdown) after it printed a result
    flagged ``before_shutdown``: keep the result, mark it, and say so on stderr (never silently)."""
    if code >= 0:
        return None
    try:
        result = _parse_result(name, stdout, stderr, code)
    except DriverError:
        return None
    if not result.get("before_shutdown"):
        return None
    result["client_shutdown_crash"] = f"signal {-code}: {stderr.strip()[-300:]}"
    sys.stderr.write(f"note: driver {name}: the official client crashed in shutdown after its result"
                     f" ({result['client_shutdown_crash']})\n")
    return result


def run_driver(name: str, args: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    """Run a driver to completion and return its JSON result; raises DriverError on failure."""
    client, _, op = name.partition(":")
    if client in JAVA_CLIENTS and os.environ.get("CHRONOMQ_JAVA_DRIVER_SERVER", "1") != "0":
        return driver_server(client).call(name, op, args, timeout)
    cmd = _driver_cmd(name, args)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_driver_env(name),
                           cwd=REPO, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise DriverError(f"driver {name} timed out after {timeout}s; stderr:\n{err[-4000:]}") from None
    if r.returncode != 0:
        accepted = _accept_shutdown_crash(name, r.stdout, r.stderr, r.returncode)
        if accepted is not None:
            return accepted
        raise DriverError(f"driver {name} failed with exit code {r.returncode}; stderr:\n{r.stderr[-4000:]}"
                          f"\nstdout tail:\n{r.stdout[-1000:]}")
    return _parse_result(name, r.stdout, r.stderr, r.returncode)


# --- the Java drivers' serve mode ---------------------------------------------------------------------
JAVA_CLIENTS = ("java4", "java53", "java5")


class _Call:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: dict[str, Any] | None = None


class DriverServer:
    """One JVM running a Java driver's serve mode (``java ... Driver serve``, tests/compat/jvm.py): a request
    is a JSON line on its stdin with an id, its answer the line on its stdout with that id; requests run side
    by side. A call that times out kills the JVM (the calls in flight in it fail with it); a JVM that exited
    fails its calls with its stderr tail. It halts by itself when its stdin closes (this process ended).
    ``run_driver`` keeps one per client and process (``driver_server``) and replaces one that is gone.
    CHRONOMQ_JAVA_DRIVER_SERVER=0 runs a JVM per call instead, as ``DriverProcess`` always does."""

    def __init__(self, client: str) -> None:
        from tests.compat.jvm import java_server

        self.client = client
        self.owner = os.getpid()
        fd, path = tempfile.mkstemp(prefix=f"chronomq-{client}-driver-", suffix=".err")
        self.stderr_path = Path(path)
        with os.fdopen(fd, "wb") as err:
            self.proc = subprocess.Popen(java_server(client), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=_driver_env(client), cwd=REPO, text=True,
                                         encoding="utf-8", bufsize=1)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._gone: str | None = None  # why the JVM no longer answers
        threading.Thread(target=self._read, name=f"{client}-driver-server", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self._gone is None and self.proc.poll() is None

    def in_flight(self) -> int:
        with self._lock:
            return len(self._calls)

    def stderr(self) -> str:
        return _tail(self.stderr_path)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                reply = json.loads(line)
            except ValueError:
                reply = None
            rid = reply.get("id") if isinstance(reply, dict) else None
            with self._lock:
                call = self._calls.pop(rid, None) if isinstance(rid, int) else None
            if call is None:  # the driver writes nothing else on its stdout: a broken answer stream
                self._fail(f"answered a line that is no request's: {line[:500]!r}")
                return
            call.reply = reply
            call.done.set()
        self._fail(f"exited with code {self.proc.wait()}")

    def _fail(self, why: str) -> None:
        with self._lock:
            self._gone = self._gone or why
            calls, self._calls = list(self._calls.values()), {}
        if self.proc.poll() is None:
            self.proc.kill()
        for call in calls:
            call.done.set()

    def call(self, name: str, op: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run ``op`` with ``args`` in this JVM and return its result; DriverError as ``run_driver``."""
        if "id" in args:
            raise ValueError(f"driver {name}: 'id' names the request in the serve mode, not an argument")
        call = _Call()
        with self._lock:
            rid = next(self._ids)
            if self._gone is None:
                self._calls[rid] = call
                try:
                    assert self.proc.stdin is not None
                    self.proc.stdin.write(json.dumps({**args, "op": op, "id": rid}) + "\n")
                    self.proc.stdin.flush()
                except OSError:  # the JVM is gone; the reader says why
                    self._calls.pop(rid, None)
                    call.done.set()
            else:
                call.done.set()
        if not call.done.wait(timeout):
            self._fail(f"was killed: driver {name} timed out after {timeout}s")
            self.proc.wait(10)
            raise DriverError(f"driver {name} timed out after {timeout}s; stderr:\n{self.stderr()}")
        if call.reply is None:  # the JVM is gone (or going): its exit code and stderr
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            why = self._gone or f"exited with code {self.proc.returncode}"
            raise DriverError(f"driver {name}: its {self.client} driver JVM (pid {self.pid}) {why};"
                              f" stderr:\n{self.stderr()}")
        error, result = call.reply.get("error"), call.reply.get("result")
        if error is not None:
            raise DriverError(f"driver {name} failed: {error.get('type')}: {error.get('message')}\n"
                              f"{error.get('stack', '')}; stderr:\n{self.stderr()}")
        if not isinstance(result, dict):
            raise DriverError(f"driver {name}: result is not a JSON object: {str(result)[:500]!r}")
        return result

    def stop(self, timeout: float = 10) -> None:
        """Close its stdin (the JVM halts), kill it if it has not exited within ``timeout``."""
        self._gone = self._gone or "was stopped"
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.stderr_path.unlink(missing_ok=True)


_servers: dict[str, DriverServer] = {}
_started: list[DriverServer] = []
_servers_lock = threading.Lock()


def driver_server(client: str) -> DriverServer:
    """This process's serve-mode JVM of ``client`` (java4/java53/java5), started on first use and again
    when the last one is gone."""
    with _servers_lock:
        server = _servers.get(client)
        if server is None or not server.alive() or server.owner != os.getpid():
            server = _servers[client] = DriverServer(client)
            if not _started:
                atexit.register(stop_driver_servers)
            _started.append(server)
        return server


def stop_driver_servers() -> None:
    """Stop every serve-mode JVM this process started (at exit, and at the end of a pytest session)."""
    with _servers_lock:
        servers = [s for s in _started if s.owner == os.getpid()]
        _started.clear()
        _servers.clear()
    for server in servers:
        server.stop()


class DriverProcess:
    """A driver running in the background. Drivers that stream records write JSON lines to
    ``args["out"]``; ``records()`` reads what is there so far. ``stop()`` sends SIGTERM (the driver shuts
    its client down cleanly and prints its result); ``kill()`` sends SIGKILL."""

    def __init__(self, name: str, args: dict[str, Any], workdir: Path) -> None:
        self.name = name
        self.args = args
        workdir.mkdir(parents=True, exist_ok=True)
        stem = f"{name}-{time.monotonic_ns()}"
        self.stdout_path = workdir / f"{stem}.out"
        self.stderr_path = workdir / f"{stem}.err"
        self.out_path = Path(args["out"]) if args.get("out") else None
        cmd = _driver_cmd(name, args)
        with open(self.stdout_path, "wb") as so, open(self.stderr_path, "wb") as se:
            self.proc = subprocess.Popen(cmd, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                         env=_driver_env(name), cwd=REPO)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def records(self) -> list[dict[str, Any]]:
        if self.out_path is None or not self.out_path.exists():
            return []
        # one read to the end: a line still being written can only be the last, and is left out (a line
        # iterator that met the end mid-line would go on reading and yield that line's rest as a line)
        text = self.out_path.read_text(encoding="utf-8")
        return [json.loads(line) for line in text.split("\n")[:-1] if line]

    def stderr(self) -> str:
        return _tail(self.stderr_path)

    def _finish(self, sig: int | None, timeout: float) -> dict[str, Any] | None:
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise DriverError(f"driver {self.name} did not exit within {timeout}s; stderr:\n{self.stderr()}")\
                from None
        if sig == signal.SIGKILL:
            return None
        stdout = self.stdout_path.read_text(errors="replace")
        if code != 0:
            accepted = _accept_shutdown_crash(self.name, stdout, self.stderr(), code)
            if accepted is not None:
                return accepted
            raise DriverError(f"driver {self.name} exited {code}; stderr:\n{self.stderr()}")
        return _parse_result(self.name, stdout, self.stderr(), code)

    def wait(self, timeout: float = 60) -> dict[str, Any]:
        result = self._finish(None, timeout)
        assert result is not None
        return result

    def stop(self, timeout: float = 60) -> dict[str, Any]:
        result = self._finish(signal.SIGTERM, timeout)
        assert result is not None
        return result

    def kill(self) -> None:
        self._finish(signal.SIGKILL, 10)


def start_driver(name: str, args: dict[str, Any], workdir: Path) -> DriverProcess:
    return DriverProcess(name, args, workdir)


# --- a raw remoting client on the project's own codec --------------------------------------------------
class RawClient:
    """Blocking request/response over one TCP connection, for requests the official wrapper lacks."""

    def __init__(self, addr: str, timeout: float = 10) -> None:
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.settimeout(timeout)
        self.decoder = FrameDecoder()
        self.pending: list[RemotingCommand] = []

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, code: int, ext: dict[str, Any] | None = None, body: bytes = b"") -> RemotingCommand:
        req = RemotingCommand.request(code, ext, body)
        self.sock.sendall(encode(req))
        while True:
            for cmd in self.pending:
                if cmd.opaque == req.opaque and cmd.is_response:
                    self.pending.remove(cmd)
                    return cmd
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError(f"connection closed while waiting for the answer to code {code}")
            for item in self.decoder.feed(data):
                if isinstance(item, FrameError):
                    raise item
                self.pending.append(item)

    # conveniences
    def view_message(self, commit_log_offset: int) -> RemotingCommand:
        return self.call(33, {"offset": str(commit_log_offset)})

    def query_consumer_offset(self, group: str, topic: str, queue_id: int) -> RemotingCommand:
        return self.call(14, {"consumerGroup": group, "topic": topic, "queueId": str(queue_id)})

    def max_offset(self, topic: str, queue_id: int) -> int:
        r = self.call(30, {"topic": topic, "queueId": str(queue_id)})
        if r.code != 0:
            raise RuntimeError(f"GET_MAX_OFFSET {topic}/{queue_id} -> code {r.code} {r.remark}")
        return int(r.ext_fields["offset"])

    def pull(self, group: str, topic: str, queue_id: int, offset: int, max_msgs: int = 32,
             subscription: str = "*") -> tuple[RemotingCommand, list[MessageExt]]:
        r = self.call(11, {"consumerGroup": group, "topic": topic, "queueId": str(queue_id),
                           "queueOffset": str(offset), "maxMsgNums": str(max_msgs), "sysFlag": "4",
                           "commitOffset": "0", "suspendTimeoutMillis": "0", "subscription": subscription,
                           "subVersion": "0"})
        msgs = decode_records(r.body) if r.code == 0 else []
        return r, msgs

    def pull_all(self, group: str, topic: str, queue_id: int, start: int = 0,
                 limit: int = 100_000) -> Iterator[MessageExt]:
        """Every message in one queue from ``start`` (bounded by ``limit`` messages)."""
        offset, seen = start, 0
        while seen < limit:
            r, msgs = self.pull(group, topic, queue_id, offset)
            if r.code != 0 or not msgs:
                return
            yield from msgs
            seen += len(msgs)
            offset = int(r.ext_fields.get("nextBeginOffset", offset + len(msgs)))
