"""The broker's timer wiring (broker/timer_processor.py): request parsing and validation as pure functions,
then the send path and codes 9001-9004 in process (a BrokerController on a virtual clock, driven over
loopback by the raw-codec client)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from tests.conftest import free_port
from tests.integration.rawclient import AsyncRawClient, send_ext

from chronomq.broker.timer_processor import parse_bool, parse_ident, parse_int, parse_query
from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.delay.timer import TimerPropertyError
from chronomq.delay.timer.props import timed_deliver_ms
from chronomq.message import MessageExt, decode_records
from chronomq.namesrv import RouteInfoManager
from chronomq.remoting.codec import BatchItem, HeaderError, RemotingCommand, encode_batch_body
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C

NOW = 1_700_000_000_000


def _req(**ext: str) -> RemotingCommand:
    return RemotingCommand.request(R.CHRONOMQ_QUERY_PENDING, ext)


# --- parsing ----------------------------------------------------------------------------------------
def test_parse_bool_accepts_true_false_and_absent_only() -> None:
    assert parse_bool(_req(byKey="true"), "byKey") is True
    assert parse_bool(_req(byKey="FALSE"), "byKey") is False
    assert parse_bool(_req(), "byKey") is False
    with pytest.raises(HeaderError, match="byKey"):
        parse_bool(_req(byKey="yes"), "byKey")


def test_parse_int_bounds_and_garbage() -> None:
    assert parse_int(_req(limit="5"), "limit", minimum=1, maximum=1000) == 5
    assert parse_int(_req(), "limit") is None
    for bad in ("0", "1001", "ten", "1.5"):
        with pytest.raises(HeaderError, match="limit"):
            parse_int(_req(limit=bad), "limit", minimum=1, maximum=1000)
    with pytest.raises(HeaderError, match="deliverMs"):
        parse_int(_req(), "deliverMs", required=True)
    with pytest.raises(HeaderError, match="deliverMs"):
        parse_int(_req(deliverMs="-1"), "deliverMs", required=True)


def test_parse_ident_requires_a_non_empty_id() -> None:
    assert parse_ident(_req(id="U1", byKey="true")) == ("U1", True)
    assert parse_ident(_req(id="U1")) == ("U1", False)
    for ext in ({}, {"id": ""}, {"id": "   "}, {"id": "x" * 5000}):
        with pytest.raises(HeaderError):
            parse_ident(_req(**ext))


def test_parse_query_filters_and_window() -> None:
    q = parse_query(_req(topic="T", key="k", tag="", startMs="10", endMs="20"))
    assert q == {"topic": "T", "key": "k", "start_ms": 10, "end_ms": 20}
    with pytest.raises(HeaderError, match="before"):
        parse_query(_req(startMs="20", endMs="10"))
    with pytest.raises(HeaderError, match="startMs"):
        parse_query(_req(startMs="soon"))


def _msg(**props: str) -> MessageExt:
    return MessageExt(topic="T", body=b"x", properties=dict(props))


def test_timed_deliver_ms_precedence_past_and_errors() -> None:
    assert timed_deliver_ms(_msg(), NOW) is None
    assert timed_deliver_ms(_msg(TIMER_DELIVER_MS=str(NOW + 5)), NOW) == NOW + 5
    assert timed_deliver_ms(_msg(TIMER_DELAY_SEC="2"), NOW) == NOW + 2000
    assert timed_deliver_ms(_msg(TIMER_DELAY_MS="1500"), NOW) == NOW + 1500
    assert timed_deliver_ms(_msg(__STARTDELIVERTIME=str((NOW + 3000) // 1000)), NOW) == NOW + 3000  # seconds
    assert timed_deliver_ms(_msg(TIMER_DELIVER_MS=str(NOW - 1)), NOW) is None  # past: deliver now
    m = _msg(DELAY="3", TIMER_DELAY_MS="100")
    assert timed_deliver_ms(m, NOW) == NOW + 100
    assert "DELAY" not in m.properties  # the timer property wins over the level
    for bad in ("soon", "-5", "nan"):
        with pytest.raises(TimerPropertyError):
            timed_deliver_ms(_msg(TIMER_DELIVER_MS=bad), NOW)


# --- in process -------------------------------------------------------------------------------------
class Env:
    def __init__(self, tmp_path: Path, clock: VirtualClock | None = None,
                 overrides: dict[str, str] | None = None) -> None:
        from chronomq.broker.controller import BrokerController

        self.clock = clock or VirtualClock(NOW)
        self.routes = RouteInfoManager()
        values = {"storePathRootDir": str(tmp_path / "store"), "listenPort": str(free_port()),
                  "messageDelayLevel": "1s 5s 10s", "timerMaxDelaySec": "3600", "metricsPort": "-1",
                  **(overrides or {})}
        self.config, _ = BrokerConfig.load(None, values)
        self.broker = BrokerController(self.config, self.clock, local_register=self.routes.register_broker)
        self.client: AsyncRawClient | None = None

    async def start(self) -> AsyncRawClient:
        await self.broker.start()
        self.client = await AsyncRawClient.connect(self.broker.server.address)
        return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        await self.broker.shutdown()

    async def queue_msgs(self, topic: str, qid: int) -> list[MessageExt]:
        store = self.broker.store
        assert await asyncio.to_thread(store.wait_dispatched, store.max_phy_offset, 5)
        assert self.client is not None
        r = await self.client.pull("G", topic, qid, 0)
        return decode_records(r.body) if r.code == C.SUCCESS else []

    async def advance(self, ms: int) -> None:
        await self.broker.timer.settle()
        await self.clock.advance(ms)
        await self.broker.timer.settle()


@pytest.fixture
async def env(tmp_path: Path):
    e = Env(tmp_path)
    c = await e.start()
    assert c is not None
    yield e
    await e.close()


def _body(resp: RemotingCommand) -> dict:
    assert resp.code == C.SUCCESS, resp.remark
    return json.loads(resp.body)


async def test_timed_send_is_parked_then_delivered_on_time(env: Env) -> None:
    c = env.client
    assert c is not None
    due = NOW + 5000
    resp = await c.send_message("TT", b"later", 1, {"TIMER_DELIVER_MS": str(due), "KEYS": "order-1",
                                                   "UNIQ_KEY": "U-TIMED-1", "DELAY": "2"})
    assert resp.code == C.SUCCESS, resp.remark
    assert resp.ext_fields["uniqKey"] == "U-TIMED-1" and resp.ext_fields["deliverMs"] == str(due)
    assert resp.ext_fields["queueId"] == "1" and resp.ext_fields["queueOffset"] == "0"
    assert len(resp.ext_fields["msgId"]) == 32
    assert await env.queue_msgs("TT", 1) == []
    await env.advance(4999)
    assert await env.queue_msgs("TT", 1) == []  # never early
    await env.advance(1)
    got = await env.queue_msgs("TT", 1)
    assert [m.body for m in got] == [b"later"]
    assert got[0].store_timestamp == due and got[0].properties["UNIQ_KEY"] == "U-TIMED-1"
    assert "DELAY" not in got[0].properties  # the timer won over the DELAY level
    assert await env.queue_msgs("SCHEDULE_TOPIC_XXXX", 1) == []


async def test_past_deliver_time_is_put_at_once(env: Env) -> None:
    c = env.client
    assert c is not None
    resp = await c.send_message("TP", b"now", 0, {"TIMER_DELIVER_MS": str(NOW - 10)})
    assert resp.code == C.SUCCESS and "deliverMs" not in resp.ext_fields
    assert [m.body for m in await env.queue_msgs("TP", 0)] == [b"now"]


async def test_bad_and_refused_times_are_message_illegal(env: Env) -> None:
    c = env.client
    assert c is not None
    r = await c.send_message("TB", b"x", 0, {"TIMER_DELAY_SEC": "soon"})
    assert r.code == C.MESSAGE_ILLEGAL and "TIMER_DELAY_SEC" in (r.remark or "")
    r = await c.send_message("TB", b"x", 0, {"TIMER_DELAY_SEC": str(3601)})
    assert r.code == C.MESSAGE_ILLEGAL and "timerMaxDelaySec" in (r.remark or "")
    assert env.broker.timer.count() == 0


async def test_cancel_reschedule_pending_and_stats(env: Env) -> None:
    c = env.client
    assert c is not None
    for i in range(3):
        r = await c.send_message("TC", f"m{i}".encode(), 0, {"TIMER_DELAY_MS": str(10_000 + i),
                                                          "KEYS": f"k{i} shared", "UNIQ_KEY": f"U{i}"})
        assert r.code == C.SUCCESS, r.remark
    page = _body(await c.request(R.CHRONOMQ_QUERY_PENDING, {"topic": "TC", "limit": "2"}))
    assert [i["msg_id"] for i in page["items"]] == ["U0", "U1"] and page["next_cursor"]
    page2 = _body(await c.request(R.CHRONOMQ_QUERY_PENDING, {"topic": "TC", "cursor": page["next_cursor"]}))
    assert [i["msg_id"] for i in page2["items"]] == ["U2"] and page2["next_cursor"] is None
    counted = _body(await c.request(R.CHRONOMQ_QUERY_PENDING, {"key": "shared", "countOnly": "true"}))
    assert counted["count"] == 3
    res = _body(await c.request(R.CHRONOMQ_CANCEL_SCHEDULED, {"id": "U0", "byKey": "false"}))["results"]
    assert [(x["outcome"], x["msg_id"]) for x in res] == [("CANCELLED", "U0")]
    res = _body(await c.request(R.CHRONOMQ_CANCEL_SCHEDULED, {"id": "U0"}))["results"]
    assert res[0]["outcome"] == "ALREADY_CANCELLED"
    res = _body(await c.request(R.CHRONOMQ_CANCEL_SCHEDULED, {"id": "nope", "byKey": "true"}))["results"]
    assert [x["outcome"] for x in res] == ["UNKNOWN"]
    res = _body(await c.request(R.CHRONOMQ_RESCHEDULE, {"id": "k1", "byKey": "true",
                                                        "deliverMs": str(NOW + 2000)}))["results"]
    assert [(x["outcome"], x["deliver_ms"]) for x in res] == [("RESCHEDULED", NOW + 2000)]
    stats = _body(await c.request(R.CHRONOMQ_DELAY_STATS))
    assert "levels" in stats and isinstance(stats["timer"], dict)
    await env.advance(2000)
    assert [m.body for m in await env.queue_msgs("TC", 0)] == [b"m1"]
    await env.advance(8002)
    assert sorted(m.body for m in await env.queue_msgs("TC", 0)) == [b"m1", b"m2"]  # m0 was cancelled
    res = _body(await c.request(R.CHRONOMQ_CANCEL_SCHEDULED, {"id": "U2"}))["results"]
    assert res[0]["outcome"] == "ALREADY_DELIVERED"


async def test_admin_codes_reject_bad_arguments(env: Env) -> None:
    c = env.client
    assert c is not None
    cases = [
        (R.CHRONOMQ_CANCEL_SCHEDULED, {}, "id"),
        (R.CHRONOMQ_CANCEL_SCHEDULED, {"id": "U", "byKey": "maybe"}, "byKey"),
        (R.CHRONOMQ_RESCHEDULE, {"id": "U"}, "deliverMs"),
        (R.CHRONOMQ_RESCHEDULE, {"id": "U", "deliverMs": "tomorrow"}, "deliverMs"),
        (R.CHRONOMQ_QUERY_PENDING, {"limit": "0"}, "limit"),
        (R.CHRONOMQ_QUERY_PENDING, {"limit": "5000"}, "limit"),
        (R.CHRONOMQ_QUERY_PENDING, {"startMs": "9", "endMs": "1"}, "before"),
    ]
    for code, ext, word in cases:
        r = await c.request(code, ext)
        assert r.code == C.SYSTEM_ERROR and word in (r.remark or ""), (code, ext, r.remark)
    r = await c.request(R.CHRONOMQ_RESCHEDULE, {"id": "U", "deliverMs": str(NOW + 10 * 3600_000)})
    assert r.code == C.MESSAGE_ILLEGAL and "maximum delay" in (r.remark or "")
    r = await c.request(R.CHRONOMQ_QUERY_PENDING, {"cursor": "garbage"})
    assert r.code == C.MESSAGE_ILLEGAL and "cursor" in (r.remark or "")


async def test_timed_batch_all_or_refused_when_mixed(env: Env) -> None:
    c = env.client
    assert c is not None
    items = [BatchItem(body=f"b{i}".encode(), properties={"TIMER_DELAY_MS": "3000", "UNIQ_KEY": f"B{i}"})
             for i in range(3)]
    r = await c.request(R.SEND_BATCH_MESSAGE, send_ext("TBATCH", 2, batch=True), encode_batch_body(items))
    assert r.code == C.SUCCESS, r.remark
    assert r.ext_fields["uniqKey"] == "B0,B1,B2"
    assert r.ext_fields["deliverMs"] == ",".join([str(NOW + 3000)] * 3)
    assert len(r.ext_fields["msgId"].split(",")) == 3
    mixed = [BatchItem(body=b"t", properties={"TIMER_DELAY_MS": "3000"}), BatchItem(body=b"n", properties={})]
    r = await c.request(R.SEND_BATCH_MESSAGE, send_ext("TBATCH", 2, batch=True), encode_batch_body(mixed))
    assert r.code == C.MESSAGE_ILLEGAL and "separate batches" in (r.remark or "")
    await env.advance(2999)
    assert await env.queue_msgs("TBATCH", 2) == []
    await env.advance(1)
    assert [m.body for m in await env.queue_msgs("TBATCH", 2)] == [b"b0", b"b1", b"b2"]


async def test_pending_survives_a_clean_restart(tmp_path: Path) -> None:
    e = Env(tmp_path)
    c = await e.start()
    r = await c.send_message("TR", b"kept", 0, {"TIMER_DELAY_SEC": "60", "UNIQ_KEY": "UR"})
    assert r.code == C.SUCCESS, r.remark
    await e.close()
    e2 = Env(tmp_path, e.clock)
    c2 = await e2.start()
    try:
        page = _body(await c2.request(R.CHRONOMQ_QUERY_PENDING, {"key": "UR"}))
        assert [i["msg_id"] for i in page["items"]] == ["UR"]
        await e2.advance(60_000)
        assert [m.body for m in await e2.queue_msgs("TR", 0)] == [b"kept"]
    finally:
        await e2.close()


async def test_sync_flush_answers_after_the_fsync_off_the_loop(tmp_path: Path) -> None:
    e = Env(tmp_path, overrides={"flushDiskType": "SYNC_FLUSH"})
    c = await e.start()
    try:
        assert e.broker.timer.sync_flush
        synced: list[str] = []
        real_sync = e.broker.timer.timer.sync_files

        def sync_files() -> None:
            synced.append(threading.current_thread().name)
            real_sync()

        e.broker.timer.timer.sync_files = sync_files  # type: ignore[method-assign]
        rs = await asyncio.gather(*(c.send_message("TS", f"s{i}".encode(), 0,
                                                   {"TIMER_DELAY_MS": "1000", "UNIQ_KEY": f"S{i}"})
                                    for i in range(3)))
        assert [r.code for r in rs] == [C.SUCCESS] * 3, [r.remark for r in rs]
        assert [r.ext_fields["uniqKey"] for r in rs] == ["S0", "S1", "S2"]
        # one fsync round may serve all three (group commit), never the event loop's thread
        assert 1 <= len(synced) <= 3 and threading.main_thread().name not in synced
        r = await c.send_message("TS", b"x", 0, {"TIMER_DELAY_SEC": "7200"})
        assert r.code == C.MESSAGE_ILLEGAL and "maximum delay" in (r.remark or "")
        await e.advance(1000)
        assert [m.body for m in await e.queue_msgs("TS", 0)] == [b"s0", b"s1", b"s2"]
    finally:
        await e.close()


# --- the admin verbs' argument parsing (cli/admin_timer.py) ----------------------------------------------
def test_admin_time_arguments() -> None:
    from chronomq.cli.admin import AdminError
    from chronomq.cli.admin_timer import fmt_epoch_ms, parse_in_seconds, parse_time_ms, timer_stats_text

    assert parse_time_ms("1700000000123") == 1_700_000_000_123
    assert parse_time_ms("1700000000") == 1_700_000_000_000  # epoch seconds, as the broker reads them
    assert parse_time_ms("2023-11-14T22:13:20Z") == 1_700_000_000_000
    assert parse_time_ms("2023-11-14T23:13:20+01:00") == 1_700_000_000_000
    assert parse_time_ms("2023-11-14T22:13:20.5") == 1_700_000_000_500  # naive = UTC
    for bad in ("", "-5", "next tuesday"):
        with pytest.raises(AdminError):
            parse_time_ms(bad)
    assert parse_in_seconds("1.5") == 1500 and parse_in_seconds("0") == 0
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(AdminError):
            parse_in_seconds(bad)
    assert fmt_epoch_ms(1_700_000_000_005) == "2023-11-14T22:13:20.005Z" and fmt_epoch_ms(None) == "-"
    text = timer_stats_text({"pending": 7, "pending_by_topic": {"T": 7}, "lateness_ms": {"count": 2},
                             "lateness_ms_by_topic": {"T": {"count": 2, "p50": 1, "p99": 3, "max": 3}}})
    assert "pending=7" in text and "T" in text.splitlines()[-1] and "3" in text.splitlines()[-1]
    assert timer_stats_text(None) == ""
