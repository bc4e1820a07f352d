"""The official RocketMQ Go client (github.com/apache/rocketmq-client-go/v2) for the compat suite.

``go_driver()`` builds ``tests/compat/drivers/go`` (main.go, go.mod, go.sum) once into the git-ignored
``<repo>/.cache/go-driver/godriver-<hash>``, the hash covering those three files and ``go version``, so
an edit or another toolchain means a new build. Modules come through Go's own module cache and build
cache (GOMODCACHE / GOCACHE left as Go's defaults), so a second build downloads nothing. A file lock
makes concurrent pytest processes share one build.

No ``go`` on PATH, or the modules cannot be downloaded (module proxy unreachable), raises
``CompatUnavailable`` with the exact reason; under pytest the test is skipped with it. A driver that
does not compile is an error, not a skip.

The harness runs it for driver names ``go:<op>`` (``run_driver("go:produce", {...})``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.compat.harness import DRIVERS, REPO, CompatUnavailable, DriverError, _unavailable

GO_DRIVER_SRC = DRIVERS / "go"
GO_DRIVER_CACHE = REPO / ".cache" / "go-driver"
GO_DRIVER_HOME = GO_DRIVER_CACHE / "home"  # HOME of the running driver (the client's local files)
GO_SOURCES = ("main.go", "go.mod", "go.sum")
GO_CLIENT_MODULE = "github.com/apache/rocketmq-client-go/v2"
# what `go mod download` says when it cannot reach the module proxy (or was told not to)
_NETWORK_ERROR = re.compile(r"dial tcp|no such host|connection refused|i/o timeout|TLS handshake timeout"
                            r"|network is unreachable|GOPROXY=off|module lookup disabled"
                            r"|reading https?://\S+: (403|5\d\d)", re.IGNORECASE)

_lock = threading.Lock()
_result: Path | CompatUnavailable | None = None
last_build: dict[str, object] = {}  # how the last go_driver() call got its binary (for reports)


def client_version() -> str:
    """The client module's version required by the driver's go.mod."""
    m = re.search(rf"^\s*(?:require\s+)?{re.escape(GO_CLIENT_MODULE)}\s+(\S+)",
                  (GO_DRIVER_SRC / "go.mod").read_text(), re.MULTILINE)
    return m.group(1) if m else "?"


def _package() -> str:
    return f"{GO_CLIENT_MODULE}@{client_version()}"


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # go.sum is committed: never let the build edit it; never fetch another toolchain
    env["GOFLAGS"] = f"{env.get('GOFLAGS', '')} -mod=readonly".strip()
    env["GOTOOLCHAIN"] = "local"
    return env


def _source_hash(go: str) -> str:
    h = hashlib.sha256()
    r = subprocess.run([go, "version"], capture_output=True, text=True, timeout=60)
    h.update(r.stdout.strip().encode())
    for name in GO_SOURCES:
        h.update(f"\0{name}\0".encode())
        h.update((GO_DRIVER_SRC / name).read_bytes())
    return h.hexdigest()[:16]


def _build(go: str) -> Path:
    binary = GO_DRIVER_CACHE / f"godriver-{_source_hash(go)}"
    if binary.exists():
        last_build.update(built=False, seconds=0.0, binary=str(binary))
        return binary
    env, begin = _go_env(), time.monotonic()
    r = subprocess.run([go, "mod", "download"], cwd=GO_DRIVER_SRC, env=env, capture_output=True, text=True,
                       timeout=600, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        err = r.stderr.strip()[-2000:]
        if _NETWORK_ERROR.search(err):
            raise _unavailable(f"the Go module proxy is unreachable (go mod download: {err})", _package())
        raise DriverError(f"go mod download failed in {GO_DRIVER_SRC}:\n{err}")
    tmp = GO_DRIVER_CACHE / f".{binary.name}.{os.getpid()}.tmp"
    r = subprocess.run([go, "build", "-o", str(tmp), "."], cwd=GO_DRIVER_SRC, env=env,
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise DriverError(f"go build failed in {GO_DRIVER_SRC}:\n{r.stderr.strip()[-4000:]}")
    os.replace(tmp, binary)
    for old in GO_DRIVER_CACHE.glob("godriver-*"):  # builds of earlier sources
        if old != binary:
            old.unlink(missing_ok=True)
    last_build.update(built=True, seconds=round(time.monotonic() - begin, 1), binary=str(binary))
    return binary


def _go_driver() -> Path:
    global _result
    with _lock:
        if _result is None:
            go = shutil.which("go")
            if go is None:
                _result = _unavailable("go is not on PATH", _package())
            else:
                GO_DRIVER_CACHE.mkdir(parents=True, exist_ok=True)
                with open(GO_DRIVER_CACHE / ".build.lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    try:
                        _result = _build(go)
                    except CompatUnavailable as e:
                        _result = e
                    except (OSError, subprocess.SubprocessError) as e:
                        _result = _unavailable(f"{type(e).__name__}: {e}", _package())
                    finally:
                        fcntl.flock(lock, fcntl.LOCK_UN)
        result = _result
    if isinstance(result, CompatUnavailable):
        raise result
    return result


def go_driver() -> Path:
    """The driver binary, built if needed. Under pytest a missing toolchain or module proxy skips the
    test with the exact reason; elsewhere CompatUnavailable is raised. A build failure raises
    DriverError."""
    try:
        return _go_driver()
    except CompatUnavailable as e:
        if "pytest" in sys.modules:
            import pytest

            pytest.skip(str(e))
        raise
