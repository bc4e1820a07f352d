"""Redis sorted-set delay queue, the way arq / RQ / BullMQ-style schedulers do it: the job id in a sorted
set scored by its due time, the payload beside it (one hash per destination); a pipelined ZADD producer;
a poller that claims due jobs atomically with a Lua script every 1 ms.

Durability: appendonly yes, appendfsync everysec (the Redis documentation's recommended trade-off)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import Consumer, PayloadFn, Peer, Producer, Sink, need_module
from .procs import free_port, require_binary, spawn, stop_group, wait_port
from .workloads import now_ms

CLAIM_LUA = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then return {} end
redis.call('ZREM', KEYS[1], unpack(ids))
local bodies = redis.call('HMGET', KEYS[2], unpack(ids))
redis.call('HDEL', KEYS[2], unpack(ids))
return bodies
"""
CLAIM_BATCH = 500
POLL_INTERVAL_S = 0.001


def _keys(dest: str) -> tuple[str, str]:
    return f"delayed:{dest}", f"jobs:{dest}"


class RedisProducer(Producer):
    def __init__(self, port: int, dest: str, payload: PayloadFn) -> None:
        redis = need_module("redis", "redis-py, the Redis client")
        self.r = redis.Redis(host="127.0.0.1", port=port)
        self.zkey, self.hkey = _keys(dest)
        self.payload = payload

    def schedule(self, items: Sequence[tuple[int, int]]) -> list[int]:
        pipe = self.r.pipeline(transaction=False)
        for seq, due in items:
            member = str(seq)
            pipe.hset(self.hkey, member, self.payload(seq, due))
            pipe.zadd(self.zkey, {member: due})
        pipe.execute()
        return [due for _, due in items]

    def close(self) -> None:
        self.r.close()


class RedisPoller(Consumer):
    def __init__(self, port: int, dest: str, sink: Sink) -> None:
        self.redis = need_module("redis", "redis-py, the Redis client")
        self.port = port
        self.zkey, self.hkey = _keys(dest)
        self.sink = sink
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"redis-poller-{dest}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        r = self.redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)
        claim = r.register_script(CLAIM_LUA)
        try:
            while not self._stop.is_set():
                try:
                    bodies = claim(keys=[self.zkey, self.hkey], args=[now_ms(), CLAIM_BATCH])
                except (self.redis.ConnectionError, self.redis.TimeoutError, self.redis.BusyLoadingError):
                    self.errors += 1  # the server is down or restarting: retry shortly
                    self._stop.wait(0.05)
                    continue
                recv = now_ms()
                for body in bodies:
                    if body is not None:
                        self.sink(body, recv)
                if len(bodies) < CLAIM_BATCH:
                    self._stop.wait(POLL_INTERVAL_S)
        finally:
            r.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


class RedisPeer(Peer):
    name = "redis"
    label = "Redis ZSET"
    durability = "AOF appendfsync everysec"
    client = "redis-py (pipelined ZADD, Lua claim poller at 1 ms)"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._binary = ""

    def check(self) -> None:
        self._binary = require_binary("redis-server", package="redis-server")
        need_module("redis", "redis-py, the Redis client")

    def version(self) -> str:
        if not self._binary:
            return ""
        out = subprocess.run([self._binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        return out.strip()

    def _launch(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
               "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
               "--protected-mode", "yes", "--loglevel", "warning"]
        self.proc = spawn(cmd, self.workdir / "redis.log")
        wait_port(self.port, 30, self.proc, "redis-server")
        redis = need_module("redis", "redis-py")
        r = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 120
        try:
            while True:  # after a restart Redis answers LOADING until the AOF is replayed
                try:
                    r.ping()
                    return
                except redis.BusyLoadingError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("redis still loading its AOF after 120 s") from None
                    time.sleep(0.05)
        finally:
            r.close()

    def start(self) -> None:
        if not self._binary:
            self.check()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self._launch()

    def stop(self) -> None:
        stop_group(self.proc)
        self.proc = None

    def kill9(self) -> None:
        stop_group(self.proc, kill=True)
        self.proc = None

    def restart(self) -> None:
        self._launch()

    def server_pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    def producer(self, dest: str, payload: PayloadFn) -> Producer:
        return RedisProducer(self.port, dest, payload)

    def consumer(self, dest: str, sink: Sink) -> Consumer:
        return RedisPoller(self.port, dest, sink)

    def settle(self, timeout_s: float) -> dict[str, Any]:
        """Wait for a running AOF rewrite to finish: its forked child shares the parent's pages, so the
        process tree's RSS would count the data set twice (and the AOF is mid-rewrite on disk)."""
        redis = need_module("redis", "redis-py")
        r = redis.Redis(host="127.0.0.1", port=self.port)
        t0 = time.monotonic()
        try:
            while True:
                info = r.info("persistence")
                busy = bool(info.get("aof_rewrite_in_progress")) or bool(info.get("aof_rewrite_scheduled"))
                if not busy or time.monotonic() - t0 > timeout_s:
                    return {"aof_rewrite_waited_s": round(time.monotonic() - t0, 1), "aof_rewrite_busy": busy}
                time.sleep(0.5)
        finally:
            r.close()

    def backlog(self, dest: str) -> dict[str, Any]:
        redis = need_module("redis", "redis-py")
        r = redis.Redis(host="127.0.0.1", port=self.port)
        try:
            zkey, hkey = _keys(dest)
            return {zkey: r.zcard(zkey), hkey: r.hlen(hkey)}
        finally:
            r.close()
