"""A real cluster with known traffic and the console serving it, shared by the console's HTTP and browser
tests: `chronomq start` (tests/compat/harness.ChronomqProcess) on loopback, messages with keys, a consumer
group part-way through, timed messages waiting, and a dead letter; the console in a thread of its own."""

from __future__ import annotations

import asyncio
import http.cookiejar
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the web extra is not installed")

from chronomq.client import LATER, Admin, Message, Producer, PushConsumer
from tests.compat.harness import ChronomqProcess
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
TOPIC = "ConsoleOrders"
GROUP = "ConsoleGroup"
FAILING_GROUP = "ConsoleFailing"
N_MESSAGES = 40
FAST = {"messageDelayLevel": "300ms 300ms 300ms 300ms 300ms 300ms 300ms 300ms", "maxReconsumeTimes": "1"}


@dataclass
class Traffic:
    sent: dict[str, str] = field(default_factory=dict)  # key -> offset msg id
    timed: dict[str, str] = field(default_factory=dict)  # key -> uniq key (handle), due in an hour
    consumed: int = 0


class LoopThread:
    """An event loop in a thread: the console and the test's own clients run on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="console-test-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def web_loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, web_loop: LoopThread) -> Iterator[tuple[Any, Traffic]]:
    proc = ChronomqProcess(tmp_path_factory.mktemp("console") / "data", FAST)
    proc.start()
    traffic = Traffic()
    consumers: list[Any] = []
    try:
        web_loop.run(_make_traffic(proc.namesrv_addr, traffic, consumers), timeout=120)
        yield proc, traffic
    finally:
        for c in consumers:
            web_loop.run(c.close())
        proc.stop()


async def _make_traffic(ns: str, traffic: Traffic, consumers: list[Any]) -> None:
    async with Admin(ns) as admin:
        await admin.create_topic(TOPIC, 2)
    async with Producer("ConsoleProducer", ns) as p:
        for i in range(N_MESSAGES):
            r = await p.send(Message(TOPIC, f"order {i} body", keys=[f"order-{i}"], tags="paid"))
            traffic.sent[f"order-{i}"] = r.offset_msg_id
        for i in range(3):
            r = await p.send(Message(TOPIC, f"timed {i}", keys=[f"timed-{i}"],
                                     deliver_at=int(time.time() * 1000) + 3_600_000))
            traffic.timed[f"timed-{i}"] = r.uniq_key
        await p.send(Message("ConsoleDead", b"this one always fails", keys=["dead-1"]))

    seen: set[str] = set()

    async def ok(msg: Any) -> None:
        seen.add(msg.id)

    async def fail(msg: Any) -> Any:
        return LATER

    opts: dict[str, Any] = dict(namesrv=ns, consume_from="first", rebalance_interval=0.5,
                                offset_commit_interval=0.3, long_poll_timeout=2.0)
    good = PushConsumer(GROUP, TOPIC, ok, **opts)
    bad = PushConsumer(FAILING_GROUP, "ConsoleDead", fail, **opts)
    for c in (good, bad):
        await c.start()
        consumers.append(c)
    async with Admin(ns) as admin:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # polled with a deadline: every message consumed and committed,
            rows = await admin.group_progress(GROUP, [TOPIC])  # and the failing one dead-lettered
            dlq = [t for t in await admin.list_topics() if t == "%DLQ%" + FAILING_GROUP]
            if len(seen) >= N_MESSAGES and rows and sum(r.lag for r in rows) == 0 and dlq:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"traffic did not settle: consumed {len(seen)}, dlq {dlq}")
    traffic.consumed = len(seen)


class Browser:
    """A cookie-keeping HTTP client of the console (no redirects followed: the tests check them)."""

    class _NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar),
                                                  self._NoRedirect)

    def request(self, path: str, form: dict[str, str] | None = None) -> tuple[int, Any, str]:
        """(status, headers (case-insensitive), body text)."""
        data = urllib.parse.urlencode(form).encode() if form is not None else None
        method = "POST" if form is not None else "GET"
        req = urllib.request.Request(self.base + path, data=data, method=method)
        try:
            with self.opener.open(req, timeout=30) as resp:
                return resp.status, resp.headers, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read().decode()

    def get(self, path: str) -> tuple[int, Any, str]:
        return self.request(path)

    def post(self, path: str, form: dict[str, str]) -> tuple[int, Any, str]:
        return self.request(path, form)

    @staticmethod
    def csrf(html: str) -> str:
        m = re.search(r'name="csrf" value="([^"]+)"', html)
        assert m, "the page has no CSRF field"
        return m.group(1)


@dataclass
class Console:
    url: str
    server: Any
    namesrv: str


def start_console(web_loop: LoopThread, namesrv: str, users_file: str | None = None) -> Console:
    from chronomq.web import ConsoleConfig, ConsoleServer

    server = ConsoleServer(ConsoleConfig(namesrv=namesrv, port=free_port(), users_file=users_file))
    web_loop.run(server.start())
    return Console(server.url, server, namesrv)


@pytest.fixture(scope="session")
def console(cluster: tuple[Any, Traffic], web_loop: LoopThread) -> Iterator[Console]:
    c = start_console(web_loop, cluster[0].namesrv_addr)
    yield c
    web_loop.run(c.server.stop())


def artifacts_dir() -> Path:
    return Path(os.environ.get("CHRONOMQ_TEST_ARTIFACTS") or REPO / "test-artifacts")


def save_failure_screenshot(driver: Any, nodeid: str) -> Path:
    out = artifacts_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / (re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid) + ".png")
    driver.save_screenshot(str(path))
    return path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing browser test leaves a screenshot of what the browser showed (its path in the report)."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    driver = getattr(item, "funcargs", {}).get("driver")
    if rep.when == "call" and rep.failed and driver is not None:
        try:
            rep.sections.append(("screenshot", str(save_failure_screenshot(driver, item.nodeid))))
        except Exception as e:  # the browser itself may be what failed
            rep.sections.append(("screenshot", f"none: {e}"))
