"""Shared helpers for the driver scripts. Drivers run inside the compat venv (PyPI rocketmq==0.4.4), not
the project's venv: they import only the standard library and the official wrapper.

Protocol: argv[1] is a JSON object of arguments; the last stdout line is the JSON result; errors go to
stderr with a non-zero exit code. Streaming drivers also append one JSON line per event to args["out"].
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

STANDARD_PROPS = ("KEYS", "TAGS", "UNIQ_KEY", "DELAY", "REAL_TOPIC", "REAL_QID", "RETRY_TOPIC",
                  "ORIGIN_MESSAGE_ID", "WAIT", "MAX_OFFSET", "MIN_OFFSET")


class ArgError(ValueError):
    pass


def fail(msg: str, code: int = 2) -> None:
    sys.stderr.write(f"driver error: {msg}\n")
    sys.stderr.flush()
    sys.exit(code)


def load_args(required: tuple[str, ...] = ()) -> dict[str, Any]:
    if len(sys.argv) != 2:
        fail("usage: driver.py '<json object of arguments>'")
    try:
        args = json.loads(sys.argv[1])
    except ValueError as e:
        fail(f"argv[1] is not JSON: {e}")
    if not isinstance(args, dict):
        fail("argv[1] must be a JSON object")
    missing = [k for k in required if k not in args]
    if missing:
        fail(f"missing arguments: {', '.join(missing)}")
    return args


def emit(result: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def emit_around_shutdown(result: Callable[[], dict[str, Any]], shutdown: Callable[[], None]) -> None:
    """The result, flagged ``before_shutdown``, then the client's shutdown, then the result again (with what
    arrived meanwhile): rocketmq-client-cpp 1.2.x sometimes aborts in shutdown (terminate after
    'boost::thread_interrupted'); the harness keeps the flagged result only then, and says so."""
    emit({**result(), "before_shutdown": True})
    shutdown()
    emit(result())


def now_ms() -> int:
    return int(time.time() * 1000)


def body_bytes(spec: dict[str, Any]) -> bytes:
    if "body_b64" in spec:
        return base64.b64decode(spec["body_b64"])
    if "body" in spec:
        return str(spec["body"]).encode("utf-8")
    raise ArgError("a message needs body or body_b64")


def make_message(spec: dict[str, Any], default_topic: str | None = None):  # type: ignore[no-untyped-def]
    """Build a rocketmq.client.Message from {topic, body|body_b64, keys, tags, props, delay_level}."""
    from rocketmq.client import Message
    from rocketmq.ffi import dll

    topic = spec.get("topic", default_topic)
    if not topic:
        raise ArgError("a message needs a topic")
    msg = Message(topic)
    body = body_bytes(spec)
    # SetByteMessageBody keeps bytes exact (set_body goes through a NUL-terminated char*).
    rc = dll.SetByteMessageBody(msg._handle, body, len(body))
    if rc != 0:
        raise RuntimeError(f"SetByteMessageBody failed: {rc}")
    if spec.get("keys"):
        msg.set_keys(spec["keys"])
    if spec.get("tags"):
        msg.set_tags(spec["tags"])
    for k, v in (spec.get("props") or {}).items():
        msg.set_property(k, str(v))
    if spec.get("delay_level"):
        msg.set_delay_time_level(int(spec["delay_level"]))
    return msg


def _s(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    return str(v)


def recv_to_dict(msg: Any, prop_names: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything the wrapper exposes about a received message, JSON-able."""
    body = msg.body or b""
    props: dict[str, str] = {}
    for name in (*STANDARD_PROPS, *prop_names):
        v = _s(msg.get_property(name))
        if v:
            props[name] = v
    return {
        "id": _s(msg.id),
        "topic": _s(msg.topic),
        "body_b64": base64.b64encode(body).decode(),
        "keys": _s(msg.keys),
        "tags": _s(msg.tags),
        "properties": props,
        "reconsume_times": msg.reconsume_times,
        "queue_id": msg.queue_id,
        "queue_offset": msg.queue_offset,
        "commit_log_offset": msg.commit_log_offset,
        "store_timestamp": msg.store_timestamp,
        "born_timestamp": msg.born_timestamp,
        "store_size": msg.store_size,
        "delay_time_level": msg.delay_time_level,
        "receipt_ms": now_ms(),
    }


class JsonlWriter:
    """Thread-safe appender of JSON lines (each line flushed whole)."""

    def __init__(self, path: str | None) -> None:
        self._f = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self._lock = threading.Lock()

    def write(self, obj: dict[str, Any]) -> None:
        if self._f is None:
            return
        line = json.dumps(obj) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            with self._lock:
                self._f.close()


class StopFlag:
    """Set by SIGTERM/SIGINT so a long-running driver can shut its client down cleanly."""

    def __init__(self) -> None:
        self.event = threading.Event()
        signal.signal(signal.SIGTERM, self._handler)
        signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.event.set()

    def wait(self, timeout: float) -> bool:
        return self.event.wait(timeout)

    @property
    def stopped(self) -> bool:
        return self.event.is_set()


def hard_exit(code: int = 0) -> None:
    """Leave without running the wrapper's __del__ hooks (they can crash after an explicit shutdown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class FirstSendGuard:
    """rocketmq-client-cpp 1.2.x race: the first send on a broker connection that is still being set up
    can fail at once ("try to connect" then "send failed of times:1..5" within a millisecond, before the
    connect callback; the broker never sees the request) and is reported as "No route info of this
    topic"; a batch send (``send_batch``) reports the same failure with no text at all (the wrapper's
    ``ProducerSendSyncFailed: ``, the client's log saying "No route info"). Until one send has
    succeeded, such a failure is retried after a short pause (at most ``limit`` times; a textless one
    only when it came back within ``fast_s``, as this race does, never after a send timeout); every
    retry is counted in ``retries`` and reported in the driver's result, and a failure after the first
    success is never retried."""

    def __init__(self, limit: int = 5, pause_s: float = 0.3, fast_s: float = 0.2) -> None:
        self.limit = limit
        self.pause_s = pause_s
        self.fast_s = fast_s
        self.retries = 0
        self.succeeded = False
        self._lock = threading.Lock()

    def call(self, fn, *args):  # type: ignore[no-untyped-def]
        while True:
            t0 = time.monotonic()
            try:
                result = fn(*args)
            except Exception as e:
                text = str(e)
                raced = "No route info" in text or (
                    not text.strip() and type(e).__name__ == "ProducerSendSyncFailed"
                    and time.monotonic() - t0 < self.fast_s)
                with self._lock:
                    retry = not self.succeeded and self.retries < self.limit and raced
                    if retry:
                        self.retries += 1
                if not retry:
                    raise
                time.sleep(self.pause_s)
                continue
            self.succeeded = True
            return result
