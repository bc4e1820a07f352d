"""Message traces through Admin.message_trace and the console's message page: a message and trace records
for it (built as RocketMQ's TraceDataEncoder builds them) sent to RMQ_SYS_TRACE_TOPIC with the message's id
as KEYS, as a client with message trace on sends them."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the web extra is not installed")

from chronomq.client import Admin, Message, Producer
from chronomq.client.trace import TRACE_TOPIC, TraceType
from chronomq.web.app import ms_text
from tests.unit.test_trace import pub_context, sub_after_context, sub_before_context
from tests.web.conftest import Browser, Console, LoopThread, Traffic

pytestmark = pytest.mark.timeout(240)

TRACED_TOPIC = "ConsoleTraced"


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


@pytest.fixture(scope="module")
def traced(cluster: tuple[Any, Traffic], web_loop: LoopThread) -> dict[str, Any]:
    """A message with a Pub, SubBefore and SubAfter trace (the SubAfter in the old form without a group,
    in a trace message that also holds another message's record), and one without any trace."""
    ns = cluster[0].namesrv_addr

    async def make() -> dict[str, Any]:
        async with Producer("ConsoleTraceProducer", ns) as p:
            sent = await p.send(Message(TRACED_TOPIC, b"traced body", keys=["traced-1"], tags="TagT"))
            bare = await p.send(Message(TRACED_TOPIC, b"not traced", keys=["bare-1"]))
            t0 = int(time.time() * 1000)
            store = "127.0.0.1:10911"
            pub = pub_context(sent.msg_id, timestamp=t0, group="ConsoleTraceProducer", topic=TRACED_TOPIC,
                              tags="TagT", keys="traced-1", store_host=store, body_length=11, cost_ms=4,
                              offset_msg_id=sent.offset_msg_id)
            # consumed later, sent earlier: the trace is ordered by its records' times, not by arrival
            subs = (sub_before_context(sent.msg_id, timestamp=t0 + 20, group="TraceCG", request_id="rq-9",
                                       retry_times=1, keys="traced-1")
                    + sub_after_context("SOMEONE-ELSE", request_id="rq-0")
                    + sub_after_context(sent.msg_id, timestamp=t0 + 27, group=None, request_id="rq-9",
                                        cost_ms=7, success=False, context_code=2, keys="traced-1"))
            await p.send(Message(TRACE_TOPIC, subs.encode(), keys=[sent.msg_id, "SOMEONE-ELSE"]))
            await p.send(Message(TRACE_TOPIC, pub.encode(), keys=[sent.msg_id, "traced-1"]))
            await p.send(Message(TRACE_TOPIC, b"\xff not a trace", keys=[sent.msg_id]))
        return {"sent": sent, "bare": bare, "t0": t0, "store": store}

    return web_loop.run(make())


def test_admin_message_trace_finds_sorts_and_fills(cluster: tuple[Any, Traffic], web_loop: LoopThread,
                                                   traced: dict[str, Any]) -> None:
    ns, sent, t0 = cluster[0].namesrv_addr, traced["sent"], traced["t0"]

    async def lookup() -> tuple[Any, Any]:
        async with Admin(ns) as admin:
            return await admin.message_trace(sent.msg_id), await admin.message_trace(traced["bare"].msg_id)

    records, none = web_loop.run(lookup())
    assert none == []
    assert [(r.type, r.timestamp) for r in records] == [
        (TraceType.PUB, t0), (TraceType.SUB_BEFORE, t0 + 20), (TraceType.SUB_AFTER, t0 + 27)]
    pub, before, after = records
    assert (pub.topic, pub.group, pub.store_host, pub.offset_msg_id, pub.success) == (
        TRACED_TOPIC, "ConsoleTraceProducer", traced["store"], sent.offset_msg_id, True)
    assert after.group == "TraceCG"  # from its SubBefore: the old SubAfter form has no group
    assert (before.retry_times, after.cost_ms, after.success, after.consume_return) == (
        1, 7, False, "EXCEPTION")
    assert all(r.client_host == "127.0.0.1" for r in records)  # the trace message's born host
    with Admin(ns) as blocking:  # the blocking facade has it too
        assert [r.type for r in blocking.message_trace(sent.msg_id)] == [r.type for r in records]


def test_message_page_shows_the_trace(console: Console, traced: dict[str, Any]) -> None:
    browser = Browser(console.url)
    status, _, html = browser.get(f"/messages/view?id={traced['sent'].offset_msg_id}")
    assert status == 200 and "traced body" in html
    table = re.search(r'<table id="trace">(.*?)</table>', html, re.S)
    assert table, "the page has no trace table"
    rows = [_text(r).strip() for r in re.findall(r"<tr><td>(.*?)</tr>", table.group(1), re.S)]
    t0 = traced["t0"]
    assert rows == [
        f"Pub {ms_text(t0)} ConsoleTraceProducer 127.0.0.1 {traced['store']} 4 ms success Normal_Msg",
        f"SubBefore {ms_text(t0 + 20)} TraceCG 127.0.0.1 - - - retry 1",
        f"SubAfter {ms_text(t0 + 27)} TraceCG 127.0.0.1 - 7 ms failed EXCEPTION",
    ]


def test_message_page_says_when_there_is_no_trace(console: Console, traced: dict[str, Any]) -> None:
    status, _, html = Browser(console.url).get(f"/messages/view?id={traced['bare'].offset_msg_id}")
    assert status == 200 and "not traced" in html
    assert 'id="no-trace"' in html and 'id="trace"' not in html
