"""Transactional messages through a real broker and name server in process (loopback), with
chronomq.client's TransactionProducer: commit makes the message visible, rollback never; an UNKNOWN answer
is settled by the broker's check-back; a message never decided is given up after transactionCheckMax
checks; a committed message may carry a delay; decisions and undecided half messages survive a restart;
END_TRANSACTION's refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import async_wait_for, free_port, queue_messages
from tests.integration.rawclient import AsyncRawClient

from chronomq.broker.controller import BrokerController
from chronomq.broker.transaction import CHECK_MAX_TOPIC, HALF_TOPIC, OP_TOPIC
from chronomq.client import LocalTransactionState as S
from chronomq.client import Message, TransactionProducer
from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.message import MessageExt
from chronomq.namesrv.server import NameServer
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C

FAST = {"transactionTimeOut": "300", "transactionCheckInterval": "200"}


def make_broker(root: Path, ns: str, port: int, **over: str) -> BrokerController:
    values = {"storePathRootDir": str(root), "listenPort": str(port), "haListenPort": str(free_port()),
              "namesrvAddr": ns, "messageDelayLevel": "1s 2s", "metricsPort": "-1", **FAST, **over}
    config, _ = BrokerConfig.load(None, values)
    return BrokerController(config, SystemClock())


def stored(b: BrokerController, topic: str) -> list[MessageExt]:
    return queue_messages(b.store, topic)


def bodies(b: BrokerController, topic: str) -> list[bytes]:
    return sorted(m.body for m in stored(b, topic))


@pytest.fixture
async def env(tmp_path: Path):
    ns = NameServer("127.0.0.1", free_port(), SystemClock())
    await ns.start()
    port = free_port()
    b = make_broker(tmp_path / "b", ns.address, port)
    await b.start()
    state: dict[str, Any] = {"ns": ns, "broker": b, "root": tmp_path / "b", "port": port}
    try:
        yield state
    finally:
        await state["broker"].shutdown()
        await ns.stop()


async def test_commit_rollback_and_the_local_transactions_answers(env):
    b, ns = env["broker"], env["ns"].address
    b.config.transactionTimeOut = 600_000  # no check-back here: the undecided half must stay the only one
    seen: list[tuple[bytes, str]] = []

    def local(msg: Message, result: Any) -> S:
        seen.append((msg.body_bytes(), result.status))
        return {b"yes": S.COMMIT, b"no": S.ROLLBACK}[msg.body_bytes()]

    async with TransactionProducer("PG_tx", ns, checker=lambda m: S.ROLLBACK) as p:
        yes = await p.send_in_transaction(Message("Tx", b"yes", keys=["k1"], tags="A"), local)
        no = await p.send_in_transaction(Message("Tx", b"no"), local)

        async def raising(msg: Message, result: Any) -> S:
            raise RuntimeError("the database is down")

        unknown = await p.send_in_transaction(Message("Tx", b"maybe"), raising)
    assert [s for _, s in seen] == ["SEND_OK", "SEND_OK"]
    assert yes.state is S.COMMIT and no.state is S.ROLLBACK
    assert unknown.state is S.UNKNOWN and "the database is down" in unknown.error
    await async_wait_for(lambda: bodies(b, "Tx") == [b"yes"], 10, message="only the committed one")
    m = stored(b, "Tx")[0]
    assert m.keys == ["k1"] and m.tags == "A" and m.sys_flag & 0xC == 8  # commit bits
    assert m.prepared_transaction_offset == int(yes.send.offset_msg_id[16:], 16)  # the half's offset
    # RocketMQ's EndTransactionProcessor stores the half's properties before it clears any of them
    assert (m.properties["PGROUP"], m.properties["TRAN_MSG"], m.properties["REAL_TOPIC"]) == \
        ("PG_tx", "true", "Tx")
    # the later halves and the rollback's op come after the commit in the log: dispatched a little later
    await async_wait_for(lambda: len(stored(b, HALF_TOPIC)) == 3 and len(stored(b, OP_TOPIC)) == 2, 10,
                         message="three halves and two ops")
    info = b.runtime_info()
    assert info["transactionCommitted"] == 1 and info["transactionRolledBack"] == 1


async def test_an_unknown_answer_is_settled_by_the_check_back(env):
    b, ns = env["broker"], env["ns"].address
    checked: list[str] = []

    def checker(msg: Any) -> S:
        assert msg.topic == "TxCheck"
        checked.append((msg.body.decode(), msg.properties.get("TRANSACTION_CHECK_TIMES")))
        return S.COMMIT

    async with TransactionProducer("PG_check", ns, checker=checker) as p:
        r = await p.send_in_transaction(Message("TxCheck", b"later"), lambda m, r: S.UNKNOWN)
        assert r.state is S.UNKNOWN
        await async_wait_for(lambda: bodies(b, "TxCheck") == [b"later"], 20, message="committed on check")
    # one check, or more if a slow machine stored the commit after the next round (as RocketMQ may ask
    # again), each counting up
    assert checked and checked == [("later", str(i + 1)) for i in range(len(checked))]
    # decided: later rounds check nothing more
    sent = b.transactions.checks_sent
    assert sent >= 1
    for _ in range(3):
        assert b.transactions.check_once() == {"checked": 0, "given_up": 0}
    assert b.transactions.checks_sent == sent


async def test_a_transaction_never_decided_is_given_up(env):
    b, ns = env["broker"], env["ns"].address
    b.config.transactionCheckMax = 2
    calls = 0

    def checker(msg: Any) -> S:
        nonlocal calls
        calls += 1
        return S.UNKNOWN

    async with TransactionProducer("PG_never", ns, checker=checker) as p:
        await p.send_in_transaction(Message("TxNever", b"limbo"), lambda m, r: S.UNKNOWN)
        await async_wait_for(lambda: bodies(b, CHECK_MAX_TOPIC) == [b"limbo"], 20, message="given up")
    assert calls == 2 and bodies(b, "TxNever") == []
    assert b.runtime_info()["transactionGivenUp"] == 1


async def test_a_committed_message_may_wait_for_its_delay(env):
    b, ns = env["broker"], env["ns"].address
    async with TransactionProducer("PG_delay", ns, checker=lambda m: S.ROLLBACK) as p:
        r = await p.send_in_transaction(Message("TxLater", b"level", delay_level=1), lambda m, r: S.COMMIT)
        t = await p.send_in_transaction(Message("TxLater", b"timed", delay=1.5), lambda m, r: S.COMMIT)
    assert r.state is S.COMMIT and t.state is S.COMMIT
    # parked: one under the level's schedule queue (its record stays there), one in the timer until it is
    # due. On a loaded machine the level's 1 s can pass before this looks, so "not visible before its
    # time" is judged by the delivered copies' store times below, not by the moment of looking.
    await async_wait_for(lambda: len(stored(b, "SCHEDULE_TOPIC_XXXX")) == 1
                         and (b.timer.count() == 1 or b"timed" in bodies(b, "TxLater")), 5)
    parked_ms = stored(b, "SCHEDULE_TOPIC_XXXX")[0].store_timestamp  # the commit parked it
    await async_wait_for(lambda: bodies(b, "TxLater") == [b"level", b"timed"], 10, message="when due")
    by_body = {m.body: m for m in stored(b, "TxLater")}  # stored() lists queue by queue
    level, timed = by_body[b"level"], by_body[b"timed"]
    assert level.store_timestamp >= parked_ms + 1000  # level 1 (1 s) counts from the commit
    assert timed.store_timestamp >= int(timed.properties["TIMER_DELIVER_MS"])


async def test_decisions_and_undecided_half_messages_survive_a_restart(env):
    b, ns = env["broker"], env["ns"].address
    b.config.transactionTimeOut = 600_000  # not checked before the restart (this producer would roll back)
    checked: list[str] = []
    async with TransactionProducer("PG_restart", ns, checker=lambda m: S.ROLLBACK) as p:
        await p.send_in_transaction(Message("TxR", b"decided"), lambda m, r: S.COMMIT)
        await p.send_in_transaction(Message("TxR", b"open"), lambda m, r: S.UNKNOWN)
        await async_wait_for(lambda: bodies(b, "TxR") == [b"decided"], 10)
    await b.shutdown()
    b = env["broker"] = make_broker(env["root"], ns, env["port"])
    await b.start()

    def checker(msg: Any) -> S:
        checked.append(msg.body.decode())
        return S.COMMIT

    async with TransactionProducer("PG_restart", ns, checker=checker) as p:
        await async_wait_for(lambda: bodies(b, "TxR") == [b"decided", b"open"], 20, message="checked")
    assert checked == ["open"]  # the decided one is never asked about again


async def test_end_transaction_refusals(env):
    b = env["broker"]
    async with TransactionProducer("PG_ref", env["ns"].address, checker=lambda m: S.ROLLBACK) as p:
        r = await p.send_in_transaction(Message("TxRef", b"x"), lambda m, r: S.UNKNOWN)
    c = await AsyncRawClient.connect(b.server.address)
    try:
        base = {"producerGroup": "PG_ref", "tranStateTableOffset": str(r.send.queue_offset),
                "commitLogOffset": str(int(r.send.offset_msg_id[16:], 16)), "commitOrRollback": "8",
                "msgId": r.send.msg_id}
        wrong_group = await c.request(R.END_TRANSACTION, {**base, "producerGroup": "other"})
        assert wrong_group.code == C.SYSTEM_ERROR and wrong_group.remark == "The producer group wrong"
        wrong_offset = await c.request(R.END_TRANSACTION, {**base, "tranStateTableOffset": "99"})
        assert wrong_offset.remark == "The transaction state table offset wrong"
        nothing = await c.request(R.END_TRANSACTION, {**base, "commitLogOffset": "1"})
        assert nothing.remark == "Find prepared transaction message failed"
        bad = await c.request(R.END_TRANSACTION, {**base, "commitOrRollback": "3"})
        assert bad.code == C.SYSTEM_ERROR and "commitOrRollback" in bad.remark
        ok = await c.request(R.END_TRANSACTION, base)
        assert ok.code == C.SUCCESS and ok.remark == "committed"
        again = await c.request(R.END_TRANSACTION, {**base, "commitOrRollback": "12"})
        assert again.code == C.SUCCESS and again.remark == "already decided"
        # the committed copy is in its queue once the dispatcher has caught up (a busy machine lags)
        await async_wait_for(lambda: bodies(b, "TxRef") == [b"x"], timeout=10,
                             message="the committed message in its queue")
        batch = await c.request(R.SEND_MESSAGE, {"producerGroup": "PG_ref", "topic": "TxRef", "queueId": 0,
                                                 "sysFlag": 4, "bornTimestamp": "1", "flag": 0,
                                                 "properties": "TRAN_MSG\x01true\x02PGROUP\x01PG_ref\x02",
                                                 "reconsumeTimes": "0", "batch": "1"}, b"")
        assert batch.code == C.MESSAGE_ILLEGAL
    finally:
        await c.close()
    info = json.loads(json.dumps(b.runtime_info()))
    assert info["transactionCommitted"] == 1
