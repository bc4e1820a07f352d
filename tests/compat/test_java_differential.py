"""The official Java client (4.x API: rocketmq-client 4.9.x and the 5.3.x remoting client) against chronomq
and against the reference Apache RocketMQ, in the same run, comparing what the client observes.

Each scenario runs once per broker through the same driver (tests/compat/java/, run by the harness); the
test then compares the observations that do not depend on the broker (bodies, tags, keys, the property
names a client sees, order, retry counts, response codes of refusals) and says in one line where chronomq
deliberately differs. Known differences are listed in docs/compat.md.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests.compat.conftest import FAST_DELAY_LEVELS
from tests.compat.harness import run_driver, start_driver
from tests.compat.observe import assert_same, b64, each, text, uniq
from tests.compat.reference import RocketMQProcess
from tests.conftest import wait_for

pytestmark = pytest.mark.compat

LEVEL_MS = [int(x[:-1]) * 1000 for x in FAST_DELAY_LEVELS.split()]
# properties a broker adds or fills with its own values (ids, offsets, cluster name, timings)
BROKER_VALUED = {"UNIQ_KEY", "MIN_OFFSET", "MAX_OFFSET", "CLUSTER", "TRAN_MSG", "PGROUP", "REAL_QID",
                 "CONSUME_START_TIME", "TIMER_OUT_MS", "TIMER_ENQUEUE_MS", "TIMER_DEQUEUE_MS",
                 "TIMER_ROLL_TIMES", "TIMER_DELIVER_MS", "ORIGIN_MESSAGE_ID", "RETRY_TOPIC", "WAIT",
                 "MSG_REGION", "TRACE_ON", "INNER_MULTI_DISPATCH", "INNER_MULTI_QUEUE_OFFSET",
                 "__SHARDINGKEY", "BORNHOST", "DELAY", "REAL_TOPIC", "TRAN_PREPARED_QUEUE_OFFSET",
                 "CHECK_IMMUNITY_TIME_IN_SECONDS", "TRANSACTION_CHECK_TIMES", "REAL_QUEUE_ID"}


class Broker(Protocol):
    namesrv_addr: str

    def log_tail(self, limit: int = ...) -> str: ...





@pytest.fixture
def client() -> str:
    """The official Java client, rocketmq-client 4.9.x; the tests of the paths every application takes
    (sends, admin) run the 5.3.x remoting client too."""
    return "java4"


both_clients = pytest.mark.parametrize("client", ["java4", "java53"])


@pytest.fixture
def brokers(chronomq_differential: Any, rocketmq5: RocketMQProcess,
            request: pytest.FixtureRequest) -> dict[str, Broker]:
    """chronomq and the reference brokers this machine can run (4.9.x is optional: its absence is noted)."""
    out: dict[str, Broker] = {"chronomq": chronomq_differential, "rocketmq5": rocketmq5}
    try:
        out["rocketmq4"] = request.getfixturevalue("rocketmq4")
    except pytest.skip.Exception as e:
        print(f"rocketmq4 reference not run: {e}")
    return out


def produce(client: str, broker: Broker, messages: list[dict[str, Any]], mode: str = "sync",
            **kw: Any) -> list[dict[str, Any]]:
    args = {"namesrv": broker.namesrv_addr, "group": uniq("PG"), "mode": mode, "messages": messages, **kw}
    return run_driver(f"{client}:produce", args, timeout=120)["results"]


def consume(client: str, broker: Broker, tmp_path: Path, topic: str, expect: int, **kw: Any
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    out = tmp_path / f"{uniq('deliveries')}.jsonl"
    args = {"namesrv": broker.namesrv_addr, "group": kw.pop("group", uniq("CG")), "topic": topic,
            "expect": expect, "out": str(out), "maxSeconds": kw.pop("max_seconds", 60), **kw}
    result = run_driver(f"{client}:push_consume", args, timeout=float(args["maxSeconds"]) + 60)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return result, records


def visible_props(rec: dict[str, Any]) -> dict[str, str]:
    """A delivered message's properties, with the broker-valued ones reduced to their presence."""
    return {k: (v if k not in BROKER_VALUED else "<set>") for k, v in rec["props"].items()}


# --- scenarios -----------------------------------------------------------------------------------------
@both_clients
def test_every_send_mode_delivers_bodies_tags_keys_and_properties(
        client: str, brokers: dict[str, Broker], tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JSend")
        modes = ("sync", "async", "oneway", "batch", "orderly")
        rounds = [{"mode": mode, "messages": [
            {"topic": topic, "body": b64(f"{mode}-{i}"), "tags": f"T{i % 2}", "keys": f"K-{mode}-{i}",
             "props": {"color": "blue", "n": str(i)}, "shardingKey": f"S{i % 2}"} for i in range(4)]}
            for mode in modes]
        # a sync send after the oneway ones: they left on the same connection before it
        rounds.append({"mode": "sync", "messages": [{"topic": topic, "body": b64("last"), "tags": "T9"}]})
        res = run_driver(f"{client}:produce", {"namesrv": broker.namesrv_addr, "group": uniq("PG"),
                                               "rounds": rounds}, timeout=120)
        sent = [m for r in rounds[:-1] for m in r["messages"]]
        for mode, results in zip([*modes, "sync"], res["rounds"], strict=True):
            assert all(r["ok"] for r in results), f"{name} {mode}: {results}"
            if mode != "oneway":
                assert {r["status"] for r in results} == {"SEND_OK"}
        _, recs = consume(client, broker, tmp_path, topic, expect=len(sent) + 1)
        got = sorted((text(r), r["tags"], r["keys"], r["props"].get("color"), r["props"].get("n"))
                     for r in recs)
        # the broker's own stamps are among them: CLUSTER, MSG_REGION, TRACE_ON
        return {"delivered": got, "property names": sorted({k for r in recs for k in visible_props(r)}),
                "reconsume": sorted({r["reconsumeTimes"] for r in recs})}

    observed = each(brokers, scenario)
    assert len(observed["chronomq"]["delivered"]) == 21
    assert {"CLUSTER", "MSG_REGION", "TRACE_ON"} <= set(observed["chronomq"]["property names"])
    # chronomq stamps as RocketMQ 5 does; 4.9.7 writes MSG_REGION and TRACE_ON only with a send hook
    v4 = observed.pop("rocketmq4", None)
    assert_same(observed, "send modes")
    if v4 is not None:
        names = [n for n in observed["chronomq"]["property names"] if n not in ("MSG_REGION", "TRACE_ON")]
        assert v4 == {**observed["chronomq"], "property names": names}


def test_orderly_sends_are_consumed_in_order_per_sharding_key(
        client: str, brokers: dict[str, Broker], tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JOrder")
        msgs = [{"topic": topic, "body": b64(f"{k}:{i}"), "shardingKey": k} for i in range(20) for k in "ABC"]
        results = produce(client, broker, msgs, "orderly")
        queues = {m["shardingKey"]: set() for m in msgs}
        for m, r in zip(msgs, results, strict=True):
            queues[m["shardingKey"]].add(r["queueId"])
        _, recs = consume(client, broker, tmp_path, topic, expect=len(msgs), orderly=True)
        by_key: dict[str, list[int]] = {}
        for r in recs:
            k, i = text(r).split(":")
            by_key.setdefault(k, []).append(int(i))
        return {"one queue per key": all(len(q) == 1 for q in queues.values()),
                "order": {k: v for k, v in sorted(by_key.items())}}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["order"] == {k: list(range(20)) for k in "ABC"}
    assert_same(observed, "orderly consumption")


def test_delay_levels_1_to_18_deliver_no_sooner_than_their_level(
        client: str, brokers: dict[str, Broker], tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JLevel")
        msgs = [{"topic": topic, "body": b64(str(level)), "delayLevel": level, "keys": f"L{level}"}
                for level in range(1, 19)]
        sent_at = time.time() * 1000
        results = produce(client, broker, msgs)
        assert all(r["ok"] for r in results), results
        _, recs = consume(client, broker, tmp_path, topic, expect=18, max_seconds=40)
        early = []
        for r in recs:
            level = int(text(r))
            # the store time of the delivered copy is when the level service re-put it
            if r["storeTimestamp"] - r["bornTimestamp"] < LEVEL_MS[level - 1] - 5:
                early.append((level, r["storeTimestamp"] - r["bornTimestamp"]))
        return {"levels": sorted(int(text(r)) for r in recs), "early": early,
                "props": sorted({k for r in recs for k in r["props"]} & {"DELAY", "REAL_TOPIC", "REAL_QID"}),
                "DELAY values": sorted({(int(text(r)), r["props"].get("DELAY")) for r in recs}),
                "late": sent_at < 0}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["levels"] == list(range(1, 19))
    assert observed["chronomq"]["early"] == []
    assert_same(observed, "delay levels")


@pytest.mark.parametrize("level", [19, -1])
def test_a_delay_level_out_of_range(client: str, brokers: dict[str, Broker], tmp_path: Path,
                                    level: int) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JRange")
        r, = produce(client, broker, [{"topic": topic, "body": b64("x"), "delayLevel": level}], retries=0)
        if not r["ok"]:
            return {"sent": False, "error": (r["error"]["code"], r["error"]["type"])}
        t0 = time.time() * 1000
        _, recs = consume(client, broker, tmp_path, topic, expect=1, max_seconds=20)
        return {"sent": True, "delivered": len(recs),
                "after level 18's delay": bool(recs) and recs[0]["storeTimestamp"] - recs[0]["bornTimestamp"]
                >= LEVEL_MS[17] - 5, "waited": t0 < 0}

    assert_same(each(brokers, scenario), f"delay level {level}")


@both_clients
def test_create_topic_through_the_admin_api_and_look_messages_up(
        client: str, brokers: dict[str, Broker]) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JAdmin")
        steps = run_driver(f"{client}:admin", {"namesrv": broker.namesrv_addr, "steps": [
            {"do": "clusterInfo"},
            {"do": "createTopic", "key": "DefaultCluster", "topic": topic, "queues": 3},
        ]}, timeout=90)["steps"]
        assert all(s["ok"] for s in steps), f"{name}: {steps}"
        r, = produce(client, broker, [{"topic": topic, "body": b64("find me"), "keys": "key-1 key-2"}])
        assert r["ok"], r
        deadline = time.monotonic() + 30
        while True:  # the key index is written behind the send on both brokers
            look = run_driver(f"{client}:admin", {"namesrv": broker.namesrv_addr, "steps": [
                {"do": "route", "topic": topic},
                {"do": "queryByKey", "topic": topic, "key": "key-2"},
                {"do": "viewById", "topic": topic, "id": r["offsetMsgId"]},
            ]}, timeout=90)["steps"]
            if (look[1]["ok"] and look[1]["messages"]) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        route, query, view = look
        return {"clusters": steps[0].get("clusters"), "route": {k: route.get(k) for k in
                                                                ("ok", "writeQueues", "readQueues")},
                "query": [(text(m), m["keys"]) for m in query.get("messages", [])],
                "view": view.get("ok") and (text(view["message"]), view["message"]["keys"])}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["route"] == {"ok": True, "writeQueues": 3, "readQueues": 3}
    assert_same(observed, "admin createTopic and lookups")


def test_reconsume_later_climbs_the_retry_ladder_then_lands_in_the_dlq(
        client: str, brokers: dict[str, Broker], tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic, group = uniq("JRetry"), uniq("CG")
        assert produce(client, broker, [{"topic": topic, "body": b64("again"), "keys": "R1"}])[0]["ok"]
        # answered RECONSUME_LATER until the third delivery: reconsume times 0, 1, 2
        _, recs = consume(client, broker, tmp_path, topic, expect=1, group=group, reconsumeLater=2,
                          max_seconds=60)
        times = [r["reconsumeTimes"] for r in recs]
        gaps = [b["receivedAt"] - a["receivedAt"] for a, b in itertools.pairwise(recs)]
        # delay level 3 + reconsume times: the gap before delivery n+1 is level (3 + n)'s delay
        short = [(n, g) for n, g in enumerate(gaps) if g < LEVEL_MS[2 + n] - 50]
        # always RECONSUME_LATER with maxReconsumeTimes 1: after two deliveries it goes to %DLQ%group, which a
        # RocketMQ broker creates write-only (perm 2): it is looked up by key, as an operator would
        dlq_group = uniq("CG")
        # two deliveries (the consumer's shutdown waits for the second one's send-back)
        _, first = consume(client, broker, tmp_path, topic, expect=1, group=dlq_group, reconsumeLater=99,
                           maxReconsumeTimes=1, expectDeliveries=2, max_seconds=60)
        dead: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        while not dead and time.monotonic() < deadline:
            look = run_driver(f"{client}:admin", {"namesrv": broker.namesrv_addr, "steps": [
                {"do": "queryByKey", "topic": f"%DLQ%{dlq_group}", "key": "R1"}]}, timeout=90)["steps"][0]
            dead = look.get("messages") or []
        return {"reconsume times": times, "short gaps": short,
                "the listener sees the topic sent to": all(r["topic"] == topic for r in recs),
                "deliveries before the DLQ": [r["reconsumeTimes"] for r in first],
                "dlq": [(text(r), r["keys"], r["reconsumeTimes"]) for r in dead]}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["reconsume times"] == [0, 1, 2]
    assert observed["chronomq"]["dlq"] == [("again", "R1", 2)]
    assert_same(observed, "retry ladder and DLQ")


def test_transactions_commit_roll_back_and_are_checked_back(
        client: str, brokers: dict[str, Broker], tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JTx")
        msgs = [{"topic": topic, "body": b64(k), "keys": k} for k in ("commit", "rollback", "unknown")]
        res = run_driver(f"{client}:transaction", {
            "namesrv": broker.namesrv_addr, "group": uniq("TxPG"), "messages": msgs,
            "outcomes": {"commit": "COMMIT_MESSAGE", "rollback": "ROLLBACK_MESSAGE", "unknown": "UNKNOW"},
            "checks": {"unknown": "COMMIT_MESSAGE"}, "awaitChecks": ["unknown"], "checkWaitSeconds": 90},
            timeout=180)
        _, recs = consume(client, broker, tmp_path, topic, expect=2, max_seconds=30)
        # a broker may check a decided transaction again (RocketMQ does when its op record is not read
        # yet): what counts is that the undecided one is checked and the rolled-back one never delivered
        return {"sent": [(r.get("status"), r.get("localState")) for r in res["results"]],
                "unknown checked": "unknown" in res["checked"], "delivered": sorted(text(r) for r in recs),
                "props": sorted({k for r in recs for k in r["props"]} & {"TRAN_MSG", "PGROUP"})}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["delivered"] == ["commit", "unknown"]
    assert_same(observed, "transactions")


def test_request_reply(client: str, brokers: dict[str, Broker]) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JReq")
        # the topic exists before the replier subscribes (a request to an unknown topic is refused)
        assert produce(client, broker, [{"topic": topic, "body": b64("warm-up")}])[0]["ok"]
        res = run_driver(f"{client}:request_reply", {"namesrv": broker.namesrv_addr, "group": uniq("RG"),
                                                     "topic": topic, "bodies": ["a", "b"]}, timeout=120)
        results = res["results"]
        return {"replies": [(r["ok"], r.get("reply"), r.get("error", {}).get("code")) for r in results],
                "reply props": sorted({k for r in results for k in r.get("props", {})}
                                      & {"MSG_TYPE", "CORRELATION_ID", "REPLY_TO_CLIENT", "TTL"})}

    observed = each(brokers, scenario)
    replies = [(True, "re:a", None), (True, "re:b", None)]
    assert observed["rocketmq5"]["replies"] == replies
    assert_same(observed, "request-reply")


BAD = {
    "a body of 4 MiB + 1": {"bodySize": 4 * 1024 * 1024 + 1},
    "a body of 4 MiB": {"bodySize": 4 * 1024 * 1024},
    "a topic with a space": {"topic": "bad topic"},
    "a topic of 128 characters": {"topic": "T" * 128},
    "the default topic's name": {"topic": "TBW102"},
    "a retry topic": {"topic": "%RETRY%someone"},
    # past both brokers' maximum (timerMaxDelaySec: RocketMQ 3 days, chronomq 40 days)
    "a timer delay of 41 days": {"delaySec": 41 * 86_400},
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_the_same_refusal(client: str, brokers: dict[str, Broker], case: str) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        msg = {"topic": uniq("JBad"), "body": b64("x"), **BAD[case]}
        r, = produce(client, broker, [msg], retries=0)
        error = r.get("error") or {}
        return {"ok": r["ok"], "error": error and (error["type"], error["code"]),
                "text": (error.get("message") or "").split("\n")[0]}

    if "delaySec" in BAD[case]:  # 4.9.x has no timer: it takes the property for a user's
        brokers = {k: v for k, v in brokers.items() if k != "rocketmq4"}
    observed = each(brokers, scenario)
    if "delaySec" in BAD[case]:  # known difference (docs/compat.md): each names its own maximum
        assert "the maximum delay is 40 days" in observed["chronomq"].pop("text")
        assert "max delay 259200000ms" in observed["rocketmq5"].pop("text")
    assert_same(observed, case)


def test_the_lite_pull_consumer_seeks_and_commits(client: str, brokers: dict[str, Broker]) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JLite")
        # one queue, so that seeking to offset 2 is legal everywhere (an empty queue refuses it)
        create = {"do": "createTopic", "key": "DefaultCluster", "topic": topic, "queues": 1}
        steps = run_driver(f"{client}:admin", {"namesrv": broker.namesrv_addr, "steps": [create]},
                           timeout=90)["steps"]
        assert steps[0]["ok"], steps
        msgs = [{"topic": topic, "body": b64(f"m{i}")} for i in range(6)]
        assert all(r["ok"] for r in produce(client, broker, msgs))
        # a new group starts at offset 0 on every broker (the queue's first message is still in memory):
        # the six are polled first, then the consumer seeks back to 2
        res = run_driver(f"{client}:lite_pull", {"namesrv": broker.namesrv_addr, "group": uniq("LG"),
                                                  "topic": topic, "before": 6, "seek": 2, "expect": 4,
                                                  "commit": True, "maxSeconds": 30}, timeout=90)
        return {"queues": res["queues"], "before the seek": [text(m) for m in res["before_seek"]],
                "after seek 2": [text(m) for m in res["messages"]],
                "committed": sorted(v for v in res["committed"].values() if v > 0)}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["before the seek"] == [f"m{i}" for i in range(6)]
    assert observed["chronomq"]["after seek 2"] == ["m2", "m3", "m4", "m5"]
    assert_same(observed, "lite pull with seek")


def test_broadcasting_hands_every_message_to_every_consumer(
        client: str, brokers: dict[str, Broker], tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic, group = uniq("JBcast"), uniq("BG")
        assert all(r["ok"] for r in produce(client, broker, [{"topic": topic, "body": b64(f"b{i}")}
                                                             for i in range(8)]))
        drivers = [start_driver(f"{client}:push_consume", {
            "namesrv": broker.namesrv_addr, "group": group, "topic": topic, "broadcasting": True, "expect": 8,
            "out": str(tmp_path / f"{uniq('bcast')}.jsonl"), "maxSeconds": 60}, tmp_path) for _ in range(2)]
        seen = []
        for d in drivers:
            d.wait(timeout=120)
            seen.append(sorted(text(r) for r in d.records()))
        return {"each consumer got": seen}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["each consumer got"] == [[f"b{i}" for i in range(8)]] * 2
    assert_same(observed, "broadcasting")


def test_reset_offset_by_time_moves_an_online_consumer_back(client: str, brokers: dict[str, Broker],
                                                             tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic, group = uniq("JReset"), uniq("RG")
        assert all(r["ok"] for r in produce(client, broker, [{"topic": topic, "body": b64(f"old{i}")}
                                                             for i in range(3)]))
        middle = int(time.time() * 1000) + 1  # after every old message was stored, before any new one
        wait_for(lambda: time.time() * 1000 > middle, message="the reset point")
        assert all(r["ok"] for r in produce(client, broker, [{"topic": topic, "body": b64(f"new{i}")}
                                                             for i in range(3)]))
        consumer = start_driver(f"{client}:push_consume", {
            "namesrv": broker.namesrv_addr, "group": group, "topic": topic, "expectDeliveries": 9,
            "out": str(tmp_path / f"{uniq('reset')}.jsonl"), "maxSeconds": 90}, tmp_path)
        try:
            wait_for(lambda: len(consumer.records()) >= 6, timeout=60, message=f"{name}: six consumed")
            # RocketMQ 4.9 refuses a reset ("group not exist") until the group has committed an offset on
            # every queue, which its consumers do every 5 s: asked again until accepted
            deadline = time.monotonic() + 30
            while True:
                reset, = run_driver(f"{client}:admin", {"namesrv": broker.namesrv_addr, "steps": [
                    {"do": "resetOffsetByTime", "topic": topic, "group": group, "timestamp": middle}]},
                    timeout=90)["steps"]
                if reset["ok"] or time.monotonic() > deadline:
                    break
            assert reset["ok"], f"{name}: {reset}"
            wait_for(lambda: len(consumer.records()) >= 9, timeout=60, message=f"{name}: three again")
        finally:
            consumer.wait(timeout=120)
        got = [text(r) for r in consumer.records()]
        return {"before the reset": sorted(got[:6]), "after it": sorted(got[6:]),
                "queues reset": reset["queues"]}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["after it"] == ["new0", "new1", "new2"]
    # RocketMQ 4.9.7 moved the group back too, but to an earlier offset (each queue's first here: old messages
    # came again); 5.3.3, and chronomq, to the first message stored at or after the time (docs/compat.md)
    four = observed.pop("rocketmq4", None)
    assert four is None or len(four["after it"]) >= 3
    assert_same(observed, "offsets reset by time")


def test_message_trace_is_written_to_the_trace_topic(client: str, brokers: dict[str, Broker],
                                                     tmp_path: Path) -> None:
    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JTrace")
        assert produce(client, broker, [{"topic": topic, "body": b64("traced"), "keys": "TR1"}],
                       trace=True)[0]["ok"]
        _, recs = consume(client, broker, tmp_path, "RMQ_SYS_TRACE_TOPIC", expect=1, max_seconds=40,
                          expression="*")
        # a trace record names the topic, the message's keys and the producer's send ("Pub")
        bodies = [text(r) for r in recs]
        return {"a Pub trace of the message": any(topic in b and "TR1" in b and b.startswith("Pub")
                                                  for b in bodies)}

    assert_same(each(brokers, scenario), "message trace")


TIMERS = {"TIMER_DELIVER_MS (setDeliverTimeMs)": "deliverTimeMs",
          "TIMER_DELAY_SEC (setDelayTimeSec)": "delaySec"}


@pytest.mark.parametrize("how", sorted(TIMERS))
def test_a_timed_message_is_not_delivered_before_its_time(
        client: str, chronomq_differential: Any, rocketmq5: RocketMQProcess, tmp_path: Path,
        how: str) -> None:
    """The 5.x API's timers (rocketmq-client 5.x writes these properties; 4.x brokers ignore them, so the
    4.9.x reference is not asked). RocketMQ 5 files a timed message in its timer wheel's slot of
    timerPrecisionMs (100 ms here) and may hand it over up to that much early; chronomq never early."""
    precision = {"chronomq": 0, "rocketmq5": 100}

    def scenario(name: str, broker: Broker) -> dict[str, Any]:
        topic = uniq("JTimer")
        due = int(time.time() * 1000) + 4000
        value = due if TIMERS[how] == "deliverTimeMs" else 4
        r, = produce(client, broker, [{"topic": topic, "body": b64("timed"), TIMERS[how]: value}])
        assert r["ok"], r
        if TIMERS[how] == "delaySec":
            due = None
        _, recs = consume(client, broker, tmp_path, topic, expect=1, max_seconds=30)
        assert len(recs) == 1, recs
        rec = recs[0]
        wanted = due if due is not None else rec["bornTimestamp"] + 4000
        # how late is the bench's business (bench.compare); the consumer here starts after the send, so
        # its own start-up, not the broker, would decide it
        return {"early by more than the precision": rec["receivedAt"] < wanted - precision[name],
                "timer property kept": (TIMERS[how] == "deliverTimeMs" and "TIMER_DELIVER_MS" in rec["props"])
                or (TIMERS[how] == "delaySec" and "TIMER_DELAY_SEC" in rec["props"])}

    observed = each({"chronomq": chronomq_differential, "rocketmq5": rocketmq5}, scenario)
    if TIMERS[how] == "delaySec":  # known difference (docs/compat.md): chronomq keeps TIMER_DELIVER_MS only
        assert observed["chronomq"].pop("timer property kept") is False
        assert observed["rocketmq5"].pop("timer property kept") is True
    assert_same(observed, how)
