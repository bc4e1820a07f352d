"""Process plumbing for the peers: free ports, waiting for a listener, RSS of a process tree, disk use of
a directory, and stopping what we started by PID (never by name)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

APT_LINE = "apt-get install -y redis-server rabbitmq-server"


class PeerUnavailable(RuntimeError):
    """The peer cannot run here (missing binary or Python client); the message says what to install."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def find_binary(name: str, extra_dirs: tuple[str, ...] = ()) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in extra_dirs:
        cand = Path(d) / name
        if cand.exists() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def require_binary(name: str, extra_dirs: tuple[str, ...] = (), package: str | None = None) -> str:
    path = find_binary(name, extra_dirs)
    if path is None:
        raise PeerUnavailable(f"{name} not found; install it with: {APT_LINE}"
                              + (f" (package {package})" if package else ""))
    return path


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None, what: str = "server") -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s")
        time.sleep(0.05)


def children_of(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in parents.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss(pids: list[int]) -> dict[str, int]:
    """RSS (and its anonymous part) in bytes, summed over the given processes and all their descendants."""
    seen: set[int] = set()
    for p in pids:
        seen.add(p)
        seen.update(children_of(p))
    return {"rss_bytes": sum(_status_kb(p, "VmRSS") for p in seen) * 1024,
            "rss_anon_bytes": sum(_status_kb(p, "RssAnon") for p in seen) * 1024,
            "processes": len(seen)}


def _cpu_ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted after the command


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by the given processes and all their descendants (from
    /proc; a process that has exited no longer counts)."""
    seen: set[int] = set()
    for p in pids:
        seen.add(p)
        seen.update(children_of(p))
    return sum(_cpu_ticks(p) for p in seen) / os.sysconf("SC_CLK_TCK")


def pin(pids: list[int], cpus: set[int], descendants: bool = True) -> int:
    """Run every thread of the given processes (and of their descendants) on ``cpus``; threads and
    processes they start later inherit it. Returns how many threads were pinned."""
    seen: set[int] = set()
    for p in pids:
        seen.add(p)
        if descendants:
            seen.update(children_of(p))
    n = 0
    for p in seen:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)
                    n += 1
    return n


def disk_usage(path: Path) -> dict[str, int]:
    """Allocated bytes (st_blocks, what the disk really holds) and apparent size under ``path``."""
    alloc = apparent = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                alloc += st.st_blocks * 512
                apparent += st.st_size
    return {"disk_bytes": alloc, "disk_apparent_bytes": apparent}


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
          cwd: str | Path | None = None) -> subprocess.Popen:
    """Start a server in its own session (so its process group can be signalled by our PID)."""
    log = open(log_path, "ab")  # noqa: SIM115 (the child owns it)
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=cwd, start_new_session=True)
    finally:
        log.close()


def stop_group(proc: subprocess.Popen | None, kill: bool = False, timeout: float = 30) -> int | None:
    """SIGTERM (or SIGKILL) the process group led by ``proc`` (a child we spawned with its own session),
    wait for it, escalate to SIGKILL after ``timeout``."""
    if proc is None:
        return None
    sig = signal.SIGKILL if kill else signal.SIGTERM
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    # the group may still hold grandchildren (e.g. an Erlang port program): SIGKILL what is left of it
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode
