"""The broker's dispatch table (processors as tables joined by BrokerProcessor), the services built whole
by one factory, and the typed outcomes of the in-process calls: a BrokerController in tmp_path with a
virtual clock, on the test's event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from tests.unit import test_broker_processors
from tests.unit.test_broker_processors import Env, _dispatched

from chronomq.broker.clients import ClientInfo
from chronomq.broker.inproc import ANSWER_KINDS, AnswerKind, LocalCalls, LocalConnection, _answer
from chronomq.broker.processors.base import Handler, join_tables
from chronomq.broker.processors.pull import _int
from chronomq.broker.services import BrokerServices, build_services
from chronomq.message import PROPERTY_PRODUCER_GROUP, MessageExt
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C

env = test_broker_processors.env  # the fixture of that module, shared


class _Table:
    def __init__(self, table: dict[int, Handler]) -> None:
        self.table = table

    def handlers(self) -> dict[int, Handler]:
        return self.table


def _answer_ok(req: RemotingCommand, conn: object) -> RemotingCommand:
    return req.response()


# --- the dispatch table ------------------------------------------------------------------------------------
def test_tables_are_joined_and_a_code_registered_twice_is_refused() -> None:
    a, b = _Table({1: _answer_ok}), _Table({2: _answer_ok})
    assert join_tables([a, b]) == {1: _answer_ok, 2: _answer_ok}
    with pytest.raises(ValueError, match="request code 2 is registered by both _Table and _Table"):
        join_tables([a, b, _Table({3: _answer_ok, 2: _answer_ok})])


async def test_each_code_is_dispatched_to_its_processors_handler(env: Env) -> None:
    p = env.broker.processor
    timers = env.broker.timers
    expected = {
        R.SEND_MESSAGE: p.send.send_message,
        R.SEND_MESSAGE_V2: p.send.send_message,
        R.CONSUMER_SEND_MSG_BACK: p.send.consumer_send_msg_back,
        R.SEND_REPLY_MESSAGE_V2: p.reply.send_reply_message,
        R.PULL_MESSAGE: p.pull.pull_message,
        R.HEART_BEAT: p.client_manage.heart_beat,
        R.QUERY_CONSUMER_OFFSET: p.consumer_manage.query_consumer_offset,
        R.VIEW_MESSAGE_BY_ID: p.query.view_message_by_id,
        R.GET_MAX_OFFSET: p.admin.get_max_offset,
        R.GET_CONSUME_STATS: p.groups.get_consume_stats,
        R.GET_BROKER_CONFIG: p.broker_config.get_broker_config,
        R.END_TRANSACTION: p.transaction.end_transaction,
        R.CHRONOMQ_DELAY_STATS: timers.delay_stats,
    }
    for code, handler in expected.items():
        assert p.handler(code) == handler, code
    tables = [p.send, p.reply, p.pull, p.client_manage, p.consumer_manage, p.query, p.admin, p.groups,
              p.broker_config, p.transaction, p.auth, timers]
    assert len(p._sync) == sum(len(t.handlers()) for t in tables)  # every code of every table, once
    assert p.handler(99_999) is None
    # the reply processor works on the send processor's stamps, less CLUSTER
    assert p.reply.send is p.send and "CLUSTER" in p.send.stamps and "CLUSTER" not in p.reply._reply_stamps


async def test_an_unknown_code_is_answered_not_supported(env: Env) -> None:
    c = await env.client()
    resp = await c.request(99_999, {})
    assert resp.code == C.REQUEST_CODE_NOT_SUPPORTED


# --- the services ---------------------------------------------------------------------------------------
async def test_the_broker_binds_its_run_into_its_services_which_are_frozen(env: Env) -> None:
    s = env.broker.services
    assert s.transactions is env.broker.transactions and s.dedup is not None  # on by default
    assert s.loop is asyncio.get_running_loop() and s.ha is env.broker.ha and not s.stopping
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(s, "stopping", True)  # noqa: B010  # an assignment mypy refuses, tried at run time


def test_build_services_builds_every_service_and_the_setters_bind_the_run(tmp_path: Path) -> None:
    e = Env(tmp_path, {"dedupWindowSec": "0"})
    s = e.broker.services
    assert s.dedup is None and s.loop is None and s.ha is None and not s.stopping
    assert s.topics.get("TBW102") is not None and s.subscription_group("NOPE") is None
    assert s.subscription_group("SELF_TEST_C_GROUP") is not None  # a built-in group of the manager
    calls: list[str] = []
    other = build_services(e.config, e.clock, ("127.0.0.1", 1), notify_consumer_ids_changed=calls.append,
                           runtime_info=dict)
    assert isinstance(other, BrokerServices) and other.store is not s.store and other.promote is None
    other.notify_consumer_ids_changed("G")
    assert calls == ["G"] and other.store_host == ("127.0.0.1", 1)
    loop = asyncio.new_event_loop()
    try:
        other.bind_loop(loop)
        other.mark_stopping()
        assert other.loop is loop and other.stopping
    finally:
        loop.close()


# --- typed outcomes ---------------------------------------------------------------------------------------
def test_a_4x_answer_reads_as_its_kind_and_only_stored_kinds_are_stored() -> None:
    req = RemotingCommand.request(R.SEND_MESSAGE, {})
    for code, kind in ANSWER_KINDS.items():
        a = _answer(req.response(code, ext_fields={"msgId": "M", "queueId": "2,3", "queueOffset": "x"}))
        assert a.kind is kind and a.msg_id == "M" and a.queue_id == 2 and a.queue_offset == -1
        assert a.stored == (code in (C.SUCCESS, C.FLUSH_DISK_TIMEOUT, C.FLUSH_SLAVE_TIMEOUT,
                                     C.SLAVE_NOT_AVAILABLE))
    a = _answer(req.response(C.SYSTEM_ERROR, remark="boom"))
    assert a.kind is AnswerKind.ERROR and not a.stored and a.remark == "boom"


async def test_in_process_calls_answer_typed_kinds(env: Env) -> None:
    calls = LocalCalls(env.broker.processor)
    a = await calls.send("Typed", {"WAIT": "true"}, b"x")
    assert a.kind is AnswerKind.OK and a.stored and a.queue_offset == 0
    a = await calls.send("SCHEDULE_TOPIC_XXXX", {}, b"x")
    assert a.kind is AnswerKind.FORBIDDEN and not a.stored
    with pytest.raises(ValueError, match="has no handler"):
        await calls.request(99_999, {})


# --- connections ------------------------------------------------------------------------------------------
class _Recorder:
    """A client connection that records what the broker sends it."""

    remote_addr = "10.0.0.9:1"
    closed = False

    def __init__(self) -> None:
        self.sent: list[RemotingCommand] = []

    def send_oneway(self, cmd: RemotingCommand) -> bool:
        self.sent.append(cmd)
        return True

    async def invoke(self, cmd: RemotingCommand, timeout: float = 3.0) -> RemotingCommand:
        raise ConnectionError("not asked here")


async def test_an_in_process_caller_takes_no_server_to_client_request() -> None:
    conn = LocalConnection(("127.0.0.1", 7), asyncio.get_running_loop())
    assert conn.send_oneway(RemotingCommand.request(R.NOTIFY_CONSUMER_IDS_CHANGED, {})) is None
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:7 is an in-process caller"):
        await conn.invoke(RemotingCommand.request(R.GET_CONSUMER_RUNNING_INFO, {}))


async def test_a_transaction_check_asks_only_a_producer_with_a_connection(env: Env) -> None:
    tx, producers = env.broker.transactions, env.broker.producers
    half = MessageExt("TxAsk", b"x", {PROPERTY_PRODUCER_GROUP: "PG_ask", "UNIQ_KEY": "U1"})
    producers.register("PG_ask", ClientInfo("gone", None, 0))  # registered without a connection
    tx._check(half, 1)
    assert tx.checks_sent == 0  # nobody to ask: not a crash
    live = _Recorder()
    producers.register("PG_ask", ClientInfo("live", live, 0))
    tx._check(half, 2)
    assert tx.checks_sent == 1 and [c.code for c in live.sent] == [R.CHECK_TRANSACTION_STATE]


def test_a_subscriptions_version_reads_as_an_int_or_0() -> None:
    assert [_int(v) for v in ("7", 8, 9.5, "x", None, [1], "")] == [7, 8, 9, 0, 0, 0, 0]


# --- traffic figures ----------------------------------------------------------------------------------------
async def test_broker_stats_read_the_in_and_out_counters_by_name(env: Env) -> None:
    c = await env.client()
    for body in (b"ab", b"cde"):
        assert (await c.send_message("Fig", body, 0, {"WAIT": "true"})).code == C.SUCCESS
    await _dispatched(env)
    assert (await c.pull("GF", "Fig", 0, 0)).code == C.SUCCESS

    async def stat(name: str, key: str) -> int:
        resp = await c.request(R.VIEW_BROKER_STATS_DATA, {"statsName": name, "statsKey": key})
        assert resp.code == C.SUCCESS, resp.remark
        return int(json.loads(resp.body)["statsDay"]["sum"])

    assert await stat("TOPIC_PUT_NUMS", "Fig") == 2 and await stat("GROUP_GET_NUMS", "Fig@GF") == 2
    assert await stat("TOPIC_PUT_SIZE", "Fig") == 5  # the bodies
    assert await stat("GROUP_GET_SIZE", "Fig@GF") > 2 * 100  # the records handed out
    resp = await c.request(R.VIEW_BROKER_STATS_DATA, {"statsName": "BROKER_PUT_NUMS", "statsKey": "Fig"})
    assert resp.code == C.SYSTEM_ERROR and resp.remark == "The stats <BROKER_PUT_NUMS> <Fig> not exist"
