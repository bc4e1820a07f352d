"""The packages a release ships, installed as a user would: ``python -m build`` makes the sdist and, from it,
the wheel (compiled kernels); each goes into a fresh venv under tmp_path (the sdist with the C compiler
hidden, so it falls back to the pure-Python kernels). Each install's ``chronomq start`` must log nothing at
WARNING or above, serve 5.x clients, and deliver a message timed 1 s ahead to chronomq's own client run by
that venv's python. One more start, of the dev venv with every extra installed, checks the extras add no
warning either. Skipped, with the reason, where the package index cannot be reached."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compat.harness import ChronomqProcess
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
# what pip or build print when the index is out of reach (then the test skips, naming the line)
UNREACHABLE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
                         r"Name or service not known|Network is unreachable|No route to host|"
                         r"ConnectTimeoutError|ReadTimeoutError|ProxyError")
LOUD = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Warning:|Traceback")

CLIENT_SCRIPT = '''
import json, sys, time
from chronomq.client import Admin, Message, Producer, PullStatus, SimpleConsumer

namesrv, topic = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 60
with Admin(namesrv) as admin:
    admin.create_topic(topic, 1)
with Producer("packaging-producer", namesrv=namesrv) as producer:
    sent_ms = int(time.time() * 1000)
    sent = producer.send(Message(topic, b"timed", keys="packaging", delay=1.0))
with SimpleConsumer("packaging-consumer", namesrv=namesrv) as consumer:
    queues = []
    while not queues and time.monotonic() < deadline:
        try:
            queues = consumer.queues(topic, refresh=True)
        except Exception:  # the route is not at the name server yet
            time.sleep(0.05)
    offset = 0
    while time.monotonic() < deadline:
        result = consumer.pull(queues[0], offset, max_count=8, timeout=1.0)  # long polling
        if result.status == PullStatus.FOUND:
            for m in result.messages:
                if m.id == sent.msg_id:
                    print(json.dumps({"sent_ms": sent_ms, "deliver_ms": sent.deliver_ms,
                                      "arrived_ms": int(time.time() * 1000), "body": m.body.decode()}))
                    sys.exit(0)
        offset = result.next_offset
sys.exit("the timed message did not arrive within 60 s")
'''


def _run(cmd: list[str], what: str, timeout: float = 300,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on failure skip if the package index was out of reach, else fail with its output."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        out = r.stdout + r.stderr
        line = next((ln for ln in out.splitlines() if UNREACHABLE.search(ln)), None)
        if line is not None:
            pytest.skip(f"{what}: the package index cannot be reached: {line.strip()[:300]}")
        pytest.fail(f"{what} failed (exit {r.returncode}):\n{out[-4000:]}")
    return r


def _env(**extra: str) -> dict[str, str]:
    """The environment of an installed chronomq: not the checkout's src/, kernels not forced."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CHRONOMQ_PURE_PYTHON")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _source_copy(dest: Path) -> Path:
    """The checkout's files that git tracks or would (ignored ones, such as a built .so, left out), as they
    are in the work tree: building from a copy writes nothing into the checkout."""
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"the source tree to build is not a git checkout: {r.stderr.strip()[:300]}")
    for name in filter(None, r.stdout.split("\0")):
        src = REPO / name
        if src.is_file() and not name.startswith(("tests/", "bench/", "docs/", "dashboards/", "examples/")):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    return dest


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel built from it, once for the module."""
    pytest.importorskip("build", reason="the build package is not installed (it is in the dev extra)")
    tmp = tmp_path_factory.mktemp("packaging")
    src = _source_copy(tmp / "src")
    _run([sys.executable, "-m", "build", "--outdir", str(tmp / "dist"), str(src)], "python -m build",
         env=_env())
    [sdist] = (tmp / "dist").glob("chronomq-*.tar.gz")
    [wheel] = (tmp / "dist").glob("chronomq-*.whl")
    return {"sdist": sdist, "wheel": wheel}


def _venv(path: Path, *requirements: str, env: dict[str, str] | None = None) -> Path:
    """A fresh venv at ``path`` holding ``requirements``, installed by this pip (pip's cache reused); its
    python. The install runs without PYTHONPATH (the suite's Spark tests put the checkout's src/ there):
    pip would see that chronomq as installed already and install nothing."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(path)], "python -m venv", timeout=120)
    py = path / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", *requirements],
         f"pip install {' '.join(Path(r).name for r in requirements)}", timeout=480, env=env or _env())
    return py


@pytest.fixture(scope="module")
def wheel_venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory.mktemp("wheel") / "venv", str(dist["wheel"]))


@pytest.fixture(scope="module")
def sdist_venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist installed with the C compiler hidden (CC=/bin/false): the extension is optional."""
    return _venv(tmp_path_factory.mktemp("sdist") / "venv", str(dist["sdist"]), env=_env(CC="/bin/false"))


class InstalledChronomq(ChronomqProcess):
    """``chronomq start`` of a venv's own console script (the dev checkout's when ``exe`` is None), on free
    loopback ports with the 5.x endpoint and /metrics on, plus ``extra_args``."""

    def __init__(self, data_dir: Path, exe: Path | None = None, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(data_dir, {"grpcListenPort": str(free_port()), "metricsPort": str(free_port())})
        self.exe, self.extra_args = exe, extra_args
        if exe is not None:
            self.env = {"PYTHONPATH": "", "CHRONOMQ_PURE_PYTHON": ""}  # empty: unset for Python

    def command(self) -> list[str]:
        cmd = super().command()
        if self.exe is not None:
            cmd = [str(self.exe), *cmd[cmd.index("start"):]]
        return [*cmd, *self.extra_args]

    def start_lines(self) -> list[str]:
        """What the start wrote on stderr (the harness's own header line left out)."""
        return [ln for ln in self.log_path.read_text().splitlines() if not ln.startswith("--- start #")]


@contextlib.contextmanager
def _running(proc: InstalledChronomq) -> Iterator[list[str]]:
    """``proc`` started, as the lines its start wrote on stderr; asserts that they say nothing at WARNING or
    above and that the 5.x endpoint serves, and that the stop is clean (exit 0)."""
    proc.start(timeout=60)
    try:
        lines = proc.start_lines()
        assert not [ln for ln in lines if LOUD.search(ln)], "\n".join(lines)
        assert any("gRPC endpoint (RocketMQ 5.x clients) on" in ln for ln in lines), "\n".join(lines)
        assert any(ln.startswith("chronomq ready ") and " grpc=" in ln for ln in proc.stdout_lines)
        # the embedded name server's /metrics on the port it was given (namesrvMetricsPort), not its port + 2
        ns_metrics = f"http://127.0.0.1:{proc.overrides['namesrvMetricsPort']}/metrics"
        with urllib.request.urlopen(ns_metrics, timeout=10) as r:
            assert b"chronomq_namesrv_requests_total" in r.read()
        yield lines
    finally:
        code = proc.stop()
    assert code == 0, proc.log_tail()


def _timed_roundtrip(py: Path, proc: InstalledChronomq, tmp_path: Path) -> dict[str, object]:
    script = tmp_path / "timed_roundtrip.py"  # run from tmp_path: the checkout is not on its sys.path
    script.write_text(CLIENT_SCRIPT)
    r = subprocess.run([str(py), str(script), proc.namesrv_addr, "PackagingTimed"], capture_output=True,
                       text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["body"] == "timed"
    assert isinstance(got["deliver_ms"], int) and got["deliver_ms"] >= got["sent_ms"] + 1000
    assert got["arrived_ms"] >= got["deliver_ms"]  # never early
    return got


def _version(py: Path) -> str:
    r = subprocess.run([str(py.parent / "chronomq"), "--version"], capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_artifacts_hold_the_kernels_their_sources_and_the_default_dependencies(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = whl.namelist()
        [meta] = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = whl.read(meta).decode()
    assert any(re.fullmatch(r"chronomq/store/_speedups\.cpython-.*\.so", n) for n in names), names
    assert any(re.fullmatch(r"chronomq/remoting/_decode\.cpython-.*\.so", n) for n in names), names
    assert any(n.startswith("chronomq/web/templates/") for n in names)
    assert any(n.startswith("chronomq/grpc/_proto/") and n.endswith(".proto") for n in names)
    requires = [ln.split(":", 1)[1].strip() for ln in metadata.splitlines()
                if ln.startswith("Requires-Dist:")]
    defaults = {re.split(r"[<>=;\s]", r)[0] for r in requires if "extra ==" not in r}
    assert {"grpcio", "protobuf", "pyyaml", "prometheus-client"} <= defaults, requires
    assert "Provides-Extra: grpc" in metadata  # pip install 'chronomq[grpc]' keeps working
    with tarfile.open(dist["sdist"]) as sd:
        members = {m.name.split("/", 1)[1] for m in sd.getmembers() if "/" in m.name}
    assert {"setup.py", "pyproject.toml", "src/chronomq/store/_speedups.pyx",
            "src/chronomq/store/_crc32.h", "src/chronomq/remoting/_decode.pyx"} <= members


def test_wheel_in_a_fresh_venv_starts_quietly_and_delivers_a_timed_message(
        wheel_venv: Path, tmp_path: Path) -> None:
    assert _version(wheel_venv).endswith("hot-path kernels compiled (chronomq.store._speedups)")
    proc = InstalledChronomq(tmp_path / "data", wheel_venv.parent / "chronomq")
    with _running(proc) as lines:
        assert lines[0].endswith(" INFO chronomq: event loop: asyncio (uvloop is faster: pip install "
                                 "'chronomq[fast]'); hot-path kernels: compiled (chronomq.store._speedups)")
        _timed_roundtrip(wheel_venv, proc, tmp_path)


def test_the_grpc_extra_still_installs(wheel_venv: Path, dist: dict[str, Path]) -> None:
    r = _run([sys.executable, "-m", "pip", "--python", str(wheel_venv), "install", f"{dist['wheel']}[grpc]"],
             "pip install chronomq[grpc]", timeout=300, env=_env())
    assert "does not provide the extra" not in r.stdout + r.stderr


def test_sdist_without_a_c_compiler_runs_the_pure_python_kernels(sdist_venv: Path, tmp_path: Path) -> None:
    assert _version(sdist_venv).endswith("hot-path kernels pure Python (not built)")
    assert not list(sdist_venv.parent.parent.glob("lib/python*/site-packages/chronomq/store/_speedups*.so"))
    assert not list(sdist_venv.parent.parent.glob("lib/python*/site-packages/chronomq/remoting/_decode*.so"))
    proc = InstalledChronomq(tmp_path / "data", sdist_venv.parent / "chronomq")
    with _running(proc) as lines:
        assert "hot-path kernels: pure Python (not built)" in lines[0]
        _timed_roundtrip(sdist_venv, proc, tmp_path)


def test_start_with_every_extra_installed_logs_nothing_above_info(tmp_path: Path) -> None:
    """The dev venv has every extra (fast, web, spark, bench): a start serving the console too is as
    quiet as the plain one (a full install per extra would cost minutes: pyspark alone is hundreds of MB)."""
    for module, extra in (("uvloop", "fast"), ("starlette", "web"), ("pyspark", "spark")):
        pytest.importorskip(module, reason=f"the {extra} extra is not installed in this venv")
    proc = InstalledChronomq(tmp_path / "data", None, ("--dashboard", "--dashboard-port", str(free_port())))
    with _running(proc) as lines:
        assert "event loop: uvloop; " in lines[0]
        assert any(" console=http://" in ln for ln in proc.stdout_lines)
